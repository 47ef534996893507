//! Child cgroups of the cgroup v2 root, one per test, for the clients sockops must see.

use std::{
    path::PathBuf,
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use anyhow::{Context as _, Result};

/// A child cgroup of the cgroup v2 root, made for one test.
#[derive(Debug)]
pub struct TestCgroup {
    /// Its directory.
    pub path: PathBuf,
}

/// The cgroup v2 mount point from /proc/mounts.
///
/// # Errors
/// When there is none.
pub fn cgroup2_root() -> Result<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/mounts")?;
    mounts
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 2 && f[2] == "cgroup2").then(|| PathBuf::from(f[1]))
        })
        .context("no cgroup2 mount")
}

static NEXT_CG: AtomicU32 = AtomicU32::new(0);

impl TestCgroup {
    /// Create `lb-test-<pid>-<n>` under the cgroup v2 root.
    ///
    /// # Errors
    /// No cgroup v2 or mkdir failure.
    pub fn new() -> Result<TestCgroup> {
        let path = cgroup2_root()?.join(format!(
            "lb-test-{}-{}",
            std::process::id(),
            NEXT_CG.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).with_context(|| format!("mkdir {}", path.display()))?;
        Ok(TestCgroup { path })
    }

    /// A child cgroup of this one.
    ///
    /// # Errors
    /// mkdir failure.
    pub fn child(&self, name: &str) -> Result<TestCgroup> {
        let path = self.path.join(name);
        std::fs::create_dir_all(&path)?;
        Ok(TestCgroup { path })
    }
}

/// `bpf(2)` commands and constants from `<linux/bpf.h>`.
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_ATTACH: libc::c_long = 8;
const BPF_PROG_TYPE_CGROUP_SOCK_ADDR: u32 = 18;
const BPF_CGROUP_INET4_CONNECT: u32 = 10;
/// Bytes of `union bpf_attr` passed (the kernel wants every byte past the fields it knows zero).
pub(crate) const ATTR_BYTES: usize = 128;

/// Issue `bpf(cmd, attr)`; the returned descriptor or the errno.
pub(crate) fn bpf(cmd: libc::c_long, attr: &mut [u8; ATTR_BYTES]) -> std::io::Result<i32> {
    // SAFETY: `attr` is a zero-padded `union bpf_attr` of ATTR_BYTES bytes whose pointers
    // (instructions, license) outlive the call.
    #[expect(
        unsafe_code,
        reason = "bpf(2) has no safe wrapper among the tests' dependencies"
    )]
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), ATTR_BYTES) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(i32::try_from(r).unwrap_or(-1))
    }
}

/// Lift `RLIMIT_MEMLOCK` (best effort): before 5.11 the kernel charges BPF maps and programs
/// to it, and its 8 MiB default refuses even a one-entry map once lb's own maps count.
fn lift_memlock() {
    let _ = nix::sys::resource::setrlimit(
        nix::sys::resource::Resource::RLIMIT_MEMLOCK,
        nix::sys::resource::RLIM_INFINITY,
        nix::sys::resource::RLIM_INFINITY,
    );
}

impl TestCgroup {
    /// Attach a do-nothing `connect4` program (`r0 = 1; exit`: allow, no rewrite) to this
    /// cgroup in exclusive mode (no `BPF_F_ALLOW_MULTI`), so the kernel refuses any other
    /// `connect4` program here: what lb meets on a node where another tool owns the hook. The
    /// attachment lasts until the cgroup is removed.
    ///
    /// # Errors
    /// The kernel refused the load or the attach (errno in the message).
    pub fn occupy_connect4(&self) -> Result<()> {
        lift_memlock();
        use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
        // BPF_ALU64 | BPF_MOV | BPF_K, dst r0, imm 1; then BPF_JMP | BPF_EXIT.
        let insns: [u8; 16] = [0xb7, 0, 0, 0, 1, 0, 0, 0, 0x95, 0, 0, 0, 0, 0, 0, 0];
        let license = b"GPL\0";
        let mut attr = [0u8; ATTR_BYTES];
        attr[0..4].copy_from_slice(&BPF_PROG_TYPE_CGROUP_SOCK_ADDR.to_ne_bytes());
        attr[4..8].copy_from_slice(&2u32.to_ne_bytes());
        attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
        attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
        attr[68..72].copy_from_slice(&BPF_CGROUP_INET4_CONNECT.to_ne_bytes());
        let prog = bpf(BPF_PROG_LOAD, &mut attr).context("BPF_PROG_LOAD of a connect4 program")?;
        // SAFETY: a descriptor the kernel just returned, owned by nobody else.
        #[expect(
            unsafe_code,
            reason = "a descriptor the kernel just returned becomes an OwnedFd"
        )]
        let prog = unsafe { OwnedFd::from_raw_fd(prog) };
        let cg = std::fs::File::open(&self.path)?;
        let mut attr = [0u8; ATTR_BYTES];
        attr[0..4].copy_from_slice(&(cg.as_raw_fd() as u32).to_ne_bytes());
        attr[4..8].copy_from_slice(&(prog.as_raw_fd() as u32).to_ne_bytes());
        attr[8..12].copy_from_slice(&BPF_CGROUP_INET4_CONNECT.to_ne_bytes());
        bpf(BPF_PROG_ATTACH, &mut attr).context("BPF_PROG_ATTACH to cgroup/connect4")?;
        Ok(())
    }
}

