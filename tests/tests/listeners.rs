//! Listener registration in the kernel: each listener charges the splice counters of its own
//! balancer. lb binds IPv6 listeners `IPV6_V6ONLY`, so `0.0.0.0:P` and `[::]:P` can belong to two
//! balancers; an IPv4 client of the first must never be counted for the second. A wildcard
//! claims local destinations only, and a dual-stack client of an IPv4 listener is keyed as IPv4.

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use lb_tests::{Holder, Host, Lb, Place, TestCgroup, free_port, run_client, skip_unless_root};
use serde_json::Value;

const MIB: u64 = 1024 * 1024;
const T: Duration = Duration::from_secs(120);

fn ok(v: &Value) -> Result<()> {
    ensure!(v["ok"] == true, "client failed: {v}");
    Ok(())
}

/// The config file of one test, removed on drop.
struct ConfigFile(std::path::PathBuf);

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Bytes of `kind` (`lb_spliced_bytes_total` or `lb_copied_bytes_total`) client to server for
/// `balancer`.
fn upstream(lb: &Lb, kind: &str, balancer: &str) -> f64 {
    let label = format!("balancer=\"{balancer}\"");
    let (_, body) = lb.get("/metrics").unwrap_or_default();
    body.lines()
        .filter(|l| l.starts_with(kind) && l.contains(&label) && l.contains("client_to_server"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Balancer `v4` listens on `0.0.0.0:P` and is listed first, `v6` on `[::]:P` after it (so a
/// `[::]` registration that also claimed IPv4 would overwrite the first one's). An IPv4 upload
/// through `127.0.0.1:P` is spliced and counted for `v4` alone; an IPv6 upload through `[::1]:P`
/// for `v6` alone. Each client pauses 200 ms after its head line, so lb pairs the connection
/// before the data (a sender that never pauses may stay on the copy path: README, "The counting
/// rule").
#[test]
fn ipv4_and_ipv6_wildcards_on_one_port_count_for_their_own_balancer() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    let cg = TestCgroup::new()?;
    let port = free_port()?;
    let path =
        std::env::temp_dir().join(format!("lb-listeners-{}-{port}.toml", std::process::id()));
    let cfg = ConfigFile(path);
    std::fs::write(
        &cfg.0,
        format!(
            r#"shutdown_grace = "1s"

[[balancer]]
name = "v4"
listen = ["0.0.0.0:{port}"]
servers = ["{}"]

[[balancer]]
name = "v6"
listen = ["[::]:{port}"]
servers = ["{}"]
"#,
            hosts[0].addr(9000),
            hosts[1].addr(9000),
        ),
    )?;
    let cgp = cg.path.display().to_string();
    let lb = Lb::start(&[
        "--config",
        cfg.0.to_str().context("config path")?,
        "--datapath",
        "bpf",
        "--cgroup",
        &cgp,
        "--forwarding",
        "splice",
    ])?;
    lb.wait_settled(Duration::from_secs(10))?;
    let place = Place::cgroup(&cg.path);
    let n = 64 * MIB;
    // "UP\n" precedes the payload.
    let sent = (n + 3) as f64;

    ok(&run_client(
        &place,
        format!("127.0.0.1:{port}").parse()?,
        &["up", &n.to_string(), "--pause-ms", "200"],
        T,
    )?)?;
    let (v4_spliced, v4_copied) = (
        upstream(&lb, "lb_spliced_bytes_total", "v4"),
        upstream(&lb, "lb_copied_bytes_total", "v4"),
    );
    let (v6_spliced, v6_copied) = (
        upstream(&lb, "lb_spliced_bytes_total", "v6"),
        upstream(&lb, "lb_copied_bytes_total", "v6"),
    );
    eprintln!(
        "IPv4 upload of {sent} bytes: v4 spliced {v4_spliced} copied {v4_copied}; v6 spliced {v6_spliced} copied {v6_copied}"
    );
    ensure!(
        v6_spliced == 0.0 && v6_copied == 0.0,
        "the IPv4 client's bytes were charged to the [::] balancer: spliced {v6_spliced}, copied {v6_copied}"
    );
    ensure!(v4_spliced > 0.0, "nothing spliced for the 0.0.0.0 balancer");
    ensure!(
        v4_spliced + v4_copied == sent,
        "v4: spliced {v4_spliced} + copied {v4_copied} != {sent} sent"
    );

    ok(&run_client(
        &place,
        format!("[::1]:{port}").parse()?,
        &["up", &n.to_string(), "--pause-ms", "200"],
        T,
    )?)?;
    let v4_after = upstream(&lb, "lb_spliced_bytes_total", "v4");
    let (v6_spliced, v6_copied) = (
        upstream(&lb, "lb_spliced_bytes_total", "v6"),
        upstream(&lb, "lb_copied_bytes_total", "v6"),
    );
    eprintln!("IPv6 upload: v6 spliced {v6_spliced} copied {v6_copied}; v4 spliced {v4_after}");
    ensure!(
        v4_after == v4_spliced,
        "the IPv6 client's bytes were charged to the 0.0.0.0 balancer: {v4_spliced} -> {v4_after}"
    );
    ensure!(v6_spliced > 0.0, "nothing spliced for the [::] balancer");
    ensure!(
        v6_spliced + v6_copied == sent,
        "v6: spliced {v6_spliced} + copied {v6_copied} != {sent} sent"
    );
    drop(hosts);
    Ok(())
}

/// A `0.0.0.0:P` listener registers only clients whose destination is on the host: a client in
/// the test cgroup holding a connection to another host's server on port P leaves no entry in
/// `LB_FLOWS` (before, every node-wide connection to port P was registered, lb's own dials to
/// servers included, and could fill the 65,536-entry maps), while a loopback client of the same
/// listener is registered and spliced.
#[test]
fn wildcard_listener_registers_local_destinations_only() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let port = free_port()?;
    let servers = lb_tests::serving_hosts(1, 9000, |i| format!("s{i}"))?;
    // Another host serving on lb's own listener port.
    let mut foreign = Host::new()?;
    foreign.serve(port, "foreign")?;
    let cg = TestCgroup::new()?;
    let lb = Lb::bpf_in(
        &cg.path,
        &format!("0.0.0.0:{port}"),
        &servers[0].addr(9000).to_string(),
        &[],
    )?;
    let place = Place::cgroup(&cg.path);
    let away = Holder::start(&place, foreign.addr(port), 0, 60_000)?;
    let ev = away.wait_for("connected", Duration::from_secs(20))?;
    ensure!(
        ev["server"] == "foreign",
        "reached {ev}, not the foreign server"
    );
    let home = Holder::start(&place, format!("127.0.0.1:{port}").parse()?, 0, 60_000)?;
    let ev = home.wait_for("connected", Duration::from_secs(20))?;
    ensure!(ev["server"] == "s0", "reached {ev} through lb, not s0");
    let flows = lb_tests::lb_map_entries(lb.pid(), "LB_FLOWS")?;
    ensure!(
        flows == 1,
        "LB_FLOWS holds {flows} entries with one client of lb and one connection to another host's port {port} open; only lb's client belongs there"
    );
    ok(&run_client(
        &place,
        format!("127.0.0.1:{port}").parse()?,
        &["up", &(16 * MIB).to_string(), "--pause-ms", "200"],
        T,
    )?)?;
    ensure!(
        upstream(&lb, "lb_spliced_bytes_total", "default") > 0.0,
        "the loopback client of the wildcard listener was not spliced"
    );
    drop((away, home));
    Ok(())
}

/// A dual-stack client (an `AF_INET6` socket) dialing an IPv4 listener through its IPv4-mapped
/// address (`[::ffff:127.0.0.1]:P`) is spliced: the kernel programs key it as IPv4, as lb keys
/// the `AF_INET` socket it accepted (before, the two keys never met and it was always copied).
#[test]
fn ipv4_mapped_client_of_an_ipv4_listener_splices() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let port = free_port()?;
    let servers = lb_tests::serving_hosts(1, 9000, |i| format!("s{i}"))?;
    let cg = TestCgroup::new()?;
    let lb = Lb::bpf_in(
        &cg.path,
        &format!("127.0.0.1:{port}"),
        &servers[0].addr(9000).to_string(),
        &[],
    )?;
    let n = 32 * MIB;
    ok(&run_client(
        &Place::cgroup(&cg.path),
        format!("[::ffff:127.0.0.1]:{port}").parse()?,
        &["up", &n.to_string(), "--pause-ms", "200"],
        T,
    )?)?;
    let (spliced, copied) = (
        upstream(&lb, "lb_spliced_bytes_total", "default"),
        upstream(&lb, "lb_copied_bytes_total", "default"),
    );
    eprintln!("IPv4-mapped upload: spliced {spliced}, copied {copied}");
    ensure!(spliced > 0.0, "the IPv4-mapped client was not spliced");
    ensure!(
        spliced + copied == (n + 3) as f64,
        "spliced {spliced} + copied {copied} != {} sent",
        n + 3
    );
    Ok(())
}
