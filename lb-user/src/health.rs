//! Health checks: the check kinds (`tcp`, `tls`, `http`, `tunnel`), the per-balancer scheduler
//! (one check in flight per server, `interval` with jitter, `fast_interval` while a server is
//! changing state, `down_interval` while it is FAILED), check-before-dial, on-demand checks and
//! passive signals. Results go to [`Balancer::record_check`], which applies `rise`/`fall` and
//! `on_unhealthy`.

pub(crate) mod http;
mod tls;
mod tunnel;

pub use tls::client_config_from_files;

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::Duration,
};

use futures::FutureExt as _;
use tokio::{
    net::TcpStream,
    sync::mpsc,
    time::{Instant, sleep_until},
};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::debug;

use crate::{
    addr::ServerAddr,
    balancer::{Balancer, Failure, ServerState, ServerStatus},
    config::{CheckKind, HealthConfig},
    metrics::{CheckLabels, Metrics, ServerLabels},
    net::Route,
    singleflight::SingleFlight,
};

/// Longest the scheduler sleeps without looking at drains and config changes.
const MAX_IDLE: Duration = Duration::from_millis(250);

/// Why one check failed.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// No answer within the check's timeout.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// Resolve, connect or I/O failure.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The TLS handshake failed (untrusted or wrong certificate, refused client certificate,
    /// no common protocol).
    #[error("TLS handshake failed: {0}")]
    Tls(#[source] std::io::Error),
    /// The TLS settings could not be used (unreadable CA, certificate or key file).
    #[error("TLS {what} {path}: {reason}")]
    TlsConfig {
        /// Which setting: `CA file`, `client certificate`, `client key`, ...
        what: &'static str,
        /// The file (`-` when none).
        path: std::path::PathBuf,
        /// Why.
        reason: String,
    },
    /// `sni` / `host` / the server's host is not a valid TLS server name.
    #[error("{0:?} is not a valid server name")]
    BadName(String),
    /// `alpn` was set and the server chose none of those protocols.
    #[error("server chose no ALPN protocol of {0:?}")]
    NoAlpn(Vec<String>),
    /// The URL template did not give a usable URL.
    #[error("bad check url {url:?}: {reason}")]
    Url {
        /// The URL after `{server}` was replaced.
        url: String,
        /// Why.
        reason: String,
    },
    /// HTTP protocol error (malformed response, connection closed mid-response).
    #[error("http: {0}")]
    Http(#[from] hyper::Error),
    /// The status is not in `expect_status`.
    #[error("unexpected HTTP status {0}")]
    Status(u16),
    /// The body does not contain `expect_body`.
    #[error("response body does not contain {0:?}")]
    Body(String),
    /// The response is larger than `max_response_bytes`.
    #[error("response larger than {0} bytes")]
    TooLarge(usize),
    /// WebSocket handshake or protocol error.
    #[error("websocket: {0}")]
    WebSocket(#[from] tokio_tungstenite::tungstenite::Error),
    /// The tunnel closed.
    #[error("tunnel closed by the server")]
    TunnelClosed,
    /// A ping got no pong within the timeout.
    #[error("no pong within {0:?}")]
    PongTimeout(Duration),
    /// The kept tunnel is down or stopped.
    #[error("tunnel: {0}")]
    Tunnel(String),
}

/// Run one check of `server` as `cfg` says, reaching it by `route` (the balancer's CONNECT
/// proxy, as client connections do), bounded by `cfg.timeout` (fixed; no escalation). A
/// `tunnel` check made here opens a WebSocket, waits for one pong and closes it; the scheduler
/// keeps tunnels open instead.
///
/// # Errors
/// [`CheckError`] saying why the server is unhealthy.
pub async fn check_once(
    cfg: &HealthConfig,
    server: &ServerAddr,
    route: &Route,
) -> Result<(), CheckError> {
    let limit = cfg.timeout.0;
    let fut = async {
        match cfg.kind {
            CheckKind::Tcp => connect_tcp(check_target(cfg, server)?.as_str(), route)
                .await
                .map(drop),
            CheckKind::Tls => tls_check(cfg, server, route).await,
            CheckKind::Http => http::check(cfg, server, route).await,
            CheckKind::Tunnel => tunnel::check_once(cfg, server, route).await,
        }
    };
    tokio::time::timeout(limit, fut)
        .await
        .unwrap_or(Err(CheckError::Timeout(limit)))
}

tokio::task_local! {
    /// How long the TCP connect of the check running in this task took, for the connect-time
    /// SYN timeout (`Balancer::note_rtt`).
    static CONNECT_TOOK: std::cell::Cell<Option<Duration>>;
}

/// Connect to `target` (`host:port`) by `route`. The socket closes with RST (`SO_LINGER` 0) so
/// checks leave no TIME_WAIT behind on either side.
async fn connect_tcp(target: &str, route: &Route) -> Result<TcpStream, CheckError> {
    let addr = ServerAddr::parse(target).map_err(|e| CheckError::Url {
        url: target.to_string(),
        reason: e.to_string(),
    })?;
    let began = Instant::now();
    let s = crate::net::connect(&addr, route).await?;
    let _ = CONNECT_TOOK.try_with(|c| c.set(Some(began.elapsed())));
    let _ = socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO));
    // A check that reaches lb's own listener would pass for a server that only loops back to
    // lb (which the dial refuses): it fails, so the server stays FAILED instead of recovering,
    // winning fail-back and resetting clients on every round.
    if route.proxy_for(&addr).is_none()
        && let Ok(peer) = s.peer_addr()
        && crate::net::is_own_listener(peer)
    {
        return Err(CheckError::Io(std::io::Error::other(format!(
            "{target} reaches one of lb's own listeners (a loop)"
        ))));
    }
    Ok(s)
}

