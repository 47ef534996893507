//! Balancer: one server set with K3s states ([`state`]), the selection policy ([`select`]), the
//! per-server connection registry ([`registry`]), the state file ([`state_file`]), its kills
//! ([`kills`]) and the passive signals it counts ([`passive`]).
//!
//! All of a balancer's mutable state sits behind one lock that is never held across an
//! `.await` or a kill: transitions return what to kill, and the kills run after the lock is
//! released. The config is an `ArcSwap` snapshot, so readers never lock.

mod handover;
mod kills;
mod names;
mod passive;
mod registry;
mod select;
mod set;
pub mod state;
pub mod state_file;
mod status;

use std::{
    fmt,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::{Instant, SystemTime},
};

use arc_swap::ArcSwap;
use rand::{SeedableRng as _, rngs::StdRng};
use tracing::{debug, info, warn};

pub use self::{
    names::NameStatus,
    registry::ConnGuard,
    state::{Failure, Hold, KillReason, PREFERRED_DURATION, ServerState},
    status::{CheckOutcome, DiscoveryStatus, ServerStatus},
};
use self::{
    registry::Registry,
    state::Server,
    state_file::{ServerSet, StateFile},
};
pub use crate::addr::{MAX_SERVERS, SetError};
use crate::{
    addr::{ServerAddr, validate_set},
    config::{BalancerConfig, Policy},
    kill::OwnSocket,
};

/// What a balancer reports as it works; the daemon counts kills in metrics and runs the
/// node-wide kill. Given at construction.
pub trait Observer: Send + Sync {
    /// `n` connections of `server` were killed for `reason`.
    fn killed(&self, balancer: &str, server: &ServerAddr, reason: KillReason, n: usize);
    /// `kill_scope = "node"`: end every socket on the node to `server` (lb's own are already
    /// killed). Called without locks held; must not block.
    fn node_kill(&self, server: &ServerAddr);
    /// The connections of `server` were ended for `reason` (not at shutdown): the daemon also
    /// ends the connect-time sockets the kernel sent to it, which lb's registry does not hold.
    /// Called without locks held; must not block.
    fn server_killed(&self, _balancer: &str, _id: u32, _server: &ServerAddr, _reason: KillReason) {}
}

/// An observer that does nothing (tests, tools).
#[derive(Debug, Default)]
pub struct NoObserver;

impl Observer for NoObserver {
    fn killed(&self, _: &str, _: &ServerAddr, _: KillReason, _: usize) {}
    fn node_kill(&self, _: &ServerAddr) {}
}

/// How a balancer is built beyond its config.
pub struct Options {
    /// Told of kills.
    pub observer: Arc<dyn Observer>,
    /// Seed of the selection RNG (`random`, `least-connections`); `None`: from the OS.
    pub seed: Option<u64>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            observer: Arc::new(NoObserver),
            seed: None,
        }
    }
}

/// One balancer: name, listeners, server set, policy and the connection registry.
pub struct Balancer {
    /// Name from the config.
    pub name: String,
    /// Id used as the kernel's balancer index.
    pub id: u32,
    cfg: ArcSwap<BalancerConfig>,
    inner: Mutex<Inner>,
    next_conn: AtomicU64,
    observer: Arc<dyn Observer>,
    discovery: Mutex<Option<DiscoveryStatus>>,
    /// What the resolution of each host name of the set last did (see [`names`]).
    names: Mutex<Vec<NameStatus>>,
    /// One state file writer at a time; holds whether the last write failed.
    state_file_turn: Mutex<bool>,
    /// Per server, the connect round trip of its last passing check (see [`Balancer::rtt`]).
    rtts: Mutex<std::collections::HashMap<ServerAddr, std::time::Duration>>,
    /// Bumped on every state change and config replacement; the health scheduler, discovery
    /// and admin watch it.
    pub changed: tokio::sync::watch::Sender<u64>,
}

impl fmt::Debug for Balancer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Balancer")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

struct Inner {
    servers: Vec<Server>,
    /// The set as given (names, not their addresses), which `servers` stands for.
    set: ServerSet,
    conns: Registry,
    rr: usize,
    rng: StdRng,
}

impl Inner {
    fn index(&self, addr: &ServerAddr) -> Option<usize> {
        self.servers.iter().position(|s| s.addr == *addr)
    }

    /// The set as configured: its entries (names, not their addresses), in order.
    fn set(&self) -> ServerSet {
        self.set.clone()
    }
}

impl Balancer {
    /// Build from config with no observer and an OS-seeded RNG; see [`Balancer::build`].
    pub fn new(id: u32, cfg: BalancerConfig) -> Arc<Balancer> {
        Balancer::build(id, cfg, Options::default())
    }

