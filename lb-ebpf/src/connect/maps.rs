//! The connect-time programs' maps and the one global lb sets for them. These are the only
//! maps the connect programs use, so with a pin directory lb pins them with the programs'
//! links (`lb_common::CONNECT_MAPS`); their names and value layouts are `lb_common`'s.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
};
use lb_common::{
    BalancerStats, CONNECT_EVENTS_RING_BYTES, CTL_SLOTS, ConnectCountKey, ConnectOrig,
    ConnectTable, GLOBAL_OFF_SK_ERR, ListenerKey, MAP_CONNECT_COUNTS, MAP_CONNECT_CTL,
    MAP_CONNECT_CURRENT, MAP_CONNECT_EVENTS, MAP_CONNECT_LISTENERS, MAP_CONNECT_NETNS_PROBE,
    MAP_CONNECT_RR, MAP_CONNECT_SCOPE, MAP_CONNECT_SOCKS, MAP_CONNECT_STATS, MAP_CONNECT_SUSPECT,
    MAP_CONNECT_SYN, MAP_CONNECT_TABLES, MAX_BALANCERS, MAX_CONNECT_COUNTS, MAX_CONNECT_SYN,
    MAX_CONNECTIONS, MAX_LISTENERS, PROBE_SLOTS, SynPolicy, TABLE_SLOTS,
};

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
);

#[map]
pub(super) static LB_CONNECT_LISTENERS: HashMap<ListenerKey, u32> =
    HashMap::with_max_entries(MAX_LISTENERS, 0);

// An array, so a table is written in place and never reused under a reader: see
// lb_common::MAP_CONNECT_TABLES for why a program never reads one torn.
#[map]
pub(super) static LB_CONNECT_TABLES: Array<ConnectTable> =
    Array::with_max_entries(MAX_BALANCERS * TABLE_SLOTS, 0);

#[map]
pub(super) static LB_CONNECT_CURRENT: Array<u32> = Array::with_max_entries(MAX_BALANCERS, 0);

#[map]
pub(super) static LB_CONNECT_RR: PerCpuArray<u32> = PerCpuArray::with_max_entries(MAX_BALANCERS, 0);

#[map]
pub(super) static LB_CONNECT_SOCKS: LruHashMap<u64, ConnectOrig> =
    LruHashMap::with_max_entries(MAX_CONNECTIONS, 0);

#[map]
pub(super) static LB_CONNECT_COUNTS: HashMap<ConnectCountKey, u64> =
    HashMap::with_max_entries(MAX_CONNECT_COUNTS, 0);

#[map]
pub(super) static LB_CONNECT_EVENTS: RingBuf =
    RingBuf::with_byte_size(CONNECT_EVENTS_RING_BYTES, 0);

// Fail fast (see failfast): per server, the SYN policy lb asks for and the suspect marks.
#[map]
pub(super) static LB_CONNECT_SYN: HashMap<ConnectCountKey, SynPolicy> =
    HashMap::with_max_entries(MAX_CONNECT_SYN, 0);

#[map]
pub(super) static LB_CONNECT_SUSPECT: HashMap<ConnectCountKey, u64> =
    HashMap::with_max_entries(MAX_CONNECT_SYN, 0);

// lb's control (see lb_common::MAP_CONNECT_CTL): its tgid, heartbeat and orphan timeout, in a
// map rather than globals so a new lb that adopts these programs can write its own.
#[map]
pub(super) static LB_CONNECT_NETNS_PROBE: Array<u64> = Array::with_max_entries(PROBE_SLOTS, 0);

#[map]
pub(super) static LB_CONNECT_CTL: Array<u64> = Array::with_max_entries(CTL_SLOTS, 0);

#[map]
pub(super) static LB_CONNECT_SCOPE: Array<u64> = Array::with_max_entries(MAX_BALANCERS, 0);

#[map]
pub(super) static LB_CONNECT_STATS: PerCpuArray<BalancerStats> =
    PerCpuArray::with_max_entries(MAX_BALANCERS, 0);
// `struct sock::sk_err` offset (bytes), set at load time from the kernel's BTF; 0 when unknown.
#[unsafe(no_mangle)]
pub(super) static LB_OFF_SK_ERR: u32 = 0;
