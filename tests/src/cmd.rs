//! Running programs: a command that must succeed, one bounded in time, and where the `lb` and `lbt` binaries are.

use std::{
    io::Read,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

/// Run a command, fail with its stderr when it fails.
///
/// # Errors
/// Spawn failure or non-zero exit.
pub fn sh(cmd: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .with_context(|| format!("spawning {cmd}"))?;
    if !out.status.success() {
        bail!(
            "{cmd} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

static BIN_DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Use binaries from `dir` (e.g. `target/release`) instead of the test executable's directory.
pub fn set_bin_dir(dir: PathBuf) {
    let _ = BIN_DIR.set(dir);
}

/// Path of a binary: `$env`, else in the directory given to [`set_bin_dir`], else next to the
/// test executable (`target/<profile>/NAME`).
pub fn sibling_bin(name: &str, env: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(env) {
        return PathBuf::from(p);
    }
    if let Some(dir) = BIN_DIR.get() {
        return dir.join(name);
    }
    let exe = std::env::current_exe().unwrap_or_default();
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir.join(name)
}

/// The `lb` binary (`$LB_BIN` or next to the tests).
pub fn lb_bin() -> PathBuf {
    sibling_bin("lb", "LB_BIN")
}

/// The `lbt` binary (`$LBT_BIN` or next to the tests).
pub fn lbt_bin() -> PathBuf {
    sibling_bin("lbt", "LBT_BIN")
}

/// Run `cmd` to completion with stdout and stderr captured, killing it when it is still running
/// after `timeout`.
///
/// # Errors
/// Spawn failure, or the timeout (the error carries what it printed so far).
pub fn output_within(mut cmd: Command, timeout: Duration) -> Result<Output> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawning {cmd:?}"))?;
    let read_all = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf);
            }
            buf
        })
    };
    let out = read_all(
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let err = read_all(
        child
            .stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    match status {
        Some(status) => Ok(Output {
            status,
            stdout,
            stderr,
        }),
        None => bail!(
            "{cmd:?} did not finish within {timeout:?}; stdout {:?}, stderr {:?}",
            String::from_utf8_lossy(&stdout),
            String::from_utf8_lossy(&stderr)
        ),
    }
}

/// The first line `child` writes to its (piped) stdout within `timeout`, with its newline;
/// empty when none came in time or stdout was not piped. The line is read on a thread of its
/// own, which ends with the child's stdout.
pub fn first_stdout_line(child: &mut std::process::Child, timeout: Duration) -> String {
    use std::io::BufRead as _;
    let Some(out) = child.stdout.take() else {
        return String::new();
    };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::BufReader::new(out).read_line(&mut line);
        let _ = tx.send(line);
    });
    rx.recv_timeout(timeout).unwrap_or_default()
}
