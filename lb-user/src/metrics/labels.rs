//! The label sets of lb's own families.

use prometheus_client::encoding::EncodeLabelSet;

/// `{balancer}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BalancerLabel {
    /// Balancer name.
    pub balancer: String,
}

/// `{balancer,server}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServerLabels {
    /// Balancer name.
    pub balancer: String,
    /// Server address.
    pub server: String,
}

/// `{balancer,status}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DialLabels {
    /// Balancer name.
    pub balancer: String,
    /// `ok` or `error`.
    pub status: String,
}

/// `{balancer,server,result}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CheckLabels {
    /// Balancer name.
    pub balancer: String,
    /// Server address.
    pub server: String,
    /// `success` or `failure`.
    pub result: String,
}

/// `{balancer,server,reason}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KillLabels {
    /// Balancer name.
    pub balancer: String,
    /// Server address.
    pub server: String,
    /// [`crate::balancer::KillReason::label`].
    pub reason: String,
}

/// `{balancer,server,kind}` of `lb_passive_events_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PassiveLabels {
    /// Balancer name.
    pub balancer: String,
    /// Server address.
    pub server: String,
    /// [`crate::datapath::PassiveKind::label`]: `connect_failed` or `rto`.
    pub kind: String,
}

/// `{balancer,program}` of `lb_netns_skipped_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NetnsSkipLabels {
    /// Balancer name.
    pub balancer: String,
    /// `connect` (a `connect()` the connect programs did not rewrite) or `sockops` (a socket
    /// sockops did not register for the splice).
    pub program: String,
}

/// `{balancer,forwarding}` of `lb_balancer_forwarding_info`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ForwardingLabels {
    /// Balancer name.
    pub balancer: String,
    /// `splice` or `connect`: the forwarding in effect.
    pub forwarding: String,
}

/// `{balancer,reason}` of `lb_balancer_forwarding_fallback_info`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ForwardingFallbackLabels {
    /// Balancer name.
    pub balancer: String,
    /// `datapath_off`, `kernel_feature` or `proxy`: why a balancer that asked for connect-time
    /// forwards through lb.
    pub reason: String,
}

/// `{balancer,direction}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DirectionLabels {
    /// Balancer name.
    pub balancer: String,
    /// `client_to_server` or `server_to_client`.
    pub direction: String,
}

/// `{balancer,reason}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FallbackLabels {
    /// Balancer name.
    pub balancer: String,
    /// [`lb_common::PassReason::label`].
    pub reason: String,
}

/// `{balancer,reason}` of the kernel's per-reason counters: `lb_sockops_register_failures_total`
/// ([`lb_common::RegisterFailure::label`]) and `lb_connect_unrewritten_total`
/// ([`lb_common::Unrewritten::label`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KernelReasonLabels {
    /// Balancer name.
    pub balancer: String,
    /// The reason's label.
    pub reason: String,
}

/// `{reason}` of `lb_datapath_fallback_info` ([`crate::datapath::FallbackReason::label`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// The reason's label.
    pub reason: String,
}

/// `{mode}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabel {
    /// `bpf` or `userspace`.
    pub mode: String,
}

/// `{dir}` of `lb_connect_pins_adopted`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PinsLabel {
    /// The pin directory.
    pub dir: String,
}

/// Labels of `lb_connections_rejected_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RejectedLabels {
    /// Balancer name.
    pub balancer: String,
    /// `max_connections`.
    pub reason: String,
}

/// Labels of `lb_accept_errors_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AcceptErrorLabels {
    /// Balancer name.
    pub balancer: String,
    /// The error's name, e.g. `EMFILE`.
    pub errno: String,
}

/// `{balancer,kind}` of the discovery gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DiscoveryLabels {
    /// Balancer name.
    pub balancer: String,
    /// `dns`, `etcd` or `file`.
    pub kind: String,
}

/// `{balancer,kind,result}` of `lb_discovery_runs_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DiscoveryRunLabels {
    /// Balancer name.
    pub balancer: String,
    /// `dns`, `etcd` or `file`.
    pub kind: String,
    /// `ok` (a usable list) or `error` (failed or empty; the last good set stayed).
    pub result: String,
}

/// Labels of `lb_clients_refused_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusedLabels {
    /// Balancer name.
    pub balancer: String,
    /// `all_failed` or `all_servers_failed`.
    pub reason: String,
}
