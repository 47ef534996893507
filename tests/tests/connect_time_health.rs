//! Passive health and bookkeeping of connect-time balancing (`forwarding = "connect"`) under
//! failures that are not the server's: connects their own client gives up on, one network
//! blip that times out many sockets at once, and connects that fail before a SYN is sent.
//! None of them may fail a healthy server or leave records in lb's kernel maps.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use lb_tests::{
    ConnectLb, Holder, Host, Place, Toml, free_port, run_client, skip_unless_kernel,
    skip_unless_root,
};

const T: Duration = Duration::from_secs(60);

/// Balancer `api` on `listen` over `servers` in failover order; every knob that makes one
/// failure count is at its harshest ([`ConnectLb::shared_checks`]): `fall = 1` and `limit`
/// resets (or server-failed connects) are one failed check. `check` is the server every check
/// goes to (`shared_target`), `interval` the check interval (also the window in which
/// retransmission timeouts count once).
fn config(listen: SocketAddr, servers: &str, check: &str, interval: &str, limit: u32) -> Toml {
    ConnectLb::config(&Toml::new(), &[listen], servers, "failover")
        .string("dial_timeout", "1s")
        .lines(ConnectLb::shared_checks(check, interval, limit).text())
}

/// lb in front of two fresh hosts, `s0:9000` and `s1:9000`, with [`config`]: checks sent to
/// `check` (0 or 1, by host).
fn start(check: usize, interval: &str, limit: u32) -> Result<ConnectLb> {
    let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    let servers = lb_tests::toml_addrs(&hosts, 9000);
    let check = hosts[check].addr(9000).to_string();
    ConnectLb::start(hosts, |listen| {
        config(listen, &servers, &check, interval, limit)
    })
}

/// Root and a kernel with the getpeername (5.8) and sock_release (5.9) hooks; prints the skip
/// reason otherwise.
fn skip() -> bool {
    skip_unless_root() || skip_unless_kernel((5, 9), "cgroup getpeername4/6 and sock_release hooks")
}

/// TCP's protocol number, not its name: the guests have no `/etc/protocols` to look it up in.
const TCP: &str = "6";

/// Drops every packet `host` sends to client port `port` (a policy rule matching the
/// destination port with the blackhole action: the route lookup of the host's SYN-ACK fails, so
/// nothing answers that port, no reset, no ICMP), removed on drop. Incoming packets cannot be
/// matched this way: the `local` table's rule comes first.
struct DropFromPort<'a> {
    host: &'a Host,
    port: String,
}

impl<'a> DropFromPort<'a> {
    fn new(host: &'a Host, port: u16) -> Result<DropFromPort<'a>> {
        let port = port.to_string();
        host.exec_ok(
            "ip",
            &["rule", "add", "ipproto", TCP, "dport", &port, "blackhole"],
        )?;
        Ok(DropFromPort { host, port })
    }
}

impl Drop for DropFromPort<'_> {
    fn drop(&mut self) {
        let _ = self.host.exec_ok(
            "ip",
            &[
                "rule",
                "del",
                "ipproto",
                TCP,
                "dport",
                &self.port,
                "blackhole",
            ],
        );
    }
}

/// Wait until server `addr` has been checked `n` more times (its `last_check` moved `n` times),
/// so lb's loops and its passive-event reader (woken at least every 100 ms) have run since.
fn wait_checks(s: &ConnectLb, addr: &str, n: usize, within: Duration) -> Result<()> {
    let last = || -> Result<f64> {
        let st = s.lb.status()?;
        let servers = st["balancers"][0]["servers"]
            .as_array()
            .context("servers")?;
        Ok(servers
            .iter()
            .find(|v| v["address"] == addr)
            .and_then(|v| v["last_check"].as_f64())
            .unwrap_or(0.0))
    };
    let mut seen = last()?;
    let mut moved = 0;
    lb_tests::wait_until(within, || {
        let now = last()?;
        if now != seen {
            seen = now;
            moved += 1;
        }
        Ok(moved >= n)
    })
    .with_context(|| format!("{addr} checked {moved} of {n} times"))?;
    Ok(())
}

