//! The connect-time programs' pins: their links and maps in a directory of a bpffs, so they
//! keep rewriting after lb exits, however it exits (`kill -9` included), until lb's heartbeat is
//! older than `datapath.orphan_timeout`. One lb per directory, held with an exclusive `flock` on
//! the directory itself (a bpffs holds no regular files); the directories are mode 0700, the pins
//! 0600, owned by lb's user. A new lb takes over whatever build left them (see [`survey`] and
//! [`swap`]): its own programs run in the pinned links from its start, the pinned maps are
//! adopted when they are of its layout and rebuilt otherwise; `lb cleanup` detaches and removes
//! everything. The splice's objects are never pinned: they die with lb.
//!
//! [`survey`]: super::survey
//! [`swap`]: super::swap
//!
//! Minimum kernel: 5.7 (pinned cgroup links), 4.4 for a bpffs.

use std::{
    fs::{DirBuilder, File, Permissions},
    io,
    mem::ManuallyDrop,
    os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
};

use aya::programs::links::{FdLink, PinnedLink};
use lb_common::{CONNECT_MAPS, CONNECT_PROGS};
use nix::fcntl::{Flock, FlockArg};

use super::survey::{Found, survey};
use crate::datapath::syscall;

/// Mount point lb prefers when several bpffs are mounted.
const SYS_FS_BPF: &str = "/sys/fs/bpf";
/// The subdirectory a rebuild pins its new maps in until it swaps them in (a crash in between
/// leaves it, and the next lb removes it before it surveys).
const STAGED: &str = "staged";

/// Errors of the pin directory.
#[derive(Debug, thiserror::Error)]
pub enum PinError {
    /// The directory (or the nearest existing directory above it) is not in a bpffs.
    #[error(
        "pin directory {dir} is not in a bpffs (mount one, e.g. `mount -t bpf bpf /sys/fs/bpf`, or set datapath.pin_dir inside one)"
    )]
    NotBpffs {
        /// The directory.
        dir: PathBuf,
    },
    /// A directory could not be made, opened or given its mode.
    #[error("cannot prepare pin directory {dir}")]
    Dir {
        /// The directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A directory on the way to the pins could be replaced by another user: owned by
    /// another user, or writable by group or others (the bpffs mount itself may be
    /// world-writable with the sticky bit, as `/tmp` is).
    #[error(
        "pin directory {dir}: {path} is {why}; another user could replace the pins lb runs (make it owned by uid {euid} and mode 0700, or set datapath.pin_dir elsewhere)",
        dir = dir.display(),
        path = path.display()
    )]
    Unsafe {
        /// The pin directory.
        dir: PathBuf,
        /// The directory at fault.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
        /// lb's effective user id.
        euid: u32,
    },
    /// Another live lb holds the directory's lock.
    #[error(
        "pin directory {dir} is held by another running lb (stop it first, or give this one another datapath.pin_dir)"
    )]
    Locked {
        /// The directory.
        dir: PathBuf,
    },
    /// The pinned programs are attached to another cgroup than this lb's.
    #[error(
        "pin directory {dir} holds connect-time programs attached to the cgroup with id {pinned}, this lb's cgroup {cgroup} has id {want}: they keep serving that cgroup; to move them run `lb cleanup --pin-dir {dir}`, then start lb again",
        dir = dir.display(),
        cgroup = cgroup.display()
    )]
    OtherCgroup {
        /// The directory.
        dir: PathBuf,
        /// The cgroup id (inode) the pinned links are attached to.
        pinned: u64,
        /// This lb's cgroup.
        cgroup: PathBuf,
        /// Its id (inode).
        want: u64,
    },
    /// A pinned object could not be opened, pinned or removed.
    #[error("pin {path}: {reason}")]
    Pin {
        /// The pin.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

impl PinError {
    fn pin(path: &Path, reason: impl std::fmt::Display) -> PinError {
        PinError::Pin {
            path: path.to_path_buf(),
            reason: reason.to_string(),
        }
    }
}

/// The bpffs mount lb pins under: `/sys/fs/bpf` when it is one, else the first bpffs in
/// `/proc/self/mounts`; `None` when none is mounted.
pub fn bpffs_mount() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    let found: Vec<PathBuf> = mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, at, kind) = (f.next()?, f.next()?, f.next()?);
            (kind == "bpf").then(|| PathBuf::from(at.replace("\\040", " ")))
        })
        .collect();
    found
        .iter()
        .find(|p| *p == Path::new(SYS_FS_BPF))
        .or(found.first())
        .cloned()
}

