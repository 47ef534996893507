//! The kernel splice (sk_msg redirecting client sends to the server socket): nothing lost or
//! reordered, bounded buffering with real backpressure, IPv6, clients in other namespaces and
//! child cgroups, clean restarts.

use std::{
    process::Stdio,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use lb_tests::{
    Host, Lb, Place, TestCgroup, client_command, free_port, run_client, sh, skip_unless_root,
};
use serde_json::Value;

const MIB: u64 = 1024 * 1024;
const T: Duration = Duration::from_secs(180);

fn ok(v: &Value) -> Result<()> {
    ensure!(v["ok"] == true, "client failed: {v}");
    Ok(())
}

/// A test cgroup, one server and lb in bpf mode listening on `ip` (a free port).
struct Fixture {
    cg: TestCgroup,
    host: Host,
    lb: Lb,
    listen: String,
}

impl Fixture {
    fn new(ip: &str) -> Result<Fixture> {
        Fixture::with_args(ip, &[])
    }

    /// As [`Fixture::new`], with more `lb run` arguments.
    fn with_args(ip: &str, extra: &[&str]) -> Result<Fixture> {
        let cg = TestCgroup::new()?;
        let listen = format!("{ip}:{}", free_port()?);
        let (host, lb) = one_server(&cg, &listen, extra)?;
        Ok(Fixture {
            cg,
            host,
            lb,
            listen,
        })
    }

    /// Clients run in the fixture's cgroup.
    fn place(&self) -> Place<'_> {
        Place::cgroup(&self.cg.path)
    }
}

/// One host serving on :9000, lb in bpf mode listening on `listen`, attached to `cg`.
fn one_server(cg: &TestCgroup, listen: &str, extra: &[&str]) -> Result<(Host, Lb)> {
    let mut h = Host::new()?;
    h.serve(9000, "s0")?;
    let server = h.addr(9000).to_string();
    let cgp = cg.path.display().to_string();
    let mut args = vec![
        "--listen",
        listen,
        "--server",
        &server,
        "--datapath",
        "bpf",
        "--cgroup",
        &cgp,
        "--forwarding",
        "splice",
    ];
    args.extend_from_slice(extra);
    let lb = Lb::start(&args)?;
    Ok((h, lb))
}

#[test]
fn one_gib_each_way_on_one_connection() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let f = Fixture::new("127.0.0.1")?;
    let (listen, place, _h, lb) = (f.listen.clone(), f.place(), &f.host, &f.lb);
    let gib = (1024 * MIB).to_string();
    // The pause lets lb pair the connection before the data (README, "The counting rule").
    ok(&run_client(
        &place,
        listen.parse()?,
        &["up", &gib, "--pause-ms", "200"],
        T,
    )?)?;
    ok(&run_client(&place, listen.parse()?, &["down", &gib], T)?)?;
    let spliced = lb.metric("lb_spliced_bytes_total", "client_to_server");
    let copied = lb.metric("lb_copied_bytes_total", "client_to_server");
    // Protocol headers: "UP\n" and "DOWN <n> 7\n".
    let sent = 1024 * MIB + 3 + format!("DOWN {gib} 7\n").len() as u64;
    ensure!(
        spliced + copied == sent as f64,
        "spliced {spliced} + copied {copied} != {sent} sent"
    );
    ensure!(spliced > 0.0, "nothing spliced");
    Ok(())
}

#[test]
fn hundred_concurrent_random_sizes() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let f = Fixture::new("127.0.0.1")?;
    let (listen, place, _h, lb) = (f.listen.clone(), f.place(), &f.host, &f.lb);
    let v = run_client(
        &place,
        listen.parse()?,
        // Each waits 200 ms before its data, as the namespace and IPv6 tests do: with 100
        // connections arriving at once on a loaded machine, data sent before lb pairs its
        // connection stays on the copy path until lb has caught up with it, and a client that
        // keeps sending may never let it (seen: 0 bytes spliced in 2 of 8 runs).
        &[
            "many",
            "100",
            &(8 * MIB).to_string(),
            "--random",
            "--pause-ms",
            "200",
        ],
        T,
    )?;
    ok(&v)?;
    ensure!(
        lb.metric("lb_spliced_bytes_total", "client_to_server") > 0.0,
        "nothing spliced: {}\n{}",
        lb.get("/metrics").map(|r| r.1).unwrap_or_default(),
        lb.log_text()
    );
    Ok(())
}

