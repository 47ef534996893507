//! Balancer: one server set with K3s states, the selection policy, the per-server connection
//! registry, fail-over and fail-back, and the state file.
//!
//! States, their order of preference and their transitions follow the K3s agent load balancer
//! (`pkg/agent/loadbalancer/servers.go` in k3s-io/k3s): new servers are UNCHECKED; a passing check
//! moves FAILED/UNCHECKED to RECOVERING, RECOVERING to PREFERRED (ACTIVE if it already has
//! connections), PREFERRED to HEALTHY after a minute; a successful dial makes HEALTHY/PREFERRED
//! ACTIVE; a failing check (after `fall`) makes a server FAILED and closes its connections. The
//! default server outside the set is STANDBY; removed servers are INVALID.

use std::{
    collections::HashMap,
    fmt,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime},
};

use arc_swap::ArcSwap;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{BalancerConfig, Policy};

/// Most servers one balancer takes (each is health-checked concurrently).
pub const MAX_SERVERS: usize = 256;

/// How long a server stays PREFERRED before it becomes HEALTHY (K3s: one minute).
pub const PREFERRED_DURATION: Duration = Duration::from_secs(60);

/// Server state; the numeric value is the `lb_server_state` metric and the order of preference.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ServerState {
    /// Removed from the set.
    Invalid = 0,
    /// Failed its checks (or a dial); connections closed.
    Failed = 1,
    /// The default server while it is not in the set: used only when nothing else works.
    Standby = 2,
    /// Added, not checked yet.
    Unchecked = 3,
    /// Passed a check after failing; needs `rise` passes.
    Recovering = 4,
    /// Passing checks.
    Healthy = 5,
    /// Recovered recently (fail-back target).
    Preferred = 6,
    /// Passing checks and carrying connections.
    Active = 7,
}

impl ServerState {
    /// Upper-case name as K3s prints it.
    pub fn name(self) -> &'static str {
        match self {
            ServerState::Invalid => "INVALID",
            ServerState::Failed => "FAILED",
            ServerState::Standby => "STANDBY",
            ServerState::Unchecked => "UNCHECKED",
            ServerState::Recovering => "RECOVERING",
            ServerState::Healthy => "HEALTHY",
            ServerState::Preferred => "PREFERRED",
            ServerState::Active => "ACTIVE",
        }
    }

    /// HEALTHY, PREFERRED or ACTIVE: the servers the spreading policies choose from.
    pub fn is_usable(self) -> bool {
        matches!(
            self,
            ServerState::Healthy | ServerState::Preferred | ServerState::Active
        )
    }
}

impl fmt::Display for ServerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An operator's hold on a server.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Hold {
    /// None.
    #[default]
    None,
    /// No new connections; existing ones stay until they end.
    Drain,
    /// No new connections; existing ones were killed.
    Disabled,
}

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
}

impl KillReason {
    /// Metric label.
    pub fn label(self) -> &'static str {
        match self {
            KillReason::Unhealthy => "health",
            KillReason::Failback => "failback",
            KillReason::Removed => "removed",
            KillReason::Admin => "manual",
            KillReason::DrainTimeout => "drain",
            KillReason::Shutdown => "shutdown",
        }
    }
}

/// Errors of server set changes.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SetError {
    /// An empty server list.
    #[error("the server list is empty")]
    Empty,
    /// More servers than a balancer takes.
    #[error("{0} servers; a balancer takes at most {MAX_SERVERS}")]
    TooMany(usize),
    /// The same server twice.
    #[error("server {0} is listed twice")]
    Duplicate(String),
    /// Not `host:port`.
    #[error("server {addr:?} is not host:port ({reason})")]
    Unparsable {
        /// As given.
        addr: String,
        /// Why.
        reason: String,
    },
    /// A server equal to one of the balancer's own listeners (a loop).
    #[error("server {0} is this balancer's own listen address")]
    OwnListener(String),
    /// Not in the set.
    #[error("server {0} is not in the set")]
    UnknownServer(String),
}

/// Split `host:port` / `[v6]:port` and check the port.
///
/// # Errors
/// A reason when it is not `host:port` with a port in 1..=65535.
pub fn parse_host_port(spec: &str) -> Result<(String, u16), String> {
    if let Ok(sa) = spec.parse::<SocketAddr>() {
        if sa.port() == 0 {
            return Err("port 0".into());
        }
        return Ok((sa.ip().to_string(), sa.port()));
    }
    let (host, port) = spec.rsplit_once(':').ok_or("missing :port")?;
    let port: u16 = port.parse().map_err(|_| format!("bad port {port:?}"))?;
    if port == 0 {
        return Err("port 0".into());
    }
    if host.is_empty() || host.contains(':') || host.contains('[') {
        return Err("bad host".into());
    }
    let ok = host.split('.').all(|l| {
        !l.is_empty() && l.len() <= 63 && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
    });
    if !ok {
        return Err(format!("bad host name {host:?}"));
    }
    Ok((host.to_string(), port))
}

