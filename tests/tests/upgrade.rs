//! `lb upgrade`: a running lb hands its listeners, connections (with the bytes it holds for
//! them), kernel data path and balancer states to a new lb started from the binary at its path,
//! on real traffic: servers on test hosts in network namespaces, clients in a child cgroup
//! (spliced by the kernel) and outside it (copied by lb), lb started from a copy of its binary
//! in a directory of the test's own, so the test can replace that binary as a package upgrade
//! would (a new file renamed over the old one).

use std::{
    net::SocketAddr,
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use lb_tests::{
    Fixture, Holder, Place, TestCgroup, UpLb, free_port, http_get, lb_bin, output_within,
    run_client, skip_unless_root, timed,
};
use serde_json::Value;

const MIB: u64 = 1024 * 1024;
/// Bound on any one client.
const T: Duration = Duration::from_secs(240);

/// `n` on the host; a sixteenth of it in a TCG guest, which moves bytes many times slower.
fn scaled(n: u64) -> String {
    if timed() { n } else { (n / 16).max(1) }.to_string()
}

/// Two hosts serving on port 9000, lb listening on a free loopback port with the bpf data path
/// attached to a child cgroup, splice forwarding unless `extra` names another.
fn setup(extra: &[&str], env: &[(&str, &str)]) -> Result<Fixture<UpLb>> {
    let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    let servers: Vec<String> = hosts.iter().map(|h| h.addr(9000).to_string()).collect();
    let mut args = vec![
        "--listen",
        "{listen}",
        "--datapath",
        "bpf",
        "--cgroup",
        "{cgroup}",
    ];
    if !extra.contains(&"--forwarding") {
        args.extend(["--forwarding", "splice"]);
    }
    for server in &servers {
        args.extend(["--server", server.as_str()]);
    }
    args.extend_from_slice(extra);
    Fixture::upgradable(hosts, 9000, &args, env)
}

/// Inside the cgroup (spliced) or outside (copied by lb).
fn place(s: &Fixture<UpLb>, spliced: bool) -> Place<'_> {
    if spliced { s.place() } else { Place::default() }
}

/// Start `action` as a client in a thread; join for its JSON result.
fn spawn(
    s: &Fixture<UpLb>,
    spliced: bool,
    action: &[&str],
) -> std::thread::JoinHandle<Result<Value>> {
    let cg = s.cg.path.clone();
    let listen = s.listen;
    let action: Vec<String> = action.iter().map(ToString::to_string).collect();
    std::thread::spawn(move || {
        let place = if spliced {
            Place::cgroup(&cg)
        } else {
            Place::default()
        };
        let a: Vec<&str> = action.iter().map(String::as_str).collect();
        run_client(&place, listen, &a, T)
    })
}

fn join_ok(name: &str, h: std::thread::JoinHandle<Result<Value>>) -> Result<Value> {
    let v = h
        .join()
        .map_err(|_| anyhow::anyhow!("{name}: client thread panicked"))??;
    ensure!(v["ok"] == true, "{name} failed: {v}");
    Ok(v)
}

/// Wait until lb counts at least `n` connections.
fn wait_conns(lb: &UpLb, n: u64, within: Duration) -> Result<()> {
    lb_tests::wait_until(within, || {
        Ok(lb.servers()?.iter().map(|s| s.2).sum::<u64>() >= n)
    })
    .with_context(|| format!("lb never had {n} connections: {:?}", lb.servers()))?;
    Ok(())
}

/// Wait until lb has accepted `n` connections in all (`lb_connections_total`, which goes on
/// across upgrades).
fn wait_accepted(lb: &UpLb, n: f64) -> Result<()> {
    lb_tests::wait_until(T, || Ok(lb.metric("lb_connections_total", "") >= n)).with_context(
        || {
            format!(
                "lb never accepted {n} connections: {}",
                lb.metric("lb_connections_total", "")
            )
        },
    )?;
    Ok(())
}

