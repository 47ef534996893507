//! The `lb` process under test: started on a free admin port, asked over its admin API,
//! terminated on drop.

use std::{
    net::SocketAddr,
    path::PathBuf,
    process::{Child, Command},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{cmd::lb_bin, http::http_get};

/// A TCP port no socket of this network namespace uses: one the kernel gives a wildcard bind
/// (`0.0.0.0:0`) without `SO_REUSEADDR`, which conflicts with every socket on the port (also the
/// client sockets the kernel still holds after their process closed them, in `FIN_WAIT2` or
/// `TIME_WAIT`, which a `127.0.0.1:0` bind with `SO_REUSEADDR` may hand out again), and that
/// `[::]` can take too (IPv6 only); bound and released. Never the same port twice in one test
/// process: a port released here is free for the kernel to hand out again at the next call,
/// and a test that asks for two (an admin port and a listener) must get two. Tries at most 20
/// ports.
///
/// # Errors
/// No such port in 20 tries, or a bind failing for another reason.
pub fn free_port() -> Result<u16> {
    use socket2::{Domain, Socket, Type};
    let bind = |domain: Domain, addr: SocketAddr, v6_only: bool| -> std::io::Result<Socket> {
        let s = Socket::new(domain, Type::STREAM, None)?;
        if v6_only {
            s.set_only_v6(true)?;
        }
        s.bind(&addr.into())?;
        Ok(s)
    };
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for _ in 0..20 {
        let v4 = bind(Domain::IPV4, "0.0.0.0:0".parse()?, false)?;
        let port = v4
            .local_addr()?
            .as_socket()
            .map(|a| a.port())
            .ok_or_else(|| anyhow::anyhow!("no port"))?;
        if given.contains(&port) {
            continue;
        }
        let v6 = SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port));
        // Another error than "in use": no IPv6 on this host, the IPv4 port is what tests use.
        if let Err(e) = bind(Domain::IPV6, v6, true)
            && e.kind() == std::io::ErrorKind::AddrInUse
        {
            continue;
        }
        given.push(port);
        return Ok(port);
    }
    bail!("no TCP port free on both 0.0.0.0 and [::] in 20 tries")
}

/// A running `lb run`, killed (SIGTERM, then SIGKILL) on drop. Where a bpffs is mounted, each
/// gets a connect-time pin directory of its own (`LB_PIN_DIR`), cleaned up on drop.
#[derive(Debug)]
pub struct Lb {
    child: Child,
    /// Admin address.
    pub admin: SocketAddr,
    /// Where its log goes.
    pub log: PathBuf,
    /// Its connect-time pin directory (`None`: no bpffs, lb runs unpinned).
    pub pin_dir: Option<PathBuf>,
}

impl Lb {
    /// Start `lb run` with `args` plus `--admin-listen` on a free port; waits until `/livez`
    /// answers 200 (or the process exits).
    ///
    /// # Errors
    /// When lb exits or does not answer within 15 s; the error carries its log.
    pub fn start(args: &[&str]) -> Result<Lb> {
        Lb::start_via(&[], args)
    }

    /// One balancer on `listen` with the one `server`, the kernel data path attached to the
    /// cgroup `cgroup` (`--datapath bpf`) and splice forwarding (unless `extra` names another
    /// `--forwarding`), plus `extra` arguments; waits until its first checks settled (10 s at
    /// most).
    ///
    /// # Errors
    /// As [`Lb::start`] and [`Lb::wait_settled`].
    pub fn bpf_in(
        cgroup: &std::path::Path,
        listen: &str,
        server: &str,
        extra: &[&str],
    ) -> Result<Lb> {
        let cgp = cgroup.display().to_string();
        let mut args = vec![
            "--listen",
            listen,
            "--server",
            server,
            "--datapath",
            "bpf",
            "--cgroup",
            &cgp,
        ];
        if !extra.contains(&"--forwarding") {
            args.extend_from_slice(&["--forwarding", "splice"]);
        }
        args.extend_from_slice(extra);
        let lb = Lb::start(&args)?;
        lb.wait_settled(Duration::from_secs(10))?;
        Ok(lb)
    }

    /// [`Lb::start`] through `wrapper` (a program and its arguments that end by running the
    /// command after them, e.g. `setpriv ...` or `unshare ...`): `wrapper... lb run args...`.
    /// [`Lb::pid`] is then the wrapper's pid (the same as lb's when the wrapper execs it).
    ///
    /// # Errors
    /// As [`Lb::start`].
    pub fn start_via(wrapper: &[&str], args: &[&str]) -> Result<Lb> {
        Lb::start_full(wrapper, args, crate::unique_pin_dir())
    }

