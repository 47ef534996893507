//! How many admin connections are served at once ([`super::MAX_CONNECTIONS`] per listener
//! group), with room kept for a new one: at the limit, the oldest connection with no request in
//! hand (one that has sent nothing yet, is still sending its request head, or waits between
//! keep-alive requests) is closed to make room. Only when every connection is handling a
//! request is the new one closed at accept. So a flood of silent or slow clients cannot keep a
//! probe out: the probe sends its request at once and is answered from a snapshot.

use std::{
    collections::BTreeMap,
    future::Future,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
};

use tokio_util::sync::CancellationToken;

/// The connections of one group of listeners.
#[derive(Debug)]
pub(super) struct Slots {
    limit: usize,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    next: u64,
    /// By admission order, oldest first.
    conns: BTreeMap<u64, Arc<Conn>>,
}

/// One admitted connection: its requests in hand and the token that closes it.
#[derive(Debug, Default)]
struct Conn {
    busy: AtomicUsize,
    close: CancellationToken,
}

/// What [`Slots::admit`] did.
#[derive(Debug)]
pub(super) enum Admission {
    /// Room was free.
    Admitted(Slot),
    /// The oldest idle connection was closed to make room.
    Replaced(Slot),
    /// Every connection is handling a request: close the new one.
    Full,
}

impl Slots {
    /// Room for `limit` connections.
    pub(super) fn new(limit: usize) -> Arc<Slots> {
        Arc::new(Slots {
            limit,
            inner: Mutex::new(Inner::default()),
        })
    }

    /// Admit a new connection, closing the oldest idle one when at the limit.
    pub(super) fn admit(self: &Arc<Self>) -> Admission {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let mut replaced = false;
        if inner.conns.len() >= self.limit {
            let idle = inner
                .conns
                .iter()
                .find(|(_, c)| c.busy.load(Ordering::Relaxed) == 0)
                .map(|(id, _)| *id);
            let Some(old) = idle.and_then(|id| inner.conns.remove(&id)) else {
                return Admission::Full;
            };
            old.close.cancel();
            replaced = true;
        }
        let id = inner.next;
        inner.next += 1;
        let conn = Arc::new(Conn::default());
        inner.conns.insert(id, conn.clone());
        let slot = Slot {
            id,
            conn,
            slots: self.clone(),
        };
        if replaced {
            Admission::Replaced(slot)
        } else {
            Admission::Admitted(slot)
        }
    }

    /// Connections admitted and not yet gone or replaced.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.lock().map(|i| i.conns.len()).unwrap_or(0)
    }
}

/// A connection's place, given back on drop.
#[derive(Debug)]
pub(super) struct Slot {
    id: u64,
    conn: Arc<Conn>,
    slots: Arc<Slots>,
}

impl Slot {
    /// Resolves when the connection is closed to make room for a newer one.
    pub(super) async fn replaced(&self) {
        self.conn.close.cancelled().await;
    }

    /// `service` with this connection marked busy while it handles each request.
    pub(super) fn track<S>(&self, service: S) -> Tracked<S> {
        Tracked {
            inner: service,
            conn: self.conn.clone(),
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut inner = self.slots.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.conns.remove(&self.id);
    }
}

/// A request in hand, counted while it lives.
struct Busy(Arc<Conn>);

impl Busy {
    fn enter(conn: &Arc<Conn>) -> Busy {
        conn.busy.fetch_add(1, Ordering::Relaxed);
        Busy(conn.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A hyper service whose connection counts as busy from a request's head until its answer.
#[derive(Debug)]
pub(super) struct Tracked<S> {
    inner: S,
    conn: Arc<Conn>,
}

impl<S, R> hyper::service::Service<R> for Tracked<S>
where
    S: hyper::service::Service<R>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn call(&self, req: R) -> Self::Future {
        let busy = Busy::enter(&self.conn);
        let answer = self.inner.call(req);
        Box::pin(async move {
            let r = answer.await;
            drop(busy);
            r
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(a: Admission) -> Slot {
        match a {
            Admission::Admitted(s) | Admission::Replaced(s) => s,
            Admission::Full => panic!("no room"),
        }
    }

    #[test]
    fn at_the_limit_the_oldest_idle_connection_makes_room() {
        let slots = Slots::new(3);
        let a = slot(slots.admit());
        let b = slot(slots.admit());
        let c = slot(slots.admit());
        assert_eq!(slots.len(), 3);
        // a is handling a request: b, the oldest idle one, is closed for d.
        let busy = Busy::enter(&a.conn);
        let d = match slots.admit() {
            Admission::Replaced(d) => d,
            other => panic!("{other:?}"),
        };
        assert!(b.conn.close.is_cancelled() && !a.conn.close.is_cancelled());
        assert_eq!(slots.len(), 3);
        drop(b);
        assert_eq!(slots.len(), 3, "a replaced slot is not given back twice");
        // Every one busy: the new one is refused.
        let (_c, _d) = (Busy::enter(&c.conn), Busy::enter(&d.conn));
        assert!(matches!(slots.admit(), Admission::Full));
        // The request ends: a is idle again and makes room.
        drop(busy);
        assert!(matches!(slots.admit(), Admission::Replaced(_)));
        assert!(a.conn.close.is_cancelled());
        drop((a, c, d));
        assert_eq!(slots.len(), 0);
    }
}
