//! What the .deb and the .rpm install, and where: the static binary, the systemd unit at the
//! packaged path, the man pages, shell completions and the K3s/RKE2 layouts as examples. The
//! pages and completions come from the built `lb` itself (`lb man --dir`, `lb completions`), so
//! they match its command line.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail, ensure};

use crate::util;

/// Where the packages put the binary.
pub const BIN: &str = "/usr/bin/lb";
/// Where the packages put the systemd unit (the distributions' unit directory, not /etc).
pub const UNIT: &str = "/usr/lib/systemd/system/lb.service";
/// The documentation directory; examples below it.
pub const DOC: &str = "/usr/share/doc/lb";
/// The example a node starts from (`lb config check` passes on it as shipped).
pub const K3S_AGENT_EXAMPLE: &str = "/usr/share/doc/lb/examples/k3s/agent.toml";

/// The unit's `ExecStart` in the repository (a manual install to /usr/local/bin) and in the
/// packages.
const EXEC_START_REPO: &str = "ExecStart=/usr/local/bin/lb ";
const EXEC_START_PACKAGED: &str = "ExecStart=/usr/bin/lb ";

/// Which package a file list is for: they differ only in where zsh looks for completions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Debian and Ubuntu.
    Deb,
    /// Fedora, RHEL, SUSE.
    Rpm,
}

/// One installed file.
#[derive(Debug, Clone)]
pub struct File {
    /// Absolute path on the installed system.
    pub path: String,
    /// Permission bits (owner and group are root in every package).
    pub mode: u32,
    /// Contents.
    pub data: Vec<u8>,
}

/// What every architecture's packages share, made once.
#[derive(Debug)]
pub struct Common {
    /// Man pages (gzip), completions, unit, examples and the copyright, minus the zsh file.
    files: Vec<File>,
    /// The zsh completion, whose directory depends on the format.
    zsh: Vec<u8>,
}

/// Make the shared files with `lb`, a binary this machine runs.
///
/// # Errors
/// `lb` failing to write its pages or completions, or a repository file missing or changed
/// so that the packaged unit cannot be made from it.
pub fn common(lb: &Path, version: &str) -> Result<Common> {
    let mut files = vec![
        File {
            path: UNIT.into(),
            mode: 0o644,
            data: packaged_unit(&read_repo("deploy/systemd/lb.service")?)?.into_bytes(),
        },
        File {
            path: format!("{DOC}/copyright"),
            mode: 0o644,
            data: copyright(version).into_bytes(),
        },
    ];
    files.extend(man_pages(lb)?);
    for (shell, path) in [
        ("bash", "/usr/share/bash-completion/completions/lb"),
        ("fish", "/usr/share/fish/vendor_completions.d/lb.fish"),
    ] {
        files.push(File {
            path: path.into(),
            mode: 0o644,
            data: completion(lb, shell)?,
        });
    }
    files.extend(examples()?);
    Ok(Common {
        files,
        zsh: completion(lb, "zsh")?,
    })
}

/// Every file of one package: `binary` at [`BIN`] and the shared ones, sorted by path.
pub fn files(common: &Common, format: Format, binary: &[u8]) -> Vec<File> {
    let zsh_dir = match format {
        // Debian's zsh reads packaged completions from vendor-completions.
        Format::Deb => "/usr/share/zsh/vendor-completions",
        Format::Rpm => "/usr/share/zsh/site-functions",
    };
    let mut files = common.files.clone();
    files.push(File {
        path: BIN.into(),
        mode: 0o755,
        data: binary.to_vec(),
    });
    files.push(File {
        path: format!("{zsh_dir}/_lb"),
        mode: 0o644,
        data: common.zsh.clone(),
    });
    files.sort_by(|a, b| a.path.cmp(&b.path));
    files
}

