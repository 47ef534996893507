//! Node-wide kill (`kill_scope = "node"`): destroy every TCP socket in lb's network namespace
//! whose peer is a failed server, whichever process owns it, through netlink sock_diag
//! `SOCK_DESTROY` (what `ss -K` does). The owner sees `ECONNABORTED` and the peer gets a RST.
//! lb's own connections are ended by the balancer's registry first; this reaches the rest, e.g.
//! an apiserver talking to etcd directly.
//!
//! Minimum kernel: 4.5 with `CONFIG_INET_DIAG_DESTROY`; needs `CAP_NET_ADMIN`.

use std::{
    net::{IpAddr, SocketAddr, ToSocketAddrs as _},
    os::fd::{AsRawFd as _, OwnedFd},
    sync::atomic::{AtomicBool, AtomicU32, Ordering},
    time::Duration,
};

use nix::{
    errno::Errno,
    sys::{
        socket::{
            AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, recv, sendto,
            setsockopt, socket, sockopt,
        },
        time::TimeVal,
    },
};
use tracing::{info, warn};

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const IPPROTO_TCP: u8 = 6;
/// `struct nlmsghdr`.
const NLMSG_HDR_LEN: usize = 16;
/// `struct inet_diag_sockid`: sport, dport (big endian), src[16], dst[16], if, cookie[2].
const SOCKID_LEN: usize = 48;
/// `struct inet_diag_req_v2`: family, protocol, ext, pad, states, sockid.
const REQ_LEN: usize = 8 + SOCKID_LEN;
/// `struct inet_diag_msg`: family, state, timer, retrans, sockid, then five u32.
const DIAG_MSG_LEN: usize = 4 + SOCKID_LEN + 20;
/// TCP states a live connection can be in (LISTEN, TIME_WAIT and CLOSE left out).
const LIVE_STATES: u32 = (1 << 1) // ESTABLISHED
    | (1 << 2) // SYN_SENT
    | (1 << 3) // SYN_RECV
    | (1 << 4) // FIN_WAIT1
    | (1 << 5) // FIN_WAIT2
    | (1 << 8) // CLOSE_WAIT
    | (1 << 9) // LAST_ACK
    | (1 << 11); // CLOSING
/// Bound on one netlink reply wait.
const RECV_TIMEOUT: Duration = Duration::from_secs(2);
/// Bound on the sockets one dump may return.
const MAX_SOCKETS: usize = 1_000_000;

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
    /// A reply that does not parse as netlink.
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
}

/// Destroy every TCP socket in this network namespace whose peer is `peer` (an IPv4 peer also
/// matches dual-stack IPv6 sockets connected to its mapped address). Blocking: call it from a
/// blocking thread.
///
/// # Errors
/// [`KillError::Unsupported`] when the kernel has no `SOCK_DESTROY`; other [`KillError`]s for
/// netlink failures. Sockets destroyed before an error stay destroyed.
pub fn destroy_peer_sockets(peer: SocketAddr) -> Result<NodeKill, KillError> {
    let nl = Netlink::open()?;
    let mut targets = Vec::new();
    match peer.ip() {
        IpAddr::V4(v4) => {
            nl.dump(libc::AF_INET as u8, peer.port(), &v4.octets(), &mut targets)?;
            nl.dump(
                libc::AF_INET6 as u8,
                peer.port(),
                &v4.to_ipv6_mapped().octets(),
                &mut targets,
            )?;
        }
        IpAddr::V6(v6) => nl.dump(
            libc::AF_INET6 as u8,
            peer.port(),
            &v6.octets(),
            &mut targets,
        )?,
    }
    let mut done = NodeKill {
        found: targets.len(),
        destroyed: 0,
    };
    let mut first_error = None;
    for (family, id) in &targets {
        match nl.destroy(*family, id) {
            Ok(()) => done.destroyed += 1,
            // Closed on its own between the dump and now.
            Err(KillError::Destroy(Errno::ENOENT)) => {}
            Err(KillError::Destroy(Errno::EOPNOTSUPP)) => return Err(KillError::Unsupported),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) if done.destroyed == 0 => Err(e),
        _ => Ok(done),
    }
}

/// The hook the balancer calls when a server's connections are killed with
/// `kill_scope = "node"`: resolves the server and destroys its sockets on a blocking thread,
/// so the caller (the health loop) never waits on netlink.
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

static NEXT_SEQ: AtomicU32 = AtomicU32::new(1);

/// A NETLINK_SOCK_DIAG socket.
struct Netlink {
    fd: OwnedFd,
}

