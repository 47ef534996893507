//! `cargo xtask bench [--quick]`: every scenario run side by side for a direct connection, lb
//! with each data path, lb with connect-time forwarding, HAProxy and nginx, alternating run by
//! run; medians and ranges go to `bench/results/` as markdown, JSON and SVG charts.
//! `--only soak` runs the churn soak instead ([`soak`]).

mod contenders;
mod procfs;
mod report;
mod scenarios;
mod soak;

use std::{
    fmt::Write as _,
    io::Write as _,
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use serde_json::{Value, json};

use crate::util::root;
use contenders::{Cgroups, Kind};
use report::Results;

/// Sizes and counts of one bench run.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Options {
    /// Smoke run: fewer, shorter runs; results go to `bench/results/raw/` only.
    pub quick: bool,
    /// Measured runs per contender of scenarios 1-4 (plus one warm-up run).
    pub runs: usize,
    /// Runs per contender of the 10,000-connection, failover, upgrade and crash scenarios (5-9).
    pub heavy_runs: usize,
    /// Bytes per 1-connection bulk run (8-connection runs carry the same total).
    pub bulk_bytes: u64,
    /// Round trips per request/response run.
    pub rr_count: u32,
    /// Length of one new-connections run (ms).
    pub cps_ms: u64,
    /// Idle connections of scenarios 5 and 7.
    pub idle_conns: u32,
    /// Long-lived clients of scenario 6.
    pub holders: u32,
}

impl Options {
    /// The full run (about 10 minutes on 2 cores) or the quick smoke run (about 1 minute).
    pub fn new(quick: bool) -> Options {
        if quick {
            Options {
                quick,
                runs: 1,
                heavy_runs: 1,
                bulk_bytes: 128 << 20,
                rr_count: 2_000,
                cps_ms: 300,
                idle_conns: 1_000,
                holders: 4,
            }
        } else {
            Options {
                quick,
                runs: 5,
                heavy_runs: 5,
                bulk_bytes: 512 << 20,
                rr_count: 20_000,
                cps_ms: 2_000,
                idle_conns: 10_000,
                holders: 10,
            }
        }
    }
}

/// Every client result line of a run, appended to `bench/results/raw/<stamp>.jsonl`.
pub struct Raw {
    file: std::fs::File,
}

impl Raw {
    /// Log one client result.
    pub fn log(&mut self, kind: Kind, action: &[&str], v: &Value) {
        let line = json!({"contender": kind.name(), "action": action.join(" "), "result": v});
        let _ = writeln!(self.file, "{line}");
    }
}

fn first_line(cmd: &str, args: &[&str]) -> String {
    std::process::Command::new(cmd)
        .args(args)
        .output()
        .map(|o| {
            let text = if o.stdout.is_empty() {
                o.stderr
            } else {
                o.stdout
            };
            String::from_utf8_lossy(&text)
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_string()
        })
        .unwrap_or_default()
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn machine(quick: bool) -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or("?", |(_, m)| m.trim())
        .to_string();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_kib: u64 = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0);
    json!({
        "cpu_model": model,
        "cpus": cpus,
        "mem_gib": (mem_kib as f64 / 1048576.0).round(),
        "kernel": first_line("uname", &["-r"]),
        "haproxy": first_line("haproxy", &["-v"]).split(" - ").next().unwrap_or("").to_string(),
        "nginx": first_line("nginx", &["-v"]).trim_start_matches("nginx version: ").to_string(),
        "date": first_line("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
        "load_start": loadavg(),
        "mode": if quick { "quick" } else { "full" },
    })
}

/// Raise this process's open-files limit to its hard limit (lb, the servers and the clients
/// inherit it) and return it. Raising the hard limit itself needs CAP_SYS_RESOURCE, which
/// containers often lack, so the bench fits itself under whatever limit it finds.
fn raise_nofile() -> Result<u64> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).context("raising RLIMIT_NOFILE")?;
    }
    Ok(hard)
}

/// Run scenario `name` and print how long it took.
fn scenario(name: &str, f: impl FnOnce() -> Result<()>) -> Result<()> {
    let t = Instant::now();
    let r = f();
    eprintln!("bench: {name} took {:.0} s", t.elapsed().as_secs_f64());
    r
}

/// Measured runs per contender of `--only bulk`.
const BULK_ONLY_RUNS: usize = 15;

