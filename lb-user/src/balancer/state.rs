//! The K3s server states and their transitions, as pure functions over the server list: each
//! takes a result (a check, a dial) and returns which connections must be killed, so the caller
//! holds no lock while it kills and nothing here touches a socket.
//!
//! States, their order of preference and their transitions follow the K3s agent load balancer
//! (`pkg/agent/loadbalancer/servers.go` in k3s-io/k3s): new servers are UNCHECKED; a passing check
//! moves FAILED/UNCHECKED to RECOVERING, RECOVERING to PREFERRED (ACTIVE if it already has
//! connections), PREFERRED to HEALTHY after a minute; a successful dial makes HEALTHY/PREFERRED
//! ACTIVE; a failing check (after `fall`) makes a server FAILED and closes its connections. The
//! default server outside the set is STANDBY; removed servers are INVALID.

use std::{
    fmt,
    time::{Duration, Instant, SystemTime},
};

use tracing::info;

pub use crate::server_state::{Hold, ServerState};
use crate::{
    addr::ServerAddr,
    config::{BalancerConfig, OnUnhealthy, Policy},
};

/// How long a server stays PREFERRED before it becomes HEALTHY (K3s: one minute).
pub const PREFERRED_DURATION: Duration = Duration::from_secs(60);

/// Why a connection was killed; the `reason` label of `lb_connections_killed_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KillReason {
    /// The server failed its health check.
    Unhealthy,
    /// Fail-back to a more preferred server.
    Failback,
    /// The server left the set.
    Removed,
    /// An operator asked (`kill`, `disable`).
    Admin,
    /// A drain ran out of time.
    DrainTimeout,
    /// lb is shutting down and the grace period ended.
    Shutdown,
    /// No byte either way for `idle_timeout`.
    Idle,
}

impl KillReason {
    /// Every reason.
    pub const ALL: [KillReason; 7] = [
        KillReason::Unhealthy,
        KillReason::Failback,
        KillReason::Removed,
        KillReason::Admin,
        KillReason::DrainTimeout,
        KillReason::Shutdown,
        KillReason::Idle,
    ];

    /// Metric label.
    pub fn label(self) -> &'static str {
        match self {
            KillReason::Unhealthy => "health",
            KillReason::Failback => "failback",
            KillReason::Removed => "removed",
            KillReason::Admin => "manual",
            KillReason::DrainTimeout => "drain",
            KillReason::Shutdown => "shutdown",
            KillReason::Idle => "idle",
        }
    }
}

/// Why a server counts as failing once: what a check, a dial or the passive signal saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// A health check failed, with its reason.
    Check(String),
    /// A dial by the proxy failed (counted with `health.passive`).
    Dial(String),
    /// This many consecutive connections were reset by the server, or connect-time connects
    /// refused or timed out (`passive_reset_limit`).
    Resets(u32),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Check(e) => f.write_str(e),
            Failure::Dial(e) => write!(f, "dial: {e}"),
            Failure::Resets(n) => write!(
                f,
                "{n} connections reset, refused or timed out by the server"
            ),
        }
    }
}

impl From<&str> for Failure {
    fn from(e: &str) -> Failure {
        Failure::Check(e.to_string())
    }
}

impl From<String> for Failure {
    fn from(e: String) -> Failure {
        Failure::Check(e)
    }
}

/// A server as the balancer tracks it (its connections live in the registry).
#[derive(Debug)]
pub(super) struct Server {
    /// What is dialed and checked: an IP address, or a name pinned to one of its addresses.
    pub(super) addr: ServerAddr,
    /// The entry of the set it came from (the name, for a name's addresses).
    pub(super) origin: ServerAddr,
    pub(super) state: ServerState,
    pub(super) hold: Hold,
    pub(super) is_default: bool,
    pub(super) in_set: bool,
    pub(super) consecutive_failures: u32,
    pub(super) consecutive_successes: u32,
    /// Resets by the server since the last passing check (passive signal).
    pub(super) passive_resets: u32,
    /// When a retransmission timeout last counted as a reset of this server: RTOs within one
    /// check interval after it (one network blip hits many sockets) count no more.
    pub(super) rto_counted_at: Option<Instant>,
    pub(super) last_check: Option<SystemTime>,
    pub(super) last_check_at: Option<Instant>,
    pub(super) last_error: Option<String>,
    pub(super) preferred_since: Option<Instant>,
    /// Set when the server went FAILED; a recovery from it (not a first check) fails back.
    pub(super) has_failed: bool,
    pub(super) drain_deadline: Option<Instant>,
}

