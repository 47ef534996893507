//! Proxy: listeners, accept, dial in preference order, pairing with the kernel splice, the
//! userspace copy path, and ending connections (half-close, reset, kill).

use std::{
    future::Future,
    io,
    net::SocketAddr,
    pin::Pin,
    sync::{
        Arc, OnceLock,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::net::{TcpListener, TcpStream};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{debug, warn};

use crate::{
    addr::ServerAddr,
    balancer::Balancer,
    datapath::{Datapath, Pair},
    kill::OwnSocket,
    metrics::{BalancerLabel, Metrics},
};

/// Runs before dialing `server`: returns `false` to skip it (e.g. a check-before-dial just
/// failed). Installed by the health module.
pub type PreDial = Arc<
    dyn Fn(Arc<Balancer>, ServerAddr) -> Pin<Box<dyn Future<Output = bool> + Send>> + Send + Sync,
>;

mod dial;
mod handover;
mod limits;
mod relay;

pub use dial::dial;
pub use handover::{Dir, Freezer, Frozen, adopt};
pub use limits::{Admitted, Limits};
use relay::{Outcome, Side, abort, relay};

/// Shared context of every connection.
pub struct ProxyCtx {
    /// Kernel data path, when attached.
    pub datapath: Option<Arc<Datapath>>,
    /// Copy buffer size (bytes).
    pub copy_buffer_bytes: usize,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Check-before-dial hook.
    pub pre_dial: Option<PreDial>,
    /// Every connection task.
    pub tasks: TaskTracker,
    /// Stops every connection at a point where it can be handed over (`lb upgrade`).
    pub freezer: Freezer,
    /// Connections through lb per balancer (`max_connections`) and rate-limited logs.
    pub limits: Limits,
}

impl std::fmt::Debug for ProxyCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyCtx")
            .field("datapath", &self.datapath.is_some())
            .finish_non_exhaustive()
    }
}

/// Bind a listener with `SO_REUSEADDR` (and `IPV6_V6ONLY` for IPv6, so `[::]` and `0.0.0.0` can
/// both be listed).
///
/// # Errors
/// The bind/listen error.
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let domain = if addr.is_ipv6() {
        socket2::Domain::IPV6
    } else {
        socket2::Domain::IPV4
    };
    let sock = socket2::Socket::new(domain, socket2::Type::STREAM, Some(socket2::Protocol::TCP))?;
    sock.set_reuse_address(true)?;
    if addr.is_ipv6() {
        sock.set_only_v6(true)?;
    }
    sock.set_nonblocking(true)?;
    sock.bind(&addr.into())?;
    sock.listen(4096)?;
    TcpListener::from_std(sock.into())
}

/// Accept on `listener` until `stop` fires; each connection runs on `ctx.tasks`.
pub async fn serve(
    listener: TcpListener,
    balancer: Arc<Balancer>,
    ctx: Arc<ProxyCtx>,
    stop: CancellationToken,
) {
    // Every accepted socket's own address, unless the listener is a wildcard.
    let bound = listener
        .local_addr()
        .ok()
        .filter(|a| !a.ip().is_unspecified());
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((client, peer)) => match ctx.limits.admit(&balancer) {
                Ok(admitted) => {
                    let conn = handle(client, peer, bound, balancer.clone(), ctx.clone());
                    ctx.tasks.spawn(async move {
                        conn.await;
                        drop(admitted);
                    });
                }
                Err(limit) => limits::reject(&client, &balancer, &ctx, limit),
            },
            // EMFILE and friends: counted, logged once a second, retried after a pause.
            Err(e) => limits::accept_failed(&e, &balancer, &ctx).await,
        }
    }
}

/// Serve one client connection from dial to close. Not itself async, so the task holds
/// nothing of it beyond [`connect`]'s future.
fn handle(
    client: TcpStream,
    peer: SocketAddr,
    local: Option<SocketAddr>,
    balancer: Arc<Balancer>,
    ctx: Arc<ProxyCtx>,
) -> impl Future<Output = ()> + Send {
    ctx.metrics
        .connections_total
        .get_or_create(&BalancerLabel {
            balancer: balancer.name.clone(),
        })
        .inc();
    let _ = client.set_nodelay(true);
    connect(client, peer, local, balancer, ctx)
}

