//! Unit tests of the data path keys balancers inherit: `forwarding`, `namespaces` and
//! `fail_fast`, their defaults, overrides and bounds.

use super::*;

#[test]
fn forwarding_defaults_inherits_and_is_overridden() {
    let cfg = Config::from_toml(FULL, "test").unwrap();
    assert_eq!(cfg.datapath.forwarding, Forwarding::Auto);
    assert_eq!(cfg.forwarding_of(&cfg.balancers[0]), Forwarding::Auto);
    assert_eq!(
        cfg.wants_connect(&cfg.balancers[0]),
        cfg.balancers[0].proxy.is_none(),
        "auto asks for connect-time unless the balancer dials through a proxy"
    );

    let global = FULL.replace(
        "mode = \"auto\"",
        "mode = \"auto\"\nforwarding = \"connect\"",
    );
    let cfg = Config::from_toml(&global, "test").unwrap();
    assert_eq!(cfg.forwarding_of(&cfg.balancers[0]), Forwarding::Connect);

    let own = global.replace(
        "policy = \"failover\"",
        "policy = \"failover\"\nforwarding = \"splice\"",
    );
    let cfg = Config::from_toml(&own, "test").unwrap();
    assert_eq!(cfg.forwarding_of(&cfg.balancers[0]), Forwarding::Splice);

    // The flag (or LB_FORWARDING) sets every balancer's.
    let path = std::env::temp_dir().join(format!("lb-fwd-{}.toml", std::process::id()));
    std::fs::write(&path, &own).unwrap();
    let o = Overrides {
        forwarding: Some(Forwarding::Connect),
        ..Overrides::default()
    };
    let cfg = Config::load(Some(&path), &o).unwrap();
    let _ = std::fs::remove_file(&path);
    assert_eq!(cfg.forwarding_of(&cfg.balancers[0]), Forwarding::Connect);

    let bad = FULL.replace(
        "mode = \"auto\"",
        "mode = \"auto\"\nforwarding = \"direct\"",
    );
    let e = Config::from_toml(&bad, "test").unwrap_err().to_string();
    assert!(e.contains("forwarding"), "{e}");
}

#[test]
fn connect_forwarding_refuses_a_proxy() {
    let text = FULL.replace(
        "policy = \"failover\"",
        "policy = \"failover\"\nforwarding = \"connect\"\nproxy = \"http://198.18.0.9:3128\"",
    );
    let e = Config::from_toml(&text, "test").unwrap_err().to_string();
    assert!(e.contains("balancer[0].forwarding"), "{e}");
    assert!(e.contains("proxy"), "{e}");
    // The same proxy with splice is fine.
    let ok = text.replace("forwarding = \"connect\"", "forwarding = \"splice\"");
    Config::from_toml(&ok, "test").unwrap();
    // With auto (the default) it is accepted too, and that balancer keeps to splice.
    let auto = text.replace("forwarding = \"connect\"\n", "");
    let cfg = Config::from_toml(&auto, "test").unwrap();
    assert_eq!(cfg.forwarding_of(&cfg.balancers[0]), Forwarding::Auto);
    assert!(!cfg.wants_connect(&cfg.balancers[0]));
}

