//! `/livez` and `/readyz`: answered in constant time from snapshots, never from balancer locks.
//!
//! Liveness is the control loop's heartbeat (an atomic the daemon's runtime bumps every 500 ms)
//! and never depends on servers' health. Readiness is computed every [`REFRESH`] by a task on
//! the admin thread and published through an `ArcSwap`.

use std::{sync::Arc, time::Duration};

use arc_swap::ArcSwap;
use axum::{
    extract::State,
    http::StatusCode,
    response::{IntoResponse, Response},
};
use tokio_util::sync::CancellationToken;

use super::{AdminState, HEARTBEAT_STALE};
use crate::{config::DatapathMode, daemon::Handle};

/// How often readiness is recomputed.
pub const REFRESH: Duration = Duration::from_millis(100);

/// The readiness snapshot.
#[derive(Debug)]
pub(super) struct Probes {
    ready: ArcSwap<Readiness>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Readiness {
    ready: bool,
    reason: String,
}

impl Probes {
    pub(super) fn new(daemon: &Handle) -> Probes {
        Probes {
            ready: ArcSwap::from_pointee(readiness(daemon)),
        }
    }

    fn refresh(&self, daemon: &Handle) {
        let now = readiness(daemon);
        if **self.ready.load() != now {
            self.ready.store(Arc::new(now));
        }
    }
}

/// Recompute readiness every [`REFRESH`] until `shutdown` fires.
pub(super) async fn refresh_until(probes: &Probes, daemon: &Handle, shutdown: &CancellationToken) {
    loop {
        probes.refresh(daemon);
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(REFRESH) => {}
        }
    }
}

/// Ready: config loaded (the daemon exists), data path attached as configured, first round of
/// checks done, every balancer has a usable server, and not shutting down.
fn readiness(d: &Handle) -> Readiness {
    let not = |reason: String| Readiness {
        ready: false,
        reason,
    };
    if d.shutting_down() {
        return not("shutting down: draining connections".into());
    }
    if d.config().datapath.mode == DatapathMode::Bpf && !d.datapath_attached() {
        return not("the bpf data path is not attached".into());
    }
    if !d.first_checks_done() {
        return not("first round of health checks not done".into());
    }
    for b in d.balancers().iter() {
        if !b.has_usable_server() {
            // A balancer fed by discovery may have no server yet: say what the source did.
            let why = match b.discovery_status() {
                Some(d) if d.last_success.is_none() => format!(
                    " ({} discovery has found none yet{})",
                    d.kind,
                    d.last_error
                        .map_or_else(String::new, |e| format!("; last error: {e}"))
                ),
                _ => String::new(),
            };
            return not(format!("balancer {} has no usable server{why}", b.name));
        }
    }
    Readiness {
        ready: true,
        reason: "ready".into(),
    }
}

pub(super) async fn livez(State(s): State<Arc<AdminState>>) -> Response {
    let d = &s.daemon;
    let age = d.heartbeat_age();
    if age > HEARTBEAT_STALE {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "control loop heartbeat is {} ms old (limit {} ms)\n",
                age.as_millis(),
                HEARTBEAT_STALE.as_millis()
            ),
        )
            .into_response();
    }
    (
        StatusCode::OK,
        format!("ok: datapath {}\n", d.datapath_mode()),
    )
        .into_response()
}

pub(super) async fn readyz(State(s): State<Arc<AdminState>>) -> Response {
    let r = s.probes.ready.load();
    let code = if r.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, format!("{}\n", r.reason)).into_response()
}
