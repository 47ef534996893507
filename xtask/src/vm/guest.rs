//! What goes into a guest: static (musl) builds of `lb`, `lbt` and the test executables,
//! iproute2 and bpftool with their shared libraries (the machine's own for an amd64 guest, the
//! architecture's Debian packages otherwise, see `userland.rs`), busybox, kernel modules and the
//! init.

use std::{path::Path, process::Command};

use anyhow::{Context as _, Result};

use super::{Arch, cpio::Archive, fetch, userland};
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
    "connect_time_takeover",
    "connect_time_failfast",
    "namespaces",
    "upgrade",
];

/// The test target only `cargo xtask vm-test --crash` runs ([`Tests::Crash`]), and its test.
pub const CRASH: (&str, &str) = ("vm_guest", "guest_crash_is_reported");

/// The test targets the static build for `arch` holds: on x86_64 every one of [`TESTS`] and
/// the [`CRASH`] target; on another architecture (arm64, cross-compiled, where each test
/// executable costs a long link) only those of [`SMOKE`], which its guest runs by default.
/// `vm-test`, `build --target` and `dist` all build this selection, so each finds the others'
/// build fresh; a run that needs more targets builds them on top (the same packages with test
/// targets, so the same features and no rebuild of lb).
pub fn built_targets(arch: &musl::Arch) -> Vec<&'static str> {
    if arch.triple == musl::X86_64.triple {
        let mut all = TESTS.to_vec();
        all.push(CRASH.0);
        return all;
    }
    let mut smoke: Vec<&'static str> = Vec::new();
    for (target, _) in SMOKE {
        if !smoke.contains(target) {
            smoke.push(target);
        }
    }
    smoke
}

/// The smoke subset: one test for each thing a new architecture could break, as (test target,
/// test name). `cargo xtask vm-test --arch arm64` runs these by default (`--tests smoke`).
pub const SMOKE: &[(&str, &str)] = &[
    // The programs load and attach: bpftool shows lb's sockops program on the test cgroup.
    (
        "connect_time",
        "connect_time_programs_are_attached_only_when_a_balancer_asks",
    ),
    // A spliced connection is byte-exact: 256 MiB each way, every byte checked, and the kernel
    // carried part of them (lb_spliced_bytes_total > 0).
    ("datapath", "bulk_256mib_each_way_bpf"),
    // A connect-time connect is rewritten: the server sees the client's own socket, getpeername
    // names the listener, 64 MiB each way arrive byte-exact and none of it crosses lb.
    ("connect_time", "connect_time_goes_straight_to_the_server"),
    // A kill resets a client: `lb servers kill` destroys a connect-time client's socket (netlink
    // SOCK_DESTROY), the client sees a reset and reconnects.
    (
        "connect_time",
        "connect_time_servers_kill_resets_direct_clients",
    ),
    // The userspace fallback works: `--datapath auto` without a usable cgroup falls back to the
    // userspace proxy with one warning, and a client's upload arrives byte-exact through it.
    ("datapath", "auto_falls_back_to_userspace_with_one_warning"),
];

/// Which tests a guest runs.
#[derive(Clone, Copy, Debug)]
pub enum Tests<'a> {
    /// Every target of [`TESTS`], each given these arguments (a name filter, say; none runs
    /// every test).
    All(&'a [String]),
    /// Only these targets of [`TESTS`] (`--target`), each given these arguments.
    Only {
        /// Test targets, each one of [`TESTS`].
        targets: &'a [String],
        /// Arguments for each executable.
        args: &'a [String],
    },
    /// [`SMOKE`]: only its targets, with its test names as exact filters.
    Smoke,
    /// [`CRASH`]: the test that crashes the guest's kernel on purpose.
    Crash,
}

