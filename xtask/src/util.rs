//! Shared helpers: the workspace root, cargo invocations, and the test driver.

use std::{
    path::PathBuf,
    process::{Command, Stdio},
};

use anyhow::{Result, bail};

/// The workspace root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or_default()
}

/// Run cargo with `args` in the workspace root.
///
/// # Errors
/// Non-zero exit.
pub fn cargo(args: &[&str]) -> Result<()> {
    eprintln!("xtask: cargo {}", args.join(" "));
    let status = Command::new(env!("CARGO"))
        .args(args)
        .current_dir(root())
        .status()?;
    if !status.success() {
        bail!("cargo {} failed ({status})", args.join(" "));
    }
    Ok(())
}

/// Build `lb` and `lbt` in release mode.
///
/// # Errors
/// Build failure.
pub fn build_release() -> Result<()> {
    cargo(&[
        "build",
        "--release",
        "-p",
        "lb-user",
        "-p",
        "lb-tests",
        "--bins",
    ])
}

/// Counts from cargo test's `test result:` lines.
#[derive(Debug, Default, Clone, Copy)]
pub struct Counts {
    /// Passed.
    pub passed: u64,
    /// Failed.
    pub failed: u64,
    /// Ignored.
    pub ignored: u64,
}

/// Run `cargo test ARGS`, echoing its output, and add its result lines to `counts`.
///
/// # Errors
/// Non-zero exit.
pub fn cargo_test(args: &[&str], counts: &mut Counts) -> Result<()> {
    eprintln!("xtask: cargo test {}", args.join(" "));
    let mut child = Command::new(env!("CARGO"))
        .arg("test")
        .args(args)
        .current_dir(root())
        .stdout(Stdio::piped())
        .spawn()?;
    let out = child.stdout.take().map(std::io::BufReader::new);
    if let Some(out) = out {
        use std::io::BufRead as _;
        for line in out.lines().map_while(Result::ok) {
            println!("{line}");
            if let Some(rest) = line.strip_prefix("test result: ") {
                let num = |word: &str| -> u64 {
                    rest.split(';')
                        .find(|p| p.trim().ends_with(word))
                        .and_then(|p| {
                            p.split_whitespace()
                                .rev()
                                .nth(1)
                                .and_then(|n| n.parse().ok())
                        })
                        .unwrap_or(0)
                };
                counts.passed += num("passed");
                counts.failed += num("failed");
                counts.ignored += num("ignored");
            }
        }
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("cargo test {} failed ({status})", args.join(" "));
    }
    Ok(())
}

/// Everything CI runs.
///
/// # Errors
/// The first failing step.
pub fn test() -> Result<()> {
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
    let mut counts = Counts::default();
    // `cargo test` also builds the `lb` and `lbt` binaries the integration tests run.
    let mut result = cargo_test(
        &[
            "--workspace",
            "--exclude",
            "lb-ebpf",
            "--",
            "--test-threads=2",
        ],
        &mut counts,
    );
    eprintln!(
        "xtask: host tests took {:.0} s",
        start.elapsed().as_secs_f64()
    );
    // Smoke check of the bench: every contender runs every scenario (the numbers are not checked).
    if result.is_ok() {
        if lb_tests::is_root() {
            let bench = build_release().and_then(|()| crate::bench::run(true));
            match &bench {
                Ok(()) => counts.passed += 1,
                Err(_) => counts.failed += 1,
            }
            result = bench;
        } else {
            eprintln!("xtask: SKIP bench --quick: needs root (network namespaces, BPF)");
            counts.ignored += 1;
        }
    }
    // The same tests on the oldest supported kernel, in a qemu guest (about 4 min under TCG
    // here, plus the musl build). `LB_VM_TEST=0` leaves it out, saying so.
    let vm_result = if std::env::var("LB_VM_TEST").is_ok_and(|v| v == "0") {
        eprintln!("xtask: LB_VM_TEST=0: the kernel 6.1 VM run is left out");
        Ok(())
    } else {
        let vm_start = std::time::Instant::now();
        let r = crate::vm::run(&["6.1"], crate::vm::DEFAULT_TIMEOUT, &[]).and_then(|outcomes| {
            for o in &outcomes {
                counts.passed += o.counts.passed;
                counts.failed += o.counts.failed;
                counts.ignored += o.counts.ignored;
                // A guest that never reported still counts as a failure in the closing line.
                if !o.ok() && o.counts.failed == 0 {
                    counts.failed += 1;
                }
            }
            crate::vm::verdict(&outcomes)
        });
        eprintln!(
            "xtask: kernel 6.1 VM run took {:.0} s",
            vm_start.elapsed().as_secs_f64()
        );
        if r.is_err() && counts.failed == 0 {
            // The build or the run itself failed before any count.
            counts.failed += 1;
        }
        r
    };
    eprintln!("xtask: test took {:.0} s", start.elapsed().as_secs_f64());
    println!(
        "xtask test: {} passed, {} failed, {} skipped",
        counts.passed, counts.failed, counts.ignored
    );
    result.and(vm_result)
}
