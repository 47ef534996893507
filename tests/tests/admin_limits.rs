//! The admin API's limits on a real `lb` process over real sockets: request heads that arrive
//! one byte at a time and bodies that never complete are cut off within their timeouts while the
//! probes keep answering; oversized heads and bodies are refused with their status without lb's
//! memory growing; 10,000 concurrent connections are survived, the probes answer meanwhile, and
//! lb's descriptors return to where they were once the clients close.
//!
//! The limits are lb's own constants (`lb_user::admin`), so the tests follow them.

use std::{
    io::{ErrorKind, Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use lb::admin::{HEADER_READ_TIMEOUT, MAX_BODY_BYTES, MAX_CONNECTIONS, REQUEST_TIMEOUT};
use lb_tests::{
    Host, Lb, free_port, http_get, open_fds, raise_nofile, rss_kib, skip_unless_root, timed,
    wait_until,
};

/// The suite's tests measure lb's descriptors and memory: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// lb on the copy path in front of one server, health loop off (no check socket comes and goes,
/// so its descriptor count is steady); ready.
fn start() -> Result<(Host, Lb)> {
    let h = Host::serving(9000, "s0")?;
    let listen = format!("127.0.0.1:{}", free_port()?);
    let server = h.addr(9000).to_string();
    let lb = Lb::start(&[
        "--listen",
        &listen,
        "--server",
        &server,
        "--datapath",
        "userspace",
        "--health-loop=false",
    ])?;
    lb.wait_ready(Duration::from_secs(10))?;
    Ok((h, lb))
}

/// Probe `/livez` and `/readyz` in turn, 50 ms apart, until `done` (120 s at most); each must
/// answer 200. Returns how many ran and the slowest.
fn probe_until(admin: SocketAddr, done: &AtomicBool) -> Result<(u32, Duration)> {
    let (mut n, mut slowest) = (0u32, Duration::ZERO);
    let deadline = Instant::now() + Duration::from_secs(120);
    while !done.load(Ordering::Relaxed) && Instant::now() < deadline {
        let path = if n % 2 == 0 { "/livez" } else { "/readyz" };
        let t = Instant::now();
        let (c, b) = http_get(admin, path).with_context(|| format!("probe {n} ({path})"))?;
        slowest = slowest.max(t.elapsed());
        ensure!(c == 200, "probe {n}: {path} answered {c} {b}");
        n += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok((n, slowest))
}

/// How a trickling client's connection ended: after how long, and what lb sent back first.
struct Cut {
    after: Duration,
    answer: String,
}

/// Connect, send `first`, then one more byte of `trickle` every `every` until lb closes the
/// connection (or answers and closes); 60 s at most.
fn trickle(admin: SocketAddr, first: &[u8], trickle: u8, every: Duration) -> Result<Cut> {
    let mut s = TcpStream::connect_timeout(&admin, Duration::from_secs(5))?;
    s.set_read_timeout(Some(every))?;
    let start = Instant::now();
    s.write_all(first)?;
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    while start.elapsed() < Duration::from_secs(60) {
        match s.read(&mut buf) {
            Ok(0) => {
                return Ok(Cut {
                    after: start.elapsed(),
                    answer: String::from_utf8_lossy(&answer).into_owned(),
                });
            }
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {
                return Ok(Cut {
                    after: start.elapsed(),
                    answer: String::from_utf8_lossy(&answer).into_owned(),
                });
            }
            Err(e) => return Err(e.into()),
        }
        // A write after lb closed may fail: the read above then sees the end.
        let _ = s.write_all(&[trickle]);
    }
    bail!("still open after 60 s of trickling")
}

/// Connections of each kind in the slow-client test: far below the connection limit.
const SLOW_CLIENTS: usize = 20;

/// Check one kind of trickling client's cuts against `timeout`: none before it (less 300 ms
/// for the clock), none past it plus 3 s (when timed), each first answer as `answered` wants.
/// Returns the shortest and the longest.
fn check_cuts(
    what: &str,
    cuts: &[Cut],
    timeout: Duration,
    answered: impl Fn(&str) -> bool,
) -> Result<(Duration, Duration)> {
    let shortest = cuts.iter().map(|c| c.after).min().unwrap_or_default();
    let longest = cuts.iter().map(|c| c.after).max().unwrap_or_default();
    for c in cuts {
        ensure!(answered(&c.answer), "a trickled {what} got {:?}", c.answer);
    }
    ensure!(
        shortest >= timeout - Duration::from_millis(300),
        "a trickled {what} ended after {shortest:?}, before its timeout {timeout:?}"
    );
    if timed() {
        ensure!(
            longest < timeout + Duration::from_secs(3),
            "a trickled {what} lasted {longest:?} (timeout {timeout:?})"
        );
    }
    Ok((shortest, longest))
}

/// [`SLOW_CLIENTS`] heads sent one byte every 250 ms (never ending: a header value that keeps
/// growing) and as many complete heads whose 1,000-byte body comes one byte every 250 ms,
/// all at once; returns how each kind's connections ended.
fn trickle_all(admin: SocketAddr, server: SocketAddr) -> Result<(Vec<Cut>, Vec<Cut>)> {
    let every = Duration::from_millis(250);
    let head = move || {
        trickle(
            admin,
            b"GET /status HTTP/1.1\r\nHost: lb\r\nX-Slow: ",
            b'a',
            every,
        )
    };
    let body_head = format!(
        "PUT /balancers/default/servers HTTP/1.1\r\nHost: lb\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"servers\": [\"{server}\"]"
    );
    let body = move || trickle(admin, body_head.as_bytes(), b' ', every);
    let heads: Vec<_> = (0..SLOW_CLIENTS)
        .map(|_| std::thread::spawn(head))
        .collect();
    let bodies: Vec<_> = (0..SLOW_CLIENTS)
        .map(|_| std::thread::spawn(body.clone()))
        .collect();
    let join = |v: Vec<std::thread::JoinHandle<Result<Cut>>>| -> Result<Vec<Cut>> {
        v.into_iter()
            .map(|t| t.join().map_err(|_| anyhow::anyhow!("client panicked"))?)
            .collect()
    };
    Ok((join(heads)?, join(bodies)?))
}

#[test]
fn slow_heads_and_bodies_are_cut_off_while_the_probes_answer() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let _g = serial();
    let (h, lb) = start()?;
    let (server, admin) = (h.addr(9000), lb.admin);
    let done = Arc::new(AtomicBool::new(false));
    let prober = {
        let done = done.clone();
        std::thread::spawn(move || probe_until(admin, &done))
    };
    let cuts = trickle_all(admin, server);
    done.store(true, Ordering::Relaxed);
    let (probes, slowest) = prober
        .join()
        .map_err(|_| anyhow::anyhow!("prober panicked"))??;
    let (heads, bodies) = cuts?;
    // hyper closes a connection whose head is late without an answer.
    let (h0, h1) = check_cuts("head", &heads, HEADER_READ_TIMEOUT, str::is_empty)?;
    let timed_out = format!("{{\"error\":\"request timed out after {REQUEST_TIMEOUT:?}\"}}");
    let (b0, b1) = check_cuts("body", &bodies, REQUEST_TIMEOUT, |a| {
        a.starts_with("HTTP/1.1 503 ") && a.contains(&timed_out)
    })?;
    println!(
        "{SLOW_CLIENTS} trickled heads cut after {h0:?}..{h1:?} (head timeout \
         {HEADER_READ_TIMEOUT:?}); {SLOW_CLIENTS} trickled bodies answered 503 and closed after \
         {b0:?}..{b1:?} (request timeout {REQUEST_TIMEOUT:?}); {probes} probes answered 200 \
         meanwhile, the slowest in {slowest:?}"
    );
    ensure!(probes >= 10, "only {probes} probes ran");
    ensure!(
        lb.servers("default")? == vec![server.to_string()],
        "a cut-off body changed the set"
    );
    Ok(())
}

/// What lb answered to one oversized request: its status line and body, and how many of the
/// request's bytes were written before lb closed the connection.
struct Answer {
    status: String,
    body: String,
    written: usize,
}

/// Send `request` in 64 KiB writes from a thread of its own (stopping at the first failed
/// write, once lb has closed) while this thread reads lb's answer to its end.
fn send_oversized(admin: SocketAddr, request: Arc<Vec<u8>>) -> Result<Answer> {
    let mut s = TcpStream::connect_timeout(&admin, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    s.set_write_timeout(Some(Duration::from_secs(20)))?;
    let mut w = s.try_clone()?;
    let writer = std::thread::spawn(move || {
        let mut written = 0;
        for chunk in request.chunks(64 * 1024) {
            if w.write_all(chunk).is_err() {
                break;
            }
            written += chunk.len();
        }
        written
    });
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            // The rest of the request lb did not read resets the connection after its answer.
            Err(e) if e.kind() == ErrorKind::ConnectionReset && !out.is_empty() => break,
            Err(e) => return Err(e).context("reading lb's answer"),
        }
    }
    let _ = s.shutdown(std::net::Shutdown::Both);
    let written = writer
        .join()
        .map_err(|_| anyhow::anyhow!("writer panicked"))?;
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    Ok(Answer {
        status: head.lines().next().unwrap_or_default().to_string(),
        body: body.to_string(),
        written,
    })
}

/// Size of each oversized request.
const HUGE: usize = 4 << 20;

/// A request head that never ends (one 4 MiB header field), a 4 MiB body with its length,
/// and a 4 MiB chunked one; with the status and body text each must get.
fn oversized_requests() -> Vec<(&'static str, Arc<Vec<u8>>, &'static str, String)> {
    let mut head = b"GET /livez HTTP/1.1\r\nHost: lb\r\nX-Big: ".to_vec();
    head.resize(HUGE, b'a');
    let mut sized = format!(
        "PUT /balancers/default/servers HTTP/1.1\r\nHost: lb\r\nContent-Length: {HUGE}\r\n\r\n"
    )
    .into_bytes();
    sized.resize(sized.len() + HUGE, b' ');
    let mut chunked =
        b"POST /balancers/default/servers HTTP/1.1\r\nHost: lb\r\nTransfer-Encoding: chunked\r\n\r\n"
            .to_vec();
    for _ in 0..HUGE / 0x10000 {
        chunked.extend_from_slice(b"10000\r\n");
        chunked.resize(chunked.len() + 0x10000, b' ');
        chunked.extend_from_slice(b"\r\n");
    }
    let too_large = format!("larger than {MAX_BODY_BYTES} bytes");
    vec![
        (
            "head",
            Arc::new(head),
            "HTTP/1.1 431 Request Header Fields Too Large",
            String::new(),
        ),
        (
            "sized body",
            Arc::new(sized),
            "HTTP/1.1 413 Payload Too Large",
            too_large.clone(),
        ),
        (
            "chunked body",
            Arc::new(chunked),
            "HTTP/1.1 413 Payload Too Large",
            too_large,
        ),
    ]
}

/// Rounds of the three oversized requests: 3 × 4 MiB offered each round.
const ROUNDS: usize = 40;
/// How much lb's resident memory may grow over [`ROUNDS`] rounds (480 MiB offered): the
/// allocator's working set for 16 KiB heads and 64 KiB bodies, with room for a debug build.
const RSS_BOUND_KIB: u64 = 32 * 1024;

#[test]
fn oversized_heads_and_bodies_are_refused_and_memory_stays_bounded() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let _g = serial();
    let (_h, lb) = start()?;
    let requests = oversized_requests();
    let check = |round: usize| -> Result<usize> {
        let mut most = 0;
        for (what, req, status, says) in &requests {
            let a = send_oversized(lb.admin, req.clone())?;
            ensure!(
                a.status == *status && a.body.contains(says.as_str()),
                "round {round}, oversized {what}: {:?} {:?}",
                a.status,
                a.body
            );
            if !says.is_empty() {
                let v: serde_json::Value = serde_json::from_str(&a.body)
                    .with_context(|| format!("{what}: not JSON: {}", a.body))?;
                ensure!(v["error"].is_string(), "{what}: {}", a.body);
            }
            most = most.max(a.written);
        }
        Ok(most)
    };
    // Warm up (first allocations, the runtime's buffers), then measure.
    for r in 0..3 {
        check(r)?;
    }
    let (fds, rss) = (open_fds(lb.pid())?, rss_kib(lb.pid())?);
    let start = Instant::now();
    let mut written = 0;
    for r in 0..ROUNDS {
        written = written.max(check(r)?);
    }
    let took = start.elapsed();
    let grown = rss_kib(lb.pid())?.saturating_sub(rss);
    println!(
        "{ROUNDS} rounds of a 4 MiB head, sized body and chunked body in {took:?}: at most {} KiB \
         of one written before lb answered and closed; lb's RSS {rss} KiB, grew {grown} KiB \
         (bound {RSS_BOUND_KIB} KiB)",
        written / 1024
    );
    ensure!(
        grown < RSS_BOUND_KIB,
        "lb's RSS grew {grown} KiB over {ROUNDS} rounds"
    );
    wait_until(Duration::from_secs(10), || Ok(open_fds(lb.pid())? <= fds))
        .with_context(|| format!("lb's descriptors did not return to {fds}"))?;
    ensure!(http_get(lb.admin, "/livez")?.0 == 200);
    Ok(())
}

