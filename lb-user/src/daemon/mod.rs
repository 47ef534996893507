//! The daemon: builds the data path, balancers, listeners and health checks from a config,
//! keeps the control loop's heartbeat, reloads on SIGHUP ([`reload`]) and drains on SIGTERM.
//! The admin API sees it only through a [`Handle`].

mod adopt;
mod connect;
mod failfast;
mod handle;
pub mod ids;
mod listeners;
pub mod reload;
pub mod upgrade;

pub use handle::Handle;

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;
use arc_swap::ArcSwap;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{error, info, warn};

use crate::{
    addr::ServerAddr,
    balancer::{Balancer, KillReason, Observer, Options},
    config::{Config, DatapathMode, Forwarding, Overrides},
    datapath::Datapath,
    health::HealthService,
    metrics::{KillLabels, Metrics, ModeLabel},
    proxy::{self, PreDial, ProxyCtx},
};

/// The running daemon.
pub struct Daemon {
    config: ArcSwap<Config>,
    config_path: Option<PathBuf>,
    overrides: Overrides,
    /// Balancers, in config order.
    balancers: ArcSwap<Vec<Arc<Balancer>>>,
    /// Balancer ids earlier upgrades retired (see [`ids`]); handed on to the next lb.
    retired_ids: Vec<u32>,
    datapath: Option<Arc<Datapath>>,
    datapath_mode: DatapathMode,
    /// Why `auto` fell back to userspace, if it did.
    datapath_fallback: Option<String>,
    /// Each balancer's forwarding in effect (by name, decided at start) and, when it asked for
    /// `connect` and did not get it, why.
    forwarding: std::collections::HashMap<String, (Forwarding, Option<String>)>,
    metrics: Arc<Metrics>,
    health: Arc<HealthService>,
    proxy: Arc<ProxyCtx>,
    /// Control loop heartbeat, milliseconds since the Unix epoch.
    heartbeat_ms: AtomicU64,
    /// Set once the first round of checks of every balancer finished.
    first_checks_done: AtomicBool,
    /// Fired when shutdown starts.
    shutdown: CancellationToken,
    /// Fired when this process stops its background work: at shutdown (a child of `shutdown`)
    /// and once it handed over (see [`upgrade`]). Health checks, discovery, the connect-time
    /// table sync, the kernel's ring readers and the heartbeat end with it.
    background: CancellationToken,
    /// Background tasks (health loops and their checks, discovery, table sync, heartbeat).
    tasks: TaskTracker,
    listeners: Mutex<Vec<(SocketAddr, CancellationToken)>>,
    runtime: tokio::runtime::Handle,
    /// Fired once this process handed everything to a new lb (`lb upgrade`): it must exit.
    handed_over: CancellationToken,
    /// Whether the admin API accepts connections: closed while a hand-over is in flight (in
    /// both processes) and, after one, for good in the old process, so every admin request is
    /// answered by the process whose state it reads or changes. Connections wait in the shared
    /// listen backlog meanwhile.
    admin_gate: tokio::sync::watch::Sender<bool>,
}

/// What a new process takes over from the lb it replaces (see [`upgrade`]).
#[derive(Debug)]
pub struct Takeover {
    /// The kernel data path adopted from it, when it ran one.
    pub datapath: Option<Datapath>,
    /// Its listening sockets by address; these are served, never bound again.
    pub listeners: std::collections::HashMap<SocketAddr, std::os::fd::OwnedFd>,
    /// Each balancer's id and the retired ones (see [`ids::carried_over`]).
    pub ids: ids::Assigned,
    /// Fired when the old process let go: only then does this one accept, check, and write
    /// the kernel's tables. Its listener maps are written before, with
    /// [`Daemon::register_listeners`].
    pub go: CancellationToken,
}

