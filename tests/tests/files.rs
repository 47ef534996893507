//! Files lb reads and writes: a device or an oversized file named in the config is refused at
//! once with the key and the limit; the state file is private (0600 in a 0700 directory) and,
//! on a full or read-only file system, keeps its previous content while lb reports the failure
//! once and keeps serving.

use std::{
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use lb_tests::{
    Host, Lb, TempDir, free_port, http_request, lb_bin, output_within, skip_unless_root, wait_until,
};

/// `lb config check FILE`: exit code, stderr, and how long it took.
fn config_check(file: &Path) -> Result<(i32, String, Duration)> {
    let mut cmd = Command::new(lb_bin());
    cmd.args(["config", "check"]).arg(file).stdin(Stdio::null());
    let start = Instant::now();
    let o = output_within(cmd, Duration::from_secs(30))?;
    Ok((
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stderr).into_owned(),
        start.elapsed(),
    ))
}

fn balancer(extra: &str) -> String {
    format!(
        "[[balancer]]\nname = \"b\"\nlisten = [\"127.0.0.1:7000\"]\nservers = [\"198.18.0.2:443\"]\n{extra}"
    )
}

#[test]
fn devices_and_oversized_files_are_refused_at_once_with_the_key() -> Result<()> {
    let dir = TempDir::new("lb-files-check")?;
    let big = dir.join("big.pem");
    std::fs::write(&big, vec![b'#'; 2 * 1024 * 1024])?;
    let cases: [(String, &str, &str); 4] = [
        (
            balancer("[balancer.health]\nkind = \"tls\"\nca_file = \"/dev/zero\"\n"),
            "balancer[0].health.ca_file",
            "not a regular file (a character device)",
        ),
        (
            balancer(&format!(
                "[balancer.health]\nkind = \"tls\"\ncert_file = \"{0}\"\nkey_file = \"{0}\"\n",
                big.display()
            )),
            "balancer[0].health.cert_file",
            "larger than 1048576 bytes",
        ),
        (
            format!("[admin]\ntoken_file = \"/dev/zero\"\n{}", balancer("")),
            "admin.token_file",
            "not a regular file",
        ),
        (
            format!(
                "[admin]\ntoken_file = \"{}\"\n{}",
                big.display(),
                balancer("")
            ),
            "admin.token_file",
            "larger than 1048576 bytes",
        ),
    ];
    for (i, (text, key, reason)) in cases.iter().enumerate() {
        let file = dir.join(&format!("c{i}.toml"));
        std::fs::write(&file, text)?;
        let (code, err, took) = config_check(&file)?;
        ensure!(
            code == 2 && err.contains(key) && err.contains(reason),
            "case {i}: exit {code}, want 2 naming {key} and {reason:?}: {err}"
        );
        ensure!(took < Duration::from_secs(5), "case {i} took {took:?}");
    }
    // The config file itself: a device, and one over 4 MiB.
    let (code, err, _) = config_check(Path::new("/dev/zero"))?;
    ensure!(
        code == 2 && err.contains("not a regular file"),
        "{code}: {err}"
    );
    let huge = dir.join("huge.toml");
    let mut text = balancer("");
    text.push_str(&format!("# {}\n", "x".repeat(5 * 1024 * 1024)));
    std::fs::write(&huge, text)?;
    let (code, err, _) = config_check(&huge)?;
    ensure!(
        code == 2 && err.contains("larger than 4194304 bytes"),
        "{code}: {err}"
    );
    Ok(())
}

/// A tmpfs of 64 KiB mounted on a directory of the test, unmounted on drop (also when the test
/// fails).
struct SmallFs {
    dir: TempDir,
}

