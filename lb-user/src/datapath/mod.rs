//! Datapath: loads `lb-ebpf`, attaches sockops to a cgroup v2 and sk_msg to the client sockhash,
//! and owns every BPF map behind small typed wrappers. Only this module touches maps.
//!
//! Minimum kernel: 5.15 (`bpf_get_netns_cookie` in sockops and sk_msg). Programs and links are
//! held by this process only (nothing is pinned), so they are detached when lb exits, however it
//! exits.

use std::{
    collections::HashMap as StdHashMap,
    fs::File,
    net::{IpAddr, SocketAddr},
    os::fd::{AsRawFd, RawFd},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use aya::{
    Ebpf,
    maps::{HashMap, MapData, MapError, PerCpuArray, RingBuf, SockHash},
    programs::{CgroupAttachMode, ProgramError, SkMsg, SockOps},
};
use lb_common::{
    AF_INET, AF_INET6, BalancerStats, FlowState, GLOBAL_BLOCKING_SPLICE, GLOBAL_OFF_F_FLAGS,
    GLOBAL_OFF_SK_SOCKET, GLOBAL_OFF_SNDTIMEO, GLOBAL_OFF_SOCKET_FILE, ListenerKey, MAP_CLIENTS,
    MAP_FLOWS, MAP_LISTENERS, MAP_NETNS, MAP_PAIRS, MAP_REFRESH, MAP_SERVERS, MAP_STATS, MODE_PASS,
    MODE_REDIRECT, NETNS_AMBIGUOUS, PASS_REASONS, PROG_SK_MSG, PROG_SOCKOPS, PairCtl,
    RefreshRequest, SockKey,
};
use tracing::{debug, info, warn};

/// The compiled kernel programs.
pub static EBPF_OBJ: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb-ebpf"));

/// Errors of the kernel data path.
#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    /// Not root / no CAP_BPF and CAP_NET_ADMIN.
    #[error("not privileged: loading BPF programs needs root (CAP_BPF, CAP_NET_ADMIN)")]
    NotPrivileged,
    /// Root without `CAP_PERFMON` (or `CAP_SYS_ADMIN`), e.g. in a container that drops it.
    #[error(
        "missing CAP_PERFMON (or CAP_SYS_ADMIN): the verifier allows the programs' pointer arithmetic only with it"
    )]
    NoPerfmon,
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
    #[error("{0} is not a cgroup v2 directory (sockops attaches to cgroup v2 only)")]
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

fn map_err(map: &'static str) -> impl FnOnce(MapError) -> DatapathError {
    move |source| DatapathError::Map { map, source }
}

/// Find the cgroup v2 mount point in `/proc/mounts`.
///
/// # Errors
/// [`DatapathError::NoCgroup2`].
pub fn detect_cgroup2() -> Result<PathBuf, DatapathError> {
    let mounts = std::fs::read_to_string("/proc/mounts").map_err(|_| DatapathError::NoCgroup2)?;
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_dev, dir, fstype) = (f.next()?, f.next()?, f.next()?);
            (fstype == "cgroup2").then(|| PathBuf::from(dir))
        })
        .next()
        .ok_or(DatapathError::NoCgroup2)
}

