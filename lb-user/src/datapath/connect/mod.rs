//! Connect-time's kernel half, the twin of `lb-ebpf/src/connect.rs`: its programs' links
//! ([`attach`]), their pins ([`pins`]) and lb's heartbeat in them ([`heartbeat`]), the server
//! tables in slots ([`slots`]), the fail-fast maps ([`failfast`]), the sockets' events
//! ([`events`]) and lb's namespace cookie before 5.14 ([`netns_probe`]); here, the listeners,
//! tables, counts and sockets of connect-mode balancers. What the daemon does with them
//! (which table, when to kill) is in the top-level `connect` module.
//!
//! Minimum kernel: 5.8 (the getpeername hooks; `sock_release` for the records, 5.9).

pub(super) mod attach;
pub(super) mod events;
pub(super) mod failfast;
pub(super) mod heartbeat;
pub(super) mod netns_probe;
pub(super) mod pins;
pub(super) mod slots;
pub(super) mod survey;
pub(super) mod swap;

use std::{collections::HashMap, net::SocketAddr, sync::Mutex, time::Instant};

use lb_common::{ConnectTable, MAX_CONNECT_SERVERS, table_index};

use self::slots::{Generations, slot_of};
use super::{
    Datapath, DatapathError,
    keys::{connect_server, listener_key, sent_tuple, server_addr},
};

/// What [`Datapath::set_connect_table`] did.
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

/// The table generations lb wrote, per balancer id.
pub(super) struct Tables {
    /// Its lock is held across a whole table write (one writer at a time).
    generations: Mutex<HashMap<u32, Generations>>,
    /// The maps were written by an earlier lb (adopted from pins or handed over): a
    /// balancer's generations go on from what the kernel holds, and every other slot may have
    /// been current until now.
    inherited: bool,
}

impl Tables {
    /// No generation tracked yet; `inherited` when an earlier lb wrote the maps.
    pub(super) fn new(inherited: bool) -> Tables {
        Tables {
            generations: Mutex::default(),
            inherited,
        }
    }
}

impl Datapath {
    /// Why connect-time forwarding is unavailable (a program type, attach type or helper the
    /// kernel lacks), `None` when its programs are attached.
    pub fn connect_unavailable(&self) -> Option<&str> {
        self.connect_missing.as_deref()
    }

    /// Tell the connect programs that `addr` is a listener of connect-mode balancer `id`. An
    /// unspecified address matches loopback destinations of its port and family only.
    ///
    /// # Errors
    /// [`DatapathError::Map`].
    pub fn add_connect_listener(&self, addr: SocketAddr, id: u32) -> Result<(), DatapathError> {
        self.maps.connect_listeners.insert(&listener_key(addr), &id)
    }

    /// Tell the connect programs that `addr` is not a connect-time listener (any more): its
    /// connects reach it unrewritten. Absent is fine.
    pub fn remove_connect_listener(&self, addr: SocketAddr) {
        self.maps.connect_listeners.remove(&listener_key(addr));
    }

    /// Forget every connect-time listener but `keep`'s: those an earlier lb registered whose
    /// balancer is gone or no longer connect-mode. Returns how many were forgotten.
    pub fn retain_connect_listeners(&self, keep: &[SocketAddr]) -> usize {
        let keys: Vec<_> = keep.iter().map(|a| listener_key(*a)).collect();
        self.maps
            .connect_listeners
            .remove_where(|k, _| !keys.contains(k))
    }

