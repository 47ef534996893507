//! Server addresses: the one parsed, normalised form (`ServerAddr`) that config, balancer,
//! health checks, the proxy, metrics and the admin API all use, the CONNECT proxy URL, and the
//! rules a server set must follow. A leaf: it imports nothing from the rest of lb.

use std::{
    fmt,
    net::{IpAddr, SocketAddr},
    str::FromStr,
};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Most servers one balancer takes (each is health-checked concurrently).
pub const MAX_SERVERS: usize = 256;

/// Why a text is not a server address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddrError {
    /// No `:port` at the end.
    #[error("missing :port")]
    MissingPort,
    /// The port is not a number in 1..=65535.
    #[error("bad port {0:?}")]
    BadPort(String),
    /// Port 0 cannot be dialed.
    #[error("port 0")]
    PortZero,
    /// The host is neither an IP address nor a DNS name (letters, digits, `-`, labels of at
    /// most 63 characters).
    #[error("bad host name {0:?}")]
    BadHost(String),
    /// A proxy URL that is not `http://host:port`.
    #[error("only http:// CONNECT proxies are supported")]
    ProxyScheme,
}

/// The host part of a server address.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Host {
    /// A literal IPv4 or IPv6 address.
    Ip(IpAddr),
    /// A DNS name, lower case.
    Name(String),
}

/// A server address, `host:port`, normalised: IPv6 in brackets in its shortest form
/// (`[::1]:80`, never `[0:0::1]:80`), host names in lower case. Two spellings of one server are
/// one `ServerAddr`, so a server has one registry entry, one metric series and one state.
///
/// A host name may be pinned to one of the addresses it resolves to, written
/// `name:port (address)`: the balancer turns a name into one pinned server per address, each
/// balanced and health-checked on its own, so one dead address never takes the name down.
///
/// Serialised as its text; parsing refuses anything but `host:port`, `[v6]:port` or
/// `name:port (address)` with a port in 1..=65535.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServerAddr {
    text: String,
    host: Host,
    port: u16,
    pin: Option<IpAddr>,
}