/// Largest Send-Q of lb's sockets toward `server` (bytes), from `ss`.
fn send_q_toward(server: &str) -> u64 {
    let out = sh("ss", &["-Htn", "dst", server]).unwrap_or_default();
    out.lines()
        .filter_map(|l| l.split_whitespace().nth(2)?.parse::<u64>().ok())
        .max()
        .unwrap_or(0)
}

/// Sample the largest queue toward `h`'s server for `sample_ms` while a stalled upload is held
/// back, then wait (at most 60 s) for the client to finish; returns the largest queue (bytes)
/// and the client's last JSON line.
fn watch_held_back(
    mut child: std::process::Child,
    h: &Host,
    sample_ms: u64,
) -> Result<(u64, Value)> {
    let start = Instant::now();
    let mut max_q = 0;
    while start.elapsed() < Duration::from_millis(sample_ms) {
        max_q = max_q.max(send_q_toward(&h.addr(9000).to_string()));
        std::thread::sleep(Duration::from_millis(50));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait()?.is_none() {
        ensure!(
            Instant::now() < deadline,
            "the client did not finish after the server resumed reading"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output()?;
    let v = serde_json::from_str(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()
            .context("no output")?,
    )?;
    Ok((max_q, v))
}

/// Upload 64 MiB from an epoll client to a server that stops reading for 3 s after
/// `stall_after` bytes; check the client's CPU while held back, the queue toward the server, and
/// that it was never redirected into the full server socket. Returns the lb it ran against.
fn epoll_client_held_back(stall_after: u64) -> Result<Fixture> {
    // Stalling mid-upload: start the data after lb paired the connection, so it is spliced.
    let pause = if stall_after > 0 { "1000" } else { "0" };
    let f = Fixture::new("127.0.0.1")?;
    let (listen, place, h, lb) = (f.listen.clone(), f.place(), &f.host, &f.lb);
    let stall_ms = 3000u64;
    let child = client_command(
        &place,
        listen.parse()?,
        &[
            "epoll-up",
            &(64 * MIB).to_string(),
            "--stall-ms",
            &stall_ms.to_string(),
            "--stall-after",
            &stall_after.to_string(),
            "--pause-ms",
            pause,
        ],
    )
    .stdout(Stdio::piped())
    .spawn()?;
    let (max_q, v) = watch_held_back(child, h, stall_ms - 300)?;
    ok(&v)?;
    let cpu = v["stall_cpu_s"].as_f64().context("stall_cpu_s")?;
    let wall = v["stall_wall_s"].as_f64().context("stall_wall_s")?;
    ensure!(
        cpu / wall < 0.05,
        "the held-back epoll client burned {:.1}% of a core",
        100.0 * cpu / wall
    );
    ensure!(
        max_q > 0,
        "saw no queue toward the stalled server (sampling broken?)"
    );
    ensure!(
        max_q <= 4 * MIB,
        "queued {max_q} bytes toward the stalled server, bound is {}",
        4 * MIB
    );
    // A non-blocking client must never be redirected into a full server socket.
    let waits = lb.metric("lb_splice_blocking_redirects_total", "");
    ensure!(
        waits == 0.0,
        "{waits} sends of an epoll client were redirected without credit"
    );
    eprintln!(
        "held back (stall after {stall_after} bytes): client CPU {:.2}% of a core, largest \
         queue toward server {max_q} bytes",
        100.0 * cpu / wall
    );
    Ok(f)
}

#[test]
fn stalled_server_holds_back_an_epoll_client_within_the_bound() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    // Stalled from the first byte: the client never catches the splice; the copy path's TCP
    // flow control holds it.
    epoll_client_held_back(0)?;
    Ok(())
}

#[test]
fn stall_mid_splice_sends_an_epoll_client_to_the_copy_path() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    // Stalled after 16 MiB, while spliced: the credit runs out and its sends take the copy path.
    let f = epoll_client_held_back(16 * MIB)?;
    ensure!(
        f.lb.metric("lb_splice_fallbacks_total", "credit") > 0.0,
        "the epoll client never ran out of credit"
    );
    ensure!(
        f.lb.metric("lb_spliced_bytes_total", "client_to_server") > 0.0,
        "nothing was spliced before the stall"
    );
    Ok(())
}

#[test]
fn stalled_server_makes_a_blocking_client_wait_in_the_kernel() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let f = Fixture::new("127.0.0.1")?;
    let (listen, place, h, lb) = (f.listen.clone(), f.place(), &f.host, &f.lb);
    let stall_ms = 2000u64;
    let n = 64 * MIB;
    let after = 16 * MIB;
    // The server stops reading after 16 MiB, while the connection is spliced.
    let child = client_command(
        &place,
        listen.parse()?,
        &[
            "up",
            &n.to_string(),
            "--stall-ms",
            &stall_ms.to_string(),
            "--stall-after",
            &after.to_string(),
            "--pause-ms",
            "1000",
        ],
    )
    .stdout(Stdio::piped())
    .spawn()?;
    // The client pauses 1 s before its data, then the server reads 16 MiB and stalls.
    let (max_q, v) = watch_held_back(child, h, 1000 + stall_ms - 300)?;
    // The client checks the server's byte count and digest of everything it sent.
    ok(&v)?;
    ensure!(
        max_q > 0 && max_q <= 4 * MIB,
        "queue toward the stalled server peaked at {max_q} bytes; bound is {}",
        4 * MIB
    );
    let waits = lb.metric("lb_splice_blocking_redirects_total", "");
    ensure!(
        waits > 0.0,
        "the blocking client was never redirected into the full server socket"
    );
    let spliced = lb.metric("lb_spliced_bytes_total", "client_to_server");
    let copied = lb.metric("lb_copied_bytes_total", "client_to_server");
    let sent = n + format!("STALL {stall_ms} {after}\n").len() as u64;
    ensure!(
        spliced + copied == sent as f64,
        "spliced {spliced} + copied {copied} != {sent} sent"
    );
    eprintln!(
        "blocking client held back by the kernel: {waits} waits, largest queue {max_q} bytes, \
         spliced {spliced} of {sent} bytes"
    );
    Ok(())
}