/// 100 connections streaming both ways (round trips, bulk each way, two against a stalled
/// server with bytes held for it, holders), half spliced by the kernel and half copied by lb,
/// stay connected and byte-exact across two upgrades in a row; then, with only the holders left,
/// `lb status` shows the same states and connection counts after a third, and the counters go
/// on from where they were.
#[test]
fn upgrade_keeps_every_connection() -> Result<()> {
    if skip_unless_root() || lb_tests::splice_fallback_asserted()? {
        return Ok(());
    }
    let mut s = setup(&[], &[])?;
    s.lb.wait_settled()?;
    let mut streams = Vec::new();
    // 80 echo streams: every byte goes both ways and is compared. Under TCG a round trip
    // takes some 70 times longer (and the holders below start slower too).
    let rr_count = if timed() { "3000" } else { "200" };
    for i in 0..80 {
        streams.push((
            format!("rr{i}"),
            spawn(&s, i % 2 == 0, &["rr", rr_count, "4096"]),
        ));
    }
    // Bulk each way, spliced and copied.
    let bulk = scaled(256 * MIB);
    for spliced in [true, false] {
        streams.push((
            "up".into(),
            spawn(&s, spliced, &["up", &bulk, "--pause-ms", "200"]),
        ));
        streams.push(("down".into(), spawn(&s, spliced, &["down", &bulk])));
    }
    // A stalled server: lb (copy path) or the kernel (splice) holds bytes for it while the
    // upgrades happen; every byte must still arrive once it reads again.
    let stalled = scaled(48 * MIB);
    for spliced in [true, false] {
        streams.push((
            "stalled".into(),
            spawn(
                &s,
                spliced,
                &["up", &stalled, "--stall-ms", "4000", "--pause-ms", "200"],
            ),
        ));
    }
    let mut holders = Vec::new();
    for i in 0..14 {
        let h = Holder::start(&place(&s, i % 2 == 0), s.listen, 0, 600_000)?;
        h.wait_for("connected", Duration::from_secs(30))?;
        holders.push(h);
    }
    wait_conns(&s.lb, 60, Duration::from_secs(30))?;
    let before = s.lb.servers()?;
    println!("before the upgrades: {before:?}");
    let spliced_before = s.lb.metric("lb_spliced_connections", "");
    ensure!(spliced_before > 0.0, "nothing spliced: {}", s.lb.log_text());
    let u1 = s.lb.upgrade_ok()?;
    // In a TCG guest the shorter echo streams may be done before the upgrade starts; the 14
    // holders, the bulk and the stalled streams are still there.
    let handed_min = if timed() { 60 } else { 30 };
    ensure!(
        u1["connections"].as_u64().unwrap_or(0) >= handed_min,
        "few connections handed over: {u1}"
    );
    std::thread::sleep(Duration::from_millis(500));
    let u2 = s.lb.upgrade_ok()?;
    ensure!(
        u2["connections"].as_u64().unwrap_or(0) >= 14,
        "few connections handed over: {u2}"
    );
    for (name, h) in streams {
        join_ok(&name, h).with_context(|| s.lb.log_text())?;
    }
    for h in &holders {
        if let Ok(ev) = h.next(Duration::from_millis(10)) {
            bail!("a held connection saw {ev} across the upgrades");
        }
    }
    // Only the holders are left: states, counts and counters survive a third upgrade.
    wait_conns(&s.lb, 14, Duration::from_secs(5))?;
    let before = s.lb.servers()?;
    let accepted = s.lb.metric("lb_connections_total", "");
    let copied = s.lb.metric("lb_copied_bytes_total", "");
    let spliced = s.lb.metric("lb_spliced_bytes_total", "");
    let checks = s.lb.metric("lb_health_checks_total", "");
    ensure!(
        accepted >= 100.0,
        "lb_connections_total {accepted} after 100 connections"
    );
    s.lb.upgrade_ok()?;
    let after = s.lb.servers()?;
    ensure!(
        before == after,
        "status changed across the upgrade: {before:?} -> {after:?}"
    );
    ensure!(
        s.lb.metric("lb_connections_total", "") == accepted,
        "lb_connections_total did not carry over"
    );
    ensure!(
        s.lb.metric("lb_copied_bytes_total", "") >= copied,
        "copied bytes reset"
    );
    ensure!(
        s.lb.metric("lb_spliced_bytes_total", "") >= spliced,
        "spliced bytes reset"
    );
    ensure!(
        s.lb.metric("lb_health_checks_total", "") >= checks,
        "health check counts reset"
    );
    // The held connections still carry bytes: an echo round trip through a new connection
    // beside them, and the holders are still there.
    let v = run_client(&place(&s, true), s.listen, &["rr", "10", "64"], T)?;
    ensure!(
        v["ok"] == true,
        "a new connection after the upgrades failed: {v}"
    );
    for h in &holders {
        if let Ok(ev) = h.next(Duration::from_millis(10)) {
            bail!("a held connection saw {ev}");
        }
    }
    Ok(())
}

