//! Redirect credit: the bound on bytes the sk_msg program may push into one server socket for a
//! non-blocking client. It owns the server socket's buffer size, the credit cap, each grant
//! (from the socket's queue, `SIOCOUTQ`) and the `lb-credit` thread that grants more when the
//! program asks through the ring buffer.
//!
//! Why the credit exists: when a server socket is full, a redirected non-blocking send fails
//! with `EAGAIN` while the client's own socket stays writable and is never woken again (measured
//! here: an epoll client hung). With credit, such sends take the copy path, where ordinary TCP
//! flow control holds the client back. Minimum kernel: as the data path, 5.15.

use std::{
    os::fd::{AsFd, RawFd},
    sync::{Arc, Mutex},
};

use lb_common::{MODE_PASS, MODE_REDIRECT, PairCtl, SockKey};
use tracing::{debug, warn};

use super::Datapath;

/// One paired connection as the credit refresher sees it.
#[derive(Debug)]
pub struct Pair {
    key: SockKey,
    server_fd: RawFd,
    ctl: Mutex<PairCtl>,
    /// The server socket's send buffer as the kernel set it (bytes, at most
    /// `max_buffered_bytes`).
    limit: u64,
}

impl Pair {
    /// A new pair of client `key` and the server socket `server_fd`, whose send buffer is
    /// `limit` bytes, after lb copied `copied` bytes of the client's stream: redirecting (once
    /// lb has caught up) the sends of the client socket whose cookie is `cookie` (its
    /// `FlowState::cookie`) only, with the whole cap as credit and the first refresh a quarter
    /// of the buffer in.
    pub(super) fn new(
        key: SockKey,
        server_fd: RawFd,
        limit: u64,
        copied: u64,
        cookie: u64,
    ) -> Pair {
        let ctl = PairCtl {
            copied,
            credit_end: credit_cap(limit),
            refresh_at: limit / 4,
            mode: MODE_REDIRECT,
            _pad: 0,
            cookie,
        };
        Pair {
            key,
            server_fd,
            ctl: Mutex::new(ctl),
            limit,
        }
    }

    /// The map key.
    pub fn key(&self) -> SockKey {
        self.key
    }

    /// What lb last told the kernel (or will tell it first).
    pub(super) fn ctl(&self) -> PairCtl {
        *self.ctl.lock().expect("poisoned")
    }

    /// Stop redirecting: every later send takes the copy path.
    pub(super) fn stop(&self) {
        self.ctl.lock().expect("poisoned").mode = MODE_PASS;
    }

    /// Set `credit_end`/`refresh_at` from the server socket's queue (`SIOCOUTQ`; an unreadable
    /// queue counts as full).
    fn grant(&self, ctl: &mut PairCtl, redirected: u64) {
        let outq = outq_bytes(self.server_fd).unwrap_or(u64::MAX);
        grant(ctl, credit_cap(self.limit), outq, redirected);
    }
}

/// Credit bound (bytes): three quarters of the server socket's buffer `limit` (bytes), leaving
/// room for the kernel's per-buffer overhead, so a redirected send never meets a full socket.
fn credit_cap(limit: u64) -> u64 {
    limit / 4 * 3
}

/// The program may redirect until the queue (`outq` bytes) would pass `cap`, counting from
/// `redirected` (bytes redirected so far), and asks again a quarter of the way there.
fn grant(ctl: &mut PairCtl, cap: u64, outq: u64, redirected: u64) {
    let room = cap.saturating_sub(outq);
    ctl.credit_end = redirected + room;
    ctl.refresh_at = redirected + room / 4;
}

/// The `SO_SNDBUFFORCE` request (bytes) for a bound of `max_buffered` bytes toward the server.
///
/// The kernel doubles the request for its bookkeeping, so the socket then holds at most
/// `max_buffered` bytes, which bounds lb's own copies and a blocking client waiting in the
/// kernel. The buffer is set 64 KiB short of the bound because the kernel checks for room before
/// each new skb and may pass its buffer by up to one (64 KiB with GSO).
fn sndbuf_request(max_buffered: u64) -> u64 {
    (max_buffered / 2)
        .saturating_sub(32 * 1024)
        .max(max_buffered / 4)
}

/// Size the server socket's send buffer for `max_buffered` bytes (see [`sndbuf_request`]) and
/// return what the kernel set (bytes, at most `max_buffered`), so the credit never exceeds the
/// real buffer. A refused `SO_SNDBUFFORCE` leaves autotuning on and is logged at debug level.
pub(super) fn size_server_socket(server: &impl AsFd, max_buffered: u64) -> u64 {
    use nix::sys::socket::{getsockopt, setsockopt, sockopt};
    let want = sndbuf_request(max_buffered);
    let buf = usize::try_from(want).unwrap_or(usize::MAX);
    if let Err(e) = setsockopt(server, sockopt::SndBufForce, &buf) {
        debug!(error = %e, "SO_SNDBUFFORCE refused; relying on autotuning");
    }
    getsockopt(server, sockopt::SndBuf)
        .ok()
        .and_then(|b| u64::try_from(b).ok())
        .map_or(want * 2, |b| b.min(max_buffered))
}

