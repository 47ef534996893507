//! Test support for lb's privileged integration tests and the benchmark: test hosts in network
//! namespaces (198.18.0.0/15 only), a child cgroup for clients, an `lb` process, and the `lbt`
//! client/server. Everything made here is removed on drop, also when a test fails.

use std::{
    io::{BufRead, BufReader},
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

/// Streaming 64-bit digest of a byte stream, independent of how it is chunked.
#[derive(Clone, Debug)]
pub struct Digest {
    h: u64,
    n: u64,
    pending: [u8; 8],
    plen: usize,
}

impl Default for Digest {
    fn default() -> Self {
        Digest {
            h: 0xcbf2_9ce4_8422_2325,
            n: 0,
            pending: [0; 8],
            plen: 0,
        }
    }
}

impl Digest {
    fn mix(&mut self, w: u64) {
        self.h = (self.h ^ w)
            .wrapping_mul(0x0000_0100_0000_01b3)
            .rotate_left(29);
    }

    /// Feed bytes.
    pub fn update(&mut self, mut data: &[u8]) {
        self.n += data.len() as u64;
        while self.plen > 0 && !data.is_empty() {
            self.pending[self.plen] = data[0];
            self.plen += 1;
            data = &data[1..];
            if self.plen == 8 {
                self.mix(u64::from_le_bytes(self.pending));
                self.plen = 0;
            }
        }
        let mut chunks = data.chunks_exact(8);
        for c in &mut chunks {
            self.mix(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        for &b in chunks.remainder() {
            self.pending[self.plen] = b;
            self.plen += 1;
        }
    }

    /// Bytes fed so far.
    pub fn count(&self) -> u64 {
        self.n
    }

    /// The digest.
    pub fn finish(&self) -> u64 {
        let mut d = self.clone();
        let mut tail = [0u8; 8];
        tail[..d.plen].copy_from_slice(&d.pending[..d.plen]);
        d.mix(u64::from_le_bytes(tail) ^ (d.plen as u64) << 56);
        d.mix(d.n);
        d.h
    }
}

/// Deterministic pseudo-random byte stream (xorshift64*), the same for any chunking.
#[derive(Clone, Debug)]
pub struct PatternStream {
    state: u64,
    word: [u8; 8],
    used: usize,
}

impl PatternStream {
    /// New stream from a seed.
    pub fn new(seed: u64) -> PatternStream {
        PatternStream {
            state: seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
            word: [0; 8],
            used: 8,
        }
    }

    fn next_word(&mut self) -> [u8; 8] {
        let mut x = self.state;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.state = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes()
    }

    /// Fill `buf` with the next bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        let mut i = 0;
        while i < buf.len() && self.used < 8 {
            buf[i] = self.word[self.used];
            self.used += 1;
            i += 1;
        }
        let rest = &mut buf[i..];
        let mut chunks = rest.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_word());
        }
        let rem = chunks.into_remainder();
        if !rem.is_empty() {
            self.word = self.next_word();
            let k = rem.len();
            rem.copy_from_slice(&self.word[..k]);
            self.used = k;
        }
    }
}

