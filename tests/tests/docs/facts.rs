//! Prose tied to code: every `| key | default | meaning |` row of `docs/configuration.md`'s
//! reference names a key of the config schema (`lb config schema`, generated from the types that
//! parse the file) with the default the schema gives, every key of a documented table has its
//! row, and a short list of facts the docs state in words (the systemd unit's user and `Type=`,
//! `suspect_after`'s default, the default forwarding) agree with their sources.

use std::fs;

use serde_json::Value;

use super::root;

/// The schema definition each reference heading of `docs/configuration.md` documents (its
/// `###` headings under `## Reference`), by heading text.
const SECTIONS: &[(&str, &str)] = &[
    ("Top level", ""),
    ("`[admin]`", "AdminConfig"),
    ("`[metrics]`", "MetricsConfig"),
    ("`[datapath]`", "DatapathConfig"),
    ("`[dns]`", "DnsConfig"),
    (
        "`[datapath.fail_fast]` and `[balancer.fail_fast]`",
        "FailFastConfig",
    ),
    ("`[[balancer]]`", "BalancerConfig"),
    ("`[balancer.health]`", "HealthConfig"),
    ("Discovery keys", "DiscoveryConfig"),
];

/// Keys of a documented table that are tables of their own, documented under their own heading.
const SUBTABLES: &[&str] = &[
    "admin",
    "metrics",
    "datapath",
    "dns",
    "balancer",
    "health",
    "fail_fast",
];

/// The properties object of definition `def` ("" for the top level) in `schema`; for a
/// definition that is one of several kinds (`DiscoveryConfig`), the kinds' properties merged,
/// each named `kind.key`.
fn properties(schema: &Value, def: &str) -> serde_json::Map<String, Value> {
    let node = if def.is_empty() {
        schema
    } else {
        &schema["definitions"][def]
    };
    if let Some(props) = node["properties"].as_object() {
        return props.clone();
    }
    let kinds = node["oneOf"]
        .as_array()
        .unwrap_or_else(|| panic!("the schema has no properties for {def:?}"));
    let mut merged = serde_json::Map::new();
    for variant in kinds {
        let kind = variant["properties"]["kind"]["const"]
            .as_str()
            .unwrap_or_else(|| panic!("a kind of {def:?} without a const `kind`"));
        for (key, prop) in variant["properties"].as_object().into_iter().flatten() {
            if key != "kind" {
                merged.insert(format!("{kind}.{key}"), prop.clone());
            }
        }
    }
    merged
}

/// A default cell as the value it states: a backquoted TOML literal (`"30s"`, `true`, `[]`),
/// or `None` for words (`none`, `required`, `detected`, another key's name).
fn literal(cell: &str) -> Option<Value> {
    let inner = cell.trim().strip_prefix('`')?.strip_suffix('`')?;
    let table: toml::Table = toml::from_str(&format!("v = {inner}")).ok()?;
    serde_json::to_value(&table["v"]).ok()
}

/// (heading, key, default cell, line number) of every reference row; a row of a table with a
/// `kind` column first (`| kind | key | default | meaning |`) names its key `kind.key`.
fn reference_rows(text: &str) -> Vec<(String, String, String, usize)> {
    let mut rows = Vec::new();
    let mut heading = None;
    let mut in_reference = false;
    for (i, line) in text.lines().enumerate() {
        if let Some(h) = line.strip_prefix("## ") {
            in_reference = h == "Reference";
            heading = None;
        } else if let Some(h) = line.strip_prefix("### ") {
            heading = in_reference.then(|| h.to_string());
        } else if let Some(h) = &heading
            && let Some(rest) = line.strip_prefix("| `")
            && let Some((key, rest)) = rest.split_once("` | ")
            && let Some((default, rest)) = rest.split_once(" | ")
        {
            // `| kind | key | default | meaning |`: the second cell is the key.
            let row = match default.strip_prefix('`').and_then(|d| d.strip_suffix('`')) {
                Some(inner) if h == "Discovery keys" => {
                    let cell = rest.split_once(" | ").map_or(rest, |(c, _)| c);
                    (format!("{key}.{inner}"), cell.to_string())
                }
                _ => (key.to_string(), default.to_string()),
            };
            rows.push((h.clone(), row.0, row.1, i + 1));
        }
    }
    rows
}