impl ServerAddr {
    /// Parse and normalise `host:port`.
    ///
    /// # Errors
    /// [`AddrError`] naming what is wrong.
    pub fn parse(spec: &str) -> Result<ServerAddr, AddrError> {
        if let Some((name, pin)) = spec.strip_suffix(')').and_then(|s| s.split_once(" (")) {
            let ip: IpAddr = pin
                .parse()
                .map_err(|_| AddrError::BadHost(pin.to_string()))?;
            let base = ServerAddr::parse(name)?;
            if matches!(base.host, Host::Ip(_)) {
                return Err(AddrError::BadHost(spec.to_string()));
            }
            return Ok(base.pinned_to(ip));
        }
        if let Ok(sa) = spec.parse::<SocketAddr>() {
            return ServerAddr::from_socket_addr(sa);
        }
        let (host, port) = spec.rsplit_once(':').ok_or(AddrError::MissingPort)?;
        // Digits only: `u16::from_str` would also take a sign (`+6443`).
        let port: u16 = Some(port)
            .filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| AddrError::BadPort(port.to_string()))?;
        if port == 0 {
            return Err(AddrError::PortZero);
        }
        // RFC 1123 §2.1: labels of letters, digits and hyphens, and a name never looks like an
        // IPv4 address, so a last label of digits alone (`1.2.3.999`) is a bad address, not a
        // name to look up.
        let ok = !host.is_empty()
            && host.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            })
            && !host
                .rsplit('.')
                .next()
                .is_some_and(|l| l.bytes().all(|b| b.is_ascii_digit()));
        if !ok {
            return Err(AddrError::BadHost(host.to_string()));
        }
        let host = host.to_ascii_lowercase();
        Ok(ServerAddr {
            text: format!("{host}:{port}"),
            host: Host::Name(host),
            port,
            pin: None,
        })
    }

    /// This name pinned to `ip`, one of its addresses: `name:port (ip)`.
    pub fn pinned_to(&self, ip: IpAddr) -> ServerAddr {
        let authority = self.authority();
        ServerAddr {
            text: format!("{authority} ({ip})"),
            host: self.host.clone(),
            port: self.port,
            pin: Some(ip),
        }
    }

    /// The address a pinned name is pinned to.
    pub fn pin(&self) -> Option<IpAddr> {
        self.pin
    }

    /// `host:port` without the pin: what a URL's `{server}` and a `Host` header carry.
    pub fn authority(&self) -> String {
        match &self.host {
            Host::Ip(ip) => SocketAddr::new(*ip, self.port).to_string(),
            Host::Name(n) => format!("{n}:{}", self.port),
        }
    }

    /// `template` with this server's parts put in: `{server}` → `host:port` (IPv6 in
    /// brackets), `{host}` → the host alone (IPv6 in brackets, as a URL wants it; a pinned
    /// name gives its name), `{port}` → the port. So a check can target another port of the
    /// same host, e.g. RKE2's supervisor: `https://{host}:9345/ping`.
    pub fn fill(&self, template: &str) -> String {
        let host = match &self.host {
            Host::Ip(IpAddr::V6(ip)) => format!("[{ip}]"),
            Host::Ip(IpAddr::V4(ip)) => ip.to_string(),
            Host::Name(n) => n.clone(),
        };
        template
            .replace("{server}", &self.authority())
            .replace("{host}", &host)
            .replace("{port}", &self.port.to_string())
    }

    /// The same host (and pin) with another port.
    pub fn with_port(&self, port: u16) -> ServerAddr {
        let base = match &self.host {
            Host::Ip(ip) => ServerAddr {
                text: SocketAddr::new(*ip, port).to_string(),
                host: self.host.clone(),
                port,
                pin: None,
            },
            Host::Name(n) => ServerAddr {
                text: format!("{n}:{port}"),
                host: self.host.clone(),
                port,
                pin: None,
            },
        };
        match self.pin {
            Some(ip) => base.pinned_to(ip),
            None => base,
        }
    }

    /// The addresses to balance over for this server: itself when it is an IP address or
    /// already pinned; for a name, one pinned server per address it resolves to (in the
    /// resolver's order, each once), or the name itself when it resolves to nothing now (it
    /// is then resolved at each dial). Blocks on the system resolver.
    pub fn expand(&self) -> Vec<ServerAddr> {
        if self.pin.is_some() || matches!(self.host, Host::Ip(_)) {
            return vec![self.clone()];
        }
        let mut ips: Vec<IpAddr> = Vec::new();
        if let Ok(found) = std::net::ToSocketAddrs::to_socket_addrs(&self.authority()) {
            for sa in found {
                if !ips.contains(&sa.ip()) {
                    ips.push(sa.ip());
                }
            }
        }
        if ips.is_empty() {
            return vec![self.clone()];
        }
        ips.into_iter().map(|ip| self.pinned_to(ip)).collect()
    }

    /// A literal socket address as a server.
    ///
    /// # Errors
    /// [`AddrError::PortZero`].
    pub fn from_socket_addr(sa: SocketAddr) -> Result<ServerAddr, AddrError> {
        if sa.port() == 0 {
            return Err(AddrError::PortZero);
        }
        Ok(ServerAddr {
            text: sa.to_string(),
            host: Host::Ip(sa.ip()),
            port: sa.port(),
            pin: None,
        })
    }

    /// The normalised text, `host:port`, `[v6]:port` or `name:port (address)`.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The host.
    pub fn host(&self) -> &Host {
        &self.host
    }

    /// The host as text without brackets (`::1`, `198.18.0.2`, `etcd-1.example`): for SNI,
    /// `Host` headers without a port, and `NO_PROXY` matching.
    pub fn host_str(&self) -> String {
        match &self.host {
            Host::Ip(ip) => ip.to_string(),
            Host::Name(n) => n.clone(),
        }
    }

    /// The port (1..=65535).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The socket address when the host is a literal IP or a pinned name.
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        match (&self.host, self.pin) {
            (Host::Ip(ip), _) => Some(SocketAddr::new(*ip, self.port)),
            (Host::Name(_), Some(ip)) => Some(SocketAddr::new(ip, self.port)),
            (Host::Name(_), None) => None,
        }
    }
}

