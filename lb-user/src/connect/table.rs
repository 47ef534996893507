//! Connect-time balancing in the daemon: each connect-mode balancer's table kept current in
//! the kernel, the kills of its servers' direct sockets, and the passive health events its
//! sockets report.

use std::{net::SocketAddr, sync::Arc};

use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::Daemon;
use crate::{
    addr::ServerAddr,
    balancer::{Balancer, KillReason},
    config::Policy,
    datapath::{ConnectPolicy, Datapath, DatapathError, PassiveKind, PassiveSink, TableWrite},
    metrics::{KillLabels, Metrics, PassiveLabels},
};

/// A server whose connect-time sockets are to be ended, and why.
pub(super) type DirectKill = (ServerAddr, KillReason);

/// After a kill or abort swept a server's sockets, how long until it sweeps once more: a
/// connect program that read the table just before it was rewritten records its socket a
/// moment later, possibly after the first sweep's snapshot.
const SWEEP_AGAIN_AFTER: std::time::Duration = std::time::Duration::from_millis(200);

/// How often the count keys of servers gone from the table are looked at again: a key whose
/// server left while its last socket was still open reaches 0 only when that socket closes,
/// after the table write that dropped the server.
const PRUNE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Keep balancer `b`'s connect-time table current: written now and after every change of its
/// servers' states, set or config, until `stop`; every [`PRUNE_EVERY`] the count keys of
/// servers no longer in it whose sockets all closed are deleted. Kills of a server's connections arrive on
/// `kills`: the table is rewritten first (so a client that reconnects at once is not sent back
/// to that server), then the sockets the kernel sent there are destroyed, twice
/// ([`SWEEP_AGAIN_AFTER`]).
pub(super) async fn sync_table(
    b: Arc<Balancer>,
    dp: Arc<Datapath>,
    metrics: Arc<Metrics>,
    mut kills: tokio::sync::mpsc::UnboundedReceiver<DirectKill>,
    (stop, fail_fast_default): (CancellationToken, super::failfast::DefaultConfig),
) {
    let hz = tokio::task::spawn_blocking(crate::datapath::kernel_hz)
        .await
        .ok()
        .flatten();
    if hz.is_none() {
        warn!(balancer = %b.name, "connect-time: the kernel's HZ cannot be measured (no /proc/timer_list, no /boot/config-*); SYN timeouts stay the kernel's 1 s");
    }
    let mut fail_fast = super::failfast::FailFast::new(fail_fast_default, hz);
    let mut ff_tick = tokio::time::interval(super::failfast::TICK);
    ff_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut changed = b.changed.subscribe();
    let mut last: Option<(ConnectPolicy, Vec<SocketAddr>)> = None;
    let mut failed: std::collections::HashSet<ServerAddr> = std::collections::HashSet::new();
    let mut prune = tokio::time::interval(PRUNE_EVERY);
    prune.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        write_table(&b, &dp, &mut last).await;
        abort_newly_failed(&b, &dp, &metrics, &mut failed);
        tokio::select! {
            () = stop.cancelled() => return,
            r = changed.changed() => if r.is_err() { return },
            _ = ff_tick.tick() => {
                if let Some((_, servers)) = &last {
                    fail_fast.tick(&b, &dp, &metrics, servers);
                }
            }
            _ = prune.tick() => {
                if let Some((_, servers)) = &last {
                    let pruned = dp.prune_connect_counts(b.id, servers);
                    if pruned > 0 {
                        debug!(balancer = %b.name, pruned, "count keys of servers gone from the table deleted once their sockets closed");
                    }
                }
            }
            k = kills.recv() => {
                let Some((server, reason)) = k else { return };
                // Rewrite the table before the kill (the loop does it when the state moved).
                write_table(&b, &dp, &mut last).await;
                // Sweep again only when no new connect can be sent there: a server still in
                // the table (`lb servers kill`, a failback) gets new, wanted connections.
                let gone = server.socket_addr().is_some_and(|a| {
                    last.as_ref().is_none_or(|l| !l.1.contains(&a))
                });
                let (dp, metrics, name, id) = (dp.clone(), metrics.clone(), b.name.clone(), b.id);
                drop(tokio::task::spawn_blocking(move || {
                    kill_direct(&dp, &metrics, &name, id, &server, reason, gone);
                }));
            }
        }
    }
}

