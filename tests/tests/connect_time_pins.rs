//! Connect-time forwarding without a live lb: the programs' links and maps pinned in a bpffs
//! (each test mounts its own, in a mount namespace private to its thread, and each lb gets a pin
//! directory of its own). After `kill -9` of lb the kernel goes on rewriting connects on the last
//! table and a new `lb run` adopts the pins without attaching twice, counting and killing the
//! sockets made meanwhile; after `orphan_timeout` without a heartbeat connects are no longer
//! rewritten; `lb cleanup` leaves nothing. Taking over pins of another build or configuration
//! is `connect_time_takeover.rs`.

use std::{
    os::unix::fs::{MetadataExt as _, PermissionsExt as _},
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use lb_tests::{
    ConnectLb, Holder, all_connected, all_reset, pinned_connect_lb, run_client, skip,
    skip_unless_kernel, skip_unless_root,
};
use serde_json::Value;

const T: Duration = Duration::from_secs(60);

/// lb in front of `s0`, `s1` with `orphan_timeout = orphan` (see [`pinned_connect_lb`]).
fn setup(orphan: &str) -> Result<Option<ConnectLb>> {
    pinned_connect_lb(orphan, "")
}

/// `kill -9` under a connect loop and held connections: no connect fails and no connection is
/// lost while lb is dead and across a new `lb run` adopting the pins; `/status` then counts the
/// sockets made meanwhile, and `lb servers kill` resets them.
#[test]
fn connect_time_pins_serve_through_kill_9_and_adoption() -> Result<()> {
    let Some(mut s) = setup("10m")? else {
        return Ok(());
    };
    let s0 = s.hosts[0].addr(9000).to_string();
    let mut held = s.hold(3, "s0")?;
    let during = s.dial_loop(60, 30);
    s.kill9()?;
    all_connected("connect loop while lb is dead", during, 60)?;
    // Sockets made while lb is dead: rewritten by the pinned programs, recorded in pinned maps.
    for _ in 0..2 {
        let h = Holder::start(&s.place(), s.listen, 0, 120_000)?;
        let ev = h.wait_for("connected", Duration::from_secs(10))?;
        ensure!(ev["server"] == "s0", "{ev}");
        held.push(h);
    }
    let across = s.dial_loop(120, 30);
    let new = s.start_again()?;
    let old = std::mem::replace(&mut s.lb, new);
    drop(old);
    all_connected("connect loop across the adoption", across, 120)?;
    let log = s.lb.log_text();
    ensure!(
        log.contains("adopted"),
        "the new lb should adopt the pins: {log}"
    );
    let st = s.lb.status()?;
    ensure!(st["pins"]["adopted"] == true, "/status pins: {st}");
    for (p, n) in s.connect_programs_attached()? {
        ensure!(n == 1, "{p} attached {n} times after the adoption");
    }
    for h in &held {
        if let Ok(ev) = h.next(Duration::from_millis(10)) {
            bail!("a held connection saw {ev}");
        }
    }
    // The five held sockets, three of them made before and two while lb was dead.
    lb_tests::wait_until(Duration::from_secs(10), || Ok(s.status_of(&s0)?.1 >= 5))
        .with_context(|| format!("counts: {:?}", s.status_of(&s0)))?;
    s.lb.cli(&["servers", "--balancer", "api", "kill", &s0])?;
    all_reset(&held, Duration::from_secs(5))?;
    lb_tests::wait_until(Duration::from_secs(5), || Ok(s.status_of(&s0)?.1 == 0))?;
    let counters = s.lb.balancer("api")?["kernel"].clone();
    ensure!(
        counters["unrewritten_connects"]
            .as_object()
            .is_some_and(|m| m.values().all(|n| n == 0)),
        "every connect, lb dead or alive, should have been rewritten: {counters}"
    );
    Ok(())
}

/// Pinned programs without a heartbeat stop rewriting after `orphan_timeout`: connects then
/// reach the listener address, where nobody listens.
#[test]
fn connect_time_pins_stop_rewriting_after_the_orphan_timeout() -> Result<()> {
    let Some(mut s) = setup("3s")? else {
        return Ok(());
    };
    let age = s.lb.metric("lb_connect_heartbeat_age_seconds", "");
    ensure!(age < 3.0, "heartbeat age {age} s while lb runs");
    s.kill9()?;
    let killed = Instant::now();
    let v = run_client(&s.place(), s.listen, &["peer"], T)?;
    ensure!(v["ok"] == true, "rewritten right after lb died: {v}");
    let mut last = Value::Null;
    lb_tests::wait_until(Duration::from_secs(20), || {
        last = run_client(&s.place(), s.listen, &["peer"], T)?;
        Ok(last["ok"] == false)
    })
    .with_context(|| format!("still rewritten: {last}"))?;
    let after = killed.elapsed();
    println!(
        "connects rewritten for {:.1} s after lb died",
        after.as_secs_f64()
    );
    ensure!(
        last["kind"] == "ConnectionRefused",
        "expected refused: {last}"
    );
    // The last heartbeat is at most 0.5 s older than the kill.
    ensure!(
        after >= Duration::from_millis(2400),
        "stopped after only {after:?}"
    );
    // The counters are pinned with the programs: the next lb reads the one connect left alone.
    let new = s.start_again()?;
    let old = std::mem::replace(&mut s.lb, new);
    drop(old);
    let counters = s.lb.balancer("api")?["kernel"]["unrewritten_connects"].clone();
    ensure!(
        counters["orphaned"] == 1 && counters["no_servers"] == 0,
        "the connect refused after the orphan timeout should be counted orphaned: {counters}"
    );
    Ok(())
}

/// Mode and owner of the pins; a second `lb run` on them attaches nothing twice; `lb cleanup`
/// is refused while lb runs, and afterwards leaves no program attached and no pin.
#[test]
fn connect_time_pins_cleanup_leaves_nothing() -> Result<()> {
    let Some(mut s) = setup("10m")? else {
        return Ok(());
    };
    let dir = s.pins()?;
    check_modes(&dir)?;
    let cleanup = || {
        std::process::Command::new(lb_tests::lb_bin())
            .args(["cleanup", "--pin-dir"])
            .arg(&dir)
            .output()
    };
    let refused = cleanup()?;
    let err = String::from_utf8_lossy(&refused.stderr);
    ensure!(
        !refused.status.success() && err.contains("held by another running lb"),
        "cleanup while lb runs: {refused:?}"
    );
    // A graceful stop leaves the programs serving too (a restart refuses no client).
    let code = s.lb.terminate(Duration::from_secs(10))?;
    ensure!(code == 0, "lb exited with {code}");
    ensure!(
        s.connect_programs_attached()?.iter().all(|(_, n)| *n == 1),
        "{:?}",
        s.connect_programs_attached()?
    );
    let new = s.start_again()?;
    drop(std::mem::replace(&mut s.lb, new));
    s.lb.wait_settled(Duration::from_secs(10))?;
    for (p, n) in s.connect_programs_attached()? {
        ensure!(n == 1, "{p} attached {n} times after a second lb run");
    }
    let code = s.lb.terminate(Duration::from_secs(10))?;
    ensure!(code == 0, "lb exited with {code}");
    let out = cleanup()?;
    ensure!(out.status.success(), "lb cleanup: {out:?}");
    println!("{}", String::from_utf8_lossy(&out.stdout).trim());
    for (p, n) in s.connect_programs_attached()? {
        ensure!(n == 0, "{p} still attached after lb cleanup");
    }
    ensure!(!dir.exists(), "{} left after lb cleanup", dir.display());
    let v = run_client(&s.place(), s.listen, &["peer"], T)?;
    ensure!(v["ok"] == false, "rewritten after lb cleanup: {v}");
    Ok(())
}

/// The pin directory is 0700, every pin 0600, all owned by lb's user (root here).
fn check_modes(dir: &Path) -> Result<()> {
    let meta = std::fs::metadata(dir)?;
    ensure!(
        meta.permissions().mode() & 0o777 == 0o700 && meta.uid() == 0,
        "{}: mode {:o} uid {}",
        dir.display(),
        meta.permissions().mode(),
        meta.uid()
    );
    let mut pins = 0;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let meta = std::fs::metadata(&path)?;
        ensure!(
            meta.permissions().mode() & 0o777 == 0o600 && meta.uid() == 0,
            "{}: mode {:o} uid {}",
            path.display(),
            meta.permissions().mode(),
            meta.uid()
        );
        pins += 1;
    }
    // The maps (lb_common::CONNECT_MAPS) and six links, one per connect-time program.
    let want = lb_common::CONNECT_MAPS.len() + 6;
    ensure!(
        pins == want,
        "{pins} pins in {}, want {want}",
        dir.display()
    );
    Ok(())
}

