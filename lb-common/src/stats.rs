//! The counters the kernel programs keep per balancer ([`BalancerStats`], one copy per CPU in
//! `LB_STATS` and `LB_CONNECT_STATS`) and the reasons they count by.

use core::mem::size_of;

/// Why a send took the copy path instead of the splice; index into [`BalancerStats::pass`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PassReason {
    /// lb has not paired the connection yet (or took it out of the maps).
    Unpaired = 0,
    /// lb has not copied every byte that took the copy path yet (the counting rule).
    Catchup = 1,
    /// The server socket's queue is at `max_buffered_bytes` (no credit left) and the client
    /// socket is non-blocking.
    Credit = 2,
    /// `bpf_msg_redirect_hash` failed (server socket gone from the map).
    RedirectError = 3,
    /// The pair lb holds for this tuple belongs to an earlier socket (its cookie differs): the
    /// client reused a closed connection's tuple before lb took the old pair out.
    StalePair = 4,
    /// The client socket has an upper layer protocol (kTLS): its sends reach the program as
    /// plaintext records, which must never be redirected past the encryption.
    Ulp = 5,
}

/// Number of [`PassReason`] variants.
pub const PASS_REASONS: usize = 6;

impl PassReason {
    /// All reasons, in index order.
    pub const ALL: [PassReason; PASS_REASONS] = [
        PassReason::Unpaired,
        PassReason::Catchup,
        PassReason::Credit,
        PassReason::RedirectError,
        PassReason::StalePair,
        PassReason::Ulp,
    ];

    /// Label used in metrics.
    pub const fn label(self) -> &'static str {
        match self {
            PassReason::Unpaired => "unpaired",
            PassReason::Catchup => "catchup",
            PassReason::Credit => "credit",
            PassReason::RedirectError => "redirect_error",
            PassReason::StalePair => "stale_pair",
            PassReason::Ulp => "ulp",
        }
    }
}

/// Why `lb_sockops` could not register a client socket for the splice; index into
/// [`BalancerStats::register_failures`]. Such a client is served on the copy path (nothing is
/// lost), but none of its bytes is spliced.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegisterFailure {
    /// The `LB_FLOWS` entry could not be written.
    FlowsMap = 0,
    /// The `LB_NETNS` entry could not be written.
    NetnsMap = 1,
    /// `LB_CLIENTS` (the sockhash) refused the socket: full (`MAX_CONNECTIONS` sockets) or the
    /// socket cannot take a psock.
    Sockhash = 2,
}

/// Number of [`RegisterFailure`] variants.
pub const REGISTER_FAILURES: usize = 3;

impl RegisterFailure {
    /// All reasons, in index order.
    pub const ALL: [RegisterFailure; REGISTER_FAILURES] = [
        RegisterFailure::FlowsMap,
        RegisterFailure::NetnsMap,
        RegisterFailure::Sockhash,
    ];

    /// Label used in metrics and `/status`.
    pub const fn label(self) -> &'static str {
        match self {
            RegisterFailure::FlowsMap => "flows_map",
            RegisterFailure::NetnsMap => "netns_map",
            RegisterFailure::Sockhash => "sockhash",
        }
    }
}

/// Why the connect programs left a `connect()` to a connect-time listener as it was (the
/// client then reaches lb's listener and is proxied); index into
/// [`BalancerStats::unrewritten`]. Sockets of another network namespace are counted apart, in
/// [`BalancerStats::netns_skipped_connects`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unrewritten {
    /// lb's heartbeat is older than the orphan timeout (`CTL_ORPHAN_NS`): lb is gone, so its
    /// pinned programs stop steering.
    Orphaned = 0,
    /// The balancer's connect table is empty or missing: no server is usable.
    NoServers = 1,
    /// The chosen server's address family cannot be reached from the socket (an IPv4 socket
    /// and an IPv6 server, or an IPv6 socket that did not dial a mapped address and an IPv4
    /// server).
    Family = 2,
    /// The socket's record in `LB_CONNECT_SOCKS` (which `getpeername` answers from) could not
    /// be written.
    RecordMap = 3,
}

/// Number of [`Unrewritten`] variants.
pub const UNREWRITTEN_REASONS: usize = 4;

impl Unrewritten {
    /// All reasons, in index order.
    pub const ALL: [Unrewritten; UNREWRITTEN_REASONS] = [
        Unrewritten::Orphaned,
        Unrewritten::NoServers,
        Unrewritten::Family,
        Unrewritten::RecordMap,
    ];

    /// Label used in metrics and `/status`.
    pub const fn label(self) -> &'static str {
        match self {
            Unrewritten::Orphaned => "orphaned",
            Unrewritten::NoServers => "no_servers",
            Unrewritten::Family => "family",
            Unrewritten::RecordMap => "record_map",
        }
    }
}

/// Per-balancer counters, one copy per CPU; lb sums them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BalancerStats {
    /// Client-to-server bytes redirected to a server socket by sk_msg.
    pub redirected_bytes: u64,
    /// Sizes of the client-to-server sends that took the copy path, as the program saw them
    /// (a send the kernel pushes only in part counts whole; lb's `lb_copied_bytes_total` is
    /// what arrived).
    pub passed_bytes: u64,
    /// Sends that took the copy path, by [`PassReason`].
    pub pass: [u64; PASS_REASONS],
    /// Client sockets registered by sockops.
    pub registered: u64,
    /// Credit refresh requests sent to lb.
    pub refresh_requests: u64,
    /// Sends of blocking clients redirected past the credit; each waits in the kernel if the
    /// server socket has no room, as on a direct connection.
    pub blocking_redirects: u64,
    /// Connect-time events the sockops program could not send because
    /// [`MAP_CONNECT_EVENTS`](crate::MAP_CONNECT_EVENTS) was full.
    pub connect_event_drops: u64,
    /// `connect()`s to a connect-time listener the connect programs left alone because the
    /// socket is in another network namespace than the balancer's ([`MAP_NETNS_SCOPE`](crate::MAP_NETNS_SCOPE)).
    pub netns_skipped_connects: u64,
    /// Sockets connected to a listener that sockops did not register for the splice because
    /// they are in another network namespace than the balancer's ([`MAP_NETNS_SCOPE`](crate::MAP_NETNS_SCOPE)).
    pub netns_skipped_sockets: u64,
    /// Client sockets `lb_sockops` could not register for the splice, by [`RegisterFailure`].
    pub register_failures: [u64; REGISTER_FAILURES],
    /// `connect()`s to a connect-time listener the connect programs left as they were, by
    /// [`Unrewritten`].
    pub unrewritten: [u64; UNREWRITTEN_REASONS],
}
const _: () = assert!(size_of::<BalancerStats>() == 168);

impl BalancerStats {
    /// Add `other`'s counters to these (lb sums the per-CPU copies).
    pub fn add(&mut self, other: &BalancerStats) {
        self.redirected_bytes += other.redirected_bytes;
        self.passed_bytes += other.passed_bytes;
        for (o, p) in self.pass.iter_mut().zip(other.pass) {
            *o += p;
        }
        self.registered += other.registered;
        self.refresh_requests += other.refresh_requests;
        self.blocking_redirects += other.blocking_redirects;
        self.connect_event_drops += other.connect_event_drops;
        self.netns_skipped_connects += other.netns_skipped_connects;
        self.netns_skipped_sockets += other.netns_skipped_sockets;
        for (o, p) in self
            .register_failures
            .iter_mut()
            .zip(other.register_failures)
        {
            *o += p;
        }
        for (o, p) in self.unrewritten.iter_mut().zip(other.unrewritten) {
            *o += p;
        }
    }
}
