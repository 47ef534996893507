//! Property test of the balancer: random sequences of checks, dials, connections, holds and set
//! changes never break the invariants operators rely on.

use std::collections::HashSet;

use lb::{
    addr::ServerAddr,
    balancer::{Balancer, ConnGuard, Hold, Options, ServerState},
    config::{Config, Overrides, Policy},
};

/// xorshift64*: deterministic, so a failure names a reproducible seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

const POOL: [&str; 5] = [
    "198.18.0.2:1",
    "198.18.0.3:1",
    "198.18.0.4:1",
    "198.18.0.5:1",
    "198.18.0.6:1",
];

fn addr(s: &str) -> ServerAddr {
    ServerAddr::parse(s).unwrap()
}

/// A balancer whose own RNG (`random`, `least-connections`) is seeded with `seed`, so a failing
/// seed reproduces exactly.
fn balancer(policy: Policy, seed: u64) -> std::sync::Arc<Balancer> {
    let o = Overrides {
        listen: vec!["127.0.0.1:6444".parse().unwrap()],
        servers: POOL[..3].iter().map(|s| addr(s)).collect(),
        default_server: Some(addr(POOL[4])),
        ..Overrides::default()
    };
    let mut cfg = Config::load(None, &o).unwrap().balancers.remove(0);
    cfg.policy = policy;
    cfg.health.rise = 2;
    cfg.health.fall = 2;
    Balancer::build(
        0,
        cfg,
        Options {
            seed: Some(seed),
            ..Options::default()
        },
    )
}

fn check_invariants(b: &Balancer, policy: Policy, guards: &[ConnGuard], seed: u64, step: usize) {
    let status = b.status();
    let ctx = format!("seed {seed} step {step}: {status:?}");
    if policy == Policy::Failover {
        let active = status
            .iter()
            .filter(|s| s.state == ServerState::Active)
            .count();
        assert!(active <= 1, "two ACTIVE servers under failover: {ctx}");
    }
    let known: HashSet<&str> = status.iter().map(|s| s.address.as_str()).collect();
    for spec in b.dial_order() {
        assert!(
            known.contains(spec.as_str()),
            "dial order offers unknown server {spec}: {ctx}"
        );
        let s = status.iter().find(|s| s.address == spec).unwrap();
        assert_eq!(s.hold, Hold::None, "dial order offers a held server: {ctx}");
        assert_ne!(
            s.state,
            ServerState::Invalid,
            "dial order offers an INVALID server: {ctx}"
        );
    }
    assert!(
        status.iter().filter(|s| s.default).count() <= 1,
        "more than one default server: {ctx}"
    );
    // The registry holds exactly the connections that are alive and were not killed.
    let live = guards.iter().filter(|g| !g.cancel.is_cancelled()).count();
    assert_eq!(
        b.connection_count(),
        live,
        "registry drifted from live connections: {ctx}"
    );
    for s in &status {
        let per = guards
            .iter()
            .filter(|g| !g.cancel.is_cancelled() && *g.server() == s.address)
            .count();
        assert_eq!(
            s.connections, per,
            "per-server count of {} wrong: {ctx}",
            s.address
        );
    }
}

fn run(policy: Policy, seed: u64, steps: usize) {
    let b = balancer(policy, seed);
    let mut rng = Rng(seed | 1);
    let mut guards: Vec<ConnGuard> = Vec::new();
    for step in 0..steps {
        let specs = b.server_specs();
        let pick = |rng: &mut Rng| specs[rng.below(specs.len())].clone();
        match rng.below(9) {
            0 | 1 => {
                b.record_check(&pick(&mut rng), Ok(()));
            }
            2 => {
                b.record_check(&pick(&mut rng), Err("refused".into()));
            }
            3 => {
                if let Some(first) = b.dial_order().first() {
                    b.record_dial(first, Ok(()));
                    guards.push(b.register(first, None));
                }
            }
            4 => {
                if !guards.is_empty() {
                    let i = rng.below(guards.len());
                    guards.swap_remove(i);
                }
            }
            5 => {
                let n = 1 + rng.below(POOL.len());
                let mut set: Vec<ServerAddr> = Vec::new();
                while set.len() < n {
                    let s = addr(POOL[rng.below(POOL.len())]);
                    if !set.contains(&s) {
                        set.push(s);
                    }
                }
                let default = if rng.below(2) == 0 {
                    Some(addr(POOL[rng.below(POOL.len())]))
                } else {
                    None
                };
                b.set_servers(&set, default.as_ref()).unwrap();
            }
            6 => {
                let hold = [Hold::None, Hold::Drain, Hold::Disabled][rng.below(3)];
                b.set_hold(pick(&mut rng).as_str(), hold).unwrap();
            }
            7 => {
                let _ = b.kill_server(pick(&mut rng).as_str(), lb::balancer::KillReason::Admin);
            }
            _ => {
                b.record_dial(&pick(&mut rng), Err("timed out".into()));
            }
        }
        guards.retain(|g| !g.cancel.is_cancelled() || rng.below(2) == 0);
        check_invariants(&b, policy, &guards, seed, step);
    }
}

#[test]
fn random_sequences_keep_invariants() {
    for seed in 1..=200u64 {
        for policy in [
            Policy::Failover,
            Policy::RoundRobin,
            Policy::LeastConnections,
            Policy::Random,
        ] {
            run(policy, seed * 7919, 150);
        }
    }
}
