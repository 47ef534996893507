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

use lb_common::MAP_CONNECT_SOCKS;
use tracing::warn;

use crate::datapath::{Datapath, DatapathError, syscall};

/// The most socket cookies kept from the maps a rebuild replaced (the records map's size in
/// every build so far).
const EARLIER_SOCKETS_MAX: usize = 65_536;

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
    /// Sockets the earlier lb's programs had recorded (their cookies kept for kills).
    pub earlier_sockets: usize,
}

impl Datapath {
    /// Keep the cookies of the sockets recorded in the socket records map pinned at `path`
    /// (the earlier build's: its keys are socket cookies in every build); how many.
    fn keep_earlier_sockets(&self, path: &Path) -> usize {
        let keys = syscall::obj_get(path)
            .and_then(|fd| syscall::map_u64_keys(fd.as_fd(), EARLIER_SOCKETS_MAX));
        match keys {
            Ok(cookies) => {
                let kept = self
                    .earlier_sockets
                    .get_or_init(|| cookies.into_iter().collect());
                kept.len()
            }
            Err(e) => {
                warn!(path = %path.display(), error = %e, "connect-time: the earlier lb's socket records cannot be read; a kill does not reach the sockets it made");
                0
            }
        }
    }

    /// Whether `cookie` is a socket an earlier build's programs recorded in maps a rebuild
    /// replaced; `false` for all when there were none.
    pub fn is_earlier_socket(&self, cookie: u64) -> bool {
        self.earlier_sockets
            .get()
            .is_some_and(|kept| kept.contains(&cookie))
    }

    /// Whether a rebuild left any [`Datapath::is_earlier_socket`].
    pub fn has_earlier_sockets(&self) -> bool {
        self.earlier_sockets
            .get()
            .is_some_and(|kept| !kept.is_empty())
    }

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
            done.earlier_sockets = self.keep_earlier_sockets(&p.dir().join(MAP_CONNECT_SOCKS));
            done.maps = p.commit_staged()?;
            done.defunct = p.remove_defunct()?;
        }
        Ok(Some(done))
    }
}
