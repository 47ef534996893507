//! `[metrics]` on a real `lb` process: the metrics listener of its own (GET /metrics only), the
//! K3s series of `compat = "k3s"` with K3s's names, label values and buckets, one dial
//! observation per client, and every lb family present before any traffic.
//!
//! Servers live on test hosts in network namespaces (198.18.0.0/15); lb listens on loopback.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Result, ensure};
use lb_tests::{
    Host, Lb, TempDir, free_port, http_get, http_request, lb_bin, output_within, skip_unless_root,
    wait_until,
};

/// Sum of the samples of `name` whose line contains every one of `labels`.
fn sample(body: &str, name: &str, labels: &[&str]) -> Option<f64> {
    let values: Vec<f64> = body
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

fn scrape(addr: SocketAddr) -> Result<String> {
    let (code, body) = http_get(addr, "/metrics")?;
    ensure!(
        code == 200,
        "GET /metrics on {addr} answered {code}: {body}"
    );
    Ok(body)
}

/// Two serving hosts, and lb (userspace copy) in front of them as the balancer `supervisor`
/// with `compat = "k3s"` and `[metrics] listen` on its own loopback port.
fn start(health: &str) -> Result<(Vec<Host>, Lb, SocketAddr, SocketAddr, std::path::PathBuf)> {
    let mut hosts = vec![Host::new()?, Host::new()?];
    for (i, h) in hosts.iter_mut().enumerate() {
        h.serve(9000, &format!("s{i}"))?;
    }
    let listen: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
    let metrics: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
    let text = format!(
        "[datapath]\nmode = \"userspace\"\n\n[metrics]\ncompat = \"k3s\"\nlisten = \"{metrics}\"\n\n\
         [[balancer]]\nname = \"supervisor\"\nlisten = [\"{listen}\"]\nservers = [\"{}\", \"{}\"]\n\n\
         [balancer.health]\nkind = \"tcp\"\n{health}\n",
        hosts[0].addr(9000),
        hosts[1].addr(9000),
    );
    let path = std::env::temp_dir().join(format!(
        "lb-k3s-metrics-{}-{}.toml",
        std::process::id(),
        listen.port()
    ));
    std::fs::write(&path, text)?;
    let lb = Lb::start(&["--config", path.to_str().unwrap_or_default()])?;
    Ok((hosts, lb, listen, metrics, path))
}

/// Every lb family (discovery's aside: no balancer has a discovery source; and the pins' gauge:
/// connect-time is not pinned here) and the K3s series
/// of every server are in `body`, the dial series at 0 with K3s's 15th bucket.
fn present_before_traffic(body: &str, name: &str, servers: &[String]) -> Result<()> {
    let registry = lb::metrics::Metrics::new();
    let missing: Vec<&str> = registry
        .families()
        .map(|(n, _)| n)
        .filter(|n| !n.starts_with("lb_discovery_") && *n != "lb_connect_pins_adopted")
        .filter(|n| !body.contains(&format!("# TYPE {n} ")))
        .collect();
    ensure!(
        missing.is_empty(),
        "families absent before any traffic: {missing:?}\n{body}"
    );
    for s in servers {
        let server = format!("server=\"{s}\"");
        for family in [
            "k3s_loadbalancer_server_health",
            "k3s_loadbalancer_server_connections",
        ] {
            ensure!(
                sample(body, family, &[name, &server]).is_some(),
                "{family} has no series for {s}:\n{body}"
            );
        }
    }
    for status in ["success", "error"] {
        let l = format!("status=\"{status}\"");
        let n = sample(
            body,
            "k3s_loadbalancer_dial_duration_seconds_count",
            &[name, &l],
        );
        ensure!(
            n == Some(0.0),
            "dial count {status} before traffic: {n:?}\n{body}"
        );
        let top = sample(
            body,
            "k3s_loadbalancer_dial_duration_seconds_bucket",
            &[name, &l, "le=\"16.384\""],
        );
        ensure!(top == Some(0.0), "no 16.384 s bucket (K3s's 15th):\n{body}");
    }
    Ok(())
}

/// The metrics listener at `metrics` serves nothing but `GET /metrics`, and cuts off a request
/// head that never finishes after the head timeout (5 s).
fn read_only_and_bounded(metrics: SocketAddr) -> Result<()> {
    // The metrics listener serves nothing else, and changes nothing.
    let (code, _) = http_get(metrics, "/status")?;
    ensure!(
        code == 404,
        "GET /status on the metrics listener answered {code}"
    );
    let (code, _) = http_request(
        metrics,
        "POST",
        "/balancers/supervisor/servers/x/drain",
        None,
    )?;
    ensure!(code == 404, "POST on the metrics listener answered {code}");
    let (code, _) = http_request(metrics, "PUT", "/metrics", None)?;
    ensure!(code == 405, "PUT /metrics answered {code}");

    // A request head that never finishes is cut off after the head timeout (5 s).
    let mut slow = TcpStream::connect_timeout(&metrics, Duration::from_secs(5))?;
    slow.set_read_timeout(Some(Duration::from_secs(30)))?;
    slow.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")?;
    let start = Instant::now();
    let mut out = Vec::new();
    let _ = slow.read_to_end(&mut out);
    let cut = start.elapsed();
    ensure!(
        cut >= Duration::from_secs(4) && cut < Duration::from_secs(15),
        "slow head on the metrics listener closed after {cut:?}"
    );
    Ok(())
}

#[test]
fn k3s_series_on_the_metrics_listener() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    let (hosts, lb, listen, metrics, path) = start("interval = \"200ms\"")?;
    let _ = std::fs::remove_file(&path);
    let name = "name=\"k3s-agent-load-balancer\"";
    let servers: Vec<String> = hosts.iter().map(|h| h.addr(9000).to_string()).collect();

    // Before any traffic: every lb family (discovery's need a discovery source), and K3s's.
    present_before_traffic(&scrape(metrics)?, name, &servers)?;

    // The checks bring both servers to HEALTHY (5) or better.
    wait_until(Duration::from_secs(10), || {
        let states = health_of(&scrape(metrics)?, name, &servers);
        Ok(states.len() == 2 && states.iter().all(|v| *v >= 5.0))
    })?;

    // One client, one dial observation with K3s's status value, one connection counted.
    let mut client = TcpStream::connect_timeout(&listen, Duration::from_secs(5))?;
    client.set_read_timeout(Some(Duration::from_secs(10)))?;
    client.write_all(b"NAME\n")?;
    let mut first = [0u8; 2];
    client.read_exact(&mut first)?;
    ensure!(
        first[0] == b's',
        "the server did not say its name: {first:?}"
    );
    wait_until(Duration::from_secs(10), || {
        let body = scrape(metrics)?;
        let ok = sample(
            &body,
            "k3s_loadbalancer_dial_duration_seconds_count",
            &[name, "status=\"success\""],
        );
        let conns = sample(&body, "k3s_loadbalancer_server_connections", &[name]);
        let active = body
            .lines()
            .filter(|l| l.starts_with("k3s_loadbalancer_server_health{") && l.ends_with(" 7"))
            .count();
        Ok(ok == Some(1.0) && conns == Some(1.0) && active == 1)
    })?;
    let body = scrape(metrics)?;
    let errors = sample(
        &body,
        "k3s_loadbalancer_dial_duration_seconds_count",
        &[name, "status=\"error\""],
    );
    ensure!(errors == Some(0.0), "a dial error counted: {errors:?}");
    ensure!(lb.metric("lb_dial_duration_seconds_count", "status=\"ok\"") >= 1.0);

    read_only_and_bounded(metrics)?;
    Ok(())
}

