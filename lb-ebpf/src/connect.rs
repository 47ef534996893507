//! Connect-time balancing: cgroup `connect4`/`connect6` programs rewrite a TCP `connect()` to a
//! listener of a connect-mode balancer into the address of the server the balancer's table
//! picks, so the client talks to the server directly and lb is on neither direction of the
//! byte stream; `getpeername4`/`getpeername6` give back the address the client dialed. Each
//! rewritten socket is recorded by its cookie; connect-time's own sockops program
//! (`lb_connect_sockops`, beside the splice's `lb_sockops` on the same cgroup, with a link of
//! its own) counts it per server once it is established and forgets it when it closes
//! ([`on_established`], [`on_state`]).
//!
//! These programs use only the maps defined here, so with a pin directory lb pins them and their
//! links, and they go on serving the last table after lb exits, whatever the cause, until lb's
//! heartbeat (`LB_CONNECT_CTL`) is older than the orphan timeout: then they leave connects
//! alone ([`control`]). lb's own process id is in that map too, written by each lb that loads
//! or adopts them.
//!
//! A balancer's table is read from the slot its current generation names (`LB_CONNECT_CURRENT`,
//! then `LB_CONNECT_TABLES`), which lb never rewrites while a program may still read it (see
//! `lb_common::MAP_CONNECT_TABLES`).
//!
//! `lb_connect_release` (cgroup `sock_release`) removes a socket's record when its last
//! descriptor is closed ([`on_release`]): a connect that fails before `TCP_CONNECT_CB`
//! (`EINVAL`, `ENETUNREACH`, `EADDRNOTAVAIL`, `EPERM` from another hook) never reaches
//! `STATE_CB`, and its record would stay in the LRU map, evicting live ones.
//!
//! Passive health: from its `connect()` on ([`on_connect`], sockops `TCP_CONNECT_CB`) a
//! rewritten socket reports its state changes and retransmission timeouts. A connect that goes
//! from `SYN_SENT` to `CLOSE` while its descriptor is open (refused, timed out; a client that
//! gives up closes it, and [`on_release`] forgets it first) and the first RTO of an
//! established socket reach lb as [`ConnectEvent`]s on `LB_CONNECT_EVENTS`, a failed connect
//! with the socket's error (`sk_err`) so lb counts only the server's failures: at most one of
//! each kind per socket, dropped (and counted in `BalancerStats::connect_event_drops`) when the
//! ring is full, so a storm of failing connects cannot flood lb.
//!
//! Fail fast (`failfast`): a rewritten connect's SYN timeout and `TCP_SYNCNT` come from its
//! server's policy, and unanswered SYNs mark the server suspect, which [`try_connect`] passes
//! over while another server is in the table.
//!
//! A connect is rewritten only when its socket is in the balancer's network namespace scope
//! (`LB_CONNECT_SCOPE`, see [`in_scope`]): by default lb's own, so a pod's connect to its own
//! `127.0.0.1:P` reaches the pod's server.
//!
//! Minimum kernel: 4.17 for connect4/6 (5.7 for `bpf_get_netns_cookie` in them), 5.8 for
//! getpeername4/6 (lb attaches all four or none), 5.9 for sock_release (optional: without it
//! failed connects leak records until the LRU evicts them); `bpf_get_socket_cookie` in
//! sock_addr, sock and sockops programs; `bpf_ktime_get_boot_ns` (5.8).

