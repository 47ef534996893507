//! Connect-time balancing (`forwarding = "connect"`) end to end: servers on test hosts, clients
//! in the test's cgroup (where lb attaches its connect4/6 and getpeername4/6 programs), lb as a
//! real process. A client's `connect()` to the listener goes straight to a server: no byte
//! crosses lb, the server sees the client's own socket, `getpeername` still names the listener,
//! the kernel's count shows in `/status`, a FAILED server's clients are reset by lb (netlink
//! `SOCK_DESTROY` of the sockets the programs sent there) and reconnect to the other server,
//! and a client outside the cgroup is still proxied. Passive health from the kernel: refused
//! connects and a retransmission timeout fail a server with no check failing, and a connect
//! still in SYN_SENT to a server that turns FAILED is aborted at once.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use lb_tests::{
    ConnectLb, Holder, Lb, Place, TestCgroup, Toml, free_port, run_client, skip_unless_kernel,
    skip_unless_root, timed,
};
use serde_json::Value;

const MIB: u64 = 1024 * 1024;
const T: Duration = Duration::from_secs(60);
/// Check settings: FAILED within 0.5 × 2 + 0.3 = 1.3 s of a blackhole.
const INTERVAL_MS: u64 = 500;
const FALL: u64 = 2;
const TIMEOUT_MS: u64 = 300;
/// Scheduling and polling slack on a shared, loaded machine.
const SLACK_MS: u64 = 700;
/// From FAILED to a direct client's abort: the table write, the netlink dump and destroy, the
/// client's wake-up.
const KILL_SLACK_MS: u64 = 300;

/// `lbt client dial`'s errnos (Linux).
const ECONNREFUSED: i64 = 111;
const ECONNABORTED: i64 = 103;
const ECONNRESET: i64 = 104;

/// These tests' config: [`ConnectLb::config`] (`datapath`, `listen`, `servers`, `policy`) with
/// a 1 s dial timeout, then `health`.
fn config(
    datapath: &Toml,
    listen: &[SocketAddr],
    servers: &str,
    policy: &str,
    health: &Toml,
) -> Toml {
    ConnectLb::config(datapath, listen, servers, policy)
        .string("dial_timeout", "1s")
        .lines(health.text())
}

/// `[balancer.health]`: an http check of each server every `interval_ms`, timing out after
/// `timeout_ms`, `fall` failures making it FAILED, and `on_unhealthy` what then becomes of its
/// connections.
fn checks(interval_ms: u64, timeout_ms: u64, fall: u64, on_unhealthy: &str) -> Toml {
    Toml::new()
        .table("balancer.health")
        .string("kind", "http")
        .string("url", "http://{server}/healthz")
        .string("interval", &format!("{interval_ms}ms"))
        .string("timeout", &format!("{timeout_ms}ms"))
        .value("rise", 1)
        .value("fall", fall)
        .string("on_unhealthy", on_unhealthy)
}

/// [`ConnectLb`] and what these tests do with it.
/// Hosts `s0`, `s1` serving `lbt` on :9000, lb in front with `policy` and connect-time
/// forwarding; returns once no server is UNCHECKED and the table was written.
fn setup(policy: &str) -> Result<ConnectLb> {
    let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    let servers = lb_tests::toml_addrs(&hosts, 9000);
    let health = checks(INTERVAL_MS, TIMEOUT_MS, FALL, "kill");
    ConnectLb::start(hosts, |listen| {
        config(&Toml::new(), &[listen], &servers, policy, &health)
    })
}

fn server(s: &ConnectLb, i: usize) -> String {
    s.hosts[i].addr(9000).to_string()
}

/// State and connection count of server `i` from `/status`.
fn server_status(s: &ConnectLb, i: usize) -> Result<(String, u64)> {
    s.status_of(&server(s, i))
}

