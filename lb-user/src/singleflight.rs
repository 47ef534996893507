//! Single flight: callers asking for the same work while it runs share one run of it, and a
//! run nobody waits for any more is dropped (cancelled). Health checks (one check per server in
//! flight, whoever asks: the scheduler, a dial, `/check`) and `/check` runs use it.

use std::{
    collections::HashMap,
    hash::Hash,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use futures::{
    FutureExt as _,
    future::{BoxFuture, Shared, WeakShared},
};

/// A run as its callers hold it: a clone per caller; the last clone dropped cancels the run.
pub type Run<T> = Shared<BoxFuture<'static, T>>;

/// One run in the map: its id (which tells a finished run from its successor), its meta, and a
/// weak handle, so the map never keeps a run alive.
type Slot<M, T> = (u64, M, WeakShared<BoxFuture<'static, T>>);

/// The runs in flight, by key, each with a caller-chosen meta (e.g. when it started).
pub struct SingleFlight<K, T: Clone, M = ()> {
    runs: Arc<Mutex<HashMap<K, Slot<M, T>>>>,
    next: AtomicU64,
}

impl<K, T: Clone, M> std::fmt::Debug for SingleFlight<K, T, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SingleFlight").finish_non_exhaustive()
    }
}

impl<K, T: Clone, M> Default for SingleFlight<K, T, M> {
    fn default() -> Self {
        SingleFlight {
            runs: Arc::new(Mutex::new(HashMap::new())),
            next: AtomicU64::new(0),
        }
    }
}

impl<K, T, M> SingleFlight<K, T, M>
where
    K: Eq + Hash + Clone + Send + 'static,
    T: Clone + Send + Sync + 'static,
    M: Clone + Send + 'static,
{
    /// Join the run of `key` in flight, or start `start()` as a new one with `meta()` (e.g. its
    /// start time, taken before `start` is called). Returns the run's meta, whether it was joined, and the run to await. The
    /// run leaves the map when it finishes, so a later caller starts afresh.
    pub fn join(
        &self,
        key: K,
        meta: impl FnOnce() -> M,
        start: impl FnOnce() -> BoxFuture<'static, T>,
    ) -> (M, bool, Run<T>) {
        let mut runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, m, weak)) = runs.get(&key)
            && let Some(run) = weak.upgrade()
        {
            return (m.clone(), true, run);
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        // Meta first: `start` may already run the work (on another thread), and a start time
        // taken after it would postdate results the run recorded.
        let m = meta();
        let work = start();
        let map = self.runs.clone();
        let k = key.clone();
        let run = async move {
            let out = work.await;
            let mut runs = map.lock().unwrap_or_else(|p| p.into_inner());
            if runs.get(&k).is_some_and(|(i, _, _)| *i == id) {
                runs.remove(&k);
            }
            out
        }
        .boxed()
        .shared();
        if let Some(weak) = run.downgrade() {
            runs.insert(key, (id, m.clone(), weak));
        }
        (m, false, run)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    #[tokio::test]
    async fn callers_share_one_run_and_the_last_one_cancels_it() {
        let flights: SingleFlight<&str, u32> = SingleFlight::default();
        let started = Arc::new(AtomicUsize::new(0));
        let (gate_tx, gate_rx) = tokio::sync::oneshot::channel::<()>();
        let gate = Arc::new(Mutex::new(Some(gate_rx)));
        let start = || {
            let started = started.clone();
            let gate = gate.clone();
            move || {
                async move {
                    started.fetch_add(1, Ordering::SeqCst);
                    let rx = gate.lock().unwrap().take();
                    if let Some(rx) = rx {
                        let _ = rx.await;
                    }
                    7
                }
                .boxed()
            }
        };
        let (_, joined_a, a) = flights.join("k", || (), start());
        let (_, joined_b, b) = flights.join("k", || (), start());
        assert!(!joined_a && joined_b);
        gate_tx.send(()).unwrap();
        assert_eq!((a.await, b.await), (7, 7));
        assert_eq!(started.load(Ordering::SeqCst), 1, "one run for both");
        // Finished: the next caller starts a new run.
        let (_, joined, c) = flights.join("k", || (), start());
        assert!(!joined);
        assert_eq!(c.await, 7);
        assert_eq!(started.load(Ordering::SeqCst), 2);
        // Abandoned: dropping every caller drops the run, and a new caller starts afresh.
        let (_, _, d) = flights.join("k", || (), || futures::future::pending().boxed());
        drop(d);
        let (_, joined, _e) = flights.join("k", || (), || futures::future::pending().boxed());
        assert!(!joined, "a run nobody waits for is gone");
    }
}
