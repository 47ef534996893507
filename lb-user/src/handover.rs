//! The hand-over between a running lb and the lb that replaces it (`lb upgrade`, `SIGUSR2`):
//! the versioned messages, their framing over a unix stream socket with descriptors passed by
//! `SCM_RIGHTS`, and the descriptors a process inherited or must be able to give away (its
//! listening sockets). The procedure itself lives in `daemon::upgrade` (old process) and
//! `cli::takeover` (new process).
//!
//! One frame is a 12-byte header (JSON length, raw length, descriptor count, each a
//! little-endian `u32`) sent with its descriptors in one `sendmsg`, then the JSON message, then
//! the raw bytes (unwritten connection buffers). At most [`MAX_FDS_PER_FRAME`] descriptors go
//! in one frame (the kernel's `SCM_MAX_FD` is 253).

use std::{
    collections::HashMap,
    io::{self, IoSlice, IoSliceMut, Read as _, Write as _},
    net::SocketAddr,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd as _, OwnedFd, RawFd},
        unix::net::UnixStream,
    },
    path::PathBuf,
    sync::Mutex,
};

use serde::{Deserialize, Serialize};

use crate::server_state::{Hold, ServerState};

/// The hand-over protocol version. A process refuses a hand-over from another version, and the
/// old process keeps serving. Bump it whenever a message, the meaning of a field, or the kernel
/// map contract (`lb-common`) changes: the new process adopts the old one's maps and programs.
///
/// Version 2: [`Hello::balancer_ids`], [`Hello::retired_balancer_ids`], [`Message::Stopped`];
/// the splice map layout in which `FlowState` and `PairCtl` carry the client socket's cookie;
/// `ConnectEvent` carrying the socket's error (48 bytes); the `lb_connect_release` program's
/// link handed over; `LB_CONNECT_TABLES` as an array of table slots with the generation current
/// per balancer in `LB_CONNECT_CURRENT` (handed over too; the new lb goes on from it).
///
/// Version 3: connect-time's own sockops program (`lb_connect_sockops`, its link handed over)
/// and maps (`LB_CONNECT_SCOPE`, `LB_CONNECT_STATS`, `LB_CONNECT_CTL` with lb's pid and
/// heartbeat); `lb_sockops` no longer counts connect-time sockets; the locked pin directory
/// travels as `pin-dir-lock` among the maps.
///
/// Version 4: [`ServerSnapshot::state`] and [`ServerSnapshot::hold`] as names (`"ACTIVE"`,
/// `"drain"`) instead of numbers; `BalancerStats` (in `LB_STATS` and `LB_CONNECT_STATS`) with
/// the sockops registration failures and the connects left unrewritten, by reason.
///
/// Version 5: `FlowState` (in `LB_FLOWS`) carries the address of the server socket a client's
/// sends were redirected to, from which the sk_msg program reads that socket's room.
pub const VERSION: u32 = 5;

/// Environment variable naming the (abstract) unix socket a new process takes over from.
pub const ENV_SOCKET: &str = "LB_UPGRADE_SOCKET";

/// Most descriptors in one frame.
pub const MAX_FDS_PER_FRAME: usize = 200;

/// Largest JSON part of a frame (bytes); a larger header is refused as corrupt.
const MAX_JSON: u32 = 64 << 20;
/// Largest raw part of a frame (bytes).
const MAX_RAW: u32 = 1 << 30;

