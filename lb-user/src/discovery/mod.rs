//! Discovery: keeps a balancer's server list current from a source ([`dns`], the [`etcd`]
//! member list, a [`file`]). Each run's list goes through [`Balancer::set_servers`], the path
//! `PUT /balancers/NAME/servers` takes: servers that left are removed and their connections
//! closed, new ones start UNCHECKED. A failed run, or one that finds no server, changes nothing:
//! the last good set stays, with a warning, `lb_discovery_runs_total{result="error"}` and the
//! error in `/status`.

mod dns;
pub(crate) mod etcd;
pub(crate) mod file;
pub mod names;

use std::{
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use tokio::time::{Instant, sleep_until};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{Instrument as _, debug, info, info_span, warn};

pub use crate::addr::merge;
use crate::{
    addr::{ServerAddr, SetError},
    balancer::{Balancer, DiscoveryStatus},
    config::DiscoveryConfig,
    metrics::{DiscoveryLabels, DiscoveryRunLabels, Metrics},
    net::Route,
};

/// Shortest wait between two runs, whatever the answer's TTL (a TTL of 0 would otherwise
/// make lb query in a loop).
pub const MIN_REFRESH: Duration = Duration::from_secs(1);

/// What one run found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    /// The servers, in the source's order.
    pub servers: Vec<ServerAddr>,
    /// The default server the source names (`file` only: `None` there means no default;
    /// DNS and etcd name none and the balancer's stays).
    pub default: Option<ServerAddr>,
    /// How long the answer is valid (DNS TTL); the next run comes no later.
    pub ttl: Option<Duration>,
}

