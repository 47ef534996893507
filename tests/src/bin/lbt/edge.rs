//! `lbt client` actions that put the splice at its edges on purpose: a new socket reusing a
//! reset one's four-tuple, a kTLS client, a non-blocking client whose sends the kernel takes in
//! part. Each prints JSON lines like the other actions; blocking reads retry on `WouldBlock`.

use std::{
    io::{self, BufRead as _, Read as _, Write as _},
    net::{Shutdown, SocketAddr, TcpStream},
    os::fd::AsRawFd as _,
    time::{Duration, Instant},
};

use clap::Subcommand;
use lb_tests::{Digest, PatternStream};
use serde_json::json;

use super::{read_line, write_retry};

#[path = "syn.rs"]
mod syn;

#[derive(Subcommand, Clone)]
pub(crate) enum EdgeAction {
    /// Connect (the old connection), send `UP\n`, print `{"event":"old_ready"}`, wait for a line
    /// on stdin, reset the old connection (`SO_LINGER` 0), connect again from the same local
    /// address and port (`SO_REUSEADDR`), send `UP\n` and then `n` bytes in 64 KiB writes,
    /// print `{"event":"new_sent"}`, wait for a line on stdin, half-close and check the server's
    /// digest (`ok`).
    ReuseTuple { n: u64 },
    /// Send `UP\n` in the clear, wait `pause_ms`, turn on kTLS for sending (`TCP_ULP` "tls",
    /// `TLS_TX` AES-GCM-128 with a fixed key), send `n` bytes, half-close, and report whether the
    /// server received exactly the plaintext (`plaintext_at_server`). `ulp_error` names the
    /// errno when the kernel refused kTLS (then nothing is sent).
    KtlsUp {
        n: u64,
        #[arg(long, default_value_t = 300)]
        pause_ms: u64,
    },
    /// A non-blocking client with a small send buffer (`SO_SNDBUF` `sndbuf` bytes): `STALL
    /// <stall_ms>\n`, then `burst` bytes in 64 KiB writes as fast as the socket takes them
    /// (waiting in `poll` when it is full), `gap_ms` of silence, then `tail` bytes the same way;
    /// half-close and check the digest. Reports how many writes the kernel took in part
    /// (`partial_writes`).
    NbBurst {
        burst: u64,
        tail: u64,
        /// 0 leaves the kernel's default (autotuned).
        #[arg(long, default_value_t = 4096)]
        sndbuf: usize,
        /// Bytes per write.
        #[arg(long, default_value_t = 65536)]
        chunk: usize,
        #[arg(long, default_value_t = 500)]
        stall_ms: u64,
        #[arg(long, default_value_t = 500)]
        gap_ms: u64,
    },
    /// A non-blocking connect whose SYN goes unanswered: reports the socket's `TCP_SYNCNT`
    /// (`syncnt`), its SYN retransmission timeout (`rto_us`, from `tcp_info`) and when the
    /// kernel first retransmitted the SYN (`first_retransmit_ms`, watched for `within_ms`).
    SynSent {
        #[arg(long, default_value_t = 3000)]
        within_ms: u64,
    },
}

/// Run one edge action against `addr`.
pub(crate) fn run(addr: SocketAddr, action: EdgeAction) -> io::Result<serde_json::Value> {
    match action {
        EdgeAction::ReuseTuple { n } => reuse_tuple(addr, n),
        EdgeAction::KtlsUp { n, pause_ms } => ktls_up(addr, n, pause_ms),
        EdgeAction::NbBurst {
            burst,
            tail,
            sndbuf,
            chunk,
            stall_ms,
            gap_ms,
        } => nb_burst(addr, (burst, tail), (sndbuf, chunk), stall_ms, gap_ms),
        EdgeAction::SynSent { within_ms } => syn::syn_sent(addr, Duration::from_millis(within_ms)),
    }
}

fn event(v: &serde_json::Value) {
    println!("{v}");
    let _ = io::stdout().flush();
}

/// Block until the test writes a line on stdin (EOF counts as one).
fn wait_for_go() -> io::Result<()> {
    let mut line = String::new();
    io::stdin().lock().read_line(&mut line)?;
    Ok(())
}

