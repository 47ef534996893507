//! Health checks against real servers on 127.0.0.1: every check kind (tcp, http, https, tls,
//! tunnel), rise/fall with a server that goes away, the scheduler's intervals, `health.loop =
//! false`, single-flight checks, and the node-wide kill of a loopback connection.

mod support;

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use futures::{SinkExt as _, StreamExt as _};
use lb::{
    addr::ServerAddr,
    balancer::{Balancer, ServerState},
    config::{CheckKind, Config, Dur, HealthConfig, Overrides, StatusMatch},
    health::{CheckError, HealthService},
    metrics::{CheckLabels, Metrics},
    net::Route,
};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::{
    ServerConfig,
    pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer},
    server::WebPkiClientVerifier,
};
use support::{state, wait_server_state};
use tokio::{
    io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _},
    net::TcpListener,
};
use tokio_rustls::TlsAcceptor;
use tokio_tungstenite::tungstenite::Message;
use tokio_util::{sync::CancellationToken, task::TaskTracker};

fn sa(s: &str) -> ServerAddr {
    ServerAddr::parse(s).unwrap()
}

/// One check of `server`, dialed directly.
async fn check_once(cfg: &HealthConfig, server: &str) -> Result<(), CheckError> {
    lb::health::check_once(cfg, &sa(server), &Route::default()).await
}

fn ms(n: u64) -> Dur {
    Dur(Duration::from_millis(n))
}

fn cfg(kind: CheckKind) -> HealthConfig {
    HealthConfig {
        kind,
        timeout: ms(1000),
        ..HealthConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Servers

/// A port on 127.0.0.1 nothing listens on (bound, then closed).
async fn closed_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap()
}

/// Read an HTTP request head (bounded).
async fn read_head<S: AsyncRead + Unpin>(s: &mut S) -> String {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && head.len() < 16 * 1024 {
        match s.read(&mut b).await {
            Ok(1) => head.push(b[0]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&head).into_owned()
}

type Responder = Arc<dyn Fn(&str) -> Vec<u8> + Send + Sync>;

/// An HTTP/1.1 server (over TLS when `tls` is set) answering every request with `reply(head)`;
/// returns its address and the request heads it saw.
async fn http_server(
    tls: Option<TlsAcceptor>,
    reply: Responder,
) -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (tls, reply, seen) = (tls.clone(), reply.clone(), seen2.clone());
            tokio::spawn(async move {
                match tls {
                    Some(acc) => {
                        if let Ok(s) = acc.accept(tcp).await {
                            answer(s, &reply, &seen).await;
                        }
                    }
                    None => answer(tcp, &reply, &seen).await,
                }
            });
        }
    });
    (addr, seen)
}

async fn answer<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    reply: &Responder,
    seen: &Mutex<Vec<String>>,
) {
    let head = read_head(&mut s).await;
    let out = reply(&head);
    seen.lock().unwrap().push(head);
    let _ = s.write_all(&out).await;
    let _ = s.shutdown().await;
}

fn response(code: u16, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {code} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A TLS server that completes handshakes and then waits for the client to leave.
async fn tls_server(acceptor: TlsAcceptor) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acc = acceptor.clone();
            tokio::spawn(async move {
                if let Ok(mut s) = acc.accept(tcp).await {
                    let mut buf = [0u8; 256];
                    while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
                }
            });
        }
    });
    addr
}

/// A test PKI: a CA made now, leaf certificates signed by it, PEM files in a temp directory.
struct Pki {
    dir: PathBuf,
    ca: CertifiedIssuer<'static, KeyPair>,
}

static NEXT_DIR: AtomicU32 = AtomicU32::new(0);

