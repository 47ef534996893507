//! A connect-time lb whose programs are pinned, under test: the start (a bpffs of the test's
//! own, two serving hosts, failover with tcp checks), the programs attached to the test's
//! cgroup, a connect loop and its verdict, and what the pins hold as `bpftool` shows it
//! (each pinned link's program, a pinned map's definition and entries).

use std::{collections::BTreeMap, path::Path, time::Duration};

use anyhow::{Context as _, Result, ensure};
use serde_json::Value;

use crate::{ConnectLb, Toml, run_client, skip, skip_unless_kernel, skip_unless_root};

/// How long a client run may take.
const T: Duration = Duration::from_secs(60);

/// Every connect-time program, by the name `bpftool` shows (its BTF name).
pub const CONNECT_PROGRAMS: [&str; 6] = [
    "lb_connect4",
    "lb_connect6",
    "lb_getpeername4",
    "lb_getpeername6",
    "lb_connect_sockops",
    "lb_connect_release",
];

/// lb in front of `s0`, `s1` (failover, tcp checks every 500 ms, kill on unhealthy) with
/// `orphan_timeout = orphan` and `health` lines added to `[balancer.health]`, given root, a
/// kernel with the getpeername hooks and `bpf_ktime_get_boot_ns` (5.8), and a bpffs of the
/// calling thread's own; `None`, with the skip reason printed, otherwise.
///
/// # Errors
/// The hosts or lb do not start, or lb got no pin directory.
pub fn pinned_connect_lb(orphan: &str, health: &str) -> Result<Option<ConnectLb>> {
    if !pinned_test_ready((5, 8), "cgroup getpeername4/6 hooks") {
        return Ok(None);
    }
    let hosts = crate::serving_hosts(2, 9000, |i| format!("s{i}"))?;
    let servers = crate::toml_addrs(&hosts, 9000);
    let datapath = Toml::new().string("orphan_timeout", orphan);
    let s = ConnectLb::start(hosts, |listen| {
        pinned_health(
            ConnectLb::config(&datapath, &[listen], &servers, "failover")
                .string("dial_timeout", "1s"),
        )
        .lines(health)
    })?;
    ensure!(s.lb.pin_dir.is_some(), "lb got no pin directory");
    Ok(Some(s))
}

/// `t` with the `[balancer.health]` of the pin tests' balancers: tcp checks every 500 ms
/// (300 ms timeout), rise 1, fall 2, kill on unhealthy.
pub fn pinned_health(t: Toml) -> Toml {
    t.table("balancer.health")
        .string("kind", "tcp")
        .string("interval", "500ms")
        .string("timeout", "300ms")
        .value("rise", 1)
        .value("fall", 2)
        .string("on_unhealthy", "kill")
}

/// Whether a pin test can run: root, a kernel of at least `min` (for `what`) and a bpffs of the
/// calling thread's own (mounted here); prints the skip reason and gives `false` otherwise.
pub fn pinned_test_ready(min: (u32, u32), what: &str) -> bool {
    if skip_unless_root() || skip_unless_kernel(min, what) {
        return false;
    }
    if let Err(e) = crate::private_bpffs() {
        skip(&format!("cannot mount a bpffs: {e:#}"));
        return false;
    }
    true
}

/// Every one of `held` ends with a reset (or an abort) within `within`.
///
/// # Errors
/// A connection ends otherwise or not in time.
pub fn all_reset(held: &[crate::Holder], within: Duration) -> Result<()> {
    for h in held {
        let closed = h.wait_for("closed", within)?;
        ensure!(
            closed["how"] == "connection reset" || closed["how"] == "connection aborted",
            "{closed}"
        );
    }
    Ok(())
}

impl ConnectLb {
    /// The pin directory of this lb.
    ///
    /// # Errors
    /// lb runs unpinned.
    pub fn pins(&self) -> Result<std::path::PathBuf> {
        self.lb.pin_dir.clone().context("no pin directory")
    }

    /// How many times each connect-time program is attached to the test's cgroup (`bpftool
    /// cgroup show`).
    ///
    /// # Errors
    /// `bpftool` fails.
    pub fn connect_programs_attached(&self) -> Result<Vec<(&'static str, usize)>> {
        let shown = crate::cgroup_programs(&self.cg.path)?;
        Ok(CONNECT_PROGRAMS
            .iter()
            .map(|p| {
                let n = shown
                    .lines()
                    .filter(|l| l.split_whitespace().any(|w| w == *p))
                    .count();
                (*p, n)
            })
            .collect())
    }

