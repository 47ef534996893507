//! The K3s agent load balancer scenario, step by step, with real servers and long-lived clients:
//! failover, fail-back, a server set change through the admin API, and the state file.

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use lb_tests::{
    Holder, Lb, Place, TestCgroup, free_port, http_request, skip_unless_root, wait_server_state,
};

fn state_of(lb: &Lb, server: &str) -> Result<String> {
    let st = lb.status()?;
    let servers = st["balancers"][0]["servers"]
        .as_array()
        .context("servers")?;
    Ok(servers
        .iter()
        .find(|s| s["address"] == server)
        .map_or("(absent)".to_string(), |s| {
            s["state"].as_str().unwrap_or("").to_string()
        }))
}

fn killed(lb: &Lb, reason: &str) -> f64 {
    lb.metric(
        "lb_connections_killed_total",
        &format!("reason=\"{reason}\""),
    )
}

fn all_reconnect_to(holders: &[Holder], server: &str) -> Result<()> {
    for h in holders {
        let ev = h.wait_for("connected", Duration::from_secs(10))?;
        ensure!(
            ev["server"] == server,
            "client reconnected to {} instead of {server}: {ev}",
            ev["server"]
        );
    }
    Ok(())
}

#[test]
fn k3s_failover_failback_and_set_change() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let hosts = lb_tests::serving_hosts(3, 6443, |i| format!("s{}", i + 1))?;
    let addr: Vec<String> = hosts.iter().map(|h| h.addr(6443).to_string()).collect();
    let cg = TestCgroup::new()?;
    let dir = std::env::temp_dir().join(format!("lb-k3s-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let state_file = dir.join("state.json");
    let listen = format!("127.0.0.1:{}", free_port()?);
    let config = |default: &str| {
        format!(
            r#"
[[balancer]]
name = "apiserver"
listen = ["{listen}"]
servers = ["{}", "{}", "{}"]
default_server = "{default}"
dial_timeout = "2s"
state_file = "{}"

[balancer.health]
kind = "tcp"
interval = "300ms"
timeout = "300ms"
rise = 2
fall = 1
"#,
            addr[0],
            addr[1],
            addr[2],
            state_file.display()
        )
    };
    let cfg_path = dir.join("lb.toml");
    std::fs::write(&cfg_path, config(&addr[0]))?;
    let cgp = cg.path.display().to_string();
    let cfgp = cfg_path.display().to_string();
    let mut lb = Lb::start(&[
        "--config",
        &cfgp,
        "--cgroup",
        &cgp,
        "--forwarding",
        "splice",
    ])?;
    lb.wait_ready(Duration::from_secs(10))?;
    for a in &addr {
        wait_server_state(&lb, "apiserver", a, "PREFERRED", Duration::from_secs(5))?;
    }

    // Three long-lived clients land on the first server, which turns ACTIVE.
    let place = Place::cgroup(&cg.path);
    let listen_addr = listen.parse()?;
    let holders: Vec<Holder> = (0..3)
        .map(|_| Holder::start(&place, listen_addr, 5, 60_000))
        .collect::<Result<_>>()?;
    all_reconnect_to(&holders, "s1")?;
    ensure!(state_of(&lb, &addr[0])? == "ACTIVE", "s1 should be ACTIVE");

    // Failover: s1 vanishes; its clients are reset and move to s2.
    hosts[0].blackhole(true)?;
    wait_server_state(&lb, "apiserver", &addr[0], "FAILED", Duration::from_secs(3))?;
    for h in &holders {
        let ev = h.wait_for("closed", Duration::from_secs(3))?;
        ensure!(
            ev["how"] == "connection reset",
            "a killed connection must be reset: {ev}"
        );
    }
    all_reconnect_to(&holders, "s2")?;
    ensure!(state_of(&lb, &addr[1])? == "ACTIVE", "s2 should be ACTIVE");
    ensure!(killed(&lb, "health") >= 3.0, "unhealthy kills not counted");

    // Fail-back: s1 recovers (RECOVERING → PREFERRED), s2's connections are closed, clients go back.
    hosts[0].blackhole(false)?;
    all_reconnect_to(&holders, "s1")?;
    ensure!(
        killed(&lb, "failback") >= 3.0,
        "fail-back kills not counted"
    );
    ensure!(
        state_of(&lb, &addr[1])? == "HEALTHY",
        "s2 should be HEALTHY after fail-back"
    );

    // Server set change: s1 leaves the set (its connections close), s2 becomes the default. The
    // clients go to s3: it is still PREFERRED, which K3s ranks above s2's HEALTHY.
    let body = format!(
        r#"{{"servers": ["{}", "{}"], "default": "{}"}}"#,
        addr[1], addr[2], addr[1]
    );
    let (code, resp) = http_request(lb.admin, "PUT", "/balancers/apiserver/servers", Some(&body))?;
    ensure!(code == 200, "PUT servers answered {code}: {resp}");
    all_reconnect_to(&holders, "s3")?;
    ensure!(state_of(&lb, &addr[0])? == "(absent)", "s1 should be gone");
    ensure!(killed(&lb, "removed") >= 3.0, "removal kills not counted");
    // An empty set is refused and changes nothing.
    let (code, _) = http_request(
        lb.admin,
        "PUT",
        "/balancers/apiserver/servers",
        Some(r#"{"servers": []}"#),
    )?;
    ensure!(code == 400, "empty server list must be refused, got {code}");
    drop(holders);

    // The state file holds the new set. On restart with the config unchanged, the set changed
    // through the API stands (the config's list is the one the file was written under).
    let saved: serde_json::Value = serde_json::from_slice(&std::fs::read(&state_file)?)?;
    ensure!(
        saved["servers"] == serde_json::json!([addr[1], addr[2]]),
        "state file: {saved}"
    );
    ensure!(saved["default"] == addr[1], "state file default: {saved}");
    lb.terminate(Duration::from_secs(35))?;
    let lb2 = Lb::start(&[
        "--config",
        &cfgp,
        "--cgroup",
        &cgp,
        "--forwarding",
        "splice",
    ])?;
    ensure!(
        state_of(&lb2, &addr[0])? == "(absent)",
        "state file not loaded: s1 is back"
    );
    ensure!(
        state_of(&lb2, &addr[1])? != "(absent)" && state_of(&lb2, &addr[2])? != "(absent)",
        "the API's set must stand"
    );
    drop(lb2);
    // The operator edited the config's server list (here its default): the edit wins and the
    // state file is ignored.
    std::fs::write(&cfg_path, config(&addr[2]))?;
    let lb3 = Lb::start(&[
        "--config",
        &cfgp,
        "--cgroup",
        &cgp,
        "--forwarding",
        "splice",
    ])?;
    ensure!(
        state_of(&lb3, &addr[0])? != "(absent)",
        "a state file written under another config list must be ignored"
    );
    drop(lb3);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
