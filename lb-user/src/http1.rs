//! One HTTP/1.1 request on a connection of its own, over hyper's client `conn` API: what the
//! HTTP health check, the etcd member list and the admin client each send. The caller connects
//! (TCP, a unix socket, TLS over either) and builds the request; [`exchange`] sends it and hands
//! back the answer's head, and [`Answer::body`] reads the body, bounded when asked.

use http_body_util::{BodyExt as _, Limited};
use hyper::{
    HeaderMap, Request, StatusCode,
    body::{Body, Bytes, Incoming},
};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::task::AbortOnDropHandle;

/// hyper refuses a read buffer below 8 KiB (`http1::Builder::max_buf_size`).
const MIN_BUF: usize = 8192;

/// An answer whose head is read and whose body is not yet. The connection is served by a task
/// that ends when this (or the body read from it) is dropped.
#[derive(Debug)]
pub struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Incoming,
    _conn: AbortOnDropHandle<Result<(), hyper::Error>>,
}

/// Why a body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// The connection failed or the peer broke the protocol.
    #[error(transparent)]
    Http(#[from] hyper::Error),
    /// The body is longer than the limit (bytes).
    #[error("the answer is larger than {0} bytes")]
    TooLarge(usize),
}

impl Answer {
    /// The status code.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The header fields.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The body's declared length (`Content-Length`), when it has a valid one.
    pub fn content_length(&self) -> Option<u64> {
        self.headers
            .get(hyper::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
    }

    /// Read the whole body, at most `limit` bytes when given.
    ///
    /// # Errors
    /// [`BodyError::TooLarge`] past `limit`; [`BodyError::Http`] when the connection fails.
    pub async fn body(self, limit: Option<usize>) -> Result<Bytes, BodyError> {
        let Answer { body, _conn, .. } = self;
        match limit {
            None => Ok(body.collect().await?.to_bytes()),
            Some(limit) => Limited::new(body, limit)
                .collect()
                .await
                .map(http_body_util::Collected::to_bytes)
                .map_err(|e| match e.downcast::<hyper::Error>() {
                    Ok(h) => BodyError::Http(*h),
                    Err(_) => BodyError::TooLarge(limit),
                }),
        }
    }
}

/// Send `req` on `io` as HTTP/1.1 and wait for the answer's head. `max_head` bounds what hyper
/// buffers for it (bytes, at least 8 KiB); `None` takes hyper's default.
///
/// # Errors
/// The handshake, the send or the head failed (hyper's error names which).
pub async fn exchange<S, B>(
    io: S,
    req: Request<B>,
    max_head: Option<usize>,
) -> Result<Answer, hyper::Error>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut builder = hyper::client::conn::http1::Builder::new();
    if let Some(n) = max_head {
        builder.max_buf_size(n.max(MIN_BUF));
    }
    let (mut sender, conn) = builder.handshake(TokioIo::new(io)).await?;
    let conn = AbortOnDropHandle::new(tokio::spawn(conn));
    let (parts, body) = sender.send_request(req).await?.into_parts();
    Ok(Answer {
        status: parts.status,
        headers: parts.headers,
        body,
        _conn: conn,
    })
}

#[cfg(test)]
mod tests {
    use http_body_util::Empty;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    /// A peer that reads one request head and answers `reply`.
    async fn peer(reply: &'static [u8]) -> tokio::io::DuplexStream {
        let (client, mut server) = tokio::io::duplex(64 * 1024);
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            let mut got = Vec::new();
            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = server.read(&mut buf).await.unwrap_or(0);
                if n == 0 {
                    return;
                }
                got.extend_from_slice(&buf[..n]);
            }
            let _ = server.write_all(reply).await;
        });
        client
    }

    fn get() -> Request<Empty<Bytes>> {
        Request::get("/ping")
            .header(hyper::header::HOST, "x")
            .body(Empty::new())
            .unwrap()
    }

    #[tokio::test]
    async fn status_head_and_bounded_body() {
        let io = peer(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\npong").await;
        let a = exchange(io, get(), None).await.unwrap();
        assert_eq!(a.status(), StatusCode::OK);
        assert_eq!(a.content_length(), Some(4));
        assert_eq!(&a.body(Some(4)).await.unwrap()[..], b"pong");

        let io = peer(b"HTTP/1.1 503 Busy\r\ncontent-length: 10\r\n\r\n0123456789").await;
        let a = exchange(io, get(), Some(1)).await.unwrap();
        assert_eq!(a.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(matches!(a.body(Some(4)).await, Err(BodyError::TooLarge(4))));
    }

    #[tokio::test]
    async fn a_peer_that_breaks_the_protocol_is_an_error() {
        let io = peer(b"not http at all\r\n\r\n").await;
        assert!(exchange(io, get(), None).await.is_err());
    }
}
