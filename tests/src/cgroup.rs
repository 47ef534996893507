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
const ATTR_BYTES: usize = 128;

/// Issue `bpf(cmd, attr)`; the returned descriptor or the errno.
fn bpf(cmd: libc::c_long, attr: &mut [u8; ATTR_BYTES]) -> std::io::Result<i32> {
    // SAFETY: `attr` is a zero-padded `union bpf_attr` of ATTR_BYTES bytes whose pointers
    // (instructions, license) outlive the call.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), ATTR_BYTES) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(i32::try_from(r).unwrap_or(-1))
    }
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
