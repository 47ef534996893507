//! `cargo xtask setup`: install only what is missing, say what is done, and name the missing
//! piece when it cannot be installed.

use std::process::Command;

use anyhow::{Context as _, Result, bail};

/// Debian packages the build, the tests, the VM runs and the benchmark need.
pub const APT_PACKAGES: &[&str] = &[
    // bpf-linker against LLVM 22 (nightly's LLVM): DESIGN.md build facts.
    "llvm-22-dev",
    "libpolly-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    // Test hosts and inspection.
    "iproute2",
    "bpftool",
    "curl",
    // VM runs: static test binaries, qemu, a busybox for the guest's init.
    "musl-tools",
    "qemu-system-x86",
    "busybox-static",
    "cpio",
    "xz-utils",
    // Benchmark contenders and load tools.
    "haproxy",
    "nginx",
    "libnginx-mod-stream",
    "iperf3",
];

/// bpf-linker version known to build against LLVM 22 here.
pub const BPF_LINKER_VERSION: &str = "0.13.0";

fn installed(pkg: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", pkg])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
}

fn exec(cmd: &mut Command, what: &str) -> Result<()> {
    eprintln!("setup: {what}");
    let status = cmd
        .status()
        .with_context(|| format!("setup: cannot start: {what}"))?;
    if !status.success() {
        bail!("setup: failed: {what} ({status})");
    }
    Ok(())
}

/// Install what is missing.
///
/// # Errors
/// Names the piece that could not be installed.
pub fn run() -> Result<()> {
    let missing: Vec<&str> = APT_PACKAGES
        .iter()
        .copied()
        .filter(|p| !installed(p))
        .collect();
    if !missing.is_empty() {
        exec(
            Command::new("apt-get").args(["update", "-qq"]),
            "apt-get update",
        )?;
        exec(
            Command::new("apt-get")
                .args(["install", "-y", "-qq", "--no-install-recommends"])
                .args(&missing)
                .env("DEBIAN_FRONTEND", "noninteractive"),
            &format!("apt-get install {}", missing.join(" ")),
        )?;
    }
    let nightly_ok = Command::new("rustup")
        .args(["component", "list", "--toolchain", "nightly", "--installed"])
        .output()
        .is_ok_and(|o| {
            o.status.success() && String::from_utf8_lossy(&o.stdout).contains("rust-src")
        });
    if !nightly_ok {
        exec(
            Command::new("rustup").args([
                "toolchain",
                "install",
                "nightly",
                "--profile",
                "minimal",
                "--component",
                "rust-src",
            ]),
            "rustup: nightly toolchain with rust-src (the BPF target is built with -Z build-std=core)",
        )?;
    }
    let musl_ok = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("x86_64-unknown-linux-musl"));
    if !musl_ok {
        exec(
            Command::new("rustup").args(["target", "add", "x86_64-unknown-linux-musl"]),
            "rustup target add x86_64-unknown-linux-musl (VM test binaries)",
        )?;
    }
    let linker_ok = Command::new("bpf-linker")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !linker_ok {
        let path = format!(
            "/usr/lib/llvm-22/bin:{}",
            std::env::var("PATH").unwrap_or_default()
        );
        exec(
            Command::new("cargo")
                .args([
                    "install",
                    "bpf-linker",
                    "--version",
                    BPF_LINKER_VERSION,
                    "--no-default-features",
                    "--features",
                    "llvm-22",
                ])
                .env("PATH", path),
            &format!("cargo install bpf-linker {BPF_LINKER_VERSION} against LLVM 22"),
        )?;
    }
    Ok(())
}
