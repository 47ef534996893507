//! `cargo xtask bench --only soak`: the churn soak. For each forwarding mode (splice and
//! connect-time) one lb carries two balancers: `streams`, in front of one server nobody touches,
//! with long byte-exact echo streams (as many as the open-files limit allows, at most
//! [`MAX_STREAMS`]), and `churn`, in front of four servers whose set changes every second (a
//! server removed and added back, drained and enabled, its connections killed, blackholed and
//! back), with a million or more short connections through it. lb's RSS, open descriptors,
//! runtime tasks and BPF map entries, and the kernel's TCP socket memory, are sampled every
//! second. The baseline is read after a warm-up of the same workload ([`WARM_UP`]) has ended and
//! lb has given its freed memory back once, so what lb sizes to its peak is in it; the end value
//! is read [`DRAIN`] after the soak, once TIME_WAIT has drained. Each must be within
//! [`TOLERANCE`] of its baseline (a drop is fine; the maps keyed by server, balancer or listener
//! may gain one entry per server), and the streams must end with every byte checked, or the run
//! fails. Results and a chart go to `bench/results/soak/`.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::SocketAddr,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use lb_tests::{Holder, Host, Lb, Place, TestCgroup, Toml, free_port, http_request, run_client};
use serde::Serialize;
use serde_json::{Value, json};

use super::procfs::tcp_socket_memory;

/// The most long streams (today's open-files limits allow about 9,000 with lb holding two
/// descriptors for each in the splice mode).
const MAX_STREAMS: u64 = 9_000;
/// Short connections per mode the soak aims at.
const SHORT_TARGET: u64 = 1_000_000;
/// Bounds of one mode's soak (it is sized from the warm-up's connection rate, with a margin for
/// the slower rate under the set changes, to reach [`SHORT_TARGET`]).
const SOAK_MIN: Duration = Duration::from_secs(120);
const SOAK_MAX: Duration = Duration::from_secs(300);
/// Length of the warm-up, the same workload as the soak.
const WARM_UP: Duration = Duration::from_secs(30);
/// How long after the soak the end values are read: TIME_WAIT lasts 60 s on Linux
/// (`TCP_TIMEWAIT_LEN`, include/net/tcp.h).
const DRAIN: Duration = Duration::from_secs(60);
/// How far above its baseline an end value may be.
const TOLERANCE: f64 = 0.05;
/// Length of one `lbt cps` run of the churn, in milliseconds.
const CHURN_CHUNK_MS: u64 = 10_000;
/// Server port of every host.
const PORT: u16 = 9000;

/// One reading of everything the soak watches.
#[derive(Clone, Debug, Default, Serialize)]
struct Sample {
    /// Seconds since the mode's soak started (negative: before).
    t: f64,
    rss_kib: u64,
    /// The anonymous part of `rss_kib` (heap and stacks: what lb allocated); the rest is
    /// file-backed (the binary's pages that ran).
    rss_anon_kib: u64,
    fds: u64,
    tasks: u64,
    /// Entries of lb's per-connection maps ([`PER_CONNECTION_MAPS`]), summed.
    map_entries: u64,
    /// Entries of lb's other hash maps (keyed by server, balancer or listener), summed.
    table_entries: u64,
    /// Memory the kernel charges to the TCP sockets of the host and the soak's hosts
    /// ([`tcp_socket_memory`]).
    socket_bytes: u64,
}

impl Sample {
    fn read(lb: &Lb, hosts: &Hosts, t: f64) -> Result<Sample> {
        let pid = lb.pid();
        let maps = map_entries(pid)?;
        Ok(Sample {
            t,
            rss_kib: lb_tests::rss_kib(pid)?,
            rss_anon_kib: lb_tests::rss_anon_kib(pid)?,
            fds: lb_tests::open_fds(pid)? as u64,
            tasks: lb.metric("lb_runtime_alive_tasks", "") as u64,
            map_entries: per_connection(&maps),
            table_entries: maps.values().sum::<usize>() as u64 - per_connection(&maps),
            socket_bytes: tcp_socket_memory(&hosts.namespaces())?,
        })
    }

