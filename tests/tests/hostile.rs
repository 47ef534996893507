//! Hostile peers of a real `lb` (the copy path, `--datapath userspace`). Servers written in the
//! test with std sockets inside test hosts' namespaces (`peer.rs`): one that sends garbage as
//! soon as it accepts, one that half-closes at once, one that answers health checks slower than
//! their timeout, with a multi-megabyte head or body, or with a body that never ends. Clients
//! (`clients.rs`): thousands of connections opened and abandoned without a byte, and a flood of
//! 20,000 connects while a normal client keeps doing round trips.
//!
//! What must hold is asserted: a check fails (or passes) as `docs/health-checks.md` says, within
//! its timeout plus a bound, reading a bounded number of bytes; lb's memory stays bounded, its
//! descriptors return to where they were, other clients are served. Timing bounds hold only
//! when `lb_tests::timed()`; the figures are printed (`--nocapture`).

// A test target's root resolves modules beside it, as a crate root does: these live in hostile/.
#[path = "hostile/clients.rs"]
mod clients;
#[path = "hostile/peer.rs"]
mod peer;

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use lb_tests::{
    Fixture, Host, Toml, free_port, open_fds, rss_kib, skip_unless_root, timed, wait_server_state,
    wait_until,
};
use peer::{Behaviour, Peer, Served};

/// lb on the copy path; one balancer `name` per entry of `balancers`, over its servers, with
/// its `[balancer.health]` lines. The first balancer listens on the fixture's address, the
/// others on free ports (returned in order).
fn start_lb(
    host: Host,
    port: u16,
    balancers: &[(&str, Vec<SocketAddr>, &str)],
) -> Result<(Fixture, Vec<SocketAddr>)> {
    let mut listens = Vec::new();
    for _ in 1..balancers.len() {
        listens.push(format!("127.0.0.1:{}", free_port()?).parse::<SocketAddr>()?);
    }
    let others = listens.clone();
    let config = move |_: &lb_tests::TestCgroup, listen: SocketAddr| {
        let mut t = Toml::new().table("datapath").string("mode", "userspace");
        for (i, (name, servers, health)) in balancers.iter().enumerate() {
            let l = if i == 0 { listen } else { others[i - 1] };
            let servers: Vec<String> = servers.iter().map(|s| format!("\"{s}\"")).collect();
            t = t
                .array_table("balancer")
                .string("name", name)
                .value("listen", format!("[\"{l}\"]"))
                .value("servers", format!("[{}]", servers.join(", ")))
                .table("balancer.health")
                .lines(health);
        }
        t
    };
    let f = Fixture::start(vec![host], port, config, &[])?;
    let mut all = vec![f.listen];
    all.extend(listens);
    Ok((f, all))
}

/// `[balancer.health]` of an HTTP check of `GET /healthz`.
fn http_check(interval: &str, timeout: &str, fall: u32) -> String {
    format!(
        "kind = \"http\"\nurl = \"http://{{server}}/healthz\"\ninterval = \"{interval}\"\ntimeout = \"{timeout}\"\nfall = {fall}\nrise = 1\n"
    )
}

/// The `last_error` `/status` gives `server` of `balancer`.
fn last_error(f: &Fixture, balancer: &str, server: SocketAddr) -> Result<String> {
    let b = f.lb.balancer(balancer)?;
    let s = b["servers"]
        .as_array()
        .and_then(|v| {
            v.iter()
                .find(|s| s["address"] == server.to_string().as_str())
        })
        .with_context(|| format!("{server} not in {b}"))?;
    Ok(s["last_error"].as_str().unwrap_or_default().to_string())
}

/// Failed checks of `server` so far (`lb_health_checks_total{result="failure"}`).
fn failures(f: &Fixture, server: SocketAddr) -> f64 {
    f.lb.metric(
        "lb_health_checks_total",
        &format!("server=\"{server}\",result=\"failure\""),
    )
}

