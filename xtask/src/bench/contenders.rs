//! The contenders: a direct connection, lb with each data path, lb with connect-time forwarding,
//! HAProxy and nginx, each started with a generated config on a loopback port and stopped on drop.

use std::{
    fmt::Write as _,
    io::{Read as _, Write as _},
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use lb_tests::{Lb, free_port};

use super::procfs::proc_stat;
use serde::Serialize;

/// Who carries the client's connection to the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Kind {
    /// The client dials the server itself: the limit.
    Direct,
    /// lb with the kernel data path and `--forwarding splice` (upstream splice, copy
    /// downstream).
    LbBpf,
    /// lb with connect-time forwarding (`--forwarding connect --datapath bpf`): the client's
    /// `connect()` to the listener is rewritten to the server, lb carries no byte.
    LbConnect,
    /// lb copying in userspace.
    LbUserspace,
    /// HAProxy in tcp mode.
    Haproxy,
    /// nginx with the stream module.
    Nginx,
}

impl Kind {
    /// Every contender, in table order.
    pub const ALL: [Kind; 6] = [
        Kind::Direct,
        Kind::LbBpf,
        Kind::LbConnect,
        Kind::LbUserspace,
        Kind::Haproxy,
        Kind::Nginx,
    ];

    /// Short name used in tables, JSON and charts.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Direct => "direct",
            Kind::LbBpf => "lb bpf",
            Kind::LbConnect => "lb connect",
            Kind::LbUserspace => "lb userspace",
            Kind::Haproxy => "haproxy",
            Kind::Nginx => "nginx",
        }
    }

    /// Whether it checks servers actively and ends the sessions of a failed one (scenarios 6, 7).
    pub fn kills_sessions(self) -> bool {
        matches!(
            self,
            Kind::LbBpf | Kind::LbConnect | Kind::LbUserspace | Kind::Haproxy
        )
    }

    /// Whether a balancer process runs whose CPU and memory are measured (for `lb connect` it
    /// only picks the server and checks: no byte passes through it).
    pub fn is_proxy(self) -> bool {
        self != Kind::Direct
    }
}

/// Health checks every contender with checks uses: tcp connect every 1 s, 1 s timeout, one
/// failure marks a server down, two successes bring it back.
pub const CHECK_INTERVAL_MS: u64 = 1000;

/// Cgroups the clients run in: each lb bpf contender's clients in the cgroup that lb attaches
/// to, every other contender's in a plain one, so no contender pays for another's programs.
#[derive(Debug)]
pub struct Cgroups {
    /// Attached by `lb --datapath bpf`.
    pub bpf: lb_tests::TestCgroup,
    /// Attached by `lb --forwarding connect` (connect4/6, getpeername4/6 and sockops).
    pub connect: lb_tests::TestCgroup,
    /// Nothing attached.
    pub plain: lb_tests::TestCgroup,
}

impl Cgroups {
    /// The cgroup `kind`'s clients run in.
    pub fn for_kind(&self, kind: Kind) -> &Path {
        match kind {
            Kind::LbBpf => &self.bpf.path,
            Kind::LbConnect => &self.connect.path,
            _ => &self.plain.path,
        }
    }
}

enum Proc {
    None,
    Lb(Lb),
    Child(Child),
}

/// A started contender. Proxies are stopped and their temp dir removed on drop.
pub struct Running {
    /// Which one.
    pub kind: Kind,
    /// Where clients connect.
    pub addr: SocketAddr,
    proc_: Proc,
    dir: Option<PathBuf>,
    primary: SocketAddr,
    /// The lb serving after `lb upgrade` (not our child).
    upgraded_lb: Option<u32>,
    /// HAProxy processes a reload replaced (they serve their connections until these end).
    replaced: Vec<Child>,
    /// The arguments lb was started with (after `run`), for a restart.
    lb_args: Vec<String>,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} at {}", self.kind.name(), self.addr)
    }
}