/// Poll until s0 is FAILED (every 10 ms, at most `limit` after `t0`); when it turned so.
fn wait_s0_failed(s: &ConnectLb, t0: Instant, limit: Duration) -> Result<Instant> {
    loop {
        if server_status(s, 0)?.0 == "FAILED" {
            return Ok(Instant::now());
        }
        if t0.elapsed() > limit {
            bail!("s0 not FAILED after {limit:?}: {}", s.lb.log_text());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Blackhole s0 and, at once, start a client `connect()` that the table sends to s0 (its
/// SYNs go nowhere, so it waits in SYN_SENT); returns the client's result, when it ended,
/// when s0 turned FAILED, and when the blackhole began.
fn dial_into_blackhole(s: &ConnectLb) -> Result<(Value, Instant, Instant, Instant)> {
    let t0 = Instant::now();
    s.hosts[0].blackhole(true)?;
    std::thread::scope(|scope| -> Result<_> {
        let client = scope.spawn(|| {
            let r = run_client(&s.place(), s.listen, &["dial"], T);
            (r, Instant::now())
        });
        let failed = wait_s0_failed(s, t0, Duration::from_secs(10))?;
        let (r, done) = client.join().expect("client thread");
        Ok((r?, done, failed, t0))
    })
}

/// `lb servers --balancer api <args>` through the CLI (the admin API).
fn servers_cmd(s: &ConnectLb, args: &[&str]) -> Result<()> {
    let out = std::process::Command::new(lb_tests::lb_bin())
        .args(["servers", "--balancer", "api"])
        .args(args)
        .args(["--admin", &s.lb.admin.to_string()])
        .output()?;
    ensure!(out.status.success(), "lb servers {args:?}: {out:?}");
    Ok(())
}

/// `lb servers kill` server `i`.
fn kill_server(s: &ConnectLb, i: usize) -> Result<()> {
    servers_cmd(s, &["kill", &server(s, i)])
}

/// `lb_connections_killed_total` for `reason`.
fn killed(s: &ConnectLb, reason: &str) -> f64 {
    s.lb.metric(
        "lb_connections_killed_total",
        &format!("reason=\"{reason}\""),
    )
}

fn peer(s: &ConnectLb, place: &Place<'_>) -> Result<Value> {
    let v = run_client(place, s.listen, &["peer"], T)?;
    ensure!(v["ok"] == true, "peer client failed: {v}");
    Ok(v)
}

/// Wait (at most 5 s) for holder `h`'s connection to end, print how and when (`what`, timed from
/// `t`), and require a reset or an abort, not a clean close.
fn expect_reset(h: &Holder, what: &str, t: Instant) -> Result<()> {
    let closed = h.wait_for("closed", Duration::from_secs(5))?;
    eprintln!(
        "{what}: client {} after {:.3} s",
        closed["how"],
        t.elapsed().as_secs_f64()
    );
    ensure!(
        closed["how"] == "connection reset" || closed["how"] == "connection aborted",
        "{closed}"
    );
    Ok(())
}

/// Root and a kernel with the getpeername hooks (5.8); prints the skip reason otherwise.
fn skip() -> bool {
    skip_unless_root() || skip_unless_kernel((5, 8), "cgroup getpeername4/6 hooks")
}

#[test]
fn connect_time_goes_straight_to_the_server() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let s = setup("failover")?;

    // In the cgroup: the server sees the client's own socket, getpeername the listener.
    let v = peer(&s, &s.place())?;
    eprintln!("in the cgroup: {v}");
    ensure!(v["peer"] == s.listen.to_string(), "getpeername: {v}");
    ensure!(v["server"] == "s0", "failover sends to s0 first: {v}");
    ensure!(
        v["server_sees"] == v["local"],
        "the server should see the client's own socket, not lb's: {v}"
    );

    // 64 MiB each way, byte-exact, none of it through lb.
    let n = (64 * MIB).to_string();
    for dir in ["up", "down"] {
        let t = Instant::now();
        let r = run_client(&s.place(), s.listen, &[dir, &n], T)?;
        ensure!(r["ok"] == true, "{dir} failed: {r}");
        eprintln!("{dir} 64 MiB direct: {:.3} s", t.elapsed().as_secs_f64());
    }
    let through_lb = s.lb.metric("lb_spliced_bytes_total", "")
        + s.lb.metric("lb_copied_bytes_total", "")
        + s.lb.metric("lb_connections_total", "");
    ensure!(
        through_lb == 0.0,
        "lb carried {through_lb} bytes/connections"
    );
    ensure!(
        s.lb.metric("lb_balancer_forwarding_info", "forwarding=\"connect\"") == 1.0,
        "lb_balancer_forwarding_info should say connect"
    );

    // A held connection is counted by the kernel, in /status and the metric, and uncounted
    // when it closes.
    let h = Holder::start(&s.place(), s.listen, 0, 60_000)?;
    let ev = h.wait_for("connected", Duration::from_secs(10))?;
    ensure!(ev["server"] == "s0", "{ev}");
    lb_tests::wait_until(Duration::from_secs(5), || Ok(server_status(&s, 0)?.1 == 1))?;
    let m = s.lb.metric("lb_server_connections", &server(&s, 0));
    ensure!(m == 1.0, "lb_server_connections for s0 = {m}");
    drop(h);
    lb_tests::wait_until(Duration::from_secs(5), || Ok(server_status(&s, 0)?.1 == 0))?;

    // Outside the cgroup nothing is rewritten: lb proxies, the server sees lb's socket.
    let v = peer(&s, &Place::default())?;
    eprintln!("outside the cgroup: {v}");
    ensure!(v["peer"] == s.listen.to_string(), "{v}");
    ensure!(
        v["server_sees"] != v["local"],
        "a client outside the cgroup should reach the server through lb: {v}"
    );
    ensure!(
        s.lb.metric("lb_connections_total", "") == 1.0,
        "lb should have accepted exactly the outside client"
    );
    Ok(())
}

#[test]
fn connect_time_failover_resets_clients_of_a_failed_server() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let s = setup("failover")?;
    let holders: Vec<Holder> = (0..3)
        .map(|_| Holder::start(&s.place(), s.listen, 3, 60_000))
        .collect::<Result<_>>()?;
    for h in &holders {
        let ev = h.wait_for("connected", Duration::from_secs(10))?;
        ensure!(ev["server"] == "s0", "client should start on s0: {ev}");
    }
    lb_tests::wait_until(Duration::from_secs(5), || Ok(server_status(&s, 0)?.1 == 3))?;
    // lb's own health checks reach s1 at its own address while clients' connects to the
    // listener are rewritten to s0.
    let s1 = server_status(&s, 1)?.0;
    ensure!(s1 == "HEALTHY" || s1 == "PREFERRED", "s1 is {s1}");

    let t0 = Instant::now();
    s.hosts[0].blackhole(true)?;
    let failed = wait_s0_failed(&s, t0, Duration::from_secs(10))?;
    let bound = Duration::from_millis(INTERVAL_MS * FALL + TIMEOUT_MS + SLACK_MS);
    eprintln!(
        "s0 FAILED {:.3} s after the blackhole",
        (failed - t0).as_secs_f64()
    );
    ensure!(
        !timed() || failed - t0 <= bound,
        "FAILED after {:?}",
        failed - t0
    );
    for (i, h) in holders.iter().enumerate() {
        let closed = h.wait_for("closed", Duration::from_secs(5))?;
        let since_blackhole = t0.elapsed();
        eprintln!(
            "client {i}: {} {:.3} s after the blackhole",
            closed["how"],
            since_blackhole.as_secs_f64()
        );
        ensure!(
            !timed() || since_blackhole <= bound + Duration::from_millis(KILL_SLACK_MS),
            "client {i} ended {since_blackhole:?} after the blackhole: {closed}"
        );
        ensure!(
            closed["how"] == "connection reset" || closed["how"] == "connection aborted",
            "the client should be reset: {closed}"
        );
        let ev = h.wait_for("connected", Duration::from_secs(5))?;
        ensure!(
            ev["server"] == "s1",
            "client {i} should reconnect to s1: {ev}"
        );
    }
    // Counted after the destroy returns, so possibly just after the clients saw it.
    let killed = || {
        s.lb.metric("lb_connections_killed_total", "reason=\"health\"")
    };
    lb_tests::wait_until(Duration::from_secs(2), || Ok(killed() == 3.0))
        .with_context(|| format!("lb_connections_killed_total = {}", killed()))?;
    s.hosts[0].blackhole(false)?;
    Ok(())
}

#[test]
fn connect_time_round_robin_spreads_new_connects() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let s = setup("round-robin")?;
    let mut per = [0u32; 2];
    for _ in 0..20 {
        let v = peer(&s, &s.place())?;
        ensure!(v["server_sees"] == v["local"], "{v}");
        match v["server"].as_str() {
            Some("s0") => per[0] += 1,
            Some("s1") => per[1] += 1,
            _ => bail!("unexpected server: {v}"),
        }
    }
    eprintln!("20 connects: s0 {}, s1 {}", per[0], per[1]);
    ensure!(per[0] >= 5 && per[1] >= 5, "uneven spread: {per:?}");
    Ok(())
}

#[test]
fn connect_time_servers_kill_resets_direct_clients() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let s = setup("failover")?;
    let h = Holder::start(&s.place(), s.listen, 1, 60_000)?;
    let ev = h.wait_for("connected", Duration::from_secs(10))?;
    ensure!(ev["server"] == "s0", "{ev}");
    lb_tests::wait_until(Duration::from_secs(5), || Ok(server_status(&s, 0)?.1 == 1))?;
    let t = Instant::now();
    kill_server(&s, 0)?;
    expect_reset(&h, "lb servers kill", t)?;
    // A kill is not a failure: the client reconnects to s0 again.
    let ev = h.wait_for("connected", Duration::from_secs(5))?;
    ensure!(ev["server"] == "s0", "{ev}");
    Ok(())
}

