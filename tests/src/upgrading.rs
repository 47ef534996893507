//! An lb that upgrades itself (`lb upgrade`), started from a copy of its binary in a directory
//! of the test's own, so a test can replace that binary as a package upgrade would (a new file
//! renamed over the old one), and followed across upgrades (its pid changes).

use std::{
    net::SocketAddr,
    path::PathBuf,
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use serde_json::Value;

use crate::{TempDir, free_port, http_get, lb_bin, output_within};

/// An lb followed across upgrades; the serving process is terminated on drop, whichever it is.
#[derive(Debug)]
pub struct UpLb {
    dir: TempDir,
    /// Admin address (the same across upgrades).
    pub admin: SocketAddr,
    log: PathBuf,
    first: Child,
    /// The process serving now.
    pub pid: u32,
    /// The connect-time pin directory (`None`: no bpffs, lb runs unpinned), removed on drop.
    pub pin_dir: Option<PathBuf>,
}

/// What `lb upgrade` answered, before the old process is waited for.
#[derive(Debug)]
pub struct Answer {
    /// The CLI's output.
    pub output: Output,
    /// The process that took over, when the upgrade succeeded.
    pub new_pid: Option<u32>,
}

impl UpLb {
    /// Start `lb run` with `args` and `--admin-listen` on a free port, with `env` added; waits
    /// until `/livez` answers 200.
    ///
    /// # Errors
    /// lb exits or does not answer within 20 s (the error carries its log).
    pub fn start(args: &[&str], env: &[(&str, &str)]) -> Result<UpLb> {
        // Orphaned lbs (the old one exits after a hand-over) come back to this process, which
        // reaps them.
        let _ = nix::sys::prctl::set_child_subreaper(true);
        let dir = TempDir::new("lb-upgrade-test")?;
        let bin = dir.join("lb");
        std::fs::copy(lb_bin(), &bin).context("copying lb")?;
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        let log = dir.join("lb.log");
        let logf = std::fs::File::create(&log)?;
        let mut cmd = Command::new(&bin);
        cmd.arg("run")
            .args(args)
            .args(["--admin-listen", &admin.to_string()])
            .env("LB_LOG", "info")
            .stdin(Stdio::null())
            .stdout(logf.try_clone()?)
            .stderr(logf);
        let pin_dir = match env.iter().find(|(k, _)| *k == "LB_PIN_DIR") {
            Some((_, v)) => Some(PathBuf::from(v)),
            None => crate::unique_pin_dir(),
        };
        if let Some(d) = &pin_dir {
            cmd.env("LB_PIN_DIR", d);
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut first = spawn_copied(&mut cmd)?;
        let pid = first.id();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = first.try_wait()? {
                bail!("lb exited with {st}: {}", std::fs::read_to_string(&log)?);
            }
            if http_get(admin, "/livez").is_ok_and(|(c, _)| c == 200) {
                break;
            }
            if Instant::now() > deadline {
                bail!(
                    "lb did not answer /livez: {}",
                    std::fs::read_to_string(&log)?
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(UpLb {
            dir,
            admin,
            log,
            first,
            pid,
            pin_dir,
        })
    }

    /// The binary at lb's path.
    pub fn bin(&self) -> PathBuf {
        self.dir.join("lb")
    }

    /// The log of every process so far (the new ones inherit it).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Run `lb upgrade` (the CLI of the binary now at lb's path) and return as soon as it
    /// answers: the old process may still run. Does not follow the new pid.
    ///
    /// # Errors
    /// The CLI could not run within 120 s, or answered success with output that names no
    /// new process.
    pub fn request_upgrade(&self) -> Result<Answer> {
        let mut cmd = Command::new(lb_bin());
        cmd.args([
            "upgrade",
            "--admin",
            &self.admin.to_string(),
            "--output",
            "json",
        ]);
        let output = output_within(cmd, Duration::from_secs(120))?;
        if !output.status.success() {
            return Ok(Answer {
                output,
                new_pid: None,
            });
        }
        let v: Value = serde_json::from_slice(&output.stdout)
            .with_context(|| format!("lb upgrade printed {:?}", output.stdout))?;
        let new = u32::try_from(v["new_pid"].as_u64().context("new_pid")?)?;
        ensure!(v["old_pid"] == self.pid, "upgraded another lb: {v}");
        ensure!(new != self.pid, "the pid did not change: {v}");
        println!(
            "upgrade {} -> {new}: {} connections in {} ms, accepting paused {} ms",
            self.pid, v["connections"], v["elapsed_ms"], v["accept_pause_ms"]
        );
        Ok(Answer {
            output,
            new_pid: Some(new),
        })
    }

    /// After a successful [`UpLb::request_upgrade`]: wait until the old process is gone and
    /// follow the new one.
    ///
    /// # Errors
    /// The old process still runs after 10 s.
    pub fn follow(&mut self, answer: &Answer) -> Result<()> {
        if let Some(new) = answer.new_pid {
            self.wait_gone(self.pid, Duration::from_secs(10))?;
            self.pid = new;
        }
        Ok(())
    }

    /// Run `lb upgrade`; on success wait for the old process to exit and follow the new pid.
    ///
    /// # Errors
    /// As [`UpLb::request_upgrade`] and [`UpLb::follow`].
    pub fn upgrade(&mut self) -> Result<Output> {
        let answer = self.request_upgrade()?;
        self.follow(&answer)?;
        Ok(answer.output)
    }

    /// `lb upgrade` that must succeed; its JSON answer.
    ///
    /// # Errors
    /// The upgrade failed (the error carries the CLI's stderr and lb's log).
    pub fn upgrade_ok(&mut self) -> Result<Value> {
        let out = self.upgrade()?;
        ensure!(
            out.status.success(),
            "lb upgrade failed ({}): {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            self.log_text()
        );
        Ok(serde_json::from_slice(&out.stdout)?)
    }

    /// Wait until process `pid` has exited (and reap it when it is our child).
    ///
    /// # Errors
    /// Still running after `within`.
    pub fn wait_gone(&mut self, pid: u32, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        loop {
            if pid == self.first.id() {
                if self.first.try_wait()?.is_some() {
                    return Ok(());
                }
            } else {
                let p = nix::unistd::Pid::from_raw(i32::try_from(pid)?);
                let _ = nix::sys::wait::waitpid(p, Some(nix::sys::wait::WaitPidFlag::WNOHANG));
                if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                bail!("pid {pid} still runs after {within:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `/status` as JSON.
    ///
    /// # Errors
    /// Request or JSON failure, or a status other than 200.
    pub fn status(&self) -> Result<Value> {
        let (code, body) = http_get(self.admin, "/status")?;
        ensure!(code == 200, "/status {code}: {body}");
        Ok(serde_json::from_str(&body)?)
    }

    /// Sum of the samples of metric `name` whose labels contain `label`; 0 when absent.
    pub fn metric(&self, name: &str, label: &str) -> f64 {
        let (_, body) = http_get(self.admin, "/metrics").unwrap_or_default();
        body.lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| l.split(['{', ' ']).next() == Some(name) && l.contains(label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Every server as `"balancer"/"address"`, its state, connections and consecutive failures.
    ///
    /// # Errors
    /// As [`UpLb::status`].
    pub fn servers(&self) -> Result<Vec<(String, String, u64, u64)>> {
        let st = self.status()?;
        let mut out = Vec::new();
        for b in st["balancers"].as_array().context("balancers")? {
            for s in b["servers"].as_array().context("servers")? {
                out.push((
                    format!("{}/{}", b["name"], s["address"]),
                    s["state"].as_str().unwrap_or_default().to_string(),
                    s["connections"].as_u64().unwrap_or(0),
                    s["consecutive_failures"].as_u64().unwrap_or(0),
                ));
            }
        }
        Ok(out)
    }

    /// Wait until no server is UNCHECKED or RECOVERING.
    ///
    /// # Errors
    /// Not settled within 20 s.
    pub fn wait_settled(&self) -> Result<()> {
        crate::wait_until(Duration::from_secs(20), || {
            Ok(self
                .servers()?
                .iter()
                .all(|s| s.1 != "UNCHECKED" && s.1 != "RECOVERING"))
        })?;
        Ok(())
    }

    /// Replace the binary at lb's path as a package manager does (new file, rename).
    ///
    /// # Errors
    /// Write or rename failure.
    pub fn replace_binary(&self, content: &[u8]) -> Result<()> {
        use std::os::unix::fs::PermissionsExt as _;
        let tmp = self.dir.join("lb.new");
        std::fs::write(&tmp, content)?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?;
        std::fs::rename(&tmp, self.bin())?;
        Ok(())
    }
}

/// Spawn `cmd`, whose program was just copied: another thread's child, forked while the copy's
/// write descriptor was open, holds it until it execs, and until then `execve` fails with
/// `ETXTBSY`. Retried for up to a second.
fn spawn_copied(cmd: &mut Command) -> std::io::Result<Child> {
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        match cmd.spawn() {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            r => return r,
        }
    }
}

impl Drop for UpLb {
    fn drop(&mut self) {
        let pid = self.pid;
        if let Ok(p) = i32::try_from(pid).map(nix::unistd::Pid::from_raw) {
            let _ = nix::sys::signal::kill(p, nix::sys::signal::Signal::SIGTERM);
            if self.wait_gone(pid, Duration::from_secs(5)).is_err() {
                let _ = nix::sys::signal::kill(p, nix::sys::signal::Signal::SIGKILL);
                let _ = self.wait_gone(pid, Duration::from_secs(5));
            }
        }
        let _ = self.first.kill();
        let _ = self.first.wait();
        if let Some(dir) = &self.pin_dir {
            crate::remove_pins(dir);
        }
    }
}
