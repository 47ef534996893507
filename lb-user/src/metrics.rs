//! Metrics: every `lb_*` family of the contract, registered once, encoded in the Prometheus /
//! OpenMetrics text format. Gauges that mirror state (server state, connections, kernel counters)
//! are refreshed from snapshots at scrape time.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, atomic::AtomicU64},
};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{MetricType, counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::{Metric, Registry},
};

use crate::{balancer::Balancer, datapath::Datapath};

/// `{balancer}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BalancerLabel {
    /// Balancer name.
    pub balancer: String,
}

/// `{balancer,server}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServerLabels {
    /// Balancer name.
    pub balancer: String,
    /// Server address.
    pub server: String,
}

/// `{balancer,status}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DialLabels {
    /// Balancer name.
    pub balancer: String,
    /// `ok` or `error`.
    pub status: String,
}

/// `{balancer,server,result}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CheckLabels {
    /// Balancer name.
    pub balancer: String,
    /// Server address.
    pub server: String,
    /// `success` or `failure`.
    pub result: String,
}

/// `{balancer,server,reason}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KillLabels {
    /// Balancer name.
    pub balancer: String,
    /// Server address.
    pub server: String,
    /// [`crate::balancer::KillReason::label`].
    pub reason: String,
}

/// `{balancer,server,kind}` of `lb_passive_events_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PassiveLabels {
    /// Balancer name.
    pub balancer: String,
    /// Server address.
    pub server: String,
    /// [`crate::datapath::PassiveKind::label`]: `connect_failed` or `rto`.
    pub kind: String,
}

/// `{balancer,program}` of `lb_netns_skipped_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NetnsSkipLabels {
    /// Balancer name.
    pub balancer: String,
    /// `connect` (a `connect()` the connect programs did not rewrite) or `sockops` (a socket
    /// sockops did not register for the splice).
    pub program: String,
}

/// `{balancer,forwarding}` of `lb_balancer_forwarding_info`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ForwardingLabels {
    /// Balancer name.
    pub balancer: String,
    /// `splice` or `connect`: the forwarding in effect.
    pub forwarding: String,
}

/// `{balancer,direction}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DirectionLabels {
    /// Balancer name.
    pub balancer: String,
    /// `client_to_server` or `server_to_client`.
    pub direction: String,
}

/// `{balancer,reason}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FallbackLabels {
    /// Balancer name.
    pub balancer: String,
    /// [`lb_common::PassReason::label`].
    pub reason: String,
}

/// `{mode}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabel {
    /// `bpf` or `userspace`.
    pub mode: String,
}

/// `{balancer,kind}` of the discovery gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DiscoveryLabels {
    /// Balancer name.
    pub balancer: String,
    /// `dns`, `etcd` or `file`.
    pub kind: String,
}

/// `{balancer,kind,result}` of `lb_discovery_runs_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DiscoveryRunLabels {
    /// Balancer name.
    pub balancer: String,
    /// `dns`, `etcd` or `file`.
    pub kind: String,
    /// `ok` (a usable list) or `error` (failed or empty; the last good set stayed).
    pub result: String,
}

/// Labels of `lb_clients_refused_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusedLabels {
    /// Balancer name.
    pub balancer: String,
    /// `all_failed` or `all_servers_failed`.
    pub reason: String,
}

/// Labels of `lb_connections_rejected_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RejectedLabels {
    /// Balancer name.
    pub balancer: String,
    /// `max_connections`.
    pub reason: String,
}

