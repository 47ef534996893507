//! Connect-time fail fast, its kernel half: the maps that hold per server the SYN policy lb asks for
//! (`LB_CONNECT_SYN`) and the servers the kernel marked suspect (`LB_CONNECT_SUSPECT`); and the
//! kernel's tick rate (`HZ`), which the SYN timeout is given in.
//!
//! Minimum kernel: as the connect-time programs; the kernel side is in
//! `lb-ebpf/src/connect/failfast.rs`.

use std::{
    net::SocketAddr,
    sync::OnceLock,
    time::{Duration, Instant},
};

use lb_common::{ConnectCountKey, SynPolicy};

use crate::datapath::{
    Datapath, DatapathError,
    keys::{connect_server, server_addr},
};

fn key(id: u32, server: SocketAddr) -> ConnectCountKey {
    ConnectCountKey {
        server: connect_server(server),
        balancer: id,
        _pad: 0,
    }
}

impl Datapath {
    /// Set the SYN policy of balancer `id`'s rewritten connects to `server`.
    ///
    /// # Errors
    /// [`DatapathError::Map`] (the map is full: 4,096 servers of all balancers).
    pub fn set_syn_policy(
        &self,
        id: u32,
        server: SocketAddr,
        policy: SynPolicy,
    ) -> Result<(), DatapathError> {
        self.maps.connect_syn.insert(&key(id, server), &policy)
    }

    /// Delete balancer `id`'s SYN policies and suspect marks of servers not in `keep`.
    /// Returns how many keys were deleted.
    pub fn prune_fail_fast(&self, id: u32, keep: &[SocketAddr]) -> usize {
        let keep: Vec<_> = keep.iter().map(|a| connect_server(*a)).collect();
        let stale = |k: &ConnectCountKey| k.balancer == id && !keep.contains(&k.server);
        self.maps.connect_syn.remove_where(|k, _| stale(k))
            + self.maps.connect_suspect.remove_where(|k, _| stale(k))
    }

    /// Balancer `id`'s servers the kernel marked suspect, with how long ago it marked each
    /// (`CLOCK_BOOTTIME`, as the programs' `bpf_ktime_get_boot_ns`).
    pub fn connect_suspects(&self, id: u32) -> Vec<(SocketAddr, Duration)> {
        let now = super::heartbeat::boottime_ns();
        self.maps
            .connect_suspect
            .entries(|k, _| k.balancer == id)
            .into_iter()
            .filter_map(|(k, at)| {
                Some((
                    server_addr(&k.server)?,
                    Duration::from_nanos(now.saturating_sub(at)),
                ))
            })
            .collect()
    }

    /// Delete the suspect mark of `server` of balancer `id`; whether there was one.
    pub fn clear_suspect(&self, id: u32, server: SocketAddr) -> bool {
        self.maps.connect_suspect.remove(&key(id, server))
    }
}

/// The kernel's tick rate (`CONFIG_HZ`, jiffies per second), measured once: `None` when it
/// cannot be (then lb leaves the kernel's SYN timeout, warning once).
///
/// `sysconf(_SC_CLK_TCK)` is `USER_HZ` (100 whatever `HZ` is), so lb measures: it reads
/// `/proc/timer_list` (root only) twice, 100 ms apart, each time the monotonic clock (`now at N
/// nsecs`) and `jiffies: J` from the same read, and snaps the rate to the nearest of the
/// kernel's choices (`kernel/Kconfig.hz`: 100, 250, 300, 1000) within 10 %. Without
/// `/proc/timer_list` it reads `CONFIG_HZ=` from `/boot/config-$(uname -r)`.
pub fn kernel_hz() -> Option<u32> {
    static HZ: OnceLock<Option<u32>> = OnceLock::new();
    *HZ.get_or_init(|| measure_hz().or_else(config_hz))
}

/// One `(now ns, jiffies)` sample of `/proc/timer_list`.
fn timer_sample() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/timer_list").ok()?;
    let now = text.lines().find_map(|l| {
        l.strip_prefix("now at ")?
            .strip_suffix(" nsecs")?
            .parse()
            .ok()
    })?;
    let jiffies = text
        .lines()
        .find_map(|l| l.strip_prefix("jiffies: ")?.trim().parse().ok())?;
    Some((now, jiffies))
}

fn measure_hz() -> Option<u32> {
    let (n0, j0) = timer_sample()?;
    let began = Instant::now();
    std::thread::sleep(Duration::from_millis(100));
    let (n1, j1) = timer_sample()?;
    let secs = n1.checked_sub(n0)? as f64 / 1e9;
    if secs <= 0.0 || began.elapsed() > Duration::from_secs(2) {
        return None;
    }
    snap_hz(j1.checked_sub(j0)? as f64 / secs)
}

/// The `HZ` choice within 10 % of a measured rate.
fn snap_hz(rate: f64) -> Option<u32> {
    [100u32, 250, 300, 1000]
        .into_iter()
        .find(|&hz| (rate - f64::from(hz)).abs() <= f64::from(hz) * 0.1)
}

fn config_hz() -> Option<u32> {
    let release = nix::sys::utsname::uname().ok()?;
    let path = format!("/boot/config-{}", release.release().to_string_lossy());
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("CONFIG_HZ=")?.trim().parse().ok())
}

/// `d` in jiffies at `hz`, rounded up, at least 1.
pub fn jiffies(d: Duration, hz: u32) -> u32 {
    let j = (d.as_nanos() * u128::from(hz)).div_ceil(1_000_000_000);
    u32::try_from(j).unwrap_or(u32::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hz_snaps_to_the_kernel_choices() {
        assert_eq!(snap_hz(248.0), Some(250));
        assert_eq!(snap_hz(1010.0), Some(1000));
        assert_eq!(snap_hz(99.0), Some(100));
        assert_eq!(snap_hz(500.0), None);
    }

    #[test]
    fn jiffies_round_up() {
        assert_eq!(jiffies(Duration::from_millis(200), 250), 50);
        assert_eq!(jiffies(Duration::from_millis(201), 250), 51);
        assert_eq!(jiffies(Duration::from_millis(1), 100), 1);
        assert_eq!(jiffies(Duration::from_secs(1), 1000), 1000);
    }
}