/// Why a run gave no usable list; the last good set stays.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// The DNS query failed or found no A/AAAA record.
    #[error("resolving {name}: {reason}")]
    Resolve {
        /// The name.
        name: String,
        /// The resolver's message.
        reason: String,
    },
    /// No etcd endpoint gave a member list.
    #[error("etcd member list: {0}")]
    Etcd(String),
    /// The file could not be read or parsed.
    #[error("{path}: {reason}")]
    File {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// The source answered with no server.
    #[error("the answer has no server")]
    Empty,
    /// The run did not finish within its bound.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The list was refused as a server set (a loop to a listener, duplicates, too many).
    #[error("refused as a server set: {0}")]
    Set(#[from] SetError),
    /// The set change did not finish (its task panicked or the runtime is stopping).
    #[error("set change failed: {0}")]
    Task(String),
}

/// Ask the source once.
///
/// # Errors
/// [`DiscoveryError`] naming the source and the reason.
pub async fn fetch(cfg: &DiscoveryConfig, route: &Route) -> Result<Found, DiscoveryError> {
    let found = match cfg {
        DiscoveryConfig::Dns(d) => dns::resolve(d).await?,
        DiscoveryConfig::Etcd(e) => etcd::members(e, route).await?,
        DiscoveryConfig::File(f) => file::read(f).await?,
    };
    if found.servers.is_empty() {
        return Err(DiscoveryError::Empty);
    }
    Ok(found)
}

/// When the next run is due after a good answer: `interval`, or the answer's TTL when that is
/// shorter (never below [`MIN_REFRESH`]).
pub fn next_run(interval: Duration, ttl: Option<Duration>) -> Duration {
    ttl.map_or(interval, |t| interval.min(t.max(MIN_REFRESH)))
}

/// Apply `found` to `balancer`; returns whether the set changed. Runs the set change on the
/// blocking pool (a file may list host names, which the system resolver expands).
async fn apply(
    balancer: &Arc<Balancer>,
    cfg: &DiscoveryConfig,
    found: Found,
) -> Result<bool, DiscoveryError> {
    let current = balancer.server_set();
    let (servers, default) = match cfg {
        // The operator's file says the order it wants and the default (none when it names
        // none, as a `PUT` body without one).
        DiscoveryConfig::File(_) => (found.servers, found.default),
        // DNS and etcd name no default: the balancer's stays.
        DiscoveryConfig::Dns(_) | DiscoveryConfig::Etcd(_) => {
            (merge(&current.servers, &found.servers), current.default)
        }
    };
    let b = balancer.clone();
    tokio::task::spawn_blocking(move || b.set_servers(&servers, default.as_ref()))
        .await
        .map_err(|e| DiscoveryError::Task(e.to_string()))?
        .map_err(DiscoveryError::from)
}

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Bound on one run: the source's own timeout (a file read gets the same 5 s).
fn run_bound(cfg: &DiscoveryConfig) -> Duration {
    match cfg {
        DiscoveryConfig::Dns(d) => d.timeout.0,
        DiscoveryConfig::Etcd(e) => e.timeout.0,
        DiscoveryConfig::File(_) => crate::config::DEFAULT_DISCOVERY_TIMEOUT,
    }
}

/// One run: ask, apply, record the outcome in the balancer's status and the metrics. Returns
/// when the next run is due.
async fn run_once(balancer: &Arc<Balancer>, cfg: &DiscoveryConfig, metrics: &Metrics) -> Duration {
    let route = Route::from_env(balancer.config().proxy.clone());
    let bound = run_bound(cfg);
    let result = match tokio::time::timeout(bound, fetch(cfg, &route)).await {
        Ok(Ok(found)) => {
            let ttl = found.ttl;
            let n = found.servers.len();
            apply(balancer, cfg, found)
                .await
                .map(|changed| (changed, n, ttl))
        }
        Ok(Err(e)) => Err(e),
        Err(_) => Err(DiscoveryError::Timeout(bound)),
    };
    let labels = DiscoveryLabels {
        balancer: balancer.name.clone(),
        kind: cfg.kind().into(),
    };
    let outcome = if result.is_ok() { "ok" } else { "error" };
    metrics
        .discovery_runs
        .get_or_create(&DiscoveryRunLabels {
            balancer: balancer.name.clone(),
            kind: cfg.kind().into(),
            result: outcome.into(),
        })
        .inc();
    let interval = cfg.interval();
    match result {
        Ok((changed, n, ttl)) => {
            let now = now_secs();
            metrics
                .discovery_last_success
                .get_or_create(&labels)
                .set(now);
            metrics
                .discovery_servers
                .get_or_create(&labels)
                .set(i64::try_from(n).unwrap_or(i64::MAX));
            let had_error = balancer
                .discovery_status()
                .is_some_and(|s| s.last_error.is_some());
            balancer.record_discovery(|st| {
                let st = st.get_or_insert_with(|| status_of(cfg));
                st.last_success = Some(now);
                st.servers = n;
                st.last_error = None;
                st.runs_ok += 1;
            });
            if changed {
                info!(balancer = %balancer.name, kind = cfg.kind(), source = %cfg.source(), servers = ?balancer.server_set().servers, "discovery changed the server set");
            } else if had_error {
                info!(balancer = %balancer.name, kind = cfg.kind(), "discovery works again");
            }
            next_run(interval, ttl)
        }
        Err(e) => {
            let text = e.to_string();
            let repeated = balancer
                .discovery_status()
                .and_then(|s| s.last_error)
                .is_some_and(|last| last == text);
            if repeated {
                debug!(balancer = %balancer.name, kind = cfg.kind(), error = %text, "discovery failed again; the last good set stays");
            } else {
                warn!(balancer = %balancer.name, kind = cfg.kind(), source = %cfg.source(), error = %text, "discovery failed; the last good set stays");
            }
            balancer.record_discovery(|st| {
                let st = st.get_or_insert_with(|| status_of(cfg));
                st.last_error = Some(text);
                st.last_error_at = Some(now_secs());
                st.runs_failed += 1;
            });
            interval
        }
    }
}

/// Drop the series of a source the balancer no longer uses (removed, or another kind), so no
/// stale last-success time stays behind to trip an alert.
fn forget_series(metrics: &Metrics, balancer: &str, kind: &str) {
    let labels = DiscoveryLabels {
        balancer: balancer.into(),
        kind: kind.into(),
    };
    metrics.discovery_last_success.remove(&labels);
    metrics.discovery_servers.remove(&labels);
    for result in ["ok", "error"] {
        metrics.discovery_runs.remove(&DiscoveryRunLabels {
            balancer: balancer.into(),
            kind: kind.into(),
            result: result.into(),
        });
    }
}

fn status_of(cfg: &DiscoveryConfig) -> DiscoveryStatus {
    DiscoveryStatus {
        kind: cfg.kind().into(),
        source: cfg.source(),
        interval_seconds: cfg.interval().as_secs_f64(),
        ..DiscoveryStatus::default()
    }
}

/// Why [`wait`] returned.
enum Wake {
    /// The time came.
    Due,
    /// The balancer changed (its set, a state, its config).
    Changed,
    /// Cancelled, or the balancer is gone.
    Stop,
}

/// Wait until `next` (for ever when `None`), a change of the balancer, or `cancel`.
async fn wait(
    next: Option<Instant>,
    cancel: &CancellationToken,
    changed: &mut tokio::sync::watch::Receiver<u64>,
) -> Wake {
    let due = async {
        match next {
            Some(t) => sleep_until(t).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        () = cancel.cancelled() => Wake::Stop,
        () = due => Wake::Due,
        r = changed.changed() => if r.is_ok() { Wake::Changed } else { Wake::Stop },
    }
}

/// Run `balancer`'s discovery until `cancel`: a run at once, then every interval (sooner when
/// a DNS TTL says so), and at once again when a reload changes the `discovery` keys. A
/// balancer without discovery waits for a reload that gives it one.
pub fn spawn(
    balancer: Arc<Balancer>,
    metrics: Arc<Metrics>,
    tasks: &TaskTracker,
    cancel: CancellationToken,
) {
    let span = info_span!("discovery", balancer = %balancer.name);
    tasks.spawn(
        async move {
            let mut changed = balancer.changed.subscribe();
            loop {
                let cfg = balancer.config().discovery.clone();
                if let Some(old) = balancer.discovery_status()
                    && cfg.as_ref().is_none_or(|d| d.kind() != old.kind)
                {
                    forget_series(&metrics, &balancer.name, &old.kind);
                }
                let next = match &cfg {
                    Some(d) => {
                        balancer.record_discovery(|st| match st {
                            Some(s) if s.kind == d.kind() && s.source == d.source() => {
                                s.interval_seconds = d.interval().as_secs_f64();
                            }
                            _ => *st = Some(status_of(d)),
                        });
                        Some(Instant::now() + run_once(&balancer, d, &metrics).await)
                    }
                    None => {
                        balancer.record_discovery(|st| *st = None);
                        None
                    }
                };
                // Sleep until the next run, waking on config changes: the set's own changes
                // bump the same channel, so only a different `discovery` ends the wait early.
                loop {
                    match wait(next, &cancel, &mut changed).await {
                        Wake::Stop => return,
                        Wake::Due => break,
                        Wake::Changed if balancer.config().discovery != cfg => break,
                        Wake::Changed => {}
                    }
                }
            }
        }
        .instrument(span),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> ServerAddr {
        ServerAddr::parse(s).unwrap()
    }

    #[test]
    fn merge_keeps_places_and_appends_new_ones() {
        let current = [sa("10.0.0.1:80"), sa("10.0.0.2:80"), sa("10.0.0.3:80")];
        // The answer rotated, dropped .2 and brought .4.
        let found = [sa("10.0.0.4:80"), sa("10.0.0.3:80"), sa("10.0.0.1:80")];
        assert_eq!(
            merge(&current, &found),
            [sa("10.0.0.1:80"), sa("10.0.0.3:80"), sa("10.0.0.4:80")]
        );
        assert_eq!(merge(&[], &found), found);
        assert!(merge(&current, &[]).is_empty());
    }
}
