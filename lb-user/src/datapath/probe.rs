//! Feature probes run before anything is loaded: privileges, the cgroup v2 to attach to (from
//! `/proc/mounts` or the configured directory), the program types, map types and helpers the
//! splice needs, and what the blocking-client splice needs beyond it (two helpers and the
//! kernel's BTF). Each names the first thing missing.
//!
//! Minimum kernel: 5.15 for the splice; the probes themselves run on any kernel.

use std::{
    fs::File,
    path::{Path, PathBuf},
};

use tracing::{info, warn};

use super::{
    DatapathError,
    btf::{self, SockOffsets},
};

/// `SO_NETNS_COOKIE` from `<asm-generic/socket.h>` (5.14+), the value on every architecture
/// but mips, parisc and sparc; libc 0.2 does not export it.
const SO_NETNS_COOKIE: libc::c_int = 71;

/// The cookie of lb's network namespace, where its listeners live: `SO_NETNS_COOKIE` of a
/// socket made for the purpose, the value `bpf_get_netns_cookie` gives the programs for a
/// socket of that namespace.
///
/// # Errors
/// [`DatapathError::NetnsCookie`]: no socket, or a kernel before 5.14.
pub(super) fn own_netns_cookie() -> Result<u64, DatapathError> {
    use std::os::fd::AsRawFd as _;
    let sock = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::DGRAM, None)
        .map_err(DatapathError::NetnsCookie)?;
    let mut cookie: u64 = 0;
    let mut len = libc::socklen_t::try_from(size_of::<u64>()).unwrap_or(8);
    // SAFETY: getsockopt writes at most `len` (8) bytes through a pointer to a live u64 and
    // the new length through a pointer to a live socklen_t.
    #[expect(unsafe_code, reason = "nix 0.29 has no SO_NETNS_COOKIE option")]
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            std::ptr::addr_of_mut!(cookie).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(DatapathError::NetnsCookie(std::io::Error::last_os_error()));
    }
    Ok(cookie)
}

/// Find the cgroup v2 mount point in `/proc/mounts`.
///
/// # Errors
/// [`DatapathError::NoCgroup2`].
pub fn detect_cgroup2() -> Result<PathBuf, DatapathError> {
    let mounts = std::fs::read_to_string("/proc/mounts").map_err(|_| DatapathError::NoCgroup2)?;
    cgroup2_in(&mounts).ok_or(DatapathError::NoCgroup2)
}

/// The first `cgroup2` mount point in the text of `/proc/mounts`.
fn cgroup2_in(mounts: &str) -> Option<PathBuf> {
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_dev, dir, fstype) = (f.next()?, f.next()?, f.next()?);
            (fstype == "cgroup2").then(|| PathBuf::from(dir))
        })
        .next()
}

/// Whether `dir` is in a cgroup v2 file system.
fn is_cgroup2(dir: &Path) -> bool {
    nix::sys::statfs::statfs(dir)
        .is_ok_and(|st| st.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC)
}

/// The cgroup v2 mount at or below `root` in the text of `/proc/mounts` nearest to `root` (the
/// fewest path components), e.g. `/host/sys/fs/cgroup/unified` below `/host/sys/fs/cgroup` on
/// a host with the hybrid layout (cgroup v1 controllers at `/sys/fs/cgroup/*`, v2 at
/// `/sys/fs/cgroup/unified`).
fn cgroup2_under(mounts: &str, root: &Path) -> Option<PathBuf> {
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_dev, dir, fstype) = (f.next()?, f.next()?, f.next()?);
            let dir = PathBuf::from(dir);
            (fstype == "cgroup2" && dir.starts_with(root)).then_some(dir)
        })
        .min_by_key(|d| d.components().count())
}

/// The cgroup v2 directory `configured` stands for: itself when it is in a cgroup v2 file
/// system, else the cgroup v2 mount nearest below it (a host's `/sys/fs/cgroup` mounted into a
/// container, whatever the host's layout: unified, or hybrid with v2 at `unified/`).
///
/// # Errors
/// [`DatapathError::NotCgroup2`] when neither holds.
pub fn resolve_cgroup(configured: &Path) -> Result<PathBuf, DatapathError> {
    if is_cgroup2(configured) {
        return Ok(configured.to_path_buf());
    }
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    cgroup2_under(&mounts, configured)
        .filter(|d| is_cgroup2(d))
        .ok_or_else(|| DatapathError::NotCgroup2(configured.to_path_buf()))
}

