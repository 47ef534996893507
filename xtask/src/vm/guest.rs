//! What goes into a guest: static (musl) builds of `lb`, `lbt` and the test executables, the
//! host's iproute2 and bpftool with their shared libraries, busybox, kernel modules and the init.

use std::{path::Path, process::Command};

use anyhow::{Context as _, Result};

use super::{cpio::Archive, fetch};
use crate::musl::{self, Binaries};

/// Integration test targets of `lb-tests` run in the guests.
pub const TESTS: &[&str] = &[
    "datapath",
    "splice_edges",
    "new_connections",
    "kernel_log",
    "connect_time",
    "connect_time_health",
    "connect_time_pins",
    "connect_time_failfast",
    "namespaces",
    "upgrade",
];

/// Modules the tests need (with their dependencies; those built in are skipped).
const MODULES: &[&str] = &["veth", "dummy", "inet_diag", "tcp_diag"];

/// Modules loaded when the kernel has them: `tls` is the kTLS upper-layer protocol the splice
/// must never redirect, and `gcm`, `ghash-generic` and `ctr` the AES-GCM cipher its key needs
/// (the guests have no modprobe to load them on demand). Debian's 5.10 is built without
/// `CONFIG_TLS`; the kTLS test then skips with its reason, as on a host without it.
const OPTIONAL_MODULES: &[&str] = &["tls", "ctr", "ghash-generic", "gcm"];

/// Host programs copied in with their shared libraries, at the same paths.
const HOST_TOOLS: &[&str] = &["/usr/sbin/ip", "/usr/sbin/bpftool"];

/// Busybox applets not linked: iproute2 stands in for them.
const SHADOWED_APPLETS: &[&str] = &["ip", "tc"];

const INIT: &str = include_str!("init.sh");

/// Where the guest finds the binaries.
const GUEST_LB: &str = "/opt/lb/lb";
const GUEST_LBT: &str = "/opt/lb/lbt";
const GUEST_TESTS: &str = "/opt/lb/tests";

/// Build `lb`, `lbt` and the test executables statically for x86_64 (musl), release because
/// TCG runs them many times slower than the host does.
///
/// # Errors
/// See [`musl::build`].
pub fn build_binaries() -> Result<Binaries> {
    musl::build(&musl::X86_64, TESTS)
}

/// A binary without its debug sections (smaller initramfs, faster to load under TCG); the
/// original when `strip` is missing.
fn stripped(path: &Path) -> Result<Vec<u8>> {
    let tmp = std::env::temp_dir().join(format!(
        "lb-vm-strip-{}-{}",
        std::process::id(),
        path.file_name().unwrap_or_default().to_string_lossy()
    ));
    let ok = Command::new("strip")
        .arg("--strip-debug")
        .arg("-o")
        .arg(&tmp)
        .arg(path)
        .status()
        .is_ok_and(|s| s.success());
    let bytes = if ok {
        std::fs::read(&tmp)
    } else {
        std::fs::read(path)
    };
    let _ = std::fs::remove_file(&tmp);
    bytes.with_context(|| format!("reading {}", path.display()))
}

/// Shared libraries of a dynamic executable, by `ldd` (the loader included).
fn libraries(exe: &str) -> Result<Vec<String>> {
    let out = Command::new("ldd")
        .arg(exe)
        .output()
        .context("cannot start ldd")?;
    if !out.status.success() {
        // Static: nothing to copy.
        return Ok(Vec::new());
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let path = match l.split_once("=>") {
                Some((_, rest)) => rest.trim(),
                None => l,
            };
            let path = path.split(" (").next()?.trim();
            path.starts_with('/').then(|| path.to_string())
        })
        .collect())
}

fn add_host_file(a: &mut Archive, path: &str) -> Result<()> {
    if a.has(path) {
        return Ok(());
    }
    let data = std::fs::read(path).with_context(|| format!("reading {path}"))?;
    a.file(path, 0o755, &data)
}

/// Write the initramfs for `kernel` to `out`; `test_args` go to every test executable (a
/// filter, say).
///
/// # Errors
/// A missing package, tool or module.
pub fn initramfs(
    kernel: &fetch::Kernel,
    bins: &Binaries,
    test_args: &[String],
    out: &Path,
) -> Result<()> {
    let cache = out.parent().context("initramfs path without a parent")?;
    let mut a = Archive::default();
    for d in ["dev", "proc", "sys", "run", "tmp", "root", "etc/lb-vm"] {
        a.dir(d)?;
    }
    a.file("init", 0o755, INIT.as_bytes())?;

    // busybox from Debian's busybox-static, every applet but those iproute2 provides.
    let bb_deb = fetch::deb(
        &fetch::Apt::system(),
        &cache.join("debs"),
        "busybox-static",
        |n| (n == "busybox-static").then_some(0),
    )?;
    let bb_root = fetch::unpack(&bb_deb, &cache.join("x"))?;
    let busybox = bb_root.join("bin/busybox");
    a.file("bin/busybox", 0o755, &std::fs::read(&busybox)?)?;
    let list = Command::new(&busybox)
        .arg("--list-full")
        .output()
        .context("running busybox --list-full")?;
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        let name = applet.rsplit('/').next().unwrap_or(applet);
        if !applet.contains('/') || SHADOWED_APPLETS.contains(&name) || a.has(applet) {
            continue;
        }
        a.symlink(applet, "/bin/busybox")?;
    }

    for tool in HOST_TOOLS {
        add_host_file(&mut a, tool)
            .with_context(|| format!("{tool} is needed in the guest (cargo xtask setup)"))?;
        for lib in libraries(tool)? {
            add_host_file(&mut a, &lib)?;
        }
    }

    a.file(GUEST_LB, 0o755, &stripped(&bins.lb)?)?;
    a.file(GUEST_LBT, 0o755, &stripped(&bins.lbt)?)?;
    let mut tests = String::new();
    for (name, exe) in &bins.tests {
        let path = format!("{GUEST_TESTS}/{name}");
        a.file(&path, 0o755, &stripped(exe)?)?;
        tests.push_str(&path);
        tests.push('\n');
    }
    a.file("etc/lb-vm/tests", 0o644, tests.as_bytes())?;
    a.file("etc/lb-vm/args", 0o644, test_args.join(" ").as_bytes())?;
    a.file(
        "etc/lb-vm/env",
        0o644,
        format!("export LB_BIN={GUEST_LB} LBT_BIN={GUEST_LBT} LB_VM=1\n").as_bytes(),
    )?;

    let mut names = String::new();
    for (name, bytes) in fetch::modules(kernel, MODULES, OPTIONAL_MODULES)? {
        a.file(&format!("lib/modules/lb-vm/{name}.ko"), 0o644, &bytes)?;
        names.push_str(&name);
        names.push('\n');
    }
    a.file("etc/lb-vm/modules", 0o644, names.as_bytes())?;

    let bytes = a.finish()?;
    std::fs::write(out, &bytes).with_context(|| format!("writing {}", out.display()))?;
    eprintln!(
        "vm: initramfs {} ({:.1} MiB), modules: {}",
        out.display(),
        bytes.len() as f64 / (1024.0 * 1024.0),
        names.trim().replace('\n', " ")
    );
    Ok(())
}
