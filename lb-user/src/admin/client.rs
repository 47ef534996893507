//! A small client of the admin API over TCP or a unix socket, used by `lb status`, `lb servers`
//! and `lb check`.

use std::{fmt, path::PathBuf, str::FromStr, time::Duration};

use http_body_util::Full;
use hyper::{
    Method, Request, StatusCode,
    body::Bytes,
    header::{AUTHORIZATION, CONTENT_TYPE, HOST},
};
use serde::{Serialize, de::DeserializeOwned};

use super::api::ErrorBody;

/// Where the admin API listens: `host:port`, `http://host:port`, `unix:/path` or `/path`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `host:port`.
    Tcp(String),
    /// A unix socket.
    Unix(PathBuf),
}

impl FromStr for Endpoint {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if let Some(path) = s.strip_prefix("unix:") {
            return Ok(Endpoint::Unix(PathBuf::from(path)));
        }
        if s.starts_with('/') || s.starts_with("./") {
            return Ok(Endpoint::Unix(PathBuf::from(s)));
        }
        let hostport = s.strip_prefix("http://").unwrap_or(s).trim_end_matches('/');
        crate::addr::ServerAddr::parse(hostport)
            .map_err(|e| format!("`{s}` is not host:port, http://host:port or unix:/path ({e})"))?;
        Ok(Endpoint::Tcp(hostport.to_string()))
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Tcp(a) => write!(f, "http://{a}"),
            Endpoint::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// Errors talking to the admin API.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No connection.
    #[error("cannot reach lb's admin API at {endpoint}: {source}")]
    Connect {
        /// Where.
        endpoint: Endpoint,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP exchange failed.
    #[error("admin API at {endpoint}: {source}")]
    Http {
        /// Where.
        endpoint: Endpoint,
        /// Why.
        #[source]
        source: hyper::Error,
    },
    /// No answer in time.
    #[error("admin API at {endpoint} did not answer within {timeout:?}")]
    Timeout {
        /// Where.
        endpoint: Endpoint,
        /// The bound.
        timeout: Duration,
    },
    /// The daemon refused the request.
    #[error("{status}: {message}")]
    Status {
        /// The HTTP status.
        status: StatusCode,
        /// The `error` field of the body, or the body.
        message: String,
    },
    /// The body was not what the API sends.
    #[error("unexpected answer from the admin API: {0}")]
    Decode(String),
    /// The token file could not be read.
    #[error("token file {path}: {reason}")]
    Token {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: super::TokenError,
    },
}

/// A client of one admin endpoint.
#[derive(Clone, Debug)]
pub struct AdminClient {
    endpoint: Endpoint,
    token: Option<String>,
    timeout: Duration,
}

/// Percent-encode one path segment (a server address may hold `[`, `]` or `%`).
pub fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~:".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl AdminClient {
    /// A client of `endpoint`; each request is bounded by `timeout`. With `token_file`, requests
    /// carry `Authorization: Bearer` with its content.
    ///
    /// # Errors
    /// [`ClientError::Token`] when the token file cannot be read or is empty.
    pub fn new(
        endpoint: Endpoint,
        token_file: Option<&std::path::Path>,
        timeout: Duration,
    ) -> Result<AdminClient, ClientError> {
        let token = token_file
            .map(|p| {
                super::read_token(p).map_err(|reason| ClientError::Token {
                    path: p.to_path_buf(),
                    reason,
                })
            })
            .transpose()?;
        Ok(AdminClient {
            endpoint,
            token,
            timeout,
        })
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// One request; returns the status and body whatever the status.
    ///
    /// # Errors
    /// [`ClientError::Connect`], [`ClientError::Http`] or [`ClientError::Timeout`].
    pub async fn raw(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), ClientError> {
        tokio::time::timeout(self.timeout, self.exchange(method, path, body))
            .await
            .map_err(|_| ClientError::Timeout {
                endpoint: self.endpoint.clone(),
                timeout: self.timeout,
            })?
    }

    async fn exchange(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), ClientError> {
        let connect = |source| ClientError::Connect {
            endpoint: self.endpoint.clone(),
            source,
        };
        let http = |source| ClientError::Http {
            endpoint: self.endpoint.clone(),
            source,
        };
        let host = match &self.endpoint {
            Endpoint::Tcp(addr) => addr.clone(),
            Endpoint::Unix(_) => "localhost".to_string(),
        };
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(HOST, host);
        if let Some(t) = &self.token {
            req = req.header(AUTHORIZATION, format!("Bearer {t}"));
        }
        if body.is_some() {
            req = req.header(CONTENT_TYPE, "application/json");
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| ClientError::Decode(e.to_string()))?;
        let resp = match &self.endpoint {
            Endpoint::Tcp(addr) => {
                let s = tokio::net::TcpStream::connect(addr.as_str())
                    .await
                    .map_err(connect)?;
                crate::http1::exchange(s, req, None).await
            }
            Endpoint::Unix(p) => {
                let s = tokio::net::UnixStream::connect(p).await.map_err(connect)?;
                crate::http1::exchange(s, req, None).await
            }
        }
        .map_err(http)?;
        let status = resp.status();
        let bytes = resp.body(None).await.map_err(|e| match e {
            crate::http1::BodyError::Http(h) => http(h),
            e @ crate::http1::BodyError::TooLarge(_) => ClientError::Decode(e.to_string()),
        })?;
        Ok((status, bytes))
    }

    /// A JSON request whose success answer is `T`; an error status becomes
    /// [`ClientError::Status`] with the daemon's message.
    ///
    /// # Errors
    /// As [`AdminClient::raw`], [`ClientError::Status`] or [`ClientError::Decode`].
    pub async fn json<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&impl Serialize>,
    ) -> Result<T, ClientError> {
        let body = body
            .map(serde_json::to_vec)
            .transpose()
            .map_err(|e| ClientError::Decode(e.to_string()))?;
        let (status, bytes) = self.raw(method, path, body).await?;
        if !status.is_success() {
            return Err(status_error(status, &bytes));
        }
        serde_json::from_slice(&bytes).map_err(|e| ClientError::Decode(e.to_string()))
    }
}

/// [`ClientError::Status`] from an answer: the `error` field when the body is an
/// [`ErrorBody`], else the body text.
pub fn status_error(status: StatusCode, body: &[u8]) -> ClientError {
    let message = serde_json::from_slice::<ErrorBody>(body)
        .map(|e| e.error)
        .unwrap_or_else(|_| String::from_utf8_lossy(body).trim().to_string());
    ClientError::Status { status, message }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            "127.0.0.1:9901".parse::<Endpoint>().unwrap(),
            Endpoint::Tcp("127.0.0.1:9901".into())
        );
        assert_eq!(
            "http://localhost:9901/".parse::<Endpoint>().unwrap(),
            Endpoint::Tcp("localhost:9901".into())
        );
        assert_eq!(
            "unix:/run/lb.sock".parse::<Endpoint>().unwrap(),
            Endpoint::Unix("/run/lb.sock".into())
        );
        assert_eq!(
            "/run/lb.sock".parse::<Endpoint>().unwrap(),
            Endpoint::Unix("/run/lb.sock".into())
        );
        assert!("nonsense".parse::<Endpoint>().is_err());
    }

    #[test]
    fn segments() {
        assert_eq!(encode_segment("198.18.0.2:80"), "198.18.0.2:80");
        assert_eq!(encode_segment("[::1]:80"), "%5B::1%5D:80");
        assert_eq!(encode_segment("a/b"), "a%2Fb");
    }
}