/// Write `b`'s connect-time table when it differs from `last` (the last one written), then
/// delete the count keys of servers no longer in it.
///
/// A table goes into the next of the balancer's `TABLE_SLOTS` slots, which may be written only
/// once it has not been current for `SLOT_REUSE_AFTER_MS` (so no program reads it torn, see
/// `lb_common::MAP_CONNECT_TABLES`): state changes that come faster than that wait here
/// (a tokio sleep), and what is written after the wait is the state then, so changes in
/// between are folded into one table.
async fn write_table(
    b: &Arc<Balancer>,
    dp: &Datapath,
    last: &mut Option<(ConnectPolicy, Vec<SocketAddr>)>,
) {
    loop {
        let policy = match b.config().policy {
            Policy::Failover => ConnectPolicy::First,
            Policy::RoundRobin => ConnectPolicy::RoundRobin,
            Policy::Random => ConnectPolicy::Random,
            Policy::LeastConnections => ConnectPolicy::LeastConnections,
        };
        let servers: Vec<SocketAddr> = b
            .connect_table()
            .iter()
            .filter_map(ServerAddr::socket_addr)
            .collect();
        let now = (policy, servers);
        if last.as_ref() == Some(&now) {
            return;
        }
        match dp.set_connect_table(b.id, now.0, &now.1) {
            Ok(w) => {
                let list: Vec<String> = now.1.iter().map(ToString::to_string).collect();
                let servers = list.join(",");
                match w {
                    TableWrite::Written {
                        generation,
                        slot,
                        idle,
                    } => {
                        // `slot_idle_ms=never`: the slot was not current since lb tracks it.
                        let idle =
                            idle.map_or_else(|| "never".to_string(), |d| d.as_millis().to_string());
                        info!(balancer = %b.name, policy = ?now.0, %servers, generation, slot, slot_idle_ms = %idle, "connect-time table updated");
                    }
                    TableWrite::Unchanged { generation } => {
                        info!(balancer = %b.name, policy = ?now.0, %servers, generation, "connect-time table updated (already current)");
                    }
                }
                let pruned = dp.prune_connect_counts(b.id, &now.1);
                debug!(balancer = %b.name, pruned, "count keys of servers gone from the table deleted");
            }
            Err(DatapathError::TableSlotBusy { wait, .. }) => {
                debug!(balancer = %b.name, wait_ms = wait.as_millis(), "connect-time table: waiting for a slot no program can still read");
                tokio::time::sleep(wait).await;
                continue;
            }
            Err(e) => {
                warn!(balancer = %b.name, error = %crate::errors::chain(&e), "cannot write the connect-time table");
            }
        }
        *last = Some(now);
        break;
    }
}

/// A server of `b` that just turned FAILED (not in `failed`, which is updated): with
/// `on_unhealthy = "kill"` its kill aborts every connect-time socket sent there; otherwise the
/// connects still in `SYN_SENT` are aborted here, so no client waits out the kernel's SYN
/// retries. Call after the table write, so no new connect is sent there once the abort looked.
fn abort_newly_failed(
    b: &Balancer,
    dp: &Arc<Datapath>,
    metrics: &Arc<Metrics>,
    failed: &mut std::collections::HashSet<ServerAddr>,
) {
    let failed_now: std::collections::HashSet<ServerAddr> = b
        .status()
        .into_iter()
        .filter(|s| s.state == crate::balancer::ServerState::Failed)
        .map(|s| s.address)
        .collect();
    if b.config().health.on_unhealthy != crate::config::OnUnhealthy::Kill {
        for server in failed_now.difference(failed) {
            let (dp, metrics, name, id, server) = (
                dp.clone(),
                metrics.clone(),
                b.name.clone(),
                b.id,
                server.clone(),
            );
            drop(tokio::task::spawn_blocking(move || {
                abort_connecting(&dp, &metrics, &name, id, &server, "failed");
            }));
        }
    }
    *failed = failed_now;
}

