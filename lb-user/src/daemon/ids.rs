//! Balancer ids: the key of a balancer's entries in the kernel's maps (listeners, connect-time
//! tables, counts and socket records, splice counters). A fresh lb numbers its balancers in
//! config order; an lb that takes over from another keeps that one's ids by balancer name, so
//! an upgrade whose config lists the balancers in another order finds each balancer's tables
//! and sockets where the kernel keeps them. The id of a balancer an upgrade drops is retired
//! until lb restarts (its sockets may still be in the kernel's records, its splice counters
//! are still in the maps), so no later balancer inherits them. A restart that adopts
//! connect-time pins keeps each balancer's id by name too ([`from_pins`]), from the names the
//! earlier lb left in the pinned control map.

use std::collections::{HashMap, HashSet};

use lb_common::MAX_BALANCERS;

/// Why an lb cannot take over the old one's balancer ids.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// The old lb named an id out of range or one id twice (a corrupt hand-over).
    #[error("the running lb gave balancer {name} id {id}, out of range or given twice")]
    Invalid {
        /// Balancer name (`(retired)` for a retired id).
        name: String,
        /// The id.
        id: u32,
    },
    /// Every id is taken by the old lb's balancers, retired ones and the new config's.
    #[error(
        "no balancer id left for new balancer {name}: the running lb's balancers, those earlier upgrades dropped and the new config's together exceed {MAX_BALANCERS}; restart lb"
    )]
    Exhausted {
        /// Balancer name.
        name: String,
    },
}

/// The ids an lb gives its balancers.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Assigned {
    /// Each balancer's id, by name.
    pub ids: HashMap<String, u32>,
    /// Ids never to give again before a restart: those retired before and those of the old
    /// lb's balancers the new config drops (ascending).
    pub retired: Vec<u32>,
}

/// Ids of a fresh lb's balancers, `names` in config order: their positions; none retired.
pub fn fresh(names: &[&str]) -> Assigned {
    Assigned {
        ids: names
            .iter()
            .zip(0..)
            .map(|(name, id)| ((*name).to_string(), id))
            .collect(),
        retired: Vec::new(),
    }
}

/// Ids of the new config's balancers (`names`, in config order) when taking over from an lb
/// whose balancers had the ids `old` (by name) and that had retired `retired`: a balancer the
/// old lb had keeps its id, a new one gets the lowest id neither in use nor retired.
///
/// # Errors
/// [`IdError`].
pub fn carried_over(
    names: &[&str],
    old: &[(String, u32)],
    retired: &[u32],
) -> Result<Assigned, IdError> {
    let mut used = HashSet::new();
    let retired_named = retired.iter().map(|id| (String::from("(retired)"), *id));
    for (name, id) in old.iter().cloned().chain(retired_named) {
        if id >= MAX_BALANCERS || !used.insert(id) {
            return Err(IdError::Invalid { name, id });
        }
    }
    let mut ids = HashMap::new();
    for name in names {
        let id = match old.iter().find(|(n, _)| n == name) {
            Some((_, id)) => *id,
            None => {
                let id = (0..MAX_BALANCERS)
                    .find(|id| !used.contains(id))
                    .ok_or_else(|| IdError::Exhausted {
                        name: (*name).to_string(),
                    })?;
                used.insert(id);
                id
            }
        };
        ids.insert((*name).to_string(), id);
    }
    let dropped = old
        .iter()
        .filter(|(n, _)| !names.contains(&n.as_str()))
        .map(|(_, id)| *id);
    let mut retired: Vec<u32> = retired.iter().copied().chain(dropped).collect();
    retired.sort_unstable();
    Ok(Assigned { ids, retired })
}

