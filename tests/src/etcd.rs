//! An etcd cluster on a test host, each member with a K3s/RKE2 supervisor stand-in beside it,
//! and `etcdctl` runs against any endpoint (a member, or lb's listener).
//!
//! How the members are networked: all of them live in one test host (one network namespace),
//! each on its own address of the host's /24 (`.2`, `.3`, `.4`, ... added to the host's side of
//! its veth pair, [`Host::add_address`]). Members reach each other inside the namespace, so no
//! packet is forwarded anywhere and no global setting (such as the root namespace's
//! `ip_forward`) changes; lb in the root namespace reaches each member's own address over the
//! veth, as it reaches any test host. Each member is its own `etcd` process (and its supervisor
//! its own `lbt supervisor`), so each can be stopped and started alone, and the root side's
//! neighbour entries are per address, so [`Host::blackhole_addr`] hides one member from lb.
//! What this cannot do is cut the members off from each other (a partition inside the cluster).
//!
//! Debian's etcd 3.4 (`etcd`, `etcdctl`, installed by `cargo xtask setup`); data directories live
//! in a [`TempDir`] removed on drop, every process is killed on drop, also when a test fails.

use std::{
    io::{BufRead as _, BufReader, Read as _},
    net::{Ipv4Addr, SocketAddr},
    path::Path,
    process::{Child, Command, Output, Stdio},
    sync::{Arc, Mutex, mpsc},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};

use crate::{
    client::{Place, placed_command},
    cmd::{lbt_bin, output_within},
    host::Host,
    tmp::TempDir,
};

/// Port of every member's client URL (`http://IP:2379`).
pub const ETCD_CLIENT_PORT: u16 = 2379;
/// Port of every member's peer URL (`http://IP:2380`).
pub const ETCD_PEER_PORT: u16 = 2380;
/// Port of the supervisor beside every member (`GET /ping` answers 200 `pong`).
pub const SUPERVISOR_PORT: u16 = 9345;

/// How long a cluster (or a member added to it) may take to report healthy.
const HEALTHY_WITHIN: Duration = Duration::from_secs(30);

/// Proxy settings that would send a gRPC or HTTP client anywhere but where it is told.
const PROXY_VARS: &[&str] = &[
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "no_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
    "grpc_proxy",
];

/// One member of an [`EtcdCluster`]: an `etcd` process and a supervisor beside it.
#[derive(Debug)]
pub struct EtcdMember {
    /// Member name (`m1`, `m2`, ...).
    pub name: String,
    /// Its own address on the cluster's test host.
    pub ip: Ipv4Addr,
    etcd: Option<Child>,
    supervisor: Option<Child>,
    /// The flags it was first started with; a restart reuses them (an existing data dir makes
    /// etcd ignore the initial-cluster ones).
    args: Vec<String>,
    removed: bool,
}

impl EtcdMember {
    /// `IP:2379`.
    pub fn client_addr(&self) -> SocketAddr {
        SocketAddr::from((self.ip, ETCD_CLIENT_PORT))
    }

    /// `http://IP:2379`, the member's client URL.
    pub fn client_url(&self) -> String {
        format!("http://{}", self.client_addr())
    }

    /// `http://IP:2380`, the member's peer URL.
    pub fn peer_url(&self) -> String {
        format!("http://{}:{ETCD_PEER_PORT}", self.ip)
    }

    /// `IP:9345`, where its supervisor listens.
    pub fn supervisor_addr(&self) -> SocketAddr {
        SocketAddr::from((self.ip, SUPERVISOR_PORT))
    }

    /// Whether its `etcd` process runs (started and not stopped or removed).
    pub fn is_running(&self) -> bool {
        self.etcd.is_some()
    }

    /// Whether it was removed from the cluster ([`EtcdCluster::member_remove`]).
    pub fn is_removed(&self) -> bool {
        self.removed
    }
}

/// A member as `etcdctl member list` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberInfo {
    /// Member id.
    pub id: u64,
    /// Name (empty while an added member has not started).
    pub name: String,
    /// Peer URLs.
    pub peer_urls: Vec<String>,
    /// Client URLs (empty while an added member has not started).
    pub client_urls: Vec<String>,
}

