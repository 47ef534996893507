//! The BPF programs attached to a test cgroup, one line each as `bpftool cgroup show` prints
//! them (`ID  ATTACH_TYPE  [FLAGS]  NAME`). bpftool 7.1 (Debian 12's) refuses `cgroup show` on
//! kernels before 6.0 (it queries the `lsm_cgroup` attach type first and gives up on the
//! refusal); there the attach types lb uses are queried directly (`BPF_PROG_QUERY`) and each
//! program's name read with `bpftool prog show id`.

use std::path::Path;

use anyhow::{Context as _, Result};

use crate::cgroup::{ATTR_BYTES, bpf};

const BPF_PROG_QUERY: libc::c_long = 16;

/// The attach types lb's programs use, with bpftool's names for them (`enum bpf_attach_type`
/// values from the kernel's UAPI `linux/bpf.h`).
const ATTACH_TYPES: [(u32, &str); 6] = [
    (3, "sock_ops"),
    (10, "connect4"),
    (11, "connect6"),
    (29, "getpeername4"),
    (30, "getpeername6"),
    (34, "sock_release"),
];

/// The programs attached to `cgroup` (see the module doc).
///
/// # Errors
/// The cgroup cannot be opened, or bpftool fails on a kernel where it should work.
pub fn cgroup_programs(cgroup: &Path) -> Result<String> {
    let path = cgroup.display().to_string();
    match crate::sh("bpftool", &["cgroup", "show", &path]) {
        Ok(shown) => Ok(shown),
        Err(e) if crate::kernel_version().is_some_and(|v| v < (6, 0)) => {
            queried(cgroup).with_context(|| format!("after {e:#}"))
        }
        Err(e) => Err(e),
    }
}

fn queried(cgroup: &Path) -> Result<String> {
    use std::os::fd::AsRawFd as _;
    let dir = std::fs::File::open(cgroup).with_context(|| format!("{}", cgroup.display()))?;
    let mut out = String::new();
    for (ty, name) in ATTACH_TYPES {
        let mut ids = [0u32; 64];
        let mut attr = [0u8; ATTR_BYTES];
        attr[0..4].copy_from_slice(&u32::try_from(dir.as_raw_fd())?.to_ne_bytes());
        attr[4..8].copy_from_slice(&ty.to_ne_bytes());
        attr[16..24].copy_from_slice(&(ids.as_mut_ptr() as u64).to_ne_bytes());
        attr[24..28].copy_from_slice(&64u32.to_ne_bytes());
        bpf(BPF_PROG_QUERY, &mut attr).with_context(|| format!("BPF_PROG_QUERY {name}"))?;
        let count = u32::from_ne_bytes(attr[24..28].try_into()?) as usize;
        for id in &ids[..count.min(ids.len())] {
            let shown = crate::sh("bpftool", &["prog", "show", "id", &id.to_string()])?;
            let prog = shown
                .split_whitespace()
                .skip_while(|w| *w != "name")
                .nth(1)
                .unwrap_or("?");
            out.push_str(&format!("{id}  {name}  {prog}\n"));
        }
    }
    Ok(out)
}
