//! A balancer's network namespace scope (`namespaces`), with both forwarding modes. A pod-like
//! client (another network namespace, in the test's cgroup) with its own server on its own
//! `127.0.0.1:P`, the address of lb's listener in lb's namespace, reaches its own server: its
//! connect is not rewritten and its socket is not registered for the splice, and each is
//! counted in `lb_netns_skipped_total`. A client of the same address in lb's namespace is
//! balanced. With `namespaces = "all"` the pod's connect is rewritten (connect-time) and its
//! socket registered (splice), as before the scope existed. The scope is a map the new lb
//! writes again after `lb upgrade`: kept, or changed by the new config.

use std::{net::SocketAddr, time::Duration};

use anyhow::{Context as _, Result, ensure};
use lb_tests::{
    Holder, Host, Lb, Place, TempDir, TestCgroup, Toml, UpLb, free_port, run_client,
    skip_unless_root,
};

const T: Duration = Duration::from_secs(60);

/// The pod (`host`'s namespace, serving `s0` on its veth address and `pod` on its own
/// `127.0.0.1:P`), the cgroup, and the configs of an lb listening on `127.0.0.1:P` in front of
/// `s0`, which each test starts (and starts again) itself.
struct Pod {
    host: Host,
    cg: TestCgroup,
    listen: SocketAddr,
    dir: TempDir,
}

impl Pod {
    fn new() -> Result<Pod> {
        let mut host = Host::serving(9000, "s0")?;
        let port = free_port()?;
        let listen: SocketAddr = format!("127.0.0.1:{port}").parse()?;
        host.serve_on(listen, "pod")?;
        Ok(Pod {
            host,
            cg: TestCgroup::new()?,
            listen,
            dir: TempDir::new("lb-namespaces")?,
        })
    }

    /// A config file: one balancer `api` on `127.0.0.1:P` over `s0`, forwarding
    /// `forwarding`, and `namespaces` when given (else the default).
    fn config(&self, forwarding: &str, namespaces: Option<&str>) -> Result<String> {
        let mut balancer = Toml::new()
            .table("datapath")
            .string("mode", "bpf")
            .array_table("balancer")
            .string("name", "api")
            .value("listen", format!("[\"{}\"]", self.listen))
            .value("servers", format!("[\"{}\"]", self.host.addr(9000)))
            .string("forwarding", forwarding);
        if let Some(n) = namespaces {
            balancer = balancer.string("namespaces", n);
        }
        let text = balancer
            .table("balancer.health")
            .string("kind", "tcp")
            .string("interval", "500ms")
            .string("timeout", "300ms")
            .value("rise", 1);
        let file = self.dir.join(&format!("{forwarding}.toml"));
        std::fs::write(&file, text.text())?;
        Ok(file.display().to_string())
    }

    /// lb with [`Pod::config`], settled, its scope checked in `/status`.
    fn lb(&self, forwarding: &str, namespaces: Option<&str>) -> Result<Lb> {
        let file = self.config(forwarding, namespaces)?;
        let lb = Lb::start(&[
            "--config",
            &file,
            "--cgroup",
            &self.cg.path.display().to_string(),
        ])?;
        lb.wait_settled(Duration::from_secs(10))?;
        let st = lb.status()?;
        let b = &st["balancers"][0];
        ensure!(
            b["forwarding"] == forwarding,
            "forwarding should be {forwarding}: {st}\n{}",
            lb.log_text()
        );
        ensure!(
            b["namespaces"] == namespaces.unwrap_or("own"),
            "/status should name the scope: {st}"
        );
        if forwarding == "connect" {
            lb_tests::wait_until(Duration::from_secs(5), || {
                Ok(lb.log_text().contains("connect-time table updated"))
            })?;
        }
        Ok(lb)
    }

    /// A client in the pod's namespace and the test's cgroup.
    fn pod(&self) -> Place<'_> {
        Place {
            cgroup: Some(&self.cg.path),
            netns: Some(&self.host.ns),
        }
    }

    /// A client in lb's namespace and the test's cgroup.
    fn node(&self) -> Place<'_> {
        Place::cgroup(&self.cg.path)
    }
}

/// `lb_netns_skipped_total{program}` of balancer `api`.
fn skipped(lb: &Lb, program: &str) -> f64 {
    lb.metric("lb_netns_skipped_total", &format!("program=\"{program}\""))
}