/// An etcd cluster on one test host, one address per member (see the module doc for why),
/// each member with a supervisor on `IP:9345`. Everything stops and is removed on drop.
#[derive(Debug)]
pub struct EtcdCluster {
    members: Vec<EtcdMember>,
    dir: TempDir,
    token: String,
    /// The test host every member lives on.
    pub host: Host,
}

impl EtcdCluster {
    /// Start `n` members (`m1` on the host's first address, `m2` on the next, ...) and their
    /// supervisors, and wait until every member reports healthy (bounded: 30 s).
    ///
    /// # Errors
    /// etcd missing (run `cargo xtask setup`), a process not starting, or the cluster not
    /// healthy in time (the error carries the members' logs).
    pub fn start(n: usize) -> Result<EtcdCluster> {
        ensure!((1..=9).contains(&n), "1 to 9 members, not {n}");
        for bin in ["etcd", "etcdctl"] {
            ensure!(
                Command::new("sh")
                    .args(["-c", &format!("command -v {bin}")])
                    .output()
                    .is_ok_and(|o| o.status.success()),
                "{bin} is not installed: run `cargo xtask setup` (Debian etcd-server, etcd-client)"
            );
        }
        let mut host = Host::new()?;
        let dir = TempDir::new("lb-etcd")?;
        let token = dir
            .path()
            .file_name()
            .map_or_else(|| "lb-etcd".into(), |n| n.to_string_lossy().into_owned());
        let mut ips = vec![host.ip];
        for _ in 1..n {
            ips.push(host.add_address()?);
        }
        let initial: Vec<String> = ips
            .iter()
            .enumerate()
            .map(|(i, ip)| format!("m{}=http://{ip}:{ETCD_PEER_PORT}", i + 1))
            .collect();
        let mut cluster = EtcdCluster {
            members: Vec::new(),
            dir,
            token,
            host,
        };
        for (i, ip) in ips.into_iter().enumerate() {
            let name = format!("m{}", i + 1);
            let args = cluster.etcd_args(&name, ip, &initial.join(","), "new");
            cluster.members.push(EtcdMember {
                name,
                ip,
                etcd: None,
                supervisor: None,
                args,
                removed: false,
            });
        }
        for i in 0..n {
            cluster.spawn_etcd(i)?;
            cluster.spawn_supervisor(i)?;
        }
        cluster.wait_healthy(HEALTHY_WITHIN)?;
        Ok(cluster)
    }

    fn etcd_args(&self, name: &str, ip: Ipv4Addr, initial: &str, state: &str) -> Vec<String> {
        let client = format!("http://{ip}:{ETCD_CLIENT_PORT}");
        let peer = format!("http://{ip}:{ETCD_PEER_PORT}");
        [
            "--name",
            name,
            "--data-dir",
            &self.dir.join(&format!("{name}.etcd")).to_string_lossy(),
            "--listen-client-urls",
            &client,
            "--advertise-client-urls",
            &client,
            "--listen-peer-urls",
            &peer,
            "--initial-advertise-peer-urls",
            &peer,
            "--initial-cluster",
            initial,
            "--initial-cluster-state",
            state,
            "--initial-cluster-token",
            &self.token,
            "--logger",
            "zap",
            "--log-outputs",
            "stderr",
        ]
        .iter()
        .map(|s| (*s).to_string())
        .collect()
    }

    fn index(&self, name: &str) -> Result<usize> {
        self.members
            .iter()
            .position(|m| m.name == name)
            .with_context(|| format!("no member {name}"))
    }

    fn spawn_etcd(&mut self, i: usize) -> Result<()> {
        let m = &self.members[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(&format!("{}.log", m.name)))?;
        let args: Vec<&str> = m.args.iter().map(String::as_str).collect();
        let mut cmd = self.host.command("etcd", &args);
        for v in PROXY_VARS {
            cmd.env_remove(v);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("spawning etcd {}", m.name))?;
        self.members[i].etcd = Some(child);
        Ok(())
    }