/// Where a tcp or tls check of `server` connects: `address` (default the server's host, or a
/// name's pinned address) at `port` (default the server's port), as HAProxy's `check addr A
/// port N` and Envoy's `health_check_config.port_value` allow.
///
/// # Errors
/// [`CheckError::Url`] when `address` is not a host.
fn check_target(cfg: &HealthConfig, server: &ServerAddr) -> Result<ServerAddr, CheckError> {
    let port = cfg.port.unwrap_or(server.port());
    let Some(address) = &cfg.address else {
        return Ok(server.with_port(port));
    };
    let text = if address.parse::<std::net::Ipv6Addr>().is_ok() {
        format!("[{address}]:{port}")
    } else {
        format!("{address}:{port}")
    };
    ServerAddr::parse(&text).map_err(|e| CheckError::Url {
        url: text.clone(),
        reason: e.to_string(),
    })
}

/// Connect and finish a TLS handshake; with `alpn` set, the server must pick one of them.
async fn tls_check(
    cfg: &HealthConfig,
    server: &ServerAddr,
    route: &Route,
) -> Result<(), CheckError> {
    let tcp = connect_tcp(check_target(cfg, server)?.as_str(), route).await?;
    tls_verdict(cfg, &server.host_str(), tcp).await
}

/// The `tls` check's verdict on a connected stream: the handshake with `cfg`'s settings
/// (verified against `host` unless `sni` or `host` say otherwise) and, with `alpn` set, a
/// protocol the server picked.
///
/// # Errors
/// As [`tls::handshake`], or [`CheckError::NoAlpn`].
pub(crate) async fn tls_verdict<S>(cfg: &HealthConfig, host: &str, io: S) -> Result<(), CheckError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let stream = tls::handshake(cfg, host, io, None).await?;
    if !cfg.alpn.is_empty() && stream.get_ref().1.alpn_protocol().is_none() {
        return Err(CheckError::NoAlpn(cfg.alpn.clone()));
    }
    Ok(())
}

/// `d` shortened by up to 10 %, so checks of many servers spread out while `interval` stays an
/// upper bound (FAILED within `interval × fall + timeout`).
fn jittered(d: Duration) -> Duration {
    d.mul_f64(0.9 + 0.1 * rand::random::<f64>())
}

/// Time from one check's start to the next for a server in `status`: `down_interval` while
/// FAILED, `fast_interval` while UNCHECKED, RECOVERING or failing but not yet FAILED, else
/// `interval`.
pub fn next_interval(cfg: &HealthConfig, status: &ServerStatus) -> Duration {
    let fast = cfg.fast_interval.map_or(cfg.interval.0 / 2, |d| d.0);
    match status.state {
        ServerState::Failed => cfg.down_interval.map_or(cfg.interval.0, |d| d.0),
        ServerState::Unchecked | ServerState::Recovering => fast,
        _ if status.consecutive_failures > 0 => fast,
        _ => cfg.interval.0,
    }
}

/// State shared by the service, its check tasks and its tunnels.
#[derive(Debug)]
struct Shared {
    metrics: Arc<Metrics>,
    tasks: TaskTracker,
    /// The check running now per (balancer, server): later callers wait for it, and a check
    /// nobody waits for any more is dropped (cancelled) and records nothing.
    inflight: SingleFlight<(String, ServerAddr), bool>,
    tunnels: tunnel::Tunnels,
}

