//! The BPF maps, behind small typed wrappers: the only place that takes maps out of the loaded
//! object (by the names in `lb_common`) and builds their keys from socket addresses; the ring
//! buffers' records are read in `refresh` (credit requests) and `passive` (connect-time events).
//! Each wrapper serialises its own operations.
//!
//! Minimum kernel: 5.8 for the ring buffer; the rest is older than the data path's 5.15.

use std::{
    net::{IpAddr, SocketAddr},
    os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
    sync::Mutex,
};

use aya::{
    Ebpf,
    maps::{
        Array, HashMap, IterableMap as _, Map, MapData, MapError, PerCpuArray, RingBuf, SockHash,
        sock::SockMapFd,
    },
};
use lb_common::{
    AF_INET, AF_INET6, BalancerStats, FlowState, ListenerKey, MAP_CLIENTS, MAP_CONNECT_COUNTS,
    MAP_CONNECT_CTL, MAP_CONNECT_CURRENT, MAP_CONNECT_EVENTS, MAP_CONNECT_LISTENERS,
    MAP_CONNECT_SCOPE, MAP_CONNECT_SOCKS, MAP_CONNECT_STATS, MAP_CONNECT_TABLES, MAP_FLOWS,
    MAP_LISTENERS, MAP_NETNS, MAP_NETNS_SCOPE, MAP_PAIRS, MAP_REFRESH, MAP_SERVERS, MAP_STATS,
    PairCtl, SockKey,
};

use super::{DatapathError, passive::EventRing};

pub use super::connect_maps::TableWrite;
pub(super) use super::connect_maps::{ConnectMaps, connect_server, sent_tuple, server_addr};
pub(super) use super::refresh::RefreshRing;

pub(super) fn map_err(map: &'static str) -> impl FnOnce(MapError) -> DatapathError {
    move |source| DatapathError::Map { map, source }
}

/// Every map of the object but the ring buffer, taken out of it once at load.
pub(super) struct Maps {
    pub(super) clients: Clients,
    pub(super) servers: Servers,
    pub(super) listeners: Listeners,
    pub(super) netns: Netns,
    pub(super) flows: Flows,
    pub(super) pairs: Pairs,
    pub(super) stats: Stats,
    pub(super) scope: Scope,
    pub(super) connect: ConnectMaps,
    /// Copies of the ring buffers' descriptors (the rings themselves go to their threads), for
    /// a hand-over.
    rings: Vec<(&'static str, OwnedFd)>,
}

impl Maps {
    /// Take every map out of the loaded object; the ring buffers come apart, each for the one
    /// thread that reads it.
    ///
    /// # Errors
    /// [`DatapathError::Missing`] for a map the object lacks, [`DatapathError::Map`] for one of
    /// another type than expected.
    pub(super) fn take(ebpf: &mut Ebpf) -> Result<(Maps, RefreshRing, EventRing), DatapathError> {
        Maps::build(
            |name| ebpf.take_map(name).ok_or(DatapathError::Missing(name)),
            true,
        )
    }

    /// The maps of a running lb, from descriptors it handed over (by map name).
    ///
    /// # Errors
    /// As [`Maps::take`]; a descriptor that is not a map is [`DatapathError::Map`].
    pub(super) fn from_fds(
        mut fds: std::collections::HashMap<String, OwnedFd>,
    ) -> Result<(Maps, RefreshRing, EventRing), DatapathError> {
        Maps::build(
            |name| {
                let fd = fds.remove(name).ok_or(DatapathError::Missing(name))?;
                let data = MapData::from_fd(fd).map_err(map_err(name))?;
                Map::from_map_data(data).map_err(map_err(name))
            },
            false,
        )
    }

