//! The ring reader threads: each drains one kernel ring buffer (credit requests, connect-time
//! events) in batches until cancelled, and can be woken and waited for at shutdown.

use std::os::fd::AsFd;

use super::Datapath;

impl Datapath {
    /// Read a ring buffer on a thread named `name` until `cancel` fires, waking at least every
    /// 100 ms: every batch of records `next` drains after a wake-up goes to `handle` (never an
    /// empty one). The credit refresher and the passive-event reader share it; the thread is
    /// kept for [`Datapath::wait_readers`].
    ///
    /// # Errors
    /// The thread could not be spawned.
    pub(super) fn spawn_ring_reader<R, T>(
        &self,
        name: &str,
        cancel: tokio_util::sync::CancellationToken,
        ring: R,
        next: fn(&mut R) -> Option<T>,
        handle: impl FnMut(Vec<T>) + Send + 'static,
    ) -> std::io::Result<()>
    where
        R: std::os::fd::AsFd + Send + 'static,
        T: 'static,
    {
        let (wake, woken) = std::os::unix::net::UnixStream::pair()?;
        let thread = ring_reader(name, cancel, ring, woken, next, handle)?;
        self.readers
            .lock()
            .expect("poisoned")
            .push(Reader { thread, wake });
        Ok(())
    }

    /// Once the ring readers' cancel token fired: wake every reader thread, so it sees it at
    /// once (ending without reading another record), and wait until they all ended, at most
    /// `within` (a batch being handled finishes first). Returns whether they all did.
    pub fn wait_readers(&self, within: std::time::Duration) -> bool {
        use std::io::Write as _;
        let deadline = std::time::Instant::now() + within;
        let mut readers = self.readers.lock().expect("poisoned");
        for r in readers.iter() {
            let _ = (&r.wake).write_all(&[1]);
        }
        while readers.iter().any(|r| !r.thread.is_finished()) {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        for r in readers.drain(..) {
            let _ = r.thread.join();
        }
        true
    }
}

/// A ring reader thread and the socket that wakes it.
pub(super) struct Reader {
    thread: std::thread::JoinHandle<()>,
    /// A byte written here makes the thread's poll return.
    wake: std::os::unix::net::UnixStream,
}

/// The thread of [`Datapath::spawn_ring_reader`].
fn ring_reader<R, T>(
    name: &str,
    cancel: tokio_util::sync::CancellationToken,
    mut ring: R,
    woken: std::os::unix::net::UnixStream,
    next: fn(&mut R) -> Option<T>,
    mut handle: impl FnMut(Vec<T>) + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<()>>
where
    R: std::os::fd::AsFd + Send + 'static,
    T: 'static,
{
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            while !cancel.is_cancelled() {
                let mut fds = [
                    nix::poll::PollFd::new(ring.as_fd(), nix::poll::PollFlags::POLLIN),
                    nix::poll::PollFd::new(woken.as_fd(), nix::poll::PollFlags::POLLIN),
                ];
                if nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(100u16)).is_err() {
                    continue;
                }
                // Cancelled while waiting (a hand-over): what is in the ring is the next
                // process's to read.
                if cancel.is_cancelled() {
                    break;
                }
                let mut batch = Vec::new();
                while let Some(record) = next(&mut ring) {
                    batch.push(record);
                }
                if !batch.is_empty() {
                    handle(batch);
                }
            }
        })
}