/// Clients connecting in a tight loop (a round trip each), spliced and copied, see no refused
/// or reset connection across two upgrades.
#[test]
fn upgrade_connect_loop_sees_no_refusal() -> Result<()> {
    if skip_unless_root() || lb_tests::splice_fallback_asserted()? {
        return Ok(());
    }
    let mut s = setup(&[], &[])?;
    s.lb.wait_settled()?;
    // Long enough for both upgrades, which take seconds each under TCG.
    let loop_ms = if timed() { "6000" } else { "15000" };
    let loops: Vec<_> = [true, false]
        .into_iter()
        .map(|spliced| spawn(&s, spliced, &["cps", loop_ms, "--workers", "2"]))
        .collect();
    // Each upgrade starts once the loops connect through the lb it replaces.
    wait_accepted(&s.lb, 20.0)?;
    let u1 = s.lb.upgrade_ok()?;
    wait_accepted(&s.lb, s.lb.metric("lb_connections_total", "") + 20.0)?;
    let u2 = s.lb.upgrade_ok()?;
    for h in loops {
        let v = join_ok("connect loop", h).with_context(|| s.lb.log_text())?;
        println!("connect loop: {v}");
        ensure!(v["failed"] == 0, "connects failed during the upgrades: {v}");
    }
    let pause = |u: &Value| u["accept_pause_ms"].as_u64().unwrap_or(u64::MAX);
    println!("accept paused {} and {} ms", pause(&u1), pause(&u2));
    if timed() {
        ensure!(
            pause(&u1) < 2000 && pause(&u2) < 2000,
            "accepting paused long: {u1} {u2}"
        );
    }
    Ok(())
}

/// A new binary that exits at once, and one that dies after the old lb froze its connections
/// (`LB_UPGRADE_FAULT=before_done`): `lb upgrade` exits 1 naming why, the old lb serves on,
/// its held connection and a stream running through the failure are untouched; a good binary
/// then takes over.
#[test]
fn upgrade_failed_takeover_keeps_the_old_lb() -> Result<()> {
    if skip_unless_root() || lb_tests::splice_fallback_asserted()? {
        return Ok(());
    }
    let mut s = setup(&[], &[])?;
    s.lb.wait_settled()?;
    let holder = Holder::start(&place(&s, true), s.listen, 0, 600_000)?;
    holder.wait_for("connected", Duration::from_secs(30))?;
    let good = std::fs::read(s.lb.bin())?;
    s.lb.replace_binary(b"#!/bin/sh\nexit 3\n")?;
    let pid = s.lb.pid;
    let before = s.lb.servers()?;
    let out = s.lb.upgrade()?;
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    ensure!(
        out.status.code() == Some(1),
        "lb upgrade exited {}: {err}",
        out.status
    );
    ensure!(
        err.contains("exit status: 3"),
        "the reason is not named: {err}"
    );
    ensure!(s.lb.pid == pid, "the pid changed");
    ensure!(s.lb.servers()? == before, "the status changed");
    ensure!(
        s.lb.log_text()
            .contains("upgrade failed; this lb keeps serving"),
        "the old lb did not log why"
    );
    let v = run_client(&place(&s, false), s.listen, &["rr", "20", "64"], T)?;
    ensure!(v["ok"] == true, "the old lb does not serve: {v}");
    if let Ok(ev) = holder.next(Duration::from_millis(10)) {
        bail!("the held connection saw {ev}");
    }
    s.lb.replace_binary(&good)?;
    s.lb.upgrade_ok()?;
    if let Ok(ev) = holder.next(Duration::from_millis(10)) {
        bail!("the held connection saw {ev}");
    }
    Ok(())
}