#[test]
fn connect_time_connects_their_client_gives_up_on_fail_no_server() -> Result<()> {
    if skip() {
        return Ok(());
    }
    const TRIES: u32 = 5;
    let s = start(0, "300ms", 1)?;
    let s0 = s.hosts[0].addr(9000).to_string();
    let h = Holder::start(&s.place(), s.listen, 0, 60_000)?;
    let ev = h.wait_for("connected", Duration::from_secs(10))?;
    ensure!(ev["server"] == "s0", "failover sends to s0 first: {ev}");

    // s0 drops everything from one client port only; its checks (from lb) keep passing.
    let port = free_port()?;
    let drop_port = DropFromPort::new(&s.hosts[0], port)?;
    let bind = format!("0.0.0.0:{port}");
    let tries = TRIES.to_string();
    let v = run_client(
        &s.place(),
        s.listen,
        &[
            "dial",
            "--bind",
            &bind,
            "--timeout-ms",
            "50",
            "--times",
            &tries,
        ],
        T,
    )?;
    eprintln!("{TRIES} connects from :{port} given up after 50 ms: {v}");
    ensure!(
        v["errnos"]["-1"] == TRIES,
        "every connect should time out on the client's side (to s0, which stays ACTIVE): {v}; s0 {:?}\n{}",
        s.status_of(&s0),
        s.lb.log_text()
    );
    drop(drop_port);
    // Two checks of s0 later, every event those connects caused has been read.
    wait_checks(&s, &s0, 2, Duration::from_secs(10))?;
    let (state, _) = s.status_of(&s0)?;
    let failed =
        s.lb.metric("lb_passive_events_total", "kind=\"connect_failed\"");
    let abandoned =
        s.lb.metric("lb_passive_events_total", "kind=\"connect_abandoned\"");
    eprintln!(
        "s0 {state}; passive events: {} connect_failed, {} connect_abandoned",
        failed + 0.0,
        abandoned + 0.0
    );
    ensure!(
        state == "ACTIVE",
        "s0 should stay ACTIVE: {state}\n{}",
        s.lb.log_text()
    );
    ensure!(
        failed == 0.0,
        "a connect its client gave up was the server's"
    );
    ensure!(
        h.next(Duration::from_millis(100)).is_err(),
        "the keep-alive client of s0 should not be killed"
    );
    ensure!(s.killed_total() == 0.0, "lb killed connections");
    Ok(())
}

#[test]
fn connect_time_a_burst_of_retransmission_timeouts_counts_once_per_interval() -> Result<()> {
    if skip() {
        return Ok(());
    }
    const SOCKETS: usize = 6;
    // Checks go to s1 only, every 30 s: nothing but the RTOs can fail s0. Two resets are one
    // failed check: with every RTO counted, the burst fails s0 at its second.
    let s = start(1, "30s", 2)?;
    let s0 = s.hosts[0].addr(9000).to_string();
    let clients = (0..SOCKETS)
        .map(|_| Holder::spawn(&s.place(), s.listen, &["rr", "1000000000", "64"]))
        .collect::<Result<Vec<_>>>()?;
    lb_tests::wait_until(Duration::from_secs(10), || {
        Ok(s.status_of(&s0)?.1 == SOCKETS as u64)
    })
    .with_context(|| format!("{SOCKETS} echo clients on s0: {:?}", s.status_of(&s0)))?;

    // One blip: every packet toward s0 vanishes until at least three sockets timed out (or
    // s0 failed).
    let rto = || s.lb.metric("lb_passive_events_total", "kind=\"rto\"");
    let t0 = Instant::now();
    s.hosts[0].blackhole(true)?;
    let seen = lb_tests::wait_until(Duration::from_secs(10), || {
        Ok(rto() >= 3.0 || s.status_of(&s0)?.0 == "FAILED")
    });
    s.hosts[0].blackhole(false)?;
    seen.with_context(|| format!("RTO events: {}\n{}", rto(), s.lb.log_text()))?;
    // The reader handles events in order: the third is counted only once the second was
    // weighed. Let it weigh the rest too.
    lb_tests::wait_until(Duration::from_secs(5), || Ok(rto() >= SOCKETS as f64)).ok();
    let (state, conns) = s.status_of(&s0)?;
    eprintln!(
        "{} RTO events within {:.3} s of the blip; s0 {state} with {conns} connections",
        rto(),
        t0.elapsed().as_secs_f64()
    );
    ensure!(
        state != "FAILED",
        "one blip failed s0: {state}\n{}",
        s.lb.log_text()
    );
    ensure!(s.killed_total() == 0.0, "lb killed connections");
    drop(clients);
    Ok(())
}

