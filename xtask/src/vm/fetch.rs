//! Debian packages for the guests: resolving a kernel series to an exact package, `apt-get
//! download` into `target/vm-cache/debs`, unpacking, and picking modules with their dependencies
//! (the packages ship no `modules.dep`).

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

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
    /// `None` when the name is not a plain amd64 image of it (dbg, unsigned, cloud, rt...).
    ///
    /// `linux-image-6.1.0-57-amd64` → 57; `linux-image-6.12.117+deb12-amd64` → 117.
    pub fn key(&self, name: &str) -> Option<u64> {
        let rest = name.strip_prefix(self.prefix)?.strip_suffix("-amd64")?;
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

/// How apt is asked: the machine's configuration, or one of a suite's own (its sources list,
/// package lists and archive cache under `target/vm-cache/apt/SUITE`).
#[derive(Clone, Debug, Default)]
pub struct Apt {
    opts: Vec<String>,
    suite: Option<&'static str>,
}

impl Apt {
    /// The machine's own apt.
    pub fn system() -> Apt {
        Apt::default()
    }

    /// apt for `series`: the machine's, or for a suite of its own a configuration under
    /// `cache` (written once; Debian's archive keyring signs every suite).
    ///
    /// # Errors
    /// The files cannot be written.
    pub fn for_series(series: &Series, cache: &Path) -> Result<Apt> {
        let Some(suite) = series.suite else {
            return Ok(Apt::system());
        };
        let dir = cache.join("apt").join(suite);
        let lists = dir.join("lists");
        std::fs::create_dir_all(lists.join("partial"))?;
        std::fs::create_dir_all(dir.join("archives/partial"))?;
        let sources = dir.join("sources.list");
        std::fs::write(
            &sources,
            format!(
                "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian {suite} main\n"
            ),
        )?;
        let opt = |k: &str, v: &Path| format!("{k}={}", v.display());
        let opts = [
            opt("Dir::Etc::SourceList", &sources),
            opt("Dir::Etc::SourceParts", &dir.join("sources.list.d")),
            opt("Dir::State::Lists", &lists),
            opt("Dir::Cache", &dir),
            opt("Dir::Cache::pkgcache", &dir.join("pkgcache.bin")),
            opt("Dir::Cache::srcpkgcache", &dir.join("srcpkgcache.bin")),
        ]
        .into_iter()
        .flat_map(|o| ["-o".to_string(), o])
        .collect();
        Ok(Apt {
            opts,
            suite: Some(suite),
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
            let of = apt.suite.map(|s| format!(" ({s})")).unwrap_or_default();
            eprintln!("vm: apt knows no {prefix}* package; apt-get update{of}");
            output(apt.command("apt-get").args(["update", "-qq"]))?;
        }
    }
    bail!("no package {prefix}* available from apt")
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
        assert_eq!(oldest.key("linux-image-5.10.0-35-amd64"), Some(35));
        assert_eq!(oldest.key("linux-image-5.10.0-35-rt-amd64"), None);
        assert_eq!(old.key("linux-image-6.1.0-57-amd64"), Some(57));
        assert_eq!(old.key("linux-image-6.1.0-57-amd64-dbg"), None);
        assert_eq!(old.key("linux-image-6.1.0-57-cloud-amd64"), None);
        assert_eq!(old.key("linux-image-6.1.0-57-rt-amd64"), None);
        assert_eq!(new.key("linux-image-6.12.117+deb12-amd64"), Some(117));
        assert_eq!(new.key("linux-image-6.12.117+deb12-cloud-amd64"), None);
        assert_eq!(new.key("linux-image-6.12-amd64"), None);
        assert_eq!(new.key("linux-image-6.1.0-57-amd64"), None);
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