/// Errors of the hand-over wire.
#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    /// The socket failed.
    #[error("hand-over socket: {0}")]
    Io(#[from] io::Error),
    /// A message could not be encoded or decoded.
    #[error("hand-over message: {0}")]
    Codec(#[from] serde_json::Error),
    /// The peer closed the socket.
    #[error("the other lb closed the hand-over socket")]
    Closed,
    /// A frame header out of bounds.
    #[error("corrupt hand-over frame ({0})")]
    Corrupt(String),
    /// Another message than the protocol expects now.
    #[error("unexpected hand-over message: {0}")]
    Unexpected(String),
}

/// What the old process offers first: everything the new one needs before it can serve.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Hello {
    /// [`VERSION`] of the old process.
    pub version: u32,
    /// The old process's pid.
    pub pid: u32,
    /// The old process's version string (`CARGO_PKG_VERSION`).
    pub lb_version: String,
    /// Listening sockets: address and index of its descriptor in this frame.
    pub listeners: Vec<(SocketAddr, usize)>,
    /// The admin API's TCP listener and its descriptor index.
    pub admin_tcp: Option<(SocketAddr, usize)>,
    /// The admin API's unix socket and its descriptor index.
    pub admin_unix: Option<(PathBuf, usize)>,
    /// The kernel data path, when the old process runs it.
    pub datapath: Option<DatapathOffer>,
    /// The forwarding each of the old process's balancers asked for (`splice`, `connect`), by
    /// balancer name: an upgrade cannot change it (the connect-time programs and tables belong
    /// to the running data path).
    pub forwarding: Vec<(String, String)>,
    /// Each of the old process's balancers' id, by name: the key of its entries in the kernel's
    /// maps (listeners, connect-time tables, counts and socket records, splice counters). The
    /// new process keeps them, whatever the order of its config, and gives a balancer the old
    /// process lacks an id none of them has. Absent from version 1 (so that its Hello still
    /// parses and is refused by its version).
    #[serde(default)]
    pub balancer_ids: Vec<(String, u32)>,
    /// Ids of balancers that earlier upgrades dropped: the new process never gives them again
    /// (their sockets may still be in the kernel's records), nor do its successors.
    #[serde(default)]
    pub retired_balancer_ids: Vec<u32>,
}

/// The kernel data path as handed over: maps and cgroup links by descriptor.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DatapathOffer {
    /// Map name (`lb_common::MAP_*`) and descriptor index.
    pub maps: Vec<(String, usize)>,
    /// Program name (`lb_common::PROG_*`) and the descriptor index of its cgroup link.
    pub links: Vec<(String, usize)>,
    /// The cgroup the programs are attached to.
    pub cgroup: PathBuf,
    /// Why the connect-time programs are not attached (`None`: they are).
    pub connect_missing: Option<String>,
}

/// One server of a balancer as the old process knew it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ServerSnapshot {
    /// The server (`ServerAddr`'s text form).
    pub address: String,
    /// Its state, by K3s's name (`"ACTIVE"`, `"FAILED"`, ...).
    pub state: ServerState,
    /// The operator's hold on it (`"none"`, `"drain"`, `"disabled"`).
    pub hold: Hold,
    /// Consecutive failed checks.
    pub consecutive_failures: u32,
    /// Consecutive passed checks.
    pub consecutive_successes: u32,
    /// Resets by the server since its last passing check.
    pub passive_resets: u32,
    /// Last check, seconds since the Unix epoch.
    pub last_check: Option<f64>,
    /// Age of the last check (milliseconds), for the scheduler.
    pub last_check_age_ms: Option<u64>,
    /// Last error.
    pub last_error: Option<String>,
    /// How long it has been PREFERRED (milliseconds).
    pub preferred_for_ms: Option<u64>,
    /// Whether it went FAILED (a recovery fails back).
    pub has_failed: bool,
    /// Time left of a drain (milliseconds).
    pub drain_left_ms: Option<u64>,
}

/// One balancer's state and the counters that must not reset.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BalancerSnapshot {
    /// Balancer name.
    pub name: String,
    /// Its servers.
    pub servers: Vec<ServerSnapshot>,
    /// `lb_connections_total`.
    pub connections_total: u64,
    /// `lb_copied_bytes_total` client→server.
    pub copied_up: u64,
    /// `lb_copied_bytes_total` server→client.
    pub copied_down: u64,
    /// `lb_connections_killed_total`: server, reason, count.
    pub killed: Vec<(String, String, u64)>,
    /// `lb_health_checks_total`: server, result, count.
    #[serde(default)]
    pub checks: Vec<(String, String, u64)>,
}

