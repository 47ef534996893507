//! Failover end to end: a server on a test host is blackholed (a dead neighbour entry: packets
//! vanish) while long-lived clients hold connections through lb. It must turn FAILED within
//! `interval × fall + timeout`, and then, per `on_unhealthy`: `kill` resets every client within
//! 1 s and they reconnect to the healthy server; `drain` resets them after `drain_timeout`;
//! `keep` leaves them. With `kill_scope = "node"` a connection another process opened straight
//! to the failed server is destroyed too.

use std::{
    io::Read as _,
    net::SocketAddr,
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use lb_tests::{
    Fixture, Holder, Lb, Place, TestCgroup, Toml, free_port, skip_unless_root, wait_server_state,
};

/// Check settings of every test: FAILED within 0.5 × 2 + 0.3 = 1.3 s of the blackhole.
const INTERVAL_MS: u64 = 500;
const FALL: u64 = 2;
const TIMEOUT_MS: u64 = 300;
/// Scheduling and polling slack on a shared, loaded machine.
const SLACK_MS: u64 = 700;

/// Two hosts `s0`, `s1` serving `lbt` on :9000, lb in front with `extra` health settings;
/// returns once both servers are PREFERRED, so every new client lands on `s0`.
fn setup(extra: &str) -> Result<Fixture> {
    let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    let servers = lb_tests::toml_addrs(&hosts, 9000);
    let config = |_: &TestCgroup, listen: SocketAddr| {
        Toml::new()
            .table("datapath")
            .string("mode", "auto")
            .array_table("balancer")
            .string("name", "api")
            .value("listen", format!("[\"{listen}\"]"))
            .value("servers", format!("[{servers}]"))
            .string("policy", "failover")
            .string("dial_timeout", "1s")
            .table("balancer.health")
            .string("kind", "http")
            .string("url", "http://{server}/healthz")
            .string("interval", &format!("{INTERVAL_MS}ms"))
            .string("timeout", &format!("{TIMEOUT_MS}ms"))
            .value("rise", 2)
            .value("fall", FALL)
            .lines(extra)
    };
    let s = Fixture::start(
        hosts,
        9000,
        config,
        &["--cgroup", "{cgroup}", "--forwarding", "splice"],
    )?;
    s.wait_all("api", "PREFERRED", Duration::from_secs(10))?;
    Ok(s)
}

/// State and connection count of server `i` from `/status`.
fn server_status(s: &Fixture, i: usize) -> Result<(String, u64)> {
    let st = s.lb.status()?;
    let addr = &s.names[i];
    let v = st["balancers"][0]["servers"]
        .as_array()
        .context("servers")?
        .iter()
        .find(|s| s["address"] == addr.as_str())
        .with_context(|| format!("{addr} not in /status: {st}"))?;
    Ok((
        v["state"].as_str().unwrap_or("").to_string(),
        v["connections"].as_u64().unwrap_or(0),
    ))
}

/// `n` clients holding connections through lb (each reconnects up to 3 times), all on `s0`.
fn holders(s: &Fixture, n: usize) -> Result<Vec<Holder>> {
    let hs: Vec<Holder> = (0..n)
        .map(|_| Holder::start(&s.place(), s.listen, 3, 60_000))
        .collect::<Result<_>>()?;
    for h in &hs {
        let ev = h.wait_for("connected", Duration::from_secs(10))?;
        ensure!(ev["server"] == "s0", "client should start on s0: {ev}");
    }
    Ok(hs)
}

/// Blackhole `s0` and return (when it was blackholed, when lb showed it FAILED), checking
/// the bound `interval × fall + timeout`.
fn fail_s0(s: &Fixture) -> Result<(Instant, Instant)> {
    let t0 = Instant::now();
    s.hosts[0].blackhole(true)?;
    let waiting = Instant::now();
    let failed =
        waiting + wait_server_state(&s.lb, "api", &s.names[0], "FAILED", Duration::from_secs(10))?;
    let took = failed - t0;
    let bound = Duration::from_millis(INTERVAL_MS * FALL + TIMEOUT_MS + SLACK_MS);
    eprintln!("s0 FAILED {:.3} s after the blackhole", took.as_secs_f64());
    ensure!(
        took <= bound,
        "FAILED after {took:?}, bound {bound:?} (interval × fall + timeout + slack)"
    );
    Ok((t0, failed))
}

/// The sum of the samples of metrics whose line starts with `name` and holds `label`.
fn metric(s: &Fixture, name: &str, label: &str) -> f64 {
    let (_, body) = s.lb.get("/metrics").unwrap_or_default();
    body.lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn blackholed_server_fails_and_clients_reconnect_elsewhere() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let s = setup(r#"on_unhealthy = "kill""#)?;
    let holders = holders(&s, 3)?;
    ensure!(server_status(&s, 0)?.1 == 3, "{:?}", server_status(&s, 0)?);
    let (_, failed) = fail_s0(&s)?;
    for (i, h) in holders.iter().enumerate() {
        let closed = h.wait_for("closed", Duration::from_secs(5))?;
        let after = Instant::now().saturating_duration_since(failed);
        eprintln!(
            "client {i}: {} {:.3} s after FAILED was seen",
            closed["how"],
            after.as_secs_f64()
        );
        ensure!(
            after <= Duration::from_secs(1),
            "client {i} closed {after:?} after FAILED: {closed}"
        );
        ensure!(
            closed["how"] == "connection reset",
            "lb should reset the client: {closed}"
        );
        let again = h.wait_for("connected", Duration::from_secs(5))?;
        ensure!(again["server"] == "s1", "client {i} reconnected to {again}");
    }
    ensure!(
        server_status(&s, 1)?.0 == "ACTIVE",
        "{:?}",
        server_status(&s, 1)?
    );
    let killed = metric(&s, "lb_connections_killed_total", "reason=\"health\"");
    ensure!(
        killed >= 3.0,
        "lb_connections_killed_total unhealthy = {killed}"
    );
    Ok(())
}

#[test]
fn drain_kills_after_drain_timeout() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let s = setup("on_unhealthy = \"drain\"\ndrain_timeout = \"2s\"")?;
    let holders = holders(&s, 2)?;
    let (_, failed) = fail_s0(&s)?;
    // New clients go to s1 while s0 drains.
    let fresh = Holder::start(&s.place(), s.listen, 0, 10_000)?;
    let ev = fresh.wait_for("connected", Duration::from_secs(5))?;
    ensure!(
        ev["server"] == "s1",
        "a new client during the drain went to {ev}"
    );
    ensure!(
        server_status(&s, 0)?.1 == 2,
        "s0 keeps its 2 connections while draining: {:?}",
        server_status(&s, 0)?
    );
    for (i, h) in holders.iter().enumerate() {
        let closed = h.wait_for("closed", Duration::from_secs(6))?;
        let after = Instant::now().saturating_duration_since(failed);
        eprintln!(
            "client {i}: {} {:.3} s after FAILED",
            closed["how"],
            after.as_secs_f64()
        );
        ensure!(
            after >= Duration::from_millis(1500) && after <= Duration::from_millis(3500),
            "client {i} closed {after:?} after FAILED, drain_timeout is 2 s"
        );
        let again = h.wait_for("connected", Duration::from_secs(5))?;
        ensure!(again["server"] == "s1", "client {i} reconnected to {again}");
    }
    let drained = metric(&s, "lb_connections_killed_total", "reason=\"drain\"");
    ensure!(drained >= 2.0, "drain_timeout kills = {drained}");
    Ok(())
}

#[test]
fn keep_leaves_connections_alone() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let s = setup(r#"on_unhealthy = "keep""#)?;
    let holders = holders(&s, 2)?;
    fail_s0(&s)?;
    let fresh = Holder::start(&s.place(), s.listen, 0, 10_000)?;
    let ev = fresh.wait_for("connected", Duration::from_secs(5))?;
    ensure!(ev["server"] == "s1", "a new client went to {ev}");
    std::thread::sleep(Duration::from_secs(3));
    for (i, h) in holders.iter().enumerate() {
        if let Ok(ev) = h.next(Duration::from_millis(10)) {
            bail!("client {i} saw {ev} although on_unhealthy = keep");
        }
    }
    ensure!(server_status(&s, 0)?.1 == 2, "{:?}", server_status(&s, 0)?);
    Ok(())
}

/// Open a connection straight to `addr` (no lb) and learn the server's name.
fn direct(addr: &str) -> Result<std::net::TcpStream> {
    use std::io::Write as _;
    let mut c = std::net::TcpStream::connect_timeout(&addr.parse()?, Duration::from_secs(5))?;
    c.write_all(b"NAME\n")?;
    let mut name = [0u8; 3];
    c.read_exact(&mut name)?;
    Ok(c)
}

#[test]
fn node_scope_destroys_other_processes_connections() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let s = setup(r#"kill_scope = "node""#)?;
    let _holders = holders(&s, 1)?;
    // Connections the test process (not lb, outside the cgroup) opened itself.
    let mut to_failed = direct(&s.names[0])?;
    let mut to_healthy = direct(&s.names[1])?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = to_failed.set_read_timeout(Some(Duration::from_secs(20)));
        let r = to_failed.read(&mut [0u8; 16]);
        let _ = tx.send((Instant::now(), r));
    });
    let (_, failed) = fail_s0(&s)?;
    let (ended, result) = rx
        .recv_timeout(Duration::from_secs(15))
        .context("reader thread")?;
    let log = s.lb.log_text();
    if log.contains("refuses SOCK_DESTROY") {
        eprintln!("SKIP node scope: the kernel refuses SOCK_DESTROY (CONFIG_INET_DIAG_DESTROY)");
        return Ok(());
    }
    let err = match result {
        Ok(n) => bail!("the direct connection read {n} bytes instead of being destroyed\n{log}"),
        Err(e) => e,
    };
    ensure!(
        err.raw_os_error() == Some(libc::ECONNABORTED),
        "the direct connection ended with {err}, not ECONNABORTED\n{log}"
    );
    let after = ended.saturating_duration_since(failed);
    eprintln!(
        "direct connection destroyed {:.3} s after FAILED",
        after.as_secs_f64()
    );
    ensure!(
        after <= Duration::from_secs(1),
        "destroyed {after:?} after FAILED"
    );
    // The healthy server's connection is untouched.
    to_healthy.set_read_timeout(Some(Duration::from_millis(200)))?;
    let e = to_healthy
        .read(&mut [0u8; 16])
        .expect_err("the healthy server sends nothing");
    ensure!(
        matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
        "connection to the healthy server ended: {e}"
    );
    Ok(())
}

