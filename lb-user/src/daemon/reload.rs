//! Config reload (SIGHUP): load the file again, validate it whole, and apply it to the
//! balancers whose config changed; what needs a restart is named and left as it runs.

use std::{path::Path, sync::Arc};

use tracing::{info, warn};

use super::Daemon;
use crate::config::{Config, ConfigError, Overrides};

/// What a reload changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ReloadSummary {
    /// Balancers whose config changed and was applied.
    pub changed: Vec<String>,
    /// Balancers left as they were (identical config).
    pub unchanged: Vec<String>,
    /// Changes that need a restart and were not applied (new or removed balancers, listeners,
    /// admin listeners, `[metrics]`, data path).
    pub need_restart: Vec<String>,
}

/// Load the config again and apply it to the balancers whose config changed; unchanged ones are
/// not touched (their connections stay). Nothing is applied when the new config is invalid.
///
/// # Errors
/// The [`ConfigError`] of the new config; the running config then stays in force.
pub fn reload_config(
    daemon: &Daemon,
    path: Option<&Path>,
    overrides: &Overrides,
) -> Result<ReloadSummary, ConfigError> {
    let mut new = Config::load(path, overrides)?;
    for w in new.warnings() {
        warn!("{w}");
    }
    let old = daemon.config.load_full();
    let mut summary = ReloadSummary::default();
    if new.admin.listen != old.admin.listen || new.admin.unix_socket != old.admin.unix_socket {
        summary
            .need_restart
            .push("[admin] listen or unix_socket".into());
    }
    if new.metrics != old.metrics {
        summary.need_restart.push("[metrics]".into());
    }
    if new.datapath != old.datapath {
        summary.need_restart.push("[datapath]".into());
    }
    for ob in &old.balancers {
        if !new.balancers.iter().any(|nb| nb.name == ob.name) {
            summary
                .need_restart
                .push(format!("removing balancer {}", ob.name));
        }
    }
    // Forwarding is decided at start (programs, listener entries, the table task).
    let new_forwarding = new.datapath.forwarding;
    for nb in &mut new.balancers {
        let Some(b) = daemon.balancer(&nb.name) else {
            summary
                .need_restart
                .push(format!("new balancer {}", nb.name));
            continue;
        };
        let current = b.config();
        if current.listen != nb.listen {
            summary
                .need_restart
                .push(format!("balancer {} listen", nb.name));
            nb.listen.clone_from(&current.listen);
        }
        if nb.forwarding.unwrap_or(new_forwarding) != old.forwarding_of(&current) {
            summary
                .need_restart
                .push(format!("balancer {} forwarding", nb.name));
            nb.forwarding = current.forwarding.or(Some(old.datapath.forwarding));
        }
        if *current == *nb {
            summary.unchanged.push(nb.name.clone());
            continue;
        }
        match b.replace_config(nb.clone()) {
            Ok(_) => summary.changed.push(nb.name.clone()),
            Err(e) => warn!(balancer = %b.name, error = %e, "reload refused for this balancer"),
        }
    }
    // Keep what could not change in the stored config, so it describes what runs.
    new.admin.listen = old.admin.listen;
    new.admin.unix_socket.clone_from(&old.admin.unix_socket);
    new.datapath = old.datapath.clone();
    new.balancers = daemon
        .balancers
        .load()
        .iter()
        .map(|b| (*b.config()).clone())
        .collect();
    daemon.config.store(Arc::new(new));
    // `namespaces` applies to the next connect or socket at once.
    if let Err(e) = daemon.write_namespaces() {
        warn!(error = %format!("{e:#}"), "reload: cannot write the namespace scopes; the previous ones stay");
    }
    Ok(summary)
}

/// SIGHUP: [`reload_config`], logging the outcome; an invalid new config is logged and the old
/// one keeps running.
pub fn reload(daemon: &Daemon, path: Option<&Path>, overrides: &Overrides) {
    match reload_config(daemon, path, overrides) {
        Ok(s) => {
            for what in &s.need_restart {
                warn!(change = %what, "reload: this change needs a restart; not applied");
            }
            info!(changed = ?s.changed, unchanged = ?s.unchanged, "config reloaded");
        }
        Err(e) => warn!(error = %e, "reload refused: config invalid; the running config stays"),
    }
}
