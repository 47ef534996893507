//! `cargo xtask demo`: lb on an embedded default config in front of three test hosts, real
//! traffic through the kernel splice (`forwarding = "splice"`), and a failover you can watch;
//! then the same servers behind a balancer with the default forwarding (`auto`: connect-time
//! where the kernel has the hooks), whose clients talk to the server directly and are reset by
//! lb and reconnect when their server fails.

use std::{
    fmt::Write as _,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use lb_tests::{Holder, Lb, Place, TestCgroup, free_port, run_client, sh};

use crate::util::root;

/// The embedded default: one balancer, three servers, K3s-style failover, an HTTP check
/// (`GET /healthz`) every 500 ms, forwarding through lb; and a second balancer in front of the
/// same servers with the default forwarding (connect-time where the kernel has it).
const CONFIG: &str = r#"
[datapath]
mode = "auto"

[[balancer]]
name = "apiserver"
listen = ["127.0.0.1:{port}"]
servers = [{servers}]
policy = "failover"
forwarding = "splice"
dial_timeout = "2s"

[balancer.health]
kind = "http"
url = "http://{server}/healthz"
interval = "500ms"
timeout = "500ms"
rise = 2
fall = 1
on_unhealthy = "kill"

[[balancer]]
name = "apiserver-direct"
listen = ["127.0.0.1:{port2}"]
servers = [{servers}]
policy = "failover"

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
        write!(
            out,
            "   balancer {} (forwarding {}",
            b["name"].as_str().unwrap_or("?"),
            b["forwarding"].as_str().unwrap_or("?")
        )?;
        if let Some(why) = b["forwarding_fallback"].as_str() {
            write!(out, "; fell back: {why}")?;
        }
        writeln!(out, ")")?;
        for s in b["servers"].as_array().context("servers")? {
            writeln!(
                out,
                "     {:<22} {:<11} connections={}",
                s["address"].as_str().unwrap_or(""),
                s["state"].as_str().unwrap_or(""),
                s["connections"]
            )?;
        }
    }
    Ok(out)
}

/// The connect-time part: balancer `apiserver-direct` at `listen`, whose clients' `connect()`
/// the kernel sends straight to the chosen server; a blackholed server's clients are reset by lb
/// and reconnect to a healthy one. Skipped with a note when the balancer fell back to the splice.
fn connect_time(
    lb: &Lb,
    hosts: &[lb_tests::Host],
    place: &Place<'_>,
    listen: std::net::SocketAddr,
) -> Result<()> {
    const NAME: &str = "apiserver-direct";
    lb.wait_settled(Duration::from_secs(10))?;
    step(&format!(
        "connect-time forwarding: balancer {NAME} listens on {listen}, but the kernel rewrites a \
         client's connect() there to the server lb chose; lb carries no byte"
    ));
    let st = lb.status()?;
    let b = st["balancers"]
        .as_array()
        .context("balancers")?
        .iter()
        .find(|b| b["name"] == NAME)
        .context("balancer apiserver-direct")?;
    if b["forwarding"] != "connect" {
        println!(
            "   skipped: {NAME} forwards through lb ({})",
            b["forwarding_fallback"].as_str().unwrap_or("?")
        );
        return Ok(());
    }
    let v = run_client(place, listen, &["peer"], Duration::from_secs(10))?;
    ensure!(v["ok"] == true, "peer client failed: {v}");
    println!(
        "   a client connected to {listen}: getpeername() names {} (the listener), yet {} sees \
         the client's own socket {} (its local address {}): nothing in between",
        v["peer"].as_str().unwrap_or("?"),
        v["server"].as_str().unwrap_or("?"),
        v["server_sees"].as_str().unwrap_or("?"),
        v["local"].as_str().unwrap_or("?"),
    );
    let label = format!("balancer=\"{NAME}\"");
    let carried =
        |lb: &Lb| lb.metric("lb_spliced_bytes_total", "") + lb.metric("lb_copied_bytes_total", "");
    let (conns0, bytes0) = (lb.metric("lb_connections_total", &label), carried(lb));
    let v = run_client(
        place,
        listen,
        &["up", &(64u64 << 20).to_string()],
        Duration::from_secs(60),
    )?;
    ensure!(v["ok"] == true, "upload failed: {v}");
    println!(
        "   a 64 MiB upload, checked byte for byte by the server: ok in {:.3} s; lb accepted {} \
         connections and carried {} bytes meanwhile",
        v["secs"].as_f64().unwrap_or(0.0),
        lb.metric("lb_connections_total", &label) - conns0,
        carried(lb) - bytes0
    );

    step(&format!(
        "three long-lived clients of {NAME}, each on its own direct connection"
    ));
    let holders: Vec<Holder> = (0..3)
        .map(|_| Holder::start(place, listen, 3, 30_000))
        .collect::<Result<_>>()?;
    let mut active = String::new();
    for (i, h) in holders.iter().enumerate() {
        let ev = h.wait_for("connected", Duration::from_secs(10))?;
        active = ev["server"].as_str().unwrap_or("").to_string();
        println!("   client {i} connected to {active}");
    }
    print!("{}", table(lb)?);

    let idx = active
        .strip_prefix("apiserver-")
        .and_then(|n| n.parse::<usize>().ok())
        .context("active server")?
        - 1;
    step(&format!(
        "blackholing {active}: lb marks it FAILED, rewrites the table, then resets its clients' \
         direct sockets (netlink SOCK_DESTROY); their next connect() goes to a healthy server"
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
    print!("{}", table(lb)?);

    step(&format!(
        "{active} comes back: once PREFERRED again, lb resets the clients it lost the fail-back \
         for, and they reconnect to {active}"
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
    print!("{}", table(lb)?);
    Ok(())
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
    let port2 = loop {
        let p = free_port()?;
        if p != port {
            break p;
        }
    };
    let servers = lb_tests::toml_addrs(&hosts, 6443);
    let cfg = CONFIG
        .replace("{port}", &port.to_string())
        .replace("{port2}", &port2.to_string())
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

    let direct = format!("127.0.0.1:{port2}").parse()?;
    connect_time(&lb, &hosts, &place, direct)?;

    step("SIGTERM: lb drains, detaches its programs and exits");
    let code = lb.terminate(Duration::from_secs(40))?;
    if let Some(dir) = lb.pin_dir.clone() {
        // Pinned connect-time programs outlive lb on purpose (they serve on while it is
        // down); the demo removes them as an operator removing lb would.
        println!(
            "   connect-time programs stay pinned in {} and serve on while lb is down; `lb cleanup --pin-dir {}` removes them",
            dir.display(),
            dir.display()
        );
        lb_tests::remove_pins(&dir);
    }
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
