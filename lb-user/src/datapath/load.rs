//! Loading the kernel programs and attaching them, in kernel order, each step undone by the drop
//! of what came before: the object with its globals, the maps, then the splice (sockops and
//! sk_msg) and the connect-time programs, each on its own. A kernel with one and not the other
//! (5.10 has the connect hooks, 5.8+, but not `bpf_get_netns_cookie` in sockops, 5.15) runs
//! what it has; the data path fails only when it has neither.

use aya::{
    Ebpf,
    programs::{CgroupAttachMode, SkMsg, SockOps, links::FdLink},
};
use lb_common::{
    GLOBAL_BLOCKING_SPLICE, GLOBAL_KERNEL_LOG_LEVEL, GLOBAL_KERNEL_READS, GLOBAL_OFF_F_FLAGS,
    GLOBAL_OFF_MSG_SK_REDIR, GLOBAL_OFF_SK_ERR, GLOBAL_OFF_SK_SOCKET, GLOBAL_OFF_SNDBUF,
    GLOBAL_OFF_SNDTIMEO, GLOBAL_OFF_SOCKET_FILE, GLOBAL_OFF_ULP_OPS, GLOBAL_OFF_WMEM_QUEUED,
    GLOBAL_OFF_WRITE_SEQ, PROG_SK_MSG, PROG_SOCKOPS,
};
use tracing::{info, warn};

use super::{
    Datapath, DatapathError, EBPF_OBJ, Parts, Pins,
    connect::{attach, heartbeat, netns_probe},
    handover, kernel_log, maps, probe,
};

/// Load the object with the globals lb sets from the kernel and its config, on the maps
/// pinned in `pins` when they are adopted (new ones, pinned aside, when they are rebuilt).
fn load_object(
    cfg: &crate::config::DatapathConfig,
    offsets: Option<super::btf::SockOffsets>,
    sk_err: u32,
    log_level: u8,
    pins: Option<&Pins>,
) -> Result<Ebpf, DatapathError> {
    let reads = u32::from(offsets.is_some());
    let blocking = u32::from(offsets.is_some() && cfg.blocking_splice);
    let offsets = offsets.unwrap_or_default();
    let mut loader = aya::EbpfLoader::new();
    let pin_paths = pins.map(Pins::map_paths).unwrap_or_default();
    for (name, path) in &pin_paths {
        loader.map_pin_path(name, path.as_path());
    }
    loader
        .override_global(GLOBAL_BLOCKING_SPLICE, &blocking, true)
        .override_global(GLOBAL_KERNEL_READS, &reads, true)
        .override_global(GLOBAL_OFF_WRITE_SEQ, &offsets.write_seq, true)
        .override_global(GLOBAL_OFF_ULP_OPS, &offsets.ulp_ops, true)
        .override_global(GLOBAL_OFF_MSG_SK_REDIR, &offsets.msg_sk_redir, true)
        .override_global(GLOBAL_OFF_WMEM_QUEUED, &offsets.wmem_queued, true)
        .override_global(GLOBAL_OFF_SNDBUF, &offsets.sndbuf, true)
        .override_global(GLOBAL_KERNEL_LOG_LEVEL, &log_level, true)
        .override_global(GLOBAL_OFF_SK_SOCKET, &offsets.sk_socket, true)
        .override_global(GLOBAL_OFF_SOCKET_FILE, &offsets.socket_file, true)
        .override_global(GLOBAL_OFF_F_FLAGS, &offsets.file_f_flags, true)
        .override_global(GLOBAL_OFF_SNDTIMEO, &offsets.sk_sndtimeo, true)
        .override_global(GLOBAL_OFF_SK_ERR, &sk_err, true)
        .load(EBPF_OBJ)
        .map_err(DatapathError::Load)
        .and_then(|ebpf| {
            // Pinned maps to rebuild: this object's new ones are pinned aside until the swap.
            if let Some(p) = pins
                && matches!(p.found(), super::Found::Rebuild(_))
            {
                p.stage_maps(&ebpf)?;
            }
            Ok(ebpf)
        })
}

