//! Hostile clients of a balancer's listener: thousands of connections opened and abandoned
//! without a byte, and a flood of connects, each while a normal client keeps doing round trips
//! through the same listener. lb must serve the normal client without an error and come back to
//! the descriptors and connections it had.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use lb_tests::{
    Fixture, Host, Lb, Toml, open_fds, raise_nofile, skip_unless_root, threads, wait_until,
};

/// lb on the copy path in front of one `lbt serve` host; settled. Its server fails after three
/// failed checks, not one: the flood reaches the server through lb, and a check whose SYN the
/// server's full accept queue drops would otherwise fail it and kill the normal client's
/// connection with every other (lb's designed answer to a server that stops answering, not what
/// these tests are about).
fn start() -> Result<Fixture> {
    let host = Host::serving(9000, "s0")?;
    let server = host.addr(9000);
    let f = Fixture::start(
        vec![host],
        9000,
        |_, listen| {
            Toml::new()
                .table("datapath")
                .string("mode", "userspace")
                .array_table("balancer")
                .string("name", "b")
                .value("listen", format!("[\"{listen}\"]"))
                .value("servers", format!("[\"{server}\"]"))
                .table("balancer.health")
                .value("fall", 3)
        },
        &[],
    )?;
    f.lb.wait_settled(Duration::from_secs(10))?;
    Ok(f)
}

/// What the normal client saw.
struct Rtt {
    /// Round trips on its long-lived connection.
    lat: Vec<Duration>,
    /// New connections it made, connect to the end of their one round trip.
    fresh: Vec<Duration>,
    errors: Vec<String>,
}

/// A normal client of the server's `ECHO`: round trips of one byte on one connection, and a
/// new connection with one round trip every 100 ms, until stopped (120 s at most). A reply may
/// take up to 30 s: an overloaded listener's full accept queue drops SYNs, whose retries come
/// 1, 2, 4 and 8 s later; that is a delay, not an error.
struct Normal {
    stop: Arc<AtomicBool>,
    threads: Option<(Samples, Samples)>,
}

/// A thread of the normal client: its sorted latencies and its errors.
type Samples = JoinHandle<(Vec<Duration>, Vec<String>)>;

fn echo(listen: SocketAddr) -> std::io::Result<TcpStream> {
    let mut s = TcpStream::connect_timeout(&listen, Duration::from_secs(10))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.write_all(b"ECHO\n")?;
    Ok(s)
}

fn ping(s: &mut TcpStream) -> std::io::Result<()> {
    s.write_all(b"x")?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b)
}

