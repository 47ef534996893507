//! lb's BPF maps as a test sees them from outside: through `bpftool` and the map descriptors
//! the lb process holds.

use anyhow::{Result, bail};
use serde_json::Value;

use crate::cmd::sh;

/// Entries of lb's map `name` (found through the map descriptors lb holds, so other lbs
/// running alongside are not counted), as `bpftool map dump` lists them.
///
/// # Errors
/// lb holds no map of that name, or `bpftool` failed.
pub fn lb_map_entries(pid: u32, name: &str) -> Result<usize> {
    for fd in std::fs::read_dir(format!("/proc/{pid}/fdinfo"))? {
        let info = std::fs::read_to_string(fd?.path()).unwrap_or_default();
        let Some(id) = info
            .lines()
            .find_map(|l| l.strip_prefix("map_id:"))
            .map(str::trim)
        else {
            continue;
        };
        let show: Value = serde_json::from_str(&sh("bpftool", &["-j", "map", "show", "id", id])?)?;
        if show["name"] == name {
            let dump: Value =
                serde_json::from_str(&sh("bpftool", &["-j", "map", "dump", "id", id])?)?;
            return Ok(dump.as_array().map_or(0, Vec::len));
        }
    }
    bail!("lb (pid {pid}) holds no map named {name}")
}
