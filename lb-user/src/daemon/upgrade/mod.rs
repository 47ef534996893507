//! `lb upgrade` and `SIGUSR2`, the old process's side: start the binary now at lb's path with
//! lb's own command line, hand it everything over a unix socket (`SCM_RIGHTS`), and exit once it
//! says it has it all. The new process's side is `cli::takeover`; the messages are
//! [`crate::handover`].
//!
//! The order, so that no connect is refused and nothing is served twice or lost:
//!
//! 1. Hello: the listening sockets (proxy and admin) and the kernel data path (map and link
//!    descriptors). This process goes on serving; the new one builds its balancers and
//!    answers Ready, or Refused with the reason (another hand-over version, a config it cannot
//!    load, a listener or data path change that needs a restart).
//! 2. The checks in flight record their results; this process stops accepting (new connects
//!    wait in the shared listen backlog) and freezes every connection task between two awaits
//!    of its copy loop; a client still being dialed goes over undialed.
//! 3. Conns (sockets, unwritten bytes, counts) in batches, then State (servers' states and
//!    counters, taken after the freeze so nothing moves afterwards).
//! 4. The new process answers Done. This one stops everything that changes its balancers or
//!    writes the kernel's maps (health checks, discovery, connect-time table sync) and the
//!    readers of the kernel's rings, says Stopped, and exits 0 without closing anything (the
//!    sockets, maps and links live on in the new process). Only then does the new process
//!    write its listener maps (keeping this one's balancer ids, see `daemon::ids`) and start
//!    accepting, checking and reading the rings: no ring event is read twice and no table is
//!    written by both.
//!
//! Any failure before Done (the binary does not start or exits, no answer within
//! [`STEP_TIMEOUT`], Refused, a broken socket) kills the new process if it still runs, and this
//! one serves on unchanged: frozen connections are adopted back, listeners served again.
//! What the new process does with the connections and states is in `daemon::adopt`.

use std::{
    os::{
        fd::{AsFd, BorrowedFd},
        linux::net::SocketAddrExt as _,
        unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream},
    },
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{Arc, OnceLock},
    time::{Duration, Instant},
};

use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

mod messages;

use messages::{hello, send_conns, snapshot};

use super::Daemon;
use crate::{
    handover::{self, ListenerKey, Message},
    proxy::{self, Frozen},
};

/// Bound on each step of the hand-over: the new process connecting, answering Hello, and
/// answering the connections.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// Bound on the old process stopping its background work after Done (a check or a ring batch
/// in flight); the new one waits this long and a second more for Stopped.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(2);

/// Connections per Conns frame (two descriptors each).
const CONNS_PER_FRAME: usize = handover::MAX_FDS_PER_FRAME / 2;

/// The binary and command line this process started with (recorded at start: after a package
/// upgrade `/proc/self/exe` names a deleted file).
static COMMAND: OnceLock<(PathBuf, Vec<std::ffi::OsString>)> = OnceLock::new();

/// Record the binary and arguments an upgrade restarts. Call once, at start. The binary is the
/// path lb was started by (`argv[0]`, made absolute against the working directory, or found in
/// `PATH` when it has no `/`), symlinks left unresolved, so a symlink switched to a new version
/// (alternatives, a versioned directory) starts that version; `/proc/self/exe` only when
/// neither names a file.
pub fn record_command() {
    let exe = invoked_path().unwrap_or_else(|| {
        std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/proc/self/exe"))
    });
    let args = std::env::args_os().skip(1).collect();
    let _ = COMMAND.set((exe, args));
}

/// The path this process was started by, as an absolute path, if it names a file.
fn invoked_path() -> Option<PathBuf> {
    let arg0 = PathBuf::from(std::env::args_os().next()?);
    let found = if arg0.as_os_str().as_encoded_bytes().contains(&b'/') {
        std::env::current_dir().ok()?.join(arg0)
    } else {
        std::env::split_paths(&std::env::var_os("PATH")?)
            .map(|dir| dir.join(&arg0))
            .find(|p| p.is_file())?
    };
    found.is_file().then_some(found)
}

