//! Node-wide kill (`kill_scope = "node"`): destroy every TCP socket in lb's network namespace
//! whose peer is a failed server, whichever process owns it, through netlink sock_diag
//! `SOCK_DESTROY` (what `ss -K` does). The owner sees `ECONNABORTED` and the peer gets a RST.
//! lb's own connections are ended by the balancer's registry first; this reaches the rest, e.g.
//! an apiserver talking to etcd directly.
//!
//! The messages are `netlink-packet-sock-diag`'s: a `SOCK_DIAG_BY_FAMILY` dump of live TCP
//! sockets per family, then one `SOCK_DESTROY` (its `SockDiagDestroy`, message type 21) per
//! match, carrying the `inet_diag_req_v2` with the socket id the dump returned; they travel on a
//! `netlink-sys` socket.
//!
//! Minimum kernel: 4.5 with `CONFIG_INET_DIAG_DESTROY`; needs `CAP_NET_ADMIN`.

use std::{
    net::{IpAddr, SocketAddr, ToSocketAddrs as _},
    sync::atomic::{AtomicBool, Ordering},
};

use netlink_packet_sock_diag::inet::{SocketId, StateFlags};
use nix::errno::Errno;
use tracing::{info, warn};

mod wire;

use wire::Target;

use crate::{netns, sock_diag::Netlink};

/// TCP states a live connection can be in (LISTEN, TIME_WAIT and CLOSE left out).
const LIVE_STATES: StateFlags = StateFlags::ESTABLISHED
    .union(StateFlags::SYN_SENT)
    .union(StateFlags::SYN_RECV)
    .union(StateFlags::FIN_WAIT1)
    .union(StateFlags::FIN_WAIT2)
    .union(StateFlags::CLOSE_WAIT)
    .union(StateFlags::LAST_ACK)
    .union(StateFlags::CLOSING);

