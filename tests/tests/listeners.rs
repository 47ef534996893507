//! Listener registration in the kernel: each listener charges the splice counters of its own
//! balancer. lb binds IPv6 listeners `IPV6_V6ONLY`, so `0.0.0.0:P` and `[::]:P` can belong to two
//! balancers; an IPv4 client of the first must never be counted for the second.

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use lb_tests::{Lb, Place, TestCgroup, free_port, run_client, skip_unless_root};
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
    if skip_unless_root("ipv4_and_ipv6_wildcards_on_one_port_count_for_their_own_balancer") {
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
