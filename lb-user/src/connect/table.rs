//! Each connect-mode balancer's table task: its server table kept current in the kernel, its
//! fail-fast round, the count keys of servers gone pruned, and the kills of its servers'
//! sockets, in that order of precedence (a table is rewritten before a kill sweeps).

use std::{collections::HashSet, net::SocketAddr, sync::Arc, time::Duration};

use tokio::sync::mpsc::UnboundedReceiver;
use tracing::{debug, info, warn};

use super::{
    Context, DirectKill,
    failfast::{self, FailFast},
    kill::{abort_connecting, kill_direct},
};
use crate::{
    addr::ServerAddr,
    balancer::{Balancer, ServerState},
    config::{OnUnhealthy, Policy},
    datapath::{Datapath, DatapathError, TableWrite},
};

/// How often the count keys of servers gone from the table are looked at again: a key whose
/// server left while its last socket was still open reaches 0 only when that socket closes,
/// after the table write that dropped the server.
const PRUNE_EVERY: Duration = Duration::from_secs(1);

/// A table as written: its policy and servers, best first.
type Written = (Policy, Vec<SocketAddr>);

/// `policy` as the connect programs read it (`ConnectTable::policy`).
fn wire_policy(policy: Policy) -> u32 {
    match policy {
        Policy::Failover => lb_common::CONNECT_FIRST,
        Policy::RoundRobin => lb_common::CONNECT_ROUND_ROBIN,
        Policy::Random => lb_common::CONNECT_RANDOM,
        Policy::LeastConnections => lb_common::CONNECT_LEAST,
    }
}

/// Keep balancer `b`'s connect-time table current: written now and after every change of its
/// servers' states, set or config, until `ctx.stop`; every [`PRUNE_EVERY`] the count keys of
/// servers no longer in it whose sockets all closed are deleted. Kills of a server's
/// connections arrive on `kills`: the table is rewritten first (so a client that reconnects at
/// once is not sent back to that server), then the sockets the kernel sent there are
/// destroyed.
pub(super) async fn run(b: Arc<Balancer>, ctx: Context, mut kills: UnboundedReceiver<DirectKill>) {
    let hz = tokio::task::spawn_blocking(crate::datapath::kernel_hz)
        .await
        .ok()
        .flatten();
    if hz.is_none() {
        warn!(balancer = %b.name, "connect-time: the kernel's HZ cannot be measured (no /proc/timer_list, no /boot/config-*); SYN timeouts stay the kernel's 1 s");
    }
    let mut fail_fast = FailFast::new(ctx.fail_fast.clone(), hz);
    let mut ff_tick = tokio::time::interval(failfast::TICK);
    ff_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut changed = b.changed.subscribe();
    let mut last: Option<Written> = None;
    let mut failed = HashSet::new();
    let mut prune = tokio::time::interval(PRUNE_EVERY);
    prune.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let dp = &ctx.datapath;
    loop {
        write_table(&b, dp, &mut last).await;
        abort_newly_failed(&b, &ctx, &mut failed);
        let servers = last.as_ref().map(|l| l.1.as_slice()).unwrap_or_default();
        tokio::select! {
            () = ctx.stop.cancelled() => return,
            r = changed.changed() => if r.is_err() { return },
            _ = ff_tick.tick() => fail_fast.tick(&b, dp, &ctx.metrics, servers),
            _ = prune.tick() => {
                let pruned = dp.prune_connect_counts(b.id, servers);
                if pruned > 0 {
                    debug!(balancer = %b.name, pruned, "count keys of servers gone from the table deleted once their sockets closed");
                }
            }
            k = kills.recv() => {
                let Some((server, reason)) = k else { return };
                // Rewrite the table before the kill (the loop does it when the state moved).
                write_table(&b, dp, &mut last).await;
                // Sweep again only when no new connect can be sent there: a server still in
                // the table (`lb servers kill`, a failback) gets new, wanted connections.
                let gone = server.socket_addr().is_some_and(|a| {
                    last.as_ref().is_none_or(|l| !l.1.contains(&a))
                });
                let (dp, metrics, name, id) = (dp.clone(), ctx.metrics.clone(), b.name.clone(), b.id);
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
async fn write_table(b: &Arc<Balancer>, dp: &Datapath, last: &mut Option<Written>) {
    loop {
        let servers: Vec<SocketAddr> = b
            .connect_table()
            .iter()
            .filter_map(ServerAddr::socket_addr)
            .collect();
        let now = (b.config().policy, servers);
        if last.as_ref() == Some(&now) {
            return;
        }
        let (policy, servers) = &now;
        match dp.set_connect_table(b.id, wire_policy(*policy), servers) {
            Ok(w) => {
                let list: Vec<String> = servers.iter().map(ToString::to_string).collect();
                let list = list.join(",");
                match w {
                    TableWrite::Written {
                        generation,
                        slot,
                        idle,
                    } => {
                        // `slot_idle_ms=never`: the slot was not current since lb tracks it.
                        let idle =
                            idle.map_or_else(|| "never".to_string(), |d| d.as_millis().to_string());
                        info!(balancer = %b.name, %policy, servers = %list, generation, slot, slot_idle_ms = %idle, "connect-time table updated");
                    }
                    TableWrite::Unchanged { generation } => {
                        info!(balancer = %b.name, %policy, servers = %list, generation, "connect-time table updated (already current)");
                    }
                }
                let pruned = dp.prune_connect_counts(b.id, servers);
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
fn abort_newly_failed(b: &Balancer, ctx: &Context, failed: &mut HashSet<ServerAddr>) {
    let failed_now: HashSet<ServerAddr> = b
        .status()
        .into_iter()
        .filter(|s| s.state == ServerState::Failed)
        .map(|s| s.address)
        .collect();
    if b.config().health.on_unhealthy != OnUnhealthy::Kill {
        for server in failed_now.difference(failed) {
            let (dp, metrics, name, id, server) = (
                ctx.datapath.clone(),
                ctx.metrics.clone(),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Each policy has its own value on the wire, the one the programs switch on.
    #[test]
    fn every_policy_has_its_wire_value() {
        let all = [
            (Policy::Failover, lb_common::CONNECT_FIRST),
            (Policy::RoundRobin, lb_common::CONNECT_ROUND_ROBIN),
            (Policy::Random, lb_common::CONNECT_RANDOM),
            (Policy::LeastConnections, lb_common::CONNECT_LEAST),
        ];
        let mut seen = HashSet::new();
        for (policy, wire) in all {
            assert_eq!(wire_policy(policy), wire);
            assert!(seen.insert(wire), "{policy} shares its value");
        }
    }
}
