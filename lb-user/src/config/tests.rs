//! Unit tests of config parsing and validation.

use super::*;

const FULL: &str = r#"
[admin]
listen = "127.0.0.1:9901"

[datapath]
mode = "auto"

[[balancer]]
name = "apiserver"
listen = ["127.0.0.1:6443", "[::1]:6443"]
servers = ["198.18.0.2:6443", "198.18.0.3:6443"]
default_server = "198.18.0.2:6443"
policy = "failover"
dial_timeout = "10s"
state_file = "/var/lib/lb/apiserver.json"

[balancer.health]
kind = "http"
url = "https://{server}/ping"
expect_status = [200, "300-399"]
interval = "1s"
timeout = "1s"
rise = 2
fall = 1
on_unhealthy = "kill"
"#;

#[test]
fn design_example_parses() {
    let cfg = Config::from_toml(FULL, "test").unwrap();
    let b = &cfg.balancers[0];
    assert_eq!(b.listen.len(), 2);
    assert_eq!(b.health.kind, CheckKind::Http);
    assert_eq!(
        b.health.expect_status,
        vec![StatusMatch::Code(200), StatusMatch::Range(300, 399)]
    );
    assert_eq!(b.dial_timeout.0, Duration::from_secs(10));
}

#[test]
fn unknown_key_is_named() {
    let err = Config::from_toml(&FULL.replace("policy =", "polcy ="), "f.toml").unwrap_err();
    assert!(err.to_string().contains("polcy"), "{err}");
}

#[test]
fn bad_values_name_their_key() {
    let cases = [
        (FULL.replace("rise = 2", "rise = 0"), "health.rise"),
        (
            FULL.replace("interval = \"1s\"", "interval = \"1x\""),
            "interval",
        ),
        (
            FULL.replace("\"198.18.0.3:6443\"]", "\"198.18.0.2:6443\"]"),
            "servers",
        ),
        (
            FULL.replace("https://{server}", "ftp://{server}"),
            "health.url",
        ),
        (
            FULL.replace("name = \"apiserver\"", "name = \"a b\""),
            "name",
        ),
        (
            FULL.replace(
                "mode = \"auto\"",
                "mode = \"auto\"\norphan_timeout = \"1s\"",
            ),
            "datapath.orphan_timeout",
        ),
        (
            FULL.replace("mode = \"auto\"", "mode = \"auto\"\npin_dir = \"lb/pins\""),
            "datapath.pin_dir",
        ),
    ];
    for (text, key) in cases {
        let err = Config::from_toml(&text, "f.toml").unwrap_err().to_string();
        assert!(err.contains(key), "expected {key} in: {err}");
    }
}

#[test]
fn refuses_what_could_never_run() {
    let two = r#"
[[balancer]]
name = "a"
listen = ["127.0.0.1:7001"]
servers = ["127.0.0.1:7002"]

[[balancer]]
name = "b"
listen = ["127.0.0.1:7002"]
servers = ["198.18.0.2:1"]
"#;
    let err = Config::from_toml(two, "f").unwrap_err().to_string();
    assert!(
        err.contains("own listen address"),
        "a server equal to another balancer's listener: {err}"
    );
    let cases = [
        (
            FULL.replace(
                "servers = [\"198.18.0.2:6443\", \"198.18.0.3:6443\"]",
                "servers = []",
            ),
            "at least one server",
        ),
        (
            FULL.replace("https://{server}/ping", "http://{server/x y"),
            "health.url",
        ),
        (
            FULL.replace(
                "expect_status = [200, \"300-399\"]",
                "expect_status = [999]",
            ),
            "expect_status",
        ),
        (
            FULL.replace(
                "kind = \"http\"",
                "kind = \"http\"\nca_file = \"/nonexistent/ca.pem\"",
            ),
            "ca_file",
        ),
        (
            FULL.replace("[admin]", "[admin]\ntoken_file = \"/nonexistent/token\""),
            "admin.token_file",
        ),
        (
            FULL.replace("\"[::1]:6443\"", "\"0.0.0.0:6443\""),
            "wildcard",
        ),
    ];
    for (text, want) in cases {
        let err = Config::from_toml(&text, "f.toml").unwrap_err().to_string();
        assert!(err.contains(want), "expected {want:?} in: {err}");
    }
}

