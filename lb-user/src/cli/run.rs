//! `lb run`: load the config, start the daemon, put the admin API in front of it, and serve
//! until SIGTERM/SIGINT. Only wiring: each piece is built by its own module.

use std::process::ExitCode;

use super::RunArgs;
use crate::{
    config::{Config, EXIT_INVALID_CONFIG},
    daemon::Daemon,
};

/// Run the daemon as `args` say: exit 0 after a clean shutdown or a hand-over to a new lb
/// (`lb upgrade`), 2 for an invalid config or when another process already serves one of its
/// listeners or its admin address, 1 when the data path, a listener or the admin API cannot
/// start. Started by `lb upgrade` (with `LB_UPGRADE_SOCKET`), it takes over instead.
pub fn run(args: &RunArgs) -> ExitCode {
    crate::daemon::upgrade::record_command();
    // Whatever lb creates (state files, the admin unix socket, their directories) is its own
    // alone, also when started from a root shell with umask 022; each such file also sets its
    // mode outright.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    if let Some(socket) = std::env::var_os(crate::handover::ENV_SOCKET) {
        let socket = socket.to_string_lossy().into_owned();
        return super::takeover::run(args, &socket);
    }
    let overrides = args.overrides();
    let cfg = match Config::load(args.config.as_deref(), &overrides) {
        Ok(cfg) => cfg,
        Err(e) => {
            eprintln!("{}", super::config::invalid(args.config.as_deref(), &e));
            return ExitCode::from(u8::try_from(EXIT_INVALID_CONFIG).unwrap_or(2));
        }
    };
    for w in cfg.warnings() {
        tracing::warn!("{w}");
    }
    if let Err(e) = preflight(&cfg) {
        eprintln!("lb: {e}");
        return ExitCode::from(super::EXIT_USAGE);
    }
    super::process::raise_nofile_limit();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lb: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let config_path = args.config.clone();
    let started = rt.block_on(async move {
        let daemon = Daemon::start(cfg, config_path, overrides).await?;
        crate::admin::start(daemon.handle()).await?;
        anyhow::Ok(daemon)
    });
    match started {
        Ok(daemon) => {
            super::process::sd_notify("READY=1");
            super::process::serve(&rt, &daemon)
        }
        Err(e) => {
            eprintln!("lb: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Refuse to start next to another process serving one of our listeners or our admin address
/// (another lb): binding would fail half-way, after the programs are attached to the cgroup.
///
/// # Errors
/// [`super::owner::InUse`]: the address in use, with the process holding it when `/proc`
/// tells.
fn preflight(cfg: &Config) -> Result<(), super::owner::InUse> {
    // What each address is for in the configuration being started (not in the running lb).
    let mut addrs: Vec<(std::net::SocketAddr, String)> = cfg
        .balancers
        .iter()
        .flat_map(|b| {
            b.listen
                .iter()
                .map(|a| (*a, format!("listener of balancer {}", b.name)))
        })
        .collect();
    addrs.push((cfg.admin.listen, "admin API".into()));
    for (addr, what) in addrs {
        if let Err(e) = try_bind(addr)
            && e.kind() == std::io::ErrorKind::AddrInUse
        {
            return Err(super::owner::InUse {
                addr: addr.to_string(),
                what,
                owner: super::owner::listening_process(addr),
            });
        }
    }
    if let Some(path) = &cfg.admin.unix_socket
        && std::os::unix::net::UnixStream::connect(path).is_ok()
    {
        return Err(super::owner::InUse {
            addr: path.display().to_string(),
            what: "admin unix socket".into(),
            owner: super::owner::unix_listening_process(path),
        });
    }
    Ok(())
}

fn try_bind(addr: std::net::SocketAddr) -> std::io::Result<()> {
    let domain = socket2::Domain::for_address(addr);
    let s = socket2::Socket::new(domain, socket2::Type::STREAM, Some(socket2::Protocol::TCP))?;
    s.set_reuse_address(true)?;
    if addr.is_ipv6() {
        s.set_only_v6(true)?;
    }
    s.bind(&addr.into())
}