impl Pki {
    fn new(name: &str) -> Pki {
        let dir = std::env::temp_dir().join(format!(
            "lb-health-test-{}-{}",
            std::process::id(),
            NEXT_DIR.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap();
        std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
        Pki { dir, ca }
    }

    fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// A leaf for `sans`; written to `<name>.pem` / `<name>.key`.
    fn leaf(
        &self,
        name: &str,
        sans: &[&str],
        client: bool,
    ) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        let key = KeyPair::generate().unwrap();
        let mut p =
            CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        p.distinguished_name.push(DnType::CommonName, name);
        p.extended_key_usages = vec![if client {
            ExtendedKeyUsagePurpose::ClientAuth
        } else {
            ExtendedKeyUsagePurpose::ServerAuth
        }];
        let cert = p.signed_by(&key, &self.ca).unwrap();
        std::fs::write(self.dir.join(format!("{name}.pem")), cert.pem()).unwrap();
        std::fs::write(self.dir.join(format!("{name}.key")), key.serialize_pem()).unwrap();
        (
            vec![cert.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
    }

    fn roots(&self) -> rustls::RootCertStore {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca.der().clone()).unwrap();
        roots
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn acceptor(mut config: ServerConfig, alpn: &[&str]) -> TlsAcceptor {
    config.alpn_protocols = alpn.iter().map(|p| p.as_bytes().to_vec()).collect();
    TlsAcceptor::from(Arc::new(config))
}

/// Server config with one certificate, optionally requiring client certificates from `pki`.
fn server_config(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    client_ca: Option<&Pki>,
) -> ServerConfig {
    let b = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap();
    let b = match client_ca {
        Some(pki) => b.with_client_cert_verifier(
            WebPkiClientVerifier::builder_with_provider(Arc::new(pki.roots()), provider())
                .build()
                .unwrap(),
        ),
        None => b.with_no_client_auth(),
    };
    b.with_single_cert(chain, key).unwrap()
}

// ---------------------------------------------------------------------------------------------
// tcp

#[tokio::test]
async fn tcp_ok_and_refused() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = listener.local_addr().unwrap().to_string();
    check_once(&cfg(CheckKind::Tcp), &up).await.unwrap();
    let down = closed_port().await.to_string();
    let e = check_once(&cfg(CheckKind::Tcp), &down).await.unwrap_err();
    assert!(
        matches!(&e, CheckError::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused),
        "{e:?}"
    );
}

/// A server that is lb's own listener under another spelling (`0.0.0.0:P`, a mapped address)
/// must fail its check: passing, it would recover, win fail-back and reset clients each round
/// while every dial to it is refused as a loop.
#[tokio::test]
async fn a_check_that_reaches_lbs_own_listener_fails() {
    let listener = TcpListener::bind("0.0.0.0:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    // Nothing else in this test binary listens on a wildcard address.
    lb::net::set_own_listeners(&[listener.local_addr().unwrap()]);
    for spelling in [
        format!("0.0.0.0:{port}"),
        format!("127.0.0.1:{port}"),
        format!("[::ffff:127.0.0.1]:{port}"),
    ] {
        let e = check_once(&cfg(CheckKind::Tcp), &spelling)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("a loop"), "{spelling}: {e}");
    }
}

/// The check target need not be the balanced address: `port` (tcp/tls) and `{host}` (http)
/// reach another port of the same host, as K3s's supervisor on 9345 beside the apiserver.
#[tokio::test]
async fn checks_target_another_port_of_the_server() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let other = listener.local_addr().unwrap().port();
    let balanced = closed_port().await.to_string();
    assert!(check_once(&cfg(CheckKind::Tcp), &balanced).await.is_err());
    let tcp = HealthConfig {
        port: Some(other),
        ..cfg(CheckKind::Tcp)
    };
    check_once(&tcp, &balanced).await.unwrap();
    let (http, heads) = http_server(None, Arc::new(|_: &str| response(200, "pong"))).await;
    let url = format!("http://{{host}}:{}/ping", http.port());
    check_once(&http_cfg(&url), &balanced).await.unwrap();
    assert_eq!(
        heads.lock().unwrap().len(),
        1,
        "the supervisor port got the check"
    );
}

/// A listener whose accept queue is full drops SYNs: the connect hangs and the fixed timeout
/// ends the check. Paused time: the 1 s timeout passes at once.
#[tokio::test(start_paused = true)]
async fn tcp_timeout_is_the_configured_timeout() {
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    sock.bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
        .unwrap();
    sock.listen(0).unwrap();
    let addr = sock.local_addr().unwrap().as_socket().unwrap();
    // Fill the queue (backlog 0 admits one) with connections nobody accepts; the second
    // connect already hangs.
    let mut held = Vec::new();
    for _ in 0..2 {
        if let Ok(s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
            held.push(s);
        }
    }
    assert_eq!(
        held.len(),
        1,
        "backlog 0 should admit exactly one connection"
    );
    let c = HealthConfig {
        timeout: ms(1000),
        ..cfg(CheckKind::Tcp)
    };
    let start = tokio::time::Instant::now();
    let e = check_once(&c, &addr.to_string()).await.unwrap_err();
    assert!(
        matches!(e, CheckError::Timeout(d) if d == Duration::from_secs(1)),
        "{e:?}"
    );
    let took = start.elapsed();
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_millis(1100),
        "{took:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// http

fn http_cfg(url: &str) -> HealthConfig {
    HealthConfig {
        url: Some(url.into()),
        ..cfg(CheckKind::Http)
    }
}

#[tokio::test]
async fn http_status_match_mismatch_and_ranges() {
    let (addr, seen) = http_server(
        None,
        Arc::new(|head: &str| {
            let path = head.split_whitespace().nth(1).unwrap_or("/");
            let code = path
                .strip_prefix("/status/")
                .and_then(|c| c.parse().ok())
                .unwrap_or(200);
            response(code, "ok")
        }),
    )
    .await;
    let server = addr.to_string();
    check_once(&http_cfg("http://{server}/healthz"), &server)
        .await
        .unwrap();
    let head = seen.lock().unwrap()[0].clone();
    assert!(head.starts_with("GET /healthz HTTP/1.1\r\n"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains(&format!("host: {server}\r\n")),
        "{head}"
    );

    let e = check_once(&http_cfg("http://{server}/status/503"), &server)
        .await
        .unwrap_err();
    assert!(matches!(e, CheckError::Status(503)), "{e:?}");

    let mut c = http_cfg("http://{server}/status/401");
    c.expect_status = vec![StatusMatch::Code(200), StatusMatch::Range(400, 403)];
    check_once(&c, &server).await.unwrap();
    c.url = Some("http://{server}/status/200".into());
    check_once(&c, &server).await.unwrap();
    c.url = Some("http://{server}/status/204".into());
    assert!(matches!(
        check_once(&c, &server).await,
        Err(CheckError::Status(204))
    ));
}

#[tokio::test]
async fn http_host_header_and_body() {
    let (addr, seen) = http_server(
        None,
        Arc::new(|_: &str| response(200, "{\"status\":\"serving\"}")),
    )
    .await;
    let server = addr.to_string();
    let mut c = http_cfg("http://{server}/ready");
    c.host = Some("api.internal".into());
    c.expect_body = Some("serving".into());
    check_once(&c, &server).await.unwrap();
    assert!(
        seen.lock().unwrap()[0]
            .to_ascii_lowercase()
            .contains("host: api.internal\r\n")
    );
    c.expect_body = Some("NOT_SERVING".into());
    let e = check_once(&c, &server).await.unwrap_err();
    assert!(
        matches!(&e, CheckError::Body(b) if b == "NOT_SERVING"),
        "{e:?}"
    );
}

#[tokio::test]
async fn http_oversize_response_fails() {
    let big = "x".repeat(10_000);
    let big2 = big.clone();
    // One server declares its length, the other streams chunks without declaring one.
    let (declared, _) = http_server(None, Arc::new(move |_: &str| response(200, &big2))).await;
    let (chunked, _) = http_server(
        None,
        Arc::new(move |_: &str| {
            let mut out =
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                    .to_vec();
            for _ in 0..10 {
                out.extend_from_slice(format!("3e8\r\n{}\r\n", &big[..1000]).as_bytes());
            }
            out.extend_from_slice(b"0\r\n\r\n");
            out
        }),
    )
    .await;
    let mut c = http_cfg("http://{server}/");
    c.max_response_bytes = 4096;
    for addr in [declared, chunked] {
        let e = check_once(&c, &addr.to_string()).await.unwrap_err();
        assert!(matches!(e, CheckError::TooLarge(4096)), "{addr}: {e:?}");
    }
    c.max_response_bytes = 64 * 1024;
    for addr in [declared, chunked] {
        check_once(&c, &addr.to_string()).await.unwrap();
    }
}

#[tokio::test]
async fn http_refused_and_garbage() {
    let down = closed_port().await.to_string();
    assert!(matches!(
        check_once(&http_cfg("http://{server}/"), &down).await,
        Err(CheckError::Io(_))
    ));
    let (addr, _) = http_server(None, Arc::new(|_: &str| b"SSH-2.0-nope\r\n".to_vec())).await;
    let e = check_once(&http_cfg("http://{server}/"), &addr.to_string())
        .await
        .unwrap_err();
    assert!(matches!(e, CheckError::Http(_)), "{e:?}");
}

// ---------------------------------------------------------------------------------------------
// https and tls

#[tokio::test]
async fn https_with_test_ca() {
    let pki = Pki::new("lb test CA");
    let (chain, key) = pki.leaf("server", &["127.0.0.1", "api.test"], false);
    let tls = acceptor(server_config(chain, key, None), &["http/1.1"]);
    let (addr, _) = http_server(Some(tls), Arc::new(|_: &str| response(200, "ok"))).await;
    let server = addr.to_string();
    let mut c = http_cfg("https://{server}/ping");
    c.ca_file = Some(pki.ca_file());
    check_once(&c, &server).await.unwrap();
    // The same server checked through a name in its certificate.
    c.sni = Some("api.test".into());
    check_once(&c, &server).await.unwrap();
    // A name it does not have.
    c.sni = Some("other.test".into());
    let e = check_once(&c, &server).await.unwrap_err();
    assert!(matches!(e, CheckError::Tls(_)), "{e:?}");
    // Another CA.
    let other = Pki::new("other CA");
    c.sni = None;
    c.ca_file = Some(other.ca_file());
    let e = check_once(&c, &server).await.unwrap_err();
    assert!(matches!(e, CheckError::Tls(_)), "{e:?}");
    assert!(e.to_string().contains("certificate"), "{e}");
    c.insecure_skip_verify = true;
    check_once(&c, &server).await.unwrap();
}

/// The server only has a certificate for `api.test` and picks it by SNI: the check reaches it
/// by IP and must send the configured name.
#[tokio::test]
async fn tls_sni_selects_the_certificate() {
    let pki = Pki::new("lb test CA");
    let (chain, key) = pki.leaf("server", &["api.test"], false);
    let ck = rustls::sign::CertifiedKey::from_der(chain, key, &provider()).unwrap();
    let mut resolver = rustls::server::ResolvesServerCertUsingSni::new();
    resolver.add("api.test", ck).unwrap();
    let config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(resolver));
    let addr = tls_server(acceptor(config, &[])).await.to_string();
    let mut c = cfg(CheckKind::Tls);
    c.ca_file = Some(pki.ca_file());
    let e = check_once(&c, &addr).await.unwrap_err();
    assert!(
        matches!(e, CheckError::Tls(_)),
        "no SNI for an IP target: {e:?}"
    );
    c.sni = Some("api.test".into());
    check_once(&c, &addr).await.unwrap();
    // `host` is the fallback for SNI.
    c.sni = None;
    c.host = Some("api.test:6443".into());
    check_once(&c, &addr).await.unwrap();
}

#[tokio::test]
async fn https_client_certificate() {
    let pki = Pki::new("lb test CA");
    let (chain, key) = pki.leaf("server", &["127.0.0.1"], false);
    pki.leaf("client", &["lb"], true);
    let tls = acceptor(server_config(chain, key, Some(&pki)), &["http/1.1"]);
    let (addr, seen) = http_server(Some(tls), Arc::new(|_: &str| response(200, "ok"))).await;
    let server = addr.to_string();
    let mut c = http_cfg("https://{server}/ping");
    c.ca_file = Some(pki.ca_file());
    let e = check_once(&c, &server).await.unwrap_err();
    assert!(
        seen.lock().unwrap().is_empty(),
        "refused without a client certificate: {e}"
    );
    c.cert_file = Some(pki.dir.join("client.pem"));
    c.key_file = Some(pki.dir.join("client.key"));
    check_once(&c, &server).await.unwrap();
    assert_eq!(seen.lock().unwrap().len(), 1);
    // A client certificate from a CA the server does not trust.
    let other = Pki::new("other CA");
    other.leaf("client", &["lb"], true);
    c.cert_file = Some(other.dir.join("client.pem"));
    c.key_file = Some(other.dir.join("client.key"));
    assert!(check_once(&c, &server).await.is_err());
    assert_eq!(seen.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn tls_handshake_ca_and_alpn() {
    let pki = Pki::new("lb test CA");
    let (chain, key) = pki.leaf("server", &["127.0.0.1"], false);
    let addr = tls_server(acceptor(server_config(chain, key, None), &["h2"]))
        .await
        .to_string();
    let mut c = cfg(CheckKind::Tls);
    c.ca_file = Some(pki.ca_file());
    check_once(&c, &addr).await.unwrap();
    c.alpn = vec!["h2".into()];
    check_once(&c, &addr).await.unwrap();
    c.alpn = vec!["x-other".into()];
    let e = check_once(&c, &addr).await.unwrap_err();
    assert!(
        matches!(e, CheckError::Tls(_)),
        "no common ALPN protocol: {e:?}"
    );
    c.alpn = Vec::new();
    let other = Pki::new("other CA");
    c.ca_file = Some(other.ca_file());
    let e = check_once(&c, &addr).await.unwrap_err();
    assert!(matches!(e, CheckError::Tls(_)), "{e:?}");
    c.ca_file = Some(pki.dir.join("missing.pem"));
    let e = check_once(&c, &addr).await.unwrap_err();
    assert!(matches!(e, CheckError::TlsConfig { .. }), "{e:?}");
    // A plain TCP server is no TLS server.
    let plain = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let plain_addr = plain.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = plain.accept().await {
            let _ = s.write_all(b"HTTP/1.1 400 Bad\r\n\r\n").await;
        }
    });
    c.ca_file = Some(pki.ca_file());
    assert!(matches!(
        check_once(&c, &plain_addr).await,
        Err(CheckError::Tls(_))
    ));
}

// ---------------------------------------------------------------------------------------------
// tunnel

/// How the WebSocket server treats its connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WsMode {
    /// Read (so pings get pongs).
    Answer,
    /// Complete the handshake, then never read: pings get no pong, the socket stays open.
    Silent,
}

struct WsServer {
    addr: SocketAddr,
    mode: Arc<Mutex<WsMode>>,
    /// Bumping it closes every open connection.
    drop_all: tokio::sync::watch::Sender<u64>,
    accepted: Arc<AtomicUsize>,
    stop: CancellationToken,
}

impl WsServer {
    async fn start(mode: WsMode) -> WsServer {
        Self::start_on(TcpListener::bind("127.0.0.1:0").await.unwrap(), mode)
    }

    fn start_on(listener: TcpListener, mode: WsMode) -> WsServer {
        let addr = listener.local_addr().unwrap();
        let mode = Arc::new(Mutex::new(mode));
        let (drop_all, _) = tokio::sync::watch::channel(0u64);
        let accepted = Arc::new(AtomicUsize::new(0));
        let stop = CancellationToken::new();
        let (m, d, a, st) = (
            mode.clone(),
            drop_all.clone(),
            accepted.clone(),
            stop.clone(),
        );
        tokio::spawn(async move {
            loop {
                let tcp = tokio::select! {
                    () = st.cancelled() => return,
                    r = listener.accept() => match r { Ok((t, _)) => t, Err(_) => return },
                };
                let mode = *m.lock().unwrap();
                let mut dropped = d.subscribe();
                let a = a.clone();
                let st = st.clone();
                tokio::spawn(async move {
                    let Ok(mut ws) = tokio_tungstenite::accept_async(tcp).await else {
                        return;
                    };
                    a.fetch_add(1, Ordering::Relaxed);
                    loop {
                        tokio::select! {
                            () = st.cancelled() => return,
                            _ = dropped.changed() => return,
                            msg = ws.next(), if mode == WsMode::Answer => match msg {
                                Some(Ok(Message::Text(t))) => { let _ = ws.send(Message::Text(t)).await; }
                                Some(Ok(_)) => {}
                                _ => return,
                            },
                        }
                    }
                });
            }
        });
        WsServer {
            addr,
            mode,
            drop_all,
            accepted,
            stop,
        }
    }

    fn drop_connections(&self) {
        self.drop_all.send_modify(|v| *v += 1);
    }
}

impl Drop for WsServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn tunnel_cfg() -> HealthConfig {
    HealthConfig {
        url: Some("ws://{server}/tunnel".into()),
        timeout: ms(300),
        ..cfg(CheckKind::Tunnel)
    }
}

#[tokio::test]
async fn tunnel_up_refused_and_no_pong() {
    let ok = WsServer::start(WsMode::Answer).await;
    check_once(&tunnel_cfg(), &ok.addr.to_string())
        .await
        .unwrap();
    assert_eq!(ok.accepted.load(Ordering::Relaxed), 1);

    let down = closed_port().await.to_string();
    assert!(matches!(
        check_once(&tunnel_cfg(), &down).await,
        Err(CheckError::Io(_))
    ));

    let silent = WsServer::start(WsMode::Silent).await;
    let start = Instant::now();
    let e = check_once(&tunnel_cfg(), &silent.addr.to_string())
        .await
        .unwrap_err();
    assert!(matches!(e, CheckError::Timeout(_)), "{e:?}");
    assert_eq!(
        silent.accepted.load(Ordering::Relaxed),
        1,
        "the socket was up"
    );
    assert!(start.elapsed() < Duration::from_secs(2));

    // An HTTP server that does not upgrade.
    let (http, _) = http_server(None, Arc::new(|_: &str| response(200, "no ws"))).await;
    assert!(matches!(
        check_once(&tunnel_cfg(), &http.to_string()).await,
        Err(CheckError::WebSocket(_))
    ));
}

fn balancer(servers: &[String], health: HealthConfig) -> Arc<Balancer> {
    let o = Overrides {
        listen: vec!["127.0.0.1:1".parse().unwrap()],
        servers: servers.iter().map(|s| sa(s)).collect(),
        ..Overrides::default()
    };
    let mut b = Config::load(None, &o).unwrap().balancers.remove(0);
    b.health = health;
    Balancer::new(0, b)
}

fn checks(metrics: &Metrics, server: &str, result: &str) -> u64 {
    metrics
        .health_checks
        .get_or_create(&CheckLabels {
            balancer: "default".into(),
            server: server.into(),
            result: result.into(),
        })
        .get()
}

/// The kept tunnel marks its server unhealthy the moment the server drops it (long before the
/// next ping is due), reconnects, and answers on-demand checks with a ping.
#[tokio::test]
async fn kept_tunnel_fails_on_drop_and_reconnects() {
    let ws = WsServer::start(WsMode::Answer).await;
    let server = ws.addr.to_string();
    let h = HealthConfig {
        interval: ms(3000),
        fast_interval: Some(ms(100)),
        timeout: ms(500),
        rise: 1,
        fall: 1,
        ..tunnel_cfg()
    };
    let b = balancer(std::slice::from_ref(&server), h);
    let metrics = Arc::new(Metrics::new());
    let tasks = TaskTracker::new();
    let svc = HealthService::new(metrics.clone(), tasks.clone());
    let cancel = CancellationToken::new();
    svc.start(b.clone(), cancel.clone());
    wait_server_state(&b, &server, ServerState::Preferred, Duration::from_secs(3)).await;
    assert_eq!(ws.accepted.load(Ordering::Relaxed), 1);

    // On demand: a ping over the kept tunnel, no new connection.
    assert!(svc.check_and_record(&b, &sa(&server)).await);
    assert_eq!(ws.accepted.load(Ordering::Relaxed), 1);

    ws.drop_connections();
    let took = wait_server_state(&b, &server, ServerState::Failed, Duration::from_secs(2)).await;
    assert!(
        took < Duration::from_millis(1000),
        "FAILED after {took:?}, interval is 3 s"
    );
    // Reconnect after the backoff (fast_interval).
    wait_server_state(&b, &server, ServerState::Preferred, Duration::from_secs(3)).await;
    assert_eq!(ws.accepted.load(Ordering::Relaxed), 2);

    // Pongs stop while the socket stays up: FAILED within interval + timeout.
    *ws.mode.lock().unwrap() = WsMode::Silent;
    ws.drop_connections();
    wait_server_state(&b, &server, ServerState::Failed, Duration::from_secs(2)).await;
    wait_server_state(&b, &server, ServerState::Preferred, Duration::from_secs(3)).await;
    let start = Instant::now();
    wait_server_state(&b, &server, ServerState::Failed, Duration::from_secs(5)).await;
    assert!(
        start.elapsed() <= Duration::from_millis(3000 + 500 + 300),
        "no pong noticed after {:?}",
        start.elapsed()
    );
    assert!(checks(&metrics, &server, "failure") >= 3);
    cancel.cancel();
    tasks.close();
    tokio::time::timeout(Duration::from_secs(2), tasks.wait())
        .await
        .expect("tunnel tasks end on cancel");
    assert_eq!(metrics.inflight_checks.get(), 0);
}

// ---------------------------------------------------------------------------------------------
// thresholds, scheduler, loop = false, single flight

/// rise = 2, fall = 3 against a real server that goes away and comes back on the same port.
#[tokio::test]
async fn rise_and_fall_with_a_server_going_away() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = addr.to_string();
    let h = HealthConfig {
        rise: 2,
        fall: 3,
        ..cfg(CheckKind::Tcp)
    };
    let b = balancer(std::slice::from_ref(&server), h);
    let svc = HealthService::new(Arc::new(Metrics::new()), TaskTracker::new());
    assert!(svc.check_and_record(&b, &sa(&server)).await);
    assert_eq!(state(&b, &server), ServerState::Recovering);
    assert!(svc.check_and_record(&b, &sa(&server)).await);
    assert_eq!(state(&b, &server), ServerState::Preferred);

    drop(listener);
    for n in 1..=2 {
        assert!(!svc.check_and_record(&b, &sa(&server)).await);
        assert_eq!(
            state(&b, &server),
            ServerState::Preferred,
            "after {n} failures"
        );
    }
    assert!(!svc.check_and_record(&b, &sa(&server)).await);
    assert_eq!(state(&b, &server), ServerState::Failed);

    let _back = TcpListener::bind(addr).await.unwrap();
    assert!(svc.check_and_record(&b, &sa(&server)).await);
    assert_eq!(state(&b, &server), ServerState::Recovering);
    // One failure in between resets the count of successes.
    drop(_back);
    assert!(!svc.check_and_record(&b, &sa(&server)).await);
    let _back = TcpListener::bind(addr).await.unwrap();
    assert!(svc.check_and_record(&b, &sa(&server)).await);
    assert_eq!(state(&b, &server), ServerState::Recovering);
    assert!(svc.check_and_record(&b, &sa(&server)).await);
    assert_eq!(state(&b, &server), ServerState::Preferred);
}

/// The loop checks a healthy server every `interval`, a FAILED one every `down_interval`.
#[tokio::test]
async fn scheduler_intervals_follow_state() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = listener.local_addr().unwrap().to_string();
    let down = closed_port().await.to_string();
    let h = HealthConfig {
        interval: ms(100),
        fast_interval: Some(ms(50)),
        down_interval: Some(ms(1000)),
        rise: 1,
        ..cfg(CheckKind::Tcp)
    };
    let b = balancer(&[up.clone(), down.clone()], h);
    let metrics = Arc::new(Metrics::new());
    let svc = HealthService::new(metrics.clone(), TaskTracker::new());
    let cancel = CancellationToken::new();
    svc.start(b.clone(), cancel.clone());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    cancel.cancel();
    let healthy = checks(&metrics, &up, "success");
    let failed = checks(&metrics, &down, "failure");
    // 1.5 s at 100 ms (up to 10 % shorter): about 15; a loaded machine may lose a few.
    assert!(
        (8..=18).contains(&healthy),
        "healthy server checked {healthy} times"
    );
    // First check at once (FAILED), then every 1 s.
    assert!(
        (1..=3).contains(&failed),
        "failed server checked {failed} times"
    );
    assert_eq!(state(&b, &up), ServerState::Preferred);
    assert_eq!(state(&b, &down), ServerState::Failed);
}

