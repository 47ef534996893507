//! Admin HTTP API: the daemon's own health for orchestrators (`/livez`, `/readyz`, `/check`),
//! `/status`, `/metrics` and server set changes, over a narrow [`Handle`] to the daemon.
//!
//! It runs on its own current-thread runtime on a dedicated thread, so a saturated data path
//! cannot starve it, and the probes answer from snapshots (an atomic heartbeat and a readiness
//! value refreshed every 100 ms) without taking a balancer lock. It listens on loopback by
//! default, optionally also on a unix socket (mode 0600); who may read and who may change is
//! in [`authz`]: changes only from root or lb's own user, or with `[admin] token_file`'s token. Request heads must arrive
//! within 5 s, bodies are limited to 64 KiB, handlers are bounded in time, connections in
//! number and lifetime.

mod accept;
pub mod api;
mod authz;
mod check;
pub mod client;
mod probes;
mod routes;
mod scrape;
mod servers;
mod slots;
mod token;

use std::{
    net::SocketAddr, os::unix::fs::PermissionsExt as _, path::PathBuf, sync::Arc, time::Duration,
};

use axum::{
    Json, Router,
    extract::{DefaultBodyLimit, Request, State},
    http::{StatusCode, header},
    middleware::Next,
    response::{IntoResponse, Response},
};
use hyper_util::rt::TokioTimer;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

use accept::{Listener, accept_loop, bind_tcp, bind_unix};
pub use api::{BalancerStatus, ConnectTableStatus, StatusBody};
pub use routes::{ENDPOINTS, Endpoint, Rule, SERVER_ACTIONS, Verb};
use token::TokenCache;
pub use token::{TokenError, read_token};

use crate::daemon::Handle;

/// Heartbeat older than this makes `/livez` fail.
pub const HEARTBEAT_STALE: Duration = Duration::from_secs(5);
/// Largest request body accepted (bytes); more is refused with 413.
pub const MAX_BODY_BYTES: usize = 64 * 1024;
/// A request head (line and headers) must arrive within this, or the connection is closed.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on handling one request but `/check` (which has its own, at most 60 s).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on one admin connection's life, keep-alive included.
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(120);
/// Admin connections served at once. At the limit the oldest idle one is closed for a new one;
/// when every one is handling a request, the new one is closed at accept ([`slots`]).
pub const MAX_CONNECTIONS: usize = 256;
/// Listen backlog of the admin and metrics listeners (the kernel caps it at
/// `net.core.somaxconn`): a burst of connections waits there for accept instead of overflowing
/// the queue, which drops new SYNs, a probe's among them (its retry comes a second later, past
/// the kubelet's default probe timeout).
const BACKLOG: i32 = 4096;
/// Largest buffered request head (bytes).
const MAX_HEAD_BYTES: usize = 16 * 1024;

/// Errors starting the admin API.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The TCP listener could not be bound.
    #[error("admin: cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The bind error.
        #[source]
        source: std::io::Error,
    },
    /// The unix socket could not be made.
    #[error("admin: cannot listen on unix socket {path}: {source}")]
    UnixSocket {
        /// The socket path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The bearer token file is unreadable or empty.
    #[error("admin: token file {path}: {reason}")]
    TokenFile {
        /// The file.
        path: PathBuf,
        /// Why it cannot be used.
        reason: TokenError,
    },
    /// The admin thread could not be started.
    #[error("admin: cannot start the admin thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// Build the `/status` body from the running daemon.
pub fn status(daemon: &Handle) -> StatusBody {
    StatusBody {
        pins: daemon.connect_pins().map(|(p, age)| api::PinsStatus {
            dir: p.dir,
            adopted: p.adopted,
            rebuilt: p.rebuilt,
            heartbeat_age_seconds: age.map(|a| a.as_secs_f64()),
        }),
        datapath: daemon.datapath_mode().to_string(),
        datapath_fallback: daemon.datapath_fallback().map(str::to_string),
        balancers: daemon
            .balancers()
            .iter()
            .map(|b| {
                let cfg = b.config();
                let (forwarding, forwarding_fallback) = daemon.forwarding(&b.name);
                let direct = daemon.connect_counts(b.id);
                let suspects = daemon.connect_suspects(b.id);
                let mut servers = b.status();
                for s in &mut servers {
                    s.suspect = s
                        .address
                        .socket_addr()
                        .is_some_and(|a| suspects.contains(&a));
                    if let Some(n) = s.address.socket_addr().and_then(|a| direct.get(&a)) {
                        s.connections += usize::try_from(*n).unwrap_or(usize::MAX);
                    }
                }
                BalancerStatus {
                    name: b.name.clone(),
                    listen: cfg.listen.clone(),
                    policy: cfg.policy.to_string(),
                    forwarding: forwarding.to_string(),
                    forwarding_fallback_reason: forwarding_fallback
                        .as_ref()
                        .map(|w| w.label().to_string()),
                    forwarding_fallback: forwarding_fallback.map(|w| w.to_string()),
                    namespaces: daemon.namespaces(&cfg).to_string(),
                    servers,
                    resolve: daemon.resolve(&cfg).to_string(),
                    names: b.names_status(),
                    discovery: b.discovery_status(),
                    connect_table: (forwarding == crate::config::Forwarding::Connect)
                        .then(|| daemon.connect_table(b.id))
                        .flatten()
                        .map(|(generation, servers)| ConnectTableStatus {
                            generation,
                            servers,
                        }),
                    kernel: daemon
                        .kernel_stats(b.id)
                        .map(|st| api::KernelCounters::from(&st)),
                }
            })
            .collect(),
    }
}

/// What the handlers share.
struct AdminState {
    daemon: Handle,
    probes: probes::Probes,
    checks: Arc<check::CheckRuns>,
    token: TokenCache,
}

/// An error answer: status plus `{"error": message}`.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
        }
    }

    fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }

    fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status,
            Json(api::ErrorBody {
                error: self.message,
            }),
        )
            .into_response()
    }
}

