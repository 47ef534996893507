//! SIGHUP and the server list: a set changed through the admin API survives a reload that
//! touched other keys (its connections too), and an edit of the file's own list takes effect.

use std::{net::SocketAddr, time::Duration};

use anyhow::{Context as _, Result, ensure};
use lb_tests::{Holder, Lb, Place, free_port, http_request, skip_unless_root, wait_until};

fn config(listen: SocketAddr, server: &str, interval: &str) -> String {
    format!(
        r#"
[[balancer]]
name = "b"
listen = ["{listen}"]
servers = ["{server}"]

[balancer.health]
kind = "tcp"
interval = "{interval}"
timeout = "300ms"
rise = 1
"#
    )
}

/// Defect: SIGHUP re-applied the file's `servers` to any balancer whose config changed in any
/// key, discarding a set changed through the API and killing its connections.
#[test]
fn sighup_keeps_the_apis_set_unless_the_files_list_changed() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let hosts = lb_tests::serving_hosts(3, 9000, |i| format!("s{i}"))?;
    let s: Vec<String> = hosts.iter().map(|h| h.addr(9000).to_string()).collect();
    let listen: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
    let dir = std::env::temp_dir().join(format!("lb-reload-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let cfg = dir.join("lb.toml");
    let result = (|| -> Result<()> {
        std::fs::write(&cfg, config(listen, &s[0], "300ms"))?;
        let lb = Lb::start(&[
            "--config",
            cfg.to_str().context("path")?,
            "--datapath",
            "userspace",
        ])?;
        lb.wait_ready(Duration::from_secs(10))?;

        // The API moves the balancer to s1; a client holds a connection there.
        let body = format!(r#"{{"servers": ["{}"]}}"#, s[1]);
        let (code, resp) = http_request(lb.admin, "PUT", "/balancers/b/servers", Some(&body))?;
        ensure!(code == 200, "PUT servers: {code} {resp}");
        wait_until(Duration::from_secs(5), || Ok(lb.get("/readyz")?.0 == 200))?;
        let holder = Holder::start(&Place::default(), listen, 0, 60_000)?;
        let ev = holder.wait_for("connected", Duration::from_secs(10))?;
        ensure!(ev["server"] == "s1", "the client must reach s1: {ev}");

        // A reload that changes another key: the API's set and the connection stay.
        std::fs::write(&cfg, config(listen, &s[0], "400ms"))?;
        lb.signal(nix::sys::signal::Signal::SIGHUP)?;
        wait_until(Duration::from_secs(5), || {
            Ok(lb.log_text().contains("config reloaded"))
        })?;
        ensure!(
            lb.servers("b")? == [s[1].clone()],
            "the API's set must survive the reload: {:?}\n{}",
            lb.servers("b")?,
            lb.log_text()
        );
        ensure!(
            holder.next(Duration::from_millis(1500)).is_err(),
            "the connection to s1 must survive a reload that left the list alone"
        );

        // A reload whose own list changed: the file wins, s1's connection is closed.
        std::fs::write(&cfg, config(listen, &s[2], "400ms"))?;
        lb.signal(nix::sys::signal::Signal::SIGHUP)?;
        wait_until(Duration::from_secs(5), || {
            Ok(lb.servers("b")? == [s[2].clone()])
        })?;
        let ev = holder.next(Duration::from_secs(5))?;
        ensure!(
            ev["event"] != "connected",
            "the removed server's connection must end: {ev}"
        );
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}
