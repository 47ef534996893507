//! `lb run` started by `lb upgrade`: the new process's side of the hand-over (the old side is
//! `daemon::upgrade`). It takes the listeners and the kernel data path, builds its balancers
//! (with the old process's balancer ids), answers Ready, takes the connections and the states,
//! answers Done, waits until the old process stopped its checks, table sync and ring readers
//! (Stopped), and only then writes its listener maps and serves. Before Done it writes and
//! serves nothing, so a failure here leaves the old process in charge, whole.

use std::{
    collections::HashMap,
    os::{
        fd::OwnedFd,
        linux::net::SocketAddrExt as _,
        unix::net::{SocketAddr as UnixAddr, UnixStream},
    },
    process::ExitCode,
};

use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::RunArgs;
use crate::{
    config::Config,
    daemon::{Daemon, Takeover, ids, upgrade::STOP_TIMEOUT},
    datapath::Datapath,
    handover::{self, Frame, ListenerKey, Message, VERSION},
};

/// Test hook: `before_done` makes a taking-over process exit just before it would answer Done.
pub const FAULT_ENV: &str = "LB_UPGRADE_FAULT";

/// Why this process refuses or fails the hand-over, with its exit code.
struct Refusal {
    reason: String,
    code: u8,
}

fn refuse(reason: impl Into<String>) -> Refusal {
    Refusal {
        reason: reason.into(),
        code: super::EXIT_FAILURE,
    }
}

/// Take over from the lb listening on the abstract unix socket `socket`, then serve until
/// signalled. Exit codes as `lb run`; 2 also for a config this process cannot load.
pub fn run(args: &RunArgs, socket: &str) -> ExitCode {
    let sock = match UnixAddr::from_abstract_name(socket.as_bytes())
        .and_then(|a| UnixStream::connect_addr(&a))
    {
        Ok(s) => s,
        Err(e) => {
            eprintln!("lb: cannot reach the lb handing over ({socket}): {e}");
            return ExitCode::FAILURE;
        }
    };
    let _ = sock.set_read_timeout(Some(crate::daemon::upgrade::STEP_TIMEOUT * 2));
    match take_over(args, &sock) {
        Ok(code) => code,
        Err(r) => {
            error!(reason = %r.reason, "not taking over; the running lb serves on");
            eprintln!("lb: not taking over: {}", r.reason);
            let _ = handover::send(&sock, &Message::Refused { reason: r.reason }, &[], &[]);
            ExitCode::from(r.code)
        }
    }
}