/// Open the cgroup to attach sockops to: `configured` resolved by [`resolve_cgroup`], or the
/// detected cgroup v2 root.
///
/// # Errors
/// [`DatapathError::NoCgroup2`], [`DatapathError::OpenCgroup`], or
/// [`DatapathError::NotCgroup2`] when the directory is in another file system and no cgroup v2
/// is mounted below it.
pub(super) fn open_cgroup(configured: Option<&Path>) -> Result<(PathBuf, File), DatapathError> {
    let cgroup = match configured {
        Some(p) if !p.exists() => p.to_path_buf(),
        Some(p) => {
            let found = resolve_cgroup(p)?;
            if found != p {
                tracing::info!(configured = %p.display(), cgroup = %found.display(), "cgroup v2 found below the configured directory");
            }
            found
        }
        None => detect_cgroup2()?,
    };
    let file = File::open(&cgroup).map_err(|source| DatapathError::OpenCgroup {
        path: cgroup.clone(),
        source,
    })?;
    let is_v2 = nix::sys::statfs::fstatfs(&file)
        .is_ok_and(|st| st.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC);
    if !is_v2 {
        return Err(DatapathError::NotCgroup2(cgroup));
    }
    Ok((cgroup, file))
}

/// Capability numbers from `<linux/capability.h>`.
const CAP_NET_ADMIN: u32 = 12;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// What loading and attaching the programs asks of this process, whatever its uid: in the
/// initial user namespace, the effective capabilities `CAP_BPF` (programs and maps),
/// `CAP_NET_ADMIN` (network program types, the cgroup attach, sock_diag) and `CAP_PERFMON`
/// (the verifier allows the programs' pointer arithmetic only with it). `CAP_SYS_ADMIN` stands
/// in for each (kernels before 5.8 know neither `CAP_BPF` nor `CAP_PERFMON`).
///
/// # Errors
/// [`DatapathError::NotPrivileged`] naming what is missing.
pub(super) fn privileges() -> Result<(), DatapathError> {
    if crate::netns::in_initial_user_namespace() == Some(false) {
        return Err(DatapathError::NotPrivileged {
            missing: "the initial user namespace (bpf() ignores capabilities held in another)"
                .into(),
        });
    }
    missing_capabilities(effective_capabilities()).map_or(Ok(()), |missing| {
        Err(DatapathError::NotPrivileged { missing })
    })
}

/// Lift `RLIMIT_MEMLOCK` before loading: kernels before 5.11 charge every BPF map to it, and a
/// container's default (64 KiB to 8 MiB) is too small for lb's maps. The soft limit is raised
/// to unlimited where the hard limit (or `CAP_SYS_RESOURCE`) allows, else to the hard limit;
/// on such a kernel a limit left finite is logged with its value. Newer kernels charge the
/// memory cgroup instead, and lifting the limit changes nothing there.
pub(super) fn lift_memlock() {
    use nix::sys::resource::{RLIM_INFINITY, Resource, getrlimit, setrlimit};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_MEMLOCK) else {
        return;
    };
    if soft == RLIM_INFINITY {
        return;
    }
    let lifted = setrlimit(Resource::RLIMIT_MEMLOCK, RLIM_INFINITY, RLIM_INFINITY)
        .map(|()| RLIM_INFINITY)
        .or_else(|_| setrlimit(Resource::RLIMIT_MEMLOCK, hard, hard).map(|()| hard))
        .unwrap_or(soft);
    let charged = aya::util::KernelVersion::current()
        .is_ok_and(|v| v < aya::util::KernelVersion::new(5, 11, 0));
    if lifted != RLIM_INFINITY && charged {
        tracing::warn!(
            bytes = lifted,
            "RLIMIT_MEMLOCK stays finite and this kernel (before 5.11) charges BPF maps to it: loading may fail (systemd: LimitMEMLOCK=infinity; a container: CAP_SYS_RESOURCE or a higher memlock ulimit)"
        );
    }
}

/// The capabilities the kernel data path needs that `effective` (a `CapEff` bit set) lacks,
/// by name; `None` when it has them all.
fn missing_capabilities(effective: u64) -> Option<String> {
    let has = |cap: u32| effective & (1 << cap | 1 << CAP_SYS_ADMIN) != 0;
    let missing: Vec<&str> = [
        (CAP_BPF, "CAP_BPF"),
        (CAP_NET_ADMIN, "CAP_NET_ADMIN"),
        (CAP_PERFMON, "CAP_PERFMON"),
    ]
    .into_iter()
    .filter(|&(cap, _)| !has(cap))
    .map(|(_, name)| name)
    .collect();
    (!missing.is_empty()).then(|| missing.join(", "))
}

