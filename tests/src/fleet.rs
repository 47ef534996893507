//! The K3s/RKE2 layouts of `deploy/` on test hosts: a test CA with server certificates naming a
//! host's address and 127.0.0.1 (as K3s's do, whose agents reach the servers through a balancer
//! on 127.0.0.1), TLS supervisor stand-ins (`lbt supervisor --cert`), and a layout file read from
//! the repository with the node's addresses, ports and paths replaced by the test's.

use std::{
    net::Ipv4Addr,
    path::PathBuf,
    process::{Child, Stdio},
    time::Duration,
};

use anyhow::{Context as _, Result, bail, ensure};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};

use crate::{Host, TempDir, cmd::lbt_bin, free_port, repo_file};

/// The documentation addresses the shipped layouts name as their servers, in order.
pub const LAYOUT_SERVERS: [&str; 3] = ["192.0.2.11", "192.0.2.12", "192.0.2.13"];

/// A test CA and the server certificates it signs, as PEM files in a directory removed on drop.
pub struct TestPki {
    dir: TempDir,
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl TestPki {
    /// A fresh CA, written to `ca.pem`.
    ///
    /// # Errors
    /// Key generation or file writes.
    pub fn new() -> Result<TestPki> {
        let dir = TempDir::new("lb-fleet-pki")?;
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name
            .push(DnType::CommonName, "lb test cluster CA");
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = CertifiedIssuer::self_signed(p, KeyPair::generate()?)?;
        std::fs::write(dir.join("ca.pem"), ca.pem())?;
        Ok(TestPki { dir, ca })
    }

    /// The CA's PEM file.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// A server certificate for `ip` and 127.0.0.1, written to `<name>.pem` and `<name>.key`;
    /// returns their paths.
    ///
    /// # Errors
    /// Signing or file writes.
    pub fn server_cert(&self, name: &str, ip: Ipv4Addr) -> Result<(PathBuf, PathBuf)> {
        let key = KeyPair::generate()?;
        let mut p = CertificateParams::new(vec![ip.to_string(), "127.0.0.1".to_string()])?;
        p.distinguished_name.push(DnType::CommonName, name);
        let cert = p.signed_by(&key, &self.ca)?;
        let (c, k) = (
            self.dir.join(&format!("{name}.pem")),
            self.dir.join(&format!("{name}.key")),
        );
        std::fs::write(&c, cert.pem())?;
        std::fs::write(&k, key.serialize_pem())?;
        Ok((c, k))
    }
}

/// An `lbt supervisor` over TLS on a test host (`GET /ping` → 200 `pong`), killed on drop.
#[derive(Debug)]
pub struct Supervisor {
    child: Option<Child>,
    /// Where it listens.
    pub addr: std::net::SocketAddr,
}

impl Supervisor {
    /// Start one on `host`'s `port` with a certificate of `pki` for the host's address; returns
    /// once it listens.
    ///
    /// # Errors
    /// Spawn failure, or no `ready` line within 10 s.
    pub fn start(host: &Host, port: u16, pki: &TestPki) -> Result<Supervisor> {
        let addr = host.addr(port);
        let (cert, key) = pki.server_cert(&format!("{}-{port}", host.ip), host.ip)?;
        let args = [
            "supervisor".to_string(),
            "--listen".into(),
            addr.to_string(),
            "--cert".into(),
            cert.display().to_string(),
            "--key".into(),
            key.display().to_string(),
        ];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut child = host
            .command(lbt_bin().to_str().unwrap_or("lbt"), &args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("spawning lbt supervisor")?;
        let ready = crate::first_stdout_line(&mut child, Duration::from_secs(10));
        let mut sup = Supervisor {
            child: Some(child),
            addr,
        };
        if ready.trim() != "ready" {
            sup.stop();
            bail!("lbt supervisor on {addr} did not start");
        }
        Ok(sup)
    }

    /// Kill it: its port refuses connections from now on.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A shipped layout file with the test's addresses: servers on the test hosts, listeners on
/// free loopback ports, state files in a temp directory.
#[derive(Debug)]
pub struct Layout {
    /// The config text lb runs.
    pub text: String,
    /// Every balancer with its listener as the file has it and the test's port instead.
    pub listeners: Vec<(String, String, u16)>,
    /// The written file.
    pub file: PathBuf,
}

/// Read `deploy/<rel>` and replace the node's addresses with the test's: the server
/// [`LAYOUT_SERVERS`] with `hosts`' addresses (same ports), each `127.0.0.1` listener with a free
/// port, `/var/lib/lb/` with `dir`; `replace` pairs then apply in order, each of which must
/// match. Writes the result to `dir`.
///
/// # Errors
/// A missing file, a layout without the expected servers, or a `replace` that matches nothing.
pub fn layout(
    rel: &str,
    hosts: &[Host],
    dir: &TempDir,
    replace: &[(&str, &str)],
) -> Result<Layout> {
    layout_from(
        rel,
        repo_file(&format!("deploy/{rel}"))?,
        hosts,
        dir,
        replace,
    )
}

/// [`layout`] of a config `text` (e.g. a ConfigMap's entry) named `rel`.
///
/// # Errors
/// As [`layout`].
pub fn layout_from(
    rel: &str,
    mut text: String,
    hosts: &[Host],
    dir: &TempDir,
    replace: &[(&str, &str)],
) -> Result<Layout> {
    for (doc, host) in LAYOUT_SERVERS.iter().zip(hosts) {
        ensure!(text.contains(doc), "{rel} names no server {doc}");
        text = text.replace(doc, &host.ip.to_string());
    }
    text = text.replace("/var/lib/lb/", &format!("{}/", dir.path().display()));
    let mut listeners = Vec::new();
    let mut name = String::new();
    let mut out = String::new();
    for line in text.lines() {
        if let Some(n) = line.strip_prefix("name = ") {
            name = n.trim_matches('"').to_string();
        }
        let listen = line
            .strip_prefix("listen = [\"127.0.0.1:")
            .and_then(|r| r.strip_suffix("\"]"));
        match listen {
            Some(port) if !name.is_empty() => {
                let test = free_port()?;
                listeners.push((name.clone(), format!("127.0.0.1:{port}"), test));
                out.push_str(&format!("listen = [\"127.0.0.1:{test}\"]\n"));
            }
            _ => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    for (from, to) in replace {
        ensure!(out.contains(from), "{rel} has no `{from}`");
        out = out.replace(from, to);
    }
    let file = dir.join(&rel.replace('/', "-"));
    std::fs::write(&file, &out)?;
    Ok(Layout {
        text: out,
        listeners,
        file,
    })
}

impl Layout {
    /// The test port of balancer `name`'s listener.
    ///
    /// # Errors
    /// No such balancer.
    pub fn port(&self, name: &str) -> Result<u16> {
        self.listeners
            .iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, _, p)| *p)
            .with_context(|| format!("no balancer {name} in {:?}", self.listeners))
    }
}

/// `curl` a TLS `GET /ping` at `127.0.0.1:port` verifying the server against `ca` (the name
/// checked is 127.0.0.1, as a K3s agent checks its local balancer's); the body.
///
/// # Errors
/// curl failing or timing out (5 s).
pub fn https_ping(port: u16, ca: &std::path::Path) -> Result<String> {
    let url = format!("https://127.0.0.1:{port}/ping");
    let out = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "5", "--cacert"])
        .arg(ca)
        .arg(&url)
        .output()
        .context("running curl")?;
    ensure!(
        out.status.success(),
        "curl {url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
