//! Starting the daemon, in steps: where the start comes from (fresh, or taking over a running
//! lb), the parts built from the config (data path, metrics, forwarding, balancers), then what is
//! spawned around them (listeners, connect-time tables, the kernel's readers, checks, discovery,
//! the heartbeat).

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
    os::fd::OwnedFd,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use anyhow::Context as _;
use arc_swap::ArcSwap;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{error, info, warn};

use super::{Daemon, Takeover, ids, listeners, now_ms};
use crate::{
    addr::ServerAddr,
    balancer::{Balancer, KillReason, Observer, Options},
    config::{Config, DatapathMode, Forwarding, Overrides},
    connect::{self, KillQueues, KillReceivers},
    datapath::{Datapath, FallbackReason},
    health::HealthService,
    metrics::{KillLabels, Metrics, ModeLabel, ReasonLabel},
    proxy::{self, PreDial, ProxyCtx},
};

/// Where a start comes from: a fresh process, or one taking over a running lb.
struct Origin {
    /// Fired when this process may serve (at once for a fresh one).
    go: CancellationToken,
    /// Listening sockets taken over, by address.
    inherited: HashMap<SocketAddr, OwnedFd>,
    /// The kernel data path taken over (`Some(None)`: the old lb ran without one); `None` for a
    /// fresh start, which attaches its own.
    adopted: Option<Option<Datapath>>,
    /// Balancer ids.
    ids: ids::Assigned,
}

impl Origin {
    fn new(takeover: Option<Takeover>, cfg: &Config) -> Origin {
        match takeover {
            Some(t) => Origin {
                go: t.go,
                inherited: t.listeners,
                adopted: Some(t.datapath),
                ids: t.ids,
            },
            None => {
                let names: Vec<&str> = cfg.balancers.iter().map(|b| b.name.as_str()).collect();
                let go = CancellationToken::new();
                go.cancel();
                Origin {
                    go,
                    inherited: HashMap::new(),
                    adopted: None,
                    ids: ids::fresh(&names),
                }
            }
        }
    }

    /// A fresh start whose data path adopted connect-time pins: the ids the earlier lb gave,
    /// by balancer name (see [`ids::from_pins`]), instead of config positions, so the pinned
    /// listeners, tables, counts and socket records stay with their balancers.
    fn keep_pinned_ids(&mut self, cfg: &Config, dp: &Datapath) {
        let pinned = dp.pinned_balancer_ids();
        if pinned.is_empty() {
            return;
        }
        let names: Vec<&str> = cfg.balancers.iter().map(|b| b.name.as_str()).collect();
        match ids::from_pins(&names, &pinned, |id| !dp.connect_counts(id).is_empty()) {
            Ok(assigned) => {
                info!(ids = ?assigned.ids, retired = ?assigned.retired, "balancer ids kept from the pinned connect-time maps");
                self.ids = assigned;
            }
            Err(e) => {
                warn!(error = %e, "balancer ids numbered afresh: the pinned maps' entries are rewritten as each balancer registers");
            }
        }
    }

    fn id_of(&self, name: &str) -> u32 {
        self.ids.ids.get(name).copied().unwrap_or_default()
    }
}

/// What [`attach_datapath`] gives: the kernel data path when it runs, the mode in effect, and
/// why `auto` fell back to userspace when it did.
type Attached = (
    Option<Arc<Datapath>>,
    DatapathMode,
    Option<(FallbackReason, String)>,
);

/// Attach the data path as `mode` asks.
///
/// # Errors
/// With `bpf`, the reason the kernel path could not be attached.
fn attach_datapath(cfg: &Config) -> anyhow::Result<Attached> {
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
                let (kind, reason) = (e.fallback_reason(), crate::errors::chain(&e));
                warn!(reason = %reason, kind = %kind, "kernel data path unavailable; falling back to the userspace copy path");
                Ok((None, DatapathMode::Userspace, Some((kind, reason))))
            }
        },
    }
}

/// What a balancer's kill sets off outside it: counts it in `lb_connections_killed_total`, runs
/// the node-wide kill, and hands a killed server to its connect-time table task, which ends the
/// sockets the kernel sent there.
struct KillObserver {
    metrics: Arc<Metrics>,
    /// Per connect-mode balancer id, its table task's kill queue.
    direct: KillQueues,
}

