//! Types and names shared by lb's kernel programs (`lb-ebpf`) and its daemon (`lb-user`).
//!
//! Every type that crosses the user/kernel boundary is `#[repr(C)]`, made of fixed-width integers,
//! has its padding written out and its size asserted at compile time. Fields in network byte order
//! end in `_be`; everything else is in host order.
#![no_std]

use core::mem::size_of;

mod failfast;
mod fnv;
mod pins;
mod stats;
pub use failfast::*;
pub use pins::*;
pub use stats::*;

/// Name of the sockops program (ELF section `sockops`).
pub const PROG_SOCKOPS: &str = "lb_sockops";
/// Name of the sk_msg program attached to [`MAP_CLIENTS`].
pub const PROG_SK_MSG: &str = "lb_sk_msg";

/// Listener addresses lb accepts on: [`ListenerKey`] → balancer id (`u32`). A wildcard
/// (`0.0.0.0`/`[::]`) entry matches local destinations only: loopback, or a destination equal
/// to the client socket's own address (what a connect to one of the host's addresses gives).
pub const MAP_LISTENERS: &str = "LB_LISTENERS";
/// Sockhash of client sockets connected to one of lb's listeners, keyed by [`SockKey`].
pub const MAP_CLIENTS: &str = "LB_CLIENTS";
/// Sockhash of lb's server sockets, keyed by the [`SockKey`] of the client they serve.
pub const MAP_SERVERS: &str = "LB_SERVERS";
/// LRU hash: [`SockKey`] with `netns_cookie = 0` → the client socket's netns cookie (`u64`), or
/// [`NETNS_AMBIGUOUS`] when two namespaces registered the same tuple.
pub const MAP_NETNS: &str = "LB_NETNS";
/// LRU hash: [`SockKey`] → [`FlowState`], written by the kernel only.
pub const MAP_FLOWS: &str = "LB_FLOWS";
/// Hash: [`SockKey`] → [`PairCtl`], written by lb only (see [`PairCtl`] for what a program
/// reading an entry lb rewrites can see).
pub const MAP_PAIRS: &str = "LB_PAIRS";
/// Per-CPU array indexed by balancer id → [`BalancerStats`].
pub const MAP_STATS: &str = "LB_STATS";
/// Ring buffer of [`RefreshRequest`]s: the sk_msg program asks lb for more redirect credit.
pub const MAP_REFRESH: &str = "LB_REFRESH";
/// Array indexed by balancer id → the network namespace cookie (`u64`) of the sockets the
/// balancer acts on: the connect programs rewrite, and sockops registers for the splice, only
/// sockets whose `bpf_get_netns_cookie` equals it, or every socket when it is
/// [`NETNS_SCOPE_ALL`]. lb writes each balancer's entry (its own namespace's cookie, read with
/// `SO_NETNS_COOKIE`) before that balancer's listeners, and a new lb writes it again after an
/// upgrade, so it follows the process that owns the listeners.
pub const MAP_NETNS_SCOPE: &str = "LB_NETNS_SCOPE";
/// Value in [`MAP_NETNS_SCOPE`]: the balancer acts on sockets of every network namespace under
/// the cgroup (`namespaces = "all"`). No namespace has cookie 0 (the kernel counts from 1).
pub const NETNS_SCOPE_ALL: u64 = 0;

