//! Unit tests of config parsing and validation.

use super::*;

mod datapath;
mod discovery;

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
    assert!(
        parse_duration("ten")
            .unwrap_err()
            .to_string()
            .contains("`ten`")
    );
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
