//! `lbt`: the test hosts' server and the test client, one binary.
//!
//! Server protocol (first line from the client picks the mode):
//! - `UP\n`, then bytes until EOF → `OK <count> <hash>\n`, close.
//! - `DOWN <n> <seed>\n` → n pseudo-random bytes, FIN; then read until EOF.
//! - `ECHO\n` → echo until EOF, then FIN.
//! - `NAME\n` → `<name>\n`, then hold until EOF.
//! - `PEER\n` → `<name> <the client address as the server sees it>\n`, close.
//! - `ONCE <n>\n` → read n bytes, echo them, close first (the server holds TIME_WAIT, so
//!   clients making many short connections do not run out of ports).
//! - `STALL <ms>\n` → read nothing for ms, then as `UP`.
//! - `STALL <ms> <after>\n` → as `UP`, but stop reading for ms once `after` bytes have arrived.
//! - `GET /path HTTP/1.1` → HTTP response; `/status/NNN` answers NNN; the body names the server.
//!
//! `lbt supervisor` stands in for a K3s/RKE2 server's supervisor (port 9345): plain HTTP/1.1,
//! `GET /ping` answers 200 `pong`, anything else 404; over TLS with `--cert` and `--key`.
//!
//! Client commands print one JSON object per line on stdout. Blocking reads retry on
//! `WouldBlock`: a socket in a sockhash (every client socket sockops adds to lb's `LB_CLIENTS`)
//! can report it spuriously, even a blocking one.

use std::{
    io::{self, BufRead, BufReader, Read, Write},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    time::{Duration, Instant},
};

use clap::{Parser, Subcommand};

#[path = "lbt/edge.rs"]
mod edge;
#[path = "lbt/http_client.rs"]
mod http_client;
#[path = "lbt/streams.rs"]
mod streams;
#[path = "lbt/tls_supervisor.rs"]
mod tls_supervisor;
use lb_tests::{Digest, PatternStream};
use serde_json::json;

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve the test protocol.
    Serve {
        #[arg(long)]
        listen: Vec<SocketAddr>,
        #[arg(long, default_value = "server")]
        name: String,
    },
    /// A stand-in for the K3s/RKE2 supervisor (port 9345): plain HTTP/1.1 on `listen`,
    /// `GET /ping` answers 200 `pong`, any other request 404; one request per connection.
    /// Prints `ready` once it listens.
    Supervisor {
        #[arg(long)]
        listen: SocketAddr,
        /// Serve TLS with this PEM certificate chain (with `--key`).
        #[arg(long, requires = "key")]
        cert: Option<std::path::PathBuf>,
        /// The PEM key of `--cert`.
        #[arg(long, requires = "cert")]
        key: Option<std::path::PathBuf>,
    },
    /// Run one client action against `connect`.
    Client {
        #[arg(long)]
        connect: SocketAddr,
        #[command(subcommand)]
        action: Action,
    },
}

