//! `cargo xtask setup`: install only what is missing, say what is done, and name the missing
//! piece when it cannot be installed.

use std::{
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

/// Debian packages the build, the tests, the VM runs and the benchmark need.
pub const APT_PACKAGES: &[&str] = &[
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
    // Servers the discovery tests start on test hosts themselves (never as system services, see
    // `NO_SERVICES`): etcd 3.4 (`etcd`, `etcdctl`) and a DNS server.
    "etcd-server",
    "etcd-client",
    "dnsmasq",
];

/// System services of `APT_PACKAGES` that must never run on the machine: the tests start their
/// own `etcd` and `dnsmasq` on test hosts, and a system one would listen on the machine's real
/// ports (2379, 2380, 53). The install runs under a `policy-rc.d` that refuses every start (see
/// `install`), and where systemd is the init they are also disabled and stopped.
pub const NO_SERVICES: &[&str] = &["etcd", "dnsmasq"];

/// Where Debian's `invoke-rc.d` and `deb-systemd-invoke` ask whether a maintainer script may
/// start a service; exit status 101 means "action forbidden".
const POLICY_RC_D: &str = "/usr/sbin/policy-rc.d";

/// bpf-linker version installed; it has features for LLVM 21, 22 and 23.
pub const BPF_LINKER_VERSION: &str = "0.13.0";

/// The dated nightly that builds the kernel programs, read from `lb-ebpf/rust-toolchain.toml`
/// (the one place it is pinned; `lb-user/build.rs` reads the same file).
///
/// # Errors
/// The file is missing or has no `[toolchain] channel`.
pub fn bpf_toolchain() -> Result<String> {
    let pin = crate::util::root().join("lb-ebpf/rust-toolchain.toml");
    let text = std::fs::read_to_string(&pin)
        .with_context(|| format!("setup: cannot read {}", pin.display()))?;
    let doc: toml::Table = text
        .parse()
        .with_context(|| format!("setup: cannot parse {}", pin.display()))?;
    doc.get("toolchain")
        .and_then(|t| t.get("channel"))
        .and_then(toml::Value::as_str)
        .map(str::to_string)
        .with_context(|| format!("setup: {} has no [toolchain] channel", pin.display()))
}

/// The LLVM that bpf-linker must link the nightly's bitcode with: the nightly toolchain's own
/// shared libLLVM (bpf-linker's LLVM must be the one that wrote the bitcode, or linking fails with
/// "Invalid record").
struct NightlyLlvm {
    /// Major version, as in `LLVM version: 23.1.4` of `rustc +nightly -vV`.
    major: u32,
    /// The toolchain's library directory (`<sysroot>/lib`).
    lib_dir: std::path::PathBuf,
    /// Link name of the shared library, e.g. `LLVM-23-rust-1.101.0-nightly`.
    link_name: String,
}

fn nightly_llvm(toolchain: &str) -> Result<NightlyLlvm> {
    let out = |args: &[&str]| -> Result<String> {
        let o = Command::new("rustc")
            .args(args)
            .output()
            .with_context(|| format!("setup: cannot run rustc {}", args.join(" ")))?;
        if !o.status.success() {
            bail!("setup: rustc {} failed ({})", args.join(" "), o.status);
        }
        Ok(String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let plus = format!("+{toolchain}");
    let vv = out(&[&plus, "-vV"])?;
    let major = vv
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next()?.parse().ok())
        .with_context(|| format!("setup: `rustc {plus} -vV` names no LLVM version"))?;
    let lib_dir = std::path::PathBuf::from(out(&[&plus, "--print", "sysroot"])?).join("lib");
    let link_name = std::fs::read_dir(&lib_dir)
        .with_context(|| format!("setup: cannot list {}", lib_dir.display()))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .find_map(|n| {
            n.strip_prefix("lib")?
                .strip_suffix(".so")
                .filter(|n| n.starts_with("LLVM-"))
                .map(str::to_string)
        })
        .with_context(|| format!("setup: no shared libLLVM-*.so in {}", lib_dir.display()))?;
    Ok(NightlyLlvm {
        major,
        lib_dir,
        link_name,
    })
}

/// Whether the `bpf-linker` on PATH loads its LLVM from the nightly toolchain's library
/// directory (as `ldd` resolves it).
fn linker_matches(llvm: &NightlyLlvm) -> bool {
    let Ok(path) = Command::new("sh")
        .args(["-c", "command -v bpf-linker"])
        .output()
    else {
        return false;
    };
    let path = String::from_utf8_lossy(&path.stdout).trim().to_string();
    if path.is_empty() {
        return false;
    }
    Command::new("ldd").arg(&path).output().is_ok_and(|o| {
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .any(|l| l.contains("libLLVM") && l.contains(&*llvm.lib_dir.to_string_lossy()))
    })
}

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

/// Whether `policy` (a `policy-rc.d`) already forbids starting services: it answers 101 for a
/// start of the first of `NO_SERVICES`.
fn policy_forbids_starts(policy: &Path) -> bool {
    Command::new(policy)
        .args([NO_SERVICES[0], "start"])
        .status()
        .is_ok_and(|s| s.code() == Some(101))
}

/// While alive, `/usr/sbin/policy-rc.d` forbids every service start (exit 101), so installing a
/// package with a service (etcd, dnsmasq, nginx, haproxy) starts nothing; on drop the machine's
/// own file comes back, or ours is removed when there was none. A file that already forbids
/// starts (as Debian container images ship) is left as it is.
struct NoServiceStarts {
    /// The machine's own policy, moved aside while ours is in place.
    saved: Option<PathBuf>,
    /// Ours is in place and must go on drop.
    ours: bool,
}

impl NoServiceStarts {
    fn new() -> Result<NoServiceStarts> {
        let policy = Path::new(POLICY_RC_D);
        if policy.exists() && policy_forbids_starts(policy) {
            return Ok(NoServiceStarts {
                saved: None,
                ours: false,
            });
        }
        let saved = if policy.exists() {
            let aside = PathBuf::from(format!("{POLICY_RC_D}.xtask-saved"));
            std::fs::rename(policy, &aside).with_context(|| {
                format!("setup: cannot move {POLICY_RC_D} aside to forbid service starts")
            })?;
            Some(aside)
        } else {
            None
        };
        let guard = NoServiceStarts { saved, ours: true };
        std::fs::write(
            policy,
            "#!/bin/sh\n# cargo xtask setup: no service starts while it installs packages.\nexit 101\n",
        )
        .with_context(|| format!("setup: cannot write {POLICY_RC_D}"))?;
        std::fs::set_permissions(policy, std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("setup: cannot make {POLICY_RC_D} executable"))?;
        eprintln!("setup: {POLICY_RC_D} forbids service starts during the install");
        Ok(guard)
    }
}

impl Drop for NoServiceStarts {
    fn drop(&mut self) {
        if self.ours {
            let _ = std::fs::remove_file(POLICY_RC_D);
        }
        if let Some(aside) = &self.saved
            && let Err(e) = std::fs::rename(aside, POLICY_RC_D)
        {
            eprintln!(
                "setup: cannot put {} back as {POLICY_RC_D}: {e}",
                aside.display()
            );
        }
    }
}

/// Where systemd is the init, make sure none of `NO_SERVICES` is enabled or running
/// (`systemctl disable --now`), whoever installed the package. Without systemd (containers,
/// this project's machines) nothing started them: the install ran under `NoServiceStarts`.
fn keep_services_off() -> Result<()> {
    if !Path::new("/run/systemd/system").is_dir() {
        return Ok(());
    }
    for svc in NO_SERVICES {
        let unit = format!("{svc}.service");
        let query = |what: &str| {
            Command::new("systemctl")
                .args([what, "--quiet", &unit])
                .status()
                .is_ok_and(|s| s.success())
        };
        if query("is-enabled") || query("is-active") {
            exec(
                Command::new("systemctl").args(["disable", "--now", &unit]),
                &format!("systemctl disable --now {unit} (the tests start their own {svc})"),
            )?;
        }
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
        let no_starts = NoServiceStarts::new()?;
        exec(
            Command::new("apt-get")
                .args(["install", "-y", "-qq", "--no-install-recommends"])
                .args(&missing)
                .env("DEBIAN_FRONTEND", "noninteractive"),
            &format!("apt-get install {}", missing.join(" ")),
        )?;
        drop(no_starts);
    }
    keep_services_off()?;
    let toolchain = bpf_toolchain()?;
    let nightly_ok = Command::new("rustup")
        .args([
            "component",
            "list",
            "--toolchain",
            &toolchain,
            "--installed",
        ])
        .output()
        .is_ok_and(|o| {
            o.status.success() && String::from_utf8_lossy(&o.stdout).contains("rust-src")
        });
    if !nightly_ok {
        exec(
            Command::new("rustup").args([
                "toolchain",
                "install",
                &toolchain,
                "--profile",
                "minimal",
                "--component",
                "rust-src",
            ]),
            &format!(
                "rustup: {toolchain} with rust-src (the BPF target is built with -Z build-std=core)"
            ),
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
    let llvm = nightly_llvm(&toolchain)?;
    if !(21..=23).contains(&llvm.major) {
        bail!(
            "setup: {toolchain} uses LLVM {}, and bpf-linker {BPF_LINKER_VERSION} \
             supports LLVM 21-23 only",
            llvm.major
        );
    }
    if !linker_matches(&llvm) {
        // Built against the nightly's own libLLVM (no system LLVM needed), with an rpath so it
        // loads that library at run time.
        let lib = llvm.lib_dir.to_string_lossy();
        exec(
            Command::new("cargo")
                .args([
                    "install",
                    "--force",
                    "bpf-linker",
                    "--version",
                    BPF_LINKER_VERSION,
                    "--no-default-features",
                    "--features",
                    &format!("llvm-{},no-llvm-linking", llvm.major),
                ])
                .env(
                    "RUSTFLAGS",
                    format!(
                        "-L native={lib} -l dylib={} -C link-arg=-Wl,-rpath,{lib}",
                        llvm.link_name
                    ),
                ),
            &format!(
                "cargo install bpf-linker {BPF_LINKER_VERSION} against the nightly's LLVM {} ({})",
                llvm.major, llvm.link_name
            ),
        )?;
    }
    Ok(())
}