/// `health.loop = false`: nothing runs by itself; a dial (check-before-dial) runs one check.
#[tokio::test(start_paused = true)]
async fn loop_off_checks_only_on_demand() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = listener.local_addr().unwrap().to_string();
    let h = HealthConfig {
        loop_enabled: false,
        interval: ms(100),
        ..cfg(CheckKind::Tcp)
    };
    let b = balancer(std::slice::from_ref(&up), h);
    let metrics = Arc::new(Metrics::new());
    let svc = HealthService::new(metrics.clone(), TaskTracker::new());
    let cancel = CancellationToken::new();
    svc.start(b.clone(), cancel.clone());
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(
        checks(&metrics, &up, "success") + checks(&metrics, &up, "failure"),
        0
    );
    assert_eq!(state(&b, &up), ServerState::Unchecked);
    assert!(svc.before_dial(&b, &sa(&up)).await);
    assert_eq!(checks(&metrics, &up, "success"), 1);
    // Fresh (younger than max_age): no second check.
    assert!(svc.before_dial(&b, &sa(&up)).await);
    assert_eq!(checks(&metrics, &up, "success"), 1);
    cancel.cancel();
}

/// Concurrent callers of the same server share one check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_check_in_flight_per_server() {
    let accepted = Arc::new(AtomicUsize::new(0));
    let acc = accepted.clone();
    let (addr, _) = http_server(
        None,
        Arc::new(move |_: &str| {
            acc.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(200));
            response(200, "ok")
        }),
    )
    .await;
    let server = addr.to_string();
    let b = balancer(
        std::slice::from_ref(&server),
        http_cfg("http://{server}/slow"),
    );
    let metrics = Arc::new(Metrics::new());
    let svc = HealthService::new(metrics.clone(), TaskTracker::new());
    let addr = sa(&server);
    let results = futures::future::join_all((0..8).map(|_| svc.check_and_record(&b, &addr))).await;
    assert!(results.iter().all(|ok| *ok));
    assert_eq!(accepted.load(Ordering::Relaxed), 1);
    assert_eq!(checks(&metrics, &server, "success"), 1);
    assert_eq!(metrics.inflight_checks.get(), 0);
}

