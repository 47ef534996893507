//! Connect-time forwarding, the daemon's half: the kernel sends a client's connect to the
//! listener straight to a server (no hop through lb), so what lb does is keep each
//! connect-mode balancer's server table current in the kernel, end the sockets of a server
//! that is killed or failed, and turn what the kernel reports of those sockets into health
//! hints. The kernel's half (programs' links, pins, maps) is `crate::datapath::connect`; the
//! programs are `lb-ebpf/src/connect.rs`. The splice, the other forwarding mode, is
//! the `proxy` module.
//!
//! The rooms: [`forwarding`] (which balancers forward connect-time, and why not), [`table`]
//! (each balancer's table task), [`failfast`] (SYN policies and suspect servers), [`kill`]
//! (ending a server's sockets), [`passive`] (the sockets' reports as hints) and [`pins`] (the
//! pin directory opened before loading).
//!
//! Minimum kernel: 5.8 (see `crate::datapath`).

mod failfast;
mod forwarding;
mod kill;
mod passive;
mod pins;
mod table;

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

pub use self::{
    failfast::DefaultConfig as FailFastDefault,
    forwarding::{ForwardingFallback, ForwardingMap, decide, record},
    passive::{Balancers, passive_sink},
    pins::open_pins,
};
use crate::{
    addr::ServerAddr,
    balancer::{Balancer, KillReason},
    datapath::Datapath,
    metrics::Metrics,
};

/// A server whose connect-time sockets are to be ended, and why.
type DirectKill = (ServerAddr, KillReason);

/// The kill queue of each connect-time balancer, by balancer id, its sending side: a kill of
/// one of the balancer's servers goes to the balancer's table task.
pub struct KillQueues(HashMap<u32, UnboundedSender<DirectKill>>);

impl KillQueues {
    /// Hand `server` of balancer `id` to its table task, which rewrites the table and ends the
    /// sockets the kernel sent there. A balancer that is not connect-time has no queue.
    pub fn send(&self, id: u32, server: &ServerAddr, reason: KillReason) {
        if let Some(tx) = self.0.get(&id) {
            let _ = tx.send((server.clone(), reason));
        }
    }
}

/// The receiving side of [`KillQueues`], until [`spawn_tables`] gives each to its task.
pub struct KillReceivers(HashMap<u32, UnboundedReceiver<DirectKill>>);

/// A kill queue for each balancer id in `ids`.
pub fn kill_queues(ids: &HashSet<u32>) -> (KillQueues, KillReceivers) {
    let (tx, rx) = ids
        .iter()
        .map(|id| {
            let (tx, rx) = unbounded_channel();
            ((*id, tx), (*id, rx))
        })
        .unzip();
    (KillQueues(tx), KillReceivers(rx))
}

/// What every table task shares.
#[derive(Clone)]
pub struct Context {
    /// The kernel data path the tables are written to.
    pub datapath: Arc<Datapath>,
    /// Where kills, aborts and suspects are counted.
    pub metrics: Arc<Metrics>,
    /// Ends every task.
    pub stop: CancellationToken,
    /// `[datapath.fail_fast]` as the config says now (a balancer's own section wins).
    pub fail_fast: FailFastDefault,
}

/// One table task per connect-time balancer (those with a queue in `kills`, which each takes):
/// from `go` on, it writes the balancer's table and SYN policies into the kernel and ends the
/// sockets of its killed servers, until `ctx.stop`.
pub fn spawn_tables(
    ctx: &Context,
    balancers: &[Arc<Balancer>],
    kills: &mut KillReceivers,
    tasks: &TaskTracker,
    go: &CancellationToken,
) {
    for b in balancers {
        let Some(rx) = kills.0.remove(&b.id) else {
            continue;
        };
        let task = table::run(b.clone(), ctx.clone(), rx);
        let go = go.clone();
        tasks.spawn(async move {
            go.cancelled().await;
            task.await;
        });
    }
}
