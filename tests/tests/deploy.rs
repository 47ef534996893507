//! The shipped deployments run the kernel path and kill pod clients. lb runs as the systemd unit
//! (`deploy/systemd/lb.service`) makes it run: uid 0 holding exactly the unit's capabilities,
//! read from the unit file; and with a DaemonSet's container arguments and
//! ConfigMap (`deploy/kubernetes/daemonset.yaml`), whose pod shares the host's network and PID
//! namespaces. A pod-like client (in another network namespace, in the test's cgroup) is
//! rewritten at `connect()` (`namespaces = "all"`) and killed when its server is. Without the host's PID namespace
//! (lb in `unshare --pid`), connect-time forwarding is refused with the fix named, and a
//! client process whose network namespace lb cannot open is logged with its pid and counted.
//! Under a container's small locked-memory limit lb lifts it before loading (kernels before
//! 5.11 charge BPF maps to it). As the unit runs it, lb pins connect-time in the bpffs and the
//! lb of the next start adopts the pins.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{Context as _, Result, ensure};
use lb_tests::{
    Holder, Host, Lb, Place, TestCgroup, free_port, run_client, skip_unless_kernel,
    skip_unless_root,
};

const T: Duration = Duration::from_secs(60);
/// An unprivileged uid and gid: lb as a user that cannot open a root client's network namespace.
const NOBODY: u32 = 65534;
/// The unit's identity: root (no `User=`), holding only the unit's capabilities.
const UNIT_UID: u32 = 0;
const UNIT: &str = "deploy/systemd/lb.service";
const DAEMONSETS: [&str; 2] = [
    "deploy/kubernetes/daemonset.yaml",
    "deploy/k3s/daemonset.yaml",
];

/// Root, a kernel with the getpeername hooks (5.8) the connect-time programs attach, and
/// `program` when given (util-linux's `setpriv` or `unshare`; busybox guests may lack them).
fn skip(program: Option<&str>) -> bool {
    if skip_unless_root() || skip_unless_kernel((5, 8), "cgroup getpeername4/6 hooks") {
        return true;
    }
    let Some(program) = program else {
        return false;
    };
    let path = std::env::var_os("PATH").unwrap_or_default();
    if std::env::split_paths(&path).any(|d| d.join(program).is_file()) {
        return false;
    }
    lb_tests::skip(&format!("needs {program} (util-linux) in PATH"));
    true
}

/// A config: balancer `direct` (connect-time, listening on 127.0.0.1 and on the root side of
/// `hosts[0]`'s link, where a client inside that host's namespace reaches it) over both hosts'
/// :9000, and balancer `spliced` (forwarded by lb, spliced) over `hosts[1]`.
fn config(hosts: &[Host], direct: u16, spliced: u16) -> String {
    let gateway = hosts[0].gateway;
    let servers = lb_tests::toml_addrs(hosts, 9000);
    let s1 = hosts[1].addr(9000);
    format!(
        r#"
[datapath]
mode = "auto"

[[balancer]]
name = "direct"
forwarding = "connect"
namespaces = "all"
listen = ["127.0.0.1:{direct}", "{gateway}:{direct}"]
servers = [{servers}]
policy = "failover"

[balancer.health]
kind = "http"
url = "http://{{server}}/healthz"
interval = "500ms"
timeout = "300ms"
rise = 1
fall = 2
on_unhealthy = "kill"

[[balancer]]
name = "spliced"
forwarding = "splice"
listen = ["127.0.0.1:{spliced}"]
servers = ["{s1}"]
"#
    )
}

/// A file in the temp directory (a config, readable by every user), removed on drop.
struct TempFile(PathBuf);

impl TempFile {
    fn new(tag: &str, text: &str) -> Result<TempFile> {
        let path = std::env::temp_dir().join(format!(
            "lb-deploy-{tag}-{}-{}.toml",
            std::process::id(),
            free_port()?
        ));
        std::fs::write(&path, text)?;
        Ok(TempFile(path))
    }