/// Globals of the sk_msg program that lb sets at load time: byte offsets (`u32`) of the kernel
/// struct fields on the way from a socket to its file's flags, read from the running kernel's BTF
/// so one object file fits every kernel build. `struct sock::sk_socket`.
pub const GLOBAL_OFF_SK_SOCKET: &str = "LB_OFF_SK_SOCKET";
/// `struct socket::file`.
pub const GLOBAL_OFF_SOCKET_FILE: &str = "LB_OFF_SOCKET_FILE";
/// `struct file::f_flags`.
pub const GLOBAL_OFF_F_FLAGS: &str = "LB_OFF_F_FLAGS";
/// `struct sock::sk_sndtimeo` (a `long`, jiffies).
pub const GLOBAL_OFF_SNDTIMEO: &str = "LB_OFF_SNDTIMEO";
/// `struct tcp_sock::write_seq` (`u32`): the sequence number after the last byte the socket
/// queued, from which the sk_msg program counts the bytes a client sent the normal way.
pub const GLOBAL_OFF_WRITE_SEQ: &str = "LB_OFF_WRITE_SEQ";
/// `struct sk_msg::sk_redir` (a pointer): where `bpf_msg_redirect_hash` sends the message being
/// judged. The sk_msg program reads it after a redirect to learn the server socket's address,
/// which it keeps in [`FlowState::server`]: sk_msg programs cannot release a socket reference
/// (`bpf_sk_release` is not among their helpers), so a sockhash lookup of the server socket,
/// which takes one, is refused by the verifier.
pub const GLOBAL_OFF_MSG_SK_REDIR: &str = "LB_OFF_MSG_SK_REDIR";
/// `struct sock::sk_wmem_queued` (an `int`, bytes): the memory a socket's write queue holds (its
/// skbs' truesize), which the kernel keeps below `sk_sndbuf`. The sk_msg program reads it from the
/// server socket lb paired, to redirect only while that socket has room.
pub const GLOBAL_OFF_WMEM_QUEUED: &str = "LB_OFF_WMEM_QUEUED";
/// `struct sock::sk_sndbuf` (an `int`, bytes): the server socket's send buffer, which lb sets
/// from `max_buffered_bytes` when it pairs.
pub const GLOBAL_OFF_SNDBUF: &str = "LB_OFF_SNDBUF";
/// `struct inet_connection_sock::icsk_ulp_ops` (a pointer; `struct tcp_sock` starts with an
/// `inet_connection_sock`): non-null for a socket with an upper layer protocol such as kTLS.
pub const GLOBAL_OFF_ULP_OPS: &str = "LB_OFF_ULP_OPS";
/// `u32`, 1 when the sk_msg program may read kernel memory (`bpf_skc_to_tcp_sock` and
/// `bpf_probe_read_kernel` allowed, offsets from the kernel's BTF), which the splice needs: the
/// byte count of the counting rule and the check for an upper layer protocol come from the
/// client's socket. 0: lb never pairs and every byte is copied; the verifier drops the code
/// behind it, so such kernels still load the program.
pub const GLOBAL_KERNEL_READS: &str = "LB_KERNEL_READS";
/// Global of the sockops program: byte offset (`u32`) of `struct sock::sk_err` (an `int`), from
/// the running kernel's BTF; 0 when lb could not have it (no BTF, or `bpf_probe_read_kernel`
/// refused to sockops programs), and then [`ConnectEvent::err`] is always 0.
pub const GLOBAL_OFF_SK_ERR: &str = "LB_OFF_SK_ERR";
/// `u32`, 1 to let blocking clients splice past the credit (`datapath.blocking_splice` and the
/// kernel features it needs), 0 to treat every client as non-blocking. The verifier drops the
/// code behind a 0, so kernels without the helpers it calls still load the program.
pub const GLOBAL_BLOCKING_SPLICE: &str = "LB_BLOCKING_SPLICE";
/// `MAX_SCHEDULE_TIMEOUT` (`LONG_MAX`): `sk_sndtimeo` of a socket without `SO_SNDTIMEO`.
pub const MAX_SCHEDULE_TIMEOUT: i64 = i64::MAX;
/// `O_NONBLOCK` in `struct file::f_flags` (x86, arm64 and most architectures; `<fcntl.h>`).
pub const O_NONBLOCK: u32 = 0o4000;

/// `u8`, aya-log's level gate (defined by `aya-log-ebpf`, the same name as `aya_log::LEVEL`): a
/// kernel log statement runs only when its level (1 error … 5 trace) is at most this. lb sets it
/// at load time from its log filter for [`KERNEL_LOG_TARGET`], 0 (every statement off) by
/// default; the map holding it is frozen, so the verifier drops the statements it turns off.
pub const GLOBAL_KERNEL_LOG_LEVEL: &str = "AYA_LOG_LEVEL";
/// Ring buffer of aya-log records (defined by `aya-log-ebpf`, 128 KiB), read by lb's
/// `lb-kernel-log` thread when kernel logging is on.
pub const MAP_KERNEL_LOG: &str = "AYA_LOGS";
/// The `log`/`tracing` target of the kernel programs' log records, so
/// `RUST_LOG=lb::kernel=debug` (or `--log-level`) turns them on.
pub const KERNEL_LOG_TARGET: &str = "lb::kernel";
/// A kernel event that recurs is logged on its 1st, 2nd, 4th, 8th, … occurrence (per CPU,
/// balancer and kind) and every `KERNEL_LOG_EVERY`th after that, so a flood of them costs a few
/// records a second, not one per send. A power of two.
pub const KERNEL_LOG_EVERY: u64 = 65_536;
const _: () = assert!(KERNEL_LOG_EVERY.is_power_of_two());