/// Check every kernel feature the splice needs, naming the first one missing: program types
/// (sockops, sk_msg), map types (sockhash, LRU hash, per-CPU array, ring buffer) and helpers
/// (`bpf_get_netns_cookie` in sockops and sk_msg, `bpf_msg_redirect_hash`).
///
/// # Errors
/// [`DatapathError::MissingFeature`] naming it; the daemon then copies in userspace.
pub fn probe_kernel() -> Result<(), DatapathError> {
    use aya::{maps::MapType, programs::ProgramType, sys};
    use sys::BpfHelper as H;
    for (ty, name) in [
        (ProgramType::SockOps, "sockops program type"),
        (ProgramType::SkMsg, "sk_msg program type"),
    ] {
        if !sys::is_program_supported(ty).unwrap_or(false) {
            return Err(DatapathError::MissingFeature(name));
        }
    }
    for (ty, name) in [
        (MapType::SockHash, "sockhash map"),
        (MapType::LruHash, "LRU hash map"),
        (MapType::PerCpuArray, "per-CPU array map"),
        (MapType::RingBuf, "ring buffer map (5.8+)"),
    ] {
        if !sys::is_map_supported(ty).unwrap_or(false) {
            return Err(DatapathError::MissingFeature(name));
        }
    }
    for (ty, helper, name) in [
        (
            ProgramType::SockOps,
            H::BPF_FUNC_get_netns_cookie,
            "bpf_get_netns_cookie in sockops (5.15+)",
        ),
        (
            ProgramType::SkMsg,
            H::BPF_FUNC_get_netns_cookie,
            "bpf_get_netns_cookie in sk_msg (5.15+)",
        ),
        (
            ProgramType::SkMsg,
            H::BPF_FUNC_msg_redirect_hash,
            "bpf_msg_redirect_hash",
        ),
    ] {
        if !sys::is_helper_supported(ty, helper).unwrap_or(false) {
            return Err(DatapathError::MissingFeature(name));
        }
    }
    Ok(())
}

/// Whether this process has `CAP_PERFMON` (bit 38) or `CAP_SYS_ADMIN` (bit 21) in its effective
/// set (`CapEff` in `/proc/self/status`; bit numbers from `<linux/capability.h>`).
fn has_perfmon() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << 38 | 1 << 21) != 0)
}

/// What the past-credit redirect of blocking clients needs beyond the splice itself: the helpers
/// `bpf_skc_to_tcp_sock` and `bpf_probe_read_kernel` in sk_msg (`CAP_PERFMON`, no lockdown) and
/// the kernel's BTF for the struct offsets.
///
/// # Errors
/// The first thing missing, as a sentence for the log.
fn probe_blocking_splice() -> Result<crate::kbtf::SockOffsets, String> {
    use aya::{programs::ProgramType, sys};
    use sys::BpfHelper as H;
    for (helper, name) in [
        (H::BPF_FUNC_skc_to_tcp_sock, "bpf_skc_to_tcp_sock"),
        (H::BPF_FUNC_probe_read_kernel, "bpf_probe_read_kernel"),
    ] {
        if !sys::is_helper_supported(ProgramType::SkMsg, helper).unwrap_or(false) {
            return Err(format!(
                "the kernel refuses {name} in sk_msg programs (needs CAP_PERFMON, no lockdown)"
            ));
        }
    }
    crate::kbtf::sock_offsets(Path::new(crate::kbtf::VMLINUX_BTF))
}

/// Kernel splice counters of one balancer, summed over CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpliceStats {
    /// Client-to-server bytes redirected by sk_msg.
    pub redirected_bytes: u64,
    /// Client-to-server bytes that took the copy path.
    pub passed_bytes: u64,
    /// Sends that took the copy path, by [`lb_common::PassReason`] index.
    pub pass: [u64; PASS_REASONS],
    /// Client sockets registered by sockops.
    pub registered: u64,
    /// Credit refresh requests.
    pub refresh_requests: u64,
    /// Sends of blocking clients redirected past the credit (each waits in the kernel if the
    /// server socket has no room).
    pub blocking_redirects: u64,
}

/// Build the map key of a client connection from lb's accepted socket: `peer` is the client's
/// address, `local` the listener address, `netns_cookie` the client socket's namespace.
pub fn sock_key(peer: SocketAddr, local: SocketAddr, netns_cookie: u64) -> Option<SockKey> {
    let (family, client_ip_be) = ip_words(peer.ip())?;
    let (lfamily, lb_ip_be) = ip_words(local.ip())?;
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

/// Address → (family, words in network byte order). IPv4-mapped IPv6 counts as IPv4.
fn ip_words(ip: IpAddr) -> Option<(u32, [u32; 4])> {
    match ip {
        IpAddr::V4(v4) => Some((AF_INET, [u32::from_ne_bytes(v4.octets()), 0, 0, 0])),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return ip_words(IpAddr::V4(v4));
            }
            let o = v6.octets();
            let w = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            Some((AF_INET6, [w(0), w(4), w(8), w(12)]))
        }
    }
}

