//! The kernel data path: loads `lb-ebpf`, attaches sockops to a cgroup v2 with a link and sk_msg
//! to the client sockhash, registers listeners, pairs and unpairs connections, and sums the
//! counters. The rooms beside it: [`probe`] (what the kernel and process allow), [`maps`]
//! (every map, declared once), [`keys`] (map keys from socket addresses), [`credit`] (the
//! bound on bytes queued toward a server), [`refresh`] (its request ring), [`btf`] (kernel
//! struct offsets), [`kernel_log`] (the programs' aya-log events in lb's log, target
//! `lb::kernel`), [`rings`] (the ring reader threads), [`syscall`] (the `bpf(2)` commands aya
//! keeps private), [`load`] (loading and attaching, each
//! forwarding mode on its own), [`handover`] (to and from another lb) and [`connect`]
//! (connect-time's kernel half: its links, pins, heartbeat, tables, fail fast and events).
//!
//! Minimum kernel: 5.8 for connect-time (the getpeername hooks), 5.15 for the splice
//! (`bpf_get_netns_cookie` in sockops and sk_msg); either runs without the other. The splice's
//! programs and links are held by this process only, so they are detached when lb exits,
//! however it exits; the connect-time ones are pinned when a bpffs is mounted
//! ([`connect::pins`], [`connect::heartbeat`]) and serve on until lb's heartbeat is older than
//! `datapath.orphan_timeout`.

mod btf;
mod connect;
mod credit;
mod fallback;
mod handover;
mod kernel_log;
mod keys;
mod load;
mod maps;
mod probe;
mod refresh;
mod rings;
mod syscall;

