//! Node-wide kill through netlink sock_diag on loopback: IPv6 peers, and IPv4 peers reached from
//! dual-stack IPv6 sockets (their IPv4-mapped address). Each test skips, saying why, without
//! `CAP_NET_ADMIN` or kernel support for `SOCK_DESTROY`.

use std::{
    io::Read as _,
    net::{SocketAddr, TcpListener, TcpStream},
    time::Duration,
};

use lb::kill::{ConnectSocket, KillError, NodeKill, destroy_connect_sockets, destroy_peer_sockets};

/// `destroy_peer_sockets(peer)`, or `None` (after saying why) when the test must skip.
fn destroy_or_skip(test: &str, peer: SocketAddr) -> Option<NodeKill> {
    match destroy_peer_sockets(peer) {
        Ok(k) => Some(k),
        Err(KillError::Unsupported) => {
            eprintln!("SKIP {test}: the kernel refuses SOCK_DESTROY");
            None
        }
        Err(KillError::Destroy(nix::errno::Errno::EPERM)) => {
            eprintln!("SKIP {test}: needs CAP_NET_ADMIN");
            None
        }
        Err(e) => panic!("{test}: node kill failed: {e}"),
    }
}

/// The client's next read fails with `ECONNABORTED` (what `SOCK_DESTROY` reports to the owner).
fn assert_aborted(mut client: TcpStream) {
    client
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let err = client.read(&mut [0u8; 8]).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ECONNABORTED), "{err}");
}

#[test]
fn node_kill_destroys_an_ipv6_connection() {
    let listener = match TcpListener::bind("[::1]:0") {
        Ok(l) => l,
        Err(e) => {
            eprintln!("SKIP node_kill_destroys_an_ipv6_connection: no IPv6 loopback ({e})");
            return;
        }
    };
    let peer = listener.local_addr().unwrap();
    let client = TcpStream::connect(peer).unwrap();
    let (_accepted, _) = listener.accept().unwrap();
    let Some(k) = destroy_or_skip("node_kill_destroys_an_ipv6_connection", peer) else {
        return;
    };
    assert_eq!((k.found, k.destroyed), (1, 1));
    assert_aborted(client);
}

#[test]
fn node_kill_finds_dual_stack_sockets_by_mapped_address() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let peer = listener.local_addr().unwrap();
    // An AF_INET6 socket without IPV6_V6ONLY connected to ::ffff:127.0.0.1: the kernel lists it
    // in the AF_INET6 dump only.
    let sock = socket2::Socket::new(socket2::Domain::IPV6, socket2::Type::STREAM, None).unwrap();
    sock.set_only_v6(false).unwrap();
    let mapped: SocketAddr = format!("[::ffff:127.0.0.1]:{}", peer.port())
        .parse()
        .unwrap();
    sock.connect(&mapped.into()).unwrap();
    let client: TcpStream = sock.into();
    let (_accepted, _) = listener.accept().unwrap();
    let Some(k) = destroy_or_skip("node_kill_finds_dual_stack_sockets_by_mapped_address", peer)
    else {
        return;
    };
    assert_eq!((k.found, k.destroyed), (1, 1));
    assert_aborted(client);
}

/// A connect-time socket named by its addresses with a cookie that is not its own (its record
/// was stale: another socket has those addresses now). The socket lb meant is gone: no error,
/// nothing destroyed, and the socket that has those addresses now is left alone. For TCP the
/// kernel answers `ENOENT` here (`inet_diag_find_one_icsk` turns `sock_diag_check_cookie`'s
/// `ESTALE` into it; seen on 6.18), so the `ESTALE` lb also accepts never reaches it.
#[test]
fn connect_kill_with_a_stale_cookie_skips_the_socket() {
    let test = "connect_kill_with_a_stale_cookie_skips_the_socket";
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let peer = listener.local_addr().unwrap();
    let mut client = TcpStream::connect(peer).unwrap();
    let (_accepted, _) = listener.accept().unwrap();
    // Cookie 1 belongs to a socket long gone; all ones would mean "no cookie" to the kernel.
    let stale = ConnectSocket {
        cookie: 1,
        tgid: std::process::id(),
        sent: Some((client.local_addr().unwrap(), peer)),
    };
    let k = match destroy_connect_sockets(peer, &[stale]) {
        Ok(k) => k,
        Err(KillError::Unsupported) => {
            eprintln!("SKIP {test}: the kernel refuses SOCK_DESTROY");
            return;
        }
        Err(KillError::Destroy(nix::errno::Errno::EPERM)) => {
            eprintln!("SKIP {test}: needs CAP_NET_ADMIN");
            return;
        }
        Err(e) => panic!("{test}: a stale cookie is an error: {e}"),
    };
    assert_eq!(k.destroyed, 0, "{k:?}");
    client
        .set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let err = client.read(&mut [0u8; 8]).unwrap_err();
    assert_eq!(
        err.kind(),
        std::io::ErrorKind::WouldBlock,
        "the socket was hit: {err}"
    );
}
