//! Entry points of the fuzz targets (`fuzz/fuzz_targets/`, run by `cargo xtask fuzz`): each
//! hands bytes from outside to one of lb's own parsers, the one the daemon or the CLI runs on
//! them, and returns that parser's verdict. Not part of lb's interface (hidden from its docs).
//!
//! Parsers behind async I/O read the bytes from an in-memory stream on a current-thread
//! runtime, bounded in time: past [`LIMIT`] the entry panics, so a hang is a finding.

use std::{future::Future, time::Duration};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, DuplexStream};

use crate::{
    addr::ServerAddr,
    config::{CheckKind, Config, CredentialFiles, HealthConfig},
    handover::{Frame, HandoverError},
    health::CheckError,
};

/// Longest an entry may take on one input before it counts as a hang.
pub const LIMIT: Duration = Duration::from_secs(10);

thread_local! {
    /// One runtime per thread, kept across inputs (building one per input costs more than most
    /// parses).
    static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime builds");
}

/// Run `fut` to its end within [`LIMIT`].
///
/// # Panics
/// When `fut` takes longer than [`LIMIT`] (a hang), naming `what`.
fn bounded<T>(what: &str, fut: impl Future<Output = T>) -> T {
    RUNTIME.with(|rt| {
        rt.block_on(async {
            tokio::time::timeout(LIMIT, fut)
                .await
                .unwrap_or_else(|_| panic!("{what}: no verdict within {LIMIT:?} (a hang)"))
        })
    })
}

/// A configuration file's bytes, as `lb config check --skip-files` and `lb run` take them: at
/// most [`crate::files::CONFIG_LIMIT`] bytes of UTF-8, parsed and validated; the credential and
/// token files it names are not read (their reads are bounded in [`crate::files`] and take no
/// part in parsing). Returns how many balancers it defines and its warnings.
///
/// # Errors
/// The message `lb` prints for a refused configuration.
pub fn config(data: &[u8]) -> Result<(usize, Vec<String>), String> {
    if data.len() as u64 > crate::files::CONFIG_LIMIT {
        return Err("over the config file limit".into());
    }
    let text = std::str::from_utf8(data).map_err(|e| e.to_string())?;
    match Config::from_toml_with(text, "<fuzz>", CredentialFiles::Skip) {
        Ok(cfg) => Ok((cfg.balancers.len(), cfg.warnings())),
        Err(e) => Err(crate::cli::config::invalid(None, &e)),
    }
}

/// Raw bytes a client sends the admin API (one or more HTTP/1.1 requests, then its write side
/// closes): served by the admin API's HTTP server, router and request parsers (path, query,
/// body) without a daemon behind them. Returns the raw bytes answered.
///
/// # Panics
/// On a hang (see [`LIMIT`]).
pub fn admin_request(data: &[u8]) -> Vec<u8> {
    bounded("admin request", crate::admin::parse_exchange(data))
}

/// A discovery file's bytes (`kind = "file"`): UTF-8, then one of its three shapes.
///
/// # Errors
/// The reason discovery logs for the file.
pub fn discovery_file(data: &[u8]) -> Result<(Vec<ServerAddr>, Option<ServerAddr>), String> {
    let text = std::str::from_utf8(data).map_err(|e| e.to_string())?;
    crate::discovery::file::parse(text)
}

/// An etcd member list answer's body (`kind = "etcd"`).
///
/// # Errors
/// The reason discovery logs for the answer.
pub fn etcd_members(data: &[u8]) -> Result<Vec<ServerAddr>, String> {
    crate::discovery::etcd::servers_of(data)
}

/// The bytes another lb sends on the hand-over socket (`lb upgrade`), received as one frame:
/// header, JSON message and raw part (no descriptors come with them).
///
/// # Errors
/// [`HandoverError`] as [`crate::handover::recv`] gives it.
///
/// # Panics
/// When no socket pair can be made (descriptors exhausted).
pub fn handover(data: &[u8]) -> Result<Frame, HandoverError> {
    use std::io::Write as _;
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().expect("a unix socket pair");
    let data = data.to_vec();
    // The peer writes from a thread: a frame larger than the socket buffer needs a reader.
    let writer = std::thread::spawn(move || {
        let mut theirs = theirs;
        let _ = theirs.write_all(&data);
    });
    let frame = crate::handover::recv(&ours);
    drop(ours);
    let _ = writer.join();
    frame
}