fn socket_from(local: Option<SocketAddr>, addr: SocketAddr) -> io::Result<TcpStream> {
    let s = bound_socket(local, addr)?;
    connect(s, addr)
}

/// A TCP socket for `addr`'s family with `SO_REUSEADDR`, bound to `local` when given.
fn bound_socket(local: Option<SocketAddr>, addr: SocketAddr) -> io::Result<socket2::Socket> {
    let domain = socket2::Domain::for_address(addr);
    let s = socket2::Socket::new(domain, socket2::Type::STREAM, Some(socket2::Protocol::TCP))?;
    s.set_reuse_address(true)?;
    if let Some(local) = local {
        s.bind(&local.into())?;
    }
    Ok(s)
}

/// Connect `s` to `addr` (15 s at most), with `TCP_NODELAY`.
fn connect(s: socket2::Socket, addr: SocketAddr) -> io::Result<TcpStream> {
    s.connect_timeout(&addr.into(), Duration::from_secs(15))?;
    s.set_nodelay(true)?;
    Ok(s.into())
}

/// Write `n` pattern bytes (seed `seed`) in 64 KiB writes, adding them to `d`.
fn upload(s: &mut TcpStream, n: u64, seed: u64, d: &mut Digest) -> io::Result<()> {
    let mut src = PatternStream::new(seed);
    let mut buf = vec![0u8; 65536];
    let mut left = n;
    while left > 0 {
        let k = usize::try_from(left.min(buf.len() as u64)).unwrap_or(buf.len());
        src.fill(&mut buf[..k]);
        d.update(&buf[..k]);
        write_retry(s, &buf[..k])?;
        left -= k as u64;
    }
    Ok(())
}

fn reuse_tuple(addr: SocketAddr, n: u64) -> io::Result<serde_json::Value> {
    // The old socket's port is bound explicitly, so no other connection on the machine shares
    // it (the kernel shares a port it picks at connect across destinations, and a later bind
    // to it would then fail); the new socket binds it before the old one goes, so nobody can
    // take it in between (both have SO_REUSEADDR and neither listens).
    let any = SocketAddr::new(addr.ip(), 0);
    let mut old = socket_from(Some(any), addr)?;
    let local = old.local_addr()?;
    write_retry(&mut old, b"UP\n")?;
    event(&json!({"event": "old_ready", "local": local.to_string()}));
    wait_for_go()?;
    let new = bound_socket(Some(local), addr)?;
    socket2::SockRef::from(&old).set_linger(Some(Duration::ZERO))?;
    drop(old);
    let mut new = connect(new, addr)?;
    write_retry(&mut new, b"UP\n")?;
    let mut d = Digest::default();
    upload(&mut new, n, 5, &mut d)?;
    event(&json!({"event": "new_sent", "local": new.local_addr()?.to_string()}));
    wait_for_go()?;
    new.shutdown(Shutdown::Write)?;
    let reply = read_line(&mut new)?;
    let want = format!("OK {} {:016x}", d.count(), d.finish());
    Ok(json!({"ok": reply == want, "event": "done", "reply": reply, "want": want}))
}

/// `struct tls12_crypto_info_aes_gcm_128` with a fixed key: nobody decrypts, the test only
/// looks at whether the server received ciphertext or the plaintext.
fn tls_tx_info() -> libc::tls12_crypto_info_aes_gcm_128 {
    // SAFETY: a plain C struct of integers and byte arrays; all zeroes is a valid value.
    #[expect(unsafe_code, reason = "the kTLS crypto info struct has no Default")]
    let mut info: libc::tls12_crypto_info_aes_gcm_128 = unsafe { std::mem::zeroed() };
    info.info.version = libc::TLS_1_2_VERSION;
    info.info.cipher_type = libc::TLS_CIPHER_AES_GCM_128;
    info.key = [7; 16];
    info.iv = [1; 8];
    info.salt = [2; 4];
    info
}

