//! Dialing through an HTTP CONNECT proxy, and NO_PROXY, against real sockets on loopback; health
//! checks take the same route as client connections.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use lb::{
    addr::{ProxyUrl, ServerAddr},
    balancer::{Balancer, ServerState},
    config::{CheckKind, Config, Overrides},
    health::HealthService,
    metrics::Metrics,
    net::{Route, connect, no_proxy_matches},
};
use tokio::{
    io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader},
    net::{TcpListener, TcpStream},
};

/// A minimal CONNECT proxy: answers 200 and relays, or 403 for targets on port 1.
async fn proxy(listener: TcpListener, connects: Arc<AtomicUsize>) {
    loop {
        let Ok((s, _)) = listener.accept().await else {
            return;
        };
        let connects = connects.clone();
        tokio::spawn(async move {
            let mut r = BufReader::new(s);
            let mut line = String::new();
            r.read_line(&mut line).await.ok()?;
            let target = line.split_whitespace().nth(1)?.to_string();
            loop {
                let mut h = String::new();
                r.read_line(&mut h).await.ok()?;
                if h == "\r\n" {
                    break;
                }
            }
            connects.fetch_add(1, Ordering::SeqCst);
            let mut client = r.into_inner();
            if target.ends_with(":1") {
                client
                    .write_all(b"HTTP/1.1 403 Forbidden\r\n\r\n")
                    .await
                    .ok()?;
                return None;
            }
            let mut upstream = TcpStream::connect(&target).await.ok()?;
            client
                .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                .await
                .ok()?;
            tokio::io::copy_bidirectional(&mut client, &mut upstream)
                .await
                .ok()?;
            Some(())
        });
    }
}

/// Dial `server` as a balancer with `proxy` and `no_proxy` would.
async fn dial_one(server: &str, proxy: Option<&str>, no_proxy: &str) -> std::io::Result<TcpStream> {
    let route = Route {
        proxy: proxy.map(|p| ProxyUrl::parse(p).unwrap()),
        no_proxy: no_proxy.to_string(),
    };
    connect(&ServerAddr::parse(server).unwrap(), &route).await
}

async fn echo_server() -> std::net::SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn dials_through_connect_proxy_unless_no_proxy() {
    let backend = echo_server().await;
    let pl = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy_url = format!("http://{}", pl.local_addr().unwrap());
    let connects = Arc::new(AtomicUsize::new(0));
    tokio::spawn(proxy(pl, connects.clone()));

    let mut s = dial_one(&backend.to_string(), Some(&proxy_url), "")
        .await
        .unwrap();
    s.write_all(b"ping").await.unwrap();
    let mut buf = [0u8; 4];
    s.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"ping");
    assert_eq!(
        connects.load(Ordering::SeqCst),
        1,
        "the dial must go through the proxy"
    );

    // NO_PROXY lists the host: dialed directly, the proxy sees nothing.
    let _direct = dial_one(
        &backend.to_string(),
        Some(&proxy_url),
        "example.org,127.0.0.1",
    )
    .await
    .unwrap();
    assert_eq!(
        connects.load(Ordering::SeqCst),
        1,
        "NO_PROXY host must bypass the proxy"
    );

    // A refusal by the proxy is an error naming it.
    let err = dial_one("127.0.0.1:1", Some(&proxy_url), "")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("403"), "{err}");
}

/// Defect: health checks dialed servers directly even with `balancer.proxy` set, so a server
/// reachable only through the proxy was FAILED (and one reachable directly but not through the
/// proxy looked healthy). Every check kind now connects by the balancer's route.
#[tokio::test]
async fn health_checks_go_through_the_balancers_proxy() {
    let backend = echo_server().await;
    let pl = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy_url = format!("http://{}", pl.local_addr().unwrap());
    let connects = Arc::new(AtomicUsize::new(0));
    tokio::spawn(proxy(pl, connects.clone()));
    let server = ServerAddr::parse(&backend.to_string()).unwrap();
    let refused = ServerAddr::parse("127.0.0.1:1").unwrap();
    let o = Overrides {
        listen: vec!["127.0.0.1:7".parse().unwrap()],
        servers: vec![server.clone(), refused.clone()],
        ..Overrides::default()
    };
    let mut cfg = Config::load(None, &o).unwrap().balancers.remove(0);
    cfg.proxy = Some(ProxyUrl::parse(&proxy_url).unwrap());
    cfg.health.kind = CheckKind::Tcp;
    let b = Balancer::new(0, cfg);
    let svc = HealthService::new(
        Arc::new(Metrics::new()),
        tokio_util::task::TaskTracker::new(),
    );
    assert!(svc.check_and_record(&b, &server).await);
    assert_eq!(
        connects.load(Ordering::SeqCst),
        1,
        "the check went through the proxy"
    );
    // The proxy refuses port 1 (403): the check fails with the proxy's answer.
    assert!(!svc.check_and_record(&b, &refused).await);
    assert_eq!(connects.load(Ordering::SeqCst), 2);
    let st = b.status();
    assert_eq!(st[1].state, ServerState::Failed);
    assert!(
        st[1]
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("403")),
        "{st:?}"
    );
}

#[test]
fn no_proxy_rules() {
    assert!(no_proxy_matches("*", "anything"));
    assert!(no_proxy_matches("example.org", "api.example.org"));
    assert!(no_proxy_matches(".example.org", "api.example.org"));
    assert!(no_proxy_matches("a, b ,c", "b"));
    assert!(!no_proxy_matches("example.org", "example.com"));
    assert!(!no_proxy_matches("", "x"));
}
