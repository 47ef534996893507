//! Debian packages for the guests: resolving a kernel series to an exact package, `apt-get
//! download` into `target/vm-cache/debs`, unpacking, and picking modules with their dependencies
//! (the packages ship no `modules.dep`).

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

/// The machine's Debian architecture: the one its apt fetches without a configuration of ours.
pub const NATIVE_ARCH: &str = "amd64";

/// A kernel series and how its package names look.
#[derive(Clone, Copy, Debug)]
pub struct Series {
    /// Short name on the command line and in summaries: `6.1`, `6.12`.
    pub label: &'static str,
    /// Package names start with this (`apt-cache pkgnames` prefix).
    pub prefix: &'static str,
    /// A Debian suite the machine's apt sources do not list (`bullseye` for 5.10): apt is then
    /// asked with a sources list and package lists of its own, under the cache, so the
    /// machine's apt configuration is never changed.
    pub suite: Option<&'static str>,
}

impl Series {
    /// The ordering key of a package name of this series (the ABI number or patch level), or
    /// `None` when the name is not a plain image of it for Debian architecture `arch` (`amd64`,
    /// `arm64`; not dbg, unsigned, cloud, rt...).
    ///
    /// `linux-image-6.1.0-57-amd64` → 57; `linux-image-6.12.117+deb12-arm64` → 117.
    pub fn key(&self, name: &str, arch: &str) -> Option<u64> {
        let rest = name
            .strip_prefix(self.prefix)?
            .strip_suffix(arch)?
            .strip_suffix('-')?;
        let num = rest.split_once("+deb").map_or(rest, |(n, d)| {
            if d.chars().all(|c| c.is_ascii_digit()) {
                n
            } else {
                ""
            }
        });
        num.parse().ok()
    }
}

/// The series in the matrix, oldest first.
pub const SERIES: &[Series] = &[
    Series {
        label: "5.10",
        prefix: "linux-image-5.10.0-",
        suite: Some("bullseye"),
    },
    Series {
        label: "6.1",
        prefix: "linux-image-6.1.0-",
        suite: None,
    },
    Series {
        label: "6.12",
        prefix: "linux-image-6.12.",
        suite: None,
    },
];

/// How apt is asked: the machine's configuration, or one of its own (package lists and archive
/// cache under `target/vm-cache/apt/NAME`) for a suite the machine does not list, an
/// architecture other than the machine's, or both.
#[derive(Clone, Debug, Default)]
pub struct Apt {
    opts: Vec<String>,
    /// What the configuration is for, in messages (`bullseye`, `arm64`).
    what: Option<String>,
}

impl Apt {
    /// The machine's own apt.
    pub fn system() -> Apt {
        Apt::default()
    }

    /// apt for `series` and the Debian architecture `arch`; see [`Apt::new`].
    ///
    /// # Errors
    /// The files cannot be written.
    pub fn for_series(series: &Series, arch: &str, cache: &Path) -> Result<Apt> {
        Apt::new(series.suite, arch, cache)
    }