    /// The named values, in report order.
    fn values(&self) -> [(&'static str, u64); 6] {
        [
            ("rss_kib", self.rss_kib),
            ("rss_anon_kib", self.rss_anon_kib),
            ("fds", self.fds),
            ("tasks", self.tasks),
            ("map_entries", self.map_entries),
            ("socket_bytes", self.socket_bytes),
        ]
    }
}

/// The smallest of each value over `n` readings a second apart (a health check's socket or a
/// scrape's task that happens to be open is not a leak).
fn settled(lb: &Lb, hosts: &Hosts, t: f64, n: usize) -> Result<Sample> {
    let mut min: Option<Sample> = None;
    for i in 0..n {
        if i > 0 {
            std::thread::sleep(Duration::from_secs(1));
        }
        let s = Sample::read(lb, hosts, t)?;
        min = Some(match min {
            None => s,
            Some(m) => Sample {
                t,
                rss_kib: m.rss_kib.min(s.rss_kib),
                rss_anon_kib: m.rss_anon_kib.min(s.rss_anon_kib),
                fds: m.fds.min(s.fds),
                tasks: m.tasks.min(s.tasks),
                map_entries: m.map_entries.min(s.map_entries),
                table_entries: m.table_entries.min(s.table_entries),
                socket_bytes: m.socket_bytes.min(s.socket_bytes),
            },
        });
    }
    min.context("no reading")
}

/// lb's maps with an entry per connection (as `bpftool` names them: the kernel keeps 15
/// characters of a map's name). Its other hash maps hold an entry per server, balancer or
/// listener of the configuration.
const PER_CONNECTION_MAPS: [&str; 6] = [
    "LB_CLIENTS",
    "LB_SERVERS",
    "LB_NETNS",
    "LB_FLOWS",
    "LB_PAIRS",
    "LB_CONNECT_SOCK",
];

/// The servers of the soak's configuration (one for the streams, four for the churn): each may
/// hold an entry in each server-keyed map once a connection went to it.
const SERVERS: u64 = 5;

fn per_connection(maps: &BTreeMap<String, usize>) -> u64 {
    maps.iter()
        .filter(|(name, _)| PER_CONNECTION_MAPS.contains(&name.as_str()))
        .map(|(_, n)| *n as u64)
        .sum()
}

/// Entries of each hash-type map lb holds (found through its map descriptors), by name.
/// Arrays (fixed size) and ring buffers are left out.
fn map_entries(pid: u32) -> Result<BTreeMap<String, usize>> {
    let mut out = BTreeMap::new();
    for fd in std::fs::read_dir(format!("/proc/{pid}/fdinfo"))? {
        let info = std::fs::read_to_string(fd?.path()).unwrap_or_default();
        let field = |k: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(k))
                .map(|v| v.trim().to_string())
        };
        let (Some(id), Some(ty)) = (field("map_id:"), field("map_type:")) else {
            continue;
        };
        // BPF_MAP_TYPE_HASH 1, LRU_HASH 9, SOCKHASH 18 (include/uapi/linux/bpf.h).
        if !matches!(ty.as_str(), "1" | "9" | "18") {
            continue;
        }
        let show: Value =
            serde_json::from_str(&lb_tests::sh("bpftool", &["-j", "map", "show", "id", &id])?)?;
        let name = show["name"].as_str().unwrap_or("?").to_string();
        let n = if ty == "18" {
            // A sockhash's values are sockets; bpftool lists its keys.
            lb_tests::sh("bpftool", &["map", "dump", "id", &id])?
                .lines()
                .filter(|l| l.starts_with("key:"))
                .count()
        } else {
            let dump: Value =
                serde_json::from_str(&lb_tests::sh("bpftool", &["-j", "map", "dump", "id", &id])?)?;
            dump.as_array().map_or(0, Vec::len)
        };
        *out.entry(name).or_default() += n;
    }
    Ok(out)
}

