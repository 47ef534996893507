//! Ending connect-time sockets: a killed server's every socket ([`kill_direct`]), or only its
//! connects still in `SYN_SENT` ([`abort_connecting`]) when it failed or turned suspect and
//! `on_unhealthy` leaves established connections alone. The sockets are the ones balancer's
//! programs recorded (`LB_CONNECT_SOCKS`); each is destroyed with netlink `SOCK_DESTROY` in its
//! own network namespace (`crate::kill`), and its close is not counted against the server.
//!
//! Minimum kernel: 5.8 (`CONFIG_INET_DIAG_DESTROY` on, as for every kill).

use std::{net::SocketAddr, time::Duration};

use tracing::warn;

use crate::{
    addr::ServerAddr,
    balancer::KillReason,
    datapath::Datapath,
    metrics::{KillLabels, Metrics},
};

/// After a kill or abort swept a server's sockets, how long until it sweeps once more: a
/// connect program that read the table just before it was rewritten records its socket a
/// moment later, possibly after the first sweep's snapshot.
const SWEEP_AGAIN_AFTER: Duration = Duration::from_millis(200);

/// Destroy the connect-time sockets balancer `id`'s programs sent to `server` (netlink
/// `SOCK_DESTROY`, in each socket's own network namespace) and count them in
/// `lb_connections_killed_total`; with `again` (the server is out of the table), once more
/// after [`SWEEP_AGAIN_AFTER`]. Blocking.
pub(super) fn kill_direct(
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
    let mut killed = crate::kill::destroy_connect_sockets(addr, &sockets);
    if dp.has_earlier_sockets() {
        // Made before this lb rebuilt the pinned maps: not in its records, found by cookie.
        let earlier =
            crate::kill::destroy_peer_sockets_by_cookie(addr, |c| dp.is_earlier_socket(c));
        if let (Ok(k), Ok(e)) = (&mut killed, earlier) {
            k.found += e.found;
            k.destroyed += e.destroyed;
        }
    }
    match killed {
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