/// One paired connection as the credit refresher sees it.
#[derive(Debug)]
pub struct Pair {
    key: SockKey,
    server_fd: RawFd,
    ctl: Mutex<PairCtl>,
    /// The server socket's send buffer as the kernel set it (bytes, at most
    /// `max_buffered_bytes`).
    limit: u64,
}

impl Pair {
    /// Credit bound (bytes): three quarters of the socket buffer, leaving room for the kernel's
    /// per-buffer overhead, so a redirected send never meets a full socket.
    fn credit_cap(&self) -> u64 {
        self.limit / 4 * 3
    }

    /// Set `credit_end`/`refresh_at` from the server socket's queue (`SIOCOUTQ`): the program may
    /// redirect until the queue would pass the cap, and asks again a quarter of the way there.
    fn grant(&self, ctl: &mut PairCtl, redirected: u64) {
        let outq = outq_bytes(self.server_fd).unwrap_or(u64::MAX);
        let room = self.credit_cap().saturating_sub(outq);
        ctl.credit_end = redirected + room;
        ctl.refresh_at = redirected + room / 4;
    }

    /// The map key.
    pub fn key(&self) -> SockKey {
        self.key
    }
}

/// The loaded kernel data path.
pub struct Datapath {
    _ebpf: Ebpf,
    /// The client sockhash; the sk_msg attachment lives as long as it does.
    _clients: SockHash<MapData, SockKey>,
    cgroup: PathBuf,
    listeners: Mutex<HashMap<MapData, ListenerKey, u32>>,
    servers: Mutex<SockHash<MapData, SockKey>>,
    netns: Mutex<HashMap<MapData, SockKey, u64>>,
    flows: Mutex<HashMap<MapData, SockKey, FlowState>>,
    pairs_map: Mutex<HashMap<MapData, SockKey, PairCtl>>,
    stats: Mutex<PerCpuArray<MapData, BalancerStats>>,
    refresh: Mutex<Option<RingBuf<MapData>>>,
    pairs: Mutex<StdHashMap<SockKey, Arc<Pair>>>,
    max_buffered: u64,
}

impl std::fmt::Debug for Datapath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Datapath")
            .field("cgroup", &self.cgroup)
            .finish_non_exhaustive()
    }
}