#[test]
fn connect_time_ipv4_mapped_from_an_ipv6_socket() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let s = setup("failover")?;
    // An IPv6 socket dialing the listener's IPv4-mapped address (connect6, getpeername6): it
    // goes to the server's mapped address and still names the listener as its peer.
    let mapped: SocketAddr = format!("[::ffff:127.0.0.1]:{}", s.listen.port()).parse()?;
    let v = run_client(&s.place(), mapped, &["peer"], T)?;
    eprintln!("IPv4-mapped: {v}");
    ensure!(v["ok"] == true, "{v}");
    ensure!(v["peer"] == mapped.to_string(), "getpeername: {v}");
    ensure!(v["server"] == "s0", "{v}");
    let local: SocketAddr = v["local"].as_str().context("local")?.parse()?;
    let seen: SocketAddr = v["server_sees"].as_str().context("server_sees")?.parse()?;
    let local_v4 = match local.ip() {
        std::net::IpAddr::V6(ip) => ip.to_ipv4_mapped().map(std::net::IpAddr::V4),
        std::net::IpAddr::V4(ip) => Some(std::net::IpAddr::V4(ip)),
    };
    ensure!(
        local_v4 == Some(seen.ip()) && local.port() == seen.port(),
        "the server should see the client's own socket: {v}"
    );
    ensure!(
        s.lb.metric("lb_connections_total", "") == 0.0,
        "nothing should go through lb"
    );
    // A kill names such a socket by its mapped addresses: the holder is reset.
    let h = Holder::start(&s.place(), mapped, 1, 60_000)?;
    let ev = h.wait_for("connected", Duration::from_secs(10))?;
    ensure!(ev["server"] == "s0", "{ev}");
    lb_tests::wait_until(Duration::from_secs(5), || Ok(server_status(&s, 0)?.1 == 1))?;
    let t = Instant::now();
    kill_server(&s, 0)?;
    expect_reset(&h, "lb servers kill (IPv4-mapped)", t)?;
    Ok(())
}

#[test]
fn connect_time_with_the_userspace_datapath_falls_back_to_the_proxy() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let hosts = lb_tests::serving_hosts(1, 9000, |i| format!("s{i}"))?;
    let cg = TestCgroup::new()?;
    let listen: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
    let lb = Lb::start(&[
        "--listen",
        &listen.to_string(),
        "--server",
        &hosts[0].addr(9000).to_string(),
        "--datapath",
        "userspace",
        "--forwarding",
        "connect",
        "--cgroup",
        &cg.path.display().to_string(),
    ])?;
    lb.wait_ready(Duration::from_secs(10))?;
    let st = lb.status()?;
    let b = &st["balancers"][0];
    ensure!(b["forwarding"] == "splice", "{st}");
    let why = b["forwarding_fallback"].as_str().unwrap_or("");
    ensure!(why.contains("kernel data path is off"), "{st}");
    ensure!(b["forwarding_fallback_reason"] == "datapath_off", "{st}");
    ensure!(
        lb.metric(
            "lb_balancer_forwarding_fallback_info",
            r#"reason="datapath_off""#
        ) == 1.0
            && lb.metric("lb_balancer_forwarding_fallback_info", "") == 1.0,
        "the fallback gauge: 1 for datapath_off, 0 for the others"
    );
    ensure!(
        lb.log_text().contains("forwarding = connect unavailable"),
        "one warning expected: {}",
        lb.log_text()
    );
    let v = run_client(&Place::cgroup(&cg.path), listen, &["peer"], T)?;
    ensure!(v["ok"] == true && v["server_sees"] != v["local"], "{v}");
    ensure!(lb.metric("lb_connections_total", "") == 1.0, "proxied");
    Ok(())
}

/// What connect-time forwarding buys, printed (not asserted: timings on a shared machine):
/// 64 B round trips and new connections per second, direct to the server, connect-time through
/// the listener, and proxied by lb (a client outside the cgroup, kernel splice upstream).
#[test]
fn connect_time_round_trip_and_new_connection_figures() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let s = setup("failover")?;
    let direct: SocketAddr = server(&s, 0).parse()?;
    let cg = s.place();
    let outside = Place::default();
    let runs: [(&str, &Place<'_>, SocketAddr); 3] = [
        ("direct", &cg, direct),
        ("connect-time", &cg, s.listen),
        ("proxied", &outside, s.listen),
    ];
    for (name, place, addr) in runs {
        let rr = run_client(place, addr, &["rr", "2000", "64"], T)?;
        ensure!(rr["ok"] == true, "{name} rr: {rr}");
        let cps = run_client(place, addr, &["cps", "1000"], T)?;
        ensure!(cps["ok"] == true, "{name} cps: {cps}");
        eprintln!(
            "{name:>12}: 64 B round trip p50 {:.1} µs p99 {:.1} µs; new connections {:.0}/s",
            rr["p50_us"].as_f64().unwrap_or(0.0),
            rr["p99_us"].as_f64().unwrap_or(0.0),
            cps["per_s"].as_f64().unwrap_or(0.0)
        );
    }
    // Only the proxied runs reached lb's listener.
    ensure!(
        s.lb.metric("lb_connections_total", "") >= 2.0,
        "the proxied runs should go through lb"
    );
    Ok(())
}

#[test]
fn connect_time_connections_outlive_lb_and_connects_fail_while_it_is_down() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let mut s = setup("failover")?;
    let h = Holder::start(&s.place(), s.listen, 0, 60_000)?;
    let ev = h.wait_for("connected", Duration::from_secs(10))?;
    ensure!(ev["server"] == "s0", "{ev}");
    let programs = |cg: &TestCgroup| -> Result<usize> {
        let shown = lb_tests::cgroup_programs(&cg.path)?;
        Ok([
            "lb_connect4",
            "lb_connect6",
            "lb_getpeername4",
            "lb_getpeername6",
        ]
        .iter()
        .filter(|p| shown.contains(*p))
        .count())
    };
    ensure!(
        programs(&s.cg)? == 4,
        "the four connect-time programs should be attached"
    );
    let code = s.lb.terminate(Duration::from_secs(10))?;
    ensure!(code == 0, "lb exited with {code}");
    if let Some(dir) = s.lb.pin_dir.clone() {
        // Pinned (a bpffs is mounted): the programs outlive lb until `lb cleanup`
        // (tests/tests/connect_time_pins.rs); take them away to test the unpinned case here.
        ensure!(programs(&s.cg)? == 4, "pinned programs should stay");
        lb_tests::remove_pins(&dir);
    }
    ensure!(
        programs(&s.cg)? == 0,
        "connect-time programs left after exit"
    );
    // lb is gone (programs detached with it): the direct connection stays up.
    if let Ok(ev) = h.next(Duration::from_secs(2)) {
        bail!("the direct connection should outlive lb: {ev}");
    }
    // A new connect to the listener address is no longer rewritten and nobody listens.
    let v = run_client(&s.place(), s.listen, &["peer"], T)?;
    eprintln!("connect while lb is down: {v}");
    ensure!(
        v["ok"] == false && v["kind"] == "ConnectionRefused",
        "expected refused: {v}"
    );
    Ok(())
}