/// Load and attach the splice: sk_msg on the client sockhash, sockops on the cgroup (its link
/// added to `links`).
fn attach_splice(
    ebpf: &mut Ebpf,
    maps: &maps::Maps,
    cgroup_file: &std::fs::File,
    links: &mut Vec<(&'static str, FdLink)>,
) -> Result<(), DatapathError> {
    let prog_err = |program: &'static str| move |source| DatapathError::Program { program, source };
    let sk_msg: &mut SkMsg = ebpf
        .program_mut(PROG_SK_MSG)
        .ok_or(DatapathError::Missing(PROG_SK_MSG))?
        .try_into()
        .map_err(prog_err(PROG_SK_MSG))?;
    sk_msg.load().map_err(prog_err(PROG_SK_MSG))?;
    sk_msg
        .attach(maps.clients.lock().fd())
        .map_err(prog_err(PROG_SK_MSG))?;
    let sockops: &mut SockOps = ebpf
        .program_mut(PROG_SOCKOPS)
        .ok_or(DatapathError::Missing(PROG_SOCKOPS))?
        .try_into()
        .map_err(prog_err(PROG_SOCKOPS))?;
    sockops.load().map_err(prog_err(PROG_SOCKOPS))?;
    let link = sockops
        .attach(cgroup_file, CgroupAttachMode::Single)
        .map_err(prog_err(PROG_SOCKOPS))?;
    let link = sockops.take_link(link).map_err(prog_err(PROG_SOCKOPS))?;
    links.push((
        PROG_SOCKOPS,
        FdLink::try_from(link).map_err(|source| DatapathError::Link {
            program: PROG_SOCKOPS,
            source,
        })?,
    ));
    Ok(())
}

/// lb's network namespace cookie: `own` when the kernel gave it, else (before 5.14) learned
/// through the connect program when it is attached. An error there turns connect-time off
/// (`connect_missing`), as a refused hook does.
fn own_netns_or_learn(
    own: Option<u64>,
    maps: &maps::Maps,
    cgroup: &std::path::Path,
    unattached: Option<&mut Ebpf>,
    connect_missing: &mut Option<String>,
) -> u64 {
    match own {
        Some(cookie) => cookie,
        None if connect_missing.is_some() => 0,
        None => match netns_probe::learn(maps, cgroup, unattached) {
            Ok(cookie) => {
                info!(
                    cookie,
                    "lb's network namespace cookie learned from the connect program (no SO_NETNS_COOKIE before 5.14)"
                );
                cookie
            }
            Err(e) => {
                *connect_missing = Some(crate::errors::chain(&e).replace('\n', ": "));
                0
            }
        },
    }
}

impl Datapath {
    /// Load the programs; attach the splice (sockops to `cfg.cgroup`, detected when `None`, with
    /// a link, and sk_msg to the client sockhash) when the kernel has what it needs, and with
    /// `want_connect` the connect-time programs. Either may be missing (the splice before 5.15:
    /// splice balancers then copy in userspace, with a warning naming why; connect-time when a
    /// hook is refused: see [`Datapath::connect_unavailable`]), not both. With `pins`, the
    /// connect-time programs' links and maps are pinned there, or adopted when an earlier lb
    /// left them (see [`super::pins`]). `cfg.blocking_splice` is honoured when the kernel allows
    /// it; otherwise it is turned off alone, with a warning naming why. The programs' log level
    /// is taken from the log filter now (see [`kernel_log`]); a kernel logger that cannot start
    /// is a warning, never an error.
    ///
    /// # Errors
    /// [`DatapathError`] naming what is missing: privileges, cgroup v2, a map type, the load
    /// or attach step that failed, or, when connect-time is not asked for or not available,
    /// what the splice lacks.
    pub fn load(
        cfg: &crate::config::DatapathConfig,
        want_connect: bool,
        pins: Option<Pins>,
    ) -> Result<Datapath, DatapathError> {
        probe::privileges()?;
        probe::lift_memlock();
        let own_netns = probe::own_netns_cookie();
        let own_cookie = own_netns.as_ref().ok().copied();
        let (cgroup, cgroup_file) = probe::open_cgroup(cfg.cgroup.as_deref())?;
        probe::probe_maps()?;
        // What the splice lacks: a program/map type or helper, else lb's netns cookie (5.14).
        let splice_missing = probe::probe_splice().err().or(own_netns.err());
        if !want_connect && let Some(e) = splice_missing {
            return Err(e);
        }
        let offsets = if splice_missing.is_none() {
            probe::kernel_reads(cfg)
        } else {
            None
        };
        let sk_err = if want_connect { sk_err_offset() } else { 0 };
        let log_level = kernel_log::level();
        let mut ebpf = load_object(cfg, offsets, sk_err, log_level, pins.as_ref())?;
        let (maps, mut rings) = maps::Maps::take(&mut ebpf)?;
        let inherited = pins.as_ref().is_some_and(Pins::adopted);
        if inherited {
            // Written by an earlier lb: its generations go on; its events are from before this
            // lb started and count against no server now.
            let dropped = rings.events.drain();
            info!(
                dropped,
                "connect-time events from before this lb started ignored"
            );
        }
        heartbeat::connect_ctl(&maps, cfg.orphan_timeout.0)?;
        let mut links = Vec::new();
        match &splice_missing {
            None => {
                attach_splice(&mut ebpf, &maps, &cgroup_file, &mut links)?;
                info!(cgroup = %cgroup.display(), "kernel data path attached (sockops + sk_msg upstream splice)");
            }
            Some(why) => {
                warn!(reason = %crate::errors::chain(why), "the kernel splice is unavailable: balancers that forward through lb copy in userspace");
            }
        }
        // Only when a balancer asked: once attached, every connect() in the cgroup runs them.
        let mut takeover = None;
        let mut connect_missing = if want_connect {
            attach::connect_or_why(
                &mut ebpf,
                &cgroup_file,
                &cgroup,
                pins.as_ref(),
                &mut links,
                &mut takeover,
            )?
        } else {
            Some(DatapathError::NotRequested.to_string())
        };
        // A rebuild's connect4 is not in the cgroup's links yet: the probe attaches it for itself.
        let unattached = takeover.is_some().then_some(&mut ebpf);
        let own_netns =
            own_netns_or_learn(own_cookie, &maps, &cgroup, unattached, &mut connect_missing);
        if let (Some(splice), Some(connect)) = (&splice_missing, &connect_missing) {
            return Err(DatapathError::NothingToRun {
                splice: crate::errors::chain(splice).replace('\n', ": "),
                connect: connect.clone(),
            });
        }
        let kernel_log = kernel_log::open(&mut ebpf, log_level);
        let links = links
            .into_iter()
            .map(|(n, l)| (n, handover::HeldLink::Loaded(l)))
            .collect();
        let parts = Parts {
            ebpf: Some(ebpf),
            links,
            cgroup,
            maps,
            rings,
            kernel_log,
            connect_missing,
            splice: splice_missing.is_none() && offsets.is_some(),
            own_netns,
            pins,
            inherited,
            takeover,
        };
        Ok(Datapath::assemble(cfg, parts))
    }
}

/// The offset of `sk_err` connect-time's sockops program reads a failed connect's error at; 0,
/// with a warning naming why, when the kernel does not allow the read.
fn sk_err_offset() -> u32 {
    probe::probe_sk_err().unwrap_or_else(|why| {
        warn!(reason = %crate::errors::chain(&why), "connect-time: a failed connect's error cannot be read; none counts against its server");
        0
    })
}
