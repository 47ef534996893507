//! A rewritten socket's life after its connect, in connect-time's sockops and `sock_release`
//! programs: counted per server once established ([`on_established`]), asked for its state
//! changes and RTOs from its connect on ([`on_connect`]), a failed connect and the first RTO
//! reported to lb ([`report`]), and uncounted and forgotten when it closes or its last
//! descriptor goes ([`on_state`], [`on_release`]).

use aya_ebpf::{
    bindings::{
        BPF_NOEXIST, BPF_SOCK_OPS_RTO_CB_FLAG, BPF_SOCK_OPS_STATE_CB_FLAG, BPF_TCP_SYN_SENT,
    },
    cty::c_void,
    helpers::{bpf_get_socket_cookie, bpf_skc_to_tcp_sock},
    programs::{SockContext, SockOpsContext},
};
use lb_common::{
    ConnectCountKey, ConnectEvent, ConnectOrig, EVENT_CONNECT_FAILED, EVENT_RTO, REPORTED_RTO,
};

use super::{
    failfast,
    maps::{
        LB_CONNECT_COUNTS, LB_CONNECT_EVENTS, LB_CONNECT_SOCKS, LB_CONNECT_STATS, LB_OFF_SK_ERR,
    },
};

/// The sockops callbacks a rewritten socket asks for: state changes (its close uncounts it; a
/// failed connect is reported) and retransmission timeouts (reported once).
const CB_FLAGS: i32 = (BPF_SOCK_OPS_STATE_CB_FLAG | BPF_SOCK_OPS_RTO_CB_FLAG) as i32;

/// Add `delta` (wrapping; `u64::MAX` is -1) to the count of `key`.
#[inline(always)]
fn count_add(key: &ConnectCountKey, delta: u64) {
    let _ = LB_CONNECT_COUNTS.insert(key, &0, u64::from(BPF_NOEXIST));
    if let Some(n) = LB_CONNECT_COUNTS.get_ptr_mut(key) {
        // SAFETY: a live map value; every writer adds atomically. `AtomicU64::fetch_add` is
        // not offered on the BPF target (no compare-and-swap), the intrinsic is: an atomic add
        // whose result is unused, which the BPF backend emits as one `lock xadd`.
        unsafe {
            core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
                n, delta,
            );
        }
    }
}

/// Sockops `ACTIVE_ESTABLISHED`: a socket a connect program rewrote is counted for its server,
/// and asked to report its state changes so its close uncounts it.
#[inline(always)]
pub(super) fn on_established(ctx: &SockOpsContext) {
    // SAFETY: the program's own context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.ops.cast()) };
    let Some(orig) = LB_CONNECT_SOCKS.get_ptr_mut(&cookie) else {
        return;
    };
    // SAFETY: a live map value; one socket's callbacks run under its lock.
    let orig = unsafe { &mut *orig };
    if orig.established == 0 && crate::add_cb_flags(ctx, CB_FLAGS).is_ok() {
        orig.established = 1;
        count_add(&orig.count, 1);
    }
}

/// Sockops `TCP_CONNECT_CB` (before the SYN is sent): a socket a connect program rewrote asks
/// for its state changes and retransmission timeouts from now on, so a connect that fails is
/// reported ([`on_state`]), and its own address (bound by now) is recorded for lb's kills. A
/// record whose server is not the socket's peer (left by an earlier connect of the socket
/// that failed before its SYN) is forgotten instead.
#[inline(always)]
pub(super) fn on_connect(ctx: &SockOpsContext) {
    // SAFETY: the program's own context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.ops.cast()) };
    let Some(orig) = LB_CONNECT_SOCKS.get_ptr_mut(&cookie) else {
        return;
    };
    // SAFETY: a live map value; one socket's callbacks run under its lock.
    let orig = unsafe { &mut *orig };
    let Some(tuple) = crate::client_tuple(ctx) else {
        return;
    };
    // A record of an earlier connect of this socket that failed before its SYN (no route, no
    // source port): this connect goes elsewhere and is none of lb's.
    let server = &orig.count.server;
    if tuple.lb_ip_be != server.ip_be
        || tuple.lb_port != server.port
        || tuple.family != server.family
    {
        let copy = *orig;
        forget(cookie, &copy);
        return;
    }
    let _ = crate::add_cb_flags(ctx, CB_FLAGS);
    failfast::on_connect(ctx, cookie);
    // The source port is bound by now: record the socket's own address for lb's kills.
    orig.local_ip_be = tuple.client_ip_be;
    orig.local_port = tuple.client_port;
    orig.family = tuple.family;
}

/// Send one event to lb; a full ring drops it and counts the drop for the balancer.
#[inline(always)]
fn report(orig: &ConnectOrig, kind: u32, cookie: u64, err: u32) {
    let ev = ConnectEvent {
        server: orig.count.server,
        balancer: orig.count.balancer,
        kind,
        cookie,
        err,
        _pad: 0,
    };
    if LB_CONNECT_EVENTS.output::<ConnectEvent>(&ev, 0).is_err()
        && let Some(stats) = LB_CONNECT_STATS.get_ptr_mut(orig.count.balancer)
    {
        // SAFETY: per-CPU slot, no other writer on this CPU while we run.
        unsafe { (*stats).connect_event_drops += 1 };
    }
}

