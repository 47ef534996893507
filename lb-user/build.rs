//! Builds the kernel programs (`lb-ebpf`) with the nightly toolchain and bpf-linker (installed by
//! `cargo xtask setup`), so that `lb` embeds them from `OUT_DIR/lb-ebpf`.
use std::path::PathBuf;

use aya_build::{Package, Toolchain};

fn main() -> anyhow::Result<()> {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let root_dir = manifest_dir.join("../lb-ebpf");
    let root_dir = root_dir.to_string_lossy();
    aya_build::build_ebpf(
        [Package {
            name: "lb-ebpf",
            root_dir: &root_dir,
            ..Default::default()
        }],
        Toolchain::Nightly,
    )
}
