//! Metrics: every `lb_*` family of the contract, registered once, encoded in the Prometheus /
//! OpenMetrics text format. Gauges that mirror state (server state, connections, kernel counters)
//! are refreshed from snapshots at scrape time.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, atomic::AtomicU64},
};

mod compat;
mod kernel;
mod labels;
mod register;

pub use compat::{
    CompatDialLabels, CompatMetrics, CompatServerLabels, DIAL_BUCKETS_COUNT, DIAL_BUCKETS_FACTOR,
    DIAL_BUCKETS_START, dial_buckets,
};
pub use labels::*;

use prometheus_client::{
    metrics::{MetricType, counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::{Metric, Registry},
};

use crate::{
    balancer::{Balancer, KillReason},
    config::Compat,
    datapath::Datapath,
};

/// All metric families.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// `lb_server_state`: the state as its number (0 INVALID ... 7 ACTIVE, K3s's order of preference).
    pub server_state: Family<ServerLabels, Gauge>,
    /// `lb_server_connections`.
    pub server_connections: Family<ServerLabels, Gauge>,
    /// `lb_dial_duration_seconds`.
    pub dial_duration: Family<DialLabels, Histogram>,
    /// `lb_health_checks_total`.
    pub health_checks: Family<CheckLabels, Counter>,
    /// `lb_health_check_duration_seconds`.
    pub health_check_duration: Family<ServerLabels, Histogram>,
    /// `lb_connections_killed_total`.
    pub connections_killed: Family<KillLabels, Counter>,
    /// `lb_spliced_connections`.
    pub spliced_connections: Family<BalancerLabel, Gauge>,
    /// `lb_spliced_bytes_total` (client_to_server from the kernel; server_to_client is copied).
    pub spliced_bytes: Family<DirectionLabels, Counter>,
    /// `lb_copied_bytes_total`: bytes lb copied in userspace.
    pub copied_bytes: Family<DirectionLabels, Counter>,
    /// `lb_splice_fallbacks_total`: sends that took the copy path in a spliced connection.
    pub splice_fallbacks: Family<FallbackLabels, Counter>,
    /// `lb_splice_blocking_redirects_total`: sends of blocking clients redirected past the credit
    /// (each waits in the kernel if the server socket has no room).
    pub splice_blocking_redirects: Family<BalancerLabel, Counter>,
    /// `lb_splice_credit_refreshes_total`: times the sk_msg program asked lb for more credit.
    pub splice_credit_refreshes: Family<BalancerLabel, Counter>,
    /// `lb_passive_events_total`: what connect-time sockets reported about their server (a
    /// failed connect, an established socket's first retransmission timeout).
    pub passive_events: Family<PassiveLabels, Counter>,
    /// `lb_passive_event_drops_total`: connect-time events the kernel dropped (ring full).
    pub passive_event_drops: Family<BalancerLabel, Counter>,
    /// `lb_connect_kill_netns_failures_total`: connect-time sockets a kill could not reach
    /// because their process's network namespace could not be opened or entered.
    pub connect_kill_netns_failures: Family<BalancerLabel, Counter>,
    /// `lb_connect_suspect_total`: times the kernel marked a server suspect (a connect-time
    /// connect's SYN went unanswered `suspect_after` times).
    pub connect_suspect: Family<ServerLabels, Counter>,
    /// `lb_netns_skipped_total`: sockets the kernel programs left alone because they are in
    /// another network namespace than the balancer's scope (`namespaces = "own"`).
    pub netns_skipped: Family<NetnsSkipLabels, Counter>,
    /// `lb_sockops_register_failures_total{balancer,reason}`: client sockets the sockops
    /// program could not register for the splice (they take the copy path).
    pub sockops_register_failures: Family<KernelReasonLabels, Counter>,
    /// `lb_connect_unrewritten_total{balancer,reason}`: connects to a connect-time listener the
    /// connect programs left as they were (the client reaches lb's listener).
    pub connect_unrewritten: Family<KernelReasonLabels, Counter>,
    /// `lb_datapath_info`.
    pub datapath_info: Family<ModeLabel, Gauge>,
    /// `lb_datapath_fallback_info`: one series per reason, 1 for why `datapath.mode = "auto"`
    /// runs the userspace copy path, 0 for the others (all 0 while the kernel data path runs).
    pub datapath_fallback: Family<ReasonLabel, Gauge>,
    /// `lb_balancer_forwarding_info`: one series per balancer, value 1.
    pub balancer_forwarding: Family<ForwardingLabels, Gauge>,
    /// `lb_balancer_forwarding_fallback_info`: per balancer and reason, 1 for why a balancer
    /// that asked for connect-time forwards through lb, 0 for the others.
    pub forwarding_fallback: Family<ForwardingFallbackLabels, Gauge>,
    /// `lb_inflight_checks`.
    pub inflight_checks: Gauge,
    /// `lb_runtime_alive_tasks`: tasks alive in lb's runtime, read at each scrape.
    pub runtime_tasks: Gauge,
    /// The runtime [`Metrics::with_compat`] was called on (the daemon's), whose tasks
    /// `lb_runtime_alive_tasks` counts; `None` outside a runtime.
    runtime: Option<tokio::runtime::Handle>,
    /// `lb_connect_heartbeat_age_seconds`: how old the heartbeat the connect programs see is.
    pub connect_heartbeat_age: Gauge<f64, AtomicU64>,
    /// `lb_connect_pins_adopted{dir}`: 1 when this lb adopted pins an earlier lb left, 0 when it
    /// pinned its own; absent when connect-time is not pinned.
    pub connect_pins_adopted: Family<PinsLabel, Gauge>,
    /// `lb_connections_total`: accepted client connections.
    pub connections_total: Family<BalancerLabel, Counter>,
    /// `lb_dials_abandoned_total`: dials given up because their server turned FAILED, was
    /// removed, drained or disabled while they were in progress.
    pub dials_abandoned: Family<BalancerLabel, Counter>,
    /// `lb_dials_raced_total`: dials made at once to every server because all were FAILED.
    pub dials_raced: Family<BalancerLabel, Counter>,
    /// `lb_clients_refused_total{reason}`: clients reset without a server (`all_failed`: every
    /// server FAILED with `all_failed = "refuse"`; `all_servers_failed`: no dial succeeded).
    pub clients_refused: Family<RefusedLabels, Counter>,
    /// `lb_connections_rejected_total{balancer,reason}`: clients reset at accept by a limit.
    pub connections_rejected: Family<RejectedLabels, Counter>,
    /// `lb_accept_errors_total{balancer,errno}`: failed accepts (out of descriptors: `EMFILE`,
    /// `ENFILE`).
    pub accept_errors: Family<AcceptErrorLabels, Counter>,
    /// `lb_discovery_runs_total{balancer,kind,result}`.
    pub discovery_runs: Family<DiscoveryRunLabels, Counter>,
    /// `lb_discovery_last_success_timestamp_seconds{balancer,kind}`: seconds since the Unix
    /// epoch of the last run that gave a usable list.
    pub discovery_last_success: Family<DiscoveryLabels, Gauge<f64, AtomicU64>>,
    /// `lb_discovery_servers{balancer,kind}`: servers in the last usable list.
    pub discovery_servers: Family<DiscoveryLabels, Gauge>,
    /// The K3s or RKE2 series (`[metrics] compat`), when asked for.
    pub compat: Option<CompatMetrics>,
    last_kernel: Mutex<HashMap<(String, String), u64>>,
    /// Held through [`Metrics::render`]: the admin API and the metrics listener may scrape at
    /// once, and one's clearing of the snapshot gauges must not empty the other's answer.
    rendering: Mutex<()>,
    /// Every registered family: its full name and type.
    families: Vec<(String, MetricType)>,
}

