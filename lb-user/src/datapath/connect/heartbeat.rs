//! lb's control of the connect programs (`LB_CONNECT_CTL`): its process id, its heartbeat
//! (written every 0.5 s, so pinned programs stop rewriting once lb has been gone longer than
//! `datapath.orphan_timeout`), and what `/status` and the metrics say of the pins.
//!
//! Minimum kernel: 5.8 (`bpf_ktime_get_boot_ns` in the connect programs).

use std::{path::PathBuf, time::Duration};

use lb_common::{
    CTL_BALANCER_NAMES, CTL_HEARTBEAT_NS, CTL_OWN_TGID, MAX_BALANCERS, balancer_name_hash,
};
use serde::Serialize;

use crate::datapath::{Datapath, DatapathError, maps::Maps};

/// The connect-time pin directory as `/status` shows it.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct PinsStatus {
    /// The directory.
    pub dir: PathBuf,
    /// Whether this lb adopted the maps an earlier lb left there as they were.
    pub adopted: bool,
    /// Why this lb rebuilt the maps an earlier lb left there (another layout or definition);
    /// `None` when it adopted them or found none.
    pub rebuilt: Option<String>,
}

impl Datapath {
    /// Write the heartbeat now (`CLOCK_BOOTTIME` ns) and this process's id; lb calls it every
    /// 0.5 s while it runs. The process id follows a hand-over (`lb upgrade`).
    ///
    /// # Errors
    /// [`DatapathError::Map`].
    pub fn heartbeat(&self) -> Result<(), DatapathError> {
        let ctl = &self.maps.connect_ctl;
        ctl.set(CTL_OWN_TGID, &u64::from(std::process::id()))?;
        ctl.set(CTL_HEARTBEAT_NS, &boottime_ns())
    }

    /// How old the heartbeat the connect programs see is; `None` when it cannot be read.
    pub fn heartbeat_age(&self) -> Option<Duration> {
        let beat = self.maps.connect_ctl.get(CTL_HEARTBEAT_NS).ok()?;
        Some(Duration::from_nanos(boottime_ns().saturating_sub(beat)))
    }

    /// The pin directory this lb holds, `None` when connect-time is not pinned.
    pub fn pins_status(&self) -> Option<PinsStatus> {
        self.pins.as_ref().map(|p| PinsStatus {
            dir: p.dir().to_path_buf(),
            adopted: p.adopted(),
            rebuilt: match p.found() {
                super::survey::Found::Rebuild(why) => Some(why.clone()),
                _ => None,
            },
        })
    }

    /// A descriptor of the locked pin directory, for a hand-over; `None` when not pinned.
    ///
    /// # Errors
    /// Out of descriptors.
    pub fn pins_lock_fd(&self) -> std::io::Result<Option<std::os::fd::OwnedFd>> {
        self.pins
            .as_ref()
            .map(super::pins::Pins::lock_fd)
            .transpose()
    }
}

impl Datapath {
    /// The balancer ids an earlier lb left in the control map of pins this lb adopted, as
    /// `(name hash, id)` (see `lb_common::CTL_BALANCER_NAMES`); empty when the maps are this
    /// lb's own (new, rebuilt or handed over by `lb upgrade`, which carries ids itself).
    pub fn pinned_balancer_ids(&self) -> Vec<(u64, u32)> {
        if !self.pins.as_ref().is_some_and(super::pins::Pins::adopted) {
            return Vec::new();
        }
        (0..MAX_BALANCERS)
            .filter_map(|id| {
                let hash = self.maps.connect_ctl.get(CTL_BALANCER_NAMES + id).ok()?;
                (hash != 0).then_some((hash, id))
            })
            .collect()
    }

    /// Record in the control map which balancer holds each id: `ids` (name → id) by their
    /// names' hashes; the slots of `retired` ids keep what they hold (their sockets may still
    /// be in the records), every other slot is cleared.
    ///
    /// # Errors
    /// [`DatapathError::Map`].
    pub fn write_balancer_ids(
        &self,
        ids: &[(String, u32)],
        retired: &[u32],
    ) -> Result<(), DatapathError> {
        for id in (0..MAX_BALANCERS).filter(|id| !retired.contains(id)) {
            let hash = ids
                .iter()
                .find(|(_, i)| *i == id)
                .map_or(0, |(name, _)| balancer_name_hash(name));
            self.maps.connect_ctl.set(CTL_BALANCER_NAMES + id, &hash)?;
        }
        Ok(())
    }
}

/// Write lb's control of the connect programs (`LB_CONNECT_CTL`): the layout version, the
/// orphan timeout, this process's id (never rewritten) and a first heartbeat, before any
/// connect program is attached or while adopted ones run.
pub(in crate::datapath) fn connect_ctl(
    maps: &Maps,
    orphan: std::time::Duration,
) -> Result<(), DatapathError> {
    use lb_common::{CONNECT_PIN_LAYOUT, CTL_LAYOUT, CTL_ORPHAN_NS};
    let c = &maps.connect_ctl;
    c.set(CTL_LAYOUT, &CONNECT_PIN_LAYOUT)?;
    c.set(
        CTL_ORPHAN_NS,
        &u64::try_from(orphan.as_nanos()).unwrap_or(u64::MAX),
    )?;
    c.set(CTL_OWN_TGID, &u64::from(std::process::id()))?;
    c.set(CTL_HEARTBEAT_NS, &boottime_ns())
}

/// `CLOCK_BOOTTIME` now, in nanoseconds (what the programs' `bpf_ktime_get_boot_ns` reads).
pub fn boottime_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME).map_or(0, |t| {
        u64::try_from(t.tv_sec()).unwrap_or(0) * 1_000_000_000
            + u64::try_from(t.tv_nsec()).unwrap_or(0)
    })
}