/// One direction of a connection at the moment it was frozen.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct DirSnapshot {
    /// Bytes fully written to the destination before the chunk in flight.
    pub written: u64,
    /// Length of the chunk in flight (bytes; 0 when none): read from the source, partly written.
    pub chunk: u64,
    /// How many of the chunk's bytes are still unwritten; they follow in the frame's raw part.
    pub unwritten: u64,
}

/// One client connection handed over.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ConnSnapshot {
    /// Balancer name.
    pub balancer: String,
    /// The client's address.
    pub peer: SocketAddr,
    /// Descriptor index of the accepted client socket.
    pub client_fd: usize,
    /// The server and the descriptor index of its socket; `None` when the dial had not
    /// finished (the new process dials again; the client has received nothing yet).
    pub server: Option<(String, usize)>,
    /// Client→server.
    pub up: DirSnapshot,
    /// Server→client.
    pub down: DirSnapshot,
    /// Whether the kernel spliced it (its server socket stays in the sockhash).
    pub spliced: bool,
}

/// A message of the hand-over.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Message {
    /// old → new: the listeners and the kernel data path.
    Hello(Box<Hello>),
    /// new → old: ready to take the connections (it serves nothing yet).
    Ready {
        /// The new process's version string.
        lb_version: String,
    },
    /// new → old: refused; the old process keeps serving.
    Refused {
        /// Why, for the operator.
        reason: String,
    },
    /// old → new: a batch of connections (the frame's descriptors and raw bytes).
    Conns {
        /// The connections.
        conns: Vec<ConnSnapshot>,
    },
    /// old → new: the balancers' states and counters; the last message of the old process.
    State {
        /// Every balancer.
        balancers: Vec<BalancerSnapshot>,
        /// Whether the first round of checks had finished.
        first_checks_done: bool,
    },
    /// new → old: everything taken; the old process stops its background work and exits.
    Done {
        /// Connections adopted.
        conns: usize,
    },
    /// old → new, the last message: after Done the old process stopped every task that
    /// changes balancers or writes the kernel's maps (health checks, discovery, connect-time
    /// table sync) and every reader of the kernel's rings; the new process may start its own.
    Stopped,
}

impl Message {
    fn kind(&self) -> &'static str {
        match self {
            Message::Hello(_) => "hello",
            Message::Ready { .. } => "ready",
            Message::Refused { .. } => "refused",
            Message::Conns { .. } => "conns",
            Message::State { .. } => "state",
            Message::Done { .. } => "done",
            Message::Stopped => "stopped",
        }
    }

    /// [`HandoverError::Unexpected`] naming this message.
    pub fn unexpected(&self) -> HandoverError {
        HandoverError::Unexpected(self.kind().into())
    }
}

/// A received frame.
#[derive(Debug)]
pub struct Frame {
    /// The message.
    pub message: Message,
    /// Its descriptors, in the order sent.
    pub fds: Vec<OwnedFd>,
    /// Its raw bytes.
    pub raw: Vec<u8>,
}

