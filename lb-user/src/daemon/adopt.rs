//! The new process's side of `lb upgrade` inside the daemon: it takes the old process's
//! balancer states and counters and serves the connections handed over (the protocol is
//! `cli::takeover`; the old process's side is [`super::upgrade`]).

use std::{collections::HashMap, os::fd::OwnedFd};

use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::Daemon;
use crate::{
    addr::ServerAddr,
    handover::{BalancerSnapshot, ConnSnapshot},
    metrics::{BalancerLabel, CheckLabels, KillLabels},
    proxy::{self, Dir, Frozen},
};

/// Why a handed-over connection cannot be taken (the hand-over is refused, the old lb serves
/// on).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum AdoptError {
    /// Its balancer is not in this lb's configuration.
    #[error("no balancer {0} here")]
    NoBalancer(String),
    /// Its server is neither one of its balancer's nor an address.
    #[error("server {0} unknown")]
    UnknownServer(String),
    /// The descriptor of its client or server socket did not come with the message.
    #[error("{0} descriptor missing")]
    Descriptor(&'static str),
    /// Its unwritten bytes run past the raw bytes that came with the message.
    #[error("raw bytes short")]
    RawShort,
}

impl Daemon {
    /// Take the old process's balancer states and counters (new process, before serving).
    pub fn restore(&self, balancers: &[BalancerSnapshot], first_checks_done: bool) {
        let m = &self.metrics;
        for s in balancers {
            let Some(b) = self.balancer(&s.name) else {
                warn!(balancer = %s.name, "the previous lb had a balancer this config lacks; its state is dropped");
                continue;
            };
            b.restore_servers(&s.servers);
            let label = BalancerLabel {
                balancer: s.name.clone(),
            };
            m.connections_total
                .get_or_create(&label)
                .inc_by(s.connections_total);
            m.copied_counter(&s.name, "client_to_server")
                .inc_by(s.copied_up);
            m.copied_counter(&s.name, "server_to_client")
                .inc_by(s.copied_down);
            for (server, result, n) in &s.checks {
                m.health_checks
                    .get_or_create(&CheckLabels {
                        balancer: s.name.clone(),
                        server: server.clone(),
                        result: result.clone(),
                    })
                    .inc_by(*n);
            }
            for (server, reason, n) in &s.killed {
                m.connections_killed
                    .get_or_create(&KillLabels {
                        balancer: s.name.clone(),
                        server: server.clone(),
                        reason: reason.clone(),
                    })
                    .inc_by(*n);
            }
        }
        if first_checks_done {
            self.first_checks_done
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Serve a handed-over connection once `go` fires. `raw` holds its unwritten bytes
    /// (client→server first) and is advanced past them.
    ///
    /// # Errors
    /// [`AdoptError`]: its balancer or server is unknown here, a descriptor is missing, or the
    /// raw bytes are short.
    pub fn adopt_connection(
        &self,
        c: ConnSnapshot,
        fds: &mut HashMap<usize, OwnedFd>,
        raw: &mut &[u8],
        go: &CancellationToken,
    ) -> Result<(), AdoptError> {
        let b = self
            .balancer(&c.balancer)
            .ok_or_else(|| AdoptError::NoBalancer(c.balancer.clone()))?;
        let mut take_raw = |n: u64| -> Result<Vec<u8>, AdoptError> {
            let n = usize::try_from(n)
                .ok()
                .filter(|n| *n <= raw.len())
                .ok_or(AdoptError::RawShort)?;
            let (head, tail) = raw.split_at(n);
            *raw = tail;
            Ok(head.to_vec())
        };
        let up_bytes = take_raw(c.up.unwritten)?;
        let down_bytes = take_raw(c.down.unwritten)?;
        let client = fds
            .remove(&c.client_fd)
            .ok_or(AdoptError::Descriptor("client"))?;
        let server = match c.server {
            None => None,
            Some((spec, i)) => {
                let fd = fds.remove(&i).ok_or(AdoptError::Descriptor("server"))?;
                let addr = b
                    .server_specs()
                    .into_iter()
                    .find(|s| s.to_string() == spec)
                    .or_else(|| spec.parse::<ServerAddr>().ok())
                    .ok_or(AdoptError::UnknownServer(spec))?;
                Some((addr, fd))
            }
        };
        let f = Frozen {
            balancer: b,
            peer: c.peer,
            client,
            server,
            up: Dir::resumed(c.up.written, c.up.chunk, up_bytes),
            down: Dir::resumed(c.down.written, c.down.chunk, down_bytes),
            spliced: c.spliced,
        };
        proxy::adopt(&self.proxy, f, go.clone());
        Ok(())
    }
}