/// Dial a server for an accepted client, then serve the pair. A freeze (`lb upgrade`) during
/// the dial hands the client over undialed: it has received nothing yet. `local` is the
/// client socket's own address when the listener's address gives it.
async fn connect(
    client: TcpStream,
    peer: SocketAddr,
    local: Option<SocketAddr>,
    balancer: Arc<Balancer>,
    ctx: Arc<ProxyCtx>,
) {
    let freeze = ctx.freezer.token();
    // Boxed so the dial's state is freed once connected instead of living in every connection's
    // task for its whole life.
    let dialed = tokio::select! {
        r = Box::pin(dial(&balancer, &ctx)) => r,
        () = freeze.cancelled() => {
            ctx.freezer.frozen(Frozen::undialed(balancer, peer, client));
            return;
        }
    };
    let (spec, server) = match dialed {
        Ok(v) => v,
        Err(e) => {
            warn!(balancer = %balancer.name, client = %peer, error = %e, "all servers failed; closing the client");
            return;
        }
    };
    established(
        Box::new(Conn {
            client,
            peer,
            local,
            balancer,
            spec,
            server,
        }),
        ctx,
        Resume::Fresh,
    )
    .await;
}

/// A client with its server socket.
struct Conn {
    client: TcpStream,
    peer: SocketAddr,
    /// The client socket's own address, when known without asking the socket.
    local: Option<SocketAddr>,
    balancer: Arc<Balancer>,
    spec: ServerAddr,
    server: TcpStream,
}

/// Where a connection's relay starts.
enum Resume {
    /// A new connection: pair it when the kernel can.
    Fresh,
    /// Handed over: each direction's state (up, down), and whether the kernel splices it.
    /// Boxed: every connection's task holds a `Resume`.
    Adopted(Box<(Dir, Dir, bool)>),
}

/// Serve a connected pair until it ends, is killed, or is frozen for a hand-over. `conn` is
/// boxed so that the task does not keep a moved-from copy of it for the connection's life.
#[expect(
    clippy::too_many_lines,
    reason = "one connection's life, phase by phase"
)]
async fn established(conn: Box<Conn>, ctx: Arc<ProxyCtx>, resume: Resume) {
    let Conn {
        client,
        peer,
        local,
        balancer,
        spec,
        server,
    } = *conn;
    let local = local.or_else(|| client.local_addr().ok());
    let own = local.and_then(|l| OwnSocket::of(&client, l, peer).ok());
    let guard = balancer.register(&spec, own);
    // Until the connection ends cleanly, closing the server socket resets it. Should lb die
    // (SIGKILL, a crash), the kernel's close then wakes a blocking client asleep in a redirected
    // send with an error; a plain close would orphan the socket, and that client would sleep on
    // it forever (found by hand: the client hung after lb was killed). The server also learns
    // that the stream broke instead of seeing a FIN.
    abort(&server);
    let splice = Splice {
        peer,
        local,
        pair: OnceLock::new(),
        tried: AtomicBool::new(true),
        client: &client,
        server: &server,
        dp: ctx.datapath.as_deref(),
        ctx: &ctx,
        balancer: &balancer.name,
        copied: AtomicU64::new(0),
    };
    let (mut up, mut down) = splice.resume(resume);
    let freeze = ctx.freezer.token();
    let idle = idle_or_never(&splice, balancer.config().idle_timeout.map(|d| d.0));
    let outcome = tokio::select! {
        // A kill resets the client in the kernel first: the relay may see that error too.
        biased;
        () = guard.cancel.cancelled() => Outcome::Killed,
        () = freeze.cancelled() => Outcome::Frozen,
        () = idle => Outcome::Idle,
        r = relay(&client, &server, &splice, &ctx, &mut up, &mut down) => r,
    };
    let outcome = match outcome {
        Outcome::Reset(..) if guard.reason().is_some() => Outcome::Killed,
        o => o,
    };
    let pair = splice.pair.into_inner();
    let pair = pair.as_ref();
    if let Outcome::Frozen = outcome {
        // Handed over as it stands: the kernel keeps the pair (sockhash entry, counts), the
        // next process takes the sockets and the unwritten bytes.
        if let (Some(dp), Some(p)) = (&ctx.datapath, pair) {
            dp.release(p);
            spliced_gauge(&ctx, &balancer.name).dec();
        }
        drop(guard);
        let frozen = Frozen::established(
            balancer,
            peer,
            client,
            (spec, server),
            (up, down),
            pair.is_some(),
        );
        ctx.freezer.frozen(frozen);
        return;
    }
    // A kill ends thousands of connections at once: reset the client first, then let the other
    // killed connections reset theirs before this one cleans its map entries (the server socket
    // stays open until its pair is out of the maps, as always).
    let client = if let Outcome::Killed | Outcome::Idle = outcome {
        abort(&client);
        drop(client);
        tokio::task::yield_now().await;
        None
    } else {
        Some(client)
    };
    // The kernel forgets the client's flow and namespace entries itself when the client's
    // socket closes (sockops `STATE_CB`).
    if let (Some(dp), Some(p)) = (&ctx.datapath, pair) {
        dp.unpair(p);
        spliced_gauge(&ctx, &balancer.name).dec();
    }
    match outcome {
        Outcome::Closed | Outcome::Frozen => {
            // Both directions ended: let the kernel deliver what is still queued, then FIN.
            let _ = socket2::SockRef::from(&server).set_linger(None);
        }
        Outcome::Reset(e, side) => {
            debug!(balancer = %balancer.name, server = %spec, error = %e, ?side, "connection reset; resetting both sides");
            if let Some(client) = &client {
                abort(client);
            }
            abort(&server);
            if side == Side::Server && e.kind() == io::ErrorKind::ConnectionReset {
                balancer.record_server_reset(&spec);
            }
        }
        Outcome::Killed => {
            let reason = guard.reason().map_or("killed", |r| r.label());
            // One line per kill would cost more than the kill itself with thousands of connections;
            // the balancer logs one summary per server and reason.
            debug!(balancer = %balancer.name, server = %spec, client = %peer, reason, "connection killed");
            abort(&server);
        }
        Outcome::Idle => idle_closed(&ctx, &balancer.name, &spec, &server),
    }
}

