//! The admin API's request and response bodies, shared by the server handlers and
//! [`super::client::AdminClient`] (so `lb status`, `lb servers` and `lb check` parse exactly
//! what the daemon sends).

use std::{collections::BTreeMap, net::SocketAddr};

use serde::{Deserialize, Serialize};

use crate::balancer::{DiscoveryStatus, NameStatus, ServerState, ServerStatus};

/// `/status` body.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct StatusBody {
    /// `bpf` or `userspace`.
    pub datapath: String,
    /// Why `auto` fell back, if it did.
    pub datapath_fallback: Option<String>,
    /// Balancers, in config order.
    pub balancers: Vec<BalancerStatus>,
    /// The connect-time pin directory; absent when connect-time is not pinned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pins: Option<PinsStatus>,
}

/// The connect-time pins in `/status`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PinsStatus {
    /// The pin directory (in a bpffs).
    pub dir: std::path::PathBuf,
    /// Whether this lb adopted the maps an earlier lb left there as they were (false: it
    /// pinned its own, or rebuilt them).
    pub adopted: bool,
    /// Why this lb rebuilt the maps an earlier lb left there (another layout or definition);
    /// absent when it did not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebuilt: Option<String>,
    /// How old lb's heartbeat is as the connect programs see it (seconds).
    pub heartbeat_age_seconds: Option<f64>,
}

/// One balancer in `/status`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct BalancerStatus {
    /// Name.
    pub name: String,
    /// Listen addresses.
    pub listen: Vec<SocketAddr>,
    /// Policy (`failover`, `round-robin`, ...).
    pub policy: String,
    /// Forwarding in effect: `splice` (through lb) or `connect` (the kernel sends clients in
    /// lb's cgroup straight to the server at `connect()`). Server `connections` include the
    /// connect-time ones.
    #[serde(default)]
    pub forwarding: String,
    /// Why a balancer configured with `forwarding = "connect"` forwards through lb instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forwarding_fallback: Option<String>,
    /// [`BalancerStatus::forwarding_fallback`]'s kind, as `lb_balancer_forwarding_fallback_info`
    /// labels it: `datapath_off`, `kernel_feature` or `proxy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forwarding_fallback_reason: Option<String>,
    /// Network namespaces the kernel programs act in for this balancer: `own` (lb's, where its
    /// listeners live) or `all` (every namespace under the cgroup).
    #[serde(default)]
    pub namespaces: String,
    /// Servers, in preference order; the default last when it is only STANDBY.
    pub servers: Vec<ServerStatus>,
    /// How host names in the server list resolve: `follow` (re-resolved at their TTL) or
    /// `once` (pinned when they enter the set).
    #[serde(default)]
    pub resolve: String,
    /// Each host name of the server list, the servers it stands for now and its last
    /// resolution; absent when the list names no host.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub names: Vec<NameStatus>,
    /// The discovery source and what it last did; absent without discovery.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub discovery: Option<DiscoveryStatus>,
    /// The connect-time table the kernel programs read now; absent unless the balancer
    /// forwards at connect time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connect_table: Option<ConnectTableStatus>,
    /// What the kernel programs left undone for this balancer's clients, counted since the
    /// programs were loaded; absent on the userspace data path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<KernelCounters>,
}

/// A balancer's clients the kernel programs did not serve as configured, by reason (each
/// reason's label as in the metrics, every reason present).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct KernelCounters {
    /// Client sockets the sockops program could not register for the splice (they take the
    /// copy path): `flows_map`, `netns_map`, `sockhash`. `lb_sockops_register_failures_total`.
    pub register_failures: BTreeMap<String, u64>,
    /// Connects to a connect-time listener left as they were (the client reaches lb's
    /// listener): `orphaned`, `no_servers`, `family`, `record_map`.
    /// `lb_connect_unrewritten_total`.
    pub unrewritten_connects: BTreeMap<String, u64>,
    /// Sockets of another network namespace left alone: `connect`, `sockops`.
    /// `lb_netns_skipped_total`.
    pub netns_skipped: BTreeMap<String, u64>,
}

