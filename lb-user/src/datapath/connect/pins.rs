//! The connect-time programs' pins: their links and maps in a directory of a bpffs, so they
//! keep rewriting after lb exits, however it exits (`kill -9` included), until lb's heartbeat is
//! older than `datapath.orphan_timeout`. One lb per directory, held with an exclusive `flock` on
//! the directory itself (a bpffs holds no regular files); the directories are mode 0700, the pins
//! 0600, owned by lb's user. A new lb adopts what it finds (no second attach, and the programs
//! never stop), once the layout version in `LB_CONNECT_CTL` is its own; `lb cleanup` detaches and
//! removes everything. The splice's objects are never pinned: they die with lb.
//!
//! Minimum kernel: 5.7 (pinned cgroup links), 4.4 for a bpffs.

use std::{
    fs::{DirBuilder, File, Permissions},
    io,
    mem::ManuallyDrop,
    os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
};

use aya::{
    maps::{Array, MapData},
    programs::links::{FdLink, PinnedLink},
};
use lb_common::{CONNECT_MAPS, CONNECT_PIN_LAYOUT, CONNECT_PROGS, CTL_LAYOUT, MAP_CONNECT_CTL};
use nix::fcntl::{Flock, FlockArg};

/// Mount point lb prefers when several bpffs are mounted.
const SYS_FS_BPF: &str = "/sys/fs/bpf";

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
    /// Another live lb holds the directory's lock.
    #[error(
        "pin directory {dir} is held by another running lb (stop it first, or give this one another datapath.pin_dir)"
    )]
    Locked {
        /// The directory.
        dir: PathBuf,
    },
    /// The pins were left by a lb whose kernel objects differ from this one's.
    #[error(
        "pin directory {dir} holds connect-time objects of layout version {found}, this lb's are version {want}: they stay attached and keep serving; to replace them run `lb cleanup --pin-dir {dir}` (connects are then not rewritten until lb starts), then start lb again",
        dir = dir.display()
    )]
    Layout {
        /// The directory.
        dir: PathBuf,
        /// The pinned objects' version.
        found: u64,
        /// This lb's ([`CONNECT_PIN_LAYOUT`]).
        want: u64,
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
    adopted: bool,
}