impl std::fmt::Debug for Daemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Daemon")
            .field("datapath_mode", &self.datapath_mode)
            .finish_non_exhaustive()
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Attach the data path as `mode` asks.
///
/// # Errors
/// With `bpf`, the reason the kernel path could not be attached.
pub fn attach_datapath(
    cfg: &Config,
) -> anyhow::Result<(Option<Arc<Datapath>>, DatapathMode, Option<String>)> {
    let d = &cfg.datapath;
    let want_connect = cfg.balancers.iter().any(|b| cfg.wants_connect(b));
    // Pins first, in every mode that loads programs: a directory another lb holds, or whose
    // objects are of another layout, refuses the start (the pinned programs keep serving).
    let pins = match d.mode {
        DatapathMode::Userspace => None,
        _ if want_connect => connect::open_pins(d)?,
        _ => None,
    };
    match d.mode {
        DatapathMode::Userspace => Ok((None, DatapathMode::Userspace, None)),
        DatapathMode::Bpf => {
            let dp = Datapath::load(d, want_connect, pins)
                .context("--datapath bpf: kernel data path unavailable")?;
            Ok((Some(Arc::new(dp)), DatapathMode::Bpf, None))
        }
        DatapathMode::Auto => match Datapath::load(d, want_connect, pins) {
            Ok(dp) => Ok((Some(Arc::new(dp)), DatapathMode::Bpf, None)),
            // Pins this lb must not adopt keep serving; falling back would hide that.
            Err(e @ crate::datapath::DatapathError::Pins(_)) => Err(e.into()),
            Err(e) => {
                let reason = crate::errors::chain(&e);
                warn!(reason = %reason, "kernel data path unavailable; falling back to the userspace copy path");
                Ok((None, DatapathMode::Userspace, Some(reason)))
            }
        },
    }
}

/// The forwarding each balancer of `cfg` gets, and why it is not the one it asked for:
/// `connect` needs the kernel data path with the connect-time programs attached, and without
/// them the balancer uses splice (or copy), with one warning naming why; `auto` is connect-time
/// where it can be and splice otherwise, with one info line naming which and why.
fn decide_forwarding(
    cfg: &Config,
    datapath: Option<&Datapath>,
    fallback: Option<&str>,
) -> std::collections::HashMap<String, (Forwarding, Option<String>)> {
    let mut out = std::collections::HashMap::new();
    for b in &cfg.balancers {
        let want = cfg.forwarding_of(b);
        let unavailable = || match datapath {
            None => Some(format!(
                "the kernel data path is off ({})",
                fallback.unwrap_or("datapath.mode = userspace")
            )),
            Some(dp) => dp.connect_unavailable().map(str::to_string),
        };
        let why = match want {
            Forwarding::Splice => None,
            Forwarding::Connect => unavailable(),
            Forwarding::Auto if b.proxy.is_some() => Some(
                "the balancer dials its servers through an HTTP CONNECT proxy, which connect-time clients cannot use"
                    .to_string(),
            ),
            Forwarding::Auto => unavailable(),
        };
        let got = if want == Forwarding::Splice || why.is_some() {
            Forwarding::Splice
        } else {
            Forwarding::Connect
        };
        match (want, &why) {
            (Forwarding::Connect, Some(why)) => {
                warn!(balancer = %b.name, reason = %why, "forwarding = connect unavailable; this balancer forwards through lb (splice or copy)");
            }
            (Forwarding::Auto, Some(why)) => {
                info!(balancer = %b.name, reason = %why, "forwarding = auto: splice (through lb)");
            }
            (Forwarding::Auto, None) => {
                info!(balancer = %b.name, "forwarding = auto: connect-time (the kernel sends clients straight to the server)");
            }
            _ => {}
        }
        out.insert(b.name.clone(), (got, why));
    }
    out
}

/// Counts kills in `lb_connections_killed_total`, runs the node-wide kill and ends the
/// connect-time sockets of a killed server.
struct KillCounter {
    metrics: Arc<Metrics>,
    /// Per connect-mode balancer id, its table task's kill queue.
    direct: std::collections::HashMap<u32, tokio::sync::mpsc::UnboundedSender<connect::DirectKill>>,
}

impl Observer for KillCounter {
    fn killed(&self, balancer: &str, server: &ServerAddr, reason: KillReason, n: usize) {
        self.metrics
            .connections_killed
            .get_or_create(&KillLabels {
                balancer: balancer.to_string(),
                server: server.to_string(),
                reason: reason.label().into(),
            })
            .inc_by(n as u64);
    }

    fn node_kill(&self, server: &ServerAddr) {
        // A name pinned to one address: only that address's sockets.
        let target = server
            .socket_addr()
            .map_or_else(|| server.authority(), |sa| sa.to_string());
        crate::kill::spawn_node_kill(target);
    }

