//! Connections across `lb upgrade`: the freeze that stops every connection task at a point
//! where nothing is half done (between two awaits of its copy loop), what a frozen connection
//! carries (its sockets, the bytes read and not yet written, the counts), and the adoption that
//! serves it again, in the next process or, after a failed hand-over, in this one.

use std::{
    net::SocketAddr,
    os::fd::OwnedFd,
    sync::{Arc, Mutex},
};

use tokio::{net::TcpStream, sync::mpsc};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::{Conn, ProxyCtx, Resume};
use crate::{addr::ServerAddr, balancer::Balancer};

/// One direction of a connection's copy loop, as a hand-over needs it.
#[derive(Debug, Default)]
pub struct Dir {
    /// The chunk in flight (read, not all written); `off` bytes of it are written.
    pub(super) pending: Vec<u8>,
    pub(super) off: usize,
    /// Bytes written to the destination before the chunk in flight.
    pub(super) written: u64,
    /// Length of the chunk in flight (0: none).
    pub(super) chunk: u64,
}

impl Dir {
    /// A direction that has written `written` bytes and holds a chunk of `chunk` bytes of
    /// which `unwritten` (the tail) are still to be written.
    pub fn resumed(written: u64, chunk: u64, unwritten: Vec<u8>) -> Dir {
        Dir {
            pending: unwritten,
            off: 0,
            written,
            chunk,
        }
    }

    /// Bytes written before the chunk in flight.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Length of the chunk in flight.
    pub fn chunk(&self) -> u64 {
        self.chunk
    }

    /// The unwritten bytes of the chunk in flight.
    pub fn unwritten(&self) -> &[u8] {
        &self.pending[self.off..]
    }
}

/// A connection stopped for a hand-over.
#[derive(Debug)]
pub struct Frozen {
    /// Its balancer.
    pub balancer: Arc<Balancer>,
    /// The client's address.
    pub peer: SocketAddr,
    /// The accepted socket.
    pub client: OwnedFd,
    /// Its server and server socket; `None` when the dial had not finished.
    pub server: Option<(ServerAddr, OwnedFd)>,
    /// Client→server.
    pub up: Dir,
    /// Server→client.
    pub down: Dir,
    /// Whether the kernel splices it.
    pub spliced: bool,
}

/// A tokio socket back to a plain descriptor (still non-blocking).
fn to_fd(s: TcpStream) -> Option<OwnedFd> {
    match s.into_std() {
        Ok(s) => Some(OwnedFd::from(s)),
        Err(e) => {
            warn!(error = %e, "cannot take a socket out of the runtime for the hand-over");
            None
        }
    }
}

impl Frozen {
    pub(super) fn undialed(
        balancer: Arc<Balancer>,
        peer: SocketAddr,
        client: TcpStream,
    ) -> Option<Frozen> {
        Some(Frozen {
            balancer,
            peer,
            client: to_fd(client)?,
            server: None,
            up: Dir::default(),
            down: Dir::default(),
            spliced: false,
        })
    }

    pub(super) fn established(
        balancer: Arc<Balancer>,
        peer: SocketAddr,
        client: TcpStream,
        (spec, server): (ServerAddr, TcpStream),
        (up, down): (Dir, Dir),
        spliced: bool,
    ) -> Option<Frozen> {
        Some(Frozen {
            balancer,
            peer,
            client: to_fd(client)?,
            server: Some((spec, to_fd(server)?)),
            up,
            down,
            spliced,
        })
    }
}

/// The freeze switch of every connection task.
#[derive(Debug, Default)]
pub struct Freezer {
    token: Mutex<CancellationToken>,
    out: Mutex<Option<mpsc::UnboundedSender<Frozen>>>,
}

impl Freezer {
    /// The token the tasks watch now.
    pub(super) fn token(&self) -> CancellationToken {
        self.token.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Stop every connection task at its next await; each sends what it is on the returned
    /// channel, then ends without closing or resetting anything. Stop accepting first.
    pub fn freeze(&self) -> mpsc::UnboundedReceiver<Frozen> {
        let (tx, rx) = mpsc::unbounded_channel();
        *self.out.lock().unwrap_or_else(|p| p.into_inner()) = Some(tx);
        self.token().cancel();
        rx
    }

    /// Arm the switch again (after a failed hand-over, before adopting the frozen connections).
    pub fn thaw(&self) {
        *self.out.lock().unwrap_or_else(|p| p.into_inner()) = None;
        *self.token.lock().unwrap_or_else(|p| p.into_inner()) = CancellationToken::new();
    }

    pub(super) fn frozen(&self, f: Option<Frozen>) {
        let Some(f) = f else { return };
        let out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tx) = out.as_ref() {
            // A closed channel drops the sockets: the collector is gone only when this
            // process is about to exit after a hand-over.
            let _ = tx.send(f);
        }
    }
}

/// Serve a frozen connection again on `ctx` once `go` fires: the unwritten bytes first, then
/// the copy loops (and the kernel pair, for a spliced one); an undialed client is dialed.
pub fn adopt(ctx: &Arc<ProxyCtx>, f: Frozen, go: CancellationToken) {
    let ctx2 = ctx.clone();
    // Counted toward `max_connections` like the connections accepted here.
    let admitted = ctx.limits.count(&f.balancer.name);
    ctx.tasks.spawn(async move {
        let _admitted = admitted;
        go.cancelled().await;
        let Frozen {
            balancer,
            peer,
            client,
            server,
            up,
            down,
            spliced,
        } = f;
        let tokio_stream = |fd: OwnedFd| {
            let s = std::net::TcpStream::from(fd);
            s.set_nonblocking(true)?;
            TcpStream::from_std(s)
        };
        let client = match tokio_stream(client) {
            Ok(c) => c,
            Err(e) => {
                warn!(balancer = %balancer.name, client = %peer, error = %e, "cannot serve a handed-over client");
                return;
            }
        };
        let Some((spec, server)) = server else {
            super::connect(client, peer, None, balancer, ctx2).await;
            return;
        };
        let server = match tokio_stream(server) {
            Ok(s) => s,
            Err(e) => {
                warn!(balancer = %balancer.name, client = %peer, error = %e, "cannot serve a handed-over server socket");
                return;
            }
        };
        super::established(
            Box::new(Conn {
                client,
                peer,
                local: None,
                balancer,
                spec,
                server,
            }),
            ctx2,
            Resume::Adopted(Box::new((up, down, spliced))),
        )
        .await;
    });
}
