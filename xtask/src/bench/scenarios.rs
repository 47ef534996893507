//! The scenarios. Each one runs every contender it applies to, alternating the order run by run,
//! and adds samples to [`Results`].

use std::{
    io::{BufRead as _, BufReader},
    net::SocketAddr,
    path::Path,
    process::{Child, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use lb_tests::{Host, Place, client_command, run_client};
use serde_json::Value;

use super::{
    Options, Raw,
    contenders::{Cgroups, Kind, Running},
    procfs::{children_cpu_secs, cpu_jiffies, kernel_socket_bytes},
    report::Results,
};

const GIB: f64 = (1u64 << 30) as f64;
const CLIENT_TIMEOUT: Duration = Duration::from_secs(180);

/// The test hosts: `a` preferred, `b` the backup, both serving `lbt`.
pub struct Hosts {
    /// Preferred server, named `a`.
    pub a: Host,
    /// Backup server, named `b`.
    pub b: Host,
    /// The port `a` serves on now: a new one after every [`Hosts::reset_a`], so the thousands
    /// of TIME_WAIT sockets the previous contender left toward `a` do not slow the next one's
    /// connects (the kernel searches past them for a free source port).
    port_a: u16,
}

/// Port the servers listen on.
pub const PORT: u16 = 9000;

impl Hosts {
    /// Two hosts in fresh namespaces, serving.
    ///
    /// # Errors
    /// Namespace or server start failure.
    pub fn new() -> Result<Hosts> {
        let mut a = Host::new()?;
        a.serve(PORT, "a")?;
        let mut b = Host::new()?;
        b.serve(PORT, "b")?;
        Ok(Hosts { a, b, port_a: PORT })
    }

    /// Where `a` serves now.
    pub fn addr_a(&self) -> SocketAddr {
        self.a.addr(self.port_a)
    }

    /// Both servers, preferred first.
    pub fn servers(&self) -> Vec<SocketAddr> {
        vec![self.addr_a(), self.b.addr(PORT)]
    }

    /// Bring `a` back after a blackhole and restart its server, dropping whatever sockets it
    /// still held.
    ///
    /// # Errors
    /// `ip` or server start failure.
    pub fn reset_a(&mut self) -> Result<()> {
        self.a.blackhole(false)?;
        self.a.stop_servers();
        self.port_a = if self.port_a >= PORT + 999 {
            PORT + 1
        } else {
            self.port_a + 1
        };
        self.a.serve(self.port_a, "a")
    }
}

/// The order of contenders in run `i`: rotated so none always goes first.
fn order(kinds: &[Kind], i: usize) -> Vec<Kind> {
    let mut v = kinds.to_vec();
    if !v.is_empty() {
        let n = v.len();
        v.rotate_left(i % n);
    }
    v
}

fn place(cg: &Path) -> Place<'_> {
    Place::cgroup(cg)
}

fn client(
    raw: &mut Raw,
    kind: Kind,
    cg: &Path,
    addr: SocketAddr,
    action: &[&str],
) -> Result<Value> {
    let v = run_client(&place(cg), addr, action, CLIENT_TIMEOUT)?;
    raw.log(kind, action, &v);
    ensure!(v["ok"] == true, "{} {action:?}: {v}", kind.name());
    Ok(v)
}

/// Scenarios 1-4: bulk throughput (1 and 8 connections, each direction) with CPU per GiB and
/// softirq share from the 1-connection runs, then (unless `bulk_only`) 64-byte round trips and
/// new connections per second.
///
/// # Errors
/// A contender fails to start or a client fails.
pub fn steady(
    opts: &Options,
    hosts: &Hosts,
    cgroups: &Cgroups,
    res: &mut Results,
    raw: &mut Raw,
    bulk_only: bool,
) -> Result<()> {
    let servers = vec![hosts.addr_a()];
    let running: Vec<Running> = Kind::ALL
        .iter()
        .map(|&k| Running::start(k, &servers, cgroups))
        .collect::<Result<_>>()?;
    let kinds: Vec<Kind> = Kind::ALL.to_vec();
    let by_kind = |k: Kind| running.iter().find(|r| r.kind == k).expect("started");

    let one = opts.bulk_bytes;
    let eight = opts.bulk_bytes / 8;
    let bulk_cases: [(&str, &str, u32, u64); 4] = [
        ("up1", "up", 1, one),
        ("down1", "down", 1, one),
        ("up8", "up", 8, eight),
        ("down8", "down", 8, eight),
    ];
    eprintln!("bench: scenario 1+4 bulk ({} MiB per run)", one >> 20);
    for run in 0..=opts.runs {
        let warm = run == 0;
        for (id, dir, conns, n) in bulk_cases {
            for kind in order(&kinds, run) {
                let r = by_kind(kind);
                let cg = cgroups.for_kind(kind);
                let n = if warm { n / 8 } else { n };
                let (c0, p0, (s0, t0)) = (children_cpu_secs(), r.cpu_secs(), cpu_jiffies());
                let spliced0 = r.spliced_up_bytes();
                let v = client(
                    raw,
                    kind,
                    cg,
                    r.addr,
                    &["bulk", dir, &conns.to_string(), &n.to_string()],
                )?;
                let (c1, p1, (s1, t1)) = (children_cpu_secs(), r.cpu_secs(), cpu_jiffies());
                if warm {
                    continue;
                }
                let gbit = v["gbit_s"].as_f64().context("gbit_s")?;
                res.add(&format!("{id}_gbit"), kind, gbit);
                if let (Some(a), Some(b), "up", 1) = (spliced0, r.spliced_up_bytes(), dir, conns) {
                    let sent = v["bytes"].as_f64().context("bytes")?;
                    res.add("splice_share_up", kind, 100.0 * (b - a) / sent);
                }
                if conns == 1 {
                    let gib = v["bytes"].as_f64().unwrap_or(0.0) / GIB;
                    res.add(&format!("cpu_client_{dir}"), kind, (c1 - c0) / gib);
                    if kind.is_proxy() {
                        res.add(&format!("cpu_proxy_{dir}"), kind, (p1 - p0) / gib);
                    }
                    if t1 > t0 {
                        res.add(
                            &format!("softirq_{dir}"),
                            kind,
                            100.0 * (s1 - s0) as f64 / (t1 - t0) as f64,
                        );
                    }
                }
            }
        }
    }

    if bulk_only {
        return Ok(());
    }

    eprintln!(
        "bench: scenario 2 request/response ({} round trips)",
        opts.rr_count
    );
    for run in 0..=opts.runs {
        for kind in order(&kinds, run) {
            let r = by_kind(kind);
            let count = if run == 0 {
                opts.rr_count / 4
            } else {
                opts.rr_count
            };
            let v = client(
                raw,
                kind,
                cgroups.for_kind(kind),
                r.addr,
                &["rr", &count.to_string(), "64"],
            )?;
            if run > 0 {
                res.add("rr_p50_us", kind, v["p50_us"].as_f64().context("p50")?);
                res.add("rr_p99_us", kind, v["p99_us"].as_f64().context("p99")?);
            }
        }
    }

    eprintln!(
        "bench: scenario 3 new connections ({} ms per run)",
        opts.cps_ms
    );
    for run in 0..=opts.runs {
        for kind in order(&kinds, run) {
            let r = by_kind(kind);
            let ms = if run == 0 {
                opts.cps_ms / 4
            } else {
                opts.cps_ms
            };
            let v = client(
                raw,
                kind,
                cgroups.for_kind(kind),
                r.addr,
                &["cps", &ms.to_string(), "--workers", "2"],
            )?;
            if run > 0 {
                res.add("cps", kind, v["per_s"].as_f64().context("per_s")?);
            }
        }
    }
    Ok(())
}

/// A client process whose JSON lines are timestamped as they arrive.
struct Events {
    child: Child,
    rx: mpsc::Receiver<(Instant, Value)>,
}

impl Events {
    fn start(cg: &Path, addr: SocketAddr, action: &[&str]) -> Result<Events> {
        let mut child = client_command(&place(cg), addr, action)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let out = child.stdout.take().context("stdout")?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str::<Value>(&line)
                    && tx.send((Instant::now(), v)).is_err()
                {
                    return;
                }
            }
        });
        Ok(Events { child, rx })
    }

    /// The next event whose `event` is `kind` (or a final `ok: false` line) within `timeout`.
    fn wait_for(&self, kind: &str, timeout: Duration) -> Result<(Instant, Value)> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let (at, v) = self
                .rx
                .recv_timeout(left)
                .with_context(|| format!("no `{kind}` event within {timeout:?}"))?;
            if v["event"] == kind {
                return Ok((at, v));
            }
            if v["ok"] == false {
                bail!("client failed waiting for `{kind}`: {v}");
            }
        }
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Scenarios 5 and 7: open `opts.idle_conns` idle connections, measure the proxy's RSS and the
/// kernel's TCP memory, then (for contenders that check servers) blackhole the server and time
/// until every client socket is closed, overall and after the proxy marked the server down.
///
/// # Errors
/// A contender fails to start, a client fails, or the connections are not all ended in time.
pub fn idle_and_kill(
    opts: &Options,
    hosts: &mut Hosts,
    cgroups: &Cgroups,
    res: &mut Results,
    raw: &mut Raw,
) -> Result<()> {
    let n = opts.idle_conns.to_string();
    eprintln!("bench: scenarios 5+7 memory with {n} idle connections, then kill them");
    for run in 0..opts.heavy_runs {
        for kind in order(&Kind::ALL, run) {
            let r = Running::start(kind, &hosts.servers(), cgroups)?;
            let cg = cgroups.for_kind(kind);
            let (rss0, mem0) = (r.rss_bytes(), kernel_socket_bytes());
            let ev = Events::start(cg, r.addr, &["idle", &n, "--max-ms", "120000"])?;
            let (_, ready) = ev.wait_for("ready", Duration::from_secs(90))?;
            raw.log(kind, &["idle", &n], &ready);
            std::thread::sleep(Duration::from_millis(300));
            let (rss1, mem1) = (r.rss_bytes(), kernel_socket_bytes());
            const MIB: f64 = 1048576.0;
            if kind.is_proxy() {
                res.add("idle_rss_mib", kind, rss1 as f64 / MIB);
                res.add(
                    "idle_rss_delta_kib_per_conn",
                    kind,
                    (rss1.saturating_sub(rss0)) as f64 / 1024.0 / opts.idle_conns as f64,
                );
            }
            res.add(
                "idle_kernel_mib",
                kind,
                (mem1 as f64 - mem0 as f64).max(0.0) / MIB,
            );
            if kind.kills_sessions() {
                let t0 = Instant::now();
                hosts.a.blackhole(true)?;
                let mut down_at = None;
                let end = loop {
                    if t0.elapsed() > Duration::from_secs(30) {
                        bail!(
                            "{}: {n} connections not all ended within 30 s of the blackhole",
                            kind.name()
                        );
                    }
                    if down_at.is_none() && r.primary_down() == Some(true) {
                        down_at = Some(Instant::now());
                    }
                    match ev.rx.recv_timeout(Duration::from_millis(10)) {
                        Ok((at, v)) if v["event"] == "all_closed" => break (at, v),
                        Ok((_, v)) if v["ok"] == false => {
                            bail!("{}: idle client failed: {v}", kind.name())
                        }
                        _ => {}
                    }
                };
                raw.log(kind, &["idle-kill", &n], &end.1);
                res.add("kill_total_ms", kind, (end.0 - t0).as_secs_f64() * 1e3);
                if let Some(d) = down_at {
                    res.add(
                        "kill_after_down_ms",
                        kind,
                        end.0.saturating_duration_since(d).as_secs_f64() * 1e3,
                    );
                }
            }
            drop(ev);
            drop(r);
            hosts.reset_a()?;
        }
    }
    Ok(())
}

