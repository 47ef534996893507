//! Connect-time tables under churn: lb writes each table into a slot no program can still be
//! reading (generations in `LB_CONNECT_CURRENT`, slots in `LB_CONNECT_TABLES`), so a `connect()`
//! racing hundreds of table writes reaches a server of one table or the other, never an address
//! put together from two (one server's address with another's port).

use std::{
    collections::BTreeMap,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use lb_tests::{ConnectLb, Host, Toml, run_client, skip_unless_kernel, skip_unless_root};
use serde_json::Value;

const T: Duration = Duration::from_secs(60);
/// Table slots per balancer and how long a slot rests before it is written again
/// (`lb_common::TABLE_SLOTS`, `lb_common::SLOT_REUSE_AFTER_MS`).
const SLOTS: u64 = 8;
const REUSE_AFTER_MS: u64 = 100;
/// Server set changes through the admin API.
const CHANGES: usize = 300;

/// One `connect-time table updated` line lb logged for a table it wrote: when (seconds since
/// midnight, from the line's timestamp), the generation and how long its slot had rested (ms;
/// `None` for a slot never current before).
#[derive(Debug)]
struct Written {
    at_s: f64,
    generation: u64,
    idle_ms: Option<u64>,
}

/// The table writes in lb's log, in order.
fn written(log: &str) -> Result<Vec<Written>> {
    let mut out = Vec::new();
    for line in log
        .lines()
        .filter(|l| l.contains("connect-time table updated") && l.contains(" slot="))
    {
        let field = |name: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
                .with_context(|| format!("no {name} in {line:?}"))
        };
        // `2026-12-03T15:59:56.440640Z  INFO ...`
        let clock = line
            .split_whitespace()
            .next()
            .and_then(|t| t.split_once('T'))
            .map(|(_, c)| c.trim_end_matches('Z'))
            .with_context(|| format!("no timestamp in {line:?}"))?;
        let mut parts = clock.split(':').map(str::parse::<f64>);
        let (Some(Ok(h)), Some(Ok(m)), Some(Ok(s))) = (parts.next(), parts.next(), parts.next())
        else {
            anyhow::bail!("timestamp {clock:?} in {line:?}");
        };
        let idle = field("slot_idle_ms")?;
        out.push(Written {
            at_s: h * 3600.0 + m * 60.0 + s,
            generation: field("generation")?.parse()?,
            idle_ms: (idle != "never").then(|| idle.parse()).transpose()?,
        });
    }
    Ok(out)
}

/// Balancer 0's generation in `LB_CONNECT_CURRENT`, read with `bpftool` (an array of `u32`:
/// element 0's value bytes, little-endian as the kernel stores them on this machine).
fn current_generation(s: &ConnectLb) -> Result<u64> {
    let dump: Value = serde_json::from_str(&s.map_dump("LB_CONNECT_CURRENT")?)?;
    let first = dump
        .as_array()
        .and_then(|a| a.first())
        .context("empty dump")?;
    let bytes: Vec<u8> = first["value"]
        .as_array()
        .context("value bytes")?
        .iter()
        .filter_map(|b| u8::from_str_radix(b.as_str()?.trim_start_matches("0x"), 16).ok())
        .collect();
    let word: [u8; 4] = bytes
        .get(..4)
        .and_then(|b| b.try_into().ok())
        .with_context(|| format!("value of {first}"))?;
    Ok(u64::from(u32::from_ne_bytes(word)))
}

/// [`CHANGES`] server set changes through the admin API, `first` and `second` in turn.
fn alternate(s: &ConnectLb, first: &[String], second: &[String]) -> Result<usize> {
    for i in 0..CHANGES {
        let servers = if i % 2 == 0 { first } else { second };
        let body = serde_json::json!({ "servers": servers }).to_string();
        let (code, answer) =
            lb_tests::http_request(s.lb.admin, "PUT", "/balancers/api/servers", Some(&body))?;
        ensure!(code == 200, "PUT {body}: {code} {answer}");
    }
    Ok(CHANGES)
}

