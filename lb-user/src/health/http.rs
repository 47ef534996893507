//! The `http` check: GET the URL template with `{server}` replaced, over http or https, with a
//! Host header; the status must match `expect_status`, the body must contain `expect_body`, and
//! the response may not exceed `max_response_bytes`.

use http_body_util::Empty;
use hyper::{
    Request, Uri,
    body::Bytes,
    header::{CONNECTION, HOST, USER_AGENT},
};
use tokio::io::{AsyncRead, AsyncWrite};

use super::{CheckError, connect_tcp, tls};
use crate::config::{HealthConfig, StatusMatch};
use crate::{addr::ServerAddr, net::Route};

/// `User-Agent` of checks.
const USER_AGENT_VALUE: &str = concat!("lb-health/", env!("CARGO_PKG_VERSION"));

/// A parsed check target: where to connect and what to send.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Target {
    /// `https` / `wss`.
    pub(super) tls: bool,
    /// Host as in the URL (brackets removed from IPv6).
    pub(super) host: String,
    /// `host:port` to connect to.
    pub(super) connect: String,
    /// The URL's authority (default Host header).
    pub(super) authority: String,
    /// Path and query.
    pub(super) path: String,
}

/// Expand `{server}`, `{host}` and `{port}` in `template` ([`ServerAddr::fill`]) and split
/// the URL. `secure`/`plain` are the schemes allowed
/// (`https`/`http` or `wss`/`ws`).
///
/// # Errors
/// [`CheckError::Url`] for a missing URL, another scheme or an unparsable one.
pub(crate) fn target(
    template: Option<&str>,
    server: &ServerAddr,
    plain: &str,
    secure: &str,
) -> Result<Target, CheckError> {
    let template = template.ok_or_else(|| CheckError::Url {
        url: String::new(),
        reason: "no url configured".into(),
    })?;
    let url = server.fill(template);
    let bad = |reason: &str| CheckError::Url {
        url: url.clone(),
        reason: reason.into(),
    };
    let uri: Uri = url
        .parse()
        .map_err(|e: hyper::http::uri::InvalidUri| bad(&e.to_string()))?;
    let tls = match uri.scheme_str() {
        Some(s) if s == secure => true,
        Some(s) if s == plain => false,
        _ => return Err(bad(&format!("scheme must be {plain} or {secure}"))),
    };
    let authority = uri.authority().ok_or_else(|| bad("no host"))?;
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let port = authority.port_u16().unwrap_or(if tls { 443 } else { 80 });
    let connect = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    Ok(Target {
        tls,
        host: host.to_string(),
        connect,
        authority: authority.as_str().to_string(),
        path: uri
            .path_and_query()
            .map_or_else(|| "/".to_string(), |p| p.as_str().to_string()),
    })
}

/// Where to connect for `t`: for a name pinned to one of its addresses whose URL names that
/// host (`{server}` or `{host}`), the pinned address at the URL's port; else the URL's
/// `host:port`.
pub(super) fn connect_to(t: &Target, server: &ServerAddr) -> String {
    match server.pin() {
        Some(_) if t.host == server.host_str() => {
            let port = t
                .connect
                .rsplit_once(':')
                .and_then(|(_, p)| p.parse().ok())
                .unwrap_or(server.port());
            server.with_port(port).as_str().to_string()
        }
        _ => t.connect.clone(),
    }
}

/// Whether `code` is accepted; an empty list accepts 200-299.
pub(super) fn status_ok(expect: &[StatusMatch], code: u16) -> bool {
    if expect.is_empty() {
        (200..=299).contains(&code)
    } else {
        expect.iter().any(|m| m.matches(code))
    }
}

/// Run the http check of `server` (the caller bounds it by the timeout).
///
/// # Errors
/// Why the server is unhealthy.
pub(super) async fn check(
    cfg: &HealthConfig,
    server: &ServerAddr,
    route: &Route,
) -> Result<(), CheckError> {
    let t = target(cfg.url.as_deref(), server, "http", "https")?;
    let tcp = connect_tcp(&connect_to(&t, server), route).await?;
    if t.tls {
        let stream = tls::handshake(cfg, &t.host, tcp, Some(&["http/1.1"])).await?;
        exchange(cfg, &t, stream).await
    } else {
        exchange(cfg, &t, tcp).await
    }
}

/// The http check's request to `t` on a connected stream and the verdict on its answer: the
/// status must match `expect_status`, the body (at most `max_response_bytes`, the head bounded
/// likewise) must contain `expect_body`.
///
/// # Errors
/// Why the answer makes the server unhealthy ([`CheckError`]).
pub(crate) async fn exchange<S>(cfg: &HealthConfig, t: &Target, io: S) -> Result<(), CheckError>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let limit = cfg.max_response_bytes;
    let host = cfg.host.clone().unwrap_or_else(|| t.authority.clone());
    let req = Request::get(t.path.as_str())
        .header(HOST, host)
        .header(USER_AGENT, USER_AGENT_VALUE)
        .header(CONNECTION, "close")
        .body(Empty::<Bytes>::new())
        .map_err(|e| CheckError::Url {
            url: t.path.clone(),
            reason: e.to_string(),
        })?;
    // The limit bounds the head as well. The connection ends with the check (timeout or done).
    let resp = crate::http1::exchange(io, req, Some(limit)).await?;
    let code = resp.status().as_u16();
    if !status_ok(&cfg.expect_status, code) {
        return Err(CheckError::Status(code));
    }
    if resp.content_length().is_some_and(|n| n > limit as u64) {
        return Err(CheckError::TooLarge(limit));
    }
    let body = resp.body(Some(limit)).await.map_err(|e| match e {
        crate::http1::BodyError::Http(h) => CheckError::Http(h),
        crate::http1::BodyError::TooLarge(n) => CheckError::TooLarge(n),
    })?;
    if let Some(want) = &cfg.expect_body
        && !String::from_utf8_lossy(&body).contains(want.as_str())
    {
        return Err(CheckError::Body(want.clone()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> ServerAddr {
        ServerAddr::parse(s).unwrap()
    }

    #[test]
    fn template_expands_and_splits() {
        let t = target(
            Some("https://{server}/ping?x=1"),
            &sa("10.0.0.1:6443"),
            "http",
            "https",
        )
        .unwrap();
        assert_eq!(
            t,
            Target {
                tls: true,
                host: "10.0.0.1".into(),
                connect: "10.0.0.1:6443".into(),
                authority: "10.0.0.1:6443".into(),
                path: "/ping?x=1".into(),
            }
        );
        let t = target(Some("http://{server}"), &sa("[::1]:80"), "http", "https").unwrap();
        assert_eq!(
            (t.host.as_str(), t.connect.as_str(), t.path.as_str()),
            ("::1", "[::1]:80", "/")
        );
        let t = target(Some("ws://example.test/t"), &sa("x:1"), "ws", "wss").unwrap();
        assert_eq!(t.connect, "example.test:80");
        assert!(matches!(
            target(Some("ftp://{server}/"), &sa("a:1"), "http", "https"),
            Err(CheckError::Url { .. })
        ));
        assert!(matches!(
            target(None, &sa("a:1"), "http", "https"),
            Err(CheckError::Url { .. })
        ));
    }

    #[test]
    fn status_lists_and_ranges() {
        assert!(status_ok(&[], 204));
        assert!(!status_ok(&[], 301));
        let m = [StatusMatch::Code(200), StatusMatch::Range(401, 403)];
        assert!(status_ok(&m, 200));
        assert!(status_ok(&m, 402));
        assert!(!status_ok(&m, 201));
        assert!(!status_ok(&m, 500));
    }
}