#[test]
fn flags_define_a_balancer_and_win() {
    let o = Overrides {
        listen: vec!["127.0.0.1:7000".parse().unwrap()],
        servers: vec!["198.18.0.2:80".parse().unwrap()],
        datapath: Some(DatapathMode::Userspace),
        health_loop: Some(false),
        ..Overrides::default()
    };
    let cfg = Config::load(None, &o).unwrap();
    assert_eq!(cfg.balancers[0].name, "default");
    assert_eq!(cfg.datapath.mode, DatapathMode::Userspace);
    assert!(!cfg.balancers[0].health.loop_enabled);
}

#[test]
fn durations() {
    assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
    assert!(parse_duration("ten").unwrap_err().contains("ten"));
}

#[test]
fn a_check_url_without_server_needs_shared_target_with_several_servers() {
    let one_url = FULL.replace("https://{server}/ping", "https://198.18.0.9/ping");
    let err = Config::from_toml(&one_url, "f.toml")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("health.url") && err.contains("shared_target"),
        "{err}"
    );
    let intended = one_url.replace("kind = \"http\"", "kind = \"http\"\nshared_target = true");
    Config::from_toml(&intended, "f.toml").unwrap();
    // One server: nothing to mix up.
    let single = one_url.replace(
        "servers = [\"198.18.0.2:6443\", \"198.18.0.3:6443\"]",
        "servers = [\"198.18.0.2:6443\"]",
    );
    Config::from_toml(&single, "f.toml").unwrap();
    // all_failed takes try or refuse only.
    let bad = FULL.replace(
        "policy = \"failover\"",
        "policy = \"failover\"\nall_failed = \"wait\"",
    );
    let err = Config::from_toml(&bad, "f.toml").unwrap_err().to_string();
    assert!(err.contains("all_failed") || err.contains("wait"), "{err}");
}

#[test]
fn check_placeholders_and_targets() {
    // K3s's supervisor on 9345 beside the apiserver: {host} without the port.
    let k3s = FULL.replace("https://{server}/ping", "https://{host}:9345/ping");
    Config::from_toml(&k3s, "f.toml").unwrap();
    // {server} already carries a port: a second one is no URL.
    let twice = FULL.replace("https://{server}/ping", "http://{server}:9345/ping");
    let err = Config::from_toml(&twice, "f.toml").unwrap_err().to_string();
    assert!(
        err.contains("health.url") && err.contains("{host}"),
        "{err}"
    );
    // tcp/tls take port and address; http does not.
    let tcp = FULL
        .replace("kind = \"http\"", "kind = \"tcp\"\nport = 9345")
        .replace("url = \"https://{server}/ping\"\n", "");
    Config::from_toml(&tcp, "f.toml").unwrap();
    let http_port = FULL.replace("kind = \"http\"", "kind = \"http\"\nport = 9345");
    let err = Config::from_toml(&http_port, "f.toml")
        .unwrap_err()
        .to_string();
    assert!(err.contains("health.port"), "{err}");
    let shared = tcp.replace("port = 9345", "address = \"198.18.0.9\"");
    let err = Config::from_toml(&shared, "f.toml")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("health.address") && err.contains("shared_target"),
        "{err}"
    );
    let intended = shared.replace("address =", "shared_target = true\naddress =");
    Config::from_toml(&intended, "f.toml").unwrap();
    let bad = tcp.replace("port = 9345", "address = \"a b\"");
    let err = Config::from_toml(&bad, "f.toml").unwrap_err().to_string();
    assert!(err.contains("health.address"), "{err}");
}

/// A shipped layout: its file, its balancers (name, listener) and its checks' URL.
type Layout = (
    &'static str,
    &'static [(&'static str, &'static str)],
    &'static str,
);

/// The K3s and RKE2 layouts shipped in `deploy/` pass `lb config check`, with the listeners
/// and checks each one's docs promise.
#[test]
fn the_k3s_and_rke2_deploy_configs_are_valid() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let layouts: [Layout; 4] = [
        (
            "k3s/agent.toml",
            &[("supervisor", "127.0.0.1:6444")],
            "https://{server}/ping",
        ),
        (
            "k3s/server.toml",
            &[("etcd", "127.0.0.1:12379")],
            "https://{host}:6443/ping",
        ),
        (
            "rke2/agent.toml",
            &[
                ("supervisor", "127.0.0.1:9345"),
                ("apiserver", "127.0.0.1:6443"),
            ],
            "https://{host}:9345/ping",
        ),
        (
            "rke2/server.toml",
            &[("etcd", "127.0.0.1:12379")],
            "https://{host}:9345/ping",
        ),
    ];
    for (file, balancers, url) in layouts {
        let cfg = Config::from_file(&root.join(file)).unwrap();
        let got: Vec<(String, String)> = cfg
            .balancers
            .iter()
            .map(|b| (b.name.clone(), b.listen[0].to_string()))
            .collect();
        let want: Vec<(String, String)> = balancers
            .iter()
            .map(|(n, l)| ((*n).into(), (*l).into()))
            .collect();
        assert_eq!(got, want, "{file}");
        assert!(
            cfg.balancers
                .iter()
                .all(|b| b.health.url.as_deref() == Some(url)),
            "{file}: every balancer is judged by the supervisor's /ping"
        );
    }
}