fn temp_dir(kind: Kind) -> Result<PathBuf> {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "lb-bench-{}-{}-{}",
        std::process::id(),
        kind.name().replace(' ', "-"),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn lb_config(mode: &str, listen: SocketAddr, servers: &[SocketAddr]) -> String {
    let list: Vec<String> = servers.iter().map(|s| format!("\"{s}\"")).collect();
    format!(
        r#"[datapath]
mode = "{mode}"

[[balancer]]
name = "bench"
listen = ["{listen}"]
servers = [{servers}]
policy = "failover"
dial_timeout = "2s"

[balancer.health]
kind = "tcp"
interval = "{CHECK_INTERVAL_MS}ms"
timeout = "1s"
rise = 2
fall = 1
on_unhealthy = "kill"
"#,
        servers = list.join(", ")
    )
}

/// The open-files hard limit of this process (inherited by the proxies).
fn files_limit() -> u64 {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map_or(1024, |(_, hard)| hard)
}

fn haproxy_config(dir: &Path, listen: SocketAddr, servers: &[SocketAddr]) -> String {
    // HAProxy wants 2 files per connection plus a few, and refuses to start without them.
    let maxconn = (files_limit().saturating_sub(100) / 2).min(60_000);
    let mut cfg = format!(
        "global
    maxconn {maxconn}
    stats socket {sock} mode 600 level admin expose-fd listeners

defaults
    mode tcp
    maxconn {maxconn}
    timeout connect 2s
    option redispatch
    timeout client 10m
    timeout server 10m
    timeout check 1s

listen bench
    bind {listen}
",
        sock = dir.join("admin.sock").display()
    );
    for (i, s) in servers.iter().enumerate() {
        let _ = writeln!(
            cfg,
            "    server s{i} {s} check inter {CHECK_INTERVAL_MS}ms fall 1 rise 2 on-marked-down shutdown-sessions{}",
            if i > 0 { " backup" } else { "" }
        );
    }
    cfg
}

fn nginx_config(dir: &Path, listen: SocketAddr, servers: &[SocketAddr]) -> String {
    let module = Path::new("/usr/lib/nginx/modules/ngx_stream_module.so");
    let mut cfg = String::new();
    if module.exists() {
        let _ = writeln!(cfg, "load_module {};", module.display());
    }
    let _ = write!(
        cfg,
        "daemon off;
master_process on;
worker_processes auto;
worker_rlimit_nofile {files};
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections {conns}; }}
stream {{
    upstream bench {{
",
        dir = dir.display(),
        files = files_limit(),
        conns = files_limit().saturating_sub(200),
    );
    for (i, s) in servers.iter().enumerate() {
        let _ = writeln!(
            cfg,
            "        server {s}{};",
            if i > 0 { " backup" } else { "" }
        );
    }
    let _ = write!(
        cfg,
        "    }}
    server {{
        listen {listen};
        proxy_pass bench;
        proxy_timeout 10m;
        proxy_half_close on;
    }}
}}
"
    );
    cfg
}

/// Wait until `addr` accepts a connection (the proxy listens).
fn wait_listening(addr: SocketAddr, child: &mut Child, what: &str, log: &Path) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        if let Some(st) = child.try_wait()? {
            bail!(
                "{what} exited with {st}: {}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        if std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(30));
    }
    bail!("{what} did not listen on {addr} within 15 s")
}

/// Make sure a `--forwarding connect` lb got connect-time forwarding (no silent fall back to
/// the splice, which would measure the wrong thing) and has written its table.
fn wait_connect_table(lb: &Lb) -> Result<()> {
    let st = lb.status()?;
    let b = &st["balancers"][0];
    if b["forwarding"] != "connect" {
        bail!(
            "lb connect: the balancer got forwarding {} ({}); log:\n{}",
            b["forwarding"],
            b["forwarding_fallback"],
            lb.log_text()
        );
    }
    lb_tests::wait_until(Duration::from_secs(5), || {
        Ok(lb.log_text().contains("connect-time table updated"))
    })
    .context("lb connect: the connect-time table was not written within 5 s")?;
    Ok(())
}

/// Starts of `lb connect` tried before giving up on having the preferred server ACTIVE.
const CONNECT_START_TRIES: u32 = 12;

/// Start lb with `args` and wait until its servers are settled. For `lb connect`, also until its
/// table is written with `primary` as the ACTIVE server (a connect-time table marks its first
/// server ACTIVE once every first verdict is in): the failover scenarios blackhole `primary`, so
/// a start on which the preferred server's first checks failed (and the backup took the
/// clients) is stopped and started again, at most [`CONNECT_START_TRIES`] times.
fn start_lb(args: &[&str], kind: Kind, primary: SocketAddr) -> Result<Lb> {
    if kind == Kind::LbConnect {
        // Reach the preferred server once first: right after a blackhole is lifted its first
        // check tended to lose the race (3-4 restarts in a row without this, none in the quick
        // run with it; presumably its neighbour entry has to be resolved again).
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline
            && std::net::TcpStream::connect_timeout(&primary, Duration::from_millis(500)).is_err()
        {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    for attempt in 1..=CONNECT_START_TRIES {
        let mut lb = Lb::start(args)?;
        lb.wait_ready(Duration::from_secs(15))?;
        lb.wait_settled(Duration::from_secs(15))?;
        if kind != Kind::LbConnect {
            return Ok(lb);
        }
        wait_connect_table(&lb)?;
        let st = lb.status()?;
        let active: Vec<String> = st["balancers"][0]["servers"]
            .as_array()
            .context("servers")?
            .iter()
            .filter(|s| s["state"] == "ACTIVE")
            .filter_map(|s| s["address"].as_str().map(str::to_string))
            .collect();
        if active.is_empty() || active == [primary.to_string()] {
            return Ok(lb);
        }
        eprintln!(
            "bench: lb connect start {attempt}: the backup {} is ACTIVE, not {primary}; \
             starting it again",
            active.join(",")
        );
        let _ = lb.terminate(Duration::from_secs(5));
    }
    bail!("lb connect: the preferred server was not ACTIVE after {CONNECT_START_TRIES} starts")
}

/// Start HAProxy on `dir/haproxy.cfg` (log and errors beside it) and wait until it listens on
/// `addr`.
fn spawn_haproxy(dir: &Path, addr: SocketAddr) -> Result<Child> {
    let mut child = Command::new("haproxy")
        .args(["-db", "-f"])
        .arg(dir.join("haproxy.cfg"))
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(dir.join("haproxy.log"))?)
        .stderr(std::fs::File::create(dir.join("haproxy.err"))?)
        .spawn()
        .context("spawning haproxy")?;
    wait_listening(addr, &mut child, "haproxy", &dir.join("haproxy.err"))?;
    Ok(child)
}

impl Running {
    /// Start `kind` in front of `servers` (the first preferred, the rest backups).
    ///
    /// # Errors
    /// The proxy does not start or become ready.
    pub fn start(kind: Kind, servers: &[SocketAddr], cgroups: &Cgroups) -> Result<Running> {
        let primary = *servers.first().context("no servers")?;
        if kind == Kind::Direct {
            return Ok(Running {
                kind,
                addr: primary,
                proc_: Proc::None,
                dir: None,
                primary,
                upgraded_lb: None,
                replaced: Vec::new(),
                lb_args: Vec::new(),
            });
        }
        let dir = temp_dir(kind)?;
        let mut lb_args = Vec::new();
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        let proc_ = match kind {
            Kind::Direct => Proc::None,
            Kind::LbBpf | Kind::LbConnect | Kind::LbUserspace => {
                let mode = if kind == Kind::LbUserspace {
                    "userspace"
                } else {
                    "bpf"
                };
                let cfg = dir.join("lb.toml");
                std::fs::write(&cfg, lb_config(mode, addr, servers))?;
                let cg = cgroups.for_kind(kind).display().to_string();
                let cfg = cfg.display().to_string();
                lb_args = vec!["--config", &cfg, "--cgroup", &cg]
                    .into_iter()
                    .map(str::to_string)
                    .collect();
                if kind == Kind::LbConnect {
                    lb_args
                        .extend(["--forwarding", "connect", "--datapath", "bpf"].map(String::from));
                } else if kind == Kind::LbBpf {
                    lb_args.extend(["--forwarding", "splice"].map(String::from));
                }
                let args: Vec<&str> = lb_args.iter().map(String::as_str).collect();
                Proc::Lb(start_lb(&args, kind, primary)?)
            }
            Kind::Haproxy => {
                std::fs::write(dir.join("haproxy.cfg"), haproxy_config(&dir, addr, servers))?;
                Proc::Child(spawn_haproxy(&dir, addr)?)
            }
            Kind::Nginx => {
                let cfg = dir.join("nginx.conf");
                std::fs::write(&cfg, nginx_config(&dir, addr, servers))?;
                let mut child = Command::new("nginx")
                    .arg("-e")
                    .arg(dir.join("error.log"))
                    .arg("-p")
                    .arg(&dir)
                    .arg("-c")
                    .arg(&cfg)
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(std::fs::File::create(dir.join("nginx.err"))?)
                    .spawn()
                    .context("spawning nginx")?;
                wait_listening(addr, &mut child, "nginx", &dir.join("error.log"))?;
                Proc::Child(child)
            }
        };
        Ok(Running {
            kind,
            addr,
            proc_,
            dir: Some(dir),
            primary,
            upgraded_lb: None,
            replaced: Vec::new(),
            lb_args,
        })
    }

    /// Replace the running proxy without dropping connections: `lb upgrade` (lb hands its
    /// listeners and connections to a new lb from the same binary), HAProxy's seamless reload
    /// (a new process takes the listening sockets from the old one's stats socket, `-x`, and
    /// tells it to finish, `-sf`). Returns how long the command took.
    ///
    /// # Errors
    /// Not an lb or HAProxy contender, or the upgrade failed.
    pub fn upgrade(&mut self) -> Result<Duration> {
        let t = Instant::now();
        match &mut self.proc_ {
            Proc::Lb(lb) => {
                let out = Command::new(lb_tests::lb_bin())
                    .args([
                        "upgrade",
                        "--admin",
                        &lb.admin.to_string(),
                        "--output",
                        "json",
                    ])
                    .output()?;
                ensure!(
                    out.status.success(),
                    "lb upgrade failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
                let new = v["new_pid"].as_u64().context("new_pid")?;
                if let Some(old) = self.upgraded_lb.replace(u32::try_from(new)?) {
                    // It exits by itself once the new one has everything.
                    wait_gone(old, false);
                }
            }
            Proc::Child(old) if self.kind == Kind::Haproxy => {
                let dir = self.dir.clone().context("no dir")?;
                let old_pid = old.id().to_string();
                let new = Command::new("haproxy")
                    .args(["-db", "-f"])
                    .arg(dir.join("haproxy.cfg"))
                    .arg("-x")
                    .arg(dir.join("admin.sock"))
                    .args(["-sf", &old_pid])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(std::fs::File::create(dir.join("haproxy-reload.err"))?)
                    .spawn()
                    .context("spawning haproxy -sf")?;
                let old = std::mem::replace(&mut self.proc_, Proc::Child(new));
                if let Proc::Child(old) = old {
                    self.replaced.push(old);
                }
                // The new process serves once it has the listeners and its stats socket.
                let deadline = Instant::now() + Duration::from_secs(10);
                while Instant::now() < deadline
                    && std::os::unix::net::UnixStream::connect(dir.join("admin.sock")).is_err()
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            _ => bail!("{} has no upgrade", self.kind.name()),
        }
        Ok(t.elapsed())
    }

    /// Kill the proxy with SIGKILL, leave it dead for `down`, then start it again as it was
    /// started (lb on the same pin directory, so a connect-time lb adopts its pins). Returns when
    /// the new process is ready: lb's `/readyz`, HAProxy's listener.
    ///
    /// # Errors
    /// Not an lb or HAProxy contender, or the new process does not start.
    pub fn crash_and_restart(&mut self, down: Duration) -> Result<()> {
        match std::mem::replace(&mut self.proc_, Proc::None) {
            Proc::Lb(mut lb) => {
                // The pins stay for the next lb: the old one's drop must not remove them.
                let pins = lb.pin_dir.take();
                lb.signal(nix::sys::signal::Signal::SIGKILL)?;
                let _ = lb.terminate(Duration::from_secs(5));
                drop(lb);
                std::thread::sleep(down);
                let args: Vec<&str> = self.lb_args.iter().map(String::as_str).collect();
                let lb = match &pins {
                    Some(dir) => Lb::start_pinned(dir, &args)?,
                    None => Lb::start(&args)?,
                };
                lb.wait_ready(Duration::from_secs(15))?;
                self.proc_ = Proc::Lb(lb);
            }
            Proc::Child(mut old) if self.kind == Kind::Haproxy => {
                let _ = old.kill();
                let _ = old.wait();
                std::thread::sleep(down);
                let dir = self.dir.clone().context("no dir")?;
                self.proc_ = Proc::Child(spawn_haproxy(&dir, self.addr)?);
            }
            other => {
                self.proc_ = other;
                bail!("{} has no process to crash", self.kind.name());
            }
        }
        Ok(())
    }

    /// Every process of the proxy: the main one and its children (nginx workers).
    pub fn pids(&self) -> Vec<u32> {
        let main = match &self.proc_ {
            Proc::None => return Vec::new(),
            Proc::Lb(_) if self.upgraded_lb.is_some() => self.upgraded_lb.unwrap_or_default(),
            Proc::Lb(lb) => lb.pid(),
            Proc::Child(c) => c.id(),
        };
        let mut pids = vec![main];
        if let Ok(rd) = std::fs::read_dir("/proc") {
            for e in rd.flatten() {
                let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                    continue;
                };
                if proc_stat(pid).is_some_and(|st| st.ppid == main) {
                    pids.push(pid);
                }
            }
        }
        pids
    }

    /// CPU seconds (user + system) the proxy's processes used so far.
    pub fn cpu_secs(&self) -> f64 {
        self.pids()
            .into_iter()
            .filter_map(proc_stat)
            .map(|s| s.cpu_secs)
            .sum()
    }

    /// Client-to-server bytes lb's kernel splice has carried so far (`lb_spliced_bytes_total`);
    /// `None` for contenders without one.
    pub fn spliced_up_bytes(&self) -> Option<f64> {
        match &self.proc_ {
            Proc::Lb(lb) if self.kind == Kind::LbBpf => {
                Some(lb.metric("lb_spliced_bytes_total", "client_to_server"))
            }
            _ => None,
        }
    }

    /// Resident memory of the proxy's processes (bytes).
    pub fn rss_bytes(&self) -> u64 {
        self.pids()
            .into_iter()
            .filter_map(|pid| {
                let st = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
                let line = st.lines().find(|l| l.starts_with("VmRSS:"))?;
                let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
                Some(kib * 1024)
            })
            .sum()
    }

    /// Whether the proxy has marked the preferred server down (None: cannot tell).
    pub fn primary_down(&self) -> Option<bool> {
        match &self.proc_ {
            Proc::None => None,
            Proc::Lb(lb) => {
                let st = lb.status().ok()?;
                let want = self.primary.to_string();
                st["balancers"].as_array()?.iter().find_map(|b| {
                    b["servers"].as_array()?.iter().find_map(|s| {
                        (s["address"].as_str()? == want).then(|| s["state"] == "FAILED")
                    })
                })
            }
            Proc::Child(_) if self.kind == Kind::Haproxy => {
                let sock = self.dir.as_ref()?.join("admin.sock");
                let mut s = std::os::unix::net::UnixStream::connect(sock).ok()?;
                s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
                s.write_all(b"show stat\n").ok()?;
                let mut out = String::new();
                s.read_to_string(&mut out).ok()?;
                // CSV: pxname, svname, ..., status is field 17.
                out.lines().find_map(|l| {
                    let f: Vec<&str> = l.split(',').collect();
                    (f.len() > 17 && f[0] == "bench" && f[1] == "s0")
                        .then(|| f[17].starts_with("DOWN"))
                })
            }
            Proc::Child(_) => None,
        }
    }
}

/// With `term` SIGTERM `pid` (not our child); wait up to 10 s for it to be gone, then SIGKILL.
fn wait_gone(pid: u32, term: bool) {
    let Ok(p) = i32::try_from(pid).map(nix::unistd::Pid::from_raw) else {
        return;
    };
    if term {
        let _ = nix::sys::signal::kill(p, nix::sys::signal::Signal::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline && Path::new(&format!("/proc/{pid}")).exists() {
        let _ = nix::sys::wait::waitpid(p, Some(nix::sys::wait::WaitPidFlag::WNOHANG));
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = nix::sys::signal::kill(p, nix::sys::signal::Signal::SIGKILL);
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(pid) = self.upgraded_lb.take() {
            wait_gone(pid, true);
        }
        for mut c in self.replaced.drain(..) {
            let _ = c.kill();
            let _ = c.wait();
        }
        match std::mem::replace(&mut self.proc_, Proc::None) {
            Proc::None => {}
            Proc::Lb(mut lb) => {
                let _ = lb.terminate(Duration::from_secs(5));
            }
            Proc::Child(mut c) => {
                let pid = nix::unistd::Pid::from_raw(c.id() as i32);
                // SIGTERM: both stop at once and take their workers with them.
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
                let deadline = Instant::now() + Duration::from_secs(5);
                while Instant::now() < deadline && matches!(c.try_wait(), Ok(None)) {
                    std::thread::sleep(Duration::from_millis(20));
                }
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        if let Some(dir) = self.dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
