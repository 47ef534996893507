//! Fail fast in the kernel for connect-time balancing (`forwarding = "connect"`): a rewritten
//! connect's SYN timeout comes from lb (`fail_fast.syn_timeout`), a connect whose SYNs go
//! unanswered `suspect_after` times marks its server suspect so the next connects go
//! elsewhere before any check fails, a passing check clears it, and `TCP_SYNCNT` bounds a
//! connect to a dead server on its own.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, ensure};
use lb_tests::{
    ConnectLb, Host, Toml, free_port, run_client, skip_unless_kernel, skip_unless_root, timed,
};
use serde_json::Value;

const T: Duration = Duration::from_secs(60);

/// lb in front of two fresh hosts, servers `s0`, `s1` in failover order; checks (tcp) every
/// `interval`, so none runs during a test unless it asks (`/check`). `fail_fast` is the
/// `[datapath.fail_fast]` body.
fn start(fail_fast: &str, interval: &str) -> Result<ConnectLb> {
    let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    let servers = lb_tests::toml_addrs(&hosts, 9000);
    let datapath = Toml::new().table("datapath.fail_fast").lines(fail_fast);
    ConnectLb::start(hosts, |listen| {
        ConnectLb::config(&datapath, &[listen], &servers, "failover")
            .table("balancer.health")
            .string("kind", "tcp")
            .string("interval", interval)
            .string("timeout", "1s")
            .value("rise", 1)
            .value("fall", 1)
    })
}

/// Root and a kernel with the getpeername (5.8) and sock_release (5.9) hooks.
fn skip() -> bool {
    skip_unless_root() || skip_unless_kernel((5, 9), "cgroup getpeername4/6 and sock_release hooks")
}

/// `/status` entry of the server at `addr`.
fn server(s: &ConnectLb, addr: &str) -> Result<Value> {
    let st = s.lb.status()?;
    st["balancers"][0]["servers"]
        .as_array()
        .context("servers")?
        .iter()
        .find(|v| v["address"] == addr)
        .cloned()
        .with_context(|| format!("{addr} not in /status: {st}"))
}

/// One blocking dial through the listener (no time limit of its own: the kernel's SYN
/// retries, or lb's abort, end it).
fn dial(s: &ConnectLb) -> Result<Value> {
    run_client(&s.place(), s.listen, &["dial"], T)
}

/// `n` dials one after another; how many reached each server.
fn dial_times(s: &ConnectLb, n: u32) -> Result<Value> {
    run_client(
        &s.place(),
        s.listen,
        &["dial", "--times", &n.to_string()],
        T,
    )
}

#[test]
fn connect_time_blackholed_server_is_avoided_before_any_check_fails() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let s = start(
        "syn_timeout = \"200ms\"\nsuspect_after = 2\nsyn_retries = 3",
        "60s",
    )?;
    let s0 = s.hosts[0].addr(9000).to_string();
    let first = dial(&s)?;
    ensure!(
        first["server"] == "s0",
        "failover sends to s0 first: {first}"
    );

    s.hosts[0].blackhole(true)?;
    let t0 = Instant::now();
    // The first connect goes to s0: two SYN timeouts (0.4 s) mark s0 suspect and lb aborts it.
    let caught = dial(&s)?;
    let caught_after = t0.elapsed();
    eprintln!(
        "connect to the blackholed s0: {caught} ({:.3} s after the blackhole)",
        caught_after.as_secs_f64()
    );
    ensure!(
        caught["errno"] == libc::ECONNABORTED,
        "the connect to the suspect s0 should be aborted: {caught}\n{}",
        s.lb.log_text()
    );
    let after = dial_times(&s, 5)?;
    let avoided_after = t0.elapsed();
    eprintln!(
        "5 connects after it: {after}; all done {:.3} s after the blackhole",
        avoided_after.as_secs_f64()
    );
    ensure!(
        after["servers"]["s1"] == 5,
        "new connects should go to s1: {after}"
    );
    if timed() {
        // 2 × 200 ms of SYN timeouts, lb's 100 ms look, the abort; far below a check's 60 s
        // and the kernel's 1 s first SYN timeout.
        ensure!(
            caught_after < Duration::from_millis(1500),
            "aborted {caught_after:?} after the blackhole"
        );
    }
    let st = server(&s, &s0)?;
    ensure!(
        st["state"] != "FAILED" && st["suspect"] == true,
        "s0 should be suspect, not FAILED (no check ran): {st}"
    );
    let marks =
        s.lb.metric("lb_connect_suspect_total", &format!("server=\"{s0}\""));
    ensure!(marks == 1.0, "lb_connect_suspect_total for s0: {marks}");

    // s0 answers again; a check passes (asked for now) and clears the suspicion.
    s.hosts[0].blackhole(false)?;
    let (code, body) = s.lb.get("/check?balancer=api")?;
    ensure!(code == 200, "/check: {code} {body}");
    lb_tests::wait_until(Duration::from_secs(5), || {
        Ok(server(&s, &s0)?["suspect"] == false)
    })
    .with_context(|| format!("s0 still suspect\n{}", s.lb.log_text()))?;
    let back = dial_times(&s, 3)?;
    ensure!(
        back["servers"]["s0"] == 3,
        "connects should go back to s0 under failover: {back}"
    );
    Ok(())
}

/// Drops every packet `host` sends to client port `port` (a policy rule with the blackhole
/// action, as in `connect_time_health.rs`): that port's SYNs are never answered, other ports'
/// are; removed on drop.
struct DropToPort<'a> {
    host: &'a Host,
    port: String,
}