    /// Copies of every map's descriptor, by name, for a hand-over.
    ///
    /// # Errors
    /// A descriptor could not be duplicated (out of descriptors).
    #[expect(
        clippy::too_many_lines,
        reason = "one line per map handed over; splitting the list would hide a missing map"
    )]
    pub(super) fn export(&self) -> std::io::Result<Vec<(&'static str, OwnedFd)>> {
        let dup = |fd: BorrowedFd<'_>| fd.try_clone_to_owned();
        let mut out = vec![
            (MAP_CLIENTS, dup(self.clients.0.fd().as_fd())?),
            (
                MAP_SERVERS,
                dup(self.servers.0.lock().expect("poisoned").map().fd().as_fd())?,
            ),
            (
                MAP_LISTENERS,
                dup(self
                    .listeners
                    .0
                    .lock()
                    .expect("poisoned")
                    .map()
                    .fd()
                    .as_fd())?,
            ),
            (
                MAP_NETNS,
                dup(self.netns.0.lock().expect("poisoned").map().fd().as_fd())?,
            ),
            (
                MAP_FLOWS,
                dup(self.flows.0.lock().expect("poisoned").map().fd().as_fd())?,
            ),
            (
                MAP_PAIRS,
                dup(self.pairs.0.lock().expect("poisoned").map().fd().as_fd())?,
            ),
            (
                MAP_STATS,
                dup(self.stats.0.lock().expect("poisoned").map().fd().as_fd())?,
            ),
            (
                MAP_NETNS_SCOPE,
                dup(self.scope.0.lock().expect("poisoned").map().fd().as_fd())?,
            ),
            (
                MAP_CONNECT_LISTENERS,
                dup(self
                    .connect
                    .listeners
                    .0
                    .lock()
                    .expect("poisoned")
                    .map()
                    .fd()
                    .as_fd())?,
            ),
            (
                MAP_CONNECT_TABLES,
                dup(self
                    .connect
                    .tables
                    .lock()
                    .expect("poisoned")
                    .map()
                    .fd()
                    .as_fd())?,
            ),
            (
                MAP_CONNECT_CURRENT,
                dup(self
                    .connect
                    .current
                    .lock()
                    .expect("poisoned")
                    .map()
                    .fd()
                    .as_fd())?,
            ),
            (
                MAP_CONNECT_SOCKS,
                dup(self
                    .connect
                    .socks
                    .lock()
                    .expect("poisoned")
                    .map()
                    .fd()
                    .as_fd())?,
            ),
            (
                MAP_CONNECT_COUNTS,
                dup(self
                    .connect
                    .counts
                    .lock()
                    .expect("poisoned")
                    .map()
                    .fd()
                    .as_fd())?,
            ),
        ];
        out.extend(self.connect.export_own()?);
        out.extend(self.connect.failfast.export()?);
        for (name, fd) in &self.rings {
            out.push((name, dup(fd.as_fd())?));
        }
        Ok(out)
    }

    /// `fresh`: the maps were created by this process (no table was ever current but the
    /// all-zero one), not handed over.
    fn build(
        mut take: impl FnMut(&'static str) -> Result<Map, DatapathError>,
        fresh: bool,
    ) -> Result<(Maps, RefreshRing, EventRing), DatapathError> {
        let ring =
            RefreshRing(RingBuf::try_from(take(MAP_REFRESH)?).map_err(map_err(MAP_REFRESH))?);
        let events = EventRing::new(
            RingBuf::try_from(take(MAP_CONNECT_EVENTS)?).map_err(map_err(MAP_CONNECT_EVENTS))?,
        );
        let dup = |name: &'static str, fd: BorrowedFd<'_>| {
            fd.try_clone_to_owned()
                .map(|fd| (name, fd))
                .map_err(|source| DatapathError::Dup { map: name, source })
        };
        let rings = vec![
            dup(MAP_REFRESH, ring.as_fd())?,
            dup(MAP_CONNECT_EVENTS, events.as_fd())?,
        ];
        let maps = Maps {
            rings,
            clients: Clients(SockHash::try_from(take(MAP_CLIENTS)?).map_err(map_err(MAP_CLIENTS))?),
            servers: Servers(Mutex::new(
                SockHash::try_from(take(MAP_SERVERS)?).map_err(map_err(MAP_SERVERS))?,
            )),
            listeners: Listeners(Mutex::new(
                HashMap::try_from(take(MAP_LISTENERS)?).map_err(map_err(MAP_LISTENERS))?,
            )),
            netns: Netns(Mutex::new(
                HashMap::try_from(take(MAP_NETNS)?).map_err(map_err(MAP_NETNS))?,
            )),
            flows: Flows(Mutex::new(
                HashMap::try_from(take(MAP_FLOWS)?).map_err(map_err(MAP_FLOWS))?,
            )),
            pairs: Pairs(Mutex::new(
                HashMap::try_from(take(MAP_PAIRS)?).map_err(map_err(MAP_PAIRS))?,
            )),
            stats: Stats(Mutex::new(
                PerCpuArray::try_from(take(MAP_STATS)?).map_err(map_err(MAP_STATS))?,
            )),
            scope: Scope(Mutex::new(
                Array::try_from(take(MAP_NETNS_SCOPE)?).map_err(map_err(MAP_NETNS_SCOPE))?,
            )),
            connect: ConnectMaps {
                listeners: Listeners(Mutex::new(
                    HashMap::try_from(take(MAP_CONNECT_LISTENERS)?)
                        .map_err(map_err(MAP_CONNECT_LISTENERS))?,
                )),
                tables: Mutex::new(
                    Array::try_from(take(MAP_CONNECT_TABLES)?)
                        .map_err(map_err(MAP_CONNECT_TABLES))?,
                ),
                current: Mutex::new(
                    Array::try_from(take(MAP_CONNECT_CURRENT)?)
                        .map_err(map_err(MAP_CONNECT_CURRENT))?,
                ),
                generations: Mutex::new(std::collections::HashMap::new()),
                fresh,
                socks: Mutex::new(
                    HashMap::try_from(take(MAP_CONNECT_SOCKS)?)
                        .map_err(map_err(MAP_CONNECT_SOCKS))?,
                ),
                counts: Mutex::new(
                    HashMap::try_from(take(MAP_CONNECT_COUNTS)?)
                        .map_err(map_err(MAP_CONNECT_COUNTS))?,
                ),
                scope: Mutex::new(
                    Array::try_from(take(MAP_CONNECT_SCOPE)?)
                        .map_err(map_err(MAP_CONNECT_SCOPE))?,
                ),
                stats: Mutex::new(
                    PerCpuArray::try_from(take(MAP_CONNECT_STATS)?)
                        .map_err(map_err(MAP_CONNECT_STATS))?,
                ),
                ctl: Mutex::new(
                    Array::try_from(take(MAP_CONNECT_CTL)?).map_err(map_err(MAP_CONNECT_CTL))?,
                ),
                netns_probe: Mutex::new(
                    Array::try_from(take(lb_common::MAP_CONNECT_NETNS_PROBE)?)
                        .map_err(map_err(lb_common::MAP_CONNECT_NETNS_PROBE))?,
                ),
                failfast: super::failfast::FailFastMaps::take(&mut take)?,
            },
        };
        Ok((maps, ring, events))
    }
}