use std::{
    collections::HashMap,
    net::SocketAddr,
    os::fd::{AsFd, AsRawFd},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use aya::{Ebpf, maps::MapError, programs::ProgramError};
use lb_common::{BalancerStats, FlowState, NETNS_AMBIGUOUS, NETNS_SCOPE_ALL, SockKey};
use tracing::debug;

pub use self::fallback::FallbackReason;
pub use self::{
    btf::BtfError,
    connect::{
        TableWrite,
        events::{PassiveKind, PassiveSink},
        failfast::{jiffies, kernel_hz},
        heartbeat::{PinsStatus, boottime_ns},
        netns_probe::netns_probe_child,
        pins::{Cleaned, PinError, Pins, bpffs_mount, cleanup, resolve_dir},
        survey::Found,
        swap::TookOver,
    },
    credit::Pair,
    keys::sock_key,
    probe::{detect_cgroup2, probe_maps, probe_splice, resolve_cgroup},
};
use crate::config::Namespaces;

/// The compiled kernel programs (`lb-ebpf`, built by `build.rs`).
pub static EBPF_OBJ: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb-ebpf"));

/// Errors of the kernel data path.
#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    /// The process lacks capabilities the programs need (see `probe::privileges`).
    #[error(
        "not privileged: the kernel data path needs CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON (or CAP_SYS_ADMIN) in the effective set; missing {missing}"
    )]
    NotPrivileged {
        /// What is missing, by name.
        missing: String,
    },
    /// lb runs in a PID namespace of its own, so the process ids the connect-time programs
    /// record are not the ones lb sees (connect-time forwarding alone is off).
    #[error(
        "lb is not in the host's PID namespace (/proc/self/ns/pid is not the initial one): the connect-time programs record host process ids, which lb could not resolve to kill the sockets of clients in other network namespaces, and lb's own connects would be rewritten; {fix}",
        fix = crate::netns::HOST_PID_FIX
    )]
    NotHostPid,
    /// No cgroup v2 hierarchy found.
    #[error("no cgroup v2 mount found in /proc/mounts (set datapath.cgroup)")]
    NoCgroup2,
    /// The cgroup directory could not be opened.
    #[error("cannot open cgroup {path}")]
    OpenCgroup {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The directory is not in a cgroup v2 hierarchy.
    #[error(
        "{0} is not a cgroup v2 directory and no cgroup v2 is mounted below it (sockops attaches to cgroup v2 only)"
    )]
    NotCgroup2(PathBuf),
    /// The kernel lacks a program type, map type or helper.
    #[error("kernel lacks the {0}")]
    MissingFeature(&'static str),
    /// The object could not be loaded.
    #[error("loading the BPF object failed")]
    Load(#[source] aya::EbpfError),
    /// A program or map is missing from the object.
    #[error("BPF object has no {0}")]
    Missing(&'static str),
    /// A program failed to load or attach.
    #[error("program {program}")]
    Program {
        /// Program name.
        program: &'static str,
        /// Why.
        #[source]
        source: ProgramError,
    },
    /// A helper the splice needs to read the client's socket is refused (the splice is off,
    /// every connection is copied).
    #[error("the kernel refuses {helper} in sk_msg programs (needs CAP_PERFMON, no lockdown)")]
    BlockingHelper {
        /// The helper.
        helper: &'static str,
    },
    /// The kernel's BTF gave no struct offsets (the splice is off, every connection is copied).
    #[error(transparent)]
    Btf(#[from] BtfError),
    /// lb's network namespace cookie could not be read, so the programs could not tell lb's
    /// namespace from others.
    #[error("cannot read lb's network namespace cookie (SO_NETNS_COOKIE, kernel 5.14+)")]
    NetnsCookie(#[source] std::io::Error),
    /// Neither forwarding mode can run on this kernel: the splice lacks something and
    /// connect-time was not asked for or could not attach.
    #[error(
        "the kernel data path has nothing to run: the splice is unavailable ({splice}); connect-time: {connect}"
    )]
    NothingToRun {
        /// What the splice lacks.
        splice: String,
        /// Why connect-time is off.
        connect: String,
    },
    /// The connect-time programs were not attached because no balancer uses them.
    #[error("no balancer has forwarding = \"connect\"")]
    NotRequested,
    /// A program's attachment is not a BPF link (kernels before 5.7 attach cgroup programs
    /// without one), or a pinned link could not be opened.
    #[error("link of program {program}")]
    Link {
        /// Program name.
        program: &'static str,
        /// Why.
        #[source]
        source: aya::programs::links::LinkError,
    },
    /// A map's descriptor could not be copied (for a hand-over).
    #[error("cannot copy the descriptor of map {map}")]
    Dup {
        /// Map name.
        map: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The next slot of a connect-time table was current too recently to be written (see
    /// `lb_common::MAP_CONNECT_TABLES`); nothing was written.
    #[error(
        "the next connect-time table slot of balancer {balancer} is writable in {wait:?} (a program may still read it)"
    )]
    TableSlotBusy {
        /// Balancer id.
        balancer: u32,
        /// How long until it may be written.
        wait: std::time::Duration,
    },
    /// The connect-time pin directory.
    #[error(transparent)]
    Pins(#[from] PinError),
    /// A pinned link could not be opened or swapped to this build's program
    /// (`BPF_LINK_UPDATE`); it keeps running the program it had.
    #[error("cannot swap the pinned link of program {program} to this lb's program")]
    Swap {
        /// Program name.
        program: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A map operation failed.
    #[error("map {map}")]
    Map {
        /// Map name.
        map: &'static str,
        /// Why.
        #[source]
        source: MapError,
    },
}

/// The loaded kernel data path.
pub struct Datapath {
    /// The programs as loaded (`None` when adopted from an lb that handed them over); dropping
    /// it detaches sk_msg from the client sockhash.
    _ebpf: Option<Ebpf>,
    /// The cgroup links (sockops, and the connect-time programs when attached), by program
    /// name; a link stays attached while any process holds it or it is pinned.
    links: Mutex<Vec<(&'static str, handover::HeldLink)>>,
    cgroup: PathBuf,
    /// Every map; the sk_msg attachment lives as long as the client sockhash in it.
    maps: maps::Maps,
    /// The credit request ring, until [`Datapath::start_refresher`] takes it.
    refresh: Mutex<Option<refresh::RefreshRing>>,
    /// The connect-time event ring, until [`Datapath::start_passive`] takes it.
    events: Mutex<Option<connect::events::EventRing>>,
    /// The connect-time table generations lb wrote.
    tables: connect::Tables,
    /// The ring reader threads started, to wake and wait for at their end (see
    /// [`Datapath::wait_readers`]).
    readers: Mutex<Vec<rings::Reader>>,
    /// Cookies of sockets lb destroyed, with when, whose events are not the server's.
    ignored: Mutex<HashMap<u64, std::time::Instant>>,
    /// The reader of the programs' log records, until [`Datapath::start_kernel_log`] takes it;
    /// `None` when kernel logging is off or could not start.
    kernel_log: Mutex<Option<kernel_log::KernelLogger>>,
    /// Paired connections by key, for the credit refresher.
    pairs: Mutex<HashMap<SockKey, Arc<Pair>>>,
    /// `datapath.max_buffered_bytes` (bytes).
    max_buffered: u64,
    /// Why the connect-time programs are not attached (`None`: they are).
    connect_missing: Option<String>,
    /// Whether the sk_msg program can read client sockets, which the splice needs
    /// (`LB_KERNEL_READS`); without it lb never pairs and every connection is copied.
    splice: bool,
    /// The cookie of lb's network namespace (see [`probe::own_netns_cookie`]), the scope of a
    /// balancer with `namespaces = "own"`.
    own_netns: u64,
    /// The connect-time pin directory this lb holds, when its programs are pinned.
    pins: Option<Pins>,
    /// The pinned links to swap to this build's programs once its state is in the new maps
    /// of a rebuild (see [`connect::swap`]); `None` when none waits.
    takeover: Mutex<Option<Vec<connect::swap::Swap>>>,
    /// Cookies of the sockets an earlier lb's programs recorded in the maps a rebuild replaced
    /// (see [`connect::swap`]): a kill finds them by cookie in lb's network namespace. Set
    /// once, when the rebuild finishes.
    earlier_sockets: std::sync::OnceLock<std::collections::HashSet<u64>>,
}

impl std::fmt::Debug for Datapath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Datapath")
            .field("cgroup", &self.cgroup)
            .finish_non_exhaustive()
    }
}

/// What a data path is made of, loaded by this process ([`Datapath::load`]) or handed over by
/// another lb ([`Datapath::adopt`]).
struct Parts {
    /// The object as loaded; `None` when adopted.
    ebpf: Option<Ebpf>,
    links: Vec<(&'static str, handover::HeldLink)>,
    cgroup: PathBuf,
    maps: maps::Maps,
    rings: maps::Rings,
    kernel_log: Option<kernel_log::KernelLogger>,
    connect_missing: Option<String>,
    splice: bool,
    own_netns: u64,
    pins: Option<Pins>,
    /// An earlier lb wrote the connect-time maps (adopted pins, a hand-over).
    inherited: bool,
    /// Pinned links waiting for a rebuild's maps to be written (see [`connect::swap`]).
    takeover: Option<Vec<connect::swap::Swap>>,
}

impl Datapath {
    /// The one constructor: `parts` with the state this process starts with (no pair, no
    /// reader, no socket ignored).
    fn assemble(cfg: &crate::config::DatapathConfig, parts: Parts) -> Datapath {
        Datapath {
            _ebpf: parts.ebpf,
            links: Mutex::new(parts.links),
            cgroup: parts.cgroup,
            maps: parts.maps,
            refresh: Mutex::new(Some(parts.rings.refresh)),
            events: Mutex::new(Some(parts.rings.events)),
            tables: connect::Tables::new(parts.inherited),
            readers: Mutex::new(Vec::new()),
            ignored: Mutex::new(HashMap::new()),
            kernel_log: Mutex::new(parts.kernel_log),
            pairs: Mutex::new(HashMap::new()),
            max_buffered: cfg.max_buffered_bytes,
            connect_missing: parts.connect_missing,
            splice: parts.splice,
            own_netns: parts.own_netns,
            pins: parts.pins,
            takeover: Mutex::new(parts.takeover),
            earlier_sockets: std::sync::OnceLock::new(),
        }
    }
}

impl Datapath {
    /// Which network namespaces balancer `id`'s programs act in: with [`Namespaces::Own`] the
    /// connect programs rewrite, and sockops registers for the splice, only sockets of lb's
    /// own namespace (where its listeners live); with [`Namespaces::All`], sockets of every
    /// namespace under the cgroup. Written before the balancer's listeners are registered.
    ///
    /// # Errors
    /// [`DatapathError::Map`].
    pub fn set_namespaces(&self, id: u32, namespaces: Namespaces) -> Result<(), DatapathError> {
        let scope = match namespaces {
            Namespaces::Own => self.own_netns,
            Namespaces::All => NETNS_SCOPE_ALL,
        };
        self.maps.connect_scope.set(id, &scope)?;
        self.maps.scope.set(id, &scope)
    }

    /// The cgroup the sockops program is attached to.
    pub fn cgroup(&self) -> &Path {
        &self.cgroup
    }

    /// Tell the kernel which address is a listener of balancer `id`. An unspecified address
    /// (`0.0.0.0`, `[::]`) registers a wildcard for its port and address family only.
    ///
    /// # Errors
    /// [`DatapathError::Map`].
    pub fn add_listener(&self, addr: SocketAddr, id: u32) -> Result<(), DatapathError> {
        self.maps.listeners.insert(&keys::listener_key(addr), &id)
    }

    /// Find the client socket's netns cookie for an accepted connection; `None` when sockops did
    /// not register it (client outside the cgroup) or the tuple is ambiguous across namespaces.
    pub fn client_key(&self, peer: SocketAddr, local: SocketAddr) -> Option<SockKey> {
        let tuple = sock_key(peer, local, 0)?;
        let cookie = self.maps.netns.get(&tuple)?;
        if cookie == NETNS_AMBIGUOUS {
            debug!(%peer, "tuple registered from two namespaces; copying in userspace");
            return None;
        }
        Some(SockKey {
            netns_cookie: cookie,
            ..tuple
        })
    }

    /// Pair a client (by key) with its server socket, after lb copied `copied` bytes of the
    /// client's stream, and start redirecting once lb has copied every byte that took the copy
    /// path (the counting rule). `accepted` is lb's socket of that client. Sizes the server
    /// socket's send buffer for `max_buffered_bytes` first (see [`credit`]).
    ///
    /// The pair carries the cookie of the client socket the kernel registered (its flow), so
    /// it redirects that socket's sends only. `Ok(None)`: no flow, or `accepted` is no longer
    /// connected, so the flow may already be a newer socket's that reused the tuple (it can
    /// connect only once the old one's reset reached `accepted`).
    ///
    /// # Errors
    /// [`DatapathError::Map`]; the caller then copies in userspace.
    pub fn pair(
        &self,
        key: SockKey,
        accepted: &impl AsFd,
        server: &(impl AsRawFd + AsFd),
        copied: u64,
    ) -> Result<Option<Arc<Pair>>, DatapathError> {
        if !self.splice {
            return Ok(None);
        }
        let Some(flow) = self.flow(&key) else {
            return Ok(None);
        };
        // Read after the flow: if this connection was reset before the flow was read, the
        // check fails here (getpeername answers ENOTCONN once a socket is closed).
        if socket2::SockRef::from(accepted).peer_addr().is_err() {
            return Ok(None);
        }
        let limit = credit::size_server_socket(server, self.max_buffered);
        let pair = Arc::new(Pair::new(
            key,
            server.as_raw_fd(),
            limit,
            copied,
            flow.cookie,
        ));
        self.maps.servers.insert_socket(&key, server)?;
        self.pairs
            .lock()
            .expect("poisoned")
            .insert(key, pair.clone());
        if let Err(e) = self.maps.pairs.insert(&key, &pair.ctl()) {
            self.unpair(&pair);
            return Err(e);
        }
        Ok(Some(pair))
    }

    /// Bytes the client sent through the normal path (`FlowState::passed`) and redirected.
    pub fn flow(&self, key: &SockKey) -> Option<FlowState> {
        self.maps.flows.get(key)
    }

    /// Take a pair out of the maps: sends take the copy path from now on. The server socket is
    /// removed from the sockhash before lb closes it. A pair whose tuple a newer connection
    /// paired since (the client reused it) leaves that connection's entries alone: pairing
    /// replaced its own.
    pub fn unpair(&self, pair: &Pair) {
        pair.stop();
        let key = pair.key();
        let mut pairs = self.pairs.lock().expect("poisoned");
        if pairs.get(&key).is_some_and(|p| std::ptr::eq(&**p, pair)) {
            self.maps.pairs.remove(&key);
            self.maps.servers.remove(&key);
            pairs.remove(&key);
        }
    }

    /// Splice counters of balancer `id`, summed over CPUs.
    pub fn stats(&self, id: u32) -> BalancerStats {
        let mut out = BalancerStats::default();
        for v in self.maps.stats.per_cpu(id) {
            out.add(&v);
        }
        for v in self.maps.connect_stats.per_cpu(id) {
            out.add(&v);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use object::{Object as _, ObjectSymbol as _};

    use super::*;

    /// Every map, program and global name lb looks up (the constants in `lb_common`) is in the
    /// embedded object: maps and programs as aya's own parser finds them, globals as ELF symbols.
    #[test]
    fn embedded_object_has_every_name() {
        let obj = aya_obj::Object::parse(EBPF_OBJ).expect("lb-ebpf parses");
        for name in lb_common::MAP_NAMES {
            assert!(
                obj.maps.contains_key(name),
                "no map {name} in {:?}",
                obj.maps.keys()
            );
        }
        for name in lb_common::PROG_NAMES {
            assert!(
                obj.programs.contains_key(name),
                "no program {name} in {:?}",
                obj.programs.keys()
            );
        }
        let elf = object::File::parse(EBPF_OBJ).expect("lb-ebpf is ELF");
        let symbols: Vec<&str> = elf.symbols().filter_map(|s| s.name().ok()).collect();
        for name in lb_common::GLOBAL_NAMES {
            assert!(symbols.contains(&name), "no global {name} in {symbols:?}");
        }
    }

    #[test]
    fn error_chain_joins_sources() {
        let e = DatapathError::Btf(BtfError::Read {
            path: "/sys/kernel/btf/vmlinux".into(),
            source: std::io::Error::from_raw_os_error(libc::ENOENT),
        });
        assert_eq!(
            crate::errors::chain(&e),
            "cannot read /sys/kernel/btf/vmlinux: No such file or directory (os error 2)"
        );
    }
}