#[test]
fn configuration_reference_defaults_are_the_schemas() {
    let schema = lb::config::schema::schema();
    let text = fs::read_to_string(root().join("docs/configuration.md")).expect("configuration.md");
    let rows = reference_rows(&text);
    assert!(rows.len() > 60, "only {} reference rows found", rows.len());
    let mut wrong = Vec::new();
    for (heading, key, cell, line) in &rows {
        let Some((_, def)) = SECTIONS.iter().find(|(h, _)| h == heading) else {
            wrong.push(format!(
                "line {line}: heading {heading:?} maps to no schema definition"
            ));
            continue;
        };
        let props = properties(&schema, def);
        let Some(prop) = props.get(key) else {
            wrong.push(format!(
                "line {line}: `{key}` is no key of {heading} in the schema"
            ));
            continue;
        };
        let schema_default = prop.get("default").filter(|d| !d.is_object());
        match (literal(cell), schema_default) {
            (Some(doc), Some(code)) if &doc != code => wrong.push(format!(
                "line {line}: {heading} `{key}` is documented as {cell}, the schema says {code}"
            )),
            (Some(_), None) => wrong.push(format!(
                "line {line}: {heading} `{key}` is documented as {cell}, the schema has no default"
            )),
            (None, Some(code)) => wrong.push(format!(
                "line {line}: {heading} `{key}` is documented as {cell:?}, the schema says {code}"
            )),
            _ => {}
        }
    }
    for (heading, def) in SECTIONS {
        for key in properties(&schema, def).keys() {
            let documented = rows.iter().any(|(h, k, _, _)| h == heading && k == key);
            if !documented && !SUBTABLES.contains(&key.as_str()) {
                wrong.push(format!(
                    "{heading} `{key}` has no row in docs/configuration.md"
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "docs/configuration.md:\n{}",
        wrong.join("\n")
    );
}

/// `text` with every run of whitespace one space, so a fact may wrap in the Markdown.
fn flat(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[test]
fn stated_facts_agree_with_their_sources() {
    let read = |p: &str| flat(&fs::read_to_string(root().join(p)).unwrap_or_default());
    let unit = fs::read_to_string(root().join("deploy/systemd/lb.service")).expect("the unit");
    let setting = |name: &str| {
        unit.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}=")))
            .map(str::to_string)
    };
    let schema = lb::config::schema::schema();
    let default = |def: &str, key: &str| properties(&schema, def)[key]["default"].clone();
    let user = match (setting("User"), setting("DynamicUser")) {
        (None, None) => "root (uid 0)".to_string(),
        (u, d) => panic!("the unit sets User={u:?} DynamicUser={d:?}: update this test's facts"),
    };
    let unit_type = setting("Type").expect("the unit sets Type=");
    let suspect_after = default("FailFastConfig", "suspect_after");
    let forwarding = default("DatapathConfig", "forwarding");
    let forwarding = forwarding
        .as_str()
        .expect("forwarding's default is a string");
    // (what, file, the sentence that must be in it, built from the source).
    let facts = [
        (
            "the unit's user",
            "docs/install.md",
            format!("The unit runs lb as {user}"),
        ),
        (
            "the unit's user",
            "docs/upgrade.md",
            "The unit's identity (uid 0, root without a `User=`".to_string(),
        ),
        (
            "the unit's Type=",
            "docs/install.md",
            format!("The unit is `Type={unit_type}`"),
        ),
        (
            "suspect_after's default",
            "docs/forwarding.md",
            format!("After `suspect_after` ({suspect_after} by default) SYN timeouts"),
        ),
        (
            "suspect_after's default",
            "docs/configuration.md",
            format!("| `suspect_after` | `{suspect_after}` |"),
        ),
        (
            "the default forwarding",
            "docs/forwarding.md",
            format!("The default, `{forwarding}`, is `connect` where the running kernel"),
        ),
    ];
    let mut wrong = Vec::new();
    for (what, file, sentence) in &facts {
        if !read(file).contains(&flat(sentence)) {
            wrong.push(format!("{file} should say {what}: {sentence:?}"));
        }
    }
    // Statements a change of those sources once left behind.
    for (file, stale) in [
        ("docs/upgrade.md", "uid 65534 with exactly its capabilities"),
        ("docs/forwarding.md", "two SYN timeouts"),
        ("docs/health-checks.md", "two SYN timeouts"),
        ("docs/forwarding.md", "stays the default"),
    ] {
        if read(file).contains(stale) {
            wrong.push(format!("{file} still says {stale:?}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
