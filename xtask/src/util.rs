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

/// A test that ran but did not test anything, and why: from its `SKIP <test>: <reason>` line
/// (see `lb_tests::skip`), or in the VM a test libtest ignored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skip {
    /// The test's name.
    pub test: String,
    /// Why it skipped, e.g. `needs root (network namespaces, BPF)`.
    pub reason: String,
}

impl Skip {
    /// The `SKIP <test>: <reason>` in `line` (it may follow other text, as libtest's
    /// `test <name> ... ` does under `--nocapture`), if there is one.
    pub fn parse(line: &str) -> Option<Skip> {
        let at = line.match_indices("SKIP ").find_map(|(at, _)| {
            let before = line[..at].chars().next_back();
            (!before.is_some_and(|c| c.is_alphanumeric() || c == '_')).then_some(at)
        })?;
        let (test, reason) = line[at + 5..].split_once(": ")?;
        if test.is_empty() || test.contains(char::is_whitespace) {
            return None;
        }
        Some(Skip {
            test: test.to_string(),
            reason: reason.trim().to_string(),
        })
    }

    /// True when the test skipped for lack of privilege (not root).
    pub fn for_privilege(&self) -> bool {
        self.reason.starts_with(lb_tests::NEEDS_ROOT)
    }
}

impl std::fmt::Display for Skip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.test, self.reason)
    }
}

/// Test counts: every test is passed, failed or skipped (ignored by libtest, or run and
/// reported skipped with a `SKIP` line; those are not passes).
#[derive(Debug, Default, Clone)]
pub struct Counts {
    /// Passed.
    pub passed: u64,
    /// Failed.
    pub failed: u64,
    /// Skipped: ignored, or reported with a `SKIP` line.
    pub skipped: u64,
    /// The skipped tests that said why.
    pub skips: Vec<Skip>,
}

impl Counts {
    /// Add `other`'s counts and skips.
    pub fn add(&mut self, other: &Counts) {
        self.passed += other.passed;
        self.failed += other.failed;
        self.skipped += other.skipped;
        self.skips.extend(other.skips.iter().cloned());
    }
}

/// cargo test's output read line by line, turned into [`Counts`] at the end (a `SKIP` line may
/// come before or after the `test result:` line that counted its test as passed).
#[derive(Debug, Default)]
pub struct Tally {
    passed: u64,
    failed: u64,
    ignored: u64,
    skips: Vec<Skip>,
}

impl Tally {
    /// Add libtest's `test result: ok. P passed; F failed; I ignored; ...`; false for any other
    /// line.
    pub fn result_line(&mut self, line: &str) -> bool {
        let Some(rest) = line.trim_start().strip_prefix("test result: ") else {
            return false;
        };
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
        self.passed += num("passed");
        self.failed += num("failed");
        self.ignored += num("ignored");
        true
    }

    /// Add a `SKIP <test>: <reason>` line; false for any other line.
    pub fn skip_line(&mut self, line: &str) -> bool {
        match Skip::parse(line) {
            Some(s) => {
                self.skips.push(s);
                true
            }
            None => false,
        }
    }

    /// The counts: each `SKIP` moves one test from passed to skipped.
    pub fn counts(&self) -> Counts {
        let n = self.skips.len() as u64;
        Counts {
            passed: self.passed.saturating_sub(n),
            failed: self.failed,
            skipped: self.ignored + n,
            skips: self.skips.clone(),
        }
    }
}

/// Fail when running as root (`as_root`, as CI does) and any test skipped for lack of
/// privilege: there every privileged test must run. Skips for other reasons (an older kernel)
/// are legitimate and pass.
///
/// # Errors
/// Names every test that skipped for lack of privilege.
pub fn check_privileged_skips(skips: &[Skip], as_root: bool) -> Result<()> {
    let bad: Vec<&str> = skips
        .iter()
        .filter(|s| s.for_privilege())
        .map(|s| s.test.as_str())
        .collect();
    if as_root && !bad.is_empty() {
        bail!(
            "{} privileged test(s) skipped for lack of root although xtask runs as root: {}",
            bad.len(),
            bad.join(", ")
        );
    }
    Ok(())
}