/// `LB_CLIENTS`: the client sockhash sockops fills; `lb_sk_msg` is attached to it and stays
/// attached as long as this is held.
pub(super) struct Clients(SockHash<MapData, SockKey>);

impl Clients {
    /// The map's descriptor, to attach sk_msg to.
    pub(super) fn fd(&self) -> &SockMapFd {
        self.0.fd()
    }
}

/// `LB_SERVERS`: lb's server sockets, keyed by the client they serve.
pub(super) struct Servers(Mutex<SockHash<MapData, SockKey>>);

impl Servers {
    /// Register `stream` as the server socket of the client `key`.
    ///
    /// # Errors
    /// [`DatapathError::Map`].
    pub(super) fn insert_pair(
        &self,
        key: &SockKey,
        stream: &impl AsRawFd,
    ) -> Result<(), DatapathError> {
        self.0
            .lock()
            .expect("poisoned")
            .insert(key, stream.as_raw_fd(), 0)
            .map_err(map_err(MAP_SERVERS))
    }

    /// Take the server socket of `key` out (before lb closes it); absent is fine.
    pub(super) fn remove(&self, key: &SockKey) {
        let _ = self.0.lock().expect("poisoned").remove(key);
    }
}

/// `LB_LISTENERS`: lb's listener addresses → balancer id.
pub(super) struct Listeners(Mutex<HashMap<MapData, ListenerKey, u32>>);

