//! The JSON Schema the real `lb config schema` prints (checked to be this build's) accepts every
//! whole TOML example that [`config_examples`](super::config_examples) finds (the docs'
//! ```` ```toml ```` blocks, `deploy/`'s files and ConfigMap entries, with commented-out keys
//! uncommented), refuses known-bad configs at the key that is wrong, and its patterns agree with
//! lb's own parsers on sample values.

use std::{process::Command, sync::OnceLock, time::Duration};

use jsonschema::Validator;
use lb::config::{Config, CredentialFiles};
use lb_tests::{lb_bin, output_within};
use serde_json::{Value, json};

use super::{Marker, config_examples::all_examples};

/// The schema `lb config schema` prints, once per run.
fn printed_schema() -> &'static Value {
    static SCHEMA: OnceLock<Value> = OnceLock::new();
    SCHEMA.get_or_init(|| {
        let mut cmd = Command::new(lb_bin());
        cmd.args(["config", "schema"]);
        let out = output_within(cmd, Duration::from_secs(60)).expect("lb config schema runs");
        assert!(
            out.status.success(),
            "lb config schema: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let printed: Value =
            serde_json::from_slice(&out.stdout).expect("lb config schema prints JSON");
        assert!(
            printed == lb::config::schema::schema(),
            "{} prints another schema than this build's: run `cargo build -p lb-user` first",
            lb_bin().display()
        );
        printed
    })
}

/// A draft-07 validator of the printed schema (building it checks the schema itself).
fn validator() -> Validator {
    jsonschema::draft7::new(printed_schema()).expect("lb config schema prints a draft-07 schema")
}

