//! `kind = "file"`: a server list an operator's tooling (or a Kubernetes ConfigMap mount)
//! writes, read every `interval`. Three shapes are accepted:
//!
//! - JSON list: `["198.18.0.2:6443", "api.example:6443"]`
//! - JSON object, the body of `PUT /balancers/NAME/servers`:
//!   `{"servers": ["198.18.0.2:6443"], "default": "198.18.0.9:6443"}`
//! - TOML: `servers = ["198.18.0.2:6443"]` and optionally `default = "198.18.0.9:6443"`
//!
//! A file that is missing, unreadable, unparsable or empty changes nothing.

use serde::Deserialize;

use super::{DiscoveryError, Found};
use crate::{
    addr::{self, ServerAddr},
    config::FileDiscovery,
};

/// Largest file read (bytes).
const MAX_FILE: u64 = 1024 * 1024;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Listed {
    servers: Vec<String>,
    #[serde(default)]
    default: Option<String>,
}

/// Parse the file's text.
///
/// # Errors
/// A message naming what is wrong: not one of the three shapes, or an entry that is not
/// `host:port`.
pub(crate) fn parse(text: &str) -> Result<(Vec<ServerAddr>, Option<ServerAddr>), String> {
    let trimmed = text.trim_start();
    let listed = if trimmed.starts_with('[') {
        Listed {
            servers: serde_json::from_str(text).map_err(|e| format!("invalid JSON list: {e}"))?,
            default: None,
        }
    } else if trimmed.starts_with('{') {
        serde_json::from_str(text).map_err(|e| format!("invalid JSON object: {e}"))?
    } else {
        toml::from_str(text).map_err(|e| format!("invalid TOML: {}", e.message()))?
    };
    let servers = addr::parse_all(&listed.servers).map_err(|e| e.to_string())?;
    let default = listed
        .default
        .as_deref()
        .map(addr::parse_one)
        .transpose()
        .map_err(|e| e.to_string())?;
    Ok((servers, default))
}

/// Read and parse the file once.
///
/// # Errors
/// [`DiscoveryError::File`] naming the file and the reason.
pub(super) async fn read(f: &FileDiscovery) -> Result<Found, DiscoveryError> {
    let failed = |reason: String| DiscoveryError::File {
        path: f.path.display().to_string(),
        reason,
    };
    let path = f.path.clone();
    let text = tokio::task::spawn_blocking(move || {
        crate::files::read_limited_string(&path, MAX_FILE).map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| failed(e.to_string()))?
    .map_err(failed)?;
    let (servers, default) = parse(&text).map_err(failed)?;
    Ok(Found {
        servers,
        default,
        ttl: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(v: &[ServerAddr]) -> Vec<String> {
        v.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn three_shapes_parse_alike() {
        let (s, d) = parse(r#"["198.18.0.2:6443", "[::1]:6443"]"#).unwrap();
        assert_eq!(texts(&s), ["198.18.0.2:6443", "[::1]:6443"]);
        assert_eq!(d, None);
        let (s, d) =
            parse(r#"{"servers": ["198.18.0.2:6443"], "default": "198.18.0.9:6443"}"#).unwrap();
        assert_eq!(texts(&s), ["198.18.0.2:6443"]);
        assert_eq!(d.unwrap().to_string(), "198.18.0.9:6443");
        let (s, d) = parse("servers = [\"a.example:1\"]\ndefault = \"b.example:2\"\n").unwrap();
        assert_eq!(texts(&s), ["a.example:1"]);
        assert_eq!(d.unwrap().to_string(), "b.example:2");
    }

    #[test]
    fn bad_files_name_what_is_wrong() {
        assert!(
            parse("[\"a:1\",")
                .unwrap_err()
                .contains("invalid JSON list")
        );
        assert!(
            parse(r#"{"servers": [], "extra": 1}"#)
                .unwrap_err()
                .contains("extra")
        );
        assert!(parse("servers = 3").unwrap_err().contains("invalid TOML"));
        assert!(parse(r#"["no-port"]"#).unwrap_err().contains("no-port"));
        // An empty list parses; `fetch` refuses it as empty (the last good set stays).
        assert!(parse("[]").unwrap().0.is_empty());
    }
}
