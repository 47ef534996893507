//! Both data paths on real traffic: servers on test hosts in network namespaces, clients in a
//! child cgroup (so the bpf path's sockops sees them), lb as a real process.

use std::time::Duration;

use anyhow::{Result, ensure};
use lb_tests::{Fixture, Host, Lb, Place, free_port, run_client, skip_unless_root};
use serde_json::Value;

const MIB: u64 = 1024 * 1024;
const T: Duration = Duration::from_secs(120);

/// `n` hosts each serving on port 9000, lb in `mode` listening on a free loopback port.
fn setup(mode: &str, n: usize, extra: &[&str]) -> Result<Fixture> {
    let hosts = lb_tests::serving_hosts(n, 9000, |i| format!("s{i}"))?;
    let servers: Vec<String> = hosts.iter().map(|h| h.addr(9000).to_string()).collect();
    let mut args = vec![
        "--listen",
        "{listen}",
        "--datapath",
        mode,
        "--cgroup",
        "{cgroup}",
        "--forwarding",
        "splice",
    ];
    for server in &servers {
        args.extend(["--server", server.as_str()]);
    }
    args.extend_from_slice(extra);
    Fixture::start_args(hosts, 9000, &args)
}

/// Run `action` as a client in the fixture's cgroup.
fn client(s: &Fixture, action: &[&str]) -> Result<Value> {
    run_client(&s.place(), s.listen, action, T)
}

fn ok(v: &Value) -> Result<()> {
    ensure!(v["ok"] == true, "client failed: {v}");
    Ok(())
}

fn bulk_both_directions(mode: &str) -> Result<()> {
    let s = setup(mode, 1, &[])?;
    let n = (256 * MIB).to_string();
    // The pause lets lb pair the connection before the data (README, "The counting rule").
    ok(&client(&s, &["up", &n, "--pause-ms", "200"])?)?;
    ok(&client(&s, &["down", &n])?)?;
    // Every byte went exactly one way: spliced by the kernel or copied by lb (protocol headers
    // "UP\n" and "DOWN <n> 7\n" included). How much the kernel carries depends on how often
    // backpressure sent sends to the copy path; the benchmark measures that, this test the sum.
    let sent = 256 * MIB + 3 + format!("DOWN {n} 7\n").len() as u64;
    let spliced = s.lb.metric("lb_spliced_bytes_total", "client_to_server");
    let copied = s.lb.metric("lb_copied_bytes_total", "client_to_server");
    ensure!(
        spliced + copied == sent as f64,
        "spliced {spliced} + copied {copied} != {sent} sent"
    );
    if mode == "bpf" {
        ensure!(spliced > 0.0, "nothing was spliced by the kernel");
    } else {
        ensure!(spliced == 0.0, "the userspace path spliced {spliced} bytes");
    }
    Ok(())
}

#[test]
fn bulk_256mib_each_way_userspace() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    bulk_both_directions("userspace")
}

#[test]
fn bulk_256mib_each_way_bpf() -> Result<()> {
    if skip_unless_root() || lb_tests::splice_fallback_asserted()? {
        return Ok(());
    }
    bulk_both_directions("bpf")
}

fn early_sends_in_order(mode: &str) -> Result<()> {
    let s = setup(mode, 1, &[])?;
    // 300 connections that write at once after connecting, in 1 KiB writes: the pairing races
    // with the first bytes on every one of them.
    let v = client(&s, &["many", "300", "200000"])?;
    ok(&v)
}

#[test]
fn early_sends_in_order_bpf() -> Result<()> {
    if skip_unless_root() || lb_tests::splice_fallback_asserted()? {
        return Ok(());
    }
    early_sends_in_order("bpf")
}

#[test]
fn early_sends_in_order_userspace() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    early_sends_in_order("userspace")
}

fn concurrent_1000(mode: &str) -> Result<()> {
    let s = setup(mode, 2, &[])?;
    let v = client(&s, &["many", "1000", "20000"])?;
    ok(&v)
}

#[test]
fn concurrent_1000_bpf() -> Result<()> {
    if skip_unless_root() || lb_tests::splice_fallback_asserted()? {
        return Ok(());
    }
    concurrent_1000("bpf")
}

#[test]
fn concurrent_1000_userspace() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    concurrent_1000("userspace")
}

fn server_reset_reaches_client(mode: &str) -> Result<()> {
    let s = setup(mode, 1, &[])?;
    let v = client(&s, &["rst"])?;
    ok(&v)?;
    ensure!(
        v["how"] == "connection reset",
        "server reset should reach the client as a reset: {v}"
    );
    Ok(())
}