#[test]
fn namespaces_default_to_own_inherit_and_are_overridden() {
    let cfg = Config::from_toml(FULL, "test").unwrap();
    assert_eq!(cfg.datapath.namespaces, Namespaces::Own);
    assert_eq!(cfg.namespaces_of(&cfg.balancers[0]), Namespaces::Own);

    let global = FULL.replace("mode = \"auto\"", "mode = \"auto\"\nnamespaces = \"all\"");
    let cfg = Config::from_toml(&global, "test").unwrap();
    assert_eq!(cfg.namespaces_of(&cfg.balancers[0]), Namespaces::All);

    let own = global.replace(
        "policy = \"failover\"",
        "policy = \"failover\"\nnamespaces = \"own\"",
    );
    let cfg = Config::from_toml(&own, "test").unwrap();
    assert_eq!(cfg.namespaces_of(&cfg.balancers[0]), Namespaces::Own);

    // The flag (or LB_NAMESPACES) sets every balancer's.
    let path = std::env::temp_dir().join(format!("lb-netns-{}.toml", std::process::id()));
    std::fs::write(&path, &own).unwrap();
    let o = Overrides {
        namespaces: Some(Namespaces::All),
        ..Overrides::default()
    };
    let cfg = Config::load(Some(&path), &o).unwrap();
    let _ = std::fs::remove_file(&path);
    assert_eq!(cfg.namespaces_of(&cfg.balancers[0]), Namespaces::All);

    let e = Config::from_toml(
        &FULL.replace("mode = \"auto\"", "mode = \"auto\"\nnamespaces = \"pods\""),
        "test",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("namespaces"), "{e}");
}

#[test]
fn fail_fast_defaults_inherit_and_bounds_name_their_key() {
    use std::time::Duration;
    let cfg = Config::from_toml(FULL, "test").unwrap();
    let ff = cfg.fail_fast_of(&cfg.balancers[0]);
    assert_eq!(ff, FailFastConfig::default());
    assert_eq!(ff.suspect_after, 1);
    assert_eq!(ff.syn_retries, 3);
    // auto: 3 × the round trip, at least the floor, at most 1 s, 1 s before a measurement.
    assert_eq!(ff.timeout_for(None), Duration::from_secs(1));
    assert_eq!(
        ff.timeout_for(Some(Duration::from_millis(1))),
        Duration::from_millis(200)
    );
    assert_eq!(
        ff.timeout_for(Some(Duration::from_millis(100))),
        Duration::from_millis(300)
    );
    assert_eq!(
        ff.timeout_for(Some(Duration::from_secs(2))),
        Duration::from_secs(1)
    );

    let global = FULL.replace(
        "mode = \"auto\"",
        "mode = \"auto\"\n\n[datapath.fail_fast]\nsyn_timeout = \"300ms\"\nsuspect_after = 3",
    );
    let cfg = Config::from_toml(&global, "test").unwrap();
    let ff = cfg.fail_fast_of(&cfg.balancers[0]);
    assert_eq!(
        ff.syn_timeout,
        SynTimeout::Fixed(Dur(Duration::from_millis(300)))
    );
    assert_eq!(ff.suspect_after, 3);
    assert_eq!(
        ff.timeout_for(Some(Duration::from_millis(1))),
        Duration::from_millis(300)
    );

    // A balancer's own table replaces the default whole.
    let own = format!("{global}\n[balancer.fail_fast]\nsyn_retries = 5\n");
    let cfg = Config::from_toml(&own, "test").unwrap();
    let ff = cfg.fail_fast_of(&cfg.balancers[0]);
    assert_eq!(
        (ff.syn_timeout, ff.suspect_after, ff.syn_retries),
        (SynTimeout::Auto, 1, 5)
    );

    for (bad, key) in [
        (
            "syn_timeout = \"10ms\"",
            "balancer[0].fail_fast.syn_timeout",
        ),
        ("syn_timeout = \"2s\"", "balancer[0].fail_fast.syn_timeout"),
        ("syn_timeout = \"soon\"", "syn_timeout"),
        (
            "syn_timeout_min = \"20ms\"",
            "balancer[0].fail_fast.syn_timeout_min",
        ),
        ("syn_retries = 128", "balancer[0].fail_fast.syn_retries"),
    ] {
        let e = Config::from_toml(&format!("{FULL}\n[balancer.fail_fast]\n{bad}\n"), "test")
            .unwrap_err()
            .to_string();
        assert!(e.contains(key), "{bad}: {e}");
    }
    let e = Config::from_toml(
        &FULL.replace(
            "mode = \"auto\"",
            "mode = \"auto\"\n\n[datapath.fail_fast]\nsyn_timeout = \"5s\"",
        ),
        "test",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("datapath.fail_fast.syn_timeout"), "{e}");
}
