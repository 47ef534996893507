//! `cargo xtask vm-test`: the privileged integration tests inside qemu guests booted on Debian
//! kernels (5.10, 6.1 and 6.12), so lb is proven on more than the host's kernel, and a smoke
//! subset of them in an arm64 guest (`--arch arm64`, emulated by TCG).
//!
//! Per kernel: fetch the packages (cached under `target/vm-cache`), build an initramfs holding
//! static test binaries, `lb`, `lbt`, busybox, iproute2, bpftool and the modules the tests need,
//! boot it (KVM when it boots, otherwise TCG) inside a hard timeout and read one result line
//! from the serial console.

mod arch;
mod cpio;
mod fetch;
mod guest;
mod userland;

use std::{
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::util;

pub use arch::{AMD64, ARM64, Arch, arch};
pub use fetch::SERIES;
pub use guest::{TESTS, Tests};

/// How long a guest may take from boot to power-off unless `--timeout` says otherwise: the 6.1
/// run takes 320-580 s under TCG on a 2-core machine, and a CI machine once needed more than
/// 900 s; a hung test still ends the run well inside CI's budget.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1500);

/// How long a KVM guest gets to print its boot line before KVM counts as broken (here KVM either
/// aborts at once or hangs without output).
const KVM_BOOT_DEADLINE: Duration = Duration::from_secs(30);

/// Set once KVM failed to boot a guest, so later kernels of the same run go straight to TCG.
static KVM_BROKEN: AtomicBool = AtomicBool::new(false);

/// The cache of packages and unpacked kernels.
fn cache() -> PathBuf {
    util::root().join("target/vm-cache")
}

/// The result of one kernel's run.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Series label (`6.1`), with the architecture after it when not the machine's (`6.1-arm64`).
    pub label: String,
    /// `uname -r` of the guest kernel.
    pub release: String,
    /// `kvm` or `tcg`.
    pub accel: &'static str,
    /// Test counts from the guest's result line (skips are not counted as passed), and the
    /// skipped tests with their reasons from the log (`SKIP` lines and tests libtest ignored).
    pub counts: util::Counts,
    /// Exit status of the test executables in the guest (0 when all passed).
    pub status: i64,
    /// Names of failed tests.
    pub failures: Vec<String>,
    /// Seconds from qemu start to power-off.
    pub guest_secs: f64,
    /// Seconds for this kernel including fetching and packing.
    pub total_secs: f64,
    /// Why the run failed when it did not produce a passing result line.
    pub error: Option<String>,
}

impl Outcome {
    /// True when the guest reported a result, with exit status 0 and no failed test.
    pub fn ok(&self) -> bool {
        self.error.is_none() && self.status == 0 && self.counts.failed == 0
    }
}

/// Run `tests` in `arch` guests on each series in `labels` (`6.1`, `6.12`), print a summary,
/// and return every outcome (a kernel that could not be fetched or booted is an outcome with
/// an error; see [`verdict`]).
///
/// # Errors
/// An unknown label, or building the binaries failing.
pub fn run(
    arch: &Arch,
    labels: &[&str],
    timeout: Duration,
    tests: Tests<'_>,
) -> Result<Vec<Outcome>> {
    let series: Vec<fetch::Series> = labels
        .iter()
        .map(|l| {
            SERIES
                .iter()
                .copied()
                .find(|s| s.label == *l)
                .with_context(|| format!("unknown kernel {l}"))
        })
        .collect::<Result<_>>()?;
    let start = Instant::now();
    let bins = guest::build_binaries(arch)?;
    eprintln!(
        "vm: built static binaries in {:.0} s",
        start.elapsed().as_secs_f64()
    );
    let mut outcomes = Vec::new();
    for s in series {
        let t0 = Instant::now();
        let mut outcome = match run_one(arch, s, &bins, timeout, tests) {
            Ok(o) => o,
            Err(e) => Outcome {
                label: label(arch, s.label),
                error: Some(format!("{e:#}")),
                ..Outcome::default()
            },
        };
        outcome.total_secs = t0.elapsed().as_secs_f64();
        outcomes.push(outcome);
    }
    print_summary(&outcomes);
    Ok(outcomes)
}

