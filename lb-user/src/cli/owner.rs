//! Which process listens on an address: the listening socket's inode from `/proc/net/tcp` or
//! `tcp6` (`/proc/net/unix` for a unix socket), then the process holding that inode among `/proc/*/fd`. Best effort: `None` when
//! `/proc` does not tell (another namespace, no permission).

use std::net::{IpAddr, SocketAddr};

/// The pid and command name of the process listening on `addr`.
pub fn listening_process(addr: SocketAddr) -> Option<(u32, String)> {
    process_holding(listening_inode(addr)?)
}

/// The pid and command name of the process listening on the unix socket at `path`.
pub fn unix_listening_process(path: &std::path::Path) -> Option<(u32, String)> {
    let want = path.to_str()?;
    let inode = std::fs::read_to_string("/proc/net/unix")
        .ok()?
        .lines()
        .skip(1)
        .find_map(|l| {
            // Num RefCount Protocol Flags Type St Inode Path; flag 0x10000 is a listener.
            let f: Vec<&str> = l.split_whitespace().collect();
            let listening = u32::from_str_radix(f.get(3)?, 16).ok()? & 0x10000 != 0;
            (listening && *f.get(7)? == want)
                .then(|| f.get(6)?.parse().ok())
                .flatten()
        })?;
    process_holding(inode)
}

/// The first process with a descriptor on socket `inode`.
fn process_holding(inode: u64) -> Option<(u32, String)> {
    let target = format!("socket:[{inode}]");
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == target.as_str()) {
                let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
                return Some((pid, comm.trim().to_string()));
            }
        }
    }
    None
}

/// An address `lb run` would serve is in use already (see [`in_use_message`]).
#[derive(Debug, thiserror::Error)]
#[error("{}", in_use_message(&self.addr, &self.what, self.owner.as_ref().map(|(p, c)| (*p, c.as_str()))))]
pub struct InUse {
    /// The socket address, or a unix socket's path.
    pub addr: String,
    /// What it is in the configuration (`listener of balancer api`, `admin API`).
    pub what: String,
    /// The process holding it (pid, command name), when `/proc` tells.
    pub owner: Option<(u32, String)>,
}

/// Why `lb run` cannot start: `addr` (`what` it is in the configuration; a socket address or
/// a unix socket's path) is in use by `owner` (pid and command name, when `/proc` tells).
/// Another lb gets the advice to upgrade it instead; another program is named; an unknown
/// holder may be either.
pub fn in_use_message(
    addr: impl std::fmt::Display,
    what: &str,
    owner: Option<(u32, &str)>,
) -> String {
    let upgrade = "`lb upgrade` replaces a running lb without dropping connections";
    match owner {
        Some((pid, "lb")) => format!(
            "cannot start: {addr} (this configuration's {what}) is already served by another lb \
             (pid {pid}); {upgrade}"
        ),
        Some((pid, comm)) => format!(
            "cannot start: {addr} (this configuration's {what}) is in use by pid {pid} ({comm}): \
             stop it or choose another address"
        ),
        None => format!(
            "cannot start: {addr} (this configuration's {what}) is in use by a process /proc does \
             not show (another network namespace or user); if it is another lb, {upgrade}"
        ),
    }
}

/// The inode of the socket in state LISTEN bound to `addr`.
fn listening_inode(addr: SocketAddr) -> Option<u64> {
    let file = if addr.is_ipv6() {
        "/proc/net/tcp6"
    } else {
        "/proc/net/tcp"
    };
    let want = hex_addr(addr);
    std::fs::read_to_string(file)
        .ok()?
        .lines()
        .skip(1)
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
            (f.get(1)?.eq_ignore_ascii_case(&want) && *f.get(3)? == "0A")
                .then(|| f.get(9)?.parse().ok())
                .flatten()
        })
}

/// `addr` as `/proc/net/tcp*` writes it: the address as the kernel stores it, each 32-bit word
/// in host byte order, in hex; then the port.
fn hex_addr(addr: SocketAddr) -> String {
    let words: Vec<u32> = match addr.ip() {
        IpAddr::V4(ip) => vec![u32::from_ne_bytes(ip.octets())],
        IpAddr::V6(ip) => ip
            .octets()
            .chunks(4)
            .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    };
    let mut s: String = words.iter().map(|w| format!("{w:08X}")).collect();
    s.push_str(&format!(":{:04X}", addr.port()));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_this_process_listening() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let (pid, _) = listening_process(l.local_addr().unwrap()).unwrap();
        assert_eq!(pid, std::process::id());
        assert_eq!(hex_addr("127.0.0.1:80".parse().unwrap()), "0100007F:0050");
    }

    #[test]
    fn names_who_holds_an_address() {
        let a: SocketAddr = "127.0.0.1:6443".parse().unwrap();
        let what = "listener of balancer api";
        assert_eq!(
            in_use_message(a, what, Some((42, "lb"))),
            "cannot start: 127.0.0.1:6443 (this configuration's listener of balancer api) is \
             already served by another lb (pid 42); `lb upgrade` replaces a running lb without \
             dropping connections"
        );
        assert_eq!(
            in_use_message(a, what, Some((7, "nginx"))),
            "cannot start: 127.0.0.1:6443 (this configuration's listener of balancer api) is in \
             use by pid 7 (nginx): stop it or choose another address"
        );
        let unknown = in_use_message(a, what, None);
        assert!(
            unknown.contains("is in use by a process /proc does not show"),
            "{unknown}"
        );
        assert!(
            unknown.contains("if it is another lb, `lb upgrade`"),
            "{unknown}"
        );
    }

    #[test]
    fn finds_this_process_on_a_unix_socket() {
        let dir = std::env::temp_dir().join(format!("lb-owner-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("admin.sock");
        let _l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let (pid, _) = unix_listening_process(&path).unwrap();
        assert_eq!(pid, std::process::id());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
