//! `cargo xtask demo`: lb on an embedded default config in front of three test hosts, real
//! traffic through the kernel splice, and a failover you can watch.

use std::{
    fmt::Write as _,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use lb_tests::{Holder, Lb, Place, TestCgroup, free_port, run_client, sh};

use crate::util::root;

/// The embedded default: one balancer, three servers, K3s-style failover, an HTTP check
/// (`GET /healthz`) every 500 ms.
const CONFIG: &str = r#"
[datapath]
mode = "auto"

[[balancer]]
name = "apiserver"
listen = ["127.0.0.1:{port}"]
servers = [{servers}]
policy = "failover"
dial_timeout = "2s"

[balancer.health]
kind = "http"
url = "http://{server}/healthz"
interval = "500ms"
timeout = "500ms"
rise = 2
fall = 1
on_unhealthy = "kill"
"#;

fn step(text: &str) {
    println!("\n== {text}");
}

fn table(lb: &Lb) -> Result<String> {
    let st = lb.status()?;
    let mut out = String::new();
    writeln!(out, "   datapath: {}", st["datapath"])?;
    for b in st["balancers"].as_array().context("balancers")? {
        for s in b["servers"].as_array().context("servers")? {
            writeln!(
                out,
                "   {:<22} {:<11} connections={}",
                s["address"].as_str().unwrap_or(""),
                s["state"].as_str().unwrap_or(""),
                s["connections"]
            )?;
        }
    }
    Ok(out)
}

/// Run the demo.
///
/// # Errors
/// Any step that fails; everything made is removed on the way out.
pub fn run() -> Result<()> {
    lb_tests::set_bin_dir(root().join("target/release"));
    ensure!(
        lb_tests::is_root(),
        "the demo needs root (network namespaces, BPF)"
    );
    step("three test hosts in network namespaces (198.18.0.0/15), each serving on :6443");
    let hosts = lb_tests::serving_hosts(3, 6443, |i| format!("apiserver-{}", i + 1))?;
    for (i, h) in hosts.iter().enumerate() {
        println!(
            "   apiserver-{} at {} (netns {})",
            i + 1,
            h.addr(6443),
            h.ns
        );
    }
    let cg = TestCgroup::new()?;
    let port = free_port()?;
    let servers = lb_tests::toml_addrs(&hosts, 6443);
    let cfg = CONFIG
        .replace("{port}", &port.to_string())
        .replace("{servers}", &servers);
    let cfg_path = std::env::temp_dir().join(format!("lb-demo-{}.toml", std::process::id()));
    std::fs::write(&cfg_path, &cfg)?;
    step(&format!(
        "lb run --config {} (clients in cgroup {})",
        cfg_path.display(),
        cg.path.display()
    ));
    print!("{cfg}");
    let mut lb = Lb::start(&[
        "--config",
        &cfg_path.display().to_string(),
        "--cgroup",
        &cg.path.display().to_string(),
    ])?;
    lb.wait_ready(Duration::from_secs(10))?;
    // Each server is checked on its own schedule: let all of them pass `rise` checks first, so
    // the clients start on apiserver-1 and no fail-back moves them during the demo.
    lb.wait_settled(Duration::from_secs(10))?;
    print!("{}", table(&lb)?);
    let listen = format!("127.0.0.1:{port}").parse()?;
    let place = Place::cgroup(&cg.path);

    step("a 64 MiB upload, checked byte for byte by the server");
    let before = lb.metric("lb_spliced_bytes_total", "client_to_server");
    let v = run_client(
        &place,
        listen,
        &["up", &(64u64 << 20).to_string()],
        Duration::from_secs(60),
    )?;
    ensure!(v["ok"] == true, "upload failed: {v}");
    let spliced = lb.metric("lb_spliced_bytes_total", "client_to_server") - before;
    println!(
        "   ok in {:.3} s; the kernel spliced {:.1} MiB of it (client socket -> server socket, no userspace copy)",
        v["secs"].as_f64().unwrap_or(0.0),
        spliced / 1048576.0
    );

    step("three long-lived clients (like kubelet watches)");
    let holders: Vec<Holder> = (0..3)
        .map(|_| Holder::start(&place, listen, 3, 30_000))
        .collect::<Result<_>>()?;
    let mut active = String::new();
    for (i, h) in holders.iter().enumerate() {
        let ev = h.wait_for("connected", Duration::from_secs(10))?;
        active = ev["server"].as_str().unwrap_or("").to_string();
        println!("   client {i} connected to {active}");
    }
    print!("{}", table(&lb)?);

    let idx = active
        .strip_prefix("apiserver-")
        .and_then(|n| n.parse::<usize>().ok())
        .context("active server")?
        - 1;
    step(&format!(
        "blackholing {active} (a dead neighbour entry: no RST, no ICMP, packets vanish)"
    ));
    let t0 = Instant::now();
    hosts[idx].blackhole(true)?;
    for (i, h) in holders.iter().enumerate() {
        let closed = h.wait_for("closed", Duration::from_secs(10))?;
        let closed_at = t0.elapsed();
        let again = h.wait_for("connected", Duration::from_secs(10))?;
        println!(
            "   client {i}: {} after {:.2} s, reconnected to {} after {:.2} s",
            closed["how"].as_str().unwrap_or("?"),
            closed_at.as_secs_f64(),
            again["server"].as_str().unwrap_or("?"),
            t0.elapsed().as_secs_f64()
        );
    }
    print!("{}", table(&lb)?);

    step(&format!(
        "{active} comes back: after rise=2 checks it is PREFERRED and clients fail back"
    ));
    hosts[idx].blackhole(false)?;
    let t1 = Instant::now();
    for (i, h) in holders.iter().enumerate() {
        let again = h.wait_for("connected", Duration::from_secs(15))?;
        println!(
            "   client {i}: back on {} after {:.2} s",
            again["server"].as_str().unwrap_or("?"),
            t1.elapsed().as_secs_f64()
        );
    }
    print!("{}", table(&lb)?);
    drop(holders);

    step("SIGTERM: lb drains, detaches its programs and exits");
    let code = lb.terminate(Duration::from_secs(40))?;
    let left = sh(
        "bpftool",
        &["cgroup", "show", &cg.path.display().to_string()],
    )
    .unwrap_or_default();
    println!(
        "   exit code {code}; programs left on the cgroup: {}",
        if left.trim().is_empty() {
            "(none)"
        } else {
            left.trim()
        }
    );
    let _ = std::fs::remove_file(&cfg_path);
    println!("\ndemo finished; namespaces, cgroup and processes are cleaned up.");
    Ok(())
}