/// Returns once the connection moved no byte for `timeout`; never without one. Boxed: only
/// connections of a balancer with a timeout pay for its timer.
async fn idle_or_never(splice: &Splice<'_>, timeout: Option<Duration>) {
    match timeout {
        Some(t) => Box::pin(limits::idle(splice, t)).await,
        None => std::future::pending().await,
    }
}

/// Reset the server side of a connection closed by `idle_timeout` and count it
/// (`lb_connections_killed_total{reason="idle"}`).
fn idle_closed(ctx: &ProxyCtx, balancer: &str, server: &ServerAddr, socket: &TcpStream) {
    debug!(balancer, %server, "idle connection closed");
    abort(socket);
    ctx.metrics
        .connections_killed
        .get_or_create(&crate::metrics::KillLabels {
            balancer: balancer.to_string(),
            server: server.to_string(),
            reason: crate::balancer::KillReason::Idle.label().into(),
        })
        .inc();
}

/// How long a client may stay silent, with all it sent copied, before lb pairs it.
const PAIR_WHEN_QUIET: Duration = Duration::from_millis(10);

/// A connection's kernel splice. A new connection is paired when its client stays quiet for
/// [`PAIR_WHEN_QUIET`] with everything it sent copied (after connecting, or between two
/// sends), or once it has sent a second chunk or one that filled the copy buffer: one that
/// sends a single request at once and ends (a health probe, a short HTTP exchange) never pays
/// for the map updates, and the bytes copied before pairing are what the counting rule already
/// handles.
struct Splice<'a> {
    peer: SocketAddr,
    /// lb's end of the client connection; `None` when unknown (never paired).
    local: Option<SocketAddr>,
    pair: OnceLock<Arc<Pair>>,
    /// Pairing was tried (or is not to be): never again.
    tried: AtomicBool,
    /// lb's socket of the client.
    client: &'a TcpStream,
    server: &'a TcpStream,
    dp: Option<&'a Datapath>,
    ctx: &'a ProxyCtx,
    balancer: &'a str,
    /// Bytes lb copied, both ways (what [`limits::idle`] watches, with the kernel's count).
    copied: AtomicU64,
}

impl limits::Activity for Splice<'_> {
    fn moved(&self) -> u64 {
        let redirected = match (self.dp, self.pair.get()) {
            (Some(dp), Some(p)) => dp.flow(&p.key()).map_or(0, |f| f.redirected),
            _ => 0,
        };
        self.copied.load(Ordering::Relaxed) + redirected
    }
}