#[test]
fn connect_time_least_connections_balances_held_connections() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let s = setup("least-connections")?;
    // With two servers the kernel compares both on every connect: each new held connection goes
    // to the one with fewer, so after every connect the counts differ by at most one.
    let mut holders = Vec::new();
    for i in 0..6u64 {
        let h = Holder::start(&s.place(), s.listen, 0, 60_000)?;
        h.wait_for("connected", Duration::from_secs(10))?;
        holders.push(h);
        lb_tests::wait_until(Duration::from_secs(5), || {
            Ok(server_status(&s, 0)?.1 + server_status(&s, 1)?.1 == i + 1)
        })?;
        let (n0, n1) = (server_status(&s, 0)?.1, server_status(&s, 1)?.1);
        ensure!(
            n0.abs_diff(n1) <= 1,
            "after {} connects: s0 {n0}, s1 {n1}",
            i + 1
        );
    }
    let (n0, n1) = (server_status(&s, 0)?.1, server_status(&s, 1)?.1);
    eprintln!("6 held connections: s0 {n0}, s1 {n1}");
    ensure!(n0 == 3 && n1 == 3, "s0 {n0}, s1 {n1}");
    let m = s.lb.metric("lb_server_connections", "");
    ensure!(m == 6.0, "lb_server_connections sum {m}");
    let out = std::process::Command::new(lb_tests::lb_bin())
        .args(["status", "--admin", &s.lb.admin.to_string()])
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{text}");
    ensure!(
        out.status.success() && text.contains("forwarding connect"),
        "lb status: {text}"
    );
    Ok(())
}

#[test]
fn connect_time_programs_are_attached_only_when_a_balancer_asks() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let hosts = lb_tests::serving_hosts(1, 9000, |i| format!("s{i}"))?;
    let cg = TestCgroup::new()?;
    let listen: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
    let lb = Lb::start(&[
        "--listen",
        &listen.to_string(),
        "--server",
        &hosts[0].addr(9000).to_string(),
        "--datapath",
        "bpf",
        "--cgroup",
        &cg.path.display().to_string(),
        "--forwarding",
        "splice",
    ]);
    if !lb_tests::splice_kernel() {
        // A splice-only lb has nothing to attach before 5.15: `--datapath bpf` refuses.
        let err = match lb {
            Ok(lb) => bail!("lb started without the splice: {}", lb.log_text()),
            Err(e) => format!("{e:#}"),
        };
        ensure!(
            err.contains("bpf_get_netns_cookie in sockops (5.15+)"),
            "the refusal should name what the splice lacks: {err}"
        );
        ensure!(
            lb_tests::cgroup_programs(&cg.path)?.trim().is_empty(),
            "programs left on the cgroup"
        );
        return Ok(());
    }
    let lb = lb?;
    lb.wait_ready(Duration::from_secs(10))?;
    let shown = lb_tests::cgroup_programs(&cg.path)?;
    ensure!(shown.contains("lb_sockops"), "{shown}");
    ensure!(
        !shown.contains("lb_connect4") && !shown.contains("lb_getpeername4"),
        "splice-only lb should attach no connect-time program: {shown}"
    );
    ensure!(lb.status()?["balancers"][0]["forwarding"] == "splice");
    Ok(())
}

#[test]
fn connect_time_is_the_default_unless_a_balancer_dials_through_a_proxy() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let hosts = lb_tests::serving_hosts(1, 9000, |i| format!("s{i}"))?;
    let cg = TestCgroup::new()?;
    let (direct, proxied) = (free_port()?, free_port()?);
    let server = hosts[0].addr(9000);
    // No `forwarding` anywhere: both balancers are `auto`. The proxy is never dialed: the
    // check and the test only look at what each balancer got.
    let text = Toml::new()
        .table("datapath")
        .string("mode", "bpf")
        .string("cgroup", &cg.path.display().to_string())
        .array_table("balancer")
        .string("name", "direct")
        .value("listen", format!("[\"127.0.0.1:{direct}\"]"))
        .value("servers", format!("[\"{server}\"]"))
        .array_table("balancer")
        .string("name", "proxied")
        .value("listen", format!("[\"127.0.0.1:{proxied}\"]"))
        .value("servers", format!("[\"{server}\"]"))
        .string("proxy", "http://127.0.0.1:9");
    let dir = lb_tests::TempDir::new("lb-auto-forwarding")?;
    let file = dir.join("lb.toml");
    std::fs::write(&file, text.text())?;
    let lb = Lb::start(&["--config", &file.display().to_string()])?;
    // Not ready as a whole: the proxied balancer's checks go to a proxy that refuses.
    lb_tests::wait_until(Duration::from_secs(10), || {
        let st = lb.status()?;
        Ok(st["balancers"].as_array().is_some_and(|a| {
            a.iter().any(|b| {
                b["name"] == "direct"
                    && b["servers"][0]["state"]
                        .as_str()
                        .is_some_and(|s| s == "PREFERRED" || s == "ACTIVE")
            })
        }))
    })
    .with_context(|| {
        format!(
            "the direct balancer's server never passed\n{}",
            lb.log_text()
        )
    })?;
    let status = lb.status()?;
    let b = |name: &str| {
        status["balancers"]
            .as_array()
            .and_then(|a| a.iter().find(|b| b["name"] == name))
            .cloned()
            .unwrap_or_default()
    };
    ensure!(b("direct")["forwarding"] == "connect", "{status}");
    ensure!(b("proxied")["forwarding"] == "splice", "{status}");
    ensure!(
        b("proxied")["forwarding_fallback"]
            .as_str()
            .is_some_and(|why| why.contains("proxy")),
        "the proxied balancer's reason: {status}"
    );
    ensure!(
        b("proxied")["forwarding_fallback_reason"] == "proxy"
            && b("direct")["forwarding_fallback_reason"].is_null(),
        "{status}"
    );
    ensure!(
        lb.metric(
            "lb_balancer_forwarding_fallback_info",
            r#"balancer="proxied",reason="proxy""#
        ) == 1.0
            && lb.metric("lb_balancer_forwarding_fallback_info", "") == 1.0,
        "the fallback gauge: 1 for the proxied balancer's proxy, 0 for the others"
    );
    let log = lb.log_text();
    ensure!(
        log.contains("forwarding = auto: connect-time")
            && log.contains("forwarding = auto: splice"),
        "one line per balancer says what auto chose: {log}"
    );
    // The direct balancer's client is rewritten: it reaches the server and lb accepts nothing.
    let addr: SocketAddr = format!("127.0.0.1:{direct}").parse()?;
    let v = run_client(&Place::cgroup(&cg.path), addr, &["dial"], T)?;
    ensure!(v["ok"] == true && v["server"] == "s0", "{v}");
    ensure!(
        lb.metric("lb_connections_total", "") == 0.0,
        "the client went through lb"
    );
    Ok(())
}

