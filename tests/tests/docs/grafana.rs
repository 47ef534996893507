//! The Grafana dashboard `deploy/grafana/lb.json` queries only series lb exports: every metric
//! name in a panel's `expr` or a template variable's `query` is a sample of a registered `lb_*`
//! family ([`Metrics::families`]) or of a `[metrics] compat` family
//! ([`Metrics::compat_families`]).

use std::{collections::BTreeSet, fs};

use lb::metrics::Metrics;
use serde_json::Value;

use super::root;

/// PromQL words that are neither metrics nor functions.
const KEYWORDS: [&str; 6] = ["and", "or", "unless", "bool", "offset", "inf"];
/// Clauses whose parenthesised list holds label names.
const LABEL_CLAUSES: [&str; 6] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// The index just past the `close` that matches the `open` at `i`.
fn skip_group(chars: &[char], mut i: usize, open: char, close: char) -> usize {
    let mut depth = 0;
    while i < chars.len() {
        if chars[i] == open {
            depth += 1;
        } else if chars[i] == close {
            depth -= 1;
            if depth == 0 {
                return i + 1;
            }
        }
        i += 1;
    }
    i
}

/// The metric names a PromQL expression (or a `label_values(metric, label)` query) reads.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => {
                i += 1;
                while i < chars.len() && chars[i] != c {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
            }
            '{' => i = skip_group(&chars, i, '{', '}'),
            '[' => i = skip_group(&chars, i, '[', ']'),
            c if c.is_ascii_digit() || c == '.' => {
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                    i += 1;
                }
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || "_:".contains(chars[i]))
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let mut next = i;
                while next < chars.len() && chars[next].is_whitespace() {
                    next += 1;
                }
                let rest: String = chars[next..].iter().take(8).collect();
                // `sum by (...) (...)`: an aggregation with its clause first.
                let aggregation = ["by", "without"].iter().any(|c| {
                    rest.strip_prefix(c)
                        .is_some_and(|r| r.starts_with(|ch: char| ch == '(' || ch.is_whitespace()))
                });
                let call = chars.get(next) == Some(&'(') || aggregation;
                if call && LABEL_CLAUSES.contains(&word.as_str()) {
                    i = skip_group(&chars, next, '(', ')');
                } else if call && word == "label_values" {
                    // Its first argument is the metric, the second a label name.
                    let end = skip_group(&chars, next, '(', ')');
                    let inner: String = chars[next + 1..end - 1].iter().collect();
                    let first = inner.split(',').next().unwrap_or_default();
                    names.extend(metric_names(first));
                    i = end;
                } else if !call && !KEYWORDS.contains(&word.to_ascii_lowercase().as_str()) {
                    names.insert(word);
                }
            }
            _ => i += 1,
        }
    }
    names
}

/// Every sample name lb may expose: each family's, with `_total` for a counter and `_bucket`,
/// `_count`, `_sum` for a histogram.
fn exported() -> BTreeSet<String> {
    let metrics = Metrics::new();
    let mut out = BTreeSet::new();
    let mut add = |name: &str, kind: &str| match kind {
        "counter" => {
            out.insert(format!("{name}_total"));
        }
        "histogram" => {
            for suffix in ["_bucket", "_count", "_sum"] {
                out.insert(format!("{name}{suffix}"));
            }
        }
        _ => {
            out.insert(name.to_string());
        }
    };
    for (name, kind) in metrics.families() {
        add(name, kind);
    }
    for name in Metrics::compat_families() {
        let kind = if name.ends_with("_seconds") {
            "histogram"
        } else {
            "gauge"
        };
        add(&name, kind);
    }
    out
}

/// Every `expr` of the dashboard's panels and every `query` of its template variables.
fn queries(dashboard: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let panels = dashboard["panels"]
        .as_array()
        .expect("the dashboard has panels");
    for p in panels {
        for t in p["targets"].as_array().into_iter().flatten() {
            out.extend(t["expr"].as_str().map(str::to_string));
        }
    }
    for v in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if v["type"] == "query" {
            out.extend(v["query"].as_str().map(str::to_string));
        }
    }
    out
}

#[test]
fn dashboard_queries_only_exported_series() {
    let path = root().join("deploy/grafana/lb.json");
    let text = fs::read_to_string(&path).expect("deploy/grafana/lb.json");
    let dashboard: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let exported = exported();
    let queries = queries(&dashboard);
    assert!(
        queries.len() >= 15,
        "only {} queries found: is the reader broken?",
        queries.len()
    );
    let mut used = BTreeSet::new();
    for q in &queries {
        let names = metric_names(q);
        assert!(!names.is_empty(), "no metric name found in {q:?}");
        for n in names {
            assert!(
                exported.contains(&n),
                "{q:?} queries {n}, which lb does not export"
            );
            used.insert(n);
        }
    }
    for compat in [
        "k3s_loadbalancer_server_health",
        "rke2_loadbalancer_dial_duration_seconds_bucket",
    ] {
        assert!(used.contains(compat), "the dashboard has no {compat} panel");
    }
}

#[test]
fn metric_names_read_promql() {
    let names = metric_names(
        "histogram_quantile(0.99, sum by (balancer, le) (rate(lb_dial_duration_seconds_bucket{balancer=~\"a|b\"}[5m]))) or on (x) k3s_x offset 5m",
    );
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        ["k3s_x", "lb_dial_duration_seconds_bucket"]
    );
    assert_eq!(
        metric_names("label_values(lb_server_state, balancer)")
            .into_iter()
            .collect::<Vec<_>>(),
        ["lb_server_state"]
    );
    assert!(
        !exported().contains("lb_server_health"),
        "a made-up name counts as exported"
    );
}