#[test]
fn connect_time_connects_failing_before_their_syn_leave_no_record() -> Result<()> {
    if skip() {
        return Ok(());
    }
    const TRIES: u32 = 200;
    let s = start(0, "1s", 10)?;
    let before = s.lb_connect_socks()?;
    // Bound to loopback, rewritten to a 198.18 server: the route lookup refuses it (EINVAL)
    // before the sockops program sees a connect.
    let tries = TRIES.to_string();
    let v = run_client(
        &s.place(),
        s.listen,
        &["dial", "--bind", "127.0.0.1:0", "--times", &tries],
        T,
    )?;
    eprintln!("{TRIES} connects bound to 127.0.0.1: {v}; LB_CONNECT_SOCKS held {before}");
    ensure!(
        v["errnos"]["22"] == TRIES,
        "every connect should fail with EINVAL: {v}"
    );
    let after = s.lb_connect_socks()?;
    ensure!(
        after == before,
        "LB_CONNECT_SOCKS grew from {before} to {after} entries"
    );
    // A connect that works is still recorded while it is open, and forgotten once closed.
    let h = Holder::start(&s.place(), s.listen, 0, 60_000)?;
    h.wait_for("connected", Duration::from_secs(10))?;
    ensure!(
        s.lb_connect_socks()? == before + 1,
        "the open socket has a record"
    );
    drop(h);
    lb_tests::wait_until(Duration::from_secs(5), || {
        Ok(s.lb_connect_socks()? == before)
    })
    .context("the closed socket's record stays")?;
    Ok(())
}

/// A socket whose connect through the listener failed before its SYN (bound to loopback,
/// rewritten to s0: EINVAL) and that then connects elsewhere (a loopback server of the test's
/// own): nothing of that connection is charged to s0, neither a count nor a failure.
#[test]
fn connect_time_a_socket_reconnected_elsewhere_is_not_charged_to_the_server() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let s = start(0, "1s", 10)?;
    let s0 = s.hosts[0].addr(9000).to_string();
    let other = std::net::TcpListener::bind("127.0.0.1:0")?;
    let then = other.local_addr()?.to_string();
    let accepting = std::thread::spawn(move || -> Result<()> {
        let (mut conn, _) = other.accept()?;
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(&conn), &mut line)?;
        std::io::Write::write_all(&mut conn, b"elsewhere\n")?;
        // Held until the client closes.
        let _ = std::io::Read::read(&mut conn, &mut [0u8; 1]);
        Ok(())
    });
    let h = Holder::spawn(
        &s.place(),
        s.listen,
        &[
            "retry",
            "--bind",
            "127.0.0.1:0",
            "--then",
            &then,
            "--hold-ms",
            "3000",
        ],
    )?;
    let ev = h.wait_for("connected", Duration::from_secs(10))?;
    ensure!(
        ev["first_errno"] == 22 && ev["server"] == "elsewhere",
        "the first connect should fail with EINVAL, the second reach the test's server: {ev}"
    );
    let (state, connections) = s.status_of(&s0)?;
    ensure!(
        connections == 0,
        "{s0} counts {connections} connection(s) while the socket is connected elsewhere"
    );
    drop(h);
    accepting
        .join()
        .map_err(|_| anyhow::anyhow!("the test's server panicked"))??;
    ensure!(state != "FAILED", "{s0} is {state}");
    let failures = s.lb.metric("lb_passive_events_total", "");
    ensure!(failures == 0.0, "passive events: {failures}");
    Ok(())
}

#[test]
fn connect_time_counts_of_servers_that_left_are_deleted() -> Result<()> {
    if skip() {
        return Ok(());
    }
    const SERVERS: u16 = 12;
    let mut host = Host::new()?;
    for i in 0..SERVERS {
        host.serve(9100 + i, &format!("p{i}"))?;
    }
    let first = host.addr(9100).to_string();
    let servers = format!("\"{first}\"");
    let s = ConnectLb::start(vec![host], |listen| {
        config(listen, &servers, &first, "200ms", 10)
    })?;
    // Discovery churn: the set is one server at a time, each dialed once (its count key is
    // made when the connect is established, and its count is back at 0 once it closed).
    for i in 0..SERVERS {
        let addr = s.hosts[0].addr(9100 + i).to_string();
        let out = std::process::Command::new(lb_tests::lb_bin())
            .args(["servers", "set", "--balancer", "api", &addr])
            .args(["--admin", &s.lb.admin.to_string()])
            .output()?;
        ensure!(out.status.success(), "lb servers set {addr}: {out:?}");
        let name = format!("p{i}");
        lb_tests::wait_until(Duration::from_secs(5), || {
            let v = run_client(&s.place(), s.listen, &["dial"], T)?;
            Ok(v["ok"] == true && v["server"] == name.as_str())
        })
        .with_context(|| format!("no connect reached {addr}\n{}", s.lb.log_text()))?;
    }
    let counts = || s.map_entries("LB_CONNECT_COUNTS");
    let left = lb_tests::wait_until(Duration::from_secs(5), || Ok(counts()? <= 1));
    eprintln!(
        "after {SERVERS} servers one at a time, LB_CONNECT_COUNTS holds {} keys",
        counts()?
    );
    left.with_context(|| {
        format!(
            "{} count keys left: {}",
            counts().unwrap_or(0),
            s.map_dump("LB_CONNECT_COUNTS").unwrap_or_default()
        ) + &s.lb.log_text()
    })?;
    Ok(())
}