#[test]
fn garbage_fails_an_http_check_and_a_tcp_check_passes_it_through() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let host = Host::new()?;
    let junk = peer::garbage();
    let sent = junk.clone();
    let p = Peer::start(
        &host,
        9000,
        Arc::new(move |c| {
            if c.write(&sent) {
                c.wait_closed(Duration::from_secs(30));
            }
        }),
    )?;
    let (f, listens) = start_lb(
        host,
        9000,
        &[
            ("tcp", vec![p.addr], ""),
            ("http", vec![p.addr], &http_check("200ms", "1s", 1)),
        ],
    )?;
    wait_server_state(
        &f.lb,
        "http",
        &p.addr.to_string(),
        "FAILED",
        Duration::from_secs(10),
    )?;
    let err = last_error(&f, "http", p.addr)?;
    ensure!(
        err.starts_with("http: "),
        "the HTTP error is not named: {err:?}"
    );
    // The tcp-checked balancer serves the same server: its client gets the garbage as sent.
    let mut c = std::net::TcpStream::connect_timeout(&listens[0], Duration::from_secs(5))?;
    c.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut got = vec![0u8; junk.len()];
    std::io::Read::read_exact(&mut c, &mut got)?;
    ensure!(got == junk, "the garbage arrived changed");
    drop(c);
    wait_until(Duration::from_secs(10), || {
        Ok(f.lb.metric("lb_server_connections", "balancer=\"tcp\"") == 0.0)
    })?;
    println!("garbage: http check failed with {err:?}; 64 KiB passed through byte for byte");
    ensure!(f.lb.get("/livez")?.0 == 200);
    Ok(())
}

#[test]
fn a_server_that_half_closes_at_once_fails_the_check_at_once() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let host = Host::new()?;
    let p = Peer::start(
        &host,
        9000,
        Arc::new(|c| {
            c.half_close();
            c.wait_closed(Duration::from_secs(30));
        }),
    )?;
    // A 5 s timeout the check must not wait for: the server's FIN ends it.
    let t0 = Instant::now();
    let (f, listens) = start_lb(
        host,
        9000,
        &[
            ("tcp", vec![p.addr], ""),
            ("http", vec![p.addr], &http_check("10s", "5s", 1)),
        ],
    )?;
    let failed = wait_server_state(
        &f.lb,
        "http",
        &p.addr.to_string(),
        "FAILED",
        Duration::from_secs(10),
    )?;
    let err = last_error(&f, "http", p.addr)?;
    println!(
        "half-close: http check failed {:?} after lb started ({failed:?} after it answered): {err:?}",
        t0.elapsed()
    );
    ensure!(err.starts_with("http: "), "{err:?}");
    if timed() {
        ensure!(
            t0.elapsed() < Duration::from_secs(5),
            "the check waited for its timeout"
        );
    }
    // Through the tcp-checked balancer: the client sees the FIN and can still send; the server
    // reads every byte, then the client's FIN.
    let mut c = std::net::TcpStream::connect_timeout(&listens[0], Duration::from_secs(5))?;
    c.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut b = [0u8; 1];
    ensure!(
        std::io::Read::read(&mut c, &mut b)? == 0,
        "no FIN from the half-closed server"
    );
    let payload = vec![7u8; 1 << 20];
    std::io::Write::write_all(&mut c, &payload)?;
    c.shutdown(std::net::Shutdown::Write)?;
    wait_until(Duration::from_secs(10), || {
        Ok(p.served().iter().any(|s| s.read == payload.len() as u64))
    })
    .context("the server did not read the client's 1 MiB after half-closing")?;
    drop(c);
    wait_until(Duration::from_secs(10), || {
        Ok(f.lb.metric("lb_server_connections", "balancer=\"tcp\"") == 0.0)
    })?;
    Ok(())
}

/// Answers at once while `slow` is false; else waits 3 s (or until lb closes) first.
fn slow_when(slow: Arc<AtomicBool>) -> Behaviour {
    Arc::new(move |c| {
        if !c.read_head() {
            return;
        }
        if slow.load(Ordering::Relaxed) && c.wait_closed(Duration::from_secs(3)) {
            return;
        }
        c.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
        c.wait_closed(Duration::from_secs(5));
    })
}

