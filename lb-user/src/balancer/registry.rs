//! The connection registry: every live connection of a balancer under its server, each with
//! a kill switch, so a server's connections can be ended at once (unhealthy, removed, fail-back,
//! an operator's kill).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use tokio_util::sync::CancellationToken;

use super::{Balancer, state::KillReason};
use crate::{addr::ServerAddr, kill::OwnSocket};

/// One live connection's entry.
#[derive(Debug)]
pub(super) struct ConnEntry {
    cancel: CancellationToken,
    reason: Arc<Mutex<Option<KillReason>>>,
    /// lb's accepted socket of the connection, by its addresses (local, peer), when known.
    pub(super) client: Option<OwnSocket>,
}

impl ConnEntry {
    /// Record why the connection is killed (before [`ConnEntry::kill`]).
    pub(super) fn set_reason(&self, reason: KillReason) {
        *self.reason.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason);
    }

    /// Fire the kill switch ([`ConnEntry::set_reason`] first).
    pub(super) fn cancel(self) {
        self.cancel.cancel();
    }
}

/// Connections by server and id.
#[derive(Debug, Default)]
pub(super) struct Registry {
    by_server: HashMap<ServerAddr, HashMap<u64, ConnEntry>>,
}

impl Registry {
    /// Record connection `id` to `server` (`client`: lb's accepted socket); returns its kill
    /// switch and reason slot.
    pub(super) fn insert(
        &mut self,
        server: &ServerAddr,
        id: u64,
        client: Option<OwnSocket>,
    ) -> (CancellationToken, Arc<Mutex<Option<KillReason>>>) {
        let cancel = CancellationToken::new();
        let reason = Arc::new(Mutex::new(None));
        self.by_server.entry(server.clone()).or_default().insert(
            id,
            ConnEntry {
                cancel: cancel.clone(),
                reason: reason.clone(),
                client,
            },
        );
        (cancel, reason)
    }

    /// Forget connection `id` (it ended).
    pub(super) fn remove(&mut self, server: &ServerAddr, id: u64) {
        if let Some(conns) = self.by_server.get_mut(server) {
            conns.remove(&id);
            if conns.is_empty() {
                self.by_server.remove(server);
            }
        }
    }

    /// Take every connection of `server` out of the registry (to be killed).
    pub(super) fn take(&mut self, server: &ServerAddr) -> Vec<ConnEntry> {
        self.by_server
            .remove(server)
            .map(|c| c.into_values().collect())
            .unwrap_or_default()
    }

    /// Take every connection, by server.
    pub(super) fn take_all(&mut self) -> Vec<(ServerAddr, Vec<ConnEntry>)> {
        self.by_server
            .drain()
            .map(|(s, c)| (s, c.into_values().collect()))
            .collect()
    }

    /// Open connections to `server`.
    pub(super) fn count(&self, server: &ServerAddr) -> usize {
        self.by_server.get(server).map_or(0, HashMap::len)
    }

    /// Open connections in all.
    pub(super) fn total(&self) -> usize {
        self.by_server.values().map(HashMap::len).sum()
    }
}

/// Kill switch handed to a connection task; dropping the last clone unregisters it.
#[derive(Clone, Debug)]
pub struct ConnGuard {
    /// Cancelled when the connection must be killed.
    pub cancel: CancellationToken,
    pub(super) reason: Arc<Mutex<Option<KillReason>>>,
    pub(super) balancer: Arc<Balancer>,
    pub(super) server: ServerAddr,
    pub(super) id: u64,
}

impl ConnGuard {
    /// Why the connection was killed, once `cancel` fired.
    pub fn reason(&self) -> Option<KillReason> {
        *self.reason.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The server this connection goes to.
    pub fn server(&self) -> &ServerAddr {
        &self.server
    }
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        // One reference is the registry's entry (while registered), one is ours: the last guard.
        if Arc::strong_count(&self.reason) == 2 {
            self.balancer.unregister(&self.server, self.id);
        }
    }
}
