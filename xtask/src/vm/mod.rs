//! `cargo xtask vm-test`: the privileged integration tests inside qemu guests booted on Debian
//! kernels (5.10, 6.1 and 6.12), so lb is proven on more than the host's kernel, and a smoke
//! subset of them in an arm64 guest (`--arch arm64`, emulated by TCG).
//!
//! Per kernel: fetch the packages (cached under `target/vm-cache`), build an initramfs holding
//! static test binaries, `lb`, `lbt`, busybox, iproute2, bpftool and the modules the tests need,
//! boot it (KVM when it boots, otherwise TCG) inside a hard timeout and read one result line
//! from the serial console.

mod arch;
mod console;
mod cpio;
mod fetch;
mod guest;
mod qemu;
mod userland;

use std::{
    path::PathBuf,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::util;

pub use arch::{AMD64, ARM64, Arch, arch};
pub use fetch::SERIES;
pub use guest::{CRASH, TESTS, Tests, built_targets};

use console::{check_smoke, read_log};
use qemu::{Accel, Boot, Guest, boot, kvm_present};

/// How long a guest may take from boot to power-off unless `--timeout` says otherwise: the 6.1
/// run takes 320-580 s under TCG on a 2-core machine, and a CI machine once needed more than
/// 900 s; a hung test still ends the run well inside CI's budget.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1500);

/// How each guest boots and how often it runs its tests.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Hard limit for one guest, boot to power-off.
    pub timeout: Duration,
    /// Rounds of the test list in one boot (`--repeat`); the guest stops after the first round
    /// with a failure.
    pub repeat: u32,
    /// Virtual CPUs (`--smp`).
    pub smp: u32,
    /// TCG with one host thread per virtual CPU (`-accel tcg,thread=multi`,
    /// `--tcg-multi-thread`) instead of one host thread for all of them (`thread=single`, the
    /// default): the guests' kernels locked up under multi-threaded TCG, an idle virtual CPU
    /// never running a task woken on it, and never under single-threaded TCG (see
    /// docs/kernels.md); the option is there to run the comparison again.
    pub tcg_multi_thread: bool,
    /// Boots more a guest gets when its kernel locks up (a soft lockup, an RCU stall or a hung
    /// task: `console::lockup`), each lockup reported with its stacks and kept in its own
    /// console file; 0 reports the first one as the run's failure.
    pub lockup_retries: u32,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            timeout: DEFAULT_TIMEOUT,
            repeat: 1,
            smp: 2,
            tcg_multi_thread: false,
            lockup_retries: 0,
        }
    }
}

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
    /// The kernel's alarm and the stacks after it (a lockup, a stall, a panic), empty when
    /// the kernel raised none (see `console::kernel_alarm`).
    pub kernel_alarm: Vec<String>,
    /// Earlier boots of this run whose kernel locked up, each as its alarm line, the test
    /// running then and the file that keeps its console ([`Options::lockup_retries`]).
    pub lockups: Vec<String>,
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
pub fn run(arch: &Arch, labels: &[&str], opts: &Options, tests: Tests<'_>) -> Result<Vec<Outcome>> {
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
    let bins = guest::build_binaries(arch, tests)?;
    eprintln!(
        "vm: built static binaries in {:.0} s",
        start.elapsed().as_secs_f64()
    );
    let mut outcomes = Vec::new();
    for s in series {
        let t0 = Instant::now();
        let mut outcome = match run_one(arch, s, &bins, opts, tests) {
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

/// Pass when every run of [`Tests::Crash`] ended the way a kernel hang should: stopped by the
/// kernel without a result line, naming the crash test as the one running, with the kernel's
/// panic and a stack in its alarm.
///
/// # Errors
/// Names each kernel whose run did not, and what was missing.
pub fn crash_verdict(outcomes: &[Outcome]) -> Result<()> {
    let mut bad = Vec::new();
    for o in outcomes {
        let error = o.error.as_deref().unwrap_or("");
        let alarm = |needle: &str| o.kernel_alarm.iter().any(|l| l.contains(needle));
        let missing: Vec<&str> = [
            (
                error.contains("the guest kernel stopped the run"),
                "the kernel stopping the run",
            ),
            (
                error.contains(&format!("test running: {}", CRASH.1)),
                "the running test's name",
            ),
            (alarm("sysrq"), "the SysRq line"),
            (alarm("Kernel panic"), "the panic line"),
            (alarm("Call Trace"), "a stack"),
        ]
        .into_iter()
        .filter_map(|(ok, what)| (!ok).then_some(what))
        .collect();
        if !missing.is_empty() {
            bad.push(format!("{} (missing {})", o.label, missing.join(", ")));
        }
    }
    if !bad.is_empty() {
        bail!(
            "a crashed guest was not reported on kernel {}",
            bad.join("; ")
        );
    }
    Ok(())
}

fn run_one(
    arch: &Arch,
    series: fetch::Series,
    bins: &crate::musl::Binaries,
    opts: &Options,
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
    guest::initramfs(arch, &kernel, bins, tests, opts.repeat, &initrd)?;

    let guest = Guest {
        arch,
        label: &label,
        image: &kernel.image,
        initrd: &initrd,
    };
    let mut lockups = Vec::new();
    loop {
        let mut outcome = boot_and_read(&guest, opts, tests)?;
        outcome.release = kernel.release.clone();
        let lockup = console::lockup(&outcome.kernel_alarm);
        match lockup {
            Some(alarm) if lockups.len() < opts.lockup_retries as usize => {
                // Keep the console of the boot that locked up before the next one writes its own.
                let kept = qemu::log_file(&format!("{label}-lockup-{}", lockups.len() + 1));
                let _ = std::fs::rename(qemu::log_file(&label), &kept);
                // The error names the test that was running (`console::read_log`).
                let what = format!(
                    "{} (console in {})",
                    outcome.error.as_deref().unwrap_or(&alarm),
                    kept.display()
                );
                eprintln!("vm: {label}: the guest kernel locked up ({what}); booting it once more");
                lockups.push(what);
            }
            _ => {
                outcome.lockups = lockups;
                return Ok(outcome);
            }
        }
    }
}

/// Boot `guest` (KVM when it works, else TCG) and read its console into an [`Outcome`].
fn boot_and_read(guest: &Guest<'_>, opts: &Options, tests: Tests<'_>) -> Result<Outcome> {
    let mut outcome = Outcome {
        label: guest.label.to_string(),
        ..Outcome::default()
    };
    let t0 = Instant::now();
    let mut run = None;
    if guest.arch.kvm && !KVM_BROKEN.load(Ordering::Relaxed) && kvm_present() {
        match boot(guest, Accel::Kvm, opts)? {
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
            match boot(guest, Accel::Tcg, opts)? {
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
        for l in &o.lockups {
            println!("  kernel lockup on {} in an earlier boot: {l}", o.label);
        }
        match (o.ok(), o.kernel_alarm.first()) {
            (_, None) => {}
            (true, Some(first)) => println!("  kernel alarm on {} (run passed): {first}", o.label),
            (false, Some(_)) => {
                println!("  kernel alarm on {}, with the stacks it printed:", o.label);
                for l in &o.kernel_alarm {
                    println!("    {l}");
                }
            }
        }
    }
}
