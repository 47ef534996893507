//! Dialing a client's server: in the balancer's order of preference, each dial bounded by
//! `dial_timeout` and the whole by `connect_budget`. A dial whose server turns FAILED, leaves
//! the set, or is drained or disabled while it is in progress is abandoned at once and the next
//! server is tried, so a new client never waits out `dial_timeout` on a server lb already knows
//! is down. When every server is FAILED, `all_failed` decides: dial them all at once (the first
//! to answer wins) or reset the client at once.

use std::{
    io,
    sync::Arc,
    time::{Duration, Instant},
};

use futures::{StreamExt as _, stream::FuturesUnordered};
use tokio::net::TcpStream;
use tracing::{debug, warn};

use super::{ProxyCtx, abort};
use crate::{
    addr::ServerAddr,
    balancer::{Balancer, Hold, ServerState},
    config::AllFailed,
    metrics::{BalancerLabel, DialLabels, RefusedLabels},
    net::{self, Route, is_local_exhaustion},
};

/// Why one dial gave no socket.
enum Failed {
    /// The server turned unusable meanwhile; it is not held against it.
    Abandoned,
    /// A local resource ran out; not held against the server either.
    Local(String),
    /// The server's own failure (counted with `health.passive`).
    Server(String),
}

/// Dial the first server that answers, in the balancer's order, within `dial_timeout` each and
/// `connect_budget` overall. Returns the server and the socket. The whole dial, every server it
/// tried, is one observation of the `[metrics] compat` histogram (as K3s records its dials).
///
/// # Errors
/// `io::ErrorKind::NotConnected` with "all servers failed" when none answered, or with
/// "every server is FAILED" at once under `all_failed = "refuse"`.
pub async fn dial(balancer: &Arc<Balancer>, ctx: &ProxyCtx) -> io::Result<(ServerAddr, TcpStream)> {
    let start = Instant::now();
    let result = dial_servers(balancer, ctx).await;
    ctx.metrics
        .observe_client_dial(balancer, result.is_ok(), start.elapsed().as_secs_f64());
    result
}

/// [`dial`] without the client's observation.
async fn dial_servers(
    balancer: &Arc<Balancer>,
    ctx: &ProxyCtx,
) -> io::Result<(ServerAddr, TcpStream)> {
    let cfg = balancer.config();
    let deadline = Instant::now() + cfg.connect_budget.0;
    let route = Route::from_env(cfg.proxy.clone());
    if balancer.all_failed() {
        // Check-before-dial first, all at once: with `health.loop = false` it is the only way
        // a FAILED server is ever checked again (with the loop on, results are fresh and this
        // returns at once).
        if let Some(pre) = &ctx.pre_dial {
            let order = balancer.dial_order();
            futures::future::join_all(order.into_iter().map(|s| pre(balancer.clone(), s))).await;
        }
        if balancer.all_failed() {
            return every_server_failed(balancer, ctx, &route, deadline).await;
        }
    }
    let mut errors = Vec::new();
    let mut deferred = Vec::new();
    // Servers whose check-before-dial failed are dialed after all others, so failing checks
    // alone never make lb refuse every client (K3s #10240).
    let mut queue: std::collections::VecDeque<(ServerAddr, bool)> = balancer
        .dial_order()
        .into_iter()
        .map(|s| (s, true))
        .collect();
    while let Some((spec, first_pass)) = queue.pop_front() {
        if Instant::now() >= deadline {
            errors.push("connect budget used up".to_string());
            break;
        }
        if first_pass
            && let Some(pre) = &ctx.pre_dial
            && !pre(balancer.clone(), spec.clone()).await
        {
            deferred.push(spec);
            if queue.is_empty() {
                queue.extend(deferred.drain(..).map(|s| (s, false)));
            }
            continue;
        }
        let budget = deadline
            .saturating_duration_since(Instant::now())
            .min(cfg.dial_timeout.0);
        match dial_one(balancer, ctx, &spec, &route, budget).await {
            Ok(stream) => return Ok((spec, stream)),
            Err(Failed::Abandoned) => {
                errors.push(format!("{spec}: abandoned, the server became unusable"));
                // The server that just failed may have been the last one up.
                if balancer.all_failed() {
                    return every_server_failed(balancer, ctx, &route, deadline).await;
                }
            }
            Err(Failed::Local(e) | Failed::Server(e)) => errors.push(format!("{spec}: {e}")),
        }
        if queue.is_empty() {
            queue.extend(deferred.drain(..).map(|s| (s, false)));
        }
    }
    refused(balancer, ctx, "all_servers_failed");
    Err(io::Error::new(
        io::ErrorKind::NotConnected,
        format!("all servers failed ({})", errors.join("; ")),
    ))
}

/// Every server is FAILED: as `all_failed` says, reset the client at once or race them all.
async fn every_server_failed(
    balancer: &Arc<Balancer>,
    ctx: &ProxyCtx,
    route: &Route,
    deadline: Instant,
) -> io::Result<(ServerAddr, TcpStream)> {
    match balancer.config().all_failed {
        AllFailed::Refuse => {
            refused(balancer, ctx, "all_failed");
            Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "every server is FAILED (all_failed = \"refuse\")",
            ))
        }
        AllFailed::Try => race_all(balancer, ctx, route, deadline).await,
    }
}

