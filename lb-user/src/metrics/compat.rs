//! The K3s/RKE2 agent load balancer's series (`[metrics] compat`), exported next to lb's own so
//! the dashboards and alerts written for K3s keep working: the names, labels, label values and
//! buckets of K3s's `pkg/agent/loadbalancer/metrics.go`.
//!
//! | K3s series | lb's own | labels |
//! | --- | --- | --- |
//! | `<program>_loadbalancer_server_connections` | `lb_server_connections` | `name`, `server` |
//! | `<program>_loadbalancer_server_health` | `lb_server_state` | `name`, `server` |
//! | `<program>_loadbalancer_dial_duration_seconds` | `lb_dial_duration_seconds` | `name`, `status` |
//!
//! `name` is the balancer's [`compat_name`], `server` its address as `host:port`. A dial is
//! observed once per client across the server list (K3s wraps its whole `dialContext`), with
//! `status` `success` or `error` (K3s's `pkg/util/metrics.ObserveWithStatus`), where lb's own
//! histogram observes each attempt at one server.

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

use crate::{
    addr::ServerAddr,
    balancer::Balancer,
    config::{Compat, compat_name},
};

/// Lower bound of the first dial bucket, in seconds (K3s: `ExponentialBuckets(0.001, 2, 15)`).
pub const DIAL_BUCKETS_START: f64 = 0.001;
/// Each dial bucket's bound is this many times the previous one's.
pub const DIAL_BUCKETS_FACTOR: f64 = 2.0;
/// Number of dial buckets, `+Inf` not counted: the last bound is 16.384 s.
pub const DIAL_BUCKETS_COUNT: u16 = 15;

/// The upper bounds of K3s's dial buckets, in seconds: 0.001, 0.002, ... 16.384.
pub fn dial_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(
        DIAL_BUCKETS_START,
        DIAL_BUCKETS_FACTOR,
        DIAL_BUCKETS_COUNT,
    )
}

/// `{name,server}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CompatServerLabels {
    /// The balancer's [`compat_name`].
    pub name: String,
    /// Server address, `host:port`.
    pub server: String,
}

/// `{name,status}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CompatDialLabels {
    /// The balancer's [`compat_name`].
    pub name: String,
    /// `success` or `error`.
    pub status: String,
}

/// The three K3s families of one program (`k3s` or `rke2`).
#[derive(Debug)]
pub struct CompatMetrics {
    compat: Compat,
    /// `<program>_loadbalancer_server_connections`: open client connections per server.
    pub connections: Family<CompatServerLabels, Gauge>,
    /// `<program>_loadbalancer_server_health`: the server state as its number, 0 INVALID ...
    /// 7 ACTIVE, the same values as K3s's.
    pub health: Family<CompatServerLabels, Gauge>,
    /// `<program>_loadbalancer_dial_duration_seconds`: one client's dial across the server list.
    pub dials: Family<CompatDialLabels, Histogram>,
}

impl CompatMetrics {
    /// The full names of the three families of `compat`, in the order of the table above.
    pub fn names(compat: Compat) -> [String; 3] {
        let p = compat.program();
        [
            format!("{p}_loadbalancer_server_connections"),
            format!("{p}_loadbalancer_server_health"),
            format!("{p}_loadbalancer_dial_duration_seconds"),
        ]
    }

    /// Register the three families of `compat` in `registry` (which must have no prefix).
    pub fn register(compat: Compat, registry: &mut Registry) -> CompatMetrics {
        let m = CompatMetrics {
            compat,
            connections: Family::default(),
            health: Family::default(),
            dials: Family::new_with_constructor(|| Histogram::new(dial_buckets())),
        };
        let [connections, health, dials] = CompatMetrics::names(compat);
        registry.register(
            connections,
            "Open client connections per load balancer server (lb_server_connections)",
            m.connections.clone(),
        );
        registry.register(
            health,
            "Load balancer server state: 0 INVALID, 1 FAILED, 2 STANDBY, 3 UNCHECKED, 4 RECOVERING, 5 HEALTHY, 6 PREFERRED, 7 ACTIVE (lb_server_state)",
            m.health.clone(),
        );
        registry.register(
            dials,
            "Time one client's dial across the server list took, in seconds, by success or error",
            m.dials.clone(),
        );
        m
    }

    /// The `name` label of `balancer`'s series.
    pub fn name_of(&self, balancer: &Balancer) -> String {
        compat_name(self.compat, &balancer.config())
    }

