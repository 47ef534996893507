//! Booting a guest under qemu: KVM when it works, else TCG, single-threaded unless
//! `--tcg-multi-thread` (`--smp` sets the virtual CPUs); the console echoed line by line and
//! kept, and a hard timeout.

use std::{
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

use super::{
    Arch, Options,
    console::{End, GuestLog, KERNEL_ARGS},
};
use crate::util;

/// How long a KVM guest gets to print its boot line before KVM counts as broken (here KVM either
/// aborts at once or hangs without output).
const KVM_BOOT_DEADLINE: Duration = Duration::from_secs(30);

/// Where a guest's whole console goes: `target/vm-logs/<label>.log`, written again by each
/// boot, so a failure seen in CI can be read whole after the run.
pub fn log_file(label: &str) -> PathBuf {
    util::root().join(format!("target/vm-logs/{label}.log"))
}

/// How qemu runs the guest's CPUs.
#[derive(Clone, Copy, Debug)]
pub enum Accel {
    /// KVM, with the host's CPU.
    Kvm,
    /// TCG, emulated.
    Tcg,
}

/// Whether `/dev/kvm` opens for reading and writing (necessary, not sufficient: here it opens
/// and qemu then fails).
pub fn kvm_present() -> bool {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok()
}

/// What a boot gave.
#[derive(Debug)]
pub enum Boot {
    /// The guest booted; its log, complete or cut by the timeout.
    Done(GuestLog),
    /// The guest never printed its boot line (KVM broken).
    NoStart(String),
}

/// What one boot runs.
pub struct Guest<'a> {
    /// Its architecture.
    pub arch: &'a Arch,
    /// Its name in the log (`super::label`).
    pub label: &'a str,
    /// The kernel image (Debian's `vmlinuz`: a bzImage on amd64, a gzip'd Image on arm64, both
    /// of which qemu's `-kernel` loads).
    pub image: &'a Path,
    /// The initramfs `guest::initramfs` wrote.
    pub initrd: &'a Path,
}

/// Boot one guest, echo its console (and write it to [`log_file`]), and stop it at
/// `opts.timeout` at the latest.
///
/// # Errors
/// qemu missing or not starting.
pub fn boot(guest: &Guest<'_>, accel: Accel, opts: &Options) -> Result<Boot> {
    let timeout = opts.timeout;
    let label = guest.label;
    let (qemu, package) = guest.arch.qemu;
    let mut cmd = Command::new(qemu);
    match accel {
        Accel::Kvm => cmd.args(["-accel", "kvm", "-cpu", "host"]),
        Accel::Tcg if opts.tcg_multi_thread => cmd
            .args(["-accel", "tcg,thread=multi"])
            .args(guest.arch.tcg),
        Accel::Tcg => cmd
            .args(["-accel", "tcg,thread=single"])
            .args(guest.arch.tcg),
    };
    // No network device: the guest's only links are the veth pairs the tests make inside it.
    cmd.args(["-smp", &opts.smp.to_string(), "-m", "1G", "-nodefaults"])
        .args(["-display", "none"])
        .args(["-serial", "stdio", "-no-reboot"])
        .arg("-kernel")
        .arg(guest.image)
        .arg("-initrd")
        .arg(guest.initrd)
        .arg("-append")
        .arg(format!("console={} {KERNEL_ARGS}", guest.arch.console))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    eprintln!("vm: booting {label} with {accel:?}");
    let mut child = cmd.spawn().with_context(|| {
        format!("cannot start {qemu} (Debian package {package}; cargo xtask setup installs it)")
    })?;
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let mut readers = Vec::new();
    if let Some(out) = child.stdout.take() {
        let tx = tx.clone();
        readers.push(std::thread::spawn(move || forward(out, &tx)));
    }
    if let Some(err) = child.stderr.take() {
        let tx = tx.clone();
        readers.push(std::thread::spawn(move || forward(err, &tx)));
    }
    drop(tx);

    let start = Instant::now();
    let boot_deadline = match accel {
        Accel::Kvm => Some(start + KVM_BOOT_DEADLINE),
        Accel::Tcg => None,
    };
    let deadline = start + timeout;
    let mut lines = Vec::new();
    let mut booted = false;
    let mut result_at: Option<Instant> = None;
    let ended = loop {
        let now = Instant::now();
        // After the result line, power-off should follow at once; do not wait long for it.
        let limit = match (booted, boot_deadline, result_at) {
            (_, _, Some(at)) => at + Duration::from_secs(30),
            (false, Some(b), None) => b,
            _ => deadline,
        };
        if now >= limit {
            break End::TimedOut;
        }
        match rx.recv_timeout(limit - now) {
            Ok(line) => {
                println!("[{label}] {line}");
                if line.contains("LB_VM_BOOTED") {
                    booted = true;
                }
                if line.contains("LB_VM_RESULT ") {
                    result_at = Some(Instant::now());
                }
                lines.push(line);
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break End::Exited,
        }
    };
    if matches!(ended, End::TimedOut) {
        let _ = child.kill();
    }
    let status = child.wait()?;
    for r in readers {
        let _ = r.join();
    }
    eprintln!(
        "vm: qemu ({label}, {accel:?}) ended after {:.0} s: {status}",
        start.elapsed().as_secs_f64()
    );
    if !booted && boot_deadline.is_some() {
        let last = lines.last().cloned().unwrap_or_default();
        return Ok(Boot::NoStart(match ended {
            End::TimedOut => format!("no boot line within {} s", KVM_BOOT_DEADLINE.as_secs()),
            End::Exited => format!("qemu exited ({status}): {last}"),
        }));
    }
    // A timeout after the result line only means power-off stalled: the result stands.
    let ended = match (ended, result_at) {
        (End::TimedOut, Some(_)) => End::Exited,
        (e, _) => e,
    };
    let file = log_file(label);
    let written = file
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| std::fs::write(&file, lines.join("\n") + "\n"));
    match written {
        Ok(()) => eprintln!("vm: {label}'s console is in {}", file.display()),
        Err(e) => eprintln!("vm: cannot write {}: {e}", file.display()),
    }
    Ok(Boot::Done(GuestLog {
        lines,
        ended,
        limit: timeout,
    }))
}

/// Send each line of `from` (lossy UTF-8, `\r` trimmed) until it closes.
fn forward(from: impl std::io::Read, tx: &std::sync::mpsc::Sender<String>) {
    let mut reader = BufReader::new(from);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let line = String::from_utf8_lossy(&buf)
                    .trim_end_matches(['\r', '\n'])
                    .to_string();
                if tx.send(line).is_err() {
                    return;
                }
            }
        }
    }
}