/// Run `cargo test ARGS` with the environment variables `envs` added, echoing its output, and add
/// what it reports to `counts`.
///
/// Passes come from libtest's `test result:` lines on stdout. Skips come from a file: the test
/// binaries append a `SKIP <test>: <reason>` line to the file named by
/// `lb_tests::SKIP_LOG_ENV` for every test that skipped, and this sets that variable to a fresh
/// file for the run. Stdout cannot carry them: libtest captures a passing test's output and
/// drops it (unless `--nocapture`, which would interleave every test's output), whereas the
/// file holds one whole line per skip whatever `--test-threads` and capture settings are, across
/// every test binary the run starts.
///
/// # Errors
/// Non-zero exit, or the skip file unreadable.
pub fn cargo_test(args: &[&str], envs: &[(&str, PathBuf)], counts: &mut Counts) -> Result<()> {
    eprintln!("xtask: cargo test {}", args.join(" "));
    let skip_log = root().join(format!(
        "target/xtask-test-skips-{}.log",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&skip_log);
    let mut child = Command::new(env!("CARGO"))
        .arg("test")
        .args(args)
        .current_dir(root())
        .env(lb_tests::SKIP_LOG_ENV, &skip_log)
        .envs(envs.iter().cloned())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut tally = Tally::default();
    let out = child.stdout.take().map(std::io::BufReader::new);
    if let Some(out) = out {
        use std::io::BufRead as _;
        for line in out.lines().map_while(Result::ok) {
            println!("{line}");
            tally.result_line(&line);
        }
    }
    let status = child.wait()?;
    let skipped = match std::fs::read_to_string(&skip_log) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => bail!("reading {}: {e}", skip_log.display()),
    };
    let _ = std::fs::remove_file(&skip_log);
    for line in skipped.lines() {
        tally.skip_line(line);
    }
    counts.add(&tally.counts());
    if !status.success() {
        bail!("cargo test {} failed ({status})", args.join(" "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_and_skip_lines_make_the_counts() {
        let mut t = Tally::default();
        for line in [
            "running 5 tests",
            "test a ... ok",
            "SKIP b: needs root (network namespaces, BPF)",
            "test c ... SKIP c: needs bpf_sock_destroy (kernel 6.5+), running 6.1",
            "test result: ok. 4 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s",
            "SKIP d: needs root (network namespaces, BPF)",
            "test result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out",
            "xtask: SKIP bench --quick: needs root",
            "NOSKIP e: not a skip",
        ] {
            if !t.result_line(line) {
                t.skip_line(line);
            }
        }
        let c = t.counts();
        // 6 passed by libtest, 3 of them skipped; 1 ignored.
        assert_eq!((c.passed, c.failed, c.skipped), (3, 1, 4));
        let names: Vec<&str> = c.skips.iter().map(|s| s.test.as_str()).collect();
        assert_eq!(names, ["b", "c", "d"]);
        assert!(c.skips[0].for_privilege() && !c.skips[1].for_privilege());
        assert_eq!(
            c.skips[1].to_string(),
            "c: needs bpf_sock_destroy (kernel 6.5+), running 6.1"
        );
    }

    #[test]
    fn the_line_lb_tests_prints_parses() {
        let line = lb_tests::skip_line("t", &format!("{} (x)", lb_tests::NEEDS_ROOT));
        let s = Skip::parse(&line).expect("a skip line");
        assert_eq!(s.test, "t");
        assert!(s.for_privilege());
    }

    #[test]
    fn a_privilege_skip_fails_only_as_root() {
        let skips = [
            Skip::parse("SKIP a: needs root (network namespaces, BPF)").expect("skip"),
            Skip::parse("SKIP k: needs bpf_sock_destroy (kernel 6.5+), running 6.1").expect("skip"),
            Skip::parse("SKIP b: needs root (network namespaces, BPF)").expect("skip"),
        ];
        let err = check_privileged_skips(&skips, true).expect_err("root run must fail");
        assert!(
            err.to_string().contains("2 privileged test(s)") && err.to_string().ends_with(": a, b")
        );
        assert!(check_privileged_skips(&skips, false).is_ok());
        assert!(
            check_privileged_skips(&skips[1..2], true).is_ok(),
            "a kernel skip is legitimate"
        );
    }
}
