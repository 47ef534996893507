//! The .rpm: a spec whose %install copies the staged payload and whose %files names every file
//! root-owned with its mode, built by `rpmbuild -bb --target <arch>-linux`. The binary is
//! already built and static: no debuginfo split, no strip, no build-id links, no automatic
//! dependencies.

use std::{path::Path, process::Command};

use anyhow::{Context as _, Result, ensure};

use super::{
    MAINTAINER, SUMMARY,
    payload::{self, File},
    scripts,
};
use crate::musl::Arch;

/// The RPM release of every package (the version is the workspace's).
pub const RELEASE: &str = "1";

fn spec(version: &str, stage: &Path, files: &[File]) -> String {
    let mut s = format!(
        "Name: lb\n\
         Version: {version}\n\
         Release: {RELEASE}\n\
         Summary: {SUMMARY}\n\
         License: MIT OR Apache-2.0\n\
         Packager: {MAINTAINER}\n\
         AutoReqProv: no\n\
         %global debug_package %{{nil}}\n\
         %global __os_install_post %{{nil}}\n\
         %global _build_id_links none\n\
         \n%description\n\
         A privileged daemon on every node: local clients connect to a loopback listener and the\n\
         kernel sends them to a healthy server (connect-time forwarding), or lb dials the server\n\
         and an eBPF program splices the pair. The binary is static (musl).\n\
         \n%install\n\
         mkdir -p %{{buildroot}}\n\
         cp -a {}/. %{{buildroot}}/\n",
        stage.display()
    );
    s.push_str(&format!(
        "\n%post\n{}\n%preun\n{}\n%postun\n{}\n%files\n",
        scripts::rpm(None, scripts::AFTER_INSTALL),
        scripts::rpm(Some(0), scripts::BEFORE_REMOVE),
        scripts::rpm(None, scripts::AFTER_REMOVE),
    ));
    for d in payload::owned_dirs(files) {
        s.push_str(&format!("%dir %attr(0755,root,root) {d}\n"));
    }
    for f in files {
        s.push_str(&format!("%attr({:04o},root,root) {}\n", f.mode, f.path));
    }
    s
}

/// The file name rpmbuild gives the package.
pub fn file_name(version: &str, arch: &Arch) -> String {
    format!("lb-{version}-{RELEASE}.{}.rpm", arch.rpm)
}

/// Write `out_dir`/[`file_name`] from `files`, staging and building under `work`.
///
/// # Errors
/// Staging failing or rpmbuild refusing.
pub fn build(
    work: &Path,
    out_dir: &Path,
    version: &str,
    arch: &Arch,
    files: &[File],
) -> Result<()> {
    let _ = std::fs::remove_dir_all(work);
    let stage = work.join("stage");
    payload::stage(&stage, files)?;
    let spec_path = work.join("lb.spec");
    std::fs::write(&spec_path, spec(version, &stage, files))?;
    let define = |k: &str, v: &str| ["--define".to_string(), format!("{k} {v}")];
    let mut cmd = Command::new("rpmbuild");
    cmd.args(["-bb", "--nodeps", "--quiet", "--target"])
        .arg(format!("{}-linux", arch.rpm))
        .args(define("_topdir", &work.join("top").to_string_lossy()))
        .args(define("_tmppath", &work.join("tmp").to_string_lossy()))
        .args(define("_rpmdir", &out_dir.to_string_lossy()))
        .args(define(
            "_build_name_fmt",
            "%%{NAME}-%%{VERSION}-%%{RELEASE}.%%{ARCH}.rpm",
        ))
        .args(define("_binary_payload", "w6.xzdio"))
        .args(define("_buildhost", "lb-dist"))
        .arg(&spec_path);
    std::fs::create_dir_all(work.join("tmp"))?;
    let st = cmd
        .status()
        .context("cannot run rpmbuild (cargo xtask setup installs package rpm)")?;
    ensure!(
        st.success(),
        "rpmbuild for {} failed ({st}); spec {}",
        arch.rpm,
        spec_path.display()
    );
    let out = out_dir.join(file_name(version, arch));
    ensure!(out.is_file(), "rpmbuild wrote no {}", out.display());
    std::fs::remove_dir_all(work)?;
    Ok(())
}