#[derive(Subcommand, Clone)]
enum Action {
    /// Upload n bytes, half-close, check the server's digest.
    Up {
        n: u64,
        #[arg(long, default_value_t = 65536)]
        chunk: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Ask the server to stall reading for this many ms first.
        #[arg(long)]
        stall_ms: Option<u64>,
        /// With `--stall-ms`: the server stalls only after this many bytes.
        #[arg(long, default_value_t = 0)]
        stall_after: u64,
        /// Wait this long after the head line before the data (lets lb pair the connection
        /// first, so the data starts on the splice).
        #[arg(long, default_value_t = 0)]
        pause_ms: u64,
    },
    /// Download n bytes and check them.
    Down {
        n: u64,
        #[arg(long, default_value_t = 7)]
        seed: u64,
    },
    /// `count` echo round trips of `size` bytes; reports p50/p99 in microseconds.
    Rr { count: u32, size: usize },
    /// Connect, learn the server's name, hold until the connection ends; with `--reconnect N`,
    /// reconnect up to N times (for failover tests). Events are printed as they happen.
    Hold {
        #[arg(long, default_value_t = 0)]
        reconnect: u32,
        #[arg(long, default_value_t = 60_000)]
        max_ms: u64,
    },
    /// Connect, print the socket's local address, its peer (`getpeername`) and the server's
    /// name and view of the client's address (`PEER`).
    Peer,
    /// Ask the server to reset the connection; reports how the read side ended.
    Rst,
    /// One socket, two connects: to the address (expected to fail, e.g. with no route), then
    /// to `then`; prints `{"event": "connected", "first_errno", "server"}` once the second
    /// connected and the server said its name, and holds it `hold_ms` before closing.
    Retry {
        /// Bind the socket to this address first (`SO_REUSEADDR`).
        #[arg(long)]
        bind: Option<SocketAddr>,
        #[arg(long)]
        then: SocketAddr,
        #[arg(long, default_value_t = 10_000)]
        hold_ms: u64,
    },
    /// One blocking `connect()` without a time limit of its own (the kernel's SYN retries
    /// bound it): reports whether it connected, and if not its errno and error, with the
    /// milliseconds it took; a connected socket also reports the server's name.
    Dial {
        /// Bind the socket to this address first (`SO_REUSEADDR`), e.g. to pick its source port.
        #[arg(long)]
        bind: Option<SocketAddr>,
        /// Give up after this many milliseconds (the socket is closed still connecting);
        /// reported as `"error": "timed out"` without an errno.
        #[arg(long)]
        timeout_ms: Option<u64>,
        /// Dial this many times, one after another; with more than one, reports only how many
        /// ended with each errno (`"errnos": {"0": connected, "22": ...}`, `-1` for a timeout
        /// of its own), how many connected ones reached each server (`"servers": {name: n}`)
        /// and how many connected ones ended before the server said its name, by errno
        /// (`"after_connect"`), and when the first 100 failed ones started (`"failed_at_ms"`,
        /// since the first dial).
        #[arg(long, default_value_t = 1)]
        times: u32,
        /// Start a dial every this many milliseconds (0: each right after the last).
        #[arg(long, default_value_t = 0)]
        every_ms: u64,
    },
    /// `conns` concurrent connections, each uploading `bytes` and checking the digest.
    Many {
        conns: u32,
        bytes: u64,
        /// Each connection sends a pseudo-random size in 0..=bytes (so they end in random order).
        #[arg(long)]
        random: bool,
        /// Each connection waits this long after its head line before the data (lets lb pair
        /// it first, so the data starts on the splice).
        #[arg(long, default_value_t = 0)]
        pause_ms: u64,
    },
    /// Upload n bytes from a non-blocking (epoll) client; reports CPU time used.
    EpollUp {
        n: u64,
        #[arg(long)]
        stall_ms: Option<u64>,
        /// With `--stall-ms`: the server stalls only after this many bytes.
        #[arg(long, default_value_t = 0)]
        stall_after: u64,
        /// Wait this long after the head line before the data.
        #[arg(long, default_value_t = 0)]
        pause_ms: u64,
    },
    /// Bulk transfer on `conns` parallel connections, n bytes each, checked; `dir` is `up` or
    /// `down`. Reports the total bytes and the wall time until the last one finished.
    Bulk { dir: String, conns: u32, n: u64 },
    /// New connections per second: `workers` threads each loop connect, one `size`-byte
    /// request/response (`ONCE`), close, for `ms` milliseconds; also reports failed ones and the
    /// longest (`longest_ms`, from connect to the server's close).
    Cps {
        ms: u64,
        #[arg(long, default_value_t = 2)]
        workers: u32,
        #[arg(long, default_value_t = 64)]
        size: usize,
    },
    /// Clients at the splice's edges (tuple reuse, kTLS, partial sends): see `lbt/edge.rs`.
    #[command(flatten)]
    Edge(edge::EdgeAction),
    /// One HTTP request (to lb's admin API): see `lbt/http_client.rs`.
    #[command(flatten)]
    Http(http_client::HttpAction),
    /// `conns` long byte-exact echo streams for `ms` milliseconds: see `lbt/streams.rs`.
    Streams {
        conns: u32,
        ms: u64,
        /// Start a round (a chunk each way on every connection) every this many milliseconds.
        #[arg(long, default_value_t = 1000)]
        every_ms: u64,
    },
    /// Open `conns` idle connections (each learns the server's name), print a `ready` event,
    /// then wait until every one is closed or reset and print `all_closed` (or `timeout` after
    /// `max_ms`); each time some end, a `closed` event says how many are still open. Raises its
    /// own open-files limit to the hard limit.
    Idle {
        conns: u32,
        #[arg(long, default_value_t = 120_000)]
        max_ms: u64,
    },
}

fn main() {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Serve { listen, name } => serve(&listen, &name),
        Cmd::Supervisor { listen, cert, key } => supervisor(listen, cert.zip(key)),
        Cmd::Client { connect, action } => {
            let out = match client(connect, action) {
                Ok(v) => v,
                Err(e) => {
                    json!({"ok": false, "error": e.to_string(), "kind": format!("{:?}", e.kind())})
                }
            };
            println!("{out}");
        }
    }
}

/// Stack of one connection's thread (bytes).
const SERVE_STACK_BYTES: usize = 256 * 1024;

fn serve(listen: &[SocketAddr], name: &str) {
    // Thousands of idle connections in the kill tests.
    raise_nofile();
    let mut handles = Vec::new();
    for addr in listen {
        let l = match listen_on(*addr) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("lbt serve: cannot listen on {addr}: {e}");
                std::process::exit(1);
            }
        };
        let name = name.to_string();
        handles.push(std::thread::spawn(move || {
            for conn in l.incoming().flatten() {
                let name = name.clone();
                // A small stack: the kill tests hold 10,000 connections, a thread each. A
                // connection that gets no thread is dropped; the server keeps accepting.
                let spawned = std::thread::Builder::new()
                    .stack_size(SERVE_STACK_BYTES)
                    .spawn(move || {
                        let _ = serve_conn(conn, &name);
                    });
                if let Err(e) = spawned {
                    eprintln!("lbt serve: no thread for a connection: {e}");
                }
            }
        }));
    }
    println!("ready");
    let _ = io::stdout().flush();
    for h in handles {
        let _ = h.join();
    }
}

