//! How a starting lb puts its own programs into the links an earlier lb pinned, whatever build
//! that was: `BPF_LINK_UPDATE` swaps a cgroup link's program in one step, so every `connect()`
//! runs the old program or the new one, never neither (Cilium's agent replaces its pinned
//! cgroup links the same way on each start).
//!
//! - Pinned maps adopted ([`Found::Adopt`]): the programs, loaded on those maps, are swapped
//!   in at load.
//! - Pinned maps rebuilt ([`Found::Rebuild`]): the programs are loaded on new maps, pinned
//!   aside ([`Pins::stage_maps`]). The old programs go on serving from the old maps while lb
//!   writes its listeners and every connect-time balancer's first table into the new ones;
//!   then [`Datapath::finish_takeover`] swaps each link, moves the new maps' pins over the old
//!   ones and removes the pins this build does not know. Socket records of connects made
//!   before the swap stay in the old maps, which go with the last program holding them: their
//!   counts start from zero, `getpeername` on such a socket answers the server's address, and
//!   a server's kill reaches those sockets through the node-wide kill by address.
//!
//! Minimum kernel: 5.7 (`BPF_LINK_UPDATE` of a cgroup link).
//!
//! [`Found::Adopt`]: super::survey::Found::Adopt
//! [`Found::Rebuild`]: super::survey::Found::Rebuild
//! [`Pins::stage_maps`]: super::pins::Pins::stage_maps

use std::{
    os::fd::{AsFd as _, BorrowedFd, OwnedFd},
    path::Path,
};

use serde::Serialize;

use crate::datapath::{Datapath, DatapathError, syscall};

/// One pinned link and the program of this build it is to run.
#[derive(Debug)]
pub(in crate::datapath) struct Swap {
    name: &'static str,
    link: OwnedFd,
    prog: OwnedFd,
}

impl Swap {
    /// The link pinned at `link` (program `name`'s) and a copy of `prog`, this build's
    /// program of that name, loaded.
    ///
    /// # Errors
    /// [`DatapathError::Swap`]: the pin cannot be opened, or `prog` not copied.
    pub(in crate::datapath) fn new(
        name: &'static str,
        link: &Path,
        prog: BorrowedFd<'_>,
    ) -> Result<Swap, DatapathError> {
        let err = |source| DatapathError::Swap {
            program: name,
            source,
        };
        Ok(Swap {
            name,
            link: syscall::obj_get(link).map_err(err)?,
            prog: prog.try_clone_to_owned().map_err(err)?,
        })
    }

    /// The link runs this build's program from now on.
    ///
    /// # Errors
    /// [`DatapathError::Swap`] (the link keeps its program).
    pub(in crate::datapath) fn run(&self) -> Result<(), DatapathError> {
        syscall::link_update(self.link.as_fd(), self.prog.as_fd()).map_err(|source| {
            DatapathError::Swap {
                program: self.name,
                source,
            }
        })
    }
}

/// What [`Datapath::finish_takeover`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TookOver {
    /// Pinned links now running this build's programs.
    pub links: usize,
    /// Map pins replaced by this build's maps.
    pub maps: usize,
    /// Pins of programs or maps this build does not have, removed.
    pub defunct: usize,
}

impl Datapath {
    /// Whether a rebuild of the pinned maps waits for [`Datapath::finish_takeover`].
    pub fn takeover_pending(&self) -> bool {
        self.takeover.lock().expect("poisoned").is_some()
    }

    /// Whether every balancer of `ids` had its connect-time table written by this lb.
    pub fn connect_tables_written(&self, ids: &[u32]) -> bool {
        let written = self.tables.generations.lock().expect("poisoned");
        ids.iter().all(|id| written.contains_key(id))
    }

    /// Finish a rebuild once lb's listeners and first tables are in its new maps: swap each
    /// pinned link to this build's program, move the new maps' pins over the old ones, remove
    /// the pins this build does not know. `None` when no rebuild was pending.
    ///
    /// # Errors
    /// [`DatapathError::Map`] (the heartbeat); [`DatapathError::Swap`] for a link that keeps
    /// its old program (those before it run the new ones); [`DatapathError::Pins`] for a pin
    /// not moved or removed.
    pub fn finish_takeover(&self) -> Result<Option<TookOver>, DatapathError> {
        let Some(swaps) = self.takeover.lock().expect("poisoned").take() else {
            return Ok(None);
        };
        // A fresh heartbeat first: the new programs must not find this lb orphaned.
        self.heartbeat()?;
        for s in &swaps {
            s.run()?;
        }
        let mut done = TookOver {
            links: swaps.len(),
            ..TookOver::default()
        };
        if let Some(p) = &self.pins {
            done.maps = p.commit_staged()?;
            done.defunct = p.remove_defunct()?;
        }
        Ok(Some(done))
    }
}