#[expect(
    clippy::too_many_lines,
    reason = "the new process's side of the hand-over, its steps in protocol order"
)]
fn take_over(args: &RunArgs, sock: &UnixStream) -> Result<ExitCode, Refusal> {
    let Frame { message, fds, .. } = handover::recv(sock).map_err(|e| refuse(e.to_string()))?;
    let hello = match message {
        Message::Hello(h) => h,
        other => return Err(refuse(other.unexpected().to_string())),
    };
    if hello.version != VERSION {
        return Err(refuse(format!(
            "incompatible hand-over version {} (lb {} pid {}); this lb {} speaks version {VERSION}: restart instead",
            hello.version,
            hello.lb_version,
            hello.pid,
            env!("CARGO_PKG_VERSION")
        )));
    }
    let overrides = args.overrides();
    let cfg = Config::load(args.config.as_deref(), &overrides).map_err(|e| Refusal {
        reason: format!("invalid configuration: {e}"),
        code: super::EXIT_USAGE,
    })?;
    super::compat::compatible(&cfg, &hello).map_err(|e| refuse(e.to_string()))?;
    let names: Vec<&str> = cfg.balancers.iter().map(|b| b.name.as_str()).collect();
    let ids = ids::carried_over(&names, &hello.balancer_ids, &hello.retired_balancer_ids)
        .map_err(|e| refuse(e.to_string()))?;
    info!(from_pid = hello.pid, from_version = %hello.lb_version, "taking over from the running lb");
    let mut fds: HashMap<usize, OwnedFd> = fds.into_iter().enumerate().collect();
    let mut take = |i: usize| {
        fds.remove(&i)
            .ok_or_else(|| refuse(format!("descriptor {i} missing from the hand-over")))
    };
    let mut listeners = HashMap::new();
    for (addr, i) in &hello.listeners {
        listeners.insert(*addr, take(*i)?);
    }
    if let Some((addr, i)) = &hello.admin_tcp {
        handover::put_inherited(ListenerKey::AdminTcp(*addr), take(*i)?);
    }
    if let Some((path, i)) = &hello.admin_unix {
        handover::put_inherited(ListenerKey::AdminUnix(path.clone()), take(*i)?);
    }
    let datapath = match &hello.datapath {
        None => None,
        Some(offer) => {
            let mut maps = HashMap::new();
            for (name, i) in &offer.maps {
                maps.insert(name.clone(), take(*i)?);
            }
            let mut links = Vec::new();
            for (name, i) in &offer.links {
                links.push((name.clone(), take(*i)?));
            }
            let dp = Datapath::adopt(
                &cfg.datapath,
                maps,
                links,
                offer.cgroup.clone(),
                offer.connect_missing.clone(),
            )
            .map_err(|e| {
                refuse(format!(
                    "cannot adopt the kernel data path: {}",
                    crate::errors::chain(&e)
                ))
            })?;
            Some(dp)
        }
    };
    super::process::raise_nofile_limit();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| refuse(format!("cannot start the runtime: {e}")))?;
    let go = CancellationToken::new();
    let config_path = args.config.clone();
    let daemon = rt.block_on(async {
        let takeover = Takeover {
            datapath,
            listeners,
            ids,
            go: go.clone(),
        };
        let d = Daemon::start_with(cfg, config_path, overrides, Some(takeover)).await?;
        crate::admin::start(d.handle()).await?;
        let unused = handover::close_unused_inherited();
        for key in &unused {
            info!(listener = ?key, "closed an inherited listener the new config does not name");
        }
        anyhow::Ok((d, unused))
    });
    let (daemon, unused) = daemon.map_err(|e| refuse(format!("{e:#}")))?;
    handover::send(
        sock,
        &Message::Ready {
            lb_version: env!("CARGO_PKG_VERSION").into(),
        },
        &[],
        &[],
    )
    .map_err(|e| refuse(e.to_string()))?;
    let mut adopted = 0;
    loop {
        let Frame { message, fds, raw } =
            handover::recv(sock).map_err(|e| refuse(e.to_string()))?;
        match message {
            Message::Conns { conns } => {
                let mut fds: HashMap<usize, OwnedFd> = fds.into_iter().enumerate().collect();
                let mut raw = raw.as_slice();
                let _rt = rt.enter();
                for c in conns {
                    daemon
                        .adopt_connection(c, &mut fds, &mut raw, &go)
                        .map_err(|e| refuse(format!("cannot take a connection: {e}")))?;
                    adopted += 1;
                }
            }
            Message::State {
                balancers,
                first_checks_done,
            } => {
                daemon.restore(&balancers, first_checks_done);
                break;
            }
            other => return Err(refuse(other.unexpected().to_string())),
        }
    }
    // For the tests: die where the old process has frozen everything and waits for Done, so
    // that its way back (serving the connections again) is exercised. Never set in production.
    if std::env::var_os(FAULT_ENV).is_some_and(|v| v == "before_done") {
        error!("{FAULT_ENV}=before_done: exiting before Done");
        std::process::exit(70);
    }
    handover::send(sock, &Message::Done { conns: adopted }, &[], &[])
        .map_err(|e| refuse(e.to_string()))?;
    wait_stopped(sock);
    if let Err(e) = daemon.register_listeners() {
        error!(error = %format!("{e:#}"), "cannot write the listener maps: connects to these listeners may reach the wrong balancer until lb restarts");
    }
    go.cancel();
    // The old admin unix socket this config no longer names: its file goes with the old lb.
    for key in unused {
        if let handover::ListenerKey::AdminUnix(path) = key {
            let _ = std::fs::remove_file(path);
        }
    }
    info!(connections = adopted, "took over: serving");
    super::process::sd_notify(&format!("MAINPID={}\nREADY=1", std::process::id()));
    Ok(super::process::serve(&rt, &daemon))
}

/// Wait (at most [`STOP_TIMEOUT`] and a second) for the old process to say it stopped its
/// background work, or to be gone.
fn wait_stopped(sock: &UnixStream) {
    let _ = sock.set_read_timeout(Some(STOP_TIMEOUT + std::time::Duration::from_secs(1)));
    match handover::recv(sock) {
        Ok(Frame {
            message: Message::Stopped,
            ..
        })
        | Err(handover::HandoverError::Closed) => {}
        Ok(f) => {
            warn!(message = %f.message.unexpected(), "the previous lb sent something else than Stopped; starting")
        }
        Err(e) => warn!(error = %e, "the previous lb did not say it stopped; starting"),
    }
}