/// A second `lb upgrade` while one is under way is refused at once (exit 2, 409, its JSON
/// error on stdout with `-o json`) instead of waiting its turn; the first one then fails as its
/// new process does, and the old lb serves on.
#[test]
fn upgrade_second_request_is_refused_while_one_runs() -> Result<()> {
    if skip_unless_root() || lb_tests::splice_fallback_asserted()? {
        return Ok(());
    }
    let mut s = setup(&[], &[])?;
    s.lb.wait_settled()?;
    let good = std::fs::read(s.lb.bin())?;
    // The new "lb" takes 3 s to fail: the first upgrade holds its turn that long.
    s.lb.replace_binary(b"#!/bin/sh\nsleep 3\nexit 3\n")?;
    let pid = s.lb.pid;
    let admin = s.lb.admin.to_string();
    let second = std::thread::spawn(move || -> Result<(Output, Duration)> {
        std::thread::sleep(Duration::from_millis(500));
        let mut cmd = Command::new(lb_bin());
        cmd.args(["upgrade", "--admin", &admin, "--output", "json"]);
        let t = Instant::now();
        let out = output_within(cmd, Duration::from_secs(30))?;
        Ok((out, t.elapsed()))
    });
    let first = s.lb.upgrade()?;
    let (out, took) = second
        .join()
        .map_err(|_| anyhow::anyhow!("second upgrade thread panicked"))??;
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    eprintln!(
        "second lb upgrade: exit {} after {took:?}: {err}",
        out.status
    );
    ensure!(
        out.status.code() == Some(2),
        "second lb upgrade exited {}: {err}",
        out.status
    );
    ensure!(
        err.contains("already in progress"),
        "no clear reason: {err}"
    );
    let v: Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("-o json printed {:?}", out.stdout))?;
    ensure!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("already in progress")),
        "JSON error: {v}"
    );
    ensure!(
        !timed() || took < Duration::from_secs(2),
        "the second upgrade waited {took:?}"
    );
    ensure!(
        first.status.code() == Some(1),
        "first lb upgrade exited {}: {}",
        first.status,
        String::from_utf8_lossy(&first.stderr)
    );
    let v: Value = serde_json::from_slice(&first.stdout)
        .with_context(|| format!("-o json printed {:?}", first.stdout))?;
    ensure!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("exit status: 3")),
        "the first upgrade's JSON error: {v}"
    );
    ensure!(s.lb.pid == pid, "the pid changed");
    let v = run_client(&place(&s, false), s.listen, &["rr", "20", "64"], T)?;
    ensure!(v["ok"] == true, "the old lb does not serve: {v}");
    s.lb.replace_binary(&good)?;
    Ok(())
}

/// SIGUSR2 (upgrade) and SIGHUP (reload) sent to an `lb run` still starting, before its
/// handlers exist, are ignored rather than ending it (their default action). The test stops lb
/// (SIGSTOP) once it ignores both and sends them only if its handlers are still not installed
/// then: sent a moment later, SIGUSR2 would start a real upgrade, which ends this process by
/// design (a guest once showed that race). A start that installed its handlers before the stop
/// is tried again, up to five times.
#[test]
fn upgrade_signals_while_starting_do_not_end_lb() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let cg = TestCgroup::new()?;
    for attempt in 1..=5 {
        match signals_while_starting(&cg)? {
            Early::Sent => return Ok(()),
            Early::Missed => eprintln!("attempt {attempt}: lb installed its handlers first"),
        }
    }
    bail!("lb installed its signal handlers before the test could stop it, 5 times of 5")
}

/// Whether [`signals_while_starting`] sent its signals before lb's handlers existed.
enum Early {
    Sent,
    Missed,
}