/// A finished hand-over.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Upgraded {
    /// This process.
    pub old_pid: u32,
    /// The process serving now.
    pub new_pid: u32,
    /// Its binary.
    pub binary: PathBuf,
    /// Connections handed over.
    pub connections: usize,
    /// Time from the start of the hand-over to the new process's Done (milliseconds).
    pub elapsed_ms: u64,
    /// Time nothing accepted new connections (milliseconds; they waited in the backlog).
    pub accept_pause_ms: u64,
}

/// One hand-over at a time.
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Why an upgrade did not happen.
#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    /// Refused at once, nothing started: another upgrade is under way, this lb already handed
    /// over, or it is shutting down (the API answers 409).
    #[error("{0}")]
    Refused(&'static str),
    /// The new process did not take over, for the reason given; this lb serves on unchanged
    /// (the API answers 500).
    #[error("{0}")]
    Failed(String),
}

/// Hand everything to a new lb started from the recorded binary; on success this process must
/// exit (see [`Daemon::handed_over`]).
///
/// # Errors
/// [`UpgradeError::Refused`] when another upgrade is under way (a second request does not wait
/// for the first) or this lb handed over or is shutting down; [`UpgradeError::Failed`] with why
/// the new process did not take over.
pub async fn upgrade(d: &Arc<Daemon>) -> Result<Upgraded, UpgradeError> {
    let Ok(_turn) = TURN.try_lock() else {
        return Err(UpgradeError::Refused("an upgrade is already in progress"));
    };
    if d.handed_over.is_cancelled() {
        return Err(UpgradeError::Refused("this lb has already handed over"));
    }
    if d.shutdown.is_cancelled() || d.proxy.tasks.is_closed() {
        return Err(UpgradeError::Refused("this lb is shutting down"));
    }
    let d2 = d.clone();
    let rt = tokio::runtime::Handle::current();
    let r = tokio::task::spawn_blocking(move || run(&d2, &rt))
        .await
        .map_err(|e| UpgradeError::Failed(format!("hand-over task failed: {e}")))?
        .map_err(UpgradeError::Failed);
    match &r {
        Ok(u) => {
            info!(
                new_pid = u.new_pid,
                connections = u.connections,
                elapsed_ms = u.elapsed_ms,
                accept_pause_ms = u.accept_pause_ms,
                "handed over to the new lb; exiting"
            );
            d.handed_over.cancel();
        }
        Err(e) => error!(reason = %e, "upgrade failed; this lb keeps serving"),
    }
    r
}

/// The new process while it may still fail: killed and reaped on drop unless released.
struct NewProcess(Option<Child>);

impl NewProcess {
    fn id(&self) -> u32 {
        self.0.as_ref().map_or(0, Child::id)
    }

    /// `Some(status)` once it exited.
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.0.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    fn release(mut self) {
        // It outlives us: whoever adopts it (init, a subreaper, systemd) reaps it.
        drop(self.0.take());
    }
}

impl Drop for NewProcess {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[expect(
    clippy::too_many_lines,
    reason = "the old process's side of the hand-over, its steps in protocol order"
)]
fn run(d: &Arc<Daemon>, rt: &tokio::runtime::Handle) -> Result<Upgraded, String> {
    let start = Instant::now();
    let (exe, args) = COMMAND
        .get()
        .cloned()
        .ok_or("the command line was not recorded at start")?;
    let name = format!(
        "lb-upgrade-{}-{}",
        std::process::id(),
        crate::daemon::now_ms()
    );
    let addr = UnixAddr::from_abstract_name(name.as_bytes()).map_err(|e| e.to_string())?;
    let listener = UnixListener::bind_addr(&addr)
        .map_err(|e| format!("cannot open the hand-over socket: {e}"))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("hand-over socket: {e}"))?;
    info!(binary = %exe.display(), "upgrade: starting the new lb");
    let child = Command::new(&exe)
        .args(&args)
        .env(handover::ENV_SOCKET, &name)
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", exe.display()))?;
    let mut child = NewProcess(Some(child));
    let sock = accept_child(&listener, &mut child)?;
    sock.set_read_timeout(Some(STEP_TIMEOUT))
        .map_err(|e| e.to_string())?;
    let fail = |what: &str, e: handover::HandoverError, child: &mut NewProcess| {
        // A closed socket usually means it died: give it a moment to be reaped, for the reason.
        let status = (0..20).find_map(|_| {
            let st = child.exited();
            if st.is_none() {
                std::thread::sleep(Duration::from_millis(10));
            }
            st
        });
        match status {
            Some(st) => format!("the new lb exited ({st}) {what}: {e}"),
            None => format!("the new lb failed {what}: {e}"),
        }
    };

