//! lb's kernel programs.
//!
//! - `lb_sockops` (cgroup sockops): when a client socket in the attached cgroup finishes connecting
//!   to one of lb's listeners, it registers the socket in `LB_CLIENTS` (which runs `lb_sk_msg` on
//!   its sends), creates its `LB_FLOWS` entry (with the socket's cookie, its generation) and
//!   records its network namespace in `LB_NETNS`; when the socket closes (`STATE_CB`), it
//!   removes both entries again. Only sockets in the listener's balancer's network namespace
//!   scope (`LB_NETNS_SCOPE`, [`in_scope`]) are registered; others are counted and left alone.
//!   A wildcard listener (`0.0.0.0:P`, `[::]:P`) claims only clients whose destination is on
//!   the host ([`client_addr::local_destination`]); an IPv6 socket connected to an
//!   IPv4-mapped address is keyed as IPv4 ([`client_addr::unmap_v4`]), as lb keys the socket it accepted.
//!   Sockets the connect programs sent straight to a server are connect-time's own sockops
//!   program's (`lb_connect_sockops`, see [`connect`]); their destination is no listener.
//! - `lb_sk_msg` (sk_msg on `LB_CLIENTS`): the upstream splice. Once lb has paired the client with
//!   its server socket and copied every byte that went the normal way (the counting rule: it
//!   redirects only once lb's published copied count equals the bytes the client's socket
//!   queued, read from its `write_seq`, so bytes sent before pairing are never overtaken), it
//!   redirects the client's sends straight to the server socket's egress while that socket has
//!   room: its queued memory plus the send within three quarters of its send buffer, read from
//!   the socket at each send through the address the first redirect gives
//!   ([`client_sock::server_fill`]); before the first redirect, within the credit lb granted.
//!   A blocking client (its file lacks `O_NONBLOCK` and it has no `SO_SNDTIMEO`) is redirected
//!   past that limit too: the kernel then makes it wait for room in the server socket, whose
//!   send buffer (`max_buffered_bytes`) bounds the queue, as a direct connection's send would
//!   wait. Only a
//!   non-blocking client must take the copy path when the room runs out: a redirected
//!   non-blocking send into a full server socket returns `EAGAIN` while the client's own socket
//!   still polls writable, so it would busy-spin. Per-send flags (`MSG_DONTWAIT`) are invisible
//!   here; `datapath.blocking_splice = false` turns the past-credit redirect off. It never
//!   redirects for a socket other than the one lb paired (a newer socket on a reused tuple:
//!   the cookies differ) nor for a socket with an upper layer protocol (kTLS: its sends reach
//!   the program as plaintext).
//!
//! - `lb_connect4`/`lb_connect6`, `lb_getpeername4`/`lb_getpeername6` (cgroup sock_addr),
//!   `lb_connect_release` (sock_release) and `lb_connect_sockops` (attached only when a
//!   balancer has `forwarding = "connect"`): connect-time balancing, in [`connect`], with maps
//!   of its own so they can be pinned and outlive lb while the splice's objects die with it.
//!
//! Kernel events for operators go through aya-log (target `lb::kernel`, debug level): a send
//! that took the copy path after pairing (catch-up, no credit, redirect error), rate-limited by
//! [`lb_common::kernel_log_due`]. lb sets aya-log's level global at load time (0 unless its log
//! filter enables that target); it is frozen, so with logging off the verifier removes the
//! logging code and a send pays for nothing but the few instructions of the rate check on the
//! copy path.
//!
//! Minimum kernel: 5.15 (`bpf_get_netns_cookie` in sockops and sk_msg programs). The splice
//! also reads the client's socket with `bpf_skc_to_tcp_sock` and `bpf_probe_read_kernel` from
//! sk_msg (offsets from the kernel's BTF), which need `CAP_PERFMON` and no lockdown; without
//! them lb pairs nothing and copies every connection.
#![no_std]
#![no_main]
// Reading kernel memory and sockets is what these programs do: every block says why it is sound
// (`// SAFETY:`, enforced by clippy::undocumented_unsafe_blocks in `cargo xtask test`).
#![expect(
    unsafe_code,
    reason = "kernel programs: raw context reads, helpers and map slots are unsafe by nature"
)]
// The atomic add of the connect-time counts (see connect::count_add).
#![feature(core_intrinsics)]
#![allow(internal_features)]
// aya-ebpf's map lookups take `impl Borrow<K>`: a key passed by reference stays in its one stack
// slot, where a key passed by value may be copied into another (the BPF stack is 512 bytes, and
// the verifier of older kernels is sensitive to how the programs use it).
#![allow(
    clippy::needless_borrows_for_generic_args,
    reason = "map keys by reference: no second stack slot per key"
)]

