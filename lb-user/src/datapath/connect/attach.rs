//! Attaching the connect-time programs (`connect4/6`, `getpeername4/6`, `sock_release` and
//! connect-time's own sockops program) to the cgroup with links; with a pin directory each new
//! link is pinned, and a link an earlier lb pinned is kept and given this build's program (see
//! [`super::swap`]).

use std::os::fd::{AsFd as _, OwnedFd};

use aya::{
    Ebpf,
    programs::{CgroupAttachMode, CgroupSock, CgroupSockAddr, SockOps, links::FdLink},
};
use lb_common::{
    PROG_CONNECT_RELEASE, PROG_CONNECT_SOCKOPS, PROG_CONNECT4, PROG_CONNECT6, PROG_GETPEERNAME4,
    PROG_GETPEERNAME6,
};
use tracing::{debug, info, warn};

use super::{pins::Pins, survey::Found, swap::Swap};
use crate::datapath::{DatapathError, probe};

/// The kind of cgroup hook a connect-time program runs at (aya's program type for it).
#[derive(Clone, Copy)]
enum Hook {
    /// `cgroup/connect4/6`, `cgroup/getpeername4/6`.
    SockAddr,
    /// `sockops`.
    SockOps,
    /// `cgroup/sock_release`.
    Sock,
}

/// Load program `$name` of aya type `$ty` (a cgroup program) from `$ebpf`; with `$cgroup`
/// (`Some`) attach it there with a link. Gives a copy of the program's descriptor and the
/// link. A macro, not a function: aya's cgroup program types share these methods but no trait.
macro_rules! load_cgroup {
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
        let fd = prog
            .fd()
            .map_err(err)?
            .as_fd()
            .try_clone_to_owned()
            .map_err(|source| DatapathError::Swap {
                program: name,
                source,
            })?;
        let link = match $cgroup {
            Some(cgroup) => Some(link_cgroup!(prog, name, cgroup)),
            None => None,
        };
        (fd, link)
    }};
}

/// Attach `$prog` (program `$name`, loaded, of a cgroup type) to the cgroup `$cgroup` with a
/// link and give the link as an [`FdLink`], detached when dropped unless pinned.
macro_rules! link_cgroup {
    ($prog:expr, $name:expr, $cgroup:expr) => {{
        let name: &'static str = $name;
        let err = |source| DatapathError::Program {
            program: name,
            source,
        };
        let id = $prog
            .attach($cgroup, CgroupAttachMode::Single)
            .map_err(err)?;
        let link = $prog.take_link(id).map_err(err)?;
        FdLink::try_from(link).map_err(|source| DatapathError::Link {
            program: name,
            source,
        })?
    }};
}

/// Attach the loaded connect4 program of `ebpf` to the cgroup `cgroup` with a link of its own
/// (the netns probe's cgroup, see `netns_probe::learn`).
///
/// # Errors
/// [`DatapathError::Missing`], [`DatapathError::Program`] or [`DatapathError::Link`].
pub(super) fn link_connect4(
    ebpf: &mut Ebpf,
    cgroup: &std::fs::File,
) -> Result<FdLink, DatapathError> {
    let err = |source| DatapathError::Program {
        program: PROG_CONNECT4,
        source,
    };
    let prog: &mut CgroupSockAddr = ebpf
        .program_mut(PROG_CONNECT4)
        .ok_or(DatapathError::Missing(PROG_CONNECT4))?
        .try_into()
        .map_err(err)?;
    Ok(link_cgroup!(prog, PROG_CONNECT4, cgroup))
}

/// Load program `name` (a `hook` one), and with `cgroup` attach it there.
fn load(
    ebpf: &mut Ebpf,
    name: &'static str,
    hook: Hook,
    cgroup: Option<&std::fs::File>,
) -> Result<(OwnedFd, Option<FdLink>), DatapathError> {
    Ok(match hook {
        Hook::SockAddr => load_cgroup!(ebpf, name, CgroupSockAddr, cgroup),
        Hook::SockOps => load_cgroup!(ebpf, name, SockOps, cgroup),
        Hook::Sock => load_cgroup!(ebpf, name, CgroupSock, cgroup),
    })
}