/// `lb upgrade` with pinned connect-time programs: the new lb takes the pin directory's lock
/// with the hand-over (so `lb cleanup` is refused once the old one is gone), and its pins serve
/// on after it is killed.
#[test]
fn connect_time_pins_go_with_an_upgrade() -> Result<()> {
    if skip_unless_root() || skip_unless_kernel((5, 8), "cgroup getpeername4/6 hooks") {
        return Ok(());
    }
    if let Err(e) = lb_tests::private_bpffs() {
        skip(&format!("cannot mount a bpffs: {e:#}"));
        return Ok(());
    }
    let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    let cg = lb_tests::TestCgroup::new()?;
    let listen: std::net::SocketAddr = format!("127.0.0.1:{}", lb_tests::free_port()?).parse()?;
    let cgp = cg.path.display().to_string();
    let mut args = vec![
        "--listen".to_string(),
        listen.to_string(),
        "--datapath".into(),
        "bpf".into(),
        "--cgroup".into(),
        cgp,
        "--forwarding".into(),
        "connect".into(),
    ];
    for h in &hosts {
        args.extend(["--server".to_string(), h.addr(9000).to_string()]);
    }
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut lb = lb_tests::UpLb::start(&argv, &[])?;
    lb.wait_settled()?;
    let dir = lb.pin_dir.clone().context("no pin directory")?;
    let st = lb.status()?;
    ensure!(st["pins"]["adopted"] == false, "{st}");
    lb.upgrade_ok()?;
    let st = lb.status()?;
    ensure!(
        st["pins"]["dir"] == dir.display().to_string().as_str(),
        "/status pins after the upgrade: {st}"
    );
    let out = std::process::Command::new(lb_tests::lb_bin())
        .args(["cleanup", "--pin-dir"])
        .arg(&dir)
        .output()?;
    ensure!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("held by"),
        "the new lb should hold the pin directory: {out:?}"
    );
    let pid = nix::unistd::Pid::from_raw(i32::try_from(lb.pid)?);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL)?;
    lb.wait_gone(lb.pid, Duration::from_secs(10))?;
    let v = run_client(&lb_tests::Place::cgroup(&cg.path), listen, &["dial"], T)?;
    ensure!(
        v["ok"] == true,
        "the pins should serve after the new lb died: {v}"
    );
    Ok(())
}