// ---------------------------------------------------------------------------------------------
// node-wide kill

/// A loopback connection to a "server" is found and destroyed with SOCK_DESTROY; its owner
/// sees the abort. Skips, saying why, without CAP_NET_ADMIN or kernel support.
#[test]
fn node_kill_destroys_a_loopback_connection() {
    use std::io::Read as _;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let peer = listener.local_addr().unwrap();
    let mut client = std::net::TcpStream::connect(peer).unwrap();
    let (_accepted, _) = listener.accept().unwrap();
    match lb::kill::destroy_peer_sockets(peer) {
        Ok(k) => {
            assert_eq!((k.found, k.destroyed), (1, 1));
            client
                .set_read_timeout(Some(Duration::from_secs(2)))
                .unwrap();
            let err = client.read(&mut [0u8; 8]).unwrap_err();
            assert_eq!(err.raw_os_error(), Some(libc::ECONNABORTED), "{err}");
            // Nothing left to destroy.
            let again = lb::kill::destroy_peer_sockets(peer).unwrap();
            assert_eq!((again.found, again.destroyed), (0, 0));
        }
        Err(lb::kill::KillError::Unsupported) => {
            eprintln!("SKIP node_kill: the kernel refuses SOCK_DESTROY");
        }
        Err(lb::kill::KillError::Destroy(nix::errno::Errno::EPERM)) => {
            eprintln!("SKIP node_kill: needs CAP_NET_ADMIN");
        }
        Err(e) => panic!("node kill failed: {e}"),
    }
}