fn supervisor(listen: SocketAddr, tls: Option<(std::path::PathBuf, std::path::PathBuf)>) {
    let tls = tls.map(|(cert, key)| {
        tls_supervisor::config(&cert, &key).unwrap_or_else(|e| {
            eprintln!("lbt supervisor: {e}");
            std::process::exit(1);
        })
    });
    let l = match listen_on(listen) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("lbt supervisor: cannot listen on {listen}: {e}");
            std::process::exit(1);
        }
    };
    println!("ready");
    let _ = io::stdout().flush();
    if let Some(cfg) = tls {
        return tls_supervisor::serve(&l, &cfg);
    }
    for conn in l.incoming().flatten() {
        std::thread::spawn(move || {
            let _ = supervise_conn(conn);
        });
    }
}

/// Answer one request: read its head (bounded in time and size), `GET /ping` → 200 `pong`,
/// anything else → 404, then close.
fn supervise_conn(conn: TcpStream) -> io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut reader = BufReader::new(conn.try_clone()?.take(16 * 1024));
    let mut w = conn;
    let mut request = String::new();
    reader.read_line(&mut request)?;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" || h == "\n" {
            break;
        }
    }
    let words: Vec<&str> = request.split_whitespace().collect();
    let (status, body) = match words.as_slice() {
        ["GET", "/ping", ..] => ("200 OK", "pong"),
        _ => ("404 Not Found", "404 page not found\n"),
    };
    let resp = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    write_retry(&mut w, resp.as_bytes())?;
    w.shutdown(Shutdown::Write)
}

/// A listener with a deep accept queue: std's `bind` asks for 128, which a burst of 1000
/// connects overflows on a slow machine (a TCG guest), dropping SYNs, health checks included.
fn listen_on(addr: SocketAddr) -> io::Result<TcpListener> {
    let sock = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    sock.set_reuse_address(true)?;
    sock.bind(&addr.into())?;
    sock.listen(4096)?;
    Ok(sock.into())
}

fn read_retry(s: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        match s.read(buf) {
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    || e.kind() == io::ErrorKind::Interrupted =>
            {
                std::thread::sleep(Duration::from_micros(200));
            }
            r => return r,
        }
    }
}

fn write_retry(s: &mut impl Write, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "write returned 0")),
            Ok(n) => buf = &buf[n..],
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    || e.kind() == io::ErrorKind::Interrupted =>
            {
                std::thread::sleep(Duration::from_micros(200));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn serve_conn(conn: TcpStream, name: &str) -> io::Result<()> {
    let _ = conn.set_nodelay(true);
    // Both halves borrow the one socket (no second descriptor: the kill tests hold 10,000
    // connections under a 20,000 open-files limit).
    let mut reader = BufReader::with_capacity(256 * 1024, &conn);
    let mut w = &conn;
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let words: Vec<&str> = line.split_whitespace().collect();
    match words.as_slice() {
        ["UP"] => sink(&mut reader, w, None),
        ["STALL", ms] => {
            std::thread::sleep(Duration::from_millis(ms.parse().unwrap_or(0)));
            sink(&mut reader, w, None)
        }
        ["STALL", ms, after] => {
            let pause = (after.parse().unwrap_or(0), ms.parse().unwrap_or(0));
            sink(&mut reader, w, Some(pause))
        }
        ["DOWN", n, seed] => {
            let n: u64 = n.parse().unwrap_or(0);
            let mut src = PatternStream::new(seed.parse().unwrap_or(7));
            let mut buf = vec![0u8; 256 * 1024];
            let mut left = n;
            while left > 0 {
                let k = usize::try_from(left.min(buf.len() as u64)).unwrap_or(buf.len());
                src.fill(&mut buf[..k]);
                write_retry(&mut w, &buf[..k])?;
                left -= k as u64;
            }
            w.shutdown(Shutdown::Write)?;
            let mut sinkbuf = [0u8; 4096];
            while read_retry(&mut reader, &mut sinkbuf)? > 0 {}
            Ok(())
        }
        ["ECHO"] => {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = read_retry(&mut reader, &mut buf)?;
                if n == 0 {
                    w.shutdown(Shutdown::Write)?;
                    return Ok(());
                }
                write_retry(&mut w, &buf[..n])?;
            }
        }
        ["RST"] => {
            // Answer, then reset the connection (SO_LINGER 0 + close).
            write_retry(&mut w, b"bye\n")?;
            std::thread::sleep(Duration::from_millis(50));
            socket2::SockRef::from(&w).set_linger(Some(Duration::ZERO))?;
            Ok(())
        }
        ["ONCE", n] => {
            let mut buf = vec![0u8; n.parse().unwrap_or(0)];
            reader.read_exact(&mut buf)?;
            write_retry(&mut w, &buf)?;
            Ok(())
        }
        ["PEER"] => {
            let seen = w.peer_addr()?;
            write_retry(&mut w, format!("{name} {seen}\n").as_bytes())?;
            Ok(())
        }
        ["NAME"] => {
            write_retry(&mut w, format!("{name}\n").as_bytes())?;
            let mut buf = [0u8; 4096];
            while read_retry(&mut reader, &mut buf)? > 0 {}
            Ok(())
        }
        ["GET", path, ..] => {
            loop {
                let mut h = String::new();
                if reader.read_line(&mut h)? == 0 || h == "\r\n" || h == "\n" {
                    break;
                }
            }
            let code: u16 = path
                .strip_prefix("/status/")
                .and_then(|c| c.parse().ok())
                .unwrap_or(200);
            let body = format!("{name}\n");
            let resp = format!(
                "HTTP/1.1 {code} X\r\nContent-Length: {}\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            write_retry(&mut w, resp.as_bytes())?;
            w.shutdown(Shutdown::Write)
        }
        _ => w.shutdown(Shutdown::Both),
    }
}

/// Read until EOF and answer with the count and digest; with `pause = (after, ms)`, stop
/// reading for ms once `after` bytes have arrived.
fn sink(reader: &mut impl Read, w: &TcpStream, mut pause: Option<(u64, u64)>) -> io::Result<()> {
    let mut d = Digest::default();
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        if let Some((after, ms)) = pause
            && d.count() >= after
        {
            std::thread::sleep(Duration::from_millis(ms));
            pause = None;
        }
        let want = match pause {
            Some((after, _)) => {
                usize::try_from(after - d.count()).map_or(buf.len(), |l| l.min(buf.len()))
            }
            None => buf.len(),
        };
        let n = read_retry(reader, &mut buf[..want])?;
        if n == 0 {
            break;
        }
        d.update(&buf[..n]);
    }
    write_retry(
        &mut { w },
        format!("OK {} {:016x}\n", d.count(), d.finish()).as_bytes(),
    )?;
    w.shutdown(Shutdown::Write)
}

