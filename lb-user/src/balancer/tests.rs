//! Unit tests of the balancer: K3s transitions, policies, set changes, the state file rule.
use super::*;
use crate::config::{Config, Overrides, Policy};

fn a(s: &str) -> ServerAddr {
    ServerAddr::parse(s).unwrap()
}

fn balancer(servers: &[&str], default: Option<&str>, policy: Policy) -> Arc<Balancer> {
    let o = Overrides {
        listen: vec!["127.0.0.1:6444".parse().unwrap()],
        servers: servers.iter().map(|s| a(s)).collect(),
        default_server: default.map(a),
        ..Overrides::default()
    };
    let mut cfg = Config::load(None, &o).unwrap().balancers.remove(0);
    cfg.policy = policy;
    Balancer::new(0, cfg)
}

fn states(b: &Balancer) -> Vec<ServerState> {
    b.status().iter().map(|s| s.state).collect()
}

#[test]
fn k3s_transitions() {
    use ServerState::*;
    let b = balancer(&["198.18.0.2:1", "198.18.0.3:1"], None, Policy::Failover);
    assert_eq!(states(&b), [Unchecked, Unchecked]);
    b.record_check(&a("198.18.0.2:1"), Ok(()));
    assert_eq!(states(&b)[0], Recovering);
    b.record_check(&a("198.18.0.2:1"), Ok(()));
    assert_eq!(states(&b)[0], Preferred);
    b.record_dial(&a("198.18.0.2:1"), Ok(()));
    assert_eq!(states(&b)[0], Active);
    let g = b.register(&a("198.18.0.2:1"), None);
    let out = b.record_check(&a("198.18.0.2:1"), Err("refused".into()));
    assert_eq!(
        (out.from, out.to, out.killed),
        (Some(Active), Some(Failed), 1)
    );
    assert!(g.cancel.is_cancelled());
    assert_eq!(g.reason(), Some(KillReason::Unhealthy));
    assert_eq!(
        b.dial_order(),
        ["198.18.0.3:1", "198.18.0.2:1"],
        "FAILED is still tried, last"
    );
}

#[test]
fn failback_kills_less_preferred_active() {
    let b = balancer(&["198.18.0.2:1", "198.18.0.3:1"], None, Policy::Failover);
    for s in ["198.18.0.2:1", "198.18.0.3:1"] {
        b.record_check(&a(s), Ok(()));
        b.record_check(&a(s), Ok(()));
    }
    b.record_check(&a("198.18.0.2:1"), Err("down".into()));
    b.record_dial(&a("198.18.0.3:1"), Ok(()));
    let g = b.register(&a("198.18.0.3:1"), None);
    b.record_check(&a("198.18.0.2:1"), Ok(()));
    assert!(!g.cancel.is_cancelled());
    b.record_check(&a("198.18.0.2:1"), Ok(()));
    assert_eq!(g.reason(), Some(KillReason::Failback));
    assert_eq!(b.dial_order()[0], "198.18.0.2:1");
}

#[test]
fn first_checks_do_not_fail_back() {
    let b = balancer(&["198.18.0.2:1", "198.18.0.3:1"], None, Policy::Failover);
    b.record_check(&a("198.18.0.3:1"), Ok(()));
    b.record_check(&a("198.18.0.3:1"), Ok(()));
    b.record_dial(&a("198.18.0.3:1"), Ok(()));
    let g = b.register(&a("198.18.0.3:1"), None);
    b.record_check(&a("198.18.0.2:1"), Ok(()));
    b.record_check(&a("198.18.0.2:1"), Ok(()));
    assert!(
        !g.cancel.is_cancelled(),
        "a server's first passing checks are not a recovery"
    );
    assert_eq!(
        b.dial_order()[0],
        "198.18.0.3:1",
        "the ACTIVE server keeps new clients"
    );
}