    fn spawn_supervisor(&mut self, i: usize) -> Result<()> {
        let addr = self.members[i].supervisor_addr().to_string();
        let lbt = lbt_bin();
        let mut cmd = self.host.command(
            lbt.to_str().unwrap_or("lbt"),
            &["supervisor", "--listen", &addr],
        );
        let child = spawn_ready(&mut cmd, &format!("lbt supervisor on {addr}"))?;
        self.members[i].supervisor = Some(child);
        Ok(())
    }

    /// Every member, removed ones included, in the order they were made.
    pub fn members(&self) -> &[EtcdMember] {
        &self.members
    }

    /// The member called `name`.
    ///
    /// # Errors
    /// No such member.
    pub fn member(&self, name: &str) -> Result<&EtcdMember> {
        Ok(&self.members[self.index(name)?])
    }

    /// The member whose client address is `addr` (`IP:2379`, as lb names a server).
    ///
    /// # Errors
    /// No such member.
    pub fn member_at(&self, addr: &str) -> Result<&EtcdMember> {
        self.members
            .iter()
            .find(|m| m.client_addr().to_string() == addr)
            .with_context(|| format!("no member at {addr}"))
    }

    /// Client addresses (`IP:2379`) of the members not removed.
    pub fn client_addrs(&self) -> Vec<SocketAddr> {
        self.members
            .iter()
            .filter(|m| !m.removed)
            .map(EtcdMember::client_addr)
            .collect()
    }

    /// `--endpoints` value naming every running member (`http://IP:2379,...`).
    pub fn endpoints(&self) -> String {
        self.members
            .iter()
            .filter(|m| m.is_running())
            .map(EtcdMember::client_url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// What member `name`'s etcd has logged so far.
    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join(&format!("{name}.log"))).unwrap_or_default()
    }