/// Errors of a node-wide kill.
#[derive(Debug, thiserror::Error)]
pub enum KillError {
    /// The netlink socket could not be opened or set up.
    #[error("netlink sock_diag socket: {0}")]
    Socket(#[source] Errno),
    /// Sending, receiving or the kernel's answer to the socket dump failed.
    #[error("sock_diag dump: {0}")]
    Dump(#[source] Errno),
    /// The kernel refuses `SOCK_DESTROY` (built without `CONFIG_INET_DIAG_DESTROY`).
    #[error("the kernel refuses SOCK_DESTROY (needs CONFIG_INET_DIAG_DESTROY)")]
    Unsupported,
    /// `SOCK_DESTROY` failed for another reason (`EPERM` without `CAP_NET_ADMIN`).
    #[error("SOCK_DESTROY: {0}")]
    Destroy(#[source] Errno),
    /// A dump reply whose payload does not decode as an `inet_diag_msg`.
    #[error("malformed netlink reply")]
    Malformed,
}

/// What one node-wide kill did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeKill {
    /// Sockets whose peer was the server.
    pub found: usize,
    /// Of those, destroyed (the rest closed on their own meanwhile).
    pub destroyed: usize,
    /// Connect-time sockets whose process's network namespace lb could not open or enter,
    /// each process logged with its id (see [`destroy_connect_sockets`]).
    pub netns_failures: usize,
}

/// Destroy every TCP socket in this network namespace whose peer is `peer` (an IPv4 peer also
/// matches dual-stack IPv6 sockets connected to its mapped address). Blocking: call it from a
/// blocking thread.
///
/// # Errors
/// [`KillError::Unsupported`] when the kernel has no `SOCK_DESTROY`; other [`KillError`]s for
/// netlink failures. Sockets destroyed before an error stay destroyed.
pub fn destroy_peer_sockets(peer: SocketAddr) -> Result<NodeKill, KillError> {
    destroy_matching(peer, LIVE_STATES, |_| true)
}

/// Destroy the TCP sockets in this network namespace whose peer is `peer` and whose cookie
/// `wanted` selects (an IPv4 peer also matches dual-stack IPv6 sockets connected to its mapped
/// address). Blocking, as [`destroy_peer_sockets`].
///
/// # Errors
/// As [`destroy_peer_sockets`].
pub fn destroy_peer_sockets_by_cookie(
    peer: SocketAddr,
    wanted: impl Fn(u64) -> bool,
) -> Result<NodeKill, KillError> {
    destroy_matching(peer, LIVE_STATES, |id| wanted(cookie_of(id)))
}

/// A connect-time socket to end, as lb's programs recorded it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectSocket {
    /// Its socket cookie.
    pub cookie: u64,
    /// The process (tgid) that called `connect()`: the socket lives in that process's
    /// network namespace (`/proc/<tgid>/ns/net`).
    pub tgid: u32,
    /// (its own address, its peer) as the kernel holds them, once its SYN was sent; `None`
    /// before, when only a dump of the namespace's sockets can find it.
    pub sent: Option<(SocketAddr, SocketAddr)>,
}

/// Destroy the connect-time sockets `sockets` to `peer` (sent there by lb's programs; other
/// sockets to it are left alone), in each one's network namespace, entered with `setns` on a
/// short-lived thread (the sockets of a process whose namespace cannot be opened are looked for
/// in lb's own). A socket whose addresses are known is named by them and its cookie, 64
/// requests per `sendmsg`, with no dump; the others are found by a dump of the sockets to
/// `peer`. Blocking, as [`destroy_peer_sockets`].
///
/// # Errors
/// As [`destroy_peer_sockets`]; the first error is returned only when nothing was destroyed. A
/// process whose network namespace cannot be opened or entered is no error: it is logged with
/// its id and its sockets counted in [`NodeKill::netns_failures`].
pub fn destroy_connect_sockets(
    peer: SocketAddr,
    sockets: &[ConnectSocket],
) -> Result<NodeKill, KillError> {
    in_each_netns(sockets, |group| {
        let mut targets = Vec::with_capacity(group.len());
        let mut unsent = std::collections::HashSet::new();
        for s in group {
            match s.sent {
                Some((local, to)) => targets.push(target(local, to, cookie_bytes(s.cookie))),
                None => {
                    unsent.insert(s.cookie);
                }
            }
        }
        let mut done = destroy_all(&Netlink::open().map_err(KillError::Socket)?, targets)?;
        if !unsent.is_empty() {
            let k = destroy_matching(peer, LIVE_STATES, |id| unsent.contains(&cookie_of(id)))?;
            done.found += k.found;
            done.destroyed += k.destroyed;
        }
        Ok(done)
    })
}

/// As [`destroy_connect_sockets`], for the sockets still in `SYN_SENT` only (found by a dump,
/// which gives each one's state): connects that have not reached the server, aborted without
/// touching its established connections.
///
/// # Errors
/// As [`destroy_connect_sockets`].
pub fn destroy_connecting(
    peer: SocketAddr,
    sockets: &[ConnectSocket],
) -> Result<NodeKill, KillError> {
    in_each_netns(sockets, |group| {
        let cookies: std::collections::HashSet<u64> = group.iter().map(|s| s.cookie).collect();
        destroy_matching(peer, StateFlags::SYN_SENT, |id| {
            cookies.contains(&cookie_of(id))
        })
    })
}

/// One of lb's own accepted sockets: its addresses and its socket cookie, which
/// [`destroy_own_sockets`] sends along so that no other socket can be taken for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OwnSocket {
    /// The socket's own address (lb's listener address).
    pub local: SocketAddr,
    /// The client's address.
    pub peer: SocketAddr,
    /// The socket's cookie (`SO_COOKIE`).
    pub cookie: u64,
}

impl OwnSocket {
    /// lb's accepted socket `sock`, at `local`, whose client is `peer`.
    ///
    /// # Errors
    /// `getsockopt(SO_COOKIE)` failing (kernel 4.12+).
    pub fn of(
        sock: impl std::os::fd::AsFd,
        local: SocketAddr,
        peer: SocketAddr,
    ) -> std::io::Result<Self> {
        let cookie = rustix::net::sockopt::socket_cookie(sock)?;
        Ok(OwnSocket {
            local,
            peer,
            cookie,
        })
    }
}

/// `SOCK_DESTROY` requests sent in one `sendmsg` (each acknowledged; 64 acknowledgements fit
/// the netlink socket's default receive buffer).
const DESTROY_BATCH: usize = 64;

/// Destroy lb's own accepted sockets `sockets` (in lb's network namespace), each named by its
/// addresses and its cookie, in batches of 64 requests per `sendmsg`: the kernel resets every
/// client at once instead of waiting for each connection's task to run. A socket that closed
/// meanwhile is skipped. Blocking (about 10 µs per socket here).
///
/// The cookie is what keeps the listener alive: the kernel finds the socket to destroy as it
/// finds the socket for an arriving segment (`inet_diag_find_one_icsk` calls `inet_lookup`),
/// the established table first and then the listeners. A socket the client already reset is in
/// neither table, so a request by addresses alone found lb's listener on the same local address
/// and aborted it (`accept` then failed with `EINVAL` for good: the churn soak found it after a
/// kill of 8,847 connections). With the cookie the kernel answers `ESTALE` instead.
///
/// # Errors
/// As [`destroy_peer_sockets`]; sockets destroyed before an error stay destroyed.
pub fn destroy_own_sockets(sockets: &[OwnSocket]) -> Result<NodeKill, KillError> {
    let targets = sockets
        .iter()
        .map(|s| target(s.local, s.peer, cookie_bytes(s.cookie)))
        .collect();
    destroy_all(&Netlink::open().map_err(KillError::Socket)?, targets)
}

