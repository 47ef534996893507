//! The K3s and RKE2 layouts shipped in `deploy/k3s/` and `deploy/rke2/`, each run as it is
//! written (read from the repository; only the node's addresses, ports and paths become the
//! test's) by a real lb against three test hosts with TLS supervisor stand-ins: every listener
//! answers, every check runs and brings its servers up, the server in use is ACTIVE, and when
//! one server's supervisor stops, its servers turn FAILED and the listeners answer from the
//! next. Also the hybrid cgroup layout: lb finds the cgroup v2 mount below the directory it is
//! given, as the DaemonSets give it the host's `/sys/fs/cgroup`.

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use lb_tests::{
    Host, Layout, Lb, Place, Supervisor, TempDir, TestCgroup, TestPki, https_ping, layout,
    run_client, skip_unless_root, wait_server_state, wait_until,
};

/// Bound on a server turning FAILED after its supervisor stops: interval × fall + timeout of the
/// layouts' checks (2 s), plus slack for a loaded machine.
const FAIL_WITHIN: Duration = Duration::from_secs(5);
const T: Duration = Duration::from_secs(20);

/// Three test hosts, each with TLS supervisor stand-ins on `tls_ports` and, with `named`, an
/// `lbt serve` named `s<i>` on that port (an etcd member's place).
struct Fleet {
    sups: Vec<Vec<Supervisor>>,
    hosts: Vec<Host>,
    pki: TestPki,
}

impl Fleet {
    fn start(tls_ports: &[u16], named: Option<u16>) -> Result<Fleet> {
        let pki = TestPki::new()?;
        let mut hosts = Vec::new();
        let mut sups = Vec::new();
        for i in 0..3 {
            let mut host = Host::new()?;
            if let Some(port) = named {
                host.serve(port, &format!("s{i}"))?;
            }
            let mine = tls_ports
                .iter()
                .map(|&p| Supervisor::start(&host, p, &pki))
                .collect::<Result<Vec<_>>>()?;
            sups.push(mine);
            hosts.push(host);
        }
        Ok(Fleet { sups, hosts, pki })
    }

    /// Stop host `i`'s supervisor on `port`.
    fn stop(&mut self, i: usize, port: u16) -> Result<()> {
        let sup = self.sups[i]
            .iter_mut()
            .find(|s| s.addr.port() == port)
            .context("no such supervisor")?;
        sup.stop();
        Ok(())
    }
}

/// lb running `layout`, its programs attached to a test cgroup.
fn run(layout: &Layout, cg: &TestCgroup) -> Result<Lb> {
    let file = layout.file.display().to_string();
    let cgp = cg.path.display().to_string();
    let lb = Lb::start(&["--config", &file, "--cgroup", &cgp])?;
    Ok(lb)
}

/// The state of each server of balancer `name`, by address.
fn states(lb: &Lb, name: &str) -> Result<Vec<(String, String)>> {
    let st = lb.status()?;
    let b = st["balancers"]
        .as_array()
        .context("balancers")?
        .iter()
        .find(|b| b["name"] == name)
        .with_context(|| format!("no balancer {name}: {st}"))?;
    Ok(b["servers"]
        .as_array()
        .context("servers")?
        .iter()
        .map(|s| {
            let a = s["address"].as_str().unwrap_or_default().to_string();
            (a, s["state"].as_str().unwrap_or_default().to_string())
        })
        .collect())
}

/// Wait until every server of every balancer of `layout` has passed its checks (PREFERRED,
/// HEALTHY or ACTIVE), and the servers are exactly the test hosts' on `ports` (by balancer).
fn wait_all_up(lb: &Lb, layout: &Layout, fleet: &Fleet, ports: &[u16]) -> Result<()> {
    for ((name, shipped, _), port) in layout.listeners.iter().zip(ports) {
        let want: Vec<String> = fleet
            .hosts
            .iter()
            .map(|h| h.addr(*port).to_string())
            .collect();
        wait_until(T, || {
            let st = states(lb, name)?;
            let addrs: Vec<&String> = st.iter().map(|(a, _)| a).collect();
            ensure!(
                addrs == want.iter().collect::<Vec<_>>(),
                "{name} ({shipped}): {st:?}"
            );
            Ok(st
                .iter()
                .all(|(_, s)| matches!(s.as_str(), "PREFERRED" | "HEALTHY" | "ACTIVE")))
        })
        .with_context(|| {
            format!(
                "{name}: servers not up: {:?}\n{}",
                states(lb, name),
                lb.log_text()
            )
        })?;
    }
    Ok(())
}