    /// The last `lines` lines of every member's log, for an error message.
    pub fn logs_tail(&self, lines: usize) -> String {
        let mut out = String::new();
        for m in &self.members {
            let log = self.log(&m.name);
            let all: Vec<&str> = log.lines().collect();
            out.push_str(&format!("--- {} ({}) ---\n", m.name, m.ip));
            for l in &all[all.len().saturating_sub(lines)..] {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }

    /// Wait until every running member answers `etcdctl endpoint health` (each try bounded).
    ///
    /// # Errors
    /// Not healthy within `timeout`; the error carries the members' logs.
    pub fn wait_healthy(&self, timeout: Duration) -> Result<Duration> {
        let start = Instant::now();
        let mut last = String::new();
        while start.elapsed() < timeout {
            match etcdctl_output(
                &Place::default(),
                &self.endpoints(),
                &["endpoint", "health"],
                Duration::from_secs(5),
            ) {
                Ok(out) if out.status.success() => return Ok(start.elapsed()),
                Ok(out) => {
                    last = format!(
                        "{}{}",
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
                Err(e) => last = format!("{e:#}"),
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        bail!(
            "etcd cluster not healthy within {timeout:?}: {last}\n{}",
            self.logs_tail(20)
        )
    }

    /// Stop member `name`'s etcd (SIGTERM, SIGKILL after 5 s); its supervisor keeps running.
    ///
    /// # Errors
    /// No such member.
    pub fn stop_member(&mut self, name: &str) -> Result<()> {
        let i = self.index(name)?;
        if let Some(child) = self.members[i].etcd.take() {
            stop_child(child, Duration::from_secs(5));
        }
        Ok(())
    }

    /// Start member `name`'s etcd again on its data dir (it rejoins the cluster); does not wait
    /// for it to be healthy ([`EtcdCluster::wait_healthy`]).
    ///
    /// # Errors
    /// No such member, a removed member, or a spawn failure.
    pub fn start_member(&mut self, name: &str) -> Result<()> {
        let i = self.index(name)?;
        ensure!(!self.members[i].removed, "member {name} was removed");
        if self.members[i].etcd.is_none() {
            self.spawn_etcd(i)?;
        }
        Ok(())
    }

    /// Stop member `name`'s supervisor only (its `IP:9345` refuses connections from now on);
    /// its etcd keeps serving.
    ///
    /// # Errors
    /// No such member.
    pub fn stop_supervisor(&mut self, name: &str) -> Result<()> {
        let i = self.index(name)?;
        if let Some(mut child) = self.members[i].supervisor.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        Ok(())
    }

    /// Start member `name`'s supervisor again; returns once it listens.
    ///
    /// # Errors
    /// No such member, or it did not start within 10 s.
    pub fn start_supervisor(&mut self, name: &str) -> Result<()> {
        let i = self.index(name)?;
        if self.members[i].supervisor.is_none() {
            self.spawn_supervisor(i)?;
        }
        Ok(())
    }

    /// The cluster's members as `etcdctl member list` reports them (asked of the running
    /// members).
    ///
    /// # Errors
    /// etcdctl failure or unparsable output.
    pub fn member_list(&self) -> Result<Vec<MemberInfo>> {
        let out = etcdctl(
            &Place::default(),
            &self.endpoints(),
            &["member", "list", "--write-out", "json"],
            Duration::from_secs(10),
        )?;
        parse_member_list(&out)
    }

    /// The id etcd gave member `name`.
    ///
    /// # Errors
    /// etcdctl failure, or no member of that name in the list.
    pub fn member_id(&self, name: &str) -> Result<u64> {
        self.member_list()?
            .into_iter()
            .find(|m| m.name == name)
            .map(|m| m.id)
            .with_context(|| format!("no member {name} in the member list"))
    }

    /// Remove member `name` from the cluster (`etcdctl member remove`, asked of the other
    /// running members); its etcd then stops by itself (killed if still running after 10 s),
    /// its supervisor is stopped, and this returns once the remaining members are healthy (a
    /// new leader elected when it was the leader).
    ///
    /// # Errors
    /// etcdctl failure, or the rest not healthy within 30 s.
    pub fn member_remove(&mut self, name: &str) -> Result<()> {
        let i = self.index(name)?;
        let id = self.member_id(name)?;
        let others: Vec<String> = self
            .members
            .iter()
            .filter(|m| m.name != name && m.is_running())
            .map(EtcdMember::client_url)
            .collect();
        ensure!(!others.is_empty(), "no other running member to ask");
        reconfigure(
            &others.join(","),
            &["member", "remove", &format!("{id:x}")],
            || Ok(self.member_list()?.iter().all(|m| m.id != id)),
        )?;
        self.members[i].removed = true;
        if let Some(child) = self.members[i].etcd.take() {
            wait_or_kill(child, Duration::from_secs(10));
        }
        self.stop_supervisor(name)?;
        // Removing the leader makes the others elect a new one: wait for it, so the next
        // request does not time out.
        self.wait_healthy(HEALTHY_WITHIN)?;
        Ok(())
    }

    /// Add a member: a new address on the host, `etcdctl member add`, then start it (and its
    /// supervisor) with the cluster's current members as its initial cluster, and wait until
    /// every running member is healthy. Returns its name.
    ///
    /// # Errors
    /// No address left, etcdctl failure, or not healthy within 30 s.
    pub fn member_add(&mut self) -> Result<String> {
        let name = format!("m{}", self.members.len() + 1);
        let ip = self.host.add_address()?;
        let peer = format!("http://{ip}:{ETCD_PEER_PORT}");
        reconfigure(
            &self.endpoints(),
            &["member", "add", &name, "--peer-urls", &peer],
            || {
                Ok(self
                    .member_list()?
                    .iter()
                    .any(|m| m.peer_urls.contains(&peer)))
            },
        )?;
        let mut initial: Vec<String> = self
            .members
            .iter()
            .filter(|m| !m.removed)
            .map(|m| format!("{}={}", m.name, m.peer_url()))
            .collect();
        initial.push(format!("{name}={peer}"));
        let args = self.etcd_args(&name, ip, &initial.join(","), "existing");
        self.members.push(EtcdMember {
            name: name.clone(),
            ip,
            etcd: None,
            supervisor: None,
            args,
            removed: false,
        });
        let i = self.members.len() - 1;
        self.spawn_etcd(i)?;
        self.spawn_supervisor(i)?;
        self.wait_healthy(HEALTHY_WITHIN)?;
        Ok(name)
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for m in &mut self.members {
            for child in [m.supervisor.take(), m.etcd.take()].into_iter().flatten() {
                let mut child = child;
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// A membership change (`etcdctl member add|remove`), asked again every 500 ms for up to 30 s
/// while etcd answers with a passing condition: "unhealthy cluster" (its strict reconfiguration
/// check, left on as in production, refuses a change until every member has been connected to
/// its peers for 5 s, so a fresh cluster refuses at first), or a timeout or a leader change
/// (after removing the leader). A change that timed out may still have been applied, so before
/// asking again `applied` looks at the member list: when it says the change is there, done.
fn reconfigure(endpoints: &str, args: &[&str], applied: impl Fn() -> Result<bool>) -> Result<()> {
    let start = Instant::now();
    loop {
        let err = match etcdctl(&Place::default(), endpoints, args, Duration::from_secs(10)) {
            Ok(_) => return Ok(()),
            Err(e) => e,
        };
        let text = format!("{err:#}");
        let passing = [
            "unhealthy cluster",
            "timed out",
            "leader",
            "deadline exceeded",
        ]
        .iter()
        .any(|p| text.contains(p));
        if !passing || start.elapsed() > Duration::from_secs(30) {
            return Err(err);
        }
        std::thread::sleep(Duration::from_millis(500));
        if applied().unwrap_or(false) {
            return Ok(());
        }
    }
}

/// Parse `etcdctl member list --write-out json`.
fn parse_member_list(json: &str) -> Result<Vec<MemberInfo>> {
    let v: serde_json::Value =
        serde_json::from_str(json).with_context(|| format!("member list output {json:?}"))?;
    let strings = |m: &serde_json::Value, key: &str| -> Vec<String> {
        m[key]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    };
    v["members"]
        .as_array()
        .with_context(|| format!("no members in {json}"))?
        .iter()
        .map(|m| {
            Ok(MemberInfo {
                id: m["ID"].as_u64().with_context(|| format!("no ID in {m}"))?,
                name: m["name"].as_str().unwrap_or("").to_string(),
                peer_urls: strings(m, "peerURLs"),
                client_urls: strings(m, "clientURLs"),
            })
        })
        .collect()
}

/// Spawn `cmd` with stdout piped and wait (10 s at most) for its first line to be `ready`.
fn spawn_ready(cmd: &mut Command, what: &str) -> Result<Child> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("spawning {what}"))?;
    let ready = crate::first_stdout_line(&mut child, Duration::from_secs(10));
    if ready.trim() != "ready" {
        let _ = child.kill();
        let _ = child.wait();
        bail!("{what} did not start");
    }
    Ok(child)
}

/// SIGTERM, then SIGKILL when `child` still runs after `grace`.
fn stop_child(child: Child, grace: Duration) {
    if let Ok(pid) = i32::try_from(child.id()) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
    wait_or_kill(child, grace);
}

/// Wait up to `limit` for `child` to exit, then kill it.
fn wait_or_kill(mut child: Child, limit: Duration) {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The `etcdctl` command line: `--endpoints` and the global timeouts, then `args`, placed as
/// asked, with no proxy from the environment.
fn etcdctl_command(place: &Place<'_>, endpoints: &str, args: &[&str]) -> Command {
    let mut all = vec![
        "--endpoints",
        endpoints,
        "--dial-timeout",
        "2s",
        "--command-timeout",
        "5s",
    ];
    all.extend_from_slice(args);
    let mut cmd = placed_command(place, Path::new("etcdctl"), &all);
    cmd.env("ETCDCTL_API", "3");
    for v in PROXY_VARS {
        cmd.env_remove(v);
    }
    cmd
}

/// Run `etcdctl --endpoints ENDPOINTS ARGS` (`--dial-timeout 2s --command-timeout 5s`) where
/// `place` says, killed after `timeout`; returns what it printed whether it succeeded or not.
/// `endpoints` is anything etcdctl takes: `http://IP:2379,...`, or lb's `127.0.0.1:PORT`.
///
/// # Errors
/// Spawn failure or the timeout.
pub fn etcdctl_output(
    place: &Place<'_>,
    endpoints: &str,
    args: &[&str],
    timeout: Duration,
) -> Result<Output> {
    output_within(etcdctl_command(place, endpoints, args), timeout)
}

/// As [`etcdctl_output`], and fail unless etcdctl exits 0; returns its stdout.
///
/// # Errors
/// Spawn failure, the timeout, or a non-zero exit (the error carries its stderr).
pub fn etcdctl(
    place: &Place<'_>,
    endpoints: &str,
    args: &[&str],
    timeout: Duration,
) -> Result<String> {
    let out = etcdctl_output(place, endpoints, args, timeout)?;
    ensure!(
        out.status.success(),
        "etcdctl --endpoints {endpoints} {}: {}: {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// One event of an [`EtcdWatch`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchEvent {
    /// `PUT` or `DELETE`.
    pub kind: String,
    /// The key.
    pub key: String,
    /// The value (empty for `DELETE`).
    pub value: String,
}

/// A long-running `etcdctl watch --prefix PREFIX` whose output is read line by line (etcdctl's
/// simple format: three lines per event, type, key, value); killed on drop.
#[derive(Debug)]
pub struct EtcdWatch {
    child: Child,
    lines: mpsc::Receiver<String>,
    stderr: Arc<Mutex<String>>,
}

impl EtcdWatch {
    /// Start `etcdctl --endpoints ENDPOINTS watch --prefix PREFIX` where `place` says. It has
    /// no command timeout: it runs until dropped, and etcdctl reconnects and resumes the watch
    /// by itself when its connection breaks.
    ///
    /// # Errors
    /// Spawn failure.
    pub fn start(place: &Place<'_>, endpoints: &str, prefix: &str) -> Result<EtcdWatch> {
        let mut child = etcdctl_command(place, endpoints, &["watch", "--prefix", prefix])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("spawning etcdctl watch")?;
        let out = child.stdout.take().context("stdout")?;
        let mut err = child.stderr.take().context("stderr")?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = Arc::clone(&stderr);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    return;
                }
                if let Ok(mut s) = sink.lock() {
                    s.push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            }
        });
        Ok(EtcdWatch {
            child,
            lines,
            stderr,
        })
    }

    /// Process id of the etcdctl.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the etcdctl has exited.
    pub fn exited(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }

    /// The next line it printed, waiting up to `timeout`.
    ///
    /// # Errors
    /// No line in time (or the etcdctl exited).
    pub fn next_line(&self, timeout: Duration) -> Result<String> {
        self.lines.recv_timeout(timeout).with_context(|| {
            format!(
                "no output from etcdctl watch within {timeout:?}; its stderr: {}",
                self.stderr()
            )
        })
    }

    /// The next event (three lines), waiting up to `timeout` for each line.
    ///
    /// # Errors
    /// As [`EtcdWatch::next_line`], or a first line that is not `PUT` or `DELETE`.
    pub fn next_event(&self, timeout: Duration) -> Result<WatchEvent> {
        let kind = self.next_line(timeout)?;
        ensure!(
            kind == "PUT" || kind == "DELETE",
            "unexpected watch output {kind:?}; stderr: {}",
            self.stderr()
        );
        let key = self.next_line(timeout)?;
        let value = self.next_line(timeout)?;
        Ok(WatchEvent { kind, key, value })
    }

    /// What it wrote on stderr so far (etcdctl logs its reconnections there).
    pub fn stderr(&self) -> String {
        self.stderr.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

impl Drop for EtcdWatch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_list_json() -> Result<()> {
        // As etcdctl 3.4 prints it (ids are uint64 and may pass i64's range).
        let json = r#"{"header":{"cluster_id":1,"member_id":2,"raft_term":3},"members":[
            {"ID":17237436991929493444,"name":"m1","peerURLs":["http://198.18.0.2:2380"],
             "clientURLs":["http://198.18.0.2:2379"]},
            {"ID":5,"peerURLs":["http://198.18.0.4:2380"]}]}"#;
        let list = parse_member_list(json)?;
        assert_eq!(list.len(), 2);
        assert_eq!(list[0].id, 17_237_436_991_929_493_444);
        assert_eq!(list[0].name, "m1");
        assert_eq!(list[0].client_urls, vec!["http://198.18.0.2:2379"]);
        assert_eq!(list[1].name, "");
        assert!(list[1].client_urls.is_empty());
        Ok(())
    }
}
