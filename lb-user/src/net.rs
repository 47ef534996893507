//! The one way lb reaches a server: resolve its address, try every address it resolves to in
//! turn, directly or through an HTTP CONNECT proxy (`balancer.proxy`, skipped for hosts in
//! `NO_PROXY`). The proxy's dials and every health check kind use it, so checks go where client
//! connections go.

use std::{io, net::SocketAddr, sync::RwLock};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
};

use crate::addr::{ProxyUrl, ServerAddr};

/// lb's own listening addresses, set once at start ([`set_own_listeners`]).
static OWN_LISTENERS: RwLock<Vec<SocketAddr>> = RwLock::new(Vec::new());

/// Record lb's own listening addresses, so a dial or a check that reaches one of them is known
/// as a loop ([`is_own_listener`]), however the server was spelled (`0.0.0.0:P`, a name that
/// resolves to this host, an IPv4-mapped address).
pub fn set_own_listeners(listeners: &[SocketAddr]) {
    *OWN_LISTENERS.write().unwrap_or_else(|p| p.into_inner()) = listeners.to_vec();
}

/// Whether a connection whose peer is `peer` reached one of lb's own listeners: the same
/// address, or a wildcard listener's port on an address of this host.
pub fn is_own_listener(peer: SocketAddr) -> bool {
    let peer_ip = match peer.ip() {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(peer.ip(), std::net::IpAddr::V4),
        ip => ip,
    };
    OWN_LISTENERS
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .any(|l| {
            l.port() == peer.port()
                && (l.ip() == peer_ip
                    || (l.ip().is_unspecified() && (peer_ip.is_loopback() || is_local_ip(peer_ip))))
        })
}

/// Whether `ip` is an address of this host (can be bound).
fn is_local_ip(ip: std::net::IpAddr) -> bool {
    std::net::TcpListener::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// Largest CONNECT response head read from a proxy (bytes).
const MAX_PROXY_HEAD: usize = 8192;

/// How to reach servers: through `proxy` unless the host is listed in `no_proxy`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Route {
    /// The CONNECT proxy, if any.
    pub proxy: Option<ProxyUrl>,
    /// A `NO_PROXY` value: `*`, names and domain suffixes, comma separated.
    pub no_proxy: String,
}

impl Route {
    /// `proxy` with `NO_PROXY` (or `no_proxy`) from the environment.
    pub fn from_env(proxy: Option<ProxyUrl>) -> Route {
        Route {
            proxy,
            no_proxy: no_proxy_env(),
        }
    }

    /// The proxy to use for `server`, if any.
    pub fn proxy_for(&self, server: &ServerAddr) -> Option<&ProxyUrl> {
        self.proxy
            .as_ref()
            .filter(|_| !no_proxy_matches(&self.no_proxy, &server.host_str()))
    }
}

/// Connect to `server` as `route` says: every resolved address in turn, or one CONNECT through
/// the proxy (which resolves the name itself). No timeout here: callers bound it.
///
/// # Errors
/// The last connect error, `NotFound` when the name resolves to nothing, or the proxy's
/// refusal (`ConnectionRefused` with its status line).
pub async fn connect(server: &ServerAddr, route: &Route) -> io::Result<TcpStream> {
    connect_to(server, route).await.map(|(s, _)| s)
}

/// As [`connect`], also returning the address the socket is connected to (the server's, or the
/// proxy's), so the caller needs no `getpeername`.
///
/// # Errors
/// As [`connect`].
pub async fn connect_to(
    server: &ServerAddr,
    route: &Route,
) -> io::Result<(TcpStream, std::net::SocketAddr)> {
    let Some(proxy) = route.proxy_for(server) else {
        return connect_direct(server).await;
    };
    let (mut s, peer) = connect_direct(proxy.addr()).await?;
    // A pinned name asks the proxy for its one address, not for whatever the name resolves to.
    let target = server
        .pin()
        .and(server.socket_addr())
        .map_or_else(|| server.authority(), |sa| sa.to_string());
    s.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .await?;
    read_connect_answer(&mut s).await?;
    Ok((s, peer))
}

/// Read a CONNECT proxy's answer head from `s`, byte by byte up to its blank line (so not one
/// byte of the tunnel is taken from the stream), at most [`MAX_PROXY_HEAD`] bytes; the answer
/// must be status 200.
///
/// # Errors
/// `InvalidData` when the proxy closes or the head grows past [`MAX_PROXY_HEAD`] bytes;
/// `ConnectionRefused` with the status line for any status but 200.
pub(crate) async fn read_connect_answer<R>(s: &mut R) -> io::Result<()>
where
    R: tokio::io::AsyncRead + Unpin,
{
    let mut head = Vec::with_capacity(256);
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() > MAX_PROXY_HEAD || s.read(&mut byte).await? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "proxy closed or sent an oversized response",
            ));
        }
        head.push(byte[0]);
    }
    let status_line = String::from_utf8_lossy(&head);
    let code = status_line.split_whitespace().nth(1).unwrap_or("");
    if code != "200" {
        return Err(io::Error::new(
            io::ErrorKind::ConnectionRefused,
            format!(
                "proxy refused CONNECT: {}",
                status_line.lines().next().unwrap_or("")
            ),
        ));
    }
    Ok(())
}

/// Resolve `server` and connect to the first address that accepts, with `TCP_NODELAY`;
/// returns the socket and that address.
async fn connect_direct(server: &ServerAddr) -> io::Result<(TcpStream, std::net::SocketAddr)> {
    let mut last = io::Error::new(
        io::ErrorKind::NotFound,
        format!("{server} resolved to no address"),
    );
    let addrs: Vec<std::net::SocketAddr> = match server.socket_addr() {
        Some(sa) => vec![sa],
        None => tokio::net::lookup_host(server.authority()).await?.collect(),
    };
    for addr in addrs {
        match TcpStream::connect(addr).await {
            Ok(s) => {
                s.set_nodelay(true)?;
                return Ok((s, addr));
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// `NO_PROXY` (or `no_proxy`) from the environment: hosts that are dialed directly.
pub fn no_proxy_env() -> String {
    std::env::var("NO_PROXY")
        .or_else(|_| std::env::var("no_proxy"))
        .unwrap_or_default()
}

/// Whether `host` is listed in a `NO_PROXY` value (`*`, exact names, or domain suffixes).
pub fn no_proxy_matches(list: &str, host: &str) -> bool {
    list.split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .any(|e| {
            e == "*" || host == e || host.ends_with(&format!(".{}", e.trim_start_matches('.')))
        })
}

/// True for errors that come from this host running out of a resource (descriptors, buffers,
/// memory) rather than from the server: they must not count toward a server's `fall`.
pub fn is_local_exhaustion(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}
