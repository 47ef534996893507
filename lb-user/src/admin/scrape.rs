//! The metrics listener (`[metrics] listen`): `GET /metrics` only, read-only and without a token,
//! so a scraper off the node reaches the metrics while the admin API stays on loopback. It runs
//! on the admin thread with the admin API's bounds: request heads within
//! [`super::HEADER_READ_TIMEOUT`], each request within [`super::REQUEST_TIMEOUT`], at most
//! [`super::MAX_CONNECTIONS`] connections, each for at most [`super::CONNECTION_LIFETIME`].

use std::net::SocketAddr;

use axum::{
    Router,
    extract::{Request, State},
    middleware::{self, Next},
    routing::get,
};
use socket2::{Domain, Protocol, Socket, Type};
use tokio::task::JoinHandle;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{error, info};

use super::{AdminError, Listener, accept_loop, bounded, not_found};
use crate::daemon::Handle;

/// Bind `[metrics] listen` when set. `SO_REUSEPORT` lets the process `lb upgrade` starts bind it
/// while the old one still serves it (the old one's socket closes when it exits).
///
/// # Errors
/// [`AdminError::Bind`] naming the address.
pub(super) fn bind(daemon: &Handle) -> Result<Option<std::net::TcpListener>, AdminError> {
    let Some(addr) = daemon.config().metrics.listen else {
        return Ok(None);
    };
    let l = bind_reuseport(addr).map_err(|source| AdminError::Bind { addr, source })?;
    info!(listen = %addr, "metrics listening (GET /metrics only)");
    Ok(Some(l))
}

fn bind_reuseport(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    s.set_reuse_address(true)?;
    s.set_reuse_port(true)?;
    if addr.is_ipv6() {
        s.set_only_v6(true)?;
    }
    s.bind(&addr.into())?;
    s.listen(super::BACKLOG)?;
    s.set_nonblocking(true)?;
    Ok(s.into())
}

/// Serve the metrics listener until shutdown; its connections join `conns`.
pub(super) fn spawn(
    tcp: std::net::TcpListener,
    daemon: &Handle,
    shutdown: CancellationToken,
    conns: TaskTracker,
) -> Option<JoinHandle<()>> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .layer(middleware::from_fn(|req: Request, next: Next| {
            bounded(super::REQUEST_TIMEOUT, req, next)
        }))
        .fallback(not_found)
        .with_state(daemon.clone());
    let slots = super::slots::Slots::new(super::MAX_CONNECTIONS);
    match tokio::net::TcpListener::from_std(tcp) {
        Ok(l) => Some(tokio::spawn(accept_loop(
            Listener::Tcp(l),
            app,
            shutdown,
            conns,
            slots,
            daemon.admin_gate(),
        ))),
        Err(e) => {
            error!(error = %e, "metrics listener");
            None
        }
    }
}

async fn metrics(State(daemon): State<Handle>) -> axum::response::Response {
    super::metrics_response(daemon.render_metrics())
}