    /// Observe one client's dial of `balancer` that took `seconds` and gave a server (`ok`) or
    /// none.
    pub fn observe_dial(&self, balancer: &Balancer, ok: bool, seconds: f64) {
        self.dials
            .get_or_create(&CompatDialLabels {
                name: self.name_of(balancer),
                status: status(ok).into(),
            })
            .observe(seconds);
    }

    /// Drop the gauges before a refresh, so servers that left disappear.
    pub(super) fn clear(&self) {
        self.connections.clear();
        self.health.clear();
    }

    /// Set one server's gauges; create the balancer's dial series at 0.
    pub(super) fn set_server(&self, name: &str, server: String, state: i64, connections: i64) {
        let l = CompatServerLabels {
            name: name.to_string(),
            server,
        };
        self.health.get_or_create(&l).set(state);
        self.connections.get_or_create(&l).set(connections);
    }

    /// Create `name`'s dial series (`success`, `error`) at 0.
    pub(super) fn touch(&self, name: &str) {
        for ok in [true, false] {
            let _ = self.dials.get_or_create(&CompatDialLabels {
                name: name.to_string(),
                status: status(ok).into(),
            });
        }
    }
}

/// The `server` label as K3s prints a server, `host:port`; one address of a host name lb
/// dials separately (`name:port (address)` in `/status`) as `address:port`, so each keeps a
/// series of its own.
pub fn server_label(server: &ServerAddr) -> String {
    match server.pin() {
        Some(ip) => std::net::SocketAddr::new(ip, server.port()).to_string(),
        None => server.authority(),
    }
}

/// K3s's `status` value: `success` or `error`.
fn status(ok: bool) -> &'static str {
    if ok { "success" } else { "error" }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_k3s_exponential_layout() {
        let b: Vec<f64> = dial_buckets().collect();
        assert_eq!(b.len(), 15);
        assert!((b[0] - 0.001).abs() < 1e-12, "{b:?}");
        assert!((b[14] - 16.384).abs() < 1e-9, "{b:?}");
        for w in b.windows(2) {
            assert!((w[1] / w[0] - 2.0).abs() < 1e-9, "{b:?}");
        }
    }

    #[test]
    fn server_label_is_host_port() {
        let name: ServerAddr = "k3s-1.example:6443".parse().unwrap();
        assert_eq!(server_label(&name), "k3s-1.example:6443");
        let pinned = name.pinned_to("192.0.2.7".parse().unwrap());
        assert_eq!(pinned.to_string(), "k3s-1.example:6443 (192.0.2.7)");
        assert_eq!(server_label(&pinned), "192.0.2.7:6443");
        let v6: ServerAddr = "[2001:db8::1]:6443".parse().unwrap();
        assert_eq!(server_label(&v6), "[2001:db8::1]:6443");
    }

    #[test]
    fn names_carry_the_program() {
        assert_eq!(
            CompatMetrics::names(Compat::K3s),
            [
                "k3s_loadbalancer_server_connections",
                "k3s_loadbalancer_server_health",
                "k3s_loadbalancer_dial_duration_seconds",
            ]
        );
        assert_eq!(
            CompatMetrics::names(Compat::Rke2)[1],
            "rke2_loadbalancer_server_health"
        );
    }

    #[test]
    fn encoded_series_use_k3s_labels_and_buckets() {
        let mut registry = Registry::default();
        let m = CompatMetrics::register(Compat::K3s, &mut registry);
        m.set_server("k3s-agent-load-balancer", "192.0.2.11:6443".into(), 7, 3);
        m.touch("k3s-agent-load-balancer");
        m.dials
            .get_or_create(&CompatDialLabels {
                name: "k3s-agent-load-balancer".into(),
                status: "success".into(),
            })
            .observe(0.003);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        for want in [
            "k3s_loadbalancer_server_health{name=\"k3s-agent-load-balancer\",server=\"192.0.2.11:6443\"} 7",
            "k3s_loadbalancer_server_connections{name=\"k3s-agent-load-balancer\",server=\"192.0.2.11:6443\"} 3",
            "k3s_loadbalancer_dial_duration_seconds_bucket{le=\"0.004\",name=\"k3s-agent-load-balancer\",status=\"success\"} 1",
            "k3s_loadbalancer_dial_duration_seconds_bucket{le=\"0.002\",name=\"k3s-agent-load-balancer\",status=\"success\"} 0",
            "k3s_loadbalancer_dial_duration_seconds_bucket{le=\"16.384\",name=\"k3s-agent-load-balancer\",status=\"error\"} 0",
            "k3s_loadbalancer_dial_duration_seconds_count{name=\"k3s-agent-load-balancer\",status=\"error\"} 0",
        ] {
            assert!(out.contains(want), "missing {want} in\n{out}");
        }
    }
}