    /// apt for the packages of `suite` (the machine's suites when `None`) built for the Debian
    /// architecture `arch`: the machine's own apt for its suites on amd64; otherwise a
    /// configuration under `cache/apt/NAME` (written once, never touching the machine's) with a
    /// sources list of its own for `suite` (Debian's archive keyring signs every suite) or the
    /// machine's sources, and `APT::Architecture` set to `arch` so apt fetches that
    /// architecture's package lists and downloads its packages.
    ///
    /// # Errors
    /// The files cannot be written.
    pub fn new(suite: Option<&'static str>, arch: &str, cache: &Path) -> Result<Apt> {
        let native = arch == NATIVE_ARCH;
        let name = match (suite, native) {
            (None, true) => return Ok(Apt::system()),
            (Some(s), true) => s.to_string(),
            (Some(s), false) => format!("{s}-{arch}"),
            (None, false) => arch.to_string(),
        };
        let dir = cache.join("apt").join(&name);
        let lists = dir.join("lists");
        std::fs::create_dir_all(lists.join("partial"))?;
        std::fs::create_dir_all(dir.join("archives/partial"))?;
        let opt = |k: &str, v: &Path| format!("{k}={}", v.display());
        let mut opts = vec![
            opt("Dir::State::Lists", &lists),
            opt("Dir::Cache", &dir),
            opt("Dir::Cache::pkgcache", &dir.join("pkgcache.bin")),
            opt("Dir::Cache::srcpkgcache", &dir.join("srcpkgcache.bin")),
        ];
        if let Some(suite) = suite {
            let sources = dir.join("sources.list");
            std::fs::write(
                &sources,
                format!(
                    "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian {suite} main\n"
                ),
            )?;
            opts.push(opt("Dir::Etc::SourceList", &sources));
            opts.push(opt("Dir::Etc::SourceParts", &dir.join("sources.list.d")));
        }
        if !native {
            opts.push(format!("APT::Architecture={arch}"));
            opts.push(format!("APT::Architectures={arch}"));
        }
        Ok(Apt {
            opts: opts
                .into_iter()
                .flat_map(|o| ["-o".to_string(), o])
                .collect(),
            what: Some(name),
        })
    }

    /// `program` (`apt-get`, `apt-cache`) with this configuration's options.
    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.args(&self.opts);
        c
    }
}

fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("cannot start {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The package name of a `.deb` file name (`NAME_VERSION_ARCH.deb`).
fn deb_package(file: &str) -> Option<&str> {
    file.strip_suffix(".deb")?.split('_').next()
}

/// The newest cached `.deb` whose package name has a key under `key`.
fn cached(debs: &Path, key: impl Fn(&str) -> Option<u64>) -> Option<PathBuf> {
    let mut best: Option<(u64, PathBuf)> = None;
    for entry in std::fs::read_dir(debs).ok()?.flatten() {
        let file = entry.file_name().to_string_lossy().into_owned();
        if let Some(k) = deb_package(&file).and_then(&key)
            && best.as_ref().is_none_or(|(b, _)| k > *b)
        {
            best = Some((k, entry.path()));
        }
    }
    best.map(|(_, p)| p)
}

/// Whether apt has a candidate version of `name` (pkgnames also lists names only referenced).
fn available(apt: &Apt, name: &str) -> bool {
    output(apt.command("apt-cache").args(["policy", name])).is_ok_and(|o| {
        o.lines()
            .any(|l| l.trim().starts_with("Candidate:") && !l.contains("(none)"))
    })
}

/// Names apt knows starting with `prefix`, newest first, that `key` accepts.
fn candidates(apt: &Apt, prefix: &str, key: &impl Fn(&str) -> Option<u64>) -> Result<Vec<String>> {
    let names = output(apt.command("apt-cache").args(["pkgnames", prefix])).unwrap_or_default();
    let mut found: Vec<(u64, String)> = names
        .lines()
        .filter_map(|n| key(n).map(|k| (k, n.to_string())))
        .collect();
    found.sort();
    found.dedup();
    Ok(found.into_iter().rev().map(|(_, n)| n).collect())
}

/// `apt-get download NAME` into `debs`, returning the file.
fn download(apt: &Apt, debs: &Path, name: &str) -> Result<PathBuf> {
    eprintln!("vm: apt-get download {name}");
    let status = apt
        .command("apt-get")
        .args(["download", "-q", "-o", "APT::Sandbox::User=root", name])
        .current_dir(debs)
        .status()
        .context("cannot start apt-get")?;
    if !status.success() {
        bail!("apt-get download {name} failed ({status})");
    }
    cached(debs, |n| (n == name).then_some(0))
        .with_context(|| format!("apt-get download {name} left no .deb in {}", debs.display()))
}

/// The `.deb` of the newest available package of `prefix` that `key` accepts: from the cache
/// when one is there (no network), else downloaded. Runs `apt-get update` once when apt knows
/// none.
///
/// # Errors
/// No such package, or the download fails.
pub fn deb(
    apt: &Apt,
    debs: &Path,
    prefix: &str,
    key: impl Fn(&str) -> Option<u64>,
) -> Result<PathBuf> {
    std::fs::create_dir_all(debs)?;
    if let Some(p) = cached(debs, &key) {
        return Ok(p);
    }
    for attempt in 0..2 {
        let names = candidates(apt, prefix, &key)?;
        // Only the newest few: apt lists old ABIs whose files are gone from the mirror.
        if let Some(name) = names.iter().take(4).find(|n| available(apt, n)) {
            return download(apt, debs, name);
        }
        if attempt == 0 {
            let of = apt
                .what
                .as_ref()
                .map(|s| format!(" ({s})"))
                .unwrap_or_default();
            eprintln!("vm: apt knows no {prefix}* package; apt-get update{of}");
            output(apt.command("apt-get").args(["update", "-qq"]))?;
        }
    }
    bail!("no package {prefix}* available from apt")
}

/// `roots` and every package they depend on (`Depends` and `Pre-Depends`, recursively; no
/// recommends or suggests), as apt resolves them for this configuration, sorted; virtual
/// package names are left out (apt lists what provides them too).
///
/// # Errors
/// apt-cache fails (after one `apt-get update` when its lists are missing).
pub fn package_depends(apt: &Apt, roots: &[&str]) -> Result<Vec<String>> {
    let mut cmd = apt.command("apt-cache");
    cmd.args(["depends", "--recurse", "--no-recommends", "--no-suggests"])
        .args([
            "--no-conflicts",
            "--no-breaks",
            "--no-replaces",
            "--no-enhances",
        ])
        .args(roots);
    let text = match output(&mut cmd) {
        Ok(t) => t,
        Err(_) => {
            output(apt.command("apt-get").args(["update", "-qq"]))?;
            output(&mut cmd)?
        }
    };
    let mut names: Vec<String> = text
        .lines()
        .filter(|l| !l.starts_with(' ') && !l.starts_with('<') && !l.is_empty())
        .map(str::to_string)
        .collect();
    names.sort();
    names.dedup();
    Ok(names)
}

/// The `.deb` of each of `names` in `debs`: from the cache when there, the rest downloaded in
/// one `apt-get download`.
///
/// # Errors
/// The download fails or leaves a package's file missing.
pub fn debs(apt: &Apt, debs: &Path, names: &[String]) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(debs)?;
    let have = |n: &str| cached(debs, |p| (p == n).then_some(0));
    let missing: Vec<&str> = names
        .iter()
        .map(String::as_str)
        .filter(|n| have(n).is_none())
        .collect();
    if !missing.is_empty() {
        eprintln!("vm: apt-get download {}", missing.join(" "));
        let status = apt
            .command("apt-get")
            .args(["download", "-q", "-o", "APT::Sandbox::User=root"])
            .args(&missing)
            .current_dir(debs)
            .status()
            .context("cannot start apt-get")?;
        if !status.success() {
            bail!("apt-get download {} failed ({status})", missing.join(" "));
        }
    }
    names
        .iter()
        .map(|n| {
            have(n)
                .with_context(|| format!("apt-get download {n} left no .deb in {}", debs.display()))
        })
        .collect()
}

/// Unpack a `.deb` under `into/<file stem>` once; returns that directory.
///
/// # Errors
/// dpkg-deb failure.
pub fn unpack(deb: &Path, into: &Path) -> Result<PathBuf> {
    let stem = deb
        .file_stem()
        .context("deb without a name")?
        .to_string_lossy()
        .into_owned();
    let dir = into.join(stem);
    let stamp = dir.join(".unpacked");
    if stamp.exists() {
        return Ok(dir);
    }
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(&dir)?;
    eprintln!("vm: unpacking {}", deb.display());
    output(Command::new("dpkg-deb").arg("-x").arg(deb).arg(&dir))?;
    std::fs::write(&stamp, b"")?;
    Ok(dir)
}