/// The hosts: one for the streams, four for the churn.
struct Hosts {
    streams: Host,
    churn: Vec<Host>,
}

impl Hosts {
    /// Their network namespaces' names.
    fn namespaces(&self) -> Vec<&str> {
        std::iter::once(&self.streams)
            .chain(&self.churn)
            .map(|h| h.ns.as_str())
            .collect()
    }
}

/// One mode's outcome.
#[derive(Debug, Serialize)]
struct ModeResult {
    mode: &'static str,
    streams: u64,
    stream_bytes: u64,
    short_connections: u64,
    short_failed: u64,
    soak_s: f64,
    set_changes: u64,
    refused_changes: u64,
    baseline: Sample,
    end: Sample,
    /// Entries of each map at the baseline and at the end.
    baseline_maps: BTreeMap<String, usize>,
    end_maps: BTreeMap<String, usize>,
    series: Vec<Sample>,
    /// Values more than [`TOLERANCE`] above their baseline.
    over: Vec<String>,
}

/// Run the soak in both modes and write `bench/results/soak/`.
///
/// # Errors
/// A host, lb or client that does not start, streams that lose a byte, or an end value over
/// its baseline by more than [`TOLERANCE`].
pub fn run(out_dir: &Path) -> Result<()> {
    let files = super::raise_nofile()?;
    // The streams client holds one descriptor per stream, the streams server one, lb two.
    let streams = MAX_STREAMS.min(files.saturating_sub(2_000) / 2 / 500 * 500);
    let hosts = Hosts {
        streams: Host::serving(PORT, "streams")?,
        churn: lb_tests::serving_hosts(4, PORT, |i| format!("c{i}"))?,
    };
    let mut results = Vec::new();
    for mode in ["splice", "connect"] {
        let r = soak_mode(mode, &hosts, streams).with_context(|| format!("soak, {mode}"))?;
        results.push(r);
    }
    std::fs::create_dir_all(out_dir)?;
    let md = markdown(&results);
    std::fs::write(out_dir.join("latest.md"), &md)?;
    std::fs::write(
        out_dir.join("latest.json"),
        serde_json::to_string_pretty(&json!({ "modes": results }))? + "\n",
    )?;
    chart(&results, &out_dir.join("soak.svg"))?;
    println!("{md}");
    let over: Vec<String> = results
        .iter()
        .flat_map(|r| r.over.iter().map(move |o| format!("{}: {o}", r.mode)))
        .collect();
    ensure!(
        over.is_empty(),
        "soak: above the baseline by more than {:.0} %: {}",
        TOLERANCE * 100.0,
        over.join("; ")
    );
    Ok(())
}

fn config(mode: &str, cg: &TestCgroup, hosts: &Hosts, listen: [SocketAddr; 2]) -> Toml {
    let churn: Vec<String> = hosts
        .churn
        .iter()
        .map(|h| format!("\"{}\"", h.addr(PORT)))
        .collect();
    Toml::new()
        .table("datapath")
        .string("mode", "bpf")
        .string("cgroup", &cg.path.display().to_string())
        .array_table("balancer")
        .string("name", "streams")
        .value("listen", format!("[\"{}\"]", listen[0]))
        .value("servers", format!("[\"{}\"]", hosts.streams.addr(PORT)))
        .string("forwarding", mode)
        // The soak looks for leaks, not for false failures: while its thousands of streams
        // connect at once, the server's accept queue overflows, a check's SYN can be dropped
        // and resent only after 1 s, and one failed check (K3s's fall of 1) would kill them all.
        .table("balancer.health")
        .value("fall", 3)
        .array_table("balancer")
        .string("name", "churn")
        .value("listen", format!("[\"{}\"]", listen[1]))
        .value("servers", format!("[{}]", churn.join(", ")))
        .string("forwarding", mode)
        .table("balancer.health")
        .string("kind", "tcp")
        .string("interval", "200ms")
        .string("timeout", "200ms")
        .value("rise", 1)
        .value("fall", 1)
}

