//! The schema says what the parser does: its keys, required keys, defaults, enum spellings and
//! descriptions are checked against the parser itself (the patterns are checked with a JSON
//! Schema validator in `tests/tests/docs/schema.rs`).

use serde_json::{Map, Value, json};

use super::schema;
use crate::config::{Config, CredentialFiles};

/// The definition `name` of the schema.
fn def(schema: &Value, name: &str) -> Value {
    schema["definitions"][name].clone()
}

/// The property names of an object schema, sorted.
fn keys(object: &Value) -> Vec<String> {
    let mut out: Vec<String> = object["properties"]
        .as_object()
        .expect("an object schema")
        .keys()
        .cloned()
        .collect();
    out.sort();
    out
}

/// Every object schema (one with `properties`) in `value`, with its path.
fn objects<'a>(value: &'a Value, path: &str, out: &mut Vec<(String, &'a Value)>) {
    match value {
        Value::Object(map) => {
            if map.contains_key("properties") {
                out.push((path.to_string(), value));
            }
            for (k, v) in map {
                objects(v, &format!("{path}/{k}"), out);
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                objects(v, &format!("{path}/{i}"), out);
            }
        }
        _ => {}
    }
}

fn parse(text: &str) -> Config {
    Config::from_toml_with(text, "schema-test.toml", CredentialFiles::Skip)
        .unwrap_or_else(|e| panic!("{e}\n{text}"))
}

/// The `default` of each property of an object schema that has one.
fn defaults(object: &Value) -> Map<String, Value> {
    object["properties"]
        .as_object()
        .expect("an object schema")
        .iter()
        .filter_map(|(k, p)| p.get("default").map(|d| (k.clone(), d.clone())))
        .collect()
}

const MINIMAL: &str = "[[balancer]]\nname = \"api\"\nlisten = [\"127.0.0.1:6443\"]\n\
                       servers = [\"198.18.0.2:6443\"]\n";

#[test]
fn keys_are_the_toml_keys_and_unknown_ones_are_refused() {
    let s = schema();
    assert_eq!(s["$schema"], "http://json-schema.org/draft-07/schema#");
    assert_eq!(
        keys(&s),
        [
            "admin",
            "balancer",
            "datapath",
            "dns",
            "metrics",
            "shutdown_grace"
        ]
    );
    let health = keys(&def(&s, "HealthConfig"));
    assert!(health.contains(&"loop".to_string()), "{health:?}");
    assert!(!health.contains(&"loop_enabled".to_string()), "{health:?}");
    let mut all = Vec::new();
    objects(&s, "", &mut all);
    // The root, its 7 tables and the 3 discovery kinds.
    assert_eq!(
        all.len(),
        11,
        "{:?}",
        all.iter().map(|o| &o.0).collect::<Vec<_>>()
    );
    for (path, object) in all {
        assert_eq!(object["additionalProperties"], false, "{path}");
    }
}

#[test]
fn required_keys_are_those_without_a_default() {
    let s = schema();
    assert_eq!(s.get("required"), None);
    assert_eq!(
        def(&s, "BalancerConfig")["required"],
        json!(["name", "listen"])
    );
    let kinds = def(&s, "DiscoveryConfig")["oneOf"].clone();
    let required: Vec<&Value> = kinds
        .as_array()
        .unwrap()
        .iter()
        .map(|k| &k["required"])
        .collect();
    assert_eq!(
        required,
        [
            &json!(["kind", "name", "port"]),
            &json!(["kind", "endpoints"]),
            &json!(["kind", "path"])
        ]
    );
    // Without a required key the parser refuses too.
    let e = Config::from_toml("[[balancer]]\nname = \"api\"\n", "t").unwrap_err();
    assert!(e.to_string().contains("missing field `listen`"), "{e}");
}

