//! Health checks: check kinds, the per-balancer scheduler (one check in flight per server,
//! `rise`/`fall` through [`Balancer::record_check`]) and check-before-dial.

use std::{
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::debug;

use crate::{
    balancer::Balancer,
    config::{CheckKind, HealthConfig},
    metrics::{CheckLabels, Metrics, ServerLabels},
};

/// Errors of one check.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// No answer within the timeout.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// Connect or I/O failure.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The check kind is not available in this build.
    #[error("check kind {0:?} is not supported")]
    Unsupported(CheckKind),
}

/// Run one check of `server` (`host:port`) as configured, bounded by `cfg.timeout`.
///
/// # Errors
/// [`CheckError`] saying why the server is unhealthy.
pub async fn check_once(cfg: &HealthConfig, server: &str) -> Result<(), CheckError> {
    let timeout = cfg.timeout.0;
    let fut = async {
        match cfg.kind {
            CheckKind::Tcp => tcp_check(server).await,
            other => Err(CheckError::Unsupported(other)),
        }
    };
    tokio::time::timeout(timeout, fut)
        .await
        .unwrap_or(Err(CheckError::Timeout(timeout)))
}

async fn tcp_check(server: &str) -> Result<(), CheckError> {
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host(server).await?.collect();
    let mut last = std::io::Error::new(
        std::io::ErrorKind::NotFound,
        format!("{server} resolved to no address"),
    );
    for addr in addrs {
        match tokio::net::TcpStream::connect(addr).await {
            Ok(s) => {
                // Close with RST so checks leave no TIME_WAIT behind on either side.
                let _ = socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO));
                return Ok(());
            }
            Err(e) => last = e,
        }
    }
    Err(last.into())
}

/// Runs checks for every balancer and records their results.
#[derive(Debug)]
pub struct HealthService {
    metrics: Arc<Metrics>,
    tasks: TaskTracker,
}

impl HealthService {
    /// New service; tasks are spawned on `tasks`.
    pub fn new(metrics: Arc<Metrics>, tasks: TaskTracker) -> Arc<HealthService> {
        Arc::new(HealthService { metrics, tasks })
    }

    /// Check `server` of `balancer` now and record the result.
    pub async fn check_and_record(&self, balancer: &Arc<Balancer>, server: &str) -> bool {
        let cfg = balancer.config().health;
        let inflight = self.metrics.inflight_guard();
        let start = Instant::now();
        let result = check_once(&cfg, server).await;
        drop(inflight);
        let ok = result.is_ok();
        self.metrics
            .health_check_duration
            .get_or_create(&ServerLabels {
                balancer: balancer.name.clone(),
                server: server.to_string(),
            })
            .observe(start.elapsed().as_secs_f64());
        self.metrics
            .health_checks
            .get_or_create(&CheckLabels {
                balancer: balancer.name.clone(),
                server: server.to_string(),
                result: if ok { "success" } else { "failure" }.into(),
            })
            .inc();
        if let Err(e) = &result {
            debug!(balancer = %balancer.name, server, error = %e, "check failed");
        }
        balancer.record_check(server, result.map_err(|e| e.to_string()));
        ok
    }

    /// Check-before-dial: when the last result of `server` is older than `max_age` (or there is
    /// none), check it now. Returns `false` when that check failed (the dialer then tries the
    /// server only after every other one).
    pub async fn before_dial(&self, balancer: &Arc<Balancer>, server: &str) -> bool {
        let max_age = balancer.config().health.max_age.0;
        if balancer
            .last_checked(server)
            .is_some_and(|t| t.elapsed() <= max_age)
        {
            return true;
        }
        self.check_and_record(balancer, server).await
    }

    /// Check every server of `balancer` once, concurrently.
    pub async fn check_all(self: &Arc<Self>, balancer: &Arc<Balancer>) {
        let specs = balancer.server_specs();
        let futs = specs.iter().map(|s| self.check_and_record(balancer, s));
        futures::future::join_all(futs).await;
    }

    /// Start the periodic loop of `balancer` (when `health.loop` is on) until `cancel` fires.
    pub fn start(self: &Arc<Self>, balancer: Arc<Balancer>, cancel: CancellationToken) {
        let this = self.clone();
        self.tasks.spawn(async move {
            loop {
                let cfg = balancer.config().health;
                if cfg.loop_enabled {
                    this.check_all(&balancer).await;
                    balancer.expire_drains();
                }
                tokio::select! {
                    () = cancel.cancelled() => return,
                    () = tokio::time::sleep(cfg.interval.0) => {}
                }
            }
        });
    }
}
