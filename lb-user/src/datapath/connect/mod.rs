//! The connect-time maps behind one wrapper: the listeners of connect-mode balancers, their
//! server tables (in slots, with each balancer's current generation), the sockets the connect
//! programs rewrote and the established ones per server; and the conversions between a
//! server's socket address and the kernel's `ConnectServer`.
//!
//! Minimum kernel: as the connect-time programs (5.15, with the splice's sockops program).

use std::{
    net::{IpAddr, SocketAddr},
    sync::Mutex,
    time::Instant,
};

use aya::maps::{Array, HashMap, MapData, PerCpuArray};
use lb_common::{
    AF_INET, AF_INET6, BalancerStats, ConnectCountKey, ConnectOrig, ConnectServer, ConnectTable,
    MAP_CONNECT_CTL, MAP_CONNECT_CURRENT, MAP_CONNECT_SCOPE, MAP_CONNECT_TABLES, table_index,
};

use super::{
    DatapathError,
    maps::{Listeners, listener_key, map_err},
    tables::{Generations, slot_of},
};

/// The connect-time maps: listeners of connect-mode balancers, their server tables (in slots,
/// with the generation current per balancer), the sockets the connect programs rewrote (by
/// cookie) and the established ones per server.
pub(super) struct ConnectMaps {
    pub(super) listeners: Listeners,
    pub(super) tables: Mutex<Array<MapData, ConnectTable>>,
    pub(super) current: Mutex<Array<MapData, u32>>,
    /// Per balancer id, the generations lb wrote; its lock is held across a whole table write
    /// (one writer at a time).
    pub(super) generations: Mutex<std::collections::HashMap<u32, Generations>>,
    /// The maps were created by this process (see [`Maps::build`]).
    pub(super) fresh: bool,
    pub(super) socks: Mutex<HashMap<MapData, u64, ConnectOrig>>,
    pub(super) counts: Mutex<HashMap<MapData, ConnectCountKey, u64>>,
    /// `LB_CONNECT_SCOPE`: the connect programs' namespace scope per balancer.
    pub(super) scope: Mutex<Array<MapData, u64>>,
    /// `LB_CONNECT_STATS`: the connect programs' counters per balancer, per CPU.
    pub(super) stats: Mutex<PerCpuArray<MapData, BalancerStats>>,
    /// `LB_CONNECT_CTL`: lb's tgid, heartbeat, orphan timeout and the layout version.
    pub(super) ctl: Mutex<Array<MapData, u64>>,
    /// `LB_CONNECT_NETNS_PROBE`: the port and the cookie of lb's network namespace probe.
    pub(super) netns_probe: Mutex<Array<MapData, u64>>,
    /// The fail-fast maps: SYN policies and suspect marks per server.
    pub(super) failfast: super::failfast::FailFastMaps,
}

/// What [`ConnectMaps::set_table`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TableWrite {
    /// The current table already was this one: nothing written.
    Unchanged {
        /// The generation current (`LB_CONNECT_CURRENT`).
        generation: u32,
    },
    /// Written into the next slot, which is current now.
    Written {
        /// The new current generation.
        generation: u32,
        /// Its slot (`generation % TABLE_SLOTS`).
        slot: usize,
        /// How long the slot had not been current before this write; `None` when it never was
        /// since this lb tracks the balancer.
        idle: Option<std::time::Duration>,
    },
}

impl ConnectMaps {
    /// Set slot `slot` of `LB_CONNECT_CTL` (see `lb_common::CTL_SLOTS`).
    ///
    /// # Errors
    /// [`DatapathError::Map`].
    pub(super) fn set_ctl(&self, slot: u32, value: u64) -> Result<(), DatapathError> {
        self.ctl
            .lock()
            .expect("poisoned")
            .set(slot, value, 0)
            .map_err(map_err(MAP_CONNECT_CTL))
    }

    /// Slot `slot` of `LB_CONNECT_CTL`; `None` when it cannot be read.
    pub(super) fn ctl(&self, slot: u32) -> Option<u64> {
        self.ctl.lock().expect("poisoned").get(&slot, 0).ok()
    }

    /// Set slot `slot` of `LB_CONNECT_NETNS_PROBE` (`lb_common::PROBE_PORT`, `PROBE_COOKIE`).
    ///
    /// # Errors
    /// [`DatapathError::Map`].
    pub(super) fn set_probe(&self, slot: u32, value: u64) -> Result<(), DatapathError> {
        self.netns_probe
            .lock()
            .expect("poisoned")
            .set(slot, value, 0)
            .map_err(map_err(lb_common::MAP_CONNECT_NETNS_PROBE))
    }

