//! Checks of a parsed config that serde cannot make: names, addresses, thresholds, durations,
//! files. Each refusal is a [`ConfigError::Invalid`] naming the key, the value and the reason.

use std::{collections::HashSet, net::SocketAddr, path::Path, time::Duration};

use super::{
    BalancerConfig, CheckKind, Config, ConfigError, HealthConfig, StatusMatch, readable_file,
};
use crate::addr::{SetError, validate_set};

/// Shortest `idle_timeout`.
const MIN_IDLE_TIMEOUT: Duration = Duration::from_millis(100);

/// Whether validation reads the credential files a config names (`[admin] token_file`, the
/// `ca_file`, `cert_file` and `key_file` of health checks and etcd discovery).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CredentialFiles {
    /// Read each one: refuse a file that cannot be read (or an empty token file).
    #[default]
    Read,
    /// Leave them unread, for a machine where the runtime credentials are not present
    /// (`lb config check --skip-files`). Everything else is checked as with `Read`.
    Skip,
}

impl CredentialFiles {
    /// Check that `path` can be read (and, with `non_empty`, holds something); nothing when
    /// skipping.
    pub(super) fn check(self, key: &str, path: &Path, non_empty: bool) -> Result<(), ConfigError> {
        match self {
            CredentialFiles::Read => readable_file(key, path, non_empty),
            CredentialFiles::Skip => Ok(()),
        }
    }
}

