//! The admin API's view of the daemon: a [`Handle`] with snapshots, lookups, checks, metrics
//! and the hand-over, and nothing else.

use std::{
    net::SocketAddr,
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use tokio_util::sync::CancellationToken;

use super::{Daemon, ForwardingFallback, now_ms, upgrade};
use crate::{
    balancer::Balancer,
    config::{Config, DatapathMode, Forwarding},
};

impl Daemon {
    /// The narrow view the admin API gets.
    pub fn handle(self: &Arc<Self>) -> Handle {
        Handle(self.clone())
    }
}

/// What the admin API may read and ask of the daemon: snapshots, lookups, checks, metrics.
#[derive(Clone, Debug)]
pub struct Handle(Arc<Daemon>);

impl Handle {
    /// The config in force (a snapshot).
    pub fn config(&self) -> Arc<Config> {
        self.0.config.load_full()
    }

    /// Every balancer, in config order.
    pub fn balancers(&self) -> Arc<Vec<Arc<Balancer>>> {
        self.0.balancers.load_full()
    }

    /// The balancer named `name`.
    pub fn balancer(&self, name: &str) -> Option<Arc<Balancer>> {
        self.0.balancer(name)
    }

    /// The data path in use (`bpf` or `userspace`).
    pub fn datapath_mode(&self) -> DatapathMode {
        self.0.datapath_mode
    }

    /// Why `auto` fell back to userspace, if it did.
    pub fn datapath_fallback(&self) -> Option<&str> {
        self.0.datapath_fallback.as_deref()
    }

    /// Balancer `name`'s forwarding in effect and, when it asked for `connect` and forwards
    /// through lb instead, why.
    pub fn forwarding(&self, name: &str) -> (Forwarding, Option<ForwardingFallback>) {
        self.0
            .forwarding
            .get(name)
            .cloned()
            .unwrap_or((Forwarding::Splice, None))
    }

    /// The network namespaces balancer config `b`'s kernel programs act in.
    pub fn namespaces(&self, b: &crate::config::BalancerConfig) -> crate::config::Namespaces {
        self.0.config.load().namespaces_of(b)
    }

    /// Whether balancer config `b`'s host names follow DNS (`resolve`, else `[dns] resolve`).
    pub fn resolve(&self, b: &crate::config::BalancerConfig) -> crate::config::Resolve {
        self.0.config.load().resolve_of(b)
    }

    /// Established connect-time connections of balancer `id` per server address (empty
    /// without the kernel data path).
    pub fn connect_counts(&self, id: u32) -> std::collections::HashMap<SocketAddr, u64> {
        self.0
            .datapath
            .as_ref()
            .map(|dp| dp.connect_counts(id))
            .unwrap_or_default()
    }

    /// Balancer `id`'s servers the kernel marked suspect (empty without the kernel data path).
    pub fn connect_suspects(&self, id: u32) -> Vec<SocketAddr> {
        self.0.datapath.as_ref().map_or_else(Vec::new, |dp| {
            dp.connect_suspects(id)
                .into_iter()
                .map(|(a, _)| a)
                .collect()
        })
    }

    /// Balancer `id`'s current connect-time table generation and servers as the kernel holds
    /// them (`None` without the kernel data path).
    pub fn connect_table(&self, id: u32) -> Option<(u32, Vec<SocketAddr>)> {
        self.0.datapath.as_ref()?.connect_table(id)
    }

    /// The counters the kernel programs keep for balancer `id`, summed over the CPUs (`None`
    /// on the userspace data path).
    pub fn kernel_stats(&self, id: u32) -> Option<lb_common::BalancerStats> {
        Some(self.0.datapath.as_ref()?.stats(id))
    }

    /// The connect-time pin directory and the heartbeat's age as the programs see it (`None`
    /// when connect-time is not pinned).
    pub fn connect_pins(
        &self,
    ) -> Option<(crate::datapath::PinsStatus, Option<std::time::Duration>)> {
        let dp = self.0.datapath.as_ref()?;
        Some((dp.pins_status()?, dp.heartbeat_age()))
    }

    /// Whether the kernel data path is attached.
    pub fn datapath_attached(&self) -> bool {
        self.0.datapath.is_some()
    }

    /// Age of the control loop's heartbeat.
    pub fn heartbeat_age(&self) -> Duration {
        Duration::from_millis(now_ms().saturating_sub(self.0.heartbeat_ms.load(Ordering::Relaxed)))
    }

    /// Whether the first round of checks finished.
    pub fn first_checks_done(&self) -> bool {
        self.0.first_checks_done.load(Ordering::Relaxed)
    }

    /// Whether the daemon is draining or stopped.
    pub fn shutting_down(&self) -> bool {
        self.0.proxy.tasks.is_closed() || self.0.shutdown.is_cancelled()
    }

    /// Fired when the daemon stops.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.0.shutdown.clone()
    }

    /// Whether the admin API may accept now (see the hand-over in [`upgrade`]).
    pub fn admin_gate(&self) -> tokio::sync::watch::Receiver<bool> {
        self.0.admin_gate.subscribe()
    }

    /// Hand everything to a new lb started from lb's binary (`lb upgrade`); this process
    /// exits after answering. Runs on the daemon's runtime.
    ///
    /// # Errors
    /// Why the new process did not take over; this one serves on unchanged.
    pub async fn upgrade(&self) -> Result<upgrade::Upgraded, upgrade::UpgradeError> {
        let d = self.0.clone();
        self.0
            .runtime
            .spawn(async move { upgrade::upgrade(&d).await })
            .await
            .map_err(|e| upgrade::UpgradeError::Failed(format!("upgrade task failed: {e}")))?
    }

    /// The metrics in Prometheus text format.
    pub fn render_metrics(&self) -> String {
        self.0
            .metrics
            .render(&self.0.balancers.load(), self.0.datapath.as_deref())
    }

    /// Check every server of `balancers` now, on the daemon's runtime (not the caller's): the
    /// returned task ends when every check is recorded; aborting it cancels the checks.
    pub fn spawn_checks(&self, balancers: Vec<Arc<Balancer>>) -> tokio::task::JoinHandle<()> {
        let health = self.0.health.clone();
        self.0.runtime.spawn(async move {
            futures::future::join_all(balancers.iter().map(|b| health.check_all(b))).await;
        })
    }
}
