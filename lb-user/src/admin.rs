//! Admin HTTP API: probes (`/livez`, `/readyz`), `/status`, `/metrics`, and config reload.
//! Runs on its own runtime thread so a saturated data path cannot starve probes.

use std::{net::SocketAddr, path::Path, sync::Arc, sync::atomic::Ordering, time::Duration};

use axum::{
    Json, Router,
    extract::State,
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
};
use serde::Serialize;
use tracing::{error, info, warn};

use crate::{
    balancer::ServerStatus,
    config::{Config, Overrides},
    daemon::Daemon,
};

/// Heartbeat older than this makes `/livez` fail.
pub const HEARTBEAT_STALE: Duration = Duration::from_secs(5);

/// `/status` body.
#[derive(Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct StatusBody {
    /// `bpf` or `userspace`.
    pub datapath: String,
    /// Why `auto` fell back, if it did.
    pub datapath_fallback: Option<String>,
    /// Balancers.
    pub balancers: Vec<BalancerStatus>,
}

/// One balancer in `/status`.
#[derive(Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct BalancerStatus {
    /// Name.
    pub name: String,
    /// Listen addresses.
    pub listen: Vec<SocketAddr>,
    /// Policy.
    pub policy: String,
    /// Servers.
    pub servers: Vec<ServerStatus>,
}

/// Build the `/status` body.
pub fn status(daemon: &Daemon) -> StatusBody {
    StatusBody {
        datapath: daemon.datapath_mode.to_string(),
        datapath_fallback: daemon.datapath_fallback.clone(),
        balancers: daemon
            .balancers
            .load()
            .iter()
            .map(|b| {
                let cfg = b.config();
                BalancerStatus {
                    name: b.name.clone(),
                    listen: cfg.listen.clone(),
                    policy: cfg.policy.to_string(),
                    servers: b.status(),
                }
            })
            .collect(),
    }
}

fn router(daemon: Arc<Daemon>) -> Router {
    Router::new()
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route("/status", get(status_handler))
        .route("/metrics", get(metrics))
        .with_state(daemon)
}

async fn livez(State(d): State<Arc<Daemon>>) -> Response {
    let age = d.heartbeat_age();
    if age > HEARTBEAT_STALE {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("control loop heartbeat is {age:?} old\n"),
        )
            .into_response();
    }
    (StatusCode::OK, "ok\n").into_response()
}

async fn readyz(State(d): State<Arc<Daemon>>) -> Response {
    if !d.first_checks_done.load(Ordering::Relaxed) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "first round of health checks not done\n",
        )
            .into_response();
    }
    for b in d.balancers.load().iter() {
        if !b.has_usable_server() {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("balancer {} has no usable server\n", b.name),
            )
                .into_response();
        }
    }
    (StatusCode::OK, "ready\n").into_response()
}

async fn status_handler(State(d): State<Arc<Daemon>>) -> Json<StatusBody> {
    Json(status(&d))
}

async fn metrics(State(d): State<Arc<Daemon>>) -> Response {
    let body = d.metrics.render(&d.balancers.load(), d.datapath.as_deref());
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

/// Bind the admin listener and serve it on a dedicated runtime thread.
///
/// # Errors
/// The bind error.
pub async fn start(daemon: Arc<Daemon>) -> anyhow::Result<()> {
    let addr = daemon.config.load().admin.listen;
    let std_listener = std::net::TcpListener::bind(addr)
        .map_err(|e| anyhow::anyhow!("admin: cannot listen on {addr}: {e}"))?;
    std_listener.set_nonblocking(true)?;
    info!(listen = %addr, "admin API listening");
    let shutdown = daemon.shutdown.clone();
    std::thread::Builder::new()
        .name("lb-admin".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    error!(error = %e, "admin runtime");
                    return;
                }
            };
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(std_listener) {
                    Ok(l) => l,
                    Err(e) => {
                        error!(error = %e, "admin listener");
                        return;
                    }
                };
                let app = router(daemon);
                if let Err(e) = axum::serve(listener, app)
                    .with_graceful_shutdown(async move { shutdown.cancelled().await })
                    .await
                {
                    error!(error = %e, "admin server stopped");
                }
            });
        })?;
    Ok(())
}

/// SIGHUP: load the config again; apply it to balancers whose config changed, or keep the old
/// one when the new one is invalid.
pub fn reload(daemon: &Arc<Daemon>, path: Option<&Path>, overrides: &Overrides) {
    let new = match Config::load(path, overrides) {
        Ok(c) => c,
        Err(e) => {
            warn!(error = %e, "reload refused: config invalid; the running config stays");
            return;
        }
    };
    let old = daemon.config.load_full();
    for nb in &new.balancers {
        match daemon.balancer(&nb.name) {
            Some(b) if b.config() != *nb => {
                if b.config().listen != nb.listen {
                    warn!(balancer = %nb.name, "reload: listener changes need a restart; kept the old listeners");
                }
                let mut nb = nb.clone();
                nb.listen = b.config().listen;
                match b.replace_config(nb) {
                    Ok(_) => info!(balancer = %b.name, "reloaded"),
                    Err(e) => {
                        warn!(balancer = %b.name, error = %e, "reload refused for this balancer")
                    }
                }
            }
            Some(_) => {}
            None => warn!(balancer = %nb.name, "reload: new balancers need a restart"),
        }
    }
    let _ = old;
    daemon.config.store(Arc::new(new));
}