/// Short connections through `addr` for `ms`: (made, failed).
fn churn(place: &Place<'_>, addr: SocketAddr, ms: u64) -> Result<(u64, u64)> {
    let v = run_client(
        place,
        addr,
        &["cps", &ms.to_string(), "--workers", "2"],
        Duration::from_millis(ms) + Duration::from_secs(60),
    )?;
    let n = v["conns"].as_u64().unwrap_or(0);
    let failed = v["failed"].as_u64().unwrap_or(0);
    Ok((n, failed))
}

/// The soak's workload for `length`: the long streams through `listen[0]`, short connections
/// through `listen[1]`, a change of the churn balancer's set every second, and a reading every
/// second (its time counted from `t0`).
struct Phase {
    short_made: u64,
    short_failed: u64,
    /// Bytes the long streams checked.
    stream_bytes: u64,
    changes: u64,
    refused: u64,
    secs: f64,
}

/// One mode's lb and where its clients go.
struct Rig<'a> {
    lb: &'a Lb,
    hosts: &'a Hosts,
    cg: &'a Path,
    /// The `streams` and `churn` listeners.
    listen: [SocketAddr; 2],
    streams: u64,
}

fn phase(rig: &Rig<'_>, length: Duration, series: &mut Vec<Sample>, t0: Instant) -> Result<Phase> {
    let Rig {
        lb,
        hosts,
        cg,
        listen,
        streams,
    } = *rig;
    let place = Place::cgroup(cg);
    let long = Holder::spawn(
        &place,
        listen[0],
        &[
            "streams",
            &streams.to_string(),
            &length.as_millis().to_string(),
        ],
    )?;
    long.wait_for("ready", Duration::from_secs(120))?;
    let start = Instant::now();
    let churner = {
        let cg = cg.to_path_buf();
        let addr = listen[1];
        std::thread::spawn(move || -> Result<(u64, u64)> {
            let (mut made, mut failed) = (0, 0);
            while start.elapsed() < length {
                let left = length.saturating_sub(start.elapsed()).as_millis() as u64;
                let (m, f) = churn(&Place::cgroup(&cg), addr, left.clamp(1_000, CHURN_CHUNK_MS))?;
                made += m;
                failed += f;
            }
            Ok((made, failed))
        })
    };
    let (mut changes, mut refused) = (0u64, 0u64);
    let mut next = start;
    while start.elapsed() < length {
        match change(lb, hosts, changes) {
            Ok(true) => {}
            Ok(false) => refused += 1,
            Err(e) => bail!("set change {changes}: {e:#}"),
        }
        changes += 1;
        series.push(Sample::read(lb, hosts, t0.elapsed().as_secs_f64())?);
        next += Duration::from_secs(1);
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
    // Whatever the cycle was at, the set ends as it began.
    hosts.churn[0].blackhole(false)?;
    for (method, path, body) in [
        (
            "POST",
            "/balancers/churn/servers",
            Some(json!({ "server": hosts.churn[3].addr(PORT).to_string() }).to_string()),
        ),
        (
            "POST",
            &format!(
                "/balancers/churn/servers/{}/enable",
                hosts.churn[1].addr(PORT)
            ),
            None,
        ),
    ] {
        let _ = http_request(lb.admin, method, path, body.as_deref());
    }
    let (short_made, short_failed) = churner
        .join()
        .map_err(|_| anyhow::anyhow!("the churn thread panicked"))??;
    let secs = start.elapsed().as_secs_f64();
    let done = long.next(Duration::from_secs(120))?;
    ensure!(
        done["ok"] == true,
        "long streams lost or reordered bytes: {done}"
    );
    Ok(Phase {
        short_made,
        short_failed,
        stream_bytes: done["bytes"].as_u64().unwrap_or(0),
        changes,
        refused,
        secs,
    })
}

fn soak_mode(mode: &'static str, hosts: &Hosts, streams: u64) -> Result<ModeResult> {
    let cg = TestCgroup::new()?;
    let listen = [
        format!("127.0.0.1:{}", free_port()?).parse()?,
        format!("127.0.0.1:{}", free_port()?).parse()?,
    ];
    let dir = lb_tests::TempDir::new("lb-soak")?;
    let file = dir.join("lb.toml");
    std::fs::write(&file, config(mode, &cg, hosts, listen).text())?;
    let lb = Lb::start(&["--config", &file.display().to_string()])?;
    lb.wait_settled(Duration::from_secs(15))?;

    // The warm-up: the same workload for WARM_UP, so every structure lb sizes to its peak (a
    // map's capacity, the runtime's slabs) is already at it; then 35 s of rest and the
    // baseline. What the soak adds beyond it grows with the work: a leak.
    let t0 = Instant::now();
    let mut series = Vec::new();
    let rig = Rig {
        lb: &lb,
        hosts,
        cg: &cg.path,
        listen,
        streams,
    };
    let warm = phase(&rig, WARM_UP, &mut series, t0)?;
    std::thread::sleep(Duration::from_secs(35));
    let baseline = settled(&lb, hosts, t0.elapsed().as_secs_f64(), 5)?;
    let baseline_maps = map_entries(lb.pid())?;
    series.push(baseline.clone());
    let rate = warm.short_made as f64 / warm.secs.max(1.0);
    let soak = Duration::from_secs_f64((SHORT_TARGET as f64 / rate.max(1.0)) * 1.1)
        .clamp(SOAK_MIN, SOAK_MAX);
    eprintln!(
        "soak {mode}: {streams} streams, {rate:.0} short connections/s in the warm-up, soaking {:.0} s",
        soak.as_secs_f64()
    );
    let run = phase(&rig, soak, &mut series, t0)?;
    let drained = Instant::now() + DRAIN;
    while Instant::now() < drained {
        std::thread::sleep(Duration::from_secs(5));
        series.push(Sample::read(&lb, hosts, t0.elapsed().as_secs_f64())?);
    }
    let end = settled(&lb, hosts, t0.elapsed().as_secs_f64(), 5)?;
    let end_maps = map_entries(lb.pid())?;
    series.push(end.clone());
    let mut over: Vec<String> = baseline
        .values()
        .iter()
        .zip(end.values())
        .filter(|((_, b), (_, e))| (*e as f64) > *b as f64 * (1.0 + TOLERANCE))
        .map(|((name, b), (_, e))| format!("{name} {b} -> {e}"))
        .collect();
    if end.table_entries > baseline.table_entries + SERVERS {
        over.push(format!(
            "table_entries {} -> {} (more than one more per server)",
            baseline.table_entries, end.table_entries
        ));
    }
    Ok(ModeResult {
        mode,
        streams,
        stream_bytes: run.stream_bytes,
        short_connections: run.short_made,
        short_failed: run.short_failed,
        soak_s: run.secs,
        set_changes: run.changes,
        refused_changes: run.refused,
        baseline,
        end,
        baseline_maps,
        end_maps,
        series,
        over,
    })
}

/// The `i`-th change of the churn balancer's set, in a cycle of eight seconds: remove `c3`,
/// add it back, drain `c1`, enable it, kill `c2`'s connections, blackhole `c0`, (wait), lift
/// the blackhole. Ok(false) when the API refused the change.
fn change(lb: &Lb, hosts: &Hosts, i: u64) -> Result<bool> {
    let addr = |k: usize| hosts.churn[k].addr(PORT).to_string();
    let base = "/balancers/churn/servers";
    let (method, path, body) = match i % 8 {
        0 => ("DELETE", format!("{base}/{}", addr(3)), None),
        1 => (
            "POST",
            base.to_string(),
            Some(json!({ "server": addr(3) }).to_string()),
        ),
        2 => ("POST", format!("{base}/{}/drain", addr(1)), None),
        3 => ("POST", format!("{base}/{}/enable", addr(1)), None),
        4 => ("POST", format!("{base}/{}/kill", addr(2)), None),
        5 => {
            hosts.churn[0].blackhole(true)?;
            return Ok(true);
        }
        7 => {
            hosts.churn[0].blackhole(false)?;
            return Ok(true);
        }
        _ => return Ok(true),
    };
    let (code, answer) = http_request(lb.admin, method, &path, body.as_deref())?;
    if !(200..300).contains(&code) {
        eprintln!("soak: {method} {path}: {code} {answer}");
        return Ok(false);
    }
    Ok(true)
}

fn markdown(results: &[ModeResult]) -> String {
    let mut md = String::from(
        "## Churn soak\n\n`cargo xtask bench --only soak`: per forwarding mode, long byte-exact \
         streams through one balancer and short connections through another whose server set \
         changes every second. Baseline 35 s after a 30 s warm-up of the same workload; end 60 s after the soak \
         (the smaller of 5 readings a second apart for each).\n\n\
         | mode | streams | bytes checked | short connections | failed | soak s | set changes | value | baseline | end | change |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for r in results {
        for ((name, b), (_, e)) in r.baseline.values().iter().zip(r.end.values()) {
            let pct = if *b == 0 {
                if e == 0 { 0.0 } else { f64::INFINITY }
            } else {
                (e as f64 / *b as f64 - 1.0) * 100.0
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {:.0} | {} ({} refused) | {name} | {b} | {e} | {pct:+.1} % |",
                r.mode,
                r.streams,
                r.stream_bytes,
                r.short_connections,
                r.short_failed,
                r.soak_s,
                r.set_changes,
                r.refused_changes
            );
        }
    }
    for r in results {
        let maps: Vec<String> = r
            .baseline_maps
            .keys()
            .chain(r.end_maps.keys())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .map(|m| {
                let (b, e) = (
                    r.baseline_maps.get(m).copied().unwrap_or(0),
                    r.end_maps.get(m).copied().unwrap_or(0),
                );
                format!("`{m}` {b} → {e}")
            })
            .collect();
        let _ = writeln!(
            md,
            "\n{} map entries, baseline → end: {}",
            r.mode,
            maps.join(", ")
        );
    }
    md
}

/// RSS and map entries over time, one line per mode.
fn chart(results: &[ModeResult], path: &Path) -> Result<()> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (920, 360)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 2));
    let t_max = results
        .iter()
        .flat_map(|r| r.series.iter().map(|s| s.t))
        .fold(1.0, f64::max);
    for (area, (title, get)) in panels.iter().zip([
        (
            "lb RSS (MiB)",
            (|s: &Sample| s.rss_kib as f64 / 1024.0) as fn(&Sample) -> f64,
        ),
        ("BPF map entries", |s: &Sample| s.map_entries as f64),
    ]) {
        let y_max = results
            .iter()
            .flat_map(|r| r.series.iter().map(get))
            .fold(1.0, f64::max)
            * 1.1;
        let mut c = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0..t_max, 0.0..y_max)?;
        c.configure_mesh().x_desc("s").draw()?;
        for (i, r) in results.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            c.draw_series(LineSeries::new(
                r.series.iter().map(|s| (s.t, get(s))),
                color,
            ))?
            .label(r.mode)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color));
        }
        c.configure_series_labels().border_style(BLACK).draw()?;
    }
    root.present()?;
    Ok(())
}
