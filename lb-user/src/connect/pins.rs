//! The connect-time pin directory as the daemon opens it before loading: configured, or the
//! default in the bpffs, or none (the programs then stop with lb).

use tracing::{info, warn};

/// The connect-time pin directory `d` names (or the default in the bpffs), opened and locked;
/// `None`, with a warning, when none is configured and no bpffs is mounted or the default one
/// cannot be made: the programs then die with lb.
///
/// # Errors
/// The directory cannot be made or locked (another lb holds it), is not in a bpffs, or holds
/// objects of another layout version; each message says how to proceed.
pub fn open_pins(
    d: &crate::config::DatapathConfig,
) -> anyhow::Result<Option<crate::datapath::Pins>> {
    let Some(dir) = crate::datapath::resolve_dir(d.pin_dir.as_deref()) else {
        warn!(
            "no bpffs is mounted: the connect-time programs are not pinned and stop with lb (mount one at /sys/fs/bpf, or set datapath.pin_dir)"
        );
        return Ok(None);
    };
    let pins = match crate::datapath::Pins::open(&dir) {
        Ok(p) => p,
        // The default directory cannot be made (lb's user may not write the bpffs): unpinned,
        // as without a bpffs. A configured one, another lb's or another layout's is an error.
        Err(e @ crate::datapath::PinError::Dir { .. }) if d.pin_dir.is_none() => {
            warn!(reason = %crate::errors::chain(&e), "the connect-time programs are not pinned and stop with lb (set datapath.pin_dir to a directory lb may write)");
            return Ok(None);
        }
        Err(e) => return Err(e.into()),
    };
    info!(pin_dir = %dir.display(), adopted = pins.adopted(), "connect-time pin directory locked");
    Ok(Some(pins))
}