/// Validate a server list and default against the balancer's listeners.
///
/// # Errors
/// [`SetError`] naming the offending server.
pub fn validate_server_set(
    servers: &[String],
    default: Option<&str>,
    listen: &[SocketAddr],
) -> Result<(), SetError> {
    if servers.is_empty() && default.is_none() {
        return Err(SetError::Empty);
    }
    if servers.len() > MAX_SERVERS {
        return Err(SetError::TooMany(servers.len()));
    }
    let mut seen = std::collections::HashSet::new();
    for s in servers.iter().map(String::as_str).chain(default) {
        parse_host_port(s).map_err(|reason| SetError::Unparsable {
            addr: s.to_string(),
            reason,
        })?;
        if let Ok(sa) = s.parse::<SocketAddr>()
            && listen.iter().any(|l| {
                *l == sa
                    || (l.port() == sa.port() && l.ip().is_unspecified() && sa.ip().is_loopback())
            })
        {
            return Err(SetError::OwnListener(s.to_string()));
        }
    }
    for s in servers {
        if !seen.insert(normalize(s)) {
            return Err(SetError::Duplicate(s.clone()));
        }
    }
    Ok(())
}

/// Canonical text of a server address (`[::1]:80`, not `[0:0::1]:80`).
pub fn normalize(spec: &str) -> String {
    spec.parse::<SocketAddr>()
        .map_or_else(|_| spec.to_ascii_lowercase(), |sa| sa.to_string())
}

/// Check `http://host:port` for the CONNECT proxy option.
///
/// # Errors
/// A reason when it is not `http://host:port`.
pub fn parse_proxy_url(url: &str) -> Result<(String, u16), String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or("only http:// CONNECT proxies are supported")?;
    let rest = rest.trim_end_matches('/');
    parse_host_port(rest)
}

/// One live connection's handle in the registry.
#[derive(Debug)]
struct ConnEntry {
    cancel: CancellationToken,
    reason: Arc<Mutex<Option<KillReason>>>,
}

/// Kill switch handed to a connection task.
#[derive(Clone, Debug)]
pub struct ConnGuard {
    /// Cancelled when the connection must be killed.
    pub cancel: CancellationToken,
    reason: Arc<Mutex<Option<KillReason>>>,
    balancer: Arc<Balancer>,
    server: String,
    id: u64,
}

impl ConnGuard {
    /// Why the connection was killed, once `cancel` fired.
    pub fn reason(&self) -> Option<KillReason> {
        *self.reason.lock().expect("poisoned")
    }

    /// The server this connection goes to.
    pub fn server(&self) -> &str {
        &self.server
    }
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        if Arc::strong_count(&self.reason) == 2 {
            self.balancer.unregister(&self.server, self.id);
        }
    }
}

/// A server as the balancer tracks it.
#[derive(Debug)]
struct Server {
    spec: String,
    state: ServerState,
    hold: Hold,
    is_default: bool,
    in_set: bool,
    consecutive_failures: u32,
    consecutive_successes: u32,
    /// Resets by the server since the last passing check (passive signal).
    passive_resets: u32,
    last_check: Option<SystemTime>,
    last_check_at: Option<Instant>,
    last_error: Option<String>,
    preferred_since: Option<Instant>,
    /// Set when the server went FAILED; a recovery from it (not a first check) fails back.
    has_failed: bool,
    conns: HashMap<u64, ConnEntry>,
    drain_deadline: Option<Instant>,
}

impl Server {
    fn new(spec: &str, is_default: bool, in_set: bool) -> Server {
        Server {
            spec: spec.to_string(),
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
            last_check: None,
            last_check_at: None,
            last_error: None,
            preferred_since: None,
            has_failed: false,
            conns: HashMap::new(),
            drain_deadline: None,
        }
    }
}

/// A server's status for `/status`, `lb status` and metrics.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ServerStatus {
    /// `host:port` as configured.
    pub address: String,
    /// State name.
    pub state: ServerState,
    /// Whether it is the default server.
    pub default: bool,
    /// Operator hold.
    pub hold: Hold,
    /// Open connections.
    pub connections: usize,
    /// Consecutive failed checks.
    pub consecutive_failures: u32,
    /// Last check time, seconds since the Unix epoch.
    pub last_check: Option<f64>,
    /// Last check error.
    pub last_error: Option<String>,
}

/// What a check result did, for the caller (kills are already done).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CheckOutcome {
    /// Old state.
    pub from: Option<ServerState>,
    /// New state.
    pub to: Option<ServerState>,
    /// Connections killed.
    pub killed: usize,
}

/// Callback for kills, so metrics can count them: `(server, reason, count)`.
pub type KillHook = Arc<dyn Fn(&str, KillReason, usize) + Send + Sync>;

/// Callback for `kill_scope = "node"`: `(server)`, called (without locks held) after lb's own
/// connections to a server that turned unhealthy (or whose drain ran out) were killed. It must
/// not block.
pub type NodeKillHook = Arc<dyn Fn(&str) + Send + Sync>;

/// One balancer: name, listeners, server set, policy and the connection registry.
pub struct Balancer {
    /// Name from the config.
    pub name: String,
    /// Id used as the kernel's balancer index.
    pub id: u32,
    cfg: ArcSwap<BalancerConfig>,
    inner: Mutex<Inner>,
    next_conn: AtomicU64,
    kill_hook: Mutex<Option<KillHook>>,
    node_kill_hook: Mutex<Option<NodeKillHook>>,
    /// Bumped on every state change; the health scheduler and admin watch it.
    pub changed: tokio::sync::watch::Sender<u64>,
}

impl fmt::Debug for Balancer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Balancer")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Default)]
struct Inner {
    servers: Vec<Server>,
    rr: usize,
}

/// Saved state: servers and default (K3s keeps the same in its state file).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct StateFile {
    /// Servers in order.
    pub servers: Vec<String>,
    /// Default server.
    pub default: Option<String>,
}