/// An unpacked kernel package: the image and its module tree.
#[derive(Debug)]
pub struct Kernel {
    /// `uname -r` of the kernel.
    pub release: String,
    /// `boot/vmlinuz-*`.
    pub image: PathBuf,
    /// `lib/modules/<release>`.
    pub modules: PathBuf,
}

impl Kernel {
    /// Find the image and module tree in an unpacked `linux-image-*` package.
    ///
    /// # Errors
    /// When either is missing.
    pub fn find(root: &Path) -> Result<Kernel> {
        let modroot = root.join("lib/modules");
        let release = std::fs::read_dir(&modroot)
            .with_context(|| format!("no {}", modroot.display()))?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .next()
            .context("empty lib/modules")?;
        let image = root.join(format!("boot/vmlinuz-{release}"));
        if !image.exists() {
            bail!("no {}", image.display());
        }
        Ok(Kernel {
            modules: modroot.join(&release),
            release,
            image,
        })
    }
}

/// A module's name as the kernel spells it (`-` becomes `_`, no `.ko[.xz|.zst]`).
fn module_name(file: &str) -> Option<String> {
    let base = file
        .strip_suffix(".ko")
        .or_else(|| file.strip_suffix(".ko.xz"))
        .or_else(|| file.strip_suffix(".ko.zst"))?;
    Some(base.replace('-', "_"))
}

fn index(dir: &Path, into: &mut BTreeMap<String, PathBuf>, depth: u32) -> Result<()> {
    if depth > 16 {
        return Ok(());
    }
    for entry in std::fs::read_dir(dir)?.flatten() {
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            index(&path, into, depth + 1)?;
        } else if let Some(name) = module_name(&entry.file_name().to_string_lossy()) {
            into.insert(name, path);
        }
    }
    Ok(())
}

/// The module file's bytes, decompressed (`.ko.xz` on 6.12, `.ko.zst` possibly later).
fn module_bytes(path: &Path) -> Result<Vec<u8>> {
    let name = path.to_string_lossy();
    if name.ends_with(".xz") {
        Ok(output_bytes(Command::new("xz").arg("-dc").arg(path))?)
    } else if name.ends_with(".zst") {
        Ok(output_bytes(Command::new("zstd").arg("-dc").arg(path))?)
    } else {
        Ok(std::fs::read(path)?)
    }
}

