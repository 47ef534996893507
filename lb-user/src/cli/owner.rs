//! Which process listens on an address: the listening socket's inode from `/proc/net/tcp` or
//! `tcp6`, then the process holding that inode among `/proc/*/fd`. Best effort: `None` when
//! `/proc` does not tell (another namespace, no permission).

use std::net::{IpAddr, SocketAddr};

/// The pid and command name of the process listening on `addr`.
pub fn listening_process(addr: SocketAddr) -> Option<(u32, String)> {
    let inode = listening_inode(addr)?;
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

/// Why `lb run` cannot start: `addr` (`what` it is in the configuration) is in use by `owner`
/// (pid and command name, when `/proc` tells). Another lb gets the advice to upgrade it instead;
/// another program is named; an unknown holder may be either.
pub fn in_use_message(addr: SocketAddr, what: &str, owner: Option<(u32, &str)>) -> String {
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
}
