//! `discovery` of a `[[balancer]]`: where its server list comes from when it is not only the
//! config's `servers` (DNS, the etcd member list, a file), and the checks of those keys.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{ConfigError, CredentialFiles, Dur};

/// Default time between two DNS or etcd discovery runs: 30 s.
pub const DEFAULT_DISCOVERY_INTERVAL: Duration = Duration::from_secs(30);
/// Default time between two reads of a discovery file: 1 s.
pub const DEFAULT_FILE_INTERVAL: Duration = Duration::from_secs(1);
/// Default bound on one discovery run (a DNS query with its retries, one etcd request): 5 s.
pub const DEFAULT_DISCOVERY_TIMEOUT: Duration = Duration::from_secs(5);
/// Shortest interval accepted: a source is not a health check.
pub const MIN_DISCOVERY_INTERVAL: Duration = Duration::from_millis(100);

/// Where a balancer's servers come from. Every source feeds the same path as
/// `PUT /balancers/NAME/servers`; an empty or failed answer never empties the balancer.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, JsonSchema)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum DiscoveryConfig {
    /// Every A and AAAA record of a name, each `address:port` a server.
    Dns(DnsDiscovery),
    /// The etcd member list: each member's client URL a server.
    Etcd(EtcdDiscovery),
    /// A JSON or TOML list in a file, read again when it changes.
    File(FileDiscovery),
}

/// `discovery = { kind = "dns", name = "...", port = N }`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DnsDiscovery {
    /// The name to resolve (A and AAAA).
    pub name: String,
    /// The servers' port.
    pub port: u16,
    /// Time between two queries; shorter when the answer's TTL is (default 30 s).
    #[serde(default = "default_interval")]
    pub interval: Dur,
    /// Bound on one query with its retries (default 5 s).
    #[serde(default = "default_timeout")]
    pub timeout: Dur,
    /// DNS servers to ask, `IP` or `IP:port`; `/etc/resolv.conf`'s when empty.
    #[serde(default)]
    pub nameservers: Vec<String>,
}

/// `discovery = { kind = "etcd", endpoints = ["https://10.0.0.1:2379"] }`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EtcdDiscovery {
    /// etcd client URLs (`http://` or `https://`), asked in order until one answers.
    pub endpoints: Vec<String>,
    /// Time between two member lists (default 30 s).
    #[serde(default = "default_interval")]
    pub interval: Dur,
    /// Bound on one request (default 5 s).
    #[serde(default = "default_timeout")]
    pub timeout: Dur,
    /// CA bundle (PEM) for `https` endpoints; the system roots when absent.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// Client certificate chain (PEM); K3s's etcd asks for one.
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    /// Client key (PEM).
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// Accept any server certificate.
    #[serde(default)]
    pub insecure_skip_verify: bool,
}

/// `discovery = { kind = "file", path = "/etc/lb/servers.json" }`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FileDiscovery {
    /// The file: a JSON list `["host:port", ...]`, JSON `{"servers": [...], "default": "..."}`,
    /// or TOML `servers = [...]` (and `default = "..."`).
    pub path: PathBuf,
    /// Time between two reads (default 1 s): reading is what notices a change, also when a
    /// Kubernetes ConfigMap mount swaps a symlink, which a watch on the file misses.
    #[serde(default = "default_file_interval")]
    pub interval: Dur,
}

fn default_interval() -> Dur {
    Dur(DEFAULT_DISCOVERY_INTERVAL)
}
fn default_timeout() -> Dur {
    Dur(DEFAULT_DISCOVERY_TIMEOUT)
}
fn default_file_interval() -> Dur {
    Dur(DEFAULT_FILE_INTERVAL)
}