    /// Slot `slot` of `LB_CONNECT_NETNS_PROBE`; `None` when it cannot be read.
    pub(super) fn probe(&self, slot: u32) -> Option<u64> {
        self.netns_probe
            .lock()
            .expect("poisoned")
            .get(&slot, 0)
            .ok()
    }

    /// Set balancer `id`'s scope for the connect programs.
    ///
    /// # Errors
    /// [`DatapathError::Map`] (an id out of range).
    pub(super) fn set_scope(&self, id: u32, netns: u64) -> Result<(), DatapathError> {
        self.scope
            .lock()
            .expect("poisoned")
            .set(id, netns, 0)
            .map_err(map_err(MAP_CONNECT_SCOPE))
    }

    /// Balancer `id`'s connect-program counters, one per CPU; empty when out of range.
    pub(super) fn stats(&self, id: u32) -> Vec<BalancerStats> {
        self.stats
            .lock()
            .expect("poisoned")
            .get(&id, 0)
            .map(|values| values.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Descriptors of the maps only the connect programs use that [`super::maps::Maps::export`]
    /// does not list itself, by name.
    ///
    /// # Errors
    /// Out of descriptors.
    pub(super) fn export_own(&self) -> std::io::Result<Vec<(&'static str, std::os::fd::OwnedFd)>> {
        use std::os::fd::AsFd as _;

        use aya::maps::IterableMap as _;
        Ok(vec![
            (
                MAP_CONNECT_SCOPE,
                self.scope
                    .lock()
                    .expect("poisoned")
                    .map()
                    .fd()
                    .as_fd()
                    .try_clone_to_owned()?,
            ),
            (
                lb_common::MAP_CONNECT_STATS,
                self.stats
                    .lock()
                    .expect("poisoned")
                    .map()
                    .fd()
                    .as_fd()
                    .try_clone_to_owned()?,
            ),
            (
                MAP_CONNECT_CTL,
                self.ctl
                    .lock()
                    .expect("poisoned")
                    .map()
                    .fd()
                    .as_fd()
                    .try_clone_to_owned()?,
            ),
            (
                lb_common::MAP_CONNECT_NETNS_PROBE,
                self.netns_probe
                    .lock()
                    .expect("poisoned")
                    .map()
                    .fd()
                    .as_fd()
                    .try_clone_to_owned()?,
            ),
        ])
    }

    /// Balancer `id`'s current generation and table, as the programs read them now.
    ///
    /// # Errors
    /// [`DatapathError::Map`] (also for an id out of range).
    pub(super) fn table(&self, id: u32) -> Result<(u32, ConnectTable), DatapathError> {
        let generation = self
            .current
            .lock()
            .expect("poisoned")
            .get(&id, 0)
            .map_err(map_err(MAP_CONNECT_CURRENT))?;
        let table = self
            .tables
            .lock()
            .expect("poisoned")
            .get(&table_index(id, generation), 0)
            .map_err(map_err(MAP_CONNECT_TABLES))?;
        Ok((generation, table))
    }

    /// Make `table` balancer `id`'s current one: written into the next generation's slot, then
    /// that generation stored as current (see `lb_common::MAP_CONNECT_TABLES`). Nothing is
    /// written when it is the current table already. The generation found in the kernel is
    /// trusted over the one lb tracks (a hand-over, another process): every other slot then
    /// counts as current until now.
    ///
    /// # Errors
    /// [`DatapathError::TableSlotBusy`] while the next slot has not been idle for
    /// `SLOT_REUSE_AFTER_MS` (nothing written: try again after the wait it names);
    /// [`DatapathError::Map`].
    pub(super) fn set_table(
        &self,
        id: u32,
        table: &ConnectTable,
    ) -> Result<TableWrite, DatapathError> {
        let mut generations = self.generations.lock().expect("poisoned");
        let (current, found) = self.table(id)?;
        let now = Instant::now();
        let g = generations.entry(id).or_insert_with(|| {
            if self.fresh {
                Generations::fresh(current)
            } else {
                Generations::found(current, now)
            }
        });
        if g.current() != current {
            *g = Generations::found(current, now);
        }
        if found == *table {
            return Ok(TableWrite::Unchanged {
                generation: current,
            });
        }
        let wait = g.wait(now);
        if !wait.is_zero() {
            return Err(DatapathError::TableSlotBusy { balancer: id, wait });
        }
        let (next, idle) = (g.next(), g.next_idle(now));
        self.tables
            .lock()
            .expect("poisoned")
            .set(table_index(id, next), table, 0)
            .map_err(map_err(MAP_CONNECT_TABLES))?;
        self.current
            .lock()
            .expect("poisoned")
            .set(id, next, 0)
            .map_err(map_err(MAP_CONNECT_CURRENT))?;
        // Retired once the store returned: later than the programs could last see it current.
        g.advance(Instant::now());
        Ok(TableWrite::Written {
            generation: next,
            slot: slot_of(next),
            idle,
        })
    }

    /// Established connect-time sockets per server of balancer `id` (servers with none are
    /// left out).
    pub(super) fn counts(&self, id: u32) -> Vec<(ConnectServer, u64)> {
        let counts = self.counts.lock().expect("poisoned");
        counts
            .iter()
            .filter_map(Result::ok)
            .filter(|(k, n)| k.balancer == id && i64::try_from(*n).is_ok_and(|v| v > 0))
            .map(|(k, n)| (k.server, n))
            .collect()
    }

    /// Delete balancer `id`'s count keys of servers not in `keep` whose count is 0 or below
    /// (a decrement that found its key deleted). Returns how many were deleted.
    ///
    /// A socket the programs sent to such a server before the table changed can still be
    /// counted once it establishes: its key comes back (the increment creates it), and goes
    /// at a later prune once the socket closed. An increment that looked its key up just
    /// before this delete is lost, and its socket's decrement leaves the recreated key at -1,
    /// which the programs read as 0 and the next prune deletes.
    pub(super) fn prune_counts(&self, id: u32, keep: &[ConnectServer]) -> usize {
        let mut counts = self.counts.lock().expect("poisoned");
        let stale: Vec<ConnectCountKey> = counts
            .iter()
            .filter_map(Result::ok)
            .filter(|(k, n)| {
                k.balancer == id
                    && !keep.contains(&k.server)
                    && !i64::try_from(*n).is_ok_and(|v| v > 0)
            })
            .map(|(k, _)| k)
            .collect();
        stale.iter().filter(|k| counts.remove(k).is_ok()).count()
    }

    /// The sockets the connect programs sent to `server` for balancer `id`: cookie and what
    /// the programs recorded.
    pub(super) fn sockets(&self, id: u32, server: &ConnectServer) -> Vec<(u64, ConnectOrig)> {
        let socks = self.socks.lock().expect("poisoned");
        socks
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, o)| o.count.balancer == id && o.count.server == *server)
            .collect()
    }
}