use aya_ebpf::{
    bindings::{
        BPF_ANY, BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_STATE_CB,
        BPF_SOCK_OPS_STATE_CB_FLAG, BPF_TCP_CLOSE, sk_action,
    },
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    macros::{map, sk_msg, sock_ops},
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf, SockHash},
    programs::{SkMsgContext, SockOpsContext},
};
use aya_log_ebpf::debug;
use lb_common::{
    AF_INET, AF_INET6, BalancerStats, FlowState, GLOBAL_BLOCKING_SPLICE, GLOBAL_KERNEL_READS,
    GLOBAL_OFF_F_FLAGS, GLOBAL_OFF_MSG_SK_REDIR, GLOBAL_OFF_SK_SOCKET, GLOBAL_OFF_SNDBUF,
    GLOBAL_OFF_SNDTIMEO, GLOBAL_OFF_SOCKET_FILE, GLOBAL_OFF_ULP_OPS, GLOBAL_OFF_WMEM_QUEUED,
    GLOBAL_OFF_WRITE_SEQ, KERNEL_LOG_TARGET, ListenerKey, MAP_CLIENTS, MAP_FLOWS, MAP_LISTENERS,
    MAP_NETNS, MAP_NETNS_SCOPE, MAP_PAIRS, MAP_REFRESH, MAP_SERVERS, MAP_STATS, MAX_BALANCERS,
    MAX_CONNECTIONS, MAX_LISTENERS, MODE_REDIRECT, NETNS_AMBIGUOUS, NETNS_SCOPE_ALL, PROG_SK_MSG,
    PROG_SOCKOPS, PairCtl, PassReason, REFRESH_RING_BYTES, RefreshRequest, RegisterFailure,
    SockKey, kernel_log_due,
};

/// The ELF names of maps (`#[map]` without `name`), programs and globals are their identifiers;
/// attributes and identifiers cannot take a constant, so each is asserted here, at compile time,
/// to be the name `lb_common` gives it and lb looks up.
macro_rules! named_as {
    ($($item:ident = $name:ident),+ $(,)?) => {
        $(const _: () = assert!(
            lb_common::same_name(stringify!($item), $name),
            concat!(stringify!($item), " is not named as lb_common::", stringify!($name)),
        );)+
    };
}

named_as!(
    LB_LISTENERS = MAP_LISTENERS,
    LB_CLIENTS = MAP_CLIENTS,
    LB_SERVERS = MAP_SERVERS,
    LB_NETNS = MAP_NETNS,
    LB_FLOWS = MAP_FLOWS,
    LB_PAIRS = MAP_PAIRS,
    LB_STATS = MAP_STATS,
    LB_REFRESH = MAP_REFRESH,
    LB_NETNS_SCOPE = MAP_NETNS_SCOPE,
    lb_sockops = PROG_SOCKOPS,
    lb_sk_msg = PROG_SK_MSG,
    LB_OFF_SK_SOCKET = GLOBAL_OFF_SK_SOCKET,
    LB_OFF_SOCKET_FILE = GLOBAL_OFF_SOCKET_FILE,
    LB_OFF_F_FLAGS = GLOBAL_OFF_F_FLAGS,
    LB_OFF_SNDTIMEO = GLOBAL_OFF_SNDTIMEO,
    LB_BLOCKING_SPLICE = GLOBAL_BLOCKING_SPLICE,
    LB_OFF_WRITE_SEQ = GLOBAL_OFF_WRITE_SEQ,
    LB_OFF_ULP_OPS = GLOBAL_OFF_ULP_OPS,
    LB_OFF_MSG_SK_REDIR = GLOBAL_OFF_MSG_SK_REDIR,
    LB_OFF_WMEM_QUEUED = GLOBAL_OFF_WMEM_QUEUED,
    LB_OFF_SNDBUF = GLOBAL_OFF_SNDBUF,
    LB_KERNEL_READS = GLOBAL_KERNEL_READS,
);

#[map]
static LB_LISTENERS: HashMap<ListenerKey, u32> = HashMap::with_max_entries(MAX_LISTENERS, 0);

#[map]
static LB_CLIENTS: SockHash<SockKey> = SockHash::with_max_entries(MAX_CONNECTIONS, 0);