/// The directories below [`DOC`] the package owns (removed with it), parents first.
pub fn owned_dirs(files: &[File]) -> Vec<String> {
    let mut dirs: Vec<String> = Vec::new();
    for f in files.iter().filter(|f| f.path.starts_with(DOC)) {
        let mut dir = Path::new(&f.path).parent();
        while let Some(d) = dir.filter(|d| d.starts_with(DOC)) {
            dirs.push(d.to_string_lossy().into_owned());
            dir = d.parent();
        }
    }
    dirs.sort();
    dirs.dedup();
    dirs
}

/// Write `files` below `root` (which must not exist yet), with their modes.
///
/// # Errors
/// Creating a directory or writing a file.
pub fn stage(root: &Path, files: &[File]) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    for f in files {
        let path = root.join(f.path.trim_start_matches('/'));
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        std::fs::write(&path, &f.data).with_context(|| format!("writing {}", path.display()))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(f.mode))?;
    }
    // Directories 0755 whatever the umask.
    let mut dirs: Vec<PathBuf> = Vec::new();
    for f in files {
        let mut dir = root.join(f.path.trim_start_matches('/'));
        while dir.pop() && dir.starts_with(root) && dir != root {
            dirs.push(dir.clone());
        }
    }
    for d in dirs {
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(())
}

fn read_repo(rel: &str) -> Result<String> {
    let path = util::root().join(rel);
    std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
}

/// deploy/systemd/lb.service with `ExecStart` on [`BIN`] and its manual install steps replaced
/// by what to do after installing the package.
///
/// # Errors
/// The unit no longer has exactly one `ExecStart=/usr/local/bin/lb ` line or a `[Unit]`.
pub fn packaged_unit(repo_unit: &str) -> Result<String> {
    let starts = repo_unit
        .lines()
        .filter(|l| l.starts_with(EXEC_START_REPO))
        .count();
    ensure!(
        starts == 1,
        "deploy/systemd/lb.service: expected one line starting with {EXEC_START_REPO:?}, found \
         {starts}; the packaged unit replaces it"
    );
    let Some(at) = repo_unit.find("\n[Unit]\n") else {
        bail!("deploy/systemd/lb.service: no [Unit] section");
    };
    let head = "# lb as a systemd service with the least privilege it needs, installed by the lb \
                package.\n#\n\
                #   write /etc/lb/lb.toml (examples: /usr/share/doc/lb/examples), then\n\
                #   lb config check /etc/lb/lb.toml\n\
                #   systemctl enable --now lb\n\
                #   systemctl reload lb      # SIGHUP: re-read the config\n\
                #   lb upgrade               # after a package upgrade: hand over to the new \
                binary\n#                            without dropping a connection\n";
    let body = repo_unit[at + 1..].replace(EXEC_START_REPO, EXEC_START_PACKAGED);
    Ok(format!("{head}{body}"))
}

fn copyright(version: &str) -> String {
    format!(
        "lb {version}: a client-side TCP load balancer with an eBPF data path.\n\
         License: MIT OR Apache-2.0 (at your option).\n"
    )
}