    fn server_killed(&self, _balancer: &str, id: u32, server: &ServerAddr, reason: KillReason) {
        if let Some(tx) = self.direct.get(&id) {
            let _ = tx.send((server.clone(), reason));
        }
    }
}

impl Daemon {
    /// Attach the data path, bind every listener, start the health checks and the heartbeat.
    /// Must run on the runtime the daemon lives on.
    ///
    /// # Errors
    /// Data path (`bpf` mode) or listener bind failures; nothing is left running then.
    pub async fn start(
        cfg: Config,
        config_path: Option<PathBuf>,
        overrides: Overrides,
    ) -> anyhow::Result<Arc<Daemon>> {
        Daemon::start_with(cfg, config_path, overrides, None).await
    }

    /// [`Daemon::start`], or with `takeover` the daemon that replaces a running lb: its data
    /// path and listeners are used as they are, and nothing is served or checked before
    /// `takeover.go` fires.
    ///
    /// # Errors
    /// As [`Daemon::start`].
    pub async fn start_with(
        cfg: Config,
        config_path: Option<PathBuf>,
        overrides: Overrides,
        takeover: Option<Takeover>,
    ) -> anyhow::Result<Arc<Daemon>> {
        let names: Vec<&str> = cfg.balancers.iter().map(|b| b.name.as_str()).collect();
        let (go, mut inherited, adopted, ids) = match takeover {
            Some(t) => (t.go, t.listeners, Some(t.datapath), t.ids),
            None => {
                let go = CancellationToken::new();
                go.cancel();
                (
                    go,
                    std::collections::HashMap::new(),
                    None,
                    ids::fresh(&names),
                )
            }
        };
        let id_of = |name: &str| ids.ids.get(name).copied().unwrap_or_default();
        let taking_over = adopted.is_some();
        let (datapath, datapath_mode, datapath_fallback) = match adopted {
            Some(Some(dp)) => (Some(Arc::new(dp)), DatapathMode::Bpf, None),
            Some(None) => (None, DatapathMode::Userspace, None),
            None => attach_datapath(&cfg)?,
        };
        let metrics = Arc::new(Metrics::with_compat(cfg.metrics.compat));
        metrics
            .datapath_info
            .get_or_create(&ModeLabel {
                mode: datapath_mode.to_string(),
            })
            .set(1);
        let tasks = TaskTracker::new();
        let health = HealthService::new(metrics.clone(), tasks.clone());
        let pre_dial: PreDial = {
            let health = health.clone();
            Arc::new(move |b: Arc<Balancer>, server: ServerAddr| {
                let health = health.clone();
                Box::pin(async move { health.before_dial(&b, &server).await })
            })
        };
        let proxy_ctx = Arc::new(ProxyCtx {
            datapath: datapath.clone(),
            copy_buffer_bytes: cfg.datapath.copy_buffer_bytes,
            metrics: metrics.clone(),
            pre_dial: Some(pre_dial),
            tasks: TaskTracker::new(),
            freezer: proxy::Freezer::default(),
            limits: proxy::Limits::default(),
        });
        // A dial or a check that lands on one of these is a loop.
        crate::net::set_own_listeners(
            &cfg.balancers
                .iter()
                .flat_map(|b| b.listen.iter().copied())
                .collect::<Vec<_>>(),
        );
        let forwarding = decide_forwarding(&cfg, datapath.as_deref(), datapath_fallback.as_deref());
        for b in &cfg.balancers {
            let f = forwarding.get(&b.name).map_or(Forwarding::Splice, |f| f.0);
            metrics
                .balancer_forwarding
                .get_or_create(&crate::metrics::ForwardingLabels {
                    balancer: b.name.clone(),
                    forwarding: f.to_string(),
                })
                .set(1);
        }
        let connect_ids: std::collections::HashSet<u32> = cfg
            .balancers
            .iter()
            .filter(|b| {
                forwarding
                    .get(&b.name)
                    .is_some_and(|f| f.0 == Forwarding::Connect)
            })
            .map(|b| id_of(&b.name))
            .collect();
        let mut direct = std::collections::HashMap::new();
        let mut direct_rx = std::collections::HashMap::new();
        for id in &connect_ids {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            direct.insert(*id, tx);
            direct_rx.insert(*id, rx);
        }
        let observer: Arc<dyn Observer> = Arc::new(KillCounter {
            metrics: metrics.clone(),
            direct,
        });
        let balancers: Vec<Arc<Balancer>> = cfg
            .balancers
            .iter()
            .map(|b| {
                let opts = Options {
                    observer: observer.clone(),
                    seed: None,
                };
                Balancer::build(id_of(&b.name), b.clone(), opts)
            })
            .collect();
        let shutdown = CancellationToken::new();
        let daemon = Arc::new(Daemon {
            config: ArcSwap::from_pointee(cfg),
            config_path,
            overrides,
            balancers: ArcSwap::from_pointee(balancers.clone()),
            retired_ids: ids.retired.clone(),
            datapath,
            datapath_mode,
            datapath_fallback,
            forwarding,
            metrics,
            health,
            proxy: proxy_ctx.clone(),
            heartbeat_ms: AtomicU64::new(now_ms()),
            first_checks_done: AtomicBool::new(false),
            background: shutdown.child_token(),
            shutdown,
            tasks: tasks.clone(),
            listeners: Mutex::new(Vec::new()),
            runtime: tokio::runtime::Handle::current(),
            handed_over: CancellationToken::new(),
            admin_gate: tokio::sync::watch::Sender::new(!taking_over),
        });
        if taking_over {
            // The new process's admin API opens once the state is taken over (Done).
            let (d, go) = (daemon.clone(), go.clone());
            tokio::spawn(async move {
                go.cancelled().await;
                d.admin_gate.send_replace(true);
            });
        }

        // Listeners first: a bind failure is fatal and nothing else has started.
        let bound = listeners::bind(&balancers, &mut inherited)?;
        // A new process writes its listener maps once the old one let go (they name balancer
        // ids, and the old one serves on with its own if the hand-over fails).
        if !taking_over {
            daemon.register_listeners()?;
        }
        daemon.serve(bound, &go);
        if let Some(dp) = &daemon.datapath {
            for b in &balancers {
                if let Some(rx) = direct_rx.remove(&b.id) {
                    let weak = Arc::downgrade(&daemon);
                    let default: failfast::DefaultConfig = Arc::new(move || {
                        weak.upgrade()
                            .map(|d| d.config.load().datapath.fail_fast)
                            .unwrap_or_default()
                    });
                    let sync = connect::sync_table(
                        b.clone(),
                        dp.clone(),
                        daemon.metrics.clone(),
                        rx,
                        (daemon.background.clone(), default),
                    );
                    let go = go.clone();
                    tasks.spawn(async move {
                        go.cancelled().await;
                        sync.await;
                    });
                }
            }
            if taking_over {
                // The old process reads the rings until it lets go.
                let (dp, daemon2, go, want_passive) = (
                    dp.clone(),
                    daemon.clone(),
                    go.clone(),
                    !connect_ids.is_empty(),
                );
                tasks.spawn(async move {
                    go.cancelled().await;
                    let mut started = dp.start_refresher(daemon2.background.clone());
                    if want_passive && started.is_ok() {
                        started = dp.start_passive(
                            daemon2.background.clone(),
                            connect::passive_sink(&daemon2),
                        );
                    }
                    if let Err(e) = started {
                        error!(error = %e, "cannot start the kernel data path's readers");
                    }
                });
            } else {
                dp.start_refresher(daemon.background.clone())?;
                if !connect_ids.is_empty() {
                    dp.start_passive(daemon.background.clone(), connect::passive_sink(&daemon))?;
                }
                dp.start_kernel_log(daemon.background.clone());
            }
        }

        // First round of checks, then the loops. Balancers with `health.loop = false` get no
        // round: their checks run only before dials and on `/check`.
        {
            let daemon = daemon.clone();
            let go = go.clone();
            tasks.spawn(async move {
                go.cancelled().await;
                let bs = daemon.balancers.load_full();
                // A new process took the old one's results: the loops go on from them.
                if !taking_over {
                    let looping = bs.iter().filter(|b| b.config().health.loop_enabled);
                    futures::future::join_all(looping.map(|b| daemon.health.check_all(b))).await;
                }
                daemon.first_checks_done.store(true, Ordering::Relaxed);
                for b in bs.iter() {
                    daemon.health.start(b.clone(), daemon.background.clone());
                }
            });
        }
        let weak = Arc::downgrade(&daemon);
        let resolving: crate::discovery::names::Settings = Arc::new(move |b| {
            weak.upgrade()
                .map(|d| {
                    let cfg = d.config.load();
                    (cfg.resolve_of(b), cfg.dns.clone())
                })
                .unwrap_or_default()
        });
        for b in &balancers {
            crate::discovery::spawn(
                b.clone(),
                daemon.metrics.clone(),
                &tasks,
                daemon.background.clone(),
            );
            crate::discovery::names::spawn(
                b.clone(),
                resolving.clone(),
                &tasks,
                daemon.background.clone(),
            );
        }
        // Heartbeat of the control loop, and (once this process serves) of the connect
        // programs, which stop rewriting when it is older than `datapath.orphan_timeout`.
        {
            let daemon = daemon.clone();
            let go = go.clone();
            tasks.spawn(async move {
                loop {
                    daemon.heartbeat_ms.store(now_ms(), Ordering::Relaxed);
                    if go.is_cancelled()
                        && let Some(dp) = &daemon.datapath
                        && let Err(e) = dp.heartbeat()
                    {
                        warn!(error = %crate::errors::chain(&e), "cannot write the connect-time heartbeat");
                    }
                    tokio::select! {
                        () = daemon.background.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_millis(500)) => {}
                    }
                }
            });
        }
        Ok(daemon)
    }

    /// Find a balancer by name.
    pub fn balancer(&self, name: &str) -> Option<Arc<Balancer>> {
        self.balancers
            .load()
            .iter()
            .find(|b| b.name == name)
            .cloned()
    }

    /// Serve until SIGTERM or SIGINT (SIGHUP reloads), then drain and stop.
    ///
    /// # Errors
    /// The signal handlers could not be installed.
    pub async fn run_until_signalled(self: &Arc<Self>) -> anyhow::Result<()> {
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let mut hup = signal(SignalKind::hangup())?;
        let mut usr2 = signal(SignalKind::user_defined2())?;
        loop {
            tokio::select! {
                _ = term.recv() => break,
                _ = int.recv() => break,
                _ = hup.recv() => {
                    reload::reload(self, self.config_path.as_deref(), &self.overrides);
                }
                _ = usr2.recv() => {
                    let d = self.clone();
                    // A failure is logged by the hand-over; the loop below sees a success.
                    tokio::spawn(async move {
                        if let Err(e @ upgrade::UpgradeError::Refused(_)) = upgrade::upgrade(&d).await {
                            warn!(reason = %e, "SIGUSR2: not upgrading");
                        }
                    });
                }
                () = self.handed_over.cancelled() => {
                    // Let the admin API answer `lb upgrade` before the process ends.
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    return Ok(());
                }
            }
        }
        self.shutdown().await;
        Ok(())
    }

    /// Stop accepting, let connections finish for `shutdown_grace`, reset the rest, stop tasks.
    pub async fn shutdown(&self) {
        let grace = self.config.load().shutdown_grace.0;
        info!(grace = ?grace, "shutting down: no new connections, draining");
        for (_, stop) in self
            .listeners
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            stop.cancel();
        }
        crate::handover::forget_proxy_listeners();
        self.proxy.tasks.close();
        let start = Instant::now();
        if tokio::time::timeout(grace, self.proxy.tasks.wait())
            .await
            .is_err()
        {
            let killed: usize = self
                .balancers
                .load()
                .iter()
                .map(|b| b.kill_all(KillReason::Shutdown))
                .sum();
            warn!(killed, "grace period over; reset the remaining connections");
            if tokio::time::timeout(Duration::from_secs(5), self.proxy.tasks.wait())
                .await
                .is_err()
            {
                error!("connections did not end after reset");
            }
        }
        self.shutdown.cancel();
        self.tasks.close();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.tasks.wait()).await;
        match self.datapath.as_ref().and_then(|d| d.pins_status()) {
            Some(p) => {
                info!(elapsed = ?start.elapsed(), pin_dir = %p.dir.display(), "stopped; the splice's programs detach as lb exits, the pinned connect-time programs serve on (lb cleanup removes them)")
            }
            None => {
                info!(elapsed = ?start.elapsed(), "stopped; kernel programs detach as lb exits")
            }
        }
    }
}