/// `text` as the JSON value an editor validates.
fn json_of(text: &str) -> Value {
    let table: toml::Table = toml::from_str(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    serde_json::to_value(table).expect("TOML is JSON")
}

/// The schema's complaints about `instance`: `path: message` each.
fn complaints(v: &Validator, instance: &Value) -> Vec<String> {
    v.iter_errors(instance)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}

#[test]
fn toml_examples_pass_the_printed_schema() {
    let v = validator();
    let examples: Vec<_> = all_examples()
        .into_iter()
        .filter(|e| e.marker == Marker::None)
        .collect();
    assert!(
        examples.iter().any(|e| e.origin.starts_with("deploy/k3s/"))
            && examples.iter().any(|e| e.origin.starts_with("docs/"))
            && examples.iter().any(|e| e.origin.contains("uncommented")),
        "no whole TOML example under deploy/k3s/ or docs/, or none uncommented: {examples:#?}"
    );
    let wrong: Vec<String> = examples
        .iter()
        .filter_map(|e| {
            let found = complaints(&v, &json_of(&e.text));
            (!found.is_empty()).then(|| format!("{}:\n  {}", e.origin, found.join("\n  ")))
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of {} whole TOML example(s) do not pass `lb config schema`'s schema:\n{}",
        wrong.len(),
        examples.len(),
        wrong.join("\n")
    );
}

/// A valid config the known-bad ones are made from.
const BASE: &str = r#"
[admin]
listen = "127.0.0.1:9901"

[datapath]
mode = "auto"

[[balancer]]
name = "api"
listen = ["127.0.0.1:6443"]
servers = ["198.18.0.2:6443"]
policy = "failover"
dial_timeout = "10s"

[balancer.health]
interval = "1s"
"#;

/// Configs the schema must refuse: what is changed in [`BASE`], and the JSON pointer of the
/// value (or table) the complaint must name.
const BAD: &[(&str, &str, &str)] = &[
    (
        "listen = \"127.0.0.1:9901\"",
        "listen = \"127.0.0.1:9901\"\nlisten2 = \"x\"",
        "/admin",
    ),
    ("[datapath]", "[datapath]\nsplice = true", "/datapath"),
    (
        "[[balancer]]",
        "[[balancers]]\nname = \"x\"\n[[balancer]]",
        "",
    ),
    (
        "interval = \"1s\"",
        "interval = \"1s\"\nloop_enabled = false",
        "/balancer/0/health",
    ),
    (
        "policy = \"failover\"",
        "policy = \"round_robin\"",
        "/balancer/0/policy",
    ),
    ("mode = \"auto\"", "mode = \"ebpf\"", "/datapath/mode"),
    (
        "dial_timeout = \"10s\"",
        "dial_timeout = 10",
        "/balancer/0/dial_timeout",
    ),
    (
        "interval = \"1s\"",
        "interval = \"soon\"",
        "/balancer/0/health/interval",
    ),
    (
        "interval = \"1s\"",
        "interval = \"10\"",
        "/balancer/0/health/interval",
    ),
    (
        "\"198.18.0.2:6443\"",
        "\"198.18.0.2\"",
        "/balancer/0/servers/0",
    ),
    (
        "listen = [\"127.0.0.1:6443\"]",
        "listen = \"127.0.0.1:6443\"",
        "/balancer/0/listen",
    ),
    ("listen = [\"127.0.0.1:6443\"]\n", "", "/balancer/0"),
    (
        "policy = \"failover\"",
        "discovery = { kind = \"consul\", name = \"api.example\" }",
        "/balancer/0/discovery",
    ),
    (
        "policy = \"failover\"",
        "discovery = { kind = \"dns\", name = \"api.example\", port = 6443, ttl = \"5s\" }",
        "/balancer/0/discovery",
    ),
];

#[test]
fn known_bad_configs_are_refused_at_their_key() {
    let v = validator();
    assert_eq!(complaints(&v, &json_of(BASE)), Vec::<String>::new());
    Config::from_toml_with(BASE, "base", CredentialFiles::Skip).expect("BASE is valid");
    for (from, to, pointer) in BAD {
        assert!(BASE.contains(from), "{from:?} is not in BASE");
        let text = BASE.replacen(from, to, 1);
        assert!(
            Config::from_toml_with(&text, "bad", CredentialFiles::Skip).is_err(),
            "lb config check accepts {to:?}, so it is no known-bad config"
        );
        let found = complaints(&v, &json_of(&text));
        assert!(
            found.iter().any(|c| c.starts_with(&format!("{pointer}: "))),
            "{to:?}: the schema names no problem at {pointer:?}: {found:?}"
        );
    }
}

/// What the schema and the parser make of one sample value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    /// Both accept it.
    Both,
    /// Both refuse it.
    Neither,
    /// The parser refuses it and the schema lets it through (a bound a pattern does not
    /// carry, such as the port range): `lb config check` names it.
    CheckOnly,
}

use Fate::{Both, CheckOnly, Neither};

/// Whether serde, as `lb config check` parses, takes `instance` (written as TOML); the checks
/// after parsing are not asked.
fn parser_takes(instance: &Value) -> bool {
    let text = toml::to_string(instance).expect("a TOML table");
    toml::from_str::<Config>(&text).is_ok()
}

/// Each sample put in place by `place`, its fate asserted.
fn agree(what: &str, place: impl Fn(Value) -> Value, samples: &[(Value, Fate)]) {
    let v = validator();
    let mut wrong = Vec::new();
    for (sample, want) in samples {
        let instance = place(sample.clone());
        let fate = match (parser_takes(&instance), v.is_valid(&instance)) {
            (true, true) => Both,
            (false, false) => Neither,
            (false, true) => CheckOnly,
            (true, false) => {
                wrong.push(format!(
                    "{sample}: the parser takes it, the schema refuses it"
                ));
                continue;
            }
        };
        if fate != *want {
            wrong.push(format!("{sample}: {fate:?}, expected {want:?}"));
        }
    }
    assert!(wrong.is_empty(), "{what}:\n{}", wrong.join("\n"));
}

/// One balancer with `key` = `value`.
fn balancer_with(key: &str, value: Value) -> Value {
    let mut b = json!({"name": "a", "listen": ["127.0.0.1:1"], "servers": ["198.18.0.2:1"]});
    b[key] = value;
    json!({ "balancer": [b] })
}

/// `(text, fate)` pairs as JSON strings.
fn strings(samples: &[(&str, Fate)]) -> Vec<(Value, Fate)> {
    samples.iter().map(|(s, f)| (json!(s), *f)).collect()
}

#[test]
fn durations_agree_with_the_parser() {
    let samples = strings(&[
        ("250ms", Both),
        ("10s", Both),
        ("1m30s", Both),
        ("1h 30m", Both),
        (" 5s ", Both),
        ("10 s", Both),
        ("1.5s", Both),
        ("2 days", Both),
        ("1\u{b5}s", Both),
        ("3weeks", Both),
        ("1M", Both),
        ("0", Both),
        ("0s", Both),
        ("", Neither),
        ("soon", Neither),
        ("10", Neither),
        ("00", Neither),
        ("1m30", Neither),
        ("1.s", Neither),
        (".5s", Neither),
        ("-1s", Neither),
        ("10 parsecs", Neither),
        ("5s x", Neither),
        ("1.5ns", CheckOnly),
        ("99999999999999999999s", CheckOnly),
    ]);
    agree(
        "shutdown_grace",
        |d| json!({ "shutdown_grace": d }),
        &samples,
    );
    let mut syn = strings(&[("auto", Both), (" auto ", Both), ("Auto", Neither)]);
    syn.extend(samples.iter().cloned());
    syn.push((json!(300), Neither));
    let place = |d| json!({"datapath": {"fail_fast": {"syn_timeout": d}}});
    agree("datapath.fail_fast.syn_timeout", place, &syn);
}

#[test]
fn server_and_proxy_addresses_agree_with_the_parser() {
    let servers = strings(&[
        ("198.18.0.2:6443", Both),
        ("api.example:6443", Both),
        ("API.Example:6443", Both),
        ("etcd-1:2379", Both),
        ("[2001:db8::1]:6443", Both),
        ("[fe80::1%2]:6443", Both),
        ("api.example:6443 (198.18.0.2)", Both),
        ("api.example:6443 (2001:db8::1)", Both),
        ("api.example:+6443", Neither),
        ("1.2.3.999:6443", CheckOnly),
        ("api.6443:6443", CheckOnly),
        ("198.18.0.2", Neither),
        ("api.example", Neither),
        (":6443", Neither),
        ("a_b:6443", Neither),
        ("host.:6443", Neither),
        ("[::1]:6443 (::1)", Neither),
        ("http://api.example:6443", Neither),
        ("api.example:0", CheckOnly),
        ("api.example:65536", CheckOnly),
        ("198.18.0.2:6443 (198.18.0.3)", CheckOnly),
    ]);
    agree(
        "servers",
        |s| balancer_with("servers", json!([s])),
        &servers,
    );
    agree(
        "default_server",
        |s| balancer_with("default_server", s),
        &servers,
    );
    let proxies = strings(&[
        ("http://198.18.0.9:3128", Both),
        ("http://proxy.example:3128/", Both),
        ("http://[2001:db8::9]:3128", Both),
        ("https://proxy.example:3128", Neither),
        ("http://proxy.example", Neither),
        ("proxy.example:3128", Neither),
        ("http://proxy.example:3128/path", Neither),
        ("http://proxy.example:0", CheckOnly),
    ]);
    agree("proxy", |p| balancer_with("proxy", p), &proxies);
}

#[test]
fn listen_addresses_and_statuses_agree_with_the_parser() {
    let listens = strings(&[
        ("127.0.0.1:6444", Both),
        ("0.0.0.0:9902", Both),
        ("[::1]:6444", Both),
        ("[::]:9902", Both),
        ("[fe80::1%2]:80", Both),
        ("localhost:6444", Neither),
        ("6444", Neither),
        ("127.0.0.1", Neither),
        ("::1:6444", Neither),
        ("1.2.3:80", Neither),
        ("127.0.0.1:70000", CheckOnly),
        ("999.0.0.1:80", CheckOnly),
    ]);
    agree(
        "admin.listen",
        |l| json!({"admin": {"listen": l}}),
        &listens,
    );
    agree(
        "metrics.listen",
        |l| json!({"metrics": {"listen": l}}),
        &listens,
    );
    agree(
        "balancer.listen",
        |l| balancer_with("listen", json!([l])),
        &listens,
    );
    let statuses = [
        (json!(200), Both),
        (json!(700), Both),
        (json!("200-299"), Both),
        (json!(" 200 - 299 "), Both),
        (json!("200"), Neither),
        (json!("2xx"), Neither),
        (json!("200-"), Neither),
        (json!(-1), Neither),
        (json!(70000), Neither),
        (json!("299-200"), CheckOnly),
        (json!("200-70000"), CheckOnly),
    ];
    let place = |s| balancer_with("health", json!({ "expect_status": [s] }));
    agree("health.expect_status", place, &statuses);
}