/// `lb man --dir` into a scratch directory, each page gzipped for /usr/share/man/man1.
fn man_pages(lb: &Path) -> Result<Vec<File>> {
    let dir = std::env::temp_dir().join(format!("lb-dist-man-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(lb)
        .args(["man", "--dir"])
        .arg(&dir)
        .output()
        .with_context(|| format!("running {} man", lb.display()));
    let pages = out.and_then(|out| {
        ensure!(
            out.status.success(),
            "{} man --dir failed ({}): {}",
            lb.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
        let mut names: Vec<String> = std::fs::read_dir(&dir)?
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.ends_with(".1"))
            .collect();
        names.sort();
        ensure!(
            names.iter().any(|n| n == "lb.1"),
            "{} man wrote no lb.1",
            lb.display()
        );
        names
            .iter()
            .map(|n| {
                Ok(File {
                    path: format!("/usr/share/man/man1/{n}.gz"),
                    mode: 0o644,
                    data: gzip(&std::fs::read(dir.join(n))?)?,
                })
            })
            .collect()
    });
    let _ = std::fs::remove_dir_all(&dir);
    pages
}

/// gzip at the default level (6: within 1 % of level 9's size on `lb`, a third of its time),
/// with no name and mtime 0, so equal input gives equal bytes.
pub fn gzip(data: &[u8]) -> Result<Vec<u8>> {
    let mut enc = flate2::GzBuilder::new().write(Vec::new(), flate2::Compression::default());
    enc.write_all(data)?;
    Ok(enc.finish()?)
}

fn completion(lb: &Path, shell: &str) -> Result<Vec<u8>> {
    let out = Command::new(lb)
        .args(["completions", shell])
        .output()
        .with_context(|| format!("running {} completions {shell}", lb.display()))?;
    ensure!(
        out.status.success() && !out.stdout.is_empty(),
        "{} completions {shell} failed ({})",
        lb.display(),
        out.status
    );
    Ok(out.stdout)
}

/// The node layouts of deploy/k3s and deploy/rke2 (configs, K3s/RKE2 options, unit drop-ins;
/// not the DaemonSet, which is applied with kubectl) and the agent's drop-in
/// deploy/systemd/after-lb.conf, under examples/.
fn examples() -> Result<Vec<File>> {
    let mut files = Vec::new();
    for dir in ["k3s", "rke2"] {
        let base = util::root().join("deploy").join(dir);
        for rel in walk(&base)? {
            if rel == Path::new("daemonset.yaml") {
                continue;
            }
            files.push(File {
                path: format!("{DOC}/examples/{dir}/{}", rel.display()),
                mode: 0o644,
                data: std::fs::read(base.join(&rel))?,
            });
        }
    }
    files.push(File {
        path: format!("{DOC}/examples/systemd/after-lb.conf"),
        mode: 0o644,
        data: read_repo("deploy/systemd/after-lb.conf")?.into_bytes(),
    });
    ensure!(
        files.iter().any(|f| f.path == K3S_AGENT_EXAMPLE),
        "deploy/k3s/agent.toml is missing"
    );
    Ok(files)
}

/// Files below `base`, relative to it, sorted; a bounded depth (the layouts are two deep).
fn walk(base: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut todo = vec![PathBuf::new()];
    for _ in 0..64 {
        let Some(rel) = todo.pop() else {
            out.sort();
            return Ok(out);
        };
        let dir = base.join(&rel);
        for e in std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))? {
            let e = e?;
            let r = rel.join(e.file_name());
            if e.file_type()?.is_dir() {
                todo.push(r);
            } else {
                out.push(r);
            }
        }
    }
    bail!("{}: more than 64 directories", base.display())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_packaged_unit_runs_the_packaged_binary() -> Result<()> {
        let unit = packaged_unit(&read_repo("deploy/systemd/lb.service")?)?;
        let exec: Vec<&str> = unit
            .lines()
            .filter(|l| l.starts_with("ExecStart="))
            .collect();
        assert_eq!(exec, ["ExecStart=/usr/bin/lb run --config /etc/lb/lb.toml"]);
        assert!(!unit.contains("/usr/local/bin"), "{unit}");
        assert!(unit.contains("\n[Service]\n") && unit.contains("\n[Install]\n"));
        let err = packaged_unit("[Unit]\nExecStart=/opt/lb run\n").expect_err("no /usr/local");
        assert!(err.to_string().contains("found 0"), "{err}");
        Ok(())
    }

    #[test]
    fn owned_dirs_are_those_below_the_doc_dir() {
        let file = |p: &str| File {
            path: p.into(),
            mode: 0o644,
            data: Vec::new(),
        };
        let files = [
            file(BIN),
            file("/usr/share/doc/lb/copyright"),
            file("/usr/share/doc/lb/examples/k3s/lb.service.d/k3s.conf"),
        ];
        assert_eq!(
            owned_dirs(&files),
            [
                "/usr/share/doc/lb",
                "/usr/share/doc/lb/examples",
                "/usr/share/doc/lb/examples/k3s",
                "/usr/share/doc/lb/examples/k3s/lb.service.d",
            ]
        );
    }
}
