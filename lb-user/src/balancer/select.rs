//! Selection policies: the order in which a client's dial tries the servers, from a snapshot
//! of the server list. The random choices take an injected RNG, so a seeded balancer repeats
//! its choices exactly (the property test names a failing seed that reproduces).

use rand::Rng;

use super::state::{Hold, Server, ServerState};
use crate::{addr::ServerAddr, config::Policy};

/// Servers to dial, best first. `failover`: by state (ACTIVE, PREFERRED, HEALTHY, RECOVERING,
/// UNCHECKED, STANDBY, FAILED; the enum's order), then set order. The spreading policies pick
/// one usable server first (`round-robin` the next in turn, `random` any, `least-connections`
/// the less loaded of two random picks, "power of two choices"), then the failover order.
/// FAILED servers come last but are still tried (K3s #10240); held and INVALID servers never.
pub(super) fn dial_order(
    servers: &[Server],
    conns: impl Fn(&ServerAddr) -> usize,
    policy: Policy,
    rr: &mut usize,
    rng: &mut impl Rng,
) -> Vec<ServerAddr> {
    let mut order: Vec<(usize, &Server)> = servers
        .iter()
        .enumerate()
        .filter(|(_, s)| s.hold == Hold::None && s.state != ServerState::Invalid)
        .collect();
    order.sort_by_key(|(i, s)| (std::cmp::Reverse(s.state), *i));
    let mut addrs: Vec<ServerAddr> = order.iter().map(|(_, s)| s.addr.clone()).collect();
    let usable: Vec<&ServerAddr> = order
        .iter()
        .filter(|(_, s)| s.state.is_usable())
        .map(|(_, s)| &s.addr)
        .collect();
    if policy == Policy::Failover || usable.len() < 2 {
        return addrs;
    }
    let pick = match policy {
        Policy::RoundRobin => {
            *rr = rr.wrapping_add(1);
            usable[*rr % usable.len()]
        }
        Policy::Random => usable[rng.gen_range(0..usable.len())],
        Policy::LeastConnections => {
            let a = usable[rng.gen_range(0..usable.len())];
            let b = usable[rng.gen_range(0..usable.len())];
            if conns(b) < conns(a) { b } else { a }
        }
        Policy::Failover => return addrs,
    }
    .clone();
    addrs.retain(|s| *s != pick);
    addrs.insert(0, pick);
    addrs
}

/// The servers a connect-time table holds, best first: under `failover` the failover order
/// without FAILED servers (all of them when nothing else is left), so the kernel's first entry
/// is the server a dial would try first; under the spreading policies the usable servers in
/// set order (the kernel spreads over them), or that failover order when fewer than two are
/// usable. Held and INVALID servers never.
pub(super) fn connect_order(servers: &[Server], policy: Policy) -> Vec<ServerAddr> {
    let mut order: Vec<(usize, &Server)> = servers
        .iter()
        .enumerate()
        .filter(|(_, s)| s.hold == Hold::None && s.state != ServerState::Invalid)
        .collect();
    if policy != Policy::Failover {
        let usable: Vec<ServerAddr> = order
            .iter()
            .filter(|(_, s)| s.state.is_usable())
            .map(|(_, s)| s.addr.clone())
            .collect();
        if usable.len() >= 2 {
            return usable;
        }
    }
    order.sort_by_key(|(i, s)| (std::cmp::Reverse(s.state), *i));
    let alive: Vec<ServerAddr> = order
        .iter()
        .filter(|(_, s)| s.state != ServerState::Failed)
        .map(|(_, s)| s.addr.clone())
        .collect();
    if alive.is_empty() {
        order.iter().map(|(_, s)| s.addr.clone()).collect()
    } else {
        alive
    }
}
