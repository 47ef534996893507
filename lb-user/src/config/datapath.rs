//! `[datapath]`: how lb forwards (the kernel splice, the copy path, connect-time), where its
//! programs attach and pin, and the defaults its balancers take.

use std::{fmt, path::PathBuf, time::Duration};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{DEFAULT_MAX_BUFFERED_BYTES, Dur, FailFastConfig};

/// Data path choice.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum, JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum DatapathMode {
    /// Kernel splice when it can be attached, otherwise userspace with a warning saying why.
    #[default]
    Auto,
    /// Kernel splice or fail with the reason.
    Bpf,
    /// Copy in userspace only.
    Userspace,
}

impl fmt::Display for DatapathMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DatapathMode::Auto => "auto",
            DatapathMode::Bpf => "bpf",
            DatapathMode::Userspace => "userspace",
        })
    }
}

/// How a balancer's clients reach their server.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum, JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Forwarding {
    /// `Connect` where the running kernel has the connect-time hooks and the balancer dials
    /// no HTTP CONNECT `proxy`, otherwise `Splice`; the daemon logs which, and why, once.
    #[default]
    Auto,
    /// Through lb: it accepts, dials the server and splices (or copies) the bytes.
    Splice,
    /// Decided at `connect()`: the kernel's cgroup connect programs send clients in lb's cgroup
    /// straight to the chosen server (kernel 5.8+); others still take the splice path.
    Connect,
}

impl fmt::Display for Forwarding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Forwarding::Auto => "auto",
            Forwarding::Splice => "splice",
            Forwarding::Connect => "connect",
        })
    }
}

/// Which network namespaces a balancer's kernel programs act in.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum, JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Namespaces {
    /// lb's own, where its listeners live: a client in another network namespace (a pod) that
    /// dials the listener's address reaches that address in its own namespace, untouched.
    #[default]
    Own,
    /// Every network namespace under the cgroup: a pod's connect to the listener's address is
    /// rewritten (`connect`) and its socket registered for the splice (`splice`).
    All,
}

impl fmt::Display for Namespaces {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Namespaces::Own => "own",
            Namespaces::All => "all",
        })
    }
}

/// `[datapath]`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct DatapathConfig {
    /// auto | bpf | userspace.
    pub mode: DatapathMode,
    /// cgroup v2 directory to attach sockops to; detected from /proc/mounts when absent.
    pub cgroup: Option<PathBuf>,
    /// Bound on bytes queued toward one server per connection (bytes); default 4 MiB.
    pub max_buffered_bytes: u64,
    /// Size of one userspace copy buffer (bytes); default 256 KiB.
    pub copy_buffer_bytes: usize,
    /// Let blocking clients keep splicing when the server socket is full (the kernel makes them
    /// wait for room, as on a direct connection); default true. Turn off for clients that send
    /// with `MSG_DONTWAIT` on blocking sockets and then poll: the program cannot see per-send
    /// flags, and such a client would spin while the server socket is full.
    pub blocking_splice: bool,
    /// Default `forwarding` of balancers that set none: auto (default) | splice | connect.
    pub forwarding: Forwarding,
    /// Default `namespaces` of balancers that set none: own (default) | all.
    pub namespaces: Namespaces,
    /// Directory in a bpffs where the connect-time programs' links and maps are pinned, so they
    /// outlive lb (one lb per directory); `<bpffs>/lb/default` when absent (connect-time runs
    /// unpinned, dying with lb, when no bpffs is mounted).
    pub pin_dir: Option<PathBuf>,
    /// How long pinned connect-time programs go on rewriting after lb's last heartbeat; then
    /// they leave connects alone. Default 10 minutes, at least 2 s.
    pub orphan_timeout: Dur,
    /// Default `fail_fast` of connect-time balancers that set none.
    pub fail_fast: FailFastConfig,
}

/// Default `datapath.orphan_timeout`: outlasts a pod replacement or a CrashLoopBackOff's
/// longest back-off (5 minutes).
pub const DEFAULT_ORPHAN_TIMEOUT: Duration = Duration::from_secs(600);

impl Default for DatapathConfig {
    fn default() -> Self {
        DatapathConfig {
            mode: DatapathMode::Auto,
            cgroup: None,
            max_buffered_bytes: DEFAULT_MAX_BUFFERED_BYTES,
            copy_buffer_bytes: 256 * 1024,
            blocking_splice: true,
            forwarding: Forwarding::Auto,
            namespaces: Namespaces::Own,
            pin_dir: None,
            orphan_timeout: Dur(DEFAULT_ORPHAN_TIMEOUT),
            fail_fast: FailFastConfig::default(),
        }
    }
}