/// Connects refused while lb is dead (the pinned programs still send them to the server that
/// refused) are kernel passive-health events from before the next lb started: it drops them, so
/// they never count toward `fall` (with `passive_reset_limit = 1` and `fall = 2` the three would
/// fail the server).
#[test]
fn connect_time_pins_ignore_passive_events_from_before_the_start() -> Result<()> {
    let Some(mut s) = pinned_connect_lb("10m", "passive_reset_limit = 1")? else {
        return Ok(());
    };
    let s0 = s.hosts[0].addr(9000).to_string();
    s.kill9()?;
    s.hosts[0].stop_servers();
    let v = run_client(&s.place(), s.listen, &["dial", "--times", "3"], T)?;
    ensure!(v["errnos"]["111"] == 3, "expected 3 refused connects: {v}");
    s.hosts[0].serve(9000, "s0")?;
    let new = s.start_again()?;
    drop(std::mem::replace(&mut s.lb, new));
    let log = s.lb.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("connect-time events from before this lb started ignored"))
        .with_context(|| format!("no line about the events: {log}"))?;
    ensure!(line.contains("dropped=3"), "{line}");
    s.lb.wait_settled(Duration::from_secs(10))?;
    let (state, _) = s.status_of(&s0)?;
    ensure!(state != "FAILED", "s0 is {state}: {}", s.lb.log_text());
    let counted = s.lb.metric("lb_passive_events_total", "");
    ensure!(counted == 0.0, "{counted} passive events counted");
    Ok(())
}