/// This process's effective capabilities (`CapEff` in `/proc/self/status`); none when it
/// cannot be read.
fn effective_capabilities() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0)
}

/// The map types both forwarding modes need: LRU hash, per-CPU array and ring buffer (5.8).
///
/// # Errors
/// [`DatapathError::MissingFeature`] naming the first one missing.
pub fn probe_maps() -> Result<(), DatapathError> {
    use aya::{maps::MapType, sys};
    for (ty, name) in [
        (MapType::LruHash, "LRU hash map"),
        (MapType::PerCpuArray, "per-CPU array map"),
        (MapType::RingBuf, "ring buffer map (5.8+)"),
    ] {
        if !sys::is_map_supported(ty).unwrap_or(false) {
            return Err(DatapathError::MissingFeature(name));
        }
    }
    Ok(())
}

/// What the splice needs beyond [`probe_maps`]: the sockops and sk_msg program types, the
/// sockhash, and in its programs `bpf_get_netns_cookie` (5.15) and `bpf_msg_redirect_hash`.
///
/// # Errors
/// [`DatapathError::MissingFeature`] naming the first thing missing.
pub fn probe_splice() -> Result<(), DatapathError> {
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
    if !sys::is_map_supported(MapType::SockHash).unwrap_or(false) {
        return Err(DatapathError::MissingFeature("sockhash map"));
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

/// What connect-time forwarding needs beyond the splice: lb in the host's PID namespace (the
/// programs record the host's process ids of the clients, which lb looks up in `/proc` to
/// reach their network namespaces when it kills their sockets, and exempt lb's own `connect()`s
/// by its pid), the cgroup sock_addr program type (4.17+) and, in it, `bpf_get_socket_cookie`
/// and `bpf_get_current_pid_tgid`. The getpeername attach types (5.8+) have no probe of their
/// own: attaching them fails on older kernels, and that failure names them.
///
/// # Errors
/// [`DatapathError::NotHostPid`], or [`DatapathError::MissingFeature`] naming the first thing
/// missing.
pub(super) fn probe_connect() -> Result<(), DatapathError> {
    use aya::{programs::ProgramType, sys};
    use sys::BpfHelper as H;
    if crate::netns::in_host_pid_namespace() == Some(false) {
        return Err(DatapathError::NotHostPid);
    }
    if !sys::is_program_supported(ProgramType::CgroupSockAddr).unwrap_or(false) {
        return Err(DatapathError::MissingFeature(
            "cgroup sock_addr program type (4.17+)",
        ));
    }
    for (helper, name) in [
        (
            H::BPF_FUNC_get_socket_cookie,
            "bpf_get_socket_cookie in cgroup sock_addr programs",
        ),
        (
            H::BPF_FUNC_get_current_pid_tgid,
            "bpf_get_current_pid_tgid in cgroup sock_addr programs",
        ),
    ] {
        if !sys::is_helper_supported(ProgramType::CgroupSockAddr, helper).unwrap_or(false) {
            return Err(DatapathError::MissingFeature(name));
        }
    }
    Ok(())
}

/// What the sk_msg program needs to read the client's socket (the splice's byte count and its
/// upper layer protocol check, and the past-credit redirect of blocking clients): the helpers
/// `bpf_skc_to_tcp_sock` and `bpf_probe_read_kernel` in sk_msg (`CAP_PERFMON`, no lockdown) and
/// the kernel's BTF for the struct offsets.
///
/// # Errors
/// The first thing missing: [`DatapathError::BlockingHelper`] or [`DatapathError::Btf`].
pub(super) fn probe_kernel_reads() -> Result<SockOffsets, DatapathError> {
    use aya::{programs::ProgramType, sys};
    use sys::BpfHelper as H;
    for (helper, name) in [
        (H::BPF_FUNC_skc_to_tcp_sock, "bpf_skc_to_tcp_sock"),
        (H::BPF_FUNC_probe_read_kernel, "bpf_probe_read_kernel"),
    ] {
        if !sys::is_helper_supported(ProgramType::SkMsg, helper).unwrap_or(false) {
            return Err(DatapathError::BlockingHelper { helper: name });
        }
    }
    Ok(btf::sock_offsets(Path::new(btf::VMLINUX_BTF))?)
}

/// What reading a failed connect-time connect's error needs: `bpf_skc_to_tcp_sock` and
/// `bpf_probe_read_kernel` in sockops programs (`CAP_PERFMON`, no lockdown) and the kernel's BTF
/// for `struct sock::sk_err`. Returns the field's offset.
///
/// # Errors
/// [`DatapathError::MissingFeature`] or [`DatapathError::Btf`].
pub(super) fn probe_sk_err() -> Result<u32, DatapathError> {
    use aya::{programs::ProgramType, sys};
    use sys::BpfHelper as H;
    for helper in [H::BPF_FUNC_skc_to_tcp_sock, H::BPF_FUNC_probe_read_kernel] {
        if !sys::is_helper_supported(ProgramType::SockOps, helper).unwrap_or(false) {
            return Err(DatapathError::MissingFeature(
                "bpf_skc_to_tcp_sock and bpf_probe_read_kernel in sockops programs (5.9+, CAP_PERFMON, no lockdown)",
            ));
        }
    }
    Ok(btf::sk_err_offset(Path::new(btf::VMLINUX_BTF))?)
}

/// The struct offsets the sk_msg program reads client sockets with, when the kernel lets it
/// (see [`probe_kernel_reads`]); `None`, with a warning naming why, turns the splice off:
/// the program could then neither count the bytes a client sent the normal way exactly nor see
/// a kTLS socket, so redirecting would risk reordered bytes or plaintext on the wire.
pub(super) fn kernel_reads(cfg: &crate::config::DatapathConfig) -> Option<btf::SockOffsets> {
    let offsets = probe_kernel_reads()
        .inspect_err(|why| {
            warn!(reason = %crate::errors::chain(why), "the kernel splice is off: every connection is copied in userspace");
        })
        .ok();
    if offsets.is_some() && !cfg.blocking_splice {
        info!(
            "datapath.blocking_splice = false: blocking clients take the copy path when a server socket is full"
        );
    }
    offsets
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every socket of this process's network namespace gives the same cookie, and no
    /// namespace has cookie 0 (`NETNS_SCOPE_ALL`); kernels before 5.14 cannot say.
    #[test]
    fn own_netns_cookie_is_stable_and_not_zero() {
        let Ok(first) = own_netns_cookie() else {
            eprintln!("skipped: no SO_NETNS_COOKIE (kernel before 5.14)");
            return;
        };
        assert_ne!(first, lb_common::NETNS_SCOPE_ALL);
        assert_eq!(own_netns_cookie().expect("read once already"), first);
    }

    #[test]
    fn finds_the_cgroup2_mount() {
        let mounts = "proc /proc proc rw 0 0\n\
                      cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n\
                      cgroup2 /sys/fs/cgroup/unified cgroup2 rw,nsdelegate 0 0\n";
        assert_eq!(
            cgroup2_in(mounts),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(cgroup2_in("proc /proc proc rw 0 0\n"), None);
    }

    #[test]
    fn finds_the_cgroup2_mount_below_a_root() {
        let hybrid = "tmpfs /host/sys/fs/cgroup tmpfs ro 0 0\n\
                      cgroup /host/sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n\
                      cgroup2 /host/sys/fs/cgroup/unified cgroup2 rw 0 0\n\
                      cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n";
        let root = Path::new("/host/sys/fs/cgroup");
        assert_eq!(
            cgroup2_under(hybrid, root),
            Some(PathBuf::from("/host/sys/fs/cgroup/unified"))
        );
        // The nearest one wins; a mount beside the root (a longer name) is not below it.
        let nested = "cgroup2 /r/a/b cgroup2 rw 0 0\ncgroup2 /r/a cgroup2 rw 0 0\ncgroup2 /rr cgroup2 rw 0 0\n";
        assert_eq!(
            cgroup2_under(nested, Path::new("/r")),
            Some(PathBuf::from("/r/a"))
        );
        assert_eq!(cgroup2_under(hybrid, Path::new("/elsewhere")), None);
    }

    #[test]
    fn capabilities_not_uid_decide() {
        let bit = |c: u32| 1u64 << c;
        // The systemd unit's set.
        assert_eq!(
            missing_capabilities(bit(CAP_BPF) | bit(CAP_PERFMON) | bit(CAP_NET_ADMIN)),
            None
        );
        // Root in a container that kept only CAP_SYS_ADMIN, or a kernel before 5.8.
        assert_eq!(missing_capabilities(bit(CAP_SYS_ADMIN)), None);
        assert_eq!(
            missing_capabilities(bit(CAP_BPF) | bit(CAP_NET_ADMIN)).as_deref(),
            Some("CAP_PERFMON")
        );
        assert_eq!(
            missing_capabilities(0).as_deref(),
            Some("CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON")
        );
    }
}
