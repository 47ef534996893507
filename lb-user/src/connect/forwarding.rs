//! Which forwarding each balancer gets: what the config asks for (`splice`, `connect`, `auto`)
//! against what the data path offers, with the reason when a balancer forwards through lb
//! instead of connect-time, as `/status` text and as `lb_balancer_forwarding_fallback_info`.

use std::collections::HashMap;

use tracing::{info, warn};

use crate::{
    config::{Config, Forwarding},
    datapath::Datapath,
    metrics::{ForwardingFallbackLabels, ForwardingLabels, Metrics},
};

/// Why a balancer that asked for connect-time (`forwarding = "connect"` or `"auto"`) forwards
/// through lb (splice, or copy) instead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ForwardingFallback {
    /// The kernel data path is off: `datapath.mode = "userspace"`, or `auto` fell back (the
    /// text names why).
    DatapathOff(String),
    /// The data path runs, but the connect-time programs are not attached: the kernel lacks a
    /// program type, attach type or helper they need (the text names it).
    KernelFeature(String),
    /// The balancer dials its servers through an HTTP CONNECT proxy, which a client sent
    /// straight to a server cannot use (`auto` only; `connect` with a proxy is refused by
    /// config validation).
    Proxy,
}

impl ForwardingFallback {
    /// Every reason, in the label order of the docs.
    pub const LABELS: [&'static str; 3] = ["datapath_off", "kernel_feature", "proxy"];

    /// The label value: `datapath_off`, `kernel_feature` or `proxy`.
    pub fn label(&self) -> &'static str {
        match self {
            ForwardingFallback::DatapathOff(_) => "datapath_off",
            ForwardingFallback::KernelFeature(_) => "kernel_feature",
            ForwardingFallback::Proxy => "proxy",
        }
    }
}

impl std::fmt::Display for ForwardingFallback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ForwardingFallback::DatapathOff(why) => {
                write!(f, "the kernel data path is off ({why})")
            }
            ForwardingFallback::KernelFeature(why) => f.write_str(why),
            ForwardingFallback::Proxy => f.write_str(
                "the balancer dials its servers through an HTTP CONNECT proxy, which connect-time clients cannot use",
            ),
        }
    }
}

/// Each balancer's forwarding in effect and, when it is not the one asked for, why.
pub type ForwardingMap = HashMap<String, (Forwarding, Option<ForwardingFallback>)>;

/// Each balancer's forwarding: `splice` as asked; `connect` needs the kernel data path with the
/// connect-time programs attached, and without them the balancer uses splice (or copy), with one
/// warning naming why; `auto` is connect-time where it can be and splice otherwise, with one info
/// line naming which and why. `datapath_fallback` is why the data path is off, when it is.
pub fn decide(
    cfg: &Config,
    datapath: Option<&Datapath>,
    datapath_fallback: Option<&str>,
) -> ForwardingMap {
    let mut out = HashMap::new();
    for b in &cfg.balancers {
        let want = cfg.forwarding_of(b);
        let unavailable = || match datapath {
            None => Some(ForwardingFallback::DatapathOff(
                datapath_fallback
                    .unwrap_or("datapath.mode = userspace")
                    .to_string(),
            )),
            Some(dp) => dp
                .connect_unavailable()
                .map(|why| ForwardingFallback::KernelFeature(why.to_string())),
        };
        let why = match want {
            Forwarding::Splice => None,
            Forwarding::Connect => unavailable(),
            Forwarding::Auto if b.proxy.is_some() => Some(ForwardingFallback::Proxy),
            Forwarding::Auto => unavailable(),
        };
        let got = if want == Forwarding::Splice || why.is_some() {
            Forwarding::Splice
        } else {
            Forwarding::Connect
        };
        match (want, &why) {
            (Forwarding::Connect, Some(why)) => {
                warn!(balancer = %b.name, reason = %why, "forwarding = connect unavailable; this balancer forwards through lb (splice or copy)");
            }
            (Forwarding::Auto, Some(why)) => {
                info!(balancer = %b.name, reason = %why, "forwarding = auto: splice (through lb)");
            }
            (Forwarding::Auto, None) => {
                info!(balancer = %b.name, "forwarding = auto: connect-time (the kernel sends clients straight to the server)");
            }
            _ => {}
        }
        out.insert(b.name.clone(), (got, why));
    }
    out
}

/// Each balancer's forwarding in effect as `lb_balancer_forwarding_info`, and
/// `lb_balancer_forwarding_fallback_info` with one series per balancer and reason: 1 for why
/// the balancer forwards through lb instead of connect-time, 0 for the others.
pub fn record(metrics: &Metrics, cfg: &Config, forwarding: &ForwardingMap) {
    for b in &cfg.balancers {
        let (f, why) = forwarding
            .get(&b.name)
            .map_or((Forwarding::Splice, None), |(f, why)| (*f, why.as_ref()));
        metrics
            .balancer_forwarding
            .get_or_create(&ForwardingLabels {
                balancer: b.name.clone(),
                forwarding: f.to_string(),
            })
            .set(1);
        for reason in ForwardingFallback::LABELS {
            metrics
                .forwarding_fallback
                .get_or_create(&ForwardingFallbackLabels {
                    balancer: b.name.clone(),
                    reason: reason.to_string(),
                })
                .set(i64::from(why.is_some_and(|w| w.label() == reason)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_has_its_label_and_names_why() {
        let all = [
            ForwardingFallback::DatapathOff("datapath.mode = userspace".into()),
            ForwardingFallback::KernelFeature("no cgroup/connect4 attach type".into()),
            ForwardingFallback::Proxy,
        ];
        let labels: Vec<_> = all.iter().map(ForwardingFallback::label).collect();
        assert_eq!(labels, ForwardingFallback::LABELS);
        assert_eq!(
            all[0].to_string(),
            "the kernel data path is off (datapath.mode = userspace)"
        );
        assert_eq!(all[1].to_string(), "no cgroup/connect4 attach type");
        assert!(all[2].to_string().contains("HTTP CONNECT proxy"));
    }

    #[test]
    fn without_a_data_path_connect_and_auto_fall_back_and_splice_does_not() {
        let cfg = Config::from_toml(
            r#"
[datapath]
mode = "userspace"

[[balancer]]
name = "c"
listen = ["127.0.0.1:7001"]
servers = ["127.0.0.1:7101"]
forwarding = "connect"

[[balancer]]
name = "s"
listen = ["127.0.0.1:7002"]
servers = ["127.0.0.1:7102"]
forwarding = "splice"
"#,
            "test",
        )
        .expect("config");
        let m = decide(&cfg, None, None);
        assert_eq!(
            m["c"],
            (
                Forwarding::Splice,
                Some(ForwardingFallback::DatapathOff(
                    "datapath.mode = userspace".into()
                ))
            )
        );
        assert_eq!(m["s"], (Forwarding::Splice, None));
        let metrics = Metrics::new();
        record(&metrics, &cfg, &m);
        let text = metrics.render(&[], None);
        assert!(
            text.contains(
                r#"lb_balancer_forwarding_fallback_info{balancer="c",reason="datapath_off"} 1"#
            ),
            "{text}"
        );
        assert!(
            text.contains(
                r#"lb_balancer_forwarding_fallback_info{balancer="s",reason="datapath_off"} 0"#
            ),
            "{text}"
        );
    }
}