impl Datapath {
    /// Publish how many bytes (`copied`) lb has copied from the accepted socket to the server
    /// socket, with fresh credit until the connection's first redirect: lb's own writes share the
    /// server socket with the redirected bytes, so the credit is recomputed from the socket's
    /// queue to keep both within the bound. After it the program reads the socket's room itself.
    pub fn set_copied(&self, pair: &Pair, copied: u64) {
        let mut ctl = pair.ctl.lock().expect("poisoned");
        ctl.copied = copied;
        let flow = self.flow(&pair.key);
        // Once a redirect showed the program where the server socket is, it reads the socket's
        // room itself and no longer goes by the credit: no `SIOCOUTQ` for it.
        if flow.is_none_or(|f| f.server == 0) {
            pair.grant(&mut ctl, flow.map_or(0, |f| f.redirected));
        }
        if let Err(e) = self.maps.pairs.insert(&pair.key, &ctl) {
            warn!(error = %e, "cannot publish copied bytes");
        }
    }

    /// Serve credit refresh requests on a dedicated thread (`lb-credit`) until `cancel` fires,
    /// waking at least every 100 ms: for each, read the server socket's unsent+unacked bytes
    /// (`SIOCOUTQ`) and grant credit so that at most `max_buffered_bytes` are queued toward the
    /// server. A second call does nothing.
    ///
    /// # Errors
    /// The thread could not be spawned.
    pub fn start_refresher(
        self: &Arc<Self>,
        cancel: tokio_util::sync::CancellationToken,
    ) -> std::io::Result<()> {
        let Some(ring) = self.refresh.lock().expect("poisoned").take() else {
            return Ok(());
        };
        let this = self.clone();
        self.spawn_ring_reader(
            "lb-credit",
            cancel,
            ring,
            super::refresh::RefreshRing::next_request,
            move |reqs| {
                for req in reqs {
                    this.refresh_one(&req.key);
                }
            },
        )
    }

    fn refresh_one(&self, key: &SockKey) {
        let Some(pair) = self.pairs.lock().expect("poisoned").get(key).cloned() else {
            return;
        };
        let Some(flow) = self.flow(key) else { return };
        let mut ctl = pair.ctl.lock().expect("poisoned");
        if ctl.mode != MODE_REDIRECT {
            return;
        }
        pair.grant(&mut ctl, flow.redirected);
        if let Err(e) = self.maps.pairs.insert(&pair.key, &ctl) {
            warn!(error = %e, "cannot grant credit");
        }
    }
}

/// Unsent plus unacknowledged bytes in a TCP socket's send queue (`SIOCOUTQ`).
fn outq_bytes(fd: RawFd) -> Option<u64> {
    let mut n: libc::c_int = 0;
    // SAFETY: SIOCOUTQ writes one c_int through the pointer, which points to a live c_int.
    #[expect(unsafe_code, reason = "SIOCOUTQ has no safe wrapper")]
    let rc = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut n) };
    (rc == 0).then(|| u64::try_from(n).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1024 * 1024;

    #[test]
    fn default_bound_sizes() {
        // The 4 MiB default: a 2 MiB - 32 KiB request, which the kernel doubles to 4 MiB - 64 KiB.
        assert_eq!(sndbuf_request(4 * MIB), 2 * MIB - 32 * 1024);
        // Small bounds never ask for less than a quarter.
        assert_eq!(sndbuf_request(64 * 1024), 16 * 1024);
        let limit = 4 * MIB - 64 * 1024;
        let first = Pair::new(SockKey::default(), -1, limit, 0, 7).ctl();
        assert_eq!(first.credit_end, credit_cap(limit));
        assert_eq!(first.credit_end, limit / 4 * 3);
        assert_eq!(first.refresh_at, limit / 4);
        assert_eq!(first.mode, MODE_REDIRECT);
        assert_eq!(first.cookie, 7);
    }

    #[test]
    fn grants_what_the_queue_leaves() {
        let mut ctl = PairCtl::default();
        grant(&mut ctl, 3 * MIB, MIB, 10 * MIB);
        assert_eq!(ctl.credit_end, 12 * MIB);
        assert_eq!(ctl.refresh_at, 10 * MIB + MIB / 2);
        // A full (or unreadable) queue grants nothing.
        grant(&mut ctl, 3 * MIB, u64::MAX, 10 * MIB);
        assert_eq!((ctl.credit_end, ctl.refresh_at), (10 * MIB, 10 * MIB));
    }
}