#[map]
static LB_SERVERS: SockHash<SockKey> = SockHash::with_max_entries(MAX_CONNECTIONS, 0);

#[map]
static LB_NETNS: LruHashMap<SockKey, u64> = LruHashMap::with_max_entries(MAX_CONNECTIONS, 0);

#[map]
static LB_FLOWS: LruHashMap<SockKey, FlowState> = LruHashMap::with_max_entries(MAX_CONNECTIONS, 0);

#[map]
static LB_PAIRS: HashMap<SockKey, PairCtl> = HashMap::with_max_entries(MAX_CONNECTIONS, 0);

#[map]
static LB_STATS: PerCpuArray<BalancerStats> = PerCpuArray::with_max_entries(MAX_BALANCERS, 0);

#[map]
static LB_REFRESH: RingBuf = RingBuf::with_byte_size(REFRESH_RING_BYTES, 0);

#[map]
static LB_NETNS_SCOPE: Array<u64> = Array::with_max_entries(MAX_BALANCERS, 0);

const SK_PASS: u32 = sk_action::SK_PASS;

/// Read a context field with a single load at a constant offset: the verifier refuses loads
/// through a ctx pointer that was moved first, which is what copying an array field compiles to.
macro_rules! ctx_u32 {
    ($ptr:expr, $($field:tt)+) => {
        // SAFETY: $ptr is the program's context pointer and the field is readable in this type.
        unsafe { core::ptr::read_volatile(core::ptr::addr_of!((*$ptr).$($field)+)) }
    };
}

macro_rules! ctx_ip6 {
    ($ptr:expr, $field:ident) => {
        [
            ctx_u32!($ptr, $field[0]),
            ctx_u32!($ptr, $field[1]),
            ctx_u32!($ptr, $field[2]),
            ctx_u32!($ptr, $field[3]),
        ]
    };
}

mod client_addr;
mod client_sock;
mod connect;

use client_addr::{local_destination, unmap_v4};
use client_sock::{
    client_blocks, client_tcp_sock, has_ulp, redirect_target, server_fill, sync_passed,
};

/// Port as the kernel exposes `remote_port` (network order in the upper 16 bits) → host order.
#[inline(always)]
fn remote_port_host(raw: u32) -> u32 {
    u32::from(u16::from_be((raw >> 16) as u16))
}

#[sock_ops]
pub fn lb_sockops(ctx: SockOpsContext) -> u32 {
    match try_sockops(&ctx) {
        Ok(v) | Err(v) => v,
    }
}

fn try_sockops(ctx: &SockOpsContext) -> Result<u32, u32> {
    match ctx.op() {
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => {}
        BPF_SOCK_OPS_STATE_CB => {
            if ctx.arg(1) == BPF_TCP_CLOSE {
                forget_client(ctx);
            }
            return Ok(1);
        }
        _ => return Ok(1),
    }
    let Some(mut key) = client_tuple(ctx) else {
        return Ok(1);
    };
    let Some(balancer) = listener_of(&key) else {
        return Ok(1);
    };
    // SAFETY: ctx.ops is the context pointer the kernel passed to this program.
    let cookie = unsafe { bpf_get_netns_cookie(ctx.ops.cast()) };
    // A socket of another namespace (a pod dialing its own 127.0.0.1:P) gets no psock.
    if !in_scope(balancer, cookie) {
        if let Some(stats) = LB_STATS.get_ptr_mut(balancer) {
            // SAFETY: per-CPU slot, no other writer on this CPU while we run.
            unsafe { (*stats).netns_skipped_sockets += 1 };
        }
        return Ok(1);
    }
    let tuple = key;
    key.netns_cookie = cookie;

    let flow = FlowState {
        balancer,
        // SAFETY: ctx.ops is the context pointer the kernel passed to this program.
        cookie: unsafe { bpf_get_socket_cookie(ctx.ops.cast()) },
        // Nothing is queued yet: write_seq equals snd_nxt (or passes it, with Fast Open data,
        // which only makes `passed` larger than what lb copies: the safe side).
        seq: ctx_u32!(ctx.ops, snd_nxt),
        ..FlowState::default()
    };
    if LB_FLOWS.insert(&key, &flow, u64::from(BPF_ANY)).is_err() {
        return Err(register_failed(balancer, RegisterFailure::FlowsMap));
    }
    // SAFETY: the value is a plain u64 copied out.
    let seen = unsafe { LB_NETNS.get(&tuple) }.copied();
    let netns = match seen {
        Some(other) if other != cookie => NETNS_AMBIGUOUS,
        _ => cookie,
    };
    if LB_NETNS.insert(&tuple, &netns, u64::from(BPF_ANY)).is_err() {
        return Err(register_failed(balancer, RegisterFailure::NetnsMap));
    }
    // SAFETY: ctx.ops is the live bpf_sock_ops of this callback.
    let ops = unsafe { &mut *ctx.ops };
    if LB_CLIENTS.update(key, ops, u64::from(BPF_ANY)).is_err() {
        return Err(register_failed(balancer, RegisterFailure::Sockhash));
    }
    // Its close then forgets the flow and namespace entries (forget_client).
    let _ = add_cb_flags(ctx, BPF_SOCK_OPS_STATE_CB_FLAG as i32);
    if let Some(stats) = LB_STATS.get_ptr_mut(balancer) {
        // SAFETY: per-CPU slot, no other writer on this CPU while we run.
        unsafe { (*stats).registered += 1 };
    }
    Ok(1)
}

