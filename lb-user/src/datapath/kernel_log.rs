//! Kernel events in lb's own log: the sk_msg program writes aya-log records (target
//! [`KERNEL_LOG_TARGET`], `lb::kernel`) into aya-log's ring buffer (`AYA_LOGS`), and the
//! `lb-kernel-log` thread hands them to the `log` crate, whose records the `tracing` subscriber
//! takes in (the `tracing-log` bridge `lb`'s `init_logging` installs), so they are filtered and
//! formatted like every other line.
//!
//! The level is fixed at load time: lb asks its log filter which levels it enables for
//! `lb::kernel` and writes the most verbose one into aya-log's level global
//! ([`GLOBAL_KERNEL_LOG_LEVEL`](lb_common::GLOBAL_KERNEL_LOG_LEVEL)), 0 when none. That global lives in a frozen map, so the verifier
//! drops every statement above it: with the default filter (`info`, the kernel events are debug)
//! the program carries no logging code and no thread reads the ring. Changing the filter takes a
//! restart.
//!
//! Minimum kernel: 5.8 (ring buffer), below the data path's 5.15.

use std::os::fd::AsFd as _;

use aya::Ebpf;
use aya_log::{EbpfLogger, Level};
use lb_common::KERNEL_LOG_TARGET;
use tracing::{info, warn};

use super::Datapath;

/// The reader of aya-log's ring buffer, forwarding to the global `log` logger.
pub(super) type KernelLogger = EbpfLogger<&'static dyn log::Log>;

/// The value for [`GLOBAL_KERNEL_LOG_LEVEL`](lb_common::GLOBAL_KERNEL_LOG_LEVEL) (aya-log's numbering): 5 when lb's log filter
/// enables trace for [`KERNEL_LOG_TARGET`], 4 for debug, 0 otherwise (also when no subscriber is
/// installed). The kernel programs log at debug and trace only, so the default filter (`info`)
/// leaves every statement off and no thread reading the ring.
pub(super) fn level() -> u8 {
    use tracing::{Level as T, enabled};
    if enabled!(target: KERNEL_LOG_TARGET, T::TRACE) {
        Level::Trace.into()
    } else if enabled!(target: KERNEL_LOG_TARGET, T::DEBUG) {
        Level::Debug.into()
    } else {
        0
    }
}

/// Take aya-log's ring buffer out of the loaded object when `level` (what [`level`] returned)
/// lets any statement run. `None` when it does not, or, with one warning naming why, when the
/// logger cannot start (the map is missing or not a ring buffer); the data path runs on without
/// kernel events either way.
pub(super) fn open(ebpf: &mut Ebpf, level: u8) -> Option<KernelLogger> {
    if level == 0 {
        return None;
    }
    match EbpfLogger::init(ebpf) {
        Ok(logger) => {
            info!(
                kernel_target = KERNEL_LOG_TARGET,
                level, "kernel program events are logged (aya-log)"
            );
            Some(logger)
        }
        Err(e) => {
            warn!(reason = %crate::errors::chain(&e), "kernel program events cannot be logged; the data path runs without them");
            None
        }
    }
}

impl Datapath {
    /// Forward the kernel programs' log records to lb's log on a dedicated thread
    /// (`lb-kernel-log`) until `cancel` fires, waking when records arrive and at least every
    /// 100 ms. Does nothing when kernel logging is off or a second time; a thread that cannot be
    /// spawned is one warning, not an error.
    pub fn start_kernel_log(&self, cancel: tokio_util::sync::CancellationToken) {
        let Some(mut logger) = self.kernel_log.lock().expect("poisoned").take() else {
            return;
        };
        let spawned = std::thread::Builder::new()
            .name("lb-kernel-log".into())
            .spawn(move || {
                while !cancel.is_cancelled() {
                    let mut fds = [nix::poll::PollFd::new(
                        logger.as_fd(),
                        nix::poll::PollFlags::POLLIN,
                    )];
                    let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(100u16));
                    logger.flush();
                }
                logger.flush();
            });
        if let Err(e) = spawned {
            warn!(error = %e, "cannot start the kernel log thread; kernel program events are not logged");
        }
    }
}

#[cfg(test)]
mod tests {
    use lb_common::GLOBAL_KERNEL_LOG_LEVEL;

    use super::*;

    /// lb names aya-log's level global and map as aya-log does.
    #[test]
    fn names_match_aya_log() {
        assert_eq!(GLOBAL_KERNEL_LOG_LEVEL, aya_log::LEVEL);
        assert_eq!(u8::from(Level::Debug), 4);
    }

    /// Without a subscriber (or with one that enables nothing for `lb::kernel`) the kernel level
    /// is 0: every statement off.
    #[test]
    fn level_follows_the_filter() {
        assert_eq!(level(), 0);
        let on = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("info,lb::kernel=debug"))
            .with_writer(std::io::sink)
            .finish();
        tracing::subscriber::with_default(on, || assert_eq!(level(), 4));
        let off = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("debug,lb::kernel=off"))
            .with_writer(std::io::sink)
            .finish();
        tracing::subscriber::with_default(off, || assert_eq!(level(), 0));
        let default = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
            .with_writer(std::io::sink)
            .finish();
        tracing::subscriber::with_default(default, || assert_eq!(level(), 0));
        let trace = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("lb=trace"))
            .with_writer(std::io::sink)
            .finish();
        tracing::subscriber::with_default(trace, || assert_eq!(level(), 5));
    }
}
