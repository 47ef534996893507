//! `fail_fast`: what the kernel does for a connect-time balancer's connects whose SYN goes
//! unanswered (the SYN retransmission timeout, when a server turns suspect, `TCP_SYNCNT`).

use std::{fmt, time::Duration};

use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize};

use super::{ConfigError, Dur, parse_duration};

/// Shortest SYN retransmission timeout lb asks for.
pub const SYN_TIMEOUT_MIN: Duration = Duration::from_millis(50);
/// Longest SYN retransmission timeout lb asks for: the kernel's own (`TCP_TIMEOUT_INIT`, 1 s,
/// RFC 6298 §2.1).
pub const SYN_TIMEOUT_MAX: Duration = Duration::from_secs(1);
/// `auto` takes this many round trips: RFC 6298 §2.2's first RTO, `R + 4 × R/2`.
pub const RTT_FACTOR: u32 = 3;

/// `syn_timeout`: `auto` (from the server's measured round trip) or a fixed duration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SynTimeout {
    /// [`RTT_FACTOR`] × the connect round trip of the server's last passing check, at least
    /// `syn_timeout_min`, at most [`SYN_TIMEOUT_MAX`]; [`SYN_TIMEOUT_MAX`] until measured.
    #[default]
    Auto,
    /// This timeout for every server.
    Fixed(Dur),
}

impl<'de> Deserialize<'de> for SynTimeout {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s.trim() == "auto" {
            return Ok(SynTimeout::Auto);
        }
        parse_duration(&s)
            .map(|d| SynTimeout::Fixed(Dur(d)))
            .map_err(|e| serde::de::Error::custom(format!("{e}, or \"auto\"")))
    }
}

impl Serialize for SynTimeout {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl fmt::Display for SynTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SynTimeout::Auto => f.write_str("auto"),
            SynTimeout::Fixed(d) => d.fmt(f),
        }
    }
}

/// `[datapath.fail_fast]` (the default of every connect-time balancer) and
/// `[balancer.fail_fast]` (replaces it whole for one balancer; keys it leaves out take the
/// defaults below, not `[datapath.fail_fast]`'s).
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct FailFastConfig {
    /// The SYN retransmission timeout of a rewritten connect: `auto` (default) or 50ms..=1s.
    pub syn_timeout: SynTimeout,
    /// Floor of `auto` (50ms..=1s); default 200 ms (the kernel's `TCP_RTO_MIN`).
    pub syn_timeout_min: Dur,
    /// SYN timeouts of one connect after which its server is suspect; 0 never; default 1 (K3s's
    /// balancer, too, tries the next server after one failed dial; with the 200 ms floor, a SYN
    /// unanswered that long is a strong sign on a LAN, and the next passing check clears it).
    pub suspect_after: u32,
    /// `TCP_SYNCNT` of rewritten sockets (1..=127); 0 keeps `net.ipv4.tcp_syn_retries`;
    /// default 3.
    pub syn_retries: u32,
}

impl Default for FailFastConfig {
    fn default() -> Self {
        FailFastConfig {
            syn_timeout: SynTimeout::Auto,
            syn_timeout_min: Dur(Duration::from_millis(200)),
            suspect_after: 1,
            syn_retries: 3,
        }
    }
}

impl FailFastConfig {
    /// Check the bounds; `key` names the table (`datapath.fail_fast`, `balancer[0].fail_fast`).
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the key, the value and the bounds.
    pub fn validate(&self, key: &str) -> Result<(), ConfigError> {
        let FailFastConfig {
            syn_timeout,
            syn_timeout_min,
            suspect_after: _,
            syn_retries,
        } = self;
        let bounds = |k: &str, d: Duration| {
            if (SYN_TIMEOUT_MIN..=SYN_TIMEOUT_MAX).contains(&d) {
                Ok(())
            } else {
                Err(ConfigError::invalid(
                    format!("{key}.{k}"),
                    Dur(d),
                    "must be between 50ms and 1s (the kernel's own SYN timeout)",
                ))
            }
        };
        if let SynTimeout::Fixed(d) = syn_timeout {
            bounds("syn_timeout", d.0)?;
        }
        bounds("syn_timeout_min", syn_timeout_min.0)?;
        if *syn_retries > lb_common::MAX_SYN_RETRIES {
            return Err(ConfigError::invalid(
                format!("{key}.syn_retries"),
                syn_retries,
                "must be at most 127 (the kernel's TCP_SYNCNT limit); 0 keeps net.ipv4.tcp_syn_retries",
            ));
        }
        Ok(())
    }

    /// The SYN timeout for a server whose measured connect round trip is `rtt`.
    pub fn timeout_for(&self, rtt: Option<Duration>) -> Duration {
        match self.syn_timeout {
            SynTimeout::Fixed(d) => d.0,
            SynTimeout::Auto => rtt.map_or(SYN_TIMEOUT_MAX, |r| {
                (r * RTT_FACTOR).clamp(self.syn_timeout_min.0.min(SYN_TIMEOUT_MAX), SYN_TIMEOUT_MAX)
            }),
        }
    }
}