/// One `lb run`: stopped as soon as it ignores SIGHUP and SIGUSR2; if it has no handler for
/// them yet, both are sent while it is stopped, and it must then go on to serve `/livez`.
fn signals_while_starting(cg: &TestCgroup) -> Result<Early> {
    use nix::sys::signal::{Signal, kill};
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
    let listen = format!("127.0.0.1:{}", free_port()?);
    let log = std::env::temp_dir().join(format!("lb-signals-{}-{admin}.log", std::process::id()));
    // A pin directory of its own, removed after: the default one would keep the pins of an
    // earlier run, attached to a cgroup gone since, and lb would refuse them.
    let pins = lb_tests::unique_pin_dir();
    let mut cmd = Command::new(lb_bin());
    if let Some(dir) = &pins {
        cmd.env("LB_PIN_DIR", dir);
    }
    let mut child = cmd
        .args(["run", "--listen", &listen, "--server", "198.18.0.2:9000"])
        .args([
            "--datapath",
            "bpf",
            "--cgroup",
            &cg.path.display().to_string(),
        ])
        .args(["--admin-listen", &admin.to_string()])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()?;
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id())?);
    let ended = |status: std::process::ExitStatus| {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        anyhow::anyhow!("lb ended after the signals ({status}): {text}")
    };
    let result = (|| -> Result<Early> {
        // SigIgn and SigCgt in /proc/<pid>/status: bit 0 is signal 1 (SIGHUP), bit 11 SIGUSR2.
        let status = || std::fs::read_to_string(format!("/proc/{pid}/status")).ok();
        let mask = |field: &str| -> Option<u64> {
            let st = status()?;
            let line = st.lines().find(|l| l.starts_with(field))?;
            u64::from_str_radix(line.split_whitespace().nth(1)?, 16).ok()
        };
        const BITS: u64 = 1 << 0 | 1 << 11;
        let deadline = Instant::now() + Duration::from_secs(30);
        while mask("SigIgn:").is_none_or(|m| m & BITS != BITS) {
            ensure!(
                Instant::now() < deadline,
                "lb never ignored SIGHUP and SIGUSR2"
            );
            ensure!(child.try_wait()?.is_none(), "lb exited while starting");
            std::thread::sleep(Duration::from_millis(1));
        }
        kill(pid, Signal::SIGSTOP)?;
        // Every thread stopped, not only the main one: a thread still running could install
        // a handler after the mask below was read.
        lb_tests::wait_until(Duration::from_secs(10), || {
            let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))?;
            let mut all = true;
            for t in tasks {
                // A thread gone meanwhile (no status, or a zombie) runs no code either.
                let st = std::fs::read_to_string(t?.path().join("status")).unwrap_or_default();
                all &= st.is_empty() || st.contains("State:\tT") || st.contains("State:\tZ");
            }
            Ok(all)
        })?;
        if mask("SigCgt:").is_none_or(|m| m & BITS != 0) {
            kill(pid, Signal::SIGCONT)?;
            return Ok(Early::Missed);
        }
        kill(pid, Signal::SIGUSR2)?;
        kill(pid, Signal::SIGHUP)?;
        kill(pid, Signal::SIGCONT)?;
        eprintln!("signals sent while lb ignored them, before its handlers existed");
        lb_tests::wait_until(Duration::from_secs(30), || {
            if let Some(status) = child.try_wait()? {
                return Err(ended(status));
            }
            Ok(http_get(admin, "/livez").is_ok_and(|(code, _)| code == 200))
        })?;
        std::thread::sleep(Duration::from_millis(300));
        if let Some(status) = child.try_wait()? {
            return Err(ended(status));
        }
        Ok(Early::Sent)
    })();
    let _ = kill(pid, Signal::SIGCONT);
    let _ = kill(pid, Signal::SIGTERM);
    let _ = child.wait();
    let _ = std::fs::remove_file(&log);
    if let Some(dir) = &pins {
        lb_tests::remove_pins(dir);
    }
    result
}

