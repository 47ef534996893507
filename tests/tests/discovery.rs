//! Server discovery against real sources (issue 15): a real DNS server (dnsmasq on a test host)
//! whose answer changes, and a real three-member etcd cluster whose member list shrinks with
//! `etcdctl member remove`. lb must follow each source, close the connections of a server that
//! left the answer, and keep the last good set when the source answers with nothing.

use std::{net::IpAddr, time::Duration};

use anyhow::{Context as _, Result, ensure};
use lb_tests::{
    DnsServer, EtcdCluster, Holder, Lb, Place, TempDir, TestCgroup, etcdctl, free_port,
    serving_hosts, skip_unless_root, wait_until,
};

/// Addresses of every server of the one balancer, sorted.
fn addresses(lb: &Lb) -> Result<Vec<String>> {
    let st = lb.status()?;
    let mut out: Vec<String> = st["balancers"][0]["servers"]
        .as_array()
        .with_context(|| format!("no servers in {st}"))?
        .iter()
        .map(|s| s["address"].as_str().unwrap_or("").to_string())
        .collect();
    out.sort();
    Ok(out)
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

/// lb on `config` (written into `dir`), attached to `cg`, forwarding through lb (splice).
fn start_lb(dir: &TempDir, cg: &TestCgroup, config: &str) -> Result<Lb> {
    let path = dir.join("lb.toml");
    std::fs::write(&path, config)?;
    let (cfgp, cgp) = (path.display().to_string(), cg.path.display().to_string());
    Lb::start(&[
        "--config",
        &cfgp,
        "--cgroup",
        &cgp,
        "--forwarding",
        "splice",
    ])
}

fn discovery(lb: &Lb) -> Result<serde_json::Value> {
    Ok(lb.status()?["balancers"][0]["discovery"].clone())
}

#[test]
fn dns_discovery_follows_the_answer_within_its_ttl() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let hosts = serving_hosts(3, 6443, |i| format!("s{}", i + 1))?;
    let addr: Vec<String> = hosts.iter().map(|h| h.addr(6443).to_string()).collect();
    let ip: Vec<IpAddr> = hosts.iter().map(|h| IpAddr::V4(h.ip)).collect();
    // TTL 2 s against an interval of 30 s: lb must come back after the TTL, not the interval.
    let mut dns = DnsServer::start(2)?;
    dns.set_records("api.lb.test", &ip[..2])?;
    let cg = TestCgroup::new()?;
    let dir = TempDir::new("lb-dns-discovery")?;
    let listen = format!("127.0.0.1:{}", free_port()?);
    let config = format!(
        r#"
[[balancer]]
name = "apiserver"
listen = ["{listen}"]
dial_timeout = "2s"
state_file = "{}"
discovery = {{ kind = "dns", name = "api.lb.test", port = 6443, interval = "30s", timeout = "2s", nameservers = ["{}"] }}

[balancer.health]
kind = "tcp"
interval = "300ms"
timeout = "300ms"
rise = 1
fall = 1
"#,
        dir.join("state.json").display(),
        dns.addr()
    );
    let lb = start_lb(&dir, &cg, &config)?;
    let took = wait_until(Duration::from_secs(10), || {
        Ok(addresses(&lb)? == sorted(addr[..2].to_vec()))
    })
    .with_context(|| format!("first answer not applied: {}", lb.log_text()))?;
    println!("first answer applied {} ms after start", took.as_millis());
    lb.wait_ready(Duration::from_secs(10))?;
    let d = discovery(&lb)?;
    ensure!(
        d["kind"] == "dns" && d["source"] == "api.lb.test:6443" && d["servers"] == 2,
        "status: {d}"
    );

    // A long-lived client lands on s1 (failover keeps the first server of the answer ACTIVE).
    let place = Place::cgroup(&cg.path);
    let holder = Holder::start(&place, listen.parse()?, 3, 60_000)?;
    let ev = holder.wait_for("connected", Duration::from_secs(5))?;
    ensure!(ev["server"] == "s1", "client on {ev}");

    // s1 leaves the answer for good, s3 joins: within the TTL (+ one run) s1 is gone and its
    // client is reset and reconnects to a server still in the answer.
    let changed = std::time::Instant::now();
    dns.set_records("api.lb.test", &ip[1..])?;
    let ev = holder.wait_for("closed", Duration::from_secs(6))?;
    let closed_ms = changed.elapsed().as_millis();
    ensure!(
        ev["how"] == "connection reset",
        "removed server's client: {ev}"
    );
    let ev = holder.wait_for("connected", Duration::from_secs(5))?;
    ensure!(
        ev["server"] == "s2" || ev["server"] == "s3",
        "reconnected to {ev}"
    );
    wait_until(Duration::from_secs(5), || {
        Ok(addresses(&lb)? == sorted(addr[1..].to_vec()))
    })?;
    println!(
        "answer changed (TTL 2 s, interval 30 s): the removed server's client was reset after {closed_ms} ms"
    );
    ensure!(
        closed_ms < 6000,
        "lb must re-resolve within the TTL, not the interval"
    );
    ensure!(
        lb.metric("lb_connections_killed_total", "reason=\"removed\"") >= 1.0,
        "removal kill not counted"
    );

    // The name disappears (NXDOMAIN): the last good set stays, the error is reported.
    let errors_before = lb.metric("lb_discovery_runs_total", "result=\"error\"");
    dns.set_records("api.lb.test", &[])?;
    wait_until(Duration::from_secs(6), || {
        Ok(discovery(&lb)?["last_error"].is_string())
    })
    .with_context(|| format!("no error reported: {}", lb.log_text()))?;
    ensure!(
        addresses(&lb)? == sorted(addr[1..].to_vec()),
        "an empty answer must not change the set"
    );
    ensure!(
        lb.metric("lb_discovery_runs_total", "result=\"error\"") > errors_before,
        "failed run not counted"
    );
    println!(
        "NXDOMAIN kept the set; error: {}",
        discovery(&lb)?["last_error"]
    );
    // The connected client was never touched by the failed run.
    ensure!(
        holder.next(Duration::from_millis(300)).is_err(),
        "the client saw an event during the DNS outage"
    );
    // The state file holds the last discovered set, for the next start.
    let saved: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("state.json"))?)?;
    ensure!(
        saved["servers"] == serde_json::json!([addr[1], addr[2]]),
        "state file: {saved}"
    );
    Ok(())
}

