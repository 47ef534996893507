//! The admin API's listeners: binding them (a unix socket with mode 0600), the accept loop
//! with its connection slots and the once-a-second log of the limit, and serving one connection
//! with the API's HTTP/1.1 server and timeouts.

use std::{
    net::SocketAddr,
    os::unix::fs::{FileTypeExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use axum::Router;
use hyper_util::{rt::TokioIo, service::TowerToHyperService};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{debug, warn};

use super::{AdminError, BACKLOG, CONNECTION_LIFETIME, MAX_CONNECTIONS, authz, http1, slots};

/// A connection from either listener.
trait Io: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Io for T {}

pub(super) enum Listener {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener, PathBuf),
}

impl Listener {
    async fn accept(&self) -> std::io::Result<(Box<dyn Io>, authz::Peer)> {
        match self {
            Listener::Tcp(l) => {
                let (s, remote) = l.accept().await?;
                let _ = s.set_nodelay(true);
                let local = s.local_addr()?;
                Ok((Box::new(s), authz::Peer::Tcp { local, remote }))
            }
            Listener::Unix(l, _) => {
                let s = l.accept().await?.0;
                let uid = s.peer_cred().ok().map(|c| c.uid());
                Ok((Box::new(s), authz::Peer::Unix { uid }))
            }
        }
    }
}

/// Serve one connection: HTTP/1.1, head read bounded, closed at shutdown, after
/// [`CONNECTION_LIFETIME`], or when an idle one makes room for a newer one ([`slots`]). A
/// client that goes away mid-request drops the handler's future.
async fn serve_connection(
    io: Box<dyn Io>,
    peer: authz::Peer,
    app: Router,
    shutdown: CancellationToken,
    slot: slots::Slot,
) {
    let app = app.layer(axum::Extension(peer));
    let conn =
        http1().serve_connection(TokioIo::new(io), slot.track(TowerToHyperService::new(app)));
    tokio::pin!(conn);
    let result = tokio::select! {
        r = conn.as_mut() => r,
        () = slot.replaced() => Ok(()),
        () = shutdown.cancelled() => {
            conn.as_mut().graceful_shutdown();
            tokio::time::timeout(Duration::from_secs(1), conn.as_mut()).await.unwrap_or(Ok(()))
        }
        () = tokio::time::sleep(CONNECTION_LIFETIME) => {
            conn.as_mut().graceful_shutdown();
            tokio::time::timeout(Duration::from_secs(1), conn.as_mut()).await.unwrap_or(Ok(()))
        }
    };
    if let Err(e) = result {
        debug!(error = %e, "admin connection ended with an error");
    }
}

/// Logs that the connection limit was reached at most once a second, with how many
/// connections were closed for it since the last line.
#[derive(Debug, Default)]
struct LimitLog {
    last: Option<std::time::Instant>,
    replaced: u64,
    refused: u64,
}

impl LimitLog {
    fn note(&mut self, admission: &slots::Admission) {
        match admission {
            slots::Admission::Admitted(_) => return,
            slots::Admission::Replaced(_) => self.replaced += 1,
            slots::Admission::Full => self.refused += 1,
        }
        if self
            .last
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(1))
        {
            warn!(
                limit = MAX_CONNECTIONS,
                idle_closed = self.replaced,
                refused = self.refused,
                "admin connections at the limit: idle ones closed for new ones, new ones refused while every one is handling a request (logged at most once a second)"
            );
            self.last = Some(std::time::Instant::now());
            (self.replaced, self.refused) = (0, 0);
        }
    }
}

pub(super) async fn accept_loop(
    listener: Listener,
    app: Router,
    shutdown: CancellationToken,
    conns: TaskTracker,
    slots: Arc<slots::Slots>,
    mut gate: tokio::sync::watch::Receiver<bool>,
) {
    let mut failed_logged: Option<std::time::Instant> = None;
    let mut at_limit = LimitLog::default();
    loop {
        // Closed during a hand-over: connections wait in the backlog for whichever process
        // serves on.
        if !*gate.borrow_and_update() {
            tokio::select! {
                () = shutdown.cancelled() => break,
                r = gate.wait_for(|open| *open) => if r.is_err() { break },
            }
            continue;
        }
        let (io, peer) = tokio::select! {
            () = shutdown.cancelled() => break,
            r = gate.changed() => if r.is_err() { break } else { continue },
            r = listener.accept() => match r {
                Ok(conn) => conn,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning; log once a second.
                    if failed_logged.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                        failed_logged = Some(std::time::Instant::now());
                        warn!(error = %e, "admin accept failed (logged at most once a second)");
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let admission = slots.admit();
        at_limit.note(&admission);
        let (slot, replaced) = match admission {
            slots::Admission::Admitted(slot) => (slot, false),
            slots::Admission::Replaced(slot) => (slot, true),
            slots::Admission::Full => continue,
        };
        let (app, shutdown) = (app.clone(), shutdown.clone());
        conns.spawn(serve_connection(io, peer, app, shutdown, slot));
        if replaced {
            // Let the replaced connection's task close its socket before the next accept, so
            // descriptors stay within the limit during a flood.
            tokio::task::yield_now().await;
        }
    }
    if let Listener::Unix(_, path) = &listener {
        let _ = std::fs::remove_file(path);
    }
}

/// Bind the admin TCP listener as `std::net::TcpListener::bind` would (`SO_REUSEADDR`), with
/// [`BACKLOG`] instead of std's 128.
pub(super) fn bind_tcp(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    s.set_reuse_address(true)?;
    s.bind(&addr.into())?;
    s.listen(BACKLOG)?;
    Ok(s.into())
}

/// Bind a unix socket at `path` with mode 0600, replacing a stale socket (never another kind of
/// file).
pub(super) fn bind_unix(path: &Path) -> Result<std::os::unix::net::UnixListener, AdminError> {
    let err = |source| AdminError::UnixSocket {
        path: path.to_path_buf(),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path).map_err(err)?,
        Ok(_) => {
            return Err(err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "the path exists and is not a socket",
            )));
        }
        Err(_) => {}
    }
    let l = std::os::unix::net::UnixListener::bind(path).map_err(err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    l.set_nonblocking(true).map_err(err)?;
    Ok(l)
}