impl Datapath {
    /// Load the programs, attach sockops to `cfg.cgroup` (detected when `None`) with a link and
    /// sk_msg to the client sockhash. `cfg.blocking_splice` is honoured when the kernel allows it;
    /// otherwise it is turned off alone, with a warning naming why.
    ///
    /// # Errors
    /// [`DatapathError`] naming what is missing: privileges, cgroup v2, a program type, or the
    /// load/attach step that failed.
    pub fn load(cfg: &crate::config::DatapathConfig) -> Result<Datapath, DatapathError> {
        let (cgroup, max_buffered) = (cfg.cgroup.as_deref(), cfg.max_buffered_bytes);
        if !nix::unistd::geteuid().is_root() {
            return Err(DatapathError::NotPrivileged);
        }
        if !has_perfmon() {
            return Err(DatapathError::NoPerfmon);
        }
        let cgroup = match cgroup {
            Some(p) => p.to_path_buf(),
            None => detect_cgroup2()?,
        };
        let cgroup_file = File::open(&cgroup).map_err(|source| DatapathError::OpenCgroup {
            path: cgroup.clone(),
            source,
        })?;
        let is_v2 = nix::sys::statfs::fstatfs(&cgroup_file)
            .is_ok_and(|st| st.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC);
        if !is_v2 {
            return Err(DatapathError::NotCgroup2(cgroup));
        }
        probe_kernel()?;
        let offsets = if cfg.blocking_splice {
            probe_blocking_splice()
                .inspect_err(|why| {
                    warn!(reason = %why, "blocking clients will take the copy path when a server socket is full (datapath.blocking_splice off)");
                })
                .ok()
        } else {
            info!(
                "datapath.blocking_splice = false: blocking clients take the copy path when a server socket is full"
            );
            None
        };
        let blocking = u32::from(offsets.is_some());
        let offsets = offsets.unwrap_or_default();
        let mut ebpf = aya::EbpfLoader::new()
            .override_global(GLOBAL_BLOCKING_SPLICE, &blocking, true)
            .override_global(GLOBAL_OFF_SK_SOCKET, &offsets.sk_socket, true)
            .override_global(GLOBAL_OFF_SOCKET_FILE, &offsets.socket_file, true)
            .override_global(GLOBAL_OFF_F_FLAGS, &offsets.file_f_flags, true)
            .override_global(GLOBAL_OFF_SNDTIMEO, &offsets.sk_sndtimeo, true)
            .load(EBPF_OBJ)
            .map_err(DatapathError::Load)?;

        let take = |ebpf: &mut Ebpf, name: &'static str| {
            ebpf.take_map(name).ok_or(DatapathError::Missing(name))
        };
        let clients: SockHash<MapData, SockKey> =
            SockHash::try_from(take(&mut ebpf, MAP_CLIENTS)?).map_err(map_err(MAP_CLIENTS))?;
        let servers =
            SockHash::try_from(take(&mut ebpf, MAP_SERVERS)?).map_err(map_err(MAP_SERVERS))?;
        let listeners =
            HashMap::try_from(take(&mut ebpf, MAP_LISTENERS)?).map_err(map_err(MAP_LISTENERS))?;
        let netns = HashMap::try_from(take(&mut ebpf, MAP_NETNS)?).map_err(map_err(MAP_NETNS))?;
        let flows = HashMap::try_from(take(&mut ebpf, MAP_FLOWS)?).map_err(map_err(MAP_FLOWS))?;
        let pairs_map =
            HashMap::try_from(take(&mut ebpf, MAP_PAIRS)?).map_err(map_err(MAP_PAIRS))?;
        let stats =
            PerCpuArray::try_from(take(&mut ebpf, MAP_STATS)?).map_err(map_err(MAP_STATS))?;
        let refresh =
            RingBuf::try_from(take(&mut ebpf, MAP_REFRESH)?).map_err(map_err(MAP_REFRESH))?;

        let prog_err =
            |program: &'static str| move |source| DatapathError::Program { program, source };
        let sk_msg: &mut SkMsg = ebpf
            .program_mut(PROG_SK_MSG)
            .ok_or(DatapathError::Missing(PROG_SK_MSG))?
            .try_into()
            .map_err(prog_err(PROG_SK_MSG))?;
        sk_msg.load().map_err(prog_err(PROG_SK_MSG))?;
        sk_msg.attach(clients.fd()).map_err(prog_err(PROG_SK_MSG))?;

