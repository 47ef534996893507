//! `cargo xtask previous`: the `lb` of the previous release, built from this repository's own
//! history and cached under `target/previous/<short commit>/`, for the takeover test that starts the
//! previous release on connect-time pins and this build over them
//! (`tests/tests/connect_time_takeover.rs`, which reads its path from `LB_PREVIOUS_LB`).
//! [`COMMIT`] is kept current at every release.

use std::{path::PathBuf, process::Command};

use anyhow::{Context as _, Result, bail};

use crate::util::root;

/// The previous release's commit: the last build whose connect-time pins are of the first
/// layout (the parent of the commit that made it 2), a 0.3.0 build speaking hand-over version
/// 4. Its pins differ from this build's in layout and in the control map's size.
pub const COMMIT: &str = "0b098bea26ee3bb6877f375fbf8a1e3dd31af9c0";

/// The worktree's directory under `target/previous/`: the commit's short form.
fn dir() -> PathBuf {
    root().join("target/previous").join(&COMMIT[..7])
}

/// Where the previous release's `lb` is once built.
pub fn binary() -> PathBuf {
    dir().join("target/debug/lb")
}

/// Build the previous release's `lb` (debug) in a worktree at `target/previous/<short commit>` with
/// a target directory of its own, unless it is built already; its path.
///
/// # Errors
/// The commit is not in this clone's history (a shallow clone), or the build fails.
pub fn build() -> Result<PathBuf> {
    let bin = binary();
    if bin.exists() {
        eprintln!(
            "xtask: the previous release's lb ({COMMIT}) is {}",
            bin.display()
        );
        return Ok(bin);
    }
    let tree = dir();
    if !tree.join("Cargo.toml").exists() {
        let status = Command::new("git")
            .args(["worktree", "add", "--force", "--detach"])
            .arg(&tree)
            .arg(COMMIT)
            .current_dir(root())
            .status()
            .context("running git worktree add")?;
        if !status.success() {
            bail!(
                "git worktree add {} {COMMIT} failed ({status}): is this a shallow clone? (`git fetch --unshallow`)",
                tree.display()
            );
        }
    }
    eprintln!(
        "xtask: building the previous release's lb ({COMMIT}) in {}",
        tree.display()
    );
    let status = Command::new(env!("CARGO"))
        .args(["build", "-p", "lb-user"])
        .current_dir(&tree)
        .env_remove("CARGO_TARGET_DIR")
        .status()?;
    if !status.success() || !bin.exists() {
        bail!("building {COMMIT}'s lb failed ({status})");
    }
    Ok(bin)
}