impl Server {
    pub(super) fn new(
        addr: ServerAddr,
        origin: ServerAddr,
        is_default: bool,
        in_set: bool,
    ) -> Server {
        Server {
            addr,
            origin,
            state: if in_set {
                ServerState::Unchecked
            } else {
                ServerState::Standby
            },
            hold: Hold::None,
            is_default,
            in_set,
            consecutive_failures: 0,
            consecutive_successes: 0,
            passive_resets: 0,
            rto_counted_at: None,
            last_check: None,
            last_check_at: None,
            last_error: None,
            preferred_since: None,
            has_failed: false,
            drain_deadline: None,
        }
    }

    /// Whether this server could take a connection now, for `/readyz` and `/check`: passing
    /// checks (HEALTHY, PREFERRED, ACTIVE), or RECOVERING/STANDBY with a passing last check. With
    /// `loop_enabled = false` an unchecked server counts too: it is checked before its first
    /// dial, so readiness must not wait for a check nobody schedules.
    pub(super) fn can_serve(&self, loop_enabled: bool) -> bool {
        if self.hold != Hold::None {
            return false;
        }
        let last_passed = self.last_check.is_some() && self.consecutive_failures == 0;
        match self.state {
            s if s.is_usable() => true,
            ServerState::Recovering | ServerState::Standby if last_passed => true,
            ServerState::Unchecked | ServerState::Standby => {
                !loop_enabled && self.last_check.is_none()
            }
            _ => false,
        }
    }
}

/// Move `s` to `to`, logging the change with its cause.
pub(super) fn transition(balancer: &str, s: &mut Server, to: ServerState, cause: &str) {
    if s.state == to {
        return;
    }
    info!(balancer, server = %s.addr, from = %s.state, to = %to, cause, "server state changed");
    if to == ServerState::Preferred {
        s.preferred_since = Some(Instant::now());
    }
    if to == ServerState::Failed {
        s.consecutive_successes = 0;
        s.has_failed = true;
    }
    s.state = to;
}

/// Under `failover` one server is ACTIVE: demote every other ACTIVE one to HEALTHY.
fn demote_other_active(balancer: &str, servers: &mut [Server], idx: usize) {
    for (i, s) in servers.iter_mut().enumerate() {
        if i != idx && s.state == ServerState::Active {
            transition(
                balancer,
                s,
                ServerState::Healthy,
                "another server became active",
            );
        }
    }
}

/// What a result asks the caller to do once the lock is released.
#[derive(Debug, Default)]
pub(super) struct Effects {
    /// Kill every connection of these servers, for these reasons.
    pub(super) kill: Vec<(ServerAddr, KillReason)>,
    /// Run the node-wide kill of these servers (`kill_scope = "node"`).
    pub(super) node_kill: Vec<ServerAddr>,
}

/// A dial to `servers[idx]` succeeded: HEALTHY/PREFERRED become ACTIVE (under `failover` the
/// previous ACTIVE server becomes HEALTHY). Returns whether a state changed.
pub(super) fn on_dial_ok(
    balancer: &str,
    servers: &mut [Server],
    idx: usize,
    policy: Policy,
) -> bool {
    if !matches!(
        servers[idx].state,
        ServerState::Healthy | ServerState::Preferred
    ) {
        return false;
    }
    if policy == Policy::Failover {
        demote_other_active(balancer, servers, idx);
    }
    transition(
        balancer,
        &mut servers[idx],
        ServerState::Active,
        "dial succeeded",
    );
    true
}