/// Clients that connect during a failover outage (one every 100 ms for 3 s).
const NEWCOMERS: u64 = 30;

/// Scenario 6: `opts.holders` long-lived clients on server `a`; `a` is blackholed; the time until
/// every client is connected to `b` again, and the longest wait of a client that connects during
/// the outage (connect to answered round trip).
///
/// # Errors
/// A contender fails to start or a client does not fail over within 20 s.
pub fn failover(
    opts: &Options,
    hosts: &mut Hosts,
    cgroups: &Cgroups,
    res: &mut Results,
    raw: &mut Raw,
) -> Result<()> {
    let kinds: Vec<Kind> = Kind::ALL
        .into_iter()
        .filter(|k| k.kills_sessions())
        .collect();
    eprintln!("bench: scenario 6 failover with {} clients", opts.holders);
    for run in 0..opts.heavy_runs {
        for kind in order(&kinds, run) {
            let r = Running::start(kind, &hosts.servers(), cgroups)?;
            let cg = cgroups.for_kind(kind);
            let holders: Vec<Events> = (0..opts.holders)
                .map(|_| {
                    Events::start(
                        cg,
                        r.addr,
                        &["hold", "--reconnect", "20", "--max-ms", "60000"],
                    )
                })
                .collect::<Result<_>>()?;
            for h in &holders {
                let (_, v) = h.wait_for("connected", Duration::from_secs(20))?;
                ensure!(v["server"] == "a", "{}: client landed on {v}", kind.name());
            }
            let t0 = Instant::now();
            hosts.a.blackhole(true)?;
            // Clients that connect during the outage: one every 100 ms for 3 s, each timed from
            // its start to its one answered round trip.
            let newcomers = {
                let (cg, addr) = (cg.to_path_buf(), r.addr);
                std::thread::spawn(move || -> Vec<(bool, Duration)> {
                    let clients: Vec<_> = (0..NEWCOMERS)
                        .map(|i| {
                            let cg = cg.clone();
                            let start = t0 + Duration::from_millis(100 * i);
                            std::thread::sleep(start.saturating_duration_since(Instant::now()));
                            std::thread::spawn(move || {
                                let began = Instant::now();
                                let v = run_client(
                                    &place(&cg),
                                    addr,
                                    &["rr", "1", "16"],
                                    Duration::from_secs(30),
                                );
                                let ok = v.is_ok_and(|v| v["ok"] == true);
                                (ok, began.elapsed())
                            })
                        })
                        .collect();
                    clients
                        .into_iter()
                        .map(|c| c.join().unwrap_or((false, Duration::from_secs(30))))
                        .collect()
                })
            };
            let mut worst = Duration::ZERO;
            for h in &holders {
                let deadline = t0 + Duration::from_secs(20);
                loop {
                    let left = deadline.saturating_duration_since(Instant::now());
                    let (at, v) = h
                        .wait_for("connected", left)
                        .with_context(|| format!("{}: a client did not fail over", kind.name()))?;
                    if v["server"] == "b" {
                        worst = worst.max(at - t0);
                        break;
                    }
                }
            }
            raw.log(
                kind,
                &["failover"],
                &serde_json::json!({"ms": worst.as_secs_f64() * 1e3}),
            );
            res.add("failover_ms", kind, worst.as_secs_f64() * 1e3);
            let waits = newcomers.join().unwrap_or_default();
            let served = waits.iter().filter(|(ok, _)| *ok).count();
            let longest = waits.iter().map(|(_, d)| *d).max().unwrap_or_default();
            raw.log(
                kind,
                &["failover-newcomers"],
                &serde_json::json!({"clients": waits.len(), "served": served,
                    "worst_ms": longest.as_secs_f64() * 1e3}),
            );
            res.add("newcomer_wait_ms", kind, longest.as_secs_f64() * 1e3);
            res.add("newcomers_unserved", kind, (waits.len() - served) as f64);
            drop(holders);
            drop(r);
            hosts.reset_a()?;
        }
    }
    Ok(())
}

