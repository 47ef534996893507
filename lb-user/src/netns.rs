//! Namespaces as lb meets them: whether lb runs in the host's PID and user namespaces (the
//! connect-time programs record host process ids, and `bpf()` honours capabilities of the
//! initial user namespace only), and the network namespaces of other processes, which a
//! connect-time kill groups its sockets by and enters to destroy them; a process whose
//! namespace cannot be opened or entered is reported with its pid ([`report`]).
//!
//! Needs `/proc` mounted for lb's own PID namespace. Opening another user's
//! `/proc/<pid>/ns/net` needs `CAP_SYS_PTRACE` (a ptrace read-access check), and entering it
//! `CAP_SYS_ADMIN` (`setns`).

use std::{collections::HashMap, fs::File, os::unix::fs::MetadataExt as _};

use nix::{errno::Errno, sched::CloneFlags};
use tracing::warn;

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

/// Where a group of a kill's sockets is looked for.
#[derive(Debug)]
pub enum Where {
    /// lb's own network namespace.
    Own,
    /// lb's own, because their process's namespace could not be opened (gone, or no ptrace
    /// access): a socket whose process exited may live on in a child of lb's namespace.
    OwnFallback,
    /// Another namespace, to enter by `ns`, opened through process `tgid`.
    Foreign {
        /// The process it was opened through.
        tgid: u32,
        /// The namespace (`/proc/<tgid>/ns/net`).
        ns: File,
    },
}

/// Items grouped by the network namespace of their process, and the processes whose
/// namespace could not be opened.
#[derive(Debug)]
pub struct Grouped<'a, S> {
    /// One entry per place, with its items.
    pub groups: Vec<(Where, Vec<&'a S>)>,
    /// Processes whose namespace could not be opened (their items are in `OwnFallback`).
    pub failures: Vec<Failure>,
}

/// Group `items` by the network namespace of their process (`tgid_of`), opening each
/// process's `/proc/<tgid>/ns/net` once and each namespace's descriptor kept once.
pub fn group_by_netns<S>(items: &[S], tgid_of: impl Fn(&S) -> u32) -> Grouped<'_, S> {
    let own = own_netns();
    // Per process and per namespace: the index of its group. Groups 0 and 1 are `Own` and
    // `OwnFallback`; empty groups are dropped at the end.
    let mut of_process: HashMap<u32, usize> = HashMap::new();
    let mut of_netns: HashMap<NetnsId, usize> = HashMap::new();
    let mut groups: Vec<(Where, Vec<&S>)> =
        vec![(Where::Own, Vec::new()), (Where::OwnFallback, Vec::new())];
    let mut unopened: HashMap<u32, (Errno, usize)> = HashMap::new();
    for item in items {
        let tgid = tgid_of(item);
        let at = *of_process
            .entry(tgid)
            .or_insert_with(|| match open_netns_of(tgid) {
                Ok((_, id)) if Some(id) == own => 0,
                Ok((ns, id)) => *of_netns.entry(id).or_insert_with(|| {
                    groups.push((Where::Foreign { tgid, ns }, Vec::new()));
                    groups.len() - 1
                }),
                Err(error) => {
                    unopened.insert(tgid, (error, 0));
                    1
                }
            });
        if let Some((_, n)) = unopened.get_mut(&tgid) {
            *n += 1;
        }
        groups[at].1.push(item);
    }
    groups.retain(|(_, g)| !g.is_empty());
    let failures = unopened
        .into_iter()
        .map(|(tgid, (error, sockets))| Failure {
            tgid,
            step: Step::Open,
            error,
            sockets,
        })
        .collect();
    Grouped { groups, failures }
}

/// Which step of reaching a process's network namespace failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Opening `/proc/<tgid>/ns/net`.
    Open,
    /// Entering it (`setns`).
    Enter,
}

/// A process whose network namespace a kill could not open or enter.
#[derive(Debug)]
pub struct Failure {
    /// The process.
    pub tgid: u32,
    /// What failed.
    pub step: Step,
    /// Why.
    pub error: Errno,
    /// Its sockets the kill wanted.
    pub sockets: usize,
}

impl Failure {
    /// Entering the namespace opened through `tgid` failed with `error`; it held `sockets`.
    pub fn enter(tgid: u32, error: Errno, sockets: usize) -> Failure {
        Failure {
            tgid,
            step: Step::Enter,
            error,
            sockets,
        }
    }
}

/// Log each failure (the first 8 one by one with the process id, the rest summed) and return
/// the sockets they concern.
pub fn report(failures: &[Failure]) -> usize {
    const LOGGED: usize = 8;
    for f in failures.iter().take(LOGGED) {
        let (step, hint) = match (f.step, f.error) {
            (Step::Open, Errno::ENOENT) => ("open", "the process is gone"),
            (Step::Open, _) => (
                "open",
                "reading another user's /proc/<pid>/ns/net needs CAP_SYS_PTRACE",
            ),
            (Step::Enter, _) => (
                "enter",
                "setns needs CAP_SYS_ADMIN and no seccomp filter forbidding it",
            ),
        };
        warn!(pid = f.tgid, step, error = %f.error, sockets = f.sockets, hint, "connect-time kill: cannot reach the network namespace of a client process");
    }
    if let Some(rest) = failures.get(LOGGED..).filter(|r| !r.is_empty()) {
        let sockets: usize = rest.iter().map(|f| f.sockets).sum();
        warn!(
            processes = rest.len(),
            sockets, "connect-time kill: more client processes' network namespaces unreachable"
        );
    }
    failures.iter().map(|f| f.sockets).sum()
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
    fn groups_by_namespace_and_counts_the_unopened() {
        let me = std::process::id();
        // (tgid, tag): lb's own process twice, a missing one twice.
        let items = [(me, 'a'), (5_000_000, 'b'), (me, 'c'), (5_000_000, 'd')];
        let g = group_by_netns(&items, |i| i.0);
        let tags = |w: fn(&Where) -> bool| -> Vec<char> {
            g.groups
                .iter()
                .filter(|(at, _)| w(at))
                .flat_map(|(_, v)| v.iter().map(|i| i.1))
                .collect()
        };
        assert_eq!(tags(|w| matches!(w, Where::Own)), ['a', 'c']);
        assert_eq!(tags(|w| matches!(w, Where::OwnFallback)), ['b', 'd']);
        assert_eq!(g.failures.len(), 1);
        let f = &g.failures[0];
        assert_eq!(
            (f.tgid, f.step, f.error, f.sockets),
            (5_000_000, Step::Open, Errno::ENOENT, 2)
        );
        assert_eq!(report(&g.failures), 2);
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