#[test]
fn ipv6_listener_splices() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let f = Fixture::new("[::1]")?;
    let (listen, place, _h, lb) = (f.listen.clone(), f.place(), &f.host, &f.lb);
    ok(&run_client(
        &place,
        listen.parse()?,
        &["up", &(64 * MIB).to_string(), "--pause-ms", "300"],
        T,
    )?)?;
    ok(&run_client(
        &place,
        listen.parse()?,
        &["down", &(16 * MIB).to_string()],
        T,
    )?)?;
    ensure!(
        lb.metric("lb_spliced_bytes_total", "client_to_server") > 0.0,
        "IPv6 client was not spliced"
    );
    Ok(())
}

#[test]
fn client_in_another_namespace_and_child_cgroup() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let cg = TestCgroup::new()?;
    let child = cg.child("pods")?;
    let client_ns = Host::new()?;
    // lb listens on the root side of the client namespace's link; a client of another
    // namespace is spliced only with the opt-in.
    let listen = format!("{}:{}", client_ns.gateway, free_port()?);
    let (_h, lb) = one_server(&cg, &listen, &["--namespaces", "all"])?;
    let place = Place {
        cgroup: Some(&child.path),
        netns: Some(&client_ns.ns),
    };
    ok(&run_client(
        &place,
        listen.parse()?,
        // The pause lets lb pair the connection before the data: this test is about keys
        // across namespaces and cgroups, not about a sender racing the pairing.
        &["up", &(32 * MIB).to_string(), "--pause-ms", "300"],
        T,
    )?)?;
    ok(&run_client(
        &place,
        listen.parse()?,
        &["many", "20", &MIB.to_string(), "--random"],
        T,
    )?)?;
    let spliced = lb.metric("lb_spliced_bytes_total", "client_to_server");
    ensure!(
        spliced > 0.0,
        "client in another namespace / child cgroup was not spliced"
    );
    // A client in the root namespace and the child cgroup as well.
    let local = Place::cgroup(&child.path);
    ok(&run_client(
        &local,
        listen.parse()?,
        &["up", &(8 * MIB).to_string()],
        T,
    )?)?;
    Ok(())
}

fn sockops_on(cg: &TestCgroup) -> usize {
    lb_tests::cgroup_programs(&cg.path)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("sock_ops"))
        .count()
}

