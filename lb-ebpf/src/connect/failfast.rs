//! Fail fast in the kernel: a rewritten connect's SYN retransmission timeout and SYN retries
//! come from its server's [`SynPolicy`] (`LB_CONNECT_SYN`), and a connect whose SYN went
//! unanswered `suspect_after` times marks its server suspect (`LB_CONNECT_SUSPECT`), which the
//! connect programs then pass over while another server is in the table.
//!
//! Minimum kernel: 4.13 for `BPF_SOCK_OPS_TIMEOUT_INIT`, 4.16 for `BPF_SOCK_OPS_RTO_CB`, 5.8
//! for `bpf_ktime_get_boot_ns`, 5.9 for `TCP_SYNCNT` through `bpf_setsockopt` (an older kernel
//! refuses it, which leaves its `tcp_syn_retries`); all older than the data path's 5.15.

use aya_ebpf::{
    bindings::{BPF_NOEXIST, BPF_TCP_SYN_SENT},
    cty::c_void,
    helpers::{bpf_get_socket_cookie, bpf_ktime_get_boot_ns, bpf_setsockopt},
    programs::SockOpsContext,
};
use lb_common::{ConnectCountKey, ConnectServer, ConnectTable, MAX_CONNECT_SERVERS, SynPolicy};

use super::maps::{LB_CONNECT_SOCKS, LB_CONNECT_SUSPECT, LB_CONNECT_SYN};

/// `SOL_TCP` from `<netinet/tcp.h>`.
const SOL_TCP: i32 = 6;
/// `TCP_SYNCNT` from `<netinet/tcp.h>`.
const TCP_SYNCNT: i32 = 7;

/// The policy of the server a rewritten socket (by `cookie`) was sent to, if lb gave one.
#[inline(always)]
fn policy_of(cookie: u64) -> Option<(ConnectCountKey, SynPolicy)> {
    // SAFETY: copied out at once.
    let orig = unsafe { LB_CONNECT_SOCKS.get(&cookie) }.copied()?;
    // SAFETY: copied out at once.
    let policy = unsafe { LB_CONNECT_SYN.get(&orig.count) }.copied()?;
    Some((orig.count, policy))
}

/// Sockops `TCP_CONNECT_CB` (before the SYN leaves): a rewritten socket gets `TCP_SYNCNT` from
/// its server's policy, so a connect to a dead server ends with `ETIMEDOUT` after that many
/// SYN retransmissions even while lb is not there to abort it.
#[inline(always)]
pub(super) fn on_connect(ctx: &SockOpsContext, cookie: u64) {
    let Some((_, policy)) = policy_of(cookie) else {
        return;
    };
    if policy.syn_retries == 0 {
        return;
    }
    let mut n = policy.syn_retries as i32;
    // SAFETY: the program's own context (a full socket in TCP_CONNECT_CB), a 4-byte value.
    // An error (an older kernel refusing the option) leaves the kernel's tcp_syn_retries.
    let _ = unsafe {
        bpf_setsockopt(
            ctx.ops.cast::<c_void>(),
            SOL_TCP,
            TCP_SYNCNT,
            core::ptr::addr_of_mut!(n).cast::<c_void>(),
            4,
        )
    };
}

/// Sockops `TIMEOUT_INIT` (from the kernel's `tcp_timeout_init`, when the SYN is about to be
/// sent and again at each SYN timeout): a rewritten socket's SYN retransmission timeout, in
/// jiffies, as its server's policy says. Other sockets keep whatever reply they have (0 for
/// the kernel's 1 s, or another sockops program's).
#[inline(always)]
pub(crate) fn on_timeout_init(ctx: &SockOpsContext) -> u32 {
    // SAFETY: the program's own context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.ops.cast()) };
    if let Some((_, policy)) = policy_of(cookie)
        && policy.timeout_jiffies > 0
    {
        ctx.set_reply(policy.timeout_jiffies);
    }
    1
}

/// Sockops `RTO_CB` of a rewritten socket not yet established: the connect's `n`th SYN
/// timeout (`arg(0)` is the retransmissions so far, `n - 1`). At `suspect_after` the server
/// is marked suspect with the time (the first mark stays until lb deletes it).
#[inline(always)]
pub(super) fn on_syn_rto(ctx: &SockOpsContext, cookie: u64) {
    // SAFETY: one 4-byte load of this callback's context.
    let state = unsafe { core::ptr::read_volatile(core::ptr::addr_of!((*ctx.ops).state)) };
    if state != BPF_TCP_SYN_SENT {
        return;
    }
    let Some((key, policy)) = policy_of(cookie) else {
        return;
    };
    if policy.suspect_after == 0 || ctx.arg(0).saturating_add(1) < policy.suspect_after {
        return;
    }
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_boot_ns() };
    let _ = LB_CONNECT_SUSPECT.insert(&key, &now, u64::from(BPF_NOEXIST));
}

/// Whether `server` of `balancer` is marked suspect.
#[inline(always)]
fn suspect(server: &ConnectServer, balancer: u32) -> bool {
    let key = ConnectCountKey {
        server: *server,
        balancer,
        _pad: 0,
    };
    // SAFETY: only presence is read.
    unsafe { LB_CONNECT_SUSPECT.get(&key) }.is_some()
}

/// How many servers after a suspect pick the connect programs look at. A small constant, so
/// the check stays a few straight-line lookups for the verifier of every kernel (a loop over
/// the whole table made 6.1's verifier take longer than lb's start-up allows under emulation).
const AVOID_LOOKAHEAD: usize = 3;

/// The index to send a connect to, given the policy's `pick` (< `count`): `pick` unless its
/// server is suspect, else the first of the next [`AVOID_LOOKAHEAD`] servers in table order
/// that is not (for `failover`, the next in preference order); `pick` when those are suspect
/// too, so a connect still goes somewhere (K3s's "try them all"). Index < `count`.
#[inline(always)]
pub(super) fn avoid_suspect(
    table: &ConnectTable,
    balancer: u32,
    pick: usize,
    count: usize,
) -> usize {
    let Some(first) = table.servers.get(pick) else {
        return pick;
    };
    if !suspect(first, balancer) {
        return pick;
    }
    for step in 1..=AVOID_LOOKAHEAD {
        if step >= count {
            break;
        }
        let i = pick + step;
        let i = if i >= count { i - count } else { i };
        // i < count <= MAX_CONNECT_SERVERS: the mask only gives the verifier the bound.
        let i = core::hint::black_box(i) & (MAX_CONNECT_SERVERS - 1);
        if let Some(s) = table.servers.get(i)
            && !suspect(s, balancer)
        {
            return i;
        }
    }
    pick
}
