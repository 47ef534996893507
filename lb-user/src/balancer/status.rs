//! What a balancer reports: each server's status and its discovery source's for `/status`,
//! `lb status` and metrics, and what a check result did.

use serde::{Deserialize, Serialize};

use super::{Hold, ServerState};
use crate::addr::ServerAddr;

/// A server's status for `/status`, `lb status` and metrics.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ServerStatus {
    /// `host:port`, normalised.
    pub address: ServerAddr,
    /// State name.
    pub state: ServerState,
    /// Whether it is the default server.
    pub default: bool,
    /// Operator hold.
    pub hold: Hold,
    /// Open connections.
    pub connections: usize,
    /// Consecutive failed checks.
    pub consecutive_failures: u32,
    /// Last check time, seconds since the Unix epoch.
    pub last_check: Option<f64>,
    /// Last check error.
    pub last_error: Option<String>,
    /// Connect-time: the kernel marked it suspect (its SYNs went unanswered) and no check
    /// passed since; new connects avoid it while another server is usable.
    #[serde(default)]
    pub suspect: bool,
}

/// What a balancer's discovery source last did, for `/status`, `lb status` and metrics.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct DiscoveryStatus {
    /// `dns`, `etcd` or `file`.
    pub kind: String,
    /// What is asked: `name:port`, the endpoints, or the path.
    pub source: String,
    /// Time between two runs, in seconds.
    pub interval_seconds: f64,
    /// Last run that gave a usable list, seconds since the Unix epoch.
    pub last_success: Option<f64>,
    /// Servers in the last usable list.
    pub servers: usize,
    /// Error of the last run, when it failed (cleared by a success).
    pub last_error: Option<String>,
    /// When the last failed run ended, seconds since the Unix epoch.
    pub last_error_at: Option<f64>,
    /// Runs that gave a usable list.
    pub runs_ok: u64,
    /// Runs that failed or gave an empty list (the last good set stayed).
    pub runs_failed: u64,
}

/// What a check result did, for the caller (kills are already done).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CheckOutcome {
    /// Old state.
    pub from: Option<ServerState>,
    /// New state.
    pub to: Option<ServerState>,
    /// Connections killed.
    pub killed: usize,
}