impl Balancer {
    /// Build from config; loads the state file when its default matches the configured one.
    pub fn new(id: u32, cfg: BalancerConfig) -> Arc<Balancer> {
        let mut servers = cfg.servers.clone();
        let default = cfg.default_server.clone();
        let read = cfg.state_file.as_deref().map(read_state_file);
        let on_disk = read.clone().and_then(Result::ok).flatten();
        if let (Some(path), Some(read)) = (&cfg.state_file, read) {
            match read {
                Ok(Some(saved))
                    if saved.default.as_deref().map(normalize)
                        == default.as_deref().map(normalize) =>
                {
                    if validate_server_set(&saved.servers, saved.default.as_deref(), &cfg.listen)
                        .is_ok()
                    {
                        info!(balancer = %cfg.name, file = %path.display(), servers = ?saved.servers, "loaded state file");
                        servers = saved.servers;
                    }
                }
                Ok(Some(_)) => {
                    info!(balancer = %cfg.name, "state file default differs from config; ignoring it")
                }
                Ok(None) => {}
                Err(e) => {
                    warn!(balancer = %cfg.name, file = %path.display(), error = %e, "state file unreadable; it will be rewritten")
                }
            }
        }
        let b = Arc::new(Balancer {
            name: cfg.name.clone(),
            id,
            cfg: ArcSwap::from_pointee(cfg),
            inner: Mutex::new(Inner::default()),
            next_conn: AtomicU64::new(1),
            kill_hook: Mutex::new(None),
            node_kill_hook: Mutex::new(None),
            changed: tokio::sync::watch::channel(0).0,
        });
        {
            let mut inner = b.lock();
            inner.servers = build_servers(&servers, default.as_deref());
        }
        // Rewrite the file only when it does not already say this (missing, corrupt, or another
        // set); afterwards it is written on every set change.
        if on_disk.as_ref() != Some(&b.state()) {
            b.write_state_file();
        }
        b
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().expect("balancer lock poisoned")
    }

    /// The balancer's config: a snapshot, replaced whole on reload (readers never lock).
    pub fn config(&self) -> Arc<BalancerConfig> {
        self.cfg.load_full()
    }

    /// Replace the config (SIGHUP) and apply its server set.
    ///
    /// # Errors
    /// As [`Balancer::set_servers`].
    pub fn replace_config(self: &Arc<Self>, cfg: BalancerConfig) -> Result<bool, SetError> {
        // Check the set first, so a refused config leaves the old one whole.
        validate_server_set(&cfg.servers, cfg.default_server.as_deref(), &cfg.listen)?;
        if cfg.servers.is_empty() {
            return Err(SetError::Empty);
        }
        let servers = cfg.servers.clone();
        let default = cfg.default_server.clone();
        self.cfg.store(Arc::new(cfg));
        self.set_servers(&servers, default.as_deref())
    }

    /// Install the callback that counts kills.
    pub fn set_kill_hook(&self, hook: KillHook) {
        *self.kill_hook.lock().expect("poisoned") = Some(hook);
    }

    /// Install the node-wide kill for `kill_scope = "node"` (see [`NodeKillHook`]).
    pub fn set_node_kill_hook(&self, hook: NodeKillHook) {
        *self.node_kill_hook.lock().expect("poisoned") = Some(hook);
    }

