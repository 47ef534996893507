//! Connect-time balancing: cgroup `connect4`/`connect6` programs rewrite a TCP `connect()` to a
//! listener of a connect-mode balancer into the address of the server the balancer's table
//! picks, so the client talks to the server directly and lb is on neither direction of the
//! byte stream; `getpeername4`/`getpeername6` give back the address the client dialed. Each
//! rewritten socket is recorded by its cookie; connect-time's own sockops program
//! (`lb_connect_sockops`, beside the splice's `lb_sockops` on the same cgroup, with a link of
//! its own) counts it per server once it is established and forgets it when it closes
//! (`sockets`).
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
//! descriptor is closed (`sockets`): a connect that fails before `TCP_CONNECT_CB`
//! (`EINVAL`, `ENETUNREACH`, `EADDRNOTAVAIL`, `EPERM` from another hook) never reaches
//! `STATE_CB`, and its record would stay in the LRU map, evicting live ones.
//!
//! Passive health: from its `connect()` on (sockops `TCP_CONNECT_CB`) a
//! rewritten socket reports its state changes and retransmission timeouts. A connect that goes
//! from `SYN_SENT` to `CLOSE` while its descriptor is open (refused, timed out; a client that
//! gives up closes it, and `sock_release` forgets it first) and the first RTO of an
//! established socket reach lb as [`ConnectEvent`]s on `LB_CONNECT_EVENTS`, a failed connect
//! with the socket's error (`sk_err`) so lb counts only the server's failures: at most one of
//! each kind per socket, dropped (and counted in `BalancerStats::connect_event_drops`) when the
//! ring is full, so a storm of failing connects cannot flood lb.
//!
//! Fail fast (`failfast`): a rewritten connect's SYN timeout and `TCP_SYNCNT` come from its
//! server's policy, and unanswered SYNs mark the server suspect, which the pick passes
//! over while another server is in the table.
//!
//! A connect is rewritten only when its socket is in the balancer's network namespace scope
//! (`LB_CONNECT_SCOPE`): by default lb's own, so a pod's connect to its own
//! `127.0.0.1:P` reaches the pod's server.
//!
//! Minimum kernel: 4.17 for connect4/6 (5.7 for `bpf_get_netns_cookie` in them), 5.8 for
//! getpeername4/6 (lb attaches all four or none), 5.9 for sock_release (optional: without it
//! failed connects leak records until the LRU evicts them); `bpf_get_socket_cookie` in
//! sock_addr, sock and sockops programs; `bpf_ktime_get_boot_ns` (5.8).

//! The rooms: [`maps`] (every map the programs use), [`rewrite`] (connect and getpeername),
//! [`pick`] (the table and the policy's choice), [`sockets`] (a rewritten socket's life in
//! sockops and `sock_release`), [`failfast`] and [`control`] (lb's heartbeat and tgid).

use aya_ebpf::{
    bindings::{
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_RTO_CB, BPF_SOCK_OPS_STATE_CB,
        BPF_SOCK_OPS_TCP_CONNECT_CB, BPF_SOCK_OPS_TIMEOUT_INIT, BPF_TCP_CLOSE,
    },
    macros::{cgroup_sock, cgroup_sock_addr, sock_ops},
    programs::{SockAddrContext, SockContext, SockOpsContext},
};
use lb_common::{
    PROG_CONNECT_RELEASE, PROG_CONNECT_SOCKOPS, PROG_CONNECT4, PROG_CONNECT6, PROG_GETPEERNAME4,
    PROG_GETPEERNAME6,
};

mod control;
mod failfast;
mod maps;
mod pick;
mod rewrite;
mod sockets;

use rewrite::{try_connect, try_getpeername};
use sockets::{on_connect, on_established, on_release, on_rto, on_state};

named_as!(
    lb_connect_sockops = PROG_CONNECT_SOCKOPS,
    lb_connect_release = PROG_CONNECT_RELEASE,
    lb_connect4 = PROG_CONNECT4,
    lb_connect6 = PROG_CONNECT6,
    lb_getpeername4 = PROG_GETPEERNAME4,
    lb_getpeername6 = PROG_GETPEERNAME6,
);

/// Allow the syscall (the only verdict these programs give; a getpeername program may return
/// nothing else).
const ALLOW: i32 = 1;

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