    /// [`Lb::start`] on the pin directory `pin_dir` (another lb's, to adopt its pins).
    ///
    /// # Errors
    /// As [`Lb::start`].
    /// A failed start leaves the directory to the lb it belongs to.
    pub fn start_pinned(pin_dir: &std::path::Path, args: &[&str]) -> Result<Lb> {
        Lb::start_full(&[], args, Some(pin_dir.to_path_buf()))
    }

    /// [`Lb::start_pinned`] through `wrapper` (see [`Lb::start_via`]).
    ///
    /// # Errors
    /// As [`Lb::start`].
    pub fn start_pinned_via(
        wrapper: &[&str],
        pin_dir: &std::path::Path,
        args: &[&str],
    ) -> Result<Lb> {
        Lb::start_full(wrapper, args, Some(pin_dir.to_path_buf()))
    }

    /// [`Lb::start_via`] with the pin directory `pin_dir` passed as `LB_PIN_DIR`, or (`None`)
    /// none passed: lb then pins where its configuration or its default (`<bpffs>/lb/default`)
    /// says, and nothing is removed on drop unless [`Lb::pin_dir`] is set afterwards.
    ///
    /// # Errors
    /// As [`Lb::start`].
    pub fn start_with(wrapper: &[&str], args: &[&str], pin_dir: Option<PathBuf>) -> Result<Lb> {
        Lb::start_full(wrapper, args, pin_dir)
    }

