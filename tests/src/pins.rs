//! Connect-time pins in tests: a bpffs of the test's own (in a mount namespace private to the
//! calling thread, so nothing shows outside the test), and a unique pin directory for every lb a
//! test starts, detached and removed when that lb is dropped.

use std::{
    path::{Path, PathBuf},
    sync::atomic::{AtomicUsize, Ordering},
};

use anyhow::{Context as _, Result};

/// The bpffs mount seen by the calling thread (its mount namespace may be its own):
/// `/sys/fs/bpf` when it is one, else the first listed; `None` when none is mounted.
pub fn bpffs_mount() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/thread-self/mounts").ok()?;
    let found: Vec<PathBuf> = mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, at, kind) = (f.next()?, f.next()?, f.next()?);
            (kind == "bpf").then(|| PathBuf::from(at))
        })
        .collect();
    found
        .iter()
        .find(|p| *p == Path::new("/sys/fs/bpf"))
        .or(found.first())
        .cloned()
}

/// Give the calling thread (and every process it starts from now on, lb among them) a mount
/// namespace of its own with a fresh bpffs at `/sys/fs/bpf`. Mounts are made private first, so
/// nothing propagates to the host; the namespace ends with the thread and its children.
///
/// # Errors
/// `unshare(CLONE_NEWNS)` or a mount fails (needs root).
pub fn private_bpffs() -> Result<PathBuf> {
    use nix::mount::{MsFlags, mount};
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).context("unshare(CLONE_NEWNS)")?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .context("making mounts private")?;
    let at = PathBuf::from("/sys/fs/bpf");
    mount(
        Some("bpf"),
        &at,
        Some("bpf"),
        MsFlags::empty(),
        Some("mode=0700"),
    )
    .context("mounting a bpffs at /sys/fs/bpf")?;
    Ok(at)
}

/// A pin directory no other lb of any test uses: `<bpffs>/lb-test-<pid>-<n>`; `None` when no
/// bpffs is mounted (lb then runs unpinned).
pub fn unique_pin_dir() -> Option<PathBuf> {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    bpffs_mount().map(|m| m.join(format!("lb-test-{}-{n}", std::process::id())))
}

/// Detach and remove everything pinned in `dir` (`lb cleanup`); when lb refuses because another
/// lb still holds the directory, that lb's own drop cleans it. Leftovers of a failed cleanup are
/// unlinked (unpinning a link detaches its program).
pub fn remove_pins(dir: &Path) {
    let out = std::process::Command::new(crate::lb_bin())
        .args(["cleanup", "--pin-dir"])
        .arg(dir)
        .output();
    if out.as_ref().is_ok_and(|o| o.status.success()) || !dir.exists() {
        return;
    }
    let held = out.is_ok_and(|o| String::from_utf8_lossy(&o.stderr).contains("held by"));
    if !held {
        let _ = std::fs::remove_dir_all(dir);
    }
}
