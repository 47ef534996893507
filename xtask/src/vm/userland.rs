//! The userland of a guest of another architecture than the machine's (arm64): busybox,
//! iproute2 and bpftool from that architecture's Debian packages, with the shared libraries
//! their ELF headers name (the dynamic loader included), taken from the library packages they
//! depend on. The amd64 guest copies the machine's own programs instead (`guest.rs`).

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use super::fetch;

/// Programs taken from packages: (package, path in its `.deb`, path in the guest). The guest
/// paths are the machine's, where the amd64 guest has them too.
const TOOLS: &[(&str, &str, &str)] = &[
    ("iproute2", "bin/ip", "/usr/sbin/ip"),
    ("bpftool", "usr/sbin/bpftool", "/usr/sbin/bpftool"),
];

/// Where libraries sit in a package (glibc's default search path on Debian includes the
/// multiarch directories under both, so the guest needs no `ld.so.cache`).
const LIB_DIRS: &[&str] = &["lib", "usr/lib"];

/// Symbolic links followed to a library's file before giving up (Debian's are one or two).
const MAX_LINKS: usize = 8;

/// A foreign guest's programs.
#[derive(Debug)]
pub struct Userland {
    /// `bin/busybox` of the architecture's `busybox-static`.
    pub busybox: PathBuf,
    /// (path in the guest, contents) of the tools and every library they load.
    pub files: Vec<(String, Vec<u8>)>,
}

/// Fetch (cached under `cache/debs-ARCH`) and unpack the packages for the Debian architecture
/// `arch` from the machine's suites, and collect the tools and their libraries.
///
/// # Errors
/// A package that cannot be had, a library no package has, or `readelf` (binutils) missing.
pub fn fetch(arch: &str, cache: &Path) -> Result<Userland> {
    let apt = fetch::Apt::new(None, arch, cache)?;
    let debs = cache.join(format!("debs-{arch}"));
    let unpacked = cache.join("x");
    let bb = fetch::deb(&apt, &debs, "busybox-static", |n| {
        (n == "busybox-static").then_some(0)
    })?;
    let busybox = fetch::unpack(&bb, &unpacked)?.join("bin/busybox");

    let tools: Vec<&str> = TOOLS.iter().map(|t| t.0).collect();
    let mut names: Vec<String> = tools.iter().map(|t| (*t).to_string()).collect();
    // Shared libraries are in packages named after them (`lib*`, Debian policy 8.1), zlib's in
    // zlib1g: the rest of the dependencies (debconf, dpkg, tar...) are not needed.
    names.extend(
        fetch::package_depends(&apt, &tools)?
            .into_iter()
            .filter(|n| n.starts_with("lib") || n.starts_with("zlib")),
    );
    let mut roots = BTreeMap::new();
    for (name, deb) in names.iter().zip(fetch::debs(&apt, &debs, &names)?) {
        roots.insert(name.clone(), fetch::unpack(&deb, &unpacked)?);
    }
    let index = Libraries::index(roots.values())?;
    let mut files = Vec::new();
    let mut placed = BTreeSet::new();
    for (package, inner, guest) in TOOLS {
        let root = roots
            .get(*package)
            .with_context(|| format!("package {package} was not fetched"))?;
        let exe = resolve(root, Path::new(inner))?;
        files.push(((*guest).to_string(), read(&exe)?));
        index.with_libraries(&exe, &mut placed, &mut files)?;
    }
    Ok(Userland { busybox, files })
}

/// The shared libraries in a set of unpacked packages, by file name.
#[derive(Debug, Default)]
struct Libraries {
    /// File name (`libc.so.6`) → (package root, path in it).
    by_name: BTreeMap<String, (PathBuf, PathBuf)>,
}

impl Libraries {
    /// Every file and link under [`LIB_DIRS`] of each root (the first root with a name wins).
    fn index<'a>(roots: impl Iterator<Item = &'a PathBuf>) -> Result<Libraries> {
        let mut libs = Libraries::default();
        for root in roots {
            for dir in LIB_DIRS {
                libs.walk(root, Path::new(dir), 0)?;
            }
        }
        Ok(libs)
    }

    fn walk(&mut self, root: &Path, rel: &Path, depth: u32) -> Result<()> {
        let Ok(entries) = std::fs::read_dir(root.join(rel)) else {
            return Ok(());
        };
        if depth > 8 {
            return Ok(());
        }
        for entry in entries.flatten() {
            let inner = rel.join(entry.file_name());
            let kind = entry.file_type()?;
            if kind.is_dir() {
                self.walk(root, &inner, depth + 1)?;
            } else {
                let name = entry.file_name().to_string_lossy().into_owned();
                self.by_name
                    .entry(name)
                    .or_insert_with(|| (root.to_path_buf(), inner));
            }
        }
        Ok(())
    }

    /// Add to `files` the dynamic loader `exe` asks for, at the path it names, and every
    /// library it loads (its `NEEDED` entries and theirs), at the path its package gives it;
    /// `placed` holds the file names already added.
    fn with_libraries(
        &self,
        exe: &Path,
        placed: &mut BTreeSet<String>,
        files: &mut Vec<(String, Vec<u8>)>,
    ) -> Result<()> {
        let (interp, mut todo) = dynamic(exe)?;
        if let Some(interp) = interp {
            let name = interp.rsplit('/').next().unwrap_or(&interp).to_string();
            if placed.insert(name.clone()) {
                let (root, inner) = self.get(&name)?;
                files.push((interp.clone(), read(&resolve(root, inner)?)?));
            }
        }
        // Each name is added once, so the loop ends after at most one round per library.
        while let Some(name) = todo.pop() {
            if !placed.insert(name.clone()) {
                continue;
            }
            let (root, inner) = self.get(&name)?;
            let file = resolve(root, inner)?;
            files.push((format!("/{}", inner.display()), read(&file)?));
            todo.extend(dynamic(&file)?.1);
        }
        Ok(())
    }

    fn get(&self, name: &str) -> Result<(&Path, &Path)> {
        self.by_name
            .get(name)
            .map(|(r, p)| (r.as_path(), p.as_path()))
            .with_context(|| format!("no fetched package has the shared library {name}"))
    }
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("reading {}", path.display()))
}