/// Concurrent admin connections in the flood test.
const FLOOD: usize = 10_000;

/// `n` non-blocking connects to `addr`, waited for until every one is connected or failed
/// (60 s at most: a full accept queue drops SYNs, whose retries take seconds); returns the
/// connected sockets and how many failed.
fn connect_many(addr: SocketAddr, n: usize) -> Result<(Vec<socket2::Socket>, usize)> {
    use socket2::{Domain, Socket, Type};
    let mut pending = Vec::with_capacity(n);
    for _ in 0..n {
        let s = Socket::new(Domain::IPV4, Type::STREAM, None)?;
        s.set_nonblocking(true)?;
        match s.connect(&addr.into()) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
            Err(e) => return Err(e).context("connect"),
        }
        pending.push(s);
    }
    let (mut connected, mut failed) = (Vec::with_capacity(n), 0);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !pending.is_empty() && Instant::now() < deadline {
        let mut still = Vec::new();
        for s in pending {
            if s.peer_addr().is_ok() {
                connected.push(s);
            } else if s.take_error()?.is_some() {
                failed += 1;
            } else {
                still.push(s);
            }
        }
        pending = still;
        std::thread::sleep(Duration::from_millis(20));
    }
    ensure!(
        pending.is_empty(),
        "{} connects still pending after 60 s",
        pending.len()
    );
    Ok((connected, failed))
}

