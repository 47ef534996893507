//! The connect-time objects that outlive lb: which programs and maps are pinned, the control
//! map lb writes for them (its tgid, a heartbeat, the orphan bound) and the layout version a new
//! lb checks before it adopts them.

use crate::{
    MAP_CONNECT_COUNTS, MAP_CONNECT_CURRENT, MAP_CONNECT_EVENTS, MAP_CONNECT_LISTENERS,
    MAP_CONNECT_RR, MAP_CONNECT_SOCKS, MAP_CONNECT_SUSPECT, MAP_CONNECT_SYN, MAP_CONNECT_TABLES,
    PROG_CONNECT_RELEASE, PROG_CONNECT_SOCKOPS, PROG_CONNECT4, PROG_CONNECT6, PROG_GETPEERNAME4,
    PROG_GETPEERNAME6,
};

/// The connect-time programs, each with a link of its own, pinned under these names.
pub const CONNECT_PROGS: [&str; 6] = [
    PROG_GETPEERNAME4,
    PROG_GETPEERNAME6,
    PROG_CONNECT_SOCKOPS,
    PROG_CONNECT_RELEASE,
    PROG_CONNECT4,
    PROG_CONNECT6,
];
/// Array of `MAX_BALANCERS` `u64`s: the connect programs' [`MAP_NETNS_SCOPE`](crate::MAP_NETNS_SCOPE) (lb writes both).
pub const MAP_CONNECT_SCOPE: &str = "LB_CONNECT_SCOPE";
/// Per-CPU array of the connect programs' [`BalancerStats`](crate::BalancerStats) by balancer; lb adds [`MAP_STATS`](crate::MAP_STATS).
pub const MAP_CONNECT_STATS: &str = "LB_CONNECT_STATS";
/// Array of [`CTL_SLOTS`] `u64`s, lb's control of the connect programs (`CTL_*` slots). Its
/// value size and the slot of [`CTL_LAYOUT`] never change, so any lb can read the layout of
/// pins another build left.
pub const MAP_CONNECT_CTL: &str = "LB_CONNECT_CTL";
/// [`MAP_CONNECT_CTL`] slot: lb's tgid, whose sockets are never rewritten (each lb writes its own).
pub const CTL_OWN_TGID: u32 = 0;
/// [`MAP_CONNECT_CTL`] slot: lb's heartbeat, `CLOCK_BOOTTIME` ns (`bpf_ktime_get_boot_ns`).
pub const CTL_HEARTBEAT_NS: u32 = 1;
/// [`MAP_CONNECT_CTL`] slot: how old (ns) the heartbeat may be before the connect programs stop
/// rewriting (`datapath.orphan_timeout`); 0: no bound.
pub const CTL_ORPHAN_NS: u32 = 2;
/// [`MAP_CONNECT_CTL`] slot: the [`CONNECT_PIN_LAYOUT`] of the programs and maps in use.
pub const CTL_LAYOUT: u32 = 3;
/// [`MAP_CONNECT_CTL`] slots `CTL_BALANCER_NAMES + id` for each balancer id below
/// [`MAX_BALANCERS`](crate::MAX_BALANCERS): the hash of the name of the balancer lb gave that id
/// ([`balancer_name_hash`]), 0 for none; the next lb that adopts the pins gives each balancer
/// the id it had. Read by lb only.
pub const CTL_BALANCER_NAMES: u32 = 4;
/// Entries of [`MAP_CONNECT_CTL`].
pub const CTL_SLOTS: u32 = CTL_BALANCER_NAMES + crate::MAX_BALANCERS;

/// The hash of a balancer's name in [`CTL_BALANCER_NAMES`]: 64-bit FNV-1a of its UTF-8 bytes
/// (`fnv.rs`), 1 where that is 0 (0 marks a free id).
pub fn balancer_name_hash(name: &str) -> u64 {
    crate::fnv::fnv1a(crate::fnv::FNV_OFFSET, name.as_bytes()).max(1)
}
/// Array of [`PROBE_SLOTS`] `u64`s through which lb learns its network namespace's cookie on a
/// kernel without `SO_NETNS_COOKIE` (before 5.14): lb writes a loopback port to
/// [`PROBE_PORT`], a process of lb's namespace in the cgroup connects to `127.0.0.1` at that
/// port, and the connect4 program writes that socket's `bpf_get_netns_cookie` (5.7) to
/// [`PROBE_COOKIE`] instead of looking the connect up.
pub const MAP_CONNECT_NETNS_PROBE: &str = "LB_CONNECT_NETNS_PROBE";
/// [`MAP_CONNECT_NETNS_PROBE`] slot: the probe's port (host order); 0: no probe running.
pub const PROBE_PORT: u32 = 0;
/// [`MAP_CONNECT_NETNS_PROBE`] slot: the cookie the probe's connect recorded; 0: none yet.
pub const PROBE_COOKIE: u32 = 1;
/// Entries of [`MAP_CONNECT_NETNS_PROBE`].
pub const PROBE_SLOTS: u32 = 2;
include!(concat!(env!("OUT_DIR"), "/layout.rs"));
/// The connect-time maps, pinned with their programs' links (the splice's maps are not).
pub const CONNECT_MAPS: [&str; 13] = [
    MAP_CONNECT_CTL,
    MAP_CONNECT_SYN,
    MAP_CONNECT_SUSPECT,
    MAP_CONNECT_LISTENERS,
    MAP_CONNECT_TABLES,
    MAP_CONNECT_CURRENT,
    MAP_CONNECT_RR,
    MAP_CONNECT_SOCKS,
    MAP_CONNECT_COUNTS,
    MAP_CONNECT_EVENTS,
    MAP_CONNECT_SCOPE,
    MAP_CONNECT_STATS,
    MAP_CONNECT_NETNS_PROBE,
];
