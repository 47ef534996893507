//! `cargo xtask test`: everything CI runs, in order: fmt, clippy (lb-ebpf for the BPF target
//! too), the unit and integration tests
//! on the host kernel, every fuzz target for [`FUZZ_TARGET_S`], the quick bench, the
//! integration tests in the kernel 6.1 and 5.10 guests, the connect-time tests in the 6.12 guest,
//! the smoke subset in the arm64 6.1 guest and the crash report check (a guest crashed on purpose
//! is reported with its stacks), then `cargo xtask dist --check`; it closes with one line of
//! counts.

use anyhow::{Context as _, Result};

use crate::{
    bench, dist, fuzz,
    util::{Counts, Skip, cargo, cargo_test, check_privileged_skips},
    vm,
};

/// Everything CI runs.
///
/// # Errors
/// The first failing step.
pub fn run() -> Result<()> {
    let start = std::time::Instant::now();
    cargo(&["fmt", "--all", "--check"])?;
    cargo(&[
        "clippy",
        "--workspace",
        "--exclude",
        "lb-ebpf",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ])?;
    clippy_ebpf()?;
    let mut counts = Counts::default();
    // `cargo test` also builds the `lb` and `lbt` binaries the integration tests run. The
    // takeover test from the previous release runs when `cargo xtask previous` built it.
    let previous: Vec<(&str, std::path::PathBuf)> = Some(crate::previous::binary())
        .filter(|b| b.exists())
        .map(|b| ("LB_PREVIOUS_LB", b))
        .into_iter()
        .collect();
    let mut result = cargo_test(
        &[
            "--workspace",
            "--exclude",
            "lb-ebpf",
            "--",
            "--test-threads=2",
        ],
        &previous,
        &mut counts,
    );
    eprintln!(
        "xtask: host tests took {:.0} s",
        start.elapsed().as_secs_f64()
    );
    let fuzz_result = fuzz_step(&mut counts);
    // Smoke check of the bench: every contender runs every scenario (the numbers are not checked).
    // It runs the static x86_64 build the VM runs use next, so CI builds lb in release once for
    // this machine (the full bench, `cargo xtask bench`, uses the host's glibc build).
    if result.is_ok() {
        if lb_tests::is_root() {
            let bench = crate::musl::build(
                &crate::musl::X86_64,
                &vm::built_targets(&crate::musl::X86_64),
            )
            .and_then(|bins| {
                let dir = bins
                    .lb
                    .parent()
                    .context("cargo named lb without a directory")?;
                bench::run(true, None, dir)
            });
            match &bench {
                Ok(()) => counts.passed += 1,
                Err(_) => counts.failed += 1,
            }
            result = bench;
        } else {
            let reason = format!("{} (network namespaces, BPF)", lb_tests::NEEDS_ROOT);
            eprintln!("xtask: SKIP bench --quick: {reason}");
            counts.skipped += 1;
            counts.skips.push(Skip {
                test: "bench --quick".into(),
                reason,
            });
        }
    }
    // Every VM failure again at the end, where a log cut to its tail still shows it.
    let mut vm_notes: Vec<String> = Vec::new();
    let vm_result = vm_step(&mut counts, &mut vm_notes);
    let dist_result = dist_step(&mut counts);
    for n in &vm_notes {
        eprintln!("xtask: kernel {n}");
    }
    eprintln!("xtask: test took {:.0} s", start.elapsed().as_secs_f64());
    let privilege = close(&counts);
    result
        .and(fuzz_result)
        .and(vm_result)
        .and(dist_result)
        .and(privilege)
}

/// Seconds each fuzz target runs in `cargo xtask test`; the targets run as many at a time as
/// there are cores (a libFuzzer process uses one).
pub const FUZZ_TARGET_S: u64 = 20;

/// Every fuzz target for [`FUZZ_TARGET_S`], each one test: passed when it found nothing.
/// `LB_FUZZ_TEST=0` leaves them out, saying so.
///
/// # Errors
/// The build failing, or a target finding something (named with its input).
fn fuzz_step(counts: &mut Counts) -> Result<()> {
    if std::env::var("LB_FUZZ_TEST").is_ok_and(|v| v == "0") {
        eprintln!("xtask: LB_FUZZ_TEST=0: the fuzz targets are left out");
        return Ok(());
    }
    let start = std::time::Instant::now();
    let targets = fuzz::targets()?;
    let seconds = FUZZ_TARGET_S;
    if let Err(e) = fuzz::build() {
        counts.failed += 1;
        return Err(e);
    }
    let built = start.elapsed().as_secs_f64();
    let mut found = Vec::new();
    for (t, outcome) in targets.iter().zip(fuzz::run_many(&targets, seconds)) {
        match outcome {
            Ok(o) if o.finding.is_none() => {
                eprintln!("xtask: {}", o.line());
                counts.passed += 1;
            }
            Ok(o) => {
                eprintln!("xtask: {}", o.line());
                counts.failed += 1;
                found.push(o.line());
            }
            Err(e) => {
                eprintln!("xtask: fuzz {t}: {e:#}");
                counts.failed += 1;
                found.push(format!("fuzz {t}: {e:#}"));
            }
        }
    }
    eprintln!(
        "xtask: fuzzing took {:.0} s ({built:.0} s of it the build)",
        start.elapsed().as_secs_f64()
    );
    anyhow::ensure!(found.is_empty(), "fuzzing found:\n  {}", found.join("\n  "));
    Ok(())
}

