//! Builds the kernel programs (`lb-ebpf`) with the dated nightly pinned in
//! `lb-ebpf/rust-toolchain.toml` and bpf-linker (both installed by `cargo xtask setup`), so that
//! `lb` embeds them from `OUT_DIR/lb-ebpf`.
use std::path::PathBuf;

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
    let root_dir = root_dir.to_string_lossy();
    aya_build::build_ebpf(
        [Package {
            name: "lb-ebpf",
            root_dir: &root_dir,
            ..Default::default()
        }],
        Toolchain::Custom(&channel),
    )
}