/// Whether lb has closed `s` (end of stream or a reset) without sending anything.
fn closed_by_peer(s: &socket2::Socket) -> Result<bool> {
    let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 1];
    match s.recv(&mut buf) {
        Ok(0) => Ok(true),
        Ok(_) => bail!("lb sent bytes on a connection that sent nothing"),
        Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(false),
        Err(e) if e.kind() == ErrorKind::ConnectionReset => Ok(true),
        Err(e) => Err(e.into()),
    }
}

/// Samples `/proc/PID/fd` every 20 ms until dropped; keeps the highest count.
struct FdPeak {
    done: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<usize>>,
}

impl FdPeak {
    fn start(pid: u32) -> FdPeak {
        let done = Arc::new(AtomicBool::new(false));
        let d = done.clone();
        let thread = std::thread::spawn(move || {
            let mut peak = 0;
            while !d.load(Ordering::Relaxed) {
                peak = peak.max(open_fds(pid).unwrap_or(0));
                std::thread::sleep(Duration::from_millis(20));
            }
            peak
        });
        FdPeak {
            done,
            thread: Some(thread),
        }
    }

    fn stop(mut self) -> usize {
        self.done.store(true, Ordering::Relaxed);
        self.thread.take().and_then(|t| t.join().ok()).unwrap_or(0)
    }
}