/// Count a client socket `balancer`'s sockops registration gave up on (it takes the copy
/// path); returns the program's verdict.
#[inline(always)]
fn register_failed(balancer: u32, why: RegisterFailure) -> u32 {
    if let Some(stats) = LB_STATS.get_ptr_mut(balancer) {
        // SAFETY: per-CPU slot, no other writer on this CPU while we run.
        unsafe { (*stats).register_failures[why as usize] += 1 };
    }
    1
}

/// Ask for the sockops callbacks in `flags` on this socket, keeping those it already asks for:
/// `bpf_sock_ops_cb_flags_set` replaces the socket's whole set, which another sockops program
/// (or lb's other callback) may have chosen.
#[inline(always)]
fn add_cb_flags(ctx: &SockOpsContext, flags: i32) -> Result<(), i32> {
    ctx.set_cb_flags(ctx.cb_flags() as i32 | flags)
}

/// The tuple of a client socket: its own address as `client`, the address it connected to as
/// `lb`, no namespace cookie; `None` for a family other than IPv4 and IPv6.
#[inline(always)]
fn client_tuple(ctx: &SockOpsContext) -> Option<SockKey> {
    let family = ctx.family();
    let mut key = SockKey {
        client_port: ctx.local_port(),
        lb_port: remote_port_host(ctx.remote_port()),
        family,
        ..SockKey::default()
    };
    if family == AF_INET {
        key.client_ip_be[0] = ctx.local_ip4();
        key.lb_ip_be[0] = ctx.remote_ip4();
    } else if family == AF_INET6 {
        key.client_ip_be = ctx_ip6!(ctx.ops, local_ip6);
        key.lb_ip_be = ctx_ip6!(ctx.ops, remote_ip6);
    } else {
        return None;
    }
    unmap_v4(&mut key);
    Some(key)
}

/// The balancer of the listener a client tuple connected to: its address exactly, or else the
/// wildcard (`0.0.0.0:P`, `[::]:P`) of its port and family when the destination is local.
#[inline(always)]
fn listener_of(key: &SockKey) -> Option<u32> {
    let listener = ListenerKey {
        ip_be: key.lb_ip_be,
        port: key.lb_port,
        family: key.family,
    };
    // SAFETY: the values are plain u32s copied out before the map can change them.
    if let Some(id) = unsafe { LB_LISTENERS.get(&listener) } {
        return Some(*id);
    }
    if !local_destination(key) {
        return None;
    }
    let wildcard = ListenerKey::wildcard(key.lb_port, key.family);
    // SAFETY: as above.
    unsafe { LB_LISTENERS.get(&wildcard) }.copied()
}

/// Whether `balancer` acts on a socket of the network namespace whose cookie is `netns`: its
/// scope (`LB_NETNS_SCOPE`) is that namespace, or every namespace ([`NETNS_SCOPE_ALL`]). A
/// listener's address names a socket only in the namespace the listener lives in: the same
/// `127.0.0.1:P` in a pod is the pod's own.
#[inline(always)]
fn in_scope(balancer: u32, netns: u64) -> bool {
    LB_NETNS_SCOPE
        .get(balancer)
        .is_some_and(|&scope| scope == NETNS_SCOPE_ALL || scope == netns)
}

