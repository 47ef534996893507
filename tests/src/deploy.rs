//! The shipped deployment files (`deploy/`), read as the tests' source of truth: the systemd
//! unit's identity and capabilities, a DaemonSet's pod settings, container arguments and
//! ConfigMap, so a test runs lb the way the files say and follows them when they change.

use std::path::PathBuf;

use anyhow::{Context as _, Result, bail};

/// The text of `rel` (e.g. `deploy/systemd/lb.service`) in the repository.
///
/// # Errors
/// The file cannot be read.
pub fn repo_file(rel: &str) -> Result<String> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(rel);
    std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
}

/// Every value of `key` in a systemd unit's text, words of all its lines in order (systemd
/// joins repeated list settings such as `AmbientCapabilities=`); comments are skipped.
pub fn unit_values(unit: &str, key: &str) -> Vec<String> {
    unit.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#') && !l.starts_with(';'))
        .filter_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .flat_map(|v| v.split_whitespace().map(String::from))
        .collect()
}

/// The `setpriv` command line that runs what follows it as `uid`/`gid` (no supplementary
/// groups) holding exactly `caps` (`CAP_BPF`, ... as in a unit file) as ambient, inheritable,
/// permitted and effective capabilities and in the bounding set: what systemd gives a service
/// with `User=`/`DynamicUser=`, `AmbientCapabilities=` and `CapabilityBoundingSet=` of the same
/// list.
///
/// # Errors
/// A name that is not `CAP_*`.
pub fn setpriv_as(uid: u32, gid: u32, caps: &[String]) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for c in caps {
        let Some(name) = c.strip_prefix("CAP_") else {
            bail!("{c} is not a capability name");
        };
        names.push(format!("+{}", name.to_ascii_lowercase()));
    }
    let set = if names.is_empty() {
        "-all".to_string()
    } else {
        format!("-all,{}", names.join(","))
    };
    Ok(vec![
        "setpriv".into(),
        format!("--reuid={uid}"),
        format!("--regid={gid}"),
        "--clear-groups".into(),
        format!("--inh-caps={set}"),
        format!("--ambient-caps={set}"),
        format!("--bounding-set={set}"),
    ])
}

/// The value of the first `key:` in `yaml` (also as a list item, `- key:`), as written, without
/// a trailing comment.
pub fn yaml_scalar(yaml: &str, key: &str) -> Option<String> {
    yaml.lines().find_map(|l| {
        let l = l.trim_start();
        let l = l.strip_prefix("- ").unwrap_or(l);
        let rest = l.strip_prefix(key)?.strip_prefix(':')?;
        let v = rest.split(" #").next().unwrap_or(rest).trim();
        (!v.is_empty()).then(|| v.to_string())
    })
}

/// The container's `args:` of a manifest, written as a flow sequence of quoted strings
/// (`args: ["run", "--config", "/etc/lb/lb.toml"]`, which is JSON).
///
/// # Errors
/// No `args:` line, or one that is not such a list.
pub fn container_args(yaml: &str) -> Result<Vec<String>> {
    let v = yaml_scalar(yaml, "args").context("no args: in the manifest")?;
    serde_json::from_str(&v).with_context(|| format!("args: {v} is not a list of strings"))
}

/// The text of the ConfigMap entry `key: |` of a manifest (the block under it, unindented).
///
/// # Errors
/// No such block.
pub fn configmap_entry(yaml: &str, key: &str) -> Result<String> {
    let mut lines = yaml.lines();
    let head = format!("{key}: |");
    lines
        .by_ref()
        .find(|l| l.trim() == head)
        .with_context(|| format!("no `{head}` in the manifest"))?;
    let block: Vec<&str> = lines
        .take_while(|l| l.trim().is_empty() || l.starts_with("    "))
        .collect();
    let indent = block
        .iter()
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.len() - l.trim_start().len())
        .min()
        .unwrap_or(0);
    Ok(block
        .iter()
        .map(|l| l.get(indent..).unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_lists_and_setpriv() -> Result<()> {
        let unit = "[Service]\n# AmbientCapabilities=CAP_SYS_ADMIN\nAmbientCapabilities=CAP_BPF CAP_NET_ADMIN\nAmbientCapabilities=CAP_PERFMON\n";
        let caps = unit_values(unit, "AmbientCapabilities");
        assert_eq!(caps, ["CAP_BPF", "CAP_NET_ADMIN", "CAP_PERFMON"]);
        let args = setpriv_as(65534, 65534, &caps)?;
        assert!(args.contains(&"--ambient-caps=-all,+bpf,+net_admin,+perfmon".to_string()));
        assert!(setpriv_as(1, 1, &["NET_ADMIN".into()]).is_err());
        Ok(())
    }

    #[test]
    fn manifest_fields() -> Result<()> {
        let yaml = "data:\n  lb.toml: |\n    [admin]\n    listen = \"x\"\n\n    [datapath]\n---\nspec:\n  hostPID: true # why\n  containers:\n    - args: [\"run\", \"--config\", \"/etc/lb/lb.toml\"]\n";
        assert_eq!(
            configmap_entry(yaml, "lb.toml")?,
            "[admin]\nlisten = \"x\"\n\n[datapath]"
        );
        assert_eq!(yaml_scalar(yaml, "hostPID").as_deref(), Some("true"));
        assert_eq!(
            container_args(yaml)?,
            ["run", "--config", "/etc/lb/lb.toml"]
        );
        Ok(())
    }
}