impl Pins {
    /// Make (mode 0700) and lock `dir`, and check the layout of what is pinned there.
    ///
    /// # Errors
    /// [`PinError::NotBpffs`], [`PinError::Dir`], [`PinError::Locked`], [`PinError::Layout`], or
    /// [`PinError::Pin`] for a control map that cannot be read.
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
        let lock = lock(dir)?;
        let found = pinned_layout(dir)?;
        if let Some(found) = found
            && found != CONNECT_PIN_LAYOUT
        {
            return Err(PinError::Layout {
                dir: dir.to_path_buf(),
                found,
                want: CONNECT_PIN_LAYOUT,
            });
        }
        Ok(Pins {
            dir: dir.to_path_buf(),
            lock: ManuallyDrop::new(lock),
            adopted: found.is_some(),
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether an earlier lb left objects here that this one adopted.
    pub fn adopted(&self) -> bool {
        self.adopted
    }

    /// Where each connect-time map is pinned (aya opens a pin that exists, else creates and pins).
    pub fn map_paths(&self) -> Vec<(&'static str, PathBuf)> {
        CONNECT_MAPS
            .iter()
            .map(|name| (*name, self.dir.join(name)))
            .collect()
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
            adopted: true,
        })
    }
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
/// cgroup v2 a cgroup's id is its directory's inode number). aya 0.14 exposes neither
/// `BPF_OBJ_GET` of a link's descriptor nor that field.
fn link_cgroup_id(path: &Path) -> io::Result<u64> {
    use std::os::{
        fd::{FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    };
    const BPF_OBJ_GET: libc::c_long = 7;
    const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    const BPF_LINK_TYPE_CGROUP: u64 = 3;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // `union bpf_attr` for BPF_OBJ_GET: the path's address, then bpf_fd, file_flags (zero).
    let get: [u64; 2] = [c_path.as_ptr() as u64, 0];
    // SAFETY: the kernel reads 16 bytes of a live array and the NUL-terminated path it points
    // to, which outlives the call; it returns a new descriptor (or -1) nobody else owns.
    #[expect(unsafe_code, reason = "aya 0.14 does not expose BPF_OBJ_GET")]
    let fd = unsafe {
        let fd = libc::syscall(libc::SYS_bpf, BPF_OBJ_GET, get.as_ptr(), size_of_val(&get));
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        OwnedFd::from_raw_fd(i32::try_from(fd).map_err(io::Error::other)?)
    };
    // `struct bpf_link_info`: type, id, prog_id (u32 each), then at byte 16 the union, whose
    // cgroup member starts with the cgroup id (u64).
    let mut info = [0u64; 16];
    let info_len = u32::try_from(size_of_val(&info)).map_err(io::Error::other)?;
    let raw_fd = u64::try_from(std::os::fd::AsRawFd::as_raw_fd(&fd)).map_err(io::Error::other)?;
    // `union bpf_attr` for BPF_OBJ_GET_INFO_BY_FD: bpf_fd and info_len (u32 each), info's address.
    let attr: [u64; 2] = [
        raw_fd | (u64::from(info_len) << 32),
        info.as_mut_ptr() as u64,
    ];
    // SAFETY: the kernel reads 16 bytes of a live array and writes at most `info_len` bytes into
    // `info`, which lives across the call.
    #[expect(unsafe_code, reason = "aya 0.14 does not expose a link's cgroup id")]
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET_INFO_BY_FD,
            attr.as_ptr(),
            size_of_val(&attr),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    if info[0] & 0xffff_ffff != BPF_LINK_TYPE_CGROUP {
        return Err(io::Error::other("not a cgroup link"));
    }
    Ok(info[2])
}

/// Mode 0600 for one pin.
fn restrict(path: &Path) -> Result<(), PinError> {
    std::fs::set_permissions(path, Permissions::from_mode(0o600))
        .map_err(|e| PinError::pin(path, e))
}

/// The layout version in the pinned `LB_CONNECT_CTL`, `None` when nothing is pinned there.
fn pinned_layout(dir: &Path) -> Result<Option<u64>, PinError> {
    let path = dir.join(MAP_CONNECT_CTL);
    if !path.exists() {
        return Ok(None);
    }
    let data = MapData::from_pin(&path).map_err(|e| PinError::pin(&path, e))?;
    let map = aya::maps::Map::from_map_data(data).map_err(|e| PinError::pin(&path, e))?;
    let ctl: Array<MapData, u64> = Array::try_from(map).map_err(|e| PinError::pin(&path, e))?;
    ctl.get(&CTL_LAYOUT, 0)
        .map(Some)
        .map_err(|e| PinError::pin(&path, e))
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

    /// A layout refusal names both versions, that the pins keep serving and the way on.
    #[test]
    fn layout_refusal_names_both_versions_and_the_way_on() {
        let e = PinError::Layout {
            dir: "/sys/fs/bpf/lb/default".into(),
            found: 7,
            want: CONNECT_PIN_LAYOUT,
        }
        .to_string();
        assert!(e.contains("layout version 7"), "{e}");
        assert!(
            e.contains(&format!("are version {CONNECT_PIN_LAYOUT}")),
            "{e}"
        );
        assert!(e.contains("keep serving"), "{e}");
        assert!(
            e.contains("lb cleanup --pin-dir /sys/fs/bpf/lb/default"),
            "{e}"
        );
    }

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

    /// A directory outside any bpffs is refused before anything is made.
    #[test]
    fn a_directory_outside_a_bpffs_is_refused() {
        let dir = std::env::temp_dir().join(format!("lb-pins-test-{}", std::process::id()));
        let e = Pins::open(&dir).unwrap_err();
        assert!(matches!(e, PinError::NotBpffs { .. }), "{e}");
        assert!(!dir.exists());
    }
}