/// Destroy `targets`, 64 requests per `sendmsg`, each acknowledged; a socket that closed
/// meanwhile is skipped: `ENOENT` when no socket has its addresses or another socket has them
/// now (its cookie differs: TCP's `inet_diag_find_one_icsk` answers `ENOENT` for that too), and
/// `ESTALE`, what `sock_diag_check_cookie` itself returns on a mismatch, in case a kernel passes
/// it on.
///
/// # Errors
/// [`KillError::Unsupported`] at the first refusal; the first other error only when nothing
/// was destroyed.
fn destroy_all(nl: &Netlink, targets: Vec<Target>) -> Result<NodeKill, KillError> {
    let mut done = NodeKill {
        found: targets.len(),
        ..NodeKill::default()
    };
    let mut first_error = None;
    let mut targets = targets.into_iter().peekable();
    while targets.peek().is_some() {
        let batch: Vec<Target> = targets.by_ref().take(DESTROY_BATCH).collect();
        let n = batch.len();
        let first = nl.send_batch(batch).map_err(KillError::Destroy)?;
        let mut unsupported = false;
        nl.receive_acks(first, n, |r| match r {
            Ok(()) => done.destroyed += 1,
            Err(Errno::ENOENT | Errno::ESTALE) => {}
            Err(Errno::EOPNOTSUPP) => unsupported = true,
            Err(e) => {
                first_error.get_or_insert(KillError::Destroy(e));
            }
        })
        .map_err(KillError::Destroy)?;
        if unsupported {
            return Err(KillError::Unsupported);
        }
    }
    match first_error {
        Some(e) if done.destroyed == 0 => Err(e),
        _ => Ok(done),
    }
}

/// The socket id of the socket `local` → `peer` with cookie bytes `cookie` (the kernel
/// compares them with the socket's own and answers `ESTALE` on a mismatch).
fn target(local: SocketAddr, peer: SocketAddr, cookie: [u8; 8]) -> Target {
    let family = if local.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    } as u8;
    Target {
        family,
        id: SocketId {
            source_port: local.port(),
            destination_port: peer.port(),
            source_address: local.ip(),
            destination_address: peer.ip(),
            interface_id: 0,
            cookie,
        },
    }
}