/// Whether the `n`th occurrence (from 1) of a recurring kernel event is logged: `n` is a power of
/// two or a multiple of [`KERNEL_LOG_EVERY`]. Three ALU instructions and a branch.
#[inline(always)]
pub const fn kernel_log_due(n: u64) -> bool {
    n & n.wrapping_sub(1) == 0 || n & (KERNEL_LOG_EVERY - 1) == 0
}
const _: () = assert!(kernel_log_due(1) && kernel_log_due(2) && !kernel_log_due(3));
const _: () = assert!(kernel_log_due(32_768) && !kernel_log_due(32_769) && !kernel_log_due(98_304));
const _: () =
    assert!(kernel_log_due(3 * KERNEL_LOG_EVERY) && !kernel_log_due(3 * KERNEL_LOG_EVERY + 2));

/// Every program name, for the ELF check.
pub const PROG_NAMES: [&str; 8] = [
    PROG_SOCKOPS,
    PROG_SK_MSG,
    PROG_CONNECT_SOCKOPS,
    PROG_CONNECT4,
    PROG_CONNECT6,
    PROG_GETPEERNAME4,
    PROG_GETPEERNAME6,
    PROG_CONNECT_RELEASE,
];

/// cgroup `connect4` program (4.17+): rewrites a TCP `connect()` to a connect-mode listener into
/// the address of the server its balancer's [`ConnectTable`] picks.
pub const PROG_CONNECT4: &str = "lb_connect4";
/// cgroup `connect6` program (4.17+): as [`PROG_CONNECT4`] for IPv6 sockets (native IPv6
/// listeners, and IPv4 listeners dialed as IPv4-mapped addresses).
pub const PROG_CONNECT6: &str = "lb_connect6";
/// cgroup `getpeername4` program (5.8+): a rewritten socket's peer reads back as the listener
/// address the client dialed.
pub const PROG_GETPEERNAME4: &str = "lb_getpeername4";
/// cgroup `getpeername6` program (5.8+): as [`PROG_GETPEERNAME4`] for IPv6 sockets.
pub const PROG_GETPEERNAME6: &str = "lb_getpeername6";
/// cgroup `sock_release` program (5.9+): when a socket's last descriptor is closed, removes its
/// [`MAP_CONNECT_SOCKS`] record (uncounting it if it was counted), also of a connect that failed
/// before the sockops program saw it (its record would otherwise stay until the LRU evicts it).
pub const PROG_CONNECT_RELEASE: &str = "lb_connect_release";
/// Connect-time's own sockops program (beside [`PROG_SOCKOPS`], with its own link): counts,
/// uncounts and reports rewritten sockets.
pub const PROG_CONNECT_SOCKOPS: &str = "lb_connect_sockops";
/// Hash: [`ListenerKey`] → balancer id (`u32`) of the listeners whose balancer uses connect-time
/// forwarding. A wildcard (`0.0.0.0`/`[::]`) entry matches loopback destinations only.
pub const MAP_CONNECT_LISTENERS: &str = "LB_CONNECT_LISTENERS";
/// Array of `MAX_BALANCERS * TABLE_SLOTS` [`ConnectTable`]s, written by lb only: balancer `b`'s
/// slot `s` is element [`table_index`]`(b, s)`. The programs read the slot that
/// [`MAP_CONNECT_CURRENT`] names; an all-zero slot (`count = 0`) leaves the connect alone.
///
/// Why no program reads a table torn: an array element is updated in place (a hash map's update
/// hands the replaced element to the next update at once, even of another key, while a program
/// may still be reading it, and a `BPF_F_NO_PREALLOC` one reuses freed elements without an RCU
/// wait too). lb writes a balancer's tables as generations: generation `g + 1` goes into slot
/// `(g + 1) % TABLE_SLOTS`, and only then is `g + 1` stored in [`MAP_CONNECT_CURRENT`]. A program
/// that loaded generation `g` reads slot `g % TABLE_SLOTS`; lb writes that slot again only for
/// generation `g + TABLE_SLOTS`, and only once it has not been current for
/// [`SLOT_REUSE_AFTER_MS`] (lb waits, see `lb-user`'s `connect::table::write_table`). A
/// program reads its table a few dozen instructions after loading the generation (no loop, no
/// helper that sleeps; microseconds), so the bound holds unless the program is stalled for
/// 100 ms between the two loads (a preempted task on a preemptible kernel under extreme load, a
/// virtual CPU its host holds that long), and only if lb wrote `TABLE_SLOTS - 1` tables since.
/// The table's stores and the generation's are two `bpf(2)` calls apart, in that order. The
/// programs take only the generation's low bits, which sit in one byte, so even a kernel that
/// copies the 4-byte value byte by byte gives them the old slot or the new one.
pub const MAP_CONNECT_TABLES: &str = "LB_CONNECT_TABLES";
/// Array of `MAX_BALANCERS` `u32`s: balancer id → the generation of its current table (see
/// [`MAP_CONNECT_TABLES`]); the programs read slot `generation % TABLE_SLOTS`
/// ([`table_index`]). 0 until lb first writes the balancer's table (slot 0, all zero: no
/// rewrite). It only grows (wrapping at `u32::MAX`, which keeps the slot sequence since
/// `TABLE_SLOTS` divides 2^32); an lb that takes over ([`MAP_CONNECT_TABLES`] handed over)
/// continues from the generation it finds here.
pub const MAP_CONNECT_CURRENT: &str = "LB_CONNECT_CURRENT";
/// Table slots per balancer in [`MAP_CONNECT_TABLES`]. A power of two (the programs mask the
/// generation with it).
pub const TABLE_SLOTS: u32 = 8;
const _: () = assert!(TABLE_SLOTS.is_power_of_two());
/// A table slot is written again only once it has not been current for this long
/// (milliseconds): far beyond the microseconds a program reads a table in. With
/// [`TABLE_SLOTS`] slots, `TABLE_SLOTS - 1` changes in a row are written at once; more wait.
pub const SLOT_REUSE_AFTER_MS: u64 = 100;