/// Ids of a fresh lb's balancers (`names`, in config order) that adopts connect-time pins whose
/// control map names the ids an earlier lb gave (`pinned`: name hash and id, see
/// `lb_common::CTL_BALANCER_NAMES`): a balancer whose name was there keeps its id; an id whose
/// balancer the config no longer has stays retired while `has_sockets` says the kernel still
/// counts sockets of it, and is free otherwise; new balancers get the lowest free ids.
///
/// # Errors
/// [`IdError::Exhausted`].
pub fn from_pins(
    names: &[&str],
    pinned: &[(u64, u32)],
    has_sockets: impl Fn(u32) -> bool,
) -> Result<Assigned, IdError> {
    let mut old = Vec::new();
    let mut retired = Vec::new();
    for (hash, id) in pinned.iter().filter(|(_, id)| *id < MAX_BALANCERS) {
        match names
            .iter()
            .find(|n| lb_common::balancer_name_hash(n) == *hash)
        {
            Some(name) if !old.iter().any(|(n, _): &(String, u32)| n == name) => {
                old.push(((*name).to_string(), *id));
            }
            _ if has_sockets(*id) => retired.push(*id),
            _ => {}
        }
    }
    carried_over(names, &old, &retired)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn old(pairs: &[(&str, u32)]) -> Vec<(String, u32)> {
        pairs.iter().map(|(n, i)| ((*n).to_string(), *i)).collect()
    }

    #[test]
    fn fresh_ids_are_config_positions() {
        let a = fresh(&["a", "b"]);
        assert_eq!((a.ids["a"], a.ids["b"]), (0, 1));
        assert!(a.retired.is_empty());
    }

    #[test]
    fn swapped_balancers_keep_their_ids() {
        let a = carried_over(&["b", "a"], &old(&[("a", 0), ("b", 1)]), &[]).unwrap();
        assert_eq!((a.ids["a"], a.ids["b"]), (0, 1));
        assert!(a.retired.is_empty());
    }

    #[test]
    fn a_dropped_balancers_id_is_retired() {
        // `b` is dropped: its id 1 is retired, `c` gets 2.
        let a = carried_over(&["c", "a"], &old(&[("a", 0), ("b", 1)]), &[]).unwrap();
        assert_eq!((a.ids["a"], a.ids["c"]), (0, 2));
        assert_eq!(a.retired, [1]);
        // The next upgrade keeps it retired: a new `d` gets 3, not 1.
        let next = carried_over(&["a", "c", "d"], &old(&[("a", 0), ("c", 2)]), &a.retired).unwrap();
        assert_eq!(next.ids["d"], 3);
        assert_eq!(next.retired, [1]);
    }

    #[test]
    fn pinned_ids_are_kept_by_name_and_a_dropped_one_retired_while_it_has_sockets() {
        let h = lb_common::balancer_name_hash;
        let pinned = [(h("a"), 0), (h("b"), 1), (h("gone"), 2), (h("idle"), 3)];
        // The config swaps a and b, drops `gone` (sockets left) and `idle` (none), adds `c`.
        let a = from_pins(&["b", "a", "c"], &pinned, |id| id == 2).unwrap();
        assert_eq!((a.ids["a"], a.ids["b"]), (0, 1));
        assert_eq!(a.ids["c"], 3, "the idle id is free again");
        assert_eq!(a.retired, [2]);
        // Nothing pinned: config positions, as a fresh start.
        assert_eq!(
            from_pins(&["x", "y"], &[], |_| false).unwrap(),
            fresh(&["x", "y"])
        );
    }

    #[test]
    fn corrupt_or_exhausted_ids_are_refused() {
        assert!(matches!(
            carried_over(&["a"], &old(&[("a", MAX_BALANCERS)]), &[]),
            Err(IdError::Invalid { .. })
        ));
        assert!(matches!(
            carried_over(&["a", "b"], &old(&[("a", 3), ("b", 3)]), &[]),
            Err(IdError::Invalid { .. })
        ));
        assert!(matches!(
            carried_over(&["a"], &old(&[("a", 3)]), &[3]),
            Err(IdError::Invalid { .. })
        ));
        let full: Vec<(String, u32)> = (0..MAX_BALANCERS).map(|i| (format!("x{i}"), i)).collect();
        assert_eq!(
            carried_over(&["new"], &full, &[]),
            Err(IdError::Exhausted { name: "new".into() })
        );
    }
}
