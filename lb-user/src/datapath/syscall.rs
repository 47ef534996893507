//! The `bpf(2)` commands lb needs that aya 0.14 keeps private, each a raw call with its
//! `union bpf_attr` laid out as the kernel's `include/uapi/linux/bpf.h` gives it: opening a
//! pinned object, reading a link's info, opening a link by id, and swapping a link's program.
//!
//! Minimum kernel: 5.7 (cgroup BPF links, `BPF_LINK_UPDATE` of a cgroup link); 4.4 for
//! `BPF_OBJ_GET`.

use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

/// `enum bpf_cmd` values used here.
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_UPDATE: libc::c_long = 29;
const BPF_LINK_GET_FD_BY_ID: libc::c_long = 30;
/// `enum bpf_link_type`: a cgroup link.
pub(super) const BPF_LINK_TYPE_CGROUP: u32 = 3;

/// `bpf(cmd, attr, size_of(attr))`: its non-negative result.
///
/// # Errors
/// The kernel's errno.
fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a live, initialised value of the size passed, laid out as the kernel's
    // `union bpf_attr` for `cmd` (each caller's comment says how); any pointer in it is to
    // memory that outlives the call and is as large as the length beside it.
    #[expect(unsafe_code, reason = "aya 0.14 does not expose these bpf commands")]
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_mut(attr),
            size_of_val(attr),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r)
}

/// A descriptor the kernel just returned, owned by nobody else.
fn owned(fd: libc::c_long) -> io::Result<OwnedFd> {
    let fd = i32::try_from(fd).map_err(io::Error::other)?;
    #[expect(
        unsafe_code,
        reason = "taking ownership of a descriptor the kernel returned"
    )]
    // SAFETY: the kernel returned this descriptor to this process just now; nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok(fd)
}

/// `BPF_OBJ_GET`: a new descriptor of the object (map, program or link) pinned at `path`.
///
/// # Errors
/// No such pin, not a bpffs, or no permission.
pub(super) fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let c_path = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // `union bpf_attr` for BPF_OBJ_GET: pathname (u64), bpf_fd, file_flags (u32 each, zero).
    let mut attr: [u64; 2] = [c_path.as_ptr() as u64, 0];
    owned(bpf(BPF_OBJ_GET, &mut attr)?)
}

/// The keys of the map `fd` whose keys are 8 bytes (`BPF_MAP_GET_NEXT_KEY`), at most `max`,
/// read as native-endian `u64`s. A map written meanwhile may give a key twice or miss one.
///
/// # Errors
/// `fd` is no map, or its keys are not 8 bytes (`EINVAL`, `EFAULT`).
pub(super) fn map_u64_keys(fd: BorrowedFd<'_>, max: usize) -> io::Result<Vec<u64>> {
    let raw_fd = u64::try_from(fd.as_raw_fd()).map_err(io::Error::other)?;
    let mut keys = Vec::new();
    let mut key = 0u64;
    let mut next = 0u64;
    while keys.len() < max {
        // `union bpf_attr` for BPF_MAP_GET_NEXT_KEY: map_fd (u32, then 4 bytes of padding),
        // the key's address (0: from the first key), next_key's address.
        let from = if keys.is_empty() {
            0
        } else {
            std::ptr::from_ref(&key) as u64
        };
        let mut attr: [u64; 3] = [raw_fd, from, std::ptr::from_mut(&mut next) as u64];
        match bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => break,
            Err(e) => return Err(e),
        }
        keys.push(next);
        key = next;
    }
    Ok(keys)
}

/// `BPF_LINK_GET_FD_BY_ID`: a new descriptor of link `id` (needs `CAP_SYS_ADMIN`).
///
/// # Errors
/// No such link, or no permission.
pub(super) fn link_fd_by_id(id: u32) -> io::Result<OwnedFd> {
    // `union bpf_attr` for the *_GET_FD_BY_ID commands: the id, next_id, open_flags; the
    // kernel wants whatever it is not given to be zero.
    let mut attr: [u32; 4] = [id, 0, 0, 0];
    owned(bpf(BPF_LINK_GET_FD_BY_ID, &mut attr)?)
}

/// What lb reads of a link (`struct bpf_link_info`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct LinkInfo {
    /// `enum bpf_link_type` ([`BPF_LINK_TYPE_CGROUP`] for lb's).
    pub kind: u32,
    /// The link's id.
    pub id: u32,
    /// The id of the program it runs.
    pub prog_id: u32,
    /// For a cgroup link, the cgroup's id (on cgroup v2 its directory's inode number).
    pub cgroup_id: u64,
}

/// `BPF_OBJ_GET_INFO_BY_FD` of the link `fd`.
///
/// # Errors
/// `fd` is no BPF object.
pub(super) fn link_info(fd: BorrowedFd<'_>) -> io::Result<LinkInfo> {
    // `struct bpf_link_info`: type, id, prog_id (u32 each), then at byte 16 the union, whose
    // cgroup member starts with the cgroup id (u64).
    let mut info = [0u64; 16];
    let info_len = u32::try_from(size_of_val(&info)).map_err(io::Error::other)?;
    let raw_fd = u64::try_from(fd.as_raw_fd()).map_err(io::Error::other)?;
    // `union bpf_attr` for BPF_OBJ_GET_INFO_BY_FD: bpf_fd and info_len (u32 each), info's
    // address; the kernel writes at most `info_len` bytes there.
    let mut attr: [u64; 2] = [
        raw_fd | (u64::from(info_len) << 32),
        info.as_mut_ptr() as u64,
    ];
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    let low = |w: u64| u32::try_from(w & 0xffff_ffff).unwrap_or_default();
    Ok(LinkInfo {
        kind: low(info[0]),
        id: low(info[0] >> 32),
        prog_id: low(info[1]),
        cgroup_id: info[2],
    })
}

/// `BPF_LINK_UPDATE`: the link `link` runs program `prog` from now on. For a cgroup link the
/// kernel swaps the program in the cgroup's effective arrays in one step (`cgroup_bpf_replace`):
/// every hook run sees the old program or the new one, never neither. The program must be of
/// the link's type and attach type.
///
/// # Errors
/// `EINVAL` for a program of another type or attach type; `EPERM`.
pub(super) fn link_update(link: BorrowedFd<'_>, prog: BorrowedFd<'_>) -> io::Result<()> {
    let as_u32 = |fd: BorrowedFd<'_>| u32::try_from(fd.as_raw_fd()).map_err(io::Error::other);
    // `union bpf_attr` for BPF_LINK_UPDATE: link_fd, new_prog_fd, flags, old_prog_fd (u32
    // each; no flag, so no old program to compare).
    let mut attr: [u32; 4] = [as_u32(link)?, as_u32(prog)?, 0, 0];
    bpf(BPF_LINK_UPDATE, &mut attr)?;
    Ok(())
}
