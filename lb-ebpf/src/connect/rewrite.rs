//! The rewrite itself: `connect4`/`connect6` send a connect to a connect-mode listener to the
//! server its balancer picks ([`try_connect`]), and `getpeername4`/`getpeername6` give the
//! client back the address it dialed ([`try_getpeername`]). lb's namespace probe rides on
//! `connect4` ([`netns_probe`]).

use aya_ebpf::{
    bindings::BPF_ANY,
    helpers::{bpf_get_current_pid_tgid, bpf_get_netns_cookie, bpf_get_socket_cookie},
    programs::SockAddrContext,
};
use lb_common::{
    AF_INET, AF_INET6, ConnectCountKey, ConnectOrig, ListenerKey, MAX_CONNECT_SERVERS,
    NETNS_SCOPE_ALL, PROBE_COOKIE, PROBE_PORT, Unrewritten,
};

use super::{
    control::{Control, control, unrewritten},
    maps::{
        LB_CONNECT_LISTENERS, LB_CONNECT_NETNS_PROBE, LB_CONNECT_SCOPE, LB_CONNECT_SOCKS,
        LB_CONNECT_STATS,
    },
    pick::{self, current_table},
};

/// `SOCK_STREAM` from `<sys/socket.h>`.
const SOCK_STREAM: u32 = 1;
/// `::ffff:0:0/96` second-to-last word, network order as stored.
const MAPPED_WORD2: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);

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
/// (the entry points return `ALLOW`); `Err` only ends the work early. Inlined, so `v6` is a
/// constant in each program: the verifier refuses a context store through a pointer computed
/// from a branch, which is what one shared body compiled to.
#[inline(always)]
pub(super) fn try_connect(ctx: &SockAddrContext, v6: bool) -> Result<(), ()> {
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
    let pick = pick::choose(table, balancer, count);
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

/// Give a rewritten socket's peer back as the listener address it dialed (inlined, as
/// [`try_connect`]).
#[inline(always)]
pub(super) fn try_getpeername(ctx: &SockAddrContext, v6: bool) -> Result<(), ()> {
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