/// Send one frame.
///
/// # Errors
/// [`HandoverError`]; more than [`MAX_FDS_PER_FRAME`] descriptors is a programming error
/// reported as [`HandoverError::Corrupt`].
pub fn send(
    sock: &UnixStream,
    message: &Message,
    fds: &[BorrowedFd<'_>],
    raw: &[u8],
) -> Result<(), HandoverError> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    if fds.len() > MAX_FDS_PER_FRAME {
        return Err(HandoverError::Corrupt(format!("{} descriptors", fds.len())));
    }
    let json = serde_json::to_vec(message)?;
    let len = |n: usize| u32::try_from(n).map_err(|_| HandoverError::Corrupt(format!("{n} bytes")));
    let mut header = [0u8; 12];
    header[0..4].copy_from_slice(&len(json.len())?.to_le_bytes());
    header[4..8].copy_from_slice(&len(raw.len())?.to_le_bytes());
    header[8..12].copy_from_slice(&len(fds.len())?.to_le_bytes());
    let raw_fds: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let cmsg = [ControlMessage::ScmRights(&raw_fds)];
    let cmsgs: &[ControlMessage<'_>] = if raw_fds.is_empty() { &[] } else { &cmsg };
    let mut sent = 0;
    while sent < header.len() {
        let iov = [IoSlice::new(&header[sent..])];
        let c = if sent == 0 { cmsgs } else { &[] };
        sent += sendmsg::<()>(sock.as_raw_fd(), &iov, c, MsgFlags::MSG_NOSIGNAL, None)
            .map_err(io::Error::from)?;
    }
    let mut w = sock;
    w.write_all(&json)?;
    w.write_all(raw)?;
    Ok(())
}

/// Receive one frame.
///
/// # Errors
/// [`HandoverError`]: [`HandoverError::Closed`] at end of stream.
pub fn recv(sock: &UnixStream) -> Result<Frame, HandoverError> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    let mut header = [0u8; 12];
    let mut got = 0;
    let mut fds = Vec::new();
    while got < header.len() {
        let mut cmsg = nix::cmsg_space!([RawFd; MAX_FDS_PER_FRAME]);
        let mut iov = [IoSliceMut::new(&mut header[got..])];
        let msg = recvmsg::<()>(
            sock.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(io::Error::from)?;
        if msg.bytes == 0 {
            return Err(HandoverError::Closed);
        }
        for c in msg.cmsgs().map_err(io::Error::from)? {
            if let ControlMessageOwned::ScmRights(list) = c {
                fds.extend(list.into_iter().map(owned));
            }
        }
        got += msg.bytes;
    }
    let word =
        |i: usize| u32::from_le_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
    let (json_len, raw_len, nfds) = (word(0), word(4), word(8));
    if json_len > MAX_JSON || raw_len > MAX_RAW || nfds as usize != fds.len() {
        return Err(HandoverError::Corrupt(format!(
            "json {json_len} bytes, raw {raw_len} bytes, {nfds} descriptors announced, {} received",
            fds.len()
        )));
    }
    let json = read_part(sock, json_len)?;
    let raw = read_part(sock, raw_len)?;
    Ok(Frame {
        message: serde_json::from_slice(&json)?,
        fds,
        raw,
    })
}

/// The next `len` bytes of `sock`, in memory that grows with what arrives: a header announcing
/// more than the peer sends costs only what it sent, not `len` bytes up front.
///
/// # Errors
/// [`HandoverError::Closed`] when the stream ends first; [`HandoverError::Io`].
fn read_part(sock: &UnixStream, len: u32) -> Result<Vec<u8>, HandoverError> {
    let mut part = Vec::new();
    sock.take(u64::from(len)).read_to_end(&mut part)?;
    if part.len() < len as usize {
        return Err(HandoverError::Closed);
    }
    Ok(part)
}

/// Take ownership of a descriptor the kernel just installed in this process (`SCM_RIGHTS`).
fn owned(fd: RawFd) -> OwnedFd {
    #[expect(
        unsafe_code,
        reason = "descriptors received with SCM_RIGHTS arrive as raw numbers"
    )]
    // SAFETY: `fd` was installed in this process's table by the kernel for this `recvmsg`
    // (SCM_RIGHTS); nothing else knows of it, so this is its only owner.
    unsafe {
        OwnedFd::from_raw_fd(fd)
    }
}

/// A listening socket a process owns or inherited.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ListenerKey {
    /// A proxy listener.
    Proxy(SocketAddr),
    /// The admin API's TCP listener.
    AdminTcp(SocketAddr),
    /// The admin API's unix socket.
    AdminUnix(PathBuf),
}

/// Listening sockets of this process, by key: what it inherited (taken once, when it binds
/// that address) and a copy of what it bound (given to the next process).
#[derive(Default)]
struct Registry {
    inherited: HashMap<ListenerKey, OwnedFd>,
    own: HashMap<ListenerKey, OwnedFd>,
}

static LISTENERS: Mutex<Option<Registry>> = Mutex::new(None);

fn with_registry<T>(f: impl FnOnce(&mut Registry) -> T) -> T {
    let mut g = LISTENERS.lock().unwrap_or_else(|p| p.into_inner());
    f(g.get_or_insert_with(Registry::default))
}

