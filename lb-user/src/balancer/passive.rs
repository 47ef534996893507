//! A balancer's passive signals: server resets, failed connect-time connects and
//! retransmission timeouts, counted toward `passive_reset_limit` and recorded as failed checks.

use std::{sync::Arc, time::Instant};

use tracing::debug;

use super::{Balancer, Failure};
use crate::addr::ServerAddr;

impl Balancer {
    /// Count a reset of an established connection by `server` (passive signal): with
    /// `health.passive`, every `passive_reset_limit` consecutive resets count as one failed
    /// check. Returns whether one was recorded.
    pub fn record_server_reset(self: &Arc<Self>, server: &ServerAddr) -> bool {
        let cfg = self.config();
        if !cfg.health.passive {
            return false;
        }
        debug!(balancer = %self.name, %server, "server reset a connection; counting toward passive_reset_limit");
        self.record_passive_reset(server, cfg.health.passive_reset_limit)
    }

    /// Count a failed connect-time connect to `server` that was the server's (refused, timed
    /// out, unreachable; the sockets' error says so): with `health.passive`, toward
    /// `passive_reset_limit` like a reset, so one failing client cannot fail a server alone.
    /// Returns whether a failed check was recorded.
    pub fn record_connect_failure(self: &Arc<Self>, server: &ServerAddr) -> bool {
        let cfg = self.config();
        if !cfg.health.passive {
            return false;
        }
        debug!(balancer = %self.name, %server, "connect-time connect failed; counting toward passive_reset_limit");
        self.record_passive_reset(server, cfg.health.passive_reset_limit)
    }

    /// Count a retransmission timeout of a connection to `server` as a reset, at most one per
    /// check interval (`health.interval`): a network blip times out every busy socket at once,
    /// and that is one sign of trouble, not many. Returns whether a failed check was recorded.
    pub fn record_rto(self: &Arc<Self>, server: &ServerAddr) -> bool {
        let cfg = self.config();
        if !cfg.health.passive {
            return false;
        }
        let now = Instant::now();
        {
            let mut inner = self.lock();
            let Some(idx) = inner.index(server) else {
                return false;
            };
            let at = &mut inner.servers[idx].rto_counted_at;
            if at.is_some_and(|t| now.duration_since(t) < cfg.health.interval.0) {
                debug!(balancer = %self.name, %server, "retransmission timeout within the check interval of a counted one; not counted");
                return false;
            }
            *at = Some(now);
        }
        self.record_server_reset(server)
    }

    /// Count a reset by `server`: every `limit` consecutive resets count as one failed check.
    /// Returns whether one was recorded.
    pub fn record_passive_reset(self: &Arc<Self>, server: &ServerAddr, limit: u32) -> bool {
        let due = {
            let mut inner = self.lock();
            let Some(idx) = inner.index(server) else {
                return false;
            };
            let s = &mut inner.servers[idx];
            s.passive_resets += 1;
            let due = s.passive_resets >= limit;
            if due {
                s.passive_resets = 0;
            }
            due
        };
        if due {
            self.record_check(server, Err(Failure::Resets(limit)));
        }
        due
    }

    /// Remember `rtt`, the connect round trip a passing check of `server` measured (its TCP
    /// connect; for a check kept on a tunnel, the ping's round trip).
    pub fn note_rtt(&self, server: &ServerAddr, rtt: std::time::Duration) {
        self.rtts
            .lock()
            .expect("poisoned")
            .insert(server.clone(), rtt);
    }

    /// The last connect round trip [`Balancer::note_rtt`] remembered for `server`.
    pub fn rtt(&self, server: &ServerAddr) -> Option<std::time::Duration> {
        self.rtts.lock().expect("poisoned").get(server).copied()
    }
}