    /// Run the node-wide kill of `spec` when the config asks for it.
    fn node_kill(&self, spec: &str) {
        if self.cfg.load().health.kill_scope != crate::config::KillScope::Node {
            return;
        }
        if let Some(hook) = self.node_kill_hook.lock().expect("poisoned").clone() {
            hook(spec);
        }
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v += 1);
    }

    /// Server addresses in set order (the default last if it is only STANDBY).
    pub fn server_specs(&self) -> Vec<String> {
        self.lock()
            .servers
            .iter()
            .filter(|s| s.state != ServerState::Invalid)
            .map(|s| s.spec.clone())
            .collect()
    }

    /// Status of every server.
    pub fn status(&self) -> Vec<ServerStatus> {
        self.lock()
            .servers
            .iter()
            .map(|s| ServerStatus {
                address: s.spec.clone(),
                state: s.state,
                default: s.is_default,
                hold: s.hold,
                connections: s.conns.len(),
                consecutive_failures: s.consecutive_failures,
                last_check: s
                    .last_check
                    .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
                    .map(|d| d.as_secs_f64()),
                last_error: s.last_error.clone(),
            })
            .collect()
    }

    /// True when some server could take a connection now (usable, or UNCHECKED/RECOVERING/STANDBY).
    ///
    /// With `health.loop = false` an UNCHECKED server counts too: it is checked before its first
    /// dial, so readiness must not wait for a check nobody schedules.
    pub fn has_usable_server(&self) -> bool {
        let loop_enabled = self.cfg.load().health.loop_enabled;
        self.lock().servers.iter().any(|s| {
            s.hold == Hold::None
                && (matches!(
                    s.state,
                    ServerState::Healthy
                        | ServerState::Preferred
                        | ServerState::Active
                        | ServerState::Recovering
                        | ServerState::Standby
                ) || (!loop_enabled && s.state == ServerState::Unchecked))
        })
    }

    /// When each server was last checked (`None`: never).
    pub fn last_checked(&self, spec: &str) -> Option<Instant> {
        self.lock()
            .servers
            .iter()
            .find(|s| s.spec == spec)
            .and_then(|s| s.last_check_at)
    }

    /// Servers to dial, best first. `failover`: by state (ACTIVE, PREFERRED, HEALTHY, RECOVERING,
    /// UNCHECKED, STANDBY, FAILED), then set order. Spreading policies pick one usable server
    /// first, then the failover order.
    /// FAILED servers come last but are still tried (K3s #10240), and held servers never.
    pub fn dial_order(&self) -> Vec<String> {
        let policy = self.cfg.load().policy;
        let mut inner = self.lock();
        let mut order: Vec<(usize, &Server)> = inner
            .servers
            .iter()
            .enumerate()
            .filter(|(_, s)| s.hold == Hold::None && s.state != ServerState::Invalid)
            .collect();
        order.sort_by_key(|(i, s)| (std::cmp::Reverse(rank(s.state)), *i));
        let mut specs: Vec<String> = order.iter().map(|(_, s)| s.spec.clone()).collect();
        let usable: Vec<(String, usize)> = order
            .iter()
            .filter(|(_, s)| s.state.is_usable())
            .map(|(_, s)| (s.spec.clone(), s.conns.len()))
            .collect();
        drop(order);
        if policy != Policy::Failover && usable.len() > 1 {
            let pick = match policy {
                Policy::RoundRobin => {
                    inner.rr = inner.rr.wrapping_add(1);
                    usable[inner.rr % usable.len()].0.clone()
                }
                Policy::Random => usable[rand::random::<usize>() % usable.len()].0.clone(),
                Policy::LeastConnections => {
                    let a = &usable[rand::random::<usize>() % usable.len()];
                    let b = &usable[rand::random::<usize>() % usable.len()];
                    if b.1 < a.1 { b.0.clone() } else { a.0.clone() }
                }
                Policy::Failover => unreachable!("handled above"),
            };
            specs.retain(|s| *s != pick);
            specs.insert(0, pick);
        }
        specs
    }

    /// Record a dial result. Success: HEALTHY/PREFERRED → ACTIVE (under `failover` the previous
    /// ACTIVE server becomes HEALTHY). Failure: counts as a failed check when `passive`.
    pub fn record_dial(self: &Arc<Self>, spec: &str, result: Result<(), String>) {
        let (policy, passive) = {
            let cfg = self.cfg.load();
            (cfg.policy, cfg.health.passive)
        };
        match result {
            Ok(()) => {
                let mut inner = self.lock();
                let mut changed = false;
                let Some(idx) = inner.servers.iter().position(|s| s.spec == spec) else {
                    return;
                };
                if matches!(
                    inner.servers[idx].state,
                    ServerState::Healthy | ServerState::Preferred
                ) {
                    if policy == Policy::Failover {
                        for (i, s) in inner.servers.iter_mut().enumerate() {
                            if i != idx && s.state == ServerState::Active {
                                transition(
                                    &self.name,
                                    s,
                                    ServerState::Healthy,
                                    "another server became active",
                                );
                            }
                        }
                    }
                    transition(
                        &self.name,
                        &mut inner.servers[idx],
                        ServerState::Active,
                        "dial succeeded",
                    );
                    changed = true;
                }
                drop(inner);
                if changed {
                    self.bump();
                }
            }
            Err(e) => {
                if passive {
                    self.record_check(spec, Err(format!("dial: {e}")));
                }
            }
        }
    }

    /// Record a health check result and apply `rise`/`fall`. A server that turns FAILED has its
    /// connections handled per `on_unhealthy`; a recovery to PREFERRED fails back (kills
    /// connections on less preferred ACTIVE servers) under `failover` with `failback = true`.
    pub fn record_check(self: &Arc<Self>, spec: &str, result: Result<(), String>) -> CheckOutcome {
        let cfg = self.config();
        let (rise, fall) = (cfg.health.rise, cfg.health.fall);
        let mut kills: Vec<(String, Vec<ConnEntry>, KillReason)> = Vec::new();
        let mut node_kills: Vec<String> = Vec::new();
        let mut out = CheckOutcome::default();
        {
            let mut inner = self.lock();
            let Some(idx) = inner.servers.iter().position(|s| s.spec == spec) else {
                return out;
            };
            let s = &mut inner.servers[idx];
            s.last_check = Some(SystemTime::now());
            s.last_check_at = Some(Instant::now());
            let from = s.state;
            match result {
                Ok(()) => {
                    s.consecutive_failures = 0;
                    s.passive_resets = 0;
                    s.consecutive_successes = s.consecutive_successes.saturating_add(1);
                    s.last_error = None;
                    let next = match s.state {
                        ServerState::Failed | ServerState::Unchecked => {
                            if rise <= 1 {
                                Some(ServerState::Preferred)
                            } else {
                                Some(ServerState::Recovering)
                            }
                        }
                        ServerState::Recovering if s.consecutive_successes >= rise => {
                            Some(ServerState::Preferred)
                        }
                        ServerState::Preferred
                            if s.preferred_since
                                .is_some_and(|t| t.elapsed() >= PREFERRED_DURATION) =>
                        {
                            Some(ServerState::Healthy)
                        }
                        _ => None,
                    };
                    if let Some(mut next) = next {
                        if next == ServerState::Preferred && !s.conns.is_empty() {
                            next = ServerState::Active;
                        }
                        transition(&self.name, s, next, "health check passed");
                        // Fail back only to a server returning from FAILED: the first checks
                        // of a new server are not a recovery, and must not move clients around.
                        let recovered =
                            next == ServerState::Preferred && std::mem::take(&mut s.has_failed);
                        if next == ServerState::Active && cfg.policy == Policy::Failover {
                            for (j, other) in inner.servers.iter_mut().enumerate() {
                                if j != idx && other.state == ServerState::Active {
                                    transition(
                                        &self.name,
                                        other,
                                        ServerState::Healthy,
                                        "another server became active",
                                    );
                                }
                            }
                        }
                        if recovered && cfg.policy == Policy::Failover && cfg.failback {
                            // Fail back: close connections on ACTIVE servers less preferred than
                            // this one (later in the set, or the default outside the set).
                            for (j, other) in inner.servers.iter_mut().enumerate() {
                                let less_preferred = j > idx || !other.in_set;
                                if j == idx || !less_preferred || other.state != ServerState::Active
                                {
                                    continue;
                                }
                                let to = if other.in_set {
                                    ServerState::Healthy
                                } else {
                                    ServerState::Standby
                                };
                                transition(
                                    &self.name,
                                    other,
                                    to,
                                    "fail-back to a preferred server",
                                );
                                let taken: Vec<ConnEntry> =
                                    other.conns.drain().map(|(_, c)| c).collect();
                                kills.push((other.spec.clone(), taken, KillReason::Failback));
                            }
                        }
                    }
                }
                Err(e) => {
                    s.consecutive_successes = 0;
                    s.consecutive_failures = s.consecutive_failures.saturating_add(1);
                    s.last_error = Some(e.clone());
                    if s.consecutive_failures >= fall
                        && !matches!(s.state, ServerState::Failed | ServerState::Invalid)
                    {
                        if s.in_set {
                            transition(
                                &self.name,
                                s,
                                ServerState::Failed,
                                &format!("health check failed: {e}"),
                            );
                        }
                        match cfg.health.on_unhealthy {
                            crate::config::OnUnhealthy::Kill => {
                                let taken: Vec<ConnEntry> =
                                    s.conns.drain().map(|(_, c)| c).collect();
                                kills.push((s.spec.clone(), taken, KillReason::Unhealthy));
                                node_kills.push(s.spec.clone());
                            }
                            crate::config::OnUnhealthy::Drain => {
                                s.drain_deadline =
                                    Some(Instant::now() + cfg.health.drain_timeout.0);
                            }
                            crate::config::OnUnhealthy::Keep => {}
                        }
                    }
                }
            }
            out.from = Some(from);
            out.to = Some(inner.servers[idx].state);
        }
        for (spec, conns, reason) in kills {
            out.killed += self.kill_entries(&spec, conns, reason);
        }
        for spec in node_kills {
            self.node_kill(&spec);
        }
        if out.from != out.to {
            // The state file holds the set and the default, which checks never change.
            self.bump();
        }
        out
    }

    /// Count a reset of an established connection by `spec` (passive signal): every `limit`
    /// consecutive resets count as one failed check. Returns whether one was recorded.
    pub fn record_passive_reset(self: &Arc<Self>, spec: &str, limit: u32) -> bool {
        let due = {
            let mut inner = self.lock();
            let Some(s) = inner.servers.iter_mut().find(|s| s.spec == spec) else {
                return false;
            };
            s.passive_resets += 1;
            if s.passive_resets >= limit {
                s.passive_resets = 0;
                true
            } else {
                false
            }
        };
        if due {
            self.record_check(
                spec,
                Err(format!("{limit} connections reset by the server")),
            );
        }
        due
    }

    /// Kill the connections of servers whose drain deadline passed; returns how many.
    pub fn expire_drains(self: &Arc<Self>) -> usize {
        let now = Instant::now();
        let mut kills = Vec::new();
        {
            let mut inner = self.lock();
            for s in &mut inner.servers {
                if s.drain_deadline.is_some_and(|d| d <= now) {
                    s.drain_deadline = None;
                    let taken: Vec<ConnEntry> = s.conns.drain().map(|(_, c)| c).collect();
                    kills.push((s.spec.clone(), taken));
                }
            }
        }
        kills
            .into_iter()
            .map(|(spec, c)| {
                let n = self.kill_entries(&spec, c, KillReason::DrainTimeout);
                self.node_kill(&spec);
                n
            })
            .sum()
    }

    fn kill_entries(&self, spec: &str, conns: Vec<ConnEntry>, reason: KillReason) -> usize {
        let n = conns.len();
        for c in conns {
            *c.reason.lock().expect("poisoned") = Some(reason);
            c.cancel.cancel();
        }
        if n > 0 {
            warn!(balancer = %self.name, server = %spec, connections = n, reason = reason.label(), "killed connections");
            if let Some(hook) = self.kill_hook.lock().expect("poisoned").clone() {
                hook(spec, reason, n);
            }
        }
        n
    }

    /// Kill every connection to `spec`.
    ///
    /// # Errors
    /// [`SetError::UnknownServer`].
    pub fn kill_server(&self, spec: &str, reason: KillReason) -> Result<usize, SetError> {
        let taken = {
            let mut inner = self.lock();
            let s = inner
                .servers
                .iter_mut()
                .find(|s| s.spec == normalize(spec) || s.spec == spec)
                .ok_or_else(|| SetError::UnknownServer(spec.to_string()))?;
            s.conns.drain().map(|(_, c)| c).collect::<Vec<_>>()
        };
        Ok(self.kill_entries(spec, taken, reason))
    }

    /// Kill every connection of the balancer (shutdown).
    pub fn kill_all(&self, reason: KillReason) -> usize {
        let taken: Vec<(String, Vec<ConnEntry>)> = {
            let mut inner = self.lock();
            inner
                .servers
                .iter_mut()
                .map(|s| (s.spec.clone(), s.conns.drain().map(|(_, c)| c).collect()))
                .collect()
        };
        taken
            .into_iter()
            .map(|(spec, c)| self.kill_entries(&spec, c, reason))
            .sum()
    }

    /// Total open connections.
    pub fn connection_count(&self) -> usize {
        self.lock().servers.iter().map(|s| s.conns.len()).sum()
    }

    /// Set an operator hold: `Drain` (no new connections), `Disabled` (no new, existing killed),
    /// `None` (enable).
    ///
    /// # Errors
    /// [`SetError::UnknownServer`].
    pub fn set_hold(self: &Arc<Self>, spec: &str, hold: Hold) -> Result<usize, SetError> {
        let taken = {
            let mut inner = self.lock();
            let s = inner
                .servers
                .iter_mut()
                .find(|s| s.spec == normalize(spec) || s.spec == spec)
                .ok_or_else(|| SetError::UnknownServer(spec.to_string()))?;
            info!(balancer = %self.name, server = %s.spec, from = ?s.hold, to = ?hold, "server hold changed");
            s.hold = hold;
            if hold == Hold::Disabled {
                s.conns.drain().map(|(_, c)| c).collect()
            } else {
                Vec::new()
            }
        };
        self.bump();
        Ok(self.kill_entries(spec, taken, KillReason::Admin))
    }

    /// Replace the server set and default. An unchanged set does nothing (returns `false`); new
    /// servers start UNCHECKED; removed ones go INVALID and their connections are closed; a
    /// previous default that was only STANDBY is removed with its connections (K3s rules).
    ///
    /// # Errors
    /// [`SetError`] for an empty list, duplicates, unparsable addresses or the own listener.
    pub fn set_servers(
        self: &Arc<Self>,
        servers: &[String],
        default: Option<&str>,
    ) -> Result<bool, SetError> {
        if servers.is_empty() {
            return Err(SetError::Empty);
        }
        let listen = self.cfg.load().listen.clone();
        validate_server_set(servers, default, &listen)?;
        let servers: Vec<String> = servers.iter().map(|s| normalize(s)).collect();
        let default = default.map(normalize);
        let mut kills = Vec::new();
        {
            let mut inner = self.lock();
            let current: Vec<String> = inner
                .servers
                .iter()
                .filter(|s| s.in_set)
                .map(|s| s.spec.clone())
                .collect();
            let current_default = inner
                .servers
                .iter()
                .find(|s| s.is_default)
                .map(|s| s.spec.clone());
            if current == servers && current_default == default {
                return Ok(false);
            }
            let mut old: Vec<Server> = std::mem::take(&mut inner.servers);
            let mut next = Vec::new();
            for spec in servers
                .iter()
                .chain(default.iter().filter(|d| !servers.contains(d)))
            {
                let in_set = servers.contains(spec);
                let is_default = default.as_deref() == Some(spec.as_str());
                let s = match old.iter().position(|s| s.spec == *spec) {
                    Some(i) => {
                        let mut s = old.remove(i);
                        if s.in_set && !in_set && s.state != ServerState::Failed {
                            transition(
                                &self.name,
                                &mut s,
                                ServerState::Standby,
                                "default server left the set",
                            );
                        } else if !s.in_set && in_set {
                            transition(
                                &self.name,
                                &mut s,
                                ServerState::Unchecked,
                                "added to the set",
                            );
                        }
                        s.in_set = in_set;
                        s.is_default = is_default;
                        s
                    }
                    None => {
                        let s = Server::new(spec, is_default, in_set);
                        info!(balancer = %self.name, server = %spec, state = %s.state, "server added");
                        s
                    }
                };
                next.push(s);
            }
            for mut s in old {
                transition(
                    &self.name,
                    &mut s,
                    ServerState::Invalid,
                    "removed from the set",
                );
                let taken: Vec<ConnEntry> = s.conns.drain().map(|(_, c)| c).collect();
                kills.push((s.spec.clone(), taken));
            }
            inner.servers = next;
        }
        for (spec, c) in kills {
            self.kill_entries(&spec, c, KillReason::Removed);
        }
        self.bump();
        self.write_state_file();
        Ok(true)
    }

    /// Add one server at the end of the set.
    ///
    /// # Errors
    /// As [`Balancer::set_servers`].
    pub fn add_server(self: &Arc<Self>, spec: &str) -> Result<bool, SetError> {
        let mut servers: Vec<String> = self
            .lock()
            .servers
            .iter()
            .filter(|s| s.in_set)
            .map(|s| s.spec.clone())
            .collect();
        servers.push(spec.to_string());
        let default = self.default_server();
        self.set_servers(&servers, default.as_deref())
    }

    /// Remove one server from the set.
    ///
    /// # Errors
    /// [`SetError::UnknownServer`], or [`SetError::Empty`] when it is the last.
    pub fn remove_server(self: &Arc<Self>, spec: &str) -> Result<bool, SetError> {
        let spec_n = normalize(spec);
        let mut servers: Vec<String> = self
            .lock()
            .servers
            .iter()
            .filter(|s| s.in_set)
            .map(|s| s.spec.clone())
            .collect();
        let before = servers.len();
        servers.retain(|s| *s != spec_n);
        if servers.len() == before {
            return Err(SetError::UnknownServer(spec.to_string()));
        }
        let default = self.default_server();
        self.set_servers(&servers, default.as_deref())
    }

    /// The default server, if any.
    pub fn default_server(&self) -> Option<String> {
        self.lock()
            .servers
            .iter()
            .find(|s| s.is_default)
            .map(|s| s.spec.clone())
    }

    /// Register a new connection to `spec`; the guard unregisters on drop.
    pub fn register(self: &Arc<Self>, spec: &str) -> ConnGuard {
        let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let cancel = CancellationToken::new();
        let reason = Arc::new(Mutex::new(None));
        let mut inner = self.lock();
        if let Some(s) = inner.servers.iter_mut().find(|s| s.spec == spec) {
            s.conns.insert(
                id,
                ConnEntry {
                    cancel: cancel.clone(),
                    reason: reason.clone(),
                },
            );
        } else {
            cancel.cancel();
        }
        drop(inner);
        ConnGuard {
            cancel,
            reason,
            balancer: self.clone(),
            server: spec.to_string(),
            id,
        }
    }

    fn unregister(&self, spec: &str, id: u64) {
        let mut inner = self.lock();
        if let Some(s) = inner.servers.iter_mut().find(|s| s.spec == spec) {
            s.conns.remove(&id);
        }
    }

    /// The set and default as the state file records them.
    fn state(&self) -> StateFile {
        let inner = self.lock();
        StateFile {
            servers: inner
                .servers
                .iter()
                .filter(|s| s.in_set)
                .map(|s| s.spec.clone())
                .collect(),
            default: inner
                .servers
                .iter()
                .find(|s| s.is_default)
                .map(|s| s.spec.clone()),
        }
    }

    fn write_state_file(&self) {
        let Some(path) = self.cfg.load().state_file.clone() else {
            return;
        };
        let state = self.state();
        if let Err(e) = write_state_file(&path, &state) {
            warn!(balancer = %self.name, file = %path.display(), error = %e, "cannot write state file");
        }
    }
}