impl Tests<'_> {
    /// The test targets the guest holds, in the order it runs them, and the arguments each gets.
    ///
    /// # Errors
    /// A target of [`Tests::Only`] that is not one of [`TESTS`], naming them.
    pub fn plan(&self) -> Result<(Vec<&'static str>, Vec<String>)> {
        Ok(match self {
            Tests::All(args) => (TESTS.to_vec(), args.to_vec()),
            Tests::Only { targets, args } => {
                let mut chosen = Vec::new();
                for t in *targets {
                    let known = TESTS.iter().find(|k| **k == t.as_str()).with_context(|| {
                        format!(
                            "no VM test target {t}: the targets are {}",
                            TESTS.join(", ")
                        )
                    })?;
                    chosen.push(*known);
                }
                (chosen, args.to_vec())
            }
            Tests::Crash => (
                vec![CRASH.0],
                ["--ignored", "--exact", CRASH.1].map(String::from).to_vec(),
            ),
            Tests::Smoke => {
                let mut targets: Vec<&'static str> = Vec::new();
                let mut args = vec!["--exact".to_string()];
                for (target, name) in SMOKE {
                    if !targets.contains(target) {
                        targets.push(target);
                    }
                    args.push((*name).to_string());
                }
                (targets, args)
            }
        })
    }
}

/// Modules the tests need (with their dependencies; those built in are skipped).
const MODULES: &[&str] = &["veth", "dummy", "inet_diag", "tcp_diag"];

/// Modules loaded when the kernel has them: `tls` is the kTLS upper-layer protocol the splice
/// must never redirect, and `gcm`, `ghash-generic` and `ctr` the AES-GCM cipher its key needs
/// (the guests have no modprobe to load them on demand). Debian's 5.10 is built without
/// `CONFIG_TLS`; the kTLS test then skips with its reason, as on a host without it.
const OPTIONAL_MODULES: &[&str] = &["tls", "ctr", "ghash-generic", "gcm"];

/// Host programs copied into an amd64 guest with their shared libraries, at the same paths.
const HOST_TOOLS: &[&str] = &["/usr/sbin/ip", "/usr/sbin/bpftool"];

/// Busybox applets not linked: iproute2 stands in for them.
const SHADOWED_APPLETS: &[&str] = &["ip", "tc"];

const INIT: &str = include_str!("init.sh");

/// Where the guest finds the binaries.
const GUEST_LB: &str = "/opt/lb/lb";
const GUEST_LBT: &str = "/opt/lb/lbt";
const GUEST_TESTS: &str = "/opt/lb/tests";

/// Build `lb`, `lbt` and the test executables statically for the guest's architecture (musl),
/// release because TCG runs them many times slower than the host does: every target of
/// [`built_targets`], and those `tests` plans beyond them.
///
/// # Errors
/// See [`musl::build`]; a target [`Tests::plan`] refuses.
pub fn build_binaries(arch: &Arch, tests: Tests<'_>) -> Result<Binaries> {
    let mut targets = built_targets(arch.musl);
    for t in tests.plan()?.0 {
        if !targets.contains(&t) {
            targets.push(t);
        }
    }
    musl::build(arch.musl, &targets)
}