/// The new process dies after the old one froze its connections and sent them: the old lb
/// serves them again, every byte of a bulk transfer each way and of a stalled upload arrives.
#[test]
fn upgrade_takeover_dying_midway_gives_everything_back() -> Result<()> {
    if skip_unless_root() || lb_tests::splice_fallback_asserted()? {
        return Ok(());
    }
    let mut s = setup(&[], &[("LB_UPGRADE_FAULT", "before_done")])?;
    s.lb.wait_settled()?;
    let bulk = scaled(256 * MIB);
    let stalled = scaled(32 * MIB);
    // Under TCG starting a client takes seconds, so the bulk streams may be over before the
    // last one starts: there the servers stall longer and only the two stalled uploads (which
    // hold bytes lb has not written yet) must be in flight at the upgrade.
    let (stall_ms, in_flight) = if timed() { ("3000", 6) } else { ("30000", 2) };
    let mut streams = Vec::new();
    for spliced in [true, false] {
        streams.push(spawn(&s, spliced, &["up", &bulk, "--pause-ms", "200"]));
        streams.push(spawn(&s, spliced, &["down", &bulk]));
        streams.push(spawn(
            &s,
            spliced,
            &["up", &stalled, "--stall-ms", stall_ms, "--pause-ms", "200"],
        ));
    }
    wait_conns(&s.lb, in_flight, Duration::from_secs(30))?;
    let pid = s.lb.pid;
    let out = s.lb.upgrade()?;
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    ensure!(
        out.status.code() == Some(1),
        "lb upgrade exited {}: {err}",
        out.status
    );
    ensure!(
        err.contains("exit status: 70"),
        "the reason is not named: {err}\n{}",
        s.lb.log_text()
    );
    ensure!(s.lb.pid == pid, "the pid changed");
    ensure!(
        s.lb.log_text()
            .contains("serving the connections and listeners again"),
        "no way back in the log: {}",
        s.lb.log_text()
    );
    for h in streams {
        join_ok("stream", h).with_context(|| s.lb.log_text())?;
    }
    let v = run_client(&place(&s, true), s.listen, &["rr", "20", "64"], T)?;
    ensure!(v["ok"] == true, "the old lb does not accept again: {v}");
    Ok(())
}

/// A second `lb run` on the same listener, or on the same admin address, exits 2 naming the
/// address and the process that has it; the running lb is untouched.
#[test]
fn upgrade_second_lb_run_exits_2() -> Result<()> {
    if skip_unless_root() || lb_tests::splice_fallback_asserted()? {
        return Ok(());
    }
    let s = setup(&[], &[])?;
    let other_admin = format!("127.0.0.1:{}", free_port()?);
    let other_listen = format!("127.0.0.1:{}", free_port()?);
    for (listen, admin) in [
        (s.listen.to_string(), other_admin.clone()),
        (other_listen, s.lb.admin.to_string()),
    ] {
        let mut cmd = Command::new(lb_bin());
        cmd.args(["run", "--listen", &listen, "--server", "198.18.0.2:9000"])
            .args([
                "--datapath",
                "bpf",
                "--cgroup",
                &s.cg.path.display().to_string(),
            ])
            .args(["--admin-listen", &admin]);
        let out = output_within(cmd, Duration::from_secs(30))?;
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        ensure!(
            out.status.code() == Some(2),
            "second lb exited {}: {err}",
            out.status
        );
        ensure!(
            err.contains("already served") && err.contains(&format!("pid {}", s.lb.pid)),
            "no clear reason: {err}"
        );
    }
    let v = run_client(&place(&s, true), s.listen, &["rr", "20", "64"], T)?;
    ensure!(v["ok"] == true, "the running lb was disturbed: {v}");
    Ok(())
}

/// The balancer's connect-time table as the kernel holds it, from `/status`: (generation,
/// servers).
fn connect_table(lb: &UpLb) -> Result<(u64, Vec<String>)> {
    let st = lb.status()?;
    let t = &st["balancers"][0]["connect_table"];
    let generation = t["generation"]
        .as_u64()
        .with_context(|| format!("no connect_table in {st}"))?;
    let servers = t["servers"]
        .as_array()
        .context("servers")?
        .iter()
        .filter_map(|s| s.as_str().map(str::to_string))
        .collect();
    Ok((generation, servers))
}