#[test]
fn etcd_discovery_follows_the_member_list() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let mut cluster = EtcdCluster::start(3)?;
    let members: Vec<String> = cluster
        .client_addrs()
        .iter()
        .map(ToString::to_string)
        .collect();
    let cg = TestCgroup::new()?;
    let dir = TempDir::new("lb-etcd-discovery")?;
    let port = free_port()?;
    let listen = format!("127.0.0.1:{port}");
    // The member list is asked through lb's own listener, as K3s's etcd proxy does; lb starts
    // from one member, the one it knows, and learns the others.
    let config = format!(
        r#"
[[balancer]]
name = "etcd"
listen = ["{listen}"]
servers = ["{}"]
dial_timeout = "2s"
discovery = {{ kind = "etcd", endpoints = ["http://{listen}"], interval = "500ms", timeout = "2s" }}

[balancer.health]
kind = "http"
url = "http://{{host}}:9345/ping"
interval = "300ms"
timeout = "300ms"
rise = 1
fall = 1
"#,
        members[0]
    );
    let lb = start_lb(&dir, &cg, &config)?;
    let took = wait_until(Duration::from_secs(15), || {
        Ok(addresses(&lb)? == sorted(members.clone()))
    })
    .with_context(|| format!("member list not applied: {}", lb.log_text()))?;
    println!("3 members discovered {} ms after start", took.as_millis());
    ensure!(discovery(&lb)?["kind"] == "etcd", "{}", discovery(&lb)?);

    // etcdctl through lb works on the discovered set.
    let place = Place::cgroup(&cg.path);
    etcdctl(
        &place,
        &listen,
        &["put", "k/1", "one"],
        Duration::from_secs(10),
    )?;

    // m3 is removed from the cluster: it leaves lb's set.
    let removed = cluster.members()[2].client_addr().to_string();
    cluster.member_remove("m3")?;
    let removed_at = std::time::Instant::now();
    wait_until(Duration::from_secs(10), || {
        Ok(!addresses(&lb)?.contains(&removed))
    })
    .with_context(|| format!("removed member still in the set: {}", lb.log_text()))?;
    println!(
        "member remove: left lb's set {} ms after etcd confirmed it",
        removed_at.elapsed().as_millis()
    );
    ensure!(
        addresses(&lb)? == sorted(members[..2].to_vec()),
        "set after remove: {:?}",
        addresses(&lb)?
    );
    let got = etcdctl(
        &place,
        &listen,
        &["get", "k/1", "--print-value-only"],
        Duration::from_secs(10),
    )?;
    ensure!(got.trim() == "one", "get through lb: {got:?}");
    // The API may not change a set the member list owns.
    let (code, body) = lb_tests::http_request(
        lb.admin,
        "PUT",
        "/balancers/etcd/servers",
        Some(&format!(r#"{{"servers": ["{}"]}}"#, members[0])),
    )?;
    ensure!(
        code == 409 && body.contains("etcd discovery"),
        "PUT: {code} {body}"
    );
    Ok(())
}

/// The servers of balancer `i`, by address, in order.
fn addresses_of(lb: &Lb, i: usize) -> Result<Vec<String>> {
    let st = lb.status()?;
    Ok(st["balancers"][i]["servers"]
        .as_array()
        .with_context(|| format!("no servers in {st}"))?
        .iter()
        .map(|s| s["address"].as_str().unwrap_or("").to_string())
        .collect())
}

/// Issue 28 item 7: a host name in `servers` follows DNS (`resolve = "follow"`, the default)
/// the way Envoy's STRICT_DNS clusters do, and `resolve = "once"` keeps the address it had.
/// One lb, two balancers on the same name; the name moves from s1 to s2 and s1 goes dark: the
/// following balancer moves its clients to s2 within the TTL, the pinned one stays on s1.
#[test]
fn server_names_follow_dns_unless_pinned() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let hosts = serving_hosts(2, 6443, |i| format!("s{}", i + 1))?;
    let ip: Vec<IpAddr> = hosts.iter().map(|h| IpAddr::V4(h.ip)).collect();
    let pinned_to = |i: usize| format!("api.lb.test:6443 ({})", ip[i]);
    let mut dns = DnsServer::start(2)?;
    dns.set_records("api.lb.test", &ip[..1])?;
    let cg = TestCgroup::new()?;
    let dir = TempDir::new("lb-names-follow")?;
    let (follow, pinned) = (
        format!("127.0.0.1:{}", free_port()?),
        format!("127.0.0.1:{}", free_port()?),
    );
    let health = r#"
[balancer.health]
kind = "tcp"
interval = "300ms"
timeout = "300ms"
rise = 1
fall = 1
"#;
    // TTL 2 s against the default interval of 30 s: the name must be asked again at its TTL.
    let config = format!(
        r#"
[dns]
nameservers = ["{dns}"]
timeout = "2s"

[[balancer]]
name = "follow"
listen = ["{follow}"]
servers = ["api.lb.test:6443"]
dial_timeout = "1s"
{health}
[[balancer]]
name = "pinned"
listen = ["{pinned}"]
servers = ["api.lb.test:6443"]
resolve = "once"
dial_timeout = "1s"
{health}"#,
        dns = dns.addr()
    );
    let lb = start_lb(&dir, &cg, &config)?;
    // The system resolver does not know the name: both balancers get s1 from the [dns] one.
    let took = wait_until(Duration::from_secs(10), || {
        Ok(addresses_of(&lb, 0)? == [pinned_to(0)] && addresses_of(&lb, 1)? == [pinned_to(0)])
    })
    .with_context(|| format!("the name was not resolved: {}", lb.log_text()))?;
    println!("api.lb.test resolved {} ms after start", took.as_millis());
    lb.wait_ready(Duration::from_secs(10))?;
    let st = lb.status()?;
    let b = &st["balancers"];
    ensure!(
        b[0]["resolve"] == "follow" && b[1]["resolve"] == "once",
        "resolve in /status: {st}"
    );
    ensure!(
        b[0]["names"][0]["name"] == "api.lb.test:6443"
            && b[0]["names"][0]["addresses"] == serde_json::json!([pinned_to(0)])
            && b[0]["names"][0]["last_error"].is_null(),
        "names in /status: {}",
        b[0]["names"]
    );

    let place = Place::cgroup(&cg.path);
    let holder = Holder::start(&place, follow.parse()?, 20, 60_000)?;
    let ev = holder.wait_for("connected", Duration::from_secs(5))?;
    ensure!(
        ev["server"] == "s1",
        "client of the follow balancer on {ev}"
    );

    // The name moves to s2 and s1 goes dark.
    let changed = std::time::Instant::now();
    dns.set_records("api.lb.test", &ip[1..])?;
    hosts[0].blackhole(true)?;
    let ev = holder.wait_for("closed", Duration::from_secs(8))?;
    ensure!(ev["how"] == "connection reset", "s1's client: {ev}");
    let ev = holder.wait_for("connected", Duration::from_secs(8))?;
    let moved_ms = changed.elapsed().as_millis();
    ensure!(ev["server"] == "s2", "reconnected to {ev}");
    ensure!(
        moved_ms < 2000 + 4000,
        "the client reached s2 after {moved_ms} ms: more than the TTL (2 s) and a margin"
    );
    ensure!(
        addresses_of(&lb, 0)? == [pinned_to(1)],
        "follow: {:?}",
        addresses_of(&lb, 0)?
    );
    println!("name moved (TTL 2 s): s1's client reset and on s2 {moved_ms} ms after the change");

    // The pinned balancer keeps s1 however often the following one asks again: wait for two
    // more resolutions (two TTLs), then s1 is still its only server, FAILED behind the
    // blackhole.
    let resolved = |lb: &Lb| -> Result<f64> {
        Ok(lb.status()?["balancers"][0]["names"][0]["last_resolved"]
            .as_f64()
            .unwrap_or(0.0))
    };
    let r0 = resolved(&lb)?;
    wait_until(Duration::from_secs(8), || Ok(resolved(&lb)? > r0))?;
    let r1 = resolved(&lb)?;
    wait_until(Duration::from_secs(8), || Ok(resolved(&lb)? > r1))?;
    ensure!(
        addresses_of(&lb, 1)? == [pinned_to(0)],
        "resolve = once must keep s1: {:?}",
        addresses_of(&lb, 1)?
    );
    wait_until(Duration::from_secs(5), || {
        Ok(lb.status()?["balancers"][1]["servers"][0]["state"] == "FAILED")
    })
    .with_context(|| format!("pinned s1 not FAILED: {}", lb.status().unwrap_or_default()))?;
    println!("resolve = once: still on s1 (FAILED) after two more answers naming s2");

    // Back to s1 while s2 stays healthy: no check fails, so the reset of s2's client is the
    // removal of an address that left the answer.
    hosts[0].blackhole(false)?;
    let removed_before = lb.metric("lb_connections_killed_total", "reason=\"removed\"");
    let changed = std::time::Instant::now();
    dns.set_records("api.lb.test", &ip[..1])?;
    let ev = holder.wait_for("closed", Duration::from_secs(8))?;
    ensure!(ev["how"] == "connection reset", "s2's client: {ev}");
    let closed_ms = changed.elapsed().as_millis();
    let ev = holder.wait_for("connected", Duration::from_secs(8))?;
    ensure!(ev["server"] == "s1", "reconnected to {ev}");
    ensure!(
        lb.metric("lb_connections_killed_total", "reason=\"removed\"") > removed_before,
        "the reset was not the removal: {}",
        lb.log_text()
    );
    ensure!(
        closed_ms < 2000 + 4000,
        "s2 left the answer {closed_ms} ms before its client was reset"
    );
    println!("name moved back to s1: s2's client reset as removed after {closed_ms} ms");
    Ok(())
}