/// Idle connections of scenario 8.
const UPGRADE_IDLE: u32 = 1_000;

/// Scenario 8: [`UPGRADE_IDLE`] idle connections and a connect loop (two workers, one round trip
/// per connection, 3 s) through the proxy while it is replaced 1 s into the loop: `lb upgrade`
/// for lb (both kernel data paths: splice and connect-time), the seamless reload for HAProxy (`-x` takes the listeners from the
/// old process's stats socket, `-sf` lets it finish). Reports the idle connections that ended,
/// the loop's connects that failed (refused or reset), and its longest connection.
///
/// # Errors
/// A contender fails to start or upgrade, or a client fails to run.
pub fn upgrade(
    opts: &Options,
    hosts: &Hosts,
    cgroups: &Cgroups,
    res: &mut Results,
    raw: &mut Raw,
) -> Result<()> {
    let kinds = [Kind::LbBpf, Kind::LbConnect, Kind::Haproxy];
    let n = UPGRADE_IDLE.min(opts.idle_conns);
    eprintln!("bench: scenario 8 upgrade with {n} idle connections and a connect loop");
    for run in 0..opts.heavy_runs {
        for kind in order(&kinds, run) {
            let mut l = Loaded::start(kind, hosts, cgroups, n, &["cps", "3000", "--workers", "2"])?;
            let took = l.r.upgrade()?;
            let (v, lost) = l.finish()?;
            raw.log(
                kind,
                &["upgrade"],
                &serde_json::json!({"loop": v, "lost": lost, "upgrade_ms": took.as_secs_f64() * 1e3}),
            );
            res.add("upgrade_lost", kind, lost as f64);
            res.add(
                "upgrade_refused",
                kind,
                v["failed"].as_f64().unwrap_or(f64::NAN),
            );
            res.add(
                "upgrade_longest_ms",
                kind,
                v["longest_ms"].as_f64().unwrap_or(f64::NAN),
            );
        }
    }
    Ok(())
}

