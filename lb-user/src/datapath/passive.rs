//! Passive health of connect-time sockets: the sockops program reports a rewritten connect that
//! failed (`SYN_SENT` → `CLOSE`: refused by a reset, out of SYN retries, or given up by the
//! client) and the first retransmission timeout of an established one on a ring buffer; the
//! `lb-passive` thread reads it and hands each event, as (balancer id, server address, kind),
//! to the daemon, which counts it like the proxy's dial failures and resets. Sockets lb
//! destroys itself (kills by cookie) are left out: their close is lb's doing, not the
//! server's. Minimum kernel: as the connect-time programs, plus `RTO_CB` (4.16) and the ring
//! buffer (5.8).

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use lb_common::{EVENT_CONNECT_FAILED, EVENT_RTO};

use super::{Datapath, maps};

/// What a connect-time socket told lb about its server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PassiveKind {
    /// A rewritten connect never got established: counted as a failed dial.
    ConnectFailed,
    /// An established socket's first retransmission timeout: counted like a reset by the
    /// server (toward `passive_reset_limit`).
    Rto,
}

impl PassiveKind {
    /// Label in `lb_passive_events_total{kind}`.
    pub fn label(self) -> &'static str {
        match self {
            PassiveKind::ConnectFailed => "connect_failed",
            PassiveKind::Rto => "rto",
        }
    }

    fn from_kernel(kind: u32) -> Option<PassiveKind> {
        match kind {
            EVENT_CONNECT_FAILED => Some(PassiveKind::ConnectFailed),
            EVENT_RTO => Some(PassiveKind::Rto),
            _ => None,
        }
    }
}

/// How long the cookies of sockets lb destroyed are remembered, so their close is not taken
/// for a failed connect (the event is written during the destroy, read a moment later).
const IGNORE_FOR: Duration = Duration::from_secs(10);

/// Where the events go: balancer id, server address, kind.
pub type PassiveSink = Arc<dyn Fn(u32, SocketAddr, PassiveKind) + Send + Sync>;

impl Datapath {
    /// Remember `sockets` as sockets lb is about to destroy: their failures are not the
    /// server's. Call before destroying them.
    pub fn ignore_events_of(&self, sockets: &[crate::kill::ConnectSocket]) {
        let mut ignored = self.ignored.lock().expect("poisoned");
        let now = Instant::now();
        ignored.retain(|_, t| now.duration_since(*t) < IGNORE_FOR);
        ignored.extend(sockets.iter().map(|s| (s.cookie, now)));
    }

    /// Read connect-time events on a dedicated thread (`lb-passive`) until `cancel` fires,
    /// waking at least every 100 ms, and give each to `sink` (on that thread). A second call
    /// does nothing.
    ///
    /// # Errors
    /// The thread could not be spawned.
    pub fn start_passive(
        self: &Arc<Self>,
        cancel: tokio_util::sync::CancellationToken,
        sink: PassiveSink,
    ) -> std::io::Result<()> {
        let Some(ring) = self.events.lock().expect("poisoned").take() else {
            return Ok(());
        };
        let this = self.clone();
        self.spawn_ring_reader(
            "lb-passive",
            cancel,
            ring,
            maps::EventRing::next_event,
            move |evs| {
                let ignored: HashMap<u64, Instant> = this.ignored.lock().expect("poisoned").clone();
                for ev in evs {
                    if ignored.contains_key(&ev.cookie) {
                        continue;
                    }
                    let (Some(kind), Some(addr)) = (
                        PassiveKind::from_kernel(ev.kind),
                        maps::server_addr(&ev.server),
                    ) else {
                        continue;
                    };
                    sink(ev.balancer, addr, kind);
                }
            },
        )
    }
}