    fn arg(&self) -> String {
        self.0.display().to_string()
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A client inside `host`'s network namespace and the test's cgroup: a pod on the node.
fn pod<'a>(host: &'a Host, cg: &'a TestCgroup) -> Place<'a> {
    Place {
        cgroup: Some(&cg.path),
        netns: Some(&host.ns),
    }
}

/// Wait (at most `within`) for holder `h`'s connection to end by a reset or an abort.
fn expect_killed(h: &Holder, lb: &Lb, within: Duration) -> Result<()> {
    let closed = h
        .wait_for("closed", within)
        .with_context(|| format!("the pod client was not killed: {}", lb.log_text()))?;
    ensure!(
        closed["how"] == "connection reset" || closed["how"] == "connection aborted",
        "{closed}"
    );
    Ok(())
}

/// `lb servers kill <server>` on balancer `direct`.
fn kill_server(lb: &Lb, server: SocketAddr) -> Result<()> {
    let out = std::process::Command::new(lb_tests::lb_bin())
        .args([
            "servers",
            "--balancer",
            "direct",
            "kill",
            &server.to_string(),
        ])
        .args(["--admin", &lb.admin.to_string()])
        .output()?;
    ensure!(out.status.success(), "lb servers kill: {out:?}");
    Ok(())
}

/// lb as `uid` (and that gid) holding exactly `caps` (ambient and bounding), in front of two
/// hosts; returns once the connect-time table is written.
fn start_as(uid: u32, caps: &[String]) -> Result<(Vec<Host>, TestCgroup, Lb, u16, u16, TempFile)> {
    let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    let cg = TestCgroup::new()?;
    let (direct, spliced) = (free_port()?, free_port()?);
    let file = TempFile::new("unit", &config(&hosts, direct, spliced))?;
    let wrapper = lb_tests::setpriv_as(uid, uid, caps)?;
    let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
    let lb = Lb::start_via(
        &wrapper,
        &[
            "--config",
            &file.arg(),
            "--cgroup",
            &cg.path.display().to_string(),
        ],
    )?;
    let uid_line = std::fs::read_to_string(format!("/proc/{}/status", lb.pid()))?
        .lines()
        .find_map(|l| l.strip_prefix("Uid:").map(str::to_string))
        .unwrap_or_default();
    ensure!(
        uid_line.split_whitespace().all(|u| u == uid.to_string()),
        "lb should run as {uid}: Uid:{uid_line}"
    );
    lb.wait_settled(Duration::from_secs(10))?;
    Ok((hosts, cg, lb, direct, spliced, file))
}

#[test]
fn systemd_unit_identity_runs_the_kernel_path_and_kills_pod_clients() -> Result<()> {
    if skip(Some("setpriv")) {
        return Ok(());
    }
    let unit = lb_tests::repo_file(UNIT)?;
    ensure!(
        lb_tests::unit_values(&unit, "User").is_empty()
            && lb_tests::unit_values(&unit, "DynamicUser").is_empty(),
        "the unit should run lb as root with bounded capabilities (its pins need the bpffs root)"
    );
    let mut caps = lb_tests::unit_values(&unit, "AmbientCapabilities");
    let mut bounding = lb_tests::unit_values(&unit, "CapabilityBoundingSet");
    caps.sort();
    bounding.sort();
    ensure!(
        caps == bounding,
        "ambient {caps:?} and bounding {bounding:?} sets differ"
    );
    // A connect-time kill enters the client's network namespace (setns): systemd's
    // RestrictNamespaces= must allow net (it cannot be run here: no systemd).
    let restrict = lb_tests::unit_values(&unit, "RestrictNamespaces");
    ensure!(
        restrict.is_empty()
            || restrict == ["no"]
            || (restrict.iter().any(|v| v == "net") && !restrict[0].starts_with('~')),
        "RestrictNamespaces={restrict:?} forbids setns into a client's network namespace"
    );
    eprintln!("the unit's capabilities: {caps:?}");
    let (hosts, cg, lb, direct, spliced, _file) = start_as(UNIT_UID, &caps)?;
    let st = lb.status()?;
    ensure!(
        st["datapath"] == "bpf",
        "the unit's identity should run the kernel data path: {st}\n{}",
        lb.log_text()
    );
    ensure!(lb.balancer("direct")?["forwarding"] == "connect", "{st}");

    // Spliced: a client in lb's namespace through balancer `spliced`.
    let listen: SocketAddr = format!("127.0.0.1:{spliced}").parse()?;
    let n = (32u64 << 20).to_string();
    let v = run_client(
        &Place::cgroup(&cg.path),
        listen,
        &["up", &n, "--pause-ms", "200"],
        T,
    )?;
    ensure!(v["ok"] == true, "{v}");
    let bytes = lb.metric("lb_spliced_bytes_total", "balancer=\"spliced\"");
    ensure!(bytes > 0.0, "nothing spliced: {}", lb.log_text());

    // Rewritten: a pod dials the listener on its node and reaches s0 directly.
    let place = pod(&hosts[0], &cg);
    let dialed = SocketAddr::new(hosts[0].gateway.into(), direct);
    let v = run_client(&place, dialed, &["peer"], T)?;
    ensure!(v["ok"] == true && v["server"] == "s0", "{v}");
    ensure!(
        v["server_sees"] == v["local"],
        "the server should see the pod's own socket: {v}"
    );

    // Killed: the pod's connection to s0 ends when s0 is killed.
    let h = Holder::spawn(&place, dialed, &["hold", "--max-ms", "60000"])?;
    let ev = h.wait_for("connected", Duration::from_secs(10))?;
    ensure!(ev["server"] == "s0", "{ev}");
    let t = std::time::Instant::now();
    kill_server(&lb, hosts[0].addr(9000))?;
    expect_killed(&h, &lb, Duration::from_secs(5))?;
    eprintln!(
        "unit identity: pod client killed {:.3} s after lb servers kill",
        t.elapsed().as_secs_f64()
    );
    lb_tests::wait_until(Duration::from_secs(5), || {
        Ok(lb.metric("lb_connections_killed_total", "balancer=\"direct\"") >= 1.0)
    })?;
    let unreached = lb.metric("lb_connect_kill_netns_failures_total", "");
    ensure!(unreached == 0.0, "{unreached} sockets unreached");
    Ok(())
}

#[test]
fn connect_time_kill_logs_and_counts_an_unreachable_client_namespace() -> Result<()> {
    if skip(Some("setpriv")) {
        return Ok(());
    }
    // What the kernel path needs, without what reaching another user's network namespace does
    // (CAP_SYS_PTRACE to open it, CAP_SYS_ADMIN to enter it).
    let caps: Vec<String> = ["CAP_BPF", "CAP_PERFMON", "CAP_NET_ADMIN"]
        .map(String::from)
        .to_vec();
    let (hosts, cg, lb, direct, _, _file) = start_as(NOBODY, &caps)?;
    ensure!(lb.status()?["datapath"] == "bpf", "{}", lb.log_text());
    let place = pod(&hosts[0], &cg);
    let dialed = SocketAddr::new(hosts[0].gateway.into(), direct);
    let h = Holder::spawn(&place, dialed, &["hold", "--max-ms", "60000"])?;
    let ev = h.wait_for("connected", Duration::from_secs(10))?;
    ensure!(ev["server"] == "s0", "{ev}");
    kill_server(&lb, hosts[0].addr(9000))?;
    lb_tests::wait_until(Duration::from_secs(5), || {
        Ok(lb.metric(
            "lb_connect_kill_netns_failures_total",
            "balancer=\"direct\"",
        ) >= 1.0)
    })
    .with_context(|| format!("the failure should be counted: {}", lb.log_text()))?;
    let log = lb.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("cannot reach the network namespace"))
        .with_context(|| format!("no warning in the log: {log}"))?;
    ensure!(
        line.contains(&format!("pid={}", h.pid())),
        "the warning should name the client's pid {}: {line}",
        h.pid()
    );
    eprintln!("{line}");
    Ok(())
}

#[test]
fn daemonset_settings_kill_pod_clients() -> Result<()> {
    if skip(None) {
        return Ok(());
    }
    for path in DAEMONSETS {
        let yaml = lb_tests::repo_file(path)?;
        for key in ["hostNetwork", "hostPID"] {
            ensure!(
                lb_tests::yaml_scalar(&yaml, key).as_deref() == Some("true"),
                "{path}: the pod needs {key}: true"
            );
        }
    }
    let yaml = lb_tests::repo_file(DAEMONSETS[0])?;
    let hosts = lb_tests::serving_hosts(2, 6443, |i| format!("s{i}"))?;
    let cg = TestCgroup::new()?;
    let port = free_port()?;
    let state = TempFile(std::env::temp_dir().join(format!(
        "lb-deploy-state-{}-{port}.json",
        std::process::id()
    )));
    let gateway = hosts[0].gateway;
    let s0 = hosts[0].addr(6443);
    let mut text = lb_tests::configmap_entry(&yaml, "lb.toml")?;
    // The node's addresses, cgroup and state directory become the test's; connect-time
    // forwarding is turned on, for clients of every network namespace.
    for (from, to) in [
        (
            "listen = [\"127.0.0.1:6444\"]".to_string(),
            format!("listen = [\"127.0.0.1:{port}\", \"{gateway}:{port}\"]"),
        ),
        (
            "servers = [\"198.18.0.2:6443\", \"198.18.0.3:6443\", \"198.18.0.4:6443\"]".into(),
            format!("servers = [{}]", lb_tests::toml_addrs(&hosts, 6443)),
        ),
        (
            "default_server = \"198.18.0.2:6443\"".into(),
            format!("default_server = \"{s0}\""),
        ),
        (
            "cgroup = \"/host/sys/fs/cgroup\"".into(),
            format!("cgroup = \"{}\"", cg.path.display()),
        ),
        (
            "state_file = \"/var/lib/lb/apiserver.json\"".into(),
            format!("state_file = \"{}\"", state.0.display()),
        ),
        (
            "mode = \"auto\"".into(),
            "mode = \"auto\"\nforwarding = \"connect\"\nnamespaces = \"all\"".into(),
        ),
    ] {
        ensure!(
            text.contains(&from),
            "the ConfigMap has no `{from}`: {text}"
        );
        text = text.replace(&from, &to);
    }
    let file = TempFile::new("daemonset", &text)?;
    let mut args = lb_tests::container_args(&yaml)?;
    ensure!(args.first().map(String::as_str) == Some("run"), "{args:?}");
    args.remove(0);
    for a in &mut args {
        if a == "/etc/lb/lb.toml" {
            *a = file.arg();
        }
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let lb = Lb::start(&args)?;
    lb.wait_settled(Duration::from_secs(10))?;
    let b = lb.balancer("apiserver")?;
    ensure!(b["forwarding"] == "connect", "{b}\n{}", lb.log_text());

    let place = pod(&hosts[0], &cg);
    let dialed = SocketAddr::new(gateway.into(), port);
    let h = Holder::spawn(&place, dialed, &["hold", "--max-ms", "60000"])?;
    let ev = h.wait_for("connected", Duration::from_secs(10))?;
    ensure!(ev["server"] == "s0", "{ev}");
    // s0 stops answering: its checks time out (interval 1 s, timeout 1 s, fall 1), it turns
    // FAILED and on_unhealthy = "kill" ends the pod's connection.
    let t = std::time::Instant::now();
    hosts[0].blackhole(true)?;
    expect_killed(&h, &lb, Duration::from_secs(15))?;
    eprintln!(
        "DaemonSet settings: pod client killed {:.3} s after its server went silent",
        t.elapsed().as_secs_f64()
    );
    ensure!(
        lb.metric("lb_connect_kill_netns_failures_total", "") == 0.0,
        "{}",
        lb.log_text()
    );
    hosts[0].blackhole(false)?;
    Ok(())
}

#[test]
fn connect_time_is_refused_outside_the_host_pid_namespace_with_the_fix() -> Result<()> {
    if skip(Some("unshare")) {
        return Ok(());
    }
    let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    let cg = TestCgroup::new()?;
    let file = TempFile::new("pidns", &config(&hosts, free_port()?, free_port()?))?;
    // A pod without hostPID: a PID namespace of its own with its own /proc. --kill-child ends
    // lb when unshare is ended.
    let lb = Lb::start_via(
        &["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"],
        &[
            "--config",
            &file.arg(),
            "--cgroup",
            &cg.path.display().to_string(),
        ],
    )?;
    let st = lb.status()?;
    ensure!(st["datapath"] == "bpf", "the splice needs no pid: {st}");
    let b = lb.balancer("direct")?;
    ensure!(b["forwarding"] == "splice", "{b}");
    let why = b["forwarding_fallback"].as_str().unwrap_or_default();
    ensure!(
        why.contains("host's PID namespace") && why.contains("hostPID: true"),
        "the reason should name the fix: {b}"
    );
    let log = lb.log_text();
    let warnings = log
        .lines()
        .filter(|l| l.contains("forwarding = connect unavailable") && l.contains("hostPID: true"))
        .count();
    ensure!(warnings == 1, "one warning for the one balancer: {log}");
    eprintln!("{why}");
    Ok(())
}

#[test]
fn the_kernel_path_lifts_a_container_memlock_limit() -> Result<()> {
    if skip(Some("prlimit")) {
        return Ok(());
    }
    // A container's default: 64 KiB of locked memory, which kernels before 5.11 charge BPF
    // maps to, under a higher hard limit (this test's own; lifting the hard limit too needs
    // CAP_SYS_RESOURCE).
    let (_, hard) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_MEMLOCK)?;
    if hard <= 65_536 {
        lb_tests::skip(&format!(
            "the hard RLIMIT_MEMLOCK ({hard} bytes) leaves nothing to lift"
        ));
        return Ok(());
    }
    let hard_text = if hard == nix::sys::resource::RLIM_INFINITY {
        "unlimited".to_string()
    } else {
        hard.to_string()
    };
    let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    let cg = TestCgroup::new()?;
    let file = TempFile::new("memlock", &config(&hosts, free_port()?, free_port()?))?;
    let memlock = format!("--memlock=65536:{hard_text}");
    let lb = Lb::start_via(
        &["prlimit", &memlock],
        &[
            "--config",
            &file.arg(),
            "--cgroup",
            &cg.path.display().to_string(),
        ],
    )?;
    ensure!(lb.status()?["datapath"] == "bpf", "{}", lb.log_text());
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", lb.pid()))?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max locked memory"))
        .context("no memlock line")?;
    let words: Vec<&str> = line.split_whitespace().collect();
    // "Max locked memory <soft> <hard> bytes": the soft limit lifted to the hard one at least.
    ensure!(
        words.len() == 6 && words[3] == words[4] && words[3] != "65536",
        "lb should lift RLIMIT_MEMLOCK: {line}"
    );
    eprintln!("{line}");
    Ok(())
}