/// Element of [`MAP_CONNECT_TABLES`] that holds balancer `balancer`'s table of generation
/// `generation` (its slot is `generation % TABLE_SLOTS`). In range for `balancer <
/// MAX_BALANCERS`.
#[inline(always)]
pub const fn table_index(balancer: u32, generation: u32) -> u32 {
    balancer
        .wrapping_mul(TABLE_SLOTS)
        .wrapping_add(generation & (TABLE_SLOTS - 1))
}
const _: () = assert!(table_index(0, 0) == 0 && table_index(0, 9) == 1);
const _: () = assert!(table_index(MAX_BALANCERS - 1, u32::MAX) == MAX_BALANCERS * TABLE_SLOTS - 1);
/// Per-CPU array indexed by balancer id → round-robin counter (`u32`, one per CPU).
pub const MAP_CONNECT_RR: &str = "LB_CONNECT_RR";
/// LRU hash: socket cookie (`u64`) → [`ConnectOrig`] of every socket a connect program
/// rewrote; removed when the socket's descriptor is released ([`PROG_CONNECT_RELEASE`]) or
/// when the sockops program sees it close, whichever comes first.
pub const MAP_CONNECT_SOCKS: &str = "LB_CONNECT_SOCKS";
/// Hash: [`ConnectCountKey`] → established connect-time sockets (`u64`, changed with atomic
/// adds by the sockops program; a decrement is an add of `u64::MAX`).
pub const MAP_CONNECT_COUNTS: &str = "LB_CONNECT_COUNTS";
/// Ring buffer of [`ConnectEvent`]s: passive health signals of connect-time sockets (a
/// rewritten connect that failed, a retransmission timeout on an established one).
pub const MAP_CONNECT_EVENTS: &str = "LB_CONNECT_EVENTS";
/// Size of [`MAP_CONNECT_EVENTS`] in bytes (a power of two, a multiple of the page size): 1170
/// events of 48 bytes (plus the ring's 8-byte header each) before the kernel drops and counts
/// [`BalancerStats::connect_event_drops`].
pub const CONNECT_EVENTS_RING_BYTES: u32 = 64 * 1024;
/// [`ConnectEvent::kind`]: a rewritten connect went from `SYN_SENT` to `CLOSE` (refused by a
/// reset, its SYN retries ran out, or the client gave up on it: [`ConnectEvent::err`] tells
/// which).
pub const EVENT_CONNECT_FAILED: u32 = 1;
/// [`ConnectEvent::kind`]: the first retransmission timeout of an established connect-time
/// socket (one per socket).
pub const EVENT_RTO: u32 = 2;
/// [`ConnectOrig::reported`] bit: the socket's RTO event was sent (or dropped).
pub const REPORTED_RTO: u32 = 1;