/// The links [`attach_connect`] holds, and the pinned ones still to be swapped.
pub(super) type Attached = (Vec<(&'static str, FdLink)>, Vec<Swap>);

/// Load and attach the connect-time programs to `cgroup` with links (connect4/6 last, once
/// what serves their sockets is in place). Any of them missing (program type, attach type,
/// helper, or the verifier refusing) leaves connect-time forwarding off; what is attached stays
/// until lb exits and is harmless without a listener entry. With `pins`, a program whose link
/// is pinned there keeps that link, which runs this program from now on (pinned maps adopted)
/// or once [`crate::datapath::Datapath::finish_takeover`] swaps it (pinned maps rebuilt: the
/// swaps are returned); every new link is pinned.
pub(super) fn attach_connect(
    ebpf: &mut Ebpf,
    cgroup: &std::fs::File,
    cgroup_path: &std::path::Path,
    pins: Option<&Pins>,
) -> Result<Attached, DatapathError> {
    probe::probe_connect()?;
    let rebuild = pins.is_some_and(|p| matches!(p.found(), Found::Rebuild(_)));
    let mut links = Vec::new();
    let mut pending = Vec::new();
    let mut held = |name: &'static str, hook: Hook| -> Result<(), DatapathError> {
        let link = match pins {
            Some(p) => match p.adopt_link(name, cgroup_path)? {
                Some(link) => {
                    let (prog, _) = load(ebpf, name, hook, None)?;
                    let swap = Swap::new(name, &p.link_path(name), prog.as_fd())?;
                    if rebuild {
                        pending.push(swap);
                    } else {
                        swap.run()?;
                    }
                    link
                }
                None => p.pin_link(name, attached(load(ebpf, name, hook, Some(cgroup))?))?,
            },
            None => attached(load(ebpf, name, hook, Some(cgroup))?),
        };
        links.push((name, link));
        Ok(())
    };
    for name in [PROG_GETPEERNAME4, PROG_GETPEERNAME6] {
        held(name, Hook::SockAddr)?;
    }
    held(PROG_CONNECT_SOCKOPS, Hook::SockOps)?;
    if let Err(e) = held(PROG_CONNECT_RELEASE, Hook::Sock) {
        warn!(reason = %crate::errors::chain(&e), "connect-time: sock_release program not attached (5.9+); records of connects that fail before sending a SYN stay until the map evicts them");
    }
    for name in [PROG_CONNECT4, PROG_CONNECT6] {
        held(name, Hook::SockAddr)?;
    }
    if let Some(p) = pins {
        p.restrict_all()?;
        if !rebuild {
            let defunct = p.remove_defunct()?;
            if defunct > 0 {
                info!(defunct, pin_dir = %p.dir().display(), "pins of programs or maps this lb does not have removed");
            }
        }
    }
    Ok((links, pending))
}

/// The link of what [`load`] attached.
fn attached((_, link): (OwnedFd, Option<FdLink>)) -> FdLink {
    link.expect("load() with a cgroup attaches")
}

/// [`attach_connect`] with its links added to `links` and the swaps a rebuild leaves for later
/// in `takeover`, logged; `Some(reason)` on one line when connect-time forwarding is off (a
/// verifier log, when there is one, goes to debug level).
///
/// # Errors
/// [`DatapathError::Pins`]: pins this lb must not take over (attached to another cgroup; they
/// keep serving, lb refuses to start).
pub(in crate::datapath) fn connect_or_why(
    ebpf: &mut Ebpf,
    cgroup_file: &std::fs::File,
    cgroup: &std::path::Path,
    pins: Option<&Pins>,
    links: &mut Vec<(&'static str, FdLink)>,
    takeover: &mut Option<Vec<Swap>>,
) -> Result<Option<String>, DatapathError> {
    Ok(match attach_connect(ebpf, cgroup_file, cgroup, pins) {
        Ok((l, pending)) => {
            links.extend(l);
            log_attached(cgroup, pins, pending.len());
            if !pending.is_empty() {
                *takeover = Some(pending);
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

/// One line for how the connect-time programs came to run: `pending` links wait for a rebuild.
fn log_attached(cgroup: &std::path::Path, pins: Option<&Pins>, pending: usize) {
    let cgroup = cgroup.display();
    let Some(p) = pins else {
        info!(%cgroup, "connect-time programs attached, not pinned (connect4/6, getpeername4/6, sockops, sock_release)");
        return;
    };
    let pin_dir = p.dir().display();
    match p.found() {
        Found::Adopt => {
            info!(%cgroup, %pin_dir, "connect-time: this lb's programs swapped into the links an earlier lb pinned, on its maps (attached throughout)");
        }
        Found::Rebuild(why) => {
            info!(%cgroup, %pin_dir, reason = %why, pending, "connect-time: the pinned maps are not of this lb's layout; new maps loaded, the pinned links keep their programs until this lb's listeners and tables are written, then run this lb's");
        }
        Found::Nothing => {
            info!(%cgroup, %pin_dir, "connect-time programs attached and pinned (connect4/6, getpeername4/6, sockops, sock_release)");
        }
    }
}