/// The state numbers of `k3s_loadbalancer_server_health`, one per server of `servers`.
fn health_of(body: &str, name: &str, servers: &[String]) -> Vec<f64> {
    servers
        .iter()
        .filter_map(|s| {
            let server = format!("server=\"{s}\"");
            sample(body, "k3s_loadbalancer_server_health", &[name, &server])
        })
        .collect()
}

#[test]
fn one_compat_observation_per_client_across_servers() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    // Checks every minute: the first server's refusal is found by the dial, not by a check.
    let (mut hosts, lb, listen, metrics, path) =
        start("interval = \"60s\"\nmax_age = \"60s\"\nrise = 1")?;
    let _ = std::fs::remove_file(&path);
    let name = "name=\"k3s-agent-load-balancer\"";
    let servers: Vec<String> = hosts.iter().map(|h| h.addr(9000).to_string()).collect();
    wait_until(Duration::from_secs(10), || {
        let states = health_of(&scrape(metrics)?, name, &servers);
        Ok(states.len() == 2 && states.iter().all(|v| *v >= 5.0))
    })?;
    hosts[0].stop_servers();

    let mut client = TcpStream::connect_timeout(&listen, Duration::from_secs(5))?;
    client.set_read_timeout(Some(Duration::from_secs(20)))?;
    client.write_all(b"NAME\n")?;
    let mut said = [0u8; 2];
    client.read_exact(&mut said)?;
    ensure!(
        &said == b"s1",
        "served by {:?}, not the second server",
        String::from_utf8_lossy(&said)
    );

    let body = scrape(metrics)?;
    let compat = |status: &str| {
        let l = format!("status=\"{status}\"");
        sample(
            &body,
            "k3s_loadbalancer_dial_duration_seconds_count",
            &[name, &l],
        )
    };
    ensure!(
        compat("success") == Some(1.0) && compat("error") == Some(0.0),
        "one client, one K3s observation: success {:?}, error {:?}",
        compat("success"),
        compat("error")
    );
    let own = |status: &str| {
        let l = format!("status=\"{status}\"");
        sample(&body, "lb_dial_duration_seconds_count", &[&l])
    };
    ensure!(
        own("ok") == Some(1.0) && own("error") == Some(1.0),
        "lb's own histogram counts each attempt: ok {:?}, error {:?}",
        own("ok"),
        own("error")
    );
    drop(lb);
    Ok(())
}

#[test]
fn a_bad_metrics_listen_is_refused_naming_the_key() -> Result<()> {
    let dir = TempDir::new("lb-k3s-metrics")?;
    for (listen, why) in [
        ("localhost", "not ADDR:PORT"),
        ("127.0.0.1:9901", "admin.listen"),
    ] {
        let path = dir.join("lb.toml");
        std::fs::write(
            &path,
            format!(
                "[metrics]\nlisten = \"{listen}\"\n\n[[balancer]]\nname = \"a\"\n\
                 listen = [\"127.0.0.1:7001\"]\nservers = [\"198.18.0.2:7001\"]\n"
            ),
        )?;
        let mut cmd = Command::new(lb_bin());
        cmd.args(["config", "check"]).arg(&path);
        let out = output_within(cmd, Duration::from_secs(30))?;
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(
            out.status.code() == Some(2),
            "{listen}: exit {:?}: {err}",
            out.status.code()
        );
        ensure!(
            err.contains("metrics.listen") && err.contains(why),
            "{listen}: the error does not name metrics.listen and {why:?}: {err}"
        );
    }
    Ok(())
}
