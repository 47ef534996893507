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
    /// Its balancer is unknown here, a descriptor index or the raw bytes are out of range.
    pub fn adopt_connection(
        &self,
        c: ConnSnapshot,
        fds: &mut HashMap<usize, OwnedFd>,
        raw: &mut &[u8],
        go: &CancellationToken,
    ) -> Result<(), String> {
        let b = self
            .balancer(&c.balancer)
            .ok_or_else(|| format!("no balancer {} here", c.balancer))?;
        let mut take_raw = |n: u64| -> Result<Vec<u8>, String> {
            let n = usize::try_from(n).map_err(|e| e.to_string())?;
            if n > raw.len() {
                return Err("raw bytes short".into());
            }
            let (head, tail) = raw.split_at(n);
            *raw = tail;
            Ok(head.to_vec())
        };
        let up_bytes = take_raw(c.up.unwritten)?;
        let down_bytes = take_raw(c.down.unwritten)?;
        let client = fds
            .remove(&c.client_fd)
            .ok_or("client descriptor missing")?;
        let server = match c.server {
            None => None,
            Some((spec, i)) => {
                let fd = fds.remove(&i).ok_or("server descriptor missing")?;
                let addr = b
                    .server_specs()
                    .into_iter()
                    .find(|s| s.to_string() == spec)
                    .or_else(|| spec.parse::<ServerAddr>().ok())
                    .ok_or_else(|| format!("server {spec} unknown"))?;
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