/// The same tests on kernel 6.1, in a qemu guest (about 6 min under TCG here, plus the musl
/// build), the same tests on 5.10 (connect-time runs; every splice test asserts lb's fallback
/// there; about 4 min), the connect-time tests but the takeover ones on 6.12 (about 3 min), and the smoke subset in an arm64 6.1 guest (under a minute; its
/// aarch64 build is the one `dist --check` packages next), counted into `counts`; each guest's
/// failures go to `notes`. `LB_VM_TEST=0` leaves them out, saying so.
///
/// # Errors
/// A kernel's run failing.
fn vm_step(counts: &mut Counts, notes: &mut Vec<String>) -> Result<()> {
    if std::env::var("LB_VM_TEST").is_ok_and(|v| v == "0") {
        eprintln!(
            "xtask: LB_VM_TEST=0: the kernel 5.10, 6.1 and 6.12 VM runs and the arm64 smoke run \
             are left out"
        );
        return Ok(());
    }
    let connect_time = ["connect_time".to_string()];
    // 6.12 runs the connect-time tests but the takeover ones, which 6.1, 5.10 and the host run.
    let on_6_12: Vec<String> = vm::TESTS
        .iter()
        .filter(|t| **t != "connect_time_takeover")
        .map(|t| (*t).to_string())
        .collect();
    let runs = [
        (&vm::AMD64, "6.1", vm::Tests::All(&[])),
        (&vm::AMD64, "5.10", vm::Tests::All(&[])),
        (
            &vm::AMD64,
            "6.12",
            vm::Tests::Only {
                targets: &on_6_12,
                args: &connect_time,
            },
        ),
        (&vm::ARM64, "6.1", vm::Tests::Smoke),
    ];
    let mut vm_result = Ok(());
    for (arch, kernel, tests) in runs {
        let vm_start = std::time::Instant::now();
        let failed_before = counts.failed;
        // A guest whose kernel locks up is booted once more (the lockup is reported with its
        // stacks either way): see CONTRIBUTING's VM runs.
        let opts = vm::Options {
            lockup_retries: 1,
            ..vm::Options::default()
        };
        let r = vm::run(arch, &[kernel], &opts, tests).and_then(|outcomes| {
            for o in &outcomes {
                notes.extend(
                    o.lockups
                        .iter()
                        .map(|l| format!("{}: kernel lockup, booted again: {l}", o.label)),
                );
                notes.extend(
                    o.failures
                        .iter()
                        .map(|f| format!("{}: failed {f}", o.label)),
                );
                notes.extend(o.error.iter().map(|e| format!("{}: {e}", o.label)));
                counts.add(&o.counts);
                // A guest that never reported still counts as a failure in the closing line.
                if !o.ok() && o.counts.failed == 0 {
                    counts.failed += 1;
                }
            }
            vm::verdict(&outcomes)
        });
        let what = match tests {
            vm::Tests::All([]) => String::new(),
            vm::Tests::All(args) => format!(" ({} tests)", args.join(" ")),
            vm::Tests::Only { targets, args } if !args.is_empty() => {
                format!(" ({} tests of {} targets)", args.join(" "), targets.len())
            }
            vm::Tests::Only { targets, .. } => format!(" ({})", targets.join(" ")),
            vm::Tests::Smoke => " (smoke subset)".to_string(),
            vm::Tests::Crash => " (crash report)".to_string(),
        };
        eprintln!(
            "xtask: kernel {kernel} {} VM run{what} took {:.0} s",
            arch.musl.deb,
            vm_start.elapsed().as_secs_f64()
        );
        if r.is_err() && counts.failed == failed_before {
            // The build or the run itself failed before any count.
            counts.failed += 1;
        }
        vm_result = vm_result.and(r);
    }
    vm_result.and(crash_step(counts, notes))
}