impl Config {
    /// Check everything serde cannot: names, addresses, thresholds, durations, files.
    ///
    /// # Errors
    /// The first [`ConfigError::Invalid`] found, naming its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_with(CredentialFiles::Read)
    }

    /// As [`Config::validate`], reading the credential files or not as `files` says.
    ///
    /// # Errors
    /// The first [`ConfigError::Invalid`] found, naming its key.
    #[expect(
        clippy::too_many_lines,
        reason = "one check per top-level key, in the order the keys are documented"
    )]
    pub fn validate_with(&self, files: CredentialFiles) -> Result<(), ConfigError> {
        if self.balancers.is_empty() {
            return Err(ConfigError::invalid(
                "balancer",
                "[]",
                "at least one [[balancer]] (or --listen and --server) is required",
            ));
        }
        self.datapath.fail_fast.validate("datapath.fail_fast")?;
        self.dns.validate()?;
        if self.datapath.max_buffered_bytes < 64 * 1024 {
            return Err(ConfigError::invalid(
                "datapath.max_buffered_bytes",
                self.datapath.max_buffered_bytes,
                "must be at least 65536",
            ));
        }
        if !(4096..=16 * 1024 * 1024).contains(&self.datapath.copy_buffer_bytes) {
            return Err(ConfigError::invalid(
                "datapath.copy_buffer_bytes",
                self.datapath.copy_buffer_bytes,
                "must be between 4096 and 16777216",
            ));
        }
        if self.datapath.orphan_timeout.0 < std::time::Duration::from_secs(2) {
            return Err(ConfigError::invalid(
                "datapath.orphan_timeout",
                self.datapath.orphan_timeout,
                "must be at least 2s (lb writes its heartbeat every 0.5 s)",
            ));
        }
        if let Some(dir) = &self.datapath.pin_dir
            && !dir.is_absolute()
        {
            return Err(ConfigError::invalid(
                "datapath.pin_dir",
                dir.display(),
                "must be an absolute path (a directory in a bpffs)",
            ));
        }
        if self.balancers.len() > lb_common::MAX_BALANCERS as usize {
            return Err(ConfigError::invalid(
                "balancer",
                self.balancers.len(),
                format!("at most {} balancers", lb_common::MAX_BALANCERS),
            ));
        }
        if let Some(path) = &self.admin.token_file {
            files.check("admin.token_file", path, true)?;
        }
        let admin = &self.admin;
        if !admin.listen.ip().is_loopback()
            && admin.token_file.is_none()
            && !admin.allow_without_token
        {
            return Err(ConfigError::invalid(
                "admin.listen",
                admin.listen,
                "a non-loopback admin address needs admin.token_file (or admin.allow_without_token = true, which opens /status and /metrics to whoever reaches it)",
            ));
        }
        let all_listens: Vec<SocketAddr> = self
            .balancers
            .iter()
            .flat_map(|b| b.listen.iter().copied())
            .collect();
        for (i, a) in all_listens.iter().enumerate() {
            for b in &all_listens[i + 1..] {
                let overlap = a.port() == b.port()
                    && a.is_ipv4() == b.is_ipv4()
                    && a != b
                    && (a.ip().is_unspecified() || b.ip().is_unspecified());
                if overlap {
                    return Err(ConfigError::invalid(
                        "balancer.listen",
                        format!("{a} and {b}"),
                        "a wildcard listener and another on the same port cannot both bind",
                    ));
                }
            }
        }
        self.validate_admin_listen()?;
        self.metrics.validate(self, &all_listens)?;
        let mut names = HashSet::new();
        let mut listens = HashSet::new();
        for (i, b) in self.balancers.iter().enumerate() {
            let key = |k: &str| format!("balancer[{i}].{k}");
            if b.name.is_empty()
                || !b
                    .name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
            {
                return Err(ConfigError::invalid(
                    key("name"),
                    &b.name,
                    "must be non-empty and use only letters, digits, '-', '_' and '.'",
                ));
            }
            if !names.insert(b.name.as_str()) {
                return Err(ConfigError::invalid(
                    key("name"),
                    &b.name,
                    "duplicate balancer name",
                ));
            }
            if b.listen.is_empty() {
                return Err(ConfigError::invalid(
                    key("listen"),
                    "[]",
                    "at least one listen address is required",
                ));
            }
            for l in &b.listen {
                if !listens.insert(*l) {
                    return Err(ConfigError::invalid(key("listen"), l, "address used twice"));
                }
            }
            validate_balancer(i, b, files)?;
            validate_not_other_listener(i, b, &self.balancers)?;
            if let Some(f) = &b.fail_fast {
                f.validate(&key("fail_fast"))?;
            }
            if let (super::Forwarding::Connect, Some(proxy)) = (self.forwarding_of(b), &b.proxy) {
                return Err(ConfigError::invalid(
                    key("forwarding"),
                    "connect",
                    format!(
                        "clients connect straight to the server, so they cannot go through \
                         balancer[{i}].proxy ({proxy}); use forwarding = \"splice\" or drop the proxy"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// `[admin] listen` (or `--admin-listen`) on a balancer's listener: both could never bind.
    fn validate_admin_listen(&self) -> Result<(), ConfigError> {
        let admin = self.admin.listen;
        for b in &self.balancers {
            if let Some(l) = b.listen.iter().find(|l| same_port(**l, admin)) {
                return Err(ConfigError::invalid(
                    "admin.listen",
                    admin,
                    format!(
                        "is also balancer {}'s listener {l}: the admin API and a balancer cannot \
                         share an address (set [admin] listen or --admin-listen to another port)",
                        b.name
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Advice about settings that work but likely not as meant: `lb config check` prints each
    /// line, `lb run` logs it as a warning.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (i, b) in self.balancers.iter().enumerate() {
            let h = &b.health;
            if h.timeout.0 > h.interval.0 {
                out.push(format!(
                    "balancer[{i}].health.timeout = \"{}\" is longer than its interval = \"{}\": \
                     one check runs at a time per server, so a server that stops answering is \
                     checked every {} and found FAILED after fall × timeout",
                    h.timeout, h.interval, h.timeout
                ));
            }
        }
        out
    }
}

/// Whether two listen addresses take the same port: equal, or one a wildcard of the same family.
fn same_port(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port()
        && a.is_ipv4() == b.is_ipv4()
        && (a == b || a.ip().is_unspecified() || b.ip().is_unspecified())
}

/// A server of balancer `i` equal to another balancer's listener would make lb dial itself;
/// the refusal names that balancer.
fn validate_not_other_listener(
    i: usize,
    b: &BalancerConfig,
    all: &[BalancerConfig],
) -> Result<(), ConfigError> {
    for (j, other) in all.iter().enumerate() {
        if j == i || b.servers.is_empty() && b.default_server.is_none() {
            continue;
        }
        if let Err(SetError::OwnListener(s)) =
            validate_set(&b.servers, b.default_server.as_ref(), &other.listen)
        {
            return Err(ConfigError::invalid(
                format!("balancer[{i}].servers"),
                &s,
                format!(
                    "server {s} is balancer {}'s listener, one of lb's own listen addresses: lb \
                     would dial itself",
                    other.name
                ),
            ));
        }
    }
    Ok(())
}

/// `max_connections` and `idle_timeout` of balancer `i`.
fn validate_limits(i: usize, b: &BalancerConfig) -> Result<(), ConfigError> {
    if b.max_connections == Some(0) {
        return Err(ConfigError::invalid(
            format!("balancer[{i}].max_connections"),
            0,
            "must be at least 1 (leave it out for no limit)",
        ));
    }
    if let Some(idle) = b.idle_timeout
        && idle.0 < MIN_IDLE_TIMEOUT
    {
        return Err(ConfigError::invalid(
            format!("balancer[{i}].idle_timeout"),
            idle,
            "must be at least 100ms (leave it out to never close idle connections)",
        ));
    }
    Ok(())
}

/// One `[[balancer]]`'s own keys.
#[expect(
    clippy::too_many_lines,
    reason = "one check per balancer key, in the order the keys are documented"
)]
fn validate_balancer(
    i: usize,
    b: &BalancerConfig,
    files: CredentialFiles,
) -> Result<(), ConfigError> {
    let key = |k: &str| format!("balancer[{i}].{k}");
    if let Some(d) = &b.discovery {
        d.validate(&key("discovery"), files)?;
        // Asking etcd through this balancer's own listener needs a server to start from.
        if let crate::config::DiscoveryConfig::Etcd(e) = d
            && b.servers.is_empty()
            && let Some(own) = e.endpoints.iter().find(|url| {
                b.listen
                    .iter()
                    .any(|l| url.trim_end_matches('/').ends_with(&format!("//{l}")))
            })
        {
            return Err(ConfigError::invalid(
                key("discovery.endpoints"),
                own,
                "is this balancer's own listener, which has no server to ask until discovery \
                 finds one: give servers = [...] a first member to start from",
            ));
        }
    } else if b.servers.is_empty() {
        return Err(ConfigError::invalid(
            key("servers"),
            "[]",
            "at least one server is required (or a discovery source)",
        ));
    }
    // A server equal to its own listener would make lb dial itself (another balancer's
    // listener: `validate_not_other_listener`).
    if !b.servers.is_empty() || b.default_server.is_some() {
        validate_set(&b.servers, b.default_server.as_ref(), &b.listen).map_err(|e| {
            let value = match &e {
                SetError::Duplicate(s) | SetError::OwnListener(s) => s.to_string(),
                _ => b
                    .servers
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
            };
            ConfigError::invalid(key("servers"), value, e.to_string())
        })?;
    }
    // With discovery the number of servers is not known here: count it as several.
    let several = b.servers.len() > 1 || b.discovery.is_some();
    if b.dial_timeout.0.is_zero() {
        return Err(ConfigError::invalid(
            key("dial_timeout"),
            b.dial_timeout,
            "must be more than 0",
        ));
    }
    if b.connect_budget.0 < b.dial_timeout.0 {
        return Err(ConfigError::invalid(
            key("connect_budget"),
            b.connect_budget,
            "must be at least dial_timeout",
        ));
    }
    validate_limits(i, b)?;
    validate_health(i, &b.health, files)?;
    let h = &b.health;
    // Discovered servers are addresses (IPv4 or IPv6, any port): the template must make a URL
    // of either. These documentation addresses (RFC 5737, RFC 3849) are never dialed.
    let samples: Vec<crate::addr::ServerAddr> = if b.discovery.is_some() {
        ["192.0.2.1:2379", "[2001:db8::1]:2379"]
            .iter()
            .filter_map(|s| crate::addr::ServerAddr::parse(s).ok())
            .collect()
    } else {
        Vec::new()
    };
    for server in b.servers.iter().chain(&b.default_server).chain(&samples) {
        if let (CheckKind::Http | CheckKind::Tunnel, Some(url)) = (h.kind, &h.url) {
            check_url(&format!("balancer[{i}].health.url"), url, server)?;
        }
    }
    if let (CheckKind::Tcp | CheckKind::Tls, Some(a), false) = (h.kind, &h.address, h.shared_target)
        && several
    {
        return Err(ConfigError::invalid(
            format!("balancer[{i}].health.address"),
            a,
            "is one place for every server, so every server's health would be that one \
             address's; drop it, or set health.shared_target = true if that is intended",
        ));
    }
    if let (CheckKind::Http | CheckKind::Tunnel, Some(url), false) =
        (h.kind, &h.url, h.shared_target)
        && several
        && !url.contains("{server}")
        && !url.contains("{host}")
    {
        return Err(ConfigError::invalid(
            format!("balancer[{i}].health.url"),
            url,
            "has neither {server} nor {host}, so every server's health would be this one \
             URL's; put {server} or {host} in it, or set health.shared_target = true if that is \
             intended",
        ));
    }
    Ok(())
}

/// `url` with `server`'s parts put in must be a URL with a host.
fn check_url(key: &str, url: &str, server: &crate::addr::ServerAddr) -> Result<(), ConfigError> {
    let filled = server.fill(url);
    let ok = filled
        .parse::<hyper::Uri>()
        .is_ok_and(|u| u.host().is_some_and(|h| !h.is_empty()));
    if ok {
        Ok(())
    } else {
        Err(ConfigError::invalid(
            key,
            url,
            format!(
                "not a valid URL for server {server} (it gives {filled:?}; {{server}} is host:port, \
                 {{host}} the host alone, {{port}} the port)"
            ),
        ))
    }
}

/// One `[balancer.health]`.
#[expect(
    clippy::too_many_lines,
    reason = "one check per health key and check kind, in the order the keys are documented"
)]
fn validate_health(i: usize, h: &HealthConfig, files: CredentialFiles) -> Result<(), ConfigError> {
    let hkey = |k: &str| format!("balancer[{i}].health.{k}");
    if h.rise == 0 {
        return Err(ConfigError::invalid(
            hkey("rise"),
            h.rise,
            "must be at least 1",
        ));
    }
    if h.passive_reset_limit == 0 {
        return Err(ConfigError::invalid(
            hkey("passive_reset_limit"),
            h.passive_reset_limit,
            "must be at least 1",
        ));
    }
    if h.fall == 0 {
        return Err(ConfigError::invalid(
            hkey("fall"),
            h.fall,
            "must be at least 1",
        ));
    }
    for (name, d) in [("interval", h.interval), ("timeout", h.timeout)] {
        if d.0 < Duration::from_millis(10) {
            return Err(ConfigError::invalid(hkey(name), d, "must be at least 10ms"));
        }
    }
    for (name, d) in [
        ("fast_interval", h.fast_interval),
        ("down_interval", h.down_interval),
    ] {
        if let Some(d) = d
            && d.0 < Duration::from_millis(10)
        {
            return Err(ConfigError::invalid(hkey(name), d, "must be at least 10ms"));
        }
    }
    match h.kind {
        CheckKind::Http | CheckKind::Tunnel => {
            let Some(url) = &h.url else {
                return Err(ConfigError::invalid(
                    hkey("url"),
                    "(none)",
                    "required for http and tunnel checks",
                ));
            };
            let ok_schemes: &[&str] = if h.kind == CheckKind::Http {
                &["http://", "https://"]
            } else {
                &["ws://", "wss://"]
            };
            if !ok_schemes.iter().any(|s| url.starts_with(s)) {
                return Err(ConfigError::invalid(
                    hkey("url"),
                    url,
                    format!("must start with {}", ok_schemes.join(" or ")),
                ));
            }
        }
        CheckKind::Tcp | CheckKind::Tls => {}
    }
    if h.expect_status.is_empty() {
        return Err(ConfigError::invalid(
            hkey("expect_status"),
            "[]",
            "at least one status",
        ));
    }
    if h.max_response_bytes == 0 {
        return Err(ConfigError::invalid(
            hkey("max_response_bytes"),
            0,
            "must be at least 1",
        ));
    }
    for m in &h.expect_status {
        let (lo, hi) = match *m {
            StatusMatch::Code(c) => (c, c),
            StatusMatch::Range(lo, hi) => (lo, hi),
        };
        if lo < 100 || hi > 599 {
            return Err(ConfigError::invalid(
                hkey("expect_status"),
                m,
                "HTTP status codes are 100-599",
            ));
        }
    }
    if let (CheckKind::Tcp | CheckKind::Tls, Some(url)) = (h.kind, &h.url) {
        return Err(ConfigError::invalid(
            hkey("url"),
            url,
            "tcp and tls checks use no url (they connect to the server, or to port/address)",
        ));
    }
    if let (CheckKind::Http | CheckKind::Tunnel, Some(_)) = (h.kind, h.port) {
        return Err(ConfigError::invalid(
            hkey("port"),
            h.port.unwrap_or_default(),
            "for http and tunnel checks put the port in url (`{host}:PORT`)",
        ));
    }
    if let (CheckKind::Http | CheckKind::Tunnel, Some(a)) = (h.kind, &h.address) {
        return Err(ConfigError::invalid(
            hkey("address"),
            a,
            "for http and tunnel checks put the address in url",
        ));
    }
    if h.port == Some(0) {
        return Err(ConfigError::invalid(hkey("port"), 0, "must be 1-65535"));
    }
    if let Some(a) = &h.address {
        let text = if a.parse::<std::net::Ipv6Addr>().is_ok() {
            format!("[{a}]:1")
        } else {
            format!("{a}:1")
        };
        crate::addr::ServerAddr::parse(&text).map_err(|e| {
            ConfigError::invalid(
                hkey("address"),
                a,
                format!("not a host or IP address ({e})"),
            )
        })?;
    }
    for (name, path) in [
        ("ca_file", &h.ca_file),
        ("cert_file", &h.cert_file),
        ("key_file", &h.key_file),
    ] {
        if let Some(path) = path {
            files.check(&hkey(name), path, false)?;
        }
    }
    super::paired_files(
        &format!("balancer[{i}].health"),
        h.cert_file.as_ref(),
        h.key_file.as_ref(),
    )?;
    Ok(())
}