/// A run's name in summaries and file names: the series (`6.1`), with the architecture after
/// it when that is not the machine's (`6.1-arm64`).
fn label(arch: &Arch, series: &str) -> String {
    if arch.musl.deb == fetch::NATIVE_ARCH {
        series.to_string()
    } else {
        format!("{series}-{}", arch.musl.deb)
    }
}

/// Fail when any kernel's run did not pass.
///
/// # Errors
/// Names the kernels that failed.
pub fn verdict(outcomes: &[Outcome]) -> Result<()> {
    let bad: Vec<&str> = outcomes
        .iter()
        .filter(|o| !o.ok())
        .map(|o| o.label.as_str())
        .collect();
    if !bad.is_empty() {
        bail!("vm-test failed on kernel {}", bad.join(", "));
    }
    Ok(())
}

fn run_one(
    arch: &Arch,
    series: fetch::Series,
    bins: &crate::musl::Binaries,
    timeout: Duration,
    tests: Tests<'_>,
) -> Result<Outcome> {
    let cache = cache();
    let deb_arch = arch.musl.deb;
    // The machine's architecture keeps the cache it always had.
    let debs = if deb_arch == fetch::NATIVE_ARCH {
        cache.join("debs")
    } else {
        cache.join(format!("debs-{deb_arch}"))
    };
    let apt = fetch::Apt::for_series(&series, deb_arch, &cache)?;
    let deb = fetch::deb(&apt, &debs, series.prefix, |n| series.key(n, deb_arch))?;
    let root = fetch::unpack(&deb, &cache.join("x"))?;
    let kernel = fetch::Kernel::find(&root)?;
    let label = label(arch, series.label);
    eprintln!("vm: kernel {label} ({})", kernel.release);
    let initrd = cache.join(format!("initramfs-{label}.cpio"));
    guest::initramfs(arch, &kernel, bins, tests, &initrd)?;

    let mut outcome = Outcome {
        label: label.clone(),
        release: kernel.release.clone(),
        ..Outcome::default()
    };
    let t0 = Instant::now();
    let mut run = None;
    let guest = Guest {
        arch,
        label: &label,
        image: &kernel.image,
        initrd: &initrd,
    };
    if arch.kvm && !KVM_BROKEN.load(Ordering::Relaxed) && kvm_present() {
        match boot(&guest, Accel::Kvm, timeout)? {
            Boot::Done(log) => {
                outcome.accel = "kvm";
                run = Some(log);
            }
            Boot::NoStart(why) => {
                eprintln!("vm: KVM did not boot the guest ({why}); using TCG");
                KVM_BROKEN.store(true, Ordering::Relaxed);
            }
        }
    }
    let log = match run {
        Some(log) => log,
        None => {
            outcome.accel = "tcg";
            match boot(&guest, Accel::Tcg, timeout)? {
                Boot::Done(log) => log,
                Boot::NoStart(why) => bail!("guest did not boot under TCG: {why}"),
            }
        }
    };
    outcome.guest_secs = t0.elapsed().as_secs_f64();
    read_log(&log, &mut outcome);
    if matches!(tests, Tests::Smoke) {
        check_smoke(&mut outcome);
    }
    Ok(outcome)
}

/// A smoke run passes only when every test of [`guest::SMOKE`] passed: one that matched no
/// test (renamed) or skipped (a kernel without what it needs) proved nothing.
fn check_smoke(outcome: &mut Outcome) {
    let c = &outcome.counts;
    if outcome.error.is_none() && (c.passed as usize != guest::SMOKE.len() || c.skipped > 0) {
        outcome.error = Some(format!(
            "the smoke subset has {} tests: {} passed, {} skipped",
            guest::SMOKE.len(),
            c.passed,
            c.skipped
        ));
    }
}