/// The file `inner` names inside the unpacked package `root`, following symbolic links as the
/// guest would (an absolute target is taken inside `root` too).
fn resolve(root: &Path, inner: &Path) -> Result<PathBuf> {
    let mut rel = inner.to_path_buf();
    for _ in 0..MAX_LINKS {
        let path = root.join(&rel);
        let meta = std::fs::symlink_metadata(&path)
            .with_context(|| format!("{} is not in its package", path.display()))?;
        if !meta.file_type().is_symlink() {
            return Ok(path);
        }
        let target = std::fs::read_link(&path)?;
        rel = if target.is_absolute() {
            target.strip_prefix("/")?.to_path_buf()
        } else {
            rel.parent().unwrap_or(Path::new("")).join(target)
        };
    }
    bail!(
        "{} links on more than {MAX_LINKS} times",
        root.join(inner).display()
    )
}

/// The program interpreter and the `NEEDED` libraries of an ELF file, by `readelf`.
fn dynamic(file: &Path) -> Result<(Option<String>, Vec<String>)> {
    let out = Command::new("readelf")
        .args(["-W", "-l", "-d"])
        .arg(file)
        .output()
        .context("cannot start readelf (binutils; cargo xtask setup installs it with gcc)")?;
    if !out.status.success() {
        bail!(
            "readelf {} failed: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(parse_dynamic(&String::from_utf8_lossy(&out.stdout)))
}

/// [`dynamic`] from `readelf -W -l -d` output.
fn parse_dynamic(text: &str) -> (Option<String>, Vec<String>) {
    let mut interp = None;
    let mut needed = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.split_once("program interpreter: ").map(|p| p.1) {
            interp = rest.strip_suffix(']').map(str::to_string);
        } else if line.contains("(NEEDED)")
            && let Some(lib) = line
                .split_once("Shared library: [")
                .and_then(|p| p.1.strip_suffix(']'))
        {
            needed.push(lib.to_string());
        }
    }
    (interp, needed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readelf_output() {
        let text = "\
Program Headers:
  INTERP 0x000238 0x0000000000000238 0x0000000000000238 0x00001b 0x00001b R   0x1
      [Requesting program interpreter: /lib/ld-linux-aarch64.so.1]

Dynamic section at offset 0xb0d50 contains 31 entries:
  Tag        Type                         Name/Value
 0x0000000000000001 (NEEDED)             Shared library: [libbpf.so.1]
 0x0000000000000001 (NEEDED)             Shared library: [libc.so.6]
 0x000000000000000e (SONAME)             Library soname: [libfoo.so.1]
";
        let (interp, needed) = parse_dynamic(text);
        assert_eq!(interp.as_deref(), Some("/lib/ld-linux-aarch64.so.1"));
        assert_eq!(needed, vec!["libbpf.so.1", "libc.so.6"]);
        assert_eq!(
            parse_dynamic("There is no dynamic section in this file."),
            (None, vec![])
        );
    }

    #[test]
    fn links_resolve_inside_the_package() -> Result<()> {
        let root = std::env::temp_dir().join(format!("lb-userland-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("lib/aarch64-linux-gnu"))?;
        std::fs::write(root.join("lib/aarch64-linux-gnu/libz.so.1.2.13"), b"z")?;
        std::os::unix::fs::symlink(
            "libz.so.1.2.13",
            root.join("lib/aarch64-linux-gnu/libz.so.1"),
        )?;
        std::os::unix::fs::symlink("/lib/aarch64-linux-gnu/libz.so.1", root.join("lib/abs"))?;
        std::os::unix::fs::symlink("loop", root.join("lib/loop"))?;
        let got = resolve(&root, Path::new("lib/abs"))?;
        assert_eq!(got, root.join("lib/aarch64-linux-gnu/libz.so.1.2.13"));
        let err = resolve(&root, Path::new("lib/loop")).expect_err("a loop never ends in a file");
        assert!(err.to_string().contains("more than 8 times"), "{err}");
        assert!(resolve(&root, Path::new("lib/none")).is_err());
        std::fs::remove_dir_all(&root)?;
        Ok(())
    }
}
