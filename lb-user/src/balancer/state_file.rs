//! The state file: a balancer's server set and default, kept across restarts (K3s keeps the
//! same in its agent's state file), and the rule for which list wins at start.
//!
//! The rule, the same at start and on SIGHUP: **the config file's server list wins when it
//! changed since lb last applied it; otherwise the running set stands** (what the admin API, an
//! operator's tooling or the cluster set). So an API change survives a restart and a reload that
//! touched other keys, as HAProxy keeps runtime changes across a reload unless the file's own
//! server line changed; and an edit of `servers`/`default_server` always takes effect. To know
//! whether the config changed, the file records the config's list it was written under.

use std::path::Path;

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::{
    addr::{ServerAddr, validate_set},
    config::BalancerConfig,
};

/// A server list and its default.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ServerSet {
    /// Servers in order of preference.
    pub servers: Vec<ServerAddr>,
    /// Default server.
    pub default: Option<ServerAddr>,
}

impl ServerSet {
    /// The set a balancer config names.
    pub fn of_config(cfg: &BalancerConfig) -> ServerSet {
        ServerSet {
            servers: cfg.servers.clone(),
            default: cfg.default_server.clone(),
        }
    }
}

/// What the file holds (JSON).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct StateFile {
    /// The running set: servers in order.
    pub servers: Vec<ServerAddr>,
    /// The running default server.
    pub default: Option<ServerAddr>,
    /// The config's own list when this was written; absent in files of older versions, which
    /// then lose to the config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub configured: Option<ServerSet>,
}

/// The set a balancer starts with: the state file's when the config's list is the one the file
/// was written under (see the module's rule), else the config's.
pub fn initial_set(cfg: &BalancerConfig) -> ServerSet {
    let configured = ServerSet::of_config(cfg);
    let Some(path) = &cfg.state_file else {
        return configured;
    };
    match read(path) {
        Ok(Some(saved)) if saved.configured.as_ref() == Some(&configured) => {
            if validate_set(&saved.servers, saved.default.as_ref(), &cfg.listen).is_ok()
                && !saved.servers.is_empty()
            {
                info!(balancer = %cfg.name, file = %path.display(), servers = ?saved.servers, "loaded state file");
                return ServerSet {
                    servers: saved.servers,
                    default: saved.default,
                };
            }
            warn!(balancer = %cfg.name, file = %path.display(), "state file holds an unusable set; using the config's");
        }
        Ok(Some(_)) => {
            info!(balancer = %cfg.name, file = %path.display(), "the config's server list changed since the state file was written; using the config's")
        }
        Ok(None) => {}
        Err(e) => {
            warn!(balancer = %cfg.name, file = %path.display(), error = %e, "state file unreadable; it will be rewritten")
        }
    }
    configured
}

/// Read a state file; `Ok(None)` when it does not exist.
///
/// # Errors
/// I/O or JSON errors, as text (the caller warns and rewrites).
pub fn read(path: &Path) -> Result<Option<StateFile>, String> {
    match crate::files::read_limited(path, crate::files::INPUT_LIMIT) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| format!("corrupt: {e}")),
        Err(crate::files::ReadError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// Write a state file atomically and privately: temporary file in the same directory (mode
/// 0600), fsync, rename, fsync of the directory ([`crate::files::write_private`]).
///
/// # Errors
/// I/O errors (a full or read-only file system); the old file is kept and the temporary file
/// removed.
pub fn write(path: &Path, state: &StateFile) -> std::io::Result<()> {
    let bytes = serde_json::to_vec_pretty(state).map_err(std::io::Error::other)?;
    crate::files::write_private(path, &bytes)
}
