//! Balancer ids: the key of a balancer's entries in the kernel's maps (listeners, connect-time
//! tables, counts and socket records, splice counters). A fresh lb numbers its balancers in
//! config order; an lb that takes over from another keeps that one's ids by balancer name, so
//! an upgrade whose config lists the balancers in another order finds each balancer's tables
//! and sockets where the kernel keeps them.

use std::collections::{HashMap, HashSet};

use lb_common::MAX_BALANCERS;

/// Why an lb cannot take over the old one's balancer ids.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// The old lb named an id out of range or one id twice (a corrupt hand-over).
    #[error("the running lb gave balancer {name} id {id}, out of range or given twice")]
    Invalid {
        /// Balancer name.
        name: String,
        /// The id.
        id: u32,
    },
    /// Every id is taken by the old lb's balancers and the new config's.
    #[error(
        "no balancer id left for new balancer {name}: the running lb's balancers and the new config's together exceed {MAX_BALANCERS}; restart lb"
    )]
    Exhausted {
        /// Balancer name.
        name: String,
    },
}

/// Ids of a fresh lb's balancers, `names` in config order: their positions.
pub fn fresh(names: &[&str]) -> HashMap<String, u32> {
    names
        .iter()
        .zip(0..)
        .map(|(name, id)| ((*name).to_string(), id))
        .collect()
}

/// Ids of the new config's balancers (`names`, in config order) when taking over from an lb
/// whose balancers had the ids `old` (by name): a balancer the old lb had keeps its id, a new
/// one gets the lowest id no balancer of either lb has (an id of a balancer the new config
/// drops is not reused: its sockets may still be in the kernel's records).
///
/// # Errors
/// [`IdError`].
pub fn carried_over(
    names: &[&str],
    old: &[(String, u32)],
) -> Result<HashMap<String, u32>, IdError> {
    let mut used = HashSet::new();
    for (name, id) in old {
        if *id >= MAX_BALANCERS || !used.insert(*id) {
            return Err(IdError::Invalid {
                name: name.clone(),
                id: *id,
            });
        }
    }
    let mut out = HashMap::new();
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
        out.insert((*name).to_string(), id);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn old(pairs: &[(&str, u32)]) -> Vec<(String, u32)> {
        pairs.iter().map(|(n, i)| ((*n).to_string(), *i)).collect()
    }

    #[test]
    fn fresh_ids_are_config_positions() {
        let ids = fresh(&["a", "b"]);
        assert_eq!(ids["a"], 0);
        assert_eq!(ids["b"], 1);
    }

    #[test]
    fn swapped_balancers_keep_their_ids() {
        let ids = carried_over(&["b", "a"], &old(&[("a", 0), ("b", 1)])).unwrap();
        assert_eq!((ids["a"], ids["b"]), (0, 1));
    }

    #[test]
    fn a_new_balancer_gets_an_id_nobody_had() {
        // `b` was dropped: its id 1 stays unused, `c` gets 2.
        let ids = carried_over(&["c", "a"], &old(&[("a", 0), ("b", 1)])).unwrap();
        assert_eq!((ids["a"], ids["c"]), (0, 2));
    }

    #[test]
    fn corrupt_or_exhausted_ids_are_refused() {
        assert!(matches!(
            carried_over(&["a"], &old(&[("a", MAX_BALANCERS)])),
            Err(IdError::Invalid { .. })
        ));
        assert!(matches!(
            carried_over(&["a", "b"], &old(&[("a", 3), ("b", 3)])),
            Err(IdError::Invalid { .. })
        ));
        let full: Vec<(String, u32)> = (0..MAX_BALANCERS).map(|i| (format!("x{i}"), i)).collect();
        assert_eq!(
            carried_over(&["new"], &full),
            Err(IdError::Exhausted { name: "new".into() })
        );
    }
}
