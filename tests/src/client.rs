//! `lbt client` runs: where a client runs (cgroup, namespace), one-shot runs that print a JSON
//! result, and long-running holders whose events are read line by line.

use std::{
    io::{BufRead, BufReader},
    net::SocketAddr,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::cmd::lbt_bin;

/// Where an `lbt client` runs.
#[derive(Clone, Debug, Default)]
pub struct Place<'a> {
    /// Inside this cgroup (so sockops sees its sockets).
    pub cgroup: Option<&'a Path>,
    /// Inside this network namespace.
    pub netns: Option<&'a str>,
}

impl<'a> Place<'a> {
    /// Inside cgroup `cg`, in lb's own network namespace.
    pub fn cgroup(cg: &'a Path) -> Place<'a> {
        Place {
            cgroup: Some(cg),
            netns: None,
        }
    }
}

/// Build the command for `lbt client --connect addr <action...>` placed as asked.
pub fn client_command(place: &Place<'_>, addr: SocketAddr, action: &[&str]) -> Command {
    let lbt = lbt_bin();
    // `ip netns exec` mounts a fresh /sys, hiding the cgroup tree: join the cgroup first, then
    // enter the namespace. iproute2 by full path: the guests' busybox sh has an `ip` applet of
    // its own, without `netns`.
    let netns = place
        .netns
        .map(|ns| format!("/usr/sbin/ip netns exec {ns} "))
        .unwrap_or_default();
    let mut inner = format!("exec {netns}{} client --connect {addr}", lbt.display());
    for a in action {
        inner.push(' ');
        inner.push_str(a);
    }
    if let Some(cg) = place.cgroup {
        inner = format!("echo $$ > {}/cgroup.procs && {inner}", cg.display());
    }
    let mut cmd = Command::new("sh");
    cmd.args(["-c", &inner]);
    cmd.stdin(Stdio::null());
    cmd
}

/// Build the command for any `program args` placed as asked (joined to `place.cgroup` first,
/// then inside `place.netns`), with standard input closed. Arguments are passed through `sh`,
/// each quoted, so they may contain anything.
pub fn placed_command(place: &Place<'_>, program: &Path, args: &[&str]) -> Command {
    let netns = place
        .netns
        .map(|ns| format!("/usr/sbin/ip netns exec {} ", sh_quote(ns)))
        .unwrap_or_default();
    let mut inner = format!("exec {netns}{}", sh_quote(&program.to_string_lossy()));
    for a in args {
        inner.push(' ');
        inner.push_str(&sh_quote(a));
    }
    if let Some(cg) = place.cgroup {
        inner = format!(
            "echo $$ > {} && {inner}",
            sh_quote(&cg.join("cgroup.procs").to_string_lossy())
        );
    }
    let mut cmd = Command::new("sh");
    cmd.args(["-c", &inner]);
    cmd.stdin(Stdio::null());
    cmd
}

/// `s` quoted for `sh`: in single quotes, each `'` written as `'\''`.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Run `lbt client` to completion (bounded by `timeout`) and parse its last JSON line.
///
/// # Errors
/// Spawn failure, timeout (the client is killed) or no JSON output.
pub fn run_client(
    place: &Place<'_>,
    addr: SocketAddr,
    action: &[&str],
    timeout: Duration,
) -> Result<serde_json::Value> {
    let mut child = client_command(place, addr, action)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let deadline = Instant::now() + timeout;
    loop {
        if child.try_wait()?.is_some() {
            break;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("lbt client {action:?} did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let out = child.wait_with_output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.lines().last().with_context(|| {
        format!(
            "lbt client printed nothing; stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    serde_json::from_str(last).with_context(|| {
        format!(
            "lbt output {last:?}; stderr {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// A long-running `lbt client ... hold`, whose events are read line by line.
#[derive(Debug)]
pub struct Holder {
    child: Child,
    rx: std::sync::mpsc::Receiver<serde_json::Value>,
    /// The client's standard input, for actions that wait for a line from the test.
    stdin: Option<std::process::ChildStdin>,
}

impl Holder {
    /// Start `hold --reconnect N --max-ms M`.
    ///
    /// # Errors
    /// Spawn failure.
    pub fn start(
        place: &Place<'_>,
        addr: SocketAddr,
        reconnect: u32,
        max_ms: u64,
    ) -> Result<Holder> {
        let r = reconnect.to_string();
        let m = max_ms.to_string();
        Holder::spawn(place, addr, &["hold", "--reconnect", &r, "--max-ms", &m])
    }

    /// Start any long-running `lbt client` action (`idle`, `hold`) whose JSON lines are read
    /// as events.
    ///
    /// # Errors
    /// Spawn failure.
    pub fn spawn(place: &Place<'_>, addr: SocketAddr, action: &[&str]) -> Result<Holder> {
        Holder::spawn_with(client_command(place, addr, action))
    }

    /// As [`Holder::spawn`], with the client's standard input open for [`Holder::say`] (the
    /// `reuse-tuple` action waits for lines from the test between its steps).
    ///
    /// # Errors
    /// Spawn failure.
    pub fn spawn_interactive(
        place: &Place<'_>,
        addr: SocketAddr,
        action: &[&str],
    ) -> Result<Holder> {
        let mut cmd = client_command(place, addr, action);
        cmd.stdin(Stdio::piped());
        Holder::spawn_with(cmd)
    }

    fn spawn_with(mut cmd: Command) -> Result<Holder> {
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::null()).spawn()?;
        let stdin = child.stdin.take();
        let out = child.stdout.take().context("stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str(&line)
                    && tx.send(v).is_err()
                {
                    return;
                }
            }
        });
        Ok(Holder { child, rx, stdin })
    }

    /// Write `line` and a newline to the client's standard input.
    ///
    /// # Errors
    /// Not started with [`Holder::spawn_interactive`], or the client is gone.
    pub fn say(&mut self, line: &str) -> Result<()> {
        use std::io::Write as _;
        let stdin = self
            .stdin
            .as_mut()
            .context("the client's stdin is not open")?;
        writeln!(stdin, "{line}")?;
        stdin.flush()?;
        Ok(())
    }

    /// The client's process id (the one that calls `connect()`: the placing shell execs it).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Next event within `timeout`.
    ///
    /// # Errors
    /// No event in time.
    pub fn next(&self, timeout: Duration) -> Result<serde_json::Value> {
        self.rx
            .recv_timeout(timeout)
            .context("no event from the holding client")
    }

    /// Wait for an event whose `event` field is `kind`, skipping others.
    ///
    /// # Errors
    /// None within `timeout`.
    pub fn wait_for(&self, kind: &str, timeout: Duration) -> Result<serde_json::Value> {
        let deadline = Instant::now() + timeout;
        let mut last = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let ev = self.next(left).with_context(|| match &last {
                Some(ev) => format!("waiting for {kind}; the last event was {ev}"),
                None => format!("waiting for {kind}; no event yet"),
            })?;
            if ev["event"] == kind {
                return Ok(ev);
            }
            last = Some(ev);
        }
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