impl Shared {
    /// Count `result` in the metrics and give it to the balancer.
    fn record(
        &self,
        balancer: &Arc<Balancer>,
        server: &ServerAddr,
        result: Result<(), CheckError>,
        took: Duration,
    ) -> bool {
        let ok = result.is_ok();
        self.metrics
            .health_check_duration
            .get_or_create(&ServerLabels {
                balancer: balancer.name.clone(),
                server: server.to_string(),
            })
            .observe(took.as_secs_f64());
        self.metrics
            .health_checks
            .get_or_create(&CheckLabels {
                balancer: balancer.name.clone(),
                server: server.to_string(),
                result: if ok { "success" } else { "failure" }.into(),
            })
            .inc();
        if let Err(e) = &result {
            debug!(balancer = %balancer.name, %server, error = %e, "check failed");
        }
        balancer.record_check(server, result.map_err(|e| Failure::Check(e.to_string())));
        ok
    }

    /// Run one check of `server` now (a ping over its tunnel when one is kept) and record it.
    async fn run_check(self: Arc<Self>, balancer: Arc<Balancer>, server: ServerAddr) -> bool {
        let config = balancer.config();
        let cfg = &config.health;
        let _inflight = self.metrics.inflight_guard();
        let start = Instant::now();
        let (result, connect_took) = CONNECT_TOOK
            .scope(std::cell::Cell::new(None), async {
                let result = match (cfg.kind, self.tunnels.ping(&balancer.name, &server)) {
                    (CheckKind::Tunnel, Some(ping)) => tokio::time::timeout(cfg.timeout.0, ping)
                        .await
                        .unwrap_or(Err(CheckError::PongTimeout(cfg.timeout.0))),
                    _ => check_once(cfg, &server, &Route::from_env(config.proxy.clone())).await,
                };
                (result, CONNECT_TOOK.with(std::cell::Cell::get))
            })
            .await;
        let took = start.elapsed();
        if result.is_ok() && config.proxy.is_none() {
            balancer.note_rtt(&server, connect_took.unwrap_or(took));
        }
        self.record(&balancer, &server, result, took)
    }
}

/// Runs checks for every balancer and records their results.
#[derive(Debug)]
pub struct HealthService {
    shared: Arc<Shared>,
}

impl HealthService {
    /// New service; its loops, checks and tunnels run on `tasks`.
    pub fn new(metrics: Arc<Metrics>, tasks: TaskTracker) -> Arc<HealthService> {
        Arc::new(HealthService {
            shared: Arc::new(Shared {
                metrics,
                tasks,
                inflight: SingleFlight::default(),
                tunnels: tunnel::Tunnels::default(),
            }),
        })
    }

    /// Check `server` of `balancer` now and record the result; returns whether it passed. When
    /// a check of that server is already running (scheduler, dial, `/check`), this waits for
    /// it instead of starting another: at most one check per server is in flight. A check whose
    /// callers have all gone (a dropped `/check`, a client that left during check-before-dial)
    /// is cancelled and records nothing.
    pub async fn check_and_record(&self, balancer: &Arc<Balancer>, server: &ServerAddr) -> bool {
        let key = (balancer.name.clone(), server.clone());
        let (_, _, run) = self.shared.inflight.join(
            key,
            || (),
            || {
                let shared = self.shared.clone();
                shared
                    .clone()
                    .run_check(balancer.clone(), server.clone())
                    .boxed()
            },
        );
        run.await
    }

    /// Check-before-dial: when the last result of `server` is older than `max_age` (or there is
    /// none), check it now. Returns `false` when that check failed (the dialer then tries the
    /// server only after every other one).
    pub async fn before_dial(&self, balancer: &Arc<Balancer>, server: &ServerAddr) -> bool {
        let max_age = balancer.config().health.max_age.0;
        if balancer
            .last_checked(server)
            .is_some_and(|t| t.elapsed() <= max_age)
        {
            return true;
        }
        self.check_and_record(balancer, server).await
    }

    /// Check every server of `balancer` once, concurrently, and record the results.
    pub async fn check_all(self: &Arc<Self>, balancer: &Arc<Balancer>) {
        let specs = balancer.server_specs();
        let futs = specs.iter().map(|s| self.check_and_record(balancer, s));
        futures::future::join_all(futs).await;
    }

    /// Start the scheduler of `balancer` until `cancel` fires. It follows config changes: with
    /// `health.loop = false` it runs no checks (only drains expire), with `kind = "tunnel"` it
    /// keeps one tunnel per server.
    pub fn start(self: &Arc<Self>, balancer: Arc<Balancer>, cancel: CancellationToken) {
        let shared = self.shared.clone();
        let this = self.clone();
        self.shared.tasks.spawn(async move {
            Scheduler {
                service: this,
                shared,
                balancer,
                due: HashMap::new(),
                running: HashSet::new(),
            }
            .run(cancel)
            .await;
        });
    }
}

/// The periodic loop of one balancer.
struct Scheduler {
    service: Arc<HealthService>,
    shared: Arc<Shared>,
    balancer: Arc<Balancer>,
    /// When each server's next check starts.
    due: HashMap<ServerAddr, Instant>,
    /// Servers whose scheduled check is running.
    running: HashSet<ServerAddr>,
}

