//! What a starting lb does with the connect-time pins an earlier lb left, beyond loading: it
//! finishes a rebuild of pinned maps once its own state is in the new ones, and when none of
//! its balancers forwards connect-time it detaches and removes the pins once its own listeners
//! serve, so a restart with `forwarding = "splice"` or `mode = "userspace"` turns connect-time
//! off at once instead of leaving the last table rewriting connects until `orphan_timeout`.

use std::{sync::Arc, time::Duration};

use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::Daemon;
use crate::config::{Config, DatapathMode, Forwarding};

/// How long a rebuild waits for every connect-time balancer's first table before it swaps the
/// pinned links anyway (a table task stuck on the kernel would otherwise keep the old programs
/// for good).
const TABLES_WAIT: Duration = Duration::from_secs(10);
/// How often it looks.
const TABLES_POLL: Duration = Duration::from_millis(10);

/// The cause logged for a server held out at a start over adopted pins.
const LEFT_OUT: &str = "not in the connect-time table the earlier lb left (it had failed or removed it): held out until a check passes";

impl Daemon {
    /// A fresh start that adopted pinned maps starts where the earlier lb stopped: each
    /// connect-time balancer's servers missing from the table it left are FAILED until a check
    /// passes, so none heads the first table because nothing is known of it yet.
    pub(super) fn hold_out_left_out(&self) {
        let Some(dp) = &self.datapath else {
            return;
        };
        if !dp.pins_status().is_some_and(|p| p.adopted) {
            return;
        }
        for b in self.balancers.load().iter() {
            let connect = self
                .forwarding
                .get(&b.name)
                .is_some_and(|f| f.0 == Forwarding::Connect);
            let Some((generation, servers)) = dp.connect_table(b.id).filter(|_| connect) else {
                continue;
            };
            if generation == 0 {
                continue;
            }
            let held = b.hold_out(|a| servers.contains(&a), LEFT_OUT);
            if held > 0 {
                info!(balancer = %b.name, held, generation, "servers the earlier lb had taken out of the table start FAILED");
            }
        }
    }

    /// When the data path rebuilt pinned maps, swap the pinned links to this lb's programs once
    /// (after `go`) every connect-time balancer's first table is written into the new maps (its
    /// listeners are written before the tables start), or after [`TABLES_WAIT`].
    pub(super) fn spawn_takeover(self: &Arc<Self>, go: &CancellationToken) {
        let Some(dp) = self.datapath.clone() else {
            return;
        };
        if !dp.takeover_pending() {
            return;
        }
        let ids: Vec<u32> = self
            .balancers
            .load()
            .iter()
            .filter(|b| {
                self.forwarding
                    .get(&b.name)
                    .is_some_and(|f| f.0 == Forwarding::Connect)
            })
            .map(|b| b.id)
            .collect();
        let go = go.clone();
        self.tasks.spawn(async move {
            go.cancelled().await;
            let began = tokio::time::Instant::now();
            while !dp.connect_tables_written(&ids) && began.elapsed() < TABLES_WAIT {
                tokio::time::sleep(TABLES_POLL).await;
            }
            let waited_ms = began.elapsed().as_millis();
            match dp.finish_takeover() {
                Ok(Some(done)) => {
                    info!(links = done.links, maps = done.maps, defunct = done.defunct, earlier_sockets = done.earlier_sockets, waited_ms, "connect-time: the pinned links run this lb's programs on its maps now (rebuild finished)");
                }
                Ok(None) => {}
                Err(e) => {
                    error!(error = %crate::errors::chain(&e), "connect-time: the rebuild of the pinned maps did not finish; the links not swapped keep their old programs");
                }
            }
        });
    }
}

/// With no balancer forwarding connect-time in `cfg` (splice asked, or the data path off), the
/// pins in lb's pin directory (configured, or the default in the bpffs): detached and removed,
/// logged. Called once this lb's listeners serve, so a connect the pinned programs no longer
/// rewrite lands on lb's listener. A directory another running lb holds is left alone, with a
/// warning.
pub(super) fn remove_unwanted(cfg: &Config, connect_running: bool) {
    if connect_running {
        return;
    }
    let d = &cfg.datapath;
    let Some(dir) = crate::datapath::resolve_dir(d.pin_dir.as_deref()) else {
        return;
    };
    let has_pins = std::fs::read_dir(&dir).is_ok_and(|mut e| e.next().is_some());
    if !has_pins {
        return;
    }
    let why = if d.mode == DatapathMode::Userspace {
        "datapath.mode = userspace"
    } else {
        "no balancer forwards connect-time"
    };
    match crate::datapath::cleanup(&dir) {
        Ok(c) => {
            info!(pin_dir = %dir.display(), links = c.links, maps = c.maps, reason = why, "connect-time is off: the programs an earlier lb pinned are detached and their pins removed");
        }
        Err(e) => {
            warn!(pin_dir = %dir.display(), error = %crate::errors::chain(&e), "connect-time is off, but the pins an earlier lb left cannot be removed; they rewrite connects until their heartbeat is orphan_timeout old (`lb cleanup` removes them)");
        }
    }
}
