//! Passive health of connect-time sockets: the sockops program reports a rewritten connect that
//! failed (`SYN_SENT` → `CLOSE`, with the socket's error) and the first retransmission timeout
//! of an established one on a ring buffer; the `lb-passive` thread reads it and hands each
//! event, as (balancer id, server address, kind), to the daemon. A failed connect is the
//! server's only when the socket's error says so (refused, timed out, unreachable); one its
//! client closed (its own connect timeout, a process killed while connecting, an egress policy
//! that dropped the SYN) is not. Sockets lb destroys itself (kills by cookie) are left out:
//! their close is lb's doing, not the server's. Minimum kernel: as the connect-time programs,
//! plus `RTO_CB` (4.16) and the ring buffer (5.8).

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
    /// A rewritten connect was refused by the server, timed out in `SYN_SENT`, or was answered
    /// by an ICMP unreachable: counted toward `passive_reset_limit`, like a reset.
    ConnectFailed,
    /// A rewritten connect that never got established but was not refused or timed out: its
    /// client closed it (or lb could not read the socket's error). Not the server's failure;
    /// only counted in the metric.
    ConnectAbandoned,
    /// An established socket's first retransmission timeout: counted like a reset by the
    /// server (toward `passive_reset_limit`).
    Rto,
}

impl PassiveKind {
    /// Label in `lb_passive_events_total{kind}`.
    pub fn label(self) -> &'static str {
        match self {
            PassiveKind::ConnectFailed => "connect_failed",
            PassiveKind::ConnectAbandoned => "connect_abandoned",
            PassiveKind::Rto => "rto",
        }
    }

    /// The kind of a kernel event `kind` whose socket's error was `err` (a positive errno).
    fn from_kernel(kind: u32, err: u32) -> Option<PassiveKind> {
        let servers = [
            libc::ECONNREFUSED,
            libc::ETIMEDOUT,
            libc::EHOSTUNREACH,
            libc::ENETUNREACH,
        ];
        match kind {
            EVENT_CONNECT_FAILED if i32::try_from(err).is_ok_and(|e| servers.contains(&e)) => {
                Some(PassiveKind::ConnectFailed)
            }
            EVENT_CONNECT_FAILED => Some(PassiveKind::ConnectAbandoned),
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
        super::spawn_ring_reader(
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
                        PassiveKind::from_kernel(ev.kind, ev.err),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the server's errors make a failed connect count; a connect its client closed (no
    /// error) or lb aborted (`ECONNABORTED`) does not.
    #[test]
    fn failed_connects_are_the_servers_only_by_their_error() {
        let kind = |err: i32| PassiveKind::from_kernel(EVENT_CONNECT_FAILED, err as u32);
        for err in [libc::ECONNREFUSED, libc::ETIMEDOUT, libc::EHOSTUNREACH] {
            assert_eq!(kind(err), Some(PassiveKind::ConnectFailed), "{err}");
        }
        for err in [0, libc::ECONNABORTED, libc::ECONNRESET, libc::EPERM] {
            assert_eq!(kind(err), Some(PassiveKind::ConnectAbandoned), "{err}");
        }
        assert_eq!(
            PassiveKind::from_kernel(EVENT_RTO, 0),
            Some(PassiveKind::Rto)
        );
        assert_eq!(PassiveKind::from_kernel(99, 0), None);
    }
}
