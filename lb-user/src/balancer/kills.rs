//! A balancer's kills: running what a state transition asked for (its connections killed, the
//! node-wide kill where configured), drain deadlines, operator and shutdown kills, and the
//! kernel-side reset of lb's own client sockets that goes with each.

use std::{sync::Arc, time::Instant};

use tracing::{debug, info, warn};

use super::{Balancer, KillReason, registry::ConnEntry, state::Effects};
use crate::{
    addr::{ServerAddr, SetError},
    config::KillScope,
    kill::OwnSocket,
};

/// Set once the kernel refused `SOCK_DESTROY` for lb's own sockets, so it is logged once.
static OWN_DESTROY_REFUSED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Reset the clients of connections being killed: destroy lb's accepted sockets in the kernel
/// (`SOCK_DESTROY`, a batch per system call), which sends each client its RST at once instead
/// of when its connection's task next runs. Without `SOCK_DESTROY` the tasks do it alone.
/// Returns how many were destroyed.
fn destroy_clients(balancer: &str, server: &ServerAddr, clients: &[OwnSocket]) -> usize {
    use std::sync::atomic::Ordering;
    if OWN_DESTROY_REFUSED.load(Ordering::Relaxed) {
        return 0;
    }
    match crate::kill::destroy_own_sockets(clients) {
        Ok(k) => k.destroyed,
        Err(crate::kill::KillError::Unsupported) => {
            if !OWN_DESTROY_REFUSED.swap(true, Ordering::Relaxed) {
                info!(
                    "the kernel refuses SOCK_DESTROY (CONFIG_INET_DIAG_DESTROY): killed connections are reset by their own tasks"
                );
            }
            0
        }
        Err(e) => {
            debug!(balancer, %server, error = %e, "cannot reset the clients in the kernel; their tasks will");
            0
        }
    }
}

impl Balancer {
    /// Run what a transition asked for: kill, then the node-wide kill where configured.
    pub(super) fn apply(&self, fx: Effects) -> usize {
        let mut killed = 0;
        for (server, reason) in fx.kill {
            let taken = self.lock().conns.take(&server);
            killed += self.kill_entries(&server, taken, reason);
        }
        for server in fx.node_kill {
            self.node_kill(&server);
        }
        killed
    }

    pub(super) fn node_kill(&self, server: &ServerAddr) {
        if self.cfg.load().health.kill_scope == KillScope::Node {
            self.observer.node_kill(server);
        }
    }

    /// Kill the connections of servers whose drain deadline passed; returns how many.
    pub fn expire_drains(self: &Arc<Self>) -> usize {
        let now = Instant::now();
        let mut expired = Vec::new();
        {
            let mut inner = self.lock();
            for s in &mut inner.servers {
                if s.drain_deadline.is_some_and(|d| d <= now) {
                    s.drain_deadline = None;
                    expired.push(s.addr.clone());
                }
            }
        }
        expired
            .into_iter()
            .map(|server| {
                let taken = self.lock().conns.take(&server);
                let n = self.kill_entries(&server, taken, KillReason::DrainTimeout);
                self.node_kill(&server);
                n
            })
            .sum()
    }

    pub(super) fn kill_entries(
        &self,
        server: &ServerAddr,
        conns: Vec<ConnEntry>,
        reason: KillReason,
    ) -> usize {
        let n = conns.len();
        // Reset the clients first, all at once in the kernel; each connection's task then
        // cleans up after its own.
        let clients: Vec<_> = conns.iter().filter_map(|c| c.client).collect();
        for c in &conns {
            c.set_reason(reason);
        }
        let reset_in_kernel = if clients.is_empty() {
            0
        } else {
            destroy_clients(&self.name, server, &clients)
        };
        for c in conns {
            c.cancel();
        }
        if reason != KillReason::Shutdown {
            self.observer
                .server_killed(&self.name, self.id, server, reason);
        }
        if n > 0 {
            warn!(balancer = %self.name, %server, connections = n, reset_in_kernel, reason = reason.label(), "killed connections");
            self.observer.killed(&self.name, server, reason, n);
        }
        n
    }

    /// Kill every connection to the server `spec` names (any spelling of it; a name: each of
    /// its addresses).
    ///
    /// # Errors
    /// [`SetError::UnknownServer`].
    pub fn kill_server(&self, spec: &str, reason: KillReason) -> Result<usize, SetError> {
        let mut killed = 0;
        for server in self.known(spec)? {
            let taken = self.lock().conns.take(&server);
            killed += self.kill_entries(&server, taken, reason);
        }
        Ok(killed)
    }

    /// Kill every connection of the balancer (shutdown).
    pub fn kill_all(&self, reason: KillReason) -> usize {
        let taken = self.lock().conns.take_all();
        taken
            .into_iter()
            .map(|(server, c)| self.kill_entries(&server, c, reason))
            .sum()
    }
}
