//! Unit tests of the `discovery` key: each source parses, and a bad one names its key.

use super::*;

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