fn connect(addr: SocketAddr) -> io::Result<TcpStream> {
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(15))?;
    s.set_nodelay(true)?;
    Ok(s)
}

fn read_line(s: &mut TcpStream) -> io::Result<String> {
    let mut out = Vec::new();
    let mut b = [0u8; 1];
    loop {
        if read_retry(s, &mut b)? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "closed before a full line",
            ));
        }
        if b[0] == b'\n' {
            return Ok(String::from_utf8_lossy(&out).into_owned());
        }
        out.push(b[0]);
        if out.len() > 4096 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "line too long"));
        }
    }
}

fn client(addr: SocketAddr, action: Action) -> io::Result<serde_json::Value> {
    let start = Instant::now();
    match action {
        Action::Up {
            n,
            chunk,
            seed,
            stall_ms,
            stall_after,
            pause_ms,
        } => {
            let mut s = connect(addr)?;
            let head = stall_head(stall_ms, stall_after);
            write_retry(&mut s, head.as_bytes())?;
            std::thread::sleep(Duration::from_millis(pause_ms));
            let mut src = PatternStream::new(seed);
            let mut d = Digest::default();
            let mut buf = vec![0u8; chunk.max(1)];
            let mut left = n;
            while left > 0 {
                let k = usize::try_from(left.min(buf.len() as u64)).unwrap_or(buf.len());
                src.fill(&mut buf[..k]);
                d.update(&buf[..k]);
                write_retry(&mut s, &buf[..k])?;
                left -= k as u64;
            }
            s.shutdown(Shutdown::Write)?;
            let reply = read_line(&mut s)?;
            let want = format!("OK {} {:016x}", d.count(), d.finish());
            Ok(
                json!({"ok": reply == want, "bytes": n, "secs": start.elapsed().as_secs_f64(), "reply": reply, "want": want}),
            )
        }
        Action::Down { n, seed } => {
            let mut s = connect(addr)?;
            write_retry(&mut s, format!("DOWN {n} {seed}\n").as_bytes())?;
            let mut expect = PatternStream::new(seed);
            let mut buf = vec![0u8; 256 * 1024];
            let mut want = vec![0u8; 256 * 1024];
            let mut got = 0u64;
            let mut same = true;
            loop {
                let k = read_retry(&mut s, &mut buf)?;
                if k == 0 {
                    break;
                }
                expect.fill(&mut want[..k]);
                same &= buf[..k] == want[..k];
                got += k as u64;
            }
            s.shutdown(Shutdown::Write)?;
            Ok(json!({"ok": same && got == n, "bytes": got, "secs": start.elapsed().as_secs_f64()}))
        }
        Action::Rr { count, size } => {
            let mut s = connect(addr)?;
            write_retry(&mut s, b"ECHO\n")?;
            let msg = vec![0x5au8; size.max(1)];
            let mut back = vec![0u8; size.max(1)];
            // Reserved up to a million: a client told to echo "forever" (a huge count, ended
            // by an error) must not ask for gigabytes up front, which a small VM refuses.
            let mut lat = Vec::with_capacity((count as usize).min(1 << 20));
            for _ in 0..count {
                let t = Instant::now();
                write_retry(&mut s, &msg)?;
                let mut got = 0;
                while got < back.len() {
                    let k = read_retry(&mut s, &mut back[got..])?;
                    if k == 0 {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "echo closed early",
                        ));
                    }
                    got += k;
                }
                lat.push(t.elapsed().as_secs_f64() * 1e6);
            }
            s.shutdown(Shutdown::Write)?;
            lat.sort_by(f64::total_cmp);
            let pct = |p: f64| {
                lat.get(((lat.len() as f64 - 1.0) * p) as usize)
                    .copied()
                    .unwrap_or(0.0)
            };
            Ok(json!({"ok": back == msg, "p50_us": pct(0.5), "p99_us": pct(0.99), "count": count}))
        }
        Action::Hold { reconnect, max_ms } => {
            let deadline = Instant::now() + Duration::from_millis(max_ms);
            for attempt in 0..=reconnect {
                let t = Instant::now();
                let mut s = match connect(addr) {
                    Ok(s) => s,
                    Err(e) => {
                        println!(
                            "{}",
                            json!({"event": "connect_error", "error": e.to_string(), "ms": start.elapsed().as_millis() as u64})
                        );
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    }
                };
                s.set_read_timeout(Some(
                    deadline
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(1)),
                ))?;
                let _ = write_retry(&mut s, b"NAME\n");
                let name = match read_line(&mut s) {
                    Ok(n) => n,
                    Err(e) => {
                        println!(
                            "{}",
                            json!({"event": "closed", "how": e.kind().to_string(), "attempt": attempt, "ms": start.elapsed().as_millis() as u64})
                        );
                        let _ = io::stdout().flush();
                        continue;
                    }
                };
                println!(
                    "{}",
                    json!({"event": "connected", "server": name, "attempt": attempt, "ms": start.elapsed().as_millis() as u64, "connect_ms": t.elapsed().as_millis() as u64})
                );
                let _ = io::stdout().flush();
                let mut buf = [0u8; 1024];
                let how = loop {
                    match s.read(&mut buf) {
                        Ok(0) => break "eof".to_string(),
                        Ok(_) => {}
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e)
                            if e.kind() == io::ErrorKind::WouldBlock
                                && Instant::now() < deadline =>
                        {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        Err(e) => break e.kind().to_string(),
                    }
                };
                println!(
                    "{}",
                    json!({"event": "closed", "how": how, "server": name, "attempt": attempt, "ms": start.elapsed().as_millis() as u64})
                );
                let _ = io::stdout().flush();
                if Instant::now() >= deadline {
                    break;
                }
            }
            Ok(json!({"ok": true, "event": "done"}))
        }
        Action::EpollUp {
            n,
            stall_ms,
            stall_after,
            pause_ms,
        } => epoll_up(addr, n, (stall_ms, stall_after), pause_ms),
        Action::Bulk { dir, conns, n } => bulk(addr, &dir, conns, n),
        Action::Cps { ms, workers, size } => cps(addr, ms, workers, size),
        Action::Idle { conns, max_ms } => idle(addr, conns, max_ms),
        Action::Streams {
            conns,
            ms,
            every_ms,
        } => streams::run(addr, conns, ms, every_ms),
        Action::Edge(edge) => edge::run(addr, edge),
        Action::Http(http) => http_client::run(addr, http),
        Action::Peer => {
            let mut s = connect(addr)?;
            let local = s.local_addr()?;
            let peer = s.peer_addr()?;
            write_retry(&mut s, b"PEER\n")?;
            let line = read_line(&mut s)?;
            let (name, seen) = line.split_once(' ').unwrap_or((line.as_str(), ""));
            Ok(
                json!({"ok": true, "local": local.to_string(), "peer": peer.to_string(), "server": name, "server_sees": seen}),
            )
        }
        Action::Dial {
            bind,
            timeout_ms,
            times,
            every_ms,
        } if times > 1 || bind.is_some() || timeout_ms.is_some() => dial_times(
            addr,
            bind,
            timeout_ms.map(Duration::from_millis),
            times,
            Duration::from_millis(every_ms),
        ),
        Action::Dial { .. } => {
            let t = Instant::now();
            match TcpStream::connect(addr) {
                Ok(mut s) => {
                    let ms = t.elapsed().as_millis() as u64;
                    write_retry(&mut s, b"NAME\n")?;
                    let name = read_line(&mut s)?;
                    Ok(json!({"ok": true, "ms": ms, "server": name}))
                }
                Err(e) => Ok(json!({
                    "ok": false,
                    "ms": t.elapsed().as_millis() as u64,
                    "errno": e.raw_os_error(),
                    "error": e.kind().to_string(),
                })),
            }
        }
        Action::Retry {
            bind,
            then,
            hold_ms,
        } => {
            let sock = tcp_socket(addr, bind)?;
            let first = sock
                .connect(&addr.into())
                .err()
                .and_then(|e| e.raw_os_error());
            sock.connect(&then.into())?;
            let mut s: TcpStream = sock.into();
            write_retry(&mut s, b"NAME\n")?;
            let name = read_line(&mut s)?;
            println!(
                "{}",
                json!({"event": "connected", "first_errno": first, "server": name})
            );
            io::stdout().flush()?;
            std::thread::sleep(Duration::from_millis(hold_ms));
            Ok(json!({"ok": true, "event": "done"}))
        }
        Action::Rst => {
            let mut s = connect(addr)?;
            write_retry(&mut s, b"RST\n")?;
            let line = read_line(&mut s)?;
            let mut buf = [0u8; 64];
            let how = loop {
                match s.read(&mut buf) {
                    Ok(0) => break "eof".to_string(),
                    Ok(_) => {}
                    Err(e)
                        if e.kind() == io::ErrorKind::WouldBlock
                            || e.kind() == io::ErrorKind::Interrupted =>
                    {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(e) => break e.kind().to_string(),
                }
            };
            Ok(json!({"ok": line == "bye", "how": how}))
        }
        Action::Many {
            conns,
            bytes,
            random,
            pause_ms,
        } => {
            let handles: Vec<_> = (0..conns)
                .map(|i| {
                    let n = if random {
                        let mut b = [0u8; 8];
                        PatternStream::new(u64::from(i) + 1000).fill(&mut b);
                        u64::from_le_bytes(b) % (bytes + 1)
                    } else {
                        bytes
                    };
                    let chunk = if random {
                        1 + (n as usize % 65536)
                    } else {
                        1024
                    };
                    let seed = u64::from(i) + 11;
                    std::thread::spawn(move || {
                        client(
                            addr,
                            Action::Up {
                                n,
                                chunk,
                                seed,
                                stall_ms: None,
                                stall_after: 0,
                                pause_ms,
                            },
                        )
                    })
                })
                .collect();
            let mut ok = 0u32;
            let mut errors = Vec::new();
            for h in handles {
                match h.join() {
                    Ok(Ok(v)) if v["ok"] == true => ok += 1,
                    Ok(Ok(v)) => errors.push(v.to_string()),
                    Ok(Err(e)) => errors.push(e.to_string()),
                    Err(_) => errors.push("panic".into()),
                }
            }
            errors.truncate(5);
            Ok(json!({"ok": ok == conns, "succeeded": ok, "conns": conns, "errors": errors}))
        }
    }
}

