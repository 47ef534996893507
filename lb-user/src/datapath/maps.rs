//! The BPF maps: every map lb uses, declared once in one table ([`declare_maps!`]) that
//! generates the struct holding them, taking them out of the loaded object or out of the
//! descriptors a running lb handed over ([`Maps::take`], [`Maps::from_fds`]), handing them
//! over ([`Maps::export`]) and the list of their names ([`Maps::NAMES`]). A map missing from
//! any of these cannot compile. Each map sits in a [`Named`] wrapper whose operations carry
//! its name into their errors. What the maps mean is in `lb_common`, next to each name; the
//! splice's operations are in `super` (the data path) and connect-time's in
//! `super::connect`; the keys are built in `super::keys`.
//!
//! Minimum kernel: 5.8 for the ring buffers; the rest is older than either forwarding mode.

use std::{
    os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
    sync::{Mutex, MutexGuard},
};

use aya::{
    Ebpf, Pod,
    maps::{
        Array, HashMap, IterableMap as _, Map, MapData, MapError, PerCpuArray, RingBuf, SockHash,
    },
};
use lb_common::{
    BalancerStats, ConnectCountKey, ConnectOrig, ConnectTable, FlowState, ListenerKey, MAP_CLIENTS,
    MAP_CONNECT_COUNTS, MAP_CONNECT_CTL, MAP_CONNECT_CURRENT, MAP_CONNECT_EVENTS,
    MAP_CONNECT_LISTENERS, MAP_CONNECT_NETNS_PROBE, MAP_CONNECT_SCOPE, MAP_CONNECT_SOCKS,
    MAP_CONNECT_STATS, MAP_CONNECT_SUSPECT, MAP_CONNECT_SYN, MAP_CONNECT_TABLES, MAP_FLOWS,
    MAP_LISTENERS, MAP_NETNS, MAP_NETNS_SCOPE, MAP_PAIRS, MAP_REFRESH, MAP_SERVERS, MAP_STATS,
    PairCtl, SockKey, SynPolicy,
};

use super::{DatapathError, connect::events::EventRing, refresh::RefreshRing};

/// One map, with its name (the constant in `lb_common`) for the errors of its operations.
/// Each map has its own lock: an operation holds it for one syscall, a scan for its length.
pub(super) struct Named<M> {
    name: &'static str,
    map: Mutex<M>,
}

impl<M: TryFrom<Map, Error = MapError>> Named<M> {
    /// Map `name` as type `M`.
    ///
    /// # Errors
    /// [`DatapathError::Map`]: the map is of another type.
    fn new(name: &'static str, map: Map) -> Result<Named<M>, DatapathError> {
        let map = M::try_from(map).map_err(|source| DatapathError::Map { map: name, source })?;
        Ok(Named {
            name,
            map: Mutex::new(map),
        })
    }
}

impl<M> Named<M> {
    /// The map, locked.
    pub(super) fn lock(&self) -> MutexGuard<'_, M> {
        self.map.lock().expect("poisoned")
    }

    /// `source` as an error of this map.
    pub(super) fn error(&self, source: MapError) -> DatapathError {
        DatapathError::Map {
            map: self.name,
            source,
        }
    }
}

impl<K: Pod, V: Pod> Named<HashMap<MapData, K, V>> {
    /// The value of `key`; `None` when absent or unreadable.
    pub(super) fn get(&self, key: &K) -> Option<V> {
        self.lock().get(key, 0).ok()
    }

    /// Set `key` to `value` (the kernel sees it whole).
    ///
    /// # Errors
    /// [`DatapathError::Map`] (the map is full).
    pub(super) fn insert(&self, key: &K, value: &V) -> Result<(), DatapathError> {
        self.lock().insert(key, value, 0).map_err(|e| self.error(e))
    }

    /// Delete `key`; whether it was there.
    pub(super) fn remove(&self, key: &K) -> bool {
        self.lock().remove(key).is_ok()
    }