    // 1. Hello.
    let (hello, fds) = hello(d)?;
    let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
    handover::send(&sock, &Message::Hello(Box::new(hello)), &borrowed, &[])
        .map_err(|e| fail("while taking the listeners", e, &mut child))?;
    drop(borrowed);
    drop(fds);
    let new_version = match handover::recv(&sock) {
        Ok(f) => match f.message {
            Message::Ready { lb_version } => lb_version,
            Message::Refused { reason } => return Err(format!("the new lb refused: {reason}")),
            other => return Err(other.unexpected().to_string()),
        },
        Err(e) => return Err(fail("before it was ready", e, &mut child)),
    };
    info!(new_pid = child.id(), new_version = %new_version, "upgrade: the new lb is ready; handing over the connections");

    // The checks in flight record their results first, so the states handed over include them
    // (bounded by the longest check timeout; one that starts in the milliseconds before the
    // snapshot is abandoned, and the new process checks that server again within an interval).
    let bound = d
        .balancers
        .load()
        .iter()
        .map(|b| b.config().health.timeout.0)
        .max()
        .unwrap_or_default()
        .min(Duration::from_secs(5))
        + Duration::from_millis(100);
    let waiting = Instant::now();
    while d.metrics.inflight_checks.get() > 0 && waiting.elapsed() < bound {
        std::thread::sleep(Duration::from_millis(2));
    }

    // 2. Stop accepting, freeze.
    let paused = Instant::now();
    let stopped = stop_accepting(d);
    let frozen = rt.block_on(freeze(d));
    let frozen = match frozen {
        Ok(f) => f,
        Err((why, f)) => {
            resume(d, rt, f, &stopped);
            return Err(why);
        }
    };
    let state = Message::State {
        balancers: snapshot(d),
        first_checks_done: d
            .first_checks_done
            .load(std::sync::atomic::Ordering::Relaxed),
    };

    // 3. Connections, then state; 4. Done.
    let sent = send_conns(&sock, &frozen).and_then(|()| handover::send(&sock, &state, &[], &[]));
    let done = sent.and_then(|()| handover::recv(&sock));
    match done {
        Ok(handover::Frame {
            message: Message::Done { conns },
            ..
        }) => {
            let new_pid = child.id();
            child.release();
            // The new process holds the sockets now: closing our descriptors ends nothing.
            drop(frozen);
            stop_background(d, rt);
            if let Err(e) = handover::send(&sock, &Message::Stopped, &[], &[]) {
                warn!(error = %e, "upgrade: cannot tell the new lb this one stopped; it starts after a timeout");
            }
            Ok(Upgraded {
                old_pid: std::process::id(),
                new_pid,
                binary: exe,
                connections: conns,
                elapsed_ms: millis(start.elapsed()),
                accept_pause_ms: millis(paused.elapsed()),
            })
        }
        other => {
            let why = match other {
                Ok(f) => f.message.unexpected().to_string(),
                Err(e) => fail("while taking the connections", e, &mut child),
            };
            // Kill it before serving again: it must not touch the sockets we resume.
            drop(child);
            resume(d, rt, frozen, &stopped);
            Err(why)
        }
    }
}