/// An HTTP CONNECT proxy's answer to lb's `CONNECT` (the head up to its blank line).
///
/// # Errors
/// As [`crate::net::connect`] reports the proxy's refusal or a broken answer.
///
/// # Panics
/// On a hang (see [`LIMIT`]).
pub fn connect_answer(data: &[u8]) -> std::io::Result<()> {
    let mut answer = data;
    bounded(
        "CONNECT answer",
        crate::net::read_connect_answer(&mut answer),
    )
}

/// A stream whose peer, once the first bytes sent to it arrive (the client speaks first: an
/// HTTP request, a ClientHello), sends `answer` and closes its write side, and reads, and drops,
/// whatever else is sent to it. The peer runs on the current runtime.
fn answering(answer: &[u8]) -> DuplexStream {
    let (ours, theirs) = tokio::io::duplex(64 * 1024);
    let answer = answer.to_vec();
    tokio::spawn(async move {
        let (mut rx, mut tx) = tokio::io::split(theirs);
        let mut buf = [0u8; 4096];
        if !rx.read(&mut buf).await.is_ok_and(|n| n > 0) {
            return;
        }
        let send = async {
            let _ = tx.write_all(&answer).await;
            let _ = tx.shutdown().await;
        };
        let drain = async { while rx.read(&mut buf).await.is_ok_and(|n| n > 0) {} };
        tokio::join!(send, drain);
    });
    ours
}

/// The server a check entry checks.
fn checked_server() -> ServerAddr {
    ServerAddr::parse("198.51.100.7:8443").expect("a literal address")
}

/// A server's answer to the `http` check (`GET {url}`, `expect_body = "ok"`, the default
/// `max_response_bytes` and status range), read through hyper as the check reads it.
///
/// # Errors
/// Why the check would mark the server unhealthy.
///
/// # Panics
/// On a hang (see [`LIMIT`]).
pub fn http_check(data: &[u8]) -> Result<(), CheckError> {
    let cfg = HealthConfig {
        kind: CheckKind::Http,
        url: Some("http://{server}/healthz".into()),
        expect_body: Some("ok".into()),
        ..HealthConfig::default()
    };
    let server = checked_server();
    let target = crate::health::http::target(cfg.url.as_deref(), &server, "http", "https")?;
    bounded("http check", async {
        crate::health::http::exchange(&cfg, &target, answering(data)).await
    })
}