impl<'a> DropToPort<'a> {
    fn new(host: &'a Host, port: u16) -> Result<DropToPort<'a>> {
        let port = port.to_string();
        host.exec_ok(
            "ip",
            &["rule", "add", "ipproto", "6", "dport", &port, "blackhole"],
        )?;
        Ok(DropToPort { host, port })
    }
}

impl Drop for DropToPort<'_> {
    fn drop(&mut self) {
        let _ = self.host.exec_ok(
            "ip",
            &[
                "rule",
                "del",
                "ipproto",
                "6",
                "dport",
                &self.port,
                "blackhole",
            ],
        );
    }
}

#[test]
fn connect_time_lost_syns_below_the_threshold_divert_nothing() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let s = start(
        "syn_timeout = \"200ms\"\nsuspect_after = 2\nsyn_retries = 3",
        "60s",
    )?;
    let s0 = s.hosts[0].addr(9000).to_string();
    // One client port's SYNs go unanswered; the client gives up after 300 ms: one SYN timeout
    // (200 ms), below suspect_after = 2.
    let port = free_port()?;
    let lost = DropToPort::new(&s.hosts[0], port)?;
    let bind = format!("0.0.0.0:{port}");
    let one = run_client(
        &s.place(),
        s.listen,
        &["dial", "--bind", &bind, "--timeout-ms", "300"],
        T,
    )?;
    ensure!(
        one["ok"] == false,
        "the dial from :{port} should time out: {one}"
    );
    let next = dial_times(&s, 3)?;
    eprintln!("one SYN timeout, then: {next}");
    ensure!(
        next["servers"]["s0"] == 3,
        "one lost SYN must divert nothing: {next}\n{}",
        s.lb.log_text()
    );
    ensure!(server(&s, &s0)?["suspect"] == false, "s0 marked suspect");
    ensure!(
        s.lb.metric("lb_connect_suspect_total", "") == 0.0,
        "no server may be marked"
    );
    // The same port, given up after 1,000 ms: two SYN timeouts (at 200 and 600 ms; a third
    // would come at 1,400 ms) reach the threshold, with 400 ms to spare for a loaded TCG guest
    // whose timers run late.
    let two = run_client(
        &s.place(),
        s.listen,
        &["dial", "--bind", &bind, "--timeout-ms", "1000"],
        T,
    )?;
    drop(lost);
    eprintln!("two SYN timeouts: {two}");
    lb_tests::wait_until(Duration::from_secs(5), || {
        Ok(server(&s, &s0)?["suspect"] == true)
    })
    .with_context(|| format!("s0 not suspect after two SYN timeouts\n{}", s.lb.log_text()))?;
    let diverted = dial_times(&s, 3)?;
    ensure!(
        diverted["servers"]["s1"] == 3,
        "a suspect s0 is avoided: {diverted}"
    );
    Ok(())
}

#[test]
fn connect_time_syn_timeout_and_syncnt_apply_to_rewritten_sockets() -> Result<()> {
    if skip() {
        return Ok(());
    }
    // A fixed SYN timeout: `auto` is 3 × the checks' connect round trip, which on a loaded TCG
    // guest can reach its 1 s ceiling, the kernel's own value, and then proves nothing here.
    // suspect_after = 0: nothing marks or aborts, so the kernel alone ends the connect.
    let s = start(
        "syn_timeout = \"200ms\"\nsuspect_after = 0\nsyn_retries = 1",
        "60s",
    )?;
    // lb writes the policy within 100 ms of the table.
    lb_tests::wait_until(Duration::from_secs(5), || {
        Ok(s.map_entries("LB_CONNECT_SYN")? == 2)
    })?;
    s.hosts[0].blackhole(true)?;
    let v = run_client(
        &s.place(),
        s.listen,
        &["syn-sent", "--within-ms", "3000"],
        T,
    )?;
    eprintln!("SYN_SENT socket to the blackholed s0: {v}");
    ensure!(
        v["ok"] == true && v["state"] == 2,
        "a connect in SYN_SENT: {v}"
    );
    ensure!(v["syncnt"] == 1, "TCP_SYNCNT set from syn_retries = 1: {v}");
    let rto = v["rto_us"].as_u64().context("rto_us")?;
    ensure!(
        (100_000..1_000_000).contains(&rto),
        "the SYN timeout should be lb's 200 ms, not the kernel's 1 s: {v}"
    );
    let first = v["first_retransmit_ms"]
        .as_u64()
        .context("no SYN retransmission")?;
    if timed() {
        ensure!(
            first < 700,
            "first SYN retransmission after {first} ms; the kernel's own is 1000 ms"
        );
    }
    // TCP_SYNCNT = 1 ends a connect to a dead server with ETIMEDOUT on its own (as it does
    // while lb is down): the kernel gives up once the time 1 retry takes with backoff has
    // passed, (2^2 - 1) × the SYN timeout, not after tcp_syn_retries' two minutes.
    let t0 = Instant::now();
    let d = dial(&s)?;
    eprintln!(
        "blocking connect: {d} after {:.3} s",
        t0.elapsed().as_secs_f64()
    );
    ensure!(
        d["errno"] == libc::ETIMEDOUT,
        "TCP_SYNCNT should end the connect with ETIMEDOUT: {d}"
    );
    if timed() {
        ensure!(
            t0.elapsed() < Duration::from_secs(10),
            "took {:?}",
            t0.elapsed()
        );
    }
    Ok(())
}