fn bulk(addr: SocketAddr, dir: &str, conns: u32, n: u64) -> io::Result<serde_json::Value> {
    if dir != "up" && dir != "down" {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "direction is up or down",
        ));
    }
    let start = Instant::now();
    let handles: Vec<_> = (0..conns)
        .map(|i| {
            let action = if dir == "up" {
                Action::Up {
                    n,
                    chunk: 65536,
                    seed: u64::from(i) + 1,
                    stall_ms: None,
                    stall_after: 0,
                    pause_ms: 0,
                }
            } else {
                Action::Down {
                    n,
                    seed: u64::from(i) + 7,
                }
            };
            std::thread::spawn(move || client(addr, action))
        })
        .collect();
    let (mut ok, mut bytes, mut errors) = (0u32, 0u64, Vec::new());
    for h in handles {
        match h.join() {
            Ok(Ok(v)) if v["ok"] == true => {
                ok += 1;
                bytes += v["bytes"].as_u64().unwrap_or(0);
            }
            Ok(Ok(v)) => errors.push(v.to_string()),
            Ok(Err(e)) => errors.push(e.to_string()),
            Err(_) => errors.push("panic".into()),
        }
    }
    let secs = start.elapsed().as_secs_f64();
    errors.truncate(3);
    Ok(json!({
        "ok": ok == conns, "conns": conns, "bytes": bytes, "secs": secs,
        "gbit_s": bytes as f64 * 8.0 / secs / 1e9, "errors": errors,
    }))
}