/// Run the benchmark with the `lb` and `lbt` of `bins` (a release build's directory) and write
/// its results.
///
/// # Errors
/// Not root, a contender that does not start, a failing client, or (quick) a contender missing
/// from the results.
pub fn run(quick: bool, only: Option<&str>, bins: &std::path::Path) -> Result<()> {
    let started = Instant::now();
    lb_tests::set_bin_dir(bins.to_path_buf());
    ensure!(
        lb_tests::is_root(),
        "the bench needs root (network namespaces, BPF)"
    );
    for tool in ["haproxy", "nginx"] {
        ensure!(
            !first_line(tool, &["-v"]).is_empty(),
            "{tool} is not installed (cargo xtask setup installs it)"
        );
    }
    if only == Some("soak") {
        return soak::run(&root().join("bench/results/soak"));
    }
    let mut opts = Options::new(quick);
    let files = raise_nofile()?;
    // A proxy holds two files per connection; without CAP_SYS_RESOURCE the hard limit caps
    // the idle connections below 10,000 (a 20,000 limit gives 9,000).
    let fit = u32::try_from(files.saturating_sub(1500) / 2 / 500 * 500).unwrap_or(u32::MAX);
    if fit < opts.idle_conns {
        eprintln!(
            "bench: open-files hard limit {files}: scenarios 5 and 7 use {fit} connections, not {}",
            opts.idle_conns
        );
        opts.idle_conns = fit;
    }
    let mut machine = machine(quick);
    let out_dir = root().join("bench/results");
    let raw_dir = out_dir.join("raw");
    std::fs::create_dir_all(&raw_dir)?;
    let stamp = first_line("date", &["-u", "+%Y%m%dT%H%M%SZ"]);
    let raw_path = raw_dir.join(format!(
        "{stamp}-{}.jsonl",
        if quick { "quick" } else { "full" }
    ));
    let mut raw = Raw {
        file: std::fs::File::create(&raw_path)?,
    };
    eprintln!(
        "bench: {} run, raw results in {}",
        machine["mode"],
        raw_path.display()
    );

    // lb connect keeps serving through a crash only with its programs pinned: without a bpffs
    // on this machine, the bench mounts one of its own (private to it and its children).
    if lb_tests::bpffs_mount().is_none() {
        let at = lb_tests::private_bpffs()?;
        eprintln!(
            "bench: no bpffs mounted; using one of the bench's own at {}",
            at.display()
        );
    }
    let mut hosts = scenarios::Hosts::new()?;
    let cgroups = Cgroups {
        bpf: lb_tests::TestCgroup::new()?,
        connect: lb_tests::TestCgroup::new()?,
        plain: lb_tests::TestCgroup::new()?,
    };
    let mut res = Results::default();
    let all = only.is_none();
    if all {
        scenario("scenarios 1-4", || {
            scenarios::steady(&opts, &hosts, &cgroups, &mut res, &mut raw, false)
        })?;
    }
    if only == Some("bulk") {
        // Bulk alone, with three times the runs: direct and lb connect differ by less than
        // one run's spread, and only more runs tell a real difference from noise.
        opts.runs = BULK_ONLY_RUNS;
        scenario("scenarios 1+4", || {
            scenarios::steady(&opts, &hosts, &cgroups, &mut res, &mut raw, true)
        })?;
    }
    if all || only == Some("kill") {
        scenario("scenarios 5+7", || {
            scenarios::idle_and_kill(&opts, &mut hosts, &cgroups, &mut res, &mut raw)
        })?;
    }
    if all {
        scenario("scenario 6", || {
            scenarios::failover(&opts, &mut hosts, &cgroups, &mut res, &mut raw)
        })?;
    }
    if all || only == Some("upgrade") {
        scenario("scenario 8", || {
            scenarios::upgrade(&opts, &hosts, &cgroups, &mut res, &mut raw)
        })?;
    }
    if all || only == Some("crash") {
        scenario("scenario 9", || {
            scenarios::crash(&opts, &hosts, &cgroups, &mut res, &mut raw)
        })?;
    }
    drop(hosts);
    machine["load_end"] = json!(loadavg());
    machine["duration_s"] = json!(started.elapsed().as_secs());

    let options = serde_json::to_value(&opts)?;
    let header = format!(
        "## Benchmark: lb (splice, copy, connect-time) next to a direct connection, HAProxy and nginx\n\n\
         `cargo xtask bench{}{}`: {} measured runs per contender of scenarios 1-4 after a warm-up, \
         {} of scenarios 5-9, contenders alternating run by run; took {} s.",
        if quick { " --quick" } else { "" },
        only.map(|o| format!(" --only {o}")).unwrap_or_default(),
        opts.runs,
        opts.heavy_runs,
        started.elapsed().as_secs()
    );
    let md = report::markdown(&res, &machine, &header, opts.idle_conns);
    let js = report::json(&res, &machine, &options, opts.idle_conns);
    let dir: PathBuf = if let Some(name) = only {
        raw_dir.join(name)
    } else if quick {
        raw_dir.join("quick")
    } else {
        out_dir
    };
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("latest.md"), &md)?;
    std::fs::write(
        dir.join("latest.json"),
        serde_json::to_string_pretty(&js)? + "\n",
    )?;
    let charts = report::charts(&res, &dir, opts.idle_conns)?;
    println!("{md}");
    let mut files = String::new();
    for f in ["latest.md", "latest.json"]
        .iter()
        .map(|s| s.to_string())
        .chain(charts)
    {
        let _ = write!(files, " {f}");
    }
    eprintln!(
        "bench: wrote{files} in {} ({:.0} s)",
        dir.display(),
        started.elapsed().as_secs_f64()
    );
    let seen = res.kinds_seen();
    let mut missing = res.missing();
    if let Some(name) = only {
        missing.retain(|m| m.starts_with(name));
        if !missing.is_empty() {
            bail!("bench: contenders without results: {missing:?}");
        }
    } else if seen.len() != Kind::ALL.len() || !missing.is_empty() {
        bail!("bench: contenders without results: {missing:?}");
    }
    if !quick && started.elapsed() > Duration::from_secs(15 * 60) {
        eprintln!("bench: warning: the full run took longer than 15 minutes");
    }
    Ok(())
}