/// Pins attached to another cgroup than the new lb's are refused with both cgroups named, and
/// keep serving the cgroup they are attached to.
#[test]
fn connect_time_pins_of_another_cgroup_are_refused_and_keep_serving() -> Result<()> {
    let Some(mut s) = setup("10m")? else {
        return Ok(());
    };
    s.kill9()?;
    let other = lb_tests::TestCgroup::new()?;
    let err = match s.start_again_in(&other.path) {
        Ok(lb) => bail!("lb adopted pins of another cgroup: {}", lb.log_text()),
        Err(e) => format!("{e:#}"),
    };
    ensure!(
        err.contains("attached to the cgroup with id")
            && err.contains(&other.path.display().to_string())
            && err.contains("lb cleanup --pin-dir"),
        "unclear refusal: {err}"
    );
    let v = run_client(&s.place(), s.listen, &["peer"], T)?;
    ensure!(
        v["ok"] == true,
        "the pinned programs should keep rewriting: {v}"
    );
    Ok(())
}

/// A pin directory under a directory another user could replace is refused, naming it and
/// why: one writable by everyone, then one owned by another user.
#[test]
fn connect_time_pins_under_a_directory_others_control_are_refused() -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let Some(mut s) = setup("10m")? else {
        return Ok(());
    };
    s.kill9()?;
    let bpffs = lb_tests::bpffs_mount().context("no bpffs")?;
    let shared = bpffs.join("shared");
    std::fs::create_dir(&shared)?;
    let args = [
        "--config",
        &s.config_path()?.display().to_string(),
        "--cgroup",
        &s.cg.path.display().to_string(),
    ];
    let refused = |want: &str| -> Result<()> {
        let err = match lb_tests::Lb::start_pinned(&shared.join("lb"), &args) {
            Ok(lb) => bail!("lb started on {}: {}", shared.display(), lb.log_text()),
            Err(e) => format!("{e:#}"),
        };
        let named = format!("{} is {want}", shared.display());
        ensure!(err.contains(&named), "want {named:?} in {err}");
        Ok(())
    };
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777))?;
    refused("mode 0777, writable by group or others")?;
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o700))?;
    nix::unistd::chown(&shared, Some(nix::unistd::Uid::from_raw(1000)), None)?;
    refused("owned by uid 1000")?;
    Ok(())
}

/// The process id the pinned programs leave alone is lb's only while lb lives: once its
/// heartbeat is over 2 s old, a process with that id (here a client made to have it, as a
/// reused pid would) is steered like any other. The client's connection is ended by its server,
/// and it reconnects through the listener while no lb runs and reaches that server again.
#[test]
fn connect_time_pins_steer_a_process_that_has_dead_lbs_pid() -> Result<()> {
    let Some(mut s) = setup("10m")? else {
        return Ok(());
    };
    let dir = s.pins()?;
    s.kill9()?;
    let h = Holder::start(&s.place(), s.listen, 30, 60_000)?;
    let ev = h.wait_for("connected", Duration::from_secs(10))?;
    ensure!(ev["server"] == "s0", "{ev}");
    // Slot 0 of LB_CONNECT_CTL is lb's process id (u32 key, u64 value).
    let pid: Vec<String> = u64::from(h.pid())
        .to_le_bytes()
        .iter()
        .map(u8::to_string)
        .collect();
    let ctl = dir.join("LB_CONNECT_CTL").display().to_string();
    let mut args = vec![
        "map", "update", "pinned", &ctl, "key", "0", "0", "0", "0", "value",
    ];
    args.extend(pid.iter().map(String::as_str));
    lb_tests::sh("bpftool", &args)?;
    // Until the heartbeat lb wrote last is over 2 s old (CLOCK_BOOTTIME ns in slot 1).
    lb_tests::wait_until(Duration::from_secs(10), || {
        let beat = lb_tests::pinned_u64(&dir, "LB_CONNECT_CTL", 1)?;
        let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME)?;
        let now_ns = u64::try_from(now.tv_sec())? * 1_000_000_000 + u64::try_from(now.tv_nsec())?;
        Ok(now_ns.saturating_sub(beat) > 2_100_000_000)
    })?;
    // s0's server ends the connection and comes back; the client reconnects (every 100 ms
    // while refused) through the listener, where nobody listens while lb is dead.
    s.hosts[0].stop_servers();
    let closed = h.wait_for("closed", Duration::from_secs(10))?;
    println!("closed: {closed}");
    s.hosts[0].serve(9000, "s0")?;
    let again = h.wait_for("connected", Duration::from_secs(10))?;
    ensure!(
        again["server"] == "s0",
        "the reconnect of the process with lb's old pid: {again}"
    );
    Ok(())
}
