//! The netlink messages of a kill: the sock_diag dump of the TCP sockets to one peer, and
//! `SOCK_DESTROY` requests sent 64 to a `sendmsg` with their acknowledgements counted.

use std::{net::SocketAddr, sync::atomic::Ordering};

use netlink_packet_core::{NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkPayload};
use netlink_packet_sock_diag::{
    IPPROTO_TCP, SockDiagDestroy, SockDiagMessage,
    inet::{ExtensionFlags, InetRequest, SocketId, StateFlags},
};
use netlink_sys::SocketAddr as NetlinkAddr;
use nix::errno::Errno;

use super::KillError;
use crate::sock_diag::{NEXT_SEQ, Netlink, encode, errno};

/// One socket found by a dump: its family and the id the kernel gave it (ports, addresses,
/// interface, cookie), which `SOCK_DESTROY` takes back as is.
pub(super) struct Target {
    pub(super) family: u8,
    pub(super) id: SocketId,
}

impl Netlink {
    /// Append the TCP sockets in `states` whose peer is `peer` (its family's dump).
    pub(super) fn dump(
        &self,
        peer: SocketAddr,
        states: StateFlags,
        out: &mut Vec<Target>,
    ) -> Result<(), KillError> {
        let (family, socket_id) = match peer {
            SocketAddr::V4(_) => (libc::AF_INET as u8, SocketId::new_v4()),
            SocketAddr::V6(_) => (libc::AF_INET6 as u8, SocketId::new_v6()),
        };
        let request = SockDiagMessage::InetRequest(InetRequest {
            family,
            protocol: IPPROTO_TCP,
            extensions: ExtensionFlags::empty(),
            states,
            socket_id,
        });
        let seq = self
            .send(NLM_F_REQUEST | NLM_F_DUMP, request)
            .map_err(KillError::Dump)?;
        let mut malformed = false;
        self.receive(seq, |msg| match msg {
            Some(SockDiagMessage::InetResponse(r)) => {
                let id = &r.header.socket_id;
                if r.header.family == family
                    && id.destination_port == peer.port()
                    && id.destination_address == peer.ip()
                {
                    out.push(Target {
                        family,
                        id: id.clone(),
                    });
                }
            }
            Some(_) => {}
            None => malformed = true,
        })
        .map_err(KillError::Dump)?;
        if malformed {
            return Err(KillError::Malformed);
        }
        Ok(())
    }

    /// Send one `SOCK_DESTROY` per target in a single `sendmsg`, each asking for an
    /// acknowledgement, numbered consecutively; returns the first number.
    pub(super) fn send_batch(&self, targets: Vec<Target>) -> Result<u32, Errno> {
        // One range of sequence numbers, so another thread's requests never interleave.
        let n = u32::try_from(targets.len()).unwrap_or(u32::MAX);
        let first = NEXT_SEQ.fetch_add(n, Ordering::Relaxed);
        let mut buf = Vec::new();
        for (i, target) in (0u32..).zip(targets) {
            let seq = first.wrapping_add(i);
            buf.extend(encode(
                seq,
                NLM_F_REQUEST | NLM_F_ACK,
                destroy_request(target),
            ));
        }
        self.socket
            .send_to(&buf, &NetlinkAddr::new(0, 0), 0)
            .map_err(|e| errno(&e))?;
        Ok(first)
    }

    /// Receive the acknowledgements of the `n` requests numbered from `first`, passing each
    /// one's outcome to `each`.
    pub(super) fn receive_acks(
        &self,
        first: u32,
        n: usize,
        mut each: impl FnMut(Result<(), Errno>),
    ) -> Result<(), Errno> {
        let mut left = n;
        if left == 0 {
            return Ok(());
        }
        self.read_replies(
            |seq| (seq.wrapping_sub(first) as usize) < n,
            |payload| {
                if let Ok(NetlinkPayload::Error(e)) = payload {
                    each(e.code.map_or(Ok(()), |c| Err(Errno::from_raw(-c.get()))));
                    left -= 1;
                }
                (left == 0).then_some(Ok(()))
            },
        )
    }
}

/// The `SOCK_DESTROY` request for `target`.
pub(super) fn destroy_request(target: Target) -> SockDiagDestroy {
    SockDiagDestroy::new(SockDiagMessage::InetRequest(InetRequest {
        family: target.family,
        protocol: IPPROTO_TCP,
        extensions: ExtensionFlags::empty(),
        // The id names the socket; the kernel ignores the states for SOCK_DESTROY (all set).
        states: StateFlags::from_bits_retain(u32::MAX),
        socket_id: target.id,
    }))
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use super::*;

    /// The bytes of a `SOCK_DESTROY` as `<linux/sock_diag.h>` and `<linux/inet_diag.h>` lay
    /// them out: `nlmsghdr` (16), then `inet_diag_req_v2` (family, protocol, ext, pad, states)
    /// and `inet_diag_sockid` (ports big endian, 16-byte addresses, interface, cookie).
    #[test]
    fn destroy_request_wire_layout() {
        let target = Target {
            family: libc::AF_INET as u8,
            id: SocketId {
                source_port: 40_000,
                destination_port: 6_443,
                source_address: IpAddr::V4(Ipv4Addr::new(127, 0, 0, 1)),
                destination_address: IpAddr::V4(Ipv4Addr::new(198, 18, 0, 2)),
                interface_id: 3,
                cookie: [1, 2, 3, 4, 5, 6, 7, 8],
            },
        };
        let b = encode(7, NLM_F_REQUEST | NLM_F_ACK, destroy_request(target));
        assert_eq!(b.len(), 16 + 8 + 48);
        let u16_at = |o: usize| u16::from_ne_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_ne_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        assert_eq!(u32_at(0), 72);
        assert_eq!(u16_at(4), 21, "SOCK_DESTROY");
        assert_eq!(u16_at(6), NLM_F_REQUEST | NLM_F_ACK);
        assert_eq!((u32_at(8), u32_at(12)), (7, 0));
        assert_eq!(&b[16..20], &[libc::AF_INET as u8, 6, 0, 0]);
        assert_eq!(u32_at(20), u32::MAX);
        assert_eq!(&b[24..28], &[0x9c, 0x40, 0x19, 0x2b], "ports, big endian");
        assert_eq!(
            &b[28..44],
            &[127, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(&b[44..48], &[198, 18, 0, 2]);
        assert_eq!(&b[48..60], &[0; 12]);
        assert_eq!(u32_at(60), 3);
        assert_eq!(&b[64..72], &[1, 2, 3, 4, 5, 6, 7, 8]);
    }
}
