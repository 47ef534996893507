//! `lbt client edge syn-sent`: a non-blocking connect whose SYN goes unanswered, watched from
//! the client's own socket: its `TCP_SYNCNT` and its SYN retransmission timeout
//! (`tcp_info.tcpi_rto`), and how long until the kernel first retransmitted the SYN.

use std::{
    io,
    net::SocketAddr,
    os::fd::AsRawFd as _,
    time::{Duration, Instant},
};

use serde_json::json;

/// `getsockopt(fd, level, name)` into a plain C value.
fn get_opt<T: Default>(fd: libc::c_int, level: libc::c_int, name: libc::c_int) -> io::Result<T> {
    let mut v = T::default();
    let mut len = libc::socklen_t::try_from(size_of::<T>()).unwrap_or(0);
    // SAFETY: `v` is a live `T` of `len` bytes the kernel writes at most `len` of.
    #[expect(
        unsafe_code,
        reason = "getsockopt(2) of a plain C value has no safe wrapper"
    )]
    let rc = unsafe {
        libc::getsockopt(
            fd,
            level,
            name,
            std::ptr::from_mut(&mut v).cast(),
            &raw mut len,
        )
    };
    if rc == 0 {
        Ok(v)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `tcp_info` of `fd`: (state, retransmits, rto in µs).
fn info(fd: libc::c_int) -> io::Result<(u8, u8, u32)> {
    // SAFETY: tcp_info is plain integers; all-zero is a valid value.
    #[expect(unsafe_code, reason = "libc::tcp_info has no Default")]
    let mut i: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = libc::socklen_t::try_from(size_of::<libc::tcp_info>()).unwrap_or(0);
    // SAFETY: `i` is a live tcp_info of `len` bytes.
    #[expect(unsafe_code, reason = "getsockopt(2) of TCP_INFO has no safe wrapper")]
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            std::ptr::from_mut(&mut i).cast(),
            &raw mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((i.tcpi_state, i.tcpi_retransmits, i.tcpi_rto))
}

/// Start a non-blocking connect to `addr`; report the socket's `syncnt` and `rto_us` while in
/// `SYN_SENT`, then watch (every 2 ms, for at most `within`) until the kernel retransmitted
/// the SYN: `first_retransmit_ms`, or `null` when it did not within `within`. `state` is the
/// kernel's TCP state number (2 is `SYN_SENT`).
pub(crate) fn syn_sent(addr: SocketAddr, within: Duration) -> io::Result<serde_json::Value> {
    let sock = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    sock.set_nonblocking(true)?;
    let t = Instant::now();
    match sock.connect(&addr.into()) {
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Ok(()) => return Ok(json!({"ok": false, "error": "connected"})),
        Err(e) => return Ok(json!({"ok": false, "error": e.to_string()})),
    }
    let fd = sock.as_raw_fd();
    let syncnt: libc::c_int = get_opt(fd, libc::IPPROTO_TCP, libc::TCP_SYNCNT)?;
    let (state, _, rto_us) = info(fd)?;
    let mut first = None;
    while t.elapsed() < within {
        let (_, retransmits, _) = info(fd)?;
        if retransmits > 0 {
            first = Some(t.elapsed().as_millis() as u64);
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(json!({
        "ok": true,
        "state": state,
        "syncnt": syncnt,
        "rto_us": rto_us,
        "first_retransmit_ms": first,
    }))
}