/// Labels of `lb_accept_errors_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AcceptErrorLabels {
    /// Balancer name.
    pub balancer: String,
    /// The error's name, e.g. `EMFILE`.
    pub errno: String,
}

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
    /// `lb_datapath_info`.
    pub datapath_info: Family<ModeLabel, Gauge>,
    /// `lb_balancer_forwarding_info`: one series per balancer, value 1.
    pub balancer_forwarding: Family<ForwardingLabels, Gauge>,
    /// `lb_inflight_checks`.
    pub inflight_checks: Gauge,
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
    last_kernel: Mutex<HashMap<(String, String), u64>>,
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
        self.registry.register(name, help, metric);
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
    /// Register every family.
    pub fn new() -> Metrics {
        let mut registry = Listed {
            registry: Registry::with_prefix("lb"),
            families: Vec::new(),
        };
        let server_state = Family::<ServerLabels, Gauge>::default();
        registry.register(
            "server_state",
            "Server state: 0 INVALID, 1 FAILED, 2 STANDBY, 3 UNCHECKED, 4 RECOVERING, 5 HEALTHY, 6 PREFERRED, 7 ACTIVE",
            server_state.clone(),
        );
        let server_connections = Family::<ServerLabels, Gauge>::default();
        registry.register(
            "server_connections",
            "Open client connections per server",
            server_connections.clone(),
        );
        let dial_duration = Family::<DialLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(seconds_buckets())
        });
        registry.register(
            "dial_duration_seconds",
            "Time to dial a server, in seconds",
            dial_duration.clone(),
        );
        let health_checks = Family::<CheckLabels, Counter>::default();
        registry.register(
            "health_checks",
            "Health checks run, by result",
            health_checks.clone(),
        );
        let health_check_duration = Family::<ServerLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(seconds_buckets())
        });
        registry.register(
            "health_check_duration_seconds",
            "Duration of one health check, in seconds",
            health_check_duration.clone(),
        );
        let connections_killed = Family::<KillLabels, Counter>::default();
        registry.register(
            "connections_killed",
            "Connections lb reset, by reason",
            connections_killed.clone(),
        );
        let spliced_connections = Family::<BalancerLabel, Gauge>::default();
        registry.register(
            "spliced_connections",
            "Connections whose client-to-server bytes the kernel splices now",
            spliced_connections.clone(),
        );
        let spliced_bytes = Family::<DirectionLabels, Counter>::default();
        registry.register(
            "spliced_bytes",
            "Bytes carried by the kernel splice, by direction",
            spliced_bytes.clone(),
        );
        let copied_bytes = Family::<DirectionLabels, Counter>::default();
        registry.register(
            "copied_bytes",
            "Bytes lb copied in userspace, by direction",
            copied_bytes.clone(),
        );
        let splice_fallbacks = Family::<FallbackLabels, Counter>::default();
        registry.register(
            "splice_fallbacks",
            "Client sends that took the copy path instead of the splice, by reason",
            splice_fallbacks.clone(),
        );
        let splice_blocking_redirects = Family::<BalancerLabel, Counter>::default();
        registry.register(
            "splice_blocking_redirects",
            "Sends of blocking clients spliced past the credit; each waits in the kernel if the server socket has no room, as on a direct connection",
            splice_blocking_redirects.clone(),
        );
        let splice_credit_refreshes = Family::<BalancerLabel, Counter>::default();
        registry.register(
            "splice_credit_refreshes",
            "Times the kernel program asked lb to recompute a connection's credit from its server socket's queue",
            splice_credit_refreshes.clone(),
        );
        let passive_events = Family::<PassiveLabels, Counter>::default();
        registry.register(
            "passive_events",
            "Connect-time sockets' reports about their server: connect_failed (a rewritten connect never got established) or rto (an established socket's first retransmission timeout)",
            passive_events.clone(),
        );
        let passive_event_drops = Family::<BalancerLabel, Counter>::default();
        registry.register(
            "passive_event_drops",
            "Connect-time events the kernel dropped because lb's ring buffer was full",
            passive_event_drops.clone(),
        );
        let connect_kill_netns_failures = Family::<BalancerLabel, Counter>::default();
        registry.register(
            "connect_kill_netns_failures",
            "Connect-time sockets a kill or abort could not reach because their process's network namespace could not be opened (process gone, or no CAP_SYS_PTRACE) or entered (no CAP_SYS_ADMIN); each process is logged with its pid",
            connect_kill_netns_failures.clone(),
        );
        let connect_suspect = Family::<ServerLabels, Counter>::default();
        registry.register(
            "connect_suspect",
            "Times the kernel marked a server suspect because a connect-time connect's SYN went unanswered suspect_after times; new connects avoid it until a check passes",
            connect_suspect.clone(),
        );
        let netns_skipped = Family::<NetnsSkipLabels, Counter>::default();
        registry.register(
            "netns_skipped",
            "Sockets of another network namespace than lb's that dialed a listener's address and were left alone (namespaces = \"own\"): connect (not rewritten) or sockops (not registered for the splice)",
            netns_skipped.clone(),
        );
        let datapath_info = Family::<ModeLabel, Gauge>::default();
        registry.register(
            "datapath_info",
            "Data path in use (value 1)",
            datapath_info.clone(),
        );
        let balancer_forwarding = Family::<ForwardingLabels, Gauge>::default();
        registry.register(
            "balancer_forwarding_info",
            "Forwarding in effect per balancer: splice (through lb) or connect (kernel sends clients straight to the server) (value 1)",
            balancer_forwarding.clone(),
        );
        let inflight_checks = Gauge::default();
        registry.register(
            "inflight_checks",
            "Health checks running now, on-demand ones included",
            inflight_checks.clone(),
        );
        let connections_total = Family::<BalancerLabel, Counter>::default();
        registry.register(
            "connections",
            "Client connections accepted",
            connections_total.clone(),
        );
        let dials_abandoned = Family::<BalancerLabel, Counter>::default();
        registry.register(
            "dials_abandoned",
            "Dials given up because their server turned FAILED, was removed or held meanwhile",
            dials_abandoned.clone(),
        );
        let dials_raced = Family::<BalancerLabel, Counter>::default();
        registry.register(
            "dials_raced",
            "Dials made at once to every server because all were FAILED",
            dials_raced.clone(),
        );
        let discovery_runs = Family::<DiscoveryRunLabels, Counter>::default();
        registry.register(
            "discovery_runs",
            "Discovery runs, by result: ok gave a usable list, error failed or found no server (the last good set stayed)",
            discovery_runs.clone(),
        );
        let discovery_last_success = Family::<DiscoveryLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "discovery_last_success_timestamp_seconds",
            "When discovery last gave a usable list, in seconds since the Unix epoch",
            discovery_last_success.clone(),
        );
        let discovery_servers = Family::<DiscoveryLabels, Gauge>::default();
        registry.register(
            "discovery_servers",
            "Servers in the last usable list discovery gave",
            discovery_servers.clone(),
        );
        let clients_refused = Family::<RefusedLabels, Counter>::default();
        registry.register(
            "clients_refused",
            "Clients reset without reaching a server",
            clients_refused.clone(),
        );
        let connections_rejected = Family::<RejectedLabels, Counter>::default();
        registry.register(
            "connections_rejected",
            "Clients reset at accept by a limit (max_connections)",
            connections_rejected.clone(),
        );
        let accept_errors = Family::<AcceptErrorLabels, Counter>::default();
        registry.register(
            "accept_errors",
            "Failed accepts on a balancer's listeners, by error (EMFILE, ENFILE: out of descriptors)",
            accept_errors.clone(),
        );
        let Listed { registry, families } = registry;
        Metrics {
            registry,
            server_state,
            server_connections,
            dial_duration,
            health_checks,
            health_check_duration,
            connections_killed,
            spliced_connections,
            spliced_bytes,
            copied_bytes,
            splice_fallbacks,
            splice_blocking_redirects,
            splice_credit_refreshes,
            passive_events,
            passive_event_drops,
            connect_kill_netns_failures,
            connect_suspect,
            netns_skipped,
            datapath_info,
            balancer_forwarding,
            inflight_checks,
            connections_total,
            dials_abandoned,
            dials_raced,
            clients_refused,
            connections_rejected,
            accept_errors,
            discovery_runs,
            discovery_last_success,
            discovery_servers,
            last_kernel: Mutex::new(HashMap::new()),
            families,
        }
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

    /// Refresh the snapshot gauges, then encode everything.
    pub fn render(&self, balancers: &[Arc<Balancer>], datapath: Option<&Datapath>) -> String {
        self.server_state.clear();
        self.server_connections.clear();
        for b in balancers {
            // Connect-time connections go straight to the server; the kernel counts them.
            let direct = datapath.map(|d| d.connect_counts(b.id)).unwrap_or_default();
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
                self.server_state.get_or_create(&l).set(s.state as i64);
                self.server_connections
                    .get_or_create(&l)
                    .set(i64::try_from(total).unwrap_or(i64::MAX));
            }
            let _ = self
                .spliced_connections
                .get_or_create(&BalancerLabel {
                    balancer: b.name.clone(),
                })
                .get();
            self.touch_balancer(&b.name);
            if let Some(dp) = datapath {
                let st = dp.stats(b.id);
                let name = b.name.as_str();
                let balancer = BalancerLabel {
                    balancer: b.name.clone(),
                };
                self.bump(
                    &self.spliced_bytes,
                    &DirectionLabels {
                        balancer: b.name.clone(),
                        direction: "client_to_server".into(),
                    },
                    (name, "client_to_server"),
                    st.redirected_bytes,
                );
                let _ = self
                    .spliced_bytes
                    .get_or_create(&DirectionLabels {
                        balancer: b.name.clone(),
                        direction: "server_to_client".into(),
                    })
                    .get();
                self.bump(
                    &self.splice_blocking_redirects,
                    &balancer,
                    (name, "blocking_redirects"),
                    st.blocking_redirects,
                );
                self.bump(
                    &self.splice_credit_refreshes,
                    &balancer,
                    (name, "credit_refreshes"),
                    st.refresh_requests,
                );
                self.bump(
                    &self.passive_event_drops,
                    &balancer,
                    (name, "passive_event_drops"),
                    st.connect_event_drops,
                );
                for (program, n) in [
                    ("connect", st.netns_skipped_connects),
                    ("sockops", st.netns_skipped_sockets),
                ] {
                    self.bump(
                        &self.netns_skipped,
                        &NetnsSkipLabels {
                            balancer: b.name.clone(),
                            program: program.into(),
                        },
                        (name, &format!("netns_skipped:{program}")),
                        n,
                    );
                }
                for r in lb_common::PassReason::ALL {
                    self.bump(
                        &self.splice_fallbacks,
                        &FallbackLabels {
                            balancer: b.name.clone(),
                            reason: r.label().into(),
                        },
                        (name, &format!("fallback:{}", r.label())),
                        st.pass[r as usize],
                    );
                }
            }
        }
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!(error = %e, "metrics encoding failed");
        }
        out
    }

    /// Create the per-balancer series that exist from the start at 0 (dials by status, bytes by
    /// direction), so they are exposed before the first event and `rate()` sees it.
    fn touch_balancer(&self, balancer: &str) {
        for status in ["ok", "error"] {
            let _ = self.dial_duration.get_or_create(&DialLabels {
                balancer: balancer.to_string(),
                status: status.into(),
            });
        }
        for direction in ["client_to_server", "server_to_client"] {
            let l = DirectionLabels {
                balancer: balancer.to_string(),
                direction: direction.into(),
            };
            let _ = self.spliced_bytes.get_or_create(&l);
            let _ = self.copied_bytes.get_or_create(&l);
        }
    }

    /// Advance the counter `labels` of `family` to the kernel's running total `now`; the last
    /// total seen is kept per balancer under `what`.
    fn bump<S: Clone + std::hash::Hash + Eq>(
        &self,
        family: &Family<S, Counter>,
        labels: &S,
        (balancer, what): (&str, &str),
        now: u64,
    ) {
        let mut last = self.last_kernel.lock().expect("poisoned");
        let prev = last
            .insert((balancer.to_string(), what.to_string()), now)
            .unwrap_or(0);
        family
            .get_or_create(labels)
            .inc_by(now.saturating_sub(prev));
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