use aya_ebpf::{
    bindings::{
        BPF_ANY, BPF_NOEXIST, BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_RTO_CB,
        BPF_SOCK_OPS_RTO_CB_FLAG, BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG,
        BPF_SOCK_OPS_TCP_CONNECT_CB, BPF_SOCK_OPS_TIMEOUT_INIT, BPF_TCP_CLOSE, BPF_TCP_SYN_SENT,
    },
    cty::c_void,
    helpers::{
        bpf_get_current_pid_tgid, bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie,
        bpf_skc_to_tcp_sock,
    },
    macros::{cgroup_sock, cgroup_sock_addr, map, sock_ops},
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
    programs::{SockAddrContext, SockContext, SockOpsContext},
};
use lb_common::{
    AF_INET, AF_INET6, BalancerStats, CONNECT_EVENTS_RING_BYTES, CONNECT_LEAST, CONNECT_RANDOM,
    CONNECT_ROUND_ROBIN, CTL_SLOTS, ConnectCountKey, ConnectEvent, ConnectOrig, ConnectServer,
    ConnectTable, EVENT_CONNECT_FAILED, EVENT_RTO, GLOBAL_OFF_SK_ERR, ListenerKey,
    MAP_CONNECT_COUNTS, MAP_CONNECT_CTL, MAP_CONNECT_CURRENT, MAP_CONNECT_EVENTS,
    MAP_CONNECT_LISTENERS, MAP_CONNECT_NETNS_PROBE, MAP_CONNECT_RR, MAP_CONNECT_SCOPE,
    MAP_CONNECT_SOCKS, MAP_CONNECT_STATS, MAP_CONNECT_SUSPECT, MAP_CONNECT_SYN, MAP_CONNECT_TABLES,
    MAX_BALANCERS, MAX_CONNECT_COUNTS, MAX_CONNECT_SERVERS, MAX_CONNECT_SYN, MAX_CONNECTIONS,
    MAX_LISTENERS, NETNS_SCOPE_ALL, PROBE_COOKIE, PROBE_PORT, PROBE_SLOTS, PROG_CONNECT_RELEASE,
    PROG_CONNECT_SOCKOPS, PROG_CONNECT4, PROG_CONNECT6, PROG_GETPEERNAME4, PROG_GETPEERNAME6,
    REPORTED_RTO, SynPolicy, TABLE_SLOTS, Unrewritten, table_index,
};

mod control;
mod failfast;

use control::{Control, control, unrewritten};

named_as!(
    LB_CONNECT_LISTENERS = MAP_CONNECT_LISTENERS,
    LB_CONNECT_TABLES = MAP_CONNECT_TABLES,
    LB_CONNECT_CURRENT = MAP_CONNECT_CURRENT,
    LB_CONNECT_RR = MAP_CONNECT_RR,
    LB_CONNECT_SOCKS = MAP_CONNECT_SOCKS,
    LB_CONNECT_COUNTS = MAP_CONNECT_COUNTS,
    LB_CONNECT_EVENTS = MAP_CONNECT_EVENTS,
    LB_CONNECT_CTL = MAP_CONNECT_CTL,
    LB_CONNECT_SCOPE = MAP_CONNECT_SCOPE,
    LB_CONNECT_STATS = MAP_CONNECT_STATS,
    LB_CONNECT_NETNS_PROBE = MAP_CONNECT_NETNS_PROBE,
    LB_CONNECT_SYN = MAP_CONNECT_SYN,
    LB_CONNECT_SUSPECT = MAP_CONNECT_SUSPECT,
    LB_OFF_SK_ERR = GLOBAL_OFF_SK_ERR,
    lb_connect_sockops = PROG_CONNECT_SOCKOPS,
    lb_connect_release = PROG_CONNECT_RELEASE,
    lb_connect4 = PROG_CONNECT4,
    lb_connect6 = PROG_CONNECT6,
    lb_getpeername4 = PROG_GETPEERNAME4,
    lb_getpeername6 = PROG_GETPEERNAME6,
);

#[map]
static LB_CONNECT_LISTENERS: HashMap<ListenerKey, u32> =
    HashMap::with_max_entries(MAX_LISTENERS, 0);

// An array, so a table is written in place and never reused under a reader: see
// lb_common::MAP_CONNECT_TABLES for why a program never reads one torn.
#[map]
static LB_CONNECT_TABLES: Array<ConnectTable> =
    Array::with_max_entries(MAX_BALANCERS * TABLE_SLOTS, 0);

#[map]
static LB_CONNECT_CURRENT: Array<u32> = Array::with_max_entries(MAX_BALANCERS, 0);

#[map]
static LB_CONNECT_RR: PerCpuArray<u32> = PerCpuArray::with_max_entries(MAX_BALANCERS, 0);

#[map]
static LB_CONNECT_SOCKS: LruHashMap<u64, ConnectOrig> =
    LruHashMap::with_max_entries(MAX_CONNECTIONS, 0);

#[map]
static LB_CONNECT_COUNTS: HashMap<ConnectCountKey, u64> =
    HashMap::with_max_entries(MAX_CONNECT_COUNTS, 0);

#[map]
static LB_CONNECT_EVENTS: RingBuf = RingBuf::with_byte_size(CONNECT_EVENTS_RING_BYTES, 0);

// Fail fast (see failfast): per server, the SYN policy lb asks for and the suspect marks.
#[map]
static LB_CONNECT_SYN: HashMap<ConnectCountKey, SynPolicy> =
    HashMap::with_max_entries(MAX_CONNECT_SYN, 0);