impl Listeners {
    /// Register `key` for balancer `id`.
    ///
    /// # Errors
    /// [`DatapathError::Map`].
    pub(super) fn insert(&self, key: &ListenerKey, id: u32) -> Result<(), DatapathError> {
        self.0
            .lock()
            .expect("poisoned")
            .insert(key, id, 0)
            .map_err(map_err(MAP_LISTENERS))
    }

    /// Forget `key`; absent is fine.
    pub(super) fn remove(&self, key: &ListenerKey) {
        let _ = self.0.lock().expect("poisoned").remove(key);
    }

    /// Forget every key not in `keep`; returns how many were forgotten.
    pub(super) fn retain(&self, keep: &[ListenerKey]) -> usize {
        let mut map = self.0.lock().expect("poisoned");
        let stale: Vec<ListenerKey> = map
            .keys()
            .filter_map(Result::ok)
            .filter(|k| !keep.contains(k))
            .collect();
        stale.iter().filter(|k| map.remove(k).is_ok()).count()
    }
}

/// `LB_NETNS`: a client tuple (cookie 0) → its namespace cookie, or `NETNS_AMBIGUOUS`.
pub(super) struct Netns(Mutex<HashMap<MapData, SockKey, u64>>);

impl Netns {
    /// The cookie sockops recorded for `tuple`.
    pub(super) fn get(&self, tuple: &SockKey) -> Option<u64> {
        self.0.lock().expect("poisoned").get(tuple, 0).ok()
    }
}

/// `LB_FLOWS`: per-connection byte counts, written by the kernel.
pub(super) struct Flows(Mutex<HashMap<MapData, SockKey, FlowState>>);

impl Flows {
    /// The counts of `key`.
    pub(super) fn get(&self, key: &SockKey) -> Option<FlowState> {
        self.0.lock().expect("poisoned").get(key, 0).ok()
    }
}

/// `LB_PAIRS`: lb's instructions per paired connection.
pub(super) struct Pairs(Mutex<HashMap<MapData, SockKey, PairCtl>>);

impl Pairs {
    /// Publish `ctl` for `key` (the kernel sees it whole).
    ///
    /// # Errors
    /// [`DatapathError::Map`].
    pub(super) fn publish(&self, key: &SockKey, ctl: &PairCtl) -> Result<(), DatapathError> {
        self.0
            .lock()
            .expect("poisoned")
            .insert(key, ctl, 0)
            .map_err(map_err(MAP_PAIRS))
    }

    /// Take `key` out; absent is fine.
    pub(super) fn remove(&self, key: &SockKey) {
        let _ = self.0.lock().expect("poisoned").remove(key);
    }
}

/// `LB_STATS`: per-CPU counters per balancer id.
pub(super) struct Stats(Mutex<PerCpuArray<MapData, BalancerStats>>);

impl Stats {
    /// Balancer `id`'s counters, one per CPU; empty when the id is out of range.
    pub(super) fn per_cpu(&self, id: u32) -> Vec<BalancerStats> {
        self.0
            .lock()
            .expect("poisoned")
            .get(&id, 0)
            .map(|values| values.iter().copied().collect())
            .unwrap_or_default()
    }
}

/// `LB_NETNS_SCOPE`: balancer id → the network namespace cookie its programs act in
/// (`NETNS_SCOPE_ALL`: every namespace).
pub(super) struct Scope(Mutex<Array<MapData, u64>>);

impl Scope {
    /// Set balancer `id`'s scope to namespace cookie `netns` (or `NETNS_SCOPE_ALL`).
    ///
    /// # Errors
    /// [`DatapathError::Map`] (an id out of range).
    pub(super) fn set(&self, id: u32, netns: u64) -> Result<(), DatapathError> {
        self.0
            .lock()
            .expect("poisoned")
            .set(id, netns, 0)
            .map_err(map_err(MAP_NETNS_SCOPE))
    }
}