fn router(state: Arc<AdminState>) -> Router {
    outer(routes::routes(&state)).with_state(state)
}

/// What every admin router has around its routes: the 404 answer and the body limit.
fn outer<S: Clone + Send + Sync + 'static>(routes: Router<S>) -> Router<S> {
    routes
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
}

/// hyper's HTTP/1.1 server as the admin API runs it: the head read bounded in time and size.
fn http1() -> hyper::server::conn::http1::Builder {
    let mut b = hyper::server::conn::http1::Builder::new();
    b.timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(MAX_HEAD_BYTES);
    b
}

/// Serve one connection whose client side sends `request` (raw bytes, one or more HTTP/1.1
/// requests) and then closes its write side, with the admin API's HTTP server and routes but
/// the parsing handlers of [`routes::parsing_router`]; returns the raw bytes answered. The
/// admin API's fuzz target.
#[cfg(feature = "fuzz")]
pub(crate) async fn parse_exchange(request: &[u8]) -> Vec<u8> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let (client, server) = tokio::io::duplex(64 * 1024);
    let app = outer(routes::parsing_router());
    let serve = tokio::spawn(async move {
        let mut b = http1();
        // The client's write side closes after its last request: answer that request still.
        b.half_close(true);
        let _ = b
            .serve_connection(
                hyper_util::rt::TokioIo::new(server),
                hyper_util::service::TowerToHyperService::new(app),
            )
            .await;
    });
    let (mut rx, mut tx) = tokio::io::split(client);
    let mut answer = Vec::new();
    let write = async {
        let _ = tx.write_all(request).await;
        let _ = tx.shutdown().await;
    };
    let (_, read) = tokio::join!(write, rx.read_to_end(&mut answer));
    drop(read);
    let _ = serve.await;
    answer
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(format!("no endpoint {} {}", req.method(), req.uri().path()))
}

/// Bound a handler in time: past `limit` the caller gets 503 and the handler is dropped.
async fn bounded(limit: Duration, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(resp) => resp,
        Err(_) => {
            warn!(path, limit = ?limit, "admin request timed out");
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("request timed out after {limit:?}"),
            )
            .into_response()
        }
    }
}

/// `POST /upgrade`: hand everything to a new lb from lb's binary; 200 with
/// [`crate::daemon::upgrade::Upgraded`] (this process exits right after), 409 at once when
/// another upgrade is under way (or this lb handed over or is shutting down), 500 with the
/// reason when the new process did not take over (this one serves on).
async fn upgrade_handler(State(s): State<Arc<AdminState>>) -> Response {
    use crate::daemon::upgrade::UpgradeError;
    match s.daemon.upgrade().await {
        Ok(u) => Json(u).into_response(),
        Err(e @ UpgradeError::Refused(_)) => {
            ApiError::new(StatusCode::CONFLICT, e.to_string()).into_response()
        }
        Err(e @ UpgradeError::Failed(_)) => {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response()
        }
    }
}

async fn status_handler(State(s): State<Arc<AdminState>>) -> Json<StatusBody> {
    Json(status(&s.daemon))
}

async fn metrics(State(s): State<Arc<AdminState>>) -> Response {
    metrics_response(s.daemon.render_metrics())
}

/// A metrics body as an OpenMetrics answer.
fn metrics_response(body: String) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

