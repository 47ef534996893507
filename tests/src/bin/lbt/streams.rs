//! `lbt client ADDR streams CONNS MS`: long byte-exact streams for the churn soak. Opens `CONNS`
//! `ECHO` connections, then in rounds (one every `--every-ms`) sends each a chunk of its own
//! pseudo-random stream and reads the echo back, checking every byte against the stream (so a
//! lost, duplicated or reordered byte is caught where it happens), until `MS` have passed.
//! Prints `{"event": "ready"}` once every connection is open, and at the end one JSON line:
//! `ok`, `conns`, `rounds`, `bytes` (checked, in both directions together) and, on a failure,
//! which connection, round and what.

use std::{
    io::{self, Write as _},
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use lb_tests::PatternStream;
use serde_json::{Value, json};

/// Bytes each connection sends per round.
const CHUNK: usize = 1024;

/// How long one echo may take to come back before the stream counts as stalled.
const ECHO_TIMEOUT: Duration = Duration::from_secs(20);

/// One stream: its socket, what it sends and what it expects back (the same stream).
struct Stream {
    sock: TcpStream,
    send: PatternStream,
    expect: PatternStream,
}

/// Run the streams; see the module doc.
///
/// # Errors
/// A connection that cannot be opened (the result then never says `ok`).
pub fn run(addr: SocketAddr, conns: u32, ms: u64, every_ms: u64) -> io::Result<Value> {
    super::raise_nofile();
    let start = Instant::now();
    let mut streams = Vec::with_capacity(conns as usize);
    for i in 0..conns {
        let mut sock = super::connect(addr)?;
        super::write_retry(&mut sock, b"ECHO\n")?;
        sock.set_read_timeout(Some(Duration::from_secs(1)))?;
        let seed = 0x5eed_0000 + u64::from(i);
        streams.push(Stream {
            sock,
            send: PatternStream::new(seed),
            expect: PatternStream::new(seed),
        });
    }
    println!(
        "{}",
        json!({"event": "ready", "conns": conns, "ms": start.elapsed().as_millis() as u64})
    );
    let _ = io::stdout().flush();
    let until = Instant::now() + Duration::from_millis(ms);
    let every = Duration::from_millis(every_ms);
    let (mut rounds, mut bytes) = (0u64, 0u64);
    let (mut out, mut want, mut got) = ([0u8; CHUNK], [0u8; CHUNK], [0u8; CHUNK]);
    while Instant::now() < until {
        let round_start = Instant::now();
        for (i, s) in streams.iter_mut().enumerate() {
            s.send.fill(&mut out);
            if let Err(e) = super::write_retry(&mut s.sock, &out) {
                return Ok(failure(i, rounds, bytes, &format!("send: {e}")));
            }
        }
        for (i, s) in streams.iter_mut().enumerate() {
            s.expect.fill(&mut want);
            if let Err(e) = read_exact(&mut s.sock, &mut got) {
                return Ok(failure(i, rounds, bytes, &format!("echo: {e}")));
            }
            if let Some(at) = want.iter().zip(&got).position(|(a, b)| a != b) {
                let offset = rounds * CHUNK as u64 + at as u64;
                return Ok(failure(
                    i,
                    rounds,
                    bytes,
                    &format!("byte {offset} of the stream differs"),
                ));
            }
            bytes += 2 * CHUNK as u64;
        }
        rounds += 1;
        std::thread::sleep(every.saturating_sub(round_start.elapsed()));
    }
    for s in &streams {
        let _ = s.sock.shutdown(std::net::Shutdown::Write);
    }
    Ok(
        json!({"ok": true, "conns": conns, "rounds": rounds, "bytes": bytes,
        "ms": start.elapsed().as_millis() as u64}),
    )
}

/// Fill `buf` from `s` (a blocking socket with a 1 s read timeout), retrying its timeouts and
/// spurious `WouldBlock` (see the crate doc) until [`ECHO_TIMEOUT`].
fn read_exact(s: &mut TcpStream, buf: &mut [u8]) -> io::Result<()> {
    use std::io::Read as _;
    let deadline = Instant::now() + ECHO_TIMEOUT;
    let mut at = 0;
    while at < buf.len() {
        match s.read(&mut buf[at..]) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed")),
            Ok(n) => at += n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                if Instant::now() > deadline {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "no echo"));
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn failure(conn: usize, round: u64, bytes: u64, what: &str) -> Value {
    json!({"ok": false, "conn": conn, "round": round, "bytes": bytes, "error": what})
}
