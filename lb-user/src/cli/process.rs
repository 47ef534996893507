//! What a serving lb process does around its daemon, for a fresh start (`lb run`) and a takeover
//! (`lb upgrade`'s new process) alike: the open-files limit, systemd's readiness notification,
//! and serving until signalled.

use std::process::ExitCode;

use crate::daemon::Daemon;

/// Serve until signalled. After a hand-over to a new lb the process exits at once, running no
/// destructor: dropping the loaded programs would detach sk_msg from the client sockhash the
/// new process now uses.
pub(super) fn serve(rt: &tokio::runtime::Runtime, daemon: &std::sync::Arc<Daemon>) -> ExitCode {
    match rt.block_on(daemon.run_until_signalled()) {
        Ok(()) if daemon.handed_over() => std::process::exit(0),
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lb: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Tell systemd (`NOTIFY_SOCKET`, `Type=notify`) `state`; nothing without it.
pub(super) fn sd_notify(state: &str) {
    use std::os::linux::net::SocketAddrExt as _;
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let path = path.to_string_lossy().into_owned();
    let addr = match path.strip_prefix('@') {
        Some(name) => std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()),
        None => std::os::unix::net::SocketAddr::from_pathname(&path),
    };
    let sent = addr.and_then(|a| {
        let s = std::os::unix::net::UnixDatagram::unbound()?;
        s.send_to_addr(state.as_bytes(), &a)
    });
    if let Err(e) = sent {
        tracing::warn!(socket = %path, error = %e, "cannot notify systemd");
    }
}

/// A node daemon holds two descriptors per connection: raise the soft open-files limit to the
/// hard limit (as HAProxy does from its maxconn), and say what it is.
pub(super) fn raise_nofile_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => tracing::info!(from = soft, to = hard, "raised the open-files limit"),
            Err(e) => tracing::warn!(soft, hard, error = %e, "cannot raise the open-files limit"),
        },
        Ok((soft, _)) => tracing::info!(limit = soft, "open-files limit"),
        Err(e) => tracing::warn!(error = %e, "cannot read the open-files limit"),
    }
}
