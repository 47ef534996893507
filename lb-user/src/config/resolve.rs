//! `[dns]` and a balancer's `resolve`: whether host names in `servers` and `default_server`
//! follow DNS (re-resolved at the answer's TTL, as Envoy's STRICT_DNS clusters do) or are
//! pinned to the addresses they had when they entered the set.

use std::{fmt, time::Duration};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{ConfigError, Dur};

/// Default longest time between two resolutions of a followed name: 30 s (the answer's TTL
/// brings the next one forward, never below 1 s).
pub const DEFAULT_RESOLVE_INTERVAL: Duration = Duration::from_secs(30);

/// How a balancer treats the host names of its server list.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Resolve {
    /// Re-resolve each name at its answer's TTL (bounded by `[dns] interval` above and 1 s
    /// below): addresses that leave the answer are removed and their connections closed, new
    /// ones are added (Envoy's STRICT_DNS).
    #[default]
    Follow,
    /// Resolve a name when it enters the set and keep those addresses (Envoy's STATIC, with
    /// names allowed): lb's behaviour before `resolve` existed.
    Once,
}

impl fmt::Display for Resolve {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Resolve::Follow => "follow",
            Resolve::Once => "once",
        })
    }
}

/// `[dns]`: how the names of server lists are resolved.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct DnsConfig {
    /// `resolve` of balancers that set none: follow (default) | once.
    pub resolve: Resolve,
    /// Longest time between two resolutions of a followed name (default 30 s); a shorter TTL
    /// brings the next one forward.
    pub interval: Dur,
    /// Bound on one resolution with its retries (default 5 s).
    pub timeout: Dur,
    /// DNS servers to ask, `IP` or `IP:port`; `/etc/resolv.conf`'s (and the hosts file) when
    /// empty.
    pub nameservers: Vec<String>,
}

impl Default for DnsConfig {
    fn default() -> Self {
        DnsConfig {
            resolve: Resolve::Follow,
            interval: Dur(DEFAULT_RESOLVE_INTERVAL),
            timeout: Dur(super::DEFAULT_DISCOVERY_TIMEOUT),
            nameservers: Vec::new(),
        }
    }
}

impl DnsConfig {
    /// Check the keys.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming `dns.interval`, `dns.timeout` or `dns.nameservers`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.interval.0 < Duration::from_secs(1) {
            return Err(ConfigError::invalid(
                "dns.interval",
                self.interval,
                "must be at least 1s (names are not re-resolved more often)",
            ));
        }
        if self.timeout.0 < Duration::from_millis(10) {
            return Err(ConfigError::invalid(
                "dns.timeout",
                self.timeout,
                "must be at least 10ms",
            ));
        }
        for ns in &self.nameservers {
            super::nameserver(ns).map_err(|reason| {
                ConfigError::invalid("dns.nameservers", ns, reason.to_string())
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    const TWO: &str = r#"
[[balancer]]
name = "api"
listen = ["127.0.0.1:6443"]
servers = ["api.example:6443"]

[[balancer]]
name = "etcd"
listen = ["127.0.0.1:2379"]
servers = ["etcd.example:2379"]
resolve = "once"
"#;

    #[test]
    fn resolve_key_and_its_default() {
        let cfg = Config::from_toml(TWO, "test").unwrap();
        assert_eq!(cfg.dns, DnsConfig::default());
        assert_eq!(cfg.resolve_of(&cfg.balancers[0]), Resolve::Follow);
        assert_eq!(cfg.resolve_of(&cfg.balancers[1]), Resolve::Once);
        let text =
            format!("[dns]\nresolve = \"once\"\nnameservers = [\"198.18.0.53:5353\"]\n{TWO}");
        let cfg = Config::from_toml(&text, "test").unwrap();
        assert_eq!(cfg.resolve_of(&cfg.balancers[0]), Resolve::Once);
        assert_eq!(cfg.dns.interval, Dur(DEFAULT_RESOLVE_INTERVAL));
    }

    #[test]
    fn bad_values_name_the_key() {
        let bad = TWO.replace("resolve = \"once\"", "resolve = \"strict_dns\"");
        let e = Config::from_toml(&bad, "test").unwrap_err().to_string();
        assert!(e.contains("resolve") && e.contains("strict_dns"), "{e}");
        for (table, key) in [
            ("interval = \"500ms\"", "dns.interval"),
            ("timeout = \"1ms\"", "dns.timeout"),
            ("nameservers = [\"dns.example\"]", "dns.nameservers"),
        ] {
            let e = Config::from_toml(&format!("[dns]\n{table}\n{TWO}"), "test")
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("`{key}`")), "{table}: {e}");
        }
        let e = Config::from_toml(&format!("[dns]\nttl = \"1s\"\n{TWO}"), "test")
            .unwrap_err()
            .to_string();
        assert!(e.contains("ttl"), "{e}");
    }
}