/// lb as the unit runs it (root, the unit's capabilities only) pins connect-time in its default
/// directory `<bpffs>/lb/default` (0700, every pin 0600, root's), the pins serve while lb is
/// dead, and the lb of the next start adopts them.
#[test]
fn systemd_unit_pins_connect_time_for_the_next_start() -> Result<()> {
    if skip(Some("setpriv")) {
        return Ok(());
    }
    let bpffs = match lb_tests::private_bpffs() {
        Ok(at) => at,
        Err(e) => {
            lb_tests::skip(&format!("cannot mount a bpffs: {e:#}"));
            return Ok(());
        }
    };
    let unit = lb_tests::repo_file(UNIT)?;
    let caps = lb_tests::unit_values(&unit, "AmbientCapabilities");
    let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    let cg = TestCgroup::new()?;
    let (direct, spliced) = (free_port()?, free_port()?);
    let file = TempFile::new("pins", &config(&hosts, direct, spliced))?;
    let wrapper = lb_tests::setpriv_as(UNIT_UID, UNIT_UID, &caps)?;
    let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
    let cgp = cg.path.display().to_string();
    let args = ["--config", &file.arg(), "--cgroup", &cgp];
    let dir = bpffs.join("lb/default");

    // No LB_PIN_DIR: lb takes its default, as under the unit.
    let mut first = Lb::start_with(&wrapper, &args, None)?;
    first.wait_settled(Duration::from_secs(10))?;
    let st = first.status()?;
    ensure!(
        st["pins"]["dir"] == dir.display().to_string().as_str() && st["pins"]["adopted"] == false,
        "lb as the unit runs it should pin in {}: {st}\n{}",
        dir.display(),
        first.log_text()
    );
    let owned = |path: &std::path::Path, mode: u32| -> Result<()> {
        use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
        let meta = std::fs::metadata(path)?;
        ensure!(
            meta.uid() == UNIT_UID && meta.permissions().mode() & 0o777 == mode,
            "{}: uid {} mode {:o}, want uid {UNIT_UID} mode {mode:o}",
            path.display(),
            meta.uid(),
            meta.permissions().mode() & 0o777
        );
        Ok(())
    };
    owned(&dir, 0o700)?;
    let mut pins = 0;
    for entry in std::fs::read_dir(&dir)? {
        owned(&entry?.path(), 0o600)?;
        pins += 1;
    }
    ensure!(pins > 0, "nothing pinned in {}", dir.display());

    first.signal(nix::sys::signal::Signal::SIGKILL)?;
    let _ = first.terminate(Duration::from_secs(5));
    drop(first);
    let place = Place::cgroup(&cg.path);
    let listen: SocketAddr = format!("127.0.0.1:{direct}").parse()?;
    let v = run_client(&place, listen, &["peer"], T)?;
    ensure!(
        v["ok"] == true && v["server"] == "s0",
        "the pins should serve while lb is dead: {v}"
    );

    let mut second = Lb::start_with(&wrapper, &args, None)?;
    // The second lb's drop removes the pins (`lb cleanup`).
    second.pin_dir = Some(dir.clone());
    second.wait_settled(Duration::from_secs(10))?;
    let st = second.status()?;
    ensure!(
        st["pins"]["adopted"] == true,
        "the lb of the next start should adopt the pins: {st}\n{}",
        second.log_text()
    );
    let v = run_client(&place, listen, &["peer"], T)?;
    ensure!(v["ok"] == true && v["server"] == "s0", "{v}");
    eprintln!(
        "unit: {pins} pins in {}, adopted by the next lb",
        dir.display()
    );
    Ok(())
}
