//! Passive health from connect-time sockets: what the kernel reports of a socket it sent to a
//! server (a failed connect, a retransmission timeout) counted, and turned into a hint
//! against that server where the report is the server's doing.

use std::sync::Arc;

use tokio::runtime::Handle;

use crate::{
    balancer::Balancer,
    datapath::{PassiveKind, PassiveSink},
    metrics::{Metrics, PassiveLabels},
};

/// The balancers now; `None` once the daemon is gone.
pub type Balancers = Arc<dyn Fn() -> Option<Arc<Vec<Arc<Balancer>>>> + Send + Sync>;

/// Where connect-time sockets' reports go: counted in `lb_passive_events_total`, then, with
/// `health.passive`, a connect the server failed (refused, timed out, unreachable) and an RTO
/// (at most one per check interval) as a reset by it, toward `passive_reset_limit`; a connect
/// its client abandoned counts nowhere else. Runs on the `lb-passive` thread, entering `runtime`
/// for the checks a hint starts.
pub fn passive_sink(balancers: Balancers, metrics: Arc<Metrics>, runtime: Handle) -> PassiveSink {
    Arc::new(move |id, addr, kind| {
        let Some(bs) = balancers() else { return };
        let _rt = runtime.enter();
        let Some(b) = bs.iter().find(|b| b.id == id) else {
            return;
        };
        let Some(server) = b.server_at(addr) else {
            return;
        };
        metrics
            .passive_events
            .get_or_create(&PassiveLabels {
                balancer: b.name.clone(),
                server: server.to_string(),
                kind: kind.label().into(),
            })
            .inc();
        tracing::debug!(balancer = %b.name, %server, kind = kind.label(), "connect-time passive signal");
        match kind {
            PassiveKind::ConnectFailed => {
                b.record_connect_failure(&server);
            }
            PassiveKind::ConnectAbandoned => {}
            PassiveKind::Rto => {
                b.record_rto(&server);
            }
        }
    })
}