#[test]
fn default_server_is_standby_and_last() {
    let b = balancer(&["198.18.0.2:1"], Some("198.18.0.9:1"), Policy::Failover);
    assert_eq!(states(&b), [ServerState::Unchecked, ServerState::Standby]);
    b.record_check(&a("198.18.0.2:1"), Err("down".into()));
    assert_eq!(b.dial_order(), ["198.18.0.9:1", "198.18.0.2:1"]);
    // Moving the default removes the old STANDBY one.
    assert!(
        b.set_servers(&[a("198.18.0.2:1")], Some(&a("198.18.0.2:1")))
            .unwrap()
    );
    assert_eq!(b.server_specs(), ["198.18.0.2:1"]);
}

#[test]
fn set_refuses_bad_sets_and_skips_unchanged() {
    let b = balancer(&["198.18.0.2:1"], None, Policy::Failover);
    assert_eq!(b.set_servers(&[], None), Err(SetError::Empty));
    assert!(matches!(
        b.set_servers(&[a("a:1"), a("a:1")], None),
        Err(SetError::Duplicate(_))
    ));
    assert!(matches!(
        crate::addr::parse_all(&["nope".into()]),
        Err(SetError::Unparsable { .. })
    ));
    assert!(matches!(
        b.set_servers(&[a("127.0.0.1:6444")], None),
        Err(SetError::OwnListener(_))
    ));
    assert!(!b.set_servers(&[a("198.18.0.2:1")], None).unwrap());
}

#[test]
fn passive_resets_fail_a_server_only_at_the_limit() {
    let b = balancer(&["198.18.0.2:1"], None, Policy::Failover);
    b.record_check(&a("198.18.0.2:1"), Ok(()));
    b.record_check(&a("198.18.0.2:1"), Ok(()));
    for _ in 0..9 {
        assert!(!b.record_passive_reset(&a("198.18.0.2:1"), 10));
    }
    assert_eq!(states(&b), [ServerState::Preferred]);
    // A passing check starts the count again.
    b.record_check(&a("198.18.0.2:1"), Ok(()));
    assert!(!b.record_passive_reset(&a("198.18.0.2:1"), 10));
    for _ in 0..9 {
        b.record_passive_reset(&a("198.18.0.2:1"), 10);
    }
    assert_eq!(states(&b), [ServerState::Failed]);
}

/// Retransmission timeouts within one check interval (1 s here) count as one reset, however
/// many sockets a blip hits; a server-failed connect counts as one reset each.
#[test]
fn rtos_count_once_per_interval_and_failed_connects_as_resets() {
    let s = a("198.18.0.2:1");
    let b = balancer(&["198.18.0.2:1"], None, Policy::Failover);
    b.record_check(&s, Ok(()));
    b.record_check(&s, Ok(()));
    for _ in 0..20 {
        assert!(!b.record_rto(&s));
    }
    // One reset counted so far: eight more stay below the limit of 10, the ninth reaches it.
    for _ in 0..8 {
        assert!(!b.record_connect_failure(&s));
    }
    assert_eq!(states(&b), [ServerState::Preferred]);
    assert!(b.record_connect_failure(&s));
    assert_eq!(states(&b), [ServerState::Failed]);
}

#[test]
fn round_robin_spreads_over_usable() {
    let b = balancer(
        &["198.18.0.2:1", "198.18.0.3:1", "198.18.0.4:1"],
        None,
        Policy::RoundRobin,
    );
    for s in b.server_specs() {
        b.record_check(&s, Ok(()));
        b.record_check(&s, Ok(()));
    }
    let firsts: std::collections::HashSet<ServerAddr> =
        (0..6).map(|_| b.dial_order()[0].clone()).collect();
    assert_eq!(firsts.len(), 3);
}

