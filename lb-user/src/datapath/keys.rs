//! The kernel's keys built from socket addresses and back: a client connection's
//! [`SockKey`], a listener's [`ListenerKey`], a connect-time server's [`ConnectServer`] and the
//! tuple a connect-time socket was sent on. Pure conversions, used by every map's wrapper; the
//! layouts are `lb_common`'s (network byte order words, IPv4 in the first word, IPv4-mapped
//! IPv6 counted as IPv4).

use std::net::{IpAddr, SocketAddr};

use lb_common::{AF_INET, AF_INET6, ConnectOrig, ConnectServer, ListenerKey, SockKey};

/// Build the map key of a client connection from lb's accepted socket: `peer` is the client's
/// address, `local` the listener address, `netns_cookie` the client socket's namespace. `None`
/// when the two are of different families.
pub fn sock_key(peer: SocketAddr, local: SocketAddr, netns_cookie: u64) -> Option<SockKey> {
    let (family, client_ip_be) = ip_words(peer.ip());
    let (lfamily, lb_ip_be) = ip_words(local.ip());
    if family != lfamily {
        return None;
    }
    Some(SockKey {
        client_ip_be,
        lb_ip_be,
        client_port: u32::from(peer.port()),
        lb_port: u32::from(local.port()),
        netns_cookie,
        family,
        _pad: 0,
    })
}

/// The [`ListenerKey`] of one listener: for `0.0.0.0`/`[::]` the wildcard of its own family
/// only (lb binds IPv6 listeners `IPV6_V6ONLY`, so `[::]` never accepts IPv4 clients and must not
/// claim them from a `0.0.0.0` listener of another balancer), its address otherwise.
pub(super) fn listener_key(addr: SocketAddr) -> ListenerKey {
    let port = u32::from(addr.port());
    if addr.ip().is_unspecified() {
        let family = if addr.is_ipv6() { AF_INET6 } else { AF_INET };
        return ListenerKey::wildcard(port, family);
    }
    let (family, ip_be) = ip_words(addr.ip());
    ListenerKey {
        ip_be,
        port,
        family,
    }
}

/// Address → (family, words in network byte order). IPv4-mapped IPv6 counts as IPv4.
fn ip_words(ip: IpAddr) -> (u32, [u32; 4]) {
    match ip {
        IpAddr::V4(v4) => (AF_INET, [u32::from_ne_bytes(v4.octets()), 0, 0, 0]),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return ip_words(IpAddr::V4(v4));
            }
            let o = v6.octets();
            let w = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            (AF_INET6, [w(0), w(4), w(8), w(12)])
        }
    }
}

/// A server address as the connect tables hold it.
pub(super) fn connect_server(addr: SocketAddr) -> ConnectServer {
    let key = listener_key(addr);
    ConnectServer {
        ip_be: key.ip_be,
        port: key.port,
        family: key.family,
    }
}

/// The socket address of a connect table entry.
pub(super) fn server_addr(s: &ConnectServer) -> Option<SocketAddr> {
    let ip: IpAddr = match s.family {
        AF_INET => IpAddr::from(s.ip_be[0].to_ne_bytes()),
        AF_INET6 => {
            let mut b = [0u8; 16];
            for (chunk, w) in b.chunks_exact_mut(4).zip(s.ip_be) {
                chunk.copy_from_slice(&w.to_ne_bytes());
            }
            IpAddr::from(b)
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, u16::try_from(s.port).ok()?))
}

/// A connect-time socket's (own address, peer) as the kernel holds them, from what sockops
/// recorded at `TCP_CONNECT_CB`; `None` before then. An IPv6 socket sent to an IPv4 `server`
/// has both addresses IPv4-mapped.
pub(super) fn sent_tuple(o: &ConnectOrig, server: SocketAddr) -> Option<(SocketAddr, SocketAddr)> {
    if o.local_port == 0 {
        return None;
    }
    let local = server_addr(&ConnectServer {
        ip_be: o.local_ip_be,
        port: o.local_port,
        family: o.family,
    })?;
    let peer = match (local, server) {
        (SocketAddr::V6(_), SocketAddr::V4(v4)) => {
            SocketAddr::new(IpAddr::V6(v4.ip().to_ipv6_mapped()), v4.port())
        }
        (SocketAddr::V4(_), SocketAddr::V6(_)) => return None,
        _ => server,
    };
    Some((local, peer))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_words_match_kernel_layout() {
        let k = sock_key(
            "127.0.0.2:40000".parse().unwrap(),
            "127.0.0.1:6444".parse().unwrap(),
            7,
        )
        .unwrap();
        assert_eq!(k.client_ip_be[0].to_ne_bytes(), [127, 0, 0, 2]);
        assert_eq!(
            (k.client_port, k.lb_port, k.family, k.netns_cookie),
            (40000, 6444, AF_INET, 7)
        );
        let mapped = sock_key(
            "[::ffff:127.0.0.2]:40000".parse().unwrap(),
            "127.0.0.1:6444".parse().unwrap(),
            7,
        )
        .unwrap();
        assert_eq!(mapped, k);
        let v6 = sock_key("[::1]:1".parse().unwrap(), "[::1]:2".parse().unwrap(), 0).unwrap();
        assert_eq!(v6.family, AF_INET6);
        assert_eq!(v6.client_ip_be[3].to_ne_bytes(), [0, 0, 0, 1]);
    }

    #[test]
    fn wildcard_listener_keys() {
        let v4 = listener_key("0.0.0.0:80".parse().unwrap());
        assert_eq!((v4.family, v4.port, v4.ip_be), (AF_INET, 80, [0; 4]));
        // IPV6_V6ONLY: `[::]` is an IPv6 wildcard only (it used to register an IPv4 one too,
        // which charged a `0.0.0.0` listener's clients to the `[::]` listener's balancer).
        let v6 = listener_key("[::]:80".parse().unwrap());
        assert_eq!((v6.family, v6.port, v6.ip_be), (AF_INET6, 80, [0; 4]));
        let one = listener_key("127.0.0.1:6443".parse().unwrap());
        assert_eq!((one.family, one.port), (AF_INET, 6443));
        assert_eq!(one.ip_be[0].to_ne_bytes(), [127, 0, 0, 1]);
    }
}