#[map]
static LB_CONNECT_SUSPECT: HashMap<ConnectCountKey, u64> =
    HashMap::with_max_entries(MAX_CONNECT_SYN, 0);

/// The sockops callbacks a rewritten socket asks for: state changes (its close uncounts it; a
/// failed connect is reported) and retransmission timeouts (reported once).
const CB_FLAGS: i32 = (BPF_SOCK_OPS_STATE_CB_FLAG | BPF_SOCK_OPS_RTO_CB_FLAG) as i32;

// lb's control (see lb_common::MAP_CONNECT_CTL): its tgid, heartbeat and orphan timeout, in a
// map rather than globals so a new lb that adopts these programs can write its own.
#[map]
static LB_CONNECT_NETNS_PROBE: Array<u64> = Array::with_max_entries(PROBE_SLOTS, 0);

#[map]
static LB_CONNECT_CTL: Array<u64> = Array::with_max_entries(CTL_SLOTS, 0);

#[map]
static LB_CONNECT_SCOPE: Array<u64> = Array::with_max_entries(MAX_BALANCERS, 0);

#[map]
static LB_CONNECT_STATS: PerCpuArray<BalancerStats> =
    PerCpuArray::with_max_entries(MAX_BALANCERS, 0);
// `struct sock::sk_err` offset (bytes), set at load time from the kernel's BTF; 0 when unknown.
#[unsafe(no_mangle)]
static LB_OFF_SK_ERR: u32 = 0;

/// Allow the syscall (the only verdict these programs give; a getpeername program may return
/// nothing else).
const ALLOW: i32 = 1;
/// `SOCK_STREAM` from `<sys/socket.h>`.
const SOCK_STREAM: u32 = 1;
/// `::ffff:0:0/96` second-to-last word, network order as stored.
const MAPPED_WORD2: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);

#[cgroup_sock_addr(connect4)]
pub fn lb_connect4(ctx: SockAddrContext) -> i32 {
    match try_connect(&ctx, false) {
        Ok(()) | Err(()) => ALLOW,
    }
}

#[cgroup_sock_addr(connect6)]
pub fn lb_connect6(ctx: SockAddrContext) -> i32 {
    match try_connect(&ctx, true) {
        Ok(()) | Err(()) => ALLOW,
    }
}

#[sock_ops]
pub fn lb_connect_sockops(ctx: SockOpsContext) -> u32 {
    match ctx.op() {
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => on_established(&ctx),
        BPF_SOCK_OPS_STATE_CB if ctx.arg(1) == BPF_TCP_CLOSE => on_state(&ctx),
        BPF_SOCK_OPS_TCP_CONNECT_CB => on_connect(&ctx),
        BPF_SOCK_OPS_RTO_CB => on_rto(&ctx),
        // Called whatever the socket's callback flags: the rewritten connect's SYN timeout.
        BPF_SOCK_OPS_TIMEOUT_INIT => return failfast::on_timeout_init(&ctx),
        _ => {}
    }
    1
}

#[cgroup_sock(sock_release)]
pub fn lb_connect_release(ctx: SockContext) -> i32 {
    on_release(&ctx);
    ALLOW
}

#[cgroup_sock_addr(getpeername4)]
pub fn lb_getpeername4(ctx: SockAddrContext) -> i32 {
    match try_getpeername(&ctx, false) {
        Ok(()) | Err(()) => ALLOW,
    }
}

#[cgroup_sock_addr(getpeername6)]
pub fn lb_getpeername6(ctx: SockAddrContext) -> i32 {
    match try_getpeername(&ctx, true) {
        Ok(()) | Err(()) => ALLOW,
    }
}

/// lb's network namespace probe ([`lb_common::MAP_CONNECT_NETNS_PROBE`]): when this connect goes
/// to `127.0.0.1` at the probe's port, record the socket's network namespace cookie and leave
/// the connect alone (it is refused: nothing listens there). Returns whether it was the probe.
#[inline(always)]
fn netns_probe(ctx: &SockAddrContext, ip_be: u32, port: u32) -> bool {
    // The address first: most connects end here without a map lookup.
    if ip_be != u32::from_ne_bytes([127, 0, 0, 1]) {
        return false;
    }
    let Some(&probe) = LB_CONNECT_NETNS_PROBE.get(PROBE_PORT) else {
        return false;
    };
    if probe == 0 || u64::from(port) != probe {
        return false;
    }
    // SAFETY: the program's own context.
    let cookie = unsafe { bpf_get_netns_cookie(ctx.sock_addr.cast()) };
    if let Some(slot) = LB_CONNECT_NETNS_PROBE.get_ptr_mut(PROBE_COOKIE) {
        // SAFETY: an array slot; lb reads it only after the probe's connect returned.
        unsafe { *slot = cookie };
    }
    true
}