impl Splice<'_> {
    /// Where each direction starts: a new connection from zero (paired once it shows it will
    /// last); a handed-over one where it stopped, paired again in the kernel if it was.
    fn resume(&self, resume: Resume) -> (Dir, Dir) {
        match resume {
            Resume::Fresh => {
                self.tried.store(self.dp.is_none(), Ordering::Relaxed);
                (Dir::default(), Dir::default())
            }
            Resume::Adopted(adopted) => {
                let (up, down, spliced) = *adopted;
                if spliced
                    && let (Some(dp), Some(local)) = (self.dp, self.local)
                    && let Some(key) = dp.client_key(self.peer, local)
                {
                    let _ = self.pair.set(dp.adopt_pair(key, self.server, up.written));
                    spliced_gauge(self.ctx, self.balancer).inc();
                } else if !spliced {
                    // Not paired yet when handed over: paired here once it shows it will last.
                    self.tried.store(self.dp.is_none(), Ordering::Relaxed);
                }
                (up, down)
            }
        }
    }

    /// Whether pairing is still to be tried.
    fn pending(&self) -> bool {
        self.dp.is_some() && !self.tried.load(Ordering::Relaxed)
    }

    /// Pair the client with its server after lb copied `copied` bytes; returns whether it did.
    /// A client the kernel did not register (outside the cgroup, an ambiguous tuple) or a map
    /// error leaves the connection on the copy path.
    fn try_pair(&self, copied: u64) -> bool {
        self.tried.store(true, Ordering::Relaxed);
        let Some(dp) = self.dp else { return false };
        let Some(key) = self.local.and_then(|local| dp.client_key(self.peer, local)) else {
            return false;
        };
        match dp.pair(key, self.client, self.server, copied) {
            Ok(Some(p)) => {
                let _ = self.pair.set(p);
                spliced_gauge(self.ctx, self.balancer).inc();
                true
            }
            Ok(None) => {
                debug!(client = %self.peer, "not paired (the client is gone, or the kernel splice is off); copying in userspace");
                false
            }
            Err(e) => {
                warn!(error = %crate::errors::chain(&e), "cannot pair; copying in userspace");
                false
            }
        }
    }

    /// After lb copied a chunk (`copied` bytes in all; `full`: it filled the copy buffer; the
    /// `chunks`-th): pair when due, else publish the count of a paired connection.
    fn copied(&self, copied: u64, full: bool, chunks: u32) {
        let Some(dp) = self.dp else { return };
        let paired_now = self.pending() && (full || chunks >= 2) && self.try_pair(copied);
        if !paired_now && let Some(p) = self.pair.get() {
            dp.set_copied(p, copied);
        }
    }
}

/// Wait until `src` is readable (`true`) or [`PAIR_WHEN_QUIET`] passed (`false`). Boxed, so
/// the timer takes room in a connection's task only while it waits on it (a connection that is
/// paired or copied in userspace keeps none).
fn readable_or_quiet(
    src: &TcpStream,
) -> Pin<Box<dyn Future<Output = io::Result<bool>> + Send + '_>> {
    Box::pin(async move {
        tokio::select! {
            biased;
            r = src.readable() => r.map(|()| true),
            () = tokio::time::sleep(PAIR_WHEN_QUIET) => Ok(false),
        }
    })
}

/// `lb_spliced_connections` of `balancer`.
fn spliced_gauge(ctx: &ProxyCtx, balancer: &str) -> prometheus_client::metrics::gauge::Gauge {
    ctx.metrics
        .spliced_connections
        .get_or_create(&BalancerLabel {
            balancer: balancer.to_string(),
        })
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size_of_future<F: Future>(_: &F) -> usize {
        std::mem::size_of::<F>()
    }

    /// Every open connection's task holds a relay future for its whole life, so its size is
    /// lb's memory per idle connection: the pairing timer is boxed and taken only while a
    /// client is waited on (unboxed, it made the relay 1,300+ bytes and lb's RSS per idle
    /// connection about 1 KiB larger in `cargo xtask bench`).
    #[test]
    fn a_connection_relay_stays_under_one_kib() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let l = bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
            let addr = l.local_addr().expect("local");
            let client = TcpStream::connect(addr).await.expect("connect");
            let (server, _) = l.accept().await.expect("accept");
            let ctx = ProxyCtx {
                datapath: None,
                copy_buffer_bytes: 64 * 1024,
                metrics: Arc::new(Metrics::new()),
                pre_dial: None,
                tasks: TaskTracker::new(),
                freezer: Freezer::default(),
                limits: Limits::default(),
            };
            let splice = Splice {
                peer: addr,
                local: None,
                pair: OnceLock::new(),
                tried: AtomicBool::new(true),
                client: &client,
                server: &server,
                dp: None,
                ctx: &ctx,
                balancer: "b",
                copied: AtomicU64::new(0),
            };
            let (mut up, mut down) = (Dir::default(), Dir::default());
            let relay = relay(&client, &server, &splice, &ctx, &mut up, &mut down);
            let bytes = size_of_future(&relay);
            assert!(bytes <= 1024, "a relay future is {bytes} bytes");
        });
    }
}