impl fmt::Display for ServerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl fmt::Debug for ServerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.text, f)
    }
}

impl FromStr for ServerAddr {
    type Err = AddrError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ServerAddr::parse(s)
    }
}

impl PartialEq<str> for ServerAddr {
    fn eq(&self, other: &str) -> bool {
        self.text == other
    }
}

impl PartialEq<&str> for ServerAddr {
    fn eq(&self, other: &&str) -> bool {
        self.text == *other
    }
}

impl Serialize for ServerAddr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

impl<'de> Deserialize<'de> for ServerAddr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        ServerAddr::parse(&text).map_err(|e| {
            serde::de::Error::custom(format!("server {text:?} is not host:port ({e})"))
        })
    }
}

/// An HTTP CONNECT proxy, `http://host:port` (a trailing `/` is allowed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxyUrl {
    url: String,
    addr: ServerAddr,
}

impl ProxyUrl {
    /// Parse `http://host:port`.
    ///
    /// # Errors
    /// [`AddrError::ProxyScheme`] for another scheme, else as [`ServerAddr::parse`].
    pub fn parse(url: &str) -> Result<ProxyUrl, AddrError> {
        let rest = url.strip_prefix("http://").ok_or(AddrError::ProxyScheme)?;
        Ok(ProxyUrl {
            url: url.to_string(),
            addr: ServerAddr::parse(rest.trim_end_matches('/'))?,
        })
    }

    /// The proxy's own address.
    pub fn addr(&self) -> &ServerAddr {
        &self.addr
    }
}

impl fmt::Display for ProxyUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.url)
    }
}

impl Serialize for ProxyUrl {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.url)
    }
}

impl<'de> Deserialize<'de> for ProxyUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        ProxyUrl::parse(&text).map_err(|e| serde::de::Error::custom(format!("proxy {text:?}: {e}")))
    }
}

/// Errors of server set changes (config, `PUT`/`POST`/`DELETE` servers, holds and kills).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SetError {
    /// An empty server list.
    #[error("the server list is empty")]
    Empty,
    /// More servers than a balancer takes.
    #[error("{0} servers; a balancer takes at most {MAX_SERVERS}")]
    TooMany(usize),
    /// The same server twice (after normalising).
    #[error("server {0} is listed twice")]
    Duplicate(ServerAddr),
    /// Not `host:port`.
    #[error("server {addr:?} is not host:port ({source})")]
    Unparsable {
        /// As given.
        addr: String,
        /// Why.
        #[source]
        source: AddrError,
    },
    /// A server equal to one of lb's own listeners (a loop).
    #[error("server {0} is this balancer's own listen address")]
    OwnListener(ServerAddr),
    /// Not in the set.
    #[error("server {0} is not in the set")]
    UnknownServer(String),
    /// A name given with its address pinned: lb pins a name's addresses itself, from the
    /// resolver; `name:port (address)` only names one of them for drain, disable or kill.
    #[error("server {0}: give the host name alone; lb finds and pins its addresses itself")]
    Pinned(ServerAddr),
}

/// The list to apply: `current` servers still `found` keep their places, new ones follow in
/// the source's order. DNS rotates its answers and a member list has no meaning in its order,
/// so taking either as given would reshuffle the preference order (and with it which server
/// `failover` keeps ACTIVE) at every run.
pub fn merge(current: &[ServerAddr], found: &[ServerAddr]) -> Vec<ServerAddr> {
    let mut out: Vec<ServerAddr> = current
        .iter()
        .filter(|s| found.contains(s))
        .cloned()
        .collect();
    for s in found {
        if !out.contains(s) {
            out.push(s.clone());
        }
    }
    out
}

