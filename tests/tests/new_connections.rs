//! Failover for clients that connect during an outage, not only those already connected: a
//! dial in progress to a server that turns FAILED is abandoned at once and the client moves on
//! to the next server, so no new client waits out `dial_timeout` on a blackholed server; with
//! every server FAILED, lb dials them all at once (`all_failed = "try"`, reset within one
//! `dial_timeout`) or resets the client at once (`all_failed = "refuse"`).
//!
//! A blackholed host has a dead neighbour entry: its packets vanish (no RST, no ICMP).

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use lb_tests::{
    Fixture, Host, Place, TestCgroup, Toml, run_client, skip_unless_root, timed, wait_server_state,
};

/// Checks: FAILED within 0.5 × 2 + 0.3 = 1.3 s of a blackhole.
const INTERVAL_MS: u64 = 500;
const FALL: u64 = 2;
const TIMEOUT_MS: u64 = 300;
/// The bound for a new client: `interval × fall + timeout + 1 s`.
const BOUND_MS: u64 = INTERVAL_MS * FALL + TIMEOUT_MS + 1000;
/// Scheduling slack on a loaded 2-core machine (process start of the client included).
const SLACK_MS: u64 = 700;

/// Two hosts `s0`, `s1` on :9000 behind lb (userspace copy: dialing is what is tested),
/// `dial_timeout` long enough that waiting it out would show; returns once both are
/// PREFERRED.
fn setup(dial_timeout: &str, all_failed: &str) -> Result<Fixture> {
    let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    let servers = lb_tests::toml_addrs(&hosts, 9000);
    setup_with(hosts, &servers, None, dial_timeout, all_failed, "")
}

/// As [`setup`] with `servers` (TOML list items) naming `hosts`, as `/status` shows them in
/// `names` (their addresses when `None`).
fn setup_with(
    hosts: Vec<Host>,
    servers: &str,
    names: Option<Vec<String>>,
    dial_timeout: &str,
    all_failed: &str,
    health_extra: &str,
) -> Result<Fixture> {
    let config = |_: &TestCgroup, listen: SocketAddr| {
        Toml::new()
            .array_table("balancer")
            .string("name", "api")
            .value("listen", format!("[\"{listen}\"]"))
            .value("servers", format!("[{servers}]"))
            .string("dial_timeout", dial_timeout)
            .string("all_failed", all_failed)
            // Fail-back resets the clients of the backup when the primary returns, by design
            // (tests/k3s.rs covers it); here every reset would be a client the outage failed,
            // so it is off.
            .value("failback", false)
            .table("balancer.health")
            .string("kind", "tcp")
            .string("interval", &format!("{INTERVAL_MS}ms"))
            .string("timeout", &format!("{TIMEOUT_MS}ms"))
            .value("rise", 2)
            .value("fall", FALL)
            .lines(health_extra)
    };
    let mut s = Fixture::start(hosts, 9000, config, &["--datapath", "userspace"])?;
    if let Some(names) = names {
        s.names = names;
    }
    // With the loop off nothing is checked until a client comes.
    if !health_extra.contains("loop = false") {
        s.wait_all("api", "PREFERRED", Duration::from_secs(10))?;
    }
    Ok(s)
}

/// The state `/status` shows for server `i` of `s` ("" when it is not listed).
fn state(s: &Fixture, i: usize) -> Result<String> {
    let st = s.lb.status()?;
    let addr = &s.names[i];
    Ok(st["balancers"][0]["servers"]
        .as_array()
        .context("servers")?
        .iter()
        .find(|s| s["address"] == addr.as_str())
        .and_then(|s| s["state"].as_str())
        .unwrap_or("")
        .to_string())
}

/// As [`client`], reconnecting once when reset, as real clients do: one that connected to a
/// server an instant before it was blackholed is reset when that server turns FAILED
/// (`on_unhealthy = "kill"`), by design. Its wait counts from its first attempt.
fn client_reconnecting(listen: SocketAddr, limit: Duration) -> Result<(bool, Duration)> {
    let start = Instant::now();
    let (ok, _) = client(listen, limit)?;
    if ok {
        return Ok((true, start.elapsed()));
    }
    let (ok, _) = client(listen, limit)?;
    Ok((ok, start.elapsed()))
}

