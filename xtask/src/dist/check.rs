//! `cargo xtask dist --check`: every file of target/dist checked with the tools that will read
//! it. SHA256SUMS matches; each binary is a static ELF of its architecture and answers
//! `--version` and `config check` (arm64 under qemu-aarch64-static); `rpm -qp` reads each .rpm's
//! name, version, release, arch, file list, owners, modes and removal script; the OCI archive is
//! read back blob by blob; the DaemonSets name its image; and the amd64 .deb is installed on
//! this machine, used and purged (`install`).

use std::{
    collections::BTreeSet,
    path::Path,
    process::{Command, Output},
};

use anyhow::{Context as _, Result, ensure};

use super::{Dist, Packed, elf, oci, payload, rpm, sha256_hex};
use crate::{musl, util};

/// Run every check.
///
/// # Errors
/// The first check that fails, named; also not being root (the .deb is really installed).
pub fn run(d: &Dist) -> Result<()> {
    ensure!(
        lb_tests::is_root(),
        "dist --check installs the amd64 .deb with dpkg -i and purges it: needs root"
    );
    sums(d)?;
    for p in &d.packed {
        binary(p, &d.version)?;
        rpm_query(p, &d.version)?;
    }
    let images: Vec<(&musl::Arch, Vec<u8>)> = d
        .packed
        .iter()
        .map(|p| Ok((p.arch, std::fs::read(&p.binary)?)))
        .collect::<Result<_>>()?;
    for line in oci::verify(&d.oci, &d.version, &images)? {
        eprintln!("dist check: oci {line}");
    }
    daemonsets(&d.version)?;
    let amd64 = d
        .packed
        .iter()
        .find(|p| p.arch.deb == musl::X86_64.deb)
        .context("no amd64 package")?;
    super::install::deb(amd64, &d.version)?;
    eprintln!("dist check: all passed");
    Ok(())
}

pub(super) fn run_out(cmd: &mut Command) -> Result<Output> {
    let shown = format!("{cmd:?}");
    cmd.output().with_context(|| format!("cannot run {shown}"))
}

pub(super) fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// SHA256SUMS names every other file of target/dist with its digest.
fn sums(d: &Dist) -> Result<()> {
    let text = std::fs::read_to_string(&d.sums)?;
    let mut listed = BTreeSet::new();
    for line in text.lines() {
        let (sum, name) = line
            .split_once("  ")
            .with_context(|| format!("SHA256SUMS: not `<sum>  <file>`: {line:?}"))?;
        let got = sha256_hex(&std::fs::read(d.dir.join(name))?);
        ensure!(
            got == sum,
            "SHA256SUMS: {name} hashes to {got}, listed {sum}"
        );
        listed.insert(name.to_string());
    }
    let present: BTreeSet<String> = std::fs::read_dir(&d.dir)?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n != "SHA256SUMS")
        .collect();
    ensure!(
        listed == present,
        "SHA256SUMS lists {listed:?}, target/dist holds {present:?}"
    );
    eprintln!("dist check: SHA256SUMS matches {} files", listed.len());
    Ok(())
}

/// A command running `bin` on this machine (through qemu's user-mode emulator for arm64).
fn runs(arch: &musl::Arch, bin: &Path) -> Command {
    match arch.runner {
        Some(runner) => {
            let mut c = Command::new(runner);
            c.arg(bin);
            c
        }
        None => Command::new(bin),
    }
}

