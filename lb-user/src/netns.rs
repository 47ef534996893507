//! Namespaces as lb meets them: whether lb runs in the host's PID and user namespaces (the
//! connect-time programs record host process ids, and `bpf()` honours capabilities of the
//! initial user namespace only), and the network namespace of another process, which a
//! connect-time kill enters to destroy that process's sockets.
//!
//! Needs `/proc` mounted for lb's own PID namespace. Opening another user's
//! `/proc/<pid>/ns/net` needs `CAP_SYS_PTRACE` (a ptrace read-access check), and entering it
//! `CAP_SYS_ADMIN` (`setns`).

use std::{fs::File, os::unix::fs::MetadataExt as _};

use nix::{errno::Errno, sched::CloneFlags};

/// Inode number of the initial PID namespace's `/proc/*/ns/pid` (`PROC_PID_INIT_INO` in the
/// kernel's `include/linux/proc_ns.h`, fixed since Linux 3.8).
pub const PROC_PID_INIT_INO: u64 = 0xEFFF_FFFC;

/// Inode number of the initial user namespace's `/proc/*/ns/user` (`PROC_USER_INIT_INO` in
/// `include/linux/proc_ns.h`).
pub const PROC_USER_INIT_INO: u64 = 0xEFFF_FFFD;

/// What lb asks of a PID namespace that is not the host's: the fix, named where the refusal is
/// reported.
pub const HOST_PID_FIX: &str =
    "run lb in the host's PID namespace (a pod: hostPID: true; docker: --pid=host)";

/// The inode of `/proc/self/ns/<kind>`; `None` when it cannot be read.
fn own_ns_inode(kind: &str) -> Option<u64> {
    std::fs::metadata(format!("/proc/self/ns/{kind}"))
        .ok()
        .map(|m| m.ino())
}

/// Whether lb runs in the host's (initial) PID namespace, where the process ids the kernel
/// programs record (`bpf_get_current_pid_tgid`) are lb's own; `None` when
/// `/proc/self/ns/pid` cannot be read.
pub fn in_host_pid_namespace() -> Option<bool> {
    own_ns_inode("pid").map(|ino| ino == PROC_PID_INIT_INO)
}

/// Whether lb runs in the initial user namespace, the only one whose capabilities `bpf()`
/// honours; `None` when `/proc/self/ns/user` cannot be read.
pub fn in_initial_user_namespace() -> Option<bool> {
    own_ns_inode("user").map(|ino| ino == PROC_USER_INIT_INO)
}

/// A network namespace's identity: device and inode of its nsfs file.
pub type NetnsId = (u64, u64);

/// The identity of lb's own network namespace; `None` when `/proc/self/ns/net` cannot be read.
pub fn own_netns() -> Option<NetnsId> {
    std::fs::metadata("/proc/self/ns/net")
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

/// Open the network namespace of process `tgid` (`/proc/<tgid>/ns/net`) and name it.
///
/// # Errors
/// The errno: `ENOENT` when the process is gone (or is not in lb's PID namespace), `EACCES`
/// when lb may not read it (another user's process without `CAP_SYS_PTRACE`).
pub fn open_netns_of(tgid: u32) -> Result<(File, NetnsId), Errno> {
    let to_errno = |e: std::io::Error| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO));
    let file = File::open(format!("/proc/{tgid}/ns/net")).map_err(to_errno)?;
    let meta = file.metadata().map_err(to_errno)?;
    Ok((file, (meta.dev(), meta.ino())))
}

/// Run `f` on a new thread that first joins the network namespace `ns` (the thread ends with
/// `f`, so lb's own threads never change namespace).
///
/// # Errors
/// The errno of `setns` (`EPERM` without `CAP_SYS_ADMIN`, or where a seccomp filter such as
/// systemd's `RestrictNamespaces=` forbids it), `EIO` when the thread panicked.
pub fn run_in_netns<T: Send>(ns: &File, f: impl FnOnce() -> T + Send) -> Result<T, Errno> {
    std::thread::scope(|scope| {
        scope
            .spawn(move || {
                nix::sched::setns(ns, CloneFlags::CLONE_NEWNET)?;
                Ok(f())
            })
            .join()
            .unwrap_or(Err(Errno::EIO))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_namespaces_are_readable() {
        assert!(in_host_pid_namespace().is_some());
        assert!(in_initial_user_namespace().is_some());
        let own = own_netns().expect("own netns");
        let (_, of_self) = open_netns_of(std::process::id()).expect("own /proc entry");
        assert_eq!(own, of_self);
    }

    #[test]
    fn a_missing_process_is_enoent() {
        // Above the kernel's PID_MAX_LIMIT (4 194 304): never a live process.
        assert_eq!(
            open_netns_of(5_000_000).map(|(_, id)| id),
            Err(Errno::ENOENT)
        );
    }
}
