//! Attaching the connect-time programs (`connect4/6`, `getpeername4/6` and `sock_release`) to
//! the cgroup with links.

use aya::{
    Ebpf,
    programs::{CgroupAttachMode, CgroupSock, CgroupSockAddr, links::FdLink},
};
use lb_common::{
    PROG_CONNECT_RELEASE, PROG_CONNECT4, PROG_CONNECT6, PROG_GETPEERNAME4, PROG_GETPEERNAME6,
};
use tracing::warn;

use super::{DatapathError, probe};

/// Load program `$name` of aya type `$ty` (a cgroup program) from `$ebpf`, attach it to
/// `$cgroup` with a link and return the link as an [`FdLink`]. A macro, not a function: aya's
/// cgroup program types share these methods but no trait.
macro_rules! attach_cgroup {
    ($ebpf:expr, $name:expr, $ty:ty, $cgroup:expr) => {{
        let name: &'static str = $name;
        let err = |source| DatapathError::Program {
            program: name,
            source,
        };
        let prog: &mut $ty = $ebpf
            .program_mut(name)
            .ok_or(DatapathError::Missing(name))?
            .try_into()
            .map_err(err)?;
        prog.load().map_err(err)?;
        let link = prog
            .attach($cgroup, CgroupAttachMode::Single)
            .map_err(err)?;
        let link = prog.take_link(link).map_err(err)?;
        FdLink::try_from(link).map_err(|source| DatapathError::Link {
            program: name,
            source,
        })?
    }};
}

/// Load and attach the four connect-time programs to `cgroup` with links. Any of them missing
/// (program type, attach type, helper, or the verifier refusing) leaves connect-time forwarding
/// off; what is attached stays until lb exits and is harmless without a listener entry.
pub(super) fn attach_connect(
    ebpf: &mut Ebpf,
    cgroup: &std::fs::File,
) -> Result<Vec<(&'static str, FdLink)>, DatapathError> {
    probe::probe_connect()?;
    let mut links = Vec::new();
    for name in [
        PROG_GETPEERNAME4,
        PROG_GETPEERNAME6,
        PROG_CONNECT4,
        PROG_CONNECT6,
    ] {
        links.push((name, attach_cgroup!(ebpf, name, CgroupSockAddr, cgroup)));
    }
    match attach_release(ebpf, cgroup) {
        Ok(link) => links.push((PROG_CONNECT_RELEASE, link)),
        Err(e) => {
            warn!(reason = %crate::errors::chain(&e), "connect-time: sock_release program not attached (5.9+); records of connects that fail before sending a SYN stay until the map evicts them");
        }
    }
    Ok(links)
}

/// Load and attach `lb_connect_release` (cgroup `sock_release`, 5.9+), which forgets a
/// connect-time socket's record when its descriptor is closed.
///
/// # Errors
/// [`DatapathError::Program`] or [`DatapathError::Link`].
fn attach_release(ebpf: &mut Ebpf, cgroup: &std::fs::File) -> Result<FdLink, DatapathError> {
    Ok(attach_cgroup!(
        ebpf,
        PROG_CONNECT_RELEASE,
        CgroupSock,
        cgroup
    ))
}