    fn start_full(wrapper: &[&str], args: &[&str], pin_dir: Option<PathBuf>) -> Result<Lb> {
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        let log = std::env::temp_dir().join(format!(
            "lb-test-{}-{}.log",
            std::process::id(),
            admin.port()
        ));
        let logf = std::fs::File::create(&log)?;
        let mut cmd = match wrapper.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(lb_bin());
                c
            }
            None => Command::new(lb_bin()),
        };
        cmd.arg("run")
            .args(args)
            .arg("--admin-listen")
            .arg(admin.to_string());
        cmd.env(
            "LB_LOG",
            std::env::var("LB_LOG").unwrap_or_else(|_| "info".into()),
        );
        if let Some(dir) = &pin_dir {
            cmd.env("LB_PIN_DIR", dir);
        }
        let child = cmd
            .stdout(logf.try_clone()?)
            .stderr(logf)
            .spawn()
            .with_context(|| format!("spawning {}", lb_bin().display()))?;
        let shared = pin_dir.as_ref().is_some_and(|d| d.exists());
        let mut lb = Lb {
            child,
            admin,
            log,
            pin_dir,
        };
        if let Err(e) = lb.wait_live() {
            // A directory this lb did not make stays to the lb that made it.
            if shared {
                lb.pin_dir = None;
            }
            return Err(e);
        }
        Ok(lb)
    }

    /// Wait until `/livez` answers 200 (15 s at most).
    fn wait_live(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                bail!("lb exited with {status}: {}", self.log_text());
            }
            if http_get(self.admin, "/livez").is_ok_and(|(code, _)| code == 200) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("lb did not answer /livez within 15 s: {}", self.log_text())
    }

    /// The log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// GET a path on the admin API: (status, body).
    ///
    /// # Errors
    /// Connect/IO failure.
    pub fn get(&self, path: &str) -> Result<(u16, String)> {
        http_get(self.admin, path)
    }

    /// Sum of the samples of metric `name` (exact family name, e.g. `lb_spliced_bytes_total`)
    /// whose labels contain `label` (`""` for all); 0 when absent or unreachable.
    pub fn metric(&self, name: &str, label: &str) -> f64 {
        let (_, body) = self.get("/metrics").unwrap_or_default();
        body.lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| l.split(['{', ' ']).next().is_some_and(|n| n == name) && l.contains(label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// `/status` as JSON.
    ///
    /// # Errors
    /// Request or JSON failure.
    pub fn status(&self) -> Result<serde_json::Value> {
        let (code, body) = self.get("/status")?;
        if code != 200 {
            bail!("/status answered {code}: {body}");
        }
        Ok(serde_json::from_str(&body)?)
    }

    /// Run the `lb` command line `args` against this lb's admin API (`--admin` appended) and
    /// return what it printed.
    ///
    /// # Errors
    /// The command could not start or exited non-zero (its output in the error).
    pub fn cli(&self, args: &[&str]) -> Result<String> {
        let out = std::process::Command::new(crate::lb_bin())
            .args(args)
            .args(["--admin", &self.admin.to_string()])
            .output()?;
        if !out.status.success() {
            bail!("lb {args:?}: {out:?}");
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Send `sig` to the lb process.
    ///
    /// # Errors
    /// The process is gone.
    pub fn signal(&self, sig: nix::sys::signal::Signal) -> Result<()> {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.pid())?);
        nix::sys::signal::kill(pid, sig)?;
        Ok(())
    }

    /// `kill -9`, then wait (at most `timeout`) until the process is reaped: every thread has
    /// exited, so its descriptors (a pin directory's lock among them) are closed. A zombie
    /// leader alone does not say so: its other threads may still be exiting.
    ///
    /// # Errors
    /// The signal or the wait failed, or the process outlived `timeout`.
    pub fn kill9(&mut self, timeout: Duration) -> Result<()> {
        self.signal(nix::sys::signal::Signal::SIGKILL)?;
        let deadline = Instant::now() + timeout;
        while self.child.try_wait()?.is_none() {
            if Instant::now() > deadline {
                bail!("lb {} outlived kill -9 by {timeout:?}", self.pid());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    /// Balancer `name` as `/status` gives it.
    ///
    /// # Errors
    /// Request or JSON failure, or no such balancer.
    pub fn balancer(&self, name: &str) -> Result<serde_json::Value> {
        let st = self.status()?;
        st["balancers"]
            .as_array()
            .and_then(|v| v.iter().find(|b| b["name"] == name).cloned())
            .with_context(|| format!("no balancer {name} in /status: {st}"))
    }

    /// The servers of balancer `name` as `/status` lists them.
    fn status_servers(&self, name: &str) -> Result<Vec<serde_json::Value>> {
        let b = self.balancer(name)?;
        b["servers"]
            .as_array()
            .cloned()
            .with_context(|| format!("no servers in /status: {b}"))
    }

    /// The server addresses of balancer `name`, as `/status` lists them.
    ///
    /// # Errors
    /// Request or JSON failure, or no such balancer.
    pub fn servers(&self, name: &str) -> Result<Vec<String>> {
        Ok(self
            .status_servers(name)?
            .iter()
            .filter_map(|s| s["address"].as_str().map(String::from))
            .collect())
    }

    /// The state `/status` gives server `server` of balancer `balancer` (`PREFERRED`,
    /// `FAILED`, ...), or `(absent)` when the balancer does not list it.
    ///
    /// # Errors
    /// Request or JSON failure, or no such balancer.
    pub fn server_state(&self, balancer: &str, server: &str) -> Result<String> {
        Ok(self
            .status_servers(balancer)?
            .iter()
            .find(|s| s["address"] == server)
            .map_or_else(
                || "(absent)".to_string(),
                |s| s["state"].as_str().unwrap_or("").to_string(),
            ))
    }

    /// Wait until `/readyz` answers 200.
    ///
    /// # Errors
    /// Not ready within `timeout`.
    pub fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.get("/readyz").is_ok_and(|(c, _)| c == 200) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("lb not ready within {timeout:?}: {}", self.log_text())
    }

    /// Wait until no server is UNCHECKED or RECOVERING, so clients land where the policy says
    /// and no first check moves them afterwards.
    ///
    /// # Errors
    /// Not settled within `timeout`.
    pub fn wait_settled(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let st = self.status()?;
            let settling = st["balancers"]
                .as_array()
                .context("balancers")?
                .iter()
                .flat_map(|b| b["servers"].as_array().cloned().unwrap_or_default())
                .any(|s| s["state"] == "UNCHECKED" || s["state"] == "RECOVERING");
            if !settling {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("servers not settled within {timeout:?}: {st}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Send SIGTERM and wait up to `timeout` for exit; returns the exit code.
    ///
    /// # Errors
    /// Still running after `timeout` (then killed).
    pub fn terminate(&mut self, timeout: Duration) -> Result<i32> {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id())?);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(st) = self.child.try_wait()? {
                return Ok(st.code().unwrap_or(-1));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        bail!("lb did not exit within {timeout:?} of SIGTERM")
    }
}

impl Drop for Lb {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.terminate(Duration::from_secs(3));
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if let Some(dir) = &self.pin_dir {
            crate::remove_pins(dir);
        }
    }
}

/// Poll `f` every 10 ms until it holds or `within` passes; returns how long it took.
///
/// # Errors
/// `f`'s error, or the condition not met in time.
pub fn wait_until(within: Duration, mut f: impl FnMut() -> Result<bool>) -> Result<Duration> {
    let start = std::time::Instant::now();
    loop {
        if f()? {
            return Ok(start.elapsed());
        }
        if start.elapsed() > within {
            bail!("condition not met within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Poll `/status` until server `server` of balancer `balancer` is `want`; returns how long that
/// took.
///
/// # Errors
/// `/status` failing, or the state still another after `within` (the error names it and holds
/// lb's log).
pub fn wait_server_state(
    lb: &Lb,
    balancer: &str,
    server: &str,
    want: &str,
    within: Duration,
) -> Result<Duration> {
    wait_until(within, || Ok(lb.server_state(balancer, server)? == want)).with_context(|| {
        format!(
            "{balancer}: {server} is {}, not {want}, after {within:?}\n{}",
            lb.server_state(balancer, server).unwrap_or_default(),
            lb.log_text()
        )
    })
}
