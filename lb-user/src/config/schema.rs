//! `lb config schema`: a JSON Schema (draft 07) of the config file, generated from the types that
//! parse it, so editors (taplo, VS Code's Even Better TOML) check `lb.toml` as it is typed.
//!
//! The derived parts follow the serde attributes: key names, `deny_unknown_fields` as
//! `additionalProperties: false`, defaults, required keys, enum spellings, and the fields' doc
//! comments as descriptions. The types that parse text themselves (durations, server, listen
//! and proxy addresses, status ranges, `syn_timeout`) have their schemas written here, as
//! patterns of what their parsers accept. What needs more than one value (a server equal to a
//! listener, a timeout past its interval, port 0) is left to `lb config check`.

use std::borrow::Cow;

use schemars::{JsonSchema, Schema, SchemaGenerator, generate::SchemaSettings, json_schema};
use serde_json::Value;

use super::{Config, Dur, StatusMatch, SynTimeout};
use crate::addr::{ProxyUrl, ServerAddr};

/// One humantime unit, as `humantime::parse_duration` spells them (longest first, so the
/// alternation reads well; the anchors make the order irrelevant to what matches).
const UNIT: &str = "(nanos|nsec|ns|usec|us|\u{b5}s|millis|msec|ms|seconds|second|secs|sec|s|\
                    minutes|minute|mins|min|m|hours|hour|hrs|hr|h|days|day|d|weeks|week|wks|wk|w|\
                    months|month|M|years|year|yrs|yr|y)";

/// A humantime number: digits (spaces between them are skipped), an optional fraction.
const NUMBER: &str = r"[0-9][0-9\s]*(\.\s*[0-9][0-9\s]*)?";

/// A host name or IPv4 address (labels of letters, digits and `-`) with its port. A name whose
/// last label is all digits but is no IPv4 address (`1.2.3.999`) matches here; only `lb config
/// check` refuses it.
const NAME_PORT: &str = r"[0-9A-Za-z-]{1,63}(\.[0-9A-Za-z-]{1,63})*:[0-9]+";

/// A bracketed IPv6 address (with an optional numeric scope) and its port.
const V6_PORT: &str = r"\[[0-9A-Fa-f:.]+(%[0-9]+)?\]:[0-9]+";

/// The pin of a host name, ` (address)`.
const PIN: &str = r" \([0-9A-Fa-f:.]+\)";

/// The body of a duration pattern: `0`, or numbers each with a unit (`1m30s`, `1h 30m`).
fn duration_body() -> String {
    format!(r"0|{NUMBER}{UNIT}(\s*{NUMBER}{UNIT})*")
}

/// The body of a server address pattern: `host:port`, `[v6]:port` or `name:port (address)`.
fn server_body() -> String {
    format!("{V6_PORT}|{NAME_PORT}({PIN})?")
}

/// The pattern of a duration as [`super::parse_duration`] reads it (leading and trailing
/// space trimmed).
fn duration_pattern() -> String {
    format!(r"^\s*({})\s*$", duration_body())
}

impl JsonSchema for Dur {
    fn schema_name() -> Cow<'static, str> {
        "Duration".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "description": "A duration: numbers with units, e.g. \"250ms\", \"10s\", \"1m30s\", \
                            \"1h\" (ns, us, ms, s, m, h, d, w, M, y and their long spellings).",
            "pattern": duration_pattern(),
        })
    }
}

impl JsonSchema for SynTimeout {
    fn schema_name() -> Cow<'static, str> {
        "SynTimeout".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "description": "\"auto\" (from the server's measured round trip) or a duration \
                            such as \"300ms\".",
            "pattern": format!(r"^\s*(auto|{})\s*$", duration_body()),
            "examples": ["auto", "300ms"],
        })
    }
}

impl JsonSchema for ServerAddr {
    fn schema_name() -> Cow<'static, str> {
        "ServerAddress".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "description": "A server: \"host:port\", \"192.0.2.1:6443\", \"[2001:db8::1]:6443\", \
                            or a host name pinned to one of its addresses, \
                            \"name:port (address)\".",
            "pattern": format!("^({})$", server_body()),
        })
    }
}

impl JsonSchema for ProxyUrl {
    fn schema_name() -> Cow<'static, str> {
        "ProxyUrl".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "description": "An HTTP CONNECT proxy, \"http://host:port\" (a trailing / allowed).",
            "pattern": format!("^http://({})/*$", server_body()),
        })
    }
}