/// The agent layouts: the balancers are those of `shipped` (name, listener as the file has it,
/// the servers' port); each listener answers a TLS `GET /ping` verified against the cluster CA
/// for 127.0.0.1 (the stand-in of its server); then host 0's supervisor (`sup_port`) stops,
/// every balancer's host-0 server turns FAILED within [`FAIL_WITHIN`] (an apiserver stand-in
/// still answering), and each listener answers from host 1. `with_ca` runs the checks as the
/// files say to once the agent has joined: `ca_file` instead of `insecure_skip_verify`.
fn agent_layout(
    rel: &str,
    sup_port: u16,
    shipped: &[(&str, &str, u16)],
    with_ca: bool,
) -> Result<()> {
    let ports: Vec<u16> = shipped.iter().map(|(_, _, p)| *p).collect();
    let mut fleet = Fleet::start(&ports, None)?;
    let ca = fleet.pki.ca_file();
    let ca_line = format!("ca_file = \"{}\"", ca.display());
    let replace: &[(&str, &str)] = if with_ca {
        &[("insecure_skip_verify = true", &ca_line)]
    } else {
        &[]
    };
    let dir = TempDir::new("lb-fleet")?;
    let layout = layout(rel, &fleet.hosts, &dir, replace)?;
    let got: Vec<(&str, &str)> = layout
        .listeners
        .iter()
        .map(|(n, l, _)| (n.as_str(), l.as_str()))
        .collect();
    let want: Vec<(&str, &str)> = shipped.iter().map(|(n, l, _)| (*n, *l)).collect();
    ensure!(got == want, "{rel}: balancers {got:?}, expected {want:?}");
    let cg = TestCgroup::new()?;
    let lb = run(&layout, &cg)?;
    wait_all_up(&lb, &layout, &fleet, &ports)?;
    for ((name, _, test_port), port) in layout.listeners.iter().zip(&ports) {
        ensure!(
            https_ping(*test_port, &ca)? == "pong",
            "{name}: no pong through lb"
        );
        let s0 = fleet.hosts[0].addr(*port).to_string();
        wait_server_state(&lb, name, &s0, "ACTIVE", T)?;
    }
    fleet.stop(0, sup_port)?;
    for ((name, _, test_port), port) in layout.listeners.iter().zip(&ports) {
        let s0 = fleet.hosts[0].addr(*port).to_string();
        let took = wait_server_state(&lb, name, &s0, "FAILED", FAIL_WITHIN)?;
        eprintln!("{rel} {name}: {s0} FAILED {took:?} after its supervisor stopped");
        ensure!(
            https_ping(*test_port, &ca)? == "pong",
            "{name}: no pong after the failover"
        );
        let s1 = fleet.hosts[1].addr(*port).to_string();
        wait_server_state(&lb, name, &s1, "ACTIVE", T)?;
    }
    Ok(())
}

/// The server layouts: the etcd balancer's listener reaches member `s0`; when host 0's
/// supervisor (`sup_port`) stops while its etcd stand-in keeps serving, `s0` turns FAILED and
/// the listener reaches `s1`.
fn server_layout(rel: &str, sup_port: u16) -> Result<()> {
    let mut fleet = Fleet::start(&[sup_port], Some(2379))?;
    let dir = TempDir::new("lb-fleet")?;
    let layout = layout(rel, &fleet.hosts, &dir, &[])?;
    let cg = TestCgroup::new()?;
    let lb = run(&layout, &cg)?;
    wait_all_up(&lb, &layout, &fleet, &[2379])?;
    let listener = format!("127.0.0.1:{}", layout.port("etcd")?).parse()?;
    let peer = |want: &str| -> Result<()> {
        let out = run_client(&Place::cgroup(&cg.path), listener, &["peer"], T)?;
        ensure!(
            out["server"] == want,
            "etcd listener reached {out}, expected {want}"
        );
        Ok(())
    };
    peer("s0")?;
    fleet.stop(0, sup_port)?;
    let s0 = fleet.hosts[0].addr(2379).to_string();
    let took = wait_server_state(&lb, "etcd", &s0, "FAILED", FAIL_WITHIN)?;
    eprintln!("{rel}: {s0} FAILED {took:?} after its supervisor stopped (its etcd still serves)");
    peer("s1")
}

