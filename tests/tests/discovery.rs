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

fn discovery(lb: &Lb) -> Result<serde_json::Value> {
    Ok(lb.status()?["balancers"][0]["discovery"].clone())
}

#[test]
fn dns_discovery_follows_the_answer_within_its_ttl() -> Result<()> {
    if skip_unless_root("dns_discovery_follows_the_answer_within_its_ttl") {
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
    let cfg_path = dir.join("lb.toml");
    std::fs::write(&cfg_path, config)?;
    let cfgp = cfg_path.display().to_string();
    let cgp = cg.path.display().to_string();
    let lb = Lb::start(&[
        "--config",
        &cfgp,
        "--cgroup",
        &cgp,
        "--forwarding",
        "splice",
    ])?;
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
    if skip_unless_root("etcd_discovery_follows_the_member_list") {
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
    let cfg_path = dir.join("lb.toml");
    std::fs::write(&cfg_path, config)?;
    let cfgp = cfg_path.display().to_string();
    let cgp = cg.path.display().to_string();
    let lb = Lb::start(&[
        "--config",
        &cfgp,
        "--cgroup",
        &cgp,
        "--forwarding",
        "splice",
    ])?;
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