/// The static binary: its ELF header, `--version` and `config check` of the K3s example.
fn binary(p: &Packed, version: &str) -> Result<()> {
    let bytes = std::fs::read(&p.binary)?;
    elf::check(&bytes, p.arch).with_context(|| p.binary.display().to_string())?;
    let out = run_out(runs(p.arch, &p.binary).arg("--version"))?;
    ensure!(
        out.status.success() && stdout(&out) == format!("lb {version}\n"),
        "{} --version: {} {:?}",
        p.binary.display(),
        out.status,
        stdout(&out)
    );
    let example = util::root().join("deploy/k3s/agent.toml");
    let out = run_out(
        runs(p.arch, &p.binary)
            .args(["config", "check"])
            .arg(&example),
    )?;
    ensure!(
        out.status.success(),
        "{} config check {}: {}",
        p.binary.display(),
        example.display(),
        out.status
    );
    eprintln!(
        "dist check: {} is a static {} ELF ({} bytes), `--version` and `config check` pass{}",
        p.binary.file_name().unwrap_or_default().to_string_lossy(),
        p.arch.deb,
        bytes.len(),
        p.arch
            .runner
            .map(|r| format!(" under {r}"))
            .unwrap_or_default()
    );
    Ok(())
}

/// `rpm -qp` of one .rpm: header fields, the file list with owners and modes, the removal
/// scriptlet.
fn rpm_query(p: &Packed, version: &str) -> Result<()> {
    let q = |args: &[&str]| -> Result<String> {
        let out = run_out(Command::new("rpm").args(args).arg(&p.rpm))?;
        ensure!(
            out.status.success(),
            "rpm {} {}: {}",
            args.join(" "),
            p.rpm.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(stdout(&out))
    };
    let info = q(&["-qip"])?;
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.trim_start().strip_prefix(':'))
            .map(str::trim)
            .unwrap_or_default()
    };
    let got = [
        field("Name"),
        field("Version"),
        field("Release"),
        field("Architecture"),
    ];
    let want = ["lb", version, rpm::RELEASE, p.arch.rpm];
    ensure!(
        got == want,
        "{}: rpm -qip reads name, version, release, arch {got:?}, expected {want:?}",
        p.rpm.display()
    );
    let listed: BTreeSet<String> = q(&["-qlp"])?.lines().map(str::to_string).collect();
    let mut expected: BTreeSet<String> = p.rpm_files.iter().map(|f| f.path.clone()).collect();
    expected.extend(payload::owned_dirs(&p.rpm_files));
    ensure!(
        listed == expected,
        "{}: rpm -qlp lists {:?} more and {:?} fewer than packed",
        p.rpm.display(),
        listed.difference(&expected).collect::<Vec<_>>(),
        expected.difference(&listed).collect::<Vec<_>>()
    );
    let modes = q(&[
        "-qp",
        "--queryformat",
        "[%{FILEUSERNAME}:%{FILEGROUPNAME} %{FILEMODES:octal} %{FILENAMES}\n]",
    ])?;
    for f in &p.rpm_files {
        let want = format!("root:root 100{:o} {}", f.mode, f.path);
        ensure!(
            modes.lines().any(|l| l == want),
            "{}: no `{want}` in the file modes",
            p.rpm.display()
        );
    }
    let scripts = q(&["-qp", "--scripts"])?;
    ensure!(
        scripts.contains("preuninstall scriptlet") && scripts.contains("/usr/bin/lb cleanup"),
        "{}: no preuninstall scriptlet running lb cleanup",
        p.rpm.display()
    );
    eprintln!(
        "dist check: {}: lb {version}-{} {}, {} files root-owned as packed, lb cleanup on removal",
        p.rpm.file_name().unwrap_or_default().to_string_lossy(),
        rpm::RELEASE,
        p.arch.rpm,
        p.rpm_files.len()
    );
    Ok(())
}

/// The DaemonSets of deploy/ run the image the archive names.
fn daemonsets(version: &str) -> Result<()> {
    let want = oci::short_name(version);
    for rel in [
        "deploy/k3s/daemonset.yaml",
        "deploy/kubernetes/daemonset.yaml",
    ] {
        let text = std::fs::read_to_string(util::root().join(rel))?;
        let images: Vec<&str> = text
            .lines()
            .filter_map(|l| l.trim().strip_prefix("image:"))
            .filter_map(|v| v.split_whitespace().next())
            .collect();
        ensure!(
            images == [want.as_str()],
            "{rel}: image {images:?}, but the OCI archive names {want}"
        );
    }
    eprintln!("dist check: both DaemonSets name image {want}");
    Ok(())
}