/// One client of `listen`: connect, one echo round trip; returns whether it was served and how
/// long it took from start to answer (or reset).
fn client(listen: SocketAddr, limit: Duration) -> Result<(bool, Duration)> {
    let start = Instant::now();
    let v = run_client(&Place::default(), listen, &["rr", "1", "16"], limit)?;
    Ok((v["ok"] == true, start.elapsed()))
}

#[test]
fn a_client_connecting_during_a_blackhole_is_served_by_the_backup_in_time() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let s = setup("10s", "try")?;
    // s0 is preferred: a new client's dial to it hangs once it is blackholed.
    s.hosts[0].blackhole(true)?;
    std::thread::sleep(Duration::from_millis(200));
    let (ok, took) = client(s.listen, Duration::from_secs(30))?;
    eprintln!("client started 0.2 s into the blackhole: served {ok} after {took:?}");
    ensure!(ok, "the client must be served by s1\n{}", s.lb.log_text());
    ensure!(
        !timed() || took < Duration::from_millis(BOUND_MS + SLACK_MS),
        "served after {took:?}: more than interval x fall + timeout + 1 s (dial_timeout is 10 s)"
    );
    ensure!(
        s.lb.metric("lb_dials_abandoned_total", "balancer=\"api\"") >= 1.0,
        "the dial to s0 must have been abandoned"
    );
    s.hosts[0].blackhole(false)?;
    Ok(())
}

#[test]
fn a_connect_loop_through_three_outages_never_waits_past_the_bound() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    connect_loop_through_outages(&setup("10s", "try")?, 3)
}

/// Lines added to `/etc/hosts` for one test, removed on drop (also when the test fails).
struct HostsEntries(String);

impl HostsEntries {
    fn add(name: &str, ips: &[std::net::Ipv4Addr]) -> Result<HostsEntries> {
        let marker = format!("# lb-test {} {name}", std::process::id());
        // A guest's initramfs may have no /etc/hosts yet.
        let mut text = std::fs::read_to_string("/etc/hosts").unwrap_or_default();
        if !text.ends_with('\n') {
            text.push('\n');
        }
        for ip in ips {
            text.push_str(&format!("{ip} {name} {marker}\n"));
        }
        std::fs::write("/etc/hosts", text)?;
        Ok(HostsEntries(marker))
    }
}

impl Drop for HostsEntries {
    fn drop(&mut self) {
        if let Ok(text) = std::fs::read_to_string("/etc/hosts") {
            let kept: String = text
                .lines()
                .filter(|l| !l.contains(&self.0))
                .map(|l| format!("{l}\n"))
                .collect();
            let _ = std::fs::write("/etc/hosts", kept);
        }
    }
}

/// A host name with two addresses (two test hosts, through `/etc/hosts`): each address is
/// its own server, so with either one blackholed the name keeps serving every new client.
#[test]
fn a_name_with_two_addresses_keeps_serving_with_either_blackholed() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    let name = format!("lbt-two-{}.test", std::process::id());
    let _entries = HostsEntries::add(&name, &[hosts[0].ip, hosts[1].ip])?;
    let names = hosts
        .iter()
        .map(|h| format!("{name}:9000 ({})", h.ip))
        .collect();
    let s = setup_with(
        hosts,
        &format!("\"{name}:9000\""),
        Some(names),
        "10s",
        "try",
        "",
    )?;
    let st = s.lb.status()?;
    ensure!(
        st["balancers"][0]["servers"].as_array().map(Vec::len) == Some(2),
        "one server per address: {st}"
    );
    connect_loop_through_outages(&s, 2)
}

