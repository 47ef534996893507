//! lb's control of the connect programs (`LB_CONNECT_CTL`): whose `connect()` is lb's own, and
//! whether lb's heartbeat is recent enough to steer; and the count of connects left as they
//! were, by reason (`BalancerStats::unrewritten`).

use aya_ebpf::helpers::bpf_ktime_get_boot_ns;
use lb_common::{CTL_HEARTBEAT_NS, CTL_ORPHAN_NS, CTL_OWN_TGID, Unrewritten};

use super::maps::{LB_CONNECT_CTL, LB_CONNECT_STATS};

/// What lb's control map says of a `connect()` by process `tgid`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Control {
    /// lb is alive and the connect is not its own: rewrite it.
    Steer,
    /// lb's own connect (its checks, its dials), while lb's heartbeat is fresh: never
    /// rewritten, never counted.
    Own,
    /// lb's heartbeat is older than the orphan timeout (or lb never wrote its control): a lb
    /// gone for longer leaves connects alone, so kernel state without a live lb stops steering
    /// after a bound.
    Orphaned,
}

/// How recent lb's heartbeat (written every 0.5 s) must be for `CTL_OWN_TGID` to name a live
/// lb: once it is older, lb is gone and its process id may be another process's, whose
/// connects are steered like any client's.
const OWN_ALIVE_NS: u64 = 2_000_000_000;

#[inline(always)]
pub(super) fn control(tgid: u32) -> Control {
    let (Some(own), Some(beat), Some(orphan)) = (
        LB_CONNECT_CTL.get(CTL_OWN_TGID),
        LB_CONNECT_CTL.get(CTL_HEARTBEAT_NS),
        LB_CONNECT_CTL.get(CTL_ORPHAN_NS),
    ) else {
        return Control::Orphaned;
    };
    // SAFETY: no preconditions.
    let age = unsafe { bpf_ktime_get_boot_ns() }.saturating_sub(*beat);
    if u64::from(tgid) == *own && age <= OWN_ALIVE_NS {
        return Control::Own;
    }
    if *orphan == 0 || age <= *orphan {
        Control::Steer
    } else {
        Control::Orphaned
    }
}

/// Count a `connect()` to `balancer`'s listener that is left as it was.
#[inline(always)]
pub(super) fn unrewritten(balancer: u32, why: Unrewritten) {
    if let Some(stats) = LB_CONNECT_STATS.get_ptr_mut(balancer) {
        // SAFETY: per-CPU slot, no other writer on this CPU while we run.
        unsafe { (*stats).unrewritten[why as usize] += 1 };
    }
}