impl Netlink {
    fn open() -> Result<Netlink, KillError> {
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkSockDiag,
        )
        .map_err(KillError::Socket)?;
        let tv = TimeVal::new(i64::try_from(RECV_TIMEOUT.as_secs()).unwrap_or(2), 0);
        setsockopt(&fd, sockopt::ReceiveTimeout, &tv).map_err(KillError::Socket)?;
        Ok(Netlink { fd })
    }

    fn send(
        &self,
        msg_type: u16,
        flags: u16,
        family: u8,
        states: u32,
        id: &[u8; SOCKID_LEN],
    ) -> Result<u32, Errno> {
        let seq = NEXT_SEQ.fetch_add(1, Ordering::Relaxed);
        let mut buf = Vec::with_capacity(NLMSG_HDR_LEN + REQ_LEN);
        buf.extend_from_slice(
            &u32::try_from(NLMSG_HDR_LEN + REQ_LEN)
                .unwrap_or(72)
                .to_ne_bytes(),
        );
        buf.extend_from_slice(&msg_type.to_ne_bytes());
        buf.extend_from_slice(&flags.to_ne_bytes());
        buf.extend_from_slice(&seq.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes());
        buf.extend_from_slice(&[family, IPPROTO_TCP, 0, 0]);
        buf.extend_from_slice(&states.to_ne_bytes());
        buf.extend_from_slice(id);
        sendto(
            self.fd.as_raw_fd(),
            &buf,
            &NetlinkAddr::new(0, 0),
            MsgFlags::empty(),
        )?;
        Ok(seq)
    }

    /// Receive replies to `seq`, calling `each(type, payload)` until `DONE` or an error
    /// message; an error message with errno 0 (an ACK) ends the wait successfully.
    fn receive(&self, seq: u32, mut each: impl FnMut(u16, &[u8])) -> Result<(), Errno> {
        let mut buf = vec![0u8; 64 * 1024];
        let mut seen = 0usize;
        loop {
            let n = recv(self.fd.as_raw_fd(), &mut buf, MsgFlags::empty())?;
            if n == 0 {
                return Err(Errno::EPROTO);
            }
            let mut off = 0;
            while off + NLMSG_HDR_LEN <= n {
                let len = read_u32(&buf, off) as usize;
                let ty = read_u16(&buf, off + 4);
                let msg_seq = read_u32(&buf, off + 8);
                if len < NLMSG_HDR_LEN || off + len > n {
                    return Err(Errno::EPROTO);
                }
                let payload = &buf[off + NLMSG_HDR_LEN..off + len];
                off += (len + 3) & !3;
                if msg_seq != seq {
                    continue;
                }
                match ty {
                    NLMSG_DONE => return Ok(()),
                    NLMSG_ERROR => {
                        if payload.len() < 4 {
                            return Err(Errno::EPROTO);
                        }
                        let code = i32::from_ne_bytes(payload[..4].try_into().expect("4 bytes"));
                        return if code == 0 {
                            Ok(())
                        } else {
                            Err(Errno::from_raw(-code))
                        };
                    }
                    _ => {
                        seen += 1;
                        if seen > MAX_SOCKETS {
                            return Err(Errno::E2BIG);
                        }
                        each(ty, payload);
                    }
                }
            }
        }
    }

    /// Append the ids of live TCP sockets of `family` whose peer is `ip`:`port`.
    fn dump(
        &self,
        family: u8,
        port: u16,
        ip: &[u8],
        out: &mut Vec<(u8, [u8; SOCKID_LEN])>,
    ) -> Result<(), KillError> {
        let seq = self
            .send(
                SOCK_DIAG_BY_FAMILY,
                NLM_F_REQUEST | NLM_F_DUMP,
                family,
                LIVE_STATES,
                &[0; SOCKID_LEN],
            )
            .map_err(KillError::Dump)?;
        let mut malformed = false;
        self.receive(seq, |ty, msg| {
            if ty != SOCK_DIAG_BY_FAMILY {
                return;
            }
            if msg.len() < DIAG_MSG_LEN {
                malformed = true;
                return;
            }
            let id: [u8; SOCKID_LEN] = msg[4..4 + SOCKID_LEN].try_into().expect("48 bytes");
            let dport = u16::from_be_bytes([id[2], id[3]]);
            if msg[0] == family && dport == port && id[20..20 + ip.len()] == *ip {
                out.push((family, id));
            }
        })
        .map_err(KillError::Dump)?;
        if malformed {
            return Err(KillError::Malformed);
        }
        Ok(())
    }

    /// Destroy the socket `id` of `family`.
    fn destroy(&self, family: u8, id: &[u8; SOCKID_LEN]) -> Result<(), KillError> {
        let seq = self
            .send(
                SOCK_DESTROY,
                NLM_F_REQUEST | NLM_F_ACK,
                family,
                u32::MAX,
                id,
            )
            .map_err(KillError::Destroy)?;
        self.receive(seq, |_, _| {}).map_err(KillError::Destroy)
    }
}

fn read_u32(buf: &[u8], off: usize) -> u32 {
    u32::from_ne_bytes(buf[off..off + 4].try_into().expect("4 bytes"))
}

fn read_u16(buf: &[u8], off: usize) -> u16 {
    u16::from_ne_bytes(buf[off..off + 2].try_into().expect("2 bytes"))
}