    /// A connect loop in the cgroup: `times` dials, one every `every_ms`, in a thread.
    pub fn dial_loop(&self, times: u32, every_ms: u64) -> std::thread::JoinHandle<Result<Value>> {
        let place_cg = self.cg.path.clone();
        let listen = self.listen;
        std::thread::spawn(move || {
            run_client(
                &crate::Place::cgroup(&place_cg),
                listen,
                &[
                    "dial",
                    "--times",
                    &times.to_string(),
                    "--every-ms",
                    &every_ms.to_string(),
                ],
                T,
            )
        })
    }

    /// `n` connections held through the listener (`lbt client hold`), each answered by the
    /// server named `server`.
    ///
    /// # Errors
    /// A client does not connect within 10 s or reaches another server.
    pub fn hold(&self, n: usize, server: &str) -> Result<Vec<crate::Holder>> {
        let mut held = Vec::new();
        for _ in 0..n {
            let h = crate::Holder::start(&self.place(), self.listen, 0, 120_000)?;
            let ev = h.wait_for("connected", Duration::from_secs(10))?;
            ensure!(ev["server"] == server, "{ev}");
            held.push(h);
        }
        Ok(held)
    }

    /// Kill lb with SIGKILL and wait for it to be gone.
    ///
    /// # Errors
    /// It is not gone within 10 s.
    pub fn kill9(&mut self) -> Result<()> {
        self.lb.kill9(Duration::from_secs(10))
    }
}

/// Join a [`ConnectLb::dial_loop`]: every dial connected and reached a server (none reached
/// the listener, where nobody listens while lb is dead); the loop's JSON.
///
/// # Errors
/// A dial failed or reached no server.
pub fn all_connected(
    what: &str,
    h: std::thread::JoinHandle<Result<Value>>,
    times: u32,
) -> Result<Value> {
    let v = h
        .join()
        .map_err(|_| anyhow::anyhow!("{what}: thread panicked"))??;
    println!("{what}: {v}");
    ensure!(v["ok"] == true, "{what}: connects failed: {v}");
    let reached: u64 = v["servers"]
        .as_object()
        .map_or(0, |m| m.values().filter_map(Value::as_u64).sum());
    ensure!(
        reached == u64::from(times),
        "{what}: {reached} of {times} reached a server: {v}"
    );
    Ok(v)
}

/// Each link pinned in `dir` (by pin name): its link id and the id of the program it runs
/// (`bpftool link show pinned`).
///
/// # Errors
/// `bpftool` fails on a pin.
pub fn pinned_links(dir: &Path) -> Result<BTreeMap<String, (u64, u64)>> {
    let mut out = BTreeMap::new();
    for name in CONNECT_PROGRAMS {
        let path = dir.join(name);
        if !path.exists() {
            continue;
        }
        let path = path.display().to_string();
        let v: Value = serde_json::from_str(&crate::sh(
            "bpftool",
            &["-j", "link", "show", "pinned", &path],
        )?)?;
        let id = |k: &str| v[k].as_u64().with_context(|| format!("{k} of {v}"));
        out.insert(name.to_string(), (id("id")?, id("prog_id")?));
    }
    Ok(out)
}

/// The map pinned at `dir/name` as `bpftool map show pinned` gives it (`id`, `bytes_key`,
/// `bytes_value`, `max_entries`, `type`...).
///
/// # Errors
/// `bpftool` fails.
pub fn pinned_map(dir: &Path, name: &str) -> Result<Value> {
    let path = dir.join(name).display().to_string();
    Ok(serde_json::from_str(&crate::sh(
        "bpftool",
        &["-j", "map", "show", "pinned", &path],
    )?)?)
}

/// The `u64` at slot `slot` of the array map pinned at `dir/name` (little-endian value bytes,
/// as this machine's kernel stores them).
///
/// # Errors
/// `bpftool` fails or the value is not 8 bytes.
pub fn pinned_u64(dir: &Path, name: &str, slot: u32) -> Result<u64> {
    let path = dir.join(name).display().to_string();
    let key: Vec<String> = slot.to_le_bytes().iter().map(u8::to_string).collect();
    let mut args = vec!["-j", "map", "lookup", "pinned", &path, "key"];
    args.extend(key.iter().map(String::as_str));
    let v: Value = serde_json::from_str(&crate::sh("bpftool", &args)?)?;
    let bytes: Vec<u8> = v["value"]
        .as_array()
        .context("value bytes")?
        .iter()
        .filter_map(|b| u8::from_str_radix(b.as_str()?.trim_start_matches("0x"), 16).ok())
        .collect();
    let word: [u8; 8] = bytes
        .as_slice()
        .try_into()
        .with_context(|| format!("value of {v}"))?;
    Ok(u64::from_le_bytes(word))
}