fn rank(state: ServerState) -> u8 {
    // Preference for dialing: ACTIVE, PREFERRED, HEALTHY, RECOVERING, UNCHECKED, STANDBY, FAILED.
    state as u8
}

fn transition(balancer: &str, s: &mut Server, to: ServerState, cause: &str) {
    if s.state == to {
        return;
    }
    info!(balancer, server = %s.spec, from = %s.state, to = %to, cause, "server state changed");
    if to == ServerState::Preferred {
        s.preferred_since = Some(Instant::now());
    }
    if to == ServerState::Failed {
        s.consecutive_successes = 0;
        s.has_failed = true;
    }
    s.state = to;
}

fn build_servers(servers: &[String], default: Option<&str>) -> Vec<Server> {
    let default = default.map(normalize);
    let mut out: Vec<Server> = servers
        .iter()
        .map(|s| {
            let spec = normalize(s);
            let is_default = default.as_deref() == Some(spec.as_str());
            Server::new(&spec, is_default, true)
        })
        .collect();
    if let Some(d) = default
        && !out.iter().any(|s| s.spec == d)
    {
        out.push(Server::new(&d, true, false));
    }
    out
}

/// Read a state file; `Ok(None)` when it does not exist.
///
/// # Errors
/// I/O or JSON errors (the caller warns and rewrites).
pub fn read_state_file(path: &Path) -> Result<Option<StateFile>, String> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| format!("corrupt: {e}")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// Write a state file atomically: temporary file in the same directory, fsync, rename.
///
/// # Errors
/// I/O errors; the old file is kept and the temporary file removed.
pub fn write_state_file(path: &Path, state: &StateFile) -> std::io::Result<()> {
    use std::io::Write as _;
    if let Some(dir) = path.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir)?;
    }
    let tmp: PathBuf = path.with_extension(format!("tmp.{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&serde_json::to_vec_pretty(state).map_err(std::io::Error::other)?)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, Overrides};

    fn balancer(servers: &[&str], default: Option<&str>, policy: Policy) -> Arc<Balancer> {
        let o = Overrides {
            listen: vec!["127.0.0.1:6444".parse().unwrap()],
            servers: servers.iter().map(|s| s.to_string()).collect(),
            default_server: default.map(str::to_string),
            ..Overrides::default()
        };
        let mut cfg = Config::load(None, &o).unwrap().balancers.remove(0);
        cfg.policy = policy;
        Balancer::new(0, cfg)
    }

    fn states(b: &Balancer) -> Vec<ServerState> {
        b.status().iter().map(|s| s.state).collect()
    }

    #[test]
    fn k3s_transitions() {
        use ServerState::*;
        let b = balancer(&["198.18.0.2:1", "198.18.0.3:1"], None, Policy::Failover);
        assert_eq!(states(&b), [Unchecked, Unchecked]);
        b.record_check("198.18.0.2:1", Ok(()));
        assert_eq!(states(&b)[0], Recovering);
        b.record_check("198.18.0.2:1", Ok(()));
        assert_eq!(states(&b)[0], Preferred);
        b.record_dial("198.18.0.2:1", Ok(()));
        assert_eq!(states(&b)[0], Active);
        let g = b.register("198.18.0.2:1");
        let out = b.record_check("198.18.0.2:1", Err("refused".into()));
        assert_eq!(
            (out.from, out.to, out.killed),
            (Some(Active), Some(Failed), 1)
        );
        assert!(g.cancel.is_cancelled());
        assert_eq!(g.reason(), Some(KillReason::Unhealthy));
        assert_eq!(
            b.dial_order(),
            ["198.18.0.3:1", "198.18.0.2:1"],
            "FAILED is still tried, last"
        );
    }

    #[test]
    fn failback_kills_less_preferred_active() {
        let b = balancer(&["198.18.0.2:1", "198.18.0.3:1"], None, Policy::Failover);
        for s in ["198.18.0.2:1", "198.18.0.3:1"] {
            b.record_check(s, Ok(()));
            b.record_check(s, Ok(()));
        }
        b.record_check("198.18.0.2:1", Err("down".into()));
        b.record_dial("198.18.0.3:1", Ok(()));
        let g = b.register("198.18.0.3:1");
        b.record_check("198.18.0.2:1", Ok(()));
        assert!(!g.cancel.is_cancelled());
        b.record_check("198.18.0.2:1", Ok(()));
        assert_eq!(g.reason(), Some(KillReason::Failback));
        assert_eq!(b.dial_order()[0], "198.18.0.2:1");
    }

    #[test]
    fn first_checks_do_not_fail_back() {
        let b = balancer(&["198.18.0.2:1", "198.18.0.3:1"], None, Policy::Failover);
        b.record_check("198.18.0.3:1", Ok(()));
        b.record_check("198.18.0.3:1", Ok(()));
        b.record_dial("198.18.0.3:1", Ok(()));
        let g = b.register("198.18.0.3:1");
        b.record_check("198.18.0.2:1", Ok(()));
        b.record_check("198.18.0.2:1", Ok(()));
        assert!(
            !g.cancel.is_cancelled(),
            "a server's first passing checks are not a recovery"
        );
        assert_eq!(
            b.dial_order()[0],
            "198.18.0.3:1",
            "the ACTIVE server keeps new clients"
        );
    }

    #[test]
    fn default_server_is_standby_and_last() {
        let b = balancer(&["198.18.0.2:1"], Some("198.18.0.9:1"), Policy::Failover);
        assert_eq!(states(&b), [ServerState::Unchecked, ServerState::Standby]);
        b.record_check("198.18.0.2:1", Err("down".into()));
        assert_eq!(b.dial_order(), ["198.18.0.9:1", "198.18.0.2:1"]);
        // Moving the default removes the old STANDBY one.
        assert!(
            b.set_servers(&["198.18.0.2:1".into()], Some("198.18.0.2:1"))
                .unwrap()
        );
        assert_eq!(b.server_specs(), ["198.18.0.2:1"]);
    }

    #[test]
    fn set_refuses_bad_sets_and_skips_unchanged() {
        let b = balancer(&["198.18.0.2:1"], None, Policy::Failover);
        assert_eq!(b.set_servers(&[], None), Err(SetError::Empty));
        assert!(matches!(
            b.set_servers(&["a:1".into(), "a:1".into()], None),
            Err(SetError::Duplicate(_))
        ));
        assert!(matches!(
            b.set_servers(&["nope".into()], None),
            Err(SetError::Unparsable { .. })
        ));
        assert!(matches!(
            b.set_servers(&["127.0.0.1:6444".into()], None),
            Err(SetError::OwnListener(_))
        ));
        assert!(!b.set_servers(&["198.18.0.2:1".into()], None).unwrap());
    }

    #[test]
    fn passive_resets_fail_a_server_only_at_the_limit() {
        let b = balancer(&["198.18.0.2:1"], None, Policy::Failover);
        b.record_check("198.18.0.2:1", Ok(()));
        b.record_check("198.18.0.2:1", Ok(()));
        for _ in 0..9 {
            assert!(!b.record_passive_reset("198.18.0.2:1", 10));
        }
        assert_eq!(states(&b), [ServerState::Preferred]);
        // A passing check starts the count again.
        b.record_check("198.18.0.2:1", Ok(()));
        assert!(!b.record_passive_reset("198.18.0.2:1", 10));
        for _ in 0..9 {
            b.record_passive_reset("198.18.0.2:1", 10);
        }
        assert_eq!(states(&b), [ServerState::Failed]);
    }

    #[test]
    fn round_robin_spreads_over_usable() {
        let b = balancer(
            &["198.18.0.2:1", "198.18.0.3:1", "198.18.0.4:1"],
            None,
            Policy::RoundRobin,
        );
        for s in b.server_specs() {
            b.record_check(&s, Ok(()));
            b.record_check(&s, Ok(()));
        }
        let firsts: std::collections::HashSet<String> =
            (0..6).map(|_| b.dial_order()[0].clone()).collect();
        assert_eq!(firsts.len(), 3);
    }

    #[test]
    fn state_file_round_trip_and_corrupt() {
        let dir = std::env::temp_dir().join(format!("lb-state-{}", std::process::id()));
        let path = dir.join("b.json");
        let st = StateFile {
            servers: vec!["198.18.0.2:1".into()],
            default: None,
        };
        write_state_file(&path, &st).unwrap();
        assert_eq!(read_state_file(&path).unwrap(), Some(st));
        std::fs::write(&path, b"{not json").unwrap();
        assert!(read_state_file(&path).unwrap_err().contains("corrupt"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
