//! `cargo xtask dist`: what a release ships, in target/dist/: for amd64 and arm64 the static
//! (musl) binary, a .deb and an .rpm; one OCI image archive with both architectures; and
//! SHA256SUMS over all of them. The version is the workspace's (`[workspace.package] version`).
//! `--check` then installs the amd64 .deb on this machine and purges it, queries the .rpm files
//! and reads the OCI archive back ([`check`]).

pub mod check;
mod deb;
mod elf;
mod install;
mod oci;
mod payload;
mod rpm;
mod scripts;

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context as _, Result, ensure};
use sha2::Digest as _;

use crate::{
    musl::{self, Arch},
    util, vm,
};

/// The packages' Maintainer (deb) and Packager (rpm).
pub const MAINTAINER: &str = "lb maintainers <lb@localhost>";
/// The packages' one-line summary.
pub const SUMMARY: &str = "client-side TCP load balancer with an eBPF data path";

/// One architecture's files in target/dist.
#[derive(Debug)]
pub struct Packed {
    /// The target.
    pub arch: &'static Arch,
    /// The static binary, debug sections stripped: `lb-VERSION-linux-ARCH`.
    pub binary: PathBuf,
    /// `lb_VERSION_ARCH.deb` and the files it installs.
    pub deb: PathBuf,
    pub deb_files: Vec<payload::File>,
    /// `lb-VERSION-1.ARCH.rpm` and the files it installs.
    pub rpm: PathBuf,
    pub rpm_files: Vec<payload::File>,
}

/// What `cargo xtask dist` wrote.
#[derive(Debug)]
pub struct Dist {
    /// target/dist.
    pub dir: PathBuf,
    /// The workspace version.
    pub version: String,
    /// One per architecture, amd64 first.
    pub packed: Vec<Packed>,
    /// `lb-VERSION-oci.tar`.
    pub oci: PathBuf,
    /// `SHA256SUMS`.
    pub sums: PathBuf,
}