impl From<&lb_common::BalancerStats> for KernelCounters {
    fn from(st: &lb_common::BalancerStats) -> Self {
        use lb_common::{RegisterFailure, Unrewritten};
        KernelCounters {
            register_failures: by_label(
                RegisterFailure::ALL.map(|r| (r.label(), st.register_failures[r as usize])),
            ),
            unrewritten_connects: by_label(
                Unrewritten::ALL.map(|r| (r.label(), st.unrewritten[r as usize])),
            ),
            netns_skipped: by_label([
                ("connect", st.netns_skipped_connects),
                ("sockops", st.netns_skipped_sockets),
            ]),
        }
    }
}

fn by_label(counts: impl IntoIterator<Item = (&'static str, u64)>) -> BTreeMap<String, u64> {
    counts
        .into_iter()
        .map(|(l, n)| (l.to_string(), n))
        .collect()
}

/// A connect-mode balancer's table as the kernel holds it (read from the maps, not from lb's
/// memory).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ConnectTableStatus {
    /// The current generation (`LB_CONNECT_CURRENT`): it grows by one with each table lb
    /// writes, and the table is in slot `generation % 8`.
    pub generation: u32,
    /// The servers the programs choose from, best first.
    pub servers: Vec<SocketAddr>,
}

/// Body of every error answer (4xx and 5xx but the probes'): `{"error": "..."}`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ErrorBody {
    /// What was wrong, naming the offending input.
    pub error: String,
}

/// `PUT /balancers/NAME/servers`: the whole server set. An absent `default` means no default
/// server (the set is replaced as a whole).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SetServersRequest {
    /// `host:port` entries in order of preference; must not be empty.
    pub servers: Vec<String>,
    /// Server of last resort.
    #[serde(default)]
    pub default: Option<String>,
}

/// `POST /balancers/NAME/servers`: add one server at the end of the set.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AddServerRequest {
    /// `host:port`.
    pub server: String,
}

/// Answer of the server set changes (`PUT`, `POST` and `DELETE` on `/balancers/NAME/servers`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ServersResponse {
    /// Balancer name.
    pub balancer: String,
    /// Whether the set changed (an identical `PUT` changes nothing).
    pub changed: bool,
    /// The servers after the change.
    pub servers: Vec<ServerStatus>,
}

/// Answer of `POST /balancers/NAME/servers/ADDR/{drain,disable,enable,kill}`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ActionResponse {
    /// Balancer name.
    pub balancer: String,
    /// The server as given.
    pub server: String,
    /// `drain`, `disable`, `enable` or `kill`.
    pub action: String,
    /// Connections reset by this action (`disable` and `kill`).
    pub killed: usize,
    /// The servers after the action.
    pub servers: Vec<ServerStatus>,
}

/// `/check` body (with status 200 when `healthy`, else 503).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CheckReport {
    /// Every balancer checked has a usable server and the run finished within the timeout.
    pub healthy: bool,
    /// The caller's timeout passed before the run finished.
    pub timed_out: bool,
    /// The timeout applied after clamping, in milliseconds.
    pub timeout_ms: u64,
    /// How long this caller waited, in milliseconds.
    pub elapsed_ms: u64,
    /// This caller joined a run another caller had started.
    pub shared: bool,
    /// Per balancer results.
    pub balancers: Vec<BalancerCheck>,
}

/// One balancer in a [`CheckReport`].
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct BalancerCheck {
    /// Name.
    pub name: String,
    /// It has a usable (HEALTHY, PREFERRED or ACTIVE) server after the run.
    pub healthy: bool,
    /// Per server results.
    pub servers: Vec<ServerCheck>,
}

/// One server in a [`CheckReport`].
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ServerCheck {
    /// `host:port`.
    pub address: String,
    /// This run's result: `true` passed, `false` failed, `null` not finished when the caller
    /// stopped waiting.
    pub ok: Option<bool>,
    /// State after the run (rise/fall applied).
    pub state: ServerState,
    /// This run's error, when it failed.
    pub error: Option<String>,
}