/// Sockops `RTO_CB`: the first retransmission timeout of an established rewritten socket is
/// reported (later ones are not); one of a connect still sending SYNs may mark its server
/// suspect (see `failfast`).
#[inline(always)]
pub(super) fn on_rto(ctx: &SockOpsContext) {
    // SAFETY: the program's own context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.ops.cast()) };
    let Some(orig) = LB_CONNECT_SOCKS.get_ptr_mut(&cookie) else {
        return;
    };
    // SAFETY: a live map value; one socket's callbacks run under its lock.
    let orig = unsafe { &mut *orig };
    if orig.established == 0 {
        failfast::on_syn_rto(ctx, cookie);
        return;
    }
    if orig.reported & REPORTED_RTO == 0 {
        orig.reported |= REPORTED_RTO;
        let copy = *orig;
        report(&copy, EVENT_RTO, cookie, 0);
    }
}

/// Sockops `STATE_CB` to `TCP_CLOSE` (only sockets [`on_connect`] or [`on_established`] asked
/// for it, and lb's registered clients): for a connect-time socket, report a connect that never
/// got established (with the socket's error), uncount the socket and forget it.
#[inline(always)]
pub(super) fn on_state(ctx: &SockOpsContext) {
    // SAFETY: the program's own context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.ops.cast()) };
    // SAFETY: copied out at once.
    let Some(orig) = (unsafe { LB_CONNECT_SOCKS.get(&cookie) }).copied() else {
        return;
    };
    if orig.established == 0 && ctx.arg(0) == BPF_TCP_SYN_SENT {
        report(&orig, EVENT_CONNECT_FAILED, cookie, sock_err(ctx));
    }
    forget(cookie, &orig);
}

/// Remove a socket's record and, if it was counted, uncount it. Only the caller whose delete
/// succeeds uncounts (the delete is atomic under the map's bucket lock), so the sockets'
/// release and its close, which may run at once on two CPUs, uncount it once.
#[inline(always)]
fn forget(cookie: u64, orig: &ConnectOrig) {
    if LB_CONNECT_SOCKS.remove(&cookie).is_ok() && orig.established == 1 {
        count_add(&orig.count, u64::MAX);
    }
}

/// cgroup `sock_release` (the socket's last descriptor is being closed, before the protocol's
/// close): forget a connect-time socket, uncounting it if it was counted. The sockops program
/// then finds no record when it closes: a connect the client gave up on is not reported.
///
/// A narrow race is left: a socket whose handshake completes on another CPU while its
/// descriptor is being closed can be counted after this copy was taken, and stays counted
/// (+1) until its server leaves the table. Closing the window needs a compare-and-swap,
/// which this target does not offer (see [`count_add`]).
#[inline(always)]
pub(super) fn on_release(ctx: &SockContext) {
    // SAFETY: the program's own context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock.cast()) };
    // SAFETY: copied out at once.
    let Some(orig) = (unsafe { LB_CONNECT_SOCKS.get(&cookie) }).copied() else {
        return;
    };
    forget(cookie, &orig);
}

/// The socket's pending error (`sk->sk_err`, a positive errno; `tcp_done_with_error` sets it
/// before the state moves to `CLOSE`): `ECONNREFUSED` after a reset in `SYN_SENT`, `ETIMEDOUT`
/// (or the ICMP error kept in `sk_err_soft`) when the SYN retries ran out, 0 when the socket
/// was closed by its owner. 0 also when lb could not give the field's offset.
#[inline(always)]
fn sock_err(ctx: &SockOpsContext) -> u32 {
    // SAFETY: reading a global lb set at load time (frozen: with 0 the verifier drops the rest,
    // so a kernel that refuses `bpf_probe_read_kernel` to sockops still loads the program).
    let off = unsafe { core::ptr::read_volatile(&LB_OFF_SK_ERR) };
    if off == 0 {
        return 0;
    }
    // SAFETY: one 8-byte load of bpf_sock_ops.sk (a full socket in STATE_CB, else null).
    let sk =
        unsafe { core::ptr::read_volatile(core::ptr::addr_of!((*ctx.ops).__bindgen_anon_2.sk)) };
    if sk.is_null() {
        return 0;
    }
    // The verifier refuses arithmetic on the context's `sk` (a `PTR_TO_SOCKET`); the BTF
    // pointer `bpf_skc_to_tcp_sock` returns for the same socket may be offset.
    // SAFETY: sk is this callback's full socket; the helper returns null for anything but TCP.
    let tp = unsafe { bpf_skc_to_tcp_sock(sk.cast::<c_void>()) } as *const u8;
    if tp.is_null() {
        return 0;
    }
    crate::client_sock::read_kernel::<i32>(tp, off)
        .and_then(|e| u32::try_from(e).ok())
        .unwrap_or(0)
}
