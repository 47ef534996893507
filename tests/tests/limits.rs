//! Limits on connections through lb (the copy path, `--datapath userspace`): `max_connections`
//! resets the one client too many at once, `idle_timeout` closes a quiet connection and keeps a
//! busy one, and running out of descriptors at accept is survived, counted and logged at a
//! bounded rate.

use std::{
    io::{ErrorKind, Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Result, bail, ensure};
use lb_tests::{
    Fixture, Host, Lb, Place, TestCgroup, Toml, run_client, skip_unless_root, wait_until,
};

/// One server host, lb on the copy path with `extra` balancer keys, through `wrapper`.
fn setup(extra: &str, wrapper: &[&str]) -> Result<Fixture> {
    setup_with_datapath("mode = \"userspace\"", extra, wrapper)
}

/// As [`setup`] with `datapath` as the `[datapath]` keys.
fn setup_with_datapath(datapath: &str, extra: &str, wrapper: &[&str]) -> Result<Fixture> {
    let host = Host::serving(9000, "s0")?;
    let server = host.addr(9000);
    let config = |_: &TestCgroup, listen: SocketAddr| {
        Toml::new()
            .table("datapath")
            .lines(datapath)
            .array_table("balancer")
            .string("name", "b")
            .value("listen", format!("[\"{listen}\"]"))
            .value("servers", format!("[\"{server}\"]"))
            .string("forwarding", "splice")
            .lines(extra)
    };
    let s = Fixture::start_via(wrapper, vec![host], 9000, config, &[])?;
    s.lb.wait_settled(Duration::from_secs(10))?;
    Ok(s)
}

/// A client of the server's `ECHO` protocol through lb.
fn echo_client(listen: SocketAddr) -> Result<TcpStream> {
    let mut s = TcpStream::connect_timeout(&listen, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(b"ECHO\n")?;
    Ok(s)
}

/// One round trip of `ECHO`.
fn ping(s: &mut TcpStream) -> Result<()> {
    s.write_all(b"x")?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b)?;
    ensure!(&b == b"x", "echoed {b:?}");
    Ok(())
}

/// Read until the connection ends; `Ok` with how long it took when it was reset or closed.
fn wait_closed(s: &mut TcpStream, within: Duration) -> Result<Duration> {
    s.set_read_timeout(Some(within))?;
    let start = Instant::now();
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return Ok(start.elapsed()),
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return Ok(start.elapsed()),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                bail!("still open after {within:?}")
            }
            Err(e) => return Err(e.into()),
            Ok(_) if start.elapsed() > within => bail!("still sending after {within:?}"),
            Ok(_) => {}
        }
    }
}

#[test]
fn max_connections_resets_the_one_client_too_many() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let s = setup("max_connections = 3\n", &[])?;
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut c = echo_client(s.listen)?;
        ping(&mut c)?;
        held.push(c);
    }
    // Connect only: lb may reset it before a first write would go out, and even before
    // `connect` returns (on loopback the RST can arrive before the poll that ends the connect).
    let took = match TcpStream::connect_timeout(&s.listen, Duration::from_secs(5)) {
        Ok(mut extra) => wait_closed(&mut extra, Duration::from_secs(5))?,
        Err(e) if e.kind() == ErrorKind::ConnectionReset => Duration::ZERO,
        Err(e) => return Err(e.into()),
    };
    ensure!(took < Duration::from_secs(1), "reset after {took:?}");
    let rejected = || {
        s.lb.metric("lb_connections_rejected_total", "max_connections")
    };
    ensure!(rejected() == 1.0, "rejected {}", rejected());
    for c in &mut held {
        ping(c)?;
    }
    // One leaves: a new client is served again.
    drop(held.pop());
    wait_until(Duration::from_secs(10), || {
        Ok(echo_client(s.listen).and_then(|mut c| ping(&mut c)).is_ok())
    })?;
    for c in &mut held {
        ping(c)?;
    }
    Ok(())
}

