//! The file discovery source against a real file and a real balancer: the list appears, a
//! server that leaves is removed with its connection closed, and a missing, empty or broken file
//! leaves the last good set, with the error in the status and the metrics. (DNS and etcd
//! discovery are tested against real dnsmasq and etcd in `tests/tests/discovery.rs`.)

use std::{
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use lb::{
    addr::ServerAddr,
    balancer::{Balancer, KillReason},
    config::{Config, Overrides},
    metrics::Metrics,
};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

fn texts(b: &Balancer) -> Vec<String> {
    b.server_set()
        .servers
        .iter()
        .map(ToString::to_string)
        .collect()
}

/// Poll `cond` every 20 ms for at most 5 s.
async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "timed out: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn write(path: &Path, text: &str) {
    // Written whole and renamed in, as tooling (and a ConfigMap's symlink swap) does.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_source_feeds_the_set_and_keeps_the_last_good_one() {
    let dir = std::env::temp_dir().join(format!("lb-discovery-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let list = dir.join("servers.json");
    let _ = std::fs::remove_file(&list);
    let toml = format!(
        r#"
[[balancer]]
name = "etcd"
listen = ["127.0.0.1:1"]
discovery = {{ kind = "file", path = "{}", interval = "100ms" }}
"#,
        list.display()
    );
    let file = dir.join("lb.toml");
    std::fs::write(&file, toml).unwrap();
    let cfg = Config::load(Some(&file), &Overrides::default()).unwrap();
    let b = Balancer::new(0, cfg.balancers[0].clone());
    assert!(b.server_set().servers.is_empty());
    let metrics = Arc::new(Metrics::new());
    let tasks = TaskTracker::new();
    let cancel = CancellationToken::new();
    lb::discovery::spawn(b.clone(), metrics.clone(), &tasks, cancel.clone());

    // No file yet: an error in the status, no server.
    until("missing file reported", || {
        b.discovery_status()
            .and_then(|s| s.last_error)
            .is_some_and(|e| e.contains("servers.json"))
    })
    .await;
    assert!(b.server_set().servers.is_empty());
    assert!(!b.has_usable_server());

    write(&list, r#"["127.0.0.1:1001", "127.0.0.1:1002"]"#);
    until("first list applied", || {
        texts(&b) == ["127.0.0.1:1001", "127.0.0.1:1002"]
    })
    .await;
    let st = b.discovery_status().unwrap();
    assert_eq!((st.kind.as_str(), st.servers), ("file", 2));
    assert!(st.last_error.is_none() && st.last_success.is_some());

    // A connection to .1002, which then leaves the list: it is closed as removed.
    let guard = b.register(&ServerAddr::parse("127.0.0.1:1002").unwrap(), None);
    assert!(!guard.cancel.is_cancelled());
    write(
        &list,
        r#"{"servers": ["127.0.0.1:1001", "127.0.0.1:1003"], "default": "127.0.0.1:1009"}"#,
    );
    until("second list applied", || {
        texts(&b) == ["127.0.0.1:1001", "127.0.0.1:1003"]
    })
    .await;
    assert!(guard.cancel.is_cancelled());
    assert_eq!(guard.reason(), Some(KillReason::Removed));
    assert_eq!(
        b.default_server().map(|d| d.to_string()).as_deref(),
        Some("127.0.0.1:1009")
    );

    // A file that names no default has none, as a PUT body without one.
    write(
        &list,
        "servers = [\"127.0.0.1:1001\", \"127.0.0.1:1003\"]\n",
    );
    until("default cleared", || b.default_server().is_none()).await;
    assert_eq!(texts(&b), ["127.0.0.1:1001", "127.0.0.1:1003"]);

    // Empty, broken, missing: the last good set stays and the error says why.
    for (text, error) in [
        (Some("[]"), "no server"),
        (Some("[\"127.0.0.1:1001\","), "invalid JSON list"),
        (Some("servers = [\"127.0.0.1:0\"]"), "port"),
        (Some("[\"127.0.0.1:1\"]"), "own listen address"),
        (None, "No such file"),
    ] {
        match text {
            Some(t) => write(&list, t),
            None => std::fs::remove_file(&list).unwrap(),
        }
        until(error, || {
            b.discovery_status()
                .and_then(|s| s.last_error)
                .is_some_and(|e| e.contains(error))
        })
        .await;
        assert_eq!(texts(&b), ["127.0.0.1:1001", "127.0.0.1:1003"], "{error}");
    }
    let st = b.discovery_status().unwrap();
    assert!(st.runs_failed >= 6 && st.runs_ok >= 2, "{st:?}");
    let text = metrics.render(std::slice::from_ref(&b), None);
    for series in [
        "lb_discovery_runs_total{balancer=\"etcd\",kind=\"file\",result=\"ok\"}",
        "lb_discovery_runs_total{balancer=\"etcd\",kind=\"file\",result=\"error\"}",
        "lb_discovery_servers{balancer=\"etcd\",kind=\"file\"} 2",
        "lb_discovery_last_success_timestamp_seconds{balancer=\"etcd\",kind=\"file\"}",
    ] {
        assert!(text.contains(series), "{series} missing from:\n{text}");
    }

    // A reload that edits the seed list while discovery stays keeps the discovered set.
    let mut edited = (*b.config()).clone();
    edited.servers = vec![ServerAddr::parse("127.0.0.1:1007").unwrap()];
    b.replace_config(edited).unwrap();
    assert_eq!(texts(&b), ["127.0.0.1:1001", "127.0.0.1:1003"]);

    // Discovery removed by a reload: the set stays, the status and the series go.
    let mut cfg2 = (*b.config()).clone();
    cfg2.discovery = None;
    cfg2.servers = vec![ServerAddr::parse("127.0.0.1:1001").unwrap()];
    b.replace_config(cfg2).unwrap();
    until("discovery status cleared", || {
        b.discovery_status().is_none()
    })
    .await;
    let text = metrics.render(std::slice::from_ref(&b), None);
    assert!(!text.contains("kind=\"file\""), "stale series:\n{text}");

    cancel.cancel();
    tasks.close();
    tokio::time::timeout(Duration::from_secs(5), tasks.wait())
        .await
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}