#[test]
fn state_file_round_trip_and_corrupt() {
    let dir = std::env::temp_dir().join(format!("lb-state-{}", std::process::id()));
    let path = dir.join("b.json");
    let st = StateFile {
        servers: vec![a("198.18.0.2:1")],
        default: None,
        configured: None,
    };
    state_file::write(&path, &st).unwrap();
    assert_eq!(state_file::read(&path).unwrap(), Some(st));
    std::fs::write(&path, b"{not json").unwrap();
    assert!(state_file::read(&path).unwrap_err().contains("corrupt"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Defect: readiness counted a STANDBY default and RECOVERING servers as usable whatever
/// their checks said, so `/readyz` and `/check` were healthy with every server down.
#[test]
fn a_failed_set_with_a_failing_default_is_not_usable() {
    let b = balancer(&["198.18.0.2:1"], Some("198.18.0.9:1"), Policy::Failover);
    b.record_check(&a("198.18.0.2:1"), Err("refused".into()));
    b.record_check(&a("198.18.0.9:1"), Err("refused".into()));
    assert_eq!(states(&b), [ServerState::Failed, ServerState::Standby]);
    assert!(!b.has_usable_server(), "{:?}", b.status());
    // The default answering again makes it usable as the server of last resort.
    b.record_check(&a("198.18.0.9:1"), Ok(()));
    assert!(b.has_usable_server());
    // RECOVERING whose last check failed (fall = 2 keeps it out of FAILED) is not usable.
    let mut cfg = b.config().as_ref().clone();
    cfg.health.fall = 2;
    cfg.health.rise = 3;
    cfg.default_server = None;
    let b = Balancer::new(0, cfg);
    let s = a("198.18.0.2:1");
    b.record_check(&s, Ok(()));
    assert_eq!(states(&b), [ServerState::Recovering]);
    assert!(b.has_usable_server());
    b.record_check(&s, Err("refused".into()));
    assert_eq!(states(&b), [ServerState::Recovering]);
    assert!(!b.has_usable_server());
}

/// Records what the balancer reports.
#[derive(Default)]
struct Recorder(Mutex<Vec<(String, KillReason, usize)>>);

impl Observer for Recorder {
    fn killed(&self, _: &str, server: &ServerAddr, reason: KillReason, n: usize) {
        self.0.lock().unwrap().push((server.to_string(), reason, n));
    }
    fn node_kill(&self, _: &ServerAddr) {}
}

/// Defect: kills by an operator were labelled with the address as the caller spelled it, so
/// one server could have two `lb_connections_killed_total` series.
#[test]
fn kills_are_reported_under_the_normalised_address() {
    let o = Overrides {
        listen: vec!["127.0.0.1:6444".parse().unwrap()],
        servers: vec![a("[::1]:7"), a("198.18.0.2:1")],
        ..Overrides::default()
    };
    let cfg = Config::load(None, &o).unwrap().balancers.remove(0);
    let rec = Arc::new(Recorder::default());
    let b = Balancer::build(
        0,
        cfg,
        Options {
            observer: rec.clone(),
            seed: Some(1),
        },
    );
    let _g1 = b.register(&a("[::1]:7"), None);
    let _g2 = b.register(&a("[::1]:7"), None);
    assert_eq!(b.kill_server("[0:0::1]:7", KillReason::Admin), Ok(2));
    let _g3 = b.register(&a("[::1]:7"), None);
    assert_eq!(b.set_hold("[0::1]:7", Hold::Disabled), Ok(1));
    assert_eq!(
        *rec.0.lock().unwrap(),
        [
            ("[::1]:7".to_string(), KillReason::Admin, 2),
            ("[::1]:7".to_string(), KillReason::Admin, 1)
        ]
    );
    assert!(matches!(
        b.kill_server("198.18.0.3:1", KillReason::Admin),
        Err(SetError::UnknownServer(_))
    ));
}

/// Defect: `random` and `least-connections` drew from the thread RNG, so a seed could not
/// reproduce a run. Two balancers with one seed choose alike.
#[test]
fn a_seed_reproduces_the_choices() {
    let specs = [
        "198.18.0.2:1",
        "198.18.0.3:1",
        "198.18.0.4:1",
        "198.18.0.5:1",
    ];
    let run = |policy: Policy, seed: u64| -> Vec<ServerAddr> {
        let o = Overrides {
            listen: vec!["127.0.0.1:6444".parse().unwrap()],
            servers: specs.iter().map(|s| a(s)).collect(),
            ..Overrides::default()
        };
        let mut cfg = Config::load(None, &o).unwrap().balancers.remove(0);
        cfg.policy = policy;
        let b = Balancer::build(
            0,
            cfg,
            Options {
                seed: Some(seed),
                ..Options::default()
            },
        );
        for s in specs {
            b.record_check(&a(s), Ok(()));
            b.record_check(&a(s), Ok(()));
        }
        (0..64).map(|_| b.dial_order()[0].clone()).collect()
    };
    for policy in [Policy::Random, Policy::LeastConnections] {
        let first = run(policy, 42);
        assert_eq!(first, run(policy, 42), "{policy}: same seed, same picks");
        assert_ne!(
            first,
            run(policy, 43),
            "{policy}: another seed, other picks"
        );
        let spread: std::collections::HashSet<&ServerAddr> = first.iter().collect();
        assert_eq!(spread.len(), 4, "{policy} spreads over every usable server");
    }
}

fn with_state_file(servers: &[&str], path: &std::path::Path) -> BalancerConfig {
    let o = Overrides {
        listen: vec!["127.0.0.1:6444".parse().unwrap()],
        servers: servers.iter().map(|s| a(s)).collect(),
        ..Overrides::default()
    };
    let mut cfg = Config::load(None, &o).unwrap().balancers.remove(0);
    cfg.state_file = Some(path.to_path_buf());
    cfg
}

/// Defect: a state file whose default matched replaced the configured servers even when the
/// operator had just edited them. The rule now: the config's list wins when it changed since
/// the file was written; otherwise the running set (API changes) stands.
#[test]
fn state_file_rule_at_start_and_on_reload() {
    let dir = std::env::temp_dir().join(format!("lb-state-rule-{}", std::process::id()));
    let path = dir.join("b.json");
    let _ = std::fs::remove_dir_all(&dir);
    // Start, then change the set through the API: the file records it.
    let b = Balancer::new(0, with_state_file(&["198.18.0.2:1"], &path));
    assert!(b.set_servers(&[a("198.18.0.3:1")], None).unwrap());
    drop(b);
    // Restart with the same config: the API's set stands.
    let b = Balancer::new(0, with_state_file(&["198.18.0.2:1"], &path));
    assert_eq!(b.server_specs(), ["198.18.0.3:1"]);
    // A reload that changes another key keeps it too.
    let mut cfg = with_state_file(&["198.18.0.2:1"], &path);
    cfg.health.interval = crate::config::Dur(std::time::Duration::from_secs(3));
    assert!(!b.replace_config(cfg).unwrap());
    assert_eq!(b.server_specs(), ["198.18.0.3:1"]);
    // A reload whose server list changed applies it.
    assert!(
        b.replace_config(with_state_file(&["198.18.0.4:1"], &path))
            .unwrap()
    );
    assert_eq!(b.server_specs(), ["198.18.0.4:1"]);
    drop(b);
    // The operator edits the file's list while lb is down: the edit wins at start.
    let b = Balancer::new(0, with_state_file(&["198.18.0.5:1"], &path));
    assert_eq!(b.server_specs(), ["198.18.0.5:1"]);
    // A file of an older version (no record of the config) loses to the config.
    drop(b);
    std::fs::write(&path, br#"{"servers": ["198.18.0.6:1"], "default": null}"#).unwrap();
    let b = Balancer::new(0, with_state_file(&["198.18.0.5:1"], &path));
    assert_eq!(b.server_specs(), ["198.18.0.5:1"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A list edited to what the API had already set still counts as applied: editing it back
/// later must win at the next start (review finding).
#[test]
fn a_list_edited_to_the_running_set_counts_as_applied() {
    let dir = std::env::temp_dir().join(format!("lb-state-applied-{}", std::process::id()));
    let path = dir.join("b.json");
    let _ = std::fs::remove_dir_all(&dir);
    let b = Balancer::new(0, with_state_file(&["198.18.0.2:1", "198.18.0.3:1"], &path));
    assert!(
        b.set_servers(&[a("198.18.0.2:1"), a("198.18.0.4:1")], None)
            .unwrap()
    );
    // The operator writes the API's list into the file and reloads: nothing moves.
    assert!(
        !b.replace_config(with_state_file(&["198.18.0.2:1", "198.18.0.4:1"], &path))
            .unwrap()
    );
    drop(b);
    // Then edits it back and restarts: the edit wins.
    let b = Balancer::new(0, with_state_file(&["198.18.0.2:1", "198.18.0.3:1"], &path));
    assert_eq!(b.server_specs(), ["198.18.0.2:1", "198.18.0.3:1"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A name is one server per address it resolves to, and a set change keeps a name's servers
/// (and their states) without resolving it again; another entry resolving to one of its
/// addresses is a duplicate, and a pinned name is not accepted as input.
#[test]
fn a_name_is_one_server_per_address_and_keeps_them_across_set_changes() {
    let name = a("localhost:7");
    let pinned = name.expand();
    assert!(pinned.iter().all(|p| p.pin().is_some()), "{pinned:?}");
    let o = Overrides {
        listen: vec!["127.0.0.1:6444".parse().unwrap()],
        servers: vec![name.clone()],
        default_server: Some(name.clone()),
        ..Overrides::default()
    };
    let cfg = Config::load(None, &o).unwrap().balancers.remove(0);
    let b = Balancer::new(0, cfg);
    let st = b.status();
    let addrs: std::collections::HashSet<&ServerAddr> = st.iter().map(|s| &s.address).collect();
    assert_eq!(addrs.len(), st.len(), "no address twice: {st:?}");
    assert_eq!(st.len(), pinned.len(), "{st:?}");
    assert!(st.iter().all(|s| s.default), "{st:?}");
    b.record_check(&pinned[0], Ok(()));
    b.record_check(&pinned[0], Ok(()));
    assert_eq!(states(&b)[0], ServerState::Preferred);
    assert!(
        b.set_servers(&[name.clone(), a("198.18.0.2:1")], Some(&name))
            .unwrap()
    );
    assert_eq!(states(&b)[0], ServerState::Preferred, "kept, not re-added");
    assert_eq!(b.default_server(), Some(name.clone()));
    assert_eq!(
        b.set_servers(&[name.clone(), a("127.0.0.1:7")], None),
        Err(SetError::Duplicate(a("127.0.0.1:7")))
    );
    assert_eq!(
        b.set_servers(&[pinned[0].clone()], None),
        Err(SetError::Pinned(pinned[0].clone()))
    );
    assert_eq!(
        states(&b)[0],
        ServerState::Preferred,
        "a refused set changes nothing"
    );
}

#[test]
fn connect_table_follows_the_states() {
    use ServerState::*;
    let (s0, s1, d) = ("198.18.0.2:1", "198.18.0.3:1", "198.18.0.4:1");
    let b = balancer(&[s0, s1], Some(d), Policy::Failover);
    // Nothing checked yet: failover order by set, default last, nobody marked ACTIVE.
    assert_eq!(b.connect_table(), [a(s0), a(s1), a(d)]);
    assert_eq!(states(&b)[..2], [Unchecked, Unchecked]);
    for s in [s0, s1, s0, s1] {
        b.record_check(&a(s), Ok(()));
    }
    // Settled: the head becomes ACTIVE, as a dialed server would.
    assert_eq!(b.connect_table()[0], a(s0));
    assert_eq!(states(&b)[..2], [Active, Preferred]);
    // A FAILED server leaves the table while anything else is left.
    b.record_check(&a(s0), Err("refused".into()));
    assert_eq!(b.connect_table(), [a(s1), a(d)]);
    b.record_check(&a(s1), Err("refused".into()));
    // Both FAILED: the default of last resort (STANDBY, never FAILED) is what is left.
    assert_eq!(b.connect_table(), [a(d)]);
    let b = balancer(&[s0, s1], None, Policy::Failover);
    b.record_check(&a(s0), Err("refused".into()));
    b.record_check(&a(s1), Err("refused".into()));
    assert_eq!(states(&b), [Failed, Failed]);
    assert_eq!(
        b.connect_table(),
        [a(s0), a(s1)],
        "all FAILED: all are left"
    );

    // round-robin spreads over the usable servers only (never the STANDBY default).
    let b = balancer(&[s0, s1], Some(d), Policy::RoundRobin);
    for s in [s0, s1, s0, s1] {
        b.record_check(&a(s), Ok(()));
    }
    assert_eq!(b.connect_table(), [a(s0), a(s1)]);
    b.record_check(&a(s1), Err("refused".into()));
    assert_eq!(b.connect_table()[0], a(s0), "one usable: failover order");
}

/// A followed name's new answer: addresses that stay keep their places and states, new ones
/// join UNCHECKED after them, those that left are removed with their connections; the set
/// (names, what the state file holds) does not move, and an address another entry stands for
/// stays that entry's.
#[test]
fn a_names_new_addresses_replace_its_servers_alone() {
    use ServerState::*;
    let name = a("localhost:7");
    let first = name.expand();
    assert!(first[0].pin().is_some(), "{first:?}");
    let b = balancer(&["localhost:7", "198.18.0.2:7"], None, Policy::Failover);
    let set_before = b.server_set();
    b.record_check(&first[0], Ok(()));
    b.record_check(&first[0], Ok(()));
    let kept = b.register(&first[0], None);
    let pin = |ip: &str| name.pinned_to(ip.parse().unwrap());
    let found = [
        a("127.0.0.9:7"),
        first[0].socket_addr().map(|s| a(&s.to_string())).unwrap(),
    ];
    assert!(b.set_addresses(&name, &found));
    let st = b.status();
    assert_eq!(st[0].address, first[0], "stays first: {st:?}");
    assert_eq!(st[0].state, Preferred, "kept its state");
    assert!(!kept.cancel.is_cancelled());
    assert!(
        st.iter()
            .any(|s| s.address == pin("127.0.0.9") && s.state == Unchecked),
        "{st:?}"
    );
    assert!(
        !b.set_addresses(&name, &found),
        "the same answer changes nothing"
    );
    // The name moves away: its old address is removed and its connection closed.
    assert!(b.set_addresses(&name, &[a("127.0.0.9:7"), a("198.18.0.2:7")]));
    assert!(kept.cancel.is_cancelled());
    assert_eq!(kept.reason(), Some(KillReason::Removed));
    assert_eq!(
        b.server_specs(),
        [pin("127.0.0.9"), a("198.18.0.2:7")],
        "198.18.0.2 stays the literal's"
    );
    assert_eq!(
        b.server_set(),
        set_before,
        "the set is names, not addresses"
    );
    let names = b.names_status();
    assert_eq!(names.len(), 1);
    assert_eq!(names[0].name, "localhost:7");
    assert_eq!(names[0].addresses, [pin("127.0.0.9")]);
    // An empty answer and a name that left the set change nothing.
    assert!(!b.set_addresses(&name, &[]));
    assert!(!b.set_addresses(&a("other:7"), &[a("127.0.0.3:7")]));
}
