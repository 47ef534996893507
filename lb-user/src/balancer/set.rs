//! Changing a balancer's server set: replace it whole (API, reload, discovery), add or remove
//! one server, and expand each entry into the servers it stands for (a name's addresses).

use std::sync::Arc;

use tracing::info;

use super::{
    Balancer, KillReason,
    state::{Server, ServerState, transition},
    state_file::ServerSet,
};
use crate::addr::{ServerAddr, SetError, validate_set};

/// Every entry of `set` (its default last when it is not in the list) with the addresses it
/// stands for ([`ServerAddr::expand`]: a name's addresses, each pinned). An entry already in
/// the balancer (`known`: origin and address of each current server) keeps the addresses it
/// has: a name is resolved when it enters the set, so an unrelated change during a DNS outage
/// never moves or kills its servers. Resolves new names, so it runs without the lock.
pub(super) fn expand(
    set: &ServerSet,
    known: &[(ServerAddr, ServerAddr)],
) -> Vec<(ServerAddr, Vec<ServerAddr>)> {
    set.servers
        .iter()
        .chain(set.default.iter().filter(|d| !set.servers.contains(d)))
        .map(|origin| {
            let had: Vec<ServerAddr> = known
                .iter()
                .filter(|(o, _)| o == origin)
                .map(|(_, a)| a.clone())
                .collect();
            let addrs = if had.is_empty() { origin.expand() } else { had };
            (origin.clone(), addrs)
        })
        .collect()
}

pub(super) fn build_servers(set: &ServerSet) -> Vec<Server> {
    let mut out: Vec<Server> = Vec::new();
    for (origin, addrs) in expand(set, &[]) {
        let in_set = set.servers.contains(&origin);
        let is_default = set.default.as_ref() == Some(&origin);
        for addr in addrs {
            // One server per address: an entry that names an address another entry already
            // stands for (`api:80` and `api:80 (10.0.0.1)`) adds nothing but its flags.
            if let Some(s) = out.iter_mut().find(|s| s.addr == addr) {
                s.is_default |= is_default;
                s.in_set |= in_set;
                continue;
            }
            out.push(Server::new(addr, origin.clone(), is_default, in_set));
        }
    }
    out
}

impl Balancer {
    /// Replace the server set and default. An unchanged set does nothing (returns `false`); new
    /// servers start UNCHECKED; removed ones go INVALID and their connections are closed; a
    /// previous default that was only STANDBY is removed with its connections (K3s rules).
    ///
    /// # Errors
    /// [`SetError`] for an empty list, duplicates or one of lb's listeners.
    pub fn set_servers(
        self: &Arc<Self>,
        servers: &[ServerAddr],
        default: Option<&ServerAddr>,
    ) -> Result<bool, SetError> {
        if servers.is_empty() {
            return Err(SetError::Empty);
        }
        validate_set(servers, default, &self.cfg.load().listen)?;
        let want = ServerSet {
            servers: servers.to_vec(),
            default: default.cloned(),
        };
        if self.lock().set() == want {
            return Ok(false);
        }
        let known: Vec<(ServerAddr, ServerAddr)> = self
            .lock()
            .servers
            .iter()
            .map(|s| (s.origin.clone(), s.addr.clone()))
            .collect();
        let expanded = expand(&want, &known);
        // Two entries of the list that resolve to one address are one server twice
        // (`localhost:80` and `127.0.0.1:80`).
        let mut seen: Vec<(&ServerAddr, &ServerAddr)> = Vec::new();
        for (origin, addrs) in expanded.iter().filter(|(o, _)| want.servers.contains(o)) {
            for addr in addrs {
                let ip = addr.socket_addr();
                if seen
                    .iter()
                    .any(|(o, a)| *o != origin && ip.is_some() && a.socket_addr() == ip)
                {
                    return Err(SetError::Duplicate(origin.clone()));
                }
                seen.push((origin, addr));
            }
        }
        self.install(want, expanded, None);
        self.write_state_file();
        Ok(true)
    }