/// `bpf(2)` commands and constants from `<linux/bpf.h>` for [`TestCgroup::count_rtt_callbacks`].
const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_TYPE_ARRAY: u32 = 2;
const BPF_PROG_TYPE_SOCK_OPS: u32 = 13;
const BPF_CGROUP_SOCK_OPS: u32 = 3;
const BPF_F_ALLOW_MULTI: u32 = 2;

/// The count of `BPF_SOCK_OPS_RTT_CB` callbacks a sockops program of the test's own saw
/// ([`TestCgroup::count_rtt_callbacks`]).
#[derive(Debug)]
pub struct RttCallbacks {
    map: std::os::fd::OwnedFd,
}

impl RttCallbacks {
    /// RTT callbacks so far.
    ///
    /// # Errors
    /// The map lookup failed.
    pub fn count(&self) -> Result<u64> {
        use std::os::fd::AsRawFd as _;
        let key = 0u32;
        let mut value = 0u64;
        let mut attr = [0u8; ATTR_BYTES];
        attr[0..4].copy_from_slice(&(self.map.as_raw_fd() as u32).to_ne_bytes());
        attr[8..16].copy_from_slice(&(&raw const key as u64).to_ne_bytes());
        attr[16..24].copy_from_slice(&(&raw mut value as u64).to_ne_bytes());
        bpf(BPF_MAP_LOOKUP_ELEM, &mut attr).context("BPF_MAP_LOOKUP_ELEM")?;
        Ok(value)
    }
}

impl TestCgroup {
    /// Attach a sockops program of another user (not lb) to this cgroup, beside any other
    /// (`BPF_F_ALLOW_MULTI`): at every callback it asks for RTT callbacks too, keeping the
    /// socket's other flags (`bpf_sock_ops_cb_flags_set(ctx, ctx->bpf_sock_ops_cb_flags |
    /// BPF_SOCK_OPS_RTT_CB_FLAG)`), and counts the `BPF_SOCK_OPS_RTT_CB` callbacks it gets. A
    /// program that runs after it and sets the flags outright takes its RTT callbacks away.
    /// The attachment lasts until the cgroup is removed.
    ///
    /// # Errors
    /// The kernel refused the map, the load or the attach (errno in the message).
    pub fn count_rtt_callbacks(&self) -> Result<RttCallbacks> {
        lift_memlock();
        use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
        let mut attr = [0u8; ATTR_BYTES];
        for (i, v) in [BPF_MAP_TYPE_ARRAY, 4, 8, 1].iter().enumerate() {
            attr[i * 4..i * 4 + 4].copy_from_slice(&v.to_ne_bytes());
        }
        let map = bpf(BPF_MAP_CREATE, &mut attr).context("BPF_MAP_CREATE of an array")?;
        // SAFETY: a descriptor the kernel just returned, owned by nobody else.
        #[expect(
            unsafe_code,
            reason = "a descriptor the kernel just returned becomes an OwnedFd"
        )]
        let map = unsafe { OwnedFd::from_raw_fd(map) };
        let insns = rtt_counter_insns(map.as_raw_fd());
        let license = b"GPL\0";
        let mut attr = [0u8; ATTR_BYTES];
        attr[0..4].copy_from_slice(&BPF_PROG_TYPE_SOCK_OPS.to_ne_bytes());
        attr[4..8].copy_from_slice(&((insns.len() / 8) as u32).to_ne_bytes());
        attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
        attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
        let prog = bpf(BPF_PROG_LOAD, &mut attr).context("BPF_PROG_LOAD of a sockops program")?;
        // SAFETY: as above.
        #[expect(
            unsafe_code,
            reason = "a descriptor the kernel just returned becomes an OwnedFd"
        )]
        let prog = unsafe { OwnedFd::from_raw_fd(prog) };
        let cg = std::fs::File::open(&self.path)?;
        let mut attr = [0u8; ATTR_BYTES];
        attr[0..4].copy_from_slice(&(cg.as_raw_fd() as u32).to_ne_bytes());
        attr[4..8].copy_from_slice(&(prog.as_raw_fd() as u32).to_ne_bytes());
        attr[8..12].copy_from_slice(&BPF_CGROUP_SOCK_OPS.to_ne_bytes());
        attr[12..16].copy_from_slice(&BPF_F_ALLOW_MULTI.to_ne_bytes());
        bpf(BPF_PROG_ATTACH, &mut attr).context("BPF_PROG_ATTACH to cgroup/sock_ops")?;
        Ok(RttCallbacks { map })
    }
}

