//! The daemon: wires config → data path → balancers → listeners → health → admin, then waits for
//! signals: SIGTERM/SIGINT drain and exit, SIGHUP reloads.

use std::{
    net::SocketAddr,
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
    balancer::{Balancer, KillReason},
    config::{Config, DatapathMode},
    datapath::Datapath,
    health::HealthService,
    metrics::{KillLabels, Metrics, ModeLabel},
    proxy::{self, PreDial, ProxyCtx},
};

/// Everything the running daemon shares with its admin API.
pub struct Daemon {
    /// The config in force.
    pub config: ArcSwap<Config>,
    /// Balancers, in config order.
    pub balancers: ArcSwap<Vec<Arc<Balancer>>>,
    /// Kernel data path, when attached.
    pub datapath: Option<Arc<Datapath>>,
    /// Data path in use: `Bpf` or `Userspace`.
    pub datapath_mode: DatapathMode,
    /// Why `auto` fell back to userspace, if it did.
    pub datapath_fallback: Option<String>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Health checks.
    pub health: Arc<HealthService>,
    /// Proxy context.
    pub proxy: Arc<ProxyCtx>,
    /// Control loop heartbeat, milliseconds since the Unix epoch.
    pub heartbeat_ms: AtomicU64,
    /// Set once the first round of checks of every balancer finished.
    pub first_checks_done: AtomicBool,
    /// Fired when shutdown starts.
    pub shutdown: CancellationToken,
    /// Background tasks (health loops, admin, heartbeat).
    pub tasks: TaskTracker,
    listeners: Mutex<Vec<(SocketAddr, CancellationToken)>>,
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

impl Daemon {
    /// Find a balancer by name.
    pub fn balancer(&self, name: &str) -> Option<Arc<Balancer>> {
        self.balancers
            .load()
            .iter()
            .find(|b| b.name == name)
            .cloned()
    }

    /// Age of the control loop heartbeat.
    pub fn heartbeat_age(&self) -> Duration {
        Duration::from_millis(now_ms().saturating_sub(self.heartbeat_ms.load(Ordering::Relaxed)))
    }
}

/// An error and its sources, joined with ": ".
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(src) = cur {
        out.push_str(": ");
        out.push_str(&src.to_string());
        cur = src.source();
    }
    out
}

/// Attach the data path as `mode` asks.
///
/// # Errors
/// With `bpf`, the reason the kernel path could not be attached.
pub fn attach_datapath(
    cfg: &Config,
) -> anyhow::Result<(Option<Arc<Datapath>>, DatapathMode, Option<String>)> {
    let d = &cfg.datapath;
    match d.mode {
        DatapathMode::Userspace => Ok((None, DatapathMode::Userspace, None)),
        DatapathMode::Bpf => {
            let dp = Datapath::load(d).context("--datapath bpf: kernel data path unavailable")?;
            Ok((Some(Arc::new(dp)), DatapathMode::Bpf, None))
        }
        DatapathMode::Auto => match Datapath::load(d) {
            Ok(dp) => Ok((Some(Arc::new(dp)), DatapathMode::Bpf, None)),
            Err(e) => {
                let reason = error_chain(&e);
                warn!(reason = %reason, "kernel data path unavailable; falling back to the userspace copy path");
                Ok((None, DatapathMode::Userspace, Some(reason)))
            }
        },
    }
}