/// A registered client socket closed (`STATE_CB` to `TCP_CLOSE`): remove its `LB_FLOWS`
/// entry, and its `LB_NETNS` entry when that still names this socket's namespace, so lb
/// spends no system call on either. Both maps are LRU, so an entry missed here is evicted
/// when the map fills.
#[inline(always)]
fn forget_client(ctx: &SockOpsContext) {
    let Some(tuple) = client_tuple(ctx) else {
        return;
    };
    // SAFETY: ctx.ops is the context pointer the kernel passed to this program.
    let cookie = unsafe { bpf_get_netns_cookie(ctx.ops.cast()) };
    let key = SockKey {
        netns_cookie: cookie,
        ..tuple
    };
    let _ = LB_FLOWS.remove(&key);
    // SAFETY: the value is a plain u64 copied out.
    if unsafe { LB_NETNS.get(&tuple) }.copied() == Some(cookie) {
        let _ = LB_NETNS.remove(&tuple);
    }
}

#[sk_msg]
pub fn lb_sk_msg(ctx: SkMsgContext) -> u32 {
    match try_sk_msg(&ctx) {
        Ok(v) | Err(v) => v,
    }
}

fn try_sk_msg(ctx: &SkMsgContext) -> Result<u32, u32> {
    let md = ctx.msg;
    let family = ctx_u32!(md, family);
    let mut key = SockKey {
        client_port: ctx_u32!(md, local_port),
        lb_port: remote_port_host(ctx_u32!(md, remote_port)),
        family,
        ..SockKey::default()
    };
    if family == AF_INET {
        key.client_ip_be[0] = ctx_u32!(md, local_ip4);
        key.lb_ip_be[0] = ctx_u32!(md, remote_ip4);
    } else if family == AF_INET6 {
        key.client_ip_be = ctx_ip6!(md, local_ip6);
        key.lb_ip_be = ctx_ip6!(md, remote_ip6);
    } else {
        return Ok(SK_PASS);
    }
    unmap_v4(&mut key);
    // SAFETY: ctx.msg is the context pointer the kernel passed to this program.
    key.netns_cookie = unsafe { bpf_get_netns_cookie(ctx.msg.cast()) };
    let size = u64::from(ctx_u32!(md, size));

    let Some(flow) = LB_FLOWS.get_ptr_mut(&key) else {
        return Ok(SK_PASS);
    };
    // SAFETY: sends on one socket run under its lock, so this program is the only writer of the
    // flow; lb only reads it.
    let flow = unsafe { &mut *flow };
    let stats = LB_STATS.get_ptr_mut(flow.balancer);
    let tp = client_tcp_sock(ctx);
    // `passed` from the socket itself, never from the sizes this program saw (see FlowState).
    let synced = tp.is_some_and(|tp| sync_passed(tp, flow));

    // SAFETY: a plain copy of a live map value. It may be torn: the kernel reuses a replaced or
    // deleted element at once (see lb_common::PairCtl), so the copy can mix whole fields of
    // the entry found and of later writes into the element. Versions of one pair are safe for
    // the decision below (same cookie; `copied` only grows and never exceeds what the client
    // passed); another connection's cookie fails the cookie check; this pair's cookie with
    // another connection's `copied` is the case lb_common::PairCtl names as not covered.
    let ctl = unsafe { LB_PAIRS.get(&key) }.copied();
    let reason = match ctl {
        Some(ctl) if ctl.mode == MODE_REDIRECT && ctl.cookie != flow.cookie => {
            PassReason::StalePair
        }
        // kTLS: these are plaintext records, encrypted only after this verdict.
        Some(ctl) if ctl.mode == MODE_REDIRECT && tp.is_none_or(has_ulp) => PassReason::Ulp,
        Some(ctl) if ctl.mode == MODE_REDIRECT => {
            let caught_up = synced && ctl.copied == flow.passed;
            // The server socket's own room once a redirect showed where it is; else the credit
            // lb granted, refreshed on request.
            let room = caught_up
                .then(|| server_fill(flow.server))
                .flatten()
                .map(|(queued, limit)| queued + size <= limit);
            let past_credit = match room {
                Some(room) => !room,
                None => flow.redirected + size > ctl.credit_end,
            };
            if !caught_up {
                PassReason::Catchup
            } else if past_credit && {
                if room.is_none() {
                    ask_refresh(&key, flow, ctl.credit_end, stats);
                }
                !tp.is_some_and(client_blocks)
            } {
                PassReason::Credit
            } else if LB_SERVERS.redirect_msg(ctx, key, 0) as u32 == SK_PASS {
                flow.redirected += size;
                if flow.server == 0 {
                    flow.server = redirect_target(ctx).unwrap_or(0);
                }
                if let Some(stats) = stats {
                    // SAFETY: per-CPU slot.
                    unsafe {
                        (*stats).redirected_bytes += size;
                        (*stats).blocking_redirects += u64::from(past_credit);
                    }
                }
                if room.is_none() && flow.redirected >= ctl.refresh_at {
                    ask_refresh(&key, flow, ctl.refresh_at, stats);
                }
                return Ok(SK_PASS);
            } else {
                PassReason::RedirectError
            }
        }
        _ => PassReason::Unpaired,
    };
    let passed_before = flow.passed;
    if !synced {
        // lb pairs nothing without kernel reads: this count only feeds the log line.
        flow.passed += size;
    }
    if let Some(stats) = stats {
        // SAFETY: per-CPU slot.
        let n = unsafe {
            (*stats).passed_bytes += size;
            (*stats).pass[reason as usize] += 1;
            (*stats).pass[reason as usize]
        };
        if reason != PassReason::Unpaired && kernel_log_due(n) {
            let ctl = ctl.unwrap_or_default();
            let fill = server_fill(flow.server).unwrap_or_default();
            log_fallback(ctx, reason, &key, flow, size, passed_before, &ctl, fill, n);
        }
    }
    Ok(SK_PASS)
}

