//! Leaf helpers every command uses: the workspace root, cargo invocations, the release build and
//! the parser of cargo test's output. It imports no other module of xtask.

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
