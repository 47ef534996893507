//! What a splice test asserts on a kernel without the splice (below 5.15, e.g. Debian 11's
//! 5.10): not a skip, but lb's answer to a splice request there. `--datapath bpf` refuses to
//! start, naming what the kernel lacks, and `--datapath auto` serves every client on the
//! copy path with that reason in `/status` and `lb_datapath_fallback_info`.

use std::time::Duration;

use anyhow::{Result, bail, ensure};

use crate::{Host, Lb, Place, TestCgroup, cgroup_programs, free_port, run_client, splice_kernel};

/// What lb names as missing for the splice below 5.15: the sockops program calls
/// `bpf_get_netns_cookie`, which sockops programs get in 5.15 (lb-user's `probe_splice`).
pub const NO_SPLICE_REASON: &str = "bpf_get_netns_cookie in sockops (5.15+)";

/// Bytes each way through the fallback's copy path.
const BYTES: &str = "1048576";

/// On a kernel the splice runs on ([`splice_kernel`]), false: the caller goes on to test the
/// splice. Below it, assert lb's fallback and return true, so the caller returns having tested
/// that instead:
/// - `--datapath bpf --forwarding splice` exits non-zero naming [`NO_SPLICE_REASON`], and leaves
///   no program on the test's cgroup;
/// - `--datapath auto --forwarding splice` runs the copy path: `/status` says
///   `"datapath": "userspace"` with the reason, `lb_datapath_fallback_info{reason="kernel_feature"}`
///   is 1, and a client in the cgroup moves 1 MiB up and 1 MiB down through it, checked by `lbt`,
///   with no byte spliced.
///
/// # Errors
/// Any of the above not holding, or the test host, cgroup or client failing.
pub fn splice_fallback_asserted() -> Result<bool> {
    if splice_kernel() {
        return Ok(false);
    }
    let host = Host::serving(9000, "s0")?;
    let cg = TestCgroup::new()?;
    let server = host.addr(9000).to_string();
    let cgroup = cg.path.display().to_string();
    let listen = format!("127.0.0.1:{}", free_port()?);
    let args = |mode| {
        [
            "--listen",
            listen.as_str(),
            "--server",
            server.as_str(),
            "--datapath",
            mode,
            "--cgroup",
            cgroup.as_str(),
            "--forwarding",
            "splice",
        ]
    };
    let err = match Lb::start(&args("bpf")) {
        Ok(lb) => bail!(
            "lb --datapath bpf started without the splice: {}",
            lb.log_text()
        ),
        Err(e) => format!("{e:#}"),
    };
    ensure!(
        err.contains(NO_SPLICE_REASON),
        "the refusal should name {NO_SPLICE_REASON:?}: {err}"
    );
    let left = cgroup_programs(&cg.path)?;
    ensure!(
        left.trim().is_empty(),
        "programs left on the cgroup: {left}"
    );

    let lb = Lb::start(&args("auto"))?;
    lb.wait_settled(Duration::from_secs(10))?;
    let st = lb.status()?;
    let why = st["datapath_fallback"].as_str().unwrap_or_default();
    ensure!(st["datapath"] == "userspace", "auto must fall back: {st}");
    ensure!(
        why.contains(NO_SPLICE_REASON),
        "the reason in /status: {why}"
    );
    let kind = lb.metric("lb_datapath_fallback_info", "reason=\"kernel_feature\"");
    ensure!(
        kind == 1.0,
        "lb_datapath_fallback_info{{reason=\"kernel_feature\"}} is {kind}"
    );
    let place = Place::cgroup(&cg.path);
    for action in [["up", BYTES], ["down", BYTES]] {
        let v = run_client(&place, listen.parse()?, &action, Duration::from_secs(120))?;
        ensure!(v["ok"] == true, "{} through the copy path: {v}", action[0]);
    }
    let spliced = lb.metric("lb_spliced_bytes_total", "client_to_server")
        + lb.metric("lb_spliced_bytes_total", "server_to_client");
    ensure!(spliced == 0.0, "{spliced} bytes spliced without the splice");
    eprintln!("no splice on this kernel; asserted lb's fallback: {why}");
    Ok(true)
}
