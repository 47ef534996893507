//! Attaching the connect-time programs (`connect4/6`, `getpeername4/6`, `sock_release` and
//! connect-time's own sockops program) to the cgroup with links; with a pin directory each link
//! is pinned, or adopted from its pin without attaching again.

use aya::{
    Ebpf,
    programs::{CgroupAttachMode, CgroupSock, CgroupSockAddr, SockOps, links::FdLink},
};
use lb_common::{
    PROG_CONNECT_RELEASE, PROG_CONNECT_SOCKOPS, PROG_CONNECT4, PROG_CONNECT6, PROG_GETPEERNAME4,
    PROG_GETPEERNAME6,
};
use tracing::{debug, info, warn};

use super::pins::Pins;
use crate::datapath::{DatapathError, probe};

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

/// Load and attach the connect-time programs to `cgroup` with links (connect4/6 last, once
/// what serves their sockets is in place). Any of them missing (program type, attach type,
/// helper, or the verifier refusing) leaves connect-time forwarding off; what is attached stays
/// until lb exits and is harmless without a listener entry. With `pins`, a program whose link is
/// pinned there is adopted (not attached again) and every new link is pinned.
pub(super) fn attach_connect(
    ebpf: &mut Ebpf,
    cgroup: &std::fs::File,
    cgroup_path: &std::path::Path,
    pins: Option<&Pins>,
) -> Result<Vec<(&'static str, FdLink)>, DatapathError> {
    probe::probe_connect()?;
    let mut links = Vec::new();
    let mut held = |name: &'static str,
                    attach: &mut dyn FnMut(&mut Ebpf) -> Result<FdLink, DatapathError>|
     -> Result<(), DatapathError> {
        let link = match pins {
            Some(p) => match p.adopt_link(name, cgroup_path)? {
                Some(link) => link,
                None => p.pin_link(name, attach(ebpf)?)?,
            },
            None => attach(ebpf)?,
        };
        links.push((name, link));
        Ok(())
    };
    for name in [PROG_GETPEERNAME4, PROG_GETPEERNAME6] {
        held(name, &mut |e| {
            Ok(attach_cgroup!(e, name, CgroupSockAddr, cgroup))
        })?;
    }
    held(PROG_CONNECT_SOCKOPS, &mut |e| {
        Ok(attach_cgroup!(e, PROG_CONNECT_SOCKOPS, SockOps, cgroup))
    })?;
    if let Err(e) = held(PROG_CONNECT_RELEASE, &mut |e| attach_release(e, cgroup)) {
        warn!(reason = %crate::errors::chain(&e), "connect-time: sock_release program not attached (5.9+); records of connects that fail before sending a SYN stay until the map evicts them");
    }
    for name in [PROG_CONNECT4, PROG_CONNECT6] {
        held(name, &mut |e| {
            Ok(attach_cgroup!(e, name, CgroupSockAddr, cgroup))
        })?;
    }
    if let Some(p) = pins {
        p.restrict_all()?;
    }
    Ok(links)
}

/// [`attach_connect`] with its links added to `links`, logged; `Some(reason)` on one line when
/// connect-time forwarding is off (a verifier log, when there is one, goes to debug level).
///
/// # Errors
/// [`DatapathError::Pins`]: pins this lb must not adopt (they keep serving; lb refuses to start).
pub(in crate::datapath) fn connect_or_why(
    ebpf: &mut Ebpf,
    cgroup_file: &std::fs::File,
    cgroup: &std::path::Path,
    pins: Option<&Pins>,
    links: &mut Vec<(&'static str, FdLink)>,
) -> Result<Option<String>, DatapathError> {
    Ok(match attach_connect(ebpf, cgroup_file, cgroup, pins) {
        Ok(l) => {
            links.extend(l);
            let cgroup = cgroup.display();
            match pins {
                Some(p) if p.adopted() => {
                    info!(%cgroup, pin_dir = %p.dir().display(), "connect-time programs adopted from their pins (attached throughout)")
                }
                Some(p) => {
                    info!(%cgroup, pin_dir = %p.dir().display(), "connect-time programs attached and pinned (connect4/6, getpeername4/6, sockops, sock_release)")
                }
                None => {
                    info!(%cgroup, "connect-time programs attached, not pinned (connect4/6, getpeername4/6, sockops, sock_release)")
                }
            }
            None
        }
        Err(e @ DatapathError::Pins(_)) => return Err(e),
        Err(e) => {
            let full = crate::errors::chain(&e);
            debug!(reason = %full, "connect-time programs not attached");
            let first = full.lines().next().unwrap_or_default();
            Some(
                first
                    .split(" Verifier output:")
                    .next()
                    .unwrap_or(first)
                    .to_string(),
            )
        }
    })
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
