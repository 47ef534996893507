//! `lbt supervisor --cert FILE --key FILE`: the supervisor stand-in over TLS, as a K3s/RKE2
//! server's supervisor and apiserver serve (`GET /ping` → 200 `pong`, anything else 404, one
//! request per connection).

use std::{
    io::{self, BufRead, BufReader, Read, Write},
    net::{TcpListener, TcpStream},
    path::Path,
    sync::Arc,
    time::Duration,
};

use rustls::{
    ServerConfig, ServerConnection, StreamOwned,
    pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject as _},
};

/// The TLS settings from a PEM certificate chain and its PEM key.
///
/// # Errors
/// Unreadable or unusable files, named in the message.
pub fn config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, String> {
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .map_err(|e| format!("certificate {}: {e}", cert.display()))?;
    let key =
        PrivateKeyDer::from_pem_file(key).map_err(|e| format!("key {}: {e}", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| format!("certificate {}: {e}", cert.display()))?;
    Ok(Arc::new(cfg))
}

/// Accept on `l` forever, one thread per connection.
pub fn serve(l: &TcpListener, cfg: &Arc<ServerConfig>) {
    for conn in l.incoming().flatten() {
        let cfg = Arc::clone(cfg);
        std::thread::spawn(move || {
            let _ = answer(conn, cfg);
        });
    }
}

/// Handshake, read one request head (bounded in time and size), answer, close.
fn answer(tcp: TcpStream, cfg: Arc<ServerConfig>) -> io::Result<()> {
    tcp.set_read_timeout(Some(Duration::from_secs(5)))?;
    let conn = ServerConnection::new(cfg).map_err(io::Error::other)?;
    let mut tls = StreamOwned::new(conn, tcp);
    let mut request = String::new();
    {
        let mut reader = BufReader::new((&mut tls).take(16 * 1024));
        reader.read_line(&mut request)?;
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h)? == 0 || h == "\r\n" || h == "\n" {
                break;
            }
        }
    }
    let (status, body) = match request.split_whitespace().collect::<Vec<_>>().as_slice() {
        ["GET", "/ping", ..] => ("200 OK", "pong"),
        _ => ("404 Not Found", "404 page not found\n"),
    };
    let resp = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    tls.write_all(resp.as_bytes())?;
    tls.flush()?;
    tls.conn.send_close_notify();
    tls.flush()
}
