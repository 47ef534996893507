//! The counters the kernel programs keep per balancer (`LB_STATS`, `LB_CONNECT_STATS`), carried
//! into the Prometheus counters at scrape time.

use lb_common::{RegisterFailure, Unrewritten};
use prometheus_client::metrics::{counter::Counter, family::Family};

use super::{
    BalancerLabel, DirectionLabels, FallbackLabels, KernelReasonLabels, Metrics, NetnsSkipLabels,
};
use crate::{balancer::Balancer, datapath::Datapath};

impl Metrics {
    /// Create `balancer`'s per-reason kernel series at 0, so they exist from the first scrape.
    pub(super) fn touch_kernel_reasons(&self, balancer: &str) {
        let labels = |reason: &str| KernelReasonLabels {
            balancer: balancer.to_string(),
            reason: reason.to_string(),
        };
        for r in RegisterFailure::ALL {
            let _ = self
                .sockops_register_failures
                .get_or_create(&labels(r.label()));
        }
        for r in Unrewritten::ALL {
            let _ = self.connect_unrewritten.get_or_create(&labels(r.label()));
        }
    }

    /// Advance the counters the kernel keeps for `b` to the kernel's running totals.
    pub(super) fn bump_kernel(&self, b: &Balancer, dp: &Datapath) {
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
        for (family, what, n) in [
            (
                &self.splice_blocking_redirects,
                "blocking_redirects",
                st.blocking_redirects,
            ),
            (
                &self.splice_credit_refreshes,
                "credit_refreshes",
                st.refresh_requests,
            ),
            (
                &self.passive_event_drops,
                "passive_event_drops",
                st.connect_event_drops,
            ),
        ] {
            self.bump(family, &balancer, (name, what), n);
        }
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
        for r in RegisterFailure::ALL {
            self.bump(
                &self.sockops_register_failures,
                &KernelReasonLabels {
                    balancer: b.name.clone(),
                    reason: r.label().into(),
                },
                (name, &format!("register_failure:{}", r.label())),
                st.register_failures[r as usize],
            );
        }
        for r in Unrewritten::ALL {
            self.bump(
                &self.connect_unrewritten,
                &KernelReasonLabels {
                    balancer: b.name.clone(),
                    reason: r.label().into(),
                },
                (name, &format!("unrewritten:{}", r.label())),
                st.unrewritten[r as usize],
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