/// Whether an IPv4 address (network order as stored) is in 127.0.0.0/8.
#[inline(always)]
fn loopback4(ip_be: u32) -> bool {
    ip_be.to_ne_bytes()[0] == 127
}

/// The listener key of a dialed address: IPv4 (also an IPv4-mapped IPv6 address) in word 0.
/// Returns the key and whether the dialed address was IPv4-mapped.
#[inline(always)]
fn dialed_key(ip: [u32; 4], port: u32, v6: bool) -> (ListenerKey, bool) {
    if !v6 {
        return (
            ListenerKey {
                ip_be: [ip[0], 0, 0, 0],
                port,
                family: AF_INET,
            },
            false,
        );
    }
    if ip[0] == 0 && ip[1] == 0 && ip[2] == MAPPED_WORD2 {
        return (
            ListenerKey {
                ip_be: [ip[3], 0, 0, 0],
                port,
                family: AF_INET,
            },
            true,
        );
    }
    (
        ListenerKey {
            ip_be: ip,
            port,
            family: AF_INET6,
        },
        false,
    )
}

/// Rewrite the destination when it is a connect-mode listener. The verdict is always "allow"
/// (the entry points return [`ALLOW`]); `Err` only ends the work early. Inlined, so `v6` is a
/// constant in each program: the verifier refuses a context store through a pointer computed
/// from a branch, which is what one shared body compiled to.
#[inline(always)]
fn try_connect(ctx: &SockAddrContext, v6: bool) -> Result<(), ()> {
    let sa = ctx.sock_addr;
    if ctx_u32!(sa, type_) != SOCK_STREAM {
        return Ok(());
    }
    let ip = if v6 {
        ctx_ip6!(sa, user_ip6)
    } else {
        [ctx_u32!(sa, user_ip4), 0, 0, 0]
    };
    let port = u32::from(u16::from_be(ctx_u32!(sa, user_port) as u16));
    if !v6 && netns_probe(ctx, ip[0], port) {
        return Ok(());
    }
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let control = control(tgid);
    if control == Control::Own {
        return Ok(());
    }
    let (key, mapped) = dialed_key(ip, port, v6);
    // SAFETY: plain u32 copied out.
    let found = unsafe { LB_CONNECT_LISTENERS.get(&key) }.copied();
    let balancer = match found {
        Some(b) => b,
        None => {
            let local = if key.family == AF_INET {
                loopback4(key.ip_be[0]) || key.ip_be[0] == 0
            } else {
                key.ip_be == [0, 0, 0, u32::from_ne_bytes([0, 0, 0, 1])] || key.ip_be == [0; 4]
            };
            if !local {
                return Ok(());
            }
            let wildcard = ListenerKey::wildcard(port, key.family);
            // SAFETY: plain u32 copied out.
            match unsafe { LB_CONNECT_LISTENERS.get(&wildcard) }.copied() {
                Some(b) => b,
                None => return Ok(()),
            }
        }
    };
    if control == Control::Orphaned {
        unrewritten(balancer, Unrewritten::Orphaned);
        return Ok(());
    }
    // SAFETY: the program's own context.
    let netns = unsafe { bpf_get_netns_cookie(sa.cast()) };
    if !in_scope(balancer, netns) {
        // Another namespace's 127.0.0.1:P is its own: the connect goes where it was going.
        if let Some(stats) = LB_CONNECT_STATS.get_ptr_mut(balancer) {
            // SAFETY: per-CPU slot, no other writer on this CPU while we run.
            unsafe { (*stats).netns_skipped_connects += 1 };
        }
        return Ok(());
    }
    let Some(table) = current_table(balancer) else {
        unrewritten(balancer, Unrewritten::NoServers);
        return Ok(());
    };
    let count = table.count as usize;
    if count == 0 || count > MAX_CONNECT_SERVERS {
        unrewritten(balancer, Unrewritten::NoServers);
        return Ok(());
    }
    let pick = match table.policy {
        CONNECT_ROUND_ROBIN => match LB_CONNECT_RR.get_ptr_mut(balancer) {
            Some(rr) => {
                // SAFETY: this CPU's slot.
                let n = unsafe {
                    *rr = (*rr).wrapping_add(1);
                    *rr
                };
                n as usize % count
            }
            None => 0,
        },
        // SAFETY: no preconditions.
        CONNECT_RANDOM => (unsafe { bpf_get_prandom_u32() }) as usize % count,
        CONNECT_LEAST => least_of_two(table, balancer, count),
        _ => 0,
    };
    // pick < count <= MAX_CONNECT_SERVERS (a power of two): the mask changes nothing but
    // gives the verifier the bound it cannot derive from a modulo (`black_box` keeps LLVM,
    // which knows the bound, from dropping it).
    let pick = core::hint::black_box(pick) & (MAX_CONNECT_SERVERS - 1);
    let pick = failfast::avoid_suspect(table, balancer, pick, count);
    let Some(server) = table.servers.get(pick).copied() else {
        unrewritten(balancer, Unrewritten::NoServers);
        return Ok(());
    };
    // An IPv4 socket can only reach an IPv4 server; an IPv6 socket an IPv6 one, or an IPv4
    // one as a mapped address when it dialed a mapped address (so it is not IPV6_V6ONLY).
    // Anything else is left to the listener (lb's proxy path).
    let new_ip = match (v6, server.family) {
        (false, AF_INET) => [server.ip_be[0], 0, 0, 0],
        (true, AF_INET6) => server.ip_be,
        (true, AF_INET) if mapped => [0, 0, MAPPED_WORD2, server.ip_be[0]],
        _ => {
            unrewritten(balancer, Unrewritten::Family);
            return Ok(());
        }
    };
    // SAFETY: the program's own context.
    let cookie = unsafe { bpf_get_socket_cookie(sa.cast()) };
    let orig = ConnectOrig {
        dialed_ip_be: ip,
        dialed_port: port,
        established: 0,
        count: ConnectCountKey {
            server,
            balancer,
            _pad: 0,
        },
        reported: 0,
        tgid,
        ..ConnectOrig::default()
    };
    if LB_CONNECT_SOCKS
        .insert(&cookie, &orig, u64::from(BPF_ANY))
        .is_err()
    {
        // Without the record getpeername could not answer: leave it to the listener.
        unrewritten(balancer, Unrewritten::RecordMap);
        return Ok(());
    }
    let port_raw = u32::from((server.port as u16).to_be());
    // SAFETY: connect programs may write the destination of their own context.
    unsafe {
        if v6 {
            core::ptr::write_volatile(core::ptr::addr_of_mut!((*sa).user_ip6[0]), new_ip[0]);
            core::ptr::write_volatile(core::ptr::addr_of_mut!((*sa).user_ip6[1]), new_ip[1]);
            core::ptr::write_volatile(core::ptr::addr_of_mut!((*sa).user_ip6[2]), new_ip[2]);
            core::ptr::write_volatile(core::ptr::addr_of_mut!((*sa).user_ip6[3]), new_ip[3]);
        } else {
            core::ptr::write_volatile(core::ptr::addr_of_mut!((*sa).user_ip4), new_ip[0]);
        }
        core::ptr::write_volatile(core::ptr::addr_of_mut!((*sa).user_port), port_raw);
    }
    Ok(())
}