/// The registry being filled, and the name and type of each family registered in it:
/// prometheus-client encodes only the families that have a series, so the list is kept beside
/// it for [`Metrics::families`].
struct Listed {
    registry: Registry,
    families: Vec<(String, MetricType)>,
}

impl Listed {
    fn register(&mut self, name: &str, help: &str, metric: impl Metric) {
        self.families
            .push((format!("lb_{name}"), metric.metric_type()));
        self.registry.register(format!("lb_{name}"), help, metric);
    }
}

fn seconds_buckets() -> impl Iterator<Item = f64> {
    [
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ]
    .into_iter()
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// Register every `lb_*` family.
    pub fn new() -> Metrics {
        Metrics::with_compat(None)
    }

    /// Register every `lb_*` family, and the three K3s families of `compat` when given.
    pub fn with_compat(compat: Option<Compat>) -> Metrics {
        let mut m = Metrics {
            registry: Registry::default(),
            server_state: Family::<ServerLabels, Gauge>::default(),
            server_connections: Family::<ServerLabels, Gauge>::default(),
            dial_duration: Family::<DialLabels, Histogram>::new_with_constructor(|| {
                Histogram::new(seconds_buckets())
            }),
            health_checks: Family::<CheckLabels, Counter>::default(),
            health_check_duration: Family::<ServerLabels, Histogram>::new_with_constructor(|| {
                Histogram::new(seconds_buckets())
            }),
            connections_killed: Family::<KillLabels, Counter>::default(),
            spliced_connections: Family::<BalancerLabel, Gauge>::default(),
            spliced_bytes: Family::<DirectionLabels, Counter>::default(),
            copied_bytes: Family::<DirectionLabels, Counter>::default(),
            splice_fallbacks: Family::<FallbackLabels, Counter>::default(),
            splice_blocking_redirects: Family::<BalancerLabel, Counter>::default(),
            splice_credit_refreshes: Family::<BalancerLabel, Counter>::default(),
            passive_events: Family::<PassiveLabels, Counter>::default(),
            passive_event_drops: Family::<BalancerLabel, Counter>::default(),
            connect_kill_netns_failures: Family::<BalancerLabel, Counter>::default(),
            connect_suspect: Family::<ServerLabels, Counter>::default(),
            netns_skipped: Family::<NetnsSkipLabels, Counter>::default(),
            sockops_register_failures: Family::<KernelReasonLabels, Counter>::default(),
            connect_unrewritten: Family::<KernelReasonLabels, Counter>::default(),
            datapath_info: Family::<ModeLabel, Gauge>::default(),
            datapath_fallback: Family::<ReasonLabel, Gauge>::default(),
            balancer_forwarding: Family::<ForwardingLabels, Gauge>::default(),
            forwarding_fallback: Family::<ForwardingFallbackLabels, Gauge>::default(),
            inflight_checks: Gauge::default(),
            runtime_tasks: Gauge::default(),
            runtime: tokio::runtime::Handle::try_current().ok(),
            connect_heartbeat_age: Gauge::<f64, AtomicU64>::default(),
            connect_pins_adopted: Family::<PinsLabel, Gauge>::default(),
            connections_total: Family::<BalancerLabel, Counter>::default(),
            dials_abandoned: Family::<BalancerLabel, Counter>::default(),
            dials_raced: Family::<BalancerLabel, Counter>::default(),
            discovery_runs: Family::<DiscoveryRunLabels, Counter>::default(),
            discovery_last_success: Family::<DiscoveryLabels, Gauge<f64, AtomicU64>>::default(),
            discovery_servers: Family::<DiscoveryLabels, Gauge>::default(),
            clients_refused: Family::<RefusedLabels, Counter>::default(),
            connections_rejected: Family::<RejectedLabels, Counter>::default(),
            accept_errors: Family::<AcceptErrorLabels, Counter>::default(),
            compat: None,
            last_kernel: Mutex::new(HashMap::new()),
            rendering: Mutex::new(()),
            families: Vec::new(),
        };
        let mut r = Listed {
            registry: Registry::default(),
            families: Vec::new(),
        };
        m.register_state_and_traffic(&mut r);
        m.register_kernel_events(&mut r);
        m.register_datapath_state(&mut r);
        m.register_dials_and_discovery(&mut r);
        m.compat = compat.map(|c| CompatMetrics::register(c, &mut r.registry));
        m.registry = r.registry;
        m.families = r.families;
        m
    }

    /// Every registered family as `(name, type)`: `("lb_connections", "counter")`, whose
    /// samples are `lb_connections_total`. All of them, also those without a series yet (which
    /// [`Metrics::render`] leaves out).
    pub fn families(&self) -> impl Iterator<Item = (&str, &str)> {
        self.families.iter().map(|(n, t)| (n.as_str(), t.as_str()))
    }

    /// Count one check as running until the returned guard drops, so a check whose future is
    /// dropped midway (an on-demand check nobody waits for any more) leaves `lb_inflight_checks`
    /// as it found it.
    pub fn inflight_guard(&self) -> InflightGuard {
        self.inflight_checks.inc();
        InflightGuard {
            gauge: self.inflight_checks.clone(),
        }
    }

    /// The `lb_copied_bytes_total` counter of one balancer and direction, to bump per chunk.
    pub fn copied_counter(&self, balancer: &str, direction: &'static str) -> Counter {
        self.copied_bytes
            .get_or_create(&DirectionLabels {
                balancer: balancer.to_string(),
                direction: direction.to_string(),
            })
            .clone()
    }

    /// The names of the families `[metrics] compat` adds, for either program: what a dashboard
    /// may query besides [`Metrics::families`].
    pub fn compat_families() -> impl Iterator<Item = String> {
        [Compat::K3s, Compat::Rke2]
            .into_iter()
            .flat_map(CompatMetrics::names)
    }

    /// Observe one client's whole dial of `balancer` (every server it tried) in the compat
    /// histogram, when `[metrics] compat` is set: `ok` when it got a server.
    pub fn observe_client_dial(&self, balancer: &Balancer, ok: bool, seconds: f64) {
        if let Some(c) = &self.compat {
            c.observe_dial(balancer, ok, seconds);
        }
    }

    /// Refresh the snapshot gauges, create every series whose labels are known at 0, then
    /// encode everything.
    pub fn render(&self, balancers: &[Arc<Balancer>], datapath: Option<&Datapath>) -> String {
        let _one_at_a_time = self.rendering.lock().unwrap_or_else(|p| p.into_inner());
        self.server_state.clear();
        self.server_connections.clear();
        if let Some(c) = &self.compat {
            c.clear();
        }
        for b in balancers {
            self.refresh_servers(b, datapath);
            self.touch_balancer(b);
            if let Some(dp) = datapath {
                self.bump_kernel(b, dp);
            }
        }
        if let Some(dp) = datapath {
            self.refresh_pins(dp);
        }
        if let Some(h) = &self.runtime {
            let alive = h.metrics().num_alive_tasks();
            self.runtime_tasks
                .set(i64::try_from(alive).unwrap_or(i64::MAX));
        }
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!(error = %e, "metrics encoding failed");
        }
        out
    }

    /// Set `lb_connect_heartbeat_age_seconds` and `lb_connect_pins_adopted` from the pins.
    fn refresh_pins(&self, dp: &Datapath) {
        if let Some(age) = dp.heartbeat_age() {
            self.connect_heartbeat_age.set(age.as_secs_f64());
        }
        if let Some(p) = dp.pins_status() {
            self.connect_pins_adopted
                .get_or_create(&PinsLabel {
                    dir: p.dir.display().to_string(),
                })
                .set(i64::from(p.adopted));
        }
    }

    /// Set `lb_server_state` and `lb_server_connections` (and their compat twins) of every
    /// server of `b`, connect-time connections (counted by the kernel) included.
    fn refresh_servers(&self, b: &Balancer, datapath: Option<&Datapath>) {
        let direct = datapath.map(|d| d.connect_counts(b.id)).unwrap_or_default();
        let compat_name = self.compat.as_ref().map(|c| c.name_of(b));
        for s in b.status() {
            let l = ServerLabels {
                balancer: b.name.clone(),
                server: s.address.to_string(),
            };
            let direct = s
                .address
                .socket_addr()
                .and_then(|a| direct.get(&a).copied())
                .unwrap_or(0);
            let total = u64::try_from(s.connections)
                .unwrap_or(u64::MAX)
                .saturating_add(direct);
            let total = i64::try_from(total).unwrap_or(i64::MAX);
            self.server_state.get_or_create(&l).set(s.state as i64);
            self.server_connections.get_or_create(&l).set(total);
            self.touch_server(&l);
            if let (Some(c), Some(name)) = (&self.compat, &compat_name) {
                c.set_server(
                    name,
                    compat::server_label(&s.address),
                    s.state as i64,
                    total,
                );
            }
        }
        if let (Some(c), Some(name)) = (&self.compat, &compat_name) {
            c.touch(name);
        }
    }

    /// Create one server's counters and histograms at 0, so they are exposed before their first
    /// event (an `absent()` alert does not fire and `rate()` sees the first one).
    fn touch_server(&self, l: &ServerLabels) {
        let (balancer, server) = (&l.balancer, &l.server);
        let _ = self.health_check_duration.get_or_create(l);
        let _ = self.connect_suspect.get_or_create(l);
        for result in ["success", "failure"] {
            let _ = self.health_checks.get_or_create(&CheckLabels {
                balancer: balancer.clone(),
                server: server.clone(),
                result: result.into(),
            });
        }
        for reason in KillReason::ALL {
            let _ = self.connections_killed.get_or_create(&KillLabels {
                balancer: balancer.clone(),
                server: server.clone(),
                reason: reason.label().into(),
            });
        }
        for kind in ["connect_failed", "connect_abandoned", "rto"] {
            let _ = self.passive_events.get_or_create(&PassiveLabels {
                balancer: balancer.clone(),
                server: server.clone(),
                kind: kind.into(),
            });
        }
    }

    /// Create the per-balancer series at 0 (dials by status, bytes by direction, fallbacks by
    /// reason, ...), so they are exposed before the first event and `rate()` sees it.
    fn touch_balancer(&self, b: &Balancer) {
        let name = || b.name.clone();
        let balancer = BalancerLabel { balancer: name() };
        for family in [
            &self.splice_blocking_redirects,
            &self.splice_credit_refreshes,
            &self.passive_event_drops,
            &self.connect_kill_netns_failures,
            &self.connections_total,
            &self.dials_abandoned,
            &self.dials_raced,
        ] {
            let _ = family.get_or_create(&balancer);
        }
        let _ = self.spliced_connections.get_or_create(&balancer);
        for status in ["ok", "error"] {
            let _ = self.dial_duration.get_or_create(&DialLabels {
                balancer: name(),
                status: status.into(),
            });
        }
        for direction in ["client_to_server", "server_to_client"] {
            let l = DirectionLabels {
                balancer: name(),
                direction: direction.into(),
            };
            let _ = self.spliced_bytes.get_or_create(&l);
            let _ = self.copied_bytes.get_or_create(&l);
        }
        for r in lb_common::PassReason::ALL {
            let _ = self.splice_fallbacks.get_or_create(&FallbackLabels {
                balancer: name(),
                reason: r.label().into(),
            });
        }
        self.touch_kernel_reasons(&b.name);
        for program in ["connect", "sockops"] {
            let _ = self.netns_skipped.get_or_create(&NetnsSkipLabels {
                balancer: name(),
                program: program.into(),
            });
        }
        for reason in ["all_failed", "all_servers_failed"] {
            let _ = self.clients_refused.get_or_create(&RefusedLabels {
                balancer: name(),
                reason: reason.into(),
            });
        }
        let _ = self.connections_rejected.get_or_create(&RejectedLabels {
            balancer: name(),
            reason: "max_connections".into(),
        });
        for errno in ["EMFILE", "ENFILE"] {
            let _ = self.accept_errors.get_or_create(&AcceptErrorLabels {
                balancer: name(),
                errno: errno.into(),
            });
        }
        if let Some(d) = &b.config().discovery {
            for result in ["ok", "error"] {
                let _ = self.discovery_runs.get_or_create(&DiscoveryRunLabels {
                    balancer: name(),
                    kind: d.kind().into(),
                    result: result.into(),
                });
            }
        }
    }
}

/// One running check in `lb_inflight_checks`; decrements on drop (see [`Metrics::inflight_guard`]).
#[derive(Debug)]
pub struct InflightGuard {
    gauge: Gauge,
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}
