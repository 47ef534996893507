//! The splice at its edges: a new client socket reusing a reset one's four-tuple before lb took
//! the old pair out, a kTLS client, and a non-blocking client whose sends the kernel takes only
//! in part. Each must keep every byte on its own connection, in order.

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use lb_tests::{
    Holder, Host, Lb, Place, TestCgroup, free_port, run_client, sh, skip, skip_unless_root,
};
use nix::sys::signal::{Signal, kill};

const MIB: u64 = 1024 * 1024;
const T: Duration = Duration::from_secs(120);

/// A test cgroup, one server on :9000 and lb in bpf mode listening on a free loopback port.
struct Fixture {
    cg: TestCgroup,
    host: Host,
    lb: Lb,
    listen: std::net::SocketAddr,
}

impl Fixture {
    fn new() -> Result<Fixture> {
        let cg = TestCgroup::new()?;
        let mut host = Host::new()?;
        host.serve(9000, "s0")?;
        let listen: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        let lb = Lb::bpf_in(
            &cg.path,
            &listen.to_string(),
            &host.addr(9000).to_string(),
            &[],
        )?;
        Ok(Fixture {
            cg,
            host,
            lb,
            listen,
        })
    }

    fn place(&self) -> Place<'_> {
        Place::cgroup(&self.cg.path)
    }
}

/// lb stopped with `SIGSTOP` (it runs no code: whatever it would do about a closed
/// connection waits), continued on drop, also when the test fails.
struct Frozen(nix::unistd::Pid);

impl Frozen {
    fn new(lb: &Lb) -> Result<Frozen> {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(lb.pid())?);
        kill(pid, Signal::SIGSTOP)?;
        Ok(Frozen(pid))
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = kill(self.0, Signal::SIGCONT);
    }
}

/// An old client is paired, then reset while lb cannot take its pair out yet (lb is stopped,
/// as when it waits on a stalled server or a loaded machine); a new socket connects from the
/// same address and port (`SO_REUSEADDR`) and sends. Its bytes must all reach its own server
/// connection, in order: the old pair belongs to the old socket (cookie), so none of them is
/// redirected into the old connection's server socket. Before, the new socket's second send
/// was redirected there (the counting rule matched: the old and new heads are both 3 bytes).
#[test]
fn reused_tuple_is_not_redirected_into_the_old_pair() -> Result<()> {
    if skip_unless_root() || lb_tests::splice_fallback_asserted()? {
        return Ok(());
    }
    let f = Fixture::new()?;
    // Small enough to sit in the loopback buffers while lb is stopped.
    let n = 48 * 1024;
    let mut client =
        Holder::spawn_interactive(&f.place(), f.listen, &["reuse-tuple", &n.to_string()])?;
    client.wait_for("old_ready", Duration::from_secs(20))?;
    lb_tests::wait_until(Duration::from_secs(10), || {
        Ok(f.lb.metric("lb_spliced_connections", "") == 1.0)
    })
    .context("the old connection was never paired")?;
    {
        let _stopped = Frozen::new(&f.lb)?;
        client.say("go")?;
        client
            .wait_for("new_sent", Duration::from_secs(20))
            .context("the new connection could not send while lb was stopped")?;
    }
    client.say("go")?;
    let done = client.wait_for("done", T)?;
    ensure!(
        done["ok"] == true,
        "the new connection's bytes did not all reach its server: {done}"
    );
    let stale = f.lb.metric("lb_splice_fallbacks_total", "stale_pair");
    ensure!(
        stale > 0.0,
        "no send met the old pair (test did not reach the case)"
    );
    eprintln!("reused tuple: {done}; sends that met the old pair: {stale}");
    Ok(())
}

