//! The amd64 .deb installed on this machine with `dpkg -i`, used and purged, twice: once with
//! the pin directory locked as a running lb locks it (its `lb cleanup` is refused, the removal
//! goes on), once free (`lb cleanup` removes it), with the installed files checked in between.
//! Every purge runs in a mount namespace of its own over a fresh bpffs, so the prerm's
//! `lb cleanup` never touches the pins of an lb running on this machine; a guard purges the
//! package when a check fails.

use std::{
    os::unix::fs::MetadataExt as _,
    path::Path,
    process::{Command, Output},
};

use anyhow::{Context as _, Result, bail, ensure};

use super::{
    Packed,
    check::{run_out, stdout},
    payload::{self, File},
};

/// The pin directory the purge's `lb cleanup` finds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pins {
    /// Empty and unlocked: `lb cleanup` removes it.
    Free,
    /// Locked (`flock`) as a running lb holds it: `lb cleanup` is refused.
    Held,
}

/// The .deb installed while alive: dropping it purges the package (after a failed check too).
struct Installed;

impl Drop for Installed {
    fn drop(&mut self) {
        match purge(Pins::Free) {
            Ok(out) if out.status.success() => {}
            Ok(out) => eprintln!(
                "dist check: dpkg --purge lb failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            Err(e) => eprintln!("dist check: dpkg --purge lb: {e:#}"),
        }
    }
}

/// `dpkg --purge lb` in a mount namespace of its own with a fresh bpffs at /sys/fs/bpf and an
/// empty pin directory `lb/default` in it, locked during the purge for [`Pins::Held`]. Prints
/// `BPFFS_READY` once the directory is made (the purge runs anyway) and `PIN_DIR_LEFT` when it
/// is still there after.
fn purge(pins: Pins) -> Result<Output> {
    run_out(
        Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-ec"])
            .arg(
                "d=/sys/fs/bpf/lb/default
                 if mount -t bpf bpf /sys/fs/bpf && mkdir -p $d; then echo BPFFS_READY; fi
                 if [ \"$HOLD\" = 1 ] && [ -d $d ]; then flock $d dpkg --purge lb
                 else dpkg --purge lb; fi
                 if [ -e $d ]; then echo PIN_DIR_LEFT; fi",
            )
            .env("HOLD", if pins == Pins::Held { "1" } else { "0" }),
    )
}

/// dpkg's status of package lb (`install ok installed`, `deinstall ok config-files`, ...),
/// unless dpkg knows nothing of it.
fn deb_status() -> Option<String> {
    let out = Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", "lb"])
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    Some(stdout(&out)).filter(|s| !s.is_empty() && !s.ends_with(" not-installed"))
}

/// Processes running /usr/bin/lb (by their executable's path).
fn lb_processes() -> Vec<u32> {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .filter_map(|e| e.ok()?.file_name().into_string().ok()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_link(format!("/proc/{pid}/exe"))
                .is_ok_and(|exe| exe == Path::new(payload::BIN))
        })
        .collect()
}

/// `dpkg -i` of the package, with the guard that purges it.
fn install(p: &Packed) -> Result<Installed> {
    let out = run_out(Command::new("dpkg").arg("-i").arg(&p.deb))?;
    let installed = Installed;
    ensure!(
        out.status.success(),
        "dpkg -i {}: {}\n{}",
        p.deb.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(installed)
}

/// Install the amd64 .deb, purge it with the pin directory held; install it again, use it,
/// and purge it with the directory free.
///
/// # Errors
/// lb already installed here (or a file it would overwrite present), or a check failing.
pub fn deb(p: &Packed, version: &str) -> Result<()> {
    if let Some(status) = deb_status() {
        bail!(
            "package lb is already known to dpkg ({status}): the check installs and purges its \
             own; run dpkg --purge lb first"
        );
    }
    for f in &p.deb_files {
        ensure!(
            !Path::new(&f.path).exists(),
            "{} exists and belongs to no lb package: the check would overwrite it",
            f.path
        );
    }
    purged(p, install(p)?, Pins::Held)?;
    let installed = install(p)?;
    installed_files(&p.deb_files)?;
    runs(version)?;
    not_started()?;
    purged(p, installed, Pins::Free)?;
    eprintln!(
        "dist check: {} installed ({} files root-owned, lb --version, config check, unit at {}, \
         lb not started) and purged (lb cleanup refused while the pin directory was locked, the \
         removal went on; then it removed the free directory; no file left), twice",
        p.deb.file_name().unwrap_or_default().to_string_lossy(),
        p.deb_files.len(),
        payload::UNIT
    );
    Ok(())
}

/// The installed lb answers `--version` and checks the shipped K3s example; the unit runs it.
fn runs(version: &str) -> Result<()> {
    let lb = Path::new(payload::BIN);
    let out = run_out(Command::new(lb).arg("--version"))?;
    ensure!(
        stdout(&out) == format!("lb {version}\n"),
        "{} --version: {:?}",
        payload::BIN,
        stdout(&out)
    );
    let out = run_out(Command::new(lb).args(["config", "check", payload::K3S_AGENT_EXAMPLE]))?;
    ensure!(
        out.status.success()
            && stdout(&out).starts_with(&format!("{}: valid", payload::K3S_AGENT_EXAMPLE)),
        "lb config check {}: {} {}",
        payload::K3S_AGENT_EXAMPLE,
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let unit = std::fs::read_to_string(payload::UNIT)?;
    ensure!(
        unit.lines()
            .any(|l| l == "ExecStart=/usr/bin/lb run --config /etc/lb/lb.toml"),
        "{} runs no /usr/bin/lb",
        payload::UNIT
    );
    Ok(())
}

/// Purge the package (the guard purges again if this fails) and check what its prerm's
/// `lb cleanup` did with the pin directory, and that nothing of the package is left.
fn purged(p: &Packed, installed: Installed, pins: Pins) -> Result<()> {
    let out = purge(pins)?;
    let said = format!("{}{}", stdout(&out), String::from_utf8_lossy(&out.stderr));
    ensure!(
        out.status.success(),
        "dpkg --purge lb ({pins:?} pins) failed ({}): {said}",
        out.status
    );
    // Purged: nothing left for the guard.
    std::mem::forget(installed);
    ensure!(
        said.contains("BPFFS_READY"),
        "lb is purged, but no bpffs could be mounted at /sys/fs/bpf to check its lb cleanup: {said}"
    );
    let cleaned = match pins {
        Pins::Free => {
            said.contains("/sys/fs/bpf/lb/default: nothing pinned")
                && !said.contains("PIN_DIR_LEFT")
        }
        Pins::Held => {
            said.contains("lb: cleanup refused")
                && said.contains("the package is removed anyway")
                && said.contains("PIN_DIR_LEFT")
        }
    };
    ensure!(
        cleaned,
        "the prerm's lb cleanup with the pin directory {pins:?}: {said}"
    );
    ensure!(
        deb_status().is_none(),
        "dpkg still knows lb after the purge"
    );
    for f in &p.deb_files {
        ensure!(
            !Path::new(&f.path).exists(),
            "{} is left after the purge",
            f.path
        );
    }
    Ok(())
}

/// Every packed file is installed, root's, with its mode and contents, and dpkg lists it.
fn installed_files(files: &[File]) -> Result<()> {
    let listed = stdout(&run_out(Command::new("dpkg").args(["-L", "lb"]))?);
    for f in files {
        let meta =
            std::fs::metadata(&f.path).with_context(|| format!("{} not installed", f.path))?;
        ensure!(
            meta.uid() == 0 && meta.gid() == 0 && meta.mode() & 0o7777 == f.mode,
            "{}: uid {} gid {} mode {:o}, packed root:root {:o}",
            f.path,
            meta.uid(),
            meta.gid(),
            meta.mode() & 0o7777,
            f.mode
        );
        ensure!(
            std::fs::read(&f.path)? == f.data,
            "{}: not the packed contents",
            f.path
        );
        ensure!(
            listed.lines().any(|l| l == f.path),
            "dpkg -L lb does not list {}",
            f.path
        );
    }
    Ok(())
}

/// Installing started no lb: no process runs /usr/bin/lb, and where systemd runs, the unit is
/// neither active nor enabled.
fn not_started() -> Result<()> {
    let pids = lb_processes();
    ensure!(
        pids.is_empty(),
        "installing started lb: pid(s) {pids:?} run {}",
        payload::BIN
    );
    if Path::new("/run/systemd/system").is_dir() {
        for what in ["is-active", "is-enabled"] {
            let out = run_out(Command::new("systemctl").args([what, "lb.service"]))?;
            ensure!(
                !out.status.success(),
                "after installing, systemctl {what} lb.service says {}",
                stdout(&out).trim()
            );
        }
    }
    Ok(())
}