/// The pin directory lb uses: `configured`, else `<bpffs>/lb/default`; `None` when none is
/// configured and no bpffs is mounted.
pub fn resolve_dir(configured: Option<&Path>) -> Option<PathBuf> {
    configured
        .map(Path::to_path_buf)
        .or_else(|| bpffs_mount().map(|m| m.join("lb").join("default")))
}

/// Whether `path` is in a bpffs.
fn on_bpffs(path: &Path) -> bool {
    nix::sys::statfs::statfs(path)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::BPF_FS_MAGIC)
}

/// A pin directory this lb holds. The lock is never released explicitly: `LOCK_UN` would also
/// release it for a hand-over's new process, which shares the open file description; it goes
/// when the last descriptor of that description closes (at the exit of the last lb holding it).
#[derive(Debug)]
pub struct Pins {
    dir: PathBuf,
    lock: ManuallyDrop<Flock<File>>,
    found: Found,
}

impl Pins {
    /// Make (mode 0700) and lock `dir`, remove what a rebuild that never finished staged
    /// there, and survey what is pinned ([`Found`]).
    ///
    /// # Errors
    /// [`PinError::NotBpffs`], [`PinError::Dir`] or [`PinError::Locked`]; [`PinError::Pin`] for
    /// a staged pin that cannot be removed.
    pub fn open(dir: &Path) -> Result<Pins, PinError> {
        let existing = dir.ancestors().find(|p| p.exists()).unwrap_or(dir);
        if !on_bpffs(existing) {
            return Err(PinError::NotBpffs {
                dir: dir.to_path_buf(),
            });
        }
        let err = |source| PinError::Dir {
            dir: dir.to_path_buf(),
            source,
        };
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(err)?;
        std::fs::set_permissions(dir, Permissions::from_mode(0o700)).map_err(err)?;
        check_owners(dir)?;
        let lock = lock(dir)?;
        remove_tree(&dir.join(STAGED))?;
        let found = survey(dir);
        Ok(Pins {
            dir: dir.to_path_buf(),
            lock: ManuallyDrop::new(lock),
            found,
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// What this lb found pinned when it opened the directory.
    pub fn found(&self) -> &Found {
        &self.found
    }

    /// Whether an earlier lb left maps here that this one adopted as they are.
    pub fn adopted(&self) -> bool {
        self.found == Found::Adopt
    }

    /// Where each connect-time map is pinned, for the loader (aya opens a pin that exists,
    /// else creates and pins); none when the pinned maps are to be rebuilt (the loader then
    /// makes new ones, which [`Pins::stage_maps`] pins aside).
    pub fn map_paths(&self) -> Vec<(&'static str, PathBuf)> {
        if matches!(self.found, Found::Rebuild(_)) {
            return Vec::new();
        }
        CONNECT_MAPS
            .iter()
            .map(|name| (*name, self.dir.join(name)))
            .collect()
    }

    /// Where program `name`'s link is pinned.
    pub(in crate::datapath) fn link_path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Pin each connect-time map of `ebpf` (just loaded, its maps new) in the staging
    /// subdirectory (mode 0700, pins 0600), where [`Pins::commit_staged`] takes them from.
    ///
    /// # Errors
    /// [`PinError::Dir`]; [`PinError::Pin`] for a map missing from `ebpf` or not pinned.
    pub(in crate::datapath) fn stage_maps(&self, ebpf: &aya::Ebpf) -> Result<(), PinError> {
        let staged = self.dir.join(STAGED);
        DirBuilder::new()
            .mode(0o700)
            .create(&staged)
            .map_err(|source| PinError::Dir {
                dir: staged.clone(),
                source,
            })?;
        for name in CONNECT_MAPS {
            let path = staged.join(name);
            let map = ebpf
                .map(name)
                .ok_or_else(|| PinError::pin(&path, "no such map in this build's object"))?;
            map.pin(&path).map_err(|e| PinError::pin(&path, e))?;
            restrict(&path)?;
        }
        Ok(())
    }

    /// Move every staged map pin over the one of its name (a rename in the bpffs: the old
    /// map's pin goes in the same step), then remove the staging directory; how many moved.
    ///
    /// # Errors
    /// [`PinError::Pin`] naming the pin that could not be moved (those before it moved).
    pub(in crate::datapath) fn commit_staged(&self) -> Result<usize, PinError> {
        let staged = self.dir.join(STAGED);
        let mut moved = 0;
        for name in CONNECT_MAPS {
            let from = staged.join(name);
            if from.exists() {
                std::fs::rename(&from, self.dir.join(name)).map_err(|e| PinError::pin(&from, e))?;
                moved += 1;
            }
        }
        remove_tree(&staged)?;
        Ok(moved)
    }

    /// Remove the pins this build does not know: a link of a program it does not have
    /// (unpinned, it detaches) or a map it does not use; how many went.
    ///
    /// # Errors
    /// [`PinError::Dir`] or [`PinError::Pin`].
    pub(in crate::datapath) fn remove_defunct(&self) -> Result<usize, PinError> {
        let err = |source| PinError::Dir {
            dir: self.dir.clone(),
            source,
        };
        let mut removed = 0;
        for entry in std::fs::read_dir(&self.dir).map_err(err)? {
            let path = entry.map_err(err)?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            let known = CONNECT_MAPS.contains(&name) || CONNECT_PROGS.contains(&name);
            if known || path.is_dir() {
                continue;
            }
            std::fs::remove_file(&path).map_err(|e| PinError::pin(&path, e))?;
            removed += 1;
        }
        Ok(removed)
    }

    /// The link of program `name` pinned here, if any, once it is attached to `cgroup` (a
    /// `datapath.cgroup` changed since the pins were made is refused: the programs would go on
    /// serving the old cgroup while lb believed them on the new one).
    ///
    /// # Errors
    /// [`PinError::Pin`]: a pin of that name that is no link; [`PinError::OtherCgroup`].
    pub fn adopt_link(&self, name: &str, cgroup: &Path) -> Result<Option<FdLink>, PinError> {
        let path = self.dir.join(name);
        if !path.exists() {
            return Ok(None);
        }
        let pinned = link_cgroup_id(&path).map_err(|e| PinError::pin(&path, e))?;
        let want = std::fs::metadata(cgroup)
            .map_err(|e| PinError::pin(cgroup, e))?
            .ino();
        if pinned != want {
            return Err(PinError::OtherCgroup {
                dir: self.dir.clone(),
                pinned,
                cgroup: cgroup.to_path_buf(),
                want,
            });
        }
        let link = PinnedLink::from_pin(&path).map_err(|e| PinError::pin(&path, e))?;
        Ok(Some(FdLink::from(link)))
    }

    /// Pin `link` as program `name`'s (mode 0600); returns it, still held by this process.
    ///
    /// # Errors
    /// [`PinError::Pin`].
    pub fn pin_link(&self, name: &str, link: FdLink) -> Result<FdLink, PinError> {
        let path = self.dir.join(name);
        let pinned = link.pin(&path).map_err(|e| PinError::pin(&path, e))?;
        restrict(&path)?;
        Ok(FdLink::from(pinned))
    }

    /// Give every pin in the directory mode 0600 (aya pins maps with the process's umask).
    ///
    /// # Errors
    /// [`PinError::Pin`].
    pub fn restrict_all(&self) -> Result<(), PinError> {
        for (_, path) in self.map_paths() {
            if path.exists() {
                restrict(&path)?;
            }
        }
        Ok(())
    }

    /// A new descriptor of the locked directory (the lock goes with it, for a hand-over).
    ///
    /// # Errors
    /// Out of descriptors.
    pub fn lock_fd(&self) -> io::Result<std::os::fd::OwnedFd> {
        use std::os::fd::AsFd as _;
        (**self.lock).as_fd().try_clone_to_owned()
    }

    /// The pins of the lb that handed over `fd` (a descriptor of its locked directory, which
    /// carries the lock).
    ///
    /// # Errors
    /// [`PinError::Dir`]: the descriptor's path cannot be read.
    pub fn from_lock_fd(fd: std::os::fd::OwnedFd) -> Result<Pins, PinError> {
        use std::os::fd::AsRawFd as _;
        let link = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
        let dir = std::fs::read_link(&link).map_err(|source| PinError::Dir {
            dir: link.clone(),
            source,
        })?;
        // Already locked by this open file description: locking again only confirms it.
        let lock = Flock::lock(File::from(fd), FlockArg::LockExclusiveNonblock)
            .map_err(|_| PinError::Locked { dir: dir.clone() })?;
        Ok(Pins {
            dir,
            lock: ManuallyDrop::new(lock),
            found: Found::Adopt,
        })
    }
}

/// Refuse a pin directory another user could swap from under lb: every directory from the
/// bpffs mount down to `dir` must be owned by lb's effective user (root may own the mount)
/// and writable by nobody else, but for a mount that is world-writable with the sticky bit.
fn check_owners(dir: &Path) -> Result<(), PinError> {
    let euid = nix::unistd::geteuid().as_raw();
    let mount = dir
        .ancestors()
        .take_while(|p| on_bpffs(p))
        .last()
        .unwrap_or(dir);
    for path in dir.ancestors().take_while(|p| p.starts_with(mount)) {
        let meta = std::fs::metadata(path).map_err(|source| PinError::Dir {
            dir: path.to_path_buf(),
            source,
        })?;
        if let Some(why) = unsafe_dir(meta.uid(), meta.mode(), euid, path == mount) {
            return Err(PinError::Unsafe {
                dir: dir.to_path_buf(),
                path: path.to_path_buf(),
                why,
                euid,
            });
        }
    }
    Ok(())
}

/// What makes a directory of owner `uid` and `mode` unsafe on the way to lb's pins (`None`:
/// nothing); `mount` for the bpffs mount itself.
fn unsafe_dir(uid: u32, mode: u32, euid: u32, mount: bool) -> Option<String> {
    const STICKY: u32 = 0o1000;
    if uid != euid && !(mount && uid == 0) {
        return Some(format!("owned by uid {uid}"));
    }
    let writable = mode & 0o022;
    if writable != 0 && !(mount && mode & STICKY != 0) {
        return Some(format!(
            "mode {:04o}, writable by group or others",
            mode & 0o7777
        ));
    }
    None
}

/// Take `dir`'s exclusive lock without waiting.
fn lock(dir: &Path) -> Result<Flock<File>, PinError> {
    let file = File::open(dir).map_err(|source| PinError::Dir {
        dir: dir.to_path_buf(),
        source,
    })?;
    Flock::lock(file, FlockArg::LockExclusiveNonblock).map_err(|(_, errno)| {
        if errno == nix::errno::Errno::EWOULDBLOCK {
            PinError::Locked {
                dir: dir.to_path_buf(),
            }
        } else {
            PinError::Dir {
                dir: dir.to_path_buf(),
                source: errno.into(),
            }
        }
    })
}

/// The id of the cgroup the link pinned at `path` is attached to (`bpf_link_info.cgroup`; on
/// cgroup v2 a cgroup's id is its directory's inode number).
fn link_cgroup_id(path: &Path) -> io::Result<u64> {
    use std::os::fd::AsFd as _;
    let fd = syscall::obj_get(path)?;
    let info = syscall::link_info(fd.as_fd())?;
    if info.kind != syscall::BPF_LINK_TYPE_CGROUP {
        return Err(io::Error::other("not a cgroup link"));
    }
    Ok(info.cgroup_id)
}

/// Mode 0600 for one pin.
fn restrict(path: &Path) -> Result<(), PinError> {
    std::fs::set_permissions(path, Permissions::from_mode(0o600))
        .map_err(|e| PinError::pin(path, e))
}

/// Remove `dir` and every pin in it (unpinned links detach); nothing there is fine.
fn remove_tree(dir: &Path) -> Result<(), PinError> {
    if !dir.exists() {
        return Ok(());
    }
    let err = |source| PinError::Dir {
        dir: dir.to_path_buf(),
        source,
    };
    for entry in std::fs::read_dir(dir).map_err(err)? {
        let path = entry.map_err(err)?.path();
        std::fs::remove_file(&path).map_err(|e| PinError::pin(&path, e))?;
    }
    std::fs::remove_dir(dir).map_err(err)
}

/// What [`cleanup`] removed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Cleaned {
    /// Links unpinned (each program detached).
    pub links: usize,
    /// Other pins removed (maps).
    pub maps: usize,
}

/// Detach and remove everything pinned in `dir`, then `dir` itself. Nothing there is fine.
///
/// # Errors
/// [`PinError::Locked`] while a live lb holds the directory (nothing is touched);
/// [`PinError::Dir`] or [`PinError::Pin`].
pub fn cleanup(dir: &Path) -> Result<Cleaned, PinError> {
    let mut out = Cleaned::default();
    if !dir.exists() {
        return Ok(out);
    }
    let _lock = lock(dir)?;
    let err = |source| PinError::Dir {
        dir: dir.to_path_buf(),
        source,
    };
    for entry in std::fs::read_dir(dir).map_err(err)? {
        let path = entry.map_err(err)?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if CONNECT_PROGS.contains(&name) {
            // Unpinned, the link's last reference goes with this descriptor: it detaches.
            let link = PinnedLink::from_pin(&path).map_err(|e| PinError::pin(&path, e))?;
            drop(link.unpin().map_err(|e| PinError::pin(&path, e))?);
            out.links += 1;
        } else if path.is_dir() {
            std::fs::remove_dir(&path).map_err(|e| PinError::pin(&path, e))?;
        } else {
            std::fs::remove_file(&path).map_err(|e| PinError::pin(&path, e))?;
            out.maps += 1;
        }
    }
    std::fs::remove_dir(dir).map_err(err)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A configured directory wins; without one the default is under the bpffs found, if any.
    #[test]
    fn the_configured_directory_wins() {
        let dir = Path::new("/somewhere/pins");
        assert_eq!(resolve_dir(Some(dir)).as_deref(), Some(dir));
        assert_eq!(
            resolve_dir(None),
            bpffs_mount().map(|m| m.join("lb").join("default"))
        );
    }

    /// A pin directory's ancestors: lb's own and 0700 pass; another user's, or writable by
    /// group or others, are refused; the mount may be root's, or 1777 as `/tmp` is.
    #[test]
    fn directories_another_user_could_replace_are_refused() {
        assert_eq!(unsafe_dir(0, 0o40700, 0, false), None);
        assert_eq!(unsafe_dir(0, 0o40700, 1000, true), None);
        assert_eq!(unsafe_dir(0, 0o41777, 1000, true), None);
        assert_eq!(
            unsafe_dir(1000, 0o40700, 0, false).as_deref(),
            Some("owned by uid 1000")
        );
        assert_eq!(
            unsafe_dir(0, 0o40777, 0, false).as_deref(),
            Some("mode 0777, writable by group or others")
        );
        assert_eq!(
            unsafe_dir(0, 0o41777, 0, false).as_deref(),
            Some("mode 1777, writable by group or others")
        );
        assert!(unsafe_dir(0, 0o40775, 0, true).is_some());
    }

    /// A directory outside any bpffs is refused before anything is made.
    #[test]
    fn a_directory_outside_a_bpffs_is_refused() {
        let dir = std::env::temp_dir().join(format!("lb-pins-test-{}", std::process::id()));
        let e = Pins::open(&dir).unwrap_err();
        assert!(matches!(e, PinError::NotBpffs { .. }), "{e}");
        assert!(!dir.exists());
    }
}