/// `setsockopt(fd, level, name, value)` for a plain C value.
fn set_opt<T>(s: &TcpStream, level: libc::c_int, name: libc::c_int, value: &T) -> io::Result<()> {
    // SAFETY: `value` points to a live `T` of `size_of::<T>()` bytes the kernel only reads.
    #[expect(
        unsafe_code,
        reason = "setsockopt(2) of a plain C value has no safe wrapper"
    )]
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            level,
            name,
            std::ptr::from_ref(value).cast(),
            libc::socklen_t::try_from(size_of::<T>()).unwrap_or(0),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn ktls_up(addr: SocketAddr, n: u64, pause_ms: u64) -> io::Result<serde_json::Value> {
    let mut s = socket_from(None, addr)?;
    write_retry(&mut s, b"UP\n")?;
    std::thread::sleep(Duration::from_millis(pause_ms));
    // Two steps, told apart: the ULP itself (a kernel that refuses it on a socket in a sockhash
    // shows the plaintext case cannot happen), then the key (a kernel without the AES-GCM
    // cipher refuses it, which says nothing about the splice).
    if let Err(e) = set_opt(&s, libc::SOL_TCP, libc::TCP_ULP, b"tls") {
        return Ok(json!({"ok": true, "ulp_error": e.to_string(), "errno": e.raw_os_error()}));
    }
    if let Err(e) = set_opt(&s, libc::SOL_TLS, libc::TLS_TX, &tls_tx_info()) {
        return Ok(json!({"ok": true, "key_error": e.to_string(), "errno": e.raw_os_error()}));
    }
    let mut d = Digest::default();
    upload(&mut s, n, 9, &mut d)?;
    s.shutdown(Shutdown::Write)?;
    let reply = read_line(&mut s)?;
    let plain = format!("OK {} {:016x}", d.count(), d.finish());
    Ok(json!({
        "ok": true,
        "plaintext_at_server": reply == plain,
        "reply": reply,
        "plaintext": plain,
    }))
}

/// Write all of `buf` to the non-blocking `s`, waiting in `poll` while it is full; returns how
/// many writes the kernel took only in part.
fn write_nonblocking(s: &mut TcpStream, mut buf: &[u8]) -> io::Result<u64> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    use std::os::fd::AsFd as _;
    let mut partial = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(k) => {
                partial += u64::from(k < buf.len());
                buf = &buf[k..];
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    return Err(io::ErrorKind::TimedOut.into());
                }
                let mut fds = [PollFd::new(s.as_fd(), PollFlags::POLLOUT)];
                poll(&mut fds, PollTimeout::from(100u16)).map_err(io::Error::from)?;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(partial)
}

fn nb_burst(
    addr: SocketAddr,
    (burst, tail): (u64, u64),
    (sndbuf, chunk): (usize, usize),
    stall_ms: u64,
    gap_ms: u64,
) -> io::Result<serde_json::Value> {
    let mut s = socket_from(None, addr)?;
    if sndbuf > 0 {
        socket2::SockRef::from(&s).set_send_buffer_size(sndbuf)?;
    }
    write_retry(&mut s, format!("STALL {stall_ms}\n").as_bytes())?;
    s.set_nonblocking(true)?;
    let mut src = PatternStream::new(13);
    let mut d = Digest::default();
    let mut buf = vec![0u8; chunk.max(1)];
    let mut partial = 0;
    for (i, n) in [burst, tail].into_iter().enumerate() {
        if i == 1 {
            std::thread::sleep(Duration::from_millis(gap_ms));
        }
        let mut left = n;
        while left > 0 {
            let k = usize::try_from(left.min(buf.len() as u64)).unwrap_or(buf.len());
            src.fill(&mut buf[..k]);
            d.update(&buf[..k]);
            partial += write_nonblocking(&mut s, &buf[..k])?;
            left -= k as u64;
        }
    }
    s.set_nonblocking(false)?;
    s.shutdown(Shutdown::Write)?;
    let reply = read_line(&mut s)?;
    let want = format!("OK {} {:016x}", d.count(), d.finish());
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    Ok(json!({"ok": reply == want, "partial_writes": partial, "reply": reply, "want": want}))
}