        let sockops: &mut SockOps = ebpf
            .program_mut(PROG_SOCKOPS)
            .ok_or(DatapathError::Missing(PROG_SOCKOPS))?
            .try_into()
            .map_err(prog_err(PROG_SOCKOPS))?;
        sockops.load().map_err(prog_err(PROG_SOCKOPS))?;
        sockops
            .attach(&cgroup_file, CgroupAttachMode::Single)
            .map_err(prog_err(PROG_SOCKOPS))?;
        info!(cgroup = %cgroup.display(), "kernel data path attached (sockops + sk_msg upstream splice)");
        // Loading parsed the kernel's BTF (megabytes) and freed it again; hand those pages back
        // so a node daemon's resident size reflects what it holds.
        // (glibc only; musl returns memory by itself.)
        #[cfg(target_env = "gnu")]
        // SAFETY: malloc_trim only releases free heap memory; it has no preconditions.
        #[expect(unsafe_code, reason = "glibc's malloc_trim has no safe wrapper")]
        unsafe {
            libc::malloc_trim(0);
        }
        let dp = Datapath {
            _ebpf: ebpf,
            _clients: clients,
            cgroup,
            listeners: Mutex::new(listeners),
            servers: Mutex::new(servers),
            netns: Mutex::new(netns),
            flows: Mutex::new(flows),
            pairs_map: Mutex::new(pairs_map),
            stats: Mutex::new(stats),
            refresh: Mutex::new(Some(refresh)),
            pairs: Mutex::new(StdHashMap::new()),
            max_buffered,
        };
        Ok(dp)
    }

    /// The cgroup the sockops program is attached to.
    pub fn cgroup(&self) -> &Path {
        &self.cgroup
    }

    /// Tell the kernel which addresses are lb's listeners for balancer `id`. Unspecified addresses
    /// (`0.0.0.0`, `[::]`) register a wildcard for their port and address family only.
    ///
    /// # Errors
    /// [`DatapathError::Map`].
    pub fn add_listener(&self, addr: SocketAddr, id: u32) -> Result<(), DatapathError> {
        let mut map = self.listeners.lock().expect("poisoned");
        for key in listener_keys(addr) {
            map.insert(key, id, 0).map_err(map_err(MAP_LISTENERS))?;
        }
        Ok(())
    }

    /// Find the client socket's netns cookie for an accepted connection; `None` when sockops did
    /// not register it (client outside the cgroup) or the tuple is ambiguous across namespaces.
    pub fn client_key(&self, peer: SocketAddr, local: SocketAddr) -> Option<SockKey> {
        let tuple = sock_key(peer, local, 0)?;
        let cookie = self.netns.lock().expect("poisoned").get(&tuple, 0).ok()?;
        if cookie == NETNS_AMBIGUOUS {
            debug!(%peer, "tuple registered from two namespaces; copying in userspace");
            return None;
        }
        Some(SockKey {
            netns_cookie: cookie,
            ..tuple
        })
    }

    /// Pair a client (by key) with its server socket and start redirecting once lb has copied
    /// `copied` bytes (the counting rule).
    ///
    /// # Errors
    /// [`DatapathError::Map`]; the caller then copies in userspace.
    pub fn pair(
        &self,
        key: SockKey,
        server: &(impl AsRawFd + std::os::fd::AsFd),
    ) -> Result<Arc<Pair>, DatapathError> {
        // The server socket holds at most `limit` bytes (the kernel doubles SO_SNDBUF for its
        // bookkeeping), which bounds lb's own copies and a blocking client waiting in the kernel;
        // the buffer is set 64 KiB short of the limit because the kernel checks for room before
        // each new skb and may pass its buffer by up to one (64 KiB with GSO). The credit (3/4 of
        // the buffer) must be what stops redirecting a non-blocking client: when a server socket
        // is full, its redirected send fails with EAGAIN while its own socket stays writable and
        // is never woken again (measured here: the client hangs).
        let want = (self.max_buffered / 2)
            .saturating_sub(32 * 1024)
            .max(self.max_buffered / 4);
        let buf = usize::try_from(want).unwrap_or(usize::MAX);
        if let Err(e) =
            nix::sys::socket::setsockopt(server, nix::sys::socket::sockopt::SndBufForce, &buf)
        {
            debug!(error = %e, "SO_SNDBUFFORCE refused; relying on autotuning");
        }
        // What the kernel set (twice the request), so the credit never exceeds the real buffer.
        let limit = nix::sys::socket::getsockopt(server, nix::sys::socket::sockopt::SndBuf)
            .ok()
            .and_then(|b| u64::try_from(b).ok())
            .map_or(want * 2, |b| b.min(self.max_buffered));
        let ctl = PairCtl {
            copied: 0,
            credit_end: limit / 4 * 3,
            refresh_at: limit / 4,
            mode: MODE_REDIRECT,
            _pad: 0,
        };
        let pair = Arc::new(Pair {
            key,
            server_fd: server.as_raw_fd(),
            ctl: Mutex::new(ctl),
            limit,
        });
        self.servers
            .lock()
            .expect("poisoned")
            .insert(key, server.as_raw_fd(), 0)
            .map_err(map_err(MAP_SERVERS))?;
        self.pairs
            .lock()
            .expect("poisoned")
            .insert(key, pair.clone());
        if let Err(e) = self.pairs_map.lock().expect("poisoned").insert(key, ctl, 0) {
            self.unpair(&pair);
            return Err(map_err(MAP_PAIRS)(e));
        }
        Ok(pair)
    }

    /// Publish how many bytes lb has copied from the accepted socket to the server socket.
    pub fn set_copied(&self, pair: &Pair, copied: u64) {
        let mut ctl = pair.ctl.lock().expect("poisoned");
        ctl.copied = copied;
        // lb's own writes share the server socket with the redirected bytes: recompute the credit
        // from the socket's queue so that both together stay within the bound.
        let redirected = self.flow(&pair.key).map_or(0, |f| f.redirected);
        pair.grant(&mut ctl, redirected);
        if let Err(e) = self
            .pairs_map
            .lock()
            .expect("poisoned")
            .insert(pair.key, *ctl, 0)
        {
            warn!(error = %e, "cannot publish copied bytes");
        }
    }

    /// Bytes the client sent through the normal path (`FlowState::passed`) and redirected.
    pub fn flow(&self, key: &SockKey) -> Option<FlowState> {
        self.flows.lock().expect("poisoned").get(key, 0).ok()
    }

    /// Take a pair out of the maps: sends take the copy path from now on. The server socket is
    /// removed from the sockhash before lb closes it.
    pub fn unpair(&self, pair: &Pair) {
        {
            let mut ctl = pair.ctl.lock().expect("poisoned");
            ctl.mode = MODE_PASS;
        }
        let _ = self.pairs_map.lock().expect("poisoned").remove(&pair.key);
        let _ = self.servers.lock().expect("poisoned").remove(&pair.key);
        self.pairs.lock().expect("poisoned").remove(&pair.key);
    }

    /// Forget a connection's flow and namespace entries (after it ended).
    pub fn forget(&self, key: &SockKey) {
        let _ = self.flows.lock().expect("poisoned").remove(key);
        let tuple = SockKey {
            netns_cookie: 0,
            ..*key
        };
        let mut netns = self.netns.lock().expect("poisoned");
        if netns.get(&tuple, 0).ok() == Some(key.netns_cookie) {
            let _ = netns.remove(&tuple);
        }
    }

    /// Splice counters of balancer `id`, summed over CPUs.
    pub fn stats(&self, id: u32) -> SpliceStats {
        let mut out = SpliceStats::default();
        if let Ok(values) = self.stats.lock().expect("poisoned").get(&id, 0) {
            for v in values.iter() {
                out.redirected_bytes += v.redirected_bytes;
                out.passed_bytes += v.passed_bytes;
                for (o, p) in out.pass.iter_mut().zip(v.pass) {
                    *o += p;
                }
                out.registered += v.registered;
                out.refresh_requests += v.refresh_requests;
                out.blocking_redirects += v.blocking_redirects;
            }
        }
        out
    }

    /// Serve credit refresh requests on a dedicated thread until `cancel` fires: for each, read
    /// the server socket's unsent+unacked bytes (SIOCOUTQ) and grant credit so that at most
    /// `max_buffered_bytes` are queued toward the server.
    ///
    /// # Errors
    /// The thread could not be spawned.
    pub fn start_refresher(
        self: &Arc<Self>,
        cancel: tokio_util::sync::CancellationToken,
    ) -> std::io::Result<()> {
        let Some(mut ring) = self.refresh.lock().expect("poisoned").take() else {
            return Ok(());
        };
        let this = self.clone();
        std::thread::Builder::new()
            .name("lb-credit".into())
            .spawn(move || {
                use std::os::fd::AsFd as _;
                while !cancel.is_cancelled() {
                    let mut fds = [nix::poll::PollFd::new(
                        ring.as_fd(),
                        nix::poll::PollFlags::POLLIN,
                    )];
                    if nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(100u16)).is_err() {
                        continue;
                    }
                    let mut reqs = Vec::new();
                    while let Some(item) = ring.next() {
                        if let Some(req) = read_request(&item) {
                            reqs.push(req);
                        }
                    }
                    for req in reqs {
                        this.refresh_one(&req.key);
                    }
                }
            })?;
        Ok(())
    }

    fn refresh_one(&self, key: &SockKey) {
        let Some(pair) = self.pairs.lock().expect("poisoned").get(key).cloned() else {
            return;
        };
        let Some(flow) = self.flow(key) else { return };
        let mut ctl = pair.ctl.lock().expect("poisoned");
        if ctl.mode != MODE_REDIRECT {
            return;
        }
        pair.grant(&mut ctl, flow.redirected);
        if let Err(e) = self
            .pairs_map
            .lock()
            .expect("poisoned")
            .insert(pair.key, *ctl, 0)
        {
            warn!(error = %e, "cannot grant credit");
        }
    }
}