#[test]
fn restart_leaves_no_duplicate_programs() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let cg = TestCgroup::new()?;
    let listen = format!("127.0.0.1:{}", free_port()?);
    let (_h, mut lb) = one_server(&cg, &listen, &[])?;
    ensure!(
        sockops_on(&cg) == 1,
        "expected one sockops program while running"
    );
    lb.terminate(Duration::from_secs(35))?;
    ensure!(sockops_on(&cg) == 0, "program left after SIGTERM");
    let (_h2, lb2) = one_server(&cg, &listen, &[])?;
    ensure!(
        sockops_on(&cg) == 1,
        "expected exactly one sockops program after restart"
    );
    // SIGKILL: the link dies with the process.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(lb2.pid())?),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while sockops_on(&cg) != 0 {
        ensure!(Instant::now() < deadline, "program left after SIGKILL");
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(lb2);
    let (_h3, _lb3) = one_server(&cg, &listen, &[])?;
    ensure!(
        sockops_on(&cg) == 1,
        "expected exactly one sockops program after SIGKILL and restart"
    );
    Ok(())
}

/// How a test ends a blocking client's connection while it sleeps in a redirected send.
#[derive(Clone, Copy, Debug)]
enum Ending {
    /// `POST /balancers/default/servers/ADDR/kill`.
    Kill,
    /// SIGKILL to lb itself.
    LbDies,
}

/// Put a blocking client to sleep in a redirected send (the server stalls after 16 MiB), end it
/// as `how` says, and check that the client returns an error within 5 s.
fn blocking_client_released(how: Ending) -> Result<()> {
    let f = Fixture::new("127.0.0.1")?;
    let (listen, place, h, lb) = (f.listen.clone(), f.place(), &f.host, &f.lb);
    let mut child = client_command(
        &place,
        listen.parse()?,
        &[
            "up",
            &(256 * MIB).to_string(),
            "--stall-ms",
            "30000",
            "--stall-after",
            &(16 * MIB).to_string(),
            "--pause-ms",
            "1000",
        ],
    )
    .stdout(Stdio::piped())
    .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while lb.metric("lb_splice_blocking_redirects_total", "") == 0.0 {
        ensure!(
            Instant::now() < deadline,
            "the blocking client never waited in the kernel"
        );
        ensure!(child.try_wait()?.is_none(), "client ended early");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Let it fall asleep on the full server socket.
    std::thread::sleep(Duration::from_millis(300));
    match how {
        Ending::Kill => {
            let server = h.addr(9000).to_string();
            let (code, body) = lb_tests::http_request(
                lb.admin,
                "POST",
                &format!("/balancers/default/servers/{server}/kill"),
                None,
            )?;
            ensure!(code == 200, "kill answered {code}: {body}");
        }
        Ending::LbDies => {
            let pid = nix::unistd::Pid::from_raw(i32::try_from(lb.pid())?);
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL)?;
        }
    }
    let ended = Instant::now();
    while child.try_wait()?.is_none() {
        if ended.elapsed() > Duration::from_secs(5) {
            let _ = child.kill();
            anyhow::bail!("the client still hangs 5 s after {how:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let released = ended.elapsed();
    let out = child.wait_with_output()?;
    let v: Value = serde_json::from_str(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()
            .context("no output")?,
    )?;
    ensure!(v["ok"] == false, "a cut upload reported success: {v}");
    eprintln!("blocking client released {released:?} after {how:?}: {v}");
    Ok(())
}

#[test]
fn kill_releases_a_blocking_client_waiting_in_the_kernel() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    blocking_client_released(Ending::Kill)
}

#[test]
fn lb_dying_releases_a_blocking_client_waiting_in_the_kernel() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    blocking_client_released(Ending::LbDies)
}

#[test]
fn blocking_splice_off_sends_a_blocking_client_to_the_copy_path() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let conf = std::env::temp_dir().join(format!("lb-splice-off-{}.toml", std::process::id()));
    std::fs::write(&conf, "[datapath]\nblocking_splice = false\n")?;
    let conf_arg = conf.display().to_string();
    let f = Fixture::with_args("127.0.0.1", &["--config", &conf_arg]);
    let _ = std::fs::remove_file(&conf);
    let f = f?;
    let (listen, place, lb) = (f.listen.clone(), f.place(), &f.lb);
    let v = run_client(
        &place,
        listen.parse()?,
        &[
            "up",
            &(64 * MIB).to_string(),
            "--stall-ms",
            "1000",
            "--stall-after",
            &(16 * MIB).to_string(),
            "--pause-ms",
            "1000",
        ],
        T,
    )?;
    ok(&v)?;
    let waits = lb.metric("lb_splice_blocking_redirects_total", "");
    ensure!(
        waits == 0.0,
        "{waits} past-credit redirects with blocking_splice off"
    );
    ensure!(
        lb.metric("lb_splice_fallbacks_total", "credit") > 0.0,
        "the blocking client never ran out of credit"
    );
    Ok(())
}