/// Parse every text of a list (as the admin API receives them).
///
/// # Errors
/// [`SetError::Unparsable`] naming the first bad one.
pub fn parse_all(specs: &[String]) -> Result<Vec<ServerAddr>, SetError> {
    specs.iter().map(|s| parse_one(s)).collect()
}

/// Parse one text as a server.
///
/// # Errors
/// [`SetError::Unparsable`].
pub fn parse_one(spec: &str) -> Result<ServerAddr, SetError> {
    ServerAddr::parse(spec).map_err(|source| SetError::Unparsable {
        addr: spec.to_string(),
        source,
    })
}

/// Check a server set and its default: at most [`MAX_SERVERS`], no duplicates, none equal to
/// one of `listen` (lb's own listeners; a wildcard listener matches loopback on its port). An
/// empty list is refused unless a default is given.
///
/// # Errors
/// [`SetError`] naming the offending server.
pub fn validate_set(
    servers: &[ServerAddr],
    default: Option<&ServerAddr>,
    listen: &[SocketAddr],
) -> Result<(), SetError> {
    if servers.is_empty() && default.is_none() {
        return Err(SetError::Empty);
    }
    if servers.len() > MAX_SERVERS {
        return Err(SetError::TooMany(servers.len()));
    }
    for s in servers.iter().chain(default) {
        if s.pin().is_some() {
            return Err(SetError::Pinned(s.clone()));
        }
        // `0.0.0.0:P` and `[::]:P` reach this host, and `[::ffff:127.0.0.1]:P` is
        // `127.0.0.1:P`: each is a listener's address under another spelling.
        let ip_of = |ip: IpAddr| match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        if let Some(sa) = s.socket_addr()
            && listen.iter().any(|l| {
                let (lip, ip) = (ip_of(l.ip()), ip_of(sa.ip()));
                l.port() == sa.port()
                    && (lip == ip
                        || ip.is_unspecified()
                        || (lip.is_unspecified() && ip.is_loopback()))
            })
        {
            return Err(SetError::OwnListener(s.clone()));
        }
    }
    let mut seen = std::collections::HashSet::new();
    for s in servers {
        if !seen.insert(s) {
            return Err(SetError::Duplicate(s.clone()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalises_and_refuses() {
        assert_eq!(ServerAddr::parse("[0:0::1]:80").unwrap(), "[::1]:80");
        assert_eq!(
            ServerAddr::parse("Etcd-1.Example:2379").unwrap(),
            "etcd-1.example:2379"
        );
        assert_eq!(
            ServerAddr::parse("[::1]:80").unwrap().host_str(),
            "::1",
            "no brackets in the bare host"
        );
        assert_eq!(ServerAddr::parse("x"), Err(AddrError::MissingPort));
        assert_eq!(ServerAddr::parse("x:0"), Err(AddrError::PortZero));
        assert_eq!(ServerAddr::parse("198.18.0.2:0"), Err(AddrError::PortZero));
        assert!(matches!(
            ServerAddr::parse("x:http"),
            Err(AddrError::BadPort(_))
        ));
        assert!(matches!(
            ServerAddr::parse("a b:1"),
            Err(AddrError::BadHost(_))
        ));
        assert!(matches!(
            ServerAddr::parse("::1:80"),
            Err(AddrError::BadHost(_))
        ));
        for bad_port in ["x:+80", "x:-80", "x: 80", "x:"] {
            assert!(
                matches!(ServerAddr::parse(bad_port), Err(AddrError::BadPort(_))),
                "{bad_port}"
            );
        }
        for not_a_name in ["1.2.3.999:80", "999.0.0.1:80", "api.6443:80", "12345:80"] {
            assert!(
                matches!(ServerAddr::parse(not_a_name), Err(AddrError::BadHost(_))),
                "{not_a_name}"
            );
        }
        assert!(ServerAddr::parse("etcd-1.example:2379").is_ok());
        assert!(ServerAddr::parse("1a.example:80").is_ok());
    }

    #[test]
    fn set_rules() {
        let a = |s: &str| ServerAddr::parse(s).unwrap();
        let listen: Vec<SocketAddr> = vec!["0.0.0.0:6444".parse().unwrap()];
        assert_eq!(validate_set(&[], None, &listen), Err(SetError::Empty));
        assert!(validate_set(&[], Some(&a("198.18.0.2:1")), &listen).is_ok());
        assert_eq!(
            validate_set(&[a("X:1"), a("x:1")], None, &listen),
            Err(SetError::Duplicate(a("x:1")))
        );
        assert_eq!(
            validate_set(&[a("127.0.0.1:6444")], None, &listen),
            Err(SetError::OwnListener(a("127.0.0.1:6444")))
        );
        // The same listener under other spellings.
        let one: Vec<SocketAddr> = vec!["127.0.0.1:6445".parse().unwrap()];
        for spelling in ["0.0.0.0:6445", "[::]:6445", "[::ffff:127.0.0.1]:6445"] {
            assert_eq!(
                validate_set(&[a(spelling)], None, &one),
                Err(SetError::OwnListener(a(spelling))),
                "{spelling}"
            );
        }
        assert!(validate_set(&[a("127.0.0.2:6445")], None, &one).is_ok());
        let many: Vec<ServerAddr> = (1..=257).map(|p| a(&format!("h:{p}"))).collect();
        assert_eq!(
            validate_set(&many, None, &listen),
            Err(SetError::TooMany(257))
        );
    }

    #[test]
    fn proxy_url() {
        assert_eq!(
            ProxyUrl::parse("http://proxy:3128/").unwrap().addr(),
            &ServerAddr::parse("proxy:3128").unwrap()
        );
        assert_eq!(
            ProxyUrl::parse("https://proxy:3128"),
            Err(AddrError::ProxyScheme)
        );
    }

    #[test]
    fn pinned_names() {
        let p = ServerAddr::parse("Etcd.Example:2379 (198.18.1.2)").unwrap();
        assert_eq!(p, "etcd.example:2379 (198.18.1.2)");
        assert_eq!(p.authority(), "etcd.example:2379");
        assert_eq!(p.socket_addr(), Some("198.18.1.2:2379".parse().unwrap()));
        assert_eq!(p.host_str(), "etcd.example");
        assert_eq!(ServerAddr::parse(p.as_str()).unwrap(), p, "round trip");
        assert!(ServerAddr::parse("198.18.0.1:1 (198.18.0.2)").is_err());
        assert!(ServerAddr::parse("a:1 (nope)").is_err());
        let local = ServerAddr::parse("localhost:7").unwrap().expand();
        assert!(
            local
                .iter()
                .all(|a| a.pin().is_some_and(|ip| ip.is_loopback())),
            "{local:?}"
        );
        let lit = ServerAddr::parse("198.18.0.2:1").unwrap();
        assert_eq!(lit.expand(), std::slice::from_ref(&lit));
    }

    #[test]
    fn templates() {
        let v4 = ServerAddr::parse("198.18.0.2:6443").unwrap();
        let v6 = ServerAddr::parse("[::1]:6443").unwrap();
        let pinned = ServerAddr::parse("api.test:6443 (198.18.0.3)").unwrap();
        let t = "https://{host}:9345/ping?s={server}&p={port}";
        assert_eq!(
            v4.fill(t),
            "https://198.18.0.2:9345/ping?s=198.18.0.2:6443&p=6443"
        );
        assert_eq!(v6.fill(t), "https://[::1]:9345/ping?s=[::1]:6443&p=6443");
        assert_eq!(
            pinned.fill(t),
            "https://api.test:9345/ping?s=api.test:6443&p=6443"
        );
        assert_eq!(v6.with_port(9345), "[::1]:9345");
        assert_eq!(pinned.with_port(9345), "api.test:9345 (198.18.0.3)");
    }
}
