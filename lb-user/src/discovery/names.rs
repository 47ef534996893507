//! Host names in a balancer's `servers` and `default_server` follow DNS (`resolve =
//! "follow"`, the default): each name is asked again at its answer's TTL, bounded by
//! `[dns] interval` above and [`MIN_REFRESH`] below, with the `dns` source's query
//! ([`super::dns::lookup`], hosts file included, as the system resolver reads it). Addresses
//! that left the answer are removed and their connections closed; new ones join UNCHECKED
//! ([`Balancer::set_addresses`]). A failed or empty answer changes nothing. With `resolve =
//! "once"` a name keeps the addresses it had when it entered the set; only a name that
//! resolved to nothing then is asked until it answers once.

use std::{collections::HashMap, sync::Arc, time::Duration};

use tokio::time::Instant;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{Instrument as _, debug, info, info_span, warn};

use super::{DiscoveryError, MIN_REFRESH, Wake, dns, next_run, now_secs, wait};
use crate::{
    addr::ServerAddr,
    balancer::Balancer,
    config::{BalancerConfig, DnsConfig, Resolve},
};

/// How long a failed resolution waits before the next try, at most.
pub const RETRY_AFTER_ERROR: Duration = Duration::from_secs(5);

/// A balancer's `resolve` in force and the `[dns]` keys, read afresh before every round (a
/// reload applies at the next one).
pub type Settings = Arc<dyn Fn(&BalancerConfig) -> (Resolve, DnsConfig) + Send + Sync>;

/// Resolve `name` once with `dns`'s resolver.
///
/// # Errors
/// [`DiscoveryError::Resolve`], [`DiscoveryError::Timeout`] or [`DiscoveryError::Empty`].
pub async fn resolve_name(
    name: &ServerAddr,
    dns: &DnsConfig,
) -> Result<super::Found, DiscoveryError> {
    let host = name.host_str();
    let query = dns::Query {
        name: &host,
        port: name.port(),
        nameservers: &dns.nameservers,
        timeout: dns.timeout.0,
        hosts_file: true,
    };
    let found = tokio::time::timeout(dns.timeout.0, dns::lookup(&query))
        .await
        .map_err(|_| DiscoveryError::Timeout(dns.timeout.0))??;
    if found.servers.is_empty() {
        return Err(DiscoveryError::Empty);
    }
    Ok(found)
}

/// One resolution of `name` applied to `balancer`, recorded in its status; returns when the
/// next one is due.
async fn run_once(balancer: &Arc<Balancer>, name: &ServerAddr, dns: &DnsConfig) -> Duration {
    match resolve_name(name, dns).await {
        Ok(found) => {
            let (b, n, servers) = (balancer.clone(), name.clone(), found.servers);
            // No resolving happens in it, but kills may: off the runtime's threads.
            let changed = tokio::task::spawn_blocking(move || b.set_addresses(&n, &servers))
                .await
                .unwrap_or(false);
            let had_error = balancer
                .names_status()
                .iter()
                .any(|s| s.name == name.as_str() && s.last_error.is_some());
            if changed {
                info!(balancer = %balancer.name, %name, servers = ?balancer.addresses_of(name).unwrap_or_default(), "the name's addresses changed");
            } else if had_error {
                info!(balancer = %balancer.name, %name, "the name resolves again");
            }
            balancer.record_name(name, |st| {
                st.last_resolved = Some(now_secs());
                st.last_error = None;
            });
            next_run(dns.interval.0, found.ttl)
        }
        Err(e) => {
            let text = e.to_string();
            let repeated = balancer
                .names_status()
                .iter()
                .any(|s| s.name == name.as_str() && s.last_error.as_deref() == Some(&text));
            if repeated {
                debug!(balancer = %balancer.name, %name, error = %text, "resolving failed again; the addresses stay");
            } else {
                warn!(balancer = %balancer.name, %name, error = %text, "resolving failed; the addresses stay");
            }
            balancer.record_name(name, |st| {
                st.last_error = Some(text);
                st.last_error_at = Some(now_secs());
            });
            dns.interval.0.min(RETRY_AFTER_ERROR).max(MIN_REFRESH)
        }
    }
}

/// Whether `name` stands for pinned addresses now (it resolved when it entered the set).
fn is_pinned(balancer: &Balancer, name: &ServerAddr) -> bool {
    balancer
        .addresses_of(name)
        .is_some_and(|a| a.iter().any(|s| s.pin().is_some()))
}

/// Resolve the names of `balancer`'s set until `cancel`: each at once when it enters the set,
/// then as its answer's TTL says (`follow`), or only until it has addresses (`once`).
pub fn spawn(
    balancer: Arc<Balancer>,
    settings: Settings,
    tasks: &TaskTracker,
    cancel: CancellationToken,
) {
    let span = info_span!("names", balancer = %balancer.name);
    tasks.spawn(
        async move {
            let mut changed = balancer.changed.subscribe();
            let mut due: HashMap<ServerAddr, Instant> = HashMap::new();
            let mut last = None;
            loop {
                let (mode, dns) = settings(&balancer.config());
                if last.as_ref() != Some(&(mode, dns.clone())) {
                    // A reload changed how names resolve: every name at once.
                    due.clear();
                    last = Some((mode, dns.clone()));
                }
                let names = balancer.name_entries();
                due.retain(|n, _| names.contains(n));
                for name in &names {
                    if due.get(name).is_some_and(|t| *t > Instant::now()) {
                        continue;
                    }
                    let next = if mode == Resolve::Once && is_pinned(&balancer, name) {
                        dns.interval.0
                    } else {
                        run_once(&balancer, name, &dns).await
                    };
                    due.insert(name.clone(), Instant::now() + next);
                }
                // Set changes and reloads bump `changed`: new names are asked at once.
                let next = due.values().min().copied();
                if matches!(wait(next, &cancel, &mut changed).await, Wake::Stop) {
                    return;
                }
            }
        }
        .instrument(span),
    );
}
