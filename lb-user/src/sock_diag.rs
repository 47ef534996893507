//! A `NETLINK_SOCK_DIAG` socket and its request/reply loop (`netlink-packet-sock-diag`'s
//! messages on a `netlink-sys` socket), shared by the node-wide kill and the admin API's
//! lookup of who owns a loopback peer's socket.
//!
//! Minimum kernel: 4.1 (`SOCK_DIAG_BY_FAMILY` with `inet_diag_req_v2`).

use std::{
    net::SocketAddr,
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use netlink_packet_core::{
    NLM_F_REQUEST, NetlinkBuffer, NetlinkHeader, NetlinkMessage, NetlinkPayload,
    NetlinkSerializable,
};
use netlink_packet_sock_diag::{
    IPPROTO_TCP, SockDiagMessage,
    inet::{ExtensionFlags, InetRequest, SocketId, StateFlags},
};
use netlink_sys::{Socket, SocketAddr as NetlinkAddr, protocols::NETLINK_SOCK_DIAG};
use nix::{
    errno::Errno,
    sys::{
        socket::{setsockopt, sockopt},
        time::TimeVal,
    },
};

/// Bound on one netlink reply wait.
pub(crate) const RECV_TIMEOUT: Duration = Duration::from_secs(2);
/// Bound on the sockets one dump may return.
pub(crate) const MAX_SOCKETS: usize = 1_000_000;
/// Receive buffer for one batch of replies (bytes).
pub(crate) const RECV_BUFFER: usize = 64 * 1024;

pub(crate) static NEXT_SEQ: AtomicU32 = AtomicU32::new(1);

/// A `NETLINK_SOCK_DIAG` socket.
pub(crate) struct Netlink {
    pub(crate) socket: Socket,
}

/// One netlink message: header (`seq`, `flags`, type and length from `payload`) and payload.
pub(crate) fn encode<M: NetlinkSerializable>(seq: u32, flags: u16, payload: M) -> Vec<u8> {
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    header.sequence_number = seq;
    let mut msg = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(payload));
    msg.finalize();
    let mut buf = vec![0u8; msg.buffer_len()];
    msg.serialize(&mut buf);
    buf
}

/// An io error from the netlink socket as an errno.
pub(crate) fn errno(e: &std::io::Error) -> Errno {
    Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))
}

impl Netlink {
    /// Open one, with a [`RECV_TIMEOUT`] bound on every reply wait.
    ///
    /// # Errors
    /// The errno of `socket(2)` or `setsockopt(2)`.
    pub(crate) fn open() -> Result<Netlink, Errno> {
        let socket = Socket::new(NETLINK_SOCK_DIAG).map_err(|e| errno(&e))?;
        let tv = TimeVal::new(i64::try_from(RECV_TIMEOUT.as_secs()).unwrap_or(2), 0);
        setsockopt(&socket, sockopt::ReceiveTimeout, &tv)?;
        Ok(Netlink { socket })
    }

    /// Send `payload` with `flags` to the kernel; returns the sequence number.
    pub(crate) fn send<M: NetlinkSerializable>(
        &self,
        flags: u16,
        payload: M,
    ) -> Result<u32, Errno> {
        let seq = NEXT_SEQ.fetch_add(1, Ordering::Relaxed);
        self.socket
            .send_to(&encode(seq, flags, payload), &NetlinkAddr::new(0, 0), 0)
            .map_err(|e| errno(&e))?;
        Ok(seq)
    }

    /// Read replies, passing the payload of each message whose sequence number `wanted`
    /// accepts to `each` (`Err` when it does not decode), until `each` returns the outcome.
    pub(crate) fn read_replies(
        &self,
        wanted: impl Fn(u32) -> bool,
        mut each: impl FnMut(Result<NetlinkPayload<SockDiagMessage>, ()>) -> Option<Result<(), Errno>>,
    ) -> Result<(), Errno> {
        let mut buf = vec![0u8; RECV_BUFFER];
        loop {
            let n = self
                .socket
                .recv(&mut &mut buf[..], 0)
                .map_err(|e| errno(&e))?;
            if n == 0 || n > buf.len() {
                return Err(Errno::EPROTO);
            }
            let mut batch = &buf[..n];
            while !batch.is_empty() {
                // Checks the header and that its length fits in what arrived.
                let frame = NetlinkBuffer::new_checked(batch).map_err(|_| Errno::EPROTO)?;
                let len = frame.length() as usize;
                let seq = frame.sequence_number();
                let msg = &batch[..len];
                batch = batch.get((len + 3) & !3..).unwrap_or_default();
                if !wanted(seq) {
                    continue;
                }
                let payload = NetlinkMessage::<SockDiagMessage>::deserialize(msg)
                    .map(|m| m.payload)
                    .map_err(|_| ());
                if let Some(outcome) = each(payload) {
                    return outcome;
                }
            }
        }
    }