/// With `forwarding = "connect"` the connect-time programs stay attached across the upgrade:
/// a connect loop in the cgroup never fails and never reaches lb's listener (every connect was
/// rewritten to a server by the kernel), and a direct connection made before outlives it. The
/// new lb goes on from the table generation it found: its first table goes into the next slot,
/// once that slot rested the whole bound from the take-over on.
#[test]
fn upgrade_keeps_connect_time_forwarding() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let mut s = setup(&["--forwarding", "connect"], &[])?;
    s.lb.wait_settled()?;
    // Wait for the table, its first server marked ACTIVE.
    lb_tests::wait_until(T, || {
        let active = s.lb.servers()?.iter().any(|v| v.1 == "ACTIVE");
        Ok(active && connect_table(&s.lb).is_ok_and(|(g, v)| g >= 1 && !v.is_empty()))
    })
    .with_context(|| format!("no table with an ACTIVE server: {:?}", s.lb.status()))?;
    let holder = Holder::start(&place(&s, true), s.listen, 0, 600_000)?;
    holder.wait_for("connected", Duration::from_secs(30))?;
    let looping = spawn(&s, true, &["cps", "4000", "--workers", "2"]);
    // The loop is under way: the kernel counts one of its connections besides the holder's.
    wait_conns(&s.lb, 2, T)?;
    let (before, servers) = connect_table(&s.lb)?;
    ensure!(
        before >= 1 && !servers.is_empty(),
        "no table before the upgrade: {before} {servers:?}"
    );
    s.lb.upgrade_ok()?;
    let v = join_ok("connect loop", looping).with_context(|| s.lb.log_text())?;
    println!("connect loop: {v}");
    ensure!(v["failed"] == 0, "connects failed: {v}");
    ensure!(
        s.lb.metric("lb_connections_total", "") == 0.0,
        "some connects reached lb's listener instead of being rewritten: {}",
        s.lb.log_text()
    );
    if let Ok(ev) = holder.next(Duration::from_millis(10)) {
        bail!("the direct connection saw {ev}");
    }
    // The new lb went on from the generation it found (with the same states it finds its
    // table current and writes none).
    let (after, _) = connect_table(&s.lb)?;
    ensure!(
        after == before || after == before + 1,
        "generation {before} before the upgrade, {after} after"
    );
    // A change: one generation further. The new lb's first write (this one, or one at its
    // take-over) went into the slot after the one current, once it had rested the whole bound
    // from the take-over on.
    let name = s.lb.status()?["balancers"][0]["name"]
        .as_str()
        .context("balancer name")?
        .to_string();
    let body = serde_json::json!({ "servers": &servers[..1] }).to_string();
    let (code, answer) = lb_tests::http_request(
        s.lb.admin,
        "PUT",
        &format!("/balancers/{name}/servers"),
        Some(&body),
    )?;
    ensure!(code == 200, "PUT {body}: {code} {answer}");
    lb_tests::wait_until(Duration::from_secs(5), || {
        Ok(connect_table(&s.lb)?.1 == servers[..1])
    })
    .with_context(|| s.lb.log_text())?;
    let (next, _) = connect_table(&s.lb)?;
    ensure!(
        next == after + 1,
        "generation {after} → {next} after one change"
    );
    let log = s.lb.log_text();
    let line = log
        .lines()
        .skip_while(|l| !l.contains("kernel data path taken over"))
        .find(|l| l.contains("connect-time table updated") && l.contains(" slot="))
        .with_context(|| format!("no table write of the new lb logged:\n{log}"))?;
    let generation: u64 = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("generation="))
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no generation in {line}"))?;
    ensure!(
        generation > before && generation <= next,
        "the new lb's first table is generation {generation}, {before} was current: {line}"
    );
    let idle: u64 = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("slot_idle_ms="))
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("the new lb's first write found a slot never current: {line}"))?;
    ensure!(
        idle >= 100,
        "the new lb wrote a slot idle only {idle} ms: {line}"
    );
    Ok(())
}