/// An `lbt serve` in lb's own namespace, killed on drop.
struct LocalServer(std::process::Child);

impl Drop for LocalServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn connect_time_ipv6_listener_to_an_ipv6_server() -> Result<()> {
    if skip() {
        return Ok(());
    }
    // A native IPv6 listener and an IPv6 server (on [::1] in lb's namespace): connect6 and
    // getpeername6 with full IPv6 addresses.
    let server: SocketAddr = format!("[::1]:{}", free_port()?).parse()?;
    let _server = LocalServer(
        std::process::Command::new(lb_tests::lbt_bin())
            .args(["serve", "--listen", &server.to_string(), "--name", "v6"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?,
    );
    lb_tests::wait_until(Duration::from_secs(5), || {
        Ok(std::net::TcpStream::connect(server).is_ok())
    })?;
    let cg = TestCgroup::new()?;
    let listen: SocketAddr = format!("[::1]:{}", free_port()?).parse()?;
    let lb = Lb::start(&[
        "--listen",
        &listen.to_string(),
        "--server",
        &server.to_string(),
        "--datapath",
        "bpf",
        "--forwarding",
        "connect",
        "--cgroup",
        &cg.path.display().to_string(),
    ])?;
    lb.wait_settled(Duration::from_secs(10))?;
    lb_tests::wait_until(Duration::from_secs(5), || {
        Ok(lb.log_text().contains("connect-time table updated"))
    })?;
    let v = run_client(&Place::cgroup(&cg.path), listen, &["peer"], T)?;
    eprintln!("IPv6: {v}");
    ensure!(v["ok"] == true && v["server"] == "v6", "{v}");
    ensure!(v["peer"] == listen.to_string(), "getpeername: {v}");
    ensure!(v["server_sees"] == v["local"], "{v}");
    ensure!(lb.metric("lb_connections_total", "") == 0.0, "through lb");
    // A kill names the socket by its IPv6 addresses: the holder is reset.
    let h = Holder::start(&Place::cgroup(&cg.path), listen, 1, 60_000)?;
    h.wait_for("connected", Duration::from_secs(10))?;
    let t = Instant::now();
    let out = std::process::Command::new(lb_tests::lb_bin())
        .args(["servers", "kill", &server.to_string()])
        .args(["--admin", &lb.admin.to_string()])
        .output()?;
    ensure!(out.status.success(), "lb servers kill: {out:?}");
    expect_reset(&h, "lb servers kill (IPv6)", t)?;
    Ok(())
}

/// `[balancer.health]` for servers `s0:9001` (host up, nothing listening: a connect is refused
/// with a reset) and `s1:9000`: the check asks port 9000 of each host (`{host}`), so both pass
/// it, and its 30 s interval leaves only passive signals to fail `s0:9001` during the test. A
/// refused connect counts toward `passive_reset_limit`; at 1, each is one failed check, and
/// `fall` of them fail the server.
fn passive_checks(fall: u64) -> Toml {
    Toml::new()
        .table("balancer.health")
        .string("kind", "http")
        .string("url", "http://{host}:9000/healthz")
        .string("interval", "30s")
        .string("timeout", "1s")
        .value("rise", 1)
        .value("fall", fall)
        .value("passive", true)
        .value("passive_reset_limit", 1)
        .string("on_unhealthy", "kill")
}

#[test]
fn connect_time_refused_connects_fail_a_server_without_a_check() -> Result<()> {
    if skip() {
        return Ok(());
    }
    const PASSIVE_FALL: u64 = 3;
    let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    let refusing = hosts[0].addr(9001).to_string();
    let servers = format!("\"{refusing}\", \"{}\"", hosts[1].addr(9000));
    let health = passive_checks(PASSIVE_FALL);
    let s = ConnectLb::start(hosts, |listen| {
        config(&Toml::new(), &[listen], &servers, "failover", &health)
    })?;
    let (first, _) = s.status_of(&refusing)?;
    ensure!(
        first != "FAILED",
        "{refusing} passed its check on :9000: {first}"
    );
    let failures = || s.lb.metric("lb_health_checks_total", "result=\"failure\"");
    let refused = || {
        s.lb.metric("lb_passive_events_total", "kind=\"connect_failed\"")
    };
    ensure!(
        failures() == 0.0,
        "no check should fail: {}",
        s.lb.log_text()
    );

    let mut last = Instant::now();
    for i in 1..=PASSIVE_FALL {
        let v = run_client(&s.place(), s.listen, &["dial"], T)?;
        last = Instant::now();
        ensure!(
            v["ok"] == false && v["errno"] == ECONNREFUSED,
            "connect {i} should be refused by {refusing}: {v}"
        );
        // The event is counted by lb a moment after the client saw the reset.
        lb_tests::wait_until(Duration::from_secs(2), || Ok(refused() == i as f64))
            .with_context(|| format!("lb_passive_events_total after {i}: {}", refused()))?;
        if i < PASSIVE_FALL {
            let (state, _) = s.status_of(&refusing)?;
            ensure!(
                state != "FAILED",
                "FAILED after {i} < fall refused connects"
            );
        }
    }
    let took = lb_tests::wait_until(Duration::from_secs(2), || {
        Ok(s.status_of(&refusing)?.0 == "FAILED")
    })
    .with_context(|| format!("{refusing} not FAILED: {}", s.lb.log_text()))?;
    eprintln!(
        "{refusing} FAILED {:.3} s after refused connect-time connect number {PASSIVE_FALL} ({:.3} s after the client saw it)",
        last.elapsed().as_secs_f64(),
        took.as_secs_f64()
    );
    ensure!(
        failures() == 0.0,
        "a health check failed; only the refused connects should count"
    );
    // The table moved: the next client goes to the other server.
    let v = run_client(&s.place(), s.listen, &["dial"], T)?;
    ensure!(v["ok"] == true && v["server"] == "s1", "{v}");
    Ok(())
}

#[test]
fn connect_time_syn_sent_connects_to_a_failed_server_are_aborted() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let s = setup("failover")?;
    let v = peer(&s, &s.place())?;
    ensure!(v["server"] == "s0", "failover sends to s0 first: {v}");

    let (dial, done, failed, t0) = dial_into_blackhole(&s)?;
    let bound = Duration::from_millis(INTERVAL_MS * FALL + TIMEOUT_MS + SLACK_MS);
    eprintln!(
        "s0 FAILED {:.3} s after the blackhole; the pending connect ended {:.3} s after that ({} after {} ms in connect())",
        (failed - t0).as_secs_f64(),
        done.saturating_duration_since(failed).as_secs_f64(),
        dial["error"],
        dial["ms"]
    );
    ensure!(
        !timed() || failed - t0 <= bound,
        "FAILED after {:?}",
        failed - t0
    );
    ensure!(
        dial["ok"] == false && (dial["errno"] == ECONNABORTED || dial["errno"] == ECONNRESET),
        "the pending connect should be aborted: {dial}"
    );
    ensure!(
        !timed() || done - t0 <= bound + Duration::from_millis(KILL_SLACK_MS),
        "the connect ended {:?} after the blackhole, not at once when s0 turned FAILED: {dial}",
        done - t0
    );
    // lb's own abort is not a failure of the server.
    ensure!(
        s.lb.metric("lb_passive_events_total", "kind=\"connect_failed\"") == 0.0,
        "the destroyed connect was counted as a server failure"
    );
    s.hosts[0].blackhole(false)?;
    Ok(())
}

/// Servers `s0:9000` and `s1:9000`, every check sent to s1 (`shared_target`), so a blackholed
/// s0 fails no check; one reset (an RTO counts as one) is one failed check, and one fails it.
#[test]
fn connect_time_retransmission_timeout_counts_as_a_reset() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    let servers = lb_tests::toml_addrs(&hosts, 9000);
    let health = ConnectLb::shared_checks(&hosts[1].addr(9000).to_string(), "30s", 1);
    let s = ConnectLb::start(hosts, |listen| {
        config(&Toml::new(), &[listen], &servers, "failover", &health)
    })?;
    let v = peer(&s, &s.place())?;
    ensure!(v["server"] == "s0", "failover sends to s0 first: {v}");
    let failures = || s.lb.metric("lb_health_checks_total", "result=\"failure\"");
    let diag = || {
        // Every TCP socket of this namespace but those in TIME_WAIT (state 06).
        let tcp: String = std::fs::read_to_string("/proc/net/tcp")
            .unwrap_or_default()
            .lines()
            .filter(|l| l.split_whitespace().nth(3) != Some("06"))
            .map(|l| format!("{l}\n"))
            .collect();
        let socks = std::process::Command::new("bpftool")
            .args(["map", "dump", "name", "LB_CONNECT_SOCK"])
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout).into_owned()
                    + &String::from_utf8_lossy(&o.stderr)
            })
            .unwrap_or_default();
        let metrics = s.lb.get("/metrics").map(|r| r.1).unwrap_or_default();
        let passive: Vec<&str> = metrics
            .lines()
            .filter(|l| {
                l.contains("passive") || l.contains("event_drops") || l.contains("connections")
            })
            .collect();
        format!(
            "DIAG /proc/net/tcp:\n{tcp}\nLB_CONNECT_SOCKS:\n{socks}\n{passive:#?}\nlog:\n{}",
            s.lb.log_text()
        )
    };
    // An echo client sending without pause: once s0 is blackholed its next segment is never
    // acknowledged, and the retransmission timer fires.
    let (rr, done, failed, t0) = std::thread::scope(|scope| -> Result<_> {
        let client = scope.spawn(|| {
            let r = run_client(
                &s.place(),
                s.listen,
                &["rr", "1000000000", "64"],
                Duration::from_secs(if timed() { 30 } else { 150 }),
            );
            (r, Instant::now())
        });
        // Under TCG the client alone can take seconds to start.
        let start_bound = Duration::from_secs(if timed() { 5 } else { 30 });
        lb_tests::wait_until(start_bound, || Ok(server_status(&s, 0)?.1 == 1)).with_context(
            || {
                format!(
                    "the echo client's connection should count on s0: {:?}; {}",
                    server_status(&s, 0),
                    diag()
                )
            },
        )?;
        let t0 = Instant::now();
        s.hosts[0].blackhole(true)?;
        let failed = wait_s0_failed(&s, t0, Duration::from_secs(if timed() { 10 } else { 60 }))
            .with_context(diag)?;
        let (r, done) = client.join().expect("client thread");
        Ok((r?, done, failed, t0))
    })?;
    let rto = s.lb.metric("lb_passive_events_total", "kind=\"rto\"");
    eprintln!(
        "s0 FAILED {:.3} s after the blackhole on {rto} RTO event(s); the echo client ended {:.3} s after that: {}",
        (failed - t0).as_secs_f64(),
        done.saturating_duration_since(failed).as_secs_f64(),
        rr["error"]
    );
    ensure!(rto == 1.0, "one RTO event expected, got {rto}");
    ensure!(
        failures() == 0.0,
        "a health check failed; only the RTO should count"
    );
    ensure!(
        !timed() || failed - t0 <= Duration::from_secs(3),
        "FAILED only {:?} after the blackhole",
        failed - t0
    );
    ensure!(
        rr["ok"] == false
            && rr["kind"]
                .as_str()
                .is_some_and(|k| k == "ConnectionAborted" || k == "ConnectionReset"),
        "the echo client should be killed: {rr}"
    );
    s.hosts[0].blackhole(false)?;
    Ok(())
}

