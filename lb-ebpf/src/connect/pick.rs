//! Which server a rewritten connect goes to: the balancer's current table (read from the slot
//! its generation names) and its policy's pick (`first`, `round-robin`, `random`,
//! `least-connections`).

use aya_ebpf::helpers::bpf_get_prandom_u32;
use lb_common::{
    CONNECT_LEAST, CONNECT_RANDOM, CONNECT_ROUND_ROBIN, ConnectCountKey, ConnectServer,
    ConnectTable, MAX_CONNECT_SERVERS, table_index,
};

use super::maps::{LB_CONNECT_COUNTS, LB_CONNECT_CURRENT, LB_CONNECT_RR, LB_CONNECT_TABLES};

/// The index of the server `balancer`'s table `table` (of `count` servers, 1 to
/// `MAX_CONNECT_SERVERS`) gives this connect, by its policy, passing over a suspect server
/// while another is in the table (`failfast`). Index < `count`.
#[inline(always)]
pub(super) fn choose(table: &ConnectTable, balancer: u32, count: usize) -> usize {
    // checked_rem: `count` is not 0 (the caller checked), but a plain `%` here keeps a
    // division-by-zero panic path the verifier would refuse.
    let pick = match table.policy {
        CONNECT_ROUND_ROBIN => match LB_CONNECT_RR.get_ptr_mut(balancer) {
            Some(rr) => {
                // SAFETY: this CPU's slot.
                let n = unsafe {
                    *rr = (*rr).wrapping_add(1);
                    *rr
                };
                (n as usize).checked_rem(count).unwrap_or(0)
            }
            None => 0,
        },
        // SAFETY: no preconditions.
        CONNECT_RANDOM => (unsafe { bpf_get_prandom_u32() } as usize)
            .checked_rem(count)
            .unwrap_or(0),
        CONNECT_LEAST => least_of_two(table, balancer, count),
        _ => 0,
    };
    // pick < count <= MAX_CONNECT_SERVERS (a power of two): the mask changes nothing but
    // gives the verifier the bound it cannot derive from a modulo (`black_box` keeps LLVM,
    // which knows the bound, from dropping it).
    let pick = core::hint::black_box(pick) & (MAX_CONNECT_SERVERS - 1);
    super::failfast::avoid_suspect(table, balancer, pick, count)
}

/// Balancer `balancer`'s current table: the generation in `LB_CONNECT_CURRENT` (one aligned
/// 4-byte load), then its slot. `None` for an id out of range.
#[inline(always)]
pub(super) fn current_table(balancer: u32) -> Option<&'static ConnectTable> {
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