#[test]
fn connect_time_leaves_a_pod_to_its_own_server() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let s = Pod::new()?;
    let lb = s.lb("connect", None)?;

    let v = run_client(&s.pod(), s.listen, &["peer"], T)?;
    eprintln!("pod, namespaces = own: {v}");
    ensure!(v["ok"] == true, "{v}");
    ensure!(
        v["server"] == "pod",
        "the pod's connect to its own {} should reach its own server: {v}",
        s.listen
    );
    lb_tests::wait_until(
        Duration::from_secs(5),
        || Ok(skipped(&lb, "connect") >= 1.0),
    )
    .with_context(|| format!("the skipped connect should be counted: {}", lb.log_text()))?;

    // The same address in lb's namespace is balanced, at connect time.
    let v = run_client(&s.node(), s.listen, &["peer"], T)?;
    ensure!(v["ok"] == true && v["server"] == "s0", "{v}");
    ensure!(
        v["server_sees"] == v["local"],
        "the node's client should reach s0 directly: {v}"
    );
    drop(lb);

    // Opted in: the pod's connect is rewritten to s0 (local in its namespace).
    let lb = s.lb("connect", Some("all"))?;
    let v = run_client(&s.pod(), s.listen, &["peer"], T)?;
    eprintln!("pod, namespaces = all: {v}");
    ensure!(v["ok"] == true && v["server"] == "s0", "{v}");
    ensure!(
        v["peer"] == s.listen.to_string(),
        "getpeername should name the listener: {v}"
    );
    ensure!(skipped(&lb, "connect") == 0.0, "nothing should be skipped");
    Ok(())
}

#[test]
fn splice_leaves_a_pod_socket_unregistered() -> Result<()> {
    if skip_unless_root() || lb_tests::splice_fallback_asserted()? {
        return Ok(());
    }
    let s = Pod::new()?;
    let lb = s.lb("splice", None)?;

    // The pod holds a connection to its own server: sockops gives it no flow (nor psock).
    let h = Holder::spawn(&s.pod(), s.listen, &["hold", "--max-ms", "60000"])?;
    let ev = h.wait_for("connected", Duration::from_secs(10))?;
    ensure!(ev["server"] == "pod", "{ev}");
    lb_tests::wait_until(
        Duration::from_secs(5),
        || Ok(skipped(&lb, "sockops") >= 1.0),
    )
    .with_context(|| format!("the skipped socket should be counted: {}", lb.log_text()))?;
    let flows = lb_tests::lb_map_entries(lb.pid(), "LB_FLOWS")?;
    ensure!(
        flows == 0,
        "the pod's socket should not be registered: {flows} flows"
    );
    drop(h);

    // The same address in lb's namespace reaches lb, which balances it to s0.
    let v = run_client(&s.node(), s.listen, &["peer"], T)?;
    ensure!(v["ok"] == true && v["server"] == "s0", "{v}");
    ensure!(
        lb.metric("lb_connections_total", "") >= 1.0,
        "the node's client should go through lb"
    );
    drop(lb);

    // Opted in: the pod's socket is registered (it still reaches its own server: lb's listener
    // is not in its namespace).
    let lb = s.lb("splice", Some("all"))?;
    let h = Holder::spawn(&s.pod(), s.listen, &["hold", "--max-ms", "60000"])?;
    let ev = h.wait_for("connected", Duration::from_secs(10))?;
    ensure!(ev["server"] == "pod", "{ev}");
    lb_tests::wait_until(Duration::from_secs(5), || {
        Ok(lb_tests::lb_map_entries(lb.pid(), "LB_FLOWS")? == 1)
    })
    .context("with namespaces = \"all\" the pod's socket should be registered")?;
    ensure!(skipped(&lb, "sockops") == 0.0, "nothing should be skipped");
    Ok(())
}

#[test]
fn an_upgrade_keeps_the_scope_or_applies_a_new_one() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let s = Pod::new()?;
    let file = s.config("connect", None)?;
    let cg = s.cg.path.display().to_string();
    let mut lb = UpLb::start(&["--config", &file, "--cgroup", &cg], &[])?;
    lb.wait_settled()?;
    lb_tests::wait_until(Duration::from_secs(5), || {
        Ok(lb.log_text().contains("connect-time table updated"))
    })?;
    let pod_reaches = |want: &str| -> Result<()> {
        let v = run_client(&s.pod(), s.listen, &["peer"], T)?;
        ensure!(v["ok"] == true && v["server"] == want, "{v}");
        Ok(())
    };
    pod_reaches("pod")?;

    // The same config: the new lb writes its own namespace's cookie again.
    lb.upgrade_ok()?;
    pod_reaches("pod")?;
    let v = run_client(&s.node(), s.listen, &["peer"], T)?;
    ensure!(
        v["ok"] == true && v["server"] == "s0" && v["server_sees"] == v["local"],
        "the node's client should still be rewritten: {v}"
    );

    // A new config opts in: the new lb's scope applies.
    s.config("connect", Some("all"))?;
    lb.upgrade_ok()?;
    ensure!(
        lb.status()?["balancers"][0]["namespaces"] == "all",
        "{}",
        lb.log_text()
    );
    pod_reaches("s0")
}