/// A server's answer to the `tls` check's ClientHello (`insecure_skip_verify`, so a
/// certificate is taken as it comes but its handshake signature is verified, and `alpn =
/// ["h2"]`), read by rustls as the check reads it.
///
/// # Errors
/// Why the check would mark the server unhealthy.
///
/// # Panics
/// On a hang (see [`LIMIT`]).
pub fn tls_check(data: &[u8]) -> Result<(), CheckError> {
    let cfg = HealthConfig {
        kind: CheckKind::Tls,
        insecure_skip_verify: true,
        alpn: vec!["h2".into()],
        ..HealthConfig::default()
    };
    let host = checked_server().host_str();
    bounded("tls check", async {
        crate::health::tls_verdict(&cfg, &host, answering(data)).await
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A seed of the checked-in corpus (`fuzz/corpus/TARGET/NAME`).
    fn seed(target: &str, name: &str) -> Vec<u8> {
        let path = format!(
            "{}/../fuzz/corpus/{target}/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    #[test]
    fn config_validates_and_names_the_key() {
        let (balancers, _) = config(&seed("config", "k3s-agent.toml")).unwrap();
        assert_eq!(balancers, 1);
        let e = config(b"[[balancer]]\nname = \"a\"\nlisten = [\"127.0.0.1:1\"]\nservers = []\n")
            .unwrap_err();
        assert!(e.starts_with("lb: invalid configuration: "), "{e}");
        assert!(config(b"\xff").is_err());
    }

    #[test]
    fn admin_requests_are_parsed_as_the_handlers_parse_them() {
        let answer =
            String::from_utf8(admin_request(&seed("admin_request", "put-servers.http"))).unwrap();
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        assert!(
            answer.contains(
                r#"k3s: ["198.18.0.2:6443", "api.example:6443"] default Some("198.18.0.9:6443")"#
            ),
            "{answer}"
        );
        let bad =
            b"PUT /balancers/k3s/servers HTTP/1.1\r\nContent-Length: 13\r\n\r\n{\"servers\":7}";
        let answer = String::from_utf8(admin_request(bad)).unwrap();
        assert!(
            answer.starts_with("HTTP/1.1 400 Bad Request\r\n"),
            "{answer}"
        );
        assert!(answer.contains("invalid JSON body"), "{answer}");
        let answer = String::from_utf8(admin_request(
            // The action is checked before the address, as the real handler does.
            b"POST /balancers/k3s/servers/nonsense/explode HTTP/1.1\r\n\r\n",
        ))
        .unwrap();
        assert!(answer.starts_with("HTTP/1.1 404 Not Found\r\n"), "{answer}");
        assert!(answer.contains("no action \\\"explode\\\""), "{answer}");
        let answer = String::from_utf8(admin_request(
            b"POST /balancers/k3s/servers/nonsense/drain HTTP/1.1\r\n\r\n",
        ))
        .unwrap();
        assert!(answer.starts_with("HTTP/1.1 404 Not Found\r\n"), "{answer}");
        assert!(
            answer.contains("server nonsense is not in the set"),
            "{answer}"
        );
        let answer =
            String::from_utf8(admin_request(b"GET /check?timeout=soon HTTP/1.1\r\n\r\n")).unwrap();
        assert!(
            answer.starts_with("HTTP/1.1 400 Bad Request\r\n"),
            "{answer}"
        );
    }

    #[test]
    fn discovery_answers_give_servers() {
        let (servers, default) = discovery_file(&seed("discovery_file", "object.json")).unwrap();
        assert_eq!(servers.len(), 2);
        assert_eq!(default.unwrap().to_string(), "198.18.0.9:6443");
        let servers = etcd_members(&seed("etcd_members", "etcd-3.4.json")).unwrap();
        let servers: Vec<String> = servers.iter().map(ToString::to_string).collect();
        assert_eq!(servers, ["198.18.1.2:2379", "[fd00::3]:2379"]);
    }

    #[test]
    fn handover_frames_are_received() {
        let frame = handover(&seed("handover", "conns.bin")).unwrap();
        assert_eq!(frame.raw, b"unwritten");
        assert!(matches!(
            frame.message,
            crate::handover::Message::Conns { ref conns } if conns.len() == 1
        ));
        assert!(matches!(
            handover(&[0xff; 12]),
            Err(HandoverError::Corrupt(_))
        ));
        assert!(matches!(handover(b""), Err(HandoverError::Closed)));
    }

    #[test]
    fn connect_answers_need_200() {
        assert!(connect_answer(&seed("connect_answer", "200.txt")).is_ok());
        let e = connect_answer(&seed("connect_answer", "407.txt")).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
        assert!(
            e.to_string().contains("407 Proxy Authentication Required"),
            "{e}"
        );
        let e = connect_answer(b"HTTP/1.1 200 OK\r\n").unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    }

    #[test]
    fn tls_answers_are_read_by_rustls() {
        // A handshake_failure alert.
        let e = tls_check(&seed("tls_check", "alert-handshake-failure.bin")).unwrap_err();
        assert!(matches!(e, CheckError::Tls(_)), "{e:?}");
        assert!(e.to_string().contains("HandshakeFailure"), "{e}");
        // A real server's first flight, signed over another ClientHello's random.
        let e = tls_check(&seed("tls_check", "tls12-ecdsa-h2.bin")).unwrap_err();
        assert!(matches!(e, CheckError::Tls(_)), "{e:?}");
    }

    #[test]
    fn http_check_reads_the_answer() {
        let r = http_check(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
        assert!(r.is_ok(), "{r:?}");
        assert!(matches!(
            http_check(b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\n\r\n"),
            Err(CheckError::Status(503))
        ));
        assert!(matches!(
            http_check(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nbad"),
            Err(CheckError::Body(_))
        ));
    }
}
