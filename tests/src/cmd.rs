//! Running programs: a command that must succeed, and where the `lb` and `lbt` binaries are.

use std::{
    path::{Path, PathBuf},
    process::Command,
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
