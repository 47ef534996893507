//! A DNS server on a test host whose answers a test changes (Debian's dnsmasq, answering only
//! from a hosts file of the test's own), and a plain DNS query over UDP to read them back.
//!
//! dnsmasq runs in the foreground inside the host's namespace with no configuration from /etc
//! (`--conf-file=/dev/null --no-resolv --no-hosts`): it answers A and AAAA for the names in
//! its hosts file (in the server's [`TempDir`]) with the chosen TTL, and never forwards a query
//! anywhere. [`DnsServer::set_records`] rewrites that file, sends SIGHUP (dnsmasq re-reads it and
//! clears its cache) and returns once a real query shows the new answer.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket},
    process::{Child, Stdio},
    sync::atomic::{AtomicU16, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};

use crate::{host::Host, tmp::TempDir};

/// The DNS port dnsmasq listens on.
pub const DNS_PORT: u16 = 53;

/// How long a change may take to show in the answers.
const CHANGE_WITHIN: Duration = Duration::from_secs(10);

/// A record type a test asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordType {
    /// IPv4 address.
    A,
    /// IPv6 address.
    Aaaa,
}

impl RecordType {
    fn wire(self) -> hickory_proto::rr::RecordType {
        match self {
            RecordType::A => hickory_proto::rr::RecordType::A,
            RecordType::Aaaa => hickory_proto::rr::RecordType::AAAA,
        }
    }
}

/// The answer to one query.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DnsAnswer {
    /// Response code (0 NOERROR, 3 NXDOMAIN, 5 REFUSED).
    pub rcode: u8,
    /// Records of the asked type, with their TTL in seconds, in the order of the answer.
    pub records: Vec<(IpAddr, u32)>,
}

impl DnsAnswer {
    /// The addresses, sorted.
    pub fn addrs(&self) -> Vec<IpAddr> {
        let mut v: Vec<IpAddr> = self.records.iter().map(|(a, _)| *a).collect();
        v.sort_unstable();
        v
    }
}

/// dnsmasq on a test host of its own, answering from a hosts file the test rewrites; stopped and
/// its files removed on drop.
#[derive(Debug)]
pub struct DnsServer {
    child: Child,
    ttl: u32,
    records: BTreeMap<String, Vec<IpAddr>>,
    dir: TempDir,
    /// The test host it runs on; it listens on the host's address, port 53.
    pub host: Host,
}