    /// Every entry `keep` selects, read under one lock (entries the kernel deletes meanwhile
    /// are skipped).
    pub(super) fn entries(&self, keep: impl Fn(&K, &V) -> bool) -> Vec<(K, V)> {
        self.lock()
            .iter()
            .filter_map(Result::ok)
            .filter(|(k, v)| keep(k, v))
            .collect()
    }

    /// Delete every entry `stale` selects; how many were deleted.
    pub(super) fn remove_where(&self, stale: impl Fn(&K, &V) -> bool) -> usize {
        let mut map = self.lock();
        let gone: Vec<K> = map
            .iter()
            .filter_map(Result::ok)
            .filter(|(k, v)| stale(k, v))
            .map(|(k, _)| k)
            .collect();
        gone.iter().filter(|k| map.remove(k).is_ok()).count()
    }
}

impl<V: Pod> Named<Array<MapData, V>> {
    /// Slot `index`.
    ///
    /// # Errors
    /// [`DatapathError::Map`] (an index out of range).
    pub(super) fn get(&self, index: u32) -> Result<V, DatapathError> {
        self.lock().get(&index, 0).map_err(|e| self.error(e))
    }

    /// Set slot `index` to `value`.
    ///
    /// # Errors
    /// [`DatapathError::Map`] (an index out of range).
    pub(super) fn set(&self, index: u32, value: &V) -> Result<(), DatapathError> {
        self.lock().set(index, value, 0).map_err(|e| self.error(e))
    }
}

impl<V: Pod> Named<PerCpuArray<MapData, V>> {
    /// Slot `index`, one value per CPU; empty when out of range.
    pub(super) fn per_cpu(&self, index: u32) -> Vec<V> {
        self.lock()
            .get(&index, 0)
            .map(|values| values.iter().copied().collect())
            .unwrap_or_default()
    }
}

impl<K: Pod> Named<SockHash<MapData, K>> {
    /// Put `socket` under `key`.
    ///
    /// # Errors
    /// [`DatapathError::Map`].
    pub(super) fn insert_socket(
        &self,
        key: &K,
        socket: &impl AsRawFd,
    ) -> Result<(), DatapathError> {
        self.lock()
            .insert(key, socket.as_raw_fd(), 0)
            .map_err(|e| self.error(e))
    }

    /// Take the socket of `key` out; whether there was one.
    pub(super) fn remove(&self, key: &K) -> bool {
        self.lock().remove(key).is_ok()
    }
}

/// A map's descriptor, whatever its aya type.
trait Descriptor {
    fn descriptor(&self) -> BorrowedFd<'_>;
}

impl<K: Pod, V: Pod> Descriptor for HashMap<MapData, K, V> {
    fn descriptor(&self) -> BorrowedFd<'_> {
        self.map().fd().as_fd()
    }
}

impl<V: Pod> Descriptor for Array<MapData, V> {
    fn descriptor(&self) -> BorrowedFd<'_> {
        self.map().fd().as_fd()
    }
}

impl<V: Pod> Descriptor for PerCpuArray<MapData, V> {
    fn descriptor(&self) -> BorrowedFd<'_> {
        self.map().fd().as_fd()
    }
}

impl<K: Pod> Descriptor for SockHash<MapData, K> {
    fn descriptor(&self) -> BorrowedFd<'_> {
        self.fd().as_fd()
    }
}

/// A copy of `fd`, map `name`'s descriptor.
fn dup(name: &'static str, fd: BorrowedFd<'_>) -> Result<(&'static str, OwnedFd), DatapathError> {
    fd.try_clone_to_owned()
        .map(|fd| (name, fd))
        .map_err(|source| DatapathError::Dup { map: name, source })
}

