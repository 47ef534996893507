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
    os::fd::{AsFd, BorrowedFd},
    sync::Arc,
    time::{Duration, Instant},
};

use aya::maps::{MapData, RingBuf};
use lb_common::{ConnectEvent, ConnectServer, EVENT_CONNECT_FAILED, EVENT_RTO};

use crate::datapath::{Datapath, keys::server_addr};

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
        self.spawn_ring_reader(
            "lb-passive",
            cancel,
            ring,
            EventRing::next_event,
            move |evs| {
                let ignored: HashMap<u64, Instant> = this.ignored.lock().expect("poisoned").clone();
                for ev in evs {
                    if ignored.contains_key(&ev.cookie) {
                        continue;
                    }
                    let (Some(kind), Some(addr)) = (
                        PassiveKind::from_kernel(ev.kind, ev.err),
                        server_addr(&ev.server),
                    ) else {
                        continue;
                    };
                    sink(ev.balancer, addr, kind);
                }
            },
        )
    }
}

/// `LB_CONNECT_EVENTS`: passive health signals of connect-time sockets. Read by one thread.
pub(in crate::datapath) struct EventRing(RingBuf<MapData>);

impl From<RingBuf<MapData>> for EventRing {
    fn from(ring: RingBuf<MapData>) -> EventRing {
        EventRing(ring)
    }
}

impl EventRing {
    /// Drop every event in the ring now (at most its capacity); returns how many.
    pub(in crate::datapath) fn drain(&mut self) -> usize {
        let most = lb_common::CONNECT_EVENTS_RING_BYTES as usize / size_of::<ConnectEvent>();
        (0..most).take_while(|_| self.0.next().is_some()).count()
    }

    /// The next event, skipping records that do not decode; `None` when the ring is empty.
    pub(in crate::datapath) fn next_event(&mut self) -> Option<ConnectEvent> {
        loop {
            let item = self.0.next()?;
            if let Some(ev) = decode_event(&item) {
                return Some(ev);
            }
        }
    }
}

impl AsFd for EventRing {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// Decode one [`ConnectEvent`] record field by field at its `#[repr(C)]` offsets (native byte
/// order); `None` when the record is shorter than the struct.
fn decode_event(bytes: &[u8]) -> Option<ConnectEvent> {
    use core::mem::offset_of;
    if bytes.len() < size_of::<ConnectEvent>() {
        return None;
    }
    let u64_at = |i: usize| -> Option<u64> {
        Some(u64::from_ne_bytes(bytes.get(i..i + 8)?.try_into().ok()?))
    };
    let u32_at = |i: usize| -> Option<u32> {
        Some(u32::from_ne_bytes(bytes.get(i..i + 4)?.try_into().ok()?))
    };
    let s = offset_of!(ConnectEvent, server);
    let mut server = ConnectServer::default();
    for (n, w) in server.ip_be.iter_mut().enumerate() {
        *w = u32_at(s + offset_of!(ConnectServer, ip_be) + n * 4)?;
    }
    server.port = u32_at(s + offset_of!(ConnectServer, port))?;
    server.family = u32_at(s + offset_of!(ConnectServer, family))?;
    Some(ConnectEvent {
        server,
        balancer: u32_at(offset_of!(ConnectEvent, balancer))?,
        kind: u32_at(offset_of!(ConnectEvent, kind))?,
        cookie: u64_at(offset_of!(ConnectEvent, cookie))?,
        err: u32_at(offset_of!(ConnectEvent, err))?,
        _pad: 0,
    })
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

    /// A connect-time event as the sockops program writes it (24 server bytes: four address
    /// words, port, family; then balancer, kind, the u64 cookie, the errno and padding)
    /// decodes to every field.
    #[test]
    fn connect_event_record_round_trips() {
        let mut rec = Vec::new();
        for w in [u32::from_ne_bytes([198, 18, 0, 2]), 0, 0, 0] {
            rec.extend_from_slice(&w.to_ne_bytes());
        }
        rec.extend_from_slice(&9001u32.to_ne_bytes());
        rec.extend_from_slice(&lb_common::AF_INET.to_ne_bytes());
        rec.extend_from_slice(&3u32.to_ne_bytes());
        rec.extend_from_slice(&lb_common::EVENT_RTO.to_ne_bytes());
        rec.extend_from_slice(&0x0102_0304_0506_0708u64.to_ne_bytes());
        rec.extend_from_slice(&111u32.to_ne_bytes());
        rec.extend_from_slice(&0u32.to_ne_bytes());
        assert_eq!(rec.len(), size_of::<ConnectEvent>());
        let ev = decode_event(&rec).expect("decodes");
        assert_eq!(
            server_addr(&ev.server),
            Some("198.18.0.2:9001".parse().unwrap())
        );
        assert_eq!(
            (ev.balancer, ev.kind, ev.cookie, ev.err),
            (3, lb_common::EVENT_RTO, 0x0102_0304_0506_0708, 111)
        );
        assert_eq!(decode_event(&rec[..rec.len() - 1]), None);
    }
}
