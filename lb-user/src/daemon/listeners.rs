//! The balancers' listeners: bound (or taken over from the lb being replaced), registered with
//! the kernel programs, and served once the daemon may accept.

use std::{collections::HashMap, net::SocketAddr, os::fd::OwnedFd, sync::Arc};

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::info;

use super::Daemon;
use crate::{balancer::Balancer, config::Forwarding, proxy};

/// A bound listener and the balancer it serves.
pub(super) type Bound = (Arc<Balancer>, SocketAddr, TcpListener);

/// Bind every listener of `balancers`, or take the one handed over in `inherited` (removed from
/// it), and keep a copy of each for a later hand-over.
///
/// # Errors
/// A bind failed or a handed-over socket is unusable (named with the balancer and address).
pub(super) fn bind(
    balancers: &[Arc<Balancer>],
    inherited: &mut HashMap<SocketAddr, OwnedFd>,
) -> anyhow::Result<Vec<Bound>> {
    let mut bound = Vec::new();
    for b in balancers {
        for addr in &b.config().listen {
            let l = match inherited.remove(addr) {
                Some(fd) => TcpListener::from_std(fd.into())
                    .with_context(|| format!("balancer {}: handed-over listener {addr}", b.name))?,
                None => proxy::bind(*addr)
                    .with_context(|| format!("balancer {}: cannot listen on {addr}", b.name))?,
            };
            crate::handover::remember(
                crate::handover::ListenerKey::Proxy(*addr),
                std::os::fd::AsFd::as_fd(&l),
            )
            .with_context(|| format!("keeping a copy of listener {addr}"))?;
            bound.push((b.clone(), *addr, l));
        }
    }
    Ok(bound)
}

impl Daemon {
    /// Serve each of `bound` once `go` fires; each can be stopped at shutdown.
    pub(super) fn serve(&self, bound: Vec<Bound>, go: &CancellationToken) {
        for (b, addr, l) in bound {
            let stop = CancellationToken::new();
            self.listeners
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((addr, stop.clone()));
            let (b2, ctx2, go2) = (b.clone(), self.proxy.clone(), go.clone());
            tokio::spawn(async move {
                go2.cancelled().await;
                proxy::serve(l, b2, ctx2, stop).await;
            });
            info!(balancer = %b.name, listen = %addr, "listening");
        }
    }

    /// Tell the kernel programs which network namespaces each balancer acts in (before its
    /// listeners, so no socket of another namespace is claimed meanwhile), which listener
    /// belongs to which balancer id, and which of them are connect-time (a listener that moved to a splice balancer in an upgrade is taken out
    /// of the connect-time map). A fresh lb does it at start; a new lb taking over once the old
    /// one let go (`Stopped`), so a failed hand-over leaves the old one's maps as they were.
    ///
    /// # Errors
    /// A map write failed (named with the listener).
    pub fn register_listeners(&self) -> anyhow::Result<()> {
        let Some(dp) = &self.datapath else {
            return Ok(());
        };
        self.write_namespaces()?;
        let mut connect_listeners = Vec::new();
        for b in self.balancers.load().iter() {
            let connect = self
                .forwarding
                .get(&b.name)
                .is_some_and(|f| f.0 == Forwarding::Connect);
            for addr in &b.config().listen {
                dp.add_listener(*addr, b.id)
                    .with_context(|| format!("registering listener {addr}"))?;
                if connect {
                    dp.add_connect_listener(*addr, b.id)
                        .with_context(|| format!("registering connect-time listener {addr}"))?;
                    connect_listeners.push(*addr);
                } else {
                    dp.remove_connect_listener(*addr);
                }
            }
        }
        // Listeners an earlier lb left in pinned maps that this config no longer has.
        let stale = dp.retain_connect_listeners(&connect_listeners);
        // For the next lb that adopts the pins: which balancer holds each id.
        let ids: Vec<(String, u32)> = self
            .balancers
            .load()
            .iter()
            .map(|b| (b.name.clone(), b.id))
            .collect();
        // An older build's control map (handed over by `lb upgrade`) has no room for them; the
        // next restart finds it of another definition and rebuilds it.
        if let Err(e) = dp.write_balancer_ids(&ids, &self.retired_ids) {
            tracing::warn!(error = %crate::errors::chain(&e), "balancer ids not recorded in the connect-time control map (an older lb's, handed over); the next restart rebuilds it");
        }
        if stale > 0 {
            tracing::info!(stale, "connect-time listeners of an earlier lb forgotten");
        }
        Ok(())
    }

    /// Write each balancer's network namespace scope (`namespaces`) to the kernel programs: at
    /// start, and again at a reload that changed it.
    ///
    /// # Errors
    /// A map write failed (named with the balancer).
    pub(super) fn write_namespaces(&self) -> anyhow::Result<()> {
        let Some(dp) = &self.datapath else {
            return Ok(());
        };
        let cfg = self.config.load();
        for b in self.balancers.load().iter() {
            let namespaces = cfg.namespaces_of(&b.config());
            dp.set_namespaces(b.id, namespaces)
                .with_context(|| format!("balancer {}: writing its namespace scope", b.name))?;
        }
        Ok(())
    }
}