    /// Make the servers those of `expanded` (each entry of `want` with its addresses): servers
    /// that stay keep their states, new ones start UNCHECKED, the others go INVALID and their
    /// connections are closed (reason `removed`). With `only_if`, nothing happens unless the
    /// set is still that one (a name's new addresses must not undo a set change made since
    /// they were asked for). Returns whether it applied.
    fn install(
        self: &Arc<Self>,
        want: ServerSet,
        expanded: Vec<(ServerAddr, Vec<ServerAddr>)>,
        only_if: Option<&ServerSet>,
    ) -> bool {
        let mut removed = Vec::new();
        {
            let mut inner = self.lock();
            if only_if.is_some_and(|s| *s != inner.set) {
                return false;
            }
            let mut old: Vec<Server> = std::mem::take(&mut inner.servers);
            let mut next = Vec::new();
            for (origin, addrs) in expanded {
                let in_set = want.servers.contains(&origin);
                let is_default = want.default.as_ref() == Some(&origin);
                for addr in addrs {
                    if let Some(s) = next.iter_mut().find(|s: &&mut Server| s.addr == addr) {
                        s.is_default |= is_default;
                        s.in_set |= in_set;
                        continue;
                    }
                    let s = match old.iter().position(|s| s.addr == addr) {
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
                            s.origin = origin.clone();
                            s
                        }
                        None => {
                            let s = Server::new(addr.clone(), origin.clone(), is_default, in_set);
                            info!(balancer = %self.name, server = %addr, state = %s.state, "server added");
                            s
                        }
                    };
                    next.push(s);
                }
            }
            for mut s in old {
                transition(
                    &self.name,
                    &mut s,
                    ServerState::Invalid,
                    "removed from the set",
                );
                let taken = inner.conns.take(&s.addr);
                removed.push((s.addr, taken));
            }
            inner.servers = next;
            inner.set = want;
        }
        for (server, c) in removed {
            self.kill_entries(&server, c, KillReason::Removed);
        }
        self.bump();
        true
    }

    /// The servers the set's entry `origin` stands for now, in order (a name's pinned
    /// addresses, or the name itself while it resolved to nothing); `None` when `origin` is
    /// no longer an entry of the set.
    pub fn addresses_of(&self, origin: &ServerAddr) -> Option<Vec<ServerAddr>> {
        let inner = self.lock();
        let set = &inner.set;
        if !set.servers.contains(origin) && set.default.as_ref() != Some(origin) {
            return None;
        }
        Some(
            inner
                .servers
                .iter()
                .filter(|s| s.origin == *origin)
                .map(|s| s.addr.clone())
                .collect(),
        )
    }

    /// Give the host name `origin`, an entry of the set, the addresses `found` (`address:port`
    /// servers; each is pinned to the name): addresses that stay keep their places, servers
    /// and states, new ones follow them and start UNCHECKED, those that left are removed and
    /// their connections closed (reason `removed`). The set itself (names, what the state file
    /// and `PUT` hold) does not change. An address another entry stands for is left to that
    /// entry. Returns whether the servers changed; nothing changes when `found` leaves no
    /// address, when `origin` left the set, or when the set changed meanwhile.
    pub fn set_addresses(self: &Arc<Self>, origin: &ServerAddr, found: &[ServerAddr]) -> bool {
        let (want, known) = {
            let inner = self.lock();
            let known: Vec<(ServerAddr, ServerAddr)> = inner
                .servers
                .iter()
                .map(|s| (s.origin.clone(), s.addr.clone()))
                .collect();
            (inner.set.clone(), known)
        };
        let taken: Vec<std::net::SocketAddr> = known
            .iter()
            .filter(|(o, _)| o != origin)
            .filter_map(|(_, a)| a.socket_addr())
            .collect();
        let pinned: Vec<ServerAddr> = found
            .iter()
            .filter_map(ServerAddr::socket_addr)
            .filter(|sa| !taken.contains(sa))
            .map(|sa| origin.pinned_to(sa.ip()))
            .collect();
        let had: Vec<ServerAddr> = known
            .iter()
            .filter(|(o, _)| o == origin)
            .map(|(_, a)| a.clone())
            .collect();
        // A rotated answer must not reshuffle the preference order.
        let pinned = crate::addr::merge(&had, &pinned);
        if pinned.is_empty() || had.is_empty() || had == pinned {
            return false;
        }
        let mut expanded = expand(&want, &known);
        for (o, addrs) in &mut expanded {
            if o == origin {
                addrs.clone_from(&pinned);
            }
        }
        self.install(want.clone(), expanded, Some(&want))
    }

    /// Add one server at the end of the set.
    ///
    /// # Errors
    /// As [`Balancer::set_servers`].
    pub fn add_server(self: &Arc<Self>, server: &ServerAddr) -> Result<bool, SetError> {
        let mut set = self.lock().set();
        set.servers.push(server.clone());
        self.set_servers(&set.servers, set.default.as_ref())
    }

    /// Remove the server `spec` names from the set.
    ///
    /// # Errors
    /// [`SetError::UnknownServer`], or [`SetError::Empty`] when it is the last.
    pub fn remove_server(self: &Arc<Self>, spec: &str) -> Result<bool, SetError> {
        let unknown = || SetError::UnknownServer(spec.to_string());
        let server = ServerAddr::parse(spec).map_err(|_| unknown())?;
        let mut set = self.lock().set();
        let before = set.servers.len();
        set.servers.retain(|s| *s != server);
        if set.servers.len() == before {
            return Err(unknown());
        }
        self.set_servers(&set.servers, set.default.as_ref())
    }
}