/// `health.loop = false`: nothing is checked by itself, not even at startup; a dial to a server
/// whose result is older than `max_age` (or that was never checked) checks it first.
#[test]
fn loop_off_checks_only_before_a_dial() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    let cg = TestCgroup::new()?;
    let port = free_port()?;
    let servers = lb_tests::toml_addrs(&hosts, 9000);
    let text = format!(
        r#"
[[balancer]]
name = "api"
listen = ["127.0.0.1:{port}"]
servers = [{}]

[balancer.health]
loop = false
interval = "100ms"
max_age = "1s"
"#,
        servers
    );
    let config =
        std::env::temp_dir().join(format!("lb-loopoff-{}-{port}.toml", std::process::id()));
    std::fs::write(&config, text)?;
    let lb = Lb::start(&[
        "--config",
        &config.display().to_string(),
        "--cgroup",
        &cg.path.display().to_string(),
        "--forwarding",
        "splice",
    ]);
    let _ = std::fs::remove_file(&config);
    let lb = lb?;
    let last_checks = || -> Result<Vec<Option<f64>>> {
        let st = lb.status()?;
        Ok(st["balancers"][0]["servers"]
            .as_array()
            .context("servers")?
            .iter()
            .map(|s| s["last_check"].as_f64())
            .collect())
    };
    lb.wait_ready(Duration::from_secs(10))?;
    let first = last_checks()?;
    std::thread::sleep(Duration::from_secs(2));
    let idle = last_checks()?;
    ensure!(
        idle == first,
        "checks ran with the loop off (interval 100 ms): {first:?} -> {idle:?}"
    );
    let place = Place::cgroup(&cg.path);
    let h = Holder::start(&place, format!("127.0.0.1:{port}").parse()?, 0, 5_000)?;
    let ev = h.wait_for("connected", Duration::from_secs(5))?;
    ensure!(ev["server"] == "s0", "{ev}");
    let after = last_checks()?;
    ensure!(
        after[0] > idle[0] && after[1] == idle[1],
        "only the dialed server is checked again: {idle:?} -> {after:?}"
    );
    Ok(())
}