/// A server address as the connect tables hold it.
pub(super) fn connect_server(addr: SocketAddr) -> ConnectServer {
    let key = listener_key(addr);
    ConnectServer {
        ip_be: key.ip_be,
        port: key.port,
        family: key.family,
    }
}

/// The socket address of a connect table entry.
pub(super) fn server_addr(s: &ConnectServer) -> Option<SocketAddr> {
    let ip: IpAddr = match s.family {
        AF_INET => IpAddr::from(s.ip_be[0].to_ne_bytes()),
        AF_INET6 => {
            let mut b = [0u8; 16];
            for (chunk, w) in b.chunks_exact_mut(4).zip(s.ip_be) {
                chunk.copy_from_slice(&w.to_ne_bytes());
            }
            IpAddr::from(b)
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, u16::try_from(s.port).ok()?))
}

/// A connect-time socket's (own address, peer) as the kernel holds them, from what sockops
/// recorded at `TCP_CONNECT_CB`; `None` before then. An IPv6 socket sent to an IPv4 `server`
/// has both addresses IPv4-mapped.
pub(super) fn sent_tuple(o: &ConnectOrig, server: SocketAddr) -> Option<(SocketAddr, SocketAddr)> {
    if o.local_port == 0 {
        return None;
    }
    let local = server_addr(&ConnectServer {
        ip_be: o.local_ip_be,
        port: o.local_port,
        family: o.family,
    })?;
    let peer = match (local, server) {
        (SocketAddr::V6(_), SocketAddr::V4(v4)) => {
            SocketAddr::new(IpAddr::V6(v4.ip().to_ipv6_mapped()), v4.port())
        }
        (SocketAddr::V4(_), SocketAddr::V6(_)) => return None,
        _ => server,
    };
    Some((local, peer))
}