fn cps(addr: SocketAddr, ms: u64, workers: u32, size: usize) -> io::Result<serde_json::Value> {
    let start = Instant::now();
    let end = start + Duration::from_millis(ms);
    let one = move || -> io::Result<()> {
        let mut s = connect(addr)?;
        let mut msg = format!("ONCE {size}\n").into_bytes();
        msg.resize(msg.len() + size, 0x33);
        write_retry(&mut s, &msg)?;
        let mut back = vec![0u8; size];
        let mut got = 0;
        while got < size {
            match read_retry(&mut s, &mut back[got..])? {
                0 => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
                k => got += k,
            }
        }
        // Wait for the server's FIN so the server side closes first.
        let mut rest = [0u8; 16];
        while read_retry(&mut s, &mut rest)? > 0 {}
        if back.iter().all(|&b| b == 0x33) {
            Ok(())
        } else {
            Err(io::Error::new(io::ErrorKind::InvalidData, "echo differs"))
        }
    };
    let handles: Vec<_> = (0..workers.max(1))
        .map(|_| {
            std::thread::spawn(move || {
                let (mut done, mut failed, mut last_error) = (0u64, 0u64, String::new());
                let mut longest = Duration::ZERO;
                while Instant::now() < end {
                    let began = Instant::now();
                    let r = one();
                    longest = longest.max(began.elapsed());
                    match r {
                        Ok(()) => done += 1,
                        Err(e) => {
                            failed += 1;
                            last_error = e.to_string();
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    }
                }
                (done, failed, last_error, longest)
            })
        })
        .collect();
    let (mut done, mut failed, mut errors) = (0u64, 0u64, Vec::new());
    let mut longest = Duration::ZERO;
    for h in handles {
        let (d, f, e, l) = h.join().unwrap_or((0, 1, "panic".into(), Duration::ZERO));
        done += d;
        failed += f;
        longest = longest.max(l);
        if !e.is_empty() {
            errors.push(e);
        }
    }
    let secs = start.elapsed().as_secs_f64();
    Ok(json!({
        "ok": done > 0 && failed == 0, "conns": done, "failed": failed, "secs": secs,
        "per_s": done as f64 / secs, "errors": errors,
        "longest_ms": longest.as_secs_f64() * 1e3,
    }))
}

fn raise_nofile() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

fn idle(addr: SocketAddr, conns: u32, max_ms: u64) -> io::Result<serde_json::Value> {
    use std::os::fd::AsFd as _;

    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    raise_nofile();
    let start = Instant::now();
    let deadline = start + Duration::from_millis(max_ms);
    let mut socks = Vec::with_capacity(conns as usize);
    for _ in 0..conns {
        let mut s = connect(addr)?;
        write_retry(&mut s, b"NAME\n")?;
        read_line(&mut s)?;
        socks.push(s);
    }
    println!(
        "{}",
        json!({"event": "ready", "conns": conns, "ms": start.elapsed().as_millis() as u64})
    );
    let _ = io::stdout().flush();
    let ready_at = Instant::now();
    let (mut resets, mut eofs, mut others) = (0u32, 0u32, 0u32);
    let mut first_ms = None;
    let mut buf = [0u8; 256];
    while !socks.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(json!({"ok": false, "event": "timeout", "open": socks.len(),
                "resets": resets, "eofs": eofs}));
        }
        let ms = u16::try_from(left.as_millis().min(1000)).unwrap_or(1000);
        let mut fds: Vec<PollFd<'_>> = socks
            .iter()
            .map(|s| PollFd::new(s.as_fd(), PollFlags::POLLIN))
            .collect();
        poll(&mut fds, PollTimeout::from(ms)).map_err(io::Error::from)?;
        let ended: Vec<bool> = fds
            .iter()
            .map(|f| f.revents().is_some_and(|r| !r.is_empty()))
            .collect();
        drop(fds);
        let socks_before = socks.len();
        let mut keep = Vec::with_capacity(socks.len());
        for (mut s, ended) in socks.into_iter().zip(ended) {
            if !ended {
                keep.push(s);
                continue;
            }
            match s.read(&mut buf) {
                Ok(0) => eofs += 1,
                Ok(_) => {
                    keep.push(s);
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    keep.push(s);
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => resets += 1,
                Err(_) => others += 1,
            }
            first_ms.get_or_insert(ready_at.elapsed().as_secs_f64() * 1e3);
        }
        if keep.len() < socks_before {
            println!(
                "{}",
                json!({"event": "closed", "open": keep.len(), "closed": socks_before - keep.len(),
                    "ms": ready_at.elapsed().as_secs_f64() * 1e3})
            );
            let _ = io::stdout().flush();
        }
        socks = keep;
    }
    Ok(json!({
        "ok": true, "event": "all_closed", "resets": resets, "eofs": eofs, "others": others,
        "first_ms": first_ms, "last_ms": ready_at.elapsed().as_secs_f64() * 1e3,
    }))
}