fn output_bytes(cmd: &mut Command) -> Result<Vec<u8>> {
    let out = cmd
        .output()
        .with_context(|| format!("cannot start {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out.stdout)
}

/// The `depends=` list in a module's `.modinfo` strings.
fn depends(ko: &[u8]) -> Vec<String> {
    let needle = b"depends=";
    let Some(at) = ko.windows(needle.len()).position(|w| w == needle) else {
        return Vec::new();
    };
    let rest = &ko[at + needle.len()..];
    let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
    String::from_utf8_lossy(&rest[..end])
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.replace('-', "_"))
        .collect()
}

/// Modules to load, in load order (dependencies first), with their decompressed bytes: each of
/// `wanted`, and each of `optional` that the package has (one that is missing is named on
/// stderr and left out). Modules built into the kernel are left out, so a name built in on one
/// kernel and modular on another is fine.
///
/// # Errors
/// A module of `wanted` (or a dependency) that is neither built in nor in the tree.
pub fn modules(
    kernel: &Kernel,
    wanted: &[&str],
    optional: &[&str],
) -> Result<Vec<(String, Vec<u8>)>> {
    let builtin: BTreeSet<String> = std::fs::read_to_string(kernel.modules.join("modules.builtin"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| module_name(l.rsplit('/').next().unwrap_or(l)))
        .collect();
    let mut files = BTreeMap::new();
    index(&kernel.modules.join("kernel"), &mut files, 0)?;

    let mut order: Vec<(String, Vec<u8>)> = Vec::new();
    let mut seen = BTreeSet::new();
    // Depth-first, post-order: a module after everything it depends on. Bounded by the number
    // of modules in the tree.
    fn visit(
        name: &str,
        files: &BTreeMap<String, PathBuf>,
        builtin: &BTreeSet<String>,
        seen: &mut BTreeSet<String>,
        order: &mut Vec<(String, Vec<u8>)>,
    ) -> Result<()> {
        if !seen.insert(name.to_string()) || builtin.contains(name) {
            return Ok(());
        }
        let path = files
            .get(name)
            .with_context(|| format!("module {name} is neither built in nor in the package"))?;
        let bytes = module_bytes(path)?;
        for dep in depends(&bytes) {
            visit(&dep, files, builtin, seen, order)?;
        }
        order.push((name.to_string(), bytes));
        Ok(())
    }
    for name in wanted {
        visit(
            &name.replace('-', "_"),
            &files,
            &builtin,
            &mut seen,
            &mut order,
        )?;
    }
    for name in optional {
        let name = name.replace('-', "_");
        if !builtin.contains(&name) && !files.contains_key(&name) {
            eprintln!(
                "vm: kernel {} has no module {name}; its tests skip",
                kernel.release
            );
            continue;
        }
        visit(&name, &files, &builtin, &mut seen, &mut order)?;
    }
    Ok(order)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_keys() {
        let [oldest, old, new] = [SERIES[0], SERIES[1], SERIES[2]];
        let amd = |s: Series, n: &str| s.key(n, "amd64");
        assert_eq!(amd(oldest, "linux-image-5.10.0-35-amd64"), Some(35));
        assert_eq!(amd(oldest, "linux-image-5.10.0-35-rt-amd64"), None);
        assert_eq!(amd(old, "linux-image-6.1.0-57-amd64"), Some(57));
        assert_eq!(amd(old, "linux-image-6.1.0-57-amd64-dbg"), None);
        assert_eq!(amd(old, "linux-image-6.1.0-57-cloud-amd64"), None);
        assert_eq!(amd(old, "linux-image-6.1.0-57-rt-amd64"), None);
        assert_eq!(amd(new, "linux-image-6.12.117+deb12-amd64"), Some(117));
        assert_eq!(amd(new, "linux-image-6.12.117+deb12-cloud-amd64"), None);
        assert_eq!(amd(new, "linux-image-6.12-amd64"), None);
        assert_eq!(amd(new, "linux-image-6.1.0-57-amd64"), None);
        assert_eq!(amd(old, "linux-image-6.1.0-57-arm64"), None);
        assert_eq!(old.key("linux-image-6.1.0-57-arm64", "arm64"), Some(57));
        assert_eq!(old.key("linux-image-6.1.0-57-cloud-arm64", "arm64"), None);
        assert_eq!(old.key("linux-image-6.1.0-57-amd64", "arm64"), None);
        assert_eq!(
            new.key("linux-image-6.12.118+deb12-arm64", "arm64"),
            Some(118)
        );
    }

    #[test]
    fn deb_names() {
        assert_eq!(
            deb_package("linux-image-6.12.117+deb12-amd64_6.12.117-1~deb12u1_amd64.deb"),
            Some("linux-image-6.12.117+deb12-amd64")
        );
        assert_eq!(deb_package("notes.txt"), None);
    }

    #[test]
    fn modinfo_depends() {
        let ko = b"\0license=GPL\0depends=inet_diag,foo-bar\0vermagic=6.1\0";
        assert_eq!(depends(ko), vec!["inet_diag", "foo_bar"]);
        assert!(depends(b"\0depends=\0").is_empty());
        assert!(depends(b"nothing here").is_empty());
    }

    #[test]
    fn module_names() {
        assert_eq!(module_name("tcp_diag.ko.xz").as_deref(), Some("tcp_diag"));
        assert_eq!(module_name("nf-nat.ko").as_deref(), Some("nf_nat"));
        assert_eq!(module_name("modules.order"), None);
    }
}