/// A guest whose kernel crashes while a test runs (SysRq c, [`vm::Tests::Crash`]) ends the run
/// at once, and the run names the test and shows the kernel's stacks: one test, on 6.12 (the
/// fastest boot).
fn crash_step(counts: &mut Counts, notes: &mut Vec<String>) -> Result<()> {
    let start = std::time::Instant::now();
    let opts = vm::Options {
        // A crash ends the guest within seconds of boot; a run that reaches this did not crash.
        timeout: std::time::Duration::from_secs(300),
        ..vm::Options::default()
    };
    let r = vm::run(&vm::AMD64, &["6.12"], &opts, vm::Tests::Crash)
        .and_then(|outcomes| vm::crash_verdict(&outcomes));
    eprintln!(
        "xtask: kernel 6.12 amd64 crash report run took {:.0} s",
        start.elapsed().as_secs_f64()
    );
    match &r {
        Ok(()) => {
            // The summary above shows that guest as FAIL: its kernel was crashed on purpose.
            eprintln!(
                "xtask: crash report check passed: the crashed guest named its test and printed \
                 the kernel's panic and stack"
            );
            counts.passed += 1;
        }
        Err(e) => {
            counts.failed += 1;
            notes.push(format!("6.12: {e:#}"));
        }
    }
    r
}

/// `cargo xtask dist --check` as one test: the packages built and checked (the amd64 .deb
/// installed here and purged). After the VM runs their x86_64 and aarch64 musl builds are
/// fresh, so only the packaging is left. `LB_DIST_TEST=0` leaves it out, saying so.
///
/// # Errors
/// The build or a check failing.
fn dist_step(counts: &mut Counts) -> Result<()> {
    if std::env::var("LB_DIST_TEST").is_ok_and(|v| v == "0") {
        eprintln!("xtask: LB_DIST_TEST=0: dist --check is left out");
        return Ok(());
    }
    if !lb_tests::is_root() {
        let reason = format!("{} (dpkg -i of the .deb)", lb_tests::NEEDS_ROOT);
        eprintln!("xtask: SKIP dist --check: {reason}");
        counts.skipped += 1;
        counts.skips.push(Skip {
            test: "dist --check".into(),
            reason,
        });
        return Ok(());
    }
    let start = std::time::Instant::now();
    let r = dist::run().and_then(|d| dist::check::run(&d));
    eprintln!(
        "xtask: dist --check took {:.0} s",
        start.elapsed().as_secs_f64()
    );
    match &r {
        Ok(()) => counts.passed += 1,
        Err(e) => {
            eprintln!("xtask: dist --check failed: {e:#}");
            counts.failed += 1;
        }
    }
    r
}

/// List every skipped test with its reason and print the closing line. Skips count as skipped,
/// never as passed; when xtask runs as root (CI) a test that skipped for lack of privilege
/// fails the run.
///
/// # Errors
/// Names the tests that skipped for lack of privilege, when running as root.
/// clippy on lb-ebpf, for the BPF target with the pinned nightly (`-Z build-std=core`), warnings
/// denied and every `unsafe` block's `// SAFETY:` comment required. Its own target directory, so
/// the build of the embedded programs (`lb-user/build.rs`) is not disturbed.
///
/// # Errors
/// A lint, or the toolchain missing (`cargo xtask setup` installs it).
fn clippy_ebpf() -> Result<()> {
    let toolchain = crate::setup::bpf_toolchain()?;
    let args = [
        "run",
        toolchain.as_str(),
        "cargo",
        "clippy",
        "--release",
        "--target",
        "bpfel-unknown-none",
        "-Z",
        "build-std=core",
        "--",
        "-D",
        "warnings",
        "-D",
        "clippy::undocumented_unsafe_blocks",
    ];
    eprintln!("xtask: (lb-ebpf) rustup {}", args.join(" "));
    let status = std::process::Command::new("rustup")
        .args(args)
        .current_dir(crate::util::root().join("lb-ebpf"))
        .env(
            "CARGO_TARGET_DIR",
            crate::util::root().join("target/ebpf-clippy"),
        )
        .status()?;
    anyhow::ensure!(status.success(), "clippy on lb-ebpf failed ({status})");
    Ok(())
}

fn close(counts: &Counts) -> Result<()> {
    for s in &counts.skips {
        eprintln!("xtask: skipped {s}");
    }
    let privilege = check_privileged_skips(&counts.skips, lb_tests::is_root());
    if let Err(e) = &privilege {
        eprintln!("xtask: {e}");
    }
    println!(
        "xtask test: {} passed, {} failed, {} skipped",
        counts.passed, counts.failed, counts.skipped
    );
    privilege
}
