//! Fail fast in the kernel for connect-time sockets: the SYN retransmission timeout and SYN
//! retry count lb asks for per server, and the servers whose SYNs went unanswered.

use core::mem::size_of;

use crate::ConnectCountKey;

/// Hash: [`ConnectCountKey`] → [`SynPolicy`], written by lb for every server of a
/// connect-mode balancer's table; read by the sockops program for the sockets sent there. A
/// server without an entry gets the kernel's defaults and is never marked suspect.
pub const MAP_CONNECT_SYN: &str = "LB_CONNECT_SYN";
/// Hash: [`ConnectCountKey`] → boot time (`CLOCK_BOOTTIME`, ns) when the sockops program
/// marked the server suspect: a rewritten connect to it saw [`SynPolicy::suspect_after`] SYN
/// retransmission timeouts. The connect programs pass over a suspect server while another is
/// in the table; lb deletes the key when a check of the server passes after the mark. A map of
/// its own, since lb rewrites the tables whole.
pub const MAP_CONNECT_SUSPECT: &str = "LB_CONNECT_SUSPECT";
/// Capacity of [`MAP_CONNECT_SYN`] and [`MAP_CONNECT_SUSPECT`] (as `MAX_CONNECT_COUNTS`).
pub const MAX_CONNECT_SYN: u32 = 4096;
/// Bounds of [`SynPolicy::syn_retries`]: `TCP_SYNCNT` takes 1..=127 (`MAX_TCP_SYNCNT` in the
/// kernel's `include/net/tcp.h`); 0 leaves the kernel's `net.ipv4.tcp_syn_retries`.
pub const MAX_SYN_RETRIES: u32 = 127;

/// What the sockops program does with a rewritten socket sent to one server.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SynPolicy {
    /// The SYN's retransmission timeout in jiffies (the kernel's `HZ`, which lb measures at
    /// start), returned for `BPF_SOCK_OPS_TIMEOUT_INIT`; 0 leaves the kernel's 1 s.
    pub timeout_jiffies: u32,
    /// After this many SYN retransmission timeouts of one connect (`BPF_SOCK_OPS_RTO_CB` in
    /// `SYN_SENT`) the server is marked in [`MAP_CONNECT_SUSPECT`]; 0 never marks it.
    pub suspect_after: u32,
    /// `TCP_SYNCNT` set on the socket before its SYN leaves (1..=[`MAX_SYN_RETRIES`]); 0
    /// leaves the kernel's `net.ipv4.tcp_syn_retries`.
    pub syn_retries: u32,
    /// Explicit padding, always 0.
    pub _pad: u32,
}
const _: () = assert!(size_of::<SynPolicy>() == 16);

/// Key of [`MAP_CONNECT_SYN`] and [`MAP_CONNECT_SUSPECT`]: the same as the counts'.
pub type SuspectKey = ConnectCountKey;