/// Most servers in one [`ConnectTable`]; lb writes the first ones in preference order. A
/// power of two (the programs mask their pick with it).
pub const MAX_CONNECT_SERVERS: usize = 16;
const _: () = assert!(MAX_CONNECT_SERVERS.is_power_of_two());
/// Capacity of [`MAP_CONNECT_COUNTS`]: balancers × servers they ever had.
pub const MAX_CONNECT_COUNTS: u32 = 4096;
/// [`ConnectTable::policy`]: always the first server (lb writes them in failover order).
pub const CONNECT_FIRST: u32 = 0;
/// [`ConnectTable::policy`]: the next server in turn (a counter per CPU and balancer).
pub const CONNECT_ROUND_ROBIN: u32 = 1;
/// [`ConnectTable::policy`]: a uniformly random server (`bpf_get_prandom_u32`).
pub const CONNECT_RANDOM: u32 = 2;
/// [`ConnectTable::policy`]: of two different random servers, the one with fewer established
/// connect-time sockets in [`MAP_CONNECT_COUNTS`] (power of two choices).
pub const CONNECT_LEAST: u32 = 3;

/// One server of a [`ConnectTable`]: the address a rewritten `connect()` goes to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ConnectServer {
    /// Address, network byte order per 32-bit word (IPv4 in word 0, words 1-3 zero).
    pub ip_be: [u32; 4],
    /// Port, host order.
    pub port: u32,
    /// [`AF_INET`] or [`AF_INET6`].
    pub family: u32,
}
const _: () = assert!(size_of::<ConnectServer>() == 24);

/// The servers a balancer's connect programs choose from, best first.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnectTable {
    /// Servers in use: `servers[..count]`; 0 means no rewrite (the listener takes the connect).
    pub count: u32,
    /// [`CONNECT_FIRST`], [`CONNECT_ROUND_ROBIN`], [`CONNECT_RANDOM`] or [`CONNECT_LEAST`].
    pub policy: u32,
    /// The servers, best first.
    pub servers: [ConnectServer; MAX_CONNECT_SERVERS],
}
const _: () = assert!(size_of::<ConnectTable>() == 8 + 24 * MAX_CONNECT_SERVERS);

/// Key of [`MAP_CONNECT_COUNTS`]: a balancer and one of its servers.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ConnectCountKey {
    /// The server.
    pub server: ConnectServer,
    /// Balancer id.
    pub balancer: u32,
    /// Explicit padding, always 0.
    pub _pad: u32,
}
const _: () = assert!(size_of::<ConnectCountKey>() == 32);