#[test]
fn idle_timeout_closes_a_quiet_connection_and_keeps_a_busy_one() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let s = setup("idle_timeout = \"1s\"\n", &[])?;
    let mut quiet = echo_client(s.listen)?;
    ping(&mut quiet)?;
    let mut busy = echo_client(s.listen)?;
    ping(&mut busy)?;
    let (tx, rx) = mpsc::channel();
    let watcher = std::thread::spawn(move || {
        let _ = tx.send(wait_closed(&mut quiet, Duration::from_secs(10)));
    });
    // The busy client keeps talking until the quiet one is closed, then for one more timeout.
    let deadline = Instant::now() + Duration::from_secs(15);
    let closed = loop {
        ensure!(
            Instant::now() < deadline,
            "the quiet connection was never closed"
        );
        ping(&mut busy)?;
        if let Ok(r) = rx.try_recv() {
            break r?;
        }
    };
    watcher
        .join()
        .map_err(|_| anyhow::anyhow!("watcher panicked"))?;
    // Idle since its last byte: closed after 1 s and within 1.25 s plus a margin.
    ensure!(
        closed >= Duration::from_millis(900) && closed < Duration::from_millis(2500),
        "closed after {closed:?}"
    );
    let more = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < more {
        ping(&mut busy)?;
    }
    let idle =
        s.lb.metric("lb_connections_killed_total", "reason=\"idle\"");
    ensure!(idle == 1.0, "idle closes counted {idle}");
    Ok(())
}

/// With the kernel splice, an upload's bytes bypass lb once paired: the kernel's count of them
/// keeps the connection from looking idle (an upload of 4 GiB takes seconds; the timeout is
/// 300 ms), while a quiet connection is still closed.
#[test]
fn idle_timeout_sees_bytes_the_kernel_splices() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let cg = TestCgroup::new()?;
    let datapath = format!("mode = \"bpf\"\ncgroup = \"{}\"", cg.path.display());
    let s = setup_with_datapath(&datapath, "idle_timeout = \"300ms\"\n", &[])?;
    let n = (4u64 << 30).to_string();
    let start = Instant::now();
    let v = run_client(
        &Place::cgroup(&cg.path),
        s.listen,
        &["up", &n, "--pause-ms", "100"],
        Duration::from_secs(120),
    )?;
    let took = start.elapsed();
    ensure!(v["ok"] == true, "upload failed after {took:?}: {v}");
    let spliced = s.lb.metric("lb_spliced_bytes_total", "client_to_server");
    ensure!(
        spliced > 0.0,
        "nothing spliced: the test did not test the kernel path"
    );
    ensure!(
        s.lb.metric("lb_connections_killed_total", "reason=\"idle\"") == 0.0,
        "an active spliced upload was closed as idle"
    );
    let mut quiet = echo_client(s.listen)?;
    ping(&mut quiet)?;
    let closed = wait_closed(&mut quiet, Duration::from_secs(5))?;
    ensure!(
        closed < Duration::from_secs(2),
        "quiet one closed after {closed:?}"
    );
    println!("4 GiB spliced upload in {took:?}, {spliced} bytes through the kernel");
    Ok(())
}

/// The log lines of failed accepts on the balancer's listener.
fn accept_lines(lb: &Lb) -> usize {
    lb.log_text().matches("accept failed; retrying").count()
}

/// Descriptors lb gets: its soft and hard limit (lb raises the soft one to the hard one).
const NOFILE: &str = "--nofile=64:64";

#[test]
fn out_of_descriptors_at_accept_is_survived() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let s = setup("", &["prlimit", NOFILE, "--"])?;
    ensure!(
        s.lb.log_text().contains("limit=64") || s.lb.log_text().contains("open-files limit"),
        "{}",
        s.lb.log_text()
    );
    // 100 clients need 200 descriptors in lb: the later ones wait in the listen backlog while
    // lb's accept fails with EMFILE.
    let start = Instant::now();
    let mut held = Vec::new();
    for _ in 0..100 {
        held.push(echo_client(s.listen)?);
    }
    let lb_pid = s.lb.pid();
    // Failing for over a second: a second line once the first one's second passed.
    wait_until(Duration::from_secs(20), || Ok(accept_lines(&s.lb) >= 2))?;
    ensure!(
        std::path::Path::new(&format!("/proc/{lb_pid}")).exists(),
        "lb died"
    );
    let elapsed = start.elapsed().as_secs() + 2;
    drop(held);
    // Descriptors back: lb answers again, counted the failures, logged a bounded number of lines.
    wait_until(Duration::from_secs(20), || {
        Ok(s.lb.get("/livez").is_ok_and(|(c, _)| c == 200))
    })?;
    let errors = s.lb.metric("lb_accept_errors_total", "errno=\"EMFILE\"");
    ensure!(errors > 0.0, "no EMFILE counted");
    let lines = accept_lines(&s.lb) as u64;
    ensure!(
        lines <= elapsed + 10,
        "{lines} accept lines in about {elapsed} s for {errors} failures"
    );
    wait_until(Duration::from_secs(20), || {
        Ok(echo_client(s.listen).and_then(|mut c| ping(&mut c)).is_ok())
    })?;
    println!("EMFILE: {errors} accept failures, {lines} log lines");
    Ok(())
}