/// Whether `balancer`'s connect programs act on a socket of network namespace `netns`
/// (`LB_CONNECT_SCOPE`, as `crate::in_scope` for the splice).
#[inline(always)]
fn in_scope(balancer: u32, netns: u64) -> bool {
    LB_CONNECT_SCOPE
        .get(balancer)
        .is_some_and(|&scope| scope == NETNS_SCOPE_ALL || scope == netns)
}

/// Balancer `balancer`'s current table: the generation in `LB_CONNECT_CURRENT` (one aligned
/// 4-byte load), then its slot. `None` for an id out of range.
#[inline(always)]
fn current_table(balancer: u32) -> Option<&'static ConnectTable> {
    let current = LB_CONNECT_CURRENT.get_ptr(balancer)?;
    // SAFETY: a live array element, one aligned u32 load: lb stores a generation whole.
    let generation = unsafe { core::ptr::read_volatile(current) };
    let table = LB_CONNECT_TABLES.get_ptr(table_index(balancer, generation))?;
    // SAFETY: a live array element (arrays are never freed while a program runs). lb writes
    // this slot again only once it has not been current for lb_common::SLOT_REUSE_AFTER_MS,
    // long after this program's read ends (see lb_common::MAP_CONNECT_TABLES).
    Some(unsafe { &*table })
}