#[test]
fn server_reset_reaches_client_bpf() -> Result<()> {
    if skip_unless_root() || lb_tests::splice_fallback_asserted()? {
        return Ok(());
    }
    server_reset_reaches_client("bpf")
}

#[test]
fn server_reset_reaches_client_userspace() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    server_reset_reaches_client("userspace")
}

fn dead_servers_skipped(mode: &str) -> Result<()> {
    // s0 refuses (no server), s1 is blackholed, s2 works: every client lands on s2.
    let mut s = setup(mode, 3, &["--health-loop", "false"])?;
    s.hosts[0].stop_servers();
    s.hosts[1].blackhole(true)?;
    let v = client(&s, &["up", "100000"])?;
    ok(&v)?;
    Ok(())
}

#[test]
fn refused_and_blackholed_servers_skipped_bpf() -> Result<()> {
    if skip_unless_root() || lb_tests::splice_fallback_asserted()? {
        return Ok(());
    }
    dead_servers_skipped("bpf")
}

#[test]
fn refused_and_blackholed_servers_skipped_userspace() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    dead_servers_skipped("userspace")
}

#[test]
fn no_server_answers_closes_client() -> Result<()> {
    if skip_unless_root() || lb_tests::splice_fallback_asserted()? {
        return Ok(());
    }
    let mut s = setup("bpf", 1, &[])?;
    s.hosts[0].stop_servers();
    let v = client(&s, &["up", "1000"])?;
    ensure!(v["ok"] == false, "no server: the client must fail: {v}");
    let log = s.lb.log_text();
    ensure!(
        log.contains("all servers failed"),
        "log must say all servers failed: {log}"
    );
    Ok(())
}

#[test]
fn bpf_detaches_on_sigterm() -> Result<()> {
    if skip_unless_root() || lb_tests::splice_fallback_asserted()? {
        return Ok(());
    }
    let mut s = setup("bpf", 1, &[])?;
    let attached = lb_tests::cgroup_programs(&s.cg.path).unwrap_or_default();
    let code = s.lb.terminate(Duration::from_secs(35))?;
    ensure!(code == 0, "lb exit code {code}");
    let after = lb_tests::cgroup_programs(&s.cg.path)?;
    ensure!(
        !after.contains("sock_ops"),
        "programs left on the cgroup after exit: {after}"
    );
    if !attached.is_empty() {
        ensure!(
            attached.contains("sock_ops"),
            "bpftool did not show the program while running: {attached}"
        );
    }
    Ok(())
}

#[test]
fn auto_falls_back_to_userspace_with_one_warning() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let mut h = Host::new()?;
    h.serve(9000, "s0")?;
    let listen = format!("127.0.0.1:{}", free_port()?);
    let server = h.addr(9000).to_string();
    let lb = Lb::start(&[
        "--listen",
        &listen,
        "--server",
        &server,
        "--datapath",
        "auto",
        "--cgroup",
        "/nonexistent-cgroup",
    ])?;
    let st = lb.status()?;
    ensure!(st["datapath"] == "userspace", "auto must fall back: {st}");
    let why = st["datapath_fallback"].as_str().unwrap_or("");
    ensure!(
        why.contains("/nonexistent-cgroup"),
        "the reason must name the cgroup: {why}"
    );
    let kind = lb.metric("lb_datapath_fallback_info", "reason=\"cgroup\"");
    ensure!(
        kind == 1.0,
        "lb_datapath_fallback_info{{reason=\"cgroup\"}} should be 1: {kind}"
    );
    let log = lb.log_text();
    ensure!(
        log.matches("falling back").count() == 1,
        "expected one fallback warning: {log}"
    );
    let v = run_client(&Place::default(), listen.parse()?, &["up", "1000000"], T)?;
    ok(&v)
}

#[test]
fn bpf_mode_fails_with_the_reason() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let listen = format!("127.0.0.1:{}", free_port()?);
    let out = std::process::Command::new(lb_tests::lb_bin())
        .args([
            "run",
            "--listen",
            &listen,
            "--server",
            "198.18.0.2:1",
            "--datapath",
            "bpf",
            "--cgroup",
            "/nonexistent-cgroup",
        ])
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success(),
        "lb --datapath bpf must fail without its cgroup"
    );
    ensure!(
        err.contains("/nonexistent-cgroup"),
        "the error must name the cgroup: {err}"
    );
    Ok(())
}
