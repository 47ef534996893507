//! What a starting lb finds in its pin directory: nothing, maps it can adopt as they are, or
//! maps it must rebuild. A pinned map is adopted only when its definition (`bpf_map_info`:
//! type, key size, value size, entries, flags) is the one of this build's object, and the
//! layout in the pinned `LB_CONNECT_CTL` is this build's `CONNECT_PIN_LAYOUT` (derived from
//! the source of every type the maps hold, so a change of meaning at the same size is seen
//! too). aya 0.14 reuses a pinned map without comparing its definition, and a pinned value
//! larger than lb's type would be read past lb's buffer: nothing here reads a map before its
//! definition is compared.
//!
//! Minimum kernel: 4.13 (`BPF_OBJ_GET_INFO_BY_FD` of a map).

use std::path::Path;

use aya::maps::{Array, Map, MapData, MapInfo};
use lb_common::{CONNECT_MAPS, CONNECT_PIN_LAYOUT, CONNECT_PROGS, CTL_LAYOUT, MAP_CONNECT_CTL};

/// What a pin directory holds, for the lb about to load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// No connect-time pin: this lb attaches and pins its own.
    Nothing,
    /// Every connect-time map pinned, of this build's layout and definitions: adopted as they
    /// are (tables, socket records and counts go on), the pinned links swapped to this build's
    /// programs at load.
    Adopt,
    /// Pins this build cannot adopt (the text names the first difference): it loads new maps,
    /// writes its state into them, then swaps the pinned links to its programs and the map
    /// pins to its maps.
    Rebuild(String),
}

/// Survey `dir` (which exists and this lb has locked).
pub(super) fn survey(dir: &Path) -> Found {
    let pinned = |name: &&&str| dir.join(name).exists();
    let maps = CONNECT_MAPS.iter().filter(pinned).count();
    let links = CONNECT_PROGS.iter().filter(pinned).count();
    if maps == 0 && links == 0 {
        return Found::Nothing;
    }
    match difference(dir) {
        None => Found::Adopt,
        Some(why) => Found::Rebuild(why),
    }
}

/// The first way the maps pinned in `dir` differ from this build's, `None` when they do not.
fn difference(dir: &Path) -> Option<String> {
    let object = match aya_obj::Object::parse(crate::datapath::EBPF_OBJ) {
        Ok(o) => o,
        Err(e) => return Some(format!("this build's object does not parse: {e}")),
    };
    for name in CONNECT_MAPS {
        let path = dir.join(name);
        if !path.exists() {
            return Some(format!("{name} is not pinned"));
        }
        let Some(want) = object.maps.get(name) else {
            return Some(format!("this build's object has no {name}"));
        };
        let found = match MapInfo::from_pin(&path) {
            Ok(info) => info,
            Err(e) => return Some(format!("{name}: {e}")),
        };
        let kind = found.map_type().map(|t| t as u32).unwrap_or(u32::MAX);
        let fields = [
            ("type", kind, want.map_type()),
            ("key size", found.key_size(), want.key_size()),
            ("value size", found.value_size(), want.value_size()),
            ("entries", found.max_entries(), want.max_entries()),
            ("flags", found.map_flags(), want.map_flags()),
        ];
        if let Some((field, pinned, own)) = fields.iter().find(|(_, p, o)| p != o) {
            return Some(format!(
                "{name}: {field} {pinned} pinned, {own} in this build"
            ));
        }
    }
    match pinned_layout(dir) {
        Ok(l) if l == CONNECT_PIN_LAYOUT => None,
        Ok(l) => Some(format!(
            "layout {l:#x} pinned, {CONNECT_PIN_LAYOUT:#x} in this build"
        )),
        Err(e) => Some(format!("{MAP_CONNECT_CTL}: {e}")),
    }
}

/// The layout in the pinned `LB_CONNECT_CTL` (its definition already compared).
fn pinned_layout(dir: &Path) -> Result<u64, aya::maps::MapError> {
    let data = MapData::from_pin(dir.join(MAP_CONNECT_CTL))?;
    let ctl: Array<MapData, u64> = Array::try_from(Map::from_map_data(data)?)?;
    ctl.get(&CTL_LAYOUT, 0)
}