impl Observer for KillObserver {
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
        self.direct.send(id, server, reason);
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
        let mut origin = Origin::new(takeover, &cfg);
        let taking_over = origin.adopted.is_some();
        let (daemon, balancers, mut kills) =
            Daemon::build(cfg, config_path, overrides, &mut origin)?;
        let go = origin.go.clone();
        if taking_over {
            // The new process's admin API opens once the state is taken over (Done).
            let (d, go) = (daemon.clone(), go.clone());
            tokio::spawn(async move {
                go.cancelled().await;
                d.admin_gate.send_replace(true);
            });
        }
        if !taking_over {
            daemon.hold_out_left_out();
        }
        // Listeners first: a bind failure is fatal and nothing else has started.
        let bound = listeners::bind(&balancers, &mut origin.inherited)?;
        // A new process writes its listener maps once the old one let go (they name balancer
        // ids, and the old one serves on with its own if the hand-over fails).
        if !taking_over {
            daemon.register_listeners()?;
        }
        daemon.serve(bound, &go);
        if let Some(dp) = &daemon.datapath {
            daemon.spawn_connect_tables(dp, &balancers, &mut kills, &go);
            daemon.start_kernel_readers(dp, &go, taking_over)?;
        }
        if !taking_over {
            daemon.spawn_takeover(&go);
            let connect_running = daemon
                .forwarding
                .values()
                .any(|(f, _)| *f == Forwarding::Connect);
            super::pins::remove_unwanted(&daemon.config.load(), connect_running);
        }
        daemon.spawn_first_checks(&go, taking_over);
        daemon.spawn_discovery(&balancers);
        daemon.spawn_heartbeat(&go);
        Ok(daemon)
    }

    /// The parts built from `cfg` before anything is served: the data path (attached, or the
    /// one taken over), metrics, health service, proxy context, each balancer's forwarding and
    /// the balancers themselves.
    fn build(
        cfg: Config,
        config_path: Option<PathBuf>,
        overrides: Overrides,
        origin: &mut Origin,
    ) -> anyhow::Result<(Arc<Daemon>, Vec<Arc<Balancer>>, KillReceivers)> {
        let taking_over = origin.adopted.is_some();
        let (datapath, datapath_mode, datapath_fallback) = match origin.adopted.take() {
            Some(Some(dp)) => (Some(Arc::new(dp)), DatapathMode::Bpf, None),
            Some(None) => (None, DatapathMode::Userspace, None),
            None => attach_datapath(&cfg)?,
        };
        if !taking_over && let Some(dp) = &datapath {
            origin.keep_pinned_ids(&cfg, dp);
        }
        let metrics = Arc::new(Metrics::with_compat(cfg.metrics.compat));
        let datapath_fallback = record_datapath(&metrics, datapath_mode, datapath_fallback);
        let tasks = TaskTracker::new();
        let health = HealthService::new(metrics.clone(), tasks.clone());
        let proxy = proxy_context(&cfg, datapath.clone(), &metrics, &health);
        // A dial or a check that lands on one of these is a loop.
        crate::net::set_own_listeners(
            &cfg.balancers
                .iter()
                .flat_map(|b| b.listen.iter().copied())
                .collect::<Vec<_>>(),
        );
        let forwarding = connect::decide(&cfg, datapath.as_deref(), datapath_fallback.as_deref());
        connect::record(&metrics, &cfg, &forwarding);
        let connect_ids: HashSet<u32> = cfg
            .balancers
            .iter()
            .filter(|b| {
                forwarding
                    .get(&b.name)
                    .is_some_and(|f| f.0 == Forwarding::Connect)
            })
            .map(|b| origin.id_of(&b.name))
            .collect();
        let (senders, kills) = connect::kill_queues(&connect_ids);
        let observer: Arc<dyn Observer> = Arc::new(KillObserver {
            metrics: metrics.clone(),
            direct: senders,
        });
        let balancers: Vec<Arc<Balancer>> = cfg
            .balancers
            .iter()
            .map(|b| {
                let opts = Options {
                    observer: observer.clone(),
                    seed: None,
                };
                Balancer::build(origin.id_of(&b.name), b.clone(), opts)
            })
            .collect();
        let shutdown = CancellationToken::new();
        let daemon = Arc::new(Daemon {
            config: ArcSwap::from_pointee(cfg),
            config_path,
            overrides,
            balancers: ArcSwap::from_pointee(balancers.clone()),
            retired_ids: origin.ids.retired.clone(),
            datapath,
            datapath_mode,
            datapath_fallback,
            forwarding,
            metrics,
            health,
            proxy,
            heartbeat_ms: AtomicU64::new(now_ms()),
            first_checks_done: AtomicBool::new(false),
            background: shutdown.child_token(),
            shutdown,
            tasks,
            listeners: Mutex::new(Vec::new()),
            runtime: tokio::runtime::Handle::current(),
            handed_over: CancellationToken::new(),
            admin_gate: tokio::sync::watch::Sender::new(!taking_over),
        });
        Ok((daemon, balancers, kills))
    }

    /// One table task per connect-time balancer (those with a kill queue in `kills`), from
    /// `go` on (see [`connect::spawn_tables`]).
    fn spawn_connect_tables(
        self: &Arc<Self>,
        dp: &Arc<Datapath>,
        balancers: &[Arc<Balancer>],
        kills: &mut KillReceivers,
        go: &CancellationToken,
    ) {
        let weak = Arc::downgrade(self);
        let ctx = connect::Context {
            datapath: dp.clone(),
            metrics: self.metrics.clone(),
            stop: self.background.clone(),
            fail_fast: Arc::new(move || {
                weak.upgrade()
                    .map(|d| d.config.load().datapath.fail_fast)
                    .unwrap_or_default()
            }),
        };
        connect::spawn_tables(&ctx, balancers, kills, &self.tasks, go);
    }

    /// Where the kernel's reports of connect-time sockets go (see [`connect::passive_sink`]).
    fn passive_sink(self: &Arc<Self>) -> crate::datapath::PassiveSink {
        let weak = Arc::downgrade(self);
        connect::passive_sink(
            Arc::new(move || weak.upgrade().map(|d| d.balancers.load_full())),
            self.metrics.clone(),
            self.runtime.clone(),
        )
    }

    /// The readers of the kernel's rings: socket refreshes, passive health events (when a
    /// balancer forwards connect-time) and the kernel log. A process taking over starts them
    /// once the old one let go (`go`), which reads them until then.
    ///
    /// # Errors
    /// A fresh start whose readers cannot start.
    fn start_kernel_readers(
        self: &Arc<Self>,
        dp: &Arc<Datapath>,
        go: &CancellationToken,
        taking_over: bool,
    ) -> anyhow::Result<()> {
        let want_passive = self
            .forwarding
            .values()
            .any(|(f, _)| *f == Forwarding::Connect);
        if !taking_over {
            dp.start_refresher(self.background.clone())?;
            if want_passive {
                dp.start_passive(self.background.clone(), self.passive_sink())?;
            }
            dp.start_kernel_log(self.background.clone());
            return Ok(());
        }
        let (dp, daemon, go) = (dp.clone(), self.clone(), go.clone());
        self.tasks.spawn(async move {
            go.cancelled().await;
            let mut started = dp.start_refresher(daemon.background.clone());
            if want_passive && started.is_ok() {
                started = dp.start_passive(daemon.background.clone(), daemon.passive_sink());
            }
            if let Err(e) = started {
                error!(error = %e, "cannot start the kernel data path's readers");
            }
        });
        Ok(())
    }

    /// First round of checks, then the loops. Balancers with `health.loop = false` get no
    /// round: their checks run only before dials and on `/check`. A process taking over goes
    /// on from the old one's results.
    fn spawn_first_checks(self: &Arc<Self>, go: &CancellationToken, taking_over: bool) {
        let (daemon, go) = (self.clone(), go.clone());
        self.tasks.spawn(async move {
            go.cancelled().await;
            let bs = daemon.balancers.load_full();
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

    /// Each balancer's discovery source and the DNS names among its servers.
    fn spawn_discovery(self: &Arc<Self>, balancers: &[Arc<Balancer>]) {
        let weak = Arc::downgrade(self);
        let resolving: crate::discovery::names::Settings = Arc::new(move |b| {
            weak.upgrade()
                .map(|d| {
                    let cfg = d.config.load();
                    (cfg.resolve_of(b), cfg.dns.clone())
                })
                .unwrap_or_default()
        });
        for b in balancers {
            crate::discovery::spawn(
                b.clone(),
                self.metrics.clone(),
                &self.tasks,
                self.background.clone(),
            );
            crate::discovery::names::spawn(
                b.clone(),
                resolving.clone(),
                &self.tasks,
                self.background.clone(),
            );
        }
    }

    /// Heartbeat of the control loop every 500 ms, and (once this process serves, `go`) of the
    /// connect programs, which stop rewriting when it is older than `datapath.orphan_timeout`.
    fn spawn_heartbeat(self: &Arc<Self>, go: &CancellationToken) {
        let (daemon, go) = (self.clone(), go.clone());
        self.tasks.spawn(async move {
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
}

/// The proxy context of the balancers lb forwards for: the data path, copy buffers, metrics,
/// and a check before each dial (`max_age`).
fn proxy_context(
    cfg: &Config,
    datapath: Option<Arc<Datapath>>,
    metrics: &Arc<Metrics>,
    health: &Arc<HealthService>,
) -> Arc<ProxyCtx> {
    let pre_dial: PreDial = {
        let health = health.clone();
        Arc::new(move |b: Arc<Balancer>, server: ServerAddr| {
            let health = health.clone();
            Box::pin(async move { health.before_dial(&b, &server).await })
        })
    };
    Arc::new(ProxyCtx {
        datapath,
        copy_buffer_bytes: cfg.datapath.copy_buffer_bytes,
        metrics: metrics.clone(),
        pre_dial: Some(pre_dial),
        tasks: TaskTracker::new(),
        freezer: proxy::Freezer::default(),
        limits: proxy::Limits::default(),
    })
}

/// The data path in effect as `lb_datapath_info`, and `lb_datapath_fallback_info` with one
/// series per reason from the start: 1 for why `auto` fell back, when it did, 0 for the others.
/// Returns the reason's text for `/status`.
fn record_datapath(
    metrics: &Metrics,
    mode: DatapathMode,
    fallback: Option<(FallbackReason, String)>,
) -> Option<String> {
    metrics
        .datapath_info
        .get_or_create(&ModeLabel {
            mode: mode.to_string(),
        })
        .set(1);
    let kind = fallback.as_ref().map(|(kind, _)| *kind);
    for r in FallbackReason::ALL {
        metrics
            .datapath_fallback
            .get_or_create(&ReasonLabel {
                reason: r.label().to_string(),
            })
            .set(i64::from(kind == Some(r)));
    }
    fallback.map(|(_, why)| why)
}