    /// Build from config. The server set comes from the state file when the config's list is
    /// unchanged since it was written, else from the config ([`state_file`]'s rule); the file is
    /// rewritten when it does not say what runs.
    pub fn build(id: u32, cfg: BalancerConfig, opts: Options) -> Arc<Balancer> {
        let set = state_file::initial_set(&cfg);
        let on_disk = cfg
            .state_file
            .as_deref()
            .and_then(|p| state_file::read(p).ok().flatten());
        let rng = opts
            .seed
            .map_or_else(StdRng::from_entropy, StdRng::seed_from_u64);
        let b = Arc::new(Balancer {
            name: cfg.name.clone(),
            id,
            cfg: ArcSwap::from_pointee(cfg),
            inner: Mutex::new(Inner {
                servers: set::build_servers(&set),
                set,
                conns: Registry::default(),
                rr: 0,
                rng,
            }),
            next_conn: AtomicU64::new(1),
            observer: opts.observer,
            discovery: Mutex::new(None),
            names: Mutex::new(Vec::new()),
            state_file_turn: Mutex::new(false),
            rtts: Mutex::new(std::collections::HashMap::new()),
            changed: tokio::sync::watch::channel(0).0,
        });
        if on_disk.as_ref() != Some(&b.state()) {
            b.write_state_file();
        }
        b
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The balancer's config: a snapshot, replaced whole on reload (readers never lock).
    pub fn config(&self) -> Arc<BalancerConfig> {
        self.cfg.load_full()
    }

    /// Replace the config (SIGHUP). The file's server list is applied only when it differs
    /// from the one in force before ([`state_file`]'s rule): a set changed through the API
    /// stays when the reload touched other keys. Returns whether the set changed.
    ///
    /// # Errors
    /// As [`Balancer::set_servers`]; a refused config leaves the old one whole.
    pub fn replace_config(self: &Arc<Self>, cfg: BalancerConfig) -> Result<bool, SetError> {
        let new_set = ServerSet::of_config(&cfg);
        // With discovery the config's list only seeds the set at start: the source owns it,
        // so a reload never swaps a discovered set for the seed (the source runs again when
        // woken, if its keys changed).
        let has_list = !new_set.servers.is_empty() && cfg.discovery.is_none();
        if !has_list && cfg.discovery.is_none() {
            return Err(SetError::Empty);
        }
        if has_list {
            validate_set(&new_set.servers, new_set.default.as_ref(), &cfg.listen)?;
        }
        let list_changed = ServerSet::of_config(&self.config()) != new_set;
        self.cfg.store(Arc::new(cfg));
        let changed = if list_changed && has_list {
            self.set_servers(&new_set.servers, new_set.default.as_ref())?
        } else {
            // The discovery task follows the new config when woken.
            self.bump();
            false
        };
        // Whether or not the running set moved, the file now records the config it runs under
        // (a list edited to what the API had already set must still count as applied).
        self.write_state_file();
        Ok(changed)
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v += 1);
    }

    /// Server addresses in set order (the default last if it is only STANDBY).
    pub fn server_specs(&self) -> Vec<ServerAddr> {
        self.lock()
            .servers
            .iter()
            .filter(|s| s.state != ServerState::Invalid)
            .map(|s| s.addr.clone())
            .collect()
    }

    /// Status of every server.
    pub fn status(&self) -> Vec<ServerStatus> {
        let inner = self.lock();
        inner
            .servers
            .iter()
            .map(|s| ServerStatus {
                address: s.addr.clone(),
                state: s.state,
                default: s.is_default,
                hold: s.hold,
                connections: inner.conns.count(&s.addr),
                consecutive_failures: s.consecutive_failures,
                last_check: s
                    .last_check
                    .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
                    .map(|d| d.as_secs_f64()),
                last_error: s.last_error.clone(),
                suspect: false,
            })
            .collect()
    }

    /// True when some server could take a connection now (see `Server::can_serve`: passing
    /// checks, or RECOVERING/STANDBY whose last check passed; with `health.loop = false` also
    /// an unchecked one). A FAILED set with a failing default outside it is not usable.
    pub fn has_usable_server(&self) -> bool {
        let loop_enabled = self.cfg.load().health.loop_enabled;
        self.lock()
            .servers
            .iter()
            .any(|s| s.can_serve(loop_enabled))
    }

    /// `server`'s state and hold, `None` when it is not in the balancer (any more).
    pub fn dial_state(&self, server: &ServerAddr) -> Option<(ServerState, Hold)> {
        let inner = self.lock();
        inner
            .index(server)
            .map(|i| (inner.servers[i].state, inner.servers[i].hold))
    }

