//! Kernel events in lb's log (aya-log, target `lb::kernel`): with the kernel target at debug, a
//! credit fallback of the sk_msg program reaches lb's log with its real values; with the default
//! filter no kernel line appears although the same fallbacks happen.

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use lb_tests::{Host, Lb, Place, TestCgroup, free_port, run_client, skip_unless_root};

const MIB: u64 = 1024 * 1024;

/// An epoll client uploads 64 MiB to a server that stops reading for 2 s after 16 MiB, while the
/// connection is spliced: its credit runs out and its sends take the copy path (reason
/// `credit`), as in `splice.rs`. lb runs in bpf mode with `--log-level log_level`, text lines.
/// Returns the cgroup, the server's host, lb (still running, for its log and metrics) and its
/// listener port, in that order so lb is dropped first.
fn credit_fallbacks(log_level: &str) -> Result<(TestCgroup, Host, Lb, u16)> {
    let cg = TestCgroup::new()?;
    let mut host = Host::new()?;
    host.serve(9000, "s0")?;
    let port = free_port()?;
    let listen = format!("127.0.0.1:{port}");
    let server = host.addr(9000).to_string();
    let cgp = cg.path.display().to_string();
    let args = vec![
        "--listen",
        &listen,
        "--server",
        &server,
        "--datapath",
        "bpf",
        "--cgroup",
        &cgp,
        "--forwarding",
        "splice",
        "--log-level",
        log_level,
        // The lines are read as text whatever LB_LOG_FORMAT the tests run with.
        "--log-format",
        "text",
    ];
    let lb = Lb::start(&args)?;
    let v = run_client(
        &Place::cgroup(&cg.path),
        listen.parse()?,
        &[
            "epoll-up",
            &(64 * MIB).to_string(),
            "--stall-ms",
            "2000",
            "--stall-after",
            &(16 * MIB).to_string(),
            "--pause-ms",
            "1000",
        ],
        Duration::from_secs(120),
    )?;
    ensure!(v["ok"] == true, "client failed: {v}");
    ensure!(
        lb.metric("lb_splice_fallbacks_total", "credit") > 0.0,
        "the epoll client never ran out of credit"
    );
    Ok((cg, host, lb, port))
}

/// The value of `key=` in a log line.
fn field(line: &str, key: &str) -> Option<u64> {
    let prefix = format!("{key}=");
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(prefix.as_str()))?
        .parse()
        .ok()
}

#[test]
fn credit_fallback_reaches_the_log_at_debug() -> Result<()> {
    if skip_unless_root() || lb_tests::splice_fallback_asserted()? {
        return Ok(());
    }
    let (_cg, _host, lb, port) = credit_fallbacks("info,lb::kernel=debug")?;
    // The thread forwarding the records wakes at least every 100 ms.
    std::thread::sleep(Duration::from_millis(300));
    let log = lb.log_text();
    ensure!(
        log.contains("kernel program events are logged"),
        "lb did not start the kernel logger: {log}"
    );
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("lb::kernel") && l.contains("splice fallback reason=credit"))
        .collect();
    ensure!(
        !lines.is_empty(),
        "no kernel credit fallback line in: {log}"
    );
    let fallbacks = lb.metric("lb_splice_fallbacks_total", "credit");
    for line in &lines {
        ensure!(line.contains("DEBUG"), "not at debug: {line}");
        ensure!(field(line, "balancer") == Some(0), "balancer: {line}");
        ensure!(
            field(line, "listener_port") == Some(u64::from(port)),
            "listener port is not {port}: {line}"
        );
        let client_port = field(line, "client_port").context("client_port")?;
        ensure!((1..=65_535).contains(&client_port), "client port: {line}");
        let bytes = field(line, "bytes").context("bytes")?;
        let redirected = field(line, "redirected").context("redirected")?;
        let credit_end = field(line, "credit_end").context("credit_end")?;
        let queued = field(line, "server_queued").context("server_queued")?;
        let limit = field(line, "server_limit").context("server_limit")?;
        ensure!(bytes > 0, "empty send: {line}");
        // The reason itself: this send would have passed the server socket's limit (read from
        // the socket once a redirect showed where it is), or else lb's credit.
        if limit > 0 {
            ensure!(
                queued + bytes > limit,
                "the send fitted the server socket: {line}"
            );
        } else {
            ensure!(
                redirected + bytes > credit_end,
                "the send fitted its credit: {line}"
            );
        }
        // The connection was spliced before the server stalled.
        ensure!(redirected > 0, "nothing redirected before: {line}");
        // Rate limit: the 1st, 2nd, 4th, … on a CPU, every 65,536th after that.
        let count = field(line, "count").context("count")?;
        ensure!(
            count.is_power_of_two() || count % 65_536 == 0,
            "logged a count that is not due: {line}"
        );
        ensure!(count as f64 <= fallbacks, "count above the metric: {line}");
    }
    eprintln!(
        "{} kernel credit fallback lines for {fallbacks} fallbacks; first: {}",
        lines.len(),
        lines[0]
    );
    Ok(())
}

#[test]
fn default_filter_logs_no_kernel_event() -> Result<()> {
    if skip_unless_root() || lb_tests::splice_fallback_asserted()? {
        return Ok(());
    }
    // lb's default filter.
    let (_cg, _host, lb, _port) = credit_fallbacks("info")?;
    std::thread::sleep(Duration::from_millis(300));
    let log = lb.log_text();
    ensure!(
        !log.contains("lb::kernel") && !log.contains("splice fallback"),
        "a kernel event was logged under the default filter: {log}"
    );
    Ok(())
}