/// A client that turns on kTLS for sending (`TCP_ULP` "tls", `TLS_TX`) after lb paired its
/// connection: its sends reach the sk_msg program as plaintext records, before encryption.
/// The server must receive ciphertext, never the plaintext.
#[test]
fn ktls_client_is_never_spliced_in_plaintext() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    // Loads the module where it is one; built in, or absent, is told by the list below.
    let loaded = sh("modprobe", &["tls"]);
    let ulps = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_ulp").unwrap_or_default();
    if !ulps.split_whitespace().any(|u| u == "tls") {
        skip(&format!(
            "the kernel has no TLS ULP (CONFIG_TLS; tcp_available_ulp: {ulps:?}; modprobe tls: {loaded:?})"
        ));
        return Ok(());
    }
    let f = Fixture::new()?;
    // The same client straight to the server first: a kernel that refuses kTLS on any socket
    // says nothing about lb.
    let direct = run_client(
        &f.place(),
        f.host.addr(9000),
        &["ktls-up", &MIB.to_string()],
        T,
    )?;
    if !direct["ulp_error"].is_null() || !direct["key_error"].is_null() {
        skip(&format!(
            "the kernel refuses kTLS on a plain connection: {direct}"
        ));
        return Ok(());
    }
    let v = run_client(&f.place(), f.listen, &["ktls-up", &MIB.to_string()], T)?;
    if !v["key_error"].is_null() {
        // kTLS works on a plain socket but not on one in lb's sockhash: the kernel keeps
        // plaintext records away from the sk_msg program, so the case cannot occur here.
        eprintln!("kTLS key refused on a socket in lb's sockhash (a plain one took it): {v}");
        return Ok(());
    }
    if !v["ulp_error"].is_null() {
        // The kernel refuses the TLS ULP on a socket in a sockhash: plaintext cannot reach the
        // sk_msg program at all, which is what this test is about.
        eprintln!("kTLS refused on a socket in lb's sockhash, so it cannot be spliced: {v}");
        return Ok(());
    }
    eprintln!(
        "kTLS client: {v}; spliced {}",
        f.lb.metric("lb_spliced_bytes_total", "client_to_server")
    );
    ensure!(
        v["plaintext_at_server"] == false,
        "the server received the kTLS client's plaintext: {v}"
    );
    Ok(())
}

/// A non-blocking client with a small send buffer streams in 1 MB writes while the server
/// stalls, so the kernel takes its sends only in part; after a pause in which lb copies
/// everything, its next bytes must be spliced. Before, the program's byte count drifted from
/// what reached lb: a send the kernel could not push whole was counted whole, and after such a
/// failed push the kernel keeps the pass verdict and pushes the next send without running the
/// program at all (`psock->eval` stays `__SK_PASS`), so it was not counted. lb's copied count
/// then never equalled it, and the connection was never spliced again.
#[test]
fn partial_sends_of_a_nonblocking_client_still_splice() -> Result<()> {
    if skip_unless_root() || lb_tests::splice_fallback_asserted()? {
        return Ok(());
    }
    let f = Fixture::new()?;
    let v = run_client(
        &f.place(),
        f.listen,
        &[
            "nb-burst",
            &(16 * MIB).to_string(),
            &(16 * MIB).to_string(),
            "--chunk",
            "1000000",
            "--stall-ms",
            "500",
            "--gap-ms",
            "1000",
        ],
        T,
    )?;
    ensure!(v["ok"] == true, "client failed: {v}");
    let partial = v["partial_writes"].as_u64().context("partial_writes")?;
    let spliced = f.lb.metric("lb_spliced_bytes_total", "client_to_server");
    let catchup = f.lb.metric("lb_splice_fallbacks_total", "catchup");
    eprintln!("partial sends: {partial}; spliced {spliced}; catch-up fallbacks {catchup}: {v}");
    ensure!(
        partial > 0,
        "no send was taken in part (test did not reach the case): {v}"
    );
    ensure!(
        spliced > 0.0,
        "nothing spliced after the pause: {catchup} sends waited for a catch-up that never came"
    );
    Ok(())
}