/// A binary without its debug sections (smaller initramfs, faster to load under TCG), by the
/// binutils `strip` of its architecture; the original when that `strip` is missing.
fn stripped(path: &Path, strip: &str) -> Result<Vec<u8>> {
    let tmp = std::env::temp_dir().join(format!(
        "lb-vm-strip-{}-{}",
        std::process::id(),
        path.file_name().unwrap_or_default().to_string_lossy()
    ));
    let ok = Command::new(strip)
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

/// Write the initramfs of an `arch` guest for `kernel` to `out`, holding the test targets and
/// arguments `tests` plans, run `repeat` times.
///
/// # Errors
/// A missing package, tool or module.
pub fn initramfs(
    arch: &Arch,
    kernel: &fetch::Kernel,
    bins: &Binaries,
    tests: Tests<'_>,
    repeat: u32,
    out: &Path,
) -> Result<()> {
    let cache = out.parent().context("initramfs path without a parent")?;
    let mut a = Archive::default();
    for d in ["dev", "proc", "sys", "run", "tmp", "root", "etc/lb-vm"] {
        a.dir(d)?;
    }
    a.file("init", 0o755, INIT.as_bytes())?;
    add_programs(arch, cache, &mut a)?;
    let strip = arch.musl.strip;
    a.file(GUEST_LB, 0o755, &stripped(&bins.lb, strip)?)?;
    a.file(GUEST_LBT, 0o755, &stripped(&bins.lbt, strip)?)?;
    let (targets, args) = tests.plan()?;
    let mut list = String::new();
    for target in targets {
        let (_, exe) = bins
            .tests
            .iter()
            .find(|(n, _)| n == target)
            .with_context(|| format!("no executable of test target {target} was built"))?;
        let path = format!("{GUEST_TESTS}/{target}");
        a.file(&path, 0o755, &stripped(exe, strip)?)?;
        list.push_str(&path);
        list.push('\n');
    }
    a.file("etc/lb-vm/tests", 0o644, list.as_bytes())?;
    a.file("etc/lb-vm/args", 0o644, args.join(" ").as_bytes())?;
    a.file(
        "etc/lb-vm/repeat",
        0o644,
        repeat.max(1).to_string().as_bytes(),
    )?;
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

/// busybox (every applet but those iproute2 provides), iproute2 and bpftool with their
/// libraries: the machine's own programs in an amd64 guest, the architecture's packages in
/// another.
fn add_programs(arch: &Arch, cache: &Path, a: &mut Archive) -> Result<()> {
    let busybox = if arch.host_tools {
        // From Debian's busybox-static: the machine's own may be a dynamic build.
        let bb_deb = fetch::deb(
            &fetch::Apt::system(),
            &cache.join("debs"),
            "busybox-static",
            |n| (n == "busybox-static").then_some(0),
        )?;
        let busybox = fetch::unpack(&bb_deb, &cache.join("x"))?.join("bin/busybox");
        for tool in HOST_TOOLS {
            add_host_file(a, tool)
                .with_context(|| format!("{tool} is needed in the guest (cargo xtask setup)"))?;
            for lib in libraries(tool)? {
                add_host_file(a, &lib)?;
            }
        }
        busybox
    } else {
        let land = userland::fetch(arch.musl.deb, cache)?;
        for (path, bytes) in &land.files {
            a.file(path, 0o755, bytes)?;
        }
        land.busybox
    };
    a.file("bin/busybox", 0o755, &std::fs::read(&busybox)?)?;
    // A foreign busybox runs under qemu's user-mode emulator to list its applets.
    let mut list = match arch.musl.runner {
        Some(runner) => {
            let mut c = Command::new(runner);
            c.arg(&busybox);
            c
        }
        None => Command::new(&busybox),
    };
    let list = list
        .arg("--list-full")
        .output()
        .with_context(|| format!("running {} --list-full", busybox.display()))?;
    anyhow::ensure!(
        list.status.success(),
        "{} --list-full failed ({}){}",
        busybox.display(),
        list.status,
        arch.musl
            .runner
            .map(|r| format!(": is {r} installed (cargo xtask setup)?"))
            .unwrap_or_default()
    );
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        let name = applet.rsplit('/').next().unwrap_or(applet);
        if !applet.contains('/') || SHADOWED_APPLETS.contains(&name) || a.has(applet) {
            continue;
        }
        a.symlink(applet, "/bin/busybox")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_smoke_plan_names_existing_tests_exactly() -> Result<()> {
        let (targets, args) = Tests::Smoke.plan()?;
        assert_eq!(targets, ["connect_time", "datapath"]);
        assert_eq!(args[0], "--exact");
        assert_eq!(args.len(), SMOKE.len() + 1);
        for (target, name) in SMOKE {
            assert!(
                TESTS.contains(target),
                "{target} is not built for the guests"
            );
            // A renamed test would match nothing, and the smoke run would pass without it.
            let file = crate::util::root().join(format!("tests/tests/{target}.rs"));
            let source = std::fs::read_to_string(&file)?;
            assert!(
                source.contains(&format!("#[test]\nfn {name}()")),
                "{} has no test {name}",
                file.display()
            );
        }
        let filter = ["x".to_string()];
        let (targets, args) = Tests::All(&filter).plan()?;
        assert_eq!((targets, args), (TESTS.to_vec(), filter.to_vec()));
        let one = ["connect_time_pins".to_string()];
        let (targets, _) = Tests::Only {
            targets: &one,
            args: &filter,
        }
        .plan()?;
        assert_eq!(targets, ["connect_time_pins"]);
        let unknown = ["pins".to_string()];
        let e = Tests::Only {
            targets: &unknown,
            args: &[],
        }
        .plan()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(e.contains("no VM test target pins"), "{e}");
        // The crash test exists under its name, ignored so that no host ever runs it.
        let file = crate::util::root().join(format!("tests/tests/{}.rs", CRASH.0));
        let source = std::fs::read_to_string(&file)?;
        assert!(
            source.contains(&format!("fn {}()", CRASH.1)),
            "{}",
            file.display()
        );
        assert!(source.contains("#[ignore = "), "{}", file.display());
        Ok(())
    }
}