/// A server with 10,000 registered connections fails its check: every connection's kill
/// switch fires inside the failing `record_check` call, which returns quickly (the proxy's
/// accept loop never waits on it: kills are token cancellations).
#[tokio::test]
async fn failing_check_kills_ten_thousand_connections_quickly() {
    let down = closed_port().await.to_string();
    let b = balancer(std::slice::from_ref(&down), cfg(CheckKind::Tcp));
    let guards: Vec<_> = (0..10_000).map(|_| b.register(&sa(&down), None)).collect();
    assert_eq!(b.connection_count(), 10_000);
    let svc = HealthService::new(Arc::new(Metrics::new()), TaskTracker::new());
    let start = Instant::now();
    assert!(!svc.check_and_record(&b, &sa(&down)).await);
    let took = start.elapsed();
    eprintln!(
        "check + kill of 10,000 connections: {:.1} ms",
        took.as_secs_f64() * 1e3
    );
    assert!(guards.iter().all(|g| g.cancel.is_cancelled()));
    assert_eq!(b.connection_count(), 0);
    assert!(took < Duration::from_secs(1), "took {took:?}");
}

/// A check whose only caller goes away is cancelled: `lb_inflight_checks` drops back at once
/// and no result is recorded; the next caller starts a fresh check.
#[tokio::test]
async fn abandoned_check_is_cancelled() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let heads = Arc::new(AtomicUsize::new(0));
    let h2 = heads.clone();
    // Reads the request, then answers only after 1 s.
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let h = h2.clone();
            tokio::spawn(async move {
                read_head(&mut s).await;
                h.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_secs(1)).await;
                let _ = s.write_all(&response(200, "late")).await;
            });
        }
    });
    let server = addr.to_string();
    let b = balancer(
        std::slice::from_ref(&server),
        HealthConfig {
            timeout: ms(3000),
            ..http_cfg("http://{server}/slow")
        },
    );
    let metrics = Arc::new(Metrics::new());
    let svc = HealthService::new(metrics.clone(), TaskTracker::new());
    let gone = tokio::time::timeout(
        Duration::from_millis(300),
        svc.check_and_record(&b, &sa(&server)),
    )
    .await;
    assert!(gone.is_err(), "the caller gave up");
    assert_eq!(heads.load(Ordering::Relaxed), 1, "the check had started");
    assert_eq!(metrics.inflight_checks.get(), 0);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(
        checks(&metrics, &server, "success") + checks(&metrics, &server, "failure"),
        0
    );
    assert!(b.last_checked(&sa(&server)).is_none());
    // A new caller runs a new check to the end.
    assert!(svc.check_and_record(&b, &sa(&server)).await);
    assert_eq!(heads.load(Ordering::Relaxed), 2);
    assert_eq!(checks(&metrics, &server, "success"), 1);
}