/// Established connect-time sockets of `server` in `balancer` (0 when none were counted).
#[inline(always)]
fn established(server: &ConnectServer, balancer: u32) -> u64 {
    let key = ConnectCountKey {
        server: *server,
        balancer,
        _pad: 0,
    };
    // SAFETY: copied out at once; a transient negative (wrapped) count reads as 0.
    let n = unsafe { LB_CONNECT_COUNTS.get(&key) }.copied().unwrap_or(0);
    if n > u64::MAX / 2 { 0 } else { n }
}

/// `least-connections`: two different servers at random (power of two choices), the one with
/// fewer established connect-time sockets (the first on a tie). Index < `count`.
#[inline(always)]
fn least_of_two(table: &ConnectTable, balancer: u32, count: usize) -> usize {
    // SAFETY: no preconditions.
    let r = unsafe { bpf_get_prandom_u32() } as usize;
    // checked_rem: no division-by-zero panic path for the verifier to refuse.
    let a = (r & 0xffff).checked_rem(count).unwrap_or(0);
    if count < 2 {
        return a;
    }
    let step = 1 + (r >> 16).checked_rem(count - 1).unwrap_or(0);
    let b = (a + step).checked_rem(count).unwrap_or(0);
    let (a, b) = (
        core::hint::black_box(a) & (MAX_CONNECT_SERVERS - 1),
        core::hint::black_box(b) & (MAX_CONNECT_SERVERS - 1),
    );
    let (Some(sa), Some(sb)) = (table.servers.get(a), table.servers.get(b)) else {
        return a;
    };
    if established(sb, balancer) < established(sa, balancer) {
        b
    } else {
        a
    }
}

/// Give a rewritten socket's peer back as the listener address it dialed (inlined, as
/// [`try_connect`]).
#[inline(always)]
fn try_getpeername(ctx: &SockAddrContext, v6: bool) -> Result<(), ()> {
    let sa = ctx.sock_addr;
    // SAFETY: the program's own context.
    let cookie = unsafe { bpf_get_socket_cookie(sa.cast()) };
    // SAFETY: copied out at once.
    let Some(orig) = (unsafe { LB_CONNECT_SOCKS.get(&cookie) }).copied() else {
        return Ok(());
    };
    let port_raw = u32::from((orig.dialed_port as u16).to_be());
    let ip = orig.dialed_ip_be;
    // SAFETY: getpeername programs may write the address they return.
    unsafe {
        if v6 {
            core::ptr::write_volatile(core::ptr::addr_of_mut!((*sa).user_ip6[0]), ip[0]);
            core::ptr::write_volatile(core::ptr::addr_of_mut!((*sa).user_ip6[1]), ip[1]);
            core::ptr::write_volatile(core::ptr::addr_of_mut!((*sa).user_ip6[2]), ip[2]);
            core::ptr::write_volatile(core::ptr::addr_of_mut!((*sa).user_ip6[3]), ip[3]);
        } else {
            core::ptr::write_volatile(core::ptr::addr_of_mut!((*sa).user_ip4), ip[0]);
        }
        core::ptr::write_volatile(core::ptr::addr_of_mut!((*sa).user_port), port_raw);
    }
    Ok(())
}

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
fn on_established(ctx: &SockOpsContext) {
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
/// reported ([`on_state`]), and its own address (bound by now) is recorded for lb's kills.
#[inline(always)]
fn on_connect(ctx: &SockOpsContext) {
    // SAFETY: the program's own context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.ops.cast()) };
    let Some(orig) = LB_CONNECT_SOCKS.get_ptr_mut(&cookie) else {
        return;
    };
    let _ = crate::add_cb_flags(ctx, CB_FLAGS);
    failfast::on_connect(ctx, cookie);
    // The source port is bound by now: record the socket's own address for lb's kills.
    if let Some(tuple) = crate::client_tuple(ctx) {
        // SAFETY: a live map value; one socket's callbacks run under its lock.
        let orig = unsafe { &mut *orig };
        orig.local_ip_be = tuple.client_ip_be;
        orig.local_port = tuple.client_port;
        orig.family = tuple.family;
    }
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
fn on_rto(ctx: &SockOpsContext) {
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
fn on_state(ctx: &SockOpsContext) {
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
fn on_release(ctx: &SockContext) {
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
