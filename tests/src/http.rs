//! HTTP requests to lb's admin API.

use std::{net::SocketAddr, time::Duration};

use anyhow::{Context as _, Result};

/// Minimal HTTP/1.1 request on a fresh connection: (status, body).
///
/// # Errors
/// Connect/IO failure or an unparsable response.
pub fn http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<(u16, String)> {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(70)))?;
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let code: u16 = resp
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

/// GET shorthand.
///
/// # Errors
/// As [`http_request`].
pub fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    http_request(addr, "GET", path, None)
}
