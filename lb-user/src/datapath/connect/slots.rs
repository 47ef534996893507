//! Connect-time tables as generations in slots: which slot of `LB_CONNECT_TABLES` lb writes a
//! balancer's next table into, and when it may (the rule that keeps a program from reading a
//! table torn, see [`lb_common::MAP_CONNECT_TABLES`]). Pure arithmetic over times; the maps are
//! written by `Datapath::set_connect_table` (`super`).

use std::time::{Duration, Instant};

use lb_common::{SLOT_REUSE_AFTER_MS, TABLE_SLOTS};

/// How long a slot must not have been current before lb writes it again.
pub(super) const SLOT_REUSE_AFTER: Duration = Duration::from_millis(SLOT_REUSE_AFTER_MS);

/// The slot (`0..TABLE_SLOTS`) of generation `generation`.
pub(super) const fn slot_of(generation: u32) -> usize {
    (generation & (TABLE_SLOTS - 1)) as usize
}

/// One balancer's table generations as lb tracks them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Generations {
    /// The generation current in the kernel (`LB_CONNECT_CURRENT`), as lb last stored or found
    /// it.
    current: u32,
    /// Per slot, when it stopped being current; `None`: not current since lb tracks it (a
    /// fresh map), or the current slot.
    retired: [Option<Instant>; TABLE_SLOTS as usize],
}

impl Generations {
    /// A balancer of maps this process created: generation `current` (0) is current and no
    /// other slot ever was.
    pub(super) fn fresh(current: u32) -> Generations {
        Generations {
            current,
            retired: [None; TABLE_SLOTS as usize],
        }
    }

    /// Generation `current` found in maps another process wrote (a hand-over), or changed by
    /// one behind lb's back, at `now`: any other slot may have been current until now.
    pub(super) fn found(current: u32, now: Instant) -> Generations {
        let mut retired = [Some(now); TABLE_SLOTS as usize];
        retired[slot_of(current)] = None;
        Generations { current, retired }
    }

    /// The generation current in the kernel.
    pub(super) fn current(&self) -> u32 {
        self.current
    }

    /// The generation the next table gets.
    pub(super) fn next(&self) -> u32 {
        self.current.wrapping_add(1)
    }

    /// How long the next generation's slot has not been current at `now` (`None`: never since
    /// lb tracks it).
    pub(super) fn next_idle(&self, now: Instant) -> Option<Duration> {
        self.retired[slot_of(self.next())].map(|at| now.saturating_duration_since(at))
    }

    /// How long from `now` until the next generation's slot may be written: zero once it has
    /// not been current for [`SLOT_REUSE_AFTER`].
    pub(super) fn wait(&self, now: Instant) -> Duration {
        self.next_idle(now)
            .map_or(Duration::ZERO, |idle| SLOT_REUSE_AFTER.saturating_sub(idle))
    }

    /// The next generation was stored as current at `now`: the slot current until then
    /// retires.
    pub(super) fn advance(&mut self, now: Instant) {
        self.retired[slot_of(self.current)] = Some(now);
        self.current = self.next();
        self.retired[slot_of(self.current)] = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn slots_wrap_with_the_generation() {
        assert_eq!(slot_of(0), 0);
        assert_eq!(slot_of(TABLE_SLOTS - 1), TABLE_SLOTS as usize - 1);
        assert_eq!(slot_of(TABLE_SLOTS), 0);
        assert_eq!(slot_of(u32::MAX), TABLE_SLOTS as usize - 1);
        // u32::MAX + 1 wraps to 0: the slot sequence goes on without a jump.
        assert_eq!(slot_of(u32::MAX.wrapping_add(1)), 0);
        assert_eq!(lb_common::table_index(3, 10), 3 * TABLE_SLOTS + 2);
    }

    #[test]
    fn a_fresh_balancer_writes_every_slot_at_once_then_waits_for_the_oldest() {
        let t0 = Instant::now();
        let mut g = Generations::fresh(0);
        // Slots 1..TABLE_SLOTS were never current: written one after another at once.
        for n in 1..TABLE_SLOTS {
            assert_eq!(g.wait(t0), Duration::ZERO, "generation {n}");
            assert_eq!(g.next_idle(t0), None);
            g.advance(t0 + MS * n);
        }
        assert_eq!(g.current(), TABLE_SLOTS - 1);
        // The next is slot 0 again, current until generation 1 was stored at t0 + 1 ms.
        assert_eq!(slot_of(g.next()), 0);
        assert_eq!(g.wait(t0 + MS * 10), SLOT_REUSE_AFTER - MS * 9);
        assert_eq!(g.next_idle(t0 + MS * 10), Some(MS * 9));
        assert_eq!(g.wait(t0 + MS + SLOT_REUSE_AFTER), Duration::ZERO);
        g.advance(t0 + MS + SLOT_REUSE_AFTER);
        // Then slot 1, retired at t0 + 2 ms.
        assert_eq!(g.wait(t0 + MS + SLOT_REUSE_AFTER), MS);
    }

    #[test]
    fn no_slot_is_written_within_the_bound_of_its_retirement() {
        // Changes every 3 ms for a second, each written as soon as `wait` allows: every write
        // finds its slot idle for at least SLOT_REUSE_AFTER, or never current.
        let t0 = Instant::now();
        let mut g = Generations::fresh(0);
        let mut now = t0;
        let mut writes = 0u32;
        while now < t0 + Duration::from_secs(1) {
            now += g.wait(now);
            assert!(g.next_idle(now).is_none_or(|idle| idle >= SLOT_REUSE_AFTER));
            g.advance(now);
            writes += 1;
            now += MS * 3;
        }
        assert_eq!(g.current(), writes);
        // At most TABLE_SLOTS - 1 writes per SLOT_REUSE_AFTER once the slots are used.
        let bound = (TABLE_SLOTS - 1) * (1000 / SLOT_REUSE_AFTER_MS as u32 + 1);
        assert!(
            writes <= bound,
            "{writes} writes in a second, bound {bound}"
        );
    }

    #[test]
    fn found_generations_treat_every_other_slot_as_current_until_now() {
        let t0 = Instant::now();
        let g = Generations::found(41, t0);
        assert_eq!((g.current(), g.next()), (41, 42));
        assert_eq!(g.wait(t0), SLOT_REUSE_AFTER);
        assert_eq!(g.wait(t0 + SLOT_REUSE_AFTER), Duration::ZERO);
        let wrapped = Generations::found(u32::MAX, t0);
        assert_eq!(wrapped.next(), 0);
        assert_eq!(wrapped.wait(t0 + MS * 40), MS * 60);
    }
}
