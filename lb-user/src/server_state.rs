//! The states K3s gives a server and an operator's hold on one: the vocabulary that `/status`,
//! the metrics, the state file and the `lb upgrade` hand-over share. The transitions live in
//! `balancer::state`.
//!
//! States and their order of preference follow the K3s agent load balancer
//! (`pkg/agent/loadbalancer/servers.go` in k3s-io/k3s).

use std::fmt;

use serde::{Deserialize, Serialize};

/// Server state; the numeric value is the `lb_server_state` metric and the order of preference.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ServerState {
    /// Removed from the set.
    Invalid = 0,
    /// Failed its checks (or a dial); connections closed.
    Failed = 1,
    /// The default server while it is not in the set: used only when nothing else works.
    Standby = 2,
    /// Added, not checked yet.
    Unchecked = 3,
    /// Passed a check after failing; needs `rise` passes.
    Recovering = 4,
    /// Passing checks.
    Healthy = 5,
    /// Recovered recently (fail-back target).
    Preferred = 6,
    /// Passing checks and carrying connections.
    Active = 7,
}

impl ServerState {
    /// Upper-case name as K3s prints it.
    pub fn name(self) -> &'static str {
        match self {
            ServerState::Invalid => "INVALID",
            ServerState::Failed => "FAILED",
            ServerState::Standby => "STANDBY",
            ServerState::Unchecked => "UNCHECKED",
            ServerState::Recovering => "RECOVERING",
            ServerState::Healthy => "HEALTHY",
            ServerState::Preferred => "PREFERRED",
            ServerState::Active => "ACTIVE",
        }
    }

    /// HEALTHY, PREFERRED or ACTIVE: the servers the spreading policies choose from.
    pub fn is_usable(self) -> bool {
        matches!(
            self,
            ServerState::Healthy | ServerState::Preferred | ServerState::Active
        )
    }
}

impl fmt::Display for ServerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An operator's hold on a server.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Hold {
    /// None.
    #[default]
    None,
    /// No new connections; existing ones stay until they end.
    Drain,
    /// No new connections; existing ones were killed.
    Disabled,
}

/// As `/status` writes it: `none`, `drain` or `disabled`.
impl fmt::Display for Hold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Hold::None => "none",
            Hold::Drain => "drain",
            Hold::Disabled => "disabled",
        })
    }
}