/// Bind the admin listeners and serve them on a dedicated thread with its own runtime.
///
/// # Errors
/// [`AdminError`]: a listener that cannot be bound, an unusable token file, or no thread.
pub async fn start(daemon: Handle) -> Result<(), AdminError> {
    let cfg = daemon.config().admin.clone();
    if let Some(path) = &cfg.token_file {
        read_token(path).map_err(|reason| AdminError::TokenFile {
            path: path.clone(),
            reason,
        })?;
        if let Ok(m) = std::fs::metadata(path)
            && m.permissions().mode() & 0o077 != 0
        {
            warn!(file = %path.display(), "admin token file is readable by group or others");
        }
    } else if !cfg.listen.ip().is_loopback() {
        warn!(listen = %cfg.listen, "admin API on a non-loopback address without a token_file (allow_without_token): anyone who reaches it can read /status and /metrics");
    }
    // After `lb upgrade` the admin sockets are the old process's, served as they are.
    let tcp_key = crate::handover::ListenerKey::AdminTcp(cfg.listen);
    let tcp = match crate::handover::take_inherited(&tcp_key) {
        Some(fd) => std::net::TcpListener::from(fd),
        None => bind_tcp(cfg.listen).map_err(|source| AdminError::Bind {
            addr: cfg.listen,
            source,
        })?,
    };
    crate::handover::remember(tcp_key, std::os::fd::AsFd::as_fd(&tcp)).map_err(|source| {
        AdminError::Bind {
            addr: cfg.listen,
            source,
        }
    })?;
    tcp.set_nonblocking(true)
        .map_err(|source| AdminError::Bind {
            addr: cfg.listen,
            source,
        })?;
    let unix = cfg
        .unix_socket
        .as_deref()
        .map(|p| -> Result<_, AdminError> {
            let key = crate::handover::ListenerKey::AdminUnix(p.to_path_buf());
            let err = |source| AdminError::UnixSocket {
                path: p.to_path_buf(),
                source,
            };
            let l = match crate::handover::take_inherited(&key) {
                Some(fd) => {
                    let l = std::os::unix::net::UnixListener::from(fd);
                    l.set_nonblocking(true).map_err(err)?;
                    l
                }
                None => bind_unix(p)?,
            };
            crate::handover::remember(key, std::os::fd::AsFd::as_fd(&l)).map_err(err)?;
            Ok((l, p.to_path_buf()))
        })
        .transpose()?;
    let scrape = scrape::bind(&daemon)?;
    info!(listen = %cfg.listen, unix_socket = ?cfg.unix_socket, token = cfg.token_file.is_some(), "admin API listening");

    // Checks started by /check run on the daemon's runtime; the admin thread only waits.
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
            rt.block_on(serve(daemon, tcp, unix, scrape));
        })
        .map_err(AdminError::Thread)?;
    Ok(())
}

async fn serve(
    daemon: Handle,
    tcp: std::net::TcpListener,
    unix: Option<(std::os::unix::net::UnixListener, PathBuf)>,
    scrape: Option<std::net::TcpListener>,
) {
    let state = Arc::new(AdminState {
        probes: probes::Probes::new(&daemon),
        checks: Arc::new(check::CheckRuns::default()),
        token: TokenCache::default(),
        daemon: daemon.clone(),
    });
    let app = router(state.clone());
    let shutdown = daemon.shutdown_token();
    let conns = TaskTracker::new();
    let slots = slots::Slots::new(MAX_CONNECTIONS);
    let mut loops = Vec::new();
    match tokio::net::TcpListener::from_std(tcp) {
        Ok(l) => loops.push(tokio::spawn(accept_loop(
            Listener::Tcp(l),
            app.clone(),
            shutdown.clone(),
            conns.clone(),
            slots.clone(),
            daemon.admin_gate(),
        ))),
        Err(e) => error!(error = %e, "admin listener"),
    }
    if let Some((l, path)) = unix {
        match tokio::net::UnixListener::from_std(l) {
            Ok(l) => loops.push(tokio::spawn(accept_loop(
                Listener::Unix(l, path),
                app.clone(),
                shutdown.clone(),
                conns.clone(),
                slots.clone(),
                daemon.admin_gate(),
            ))),
            Err(e) => error!(error = %e, "admin unix listener"),
        }
    }
    if let Some(l) = scrape {
        loops.extend(scrape::spawn(l, &daemon, shutdown.clone(), conns.clone()));
    }
    probes::refresh_until(&state.probes, &daemon, &shutdown).await;
    for l in loops {
        let _ = l.await;
    }
    conns.close();
    let _ = tokio::time::timeout(Duration::from_secs(2), conns.wait()).await;
}