impl DnsServer {
    /// Start dnsmasq on a new test host, answering with TTL `ttl` seconds; no names yet. Returns
    /// once it answers queries.
    ///
    /// # Errors
    /// dnsmasq missing (run `cargo xtask setup`), or not answering within 10 s (the error
    /// carries its log).
    pub fn start(ttl: u32) -> Result<DnsServer> {
        let host = Host::new()?;
        let dir = TempDir::new("lb-dns")?;
        let hosts = dir.join("hosts");
        std::fs::write(&hosts, "")?;
        let log = std::fs::File::create(dir.join("dnsmasq.log"))?;
        let args = [
            "--no-daemon".to_string(),
            "--conf-file=/dev/null".into(),
            "--no-resolv".into(),
            "--no-hosts".into(),
            format!("--addn-hosts={}", hosts.display()),
            format!("--local-ttl={ttl}"),
            format!("--listen-address={}", host.ip),
            "--bind-interfaces".into(),
            format!("--port={DNS_PORT}"),
            format!("--pid-file={}", dir.join("dnsmasq.pid").display()),
            format!("--dhcp-leasefile={}", dir.join("dnsmasq.leases").display()),
            // Every name is local: one not in the file is NXDOMAIN, not REFUSED for want of an
            // upstream server.
            "--local=/#/".into(),
            "--log-facility=-".into(),
            "--log-queries".into(),
        ];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let child = host
            .command("dnsmasq", &args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("spawning dnsmasq (installed by `cargo xtask setup`)")?;
        let mut server = DnsServer {
            child,
            ttl,
            records: BTreeMap::new(),
            dir,
            host,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = server.child.try_wait()? {
                bail!("dnsmasq exited with {status}: {}", server.log());
            }
            // Any answer, even NXDOMAIN, means it listens.
            if dns_query(
                server.addr(),
                "ready.lb.test",
                RecordType::A,
                Duration::from_millis(200),
            )
            .is_ok()
            {
                return Ok(server);
            }
            if Instant::now() >= deadline {
                bail!("dnsmasq did not answer within 10 s: {}", server.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `IP:53`, where it answers (for lb's resolver configuration).
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((self.host.ip, DNS_PORT))
    }

    /// The TTL of its answers, in seconds.
    pub fn ttl(&self) -> u32 {
        self.ttl
    }

    /// What dnsmasq logged so far (every query, with `--log-queries`).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("dnsmasq.log")).unwrap_or_default()
    }

    /// Make `name` answer exactly `addrs` (A records for the IPv4 ones, AAAA for the IPv6 ones;
    /// none: the name is gone), then wait until queries show it; returns how long that took.
    /// Test hosts have IPv4 addresses only, so an AAAA record that something will dial should
    /// be an IPv4-mapped one (`::ffff:198.18.x.y`), which still reaches the test host.
    ///
    /// # Errors
    /// Writing the file, signalling dnsmasq, or the answer not changing within 10 s.
    pub fn set_records(&mut self, name: &str, addrs: &[IpAddr]) -> Result<Duration> {
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        if addrs.is_empty() {
            self.records.remove(&name);
        } else {
            self.records.insert(name.clone(), addrs.to_vec());
        }
        let mut text = String::new();
        for (n, addrs) in &self.records {
            for a in addrs {
                text.push_str(&format!("{a} {n}\n"));
            }
        }
        let hosts = self.dir.join("hosts");
        let tmp = self.dir.join("hosts.new");
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, &hosts)?;
        let start = Instant::now();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(self.child.id())?),
            nix::sys::signal::Signal::SIGHUP,
        )
        .context("SIGHUP to dnsmasq")?;
        let mut want: Vec<IpAddr> = addrs.to_vec();
        want.sort_unstable();
        want.dedup();
        let (want4, want6): (Vec<IpAddr>, Vec<IpAddr>) = want.iter().partition(|a| a.is_ipv4());
        let mut seen = (Vec::new(), Vec::new());
        while start.elapsed() < CHANGE_WITHIN {
            let a = self.query(&name, RecordType::A);
            let aaaa = self.query(&name, RecordType::Aaaa);
            if let (Ok(a), Ok(aaaa)) = (a, aaaa) {
                seen = (a.addrs(), aaaa.addrs());
                if seen.0 == want4 && seen.1 == want6 {
                    return Ok(start.elapsed());
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!(
            "{name} answers {seen:?}, not {want:?}, {CHANGE_WITHIN:?} after the change: {}",
            self.log()
        )
    }

    /// Ask it for `name`'s records of type `qtype`.
    ///
    /// # Errors
    /// No answer within 2 s, or a malformed one.
    pub fn query(&self, name: &str, qtype: RecordType) -> Result<DnsAnswer> {
        dns_query(self.addr(), name, qtype, Duration::from_secs(2))
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

static NEXT_ID: AtomicU16 = AtomicU16::new(1);

/// One DNS query over UDP (recursion desired, as a stub resolver sends it) to `server`, sent
/// again every 500 ms until an answer with its id arrives or `timeout` passes.
///
/// # Errors
/// No answer in time, or a malformed or truncated one.
pub fn dns_query(
    server: SocketAddr,
    name: &str,
    qtype: RecordType,
    timeout: Duration,
) -> Result<DnsAnswer> {
    #[allow(clippy::cast_possible_truncation)]
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed) ^ (std::process::id() as u16);
    let query = encode_query(id, name, qtype)?;
    let bind: SocketAddr = if server.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let sock = UdpSocket::bind(bind)?;
    sock.connect(server)?;
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline {
        sock.send(&query)?;
        let resend = Instant::now() + Duration::from_millis(500);
        while Instant::now() < resend.min(deadline) {
            let left = resend
                .min(deadline)
                .saturating_duration_since(Instant::now());
            sock.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
            match sock.recv(&mut buf) {
                Ok(n) if n >= 2 && buf[..2] == id.to_be_bytes() => {
                    return decode_answer(&buf[..n], qtype);
                }
                Ok(_) => {}
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::TimedOut => {}
                // A refused port (ICMP unreachable) shows as ConnectionRefused: try again.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    std::thread::sleep(Duration::from_millis(20));
                    break;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
    bail!("no DNS answer from {server} for {name} within {timeout:?}")
}

/// The query message: one question, recursion desired (as a stub resolver sends it).
fn encode_query(id: u16, name: &str, qtype: RecordType) -> Result<Vec<u8>> {
    use hickory_proto::{
        op::{Message, MessageType, OpCode, Query},
        rr::Name,
    };
    let name = Name::from_ascii(name).with_context(|| format!("bad DNS name {name:?}"))?;
    let mut m = Message::new();
    m.set_id(id)
        .set_message_type(MessageType::Query)
        .set_op_code(OpCode::Query)
        .set_recursion_desired(true)
        .add_query(Query::query(name, qtype.wire()));
    Ok(m.to_vec()?)
}

/// The records of type `qtype` in the answer `msg`, with its response code.
fn decode_answer(msg: &[u8], qtype: RecordType) -> Result<DnsAnswer> {
    use hickory_proto::{op::Message, rr::RData};
    let m = Message::from_vec(msg).context("malformed DNS answer")?;
    ensure!(
        m.message_type() == hickory_proto::op::MessageType::Response,
        "not a response"
    );
    ensure!(!m.truncated(), "truncated response");
    let rcode = u8::try_from(u16::from(m.response_code())).context("extended response code")?;
    let mut records = Vec::new();
    for r in m.answers() {
        let addr = match (qtype, r.data()) {
            (RecordType::A, RData::A(a)) => IpAddr::from(a.0),
            (RecordType::Aaaa, RData::AAAA(a)) => IpAddr::from(a.0),
            _ => continue,
        };
        records.push((addr, r.ttl()));
    }
    Ok(DnsAnswer { rcode, records })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_and_answer_wire_format() -> Result<()> {
        let q = encode_query(0x1234, "etcd.lb.test.", RecordType::Aaaa)?;
        assert_eq!(&q[..4], &[0x12, 0x34, 0x01, 0x00]);
        assert_eq!(&q[12..26], b"\x04etcd\x02lb\x04test\x00");
        assert_eq!(&q[26..], &[0, 28, 0, 1]);
        // The answer: the question, then one AAAA record whose name is a pointer to it, then a
        // CNAME that is skipped.
        let mut a = q.clone();
        a[2] = 0x81;
        a[3] = 0x80;
        a[7] = 2;
        a.extend_from_slice(&[0xC0, 12, 0, 28, 0, 1, 0, 0, 0x01, 0x2C, 0, 16]);
        a.extend_from_slice(&"::ffff:198.18.0.2".parse::<Ipv6Addr>()?.octets());
        a.extend_from_slice(&[0xC0, 12, 0, 5, 0, 1, 0, 0, 0, 5, 0, 2, 0xC0, 12]);
        let ans = decode_answer(&a, RecordType::Aaaa)?;
        assert_eq!(ans.rcode, 0);
        assert_eq!(
            ans.records,
            vec![("::ffff:198.18.0.2".parse::<IpAddr>()?, 300)]
        );
        ensure!(decode_answer(&a[..a.len() - 3], RecordType::Aaaa).is_err());
        Ok(())
    }
}