impl DiscoveryConfig {
    /// `dns`, `etcd` or `file`: the `kind` label of metrics and `/status`.
    pub fn kind(&self) -> &'static str {
        match self {
            DiscoveryConfig::Dns(_) => "dns",
            DiscoveryConfig::Etcd(_) => "etcd",
            DiscoveryConfig::File(_) => "file",
        }
    }

    /// What is asked, for `/status` and logs: `name:port`, the endpoints, or the path.
    pub fn source(&self) -> String {
        match self {
            DiscoveryConfig::Dns(d) => format!("{}:{}", d.name, d.port),
            DiscoveryConfig::Etcd(e) => e.endpoints.join(","),
            DiscoveryConfig::File(f) => f.path.display().to_string(),
        }
    }

    /// Time between two runs.
    pub fn interval(&self) -> Duration {
        match self {
            DiscoveryConfig::Dns(d) => d.interval.0,
            DiscoveryConfig::Etcd(e) => e.interval.0,
            DiscoveryConfig::File(f) => f.interval.0,
        }
    }

    /// Check the keys; `key` is the dotted prefix (`balancer[0].discovery`); etcd's TLS files
    /// are read or not as `files` says.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the key, the value and the reason.
    #[expect(
        clippy::too_many_lines,
        reason = "one check per key of each source kind, in the order the keys are documented"
    )]
    pub fn validate(&self, key: &str, files: CredentialFiles) -> Result<(), ConfigError> {
        let k = |name: &str| format!("{key}.{name}");
        if self.interval() < MIN_DISCOVERY_INTERVAL {
            return Err(ConfigError::invalid(
                k("interval"),
                Dur(self.interval()),
                "must be at least 100ms",
            ));
        }
        match self {
            DiscoveryConfig::Dns(d) => {
                let as_server = format!("{}:{}", d.name, d.port);
                if d.name.is_empty() || d.name.parse::<std::net::IpAddr>().is_ok() {
                    return Err(ConfigError::invalid(
                        k("name"),
                        &d.name,
                        "must be a host name to resolve",
                    ));
                }
                if d.port == 0 {
                    return Err(ConfigError::invalid(k("port"), 0, "must be 1-65535"));
                }
                crate::addr::ServerAddr::parse(&as_server).map_err(|e| {
                    ConfigError::invalid(k("name"), &d.name, format!("not a host name ({e})"))
                })?;
                if d.timeout.0 < Duration::from_millis(10) {
                    return Err(ConfigError::invalid(
                        k("timeout"),
                        d.timeout,
                        "must be at least 10ms",
                    ));
                }
                for ns in &d.nameservers {
                    nameserver(ns).map_err(|reason| {
                        ConfigError::invalid(k("nameservers"), ns, reason.to_string())
                    })?;
                }
            }
            DiscoveryConfig::Etcd(e) => {
                if e.endpoints.is_empty() {
                    return Err(ConfigError::invalid(
                        k("endpoints"),
                        "[]",
                        "at least one etcd client URL is required",
                    ));
                }
                for url in &e.endpoints {
                    let ok = (url.starts_with("http://") || url.starts_with("https://"))
                        && url
                            .parse::<hyper::Uri>()
                            .is_ok_and(|u| u.host().is_some_and(|h| !h.is_empty()));
                    if !ok {
                        return Err(ConfigError::invalid(
                            k("endpoints"),
                            url,
                            "not an http:// or https:// URL with a host",
                        ));
                    }
                }
                if e.timeout.0 < Duration::from_millis(10) {
                    return Err(ConfigError::invalid(
                        k("timeout"),
                        e.timeout,
                        "must be at least 10ms",
                    ));
                }
                for (name, path) in [
                    ("ca_file", &e.ca_file),
                    ("cert_file", &e.cert_file),
                    ("key_file", &e.key_file),
                ] {
                    if let Some(path) = path {
                        files.check(&k(name), path, false)?;
                    }
                }
                super::paired_files(key, e.cert_file.as_ref(), e.key_file.as_ref())?;
            }
            DiscoveryConfig::File(f) => {
                if f.path.as_os_str().is_empty() {
                    return Err(ConfigError::invalid(
                        k("path"),
                        "\"\"",
                        "a file is required",
                    ));
                }
                if !f.path.is_absolute() {
                    return Err(ConfigError::invalid(
                        k("path"),
                        f.path.display(),
                        "must be an absolute path",
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Why a DNS server's text is not one.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum NameserverError {
    /// `IP:0`.
    #[error("port 0")]
    PortZero,
    /// Neither an IP address nor `IP:port`.
    #[error("not an IP address or IP:port (a DNS server is given by address)")]
    NotAnAddress,
}

/// A DNS server given as `IP` (port 53) or `IP:port`.
///
/// # Errors
/// [`NameserverError`]: why the text is neither.
pub fn nameserver(text: &str) -> Result<SocketAddr, NameserverError> {
    if let Ok(ip) = text.parse::<std::net::IpAddr>() {
        return Ok(SocketAddr::new(ip, 53));
    }
    match text.parse::<SocketAddr>() {
        Ok(sa) if sa.port() != 0 => Ok(sa),
        Ok(_) => Err(NameserverError::PortZero),
        Err(_) => Err(NameserverError::NotAnAddress),
    }
}