/// Pull the result line, skips and failures out of the serial log.
fn read_log(log: &GuestLog, outcome: &mut Outcome) {
    let mut in_failures = false;
    for line in &log.lines {
        // libtest ends with "failures:" and the failed names indented by four spaces.
        if line == "failures:" {
            in_failures = true;
            continue;
        }
        if in_failures {
            match line.strip_prefix("    ") {
                Some(name) if !name.contains(' ') => {
                    if !outcome.failures.iter().any(|f| f == name) {
                        outcome.failures.push(name.to_string());
                    }
                }
                _ => in_failures = !line.is_empty() && line.starts_with("    "),
            }
        }
        if let Some(skip) = util::Skip::parse(line) {
            outcome.counts.skips.push(skip);
        }
        if let Some(rest) = line.strip_prefix("test ")
            && let Some((name, verdict)) = rest.split_once(" ... ")
        {
            if verdict.starts_with("FAILED") {
                if !outcome.failures.iter().any(|f| f == name) {
                    outcome.failures.push(name.to_string());
                }
            } else if verdict.starts_with("ignored") {
                outcome.counts.skips.push(util::Skip {
                    test: name.to_string(),
                    reason: verdict.to_string(),
                });
            }
        }
    }
    let Some(result) = log.lines.iter().find_map(|l| {
        let at = l.find("LB_VM_RESULT ")?;
        Some(l[at..].to_string())
    }) else {
        let why = match log.ended {
            End::TimedOut => format!(
                "no result line: the guest did not finish within {} s",
                log.limit.as_secs()
            ),
            End::Exited => "no result line: the guest stopped before the tests finished".into(),
        };
        outcome.error = Some(format!("{why}{}", last_started(&log.lines)));
        return;
    };
    let field = |key: &str| -> Option<i64> {
        result.split_whitespace().find_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            (k == key).then(|| v.parse().ok()).flatten()
        })
    };
    let count = |key: &str| field(key).and_then(|v| u64::try_from(v).ok()).unwrap_or(0);
    outcome.status = field("status").unwrap_or(-1);
    outcome.counts.passed = count("passed");
    outcome.counts.failed = count("failed");
    outcome.counts.skipped = count("skipped");
    if outcome.status != 0 && outcome.counts.failed == 0 && outcome.failures.is_empty() {
        outcome.error = Some(format!(
            "the test executable exited with {} without a failed test (crash?)",
            outcome.status
        ));
    }
}