#[test]
fn a_slow_answer_fails_each_check_at_its_timeout_and_the_server_after_fall() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let host = Host::new()?;
    let slow = Arc::new(AtomicBool::new(false));
    let p = Peer::start(&host, 9000, slow_when(slow.clone()))?;
    let (interval, timeout, fall) = (Duration::from_millis(500), Duration::from_millis(300), 3);
    let (f, _) = start_lb(
        host,
        9000,
        &[("h", vec![p.addr], &http_check("500ms", "300ms", fall))],
    )?;
    f.lb.wait_settled(Duration::from_secs(10))?;
    ensure!(f.lb.server_state("h", &p.addr.to_string())? != "FAILED");
    let before = failures(&f, p.addr);
    let served_before = p.served().len();
    slow.store(true, Ordering::Relaxed);
    let t0 = Instant::now();
    let took = wait_server_state(
        &f.lb,
        "h",
        &p.addr.to_string(),
        "FAILED",
        Duration::from_secs(30),
    )?;
    let failed = failures(&f, p.addr) - before;
    let err = last_error(&f, "h", p.addr)?;
    // Every slow check's connection, closed by lb (not by the server's 3 s).
    wait_until(Duration::from_secs(5), || {
        Ok(p.served().len() >= served_before + fall as usize)
    })?;
    let slow_conns: Vec<Served> = p.served()[served_before..].to_vec();
    let longest = slow_conns
        .iter()
        .map(|s| s.lifetime)
        .max()
        .unwrap_or_default();
    println!(
        "slow answer: FAILED {took:?} after the server turned slow ({:?} in all) with {failed} \
         failed checks (fall {fall}): {err:?}; {} slow check connections closed by lb after at \
         most {longest:?} (timeout {timeout:?})",
        t0.elapsed(),
        slow_conns.len()
    );
    ensure!(err.contains("timed out"), "{err:?}");
    ensure!(
        (f64::from(fall)..=f64::from(fall) + 1.0).contains(&failed),
        "FAILED after {failed} failed checks, fall is {fall}"
    );
    for s in &slow_conns {
        ensure!(
            s.lifetime < Duration::from_secs(3),
            "a slow check was held {:?}",
            s.lifetime
        );
        ensure!(
            s.lifetime >= timeout - Duration::from_millis(50),
            "closed after {:?}",
            s.lifetime
        );
    }
    if timed() {
        let bound = interval * fall + timeout + Duration::from_secs(1);
        ensure!(took < bound, "FAILED after {took:?}, bound {bound:?}");
        ensure!(
            longest < timeout + Duration::from_secs(1),
            "a check lasted {longest:?}"
        );
    }
    // Fast again: back within a check or two (rise 1).
    slow.store(false, Ordering::Relaxed);
    wait_until(Duration::from_secs(10), || {
        Ok(f.lb.server_state("h", &p.addr.to_string())? != "FAILED")
    })?;
    Ok(())
}

/// Reads the request head, answers `head`, then sends `chunk` again and again (one every
/// `pace`, or as fast as lb takes them) up to `total` bytes, and waits for lb to close.
fn answer(
    head: &'static [u8],
    chunk: &'static [u8],
    total: u64,
    pace: Option<Duration>,
) -> Behaviour {
    Arc::new(move |c| {
        if c.read_head() && c.write(head) {
            c.flood(chunk, total, pace);
            c.wait_closed(Duration::from_secs(30));
        }
    })
}

/// A largest TCP buffer the kernel gives a socket (`tcp_rmem` or `tcp_wmem`'s maximum).
fn tcp_buffer_max(which: &str) -> Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/sys/net/ipv4/{which}"))?;
    text.split_whitespace()
        .nth(2)
        .context("three numbers")?
        .parse()
        .with_context(|| format!("{which}: {text:?}"))
}

/// The check's response limit (`max_response_bytes`' default).
const LIMIT: u64 = 64 * 1024;
/// How much lb's resident memory may grow while it checks the huge servers.
const RSS_BOUND_KIB: u64 = 32 * 1024;
/// Checks each huge server must have had before memory is measured.
const HUGE_CHECKS: usize = 10;

/// Four servers on ports 9001-9004 of `host`: a head that never ends (one header line of up to
/// 64 MiB), a 16 MiB body with its length, a 64 MiB body ended by the close, and a 60,000-byte
/// body, under the limit.
fn huge_peers(host: &Host) -> Result<[Peer; 4]> {
    static A: [u8; 65536] = [b'a'; 65536];
    let mb64 = 64 << 20;
    let answers: [(&'static [u8], &'static [u8], u64); 4] = [
        (b"HTTP/1.1 200 OK\r\nX-Big: ", &A, mb64),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 16777216\r\n\r\n",
            &A,
            16 << 20,
        ),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", &A, mb64),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 60000\r\n\r\n",
            &A[..60_000],
            60_000,
        ),
    ];
    let mut peers = Vec::new();
    for (port, (head, chunk, total)) in (9001..).zip(answers) {
        peers.push(Peer::start(host, port, answer(head, chunk, total, None))?);
    }
    peers.try_into().map_err(|_| anyhow::anyhow!("four peers"))
}