/// Run `step` until `stop` (120 s at most), 1 ms apart; its samples and errors.
fn repeat(
    stop: &AtomicBool,
    mut step: impl FnMut() -> std::io::Result<()>,
) -> (Vec<Duration>, Vec<String>) {
    let (mut lat, mut errors) = (Vec::new(), Vec::new());
    let start = Instant::now();
    while !stop.load(Ordering::Relaxed) && start.elapsed() < Duration::from_secs(120) {
        let t = Instant::now();
        match step() {
            Ok(()) => lat.push(t.elapsed()),
            Err(e) => errors.push(e.to_string()),
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    lat.sort();
    (lat, errors)
}

impl Normal {
    /// Round trips on one connection on one thread, new connections on another (one every
    /// 100 ms).
    fn start(listen: SocketAddr) -> Result<Normal> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut conn = echo(listen)?;
        ping(&mut conn)?;
        let st = stop.clone();
        let rr = std::thread::spawn(move || repeat(&st, || ping(&mut conn)));
        let st = stop.clone();
        let fresh = std::thread::spawn(move || {
            repeat(&st, || {
                std::thread::sleep(Duration::from_millis(100));
                echo(listen).and_then(|mut s| ping(&mut s))
            })
        });
        Ok(Normal {
            stop,
            threads: Some((rr, fresh)),
        })
    }

    fn stop(mut self) -> Result<Rtt> {
        self.stop.store(true, Ordering::Relaxed);
        let (rr, fresh) = self.threads.take().context("stopped twice")?;
        let panicked = |_| anyhow::anyhow!("normal client panicked");
        let (lat, mut errors) = rr.join().map_err(panicked)?;
        let (fresh, e) = fresh.join().map_err(panicked)?;
        errors.extend(e.into_iter().map(|e| format!("new connection: {e}")));
        Ok(Rtt { lat, fresh, errors })
    }
}

impl Drop for Normal {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn pct(lat: &[Duration], q: f64) -> Duration {
    lat.get(((lat.len().saturating_sub(1)) as f64 * q).round() as usize)
        .copied()
        .unwrap_or_default()
}

/// lb's descriptors and connections back to what they were (20 s at most).
fn back_to(lb: &Lb, fds: usize) -> Result<()> {
    wait_until(Duration::from_secs(20), || {
        Ok(open_fds(lb.pid())? <= fds && lb.metric("lb_server_connections", "") == 0.0)
    })
    .with_context(|| {
        format!(
            "lb did not return to {fds} descriptors and no connection: {} descriptors, {} connections",
            open_fds(lb.pid()).unwrap_or(0),
            lb.metric("lb_server_connections", "")
        )
    })?;
    Ok(())
}

/// Connections opened and abandoned in one test.
const ABANDONED: usize = 3000;

#[test]
fn abandoned_connections_leave_nothing_behind_and_others_are_served() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    raise_nofile(ABANDONED as u64 + 1024)?;
    let f = start()?;
    let (fds, thr) = (open_fds(f.lb.pid())?, threads(f.lb.pid())?);
    let normal = Normal::start(f.listen)?;
    let mut held = Vec::with_capacity(ABANDONED);
    let t = Instant::now();
    for i in 0..ABANDONED {
        let s = TcpStream::connect_timeout(&f.listen, Duration::from_secs(10))
            .with_context(|| format!("connection {i}"))?;
        held.push(s);
    }
    let opened = t.elapsed();
    // lb dials the server for each: wait until it holds them all, then abandon them, half with
    // a FIN and half with a reset.
    let most = wait_until(Duration::from_secs(60), || {
        Ok(f.lb.metric("lb_server_connections", "") >= ABANDONED as f64)
    })
    .map(|_| f.lb.metric("lb_server_connections", ""))
    .unwrap_or_else(|_| f.lb.metric("lb_server_connections", ""));
    let (fds_held, thr_held) = (open_fds(f.lb.pid())?, threads(f.lb.pid())?);
    for (i, s) in held.into_iter().enumerate() {
        if i % 2 == 0 {
            let _ = socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO));
        }
        drop(s);
    }
    let rtt = normal.stop()?;
    back_to(&f.lb, fds)?;
    println!(
        "{ABANDONED} abandoned connections opened in {opened:?}; lb held {most} connections, \
         {fds_held} descriptors and {thr_held} threads (before: {fds}, {thr}), back to {} and {} \
         after; normal client meanwhile: {} round trips p50 {:?} p99 {:?}, {} new connections, \
         {} errors",
        open_fds(f.lb.pid())?,
        threads(f.lb.pid())?,
        rtt.lat.len(),
        pct(&rtt.lat, 0.5),
        pct(&rtt.lat, 0.99),
        rtt.fresh.len(),
        rtt.errors.len()
    );
    ensure!(
        rtt.errors.is_empty(),
        "the normal client failed: {:?}",
        rtt.errors
    );
    ensure!(
        most >= ABANDONED as f64,
        "lb held only {most} of {ABANDONED} connections"
    );
    ensure!(f.lb.get("/livez")?.0 == 200);
    Ok(())
}