fn print_summary(outcomes: &[Outcome]) {
    println!();
    println!("vm-test summary");
    println!(
        "{:<9} {:<24} {:<5} {:<6} {:>6} {:>6} {:>7} {:>8} {:>8}",
        "kernel", "release", "accel", "result", "passed", "failed", "skipped", "guest s", "total s"
    );
    for o in outcomes {
        println!(
            "{:<9} {:<24} {:<5} {:<6} {:>6} {:>6} {:>7} {:>8.0} {:>8.0}",
            o.label,
            o.release,
            o.accel,
            if o.ok() { "ok" } else { "FAIL" },
            o.counts.passed,
            o.counts.failed,
            o.counts.skipped,
            o.guest_secs,
            o.total_secs
        );
        for s in &o.counts.skips {
            println!("  skipped on {}: {s}", o.label);
        }
        for f in &o.failures {
            println!("  failed on {}: {f}", o.label);
        }
        if let Some(e) = &o.error {
            println!("  error on {}: {e}", o.label);
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Accel {
    Kvm,
    Tcg,
}

/// Whether `/dev/kvm` opens for reading and writing (necessary, not sufficient: here it opens
/// and qemu then fails).
fn kvm_present() -> bool {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok()
}

#[derive(Debug)]
enum End {
    Exited,
    TimedOut,
}

#[derive(Debug)]
struct GuestLog {
    lines: Vec<String>,
    ended: End,
    limit: Duration,
}

#[derive(Debug)]
enum Boot {
    /// The guest booted; its log, complete or cut by the timeout.
    Done(GuestLog),
    /// The guest never printed its boot line (KVM broken).
    NoStart(String),
}

/// What one boot runs.
struct Guest<'a> {
    arch: &'a Arch,
    /// Its name in the log ([`label`]).
    label: &'a str,
    /// The kernel image (Debian's `vmlinuz`: a bzImage on amd64, a gzip'd Image on arm64, both
    /// of which qemu's `-kernel` loads).
    image: &'a Path,
    initrd: &'a Path,
}

/// Boot one guest, echo its console, and stop it at `timeout` at the latest.
fn boot(guest: &Guest<'_>, accel: Accel, timeout: Duration) -> Result<Boot> {
    let label = guest.label;
    let (qemu, package) = guest.arch.qemu;
    let mut cmd = Command::new(qemu);
    match accel {
        Accel::Kvm => cmd.args(["-accel", "kvm", "-cpu", "host"]),
        Accel::Tcg => cmd.args(["-accel", "tcg"]).args(guest.arch.tcg),
    };
    // No network device: the guest's only links are the veth pairs the tests make inside it.
    cmd.args(["-smp", "2", "-m", "1G", "-nodefaults", "-display", "none"])
        .args(["-serial", "stdio", "-no-reboot"])
        .arg("-kernel")
        .arg(guest.image)
        .arg("-initrd")
        .arg(guest.initrd)
        .arg("-append")
        .arg(format!("console={} panic=-1 quiet", guest.arch.console))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    eprintln!("vm: booting {label} with {accel:?}");
    let mut child = cmd.spawn().with_context(|| {
        format!("cannot start {qemu} (Debian package {package}; cargo xtask setup installs it)")
    })?;
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let mut readers = Vec::new();
    if let Some(out) = child.stdout.take() {
        let tx = tx.clone();
        readers.push(std::thread::spawn(move || forward(out, &tx)));
    }
    if let Some(err) = child.stderr.take() {
        let tx = tx.clone();
        readers.push(std::thread::spawn(move || forward(err, &tx)));
    }
    drop(tx);

    let start = Instant::now();
    let boot_deadline = match accel {
        Accel::Kvm => Some(start + KVM_BOOT_DEADLINE),
        Accel::Tcg => None,
    };
    let deadline = start + timeout;
    let mut lines = Vec::new();
    let mut booted = false;
    let mut result_at: Option<Instant> = None;
    let ended = loop {
        let now = Instant::now();
        // After the result line, power-off should follow at once; do not wait long for it.
        let limit = match (booted, boot_deadline, result_at) {
            (_, _, Some(at)) => at + Duration::from_secs(30),
            (false, Some(b), None) => b,
            _ => deadline,
        };
        if now >= limit {
            break End::TimedOut;
        }
        match rx.recv_timeout(limit - now) {
            Ok(line) => {
                println!("[{label}] {line}");
                if line.contains("LB_VM_BOOTED") {
                    booted = true;
                }
                if line.contains("LB_VM_RESULT ") {
                    result_at = Some(Instant::now());
                }
                lines.push(line);
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break End::Exited,
        }
    };
    if matches!(ended, End::TimedOut) {
        let _ = child.kill();
    }
    let status = child.wait()?;
    for r in readers {
        let _ = r.join();
    }
    eprintln!(
        "vm: qemu ({label}, {accel:?}) ended after {:.0} s: {status}",
        start.elapsed().as_secs_f64()
    );
    if !booted && boot_deadline.is_some() {
        let last = lines.last().cloned().unwrap_or_default();
        return Ok(Boot::NoStart(match ended {
            End::TimedOut => format!("no boot line within {} s", KVM_BOOT_DEADLINE.as_secs()),
            End::Exited => format!("qemu exited ({status}): {last}"),
        }));
    }
    // A timeout after the result line only means power-off stalled: the result stands.
    let ended = match (ended, result_at) {
        (End::TimedOut, Some(_)) => End::Exited,
        (e, _) => e,
    };
    Ok(Boot::Done(GuestLog {
        lines,
        ended,
        limit: timeout,
    }))
}

/// Where a guest's log stops: the last test binary it started (with the guest's uptime then)
/// and the last test line, as `"; last binary ...; last test ..."` (empty when neither is there).
fn last_started(lines: &[String]) -> String {
    let mut out = String::new();
    if let Some(bin) = lines
        .iter()
        .rev()
        .find_map(|l| l.strip_prefix("LB_VM: running "))
    {
        out.push_str(&format!("; last binary started: {bin}"));
    }
    if let Some(test) = lines.iter().rev().find(|l| l.starts_with("test ")) {
        out.push_str(&format!("; last test line: {test}"));
    }
    out
}

/// Send each line of `from` (lossy UTF-8, `\r` trimmed) until it closes.
fn forward(from: impl std::io::Read, tx: &std::sync::mpsc::Sender<String>) {
    let mut reader = BufReader::new(from);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let line = String::from_utf8_lossy(&buf)
                    .trim_end_matches(['\r', '\n'])
                    .to_string();
                if tx.send(line).is_err() {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(lines: &[&str], ended: End) -> GuestLog {
        GuestLog {
            lines: lines.iter().map(|s| s.to_string()).collect(),
            ended,
            limit: Duration::from_secs(5),
        }
    }

    #[test]
    fn result_line_and_skips() {
        let mut o = Outcome::default();
        read_log(
            &log(
                &[
                    "test a ... ok",
                    "test b ... SKIP b: needs bpf_sock_destroy (kernel 6.5+)",
                    "ok",
                    "test c ... ignored, slow",
                    "LB_VM_RESULT status=0 passed=1 failed=0 skipped=2",
                ],
                End::Exited,
            ),
            &mut o,
        );
        assert!(o.ok(), "{o:?}");
        assert_eq!((o.counts.passed, o.counts.skipped), (1, 2));
        let skips: Vec<String> = o.counts.skips.iter().map(ToString::to_string).collect();
        assert_eq!(
            skips,
            vec![
                "b: needs bpf_sock_destroy (kernel 6.5+)".to_string(),
                "c: ignored, slow".to_string()
            ]
        );
    }

    #[test]
    fn failures_and_missing_marker() {
        let mut o = Outcome::default();
        read_log(
            &log(
                &[
                    "test a ... FAILED",
                    "test b ... Error: client failed",
                    "FAILED",
                    "failures:",
                    "",
                    "failures:",
                    "    a",
                    "    b",
                    "",
                    "test result: FAILED. 2 passed; 2 failed; 0 ignored",
                    "LB_VM_RESULT status=101 passed=2 failed=2 skipped=0",
                ],
                End::Exited,
            ),
            &mut o,
        );
        assert!(!o.ok());
        assert_eq!(o.failures, vec!["a".to_string(), "b".to_string()]);
        assert_eq!(o.counts.failed, 2);

        let mut o = Outcome::default();
        read_log(
            &log(
                &[
                    "LB_VM: running /opt/lb/tests/datapath at 12.5 s",
                    "test a ... ok",
                    "test b ... waiting",
                ],
                End::TimedOut,
            ),
            &mut o,
        );
        assert!(!o.ok());
        let e = o.error.as_deref().unwrap_or("");
        assert!(e.contains("within 5 s"), "{e}");
        assert!(
            e.contains("last binary started: /opt/lb/tests/datapath at 12.5 s")
                && e.contains("last test line: test b ... waiting"),
            "{e}"
        );

        let mut o = Outcome::default();
        read_log(
            &log(
                &["LB_VM_RESULT status=101 passed=0 failed=0 skipped=0"],
                End::Exited,
            ),
            &mut o,
        );
        assert!(!o.ok(), "a crash without a failed test still fails");
    }

    #[test]
    fn a_smoke_run_needs_every_smoke_test_passed() {
        let n = guest::SMOKE.len();
        for (passed, skipped, ok) in [(n, 0, true), (n - 1, 0, false), (n - 1, 1, false)] {
            let mut o = Outcome::default();
            read_log(
                &log(
                    &[&format!(
                        "LB_VM_RESULT status=0 passed={passed} failed=0 skipped={skipped}"
                    )],
                    End::Exited,
                ),
                &mut o,
            );
            check_smoke(&mut o);
            assert_eq!(o.ok(), ok, "{passed} passed, {skipped} skipped: {o:?}");
        }
    }
}
