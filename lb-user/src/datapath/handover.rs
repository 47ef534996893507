//! The kernel data path across `lb upgrade`: the old process gives the new one a descriptor of
//! every map and of every cgroup link, passed with `SCM_RIGHTS` like the sockets. The new one
//! adopts them without loading or attaching anything, so every socket stays in the sockhashes,
//! sk_msg stays attached to the client sockhash (the map holds it), the cgroup programs never
//! detach, and nothing new is pinned: the splice's programs still end with the last process
//! holding them (the connect-time ones are pinned, or not, as the first lb left them).
//! Paired connections move as [`credit::Pair`]s rebuilt from lb's copied count.
//!
//! Each balancer's network namespace scope (`LB_NETNS_SCOPE`) is a map, handed over with the
//! others; the new process writes it again, with its own namespace's cookie, when it registers
//! its listeners.
//!
//! lb's pid, whose `connect()`s the connect-time programs never rewrite, is in a map
//! (`LB_CONNECT_CTL`) the new process writes with its heartbeat. With connect-time pins, the
//! old process also hands over a descriptor of its locked pin directory: the lock goes with it,
//! so the directory is never free while one of them runs.
//!
//! Minimum kernel: 5.7 (cgroup programs attached with BPF links).

use std::{
    collections::HashMap,
    os::fd::{AsFd, AsRawFd, OwnedFd},
    path::PathBuf,
    sync::Arc,
};

use aya::programs::links::FdLink;
use lb_common::{PROG_NAMES, SockKey};
use tracing::info;

use super::{Datapath, DatapathError, Parts, Pins, credit, maps::Maps};

/// The name under which the pin directory's locked descriptor travels with the maps.
const PIN_LOCK: &str = "pin-dir-lock";

/// A cgroup link this process holds: attached by it, or handed over by the lb before it.
#[derive(Debug)]
pub(super) enum HeldLink {
    /// Attached by this process.
    Loaded(FdLink),
    /// Handed over (a descriptor of the link).
    Adopted(OwnedFd),
}

impl HeldLink {
    /// A new descriptor of this link.
    fn dup(&self) -> std::io::Result<OwnedFd> {
        match self {
            HeldLink::Adopted(fd) => fd.try_clone(),
            // aya gives an FdLink's descriptor to nobody: open the link again by its id.
            HeldLink::Loaded(link) => {
                let id = link.info().map_err(std::io::Error::other)?.id();
                super::syscall::link_fd_by_id(id)
            }
        }
    }
}

/// What the old process hands over of its data path: descriptors by name.
#[derive(Debug)]
pub struct Export {
    /// Map name and a new descriptor of it.
    pub maps: Vec<(&'static str, OwnedFd)>,
    /// Program name and a new descriptor of its cgroup link.
    pub links: Vec<(&'static str, OwnedFd)>,
}

impl Datapath {
    /// New descriptors of every map and link. This process keeps its own, so a failed
    /// hand-over changes nothing.
    ///
    /// # Errors
    /// [`DatapathError::Dup`]: a descriptor could not be had (out of descriptors).
    pub fn export(&self) -> Result<Export, DatapathError> {
        let mut maps = self.maps.export()?;
        if let Some(fd) = self.pins_lock_fd().map_err(|source| DatapathError::Dup {
            map: PIN_LOCK,
            source,
        })? {
            maps.push((PIN_LOCK, fd));
        }
        let links = self
            .links
            .lock()
            .expect("poisoned")
            .iter()
            .map(|(name, link)| {
                link.dup()
                    .map(|fd| (*name, fd))
                    .map_err(|source| DatapathError::Dup { map: name, source })
            })
            .collect::<Result<_, _>>()?;
        Ok(Export { maps, links })
    }

    /// The data path of the lb that handed it over: its maps and links (by name) attached to
    /// `cgroup`. Nothing is loaded or attached, nothing detaches.
    ///
    /// # Errors
    /// A map missing or of the wrong type; a link of an unknown program.
    pub fn adopt(
        cfg: &crate::config::DatapathConfig,
        mut maps: HashMap<String, OwnedFd>,
        links: Vec<(String, OwnedFd)>,
        cgroup: PathBuf,
        connect_missing: Option<String>,
    ) -> Result<Datapath, DatapathError> {
        let own_cookie = super::probe::own_netns_cookie();
        let pins = maps.remove(PIN_LOCK).map(Pins::from_lock_fd).transpose()?;
        let (maps, rings) = Maps::from_fds(maps)?;
        // Before 5.14 the old process learned the cookie through the connect program, which
        // left it in the probe map.
        let own_netns = match own_cookie {
            Ok(cookie) => cookie,
            Err(e) => maps
                .connect_netns_probe
                .get(lb_common::PROBE_COOKIE)
                .ok()
                .filter(|c| *c != 0)
                .ok_or(e)?,
        };
        let mut held = Vec::new();
        for (name, fd) in links {
            let program = PROG_NAMES
                .iter()
                .copied()
                .find(|p| *p == name)
                .ok_or(DatapathError::Missing("program named in the hand-over"))?;
            held.push((program, HeldLink::Adopted(fd)));
        }
        info!(cgroup = %cgroup.display(), links = held.len(), "kernel data path taken over (maps and links of the previous lb)");
        let spliced = held.iter().any(|(p, _)| *p == lb_common::PROG_SOCKOPS);
        let parts = Parts {
            ebpf: None,
            links: held,
            cgroup,
            maps,
            rings,
            kernel_log: None,
            connect_missing,
            // The programs are the old process's, loaded on this kernel by the same code: its
            // answer then is this one now.
            splice: spliced && super::probe::kernel_reads(cfg).is_some(),
            own_netns,
            pins,
            inherited: true,
            takeover: None,
        };
        Ok(Datapath::assemble(cfg, parts))
    }

    /// Take over a paired connection whose server socket is already in the server sockhash
    /// (left there by the lb that handed it over): lb has copied `copied` bytes of the client's
    /// stream, and redirecting goes on under the counting rule with fresh credit, for the
    /// client socket the kernel holds the flow of (none: it never redirects again).
    pub fn adopt_pair(
        &self,
        key: SockKey,
        server: &(impl AsRawFd + AsFd),
        copied: u64,
    ) -> Arc<credit::Pair> {
        let limit = credit::size_server_socket(server, self.max_buffered);
        let cookie = self.flow(&key).map_or(0, |f| f.cookie);
        let pair = Arc::new(credit::Pair::new(
            key,
            server.as_raw_fd(),
            limit,
            copied,
            cookie,
        ));
        self.pairs
            .lock()
            .expect("poisoned")
            .insert(key, pair.clone());
        self.set_copied(&pair, copied);
        pair
    }

    /// Forget a paired connection in this process only (it is being handed over): the kernel
    /// keeps its sockhash entry and the count lb last published.
    pub fn release(&self, pair: &credit::Pair) {
        self.pairs.lock().expect("poisoned").remove(&pair.key());
    }
}