fn cpu_time() -> Duration {
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF);
    usage.map_or(Duration::ZERO, |u| {
        let t = |tv: nix::sys::time::TimeVal| {
            Duration::new(tv.tv_sec() as u64, tv.tv_usec() as u32 * 1000)
        };
        t(u.user_time()) + t(u.system_time())
    })
}

/// The `STALL` head line for a stall of `ms` after `after` bytes (`UP` without a stall).
fn stall_head(stall_ms: Option<u64>, after: u64) -> String {
    match stall_ms {
        None => "UP\n".to_string(),
        Some(ms) if after > 0 => format!("STALL {ms} {after}\n"),
        Some(ms) => format!("STALL {ms}\n"),
    }
}

fn epoll_up(
    addr: SocketAddr,
    n: u64,
    (stall_ms, stall_after): (Option<u64>, u64),
    pause_ms: u64,
) -> io::Result<serde_json::Value> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        s.write_all(stall_head(stall_ms, stall_after).as_bytes())
            .await?;
        tokio::time::sleep(Duration::from_millis(pause_ms)).await;
        let start = Instant::now();
        let cpu0 = cpu_time();
        // The stall window starts once `stall_after` bytes are written.
        let mut window = (stall_after == 0).then_some((start, cpu0));
        let mut src = PatternStream::new(3);
        let mut d = Digest::default();
        let mut buf = vec![0u8; 65536];
        let mut left = n;
        // CPU used while the server stalls (stall_ms from the window's start).
        let mut stall_cpu = None;
        while left > 0 {
            let k = usize::try_from(left.min(buf.len() as u64)).unwrap_or(buf.len());
            src.fill(&mut buf[..k]);
            d.update(&buf[..k]);
            s.write_all(&buf[..k]).await?;
            left -= k as u64;
            if window.is_none() && n - left >= stall_after {
                window = Some((Instant::now(), cpu_time()));
            }
            if let Some((w0, c0)) = window
                && stall_cpu.is_none()
                && stall_ms.is_some_and(|ms| w0.elapsed() >= Duration::from_millis(ms))
            {
                stall_cpu = Some(((cpu_time() - c0).as_secs_f64(), w0.elapsed().as_secs_f64()));
            }
        }
        s.shutdown().await?;
        let mut reply = String::new();
        s.read_to_string(&mut reply).await?;
        let want = format!("OK {} {:016x}\n", d.count(), d.finish());
        let (stall_cpu_s, stall_wall_s) = stall_cpu.unwrap_or((f64::NAN, f64::NAN));
        Ok(json!({
            "ok": reply == want,
            "bytes": n,
            "cpu_s": (cpu_time() - cpu0).as_secs_f64(),
            "wall_s": start.elapsed().as_secs_f64(),
            "stall_cpu_s": stall_cpu_s,
            "stall_wall_s": stall_wall_s,
            "reply": reply.trim(),
        }))
    })
}

