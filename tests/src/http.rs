//! HTTP requests to lb's admin API: over TCP with `ureq`, over lb's unix socket by hand.

use std::{
    io::{Read as _, Write as _},
    net::SocketAddr,
    path::Path,
    sync::OnceLock,
    time::Duration,
};

use anyhow::{Context as _, Result};

/// The client every TCP request goes through. Each request opens a fresh connection (no idle
/// connection is kept, as with the kubelet's probes and lb's own CLI), no redirect is followed,
/// 4xx and 5xx are answers rather than errors, and no proxy from the environment is used.
fn agent() -> &'static ureq::Agent {
    static AGENT: OnceLock<ureq::Agent> = OnceLock::new();
    AGENT.get_or_init(|| {
        ureq::Agent::config_builder()
            .proxy(None)
            .http_status_as_error(false)
            .max_redirects(0)
            .max_redirects_will_error(false)
            .max_idle_connections(0)
            .max_idle_connections_per_host(0)
            .timeout_connect(Some(Duration::from_secs(5)))
            .timeout_per_read(Some(Duration::from_secs(70)))
            .build()
            .into()
    })
}

/// An HTTP/1.1 request with extra `headers` on a fresh connection; `body` is sent with its
/// `Content-Length` (0 when `None`). Returns (status, body).
///
/// # Errors
/// Connect/IO failure, an invalid method, path or header, or an unparsable response.
pub fn http_request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Result<(u16, String)> {
    let mut req = ureq::http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(body.unwrap_or(""))
        .with_context(|| format!("building {method} {path}"))?;
    let mut resp = agent()
        .run(req)
        .with_context(|| format!("{method} http://{addr}{path}"))?;
    let code = resp.status().as_u16();
    let body = resp
        .body_mut()
        .read_to_string()
        .with_context(|| format!("reading the body of {method} {path}"))?;
    Ok((code, body))
}

/// An HTTP/1.1 request with a JSON body (or none) on a fresh connection: (status, body).
///
/// # Errors
/// As [`http_request_with`].
pub fn http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<(u16, String)> {
    http_request_with(
        addr,
        method,
        path,
        &[("Content-Type", "application/json")],
        body,
    )
}

/// GET shorthand.
///
/// # Errors
/// As [`http_request`].
pub fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    http_request(addr, "GET", path, None)
}

/// The same request over the unix socket at `socket` (lb's `admin.unix_socket`): (status, body).
///
/// Written by hand because ureq dials only TCP (a unix-socket transport would have to use its
/// `unversioned` API, which may change in any release). It sends `Connection: close` and reads
/// the response to EOF, which lb's admin server closes after answering.
///
/// # Errors
/// Connect/IO failure or a response without a status line.
pub fn unix_request(
    socket: &Path,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Result<(u16, String)> {
    let mut s = std::os::unix::net::UnixStream::connect(socket)
        .with_context(|| format!("connecting to {}", socket.display()))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let body = body.unwrap_or("");
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: lb\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes())?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let code = resp
        .split_whitespace()
        .nth(1)
        .context("no status")?
        .parse()?;
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((code, body))
}