/// After Done: end every task that changes balancers or writes the kernel's maps (health
/// loops and the checks they run, discovery, connect-time table sync), the heartbeat and the
/// readers of the kernel's rings, before the new process starts its own. Bounded by
/// [`STOP_TIMEOUT`]; what still runs then is logged.
fn stop_background(d: &Daemon, rt: &tokio::runtime::Handle) {
    let began = Instant::now();
    d.background.cancel();
    d.tasks.close();
    let tasks_ended = rt.block_on(async {
        tokio::time::timeout(STOP_TIMEOUT, d.tasks.wait())
            .await
            .is_ok()
    });
    let left = STOP_TIMEOUT.saturating_sub(began.elapsed());
    let readers_ended = d.datapath.as_ref().is_none_or(|dp| dp.wait_readers(left));
    if tasks_ended && readers_ended {
        info!(
            ms = millis(began.elapsed()),
            "upgrade: stopped checks, table sync and ring readers"
        );
    } else {
        warn!(
            tasks_ended,
            readers_ended,
            "upgrade: background work still running {} s after Done",
            STOP_TIMEOUT.as_secs()
        );
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Wait for the new process to connect (or exit) within [`STEP_TIMEOUT`]; it must be the
/// process we started.
fn accept_child(listener: &UnixListener, child: &mut NewProcess) -> Result<UnixStream, String> {
    let deadline = Instant::now() + STEP_TIMEOUT;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                let cred =
                    nix::sys::socket::getsockopt(&s, nix::sys::socket::sockopt::PeerCredentials)
                        .map_err(|e| format!("hand-over socket: {e}"))?;
                if u32::try_from(cred.pid()).ok() != Some(child.id()) {
                    warn!(
                        pid = cred.pid(),
                        "upgrade: a stranger connected to the hand-over socket; ignored"
                    );
                    continue;
                }
                s.set_nonblocking(false).map_err(|e| e.to_string())?;
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(format!("hand-over socket: {e}")),
        }
        if let Some(st) = child.exited() {
            return Err(format!("the new lb exited ({st}) before taking over"));
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "the new lb did not connect within {} s",
                STEP_TIMEOUT.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Stop every accept loop (the listening sockets stay open: the new process has them, and
/// this one keeps copies to serve again if the hand-over fails). Returns their addresses.
fn stop_accepting(d: &Daemon) -> Vec<std::net::SocketAddr> {
    // The admin API too: a request now would read or change state that is being handed over.
    d.admin_gate.send_replace(false);
    let mut l = d.listeners.lock().unwrap_or_else(|p| p.into_inner());
    l.drain(..)
        .map(|(addr, stop)| {
            stop.cancel();
            addr
        })
        .collect()
}

type Failed = (String, Vec<Frozen>);

/// Freeze every connection task and collect them.
async fn freeze(d: &Daemon) -> Result<Vec<Frozen>, Failed> {
    let mut rx = d.proxy.freezer.freeze();
    // Not `close()` + `wait()`: a closed tracker reads as "shutting down" to /readyz. Nothing
    // spawns connection tasks now (the accept loops are stopped).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !d.proxy.tasks.is_empty() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut out = Vec::new();
    while let Ok(f) = rx.try_recv() {
        out.push(f);
    }
    if !d.proxy.tasks.is_empty() {
        return Err(("connection tasks did not stop within 10 s".into(), out));
    }
    Ok(out)
}

/// After a failed hand-over: serve the frozen connections and accept again.
fn resume(
    d: &Arc<Daemon>,
    rt: &tokio::runtime::Handle,
    frozen: Vec<Frozen>,
    stopped: &[std::net::SocketAddr],
) {
    let _g = rt.enter();
    d.admin_gate.send_replace(true);
    d.proxy.freezer.thaw();
    let n = frozen.len();
    let go = CancellationToken::new();
    go.cancel();
    for f in frozen {
        proxy::adopt(&d.proxy, f, go.clone());
    }
    let own = handover::own_listeners().unwrap_or_default();
    for addr in stopped {
        let Some(fd) = own.iter().find_map(|(k, fd)| {
            (k == &ListenerKey::Proxy(*addr))
                .then(|| fd.try_clone().ok())
                .flatten()
        }) else {
            error!(listen = %addr, "upgrade failed and this listener cannot be served again");
            continue;
        };
        let Some(b) = d
            .balancers
            .load()
            .iter()
            .find(|b| b.config().listen.contains(addr))
            .cloned()
        else {
            continue;
        };
        match tokio::net::TcpListener::from_std(std::net::TcpListener::from(fd)) {
            Ok(l) => {
                let stop = CancellationToken::new();
                d.listeners
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push((*addr, stop.clone()));
                rt.spawn(proxy::serve(l, b, d.proxy.clone(), stop));
            }
            Err(e) => error!(listen = %addr, error = %e, "cannot serve a listener again"),
        }
    }
    warn!(
        connections = n,
        "upgrade failed: serving the connections and listeners again"
    );
}

impl Daemon {
    /// Whether this process handed everything to a new lb and must exit now.
    pub fn handed_over(&self) -> bool {
        self.handed_over.is_cancelled()
    }
}