/// Run `f` once per network namespace holding some of `sockets`, with those sockets: in lb's
/// own namespace directly, in another from a thread that joined it (grouped by
/// [`netns::group_by_netns`], which says what happens to a process whose namespace cannot be
/// opened). A namespace that cannot be entered is skipped; either failure is logged with the
/// process id and counted in [`NodeKill::netns_failures`].
///
/// # Errors
/// [`KillError::Unsupported`] at once; otherwise the first error, only when nothing was
/// destroyed.
fn in_each_netns(
    sockets: &[ConnectSocket],
    f: impl Fn(&[&ConnectSocket]) -> Result<NodeKill, KillError> + Sync,
) -> Result<NodeKill, KillError> {
    let netns::Grouped {
        groups,
        mut failures,
    } = netns::group_by_netns(sockets, |s| s.tgid);
    let mut done = NodeKill::default();
    let mut first_error = None;
    for (at, group) in groups {
        let r = match &at {
            netns::Where::Own | netns::Where::OwnFallback => f(&group),
            netns::Where::Foreign { tgid, ns } => match netns::run_in_netns(ns, || f(&group)) {
                Ok(r) => r,
                Err(error) => {
                    failures.push(netns::Failure::enter(*tgid, error, group.len()));
                    continue;
                }
            },
        };
        match r {
            Ok(k) => {
                if matches!(at, netns::Where::OwnFallback) {
                    info!(
                        found = k.found,
                        destroyed = k.destroyed,
                        "connect-time kill: sockets of processes whose network namespace could not be opened, looked for in lb's own"
                    );
                }
                done.found += k.found;
                done.destroyed += k.destroyed;
            }
            Err(KillError::Unsupported) => return Err(KillError::Unsupported),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    done.netns_failures = netns::report(&failures);
    match first_error {
        Some(e) if done.destroyed == 0 => Err(e),
        _ => Ok(done),
    }
}

/// The socket cookie of a dumped socket: `inet_diag_sockid.idiag_cookie` is two `u32`s in host
/// order, low word first.
fn cookie_of(id: &SocketId) -> u64 {
    let c = id.cookie;
    let lo = u32::from_ne_bytes([c[0], c[1], c[2], c[3]]);
    let hi = u32::from_ne_bytes([c[4], c[5], c[6], c[7]]);
    u64::from(hi) << 32 | u64::from(lo)
}

/// The inverse of [`cookie_of`].
fn cookie_bytes(cookie: u64) -> [u8; 8] {
    let mut c = [0; 8];
    c[..4].copy_from_slice(&(cookie as u32).to_ne_bytes());
    c[4..].copy_from_slice(&((cookie >> 32) as u32).to_ne_bytes());
    c
}

fn destroy_matching(
    peer: SocketAddr,
    states: StateFlags,
    keep: impl Fn(&SocketId) -> bool,
) -> Result<NodeKill, KillError> {
    let nl = Netlink::open().map_err(KillError::Socket)?;
    let mut targets = Vec::new();
    match peer.ip() {
        IpAddr::V4(v4) => {
            nl.dump(peer, states.clone(), &mut targets)?;
            let mapped = SocketAddr::new(IpAddr::V6(v4.to_ipv6_mapped()), peer.port());
            nl.dump(mapped, states, &mut targets)?;
        }
        IpAddr::V6(_) => nl.dump(peer, states, &mut targets)?,
    }
    targets.retain(|t| keep(&t.id));
    destroy_all(&nl, targets)
}

/// Destroy every socket to `server` (`host:port`, resolved to every address) on a blocking
/// thread, so the caller (the health loop, with `kill_scope = "node"`) never waits on DNS or
/// netlink. Uses the tokio runtime's blocking pool when called inside one, a new thread
/// otherwise. Outcomes are logged; the kernel refusing `SOCK_DESTROY` is logged once.
pub fn spawn_node_kill(server: String) {
    let work = move || kill_node(&server);
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => drop(rt.spawn_blocking(work)),
        Err(_) => drop(std::thread::spawn(work)),
    }
}

/// Set once the kernel refused `SOCK_DESTROY`, so it is logged once.
static UNSUPPORTED_LOGGED: AtomicBool = AtomicBool::new(false);

fn kill_node(server: &str) {
    let addrs: Vec<SocketAddr> = match server.to_socket_addrs() {
        Ok(a) => a.collect(),
        Err(e) => {
            warn!(server, error = %e, "node-wide kill: cannot resolve the server");
            return;
        }
    };
    for addr in addrs {
        match destroy_peer_sockets(addr) {
            Ok(k) => {
                info!(server, peer = %addr, found = k.found, destroyed = k.destroyed, "node-wide kill: destroyed sockets to the failed server");
            }
            Err(KillError::Unsupported) => {
                if !UNSUPPORTED_LOGGED.swap(true, Ordering::Relaxed) {
                    warn!(
                        server,
                        "node-wide kill unavailable: the kernel refuses SOCK_DESTROY (CONFIG_INET_DIAG_DESTROY); only lb's own connections are killed"
                    );
                }
                return;
            }
            Err(e) => warn!(server, peer = %addr, error = %e, "node-wide kill failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kill of an accepted socket its client already reset reaches neither that socket (it is
    /// gone from the kernel's tables) nor the listener on the same local address, and the
    /// listener keeps accepting. Needs `CAP_NET_ADMIN` for `SOCK_DESTROY`.
    #[test]
    fn destroying_a_reset_accepted_socket_leaves_its_listener() {
        use std::{
            io::{ErrorKind, Read as _},
            net::{TcpListener, TcpStream},
            time::Duration,
        };
        if !nix::unistd::geteuid().is_root() {
            println!(
                "SKIP destroying_a_reset_accepted_socket_leaves_its_listener: SOCK_DESTROY needs CAP_NET_ADMIN"
            );
            return;
        }
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let client = TcpStream::connect(addr).unwrap();
        let (mut accepted, peer) = listener.accept().unwrap();
        let own = OwnSocket::of(&accepted, addr, peer).unwrap();
        socket2::SockRef::from(&client)
            .set_linger(Some(Duration::ZERO))
            .unwrap();
        drop(client);
        accepted
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let err = accepted.read(&mut [0; 1]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ConnectionReset, "{err}");

        let done = destroy_own_sockets(&[own]).unwrap();
        assert_eq!(done.destroyed, 0, "{done:?}");
        let next = TcpStream::connect(addr).unwrap();
        let (_, next_peer) = listener.accept().expect("the listener survives the kill");
        assert_eq!(next_peer, next.local_addr().unwrap());
    }

    #[test]
    fn live_states_leave_out_listen_time_wait_and_close() {
        assert_eq!(
            LIVE_STATES.bits(),
            (1 << 1) | (1 << 2) | (1 << 3) | (1 << 4) | (1 << 5) | (1 << 8) | (1 << 9) | (1 << 11)
        );
    }
}