/// `lb upgrade` twice back to back: both succeed, the second answered by the first one's new
/// lb, and an admin change made at once lands in the lb that serves on (the old lb stops
/// accepting on the admin API when a hand-over starts, the new one starts once it has the
/// state). Then an upgrade whose config changes a balancer's forwarding is refused, naming it,
/// and the running lb serves on.
#[test]
fn upgrade_back_to_back_admin_follows_and_forwarding_is_kept() -> Result<()> {
    if skip_unless_root() || lb_tests::splice_fallback_asserted()? {
        return Ok(());
    }
    let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    let cg = TestCgroup::new()?;
    let port = free_port()?;
    let text = format!(
        "[datapath]\nmode = \"bpf\"\ncgroup = \"{}\"\nforwarding = \"splice\"\n\n\
         [[balancer]]\nname = \"api\"\nlisten = [\"127.0.0.1:{port}\"]\nservers = [{}]\n",
        cg.path.display(),
        lb_tests::toml_addrs(&hosts, 9000)
    );
    let config = std::env::temp_dir().join(format!(
        "lb-upgrade-forwarding-{}-{port}.toml",
        std::process::id()
    ));
    std::fs::write(&config, &text)?;
    let started = UpLb::start(&["--config", &config.display().to_string()], &[]);
    let mut lb = match started {
        Ok(lb) => lb,
        Err(e) => {
            let _ = std::fs::remove_file(&config);
            return Err(e);
        }
    };
    let r = (|| -> Result<()> {
        lb.wait_settled()?;
        let raw_upgrade = |admin: SocketAddr| -> Result<Value> {
            let mut cmd = Command::new(lb_bin());
            cmd.args(["upgrade", "--admin", &admin.to_string(), "--output", "json"]);
            let out = output_within(cmd, Duration::from_secs(120))?;
            ensure!(
                out.status.success(),
                "lb upgrade failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
            Ok(serde_json::from_slice(&out.stdout)?)
        };
        let first = raw_upgrade(lb.admin)?;
        let second = raw_upgrade(lb.admin)?;
        let s1 = hosts[1].addr(9000).to_string();
        let out = Command::new(lb_bin())
            .args(["servers", "--balancer", "api", "drain", &s1, "--admin"])
            .arg(lb.admin.to_string())
            .output()?;
        ensure!(out.status.success(), "lb servers drain: {out:?}");
        println!("back to back: {first} then {second}");
        ensure!(
            second["old_pid"] == first["new_pid"],
            "the second upgrade should be answered by the first one's new lb: {first} {second}"
        );
        for old in [&first["old_pid"], &second["old_pid"]] {
            let old = u32::try_from(old.as_u64().context("old_pid")?)?;
            lb.wait_gone(old, Duration::from_secs(10))?;
        }
        lb.pid = u32::try_from(second["new_pid"].as_u64().context("new_pid")?)?;
        let st = lb.status()?;
        let held = st["balancers"][0]["servers"]
            .as_array()
            .context("servers")?
            .iter()
            .find(|s| s["address"] == s1.as_str())
            .map(|s| s["hold"].clone());
        ensure!(
            held == Some(Value::from("drain")),
            "the drain made right after the upgrades should be in the serving lb: {st}"
        );

        std::fs::write(&config, text.replace("\"splice\"", "\"connect\""))?;
        let pid = lb.pid;
        let out = lb.upgrade()?;
        let err = String::from_utf8_lossy(&out.stderr);
        println!("forwarding change: {err}");
        ensure!(
            out.status.code() == Some(1),
            "lb upgrade exited {}: {err}",
            out.status
        );
        ensure!(
            err.contains(
                "balancer api: forwarding splice in the running lb, connect in the new config"
            ),
            "the refusal should name the change: {err}"
        );
        ensure!(lb.pid == pid, "the running lb should serve on");
        let v = run_client(
            &Place::cgroup(&cg.path),
            format!("127.0.0.1:{port}").parse()?,
            &["rr", "10", "64"],
            T,
        )?;
        ensure!(v["ok"] == true, "the running lb should still serve: {v}");
        Ok(())
    })();
    let _ = std::fs::remove_file(&config);
    r
}