    /// Replace the servers balancer `id`'s connect programs choose from, best first (at most
    /// [`MAX_CONNECT_SERVERS`] are kept), picked by `policy` (`lb_common::CONNECT_FIRST`,
    /// `CONNECT_ROUND_ROBIN`, `CONNECT_RANDOM` or `CONNECT_LEAST`). An empty list stops
    /// rewriting: connects then reach the listener. The table goes into the next of the
    /// balancer's slots, then becomes current (see `lb_common::MAP_CONNECT_TABLES`); a program
    /// reads either the old table or the new one, never a mix. Nothing is written when it is
    /// the current table already. The generation found in the kernel is trusted over the one
    /// lb tracks (a hand-over, another process): every other slot then counts as current until
    /// now.
    ///
    /// # Errors
    /// [`DatapathError::TableSlotBusy`] when the table changed more than
    /// `lb_common::TABLE_SLOTS - 1` times within `lb_common::SLOT_REUSE_AFTER_MS`: nothing is
    /// written, call again after the wait it names. [`DatapathError::Map`].
    pub fn set_connect_table(
        &self,
        id: u32,
        policy: u32,
        servers: &[SocketAddr],
    ) -> Result<TableWrite, DatapathError> {
        let mut table = ConnectTable {
            policy,
            ..ConnectTable::default()
        };
        for (slot, addr) in table.servers.iter_mut().zip(servers) {
            *slot = connect_server(*addr);
        }
        table.count = u32::try_from(servers.len().min(MAX_CONNECT_SERVERS)).unwrap_or(0);
        let mut generations = self.tables.generations.lock().expect("poisoned");
        let (current, found) = self.current_table(id)?;
        let now = Instant::now();
        let g = generations.entry(id).or_insert_with(|| {
            if self.tables.inherited {
                Generations::found(current, now)
            } else {
                Generations::fresh(current)
            }
        });
        if g.current() != current {
            *g = Generations::found(current, now);
        }
        if found == table {
            return Ok(TableWrite::Unchanged {
                generation: current,
            });
        }
        let wait = g.wait(now);
        if !wait.is_zero() {
            return Err(DatapathError::TableSlotBusy { balancer: id, wait });
        }
        let (next, idle) = (g.next(), g.next_idle(now));
        self.maps
            .connect_tables
            .set(table_index(id, next), &table)?;
        self.maps.connect_current.set(id, &next)?;
        // Retired once the store returned: later than the programs could last see it current.
        g.advance(Instant::now());
        Ok(TableWrite::Written {
            generation: next,
            slot: slot_of(next),
            idle,
        })
    }

    /// Balancer `id`'s current generation and table, as the programs read them now.
    fn current_table(&self, id: u32) -> Result<(u32, ConnectTable), DatapathError> {
        let generation = self.maps.connect_current.get(id)?;
        let table = self.maps.connect_tables.get(table_index(id, generation))?;
        Ok((generation, table))
    }

    /// Balancer `id`'s current table generation (`LB_CONNECT_CURRENT`) and the servers of that
    /// table, as the connect programs read them now; `None` when the maps cannot be read.
    pub fn connect_table(&self, id: u32) -> Option<(u32, Vec<SocketAddr>)> {
        let (generation, table) = self.current_table(id).ok()?;
        let count = usize::try_from(table.count)
            .unwrap_or(0)
            .min(MAX_CONNECT_SERVERS);
        let servers = table.servers[..count]
            .iter()
            .filter_map(server_addr)
            .collect();
        Some((generation, servers))
    }

    /// Forget balancer `id`'s per-server counts of servers not in `servers` that count no
    /// socket (0, or below: a decrement that found its key deleted), so servers that come and
    /// go (discovery) do not fill the count map (4,096 keys for every balancer together).
    /// Returns how many keys were deleted.
    ///
    /// A socket the programs sent to such a server before the table changed can still be
    /// counted once it establishes: its key comes back (the increment creates it), and goes
    /// at a later prune once the socket closed. An increment that looked its key up just
    /// before this delete is lost, and its socket's decrement leaves the recreated key at -1,
    /// which the programs read as 0 and the next prune deletes.
    pub fn prune_connect_counts(&self, id: u32, servers: &[SocketAddr]) -> usize {
        let keep: Vec<_> = servers.iter().map(|a| connect_server(*a)).collect();
        self.maps.connect_counts.remove_where(|k, n| {
            k.balancer == id && !keep.contains(&k.server) && !i64::try_from(*n).is_ok_and(|v| v > 0)
        })
    }

    /// Established connect-time sockets of balancer `id`, per server address (servers with
    /// none are left out).
    pub fn connect_counts(&self, id: u32) -> HashMap<SocketAddr, u64> {
        let mut out = HashMap::new();
        let counts = self
            .maps
            .connect_counts
            .entries(|k, n| k.balancer == id && i64::try_from(*n).is_ok_and(|v| v > 0));
        for (key, n) in counts {
            if let Some(addr) = server_addr(&key.server) {
                *out.entry(addr).or_insert(0) += n;
            }
        }
        out
    }

    /// The connect-time sockets balancer `id`'s programs sent to `server`.
    pub fn connect_sockets(&self, id: u32, server: SocketAddr) -> Vec<crate::kill::ConnectSocket> {
        let want = connect_server(server);
        self.maps
            .connect_socks
            .entries(|_, o| o.count.balancer == id && o.count.server == want)
            .into_iter()
            .map(|(cookie, o)| crate::kill::ConnectSocket {
                cookie,
                tgid: o.tgid,
                sent: sent_tuple(&o, server),
            })
            .collect()
    }
}
