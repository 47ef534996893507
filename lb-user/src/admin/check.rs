//! `/check?balancer=NAME&timeout=DUR`: run the health checks now.
//!
//! Callers with the same scope (one balancer, or all) share one run. A run is a task on the
//! daemon's runtime driven by [`Handle::spawn_checks`] through the [`SingleFlight`] helper;
//! each caller holds a clone of a shared future that owns the task and aborts it on drop. So a
//! caller that times out or disconnects (hyper then drops its handler) stops waiting, and when
//! the last one goes the run is aborted: no check outlives its callers, which
//! `lb_inflight_checks` shows.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use axum::{
    Json,
    extract::{Query, State, rejection::QueryRejection},
    http::StatusCode,
    response::{IntoResponse, Response},
};
use futures::FutureExt as _;
use serde::Deserialize;
use tracing::debug;

use super::{
    AdminState, ApiError,
    api::{BalancerCheck, CheckReport, ServerCheck},
};
use crate::{
    balancer::Balancer,
    daemon::Handle,
    singleflight::{Run, SingleFlight},
};

/// Shortest timeout a caller can ask for; shorter ones are raised to it.
pub const MIN_TIMEOUT: Duration = Duration::from_millis(100);
/// Longest timeout; longer ones are lowered to it.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(60);
/// Timeout when the caller gives none.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// The runs in progress, by scope (`None`: every balancer), each with its start.
#[derive(Debug, Default)]
pub(super) struct CheckRuns {
    runs: SingleFlight<Option<String>, (), Instant>,
}

/// Aborts the run's task when the shared future holding it is dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl CheckRuns {
    /// Join the run of `scope` in progress, or start one over `balancers` on the daemon's
    /// runtime. Returns the run's start, whether it was joined, and the future to wait on.
    fn join(
        &self,
        daemon: &Handle,
        scope: Option<String>,
        balancers: Vec<Arc<Balancer>>,
    ) -> (Instant, bool, Run<()>) {
        self.runs.join(scope, Instant::now, || {
            let task = daemon.spawn_checks(balancers);
            let guard = AbortOnDrop(task.abort_handle());
            async move {
                let _guard = guard;
                let _ = task.await;
            }
            .boxed()
        })
    }
}

/// Query parameters of `/check`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CheckQuery {
    balancer: Option<String>,
    timeout: Option<String>,
}

/// Parse and clamp `timeout` to [[`MIN_TIMEOUT`], [`MAX_TIMEOUT`]].
///
/// # Errors
/// [`crate::config::DurationError`]: not a duration.
fn parse_timeout(raw: Option<&str>) -> Result<Duration, crate::config::DurationError> {
    let Some(raw) = raw else {
        return Ok(DEFAULT_TIMEOUT);
    };
    Ok(crate::config::parse_duration(raw)?.clamp(MIN_TIMEOUT, MAX_TIMEOUT))
}

/// The query of `/check`: the balancer asked for (all when `None`) and the timeout, clamped.
///
/// # Errors
/// 400 naming an unknown parameter or a timeout that is not a duration.
fn request(
    query: Result<Query<CheckQuery>, QueryRejection>,
) -> Result<(Option<String>, Duration), ApiError> {
    let Query(q) = query.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let timeout = parse_timeout(q.timeout.as_deref())
        .map_err(|e| ApiError::bad_request(format!("timeout: {e}")))?;
    Ok((q.balancer, timeout))
}

/// `/check`'s query as [`handler`] parses it, before it looks a balancer up: what
/// [`super::routes::parsing_router`] answers with (the admin API's fuzz target).
#[cfg(feature = "fuzz")]
pub(super) async fn parsed(
    query: Result<Query<CheckQuery>, QueryRejection>,
) -> Result<String, ApiError> {
    let (scope, timeout) = request(query)?;
    Ok(format!("{scope:?} within {timeout:?}"))
}

pub(super) async fn handler(
    State(s): State<Arc<AdminState>>,
    query: Result<Query<CheckQuery>, QueryRejection>,
) -> Response {
    let (scope, timeout) = match request(query) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let balancers: Vec<Arc<Balancer>> = match &scope {
        Some(name) => match s.daemon.balancer(name) {
            Some(b) => vec![b],
            None => {
                return ApiError::not_found(format!("no balancer named {name:?}")).into_response();
            }
        },
        None => s.daemon.balancers().iter().cloned().collect(),
    };
    let waited = Instant::now();
    let (started, shared, run) = s.checks.join(&s.daemon, scope.clone(), balancers.clone());
    let timed_out = tokio::time::timeout(timeout, run).await.is_err();
    let report = report(
        &balancers,
        started,
        timeout,
        waited.elapsed(),
        shared,
        timed_out,
    );
    debug!(balancer = ?scope, healthy = report.healthy, timed_out, shared, "/check");
    let code = if report.healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(report)).into_response()
}

/// Results of the run that started at `started`: a server's result belongs to it when it was
/// recorded after that instant.
fn report(
    balancers: &[Arc<Balancer>],
    started: Instant,
    timeout: Duration,
    elapsed: Duration,
    shared: bool,
    timed_out: bool,
) -> CheckReport {
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let balancers: Vec<BalancerCheck> = balancers
        .iter()
        .map(|b| {
            let servers: Vec<ServerCheck> = b
                .status()
                .into_iter()
                .map(|st| {
                    let ours = b.last_checked(&st.address).is_some_and(|t| t >= started);
                    ServerCheck {
                        ok: ours.then_some(st.last_error.is_none()),
                        error: if ours { st.last_error } else { None },
                        state: st.state,
                        address: st.address.to_string(),
                    }
                })
                .collect();
            // When the run timed out (one slow server), a balancer is still healthy if a server
            // passed its check in this run: one dead server must not fail a liveness probe.
            let passed_now = servers.iter().any(|s: &ServerCheck| s.ok == Some(true));
            BalancerCheck {
                name: b.name.clone(),
                healthy: if timed_out {
                    passed_now && b.has_usable_server()
                } else {
                    b.has_usable_server()
                },
                servers,
            }
        })
        .collect();
    CheckReport {
        healthy: balancers.iter().all(|b| b.healthy),
        timed_out,
        timeout_ms: ms(timeout),
        elapsed_ms: ms(elapsed),
        shared,
        balancers,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_is_clamped_and_validated() {
        assert_eq!(parse_timeout(None).unwrap(), DEFAULT_TIMEOUT);
        assert_eq!(
            parse_timeout(Some("250ms")).unwrap(),
            Duration::from_millis(250)
        );
        assert_eq!(parse_timeout(Some("1ms")).unwrap(), MIN_TIMEOUT);
        assert_eq!(parse_timeout(Some("10m")).unwrap(), MAX_TIMEOUT);
        assert!(parse_timeout(Some("soon")).is_err());
        assert!(parse_timeout(Some("-1s")).is_err());
        assert!(parse_timeout(Some("")).is_err());
    }
}
