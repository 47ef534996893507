//! Limits on connections through lb: a balancer's `max_connections` (clients beyond it reset at
//! accept), its `idle_timeout` (a connection with no byte either way for that long closed), and
//! surviving accept errors such as running out of descriptors (counted, logged at most once a
//! second per balancer, retried after a short pause). Connect-time clients never reach lb, so
//! none of this applies to them.

use std::{
    collections::HashMap,
    io,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use tokio::net::TcpStream;
use tracing::warn;

use super::{ProxyCtx, abort};
use crate::{
    balancer::Balancer,
    metrics::{AcceptErrorLabels, RejectedLabels},
};

/// Shortest time between two log lines of one kind for one balancer.
const LOG_EVERY: Duration = Duration::from_secs(1);

/// Pause after a failed accept, so a listener that stays readable does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Per balancer: connections through lb now, and when each kind of event was last logged.
#[derive(Debug, Default)]
pub struct Limits {
    live: Mutex<HashMap<String, Arc<AtomicUsize>>>,
    logged: Mutex<HashMap<(String, &'static str), Logged>>,
}

/// When a kind of line was last logged for a balancer, and how many were left out since.
type Logged = (Option<Instant>, u64);

/// One connection counted against its balancer's `max_connections` until dropped.
#[derive(Debug)]
pub struct Admitted(Arc<AtomicUsize>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Limits {
    fn live(&self, balancer: &str) -> Arc<AtomicUsize> {
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(balancer.to_string())
            .or_default()
            .clone()
    }

    /// Count a new client of `balancer`, or refuse it with the limit when the balancer already
    /// has `max_connections` through lb.
    ///
    /// # Errors
    /// The limit that was reached.
    pub fn admit(&self, balancer: &Balancer) -> Result<Admitted, u32> {
        let live = self.live(&balancer.name);
        let limit = balancer.config().max_connections;
        let before = live.fetch_add(1, Ordering::Relaxed);
        let admitted = Admitted(live);
        match limit {
            Some(max) if before >= max as usize => Err(max),
            _ => Ok(admitted),
        }
    }

    /// Count a connection that is already established (handed over by `lb upgrade`), whatever
    /// the limit.
    pub fn count(&self, balancer: &str) -> Admitted {
        let live = self.live(balancer);
        live.fetch_add(1, Ordering::Relaxed);
        Admitted(live)
    }

    /// Whether a line of `kind` for `balancer` is due (none in the last [`LOG_EVERY`]); when it
    /// is, also the number of events left unlogged since the last line.
    fn due(&self, balancer: &str, kind: &'static str) -> Option<u64> {
        let mut logged = self.logged.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let entry = logged
            .entry((balancer.to_string(), kind))
            .or_insert((None, 0));
        match entry.0 {
            Some(at) if now.duration_since(at) < LOG_EVERY => {
                entry.1 += 1;
                None
            }
            _ => {
                let skipped = entry.1;
                *entry = (Some(now), 0);
                Some(skipped)
            }
        }
    }
}

/// Reset a client refused by `max_connections` at once, count and (rate-limited) log it.
pub(super) fn reject(client: &TcpStream, balancer: &Balancer, ctx: &ProxyCtx, limit: u32) {
    abort(client);
    ctx.metrics
        .connections_rejected
        .get_or_create(&RejectedLabels {
            balancer: balancer.name.clone(),
            reason: "max_connections".into(),
        })
        .inc();
    if let Some(skipped) = ctx.limits.due(&balancer.name, "max_connections") {
        warn!(balancer = %balancer.name, limit, not_logged = skipped, "max_connections reached; resetting new clients (logged at most once a second)");
    }
}

/// After a failed accept: count it by errno, log it at most once a second, and pause briefly
/// (out of descriptors, the listener stays readable and the client waits in the backlog).
pub(super) async fn accept_failed(e: &io::Error, balancer: &Balancer, ctx: &ProxyCtx) {
    let errno = e.raw_os_error().map_or_else(
        || "other".to_string(),
        |n| format!("{:?}", nix::errno::Errno::from_raw(n)),
    );
    ctx.metrics
        .accept_errors
        .get_or_create(&AcceptErrorLabels {
            balancer: balancer.name.clone(),
            errno: errno.clone(),
        })
        .inc();
    if let Some(skipped) = ctx.limits.due(&balancer.name, "accept") {
        warn!(balancer = %balancer.name, %errno, error = %e, not_logged = skipped, "accept failed; retrying (logged at most once a second)");
    }
    tokio::time::sleep(ACCEPT_BACKOFF).await;
}

/// Bytes a connection carried so far, both ways, as far as lb can tell: what it copied, plus
/// what the kernel redirected for a spliced one.
pub(super) trait Activity {
    /// A count that grows whenever a byte moves either way.
    fn moved(&self) -> u64;
}

/// Return once `conn` moved no byte for `timeout` (checked every quarter of it, at least
/// every 50 ms: closed within 1.25 × `timeout`).
pub(super) async fn idle(conn: &impl Activity, timeout: Duration) {
    let tick = (timeout / 4).max(Duration::from_millis(50));
    let mut last = conn.moved();
    let mut since = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(tick).await;
        let now = conn.moved();
        if now != last {
            last = now;
            since = tokio::time::Instant::now();
        } else if since.elapsed() >= timeout {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;

    use super::*;

    #[test]
    fn a_kind_logs_once_a_second_and_counts_the_rest() {
        let l = Limits::default();
        assert_eq!(l.due("b", "accept"), Some(0));
        assert_eq!(l.due("b", "accept"), None);
        assert_eq!(l.due("b", "accept"), None);
        assert_eq!(
            l.due("c", "accept"),
            Some(0),
            "another balancer logs on its own"
        );
        assert_eq!(l.due("b", "max_connections"), Some(0), "another kind too");
    }

    struct Fixed(AtomicU64);
    impl Activity for Fixed {
        fn moved(&self) -> u64 {
            self.0.load(Ordering::Relaxed)
        }
    }

    #[tokio::test(start_paused = true)]
    async fn idle_returns_after_the_timeout_without_bytes_only() {
        let c = Fixed(AtomicU64::new(0));
        let start = tokio::time::Instant::now();
        idle(&c, Duration::from_secs(4)).await;
        let took = start.elapsed();
        assert!(
            took >= Duration::from_secs(4) && took <= Duration::from_secs(5),
            "{took:?}"
        );

        // Bytes every second keep it open.
        let start = tokio::time::Instant::now();
        let busy = async {
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_secs(1)).await;
                c.0.fetch_add(1, Ordering::Relaxed);
            }
        };
        tokio::select! {
            () = idle(&c, Duration::from_secs(4)) => {}
            () = busy => {}
        }
        assert!(
            start.elapsed() >= Duration::from_secs(10),
            "closed while busy"
        );
    }
}