    /// Receive replies to `seq`, calling `each` with every inner message until `DONE` or an
    /// error message; an error message with errno 0 (an ACK) ends the wait successfully. An
    /// inner message that does not decode is passed as `None`.
    pub(crate) fn receive(
        &self,
        seq: u32,
        mut each: impl FnMut(Option<SockDiagMessage>),
    ) -> Result<(), Errno> {
        let mut seen = 0usize;
        self.read_replies(
            |s| s == seq,
            |payload| {
                match payload {
                    Ok(NetlinkPayload::Done(_)) => return Some(Ok(())),
                    Ok(NetlinkPayload::Error(e)) => {
                        return Some(match e.code {
                            None => Ok(()),
                            Some(code) => Err(Errno::from_raw(-code.get())),
                        });
                    }
                    Ok(NetlinkPayload::InnerMessage(m)) => {
                        seen += 1;
                        each(Some(m));
                    }
                    Ok(_) => {}
                    // The header parsed but the payload did not.
                    Err(()) => {
                        seen += 1;
                        each(None);
                    }
                }
                (seen > MAX_SOCKETS).then_some(Err(Errno::E2BIG))
            },
        )
    }
}

/// The uid owning the TCP socket in lb's network namespace whose local address is `local` and
/// whose peer is `remote` (for a loopback connection to lb, the client's own socket: `local`
/// is the client's address, `remote` lb's), looked up by its exact four-tuple
/// (`SOCK_DIAG_BY_FAMILY` without `NLM_F_DUMP`, as `ss` does for one socket). `None` when no
/// such socket exists (it closed, or it lives in another network namespace or host).
///
/// # Errors
/// The netlink socket's errno, or `EPROTO` for a reply that does not decode.
pub fn tcp_socket_owner(local: SocketAddr, remote: SocketAddr) -> Result<Option<u32>, Errno> {
    let (family, mut id) = match (local, remote) {
        (SocketAddr::V4(_), SocketAddr::V4(_)) => (libc::AF_INET as u8, SocketId::new_v4()),
        (SocketAddr::V6(_), SocketAddr::V6(_)) => (libc::AF_INET6 as u8, SocketId::new_v6()),
        _ => return Ok(None),
    };
    id.source_port = local.port();
    id.destination_port = remote.port();
    id.source_address = local.ip();
    id.destination_address = remote.ip();
    // INET_DIAG_NOCOOKIE: match by the tuple alone.
    id.cookie = [0xff; 8];
    let nl = Netlink::open()?;
    let seq = nl.send(
        NLM_F_REQUEST,
        SockDiagMessage::InetRequest(InetRequest {
            family,
            protocol: IPPROTO_TCP,
            extensions: ExtensionFlags::empty(),
            states: StateFlags::all(),
            socket_id: id,
        }),
    )?;
    let mut owner = None;
    let mut malformed = false;
    let done = nl.read_replies(
        |s| s == seq,
        |payload| match payload {
            Ok(NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r))) => {
                owner = Some(r.header.uid);
                Some(Ok(()))
            }
            Ok(NetlinkPayload::Error(e)) => Some(match e.code {
                None => Ok(()),
                Some(code) => Err(Errno::from_raw(-code.get())),
            }),
            Ok(NetlinkPayload::Done(_)) => Some(Ok(())),
            Ok(_) => None,
            Err(()) => {
                malformed = true;
                Some(Ok(()))
            }
        },
    );
    match done {
        Ok(()) if malformed => Err(Errno::EPROTO),
        Ok(()) => Ok(owner),
        Err(Errno::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_owner_of_a_loopback_client_socket() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (_s, peer) = l.accept().unwrap();
        let me = nix::unistd::geteuid().as_raw();
        assert_eq!(
            tcp_socket_owner(peer, l.local_addr().unwrap()).unwrap(),
            Some(me)
        );
        drop(c);
        // A tuple no socket has.
        let nobody: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(
            tcp_socket_owner(nobody, l.local_addr().unwrap()).unwrap(),
            None
        );
    }
}