impl JsonSchema for StatusMatch {
    fn schema_name() -> Cow<'static, str> {
        "StatusMatch".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "An HTTP status code (200) or an inclusive range (\"200-299\"); \
                            lb config check takes 100-599.",
            "anyOf": [
                { "type": "integer", "minimum": 0, "maximum": 65535 },
                { "type": "string", "pattern": r"^\s*\+?[0-9]+\s*-\s*\+?[0-9]+\s*$" },
            ],
        })
    }
}

/// The schema of a socket address as lb listens on it (`std::net::SocketAddr`'s syntax):
/// `ADDR:PORT` with an IPv4 address or a bracketed IPv6 one. Used through
/// `#[schemars(with = ...)]` on the fields of that type.
#[derive(Debug)]
pub struct ListenAddr;

impl JsonSchema for ListenAddr {
    fn schema_name() -> Cow<'static, str> {
        "ListenAddress".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "description": "An IP address and port: \"127.0.0.1:6444\", \"0.0.0.0:9902\", \
                            \"[::1]:6444\".",
            "pattern": format!(r"^([0-9]{{1,3}}(\.[0-9]{{1,3}}){{3}}:[0-9]+|{V6_PORT})$"),
        })
    }
}

/// The JSON Schema of the config file, as `lb config schema` prints it.
pub fn schema() -> Value {
    let generator = SchemaSettings::draft07()
        .with_transform(tidy as fn(&mut Schema))
        .into_generator();
    let mut root = generator.into_root_schema_for::<Config>();
    root.insert("title".into(), "lb configuration".into());
    root.insert(
        "description".into(),
        "The TOML file of lb run --config. This schema checks keys, types and the spelling of \
         values; lb config check also checks the rules between keys."
            .into(),
    );
    root.to_value()
}

/// What TOML cannot say or an editor need not show: `null` (TOML has none, so an absent key is
/// the only "none") is taken out of types and defaults, integer formats become bounds, and a
/// doc comment's line breaks within a paragraph become spaces.
fn tidy(schema: &mut Schema) {
    schemars::transform::transform_subschemas(&mut (tidy as fn(&mut Schema)), schema);
    let Some(obj) = schema.as_object_mut() else {
        return;
    };
    match obj.get_mut("default") {
        Some(Value::Null) => drop(obj.remove("default")),
        Some(d) => drop_nulls(d),
        None => {}
    }
    if let Some(Value::Array(types)) = obj.get_mut("type") {
        types.retain(|t| t != "null");
        if let [one] = types.as_slice() {
            let one = one.clone();
            obj.insert("type".into(), one);
        }
    }
    for key in ["anyOf", "oneOf"] {
        let Some(Value::Array(branches)) = obj.get_mut(key) else {
            continue;
        };
        branches.retain(|b| b.get("type").is_none_or(|t| t != "null"));
        if let [one] = branches.as_slice() {
            let one = one.clone();
            obj.remove(key);
            if let Value::Array(all) = obj.entry("allOf").or_insert(Value::Array(Vec::new())) {
                all.push(one);
            }
        }
    }
    // schemars' `uint32`-like formats are no standard format: say their bounds instead (a TOML
    // integer is an i64, so that is the most a u64 field can get).
    if let Some(Value::String(format)) = obj.remove("format") {
        let max = match format.as_str() {
            "uint16" => Some(u64::from(u16::MAX)),
            "uint32" => Some(u64::from(u32::MAX)),
            "uint" | "uint64" => Some(i64::MAX.unsigned_abs()),
            _ => {
                obj.insert("format".into(), format.into());
                None
            }
        };
        if let Some(max) = max {
            obj.entry("maximum").or_insert(max.into());
        }
    }
    if let Some(Value::String(d)) = obj.get_mut("description") {
        *d = d
            .split("\n\n")
            .map(|p| p.split('\n').map(str::trim).collect::<Vec<_>>().join(" "))
            .collect::<Vec<_>>()
            .join("\n\n");
    }
}

/// `value` without the `null` members of its tables (an absent key, in TOML).
fn drop_nulls(value: &mut Value) {
    match value {
        Value::Object(map) => {
            map.retain(|_, v| !v.is_null());
            map.values_mut().for_each(drop_nulls);
        }
        Value::Array(items) => items.iter_mut().for_each(drop_nulls),
        _ => {}
    }
}

#[cfg(test)]
mod tests;
