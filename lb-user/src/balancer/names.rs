//! The host names of a balancer's set and what their resolution last did, for `/status` and
//! `lb status` (the resolving itself is `discovery::names`).

use serde::{Deserialize, Serialize};

use super::Balancer;
use crate::addr::{Host, ServerAddr};

/// One host name of the set (`servers` or `default_server`) and its resolution.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct NameStatus {
    /// The entry, `name:port`.
    pub name: String,
    /// The servers it stands for now: `name:port (address)` each, or the name alone while it
    /// resolved to nothing (then resolved at each dial).
    pub addresses: Vec<ServerAddr>,
    /// Last resolution that gave addresses, seconds since the Unix epoch (`None`: only the
    /// resolution made when the name entered the set).
    pub last_resolved: Option<f64>,
    /// Error of the last resolution, when it failed (cleared by a success); the addresses
    /// then stay as they were.
    pub last_error: Option<String>,
    /// When the last failed resolution ended, seconds since the Unix epoch.
    pub last_error_at: Option<f64>,
}

impl Balancer {
    /// The entries of the set that are host names (`servers`, then `default_server` when it
    /// is not among them), in order.
    pub fn name_entries(&self) -> Vec<ServerAddr> {
        let set = self.lock().set();
        set.servers
            .iter()
            .chain(set.default.iter().filter(|d| !set.servers.contains(d)))
            .filter(|s| matches!(s.host(), Host::Name(_)) && s.pin().is_none())
            .cloned()
            .collect()
    }

    /// Every host name of the set with the servers it stands for and its last resolution.
    pub fn names_status(&self) -> Vec<NameStatus> {
        let recorded = self.names.lock().unwrap_or_else(|p| p.into_inner()).clone();
        self.name_entries()
            .into_iter()
            .map(|origin| {
                let mut st = recorded
                    .iter()
                    .find(|n| n.name == origin.as_str())
                    .cloned()
                    .unwrap_or_default();
                st.name = origin.to_string();
                st.addresses = self.addresses_of(&origin).unwrap_or_default();
                st
            })
            .collect()
    }

    /// Update what the resolution of `origin` last did (the resolving task, after each run);
    /// names no longer in the set are forgotten.
    pub fn record_name(&self, origin: &ServerAddr, f: impl FnOnce(&mut NameStatus)) {
        let entries = self.name_entries();
        let mut names = self.names.lock().unwrap_or_else(|p| p.into_inner());
        names.retain(|n| entries.iter().any(|e| e.as_str() == n.name));
        let i = match names.iter().position(|n| n.name == origin.as_str()) {
            Some(i) => i,
            None => {
                names.push(NameStatus {
                    name: origin.to_string(),
                    ..NameStatus::default()
                });
                names.len() - 1
            }
        };
        f(&mut names[i]);
    }
}
