//! `cargo xtask setup`: install only what is missing (apt packages, the pinned nightly,
//! bpf-linker, cargo-fuzz), say what is done, and name the missing
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
    // The aarch64 cross build (`cargo xtask build --target aarch64-unknown-linux-musl`): a C
    // compiler and arm64 libc headers for ring, and qemu's user-mode emulator to run the result.
    "gcc-aarch64-linux-gnu",
    "libc6-dev-arm64-cross",
    "qemu-user-static",
    // `cargo xtask vm-test --arch arm64`: an arm64 guest under TCG (qemu-system-aarch64).
    "qemu-system-arm",
    // `cargo xtask dist`: rpmbuild and rpm (dpkg-deb comes with dpkg).
    "rpm",
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

/// cargo-fuzz version installed: `cargo xtask fuzz` (and `test`) build the fuzz targets with it.
pub const CARGO_FUZZ_VERSION: &str = "0.13.2";

/// The components rustup lists as installed for `toolchain`, one per line; empty when the
/// toolchain is not installed.
fn installed_components(toolchain: &str) -> String {
    Command::new("rustup")
        .args(["component", "list", "--toolchain", toolchain, "--installed"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

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
    // A file just written may still be open in a child another thread forked (ETXTBSY) for an
    // instant: ask again.
    for _ in 0..50 {
        match Command::new(policy)
            .args([NO_SERVICES[0], "start"])
            .status()
        {
            Err(e) if e.raw_os_error() == Some(nix::errno::Errno::ETXTBSY as i32) => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            r => return r.is_ok_and(|s| s.code() == Some(101)),
        }
    }
    false
}

/// The first line after the shebang of the `policy-rc.d` setup writes, to recognise it.
const OUR_POLICY_MARK: &str = "# cargo xtask setup: no service starts while it installs packages.";

/// While alive, `/usr/sbin/policy-rc.d` forbids every service start (exit 101), so installing a
/// package with a service (etcd, dnsmasq, nginx, haproxy) starts nothing; on drop the machine's
/// own file comes back, or ours is removed when there was none. A file that already forbids
/// starts (as Debian container images ship) is left as it is.
#[derive(Debug)]
struct NoServiceStarts {
    /// Where the policy is (`POLICY_RC_D`; another path in the unit tests).
    policy: PathBuf,
    /// The machine's own policy, moved aside while ours is in place.
    saved: Option<PathBuf>,
    /// Ours is in place and must go on drop.
    ours: bool,
}

impl NoServiceStarts {
    fn new(policy: &Path) -> Result<NoServiceStarts> {
        let shown = policy.display();
        let aside = PathBuf::from(format!("{shown}.xtask-saved"));
        // A setup killed while ours was in place left it there and the machine's aside: put the
        // machine's back first.
        let ours_in_place =
            std::fs::read_to_string(policy).is_ok_and(|t| t.contains(OUR_POLICY_MARK));
        if ours_in_place && aside.exists() {
            std::fs::rename(&aside, policy).with_context(|| {
                format!("setup: cannot put {} back as {shown}", aside.display())
            })?;
        }
        if policy.exists() && policy_forbids_starts(policy) {
            return Ok(NoServiceStarts {
                policy: policy.to_path_buf(),
                saved: None,
                ours: false,
            });
        }
        let saved = if policy.exists() {
            std::fs::rename(policy, &aside).with_context(|| {
                format!("setup: cannot move {shown} aside to forbid service starts")
            })?;
            Some(aside)
        } else {
            None
        };
        let guard = NoServiceStarts {
            policy: policy.to_path_buf(),
            saved,
            ours: true,
        };
        std::fs::write(policy, format!("#!/bin/sh\n{OUR_POLICY_MARK}\nexit 101\n"))
            .with_context(|| format!("setup: cannot write {shown}"))?;
        std::fs::set_permissions(policy, std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("setup: cannot make {shown} executable"))?;
        eprintln!("setup: {shown} forbids service starts during the install");
        Ok(guard)
    }
}

impl Drop for NoServiceStarts {
    fn drop(&mut self) {
        if self.ours {
            let _ = std::fs::remove_file(&self.policy);
        }
        if let Some(aside) = &self.saved
            && let Err(e) = std::fs::rename(aside, &self.policy)
        {
            eprintln!(
                "setup: cannot put {} back as {}: {e}",
                aside.display(),
                self.policy.display()
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
        let no_starts = NoServiceStarts::new(Path::new(POLICY_RC_D))?;
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
    rust_toolchains(&toolchain)?;
    bpf_linker(&toolchain)?;
    cargo_fuzz()
}

/// cargo-fuzz at [`CARGO_FUZZ_VERSION`], unless `cargo fuzz --version` already names it.
fn cargo_fuzz() -> Result<()> {
    let want = format!("cargo-fuzz {CARGO_FUZZ_VERSION}");
    let have = Command::new("cargo")
        .args(["fuzz", "--version"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    if have.as_deref() == Some(want.as_str()) {
        return Ok(());
    }
    exec(
        Command::new("cargo").args([
            "install",
            "--force",
            "--locked",
            "cargo-fuzz",
            "--version",
            CARGO_FUZZ_VERSION,
        ]),
        &format!("cargo install cargo-fuzz {CARGO_FUZZ_VERSION} (the fuzz targets' builder)"),
    )
}

/// The pinned nightly with rust-src and clippy, and the musl targets of the stable toolchain.
fn rust_toolchains(toolchain: &str) -> Result<()> {
    let nightly_ok = installed_components(toolchain).contains("rust-src");
    if !nightly_ok {
        exec(
            Command::new("rustup").args([
                "toolchain",
                "install",
                toolchain,
                "--profile",
                "minimal",
                "--component",
                "rust-src",
                "--component",
                "clippy",
            ]),
            &format!(
                "rustup: {toolchain} with rust-src (the BPF target is built with -Z build-std=core) and clippy"
            ),
        )?;
    }
    if !installed_components(toolchain).contains("clippy") {
        exec(
            Command::new("rustup").args(["component", "add", "clippy", "--toolchain", toolchain]),
            &format!("rustup: clippy for {toolchain} (`cargo xtask test` lints lb-ebpf with it)"),
        )?;
    }
    let targets = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    for (target, why) in [
        ("x86_64-unknown-linux-musl", "VM test binaries, packages"),
        ("aarch64-unknown-linux-musl", "the arm64 build and packages"),
    ] {
        if !targets.lines().any(|l| l.trim() == target) {
            exec(
                Command::new("rustup").args(["target", "add", target]),
                &format!("rustup target add {target} ({why})"),
            )?;
        }
    }
    Ok(())
}

/// bpf-linker built against the nightly's own LLVM, unless the one on PATH already is.
fn bpf_linker(toolchain: &str) -> Result<()> {
    let llvm = nightly_llvm(toolchain)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory for a fake `policy-rc.d`.
    fn scratch(name: &str) -> Result<PathBuf> {
        let dir = std::env::temp_dir().join(format!("xtask-setup-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        Ok(dir)
    }

    fn write_policy(path: &Path, code: u8) -> Result<()> {
        std::fs::write(path, format!("#!/bin/sh\nexit {code}\n"))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
        Ok(())
    }

    #[test]
    fn no_policy_gets_ours_for_the_install_only() -> Result<()> {
        let dir = scratch("none")?;
        let policy = dir.join("policy-rc.d");
        let guard = NoServiceStarts::new(&policy)?;
        assert!(policy_forbids_starts(&policy));
        drop(guard);
        assert!(!policy.exists());
        std::fs::remove_dir_all(dir)?;
        Ok(())
    }

    #[test]
    fn a_permissive_policy_is_moved_aside_and_restored() -> Result<()> {
        let dir = scratch("allows")?;
        let policy = dir.join("policy-rc.d");
        write_policy(&policy, 0)?;
        let guard = NoServiceStarts::new(&policy)?;
        assert!(policy_forbids_starts(&policy));
        drop(guard);
        assert_eq!(std::fs::read_to_string(&policy)?, "#!/bin/sh\nexit 0\n");
        assert!(!dir.join("policy-rc.d.xtask-saved").exists());
        std::fs::remove_dir_all(dir)?;
        Ok(())
    }

    #[test]
    fn a_forbidding_policy_is_left_alone_and_a_leftover_is_repaired() -> Result<()> {
        let dir = scratch("forbids")?;
        let policy = dir.join("policy-rc.d");
        write_policy(&policy, 101)?;
        drop(NoServiceStarts::new(&policy)?);
        assert_eq!(std::fs::read_to_string(&policy)?, "#!/bin/sh\nexit 101\n");
        // An interrupted run: ours in place, the machine's (permissive) aside.
        write_policy(&dir.join("policy-rc.d.xtask-saved"), 0)?;
        std::fs::write(&policy, format!("#!/bin/sh\n{OUR_POLICY_MARK}\nexit 101\n"))?;
        let guard = NoServiceStarts::new(&policy)?;
        assert!(policy_forbids_starts(&policy));
        drop(guard);
        assert_eq!(std::fs::read_to_string(&policy)?, "#!/bin/sh\nexit 0\n");
        std::fs::remove_dir_all(dir)?;
        Ok(())
    }
}