#[test]
fn huge_answers_are_read_to_the_limit_and_memory_stays_bounded() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let host = Host::new()?;
    let peers = huge_peers(&host)?;
    let addrs: Vec<SocketAddr> = peers.iter().map(|p| p.addr).collect();
    let (f, _) = start_lb(
        host,
        9001,
        &[("h", addrs.clone(), &http_check("200ms", "2s", 1))],
    )?;
    f.lb.wait_settled(Duration::from_secs(10))?;
    let rss = rss_kib(f.lb.pid())?;
    let fds = open_fds(f.lb.pid())?;
    wait_until(Duration::from_secs(60), || {
        Ok(peers[..3].iter().all(|p| p.served().len() >= HUGE_CHECKS))
    })
    .context("the huge servers were not checked often enough")?;
    let grown = rss_kib(f.lb.pid())?.saturating_sub(rss);
    let states: Vec<String> = addrs
        .iter()
        .map(|a| f.lb.server_state("h", &a.to_string()))
        .collect::<Result<_>>()?;
    let errors: Vec<String> = addrs
        .iter()
        .map(|a| last_error(&f, "h", *a))
        .collect::<Result<_>>()?;
    let bound = LIMIT + tcp_buffer_max("tcp_rmem")? + tcp_buffer_max("tcp_wmem")?;
    for (i, p) in peers.iter().enumerate() {
        let s = p.served();
        let most = s.iter().map(|s| s.written).max().unwrap_or_default();
        println!(
            "huge server {i}: {} checks, at most {} KiB written before lb closed (bound {} KiB), \
             {}: {:?}",
            s.len(),
            most / 1024,
            bound / 1024,
            states[i],
            errors[i]
        );
        ensure!(
            most <= bound,
            "server {i}: {most} bytes written into one check"
        );
    }
    println!("lb's RSS {rss} KiB before, grew {grown} KiB (bound {RSS_BOUND_KIB} KiB)");
    ensure!(
        errors[0].contains("message head is too large"),
        "{:?}",
        errors[0]
    );
    for e in &errors[1..3] {
        ensure!(e.contains(&format!("larger than {LIMIT} bytes")), "{e:?}");
    }
    ensure!(states[..3].iter().all(|s| s == "FAILED"), "{states:?}");
    ensure!(
        states[3] != "FAILED" && errors[3].is_empty(),
        "under the limit: {states:?} {errors:?}"
    );
    ensure!(grown < RSS_BOUND_KIB, "lb's RSS grew {grown} KiB");
    wait_until(Duration::from_secs(10), || {
        Ok(open_fds(f.lb.pid())? <= fds + 4)
    })?;
    Ok(())
}

#[test]
fn a_never_ending_body_fails_the_check_at_its_timeout() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let host = Host::new()?;
    // One byte every 20 ms for as long as lb reads.
    let p = Peer::start(
        &host,
        9000,
        answer(
            b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n",
            b"x",
            u64::MAX,
            Some(Duration::from_millis(20)),
        ),
    )?;
    let timeout = Duration::from_millis(500);
    let (f, _) = start_lb(
        host,
        9000,
        &[("h", vec![p.addr], &http_check("1s", "500ms", 1))],
    )?;
    wait_server_state(
        &f.lb,
        "h",
        &p.addr.to_string(),
        "FAILED",
        Duration::from_secs(10),
    )?;
    wait_until(Duration::from_secs(10), || Ok(p.served().len() >= 2))?;
    let err = last_error(&f, "h", p.addr)?;
    let s = p.served();
    let longest = s.iter().map(|s| s.lifetime).max().unwrap_or_default();
    let most = s.iter().map(|s| s.written).max().unwrap_or_default();
    println!(
        "never-ending body: {} checks, each closed by lb after at most {longest:?} and {most} \
         bytes (timeout {timeout:?}): {err:?}",
        s.len()
    );
    ensure!(err.contains("timed out"), "{err:?}");
    // 30 s of this server is 1,500 bytes: lb stopped long before.
    ensure!(
        longest < Duration::from_secs(10) && most < 1500,
        "{longest:?}, {most} bytes"
    );
    if timed() {
        ensure!(
            longest < timeout + Duration::from_secs(1),
            "a check lasted {longest:?}"
        );
    }
    Ok(())
}