#[test]
fn every_default_shown_is_what_the_parser_takes_for_an_absent_key() {
    let s = schema();
    let mut root = defaults(&s);
    let mut balancer = defaults(&def(&s, "BalancerConfig"));
    balancer.insert(
        "health".into(),
        Value::Object(defaults(&def(&s, "HealthConfig"))),
    );
    for (k, v) in [
        ("name", json!("api")),
        ("listen", json!(["127.0.0.1:6443"])),
        ("servers", json!(["198.18.0.2:6443"])),
    ] {
        balancer.insert(k.into(), v);
    }
    root.insert("balancer".into(), json!([balancer]));
    let mut datapath = defaults(&def(&s, "DatapathConfig"));
    datapath.insert(
        "fail_fast".into(),
        defaults(&def(&s, "FailFastConfig")).into(),
    );
    root.insert("datapath".into(), datapath.into());
    root.insert("dns".into(), defaults(&def(&s, "DnsConfig")).into());
    root.insert("admin".into(), defaults(&def(&s, "AdminConfig")).into());
    let text = toml::to_string(&root).expect("the defaults are TOML");
    assert!(text.contains("expect_status = [\"200-299\"]"), "{text}");
    assert!(text.contains("orphan_timeout = \"10m\""), "{text}");
    assert_eq!(parse(&text), parse(MINIMAL), "{text}");
    // A table's own default is its keys' defaults.
    let admin: Map<String, Value> = defaults(&def(&s, "AdminConfig"));
    assert_eq!(s["properties"]["admin"]["default"], Value::Object(admin));
}

/// The `const` values of an enum definition.
fn spellings(schema: &Value, name: &str) -> Vec<String> {
    def(schema, name)["oneOf"]
        .as_array()
        .unwrap_or_else(|| panic!("{name} is no enum"))
        .iter()
        .map(|v| v["const"].as_str().expect("a const").to_string())
        .collect()
}

#[test]
fn enums_are_spelled_as_the_parser_spells_them() {
    let s = schema();
    let policies = spellings(&s, "Policy");
    assert_eq!(
        policies,
        ["failover", "round-robin", "least-connections", "random"]
    );
    for p in &policies {
        let cfg = parse(&format!("{MINIMAL}policy = \"{p}\"\n"));
        assert_eq!(cfg.balancers[0].policy.to_string(), *p);
    }
    for (name, key, table) in [
        ("Forwarding", "forwarding", "[datapath]"),
        ("Namespaces", "namespaces", "[datapath]"),
        ("DatapathMode", "mode", "[datapath]"),
        ("Resolve", "resolve", "[dns]"),
        ("Compat", "compat", "[metrics]"),
        ("CheckKind", "kind", "[balancer.health]"),
        ("OnUnhealthy", "on_unhealthy", "[balancer.health]"),
        ("KillScope", "kill_scope", "[balancer.health]"),
        ("AllFailed", "all_failed", ""),
    ] {
        let values = spellings(&s, name);
        assert!(values.len() >= 2, "{name}: {values:?}");
        for v in values {
            // http and tunnel checks need a url.
            let url = if matches!(v.as_str(), "http" | "tunnel") {
                format!(
                    "url = \"{}://{{server}}/\"\n",
                    if v == "http" { "http" } else { "ws" }
                )
            } else {
                String::new()
            };
            let text = format!("{MINIMAL}{table}\n{key} = \"{v}\"\n{url}");
            parse(&text);
            let wrong = text.replace(&format!("= \"{v}\""), &format!("= \"{v}x\""));
            assert!(Config::from_toml(&wrong, "t").is_err(), "{wrong}");
        }
    }
}

#[test]
fn descriptions_are_the_doc_comments_without_null() {
    let s = schema();
    let health = def(&s, "HealthConfig");
    assert_eq!(
        health["properties"]["interval"]["description"],
        "Time between checks; default 1 s (K3s checks every second)."
    );
    let blocking = &def(&s, "DatapathConfig")["properties"]["blocking_splice"]["description"];
    let blocking = blocking.as_str().unwrap();
    assert!(
        blocking.starts_with("Let blocking clients keep splicing when the server socket is full (the kernel makes them wait"),
        "{blocking}"
    );
    assert_eq!(spellings(&s, "OnUnhealthy"), ["kill", "drain", "keep"]);
    assert_eq!(
        def(&s, "OnUnhealthy")["oneOf"][2]["description"],
        "No new connections; existing ones stay."
    );
    let text = s.to_string();
    assert!(!text.contains("null"), "TOML has no null: {text}");
    assert!(!text.contains("\"format\""), "{text}");
    assert!(!text.contains("loop_enabled"), "{text}");
}