/// Build the map key of a client connection from lb's accepted socket: `peer` is the client's
/// address, `local` the listener address, `netns_cookie` the client socket's namespace. `None`
/// when the two are of different families.
pub fn sock_key(peer: SocketAddr, local: SocketAddr, netns_cookie: u64) -> Option<SockKey> {
    let (family, client_ip_be) = ip_words(peer.ip());
    let (lfamily, lb_ip_be) = ip_words(local.ip());
    if family != lfamily {
        return None;
    }
    Some(SockKey {
        client_ip_be,
        lb_ip_be,
        client_port: u32::from(peer.port()),
        lb_port: u32::from(local.port()),
        netns_cookie,
        family,
        _pad: 0,
    })
}

/// The [`ListenerKey`] of one listener: for `0.0.0.0`/`[::]` the wildcard of its own family
/// only (lb binds IPv6 listeners `IPV6_V6ONLY`, so `[::]` never accepts IPv4 clients and must not
/// claim them from a `0.0.0.0` listener of another balancer), its address otherwise.
pub(super) fn listener_key(addr: SocketAddr) -> ListenerKey {
    let port = u32::from(addr.port());
    if addr.ip().is_unspecified() {
        let family = if addr.is_ipv6() { AF_INET6 } else { AF_INET };
        return ListenerKey::wildcard(port, family);
    }
    let (family, ip_be) = ip_words(addr.ip());
    ListenerKey {
        ip_be,
        port,
        family,
    }
}

/// Address → (family, words in network byte order). IPv4-mapped IPv6 counts as IPv4.
fn ip_words(ip: IpAddr) -> (u32, [u32; 4]) {
    match ip {
        IpAddr::V4(v4) => (AF_INET, [u32::from_ne_bytes(v4.octets()), 0, 0, 0]),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return ip_words(IpAddr::V4(v4));
            }
            let o = v6.octets();
            let w = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            (AF_INET6, [w(0), w(4), w(8), w(12)])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_words_match_kernel_layout() {
        let k = sock_key(
            "127.0.0.2:40000".parse().unwrap(),
            "127.0.0.1:6444".parse().unwrap(),
            7,
        )
        .unwrap();
        assert_eq!(k.client_ip_be[0].to_ne_bytes(), [127, 0, 0, 2]);
        assert_eq!(
            (k.client_port, k.lb_port, k.family, k.netns_cookie),
            (40000, 6444, AF_INET, 7)
        );
        let mapped = sock_key(
            "[::ffff:127.0.0.2]:40000".parse().unwrap(),
            "127.0.0.1:6444".parse().unwrap(),
            7,
        )
        .unwrap();
        assert_eq!(mapped, k);
        let v6 = sock_key("[::1]:1".parse().unwrap(), "[::1]:2".parse().unwrap(), 0).unwrap();
        assert_eq!(v6.family, AF_INET6);
        assert_eq!(v6.client_ip_be[3].to_ne_bytes(), [0, 0, 0, 1]);
    }

    #[test]
    fn wildcard_listener_keys() {
        let v4 = listener_key("0.0.0.0:80".parse().unwrap());
        assert_eq!((v4.family, v4.port, v4.ip_be), (AF_INET, 80, [0; 4]));
        // IPV6_V6ONLY: `[::]` is an IPv6 wildcard only (it used to register an IPv4 one too,
        // which charged a `0.0.0.0` listener's clients to the `[::]` listener's balancer).
        let v6 = listener_key("[::]:80".parse().unwrap());
        assert_eq!((v6.family, v6.port, v6.ip_be), (AF_INET6, 80, [0; 4]));
        let one = listener_key("127.0.0.1:6443".parse().unwrap());
        assert_eq!((one.family, one.port), (AF_INET, 6443));
        assert_eq!(one.ip_be[0].to_ne_bytes(), [127, 0, 0, 1]);
    }
}