/// Declares every map lb uses, once: `field: aya type = name` for the maps kept in [`Maps`],
/// `field: type = name` for the ring buffers (each read by one thread, so handed out whole in
/// [`Rings`]; their type is built `From<RingBuf<MapData>>`). Generates [`Maps`], [`Rings`],
/// [`Maps::NAMES`], the one constructor both sources go through and [`Maps::export`].
macro_rules! declare_maps {
    (
        maps { $( $(#[$doc:meta])* $field:ident: $ty:ty = $name:path, )* }
        rings { $( $(#[$rdoc:meta])* $ring:ident: $rty:ty = $rname:path, )* }
    ) => {
        /// Every map lb uses but the ring buffers, by the field names of [`declare_maps!`].
        pub(super) struct Maps {
            $( $(#[$doc])* pub(super) $field: Named<$ty>, )*
            /// Copies of the ring buffers' descriptors, for a hand-over.
            ring_fds: Vec<(&'static str, OwnedFd)>,
        }

        /// The ring buffers, each for the one thread that reads it.
        pub(super) struct Rings {
            $( $(#[$rdoc])* pub(super) $ring: $rty, )*
        }

        impl Maps {
            /// The name of every map in the table, rings included.
            #[cfg(test)]
            pub(super) const NAMES: &'static [&'static str] = &[$($name,)* $($rname,)*];

            /// Every map of the table by name from `take`.
            ///
            /// # Errors
            /// What `take` returns for a missing map; [`DatapathError::Map`] for one of
            /// another type; [`DatapathError::Dup`] when a ring's descriptor cannot be copied.
            fn build(
                mut take: impl FnMut(&'static str) -> Result<Map, DatapathError>,
            ) -> Result<(Maps, Rings), DatapathError> {
                let rings = Rings {
                    $( $ring: <$rty>::from(
                        RingBuf::try_from(take($rname)?)
                            .map_err(|source| DatapathError::Map { map: $rname, source })?,
                    ), )*
                };
                let ring_fds = vec![ $( dup($rname, rings.$ring.as_fd())?, )* ];
                let maps = Maps {
                    $( $field: Named::new($name, take($name)?)?, )*
                    ring_fds,
                };
                Ok((maps, rings))
            }

            /// Copies of every map's descriptor, by name, for a hand-over.
            ///
            /// # Errors
            /// [`DatapathError::Dup`] naming the map (out of descriptors).
            pub(super) fn export(&self) -> Result<Vec<(&'static str, OwnedFd)>, DatapathError> {
                let mut out = vec![ $( dup($name, self.$field.lock().descriptor())?, )* ];
                for (name, fd) in &self.ring_fds {
                    out.push(dup(name, fd.as_fd())?);
                }
                Ok(out)
            }
        }
    };
}

declare_maps! {
    maps {
        /// The client sockhash sockops fills; `lb_sk_msg` is attached to it and stays attached
        /// as long as this is held.
        clients: SockHash<MapData, SockKey> = MAP_CLIENTS,
        /// lb's server sockets, keyed by the client they serve.
        servers: SockHash<MapData, SockKey> = MAP_SERVERS,
        /// lb's listener addresses → balancer id (the splice's).
        listeners: HashMap<MapData, ListenerKey, u32> = MAP_LISTENERS,
        /// A client tuple (cookie 0) → its namespace cookie, or `NETNS_AMBIGUOUS`.
        netns: HashMap<MapData, SockKey, u64> = MAP_NETNS,
        /// Per-connection byte counts, written by the kernel.
        flows: HashMap<MapData, SockKey, FlowState> = MAP_FLOWS,
        /// lb's instructions per paired connection.
        pairs: HashMap<MapData, SockKey, PairCtl> = MAP_PAIRS,
        /// The splice's per-CPU counters per balancer id.
        stats: PerCpuArray<MapData, BalancerStats> = MAP_STATS,
        /// Balancer id → the namespace cookie sockops acts in (`NETNS_SCOPE_ALL`: every one).
        scope: Array<MapData, u64> = MAP_NETNS_SCOPE,
        /// Listeners of connect-mode balancers → balancer id.
        connect_listeners: HashMap<MapData, ListenerKey, u32> = MAP_CONNECT_LISTENERS,
        /// Each balancer's server tables, in slots (`lb_common::table_index`).
        connect_tables: Array<MapData, ConnectTable> = MAP_CONNECT_TABLES,
        /// Each balancer's current table generation.
        connect_current: Array<MapData, u32> = MAP_CONNECT_CURRENT,
        /// The sockets the connect programs rewrote, by cookie.
        connect_socks: HashMap<MapData, u64, ConnectOrig> = MAP_CONNECT_SOCKS,
        /// Established connect-time sockets per balancer and server.
        connect_counts: HashMap<MapData, ConnectCountKey, u64> = MAP_CONNECT_COUNTS,
        /// The connect programs' namespace scope per balancer.
        connect_scope: Array<MapData, u64> = MAP_CONNECT_SCOPE,
        /// The connect programs' per-CPU counters per balancer.
        connect_stats: PerCpuArray<MapData, BalancerStats> = MAP_CONNECT_STATS,
        /// lb's tgid, heartbeat, orphan timeout and the layout version (`CTL_*` slots).
        connect_ctl: Array<MapData, u64> = MAP_CONNECT_CTL,
        /// The port and the cookie of lb's network namespace probe (before 5.14).
        connect_netns_probe: Array<MapData, u64> = MAP_CONNECT_NETNS_PROBE,
        /// The SYN policy lb asks for, per balancer and server (fail fast).
        connect_syn: HashMap<MapData, ConnectCountKey, SynPolicy> = MAP_CONNECT_SYN,
        /// When the kernel marked a server suspect (`CLOCK_BOOTTIME` ns), per balancer.
        connect_suspect: HashMap<MapData, ConnectCountKey, u64> = MAP_CONNECT_SUSPECT,
    }
    rings {
        /// The splice's credit requests.
        refresh: RefreshRing = MAP_REFRESH,
        /// Connect-time sockets' failures and retransmission timeouts.
        events: EventRing = MAP_CONNECT_EVENTS,
    }
}

impl Maps {
    /// Take every map out of the loaded object.
    ///
    /// # Errors
    /// [`DatapathError::Missing`] for a map the object lacks, [`DatapathError::Map`] for one of
    /// another type than expected.
    pub(super) fn take(ebpf: &mut Ebpf) -> Result<(Maps, Rings), DatapathError> {
        Maps::build(|name| ebpf.take_map(name).ok_or(DatapathError::Missing(name)))
    }

    /// The maps of a running lb, from descriptors it handed over (by map name).
    ///
    /// # Errors
    /// As [`Maps::take`]; a descriptor that is not a map is [`DatapathError::Map`].
    pub(super) fn from_fds(
        mut fds: std::collections::HashMap<String, OwnedFd>,
    ) -> Result<(Maps, Rings), DatapathError> {
        Maps::build(|name| {
            let fd = fds.remove(name).ok_or(DatapathError::Missing(name))?;
            let err = |source| DatapathError::Map { map: name, source };
            Map::from_map_data(MapData::from_fd(fd).map_err(err)?).map_err(err)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// The table names every map of the object but the two lb never opens: the round-robin
    /// counters only the programs use, and aya-log's ring, which the kernel logger takes.
    #[test]
    fn the_table_has_every_map_of_the_object() {
        let table: BTreeSet<&str> = Maps::NAMES.iter().copied().collect();
        assert_eq!(table.len(), Maps::NAMES.len(), "a name twice");
        let object: BTreeSet<&str> = lb_common::MAP_NAMES
            .into_iter()
            .filter(|n| ![lb_common::MAP_CONNECT_RR, lb_common::MAP_KERNEL_LOG].contains(n))
            .collect();
        assert_eq!(table, object);
    }
}