/// A new client every 100 ms while the servers are blackholed in turn, `outages` times: every
/// client is served, none waits past the bound.
fn connect_loop_through_outages(s: &Fixture, outages: usize) -> Result<()> {
    let waits: Arc<Mutex<Vec<(bool, Duration)>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // One new client every 100 ms for the whole run, each on its own thread.
    let looper = {
        let (listen, waits, stop) = (s.listen, waits.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut clients = Vec::new();
            for _ in 0..400 {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                let waits = waits.clone();
                clients.push(std::thread::spawn(move || {
                    if let Ok(r) = client_reconnecting(listen, Duration::from_secs(30)) {
                        waits.lock().unwrap_or_else(|p| p.into_inner()).push(r);
                    }
                }));
                std::thread::sleep(Duration::from_millis(100));
            }
            for c in clients {
                let _ = c.join();
            }
        })
    };
    let ran = (|| -> Result<()> {
        for round in 0..outages {
            let i = round % 2;
            s.hosts[i].blackhole(true)?;
            wait_server_state(&s.lb, "api", &s.names[i], "FAILED", Duration::from_secs(5))?;
            std::thread::sleep(Duration::from_millis(1000));
            s.hosts[i].blackhole(false)?;
            wait_server_state(
                &s.lb,
                "api",
                &s.names[i],
                "PREFERRED",
                Duration::from_secs(10),
            )?;
            std::thread::sleep(Duration::from_millis(500));
        }
        Ok(())
    })();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = looper.join();
    ran?;
    let waits = waits.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let worst = waits.iter().map(|(_, d)| *d).max().unwrap_or_default();
    let failed = waits.iter().filter(|(ok, _)| !ok).count();
    eprintln!(
        "{} clients through {outages} outages: {failed} not served, worst wait {worst:?}",
        waits.len()
    );
    ensure!(
        waits.len() >= 10 * outages,
        "too few clients ran: {}",
        waits.len()
    );
    ensure!(failed == 0, "{failed} clients were not served");
    ensure!(
        !timed() || worst < Duration::from_millis(BOUND_MS + SLACK_MS),
        "a client waited {worst:?}, past interval x fall + timeout + 1 s"
    );
    Ok(())
}

#[test]
fn with_every_server_down_a_client_is_reset_within_one_dial_timeout_or_at_once() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    for (all_failed, bound) in [
        ("try", Duration::from_secs(3 + 1)),
        ("refuse", Duration::from_millis(500 + SLACK_MS)),
    ] {
        let s = setup("3s", all_failed)?;
        for i in 0..2 {
            s.hosts[i].blackhole(true)?;
        }
        for i in 0..2 {
            wait_server_state(&s.lb, "api", &s.names[i], "FAILED", Duration::from_secs(5))?;
        }
        let (ok, took) = client(s.listen, Duration::from_secs(30))?;
        eprintln!("all_failed = {all_failed}: reset after {took:?}");
        ensure!(!ok, "no server can answer");
        ensure!(
            !timed() || took < bound,
            "all_failed = {all_failed}: reset after {took:?}, bound {bound:?} (dials one after \
             another would take 2 x 3 s)"
        );
        let refused = s.lb.metric("lb_clients_refused_total", "balancer=\"api\"");
        ensure!(refused >= 1.0, "lb_clients_refused_total not counted");
        if all_failed == "try" {
            ensure!(
                s.lb.metric("lb_dials_raced_total", "balancer=\"api\"") >= 2.0,
                "both servers must have been dialed at once"
            );
        }
        for i in 0..2 {
            s.hosts[i].blackhole(false)?;
        }
    }
    Ok(())
}

/// With `health.loop = false` checks run only before dials: when every server is FAILED, a
/// client's dial still checks them first (once `max_age` has passed), so servers that came back
/// leave FAILED instead of being raced as FAILED forever (review finding).
#[test]
fn with_the_loop_off_failed_servers_are_checked_again_before_a_dial() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    let servers = lb_tests::toml_addrs(&hosts, 9000);
    let mut s = setup_with(
        hosts,
        &servers,
        None,
        "2s",
        "try",
        "loop = false\nmax_age = \"500ms\"",
    )?;
    for h in &mut s.hosts {
        h.stop_servers();
    }
    for _ in 0..3 {
        let (ok, _) = client(s.listen, Duration::from_secs(30))?;
        ensure!(!ok, "nothing serves");
        std::thread::sleep(Duration::from_millis(600));
    }
    for i in 0..2 {
        wait_server_state(&s.lb, "api", &s.names[i], "FAILED", Duration::from_secs(5))?;
    }
    for (i, h) in s.hosts.iter_mut().enumerate() {
        h.serve(9000, &format!("s{i}"))?;
    }
    std::thread::sleep(Duration::from_millis(600));
    let (ok, _) = client(s.listen, Duration::from_secs(30))?;
    ensure!(ok, "a server is back: the client must be served");
    let states = [state(&s, 0)?, state(&s, 1)?];
    ensure!(
        states.iter().any(|st| st != "FAILED"),
        "the dial's checks must have moved a server out of FAILED: {states:?}\n{}",
        s.lb.log_text()
    );
    Ok(())
}