#[test]
fn connect_time_syn_sent_connects_are_aborted_with_on_unhealthy_keep() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    let servers = lb_tests::toml_addrs(&hosts, 9000);
    let health = checks(INTERVAL_MS, TIMEOUT_MS, FALL, "keep");
    let s = ConnectLb::start(hosts, |listen| {
        config(&Toml::new(), &[listen], &servers, "failover", &health)
    })?;
    // An established connection to s0, idle: `keep` leaves it alone.
    let h = Holder::start(&s.place(), s.listen, 0, 60_000)?;
    let ev = h.wait_for("connected", Duration::from_secs(10))?;
    ensure!(ev["server"] == "s0", "{ev}");

    let (dial, done, failed, t0) = dial_into_blackhole(&s)?;
    let bound = Duration::from_millis(INTERVAL_MS * FALL + TIMEOUT_MS + SLACK_MS);
    eprintln!(
        "on_unhealthy = keep: s0 FAILED {:.3} s after the blackhole; the pending connect ended {:.3} s after that ({})",
        (failed - t0).as_secs_f64(),
        done.saturating_duration_since(failed).as_secs_f64(),
        dial["error"]
    );
    ensure!(
        dial["ok"] == false && (dial["errno"] == ECONNABORTED || dial["errno"] == ECONNRESET),
        "the pending connect should be aborted: {dial}"
    );
    ensure!(
        !timed() || done - t0 <= bound + Duration::from_millis(KILL_SLACK_MS),
        "the connect ended {:?} after the blackhole: {dial}",
        done - t0
    );
    // The established connection is kept.
    ensure!(
        h.next(Duration::from_millis(500)).is_err(),
        "the held connection should be kept under on_unhealthy = keep"
    );
    let (_, held) = server_status(&s, 0)?;
    ensure!(
        held == 1,
        "s0 should still count the held connection: {held}"
    );
    s.hosts[0].blackhole(false)?;
    Ok(())
}

