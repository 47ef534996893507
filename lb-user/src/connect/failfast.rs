//! Connect-time fail fast, the daemon's half (the maps are `crate::datapath`'s): each
//! server's SYN policy kept current in the kernel (its SYN timeout from the measured round
//! trip), and the servers the kernel marked suspect acted on: counted, their connects still in
//! `SYN_SENT` aborted, the mark cleared once a check of the server passes after it.

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
    sync::Arc,
    time::{Duration, SystemTime},
};

use lb_common::SynPolicy;
use tracing::{debug, info, warn};

use crate::{
    balancer::Balancer,
    config::FailFastConfig,
    datapath::{Datapath, jiffies},
    metrics::{Metrics, ServerLabels},
};

/// How often the suspect marks are looked at (and the policies brought up to date): the
/// longest a connect to a suspect server waits in `SYN_SENT` for lb's abort, beyond the
/// sweep itself.
pub(super) const TICK: Duration = Duration::from_millis(100);

/// `[datapath.fail_fast]` as the config says now.
pub type DefaultConfig = Arc<dyn Fn() -> FailFastConfig + Send + Sync>;

/// One connect-time balancer's fail-fast bookkeeping.
pub(super) struct FailFast {
    default: DefaultConfig,
    /// The kernel's `HZ`; `None` leaves the kernel's SYN timeout.
    hz: Option<u32>,
    /// The policy written per server.
    written: HashMap<SocketAddr, SynPolicy>,
    /// The suspect servers already acted on.
    suspects: HashSet<SocketAddr>,
    /// When this lb started tracking the balancer: a mark made before (by the programs while
    /// an earlier lb ran, or none did) is left for the next check to clear, not acted on as a
    /// new failure.
    since: SystemTime,
}

impl FailFast {
    pub(super) fn new(default: DefaultConfig, hz: Option<u32>) -> FailFast {
        FailFast {
            default,
            hz,
            written: HashMap::new(),
            suspects: HashSet::new(),
            since: SystemTime::now(),
        }
    }

    /// One round for balancer `b` whose table holds `servers`: policies written where they
    /// changed (and deleted for servers that left), new suspects acted on, marks that a
    /// passing check outdated deleted.
    pub(super) fn tick(
        &mut self,
        b: &Arc<Balancer>,
        dp: &Arc<Datapath>,
        metrics: &Arc<Metrics>,
        servers: &[SocketAddr],
    ) {
        let cfg = b.config().fail_fast.unwrap_or_else(|| (self.default)());
        self.write_policies(b, dp, &cfg, servers);
        let marks = dp.connect_suspects(b.id);
        let status = b.status();
        let now = SystemTime::now();
        for (addr, ago) in &marks {
            let Some(server) = b.server_at(*addr) else {
                continue;
            };
            let marked_at = now.checked_sub(*ago).unwrap_or(SystemTime::UNIX_EPOCH);
            if self.suspects.insert(*addr) {
                if marked_at < self.since {
                    info!(balancer = %b.name, %server, marked_ms_ago = ago.as_millis(), "connect-time: a suspect mark from before this lb started; new connects avoid the server until a check passes, nothing counted against it");
                } else {
                    on_suspect(b, dp, metrics, &server, *addr, ago);
                }
            }
            let marked = marked_at
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            let passed_after = status.iter().any(|s| {
                s.address == server
                    && s.last_error.is_none()
                    && s.last_check.is_some_and(|t| t > marked)
            });
            if passed_after && dp.clear_suspect(b.id, *addr) {
                self.suspects.remove(addr);
                info!(balancer = %b.name, %server, "connect-time: suspicion cleared, a check passed");
            }
        }
        self.suspects.retain(|a| marks.iter().any(|(m, _)| m == a));
    }

    /// Write each server's policy where it changed; delete those of servers gone.
    fn write_policies(
        &mut self,
        b: &Balancer,
        dp: &Datapath,
        cfg: &FailFastConfig,
        servers: &[SocketAddr],
    ) {
        for addr in servers {
            let rtt = b.server_at(*addr).and_then(|s| b.rtt(&s));
            let timeout = cfg.timeout_for(rtt);
            let policy = SynPolicy {
                timeout_jiffies: self.hz.map_or(0, |hz| jiffies(timeout, hz)),
                suspect_after: cfg.suspect_after,
                syn_retries: cfg.syn_retries,
                _pad: 0,
            };
            if self.written.get(addr) == Some(&policy) {
                continue;
            }
            match dp.set_syn_policy(b.id, *addr, policy) {
                Ok(()) => {
                    debug!(balancer = %b.name, server = %addr, syn_timeout_ms = timeout.as_millis(), jiffies = policy.timeout_jiffies, suspect_after = policy.suspect_after, syn_retries = policy.syn_retries, "connect-time SYN policy written");
                    self.written.insert(*addr, policy);
                }
                Err(e) => {
                    warn!(balancer = %b.name, server = %addr, error = %crate::errors::chain(&e), "cannot write the connect-time SYN policy");
                }
            }
        }
        let before = self.written.len();
        self.written.retain(|a, _| servers.contains(a));
        if self.written.len() != before {
            let pruned = dp.prune_fail_fast(b.id, servers);
            debug!(balancer = %b.name, pruned, "fail-fast keys of servers gone from the table deleted");
        }
    }
}

/// A server the kernel just marked suspect: counted, logged, one passive reset toward
/// `passive_reset_limit`, and its connects still in `SYN_SENT` aborted (in the background).
fn on_suspect(
    b: &Arc<Balancer>,
    dp: &Arc<Datapath>,
    metrics: &Arc<Metrics>,
    server: &crate::addr::ServerAddr,
    addr: SocketAddr,
    ago: &Duration,
) {
    metrics
        .connect_suspect
        .get_or_create(&ServerLabels {
            balancer: b.name.clone(),
            server: server.to_string(),
        })
        .inc();
    warn!(balancer = %b.name, %server, %addr, marked_ms_ago = ago.as_millis(), "connect-time: server suspect, a connect's SYNs went unanswered; new connects avoid it until a check passes");
    b.record_connect_failure(server);
    let (dp, metrics, name, id, server) = (
        dp.clone(),
        metrics.clone(),
        b.name.clone(),
        b.id,
        server.clone(),
    );
    drop(tokio::task::spawn_blocking(move || {
        super::kill::abort_connecting(&dp, &metrics, &name, id, &server, "suspect");
    }));
}
