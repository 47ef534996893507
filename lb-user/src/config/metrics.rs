//! `[metrics]`: series exported under the K3s or RKE2 agent load balancer's names next to lb's
//! own, and a listen address of its own that serves only `GET /metrics`.

use std::{collections::HashSet, net::SocketAddr};

use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize};

use super::{BalancerConfig, Config, ConfigError};

/// `[metrics] compat`: whose load balancer series lb also exports.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Compat {
    /// `k3s_loadbalancer_*`.
    K3s,
    /// `rke2_loadbalancer_*`.
    Rke2,
}

impl Compat {
    /// The program name K3s puts in front of its series and service names (`version.Program`):
    /// `k3s` or `rke2`.
    pub fn program(self) -> &'static str {
        match self {
            Compat::K3s => "k3s",
            Compat::Rke2 => "rke2",
        }
    }
}

/// `[metrics]`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Also export the agent load balancer's three series under K3s's or RKE2's names; none
    /// when absent.
    pub compat: Option<Compat>,
    /// Serve `GET /metrics` (read-only, no token) on this address too, so a scraper off the node
    /// can reach it while the admin API stays on loopback; none when absent.
    #[serde(deserialize_with = "listen_addr")]
    #[schemars(with = "Option<super::schema::ListenAddr>")]
    pub listen: Option<SocketAddr>,
}

/// `listen` as `ADDR:PORT`, refused with a message naming the key.
fn listen_addr<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SocketAddr>, D::Error> {
    let text = String::deserialize(d)?;
    text.parse().map(Some).map_err(|_| {
        serde::de::Error::custom(format!(
            "metrics.listen: {text:?} is not ADDR:PORT (e.g. \"0.0.0.0:9902\" or \"[::]:9902\")"
        ))
    })
}

impl MetricsConfig {
    /// Check `listen` against the other addresses lb binds (`listeners`: every balancer's), and
    /// each balancer's `metrics_name`.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the key: `metrics.listen` with port 0 or equal to the
    /// admin address or a balancer's listener (both would bind it); a `metrics_name` that is
    /// empty, holds a control character, or is the compat name of another balancer too (their
    /// series would mix).
    pub fn validate(&self, cfg: &Config, listeners: &[SocketAddr]) -> Result<(), ConfigError> {
        let mut names = HashSet::new();
        for (i, b) in cfg.balancers.iter().enumerate() {
            let key = format!("balancer[{i}].metrics_name");
            if let Some(n) = &b.metrics_name
                && (n.is_empty() || n.chars().any(char::is_control))
            {
                return Err(ConfigError::invalid(
                    key,
                    n,
                    "must be non-empty and without control characters",
                ));
            }
            let Some(compat) = self.compat else { continue };
            let name = compat_name(compat, b);
            if !names.insert(name.clone()) {
                return Err(ConfigError::invalid(
                    key,
                    name,
                    "another balancer's compat series already use this name",
                ));
            }
        }
        let Some(listen) = self.listen else {
            return Ok(());
        };
        let refuse = |why: &str| Err(ConfigError::invalid("metrics.listen", listen, why));
        if listen.port() == 0 {
            return refuse("needs a fixed port for the scraper to find");
        }
        if listen == cfg.admin.listen {
            return refuse("is admin.listen too; the admin API already serves /metrics there");
        }
        if listeners.contains(&listen) {
            return refuse("is a balancer's listen address too");
        }
        Ok(())
    }
}

/// The `name` label of one balancer's compat series: its `metrics_name`, else K3s's service
/// name for the balancers of the shipped layouts (`deploy/k3s/`, `deploy/rke2/`), else its own
/// name.
///
/// K3s names its load balancers `<program>-agent-load-balancer` (the supervisor, which on a K3s
/// agent also carries the apiserver), `<program>-api-server-agent-load-balancer` (RKE2's
/// apiserver) and `<program>-etcd-server-load-balancer` (`SupervisorServiceName`,
/// `APIServerServiceName`, `ETCDServerServiceName` in K3s's
/// `pkg/agent/loadbalancer/loadbalancer.go`).
pub fn compat_name(compat: Compat, b: &BalancerConfig) -> String {
    if let Some(n) = &b.metrics_name {
        return n.clone();
    }
    let program = compat.program();
    match b.name.as_str() {
        "supervisor" => format!("{program}-agent-load-balancer"),
        "apiserver" => format!("{program}-api-server-agent-load-balancer"),
        "etcd" => format!("{program}-etcd-server-load-balancer"),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> Result<Config, ConfigError> {
        Config::from_toml_with(text, "test.toml", super::super::CredentialFiles::Skip)
    }

    const BALANCERS: &str = r#"
[[balancer]]
name = "supervisor"
listen = ["127.0.0.1:6444"]
servers = ["192.0.2.11:6443"]

[[balancer]]
name = "other"
listen = ["127.0.0.1:7000"]
servers = ["192.0.2.11:7000"]
"#;

    #[test]
    fn compat_names_follow_k3s_service_names() {
        let cfg = config(&format!("[metrics]\ncompat = \"rke2\"\n{BALANCERS}")).unwrap();
        assert_eq!(cfg.metrics.compat, Some(Compat::Rke2));
        let names: Vec<String> = cfg
            .balancers
            .iter()
            .map(|b| compat_name(Compat::Rke2, b))
            .collect();
        assert_eq!(names, ["rke2-agent-load-balancer", "other"]);
        let mut b = cfg.balancers[1].clone();
        for (name, want) in [
            ("apiserver", "k3s-api-server-agent-load-balancer"),
            ("etcd", "k3s-etcd-server-load-balancer"),
        ] {
            b.name = name.into();
            assert_eq!(compat_name(Compat::K3s, &b), want);
        }
        b.metrics_name = Some("mine".into());
        assert_eq!(compat_name(Compat::K3s, &b), "mine");
    }

    #[test]
    fn bad_listen_and_names_are_refused_naming_the_key() {
        let e = config(&format!("[metrics]\nlisten = \"9902\"\n{BALANCERS}")).unwrap_err();
        assert!(e.to_string().contains("metrics.listen"), "{e}");
        assert!(e.to_string().contains("not ADDR:PORT"), "{e}");
        for (listen, why) in [
            ("127.0.0.1:9901", "admin.listen"),
            ("127.0.0.1:6444", "balancer's listen"),
            ("0.0.0.0:0", "fixed port"),
        ] {
            let e = config(&format!("[metrics]\nlisten = \"{listen}\"\n{BALANCERS}"))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("metrics.listen") && e.contains(why),
                "{listen}: {e}"
            );
        }
        let ok = config(&format!(
            "[metrics]\nlisten = \"0.0.0.0:9902\"\n{BALANCERS}"
        ))
        .unwrap();
        assert_eq!(ok.metrics.listen, Some("0.0.0.0:9902".parse().unwrap()));
        let dup = BALANCERS.replace(
            "name = \"other\"",
            "name = \"other\"\nmetrics_name = \"k3s-agent-load-balancer\"",
        );
        let e = config(&format!("[metrics]\ncompat = \"k3s\"\n{dup}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("balancer[1].metrics_name"), "{e}");
        let e = config(&format!("[metrics]\ncompat = \"k3s3\"\n{BALANCERS}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("compat"), "{e}");
    }
}
