//! The guest architectures: amd64, the machine's own, and arm64 under emulation.

use anyhow::{Context as _, Result};

use super::Tests;
use crate::musl;

/// A guest architecture: its static build, its qemu and how that boots it.
#[derive(Debug)]
pub struct Arch {
    /// The musl target of its binaries; `musl.deb` (`amd64`, `arm64`) names the architecture
    /// on the command line and in Debian's package names.
    pub musl: &'static musl::Arch,
    /// The qemu system emulator, and the Debian package that has it.
    pub(super) qemu: (&'static str, &'static str),
    /// Machine and CPU arguments under TCG.
    pub(super) tcg: &'static [&'static str],
    /// Whether KVM can run it (only the machine's own architecture).
    pub(super) kvm: bool,
    /// The kernel's serial console.
    pub(super) console: &'static str,
    /// iproute2 and bpftool are the machine's own (else the architecture's Debian packages).
    pub(super) host_tools: bool,
    /// The kernels `vm-test` boots when `--kernel` is not given.
    pub default_kernels: &'static [&'static str],
    /// The tests it runs when `--tests` is not given.
    pub default_tests: Tests<'static>,
}

/// The machine's own architecture: every test on every kernel series.
pub const AMD64: Arch = Arch {
    musl: &musl::X86_64,
    qemu: ("qemu-system-x86_64", "qemu-system-x86"),
    tcg: &["-cpu", "max"],
    kvm: true,
    console: "ttyS0",
    host_tools: true,
    default_kernels: &["5.10", "6.1", "6.12"],
    default_tests: Tests::All(&[]),
};

/// arm64 under TCG on QEMU's `virt` board: the smoke subset on bookworm's 6.1 (every feature
/// the subset needs: the splice from 5.15, connect-time from 5.8). The CPU is `max`, with the
/// extensions of current arm64 servers (LSE atomics, which the BPF JIT uses when present), and
/// `pauth-impdef=on`: pointer authentication by QEMU's own cheap hash instead of the architected
/// QARMA algorithm, which is slow to emulate.
pub const ARM64: Arch = Arch {
    musl: &musl::AARCH64,
    qemu: ("qemu-system-aarch64", "qemu-system-arm"),
    tcg: &["-machine", "virt", "-cpu", "max,pauth-impdef=on"],
    kvm: false,
    console: "ttyAMA0",
    host_tools: false,
    default_kernels: &["6.1"],
    default_tests: Tests::Smoke,
};

/// The guest architectures `vm-test --arch` takes.
pub const ARCHES: &[&Arch] = &[&AMD64, &ARM64];

/// The guest architecture Debian calls `name`.
///
/// # Errors
/// Any other name, naming the known ones.
pub fn arch(name: &str) -> Result<&'static Arch> {
    ARCHES
        .iter()
        .copied()
        .find(|a| a.musl.deb == name)
        .with_context(|| {
            let known: Vec<&str> = ARCHES.iter().map(|a| a.musl.deb).collect();
            format!(
                "unknown guest architecture {name}: vm-test boots {}",
                known.join(" and ")
            )
        })
}