    /// Whether every server a dial could use is FAILED (a STANDBY default whose last check
    /// failed counts as failed): the case `all_failed` decides.
    pub fn all_failed(&self) -> bool {
        let inner = self.lock();
        let mut candidates = inner
            .servers
            .iter()
            .filter(|s| s.hold == Hold::None && s.state != ServerState::Invalid)
            .peekable();
        candidates.peek().is_some()
            && candidates.all(|s| {
                s.state == ServerState::Failed
                    || (s.state == ServerState::Standby && s.consecutive_failures > 0)
            })
    }

    /// When `server` was last checked (`None`: never, or not in the set).
    pub fn last_checked(&self, server: &ServerAddr) -> Option<Instant> {
        let inner = self.lock();
        inner
            .index(server)
            .and_then(|i| inner.servers[i].last_check_at)
    }

    /// Servers to dial, best first (see [`select`]).
    pub fn dial_order(&self) -> Vec<ServerAddr> {
        let policy = self.cfg.load().policy;
        let mut guard = self.lock();
        let Inner {
            servers,
            conns,
            rr,
            rng,
            set: _,
        } = &mut *guard;
        select::dial_order(servers, |a| conns.count(a), policy, rr, rng)
    }

    /// The servers a connect-time table holds, best first (see [`select::connect_order`]).
    /// Under `failover`, once no server is UNCHECKED or RECOVERING (every first verdict is in),
    /// the first one is also marked as dialed (HEALTHY/PREFERRED → ACTIVE): connects now go to
    /// it, so it keeps them the way a dialed server keeps its clients (and `failback = false`
    /// holds). Before that, whichever server passed its `rise` checks first would become
    /// ACTIVE and keep the clients from the preferred one, which a first start never fails
    /// back to (only a recovery from FAILED does).
    pub fn connect_table(self: &Arc<Self>) -> Vec<ServerAddr> {
        let policy = self.cfg.load().policy;
        let (order, settled) = {
            let inner = self.lock();
            let settled = !inner
                .servers
                .iter()
                .any(|s| matches!(s.state, ServerState::Unchecked | ServerState::Recovering));
            (select::connect_order(&inner.servers, policy), settled)
        };
        if policy == Policy::Failover
            && settled
            && let Some(first) = order.first()
        {
            self.record_dial(first, Ok(()));
        }
        order
    }

    /// The server of this balancer at `addr` (a name's server pinned to that address, or an
    /// address server), for signals that know only the address (connect-time sockets).
    pub fn server_at(&self, addr: std::net::SocketAddr) -> Option<ServerAddr> {
        self.lock()
            .servers
            .iter()
            .find(|s| s.addr.socket_addr() == Some(addr))
            .map(|s| s.addr.clone())
    }

    /// Record a dial result. Success: HEALTHY/PREFERRED → ACTIVE (under `failover` the previous
    /// ACTIVE server becomes HEALTHY). Failure: counts as a failed check when `passive`.
    pub fn record_dial(self: &Arc<Self>, server: &ServerAddr, result: Result<(), String>) {
        let (policy, passive) = {
            let cfg = self.cfg.load();
            (cfg.policy, cfg.health.passive)
        };
        match result {
            Ok(()) => {
                let changed = {
                    let mut inner = self.lock();
                    let Some(idx) = inner.index(server) else {
                        return;
                    };
                    state::on_dial_ok(&self.name, &mut inner.servers, idx, policy)
                };
                if changed {
                    self.bump();
                }
            }
            Err(e) if passive => {
                self.record_check(server, Err(Failure::Dial(e)));
            }
            Err(_) => {}
        }
    }

    /// Record a health check result and apply `rise`/`fall`. A server that turns FAILED has its
    /// connections handled per `on_unhealthy`; a recovery to PREFERRED fails back (kills
    /// connections on less preferred ACTIVE servers) under `failover` with `failback = true`.
    pub fn record_check(
        self: &Arc<Self>,
        server: &ServerAddr,
        result: Result<(), Failure>,
    ) -> CheckOutcome {
        let cfg = self.config();
        let mut out = CheckOutcome::default();
        let fx = {
            let mut inner = self.lock();
            let Some(idx) = inner.index(server) else {
                return out;
            };
            out.from = Some(inner.servers[idx].state);
            let has_conns = inner.conns.count(server) > 0;
            let fx = state::on_check(
                &self.name,
                &mut inner.servers,
                idx,
                result.as_ref().map(|_| ()),
                &cfg,
                has_conns,
            );
            out.to = Some(inner.servers[idx].state);
            fx
        };
        out.killed = self.apply(fx);
        if out.from != out.to {
            // The state file holds the set and the default, which checks never change.
            self.bump();
        }
        out
    }