/// What a connect program recorded about a socket it rewrote.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnectOrig {
    /// The address the client dialed (a listener), network byte order per word; for an IPv6
    /// socket the whole IPv6 address (IPv4-mapped when it dialed one).
    pub dialed_ip_be: [u32; 4],
    /// The port it dialed, host order.
    pub dialed_port: u32,
    /// 1 once the sockops program counted the socket as established, else 0.
    pub established: u32,
    /// Where the program sent it, and its balancer.
    pub count: ConnectCountKey,
    /// Events already reported for this socket ([`REPORTED_RTO`]), so each kind is sent at
    /// most once per socket.
    pub reported: u32,
    /// The process (tgid) that called `connect()`: lb finds the socket's network namespace
    /// through `/proc/<tgid>/ns/net` when it kills it.
    pub tgid: u32,
    /// The socket's own address once its SYN is about to leave (sockops `TCP_CONNECT_CB`),
    /// network byte order per word, as [`ConnectServer::ip_be`]; for an IPv6 socket the whole
    /// IPv6 address (IPv4-mapped when it dialed an IPv4-mapped listener). With
    /// [`Self::local_port`] and the server it names the socket to the kernel, so lb kills it
    /// without listing the namespace's sockets.
    pub local_ip_be: [u32; 4],
    /// The socket's own port, host order; 0 until `TCP_CONNECT_CB`.
    pub local_port: u32,
    /// The socket's family ([`AF_INET`] or [`AF_INET6`]); 0 until `TCP_CONNECT_CB`.
    pub family: u32,
}
const _: () = assert!(size_of::<ConnectOrig>() == 88);

/// A passive health signal of one connect-time socket, from the sockops program to lb.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnectEvent {
    /// The server the socket was sent to.
    pub server: ConnectServer,
    /// Balancer id.
    pub balancer: u32,
    /// [`EVENT_CONNECT_FAILED`] or [`EVENT_RTO`].
    pub kind: u32,
    /// The socket's cookie (lb ignores the failures of sockets it destroyed itself).
    pub cookie: u64,
    /// For [`EVENT_CONNECT_FAILED`], the socket's error (`sk_err`, a positive errno) when it
    /// closed: `ECONNREFUSED` (reset by the server), `ETIMEDOUT` (SYN retries ran out),
    /// `EHOSTUNREACH`/`ENETUNREACH` (ICMP), 0 when the client closed it itself (or lb cannot
    /// read it, see [`GLOBAL_OFF_SK_ERR`]). 0 for [`EVENT_RTO`].
    pub err: u32,
    /// Explicit padding, always 0.
    pub _pad: u32,
}
const _: () = assert!(size_of::<ConnectEvent>() == 48);

/// Every global lb sets at load time, for the ELF check.
pub const GLOBAL_NAMES: [&str; 13] = [
    GLOBAL_OFF_SK_ERR,
    GLOBAL_OFF_WRITE_SEQ,
    GLOBAL_OFF_MSG_SK_REDIR,
    GLOBAL_OFF_WMEM_QUEUED,
    GLOBAL_OFF_SNDBUF,
    GLOBAL_OFF_ULP_OPS,
    GLOBAL_KERNEL_READS,
    GLOBAL_OFF_SK_SOCKET,
    GLOBAL_OFF_SOCKET_FILE,
    GLOBAL_OFF_F_FLAGS,
    GLOBAL_OFF_SNDTIMEO,
    GLOBAL_BLOCKING_SPLICE,
    GLOBAL_KERNEL_LOG_LEVEL,
];

