//! lb's network namespace cookie on a kernel without `SO_NETNS_COOKIE` (added in 5.14; Debian
//! 11's and Amazon Linux 2's 5.10 lack it). The cookie is what tells lb's own namespace from a
//! pod's (`namespaces = "own"`), and such a kernel gives it only to BPF programs
//! (`bpf_get_netns_cookie`, 5.7 in the connect hooks). So lb asks its connect4 program: it
//! reserves a loopback port nothing listens on, writes it to `LB_CONNECT_NETNS_PROBE`, and
//! starts a copy of itself (`lb netns-probe`) that joins a cgroup made for the purpose under
//! the data path's cgroup and connects to `127.0.0.1` at that port. The program records that
//! socket's namespace cookie and leaves the connect alone (it is refused). The probe process is
//! in lb's namespace, so the cookie is lb's.

use std::{
    net::{Ipv4Addr, SocketAddr, TcpStream},
    path::Path,
    process::{Command, ExitCode, Stdio},
    time::{Duration, Instant},
};

use lb_common::{PROBE_COOKIE, PROBE_PORT};

use crate::datapath::{DatapathError, maps::Maps};

/// How long the probe process may take (it makes one loopback connect).
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The probe's cgroup, removed on drop.
struct ProbeCgroup(std::path::PathBuf);

impl Drop for ProbeCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

fn failed(what: impl std::fmt::Display) -> DatapathError {
    DatapathError::NetnsCookie(std::io::Error::other(format!(
        "learning it from the connect program: {what}"
    )))
}

/// Learn lb's network namespace cookie through the connect4 program (attached to `cgroup`).
/// With `unattached` (this lb's object, whose connect4 is loaded but not yet in the cgroup's
/// links: a rebuild of pinned maps waits to swap them), that program is attached to the probe's
/// own cgroup for the probe's time, so it is this lb's program, on this lb's maps, that sees
/// the probe's connect; nothing else runs in that cgroup.
///
/// # Errors
/// [`DatapathError::NetnsCookie`]: the port, the cgroup or the process could not be made, the
/// process failed or took longer than 5 s, or the program recorded nothing;
/// [`DatapathError::Program`] when the program cannot be attached to the probe's cgroup.
pub(in crate::datapath) fn learn(
    maps: &Maps,
    cgroup: &Path,
    unattached: Option<&mut aya::Ebpf>,
) -> Result<u64, DatapathError> {
    let reserved = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
        .and_then(|s| {
            s.bind(&SocketAddr::from((Ipv4Addr::LOCALHOST, 0)).into())?;
            Ok(s)
        })
        .map_err(failed)?;
    let port = reserved
        .local_addr()
        .ok()
        .and_then(|a| a.as_socket())
        .map(|a| a.port())
        .ok_or_else(|| failed("no loopback port"))?;
    let dir = ProbeCgroup(cgroup.join(format!("lb-netns-probe-{}", std::process::id())));
    std::fs::create_dir(&dir.0).map_err(|e| failed(format!("{}: {e}", dir.0.display())))?;
    // Dropped (detached) before the cgroup is removed.
    let _probe_link = match unattached {
        Some(ebpf) => Some(attach_to(ebpf, &dir.0)?),
        None => None,
    };
    maps.connect_netns_probe.set(PROBE_COOKIE, &0)?;
    maps.connect_netns_probe.set(PROBE_PORT, &u64::from(port))?;
    let ran = run_probe(&dir.0, port);
    maps.connect_netns_probe.set(PROBE_PORT, &0)?;
    ran?;
    match maps.connect_netns_probe.get(PROBE_COOKIE).ok() {
        Some(cookie) if cookie != 0 => Ok(cookie),
        _ => Err(failed("the probe's connect was not seen")),
    }
}

/// Attach `ebpf`'s connect4 program (loaded) to the cgroup `dir` with a link, detached when the
/// link is dropped.
fn attach_to(
    ebpf: &mut aya::Ebpf,
    dir: &Path,
) -> Result<aya::programs::links::FdLink, DatapathError> {
    let file = std::fs::File::open(dir).map_err(|e| failed(format!("{}: {e}", dir.display())))?;
    super::attach::link_connect4(ebpf, &file)
}

/// Start `lb netns-probe` and wait for it, at most [`PROBE_TIMEOUT`].
fn run_probe(cgroup: &Path, port: u16) -> Result<(), DatapathError> {
    let exe = std::env::current_exe().map_err(failed)?;
    let mut child = Command::new(exe)
        .arg("netns-probe")
        .arg("--cgroup")
        .arg(cgroup)
        .args(["--port", &port.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .map_err(failed)?;
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().map_err(failed)? {
            return if status.success() {
                Ok(())
            } else {
                Err(failed(format!("lb netns-probe: {status}")))
            };
        }
        if start.elapsed() > PROBE_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            return Err(failed("lb netns-probe took longer than 5 s"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `lb netns-probe`: join `cgroup`, connect to `127.0.0.1:port` (refused: nothing listens), and
/// exit 0 when the connect was refused as expected, 1 otherwise (with the reason on stderr).
pub fn netns_probe_child(cgroup: &Path, port: u16) -> ExitCode {
    if let Err(e) = std::fs::write(cgroup.join("cgroup.procs"), "0") {
        eprintln!("lb netns-probe: joining {}: {e}", cgroup.display());
        return ExitCode::FAILURE;
    }
    match TcpStream::connect_timeout(
        &SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
        PROBE_TIMEOUT,
    ) {
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => ExitCode::SUCCESS,
        other => {
            eprintln!(
                "lb netns-probe: connect to 127.0.0.1:{port}: expected refused, got {other:?}"
            );
            ExitCode::FAILURE
        }
    }
}