/// The [`ListenerKey`]s of one listener: a wildcard of its own family for `0.0.0.0`/`[::]`
/// (lb binds IPv6 listeners `IPV6_V6ONLY`, so `[::]` never accepts IPv4 clients and must not
/// claim them from a `0.0.0.0` listener of another balancer), its address otherwise.
fn listener_keys(addr: SocketAddr) -> Vec<ListenerKey> {
    let port = u32::from(addr.port());
    if addr.ip().is_unspecified() {
        let family = if addr.is_ipv6() { AF_INET6 } else { AF_INET };
        return vec![ListenerKey {
            ip_be: [0; 4],
            port,
            family,
        }];
    }
    ip_words(addr.ip())
        .map(|(family, ip_be)| {
            vec![ListenerKey {
                ip_be,
                port,
                family,
            }]
        })
        .unwrap_or_default()
}

/// Decode one ring buffer record (a [`RefreshRequest`], native byte order).
fn read_request(bytes: &[u8]) -> Option<RefreshRequest> {
    let word = |i: usize| -> Option<u64> {
        Some(u64::from_ne_bytes(bytes.get(i..i + 8)?.try_into().ok()?))
    };
    let half = |i: usize| -> Option<u32> {
        Some(u32::from_ne_bytes(bytes.get(i..i + 4)?.try_into().ok()?))
    };
    let mut key = SockKey::default();
    for (n, w) in key.client_ip_be.iter_mut().enumerate() {
        *w = half(n * 4)?;
    }
    for (n, w) in key.lb_ip_be.iter_mut().enumerate() {
        *w = half(16 + n * 4)?;
    }
    key.client_port = half(32)?;
    key.lb_port = half(36)?;
    key.netns_cookie = word(40)?;
    key.family = half(48)?;
    Some(RefreshRequest {
        key,
        redirected: word(56)?,
    })
}

/// Unsent plus unacknowledged bytes in a TCP socket's send queue (`SIOCOUTQ`).
fn outq_bytes(fd: RawFd) -> Option<u64> {
    let mut n: libc::c_int = 0;
    // SAFETY: SIOCOUTQ writes one c_int through the pointer, which points to a live c_int.
    #[expect(unsafe_code, reason = "SIOCOUTQ has no safe wrapper")]
    let rc = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut n) };
    (rc == 0).then(|| u64::try_from(n).unwrap_or(0))
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
        let v4 = listener_keys("0.0.0.0:80".parse().unwrap());
        assert_eq!(v4.len(), 1);
        assert_eq!(
            (v4[0].family, v4[0].port, v4[0].ip_be),
            (AF_INET, 80, [0; 4])
        );
        // IPV6_V6ONLY: `[::]` is an IPv6 wildcard only (it used to register an IPv4 one too,
        // which charged a `0.0.0.0` listener's clients to the `[::]` listener's balancer).
        let v6 = listener_keys("[::]:80".parse().unwrap());
        assert_eq!(v6.len(), 1);
        assert_eq!(
            (v6[0].family, v6[0].port, v6[0].ip_be),
            (AF_INET6, 80, [0; 4])
        );
    }
}