/// Connections held through scenario 9.
const CRASH_HELD: u32 = 1_000;
/// Dials of scenario 9's connect loop, one every [`CRASH_DIAL_EVERY_MS`].
const CRASH_DIALS: u32 = 140;
/// Milliseconds between two dials of scenario 9's loop.
const CRASH_DIAL_EVERY_MS: u64 = 50;
/// How long the proxy stays dead in scenario 9 before it is started again.
const CRASH_DOWN: Duration = Duration::from_secs(2);

/// Scenario 9: [`CRASH_HELD`] held connections and a connect loop (a dial every 50 ms for 7 s,
/// each asking the server its name) while the proxy is killed with SIGKILL 1 s into the loop and
/// started again [`CRASH_DOWN`] later: lb on the same configuration and pin directory (a
/// connect-time lb adopts the pinned programs), HAProxy on the same configuration. Reports the
/// held connections that ended and the dials that were not served (refused, reset, or connected
/// without an answer).
///
/// # Errors
/// A contender fails to start or restart, or a client fails to run.
pub fn crash(
    opts: &Options,
    hosts: &Hosts,
    cgroups: &Cgroups,
    res: &mut Results,
    raw: &mut Raw,
) -> Result<()> {
    let kinds = [Kind::LbBpf, Kind::LbConnect, Kind::Haproxy];
    let n = CRASH_HELD.min(opts.idle_conns);
    eprintln!(
        "bench: scenario 9 kill -9 with {n} held connections and a connect loop, restarted {} s later",
        CRASH_DOWN.as_secs()
    );
    for run in 0..opts.heavy_runs {
        for kind in order(&kinds, run) {
            let dials = CRASH_DIALS.to_string();
            let every = CRASH_DIAL_EVERY_MS.to_string();
            let action = [
                "dial",
                "--timeout-ms",
                "3000",
                "--times",
                &dials,
                "--every-ms",
                &every,
            ];
            let mut l = Loaded::start(kind, hosts, cgroups, n, &action)?;
            l.r.crash_and_restart(CRASH_DOWN)?;
            let (v, lost) = l.finish()?;
            let served: u64 = v["servers"]
                .as_object()
                .map(|m| m.values().filter_map(Value::as_u64).sum())
                .unwrap_or(0);
            let unserved = u64::from(CRASH_DIALS).saturating_sub(served);
            raw.log(
                kind,
                &["crash"],
                &serde_json::json!({"loop": v, "lost": lost, "unserved": unserved}),
            );
            res.add("crash_lost", kind, lost as f64);
            res.add("crash_unserved", kind, unserved as f64);
        }
    }
    Ok(())
}

