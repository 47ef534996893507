//! A balancer's server states across `lb upgrade`: what the old process knew of each server
//! (state, rise/fall counts, last check and error, holds, how long it has been PREFERRED or
//! draining) is written into the new process's servers of the same address, so no server
//! starts over as UNCHECKED and no count toward `rise` or `fall` is lost. Across a restart
//! that adopts connect-time pins, what the earlier lb left is its last table: a server it had
//! taken out starts FAILED ([`Balancer::hold_out`]).

use std::time::{Duration, Instant, UNIX_EPOCH};

use tracing::info;

use super::Balancer;
use crate::handover::ServerSnapshot;

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Balancer {
    /// Every server as this process knows it now.
    pub fn snapshot_servers(&self) -> Vec<ServerSnapshot> {
        let now = Instant::now();
        self.lock()
            .servers
            .iter()
            .map(|s| ServerSnapshot {
                address: s.addr.to_string(),
                state: s.state,
                hold: s.hold,
                consecutive_failures: s.consecutive_failures,
                consecutive_successes: s.consecutive_successes,
                passive_resets: s.passive_resets,
                last_check: s
                    .last_check
                    .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                    .map(|d| d.as_secs_f64()),
                last_check_age_ms: s.last_check_at.map(|t| millis(now - t)),
                last_error: s.last_error.clone(),
                preferred_for_ms: s.preferred_since.map(|t| millis(now - t)),
                has_failed: s.has_failed,
                drain_left_ms: s
                    .drain_deadline
                    .map(|t| millis(t.saturating_duration_since(now))),
            })
            .collect()
    }

    /// Start each server of this balancer whose address `keep` rejects as FAILED, with `why`
    /// as its last error, so it enters the table only once a check passes (a connect-time
    /// balancer that adopted pins: the servers missing from the table the earlier lb left,
    /// which it had failed or removed). Returns how many.
    pub fn hold_out(&self, keep: impl Fn(std::net::SocketAddr) -> bool, why: &str) -> usize {
        let mut held = 0;
        {
            let mut inner = self.lock();
            for s in inner.servers.iter_mut().filter(|s| s.in_set) {
                let Some(addr) = s.addr.socket_addr() else {
                    continue;
                };
                if keep(addr) || s.state != crate::server_state::ServerState::Unchecked {
                    continue;
                }
                super::state::transition(
                    &self.name,
                    s,
                    crate::server_state::ServerState::Failed,
                    why,
                );
                s.last_error = Some(why.to_string());
                held += 1;
            }
        }
        if held > 0 {
            self.bump();
        }
        held
    }

    /// Take the old process's view of the servers this balancer also has (same address);
    /// servers it did not know keep their fresh state. Returns how many were restored.
    pub fn restore_servers(&self, snapshot: &[ServerSnapshot]) -> usize {
        let now = Instant::now();
        let ago = |ms: u64| now.checked_sub(Duration::from_millis(ms)).unwrap_or(now);
        let mut restored = 0;
        {
            let mut inner = self.lock();
            for s in &mut inner.servers {
                let addr = s.addr.to_string();
                let Some(old) = snapshot.iter().find(|o| o.address == addr) else {
                    continue;
                };
                s.state = old.state;
                s.hold = old.hold;
                s.consecutive_failures = old.consecutive_failures;
                s.consecutive_successes = old.consecutive_successes;
                s.passive_resets = old.passive_resets;
                s.last_check = old
                    .last_check
                    .map(|secs| UNIX_EPOCH + Duration::from_secs_f64(secs.max(0.0)));
                s.last_check_at = old.last_check_age_ms.map(ago);
                s.last_error.clone_from(&old.last_error);
                s.preferred_since = old.preferred_for_ms.map(ago);
                s.has_failed = old.has_failed;
                s.drain_deadline = old.drain_left_ms.map(|ms| now + Duration::from_millis(ms));
                restored += 1;
            }
        }
        info!(balancer = %self.name, restored, "server states taken over");
        self.bump();
        restored
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server_state::ServerState;
    use crate::{
        addr::ServerAddr,
        config::{Config, Overrides},
    };

    fn balancer() -> std::sync::Arc<Balancer> {
        let o = Overrides {
            listen: vec!["127.0.0.1:6444".parse().unwrap()],
            servers: ["198.18.0.2:1", "198.18.0.3:1", "198.18.0.4:1"]
                .iter()
                .map(|s| ServerAddr::parse(s).unwrap())
                .collect(),
            ..Overrides::default()
        };
        Balancer::new(0, Config::load(None, &o).unwrap().balancers.remove(0))
    }

    /// A new balancer takes every state and count the old one had: a RECOVERING server stays one
    /// pass short of `rise`, a FAILED one keeps its failures and error.
    #[test]
    fn states_and_counts_carry_over() {
        let old = balancer();
        let s = |a: &str| ServerAddr::parse(a).unwrap();
        for _ in 0..2 {
            old.record_check(&s("198.18.0.2:1"), Ok(()));
        }
        old.record_dial(&s("198.18.0.2:1"), Ok(()));
        old.record_check(&s("198.18.0.3:1"), Err("refused".into()));
        old.record_check(&s("198.18.0.4:1"), Ok(()));
        let snap = old.snapshot_servers();
        let new = balancer();
        assert_eq!(new.restore_servers(&snap), 3);
        let view = |b: &Balancer| {
            b.status()
                .into_iter()
                .map(|s| {
                    (
                        s.address.to_string(),
                        s.state,
                        s.consecutive_failures,
                        s.last_error,
                    )
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(view(&old), view(&new));
        assert_eq!(new.status()[0].state, ServerState::Active);
        assert_eq!(new.status()[1].state, ServerState::Failed);
        assert_eq!(new.status()[2].state, ServerState::Recovering);
        // One more pass: the RECOVERING server reaches `rise` (2) in the new balancer too.
        new.record_check(&s("198.18.0.4:1"), Ok(()));
        assert_eq!(new.status()[2].state, ServerState::Preferred);
    }
}