/// Whether two names are equal, usable in `const` context: `lb-ebpf` checks at compile time that
/// each map, program and global it defines is named by the constant here (Rust attributes and
/// item names cannot take a constant, so the kernel side states the name once as the item's
/// identifier and asserts it against this crate).
pub const fn same_name(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

const _: () = assert!(same_name(MAP_STATS, "LB_STATS") && !same_name(MAP_STATS, "LB_STATZ"));
const _: () = assert!(!same_name(MAP_STATS, "LB_STATS_") && !same_name("", MAP_STATS));

/// Every map name, for the ELF check. [`MAP_KERNEL_LOG`] is aya-log's, but lb's logger needs it
/// by that name, so a build that loses or renames it fails the check instead of turning kernel
/// logging off at run time.
pub const MAP_NAMES: [&str; 23] = [
    MAP_CONNECT_CTL,
    MAP_CONNECT_NETNS_PROBE,
    MAP_CONNECT_SCOPE,
    MAP_CONNECT_STATS,
    MAP_CONNECT_LISTENERS,
    MAP_CONNECT_SYN,
    MAP_CONNECT_SUSPECT,
    MAP_CONNECT_EVENTS,
    MAP_CONNECT_TABLES,
    MAP_CONNECT_CURRENT,
    MAP_CONNECT_RR,
    MAP_CONNECT_SOCKS,
    MAP_CONNECT_COUNTS,
    MAP_LISTENERS,
    MAP_CLIENTS,
    MAP_SERVERS,
    MAP_NETNS,
    MAP_FLOWS,
    MAP_PAIRS,
    MAP_STATS,
    MAP_REFRESH,
    MAP_NETNS_SCOPE,
    MAP_KERNEL_LOG,
];

/// Capacity of the connection maps (client sockets, server sockets, flows, pairs).
pub const MAX_CONNECTIONS: u32 = 65_536;
/// Capacity of [`MAP_LISTENERS`].
pub const MAX_LISTENERS: u32 = 256;
/// Balancer ids are `0..MAX_BALANCERS`; [`MAP_STATS`] has this many slots.
pub const MAX_BALANCERS: u32 = 64;
/// Size of [`MAP_REFRESH`] in bytes (a power of two, a multiple of the page size).
pub const REFRESH_RING_BYTES: u32 = 256 * 1024;

/// `AF_INET` from `<sys/socket.h>`.
pub const AF_INET: u32 = 2;
/// `AF_INET6` from `<sys/socket.h>`.
pub const AF_INET6: u32 = 10;

/// Value in [`MAP_NETNS`] when the same tuple was registered from two network namespaces:
/// lb then copies that connection in userspace instead of guessing.
pub const NETNS_AMBIGUOUS: u64 = u64::MAX;

/// [`PairCtl::mode`]: the pair is not spliced; every byte takes the copy path.
pub const MODE_PASS: u32 = 0;
/// [`PairCtl::mode`]: redirect the client's sends to the server socket once lb has copied every
/// byte that took the copy path (the counting rule).
pub const MODE_REDIRECT: u32 = 1;

/// The four-tuple of a client socket connected to lb, plus the client's network namespace cookie.
///
/// `client_*` is the client socket's local end, `lb_*` its remote end (one of lb's listeners).
/// IPv4 addresses sit in word 0 with words 1-3 zero. Addresses are in network byte order as the
/// kernel stores them; ports are in host order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockKey {
    /// Client address, network byte order per 32-bit word.
    pub client_ip_be: [u32; 4],
    /// Listener address, network byte order per 32-bit word.
    pub lb_ip_be: [u32; 4],
    /// Client port, host order.
    pub client_port: u32,
    /// Listener port, host order.
    pub lb_port: u32,
    /// `bpf_get_netns_cookie()` of the client socket; 0 in [`MAP_NETNS`] keys.
    pub netns_cookie: u64,
    /// [`AF_INET`] or [`AF_INET6`].
    pub family: u32,
    /// Explicit padding, always 0.
    pub _pad: u32,
}
const _: () = assert!(size_of::<SockKey>() == 56);

/// A listener address lb accepts on, as seen from a connecting client socket.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ListenerKey {
    /// Address, network byte order per 32-bit word (IPv4 in word 0).
    pub ip_be: [u32; 4],
    /// Port, host order.
    pub port: u32,
    /// [`AF_INET`] or [`AF_INET6`].
    pub family: u32,
}
const _: () = assert!(size_of::<ListenerKey>() == 24);

impl ListenerKey {
    /// The wildcard (`0.0.0.0` or `[::]`) listener of `port` (host order) in `family`
    /// ([`AF_INET`] or [`AF_INET6`]). Each family has its own: lb binds IPv6 listeners
    /// `IPV6_V6ONLY`, so `[::]` accepts no IPv4 client and registers only the [`AF_INET6`] one.
    pub const fn wildcard(port: u32, family: u32) -> ListenerKey {
        ListenerKey {
            ip_be: [0; 4],
            port,
            family,
        }
    }
}