/// Run the daemon until SIGTERM/SIGINT.
///
/// # Errors
/// Data path (`bpf` mode) or listener bind failures.
pub async fn run(
    cfg: Config,
    config_path: Option<std::path::PathBuf>,
    overrides: crate::config::Overrides,
) -> anyhow::Result<()> {
    let (datapath, datapath_mode, datapath_fallback) = attach_datapath(&cfg)?;
    let metrics = Arc::new(Metrics::new());
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
        Arc::new(move |b: Arc<Balancer>, spec: String| {
            let health = health.clone();
            Box::pin(async move { health.before_dial(&b, &spec).await })
        })
    };
    let proxy_ctx = Arc::new(ProxyCtx {
        datapath: datapath.clone(),
        copy_buffer_bytes: cfg.datapath.copy_buffer_bytes,
        metrics: metrics.clone(),
        pre_dial: Some(pre_dial),
        tasks: TaskTracker::new(),
        listeners: cfg
            .balancers
            .iter()
            .flat_map(|b| b.listen.iter().copied())
            .collect(),
    });
    let balancers: Vec<Arc<Balancer>> = cfg
        .balancers
        .iter()
        .enumerate()
        .map(|(i, b)| Balancer::new(u32::try_from(i).unwrap_or(0), b.clone()))
        .collect();
    for b in &balancers {
        b.set_node_kill_hook(crate::kill::node_kill_hook());
        let m = metrics.clone();
        let name = b.name.clone();
        b.set_kill_hook(Arc::new(
            move |server: &str, reason: KillReason, n: usize| {
                m.connections_killed
                    .get_or_create(&KillLabels {
                        balancer: name.clone(),
                        server: server.to_string(),
                        reason: reason.label().into(),
                    })
                    .inc_by(n as u64);
            },
        ));
    }
    let daemon = Arc::new(Daemon {
        config: ArcSwap::from_pointee(cfg.clone()),
        balancers: ArcSwap::from_pointee(balancers.clone()),
        datapath,
        datapath_mode,
        datapath_fallback,
        metrics,
        health: health.clone(),
        proxy: proxy_ctx.clone(),
        heartbeat_ms: AtomicU64::new(now_ms()),
        first_checks_done: AtomicBool::new(false),
        shutdown: CancellationToken::new(),
        tasks: tasks.clone(),
        listeners: Mutex::new(Vec::new()),
    });

    // Listeners first: a bind failure is fatal and nothing else has started.
    let mut bound = Vec::new();
    for b in &balancers {
        for addr in &b.config().listen {
            let l = proxy::bind(*addr)
                .with_context(|| format!("balancer {}: cannot listen on {addr}", b.name))?;
            bound.push((b.clone(), *addr, l));
        }
    }
    for (b, addr, l) in bound {
        if let Some(dp) = &daemon.datapath {
            dp.add_listener(addr, b.id)
                .with_context(|| format!("registering listener {addr}"))?;
        }
        let stop = CancellationToken::new();
        daemon
            .listeners
            .lock()
            .expect("poisoned")
            .push((addr, stop.clone()));
        tokio::spawn(proxy::serve(l, b.clone(), proxy_ctx.clone(), stop));
        info!(balancer = %b.name, listen = %addr, "listening");
    }
    if let Some(dp) = &daemon.datapath {
        dp.start_refresher(daemon.shutdown.clone())?;
    }

    // First round of checks, then the loops. Balancers with `health.loop = false` get no round:
    // their checks run only before dials and on `/check`.
    {
        let daemon = daemon.clone();
        tasks.spawn(async move {
            let bs = daemon.balancers.load_full();
            let looping = bs.iter().filter(|b| b.config().health.loop_enabled);
            futures::future::join_all(looping.map(|b| daemon.health.check_all(b))).await;
            daemon.first_checks_done.store(true, Ordering::Relaxed);
            for b in bs.iter() {
                daemon.health.start(b.clone(), daemon.shutdown.clone());
            }
        });
    }
    // Heartbeat of the control loop.
    {
        let daemon = daemon.clone();
        tasks.spawn(async move {
            loop {
                daemon.heartbeat_ms.store(now_ms(), Ordering::Relaxed);
                tokio::select! {
                    () = daemon.shutdown.cancelled() => return,
                    () = tokio::time::sleep(Duration::from_millis(500)) => {}
                }
            }
        });
    }
    crate::admin::start(daemon.clone()).await?;

    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = hup.recv() => crate::admin::reload(&daemon, config_path.as_deref(), &overrides),
        }
    }
    shutdown(&daemon).await;
    Ok(())
}

/// Stop accepting, let connections finish for `shutdown_grace`, reset the rest, stop tasks.
pub async fn shutdown(daemon: &Arc<Daemon>) {
    let grace = daemon.config.load().shutdown_grace.0;
    info!(grace = ?grace, "shutting down: no new connections, draining");
    for (_, stop) in daemon.listeners.lock().expect("poisoned").drain(..) {
        stop.cancel();
    }
    daemon.proxy.tasks.close();
    let start = Instant::now();
    if tokio::time::timeout(grace, daemon.proxy.tasks.wait())
        .await
        .is_err()
    {
        let killed: usize = daemon
            .balancers
            .load()
            .iter()
            .map(|b| b.kill_all(KillReason::Shutdown))
            .sum();
        warn!(killed, "grace period over; reset the remaining connections");
        if tokio::time::timeout(Duration::from_secs(5), daemon.proxy.tasks.wait())
            .await
            .is_err()
        {
            error!("connections did not end after reset");
        }
    }
    daemon.shutdown.cancel();
    daemon.tasks.close();
    let _ = tokio::time::timeout(Duration::from_secs(5), daemon.tasks.wait()).await;
    info!(elapsed = ?start.elapsed(), "stopped; kernel programs detach as lb exits");
}
