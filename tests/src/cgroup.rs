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