#[test]
fn connect_time_clients_in_another_network_namespace_are_rewritten_and_killed() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    // A second listener on the root side of s0's link, which a client inside s0's namespace
    // reaches; its connects are rewritten to s0 itself, in that namespace.
    let gateway = hosts[0].gateway;
    // A client of another namespace is rewritten only with the opt-in.
    let servers = lb_tests::toml_addrs(&hosts, 9000);
    let health = checks(INTERVAL_MS, TIMEOUT_MS, FALL, "kill");
    let s = ConnectLb::start(hosts, |listen| {
        let second = SocketAddr::new(gateway.into(), listen.port());
        let datapath = Toml::new().string("namespaces", "all");
        config(&datapath, &[listen, second], &servers, "failover", &health)
    })?;
    let ns = s.hosts[0].ns.clone();
    let place = Place {
        cgroup: Some(&s.cg.path),
        netns: Some(&ns),
    };
    let dialed: SocketAddr = SocketAddr::new(gateway.into(), s.listen.port());
    let v = run_client(&place, dialed, &["peer"], T)?;
    eprintln!("client in namespace {ns}: {v}");
    ensure!(v["ok"] == true, "{v}");
    ensure!(v["peer"] == dialed.to_string(), "getpeername: {v}");
    ensure!(v["server"] == "s0", "{v}");
    ensure!(
        v["server_sees"] == v["local"],
        "the server should see the client's own socket: {v}"
    );
    ensure!(
        s.lb.metric("lb_connections_total", "") == 0.0,
        "nothing should go through lb"
    );

    let h = Holder::spawn(&place, dialed, &["hold", "--max-ms", "60000"])?;
    let ev = h.wait_for("connected", Duration::from_secs(10))?;
    ensure!(ev["server"] == "s0", "{ev}");
    lb_tests::wait_until(Duration::from_secs(5), || Ok(server_status(&s, 0)?.1 == 1))?;
    let t = Instant::now();
    kill_server(&s, 0)?;
    let closed = h
        .wait_for("closed", Duration::from_secs(5))
        .with_context(|| {
            format!(
                "the client in namespace {ns} was not killed: {}",
                s.lb.log_text()
            )
        })?;
    eprintln!(
        "lb servers kill in namespace {ns}: client {} after {:.3} s",
        closed["how"],
        t.elapsed().as_secs_f64()
    );
    ensure!(
        closed["how"] == "connection reset" || closed["how"] == "connection aborted",
        "{closed}"
    );
    // Counted once the kill returns, which can be just after the client saw it.
    lb_tests::wait_until(Duration::from_secs(5), || {
        Ok(s.lb.metric("lb_connections_killed_total", "") >= 1.0)
    })
    .context("the kill should be counted")?;
    Ok(())
}

/// Connect-time sockets the kill test holds open (the issue asks for 10,000; each needs a file
/// in the client and one in the server, both under the machine's open-files limit). The qemu
/// guests have too little memory for 10,000 server threads: they hold 1,000.
fn many() -> u32 {
    if timed() { 10_000 } else { 1_000 }
}

#[test]
fn connect_time_ten_thousand_sockets_are_killed() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let many = many();
    let hard = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)?.1;
    if hard < u64::from(many) + 1024 {
        eprintln!(
            "skipped connect_time_ten_thousand_sockets_are_killed: the open-files hard limit is {hard}, below {many} + 1024"
        );
        return Ok(());
    }
    // Checks that a server busy accepting 10,000 connections passes in time.
    let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    let servers = lb_tests::toml_addrs(&hosts, 9000);
    let health = checks(1000, 1000, 5, "kill");
    let s = ConnectLb::start(hosts, |listen| {
        config(&Toml::new(), &[listen], &servers, "failover", &health)
    })?;
    let max_ms = if timed() { "120000" } else { "600000" };
    let idle = Holder::spawn(
        &s.place(),
        s.listen,
        &["idle", &many.to_string(), "--max-ms", max_ms],
    )?;
    let ready_within = if timed() { 60 } else { 500 };
    let ready = idle
        .wait_for("ready", Duration::from_secs(ready_within))
        .with_context(|| s.lb.log_text())?;
    eprintln!("{many} connect-time connections open in {} ms", ready["ms"]);
    lb_tests::wait_until(Duration::from_secs(10), || {
        Ok(server_status(&s, 0)?.1 == u64::from(many))
    })
    .with_context(|| format!("s0 should count {many}: {:?}", server_status(&s, 0)))?;
    ensure!(
        s.lb.metric("lb_connections_total", "") == 0.0,
        "nothing should go through lb"
    );
    let t = Instant::now();
    kill_server(&s, 0)?;
    let done = idle.wait_for("all_closed", Duration::from_secs(ready_within))?;
    let took = t.elapsed();
    eprintln!(
        "lb servers kill of {many} connect-time sockets: all closed after {:.3} s (first {:.1} ms, last {:.1} ms after ready; resets {}, eofs {}, others {})",
        took.as_secs_f64(),
        done["first_ms"],
        done["last_ms"],
        done["resets"],
        done["eofs"],
        done["others"]
    );
    ensure!(done["ok"] == true, "{done}");
    ensure!(
        done["eofs"] == 0,
        "every socket should be reset or aborted, none closed cleanly: {done}"
    );
    ensure!(
        !timed() || took < Duration::from_secs(5),
        "killing {many} took {took:?}"
    );
    // Counted once the kill's last batch is acknowledged, which can be just after the clients
    // saw their resets.
    lb_tests::wait_until(Duration::from_secs(5), || {
        Ok(s.lb.metric("lb_connections_killed_total", "") == f64::from(many))
    })
    .with_context(|| {
        format!(
            "lb_connections_killed_total {}, want {many}",
            s.lb.metric("lb_connections_killed_total", "")
        )
    })?;
    lb_tests::wait_until(Duration::from_secs(5), || Ok(server_status(&s, 0)?.1 == 0))
        .with_context(|| {
            format!(
                "s0 should count 0 after the kill: {:?}",
                server_status(&s, 0)
            )
        })?;
    Ok(())
}