    /// The servers `spec` names, normalised: one address, or every address of a name.
    fn known(&self, spec: &str) -> Result<Vec<ServerAddr>, SetError> {
        let unknown = || SetError::UnknownServer(spec.to_string());
        let addr = ServerAddr::parse(spec).map_err(|_| unknown())?;
        let found: Vec<ServerAddr> = self
            .lock()
            .servers
            .iter()
            .filter(|s| s.addr == addr || s.origin == addr)
            .map(|s| s.addr.clone())
            .collect();
        if found.is_empty() {
            return Err(unknown());
        }
        Ok(found)
    }

    /// Total open connections.
    pub fn connection_count(&self) -> usize {
        self.lock().conns.total()
    }

    /// Set an operator hold on the server `spec` names: `Drain` (no new connections),
    /// `Disabled` (no new, existing killed), `None` (enable). Returns how many were killed.
    ///
    /// # Errors
    /// [`SetError::UnknownServer`].
    pub fn set_hold(self: &Arc<Self>, spec: &str, hold: Hold) -> Result<usize, SetError> {
        let mut killed = 0;
        for server in self.known(spec)? {
            let taken = {
                let mut inner = self.lock();
                let Some(idx) = inner.index(&server) else {
                    continue;
                };
                let s = &mut inner.servers[idx];
                info!(balancer = %self.name, %server, from = %s.hold, to = %hold, "server hold changed");
                s.hold = hold;
                if hold == Hold::Disabled {
                    inner.conns.take(&server)
                } else {
                    Vec::new()
                }
            };
            killed += self.kill_entries(&server, taken, KillReason::Admin);
        }
        self.bump();
        Ok(killed)
    }

    /// The set as given (entries and default, names not expanded): what `PUT` replaces.
    pub fn server_set(&self) -> ServerSet {
        self.lock().set()
    }

    /// What the discovery source last did; `None` without discovery.
    pub fn discovery_status(&self) -> Option<DiscoveryStatus> {
        self.discovery
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Update the discovery status (the discovery task, after each run).
    pub fn record_discovery(&self, f: impl FnOnce(&mut Option<DiscoveryStatus>)) {
        f(&mut self.discovery.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// The default server, if any.
    pub fn default_server(&self) -> Option<ServerAddr> {
        self.lock().set().default
    }

    /// Register a new connection to `server`; `client` is lb's accepted socket of it, by its
    /// addresses (local, peer), which a kill destroys in the kernel (`None`: the connection's
    /// task ends it alone). The guard unregisters on drop. A server no longer in the balancer
    /// gets a guard that is already cancelled.
    pub fn register(self: &Arc<Self>, server: &ServerAddr, client: Option<OwnSocket>) -> ConnGuard {
        let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let mut inner = self.lock();
        let (cancel, reason) = if inner.index(server).is_some() {
            inner.conns.insert(server, id, client)
        } else {
            let c = tokio_util::sync::CancellationToken::new();
            c.cancel();
            (c, Arc::new(Mutex::new(None)))
        };
        drop(inner);
        ConnGuard {
            cancel,
            reason,
            balancer: self.clone(),
            server: server.clone(),
            id,
        }
    }

    fn unregister(&self, server: &ServerAddr, id: u64) {
        self.lock().conns.remove(server, id);
    }

    /// The set and default as the state file records them.
    fn state(&self) -> StateFile {
        let set = self.lock().set();
        StateFile {
            servers: set.servers,
            default: set.default,
            configured: Some(ServerSet::of_config(&self.config())),
        }
    }

    fn write_state_file(&self) {
        let Some(path) = self.cfg.load().state_file.clone() else {
            return;
        };
        // One writer at a time, each writing what holds when it gets the turn: two changes at
        // once (a reload and a discovery run) must neither share a temporary file nor let the
        // older set land last.
        // The turn also holds whether the last write failed: a full or read-only disk is
        // reported once, not at every change, and its end once too.
        let mut failing = self
            .state_file_turn
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match state_file::write(&path, &self.state()) {
            Err(e) if !*failing => {
                *failing = true;
                warn!(balancer = %self.name, file = %path.display(), error = %e, "cannot write state file; the previous one is kept and lb keeps serving (logged once until a write succeeds)");
            }
            Err(e) => {
                debug!(balancer = %self.name, file = %path.display(), error = %e, "cannot write state file");
            }
            Ok(()) if *failing => {
                *failing = false;
                info!(balancer = %self.name, file = %path.display(), "state file written again");
            }
            Ok(()) => {}
        }
    }
}

#[cfg(test)]
mod tests;