/// Scenarios 8 and 9 under way: a contender with `n` idle connections through it and a client
/// running an action in a thread of its own, started 1 s before the contender is replaced or
/// killed.
struct Loaded {
    // Dropped in this order: the clients' connections end before the contender stops.
    ev: Events,
    r: Running,
    n: u32,
    looping: std::thread::JoinHandle<Result<Value>>,
}

impl Loaded {
    fn start(
        kind: Kind,
        hosts: &Hosts,
        cgroups: &Cgroups,
        n: u32,
        action: &[&str],
    ) -> Result<Loaded> {
        let r = Running::start(kind, &hosts.servers(), cgroups)?;
        let cg = cgroups.for_kind(kind);
        let ev = Events::start(cg, r.addr, &["idle", &n.to_string(), "--max-ms", "120000"])?;
        ev.wait_for("ready", Duration::from_secs(90))?;
        let looping = {
            let (cg, addr) = (cg.to_path_buf(), r.addr);
            let action: Vec<String> = action.iter().map(|a| a.to_string()).collect();
            std::thread::spawn(move || {
                let action: Vec<&str> = action.iter().map(String::as_str).collect();
                run_client(&place(&cg), addr, &action, Duration::from_secs(60))
            })
        };
        std::thread::sleep(Duration::from_millis(1000));
        Ok(Loaded { r, ev, n, looping })
    }

    /// The client's result and how many idle connections ended.
    fn finish(self) -> Result<(Value, u64)> {
        let v = self
            .looping
            .join()
            .map_err(|_| anyhow::anyhow!("the client thread panicked"))??;
        // Give ended connections time to show.
        std::thread::sleep(Duration::from_millis(500));
        let n = u64::from(self.n);
        Ok((v, n - still_open(&self.ev, n)))
    }
}

/// How many of `n` idle connections `ev` still reports open, from the events it printed so far.
fn still_open(ev: &Events, n: u64) -> u64 {
    let mut open = n;
    while let Ok((_, e)) = ev.rx.try_recv() {
        match e["event"].as_str() {
            Some("closed") => open = open.min(e["open"].as_u64().unwrap_or(0)),
            Some("all_closed" | "timeout") => open = 0,
            _ => {}
        }
    }
    open
}