#[test]
fn connect_time_tables_are_never_read_torn_while_rewritten() -> Result<()> {
    if skip_unless_root()
        || skip_unless_kernel((5, 9), "cgroup getpeername4/6 and sock_release hooks")
    {
        return Ok(());
    }
    // Two sets of different sizes; every server on a port of its own and no two on one host
    // with the same port, so an address from one entry with the port of another is a port
    // nobody listens on (the connect is refused).
    let mut hosts = vec![Host::new()?, Host::new()?, Host::new()?];
    let plan: [(usize, u16, &str, bool); 5] = [
        (0, 9001, "a0", true),
        (1, 9002, "a1", true),
        (1, 9003, "b0", false),
        (2, 9004, "b1", false),
        (0, 9005, "b2", false),
    ];
    for (h, port, server, _) in plan {
        hosts[h].serve(port, server)?;
    }
    let set = |a: bool| -> Vec<String> {
        plan.iter()
            .filter(|p| p.3 == a)
            .map(|(h, port, _, _)| hosts[*h].addr(*port).to_string())
            .collect()
    };
    let (set_a, set_b) = (set(true), set(false));
    let quoted: Vec<String> = set_a.iter().map(|a| format!("\"{a}\"")).collect();
    let servers = quoted.join(", ");
    let s = ConnectLb::start(hosts, |listen| {
        ConnectLb::config(&Toml::new(), &[listen], &servers, "round-robin")
            .string("dial_timeout", "1s")
            .table("balancer.health")
            .string("kind", "tcp")
            .string("interval", "100ms")
            .string("timeout", "500ms")
            .value("rise", 1)
            .value("fall", 1)
    })?;
    let first_generation = current_generation(&s)?;

    let stop = AtomicBool::new(false);
    let began = Instant::now();
    let (dials, puts) = std::thread::scope(|scope| -> Result<_> {
        let dialer = scope.spawn(|| -> Result<Vec<Value>> {
            let mut out = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                out.push(run_client(
                    &s.place(),
                    s.listen,
                    &["dial", "--times", "100"],
                    T,
                )?);
            }
            Ok(out)
        });
        let changes = alternate(&s, &set_b, &set_a);
        // Let the last change reach the table, with connects still running.
        std::thread::sleep(Duration::from_millis(300));
        // Stopped whatever happened, or the scope would wait for the dialer for ever.
        stop.store(true, Ordering::Relaxed);
        let dials = dialer
            .join()
            .map_err(|_| anyhow::anyhow!("dialer panicked"))??;
        Ok((dials, changes?))
    })?;
    let took = began.elapsed();

    // Every connect reached a server of one of the sets.
    let mut errnos = BTreeMap::<String, u64>::new();
    let mut servers = BTreeMap::<String, u64>::new();
    let mut after = BTreeMap::<String, u64>::new();
    for d in &dials {
        for (map, key) in [
            (&mut errnos, "errnos"),
            (&mut servers, "servers"),
            (&mut after, "after_connect"),
        ] {
            for (k, n) in d[key].as_object().context("counts")? {
                *map.entry(k.clone()).or_default() += n.as_u64().unwrap_or(0);
            }
        }
    }
    let connected = errnos.get("0").copied().unwrap_or(0);
    eprintln!(
        "{puts} set changes in {took:?}: {} dials, by errno {errnos:?}, by server {servers:?}, ended before the name {after:?}",
        dials.len() * 100
    );
    let log = s.lb.log_text();
    ensure!(
        !errnos.contains_key("111"),
        "connects refused (an address and port from two table entries?): {errnos:?}\n{log}"
    );
    ensure!(
        servers
            .keys()
            .all(|n| ["a0", "a1", "b0", "b1", "b2"].contains(&n.as_str())),
        "a connect reached an unknown server: {servers:?}"
    );
    ensure!(
        servers.keys().any(|n| n.starts_with('a')) && servers.keys().any(|n| n.starts_with('b')),
        "connects did not follow the table changes: {servers:?}"
    );
    ensure!(connected >= 100, "only {connected} connects: {errnos:?}");

    // The generation advanced with the writes; no slot was written within the bound of its
    // last time as the current one.
    let writes = written(&log)?;
    let last = writes.last().context("no table write logged")?;
    let now = current_generation(&s)?;
    ensure!(
        now == last.generation,
        "LB_CONNECT_CURRENT holds {now}, the last write logged {last:?}"
    );
    ensure!(
        now >= first_generation + 3 * SLOTS,
        "only {} table writes ({first_generation} → {now}): the slots were not reused",
        now - first_generation
    );
    for pair in writes.windows(2) {
        ensure!(
            pair[1].generation == pair[0].generation + 1,
            "generations not consecutive: {pair:?}"
        );
    }
    let mut youngest = u64::MAX;
    for (i, w) in writes.iter().enumerate() {
        if w.generation >= SLOTS {
            let idle = w.idle_ms.with_context(|| {
                format!("generation {} reused a slot, idle unknown", w.generation)
            })?;
            ensure!(
                idle >= REUSE_AFTER_MS,
                "generation {} wrote a slot idle only {idle} ms",
                w.generation
            );
            youngest = youngest.min(idle);
        }
        // From the log's own clock: the slot of generation g was last current until g - 7 was
        // stored, and lb's one writer per balancer logged g - 8 before it stored g - 7; g is
        // logged after it is stored, so at least the bound after g - 8's line however late
        // any line was written (comparing with g - 7's line would not hold: a line delayed
        // by a busy machine moves closer to the next one). 1 ms of slack for the wall clock
        // the log uses against the monotonic one lb waits on.
        if let Some(earlier) = i
            .checked_sub(SLOTS as usize)
            .and_then(|j| writes.get(j))
            .filter(|_| w.generation >= SLOTS)
        {
            let apart_ms = (w.at_s - earlier.at_s) * 1000.0;
            ensure!(
                apart_ms >= (REUSE_AFTER_MS - 1) as f64,
                "generation {} logged {apart_ms:.1} ms after generation {}",
                w.generation,
                earlier.generation
            );
        }
    }
    eprintln!(
        "{} table writes logged, generations {first_generation} → {now}, youngest reused slot idle {youngest} ms",
        writes.len()
    );
    Ok(())
}
