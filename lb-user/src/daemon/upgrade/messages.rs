//! What the old process sends in a hand-over: the Hello with its descriptors (listeners, the
//! kernel data path's maps and links), the frozen connections in batches, and every
//! balancer's servers and counters.

use std::os::{
    fd::{AsFd, BorrowedFd, OwnedFd},
    unix::net::UnixStream,
};

use super::{super::Daemon, CONNS_PER_FRAME};
use crate::{
    handover::{
        self, BalancerSnapshot, ConnSnapshot, DatapathOffer, DirSnapshot, Hello, ListenerKey,
        Message, VERSION,
    },
    metrics::{BalancerLabel, CheckLabels, DirectionLabels, KillLabels},
    proxy::{Dir, Frozen},
};

/// The Hello message and its descriptors.
pub(super) fn hello(d: &Daemon) -> Result<(Hello, Vec<OwnedFd>), String> {
    let mut fds: Vec<OwnedFd> = Vec::new();
    let mut push = |fd: OwnedFd| {
        fds.push(fd);
        fds.len() - 1
    };
    let mut listeners = Vec::new();
    let (mut admin_tcp, mut admin_unix) = (None, None);
    let own = handover::own_listeners().map_err(|e| format!("cannot copy a listener: {e}"))?;
    for (key, fd) in own {
        match key {
            ListenerKey::Proxy(a) => listeners.push((a, push(fd))),
            ListenerKey::AdminTcp(a) => admin_tcp = Some((a, push(fd))),
            ListenerKey::AdminUnix(p) => admin_unix = Some((p, push(fd))),
        }
    }
    let datapath = match &d.datapath {
        None => None,
        Some(dp) => {
            let ex = dp.export().map_err(|e| {
                format!(
                    "cannot hand over the kernel data path (copying BPF map and link descriptors needs CAP_SYS_ADMIN): {}",
                    crate::errors::chain(&e)
                )
            })?;
            let maps = ex
                .maps
                .into_iter()
                .map(|(n, fd)| (n.to_string(), push(fd)))
                .collect();
            let links = ex
                .links
                .into_iter()
                .map(|(n, fd)| (n.to_string(), push(fd)))
                .collect();
            Some(DatapathOffer {
                maps,
                links,
                cgroup: dp.cgroup().to_path_buf(),
                connect_missing: dp.connect_unavailable().map(str::to_string),
            })
        }
    };
    let hello = Hello {
        version: VERSION,
        pid: std::process::id(),
        lb_version: env!("CARGO_PKG_VERSION").into(),
        listeners,
        admin_tcp,
        admin_unix,
        datapath,
        forwarding: {
            let cfg = d.config.load_full();
            cfg.balancers
                .iter()
                .map(|b| (b.name.clone(), cfg.forwarding_of(b).to_string()))
                .collect()
        },
        balancer_ids: d
            .balancers
            .load()
            .iter()
            .map(|b| (b.name.clone(), b.id))
            .collect(),
        retired_balancer_ids: d.retired_ids.clone(),
    };
    Ok((hello, fds))
}

fn dir_snapshot(dir: &Dir) -> DirSnapshot {
    DirSnapshot {
        written: dir.written(),
        chunk: dir.chunk(),
        unwritten: dir.unwritten().len() as u64,
    }
}

/// Send the frozen connections in batches.
pub(super) fn send_conns(
    sock: &UnixStream,
    frozen: &[Frozen],
) -> Result<(), handover::HandoverError> {
    for batch in frozen.chunks(CONNS_PER_FRAME) {
        let mut fds: Vec<BorrowedFd<'_>> = Vec::new();
        let mut raw = Vec::new();
        let mut conns = Vec::new();
        for f in batch {
            fds.push(f.client.as_fd());
            let client_fd = fds.len() - 1;
            let server = f.server.as_ref().map(|(spec, fd)| {
                fds.push(fd.as_fd());
                (spec.to_string(), fds.len() - 1)
            });
            raw.extend_from_slice(f.up.unwritten());
            raw.extend_from_slice(f.down.unwritten());
            conns.push(ConnSnapshot {
                balancer: f.balancer.name.clone(),
                peer: f.peer,
                client_fd,
                server,
                up: dir_snapshot(&f.up),
                down: dir_snapshot(&f.down),
                spliced: f.spliced,
            });
        }
        handover::send(sock, &Message::Conns { conns }, &fds, &raw)?;
    }
    Ok(())
}

/// Every balancer's servers and counters.
pub(super) fn snapshot(d: &Daemon) -> Vec<BalancerSnapshot> {
    let m = &d.metrics;
    d.balancers
        .load()
        .iter()
        .map(|b| {
            let name = b.name.clone();
            let copied = |direction: &str| {
                m.copied_bytes
                    .get(&DirectionLabels {
                        balancer: name.clone(),
                        direction: direction.into(),
                    })
                    .map_or(0, |c| c.get())
            };
            let mut killed = Vec::new();
            let mut checks = Vec::new();
            for server in b.server_specs() {
                for result in ["success", "failure"] {
                    let labels = CheckLabels {
                        balancer: name.clone(),
                        server: server.to_string(),
                        result: result.into(),
                    };
                    if let Some(c) = m.health_checks.get(&labels) {
                        checks.push((labels.server, labels.result, c.get()));
                    }
                }
                for reason in crate::balancer::KillReason::ALL {
                    let labels = KillLabels {
                        balancer: name.clone(),
                        server: server.to_string(),
                        reason: reason.label().into(),
                    };
                    if let Some(c) = m.connections_killed.get(&labels) {
                        killed.push((labels.server, labels.reason, c.get()));
                    }
                }
            }
            BalancerSnapshot {
                servers: b.snapshot_servers(),
                connections_total: m
                    .connections_total
                    .get(&BalancerLabel {
                        balancer: name.clone(),
                    })
                    .map_or(0, |c| c.get()),
                copied_up: copied("client_to_server"),
                copied_down: copied("server_to_client"),
                killed,
                checks,
                name,
            }
        })
        .collect()
}