/// Destroy the connect-time sockets balancer `id`'s programs sent to `server` (netlink
/// `SOCK_DESTROY`, in each socket's own network namespace) and count them in
/// `lb_connections_killed_total`; with `again` (the server is out of the table), once more
/// after [`SWEEP_AGAIN_AFTER`]. Blocking.
fn kill_direct(
    dp: &Datapath,
    metrics: &Metrics,
    balancer: &str,
    id: u32,
    server: &ServerAddr,
    reason: KillReason,
    again: bool,
) {
    let Some(addr) = server.socket_addr() else {
        return;
    };
    sweep(dp, metrics, balancer, id, (server, addr), reason);
    if again {
        std::thread::sleep(SWEEP_AGAIN_AFTER);
        sweep(dp, metrics, balancer, id, (server, addr), reason);
    }
}

/// One sweep of [`kill_direct`].
fn sweep(
    dp: &Datapath,
    metrics: &Metrics,
    balancer: &str,
    id: u32,
    (server, addr): (&ServerAddr, SocketAddr),
    reason: KillReason,
) {
    let began = std::time::Instant::now();
    let sockets = dp.connect_sockets(id, addr);
    // Their close is lb's doing: not a failed connect of the server.
    dp.ignore_events_of(&sockets);
    match crate::kill::destroy_connect_sockets(addr, &sockets) {
        Ok(k) => {
            count_netns_failures(metrics, balancer, k.netns_failures);
            if k.destroyed > 0 {
                let ms = began.elapsed().as_millis();
                warn!(%balancer, %server, found = k.found, destroyed = k.destroyed, reason = reason.label(), ms, "killed connect-time connections");
                metrics
                    .connections_killed
                    .get_or_create(&KillLabels {
                        balancer: balancer.to_string(),
                        server: server.to_string(),
                        reason: reason.label().into(),
                    })
                    .inc_by(k.destroyed as u64);
            }
        }
        Err(e) => {
            warn!(%balancer, %server, error = %crate::errors::chain(&e), "cannot kill connect-time connections");
        }
    }
}

/// Where connect-time sockets' reports go: counted in `lb_passive_events_total`, then, with
/// `health.passive`, a connect the server failed (refused, timed out, unreachable) and an RTO
/// (at most one per check interval) as a reset by it, toward `passive_reset_limit`; a connect
/// its client abandoned counts nowhere else. Runs on the `lb-passive` thread.
pub(super) fn passive_sink(daemon: &Arc<Daemon>) -> PassiveSink {
    let weak = Arc::downgrade(daemon);
    Arc::new(move |id, addr, kind| {
        let Some(d) = weak.upgrade() else { return };
        let _rt = d.runtime.enter();
        let bs = d.balancers.load();
        let Some(b) = bs.iter().find(|b| b.id == id) else {
            return;
        };
        let Some(server) = b.server_at(addr) else {
            return;
        };
        d.metrics
            .passive_events
            .get_or_create(&PassiveLabels {
                balancer: b.name.clone(),
                server: server.to_string(),
                kind: kind.label().into(),
            })
            .inc();
        tracing::debug!(balancer = %b.name, %server, kind = kind.label(), "connect-time passive signal");
        match kind {
            PassiveKind::ConnectFailed => {
                b.record_connect_failure(&server);
            }
            PassiveKind::ConnectAbandoned => {}
            PassiveKind::Rto => {
                b.record_rto(&server);
            }
        }
    })
}

