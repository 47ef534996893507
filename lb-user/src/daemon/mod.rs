//! The daemon: builds the data path, balancers, listeners and health checks from a config,
//! keeps the control loop's heartbeat, reloads on SIGHUP ([`reload`]) and drains on SIGTERM.
//! The admin API sees it only through a [`Handle`].

mod adopt;
mod handle;
pub mod ids;
mod listeners;
mod pins;
pub mod reload;
mod start;
pub mod upgrade;

pub use crate::connect::ForwardingFallback;
pub use handle::Handle;

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use arc_swap::ArcSwap;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{error, info, warn};

use crate::{
    balancer::{Balancer, KillReason},
    config::{Config, DatapathMode, Overrides},
    datapath::Datapath,
    health::HealthService,
    metrics::Metrics,
    proxy::ProxyCtx,
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
    forwarding: crate::connect::ForwardingMap,
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

impl Daemon {
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
