//! Test hosts: network namespaces reached over veth pairs, each in its own /24 of
//! 198.18.0.0/15, serving `lbt`; blackholing one.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};

use crate::cmd::{lbt_bin, sh};

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
    /// Addresses added with [`Host::add_address`], in order (`.3`, `.4`, ...).
    pub extra: Vec<Ipv4Addr>,
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
                extra: Vec::new(),
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

    /// Give the host one more address of its /24 (`.3`, then `.4`, ...) on its side of the
    /// veth pair, and return it. The root namespace reaches it like the first one (its route
    /// for the /24 points at the veth, and the host answers ARP for every address it owns), and
    /// processes inside the host reach each other on these addresses without leaving the
    /// namespace, so nothing is forwarded and no global setting changes. The root side's
    /// neighbour entries are per address, so [`Host::blackhole_addr`] cuts one of them alone.
    ///
    /// # Errors
    /// `ip` failure, or the /24 is full.
    pub fn add_address(&mut self) -> Result<Ipv4Addr> {
        let last = self.extra.last().copied().unwrap_or(self.ip).octets()[3];
        if last >= 254 {
            bail!("no address left in the /24 of {}", self.ip);
        }
        let o = self.ip.octets();
        let ip = Ipv4Addr::new(o[0], o[1], o[2], last + 1);
        self.exec_ok(
            "ip",
            &[
                "addr",
                "add",
                &format!("{ip}/24"),
                "dev",
                &format!("{}p", self.veth),
            ],
        )?;
        self.extra.push(ip);
        Ok(ip)
    }

    /// A command that runs `program args` inside the namespace (`ip netns exec`, which execs
    /// it: the child's pid is the program's).
    pub fn command(&self, program: &str, args: &[&str]) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns, program]).args(args);
        cmd
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
        self.serve_on(self.addr(port), name)
    }

    /// Start `lbt serve` on `addr` inside the namespace (e.g. its own `127.0.0.1:P`, as a
    /// pod's server), named `name`; waits until it listens.
    ///
    /// # Errors
    /// As [`Host::serve`].
    pub fn serve_on(&mut self, addr: SocketAddr, name: &str) -> Result<()> {
        let addr = addr.to_string();
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
        let ready = crate::first_stdout_line(&mut child, Duration::from_secs(10));
        self.servers.push(child);
        if ready.trim() != "ready" {
            bail!("lbt serve on {addr} did not start");
        }
        Ok(())
    }

    /// A TCP listener on `port` of this host, bound inside its namespace by a thread that
    /// enters the namespace for the bind alone (a namespace is per thread; the socket stays in
    /// it), for a server a test writes itself with std sockets.
    ///
    /// # Errors
    /// The namespace cannot be entered or the port not bound.
    pub fn listen(&self, port: u16) -> Result<std::net::TcpListener> {
        let (ns, addr) = (self.ns.clone(), self.addr(port));
        std::thread::spawn(move || -> Result<std::net::TcpListener> {
            let f = std::fs::File::open(format!("/run/netns/{ns}"))
                .with_context(|| format!("opening /run/netns/{ns}"))?;
            nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET)
                .with_context(|| format!("entering network namespace {ns}"))?;
            std::net::TcpListener::bind(addr).with_context(|| format!("binding {addr} in {ns}"))
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the thread binding {addr} panicked"))?
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
        self.blackhole_addr(self.ip, on)
    }

    /// As [`Host::blackhole`], for one of the host's addresses only (its first one or one from
    /// [`Host::add_address`]); the others stay reachable.
    ///
    /// # Errors
    /// `ip` failure.
    pub fn blackhole_addr(&self, ip: Ipv4Addr, on: bool) -> Result<()> {
        let ip = ip.to_string();
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