#[test]
fn k3s_agent_layout_carries_supervisor_and_apiserver() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    // As shipped (the check skips verification until the agent has joined): one balancer on
    // the port K3s's own balancer had, for the supervisor and apiserver that share 6443.
    agent_layout(
        "k3s/agent.toml",
        6443,
        &[("supervisor", "127.0.0.1:6444", 6443)],
        false,
    )?;
    agent_layout(
        "k3s/agent.toml",
        6443,
        &[("supervisor", "127.0.0.1:6444", 6443)],
        true,
    )
}

#[test]
fn rke2_agent_layout_carries_supervisor_and_apiserver() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    // The agent joins through 127.0.0.1:9345 and derives the apiserver at 127.0.0.1:6443.
    let shipped = [
        ("supervisor", "127.0.0.1:9345", 9345),
        ("apiserver", "127.0.0.1:6443", 6443),
    ];
    agent_layout("rke2/agent.toml", 9345, &shipped, true)
}

#[test]
fn k3s_server_layout_carries_etcd() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    server_layout("k3s/server.toml", 6443)
}

#[test]
fn rke2_server_layout_carries_etcd() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    server_layout("rke2/server.toml", 9345)
}

/// A bind mount removed on drop (lazily, so a failed test never leaves it behind busy).
struct BindMount(std::path::PathBuf);

impl BindMount {
    fn new(from: &std::path::Path, to: &std::path::Path) -> Result<BindMount> {
        std::fs::create_dir_all(to)?;
        let (f, t) = (from.display().to_string(), to.display().to_string());
        lb_tests::sh("mount", &["--bind", &f, &t])?;
        Ok(BindMount(to.to_path_buf()))
    }
}

impl Drop for BindMount {
    fn drop(&mut self) {
        let _ = lb_tests::sh("umount", &["-l", &self.0.display().to_string()]);
    }
}

/// `deploy/k3s/daemonset.yaml` as a pod runs it on a host with the hybrid cgroup layout: its
/// `args` (`--cgroup /host/sys/fs/cgroup`) name a directory that is not cgroup v2, with the
/// cgroup v2 mount at `unified/` below it (here the test's cgroup, bind-mounted there). lb
/// attaches the kernel data path there (`--datapath bpf` would exit otherwise; the ConfigMap's
/// `auto` is checked through `/status`), and its ConfigMap's apiserver balancer answers with
/// the servers' CA. A root with no cgroup v2 below it is refused, naming the directory.
#[test]
fn daemonset_finds_the_hybrid_cgroup_v2_mount() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let yaml = lb_tests::repo_file("deploy/k3s/daemonset.yaml")?;
    let fleet = Fleet::start(&[6443], None)?;
    let dir = TempDir::new("lb-fleet")?;
    let ca = format!("ca_file = \"{}\"", fleet.pki.ca_file().display());
    let text = lb_tests::configmap_entry(&yaml, "lb.toml")?;
    let layout = lb_tests::layout_from(
        "k3s/daemonset.yaml lb.toml",
        text,
        &fleet.hosts,
        &dir,
        &[(
            "ca_file = \"/var/lib/rancher/k3s/agent/server-ca.crt\"",
            &ca,
        )],
    )?;
    let cg = TestCgroup::new()?;
    let root = dir.join("host-sys-fs-cgroup");
    let _unified = BindMount::new(&cg.path, &root.join("unified"))?;
    let mut args = lb_tests::container_args(&yaml)?;
    ensure!(args.first().map(String::as_str) == Some("run"), "{args:?}");
    args.remove(0);
    let (config, cgroup_root) = (
        layout.file.display().to_string(),
        root.display().to_string(),
    );
    for a in &mut args {
        match a.as_str() {
            "/etc/lb/lb.toml" => a.clone_from(&config),
            "/host/sys/fs/cgroup" => a.clone_from(&cgroup_root),
            _ => {}
        }
    }
    ensure!(
        args.contains(&cgroup_root),
        "the DaemonSet no longer names the host's cgroup: {args:?}"
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let lb = Lb::start(&args)?;
    wait_all_up(&lb, &layout, &fleet, &[6443])?;
    let st = lb.status()?;
    ensure!(
        st["datapath"] == "bpf",
        "kernel data path not attached: {st}\n{}",
        lb.log_text()
    );
    ensure!(
        lb.log_text()
            .contains("cgroup v2 found below the configured directory"),
        "{}",
        lb.log_text()
    );
    let port = layout.port("apiserver")?;
    ensure!(
        https_ping(port, &fleet.pki.ca_file())? == "pong",
        "no pong through lb"
    );
    drop(lb);
    // No cgroup v2 below: refused with the reason, not a silent fallback under --datapath bpf.
    let empty = dir.join("empty-root");
    std::fs::create_dir_all(&empty)?;
    let empty = empty.display().to_string();
    let err = Lb::start(&["--config", &config, "--cgroup", &empty, "--datapath", "bpf"])
        .err()
        .context("lb started without a cgroup v2")?;
    ensure!(
        format!("{err:#}").contains("no cgroup v2 is mounted below it"),
        "{err:#}"
    );
    Ok(())
}

