//! The splice's tests of a client socket's addresses: whether its destination is on its own
//! host (a wildcard listener's client), and an IPv4-mapped IPv6 socket keyed as IPv4, as lb
//! keys the socket it accepted.

use lb_common::{AF_INET, AF_INET6, SockKey};

/// `127.0.0.1`'s first byte, and `::1`'s last word, in network byte order as the kernel
/// stores addresses.
const LOOPBACK4_NET: u8 = 127;
const LOOPBACK6_LAST_BE: u32 = u32::from_ne_bytes([0, 0, 0, 1]);
/// Word 2 of an IPv4-mapped IPv6 address (`::ffff:a.b.c.d`), network byte order.
const V4_MAPPED_BE: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);

/// Whether a client's destination is on its own host, so that a wildcard listener of its port
/// may be the socket that accepted it: a loopback address (`127.0.0.0/8`, `::1`), or the
/// client's own address. Why the second: a connect to one of the host's own addresses takes a
/// local route, whose preferred source is that same address (`ip route show table local`), so
/// the socket's two ends carry one address; a connect to another host's address on port P
/// (lb's own dials to its servers, any program's) never does, and must not be registered: it
/// would fill `LB_CLIENTS`/`LB_FLOWS` (65,536 entries) and crowd out lb's clients. A client
/// that binds another local source address, or reaches the wildcard from another network
/// namespace through a host address, is not registered and takes the copy path; a listener
/// on that address, named exactly, splices it.
#[inline(always)]
pub(crate) fn local_destination(key: &SockKey) -> bool {
    if key.lb_ip_be == key.client_ip_be {
        return true;
    }
    if key.family == AF_INET {
        key.lb_ip_be[0].to_ne_bytes()[0] == LOOPBACK4_NET
    } else {
        key.lb_ip_be == [0, 0, 0, LOOPBACK6_LAST_BE]
    }
}

/// Key an IPv6 socket connected to an IPv4-mapped address (`[::ffff:127.0.0.1]:P`, a
/// dual-stack client of an IPv4 listener) as IPv4: it talks IPv4 on the wire, lb accepts it on
/// an `AF_INET` socket and keys it so (`lb-user`'s `sock_key`), and both sides must agree for
/// the connection to be paired.
#[inline(always)]
pub(crate) fn unmap_v4(key: &mut SockKey) {
    let lb = key.lb_ip_be;
    if key.family != AF_INET6 || lb[0] != 0 || lb[1] != 0 || lb[2] != V4_MAPPED_BE {
        return;
    }
    // A socket connected to a mapped address has a mapped address of its own.
    key.family = AF_INET;
    key.lb_ip_be = [lb[3], 0, 0, 0];
    key.client_ip_be = [key.client_ip_be[3], 0, 0, 0];
}