#[test]
fn connect_time_keeps_another_sockops_programs_flags() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let s = start(0, "1s", 10)?;
    // Another tool's sockops program in a child cgroup: it runs before lb's on the same
    // callbacks and asks for RTT callbacks, which it counts.
    let child = s.cg.child("other-sockops")?;
    let rtt = child.count_rtt_callbacks()?;
    // 50 echo round trips of a connect-time connection: each acknowledged send is an RTT
    // sample, so the other program gets about 50 callbacks unless lb took its flag away.
    const ROUND_TRIPS: u64 = 50;
    let v = run_client(
        &Place::cgroup(&child.path),
        s.listen,
        &["rr", &ROUND_TRIPS.to_string(), "64"],
        T,
    )?;
    ensure!(v["ok"] == true, "echo client: {v}");
    ensure!(
        s.lb.metric("lb_connections_total", "") == 0.0,
        "the echo client should go straight to a server, not through lb's listener"
    );
    let n = rtt.count()?;
    eprintln!("the other program saw {n} RTT callbacks over {ROUND_TRIPS} round trips");
    ensure!(
        n >= ROUND_TRIPS / 2,
        "lb cleared the other sockops program's flags: {n} RTT callbacks"
    );
    Ok(())
}

/// What these tests read from lb.
trait Read {
    /// `lb_connections_killed_total`, every reason.
    fn killed_total(&self) -> f64;
    /// Entries in `LB_CONNECT_SOCKS`.
    fn lb_connect_socks(&self) -> Result<usize>;
}

impl Read for ConnectLb {
    fn killed_total(&self) -> f64 {
        self.lb.metric("lb_connections_killed_total", "")
    }

    fn lb_connect_socks(&self) -> Result<usize> {
        self.map_entries("LB_CONNECT_SOCKS")
    }
}

/// While no server is usable (both disabled), the connect programs leave connects to the
/// listener as they were and count each as `no_servers`, in `/status`, the metrics and `lb
/// status`; once a server is back they rewrite again and the count stays.
#[test]
fn connect_time_connects_without_a_usable_server_are_counted_unrewritten() -> Result<()> {
    if skip() {
        return Ok(());
    }
    const TRIES: u32 = 3;
    let s = start(0, "300ms", 1)?;
    let unrewritten = |reason: &str| -> Result<u64> {
        let b = s.lb.balancer("api")?;
        b["kernel"]["unrewritten_connects"][reason]
            .as_u64()
            .with_context(|| format!("no kernel counters in /status: {b}"))
    };
    ensure!(
        unrewritten("no_servers")? == 0,
        "counted before any connect"
    );
    let servers: Vec<String> = (0..2).map(|i| s.hosts[i].addr(9000).to_string()).collect();
    for addr in &servers {
        s.lb.cli(&["servers", "--balancer", "api", "disable", addr])?;
    }
    lb_tests::wait_until(Duration::from_secs(10), || {
        Ok(s.lb.balancer("api")?["connect_table"]["servers"]
            .as_array()
            .is_none_or(Vec::is_empty))
    })
    .context("the connect table should empty")?;
    let tries = TRIES.to_string();
    let v = run_client(&s.place(), s.listen, &["dial", "--times", &tries], T)?;
    eprintln!("{TRIES} connects with every server disabled: {v}");
    ensure!(
        unrewritten("no_servers")? == u64::from(TRIES),
        "no_servers {} after {TRIES} connects: {}",
        unrewritten("no_servers")?,
        s.lb.balancer("api")?
    );
    let metric =
        s.lb.metric("lb_connect_unrewritten_total", "reason=\"no_servers\"");
    ensure!(
        metric == f64::from(TRIES),
        "lb_connect_unrewritten_total {metric}"
    );
    let text = s.lb.cli(&["status"])?;
    ensure!(
        text.contains("connects not rewritten no_servers 3"),
        "lb status: {text}"
    );
    s.lb.cli(&["servers", "--balancer", "api", "enable", &servers[0]])?;
    lb_tests::wait_until(Duration::from_secs(10), || {
        let ev = run_client(&s.place(), s.listen, &["peer"], T)?;
        Ok(ev["ok"] == true && ev["server"] == "s0" && ev["server_sees"] == ev["local"])
    })
    .context("connects should be rewritten to s0 again")?;
    ensure!(
        unrewritten("no_servers")? == u64::from(TRIES),
        "counted a rewritten connect"
    );
    for reason in ["orphaned", "family", "record_map"] {
        ensure!(unrewritten(reason)? == 0, "{reason} counted");
    }
    Ok(())
}