/// `TcpExt: ListenOverflows` of this network namespace (`/proc/net/netstat`): SYNs and
/// handshakes dropped because a listener's accept queue was full.
fn listen_overflows() -> Result<u64> {
    let text = std::fs::read_to_string("/proc/net/netstat")?;
    let mut tcpext = text.lines().filter(|l| l.starts_with("TcpExt:"));
    let (names, values) = (tcpext.next(), tcpext.next());
    let (names, values) = names.zip(values).context("no TcpExt lines")?;
    let i = names
        .split_whitespace()
        .position(|n| n == "ListenOverflows")
        .context("no ListenOverflows")?;
    Ok(values.split_whitespace().nth(i).context("value")?.parse()?)
}

/// Connects in the flood, made by [`FLOOD_THREADS`] threads.
const FLOOD: usize = 20_000;
const FLOOD_THREADS: usize = 2;

/// `n` connects to `listen`, each closed at once; returns how many connected and the errors.
fn connect_and_close(listen: SocketAddr, n: usize) -> (usize, Vec<String>) {
    let (mut ok, mut errors) = (0, Vec::new());
    let start = Instant::now();
    for _ in 0..n {
        if start.elapsed() > Duration::from_secs(120) {
            errors.push("gave up after 120 s".to_string());
            break;
        }
        match TcpStream::connect_timeout(&listen, Duration::from_secs(10)) {
            Ok(s) => {
                ok += 1;
                drop(s);
            }
            Err(e) if errors.len() < 10 => errors.push(e.to_string()),
            Err(_) => {}
        }
    }
    (ok, errors)
}

#[test]
fn a_connect_flood_leaves_a_normal_client_unhurt() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let f = start()?;
    let fds = open_fds(f.lb.pid())?;
    let normal = Normal::start(f.listen)?;
    let overflows = listen_overflows()?;
    let t = Instant::now();
    let listen = f.listen;
    let flooders: Vec<_> = (0..FLOOD_THREADS)
        .map(|_| std::thread::spawn(move || connect_and_close(listen, FLOOD / FLOOD_THREADS)))
        .collect();
    let (mut connected, mut errors) = (0, Vec::new());
    for h in flooders {
        let (ok, e) = h.join().map_err(|_| anyhow::anyhow!("flooder panicked"))?;
        connected += ok;
        errors.extend(e);
    }
    let took = t.elapsed();
    let overflows = listen_overflows()? - overflows;
    let rtt = normal.stop()?;
    back_to(&f.lb, fds)?;
    println!(
        "connect flood: {connected} of {FLOOD} connects in {took:?} ({:.0}/s) from \
         {FLOOD_THREADS} threads, errors {errors:?}, {overflows} accept queue overflows (root \
         namespace); normal client meanwhile: {} round trips p50 {:?} p99 {:?} max {:?}, {} new \
         connections p50 {:?} max {:?}, {} errors; lb's descriptors back to {}",
        connected as f64 / took.as_secs_f64(),
        rtt.lat.len(),
        pct(&rtt.lat, 0.5),
        pct(&rtt.lat, 0.99),
        pct(&rtt.lat, 1.0),
        rtt.fresh.len(),
        pct(&rtt.fresh, 0.5),
        pct(&rtt.fresh, 1.0),
        rtt.errors.len(),
        open_fds(f.lb.pid())?
    );
    let changes: Vec<String> =
        f.lb.log_text()
            .lines()
            .filter(|l| l.contains("state changed") || l.contains("killed"))
            .map(str::to_string)
            .collect();
    ensure!(
        rtt.errors.is_empty(),
        "the normal client failed: {:?} (first 5 of {}); lb's state changes and kills: {changes:#?}",
        rtt.errors.iter().take(5).collect::<Vec<_>>(),
        rtt.errors.len()
    );
    ensure!(!rtt.lat.is_empty(), "the normal client made no round trip");
    ensure!(f.lb.get("/livez")?.0 == 200);
    ensure!(
        f.lb.metric("lb_connections_total", "") >= connected as f64,
        "lb counted fewer connections than were made"
    );
    Ok(())
}