#[test]
fn a_tcp_check_takes_no_url_and_url_errors_name_a_real_server() {
    let tcp_url = FULL.replace("kind = \"http\"", "kind = \"tcp\"");
    let err = Config::from_toml(&tcp_url, "f.toml")
        .unwrap_err()
        .to_string();
    assert!(err.contains("health.url") && err.contains("tcp"), "{err}");
    let twice = FULL.replace("https://{server}/ping", "http://{server}:9345/ping");
    let err = Config::from_toml(&twice, "f.toml").unwrap_err().to_string();
    assert!(
        err.contains("198.18.0.2:6443"),
        "names a configured server: {err}"
    );
    let pinned = FULL.replace("\"198.18.0.3:6443\"]", "\"api.test:6443 (198.18.0.9)\"]");
    let err = Config::from_toml(&pinned, "f.toml")
        .unwrap_err()
        .to_string();
    assert!(err.contains("host name alone"), "{err}");
}

fn with_discovery(discovery: &str) -> String {
    format!(
        r#"
[[balancer]]
name = "etcd"
listen = ["127.0.0.1:2379"]
discovery = {discovery}

[balancer.health]
kind = "http"
url = "http://{{host}}:9345/ping"
"#
    )
}

#[test]
fn discovery_sources_parse_and_servers_may_be_empty() {
    let cfg = Config::from_toml(
        &with_discovery(
            r#"{ kind = "dns", name = "etcd.k3s.test", port = 2379, interval = "10s", nameservers = ["198.18.0.53", "[fd00::53]:5353"] }"#,
        ),
        "t",
    )
    .unwrap();
    let d = cfg.balancers[0].discovery.as_ref().unwrap();
    assert_eq!(d.kind(), "dns");
    assert_eq!(d.source(), "etcd.k3s.test:2379");
    assert_eq!(d.interval(), Duration::from_secs(10));
    assert!(cfg.balancers[0].servers.is_empty());
    let cfg = Config::from_toml(
        &with_discovery(r#"{ kind = "etcd", endpoints = ["http://198.18.0.2:2379"] }"#),
        "t",
    )
    .unwrap();
    let d = cfg.balancers[0].discovery.as_ref().unwrap();
    assert_eq!(
        (d.kind(), d.interval()),
        ("etcd", DEFAULT_DISCOVERY_INTERVAL)
    );
    let cfg = Config::from_toml(
        &with_discovery(r#"{ kind = "file", path = "/etc/lb/etcd.json" }"#),
        "t",
    )
    .unwrap();
    let d = cfg.balancers[0].discovery.as_ref().unwrap();
    assert_eq!((d.kind(), d.interval()), ("file", DEFAULT_FILE_INTERVAL));
}

#[test]
fn bad_discovery_names_its_key() {
    let cases = [
        (r#"{ kind = "consul", name = "x" }"#, "consul"),
        (
            r#"{ kind = "dns", name = "x.test", port = 1, bogus = 1 }"#,
            "bogus",
        ),
        (r#"{ kind = "dns", name = "x.test" }"#, "port"),
        (
            r#"{ kind = "dns", name = "10.0.0.1", port = 1 }"#,
            "discovery.name",
        ),
        (
            r#"{ kind = "dns", name = "x.test", port = 0 }"#,
            "discovery.port",
        ),
        (
            r#"{ kind = "dns", name = "x.test", port = 1, nameservers = ["ns.example"] }"#,
            "discovery.nameservers",
        ),
        (
            r#"{ kind = "dns", name = "x.test", port = 1, interval = "10ms" }"#,
            "discovery.interval",
        ),
        (
            r#"{ kind = "etcd", endpoints = [] }"#,
            "discovery.endpoints",
        ),
        (
            r#"{ kind = "etcd", endpoints = ["10.0.0.1:2379"] }"#,
            "discovery.endpoints",
        ),
        (
            r#"{ kind = "etcd", endpoints = ["https://e:2379"], ca_file = "/nonexistent/ca.pem" }"#,
            "discovery.ca_file",
        ),
        (
            r#"{ kind = "etcd", endpoints = ["https://e:2379"], cert_file = "/etc/hostname" }"#,
            "discovery.cert_file",
        ),
        (
            r#"{ kind = "file", path = "servers.json" }"#,
            "discovery.path",
        ),
        (
            r#"{ kind = "etcd", endpoints = ["https://e:2379"], key_file = "/etc/hostname" }"#,
            "discovery.key_file",
        ),
        // Asked through lb's own listener with nothing to start from: it could never answer.
        (
            r#"{ kind = "etcd", endpoints = ["http://127.0.0.1:2379"] }"#,
            "discovery.endpoints",
        ),
    ];
    for (discovery, key) in cases {
        let err = Config::from_toml(&with_discovery(discovery), "t").unwrap_err();
        assert!(err.to_string().contains(key), "{discovery}: {err}");
    }
    // Without discovery an empty list is still refused, naming the way out.
    let err = Config::from_toml(
        "[[balancer]]\nname = \"a\"\nlisten = [\"127.0.0.1:1\"]\n",
        "t",
    )
    .unwrap_err();
    assert!(err.to_string().contains("discovery source"), "{err}");
    // With discovery a check URL must work for any address it may bring.
    let err = Config::from_toml(
        &with_discovery(r#"{ kind = "file", path = "/x.json" }"#)
            .replace("http://{host}:9345/ping", "http://{server}:9345/ping"),
        "t",
    )
    .unwrap_err();
    assert!(err.to_string().contains("health.url"), "{err}");
}

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
fn skipping_credential_files_leaves_them_unread_and_checks_the_rest() {
    let health = FULL.replace(
        "kind = \"http\"",
        "kind = \"http\"\nca_file = \"/nonexistent/ca.pem\"\ncert_file = \"/nonexistent/c.pem\"\n\
         key_file = \"/nonexistent/k.pem\"",
    );
    let token = FULL.replace("[admin]", "[admin]\ntoken_file = \"/nonexistent/token\"");
    let etcd = with_discovery(
        r#"{ kind = "etcd", endpoints = ["https://e:2379"], ca_file = "/nonexistent/ca.pem" }"#,
    );
    for text in [&health, &token, &etcd] {
        assert!(Config::from_toml(text, "f.toml").is_err(), "{text}");
        Config::from_toml_with(text, "f.toml", CredentialFiles::Skip)
            .unwrap_or_else(|e| panic!("{e} in {text}"));
    }
    let unpaired = FULL.replace(
        "kind = \"http\"",
        "kind = \"http\"\ncert_file = \"/nonexistent/c.pem\"",
    );
    let err = Config::from_toml_with(&unpaired, "f.toml", CredentialFiles::Skip)
        .unwrap_err()
        .to_string();
    assert!(err.contains("needs key_file beside it"), "{err}");
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

/// A credential file named by the layouts' advice is missing whenever the unit is not running:
/// the error says so and names the check that skips it, which then passes.
#[test]
fn a_missing_systemd_credential_points_at_skip_files() {
    let text = FULL.replace(
        "kind = \"http\"",
        "kind = \"http\"\nca_file = \"/run/credentials/lb-test-absent.service/server-ca.crt\"",
    );
    let err = Config::from_toml(&text, "f.toml").unwrap_err().to_string();
    assert!(
        err.contains("ca_file")
            && err.contains("--skip-files")
            && err.contains("while its unit runs"),
        "{err}"
    );
    Config::from_toml_with(&text, "f.toml", CredentialFiles::Skip).unwrap();
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

#[test]
fn limits_parse_and_out_of_range_ones_are_named() {
    let with = |keys: &str| {
        FULL.replace(
            "policy = \"failover\"",
            &format!("policy = \"failover\"\n{keys}"),
        )
    };
    let cfg =
        Config::from_toml(&with("max_connections = 10\nidle_timeout = \"90s\""), "t").unwrap();
    assert_eq!(cfg.balancers[0].max_connections, Some(10));
    assert_eq!(
        cfg.balancers[0].idle_timeout.map(|d| d.0),
        Some(std::time::Duration::from_secs(90))
    );
    let cfg = Config::from_toml(FULL, "t").unwrap();
    assert_eq!(
        (
            cfg.balancers[0].max_connections,
            cfg.balancers[0].idle_timeout
        ),
        (None, None)
    );
    for (keys, named) in [
        ("max_connections = 0", "balancer[0].max_connections"),
        ("idle_timeout = \"10ms\"", "balancer[0].idle_timeout"),
    ] {
        let e = Config::from_toml(&with(keys), "t").unwrap_err().to_string();
        assert!(e.contains(named) && e.contains("at least"), "{keys}: {e}");
    }
}