/// The listener of balancer `name` in the layout `deploy/<rel>`.
fn shipped_listener(rel: &str, name: &str) -> Result<String> {
    let cfg: toml::Value = toml::from_str(&lb_tests::repo_file(&format!("deploy/{rel}"))?)?;
    let b = cfg["balancer"]
        .as_array()
        .context("balancers")?
        .iter()
        .find(|b| b["name"].as_str() == Some(name))
        .with_context(|| format!("{rel}: no balancer {name}"))?;
    Ok(b["listen"][0].as_str().context("listen")?.to_string())
}

/// The K3s/RKE2 options and drop-ins shipped beside the layouts agree with them: the agent's
/// `server:` is lb's supervisor listener (on RKE2, whose agent derives the apiserver from its
/// host with port 6443, lb's apiserver listener is that address, and the agent's own balancer
/// moves off it), K3s's agent turns its balancer off, a server's `etcd-servers` is lb's etcd
/// listener, and the drop-ins start lb before the K3s/RKE2 units.
#[test]
fn k3s_and_rke2_options_point_at_the_layouts_listeners() -> Result<()> {
    let option = |rel: &str, key: &str| -> Result<String> {
        let yaml = lb_tests::repo_file(&format!("deploy/{rel}"))?;
        lb_tests::yaml_scalar(&yaml, key).with_context(|| format!("{rel}: no {key}"))
    };
    for dist in ["k3s", "rke2"] {
        let agent = format!("{dist}/config.yaml.d/agent.yaml");
        let sup = shipped_listener(&format!("{dist}/agent.toml"), "supervisor")?;
        ensure!(
            option(&agent, "server")? == format!("https://{sup}"),
            "{agent}: server is not lb's {sup}"
        );
        let server = format!("{dist}/config.yaml.d/server.yaml");
        let etcd = shipped_listener(&format!("{dist}/server.toml"), "etcd")?;
        ensure!(option(&server, "disable-etcd")? == "true", "{server}");
        let yaml = lb_tests::repo_file(&format!("deploy/{server}"))?;
        let arg = yaml
            .lines()
            .find_map(|l| l.trim().strip_prefix("- etcd-servers="))
            .with_context(|| format!("{server}: no kube-apiserver-arg etcd-servers"))?;
        ensure!(
            arg == format!("https://{etcd}"),
            "{server}: etcd-servers {arg} is not lb's {etcd}"
        );
    }
    ensure!(option("k3s/config.yaml.d/agent.yaml", "disable-apiserver-lb")? == "true");
    let api = shipped_listener("rke2/agent.toml", "apiserver")?;
    ensure!(
        api == "127.0.0.1:6443",
        "RKE2 derives https://127.0.0.1:6443, lb listens on {api}"
    );
    let lb_port: u16 = option("rke2/config.yaml.d/agent.yaml", "lb-server-port")?.parse()?;
    ensure!(
        lb_port - 1 != 6443 && lb_port != 6443 && lb_port != 9345,
        "the agent's balancer on {lb_port}"
    );
    let after = lb_tests::repo_file("deploy/systemd/after-lb.conf")?;
    for key in ["Wants", "After"] {
        ensure!(
            lb_tests::unit_values(&after, key) == ["lb.service"],
            "after-lb.conf {key}="
        );
    }
    for (conf, units) in [
        (
            "k3s/lb.service.d/k3s.conf",
            ["k3s-agent.service", "k3s.service"],
        ),
        (
            "rke2/lb.service.d/rke2.conf",
            ["rke2-agent.service", "rke2-server.service"],
        ),
    ] {
        let text = lb_tests::repo_file(&format!("deploy/{conf}"))?;
        ensure!(
            lb_tests::unit_values(&text, "Before") == units,
            "{conf}: Before="
        );
    }
    Ok(())
}