/// Every server is FAILED: dial them all at once within one `dial_timeout` (and what is left
/// of the budget); the first to answer serves the client and the other dials are dropped
/// (their sockets close).
async fn race_all(
    balancer: &Arc<Balancer>,
    ctx: &ProxyCtx,
    route: &Route,
    deadline: Instant,
) -> io::Result<(ServerAddr, TcpStream)> {
    let cfg = balancer.config();
    let budget = deadline
        .saturating_duration_since(Instant::now())
        .min(cfg.dial_timeout.0);
    let order = balancer.dial_order();
    ctx.metrics
        .dials_raced
        .get_or_create(&label(balancer))
        .inc_by(order.len() as u64);
    let mut dials: FuturesUnordered<_> = order
        .iter()
        .map(|spec| async move { (spec, dial_one(balancer, ctx, spec, route, budget).await) })
        .collect();
    let mut errors = Vec::new();
    while let Some((spec, result)) = dials.next().await {
        match result {
            Ok(stream) => return Ok((spec.clone(), stream)),
            Err(Failed::Abandoned) => errors.push(format!("{spec}: abandoned")),
            Err(Failed::Local(e) | Failed::Server(e)) => errors.push(format!("{spec}: {e}")),
        }
    }
    refused(balancer, ctx, "all_servers_failed");
    Err(io::Error::new(
        io::ErrorKind::NotConnected,
        format!(
            "all servers failed, every one FAILED and dialed at once ({})",
            errors.join("; ")
        ),
    ))
}

/// One dial of `spec` within `budget`, given up as soon as the server turns unusable; counts
/// the dial's duration, refuses a dial that reached lb itself, and records the result.
async fn dial_one(
    balancer: &Arc<Balancer>,
    ctx: &ProxyCtx,
    spec: &ServerAddr,
    route: &Route,
    budget: Duration,
) -> Result<TcpStream, Failed> {
    let start = Instant::now();
    let result = tokio::select! {
        r = tokio::time::timeout(budget, net::connect_to(spec, route)) => {
            r.unwrap_or_else(|_| Err(io::Error::new(io::ErrorKind::TimedOut, "dial timed out")))
        }
        () = turned_unusable(balancer, spec) => {
            ctx.metrics.dials_abandoned.get_or_create(&label(balancer)).inc();
            debug!(balancer = %balancer.name, server = %spec, after = ?start.elapsed(), "dial abandoned: the server became unusable");
            return Err(Failed::Abandoned);
        }
    };
    ctx.metrics
        .dial_duration
        .get_or_create(&DialLabels {
            balancer: balancer.name.clone(),
            status: if result.is_ok() { "ok" } else { "error" }.into(),
        })
        .observe(start.elapsed().as_secs_f64());
    match result {
        Ok((stream, peer)) if crate::net::is_own_listener(peer) => {
            // A host name that resolves to lb itself: refuse instead of dialing in a loop.
            let e = format!("{spec} is one of lb's own listeners (a loop)");
            warn!(balancer = %balancer.name, server = %spec, "dial reached lb's own listener; refusing the loop");
            abort(&stream);
            balancer.record_dial(spec, Err(e.clone()));
            Err(Failed::Server(e))
        }
        Ok((stream, _)) => {
            balancer.record_dial(spec, Ok(()));
            Ok(stream)
        }
        Err(e) if is_local_exhaustion(&e) => {
            // Out of descriptors or memory here says nothing about the server.
            warn!(balancer = %balancer.name, server = %spec, error = %e, "dial failed for a local reason; not held against the server");
            Err(Failed::Local(e.to_string()))
        }
        Err(e) => {
            debug!(balancer = %balancer.name, server = %spec, error = %e, "dial failed");
            balancer.record_dial(spec, Err(e.to_string()));
            Err(Failed::Server(e.to_string()))
        }
    }
}

/// Resolves when `spec` turns unusable for a dial in progress: it leaves the balancer, is
/// drained or disabled, or turns FAILED (a dial begun while it was already FAILED, the last
/// resort, is not given up for that).
async fn turned_unusable(balancer: &Balancer, spec: &ServerAddr) {
    let mut changed = balancer.changed.subscribe();
    let was_failed = matches!(balancer.dial_state(spec), Some((ServerState::Failed, _)));
    loop {
        match balancer.dial_state(spec) {
            None => return,
            Some((_, hold)) if hold != Hold::None => return,
            Some((ServerState::Failed | ServerState::Invalid, _)) if !was_failed => return,
            _ => {}
        }
        if changed.changed().await.is_err() {
            return std::future::pending().await;
        }
    }
}

fn label(balancer: &Balancer) -> BalancerLabel {
    BalancerLabel {
        balancer: balancer.name.clone(),
    }
}

fn refused(balancer: &Balancer, ctx: &ProxyCtx, reason: &str) {
    ctx.metrics
        .clients_refused
        .get_or_create(&RefusedLabels {
            balancer: balancer.name.clone(),
            reason: reason.into(),
        })
        .inc();
}