/// A TCP socket of `addr`'s family, bound to `bind` first (`SO_REUSEADDR`) when given.
fn tcp_socket(addr: SocketAddr, bind: Option<SocketAddr>) -> io::Result<socket2::Socket> {
    let sock = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    if let Some(bind) = bind {
        sock.set_reuse_address(true)?;
        sock.bind(&bind.into())?;
    }
    Ok(sock)
}

/// `times` dials of `addr` from a socket bound to `bind` (when given), each given up after
/// `timeout` (when given) by closing it. One dial reports as `dial` does; more report how many
/// ended with each errno (0 connected, -1 given up), how many connected ones reached each
/// server by name, and how many connected ones ended before the name came (by errno; the
/// connection was reset or aborted). With `every`, dial `i` starts `every × i` after the first
/// (or at once when the ones before took longer).
fn dial_times(
    addr: SocketAddr,
    bind: Option<SocketAddr>,
    timeout: Option<Duration>,
    times: u32,
    every: Duration,
) -> io::Result<serde_json::Value> {
    let mut errnos = std::collections::BTreeMap::<String, u32>::new();
    let mut servers = std::collections::BTreeMap::<String, u32>::new();
    let mut after = std::collections::BTreeMap::<String, u32>::new();
    let mut last = json!({});
    let mut failed_at = Vec::new();
    let start = Instant::now();
    for i in 0..times {
        if let Some(wait) = (every * i).checked_sub(start.elapsed()) {
            std::thread::sleep(wait);
        }
        let t = Instant::now();
        let sock = tcp_socket(addr, bind)?;
        let r = match timeout {
            Some(d) => sock.connect_timeout(&addr.into(), d),
            None => sock.connect(&addr.into()),
        };
        let ms = t.elapsed().as_millis() as u64;
        let errno = match &r {
            Ok(()) => 0,
            Err(e) => e.raw_os_error().unwrap_or(-1),
        };
        *errnos.entry(errno.to_string()).or_default() += 1;
        if errno != 0 && failed_at.len() < 100 {
            failed_at.push(start.elapsed().as_millis() as u64);
        }
        last = match r {
            Ok(()) if times > 1 => {
                let mut s: TcpStream = sock.into();
                match write_retry(&mut s, b"NAME\n").and_then(|()| read_line(&mut s)) {
                    Ok(name) => *servers.entry(name).or_default() += 1,
                    Err(e) => {
                        *after
                            .entry(e.raw_os_error().unwrap_or(-1).to_string())
                            .or_default() += 1;
                    }
                }
                json!({})
            }
            Ok(()) => {
                let mut s: TcpStream = sock.into();
                write_retry(&mut s, b"NAME\n")?;
                let name = read_line(&mut s)?;
                json!({"ok": true, "ms": ms, "server": name})
            }
            Err(e) => json!({
                "ok": false,
                "ms": ms,
                "errno": e.raw_os_error(),
                "error": e.kind().to_string(),
            }),
        };
    }
    if times == 1 {
        return Ok(last);
    }
    Ok(json!({
        "ok": errnos.keys().all(|k| k == "0"),
        "errnos": errnos,
        "servers": servers,
        "after_connect": after,
        "failed_at_ms": failed_at,
    }))
}