/// The instructions of [`TestCgroup::count_rtt_callbacks`]'s program, `map` the counter array.
/// `struct bpf_sock_ops` offsets: `op` 0, `bpf_sock_ops_cb_flags` 84; `BPF_SOCK_OPS_RTT_CB`
/// is 12, `BPF_SOCK_OPS_RTT_CB_FLAG` 8, helpers 1 (`map_lookup_elem`) and 59
/// (`sock_ops_cb_flags_set`), all from `<linux/bpf.h>`.
fn rtt_counter_insns(map: i32) -> Vec<u8> {
    // (opcode, dst, src, off, imm) in the kernel's `struct bpf_insn` layout.
    let insns: [(u8, u8, u8, i16, i32); 20] = [
        (0xbf, 6, 1, 0, 0),   // r6 = r1
        (0x61, 2, 6, 0, 0),   // r2 = ctx->op
        (0x15, 2, 0, 6, 12),  // if r2 == RTT_CB goto count
        (0x61, 2, 6, 84, 0),  // r2 = ctx->bpf_sock_ops_cb_flags
        (0x47, 2, 0, 0, 8),   // r2 |= RTT_CB_FLAG
        (0xbf, 1, 6, 0, 0),   // r1 = r6
        (0x85, 0, 0, 0, 59),  // call sock_ops_cb_flags_set
        (0xb7, 0, 0, 0, 1),   // r0 = 1
        (0x95, 0, 0, 0, 0),   // exit
        (0x18, 1, 1, 0, map), // count: r1 = map (ld_imm64, pseudo map fd)
        (0x00, 0, 0, 0, 0),   //   (second half)
        (0xbf, 2, 10, 0, 0),  // r2 = r10
        (0x07, 2, 0, 0, -4),  // r2 += -4
        (0x62, 10, 0, -4, 0), // *(u32 *)(r10 - 4) = 0
        (0x85, 0, 0, 0, 1),   // call map_lookup_elem
        (0x15, 0, 0, 2, 0),   // if r0 == 0 goto out
        (0xb7, 1, 0, 0, 1),   // r1 = 1
        (0xdb, 0, 1, 0, 0),   // lock *(u64 *)(r0 + 0) += r1
        (0xb7, 0, 0, 0, 1),   // out: r0 = 1
        (0x95, 0, 0, 0, 0),   // exit
    ];
    let mut out = Vec::with_capacity(insns.len() * 8);
    for (op, dst, src, off, imm) in insns {
        out.push(op);
        out.push(dst | (src << 4));
        out.extend_from_slice(&off.to_ne_bytes());
        out.extend_from_slice(&imm.to_ne_bytes());
    }
    out
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Processes still inside (a failed test's clients) are killed first.
        for _ in 0..50 {
            let procs = std::fs::read_to_string(self.path.join("cgroup.procs")).unwrap_or_default();
            let pids: Vec<i32> = procs
                .lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect();
            if pids.is_empty() {
                break;
            }
            for p in pids {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(p),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = std::fs::remove_dir(&self.path);
    }
}