impl SmallFs {
    fn new() -> Result<SmallFs> {
        let dir = TempDir::new("lb-files-tmpfs")?;
        let o = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=64k,mode=0755", "lbtest"])
            .arg(dir.path())
            .output()?;
        ensure!(o.status.success(), "mount: {o:?}");
        Ok(SmallFs { dir })
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn remount(&self, opts: &str) -> Result<()> {
        let o = Command::new("mount")
            .args(["-o", &format!("remount,{opts}")])
            .arg(self.dir.path())
            .output()?;
        ensure!(o.status.success(), "remount {opts}: {o:?}");
        Ok(())
    }

    /// Write a filler file until the file system is full.
    fn fill(&self) -> Result<PathBuf> {
        use std::io::Write as _;
        let path = self.dir.join("filler");
        let mut f = std::fs::File::create(&path)?;
        let chunk = [0u8; 4096];
        for _ in 0..1024 {
            if let Err(e) = f.write_all(&chunk).and_then(|()| f.sync_all()) {
                ensure!(e.raw_os_error() == Some(libc::ENOSPC), "filling: {e}");
                return Ok(path);
            }
        }
        bail!("64 KiB tmpfs not full after 4 MiB")
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

fn put_servers(lb: &Lb, servers: &[String]) -> Result<()> {
    let body = serde_json::json!({ "servers": servers }).to_string();
    let (code, text) = http_request(lb.admin, "PUT", "/balancers/b/servers", Some(&body))?;
    ensure!(code == 200, "PUT servers: {code} {text}");
    Ok(())
}

fn saved_servers(path: &Path) -> Result<Vec<String>> {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(path)?)?;
    Ok(v["servers"]
        .as_array()
        .context("servers")?
        .iter()
        .filter_map(|s| s.as_str().map(String::from))
        .collect())
}

fn warnings(lb: &Lb) -> usize {
    lb.log_text().matches("cannot write state file;").count()
}

#[test]
fn state_file_is_private_and_survives_a_full_and_a_read_only_disk() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let host = Host::serving(9000, "s0")?;
    let fs = SmallFs::new()?;
    let state = fs.path().join("lb/state.json");
    let cfgdir = TempDir::new("lb-files-cfg")?;
    let listen = format!("127.0.0.1:{}", free_port()?);
    let a = host.addr(9000).to_string();
    let b = host.addr(9001).to_string();
    let cfg = cfgdir.join("lb.toml");
    std::fs::write(
        &cfg,
        format!(
            "[datapath]\nmode = \"userspace\"\n[[balancer]]\nname = \"b\"\nlisten = [\"{listen}\"]\nservers = [\"{a}\"]\nstate_file = \"{}\"\n",
            state.display()
        ),
    )?;
    // Started from a umask that would make the file 0644 and its directory 0755.
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o022));
    let lb = Lb::start(&["--config", cfg.to_str().context("path")?]);
    nix::sys::stat::umask(old);
    let lb = lb?;
    put_servers(&lb, &[a.clone(), b.clone()])?;
    wait_until(Duration::from_secs(10), || Ok(state.exists()))?;
    let mode = |p: &Path| -> Result<u32> { Ok(std::fs::metadata(p)?.permissions().mode() & 0o777) };
    ensure!(
        mode(&state)? == 0o600,
        "state file mode {:o}",
        mode(&state)?
    );
    ensure!(
        mode(state.parent().context("dir")?)? == 0o700,
        "directory mode"
    );
    ensure!(saved_servers(&state)? == [a.clone(), b.clone()]);

    // Full: two changes, one warning, the previous file intact, lb serving the new set.
    let filler = fs.fill()?;
    put_servers(&lb, std::slice::from_ref(&b))?;
    put_servers(&lb, std::slice::from_ref(&a))?;
    wait_until(Duration::from_secs(10), || Ok(warnings(&lb) >= 1))?;
    ensure!(
        warnings(&lb) == 1,
        "one warning while full:\n{}",
        lb.log_text()
    );
    ensure!(
        lb.log_text().contains("No space left on device"),
        "{}",
        lb.log_text()
    );
    ensure!(
        saved_servers(&state)? == [a.clone(), b.clone()],
        "previous file kept"
    );
    ensure!(
        lb.servers("b")? == [a.clone()],
        "the change applies while the disk is full"
    );
    ensure!(lb.get("/livez")?.0 == 200);

    // Room again: the next change is written and the recovery logged.
    std::fs::remove_file(&filler)?;
    put_servers(&lb, std::slice::from_ref(&b))?;
    wait_until(Duration::from_secs(10), || {
        Ok(saved_servers(&state)? == [b.clone()])
    })?;
    ensure!(lb.log_text().contains("state file written again"));

    // Read-only: again one warning, the file as it was.
    fs.remount("ro")?;
    put_servers(&lb, std::slice::from_ref(&a))?;
    put_servers(&lb, &[a.clone(), b.clone()])?;
    wait_until(Duration::from_secs(10), || Ok(warnings(&lb) >= 2))?;
    ensure!(
        warnings(&lb) == 2,
        "one more warning when read-only:\n{}",
        lb.log_text()
    );
    ensure!(
        lb.log_text().contains("Read-only file system"),
        "{}",
        lb.log_text()
    );
    ensure!(saved_servers(&state)? == [b.clone()], "previous file kept");
    ensure!(lb.get("/livez")?.0 == 200);
    fs.remount("rw")?;
    Ok(())
}
