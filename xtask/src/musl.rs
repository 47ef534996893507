//! Static (musl) release builds of `lb`, `lbt` and test executables, for the host's x86_64 and
//! cross-compiled for aarch64. The VM runs (`vm/guest.rs`), `cargo xtask build --target` and
//! `cargo xtask dist` all build through [`build`], with one package and target selection, so a
//! later command finds the earlier one's build fresh.
//!
//! The kernel programs inside are the same for every target: `lb-user/build.rs` builds them
//! with aya-build for `bpfel-unknown-none` (the endianness of the target being built, little for
//! both), and nothing in `lb-ebpf` reads the target architecture (kernel field offsets come from
//! the running kernel's BTF at load time).

use std::{
    path::PathBuf,
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};

use crate::util;

/// One musl target lb is built and packaged for.
#[derive(Debug)]
pub struct Arch {
    /// Rust target triple.
    pub triple: &'static str,
    /// Debian's name (`dpkg --print-architecture`), also the OCI platform's `architecture`.
    pub deb: &'static str,
    /// RPM's name (`rpm --eval %_arch`).
    pub rpm: &'static str,
    /// OCI platform `variant` (`v8` for arm64, as registries and containerd write it).
    pub oci_variant: Option<&'static str>,
    /// ELF `e_machine`: 62 (EM_X86_64) or 183 (EM_AARCH64).
    pub elf_machine: u16,
    /// What runs its binaries on an x86_64 host: nothing, or qemu's user-mode emulator.
    pub runner: Option<&'static str>,
    /// The binutils `strip` that reads its binaries.
    pub strip: &'static str,
    /// Environment of a cross build: linker and C compiler (ring has C and assembly).
    cross: &'static [(&'static str, &'static str)],
    /// Programs the cross build runs that `cargo xtask setup` installs (rust-lld comes with
    /// rustc).
    tools: &'static [&'static str],
}

/// The host's own target: built with the host's cc (musl-gcc is not needed: rustc links musl
/// targets self-contained).
pub const X86_64: Arch = Arch {
    triple: "x86_64-unknown-linux-musl",
    deb: "amd64",
    rpm: "x86_64",
    oci_variant: None,
    elf_machine: 62,
    runner: None,
    strip: "strip",
    cross: &[],
    tools: &[],
};

/// Cross-compiled: rustc links with its own `rust-lld` against the target's self-contained musl
/// (crt objects, libc.a, libunwind.a shipped by `rustup target add`); ring's C and assembly go
/// through Debian's cross gcc with the arm64 libc headers (`gcc-aarch64-linux-gnu`,
/// `libc6-dev-arm64-cross`; the objects call only memcpy-like functions musl provides).
pub const AARCH64: Arch = Arch {
    triple: "aarch64-unknown-linux-musl",
    deb: "arm64",
    rpm: "aarch64",
    oci_variant: Some("v8"),
    elf_machine: 183,
    runner: Some("qemu-aarch64-static"),
    strip: "aarch64-linux-gnu-strip",
    cross: &[
        ("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_MUSL_LINKER", "rust-lld"),
        ("CC_aarch64_unknown_linux_musl", "aarch64-linux-gnu-gcc"),
        ("AR_aarch64_unknown_linux_musl", "aarch64-linux-gnu-ar"),
    ],
    tools: &["aarch64-linux-gnu-gcc", "aarch64-linux-gnu-ar"],
};

/// Every target `cargo xtask dist` packages.
pub const ARCHES: &[&Arch] = &[&X86_64, &AARCH64];

/// The target named `triple`.
///
/// # Errors
/// Any other triple, naming the supported ones.
pub fn arch(triple: &str) -> Result<&'static Arch> {
    ARCHES
        .iter()
        .copied()
        .find(|a| a.triple == triple)
        .with_context(|| {
            let known: Vec<&str> = ARCHES.iter().map(|a| a.triple).collect();
            format!(
                "unsupported target {triple:?}: cargo xtask builds {}",
                known.join(" and ")
            )
        })
}

/// Host paths of the static binaries of one build.
#[derive(Debug)]
pub struct Binaries {
    /// `lb`.
    pub lb: PathBuf,
    /// `lbt`, the tests' helper.
    pub lbt: PathBuf,
    /// (test target name, executable).
    pub tests: Vec<(String, PathBuf)>,
}

