//! The metrics reference of `docs/admin-api.md` (the table under `## Metrics`) lists exactly
//! the families lb registers, each with its type: the registry is built as the daemon builds it
//! ([`Metrics::new`]) and its families listed ([`Metrics::families`]: a rendering leaves out the
//! families without a series yet). A counter is documented by its sample name
//! (`lb_connections_total` for the family `lb_connections`).

use std::{collections::BTreeMap, fs};

use lb::metrics::Metrics;

use super::{first_table, root};

/// The registered families by their documented name, with their type.
fn registered<'a>(families: impl Iterator<Item = (&'a str, &'a str)>) -> BTreeMap<String, String> {
    families
        .map(|(name, kind)| {
            let name = if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_string()
            };
            (name, kind.to_string())
        })
        .collect()
}

/// The families of the reference table, with their type.
fn documented(admin_api: &str) -> BTreeMap<String, String> {
    let (header, rows) = first_table(admin_api, Some("## Metrics"));
    let column = |name: &str| {
        header
            .iter()
            .position(|h| h == name)
            .unwrap_or_else(|| panic!("the metrics table has no column {name:?}"))
    };
    let (family, kind) = (column("family"), column("type"));
    rows.iter()
        .map(|r| (r[family].trim_matches('`').to_string(), r[kind].clone()))
        .collect()
}

#[test]
fn metrics_reference_lists_every_registered_family() {
    let text = fs::read_to_string(root().join("docs/admin-api.md")).expect("docs/admin-api.md");
    let documented = documented(&text);
    let metrics = Metrics::new();
    let registered = registered(metrics.families());
    assert!(
        registered.len() > 10,
        "only {} families read from the registry: is the parser broken?",
        registered.len()
    );
    let mut wrong = Vec::new();
    for (name, kind) in &registered {
        match documented.get(name) {
            None => wrong.push(format!("{name} ({kind}): registered, not in the table")),
            Some(k) if k != kind => {
                wrong.push(format!("{name}: the table says {k}, the registry {kind}"));
            }
            Some(_) => {}
        }
    }
    for name in documented.keys().filter(|n| !registered.contains_key(*n)) {
        wrong.push(format!("{name}: in the table, not registered"));
    }
    assert!(
        wrong.is_empty(),
        "docs/admin-api.md's metrics reference differs from the registry:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn counters_are_documented_by_their_sample_name() {
    let families = registered([("lb_x", "counter"), ("lb_y", "gauge")].into_iter());
    assert_eq!(
        families.get("lb_x_total").map(String::as_str),
        Some("counter")
    );
    assert_eq!(families.get("lb_y").map(String::as_str), Some("gauge"));
}