/// Run a command, fail with its stderr when it fails.
///
/// # Errors
/// Spawn failure or non-zero exit.
pub fn sh(cmd: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .with_context(|| format!("spawning {cmd}"))?;
    if !out.status.success() {
        bail!(
            "{cmd} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// True when running as root (privileged tests skip otherwise, saying so).
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Print why a test is skipped and return true when it must skip (not root).
pub fn skip_unless_root(test: &str) -> bool {
    if is_root() {
        return false;
    }
    eprintln!("SKIP {test}: needs root (network namespaces, BPF)");
    true
}

/// The running kernel's `(major, minor)`, from `/proc/sys/kernel/osrelease`.
pub fn kernel_version() -> Option<(u32, u32)> {
    parse_kernel_release(&std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()?)
}

/// `(major, minor)` of a release string such as `6.1.0-57-amd64` or `6.12.117+deb12-amd64`.
fn parse_kernel_release(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.trim().split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// Print why a test is skipped and return true when the kernel is older than `min`; `feature`
/// names what the test needs (e.g. `"bpf_sock_destroy"`). The line has the form
/// `SKIP <test>: <reason>`, which `cargo xtask vm-test` lists in its summary.
pub fn skip_unless_kernel(test: &str, min: (u32, u32), feature: &str) -> bool {
    match kernel_version() {
        Some(v) if v >= min => false,
        v => {
            let running = v.map_or_else(|| "unknown".to_string(), |(a, b)| format!("{a}.{b}"));
            eprintln!(
                "SKIP {test}: needs {feature} (kernel {}.{}+), running {running}",
                min.0, min.1
            );
            true
        }
    }
}

static NEXT_SUBNET: AtomicU32 = AtomicU32::new(0);

/// A test host: a network namespace reached from the root namespace over a veth pair, in its own
/// /24 of 198.18.0.0/15 (root side `.1`, host side `.2`).
#[derive(Debug)]
pub struct Host {
    /// Namespace name.
    pub ns: String,
    /// Root-side interface.
    pub veth: String,
    /// The host's address.
    pub ip: Ipv4Addr,
    /// The root side's address.
    pub gateway: Ipv4Addr,
    servers: Vec<Child>,
}

impl Host {
    /// Create a host with a fresh subnet (retrying past names or subnets in use).
    ///
    /// # Errors
    /// `ip` failures.
    pub fn new() -> Result<Host> {
        let base = std::process::id() % 97;
        for _ in 0..512 {
            let n = (base * 5 + NEXT_SUBNET.fetch_add(1, Ordering::Relaxed)) % 510 + 1;
            let (b2, b3) = (18 + n / 256, n % 256);
            let veth = format!("lbt{n}");
            let peer = format!("lbt{n}p");
            if sh(
                "ip",
                &["link", "add", &veth, "type", "veth", "peer", "name", &peer],
            )
            .is_err()
            {
                continue;
            }
            let ns = format!("lbt{n}-{}", std::process::id());
            let host = Host {
                ns: ns.clone(),
                veth: veth.clone(),
                ip: Ipv4Addr::new(198, b2 as u8, b3 as u8, 2),
                gateway: Ipv4Addr::new(198, b2 as u8, b3 as u8, 1),
                servers: Vec::new(),
            };
            let setup = || -> Result<()> {
                sh("ip", &["netns", "add", &ns])?;
                sh("ip", &["link", "set", &peer, "netns", &ns])?;
                sh(
                    "ip",
                    &["addr", "add", &format!("{}/24", host.gateway), "dev", &veth],
                )?;
                sh("ip", &["link", "set", &veth, "up"])?;
                host.exec_ok(
                    "ip",
                    &["addr", "add", &format!("{}/24", host.ip), "dev", &peer],
                )?;
                host.exec_ok("ip", &["link", "set", &peer, "up"])?;
                host.exec_ok("ip", &["link", "set", "lo", "up"])?;
                host.exec_ok(
                    "ip",
                    &["route", "add", "default", "via", &host.gateway.to_string()],
                )?;
                Ok(())
            };
            setup()?;
            return Ok(host);
        }
        bail!("no free test subnet in 198.18.0.0/15")
    }

    /// A new host already serving `lbt` on `port` as `name`.
    ///
    /// # Errors
    /// As [`Host::new`] and [`Host::serve`].
    pub fn serving(port: u16, name: &str) -> Result<Host> {
        let mut h = Host::new()?;
        h.serve(port, name)?;
        Ok(h)
    }

    /// Run a command inside the namespace.
    ///
    /// # Errors
    /// Failure or non-zero exit.
    pub fn exec_ok(&self, cmd: &str, args: &[&str]) -> Result<String> {
        let mut all = vec!["netns", "exec", &self.ns, cmd];
        all.extend_from_slice(args);
        sh("ip", &all)
    }

    /// `ip:port` of this host.
    pub fn addr(&self, port: u16) -> SocketAddr {
        SocketAddr::new(IpAddr::V4(self.ip), port)
    }

    /// Start `lbt serve` on `port`, named `name`; waits until it listens.
    ///
    /// # Errors
    /// Spawn failure or the server not becoming ready within 10 s.
    pub fn serve(&mut self, port: u16, name: &str) -> Result<()> {
        let addr = self.addr(port).to_string();
        let mut child = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.ns,
                lbt_bin().to_str().unwrap_or("lbt"),
                "serve",
                "--listen",
                &addr,
                "--name",
                name,
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("spawning lbt serve")?;
        let out = child.stdout.take().context("stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(out).read_line(&mut line);
            let _ = tx.send(line);
        });
        let ready = rx.recv_timeout(Duration::from_secs(10)).unwrap_or_default();
        self.servers.push(child);
        if ready.trim() != "ready" {
            bail!("lbt serve on {addr} did not start");
        }
        Ok(())
    }

    /// Kill every server on this host (new connections are refused with RST).
    pub fn stop_servers(&mut self) {
        for mut c in self.servers.drain(..) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Blackhole the host: the root side's neighbour entry for it points at a MAC nobody has, so
    /// every packet toward it vanishes (no RST, no ICMP, connects hang), as with a crashed machine
    /// or a partition; the host's own link stays up.
    ///
    /// # Errors
    /// `ip` failure.
    pub fn blackhole(&self, on: bool) -> Result<()> {
        let ip = self.ip.to_string();
        if on {
            sh(
                "ip",
                &[
                    "neigh",
                    "replace",
                    &ip,
                    "lladdr",
                    "02:00:00:00:00:01",
                    "dev",
                    &self.veth,
                    "nud",
                    "permanent",
                ],
            )?;
        } else {
            sh("ip", &["neigh", "del", &ip, "dev", &self.veth])?;
        }
        Ok(())
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.stop_servers();
        let _ = sh("ip", &["link", "del", &self.veth]);
        let _ = sh("ip", &["netns", "del", &self.ns]);
    }
}

/// `n` hosts serving `lbt` on `port`, host `i` named `name(i)`.
///
/// # Errors
/// As [`Host::serving`].
pub fn serving_hosts(n: usize, port: u16, name: impl Fn(usize) -> String) -> Result<Vec<Host>> {
    (0..n).map(|i| Host::serving(port, &name(i))).collect()
}

/// `"ip:port", "ip:port"` of `hosts`, for a TOML array.
pub fn toml_addrs(hosts: &[Host], port: u16) -> String {
    hosts
        .iter()
        .map(|h| format!("\"{}\"", h.addr(port)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A network namespace for clients (its own loopback, reaching lb over a veth pair).
pub type ClientNs = Host;

/// A child cgroup of the cgroup v2 root, made for one test.
#[derive(Debug)]
pub struct TestCgroup {
    /// Its directory.
    pub path: PathBuf,
}

/// The cgroup v2 mount point from /proc/mounts.
///
/// # Errors
/// When there is none.
pub fn cgroup2_root() -> Result<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/mounts")?;
    mounts
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 2 && f[2] == "cgroup2").then(|| PathBuf::from(f[1]))
        })
        .context("no cgroup2 mount")
}

static NEXT_CG: AtomicU32 = AtomicU32::new(0);

impl TestCgroup {
    /// Create `lb-test-<pid>-<n>` under the cgroup v2 root.
    ///
    /// # Errors
    /// No cgroup v2 or mkdir failure.
    pub fn new() -> Result<TestCgroup> {
        let path = cgroup2_root()?.join(format!(
            "lb-test-{}-{}",
            std::process::id(),
            NEXT_CG.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).with_context(|| format!("mkdir {}", path.display()))?;
        Ok(TestCgroup { path })
    }

    /// A child cgroup of this one.
    ///
    /// # Errors
    /// mkdir failure.
    pub fn child(&self, name: &str) -> Result<TestCgroup> {
        let path = self.path.join(name);
        std::fs::create_dir_all(&path)?;
        Ok(TestCgroup { path })
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Processes still inside (a failed test's clients) are killed first.
        for _ in 0..50 {
            let procs = std::fs::read_to_string(self.path.join("cgroup.procs")).unwrap_or_default();
            let pids: Vec<i32> = procs
                .lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect();
            if pids.is_empty() {
                break;
            }
            for p in pids {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(p),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = std::fs::remove_dir(&self.path);
    }
}

static BIN_DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Use binaries from `dir` (e.g. `target/release`) instead of the test executable's directory.
pub fn set_bin_dir(dir: PathBuf) {
    let _ = BIN_DIR.set(dir);
}

/// Path of a binary: `$env`, else in the directory given to [`set_bin_dir`], else next to the
/// test executable (`target/<profile>/NAME`).
pub fn sibling_bin(name: &str, env: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(env) {
        return PathBuf::from(p);
    }
    if let Some(dir) = BIN_DIR.get() {
        return dir.join(name);
    }
    let exe = std::env::current_exe().unwrap_or_default();
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir.join(name)
}

/// The `lb` binary (`$LB_BIN` or next to the tests).
pub fn lb_bin() -> PathBuf {
    sibling_bin("lb", "LB_BIN")
}

/// The `lbt` binary (`$LBT_BIN` or next to the tests).
pub fn lbt_bin() -> PathBuf {
    sibling_bin("lbt", "LBT_BIN")
}

/// A free TCP port on 127.0.0.1 (bound and released).
///
/// # Errors
/// Bind failure.
pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A running `lb run`, killed (SIGTERM, then SIGKILL) on drop.
#[derive(Debug)]
pub struct Lb {
    child: Child,
    /// Admin address.
    pub admin: SocketAddr,
    /// Where its log goes.
    pub log: PathBuf,
}

impl Lb {
    /// Start `lb run` with `args` plus `--admin-listen` on a free port; waits until `/livez`
    /// answers 200 (or the process exits).
    ///
    /// # Errors
    /// When lb exits or does not answer within 15 s; the error carries its log.
    pub fn start(args: &[&str]) -> Result<Lb> {
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        let log = std::env::temp_dir().join(format!(
            "lb-test-{}-{}.log",
            std::process::id(),
            admin.port()
        ));
        let logf = std::fs::File::create(&log)?;
        let mut cmd = Command::new(lb_bin());
        cmd.arg("run")
            .args(args)
            .arg("--admin-listen")
            .arg(admin.to_string());
        cmd.env(
            "LB_LOG",
            std::env::var("LB_LOG").unwrap_or_else(|_| "info".into()),
        );
        let child = cmd
            .stdout(logf.try_clone()?)
            .stderr(logf)
            .spawn()
            .with_context(|| format!("spawning {}", lb_bin().display()))?;
        let mut lb = Lb { child, admin, log };
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Some(status) = lb.child.try_wait()? {
                bail!("lb exited with {status}: {}", lb.log_text());
            }
            if http_get(admin, "/livez").is_ok_and(|(code, _)| code == 200) {
                return Ok(lb);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("lb did not answer /livez within 15 s: {}", lb.log_text())
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
    }
}

/// Minimal HTTP/1.1 request on a fresh connection: (status, body).
///
/// # Errors
/// Connect/IO failure or an unparsable response.
pub fn http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<(u16, String)> {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(70)))?;
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let code: u16 = resp
        .split_whitespace()
        .nth(1)
        .context("no status")?
        .parse()?;
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((code, body))
}

/// GET shorthand.
///
/// # Errors
/// As [`http_request`].
pub fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    http_request(addr, "GET", path, None)
}

/// Where an `lbt client` runs.
#[derive(Clone, Debug, Default)]
pub struct Place<'a> {
    /// Inside this cgroup (so sockops sees its sockets).
    pub cgroup: Option<&'a Path>,
    /// Inside this network namespace.
    pub netns: Option<&'a str>,
}

impl<'a> Place<'a> {
    /// Inside cgroup `cg`, in lb's own network namespace.
    pub fn cgroup(cg: &'a Path) -> Place<'a> {
        Place {
            cgroup: Some(cg),
            netns: None,
        }
    }
}

/// Build the command for `lbt client --connect addr <action...>` placed as asked.
pub fn client_command(place: &Place<'_>, addr: SocketAddr, action: &[&str]) -> Command {
    let lbt = lbt_bin();
    // `ip netns exec` mounts a fresh /sys, hiding the cgroup tree: join the cgroup first, then
    // enter the namespace.
    let netns = place
        .netns
        .map(|ns| format!("ip netns exec {ns} "))
        .unwrap_or_default();
    let mut inner = format!("exec {netns}{} client --connect {addr}", lbt.display());
    for a in action {
        inner.push(' ');
        inner.push_str(a);
    }
    if let Some(cg) = place.cgroup {
        inner = format!("echo $$ > {}/cgroup.procs && {inner}", cg.display());
    }
    let mut cmd = Command::new("sh");
    cmd.args(["-c", &inner]);
    cmd.stdin(Stdio::null());
    cmd
}

/// Run `lbt client` to completion (bounded by `timeout`) and parse its last JSON line.
///
/// # Errors
/// Spawn failure, timeout (the client is killed) or no JSON output.
pub fn run_client(
    place: &Place<'_>,
    addr: SocketAddr,
    action: &[&str],
    timeout: Duration,
) -> Result<serde_json::Value> {
    let mut child = client_command(place, addr, action)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let deadline = Instant::now() + timeout;
    loop {
        if child.try_wait()?.is_some() {
            break;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("lbt client {action:?} did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let out = child.wait_with_output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.lines().last().with_context(|| {
        format!(
            "lbt client printed nothing; stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    serde_json::from_str(last).with_context(|| {
        format!(
            "lbt output {last:?}; stderr {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// A long-running `lbt client ... hold`, whose events are read line by line.
#[derive(Debug)]
pub struct Holder {
    child: Child,
    rx: std::sync::mpsc::Receiver<serde_json::Value>,
}

impl Holder {
    /// Start `hold --reconnect N --max-ms M`.
    ///
    /// # Errors
    /// Spawn failure.
    pub fn start(
        place: &Place<'_>,
        addr: SocketAddr,
        reconnect: u32,
        max_ms: u64,
    ) -> Result<Holder> {
        let r = reconnect.to_string();
        let m = max_ms.to_string();
        let mut child = client_command(place, addr, &["hold", "--reconnect", &r, "--max-ms", &m])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let out = child.stdout.take().context("stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str(&line)
                    && tx.send(v).is_err()
                {
                    return;
                }
            }
        });
        Ok(Holder { child, rx })
    }

    /// Next event within `timeout`.
    ///
    /// # Errors
    /// No event in time.
    pub fn next(&self, timeout: Duration) -> Result<serde_json::Value> {
        self.rx
            .recv_timeout(timeout)
            .context("no event from the holding client")
    }

    /// Wait for an event whose `event` field is `kind`, skipping others.
    ///
    /// # Errors
    /// None within `timeout`.
    pub fn wait_for(&self, kind: &str, timeout: Duration) -> Result<serde_json::Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let ev = self.next(left)?;
            if ev["event"] == kind {
                return Ok(ev);
            }
        }
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_ignores_chunking() {
        let mut src = PatternStream::new(5);
        let mut data = vec![0u8; 100_003];
        src.fill(&mut data);
        let mut a = Digest::default();
        a.update(&data);
        let mut b = Digest::default();
        for c in data.chunks(7) {
            b.update(c);
        }
        assert_eq!(a.finish(), b.finish());
        assert_eq!(a.count(), 100_003);
        let mut c = Digest::default();
        data[500] ^= 1;
        c.update(&data);
        assert_ne!(a.finish(), c.finish());
    }

    #[test]
    fn kernel_releases() {
        assert_eq!(parse_kernel_release("6.1.0-57-amd64\n"), Some((6, 1)));
        assert_eq!(parse_kernel_release("6.12.117+deb12-amd64"), Some((6, 12)));
        assert_eq!(parse_kernel_release("6.18.44-fc-v669"), Some((6, 18)));
        assert_eq!(parse_kernel_release("garbage"), None);
        assert!((6, 1) < (6, 5) && (6, 12) >= (6, 5));
    }

    #[test]
    fn pattern_ignores_chunking() {
        let mut a = PatternStream::new(9);
        let mut whole = vec![0u8; 1000];
        a.fill(&mut whole);
        let mut b = PatternStream::new(9);
        let mut parts = vec![0u8; 1000];
        for c in parts.chunks_mut(13) {
            b.fill(c);
        }
        assert_eq!(whole, parts);
    }
}