/// A tool of a cross build, or why it is missing.
fn require(tool: &str) -> Result<()> {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        bail!("{tool} is not installed (cargo xtask setup installs it)");
    }
    Ok(())
}

/// Build `lb`, `lbt` and the integration test executables `tests` of lb-tests for `arch` in one
/// release cargo invocation (so features unify once), and return their paths.
///
/// # Errors
/// A cross tool missing, the build failing, or cargo naming no executable for a target.
pub fn build(arch: &Arch, tests: &[&str]) -> Result<Binaries> {
    for tool in arch.tools {
        require(tool)?;
    }
    let mut args = vec![
        "build",
        "--release",
        "--target",
        arch.triple,
        "-p",
        "lb-user",
        "-p",
        "lb-tests",
        "--bins",
        "--message-format=json-render-diagnostics",
    ];
    for t in tests {
        args.extend(["--test", t]);
    }
    eprintln!("xtask: cargo {}", args.join(" "));
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(&args)
        .current_dir(util::root())
        .stderr(Stdio::inherit());
    for (key, value) in arch.cross {
        // A value of the caller's own (another linker, say) wins.
        if std::env::var_os(key).is_none() {
            cmd.env(key, value);
        }
    }
    let out = cmd.output().context("cannot start cargo")?;
    if !out.status.success() {
        bail!("cargo {} failed ({})", args.join(" "), out.status);
    }
    binaries(&String::from_utf8_lossy(&out.stdout), tests)
}

/// The executables cargo's JSON messages name.
fn binaries(json: &str, tests: &[&str]) -> Result<Binaries> {
    let (mut lb, mut lbt, mut found) = (None, None, Vec::new());
    for line in json.lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let target = &msg["target"];
        let kind = |k: &str| {
            target["kind"]
                .as_array()
                .is_some_and(|ks| ks.iter().any(|x| x == k))
        };
        let (Some(name), Some(exe)) = (target["name"].as_str(), msg["executable"].as_str()) else {
            continue;
        };
        let exe = PathBuf::from(exe);
        match name {
            "lb" if kind("bin") => lb = Some(exe),
            "lbt" if kind("bin") => lbt = Some(exe),
            t if kind("test") && tests.contains(&t) => found.push((t.to_string(), exe)),
            _ => {}
        }
    }
    for t in tests {
        if !found.iter().any(|(n, _)| n == t) {
            bail!("cargo named no executable for test target {t}");
        }
    }
    Ok(Binaries {
        lb: lb.context("cargo named no lb executable")?,
        lbt: lbt.context("cargo named no lbt executable")?,
        tests: found,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_target_names_the_known_ones() {
        assert_eq!(
            arch("aarch64-unknown-linux-musl").map(|a| a.deb).ok(),
            Some("arm64")
        );
        let err = arch("aarch64-unknown-linux-gnu").expect_err("not a musl target lb builds");
        assert_eq!(
            err.to_string(),
            "unsupported target \"aarch64-unknown-linux-gnu\": cargo xtask builds \
             x86_64-unknown-linux-musl and aarch64-unknown-linux-musl"
        );
    }

    #[test]
    fn executables_come_from_cargo_messages() -> Result<()> {
        let json = [
            r#"{"reason":"compiler-artifact","target":{"kind":["bin"],"name":"lb"},"executable":"/t/lb"}"#,
            r#"{"reason":"compiler-artifact","target":{"kind":["bin"],"name":"lbt"},"executable":"/t/lbt"}"#,
            r#"{"reason":"compiler-artifact","target":{"kind":["test"],"name":"upgrade"},"executable":"/t/upgrade-1"}"#,
            r#"{"reason":"compiler-artifact","target":{"kind":["lib"],"name":"lb"},"executable":null}"#,
        ]
        .join("\n");
        let b = binaries(&json, &["upgrade"])?;
        assert_eq!(b.lb, PathBuf::from("/t/lb"));
        assert_eq!(
            b.tests,
            [("upgrade".to_string(), PathBuf::from("/t/upgrade-1"))]
        );
        let err = binaries(&json, &["upgrade", "datapath"]).expect_err("datapath missing");
        assert!(err.to_string().ends_with("test target datapath"));
        Ok(())
    }
}
