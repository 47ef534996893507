//! `[balancer.health]`: the health check's keys and defaults (kind, target, timing, `rise` and
//! `fall`, passive signals, what a failure does to connections, TLS) and the accepted statuses.

use std::{fmt, path::PathBuf, time::Duration};

use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize};

use super::Dur;

/// What happens to a server's connections when it turns unhealthy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum OnUnhealthy {
    /// Reset every connection at once (default; K3s closes them too).
    #[default]
    Kill,
    /// No new connections; reset the rest after `drain_timeout`.
    Drain,
    /// No new connections; existing ones stay.
    Keep,
}

/// Which sockets a kill reaches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum KillScope {
    /// lb's own connections.
    #[default]
    Own,
    /// Also every TCP socket on the node whose peer is the failed server.
    Node,
}

/// Health check kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum CheckKind {
    /// Connect within `timeout`.
    #[default]
    Tcp,
    /// Connect and finish a TLS handshake.
    Tls,
    /// GET a URL and match the status (and optionally a body substring).
    Http,
    /// A long-lived WebSocket pinged every `interval`.
    Tunnel,
}

/// `[balancer.health]`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct HealthConfig {
    /// tcp | tls | http | tunnel.
    pub kind: CheckKind,
    /// Run the periodic loop (false: checks run before dials and on `/check` only).
    #[serde(rename = "loop")]
    pub loop_enabled: bool,
    /// URL template for http (`http://{server}/ping`) and tunnel (`ws://{server}/tunnel`):
    /// `{server}` is the server's `host:port`, `{host}` its host alone and `{port}` its port, so
    /// `https://{host}:9345/ping` checks another port of the same host (RKE2's supervisor).
    pub url: Option<String>,
    /// tcp and tls: check this port instead of the server's (HAProxy's `check port N`).
    pub port: Option<u16>,
    /// tcp and tls: check this host or IP address instead of the server's (HAProxy's `addr`);
    /// one place for every server, so several servers need `shared_target = true`.
    pub address: Option<String>,
    /// Host header / SNI override.
    pub host: Option<String>,
    /// Accepted HTTP status codes or ranges: `[200, "200-299"]`.
    pub expect_status: Vec<StatusMatch>,
    /// Substring the HTTP body must contain.
    pub expect_body: Option<String>,
    /// Largest HTTP response read (bytes); default 64 KiB.
    pub max_response_bytes: usize,
    /// Time between checks; default 1 s (K3s checks every second).
    pub interval: Dur,
    /// Interval while a server is changing state; default = interval / 2.
    pub fast_interval: Option<Dur>,
    /// Interval while a server is FAILED; default = interval.
    pub down_interval: Option<Dur>,
    /// Fixed timeout of one check; default 1 s.
    pub timeout: Dur,
    /// Consecutive successes to become healthy; default 2.
    pub rise: u32,
    /// Consecutive failures to become FAILED; default 1 (K3s fails on the first failed check).
    pub fall: u32,
    /// Results older than this are refreshed before a dial; default 5 s.
    pub max_age: Dur,
    /// Dial failures and resets seen by the proxy count toward `fall`.
    pub passive: bool,
    /// With `passive`, this many consecutive resets by a server count as one failed check;
    /// default 10 (HAProxy's `error-limit` default), so one reset never fails a busy server.
    pub passive_reset_limit: u32,
    /// kill | drain | keep.
    pub on_unhealthy: OnUnhealthy,
    /// With `drain`, kill what is left after this long; default 30 s.
    pub drain_timeout: Dur,
    /// own | node.
    pub kill_scope: KillScope,
    /// TLS: server name for SNI and verification.
    pub sni: Option<String>,
    /// TLS: ALPN protocols.
    pub alpn: Vec<String>,
    /// TLS: CA bundle (PEM); system roots when absent.
    pub ca_file: Option<PathBuf>,
    /// TLS: client certificate chain (PEM).
    pub cert_file: Option<PathBuf>,
    /// TLS: client key (PEM).
    pub key_file: Option<PathBuf>,
    /// TLS: accept any server certificate.
    pub insecure_skip_verify: bool,
    /// The check `url` targets one place for every server (no `{server}` in it), on purpose;
    /// without this, `lb config check` refuses such a URL for a balancer of several servers.
    pub shared_target: bool,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            kind: CheckKind::Tcp,
            loop_enabled: true,
            url: None,
            port: None,
            address: None,
            host: None,
            expect_status: vec![StatusMatch::Range(200, 299)],
            expect_body: None,
            max_response_bytes: 64 * 1024,
            interval: Dur(Duration::from_secs(1)),
            fast_interval: None,
            down_interval: None,
            timeout: Dur(Duration::from_secs(1)),
            rise: 2,
            fall: 1,
            max_age: Dur(Duration::from_secs(5)),
            passive: true,
            passive_reset_limit: 10,
            on_unhealthy: OnUnhealthy::Kill,
            drain_timeout: Dur(Duration::from_secs(30)),
            kill_scope: KillScope::Own,
            sni: None,
            alpn: Vec::new(),
            ca_file: None,
            cert_file: None,
            key_file: None,
            insecure_skip_verify: false,
            shared_target: false,
        }
    }
}

/// One accepted HTTP status: a code or an inclusive range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatusMatch {
    /// Exactly this code.
    Code(u16),
    /// `lo..=hi`.
    Range(u16, u16),
}

impl StatusMatch {
    /// Whether `code` is accepted.
    pub fn matches(self, code: u16) -> bool {
        match self {
            StatusMatch::Code(c) => c == code,
            StatusMatch::Range(lo, hi) => (lo..=hi).contains(&code),
        }
    }
}

/// As written in `expect_status`: `200` or `200-299`.
impl fmt::Display for StatusMatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StatusMatch::Code(c) => write!(f, "{c}"),
            StatusMatch::Range(lo, hi) => write!(f, "{lo}-{hi}"),
        }
    }
}

/// As written in `expect_status`: `200` a number, `200-299` a string (so the schema's default is
/// a value the parser takes).
impl Serialize for StatusMatch {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            StatusMatch::Code(c) => s.serialize_u16(*c),
            StatusMatch::Range(..) => s.collect_str(self),
        }
    }
}

impl<'de> Deserialize<'de> for StatusMatch {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Code(u16),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Code(c) => Ok(StatusMatch::Code(c)),
            Raw::Text(t) => {
                let bad = || {
                    serde::de::Error::custom(format!(
                        "`{t}` is not a status code or a range like 200-299"
                    ))
                };
                let (lo, hi) = t.split_once('-').ok_or_else(bad)?;
                let lo: u16 = lo.trim().parse().map_err(|_| bad())?;
                let hi: u16 = hi.trim().parse().map_err(|_| bad())?;
                if lo > hi {
                    return Err(bad());
                }
                Ok(StatusMatch::Range(lo, hi))
            }
        }
    }
}