/// A kill resets the clients of a thousand proxied connections in the kernel (`SOCK_DESTROY`
/// of lb's accepted sockets, a batch per system call) before their tasks run: every client
/// sees a reset, none a clean close, and lb's log says how many the kernel reset.
#[test]
fn kill_resets_a_thousand_clients_in_the_kernel() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    const MANY: u64 = 1000;
    let f = Fixture::new("127.0.0.1")?;
    let idle = lb_tests::Holder::spawn(
        &f.place(),
        f.listen.parse()?,
        &["idle", &MANY.to_string(), "--max-ms", "120000"],
    )?;
    idle.wait_for("ready", Duration::from_secs(60))
        .with_context(|| f.lb.log_text())?;
    lb_tests::wait_until(Duration::from_secs(10), || {
        Ok(f.lb.status()?["balancers"][0]["servers"][0]["connections"] == MANY)
    })
    .with_context(|| format!("lb should hold {MANY} connections: {:?}", f.lb.status()))?;
    let server = f.host.addr(9000).to_string();
    let t = Instant::now();
    let (code, body) = lb_tests::http_request(
        f.lb.admin,
        "POST",
        &format!("/balancers/default/servers/{server}/kill"),
        None,
    )?;
    ensure!(code == 200, "kill answered {code}: {body}");
    let done = idle.wait_for("all_closed", Duration::from_secs(30))?;
    eprintln!(
        "kill of {MANY} proxied connections: all closed after {:.3} s: {done}",
        t.elapsed().as_secs_f64()
    );
    ensure!(done["ok"] == true, "{done}");
    ensure!(
        done["resets"] == MANY,
        "every client should see a reset: {done}"
    );
    let log = f.lb.log_text();
    ensure!(
        log.contains(&format!("reset_in_kernel={MANY}")),
        "lb should say the kernel reset all {MANY} clients:\n{log}"
    );
    Ok(())
}

/// Clients that made one request each and closed (never paired), and one upload that was
/// spliced, leave nothing in `LB_FLOWS` or `LB_NETNS`: the sockops program removes a client's
/// entries when its socket closes, with no system call from lb.
#[test]
fn closed_clients_leave_no_flow_or_namespace_entries() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let f = Fixture::new("127.0.0.1")?;
    let addr = f.listen.parse()?;
    let cps = run_client(&f.place(), addr, &["cps", "300"], T)?;
    ok(&cps)?;
    let conns = cps["conns"].as_u64().context("conns")?;
    ensure!(conns > 0, "no connection was made: {cps}");
    let up = run_client(
        &f.place(),
        addr,
        &["up", &(8 * MIB).to_string(), "--pause-ms", "200"],
        T,
    )?;
    ok(&up)?;
    ensure!(
        f.lb.metric("lb_spliced_bytes_total", "client_to_server") > 0.0,
        "the upload was not spliced"
    );
    let pid = f.lb.pid();
    let mut left = (usize::MAX, usize::MAX);
    lb_tests::wait_until(Duration::from_secs(10), || {
        left = (
            lb_tests::lb_map_entries(pid, "LB_FLOWS")?,
            lb_tests::lb_map_entries(pid, "LB_NETNS")?,
        );
        Ok(left == (0, 0))
    })
    .with_context(|| {
        format!("after {conns} one-request connections and an upload, LB_FLOWS and LB_NETNS still hold {left:?} entries")
    })?;
    eprintln!(
        "{conns} one-request connections and a spliced upload left no flow or namespace entry"
    );
    Ok(())
}