/// Abort the connect-time sockets balancer `id`'s programs sent to `server` that are still in
/// `SYN_SENT` (netlink `SOCK_DESTROY`; the clients' connects fail with `ECONNABORTED`), leaving
/// its established connections to `on_unhealthy`; once more after [`SWEEP_AGAIN_AFTER`].
/// `why` says what the server is (`failed`, `suspect`) in the log. Blocking.
pub(super) fn abort_connecting(
    dp: &Datapath,
    metrics: &Metrics,
    balancer: &str,
    id: u32,
    server: &ServerAddr,
    why: &'static str,
) {
    let Some(addr) = server.socket_addr() else {
        return;
    };
    abort_sweep(dp, metrics, balancer, id, (server, addr), why);
    std::thread::sleep(SWEEP_AGAIN_AFTER);
    abort_sweep(dp, metrics, balancer, id, (server, addr), why);
}

/// One sweep of [`abort_connecting`].
fn abort_sweep(
    dp: &Datapath,
    metrics: &Metrics,
    balancer: &str,
    id: u32,
    (server, addr): (&ServerAddr, SocketAddr),
    why: &'static str,
) {
    let sockets = dp.connect_sockets(id, addr);
    dp.ignore_events_of(&sockets);
    let r = crate::kill::destroy_connecting(addr, &sockets);
    if let Ok(k) = &r {
        count_netns_failures(metrics, balancer, k.netns_failures);
    }
    match r {
        Ok(k) if k.destroyed > 0 => {
            warn!(%balancer, %server, aborted = k.destroyed, server_is = why, "aborted connect-time connects still in SYN_SENT");
        }
        Ok(_) => {}
        Err(e) => {
            warn!(%balancer, %server, error = %crate::errors::chain(&e), "cannot abort connect-time connects");
        }
    }
}

/// Count connect-time sockets a kill could not reach in their own network namespace (each
/// process was logged with its pid by the kill) in `lb_connect_kill_netns_failures_total`.
fn count_netns_failures(metrics: &Metrics, balancer: &str, n: usize) {
    if n > 0 {
        metrics
            .connect_kill_netns_failures
            .get_or_create(&crate::metrics::BalancerLabel {
                balancer: balancer.to_string(),
            })
            .inc_by(n as u64);
    }
}

/// The connect-time pin directory `d` names (or the default in the bpffs), opened and locked;
/// `None`, with a warning, when none is configured and no bpffs is mounted or the default one
/// cannot be made: the programs then die with lb.
///
/// # Errors
/// The directory cannot be made or locked (another lb holds it), is not in a bpffs, or holds
/// objects of another layout version; each message says how to proceed.
pub(super) fn open_pins(
    d: &crate::config::DatapathConfig,
) -> anyhow::Result<Option<crate::datapath::Pins>> {
    let Some(dir) = crate::datapath::resolve_dir(d.pin_dir.as_deref()) else {
        warn!(
            "no bpffs is mounted: the connect-time programs are not pinned and stop with lb (mount one at /sys/fs/bpf, or set datapath.pin_dir)"
        );
        return Ok(None);
    };
    let pins = match crate::datapath::Pins::open(&dir) {
        Ok(p) => p,
        // The default directory cannot be made (lb's user may not write the bpffs): unpinned,
        // as without a bpffs. A configured one, another lb's or another layout's is an error.
        Err(e @ crate::datapath::PinError::Dir { .. }) if d.pin_dir.is_none() => {
            warn!(reason = %crate::errors::chain(&e), "the connect-time programs are not pinned and stop with lb (set datapath.pin_dir to a directory lb may write)");
            return Ok(None);
        }
        Err(e) => return Err(e.into()),
    };
    info!(pin_dir = %dir.display(), adopted = pins.adopted(), "connect-time pin directory locked");
    Ok(Some(pins))
}