/// The packages' staging directory, removed on drop (also when a step fails).
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Lower-case hex SHA-256 of `data`.
pub fn sha256_hex(data: &[u8]) -> String {
    sha2::Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `[workspace.package] version` of the workspace's Cargo.toml.
///
/// # Errors
/// The file unreadable or without that key.
pub fn version() -> Result<String> {
    let path = util::root().join("Cargo.toml");
    let doc: toml::Table = std::fs::read_to_string(&path)
        .with_context(|| format!("reading {}", path.display()))?
        .parse()
        .with_context(|| format!("parsing {}", path.display()))?;
    doc.get("workspace")
        .and_then(|w| w.get("package"))
        .and_then(|p| p.get("version"))
        .and_then(toml::Value::as_str)
        .map(str::to_string)
        .with_context(|| format!("{}: no [workspace.package] version", path.display()))
}

/// Build both architectures and write every file of target/dist (emptied first).
///
/// # Errors
/// The first build or packaging step that fails.
pub fn run() -> Result<Dist> {
    let start = Instant::now();
    let version = version()?;
    let root = util::root();
    let dir = root.join("target/dist");
    let scratch = Scratch(root.join("target/dist-work"));
    let work = &scratch.0;
    // The same selection as the VM runs (lb, lbt, the VM tests): after `cargo xtask vm-test`
    // the x86_64 build is fresh, and the aarch64 one is what an arm64 VM run needs.
    let mut built = Vec::new();
    for arch in musl::ARCHES.iter().copied() {
        let t = Instant::now();
        built.push((arch, musl::build(arch, &vm::built_targets(arch))?.lb));
        eprintln!(
            "dist: {} build took {:.0} s",
            arch.triple,
            t.elapsed().as_secs_f64()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut binaries = Vec::new();
    for (arch, lb) in &built {
        let out = dir.join(format!("lb-{version}-linux-{}", arch.deb));
        strip(arch, lb, &out)?;
        binaries.push((*arch, out));
    }
    let host = binaries
        .iter()
        .find(|(a, _)| a.runner.is_none())
        .map(|(_, p)| p.clone())
        .context("no binary this machine runs")?;
    let common = payload::common(&host, &version)?;
    // Each architecture's packages in a thread of its own (xz takes most of the time).
    let results: Vec<Result<Packed>> = std::thread::scope(|s| {
        let handles: Vec<_> = binaries
            .into_iter()
            .map(|(arch, binary)| {
                let (common, dir, version) = (&common, &dir, &version);
                let work = work.join(arch.deb);
                s.spawn(move || pack(arch, binary, common, dir, &work, version))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("packing panicked")))
            })
            .collect()
    });
    let packed = results.into_iter().collect::<Result<Vec<Packed>>>()?;
    let images = packed
        .iter()
        .map(|p| Ok((p.arch, std::fs::read(&p.binary)?)))
        .collect::<Result<Vec<_>>>()?;
    let oci = dir.join(format!("lb-{version}-oci.tar"));
    oci::write(&oci, &version, &images)?;
    let sums = write_sums(&dir)?;
    let dist = Dist {
        dir,
        version,
        packed,
        oci,
        sums,
    };
    print_summary(&dist)?;
    eprintln!("dist: took {:.0} s", start.elapsed().as_secs_f64());
    Ok(dist)
}

/// The .deb and .rpm of one architecture's stripped `binary`.
fn pack(
    arch: &'static Arch,
    binary: PathBuf,
    common: &payload::Common,
    dir: &Path,
    work: &Path,
    version: &str,
) -> Result<Packed> {
    let bytes = std::fs::read(&binary)?;
    let deb_files = payload::files(common, payload::Format::Deb, &bytes);
    let deb = dir.join(format!("lb_{version}_{}.deb", arch.deb));
    deb::build(&work.join("deb"), &deb, version, arch, &deb_files)?;
    let rpm_files = payload::files(common, payload::Format::Rpm, &bytes);
    rpm::build(&work.join("rpm"), dir, version, arch, &rpm_files)?;
    Ok(Packed {
        arch,
        binary,
        deb,
        deb_files,
        rpm: dir.join(rpm::file_name(version, arch)),
        rpm_files,
    })
}

/// `out`: `lb` without its debug sections (the release profile keeps line tables), with the
/// binutils of its architecture.
fn strip(arch: &Arch, lb: &Path, out: &Path) -> Result<()> {
    let st = Command::new(arch.strip)
        .arg("--strip-debug")
        .arg("-o")
        .arg(out)
        .arg(lb)
        .status()
        .with_context(|| format!("cannot run {} (cargo xtask setup installs it)", arch.strip))?;
    ensure!(
        st.success(),
        "{} {} failed ({st})",
        arch.strip,
        lb.display()
    );
    Ok(())
}

/// SHA256SUMS in `dir` over every other file there, in `sha256sum -c` format.
fn write_sums(dir: &Path) -> Result<PathBuf> {
    let mut names: Vec<String> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n != "SHA256SUMS")
        .collect();
    names.sort();
    let mut text = String::new();
    for n in &names {
        let data = std::fs::read(dir.join(n))?;
        text.push_str(&format!("{}  {n}\n", sha256_hex(&data)));
    }
    let path = dir.join("SHA256SUMS");
    std::fs::write(&path, text)?;
    Ok(path)
}

fn print_summary(dist: &Dist) -> Result<()> {
    eprintln!("dist: {} (version {})", dist.dir.display(), dist.version);
    let mut names: Vec<PathBuf> = std::fs::read_dir(&dist.dir)?
        .filter_map(|e| Some(e.ok()?.path()))
        .collect();
    names.sort();
    for p in names {
        let size = std::fs::metadata(&p)?.len();
        eprintln!(
            "dist: {:>10.1} MiB  {}",
            size as f64 / (1024.0 * 1024.0),
            p.file_name().unwrap_or_default().to_string_lossy()
        );
    }
    Ok(())
}