impl Scheduler {
    async fn run(mut self, cancel: CancellationToken) {
        let (done_tx, mut done_rx) = mpsc::unbounded_channel::<(ServerAddr, Instant)>();
        let mut changed = self.balancer.changed.subscribe();
        loop {
            let config = self.balancer.config();
            let cfg = &config.health;
            self.balancer.expire_drains();
            let statuses: Vec<ServerStatus> = self
                .balancer
                .status()
                .into_iter()
                .filter(|s| s.state != ServerState::Invalid)
                .collect();
            let specs: Vec<ServerAddr> = statuses.iter().map(|s| s.address.clone()).collect();
            self.due.retain(|s, _| specs.contains(s));
            let now = Instant::now();
            let mut wake = now + MAX_IDLE;
            if cfg.loop_enabled && cfg.kind == CheckKind::Tunnel {
                self.shared.tunnels.ensure(
                    &self.shared,
                    &self.balancer,
                    &specs,
                    cfg,
                    &Route::from_env(config.proxy.clone()),
                );
            } else {
                self.shared.tunnels.stop(&self.balancer.name);
            }
            if cfg.loop_enabled && cfg.kind != CheckKind::Tunnel {
                for st in &statuses {
                    if self.running.contains(&st.address) {
                        continue;
                    }
                    let due = *self
                        .due
                        .entry(st.address.clone())
                        .or_insert_with(|| first_due(&self.balancer, cfg, st, now));
                    if due <= now {
                        self.running.insert(st.address.clone());
                        let service = self.service.clone();
                        let balancer = self.balancer.clone();
                        let spec = st.address.clone();
                        let tx = done_tx.clone();
                        let cancel = cancel.clone();
                        self.shared.tasks.spawn(async move {
                            let started = Instant::now();
                            // A check still running when the loop is cancelled (shutdown, a
                            // hand-over) is dropped and records nothing.
                            tokio::select! {
                                () = cancel.cancelled() => return,
                                _ = service.check_and_record(&balancer, &spec) => {}
                            }
                            let _ = tx.send((spec, started));
                        });
                    } else {
                        wake = wake.min(due);
                    }
                }
            }
            tokio::select! {
                () = cancel.cancelled() => {
                    self.shared.tunnels.stop(&self.balancer.name);
                    return;
                }
                Some((spec, started)) = done_rx.recv() => {
                    self.running.remove(&spec);
                    let config = self.balancer.config();
                    let cfg = &config.health;
                    if let Some(st) = self.balancer.status().into_iter().find(|s| s.address == spec) {
                        self.due.insert(spec, started + jittered(next_interval(cfg, &st)));
                    }
                }
                _ = changed.changed() => {}
                () = sleep_until(wake) => {}
            }
        }
    }
}

/// First check time of a server the scheduler has not seen: one interval after its last result
/// (the daemon's first round, a dial), or now.
fn first_due(balancer: &Balancer, cfg: &HealthConfig, st: &ServerStatus, now: Instant) -> Instant {
    match balancer.last_checked(&st.address) {
        Some(at) => {
            let age = at.elapsed();
            now + jittered(next_interval(cfg, st)).saturating_sub(age)
        }
        None => now,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{balancer::Hold, config::Dur};

    fn status(state: ServerState, failures: u32) -> ServerStatus {
        ServerStatus {
            address: ServerAddr::parse("198.18.0.2:1").unwrap(),
            state,
            default: false,
            hold: Hold::None,
            connections: 0,
            consecutive_failures: failures,
            last_check: None,
            last_error: None,
            suspect: false,
        }
    }

    #[test]
    fn interval_follows_state() {
        let cfg = HealthConfig {
            interval: Dur(Duration::from_secs(2)),
            fast_interval: None,
            down_interval: Some(Dur(Duration::from_secs(10))),
            ..HealthConfig::default()
        };
        let s = Duration::from_secs;
        assert_eq!(next_interval(&cfg, &status(ServerState::Active, 0)), s(2));
        assert_eq!(next_interval(&cfg, &status(ServerState::Healthy, 0)), s(2));
        assert_eq!(next_interval(&cfg, &status(ServerState::Active, 1)), s(1));
        assert_eq!(
            next_interval(&cfg, &status(ServerState::Unchecked, 0)),
            s(1)
        );
        assert_eq!(
            next_interval(&cfg, &status(ServerState::Recovering, 0)),
            s(1)
        );
        assert_eq!(next_interval(&cfg, &status(ServerState::Failed, 3)), s(10));
    }

    #[test]
    fn jitter_only_shortens() {
        let d = Duration::from_millis(1000);
        for _ in 0..1000 {
            let j = jittered(d);
            assert!(j <= d && j >= Duration::from_millis(900), "{j:?}");
        }
    }
}
