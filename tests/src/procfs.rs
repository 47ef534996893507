//! What a test reads about a process from `/proc` (its open descriptors, resident memory and
//! threads) and the test process's own open-files limit, for tests that check lb returns to
//! where it was after abuse.

use anyhow::{Context as _, Result, bail};

/// How many descriptors process `pid` has open (`/proc/PID/fd`).
///
/// # Errors
/// The process is gone or its directory unreadable.
pub fn open_fds(pid: u32) -> Result<usize> {
    Ok(std::fs::read_dir(format!("/proc/{pid}/fd"))
        .with_context(|| format!("reading /proc/{pid}/fd"))?
        .count())
}

/// A field of `/proc/PID/status` as a number (`VmRSS` in KiB, `Threads`, ...).
fn status_field(pid: u32, field: &str) -> Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .with_context(|| format!("no {field} in /proc/{pid}/status"))?;
    line.split_whitespace()
        .next()
        .context("empty field")?
        .parse()
        .with_context(|| format!("{field} of /proc/{pid}/status: {line:?}"))
}

/// Resident memory of process `pid` in KiB (`VmRSS`).
///
/// # Errors
/// As [`open_fds`].
pub fn rss_kib(pid: u32) -> Result<u64> {
    status_field(pid, "VmRSS")
}

/// Resident anonymous memory of process `pid` (heap, stacks; `RssAnon`), in KiB.
///
/// # Errors
/// As [`open_fds`].
pub fn rss_anon_kib(pid: u32) -> Result<u64> {
    status_field(pid, "RssAnon")
}

/// Threads of process `pid`.
///
/// # Errors
/// As [`open_fds`].
pub fn threads(pid: u32) -> Result<u64> {
    status_field(pid, "Threads")
}

/// Raise this process's soft open-files limit to at least `want` (and the hard one with it when
/// it is lower, which needs root); returns the soft limit now.
///
/// # Errors
/// The limit cannot be raised that far.
pub fn raise_nofile(want: u64) -> Result<u64> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft >= want {
        return Ok(soft);
    }
    if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, want, hard.max(want)) {
        bail!("cannot raise the open-files limit from {soft}/{hard} to {want}: {e}");
    }
    Ok(want)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() -> Result<()> {
        let me = std::process::id();
        assert!(open_fds(me)? >= 3);
        assert!(rss_kib(me)? > 0);
        assert!(threads(me)? >= 1);
        Ok(())
    }
}