/// A check (or a failure counted as one) of `servers[idx]`, under `cfg`'s `rise`, `fall`,
/// `on_unhealthy`, policy and `failback`. `has_conns` says whether that server carries
/// connections now (a recovered server with connections is ACTIVE at once).
pub(super) fn on_check(
    balancer: &str,
    servers: &mut [Server],
    idx: usize,
    result: Result<(), &Failure>,
    cfg: &BalancerConfig,
    has_conns: bool,
) -> Effects {
    let mut fx = Effects::default();
    let s = &mut servers[idx];
    s.last_check = Some(SystemTime::now());
    s.last_check_at = Some(Instant::now());
    match result {
        Ok(()) => {
            s.consecutive_failures = 0;
            s.passive_resets = 0;
            s.consecutive_successes = s.consecutive_successes.saturating_add(1);
            s.last_error = None;
            let Some(mut next) = next_on_pass(s, cfg.health.rise) else {
                return fx;
            };
            if next == ServerState::Preferred && has_conns {
                next = ServerState::Active;
            }
            transition(balancer, s, next, "health check passed");
            // Fail back only to a server returning from FAILED: the first checks of a new
            // server are not a recovery, and must not move clients around.
            let recovered = next == ServerState::Preferred && std::mem::take(&mut s.has_failed);
            if next == ServerState::Active && cfg.policy == Policy::Failover {
                demote_other_active(balancer, servers, idx);
            }
            if recovered && cfg.policy == Policy::Failover && cfg.failback {
                fx.kill = fail_back(balancer, servers, idx);
            }
        }
        Err(e) => {
            s.consecutive_successes = 0;
            s.consecutive_failures = s.consecutive_failures.saturating_add(1);
            s.last_error = Some(e.to_string());
            if s.consecutive_failures < cfg.health.fall
                || matches!(s.state, ServerState::Failed | ServerState::Invalid)
            {
                return fx;
            }
            if s.in_set {
                transition(
                    balancer,
                    s,
                    ServerState::Failed,
                    &format!("health check failed: {e}"),
                );
            }
            match cfg.health.on_unhealthy {
                OnUnhealthy::Kill => {
                    fx.kill.push((s.addr.clone(), KillReason::Unhealthy));
                    fx.node_kill.push(s.addr.clone());
                }
                OnUnhealthy::Drain => {
                    s.drain_deadline = Some(Instant::now() + cfg.health.drain_timeout.0);
                }
                OnUnhealthy::Keep => {}
            }
        }
    }
    fx
}

/// The state a passing check moves `s` to, if any.
fn next_on_pass(s: &Server, rise: u32) -> Option<ServerState> {
    match s.state {
        ServerState::Failed | ServerState::Unchecked if rise <= 1 => Some(ServerState::Preferred),
        ServerState::Failed | ServerState::Unchecked => Some(ServerState::Recovering),
        ServerState::Recovering if s.consecutive_successes >= rise => Some(ServerState::Preferred),
        ServerState::Preferred
            if s.preferred_since
                .is_some_and(|t| t.elapsed() >= PREFERRED_DURATION) =>
        {
            Some(ServerState::Healthy)
        }
        _ => None,
    }
}

/// Fail back to `servers[idx]`: ACTIVE servers less preferred than it (later in the set, or the
/// default outside the set) go HEALTHY (STANDBY) and their connections are to be killed.
fn fail_back(balancer: &str, servers: &mut [Server], idx: usize) -> Vec<(ServerAddr, KillReason)> {
    let mut kill = Vec::new();
    for (j, other) in servers.iter_mut().enumerate() {
        let less_preferred = j > idx || !other.in_set;
        if j == idx || !less_preferred || other.state != ServerState::Active {
            continue;
        }
        let to = if other.in_set {
            ServerState::Healthy
        } else {
            ServerState::Standby
        };
        transition(balancer, other, to, "fail-back to a preferred server");
        kill.push((other.addr.clone(), KillReason::Failback));
    }
    kill
}

#[cfg(test)]
mod tests {
    use super::Hold;

    /// Log lines (`server hold changed from=none to=drain`) show a hold as `/status` does.
    #[test]
    fn holds_print_as_status_writes_them() {
        for hold in [Hold::None, Hold::Drain, Hold::Disabled] {
            let json = serde_json::to_string(&hold).unwrap();
            assert_eq!(format!("\"{hold}\""), json);
        }
    }
}
