//! The .deb: the payload staged in a directory with its DEBIAN/ control files, built by
//! `dpkg-deb --root-owner-group --build` (every file root's, whoever builds).

use std::{os::unix::fs::PermissionsExt as _, path::Path, process::Command};

use anyhow::{Context as _, Result, ensure};

use super::{
    MAINTAINER, SUMMARY,
    payload::{self, File},
    scripts,
};
use crate::musl::Arch;

/// The control file. `Installed-Size` is in KiB, as dpkg counts it.
fn control(version: &str, arch: &Arch, files: &[File]) -> String {
    let bytes: usize = files.iter().map(|f| f.data.len()).sum();
    format!(
        "Package: lb\n\
         Version: {version}\n\
         Architecture: {}\n\
         Maintainer: {MAINTAINER}\n\
         Installed-Size: {}\n\
         Section: net\n\
         Priority: optional\n\
         Description: {SUMMARY}\n \
         A privileged daemon on every node: local clients connect to a loopback listener and\n \
         the kernel sends them to a healthy server (connect-time forwarding), or lb dials the\n \
         server and an eBPF program splices the pair. The binary is static (musl).\n",
        arch.deb,
        bytes.div_ceil(1024)
    )
}

/// Write `out` (lb_VERSION_ARCH.deb) from `files`, staging under `work`.
///
/// # Errors
/// Staging failing or dpkg-deb refusing.
pub fn build(work: &Path, out: &Path, version: &str, arch: &Arch, files: &[File]) -> Result<()> {
    let _ = std::fs::remove_dir_all(work);
    payload::stage(work, files)?;
    let debian = work.join("DEBIAN");
    std::fs::create_dir_all(&debian)?;
    std::fs::set_permissions(&debian, std::fs::Permissions::from_mode(0o755))?;
    let write = |name: &str, text: &str, mode: u32| -> Result<()> {
        let path = debian.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))?;
        Ok(())
    };
    write("control", &control(version, arch, files), 0o644)?;
    write(
        "postinst",
        &scripts::deb(&["configure"], scripts::AFTER_INSTALL),
        0o755,
    )?;
    write(
        "prerm",
        &scripts::deb(&["remove", "deconfigure"], scripts::BEFORE_REMOVE),
        0o755,
    )?;
    write("postrm", &scripts::deb(&[], scripts::AFTER_REMOVE), 0o755)?;
    let st = Command::new("dpkg-deb")
        .args(["--root-owner-group", "-Zxz", "--build"])
        .arg(work)
        .arg(out)
        .status()
        .context("cannot run dpkg-deb (package dpkg)")?;
    ensure!(
        st.success(),
        "dpkg-deb --build {} failed ({st})",
        out.display()
    );
    std::fs::remove_dir_all(work)?;
    Ok(())
}
