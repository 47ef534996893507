//! Why a privileged test does not run (not root, or a kernel older than the feature it needs),
//! and how it says so, so that a skipped test is counted as skipped and never as passed.
//!
//! A test that cannot run calls [`skip`] (through [`skip_unless_root`] or
//! [`skip_unless_kernel`]) and returns `Ok`, which libtest counts as passed. None of them takes
//! the test's name: libtest runs every test on a thread named after it, and [`test_name`] reads
//! it from there, so no test spells its own name. [`skip`] prints one
//! machine-readable line, `SKIP <test>: <reason>`, on stdout, and appends the same line to the
//! file named by `$LB_TEST_SKIP_LOG` ([`SKIP_LOG_ENV`]) when that is set. The file is what
//! `cargo xtask test` reads: libtest captures the stdout of passing tests and throws it away
//! unless run with `--nocapture`, and the file works with any `--test-threads`, with or
//! without `--nocapture`, across every test binary of one `cargo test`. The stdout line is for
//! people and for the VM guest, which runs the tests with `--nocapture` and reads its console.
//! Each such line moves one test from passed to skipped; a reason that starts with
//! [`NEEDS_ROOT`] marks a skip for lack of privilege, which fails `cargo xtask test` when it runs
//! as root (CI), since there every privileged test must run.

use std::{io::Write as _, path::Path};

/// Names the file every skip is appended to (one `SKIP <test>: <reason>` line each).
pub const SKIP_LOG_ENV: &str = "LB_TEST_SKIP_LOG";

/// How the reason of a skip for lack of privilege begins.
pub const NEEDS_ROOT: &str = "needs root";

/// True when running as root (privileged tests skip otherwise, saying so).
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// The name of the running test: the last `::` part of the current thread's name, which
/// libtest sets to the test's path (also with `--test-threads=1`), so `a::b::some_test` gives
/// `some_test`, the bare function name every `SKIP` line carries.
///
/// # Panics
/// On a thread that libtest did not start for a test (an unnamed or the main thread): a skip
/// reported under the wrong name would be counted against another test.
pub fn test_name() -> String {
    let thread = std::thread::current();
    match thread.name() {
        Some(path) if path != "main" => path.rsplit("::").next().unwrap_or(path).to_string(),
        _ => panic!("test_name() called outside a libtest test thread"),
    }
}

/// The line that reports a skip: `SKIP <test>: <reason>`.
pub fn skip_line(test: &str, reason: &str) -> String {
    format!("SKIP {test}: {reason}")
}

/// Report that the running test ([`test_name`]) is skipped because of `reason`: print
/// [`skip_line`] on stdout and append it to `$LB_TEST_SKIP_LOG` when set. The caller then
/// returns `Ok` without testing anything.
///
/// # Panics
/// When `$LB_TEST_SKIP_LOG` is set but cannot be written: a skip that cannot be recorded would
/// be counted as a pass, so the test fails instead. Outside a test thread (see [`test_name`]).
pub fn skip(reason: &str) {
    let line = skip_line(&test_name(), reason);
    println!("{line}");
    if let Some(log) = std::env::var_os(SKIP_LOG_ENV)
        && let Err(e) = append_line(Path::new(&log), &line)
    {
        panic!(
            "cannot record `{line}` in {}: {e}",
            Path::new(&log).display()
        );
    }
}

/// Append `line` and a newline in one write (`O_APPEND`, so lines from tests running in
/// parallel do not mix).
fn append_line(log: &Path, line: &str) -> std::io::Result<()> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?
        .write_all(format!("{line}\n").as_bytes())
}

/// Report a skip and return true when not running as root (the reason starts with
/// [`NEEDS_ROOT`]); false when the test may run.
pub fn skip_unless_root() -> bool {
    if is_root() {
        return false;
    }
    skip(&format!("{NEEDS_ROOT} (network namespaces, BPF)"));
    true
}

/// The running kernel's `(major, minor)`, from `/proc/sys/kernel/osrelease`.
pub fn kernel_version() -> Option<(u32, u32)> {
    parse_kernel_release(&std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()?)
}

/// Whether this kernel is one the splice runs on: 5.15 or later (the sockops program needs
/// `bpf_get_netns_cookie`). lb itself decides by probing; the tests know the Debian kernels they
/// run on (5.10, 6.1, 6.12, the host's), so they can say which outcome to expect on each: the
/// splice, or the fallback with its reason.
pub fn splice_kernel() -> bool {
    kernel_version().is_some_and(|v| v >= (5, 15))
}

/// `(major, minor)` of a release string such as `6.1.0-57-amd64` or `6.12.117+deb12-amd64`.
fn parse_kernel_release(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.trim().split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// Report a skip and return true when the kernel is older than `min`; `feature` names what the
/// test needs (e.g. `"bpf_sock_destroy"`). A legitimate skip: counted as skipped, never a
/// failure; `cargo xtask vm-test` lists it in its summary.
pub fn skip_unless_kernel(min: (u32, u32), feature: &str) -> bool {
    match kernel_version() {
        Some(v) if v >= min => false,
        v => {
            let running = v.map_or_else(|| "unknown".to_string(), |(a, b)| format!("{a}.{b}"));
            skip(&format!(
                "needs {feature} (kernel {}.{}+), running {running}",
                min.0, min.1
            ));
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skip_lines_are_appended_whole() -> std::io::Result<()> {
        let log = std::env::temp_dir().join(format!("lb-skip-log-test-{}", std::process::id()));
        let _ = std::fs::remove_file(&log);
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let log = log.clone();
                std::thread::spawn(move || {
                    append_line(&log, &skip_line(&format!("t{i}"), "needs root (x)"))
                })
            })
            .collect();
        for t in threads {
            t.join().expect("thread")?;
        }
        let text = std::fs::read_to_string(&log)?;
        std::fs::remove_file(&log)?;
        let mut lines: Vec<&str> = text.lines().collect();
        lines.sort_unstable();
        let want: Vec<String> = (0..8)
            .map(|i| format!("SKIP t{i}: needs root (x)"))
            .collect();
        assert_eq!(lines, want);
        assert!(want[0].starts_with(&format!("SKIP t0: {NEEDS_ROOT}")));
        Ok(())
    }

    /// libtest names each test's thread after the test's path, also when it runs one test at a
    /// time (`--test-threads=1`, as the VM guest does); [`test_name`] keeps the last part.
    #[test]
    fn a_test_knows_its_own_name() {
        assert_eq!(test_name(), "a_test_knows_its_own_name");
        let path = std::thread::current().name().map(str::to_string);
        assert_eq!(
            path.as_deref(),
            Some("skip::tests::a_test_knows_its_own_name")
        );
    }

    #[test]
    fn kernel_releases() {
        assert_eq!(parse_kernel_release("6.1.0-57-amd64\n"), Some((6, 1)));
        assert_eq!(parse_kernel_release("6.12.117+deb12-amd64"), Some((6, 12)));
        assert_eq!(parse_kernel_release("6.18.44-fc-v669"), Some((6, 18)));
        assert_eq!(parse_kernel_release("garbage"), None);
        assert!((6, 1) < (6, 5) && (6, 12) >= (6, 5));
    }
}