/// Per-connection counters kept by the sk_msg program (single writer: sends on one socket are
/// serialised by the socket lock).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowState {
    /// Bytes the client sent through the normal path (to lb's accepted socket), in bytes: the
    /// growth of the client socket's `write_seq` since it connected, brought up to date at each
    /// send. Not the sizes of the sends the program passed: the kernel may push a passed send
    /// only in part (a non-blocking client) and then pushes the next one under the same verdict
    /// without running the program.
    pub passed: u64,
    /// Bytes redirected to the server socket's egress, in bytes.
    pub redirected: u64,
    /// `redirected` value at which a credit refresh was last requested.
    pub refresh_asked_at: u64,
    /// Balancer id of the listener the client connected to.
    pub balancer: u32,
    /// The client socket's `write_seq` when [`Self::passed`] was last brought up to date (at
    /// registration: `snd_nxt`, which equals it then).
    pub seq: u32,
    /// The client socket's cookie (`bpf_get_socket_cookie`, unique while the kernel runs): the
    /// generation of this tuple. A new socket that reuses a closed one's tuple gets a new flow
    /// with its own cookie, so a pair lb made for the old socket ([`PairCtl::cookie`]) never
    /// redirects the new one's sends.
    pub cookie: u64,
    /// Address of the server socket (`struct sock *`) this client's sends were last redirected
    /// to, 0 before the first: the program reads that socket's room through it with
    /// `bpf_probe_read_kernel` (never dereferenced otherwise). The socket stays alive while it is
    /// in the servers' sockhash, which is as long as the pair that sends there exists.
    pub server: u64,
}
const _: () = assert!(size_of::<FlowState>() == 48);

/// lb's instructions for one paired connection (single writer: lb).
///
/// lb replaces an entry whole, but the program may read it torn: [`MAP_PAIRS`] is a
/// preallocated hash, whose update hands the replaced element to the updating CPU's spare at
/// once (the next update of any existing key on that CPU copies its key and value into it) and
/// whose delete frees the element for the next insert, while a program may still be copying
/// the element out (five loads; an interrupt can fall between them). Each field is one aligned
/// load, so a copy mixes whole fields of the entry it found and of values written into the
/// element later. Mixed versions of one pair are safe: [`Self::cookie`] is the pair's
/// throughout, [`Self::copied`] only grows and is at most the bytes the client passed, so
/// `copied == passed` with another version's `copied` still means lb copied every passed byte;
/// [`Self::credit_end`] is a bound lb granted at one of those moments. A [`Self::cookie`] from
/// another connection's entry does not match the socket's and the send is passed. Not covered:
/// this pair's cookie with [`Self::copied`] of another connection's entry (lb rewrote the
/// element for another key within the read) passes the counting rule if the two byte counts
/// happen to be equal, and the send can then overtake bytes lb has not copied yet.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PairCtl {
    /// Bytes lb has read from the accepted socket and written to the server socket, in bytes.
    pub copied: u64,
    /// The program may redirect while `FlowState::redirected + size <= credit_end` (bytes).
    pub credit_end: u64,
    /// Ask for a refresh once `FlowState::redirected` passes this value (bytes).
    pub refresh_at: u64,
    /// [`MODE_PASS`] or [`MODE_REDIRECT`].
    pub mode: u32,
    /// Explicit padding, always 0.
    pub _pad: u32,
    /// [`FlowState::cookie`] of the client socket lb paired: the program redirects only the
    /// sends of that socket, never those of a newer one on the same tuple.
    pub cookie: u64,
}
const _: () = assert!(size_of::<PairCtl>() == 40);

/// A request from the sk_msg program for more redirect credit on one connection.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RefreshRequest {
    /// The connection.
    pub key: SockKey,
    /// `FlowState::redirected` when asked, in bytes.
    pub redirected: u64,
}
const _: () = assert!(size_of::<RefreshRequest>() == 64);

#[cfg(feature = "user")]
#[expect(
    unsafe_code,
    reason = "aya::Pod is an unsafe trait: the map value types promise every bit pattern is valid"
)]
mod pod {
    // SAFETY: each type is #[repr(C)], made only of integers, with padding written out, so every
    // bit pattern is valid and there are no uninitialised bytes.
    unsafe impl aya::Pod for super::SockKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::ListenerKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::FlowState {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::PairCtl {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::BalancerStats {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::RefreshRequest {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::ConnectServer {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::ConnectTable {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::ConnectCountKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::ConnectOrig {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::ConnectEvent {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::SynPolicy {}
}
