//! Builds the kernel programs (`lb-ebpf`) with the dated nightly pinned in
//! `lb-ebpf/rust-toolchain.toml` and bpf-linker (both installed by `cargo xtask setup`), so that
//! `lb` embeds them from `OUT_DIR/lb-ebpf`.
//!
//! One build of the programs serves every build of lb in a target directory: the nested cargo
//! that `aya_build` runs works in `<target>/lb-ebpf/<arch>` instead of this build's own
//! `OUT_DIR`, so the debug, release, clippy and musl builds of one architecture (which build the
//! same bytes: the programs are always `--release`, with the same flags) find it fresh instead
//! of building it again (about 36 s each on a 2-core machine). The nested cargo runs quiet
//! (`CARGO_TERM_QUIET`): its `Compiling` lines would come out as `warning:` lines of this build,
//! and its real diagnostics still do.
//!
//! With the `fuzz` feature (only the fuzz targets' build enables it, and it builds lb's library,
//! never the `lb` binary) the kernel programs are not built: the fuzz entries parse bytes and
//! load nothing, and `OUT_DIR/lb-ebpf` is left empty.
#![deny(unsafe_code)]

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use aya_build::{Package, Toolchain};

fn main() -> anyhow::Result<()> {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let root_dir = manifest_dir.join("../lb-ebpf");
    let pin = root_dir.join("rust-toolchain.toml");
    println!("cargo:rerun-if-changed={}", pin.display());
    let text = std::fs::read_to_string(&pin).with_context(|| format!("read {}", pin.display()))?;
    let doc: toml::Table = text
        .parse()
        .with_context(|| format!("parse {}", pin.display()))?;
    let channel = doc
        .get("toolchain")
        .and_then(|t| t.get("channel"))
        .and_then(toml::Value::as_str)
        .with_context(|| format!("{}: no [toolchain] channel", pin.display()))?
        .to_string();
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    if std::env::var_os("CARGO_FEATURE_FUZZ").is_some() {
        std::fs::write(out_dir.join("lb-ebpf"), [])?;
        return Ok(());
    }
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH")?;
    let shared = shared_dir(&out_dir, &arch);
    std::fs::create_dir_all(&shared).with_context(|| format!("create {}", shared.display()))?;
    // SAFETY: a build script is one thread until aya_build spawns the nested cargo, which
    // inherits these; nothing else reads the environment meanwhile.
    #[expect(
        unsafe_code,
        reason = "aya_build takes its output directory and the nested cargo's settings from the environment"
    )]
    unsafe {
        std::env::set_var("OUT_DIR", &shared);
        std::env::set_var("CARGO_TERM_QUIET", "true");
    }
    let root_dir = root_dir.to_string_lossy();
    aya_build::build_ebpf(
        [Package {
            name: "lb-ebpf",
            root_dir: &root_dir,
            ..Default::default()
        }],
        Toolchain::Custom(&channel),
    )?;
    let built = shared.join("lb-ebpf");
    std::fs::copy(&built, out_dir.join("lb-ebpf"))
        .with_context(|| format!("copy {} to {}", built.display(), out_dir.display()))?;
    Ok(())
}

/// Where the kernel programs of `arch` are built: `lb-ebpf/<arch>` in the target directory that
/// holds `out_dir`, or `out_dir` itself when none is found. The target directory is the
/// outermost of the consecutive ancestors with cargo's `CACHEDIR.TAG`: a cross build's
/// `<target>/<triple>/` has one too, and the programs are the same for every triple.
fn shared_dir(out_dir: &Path, arch: &str) -> PathBuf {
    let tagged = |d: &Path| d.join("CACHEDIR.TAG").is_file();
    let Some(mut target) = out_dir.ancestors().find(|d| tagged(d)) else {
        return out_dir.to_path_buf();
    };
    while let Some(parent) = target.parent().filter(|p| tagged(p)) {
        target = parent;
    }
    target.join("lb-ebpf").join(arch)
}