/// Log (debug, target `lb::kernel`) a send of a paired connection that took the copy path: the
/// reason as `lb_splice_fallbacks_total` labels it, the connection (balancer id, client and
/// listener ports), the send's size and the counts behind the decision (bytes; for `credit`, the
/// server socket's queued memory and its limit, or 0 and 0 when lb's credit decided), and `count`, how
/// many times this CPU saw that reason for that balancer. Runs only when [`kernel_log_due`] says
/// so; every statement is dropped by the verifier unless lb turned kernel logging on.
#[inline(always)]
#[expect(clippy::too_many_arguments, reason = "each is a value of the log line")]
fn log_fallback(
    ctx: &SkMsgContext,
    reason: PassReason,
    key: &SockKey,
    flow: &FlowState,
    size: u64,
    passed_before: u64,
    ctl: &PairCtl,
    (queued, limit): (u64, u64),
    count: u64,
) {
    let (balancer, client_port, listener_port) = (flow.balancer, key.client_port, key.lb_port);
    match reason {
        PassReason::Catchup => debug!(
            ctx,
            target: KERNEL_LOG_TARGET,
            "splice fallback reason=catchup balancer={} client_port={} listener_port={} bytes={} passed={} copied={} count={}",
            balancer,
            client_port,
            listener_port,
            size,
            passed_before,
            ctl.copied,
            count
        ),
        PassReason::Credit => debug!(
            ctx,
            target: KERNEL_LOG_TARGET,
            "splice fallback reason=credit balancer={} client_port={} listener_port={} bytes={} redirected={} credit_end={} server_queued={} server_limit={} count={}",
            balancer,
            client_port,
            listener_port,
            size,
            flow.redirected,
            ctl.credit_end,
            queued,
            limit,
            count
        ),
        PassReason::RedirectError => debug!(
            ctx,
            target: KERNEL_LOG_TARGET,
            "splice fallback reason=redirect_error balancer={} client_port={} listener_port={} bytes={} redirected={} count={}",
            balancer,
            client_port,
            listener_port,
            size,
            flow.redirected,
            count
        ),
        PassReason::StalePair => debug!(
            ctx,
            target: KERNEL_LOG_TARGET,
            "splice fallback reason=stale_pair balancer={} client_port={} listener_port={} bytes={} socket_cookie={} paired_cookie={} count={}",
            balancer,
            client_port,
            listener_port,
            size,
            flow.cookie,
            ctl.cookie,
            count
        ),
        PassReason::Unpaired | PassReason::Ulp => {}
    }
}

/// Ask lb (once per credit mark) to look at the server socket's queue and grant more credit.
#[inline(always)]
fn ask_refresh(key: &SockKey, flow: &mut FlowState, mark: u64, stats: Option<*mut BalancerStats>) {
    if flow.refresh_asked_at == mark {
        return;
    }
    let req = RefreshRequest {
        key: *key,
        redirected: flow.redirected,
    };
    if LB_REFRESH.output::<RefreshRequest>(&req, 0).is_ok() {
        flow.refresh_asked_at = mark;
        if let Some(stats) = stats {
            // SAFETY: per-CPU slot.
            unsafe { (*stats).refresh_requests += 1 };
        }
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