/// Offer an inherited listening socket to whoever binds `key` in this process.
pub fn put_inherited(key: ListenerKey, fd: OwnedFd) {
    with_registry(|r| r.inherited.insert(key, fd));
}

/// The inherited listening socket for `key`, once.
pub fn take_inherited(key: &ListenerKey) -> Option<OwnedFd> {
    with_registry(|r| r.inherited.remove(key))
}

/// Close the inherited listening sockets nobody took (an admin address the new config no
/// longer names): otherwise they would accept connections nobody serves once the old process
/// is gone. Returns what was closed; a unix socket's file is the caller's to remove once the
/// hand-over is done (the old process serves it until then, and again if the hand-over fails).
pub fn close_unused_inherited() -> Vec<ListenerKey> {
    let left: Vec<(ListenerKey, OwnedFd)> = with_registry(|r| r.inherited.drain().collect());
    left.into_iter().map(|(key, _fd)| key).collect()
}

/// Keep a copy of a listening socket this process serves, to hand it over later.
///
/// # Errors
/// The descriptor could not be duplicated.
pub fn remember(key: ListenerKey, fd: BorrowedFd<'_>) -> io::Result<()> {
    let dup = fd.try_clone_to_owned()?;
    with_registry(|r| r.own.insert(key, dup));
    Ok(())
}

/// Close this process's copies of its proxy listeners (shutdown: once the accept loops stop,
/// the listening sockets must close, so new connects are refused rather than queued).
pub fn forget_proxy_listeners() {
    with_registry(|r| r.own.retain(|k, _| !matches!(k, ListenerKey::Proxy(_))));
}

/// Copies of every listening socket this process serves (for a hand-over or to serve them
/// again after a failed one).
///
/// # Errors
/// A descriptor could not be duplicated.
pub fn own_listeners() -> io::Result<Vec<(ListenerKey, OwnedFd)>> {
    with_registry(|r| {
        r.own
            .iter()
            .map(|(k, fd)| Ok((k.clone(), fd.as_fd().try_clone_to_owned()?)))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_carry_messages_descriptors_and_bytes() {
        let (a, b) = UnixStream::pair().unwrap();
        let (p, q) = UnixStream::pair().unwrap();
        let msg = Message::Refused {
            reason: "state version 9".into(),
        };
        send(&a, &msg, &[p.as_fd(), q.as_fd()], b"unwritten").unwrap();
        send(&a, &Message::Done { conns: 3 }, &[], b"").unwrap();
        let f = recv(&b).unwrap();
        assert!(
            matches!(f.message, Message::Refused { ref reason } if reason == "state version 9")
        );
        assert_eq!(f.fds.len(), 2);
        assert_eq!(f.raw, b"unwritten");
        // The received descriptor is the same socket: what goes in one end comes out of q.
        let mut p2 = UnixStream::from(f.fds.into_iter().next().unwrap());
        p2.write_all(b"x").unwrap();
        let mut one = [0u8; 1];
        (&q).read_exact(&mut one).unwrap();
        assert_eq!(&one, b"x");
        let f = recv(&b).unwrap();
        assert!(matches!(f.message, Message::Done { conns: 3 }));
        drop(a);
        assert!(matches!(recv(&b), Err(HandoverError::Closed)));
    }

    /// A version 1 Hello (no balancer ids) still parses, so the new process can refuse it by
    /// its version, naming both.
    #[test]
    fn version_1_hello_parses_for_its_refusal() {
        let v1 = r#"{"type":"hello","version":1,"pid":7,"lb_version":"0.1.0","listeners":[],
            "admin_tcp":null,"admin_unix":null,"datapath":null,"forwarding":[]}"#;
        let Message::Hello(h) = serde_json::from_str(v1).unwrap() else {
            panic!("not a Hello");
        };
        assert_eq!(h.version, 1);
        assert_ne!(h.version, VERSION);
        assert!(h.balancer_ids.is_empty());
    }

    #[test]
    fn corrupt_header_is_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut w = &a;
        w.write_all(&[0xff; 12]).unwrap();
        assert!(matches!(recv(&b), Err(HandoverError::Corrupt(_))));
    }
}