impl Drop for FdPeak {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
    }
}

#[test]
fn ten_thousand_connections_are_survived_and_the_probes_get_through() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let _g = serial();
    raise_nofile(FLOOD as u64 + 1024)?;
    let (_h, lb) = start()?;
    let base = open_fds(lb.pid())?;
    let peak = FdPeak::start(lb.pid());
    let t = Instant::now();
    let (conns, failed) = connect_many(lb.admin, FLOOD)?;
    let connected_in = t.elapsed();
    // Every connection is held open, sending nothing; the probes must get through meanwhile.
    let mut probe_lat = Vec::new();
    for i in 0..20 {
        let path = if i % 2 == 0 { "/livez" } else { "/readyz" };
        let t = Instant::now();
        let (c, b) = http_get(lb.admin, path)
            .with_context(|| format!("probe {i} ({path}) with {FLOOD} connections held"))?;
        probe_lat.push(t.elapsed());
        ensure!(c == 200, "probe {i}: {path} answered {c} {b}");
    }
    // The excess is closed: at most the limit stays open.
    let mut open = conns.len();
    wait_until(Duration::from_secs(30), || {
        open = 0;
        for s in &conns {
            if !closed_by_peer(s)? {
                open += 1;
            }
        }
        Ok(open <= MAX_CONNECTIONS)
    })
    .with_context(|| format!("{open} connections still open, limit {MAX_CONNECTIONS}"))?;
    let held_fds = open_fds(lb.pid())?;
    drop(conns);
    wait_until(Duration::from_secs(20), || Ok(open_fds(lb.pid())? <= base))
        .with_context(|| format!("lb's descriptors did not return to {base}"))?;
    let peak = peak.stop();
    probe_lat.sort();
    println!(
        "{FLOOD} admin connections: connected in {connected_in:?} ({failed} failed); {open} open \
         once the excess was closed (limit {MAX_CONNECTIONS}); lb's descriptors {base} before, \
         {held_fds} while held, {peak} at most, back to {} after; 20 probes meanwhile: p50 {:?}, \
         max {:?}",
        open_fds(lb.pid())?,
        probe_lat[probe_lat.len() / 2],
        probe_lat[probe_lat.len() - 1]
    );
    ensure!(failed == 0, "{failed} connects failed");
    // The limit, the probe and one connection lb is closing.
    ensure!(
        peak <= base + MAX_CONNECTIONS + 8,
        "lb held {peak} descriptors (baseline {base}, limit {MAX_CONNECTIONS})"
    );
    ensure!(http_get(lb.admin, "/livez")?.0 == 200);
    Ok(())
}