#[test]
fn connect_time_falls_back_to_splice_when_the_kernel_refuses_a_hook() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    let cg = TestCgroup::new()?;
    // Another program owns cgroup/connect4 exclusively: the kernel refuses lb's.
    cg.occupy_connect4()?;
    let port = free_port()?;
    let listen = SocketAddr::from(([127, 0, 0, 1], port));
    let servers = lb_tests::toml_addrs(&hosts, 9000);
    let health = checks(INTERVAL_MS, TIMEOUT_MS, FALL, "kill");
    let text = config(&Toml::new(), &[listen], &servers, "failover", &health);
    let config = std::env::temp_dir().join(format!(
        "lb-connect-refused-{}-{port}.toml",
        std::process::id()
    ));
    std::fs::write(&config, text.text())?;
    let lb = Lb::start(&[
        "--config",
        &config.display().to_string(),
        "--cgroup",
        &cg.path.display().to_string(),
    ]);
    let _ = std::fs::remove_file(&config);
    if !lb_tests::splice_kernel() {
        // Without the splice (before 5.15) `mode = "bpf"` has nothing left to run: lb refuses
        // to start, naming both.
        let err = match lb {
            Ok(lb) => bail!(
                "lb started without the splice or connect4: {}",
                lb.log_text()
            ),
            Err(e) => format!("{e:#}"),
        };
        eprintln!("{}", err.lines().last().unwrap_or_default());
        ensure!(
            err.contains("nothing to run")
                && err.contains("sockops")
                && err.contains("lb_connect4"),
            "the refusal should name what the splice lacks and the refused program: {err}"
        );
        return Ok(());
    }
    let lb = lb?;
    lb.wait_settled(Duration::from_secs(10))?;
    let st = lb.status()?;
    let b = &st["balancers"][0];
    eprintln!(
        "forwarding {} ({}); datapath {}",
        b["forwarding"], b["forwarding_fallback"], st["datapath"]
    );
    ensure!(b["forwarding"] == "splice", "{st}");
    let why = b["forwarding_fallback"].as_str().unwrap_or("");
    ensure!(
        why.contains("lb_connect4"),
        "the reason should name the refused program: {st}"
    );
    ensure!(b["forwarding_fallback_reason"] == "kernel_feature", "{st}");
    ensure!(
        lb.metric(
            "lb_balancer_forwarding_fallback_info",
            r#"reason="kernel_feature""#
        ) == 1.0,
        "the fallback gauge's kernel_feature"
    );
    let log = lb.log_text();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("forwarding = connect unavailable"))
        .collect();
    ensure!(
        warnings.len() == 1 && warnings[0].contains("lb_connect4"),
        "one warning naming the refused program: {log}"
    );
    // The balancer still serves its clients in the cgroup, through lb's splice.
    let listen: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let v = run_client(&Place::cgroup(&cg.path), listen, &["peer"], T)?;
    ensure!(v["ok"] == true && v["server"] == "s0", "{v}");
    ensure!(
        v["server_sees"] != v["local"],
        "the server should see lb's socket, not the client's: {v}"
    );
    ensure!(
        lb.metric("lb_connections_total", "") >= 1.0,
        "the connection should go through lb"
    );
    drop(lb);
    drop(hosts);
    Ok(())
}

#[test]
fn connect_time_failback_moves_clients_back_to_the_recovered_server() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let s = setup("failover")?;
    let holders = (0..3)
        .map(|_| Holder::start(&s.place(), s.listen, 3, 60_000))
        .collect::<Result<Vec<_>>>()?;
    for h in &holders {
        let ev = h.wait_for("connected", Duration::from_secs(10))?;
        ensure!(ev["server"] == "s0", "{ev}");
    }
    s.hosts[0].blackhole(true)?;
    wait_s0_failed(&s, Instant::now(), Duration::from_secs(10))?;
    for h in &holders {
        let ev = h.wait_for("connected", Duration::from_secs(10))?;
        ensure!(ev["server"] == "s1", "after the failover: {ev}");
    }
    let t = Instant::now();
    s.hosts[0].blackhole(false)?;
    // s0 passes its next check (rise 1) and wins fail-back: the clients on s1 are reset and
    // their reconnects go to s0.
    for h in &holders {
        let closed = h.wait_for("closed", Duration::from_secs(10))?;
        ensure!(
            closed["how"] == "connection reset" || closed["how"] == "connection aborted",
            "{closed}"
        );
        let ev = h.wait_for("connected", Duration::from_secs(10))?;
        ensure!(ev["server"] == "s0", "after the fail-back: {ev}");
    }
    eprintln!(
        "fail-back: three connect-time clients back on s0 {:.3} s after the blackhole ended",
        t.elapsed().as_secs_f64()
    );
    let failback = killed(&s, "failback");
    ensure!(failback == 3.0, "killed for fail-back: {failback}, want 3");
    Ok(())
}

#[test]
fn connect_time_server_removed_through_the_api_resets_its_clients() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let s = setup("failover")?;
    let h = Holder::start(&s.place(), s.listen, 1, 60_000)?;
    let ev = h.wait_for("connected", Duration::from_secs(10))?;
    ensure!(ev["server"] == "s0", "{ev}");
    lb_tests::wait_until(Duration::from_secs(5), || Ok(server_status(&s, 0)?.1 == 1))?;
    let t = Instant::now();
    servers_cmd(&s, &["remove", &server(&s, 0)])?;
    expect_reset(&h, "server removed, its connect-time", t)?;
    let ev = h.wait_for("connected", Duration::from_secs(5))?;
    ensure!(ev["server"] == "s1", "the reconnect should go to s1: {ev}");
    ensure!(
        killed(&s, "removed") == 1.0,
        "killed for removal: {}",
        killed(&s, "removed")
    );
    let st = s.lb.status()?;
    let servers = st["balancers"][0]["servers"]
        .as_array()
        .context("servers")?;
    ensure!(
        servers.len() == 1 && servers[0]["address"] == server(&s, 1).as_str(),
        "s0 should be gone: {st}"
    );
    // Later connects never reach s0 again.
    for _ in 0..5 {
        let v = peer(&s, &s.place())?;
        ensure!(v["server"] == "s1", "{v}");
    }
    Ok(())
}
