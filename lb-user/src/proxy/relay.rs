//! The copy loop of one connection through lb: both directions copied until both ends closed
//! (a half-close passed on as FIN) or one failed, what a client sends handed to the kernel
//! splice once it pairs, and how the loop ended.

use std::{cell::RefCell, io, net::Shutdown, sync::atomic::Ordering, time::Duration};

use tokio::net::TcpStream;

use super::{Dir, ProxyCtx, Splice, readable_or_quiet};

thread_local! {
    /// One read buffer per runtime thread (`copy_buffer_bytes` long), shared by its connections.
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

pub(super) enum Outcome {
    Closed,
    /// No byte either way for `idle_timeout`.
    Idle,
    /// Stopped for a hand-over; the sockets go to the next process as they are.
    Frozen,
    Reset(io::Error, Side),
    Killed,
}

/// Which socket an error came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Side {
    Client,
    Server,
}

/// Reset a socket: `SO_LINGER` 0, so closing it sends RST.
pub(super) fn abort(s: &TcpStream) {
    let _ = socket2::SockRef::from(s).set_linger(Some(Duration::ZERO));
}

/// Copy both directions until both ends closed (half-close passed on as FIN) or one failed.
pub(super) async fn relay(
    client: &TcpStream,
    server: &TcpStream,
    splice: &Splice<'_>,
    ctx: &ProxyCtx,
    up_dir: &mut Dir,
    down_dir: &mut Dir,
) -> Outcome {
    // Counted as each chunk lands, so the metric is current while connections live.
    let up_bytes = ctx
        .metrics
        .copied_counter(splice.balancer, "client_to_server");
    let down_bytes = ctx
        .metrics
        .copied_counter(splice.balancer, "server_to_client");
    let up = async {
        let mut last = up_dir.written;
        let mut chunks = 0u32;
        pump(client, server, ctx, up_dir, Some(splice), |copied, full| {
            chunks += 1;
            splice.copied(copied, full, chunks);
            splice.copied.fetch_add(copied - last, Ordering::Relaxed);
            up_bytes.inc_by(copied - last);
            last = copied;
        })
        .await
        .map_err(|(e, on_src)| (e, if on_src { Side::Client } else { Side::Server }))?;
        socket2::SockRef::from(server)
            .shutdown(Shutdown::Write)
            .map_err(|e| (e, Side::Server))?;
        Ok::<(), (io::Error, Side)>(())
    };
    let down = async {
        let mut last = down_dir.written;
        pump(server, client, ctx, down_dir, None, |copied, _| {
            splice.copied.fetch_add(copied - last, Ordering::Relaxed);
            down_bytes.inc_by(copied - last);
            last = copied;
        })
        .await
        .map_err(|(e, on_src)| (e, if on_src { Side::Server } else { Side::Client }))?;
        socket2::SockRef::from(client)
            .shutdown(Shutdown::Write)
            .map_err(|e| (e, Side::Client))?;
        Ok::<(), (io::Error, Side)>(())
    };
    match tokio::try_join!(up, down) {
        Ok(((), ())) => Outcome::Closed,
        Err((e, side)) => Outcome::Reset(e, side),
    }
}

/// Read what `src` has into `buf`. A read shorter than `buf` drained the socket, so its
/// readiness is cleared at once (as tokio's own `poll_read` does): the next wait goes straight to
/// epoll instead of first paying a `recv` that returns `EAGAIN`. Data that arrives meanwhile
/// raises a new readiness event, which the clear leaves alone.
///
/// # Errors
/// The socket's error; `WouldBlock` when nothing was there.
fn read_draining(src: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    use std::io::Read as _;
    let mut got = None;
    let r = src.try_io(tokio::io::Interest::READABLE, || {
        let n = (&*socket2::SockRef::from(src)).read(buf)?;
        got = Some(n);
        if n > 0 && n < buf.len() {
            Err(io::ErrorKind::WouldBlock.into())
        } else {
            Ok(n)
        }
    });
    match got {
        Some(n) => Ok(n),
        None => r,
    }
}

/// Copy `src` to `dst` until EOF; once bytes are in `dst`, `on_copied(total, full)`, `full`
/// when the chunk filled the copy buffer (more was likely waiting). An error says
/// whether it came from `src` (`true`) or `dst`. `dir` holds what a hand-over needs at any
/// await point: the bytes written so far and the chunk in flight with its unwritten part.
async fn pump(
    src: &TcpStream,
    dst: &TcpStream,
    ctx: &ProxyCtx,
    dir: &mut Dir,
    splice: Option<&Splice<'_>>,
    mut on_copied: impl FnMut(u64, bool),
) -> Result<u64, (io::Error, bool)> {
    // Reads land in a per-thread scratch buffer and are written on at once; only bytes the
    // destination cannot take right now are kept, in `dir.pending`, which is released as soon
    // as it is flushed. Idle and request/response connections therefore hold no buffer at all.
    loop {
        if dir.chunk == 0 {
            match splice {
                Some(sp) if sp.pending() => {
                    if !readable_or_quiet(src).await.map_err(|e| (e, true))? {
                        // Everything the client sent so far is copied: pair now, and the
                        // counting rule lets its next send through the kernel at once.
                        sp.try_pair(dir.written);
                        continue;
                    }
                }
                _ => src.readable().await.map_err(|e| (e, true))?,
            }
            let read = SCRATCH.with(|scratch| {
                let mut scratch = scratch.borrow_mut();
                if scratch.len() < ctx.copy_buffer_bytes {
                    scratch.resize(ctx.copy_buffer_bytes, 0);
                }
                let buf = &mut scratch[..ctx.copy_buffer_bytes];
                let n = read_draining(src, buf).map_err(|e| (e, true))?;
                let mut off = 0;
                while off < n {
                    match dst.try_write(&buf[off..n]) {
                        Ok(w) => off += w,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) => return Err((e, false)),
                    }
                }
                dir.pending.extend_from_slice(&buf[off..n]);
                Ok(n)
            });
            match read {
                Ok(0) => return Ok(dir.written),
                Ok(n) => dir.chunk = n as u64,
                // Sockets in a sockhash may report readable spuriously: wait again.
                Err((e, true)) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(err) => return Err(err),
            }
        }
        while dir.off < dir.pending.len() {
            dst.writable().await.map_err(|e| (e, false))?;
            match dst.try_write(&dir.pending[dir.off..]) {
                Ok(w) => dir.off += w,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err((e, false)),
            }
        }
        dir.pending = Vec::new();
        dir.off = 0;
        let chunk = std::mem::take(&mut dir.chunk);
        dir.written += chunk;
        on_copied(dir.written, chunk >= ctx.copy_buffer_bytes as u64);
    }
}
