//! TLS for the `tls`, `https` and `wss` checks: the rustls client config built from
//! `[balancer.health]` (CA file or system roots, client certificate, ALPN, insecure mode), cached
//! while the files it was read from are unchanged, and the handshake itself.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Arc, LazyLock, Mutex},
    time::SystemTime,
};

use rustls::{
    ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    crypto::{CryptoProvider, WebPkiSupportedAlgorithms},
    pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime, pem::PemObject as _},
};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::{TlsConnector, client::TlsStream};

use super::CheckError;
use crate::config::HealthConfig;

/// What a client config depends on: the TLS keys of the health config and the files' mtimes,
/// so a rotated certificate is picked up at the next check.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Key {
    alpn: Vec<String>,
    ca_file: Option<(PathBuf, Option<SystemTime>)>,
    cert_file: Option<(PathBuf, Option<SystemTime>)>,
    key_file: Option<(PathBuf, Option<SystemTime>)>,
    insecure: bool,
}

fn stamped(path: Option<&PathBuf>) -> Option<(PathBuf, Option<SystemTime>)> {
    path.map(|p| {
        let mtime = std::fs::metadata(p).and_then(|m| m.modified()).ok();
        (p.clone(), mtime)
    })
}

/// Built configs; a handful of entries at most (one per distinct TLS setting).
static CACHE: LazyLock<Mutex<HashMap<Key, Arc<ClientConfig>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// The client config for `cfg`, offering `alpn` (the config's own list when `None`).
///
/// # Errors
/// [`CheckError::TlsConfig`] when a CA, certificate or key file cannot be read or used.
pub(super) fn client_config(
    cfg: &HealthConfig,
    alpn: Option<&[&str]>,
) -> Result<Arc<ClientConfig>, CheckError> {
    let key = Key {
        alpn: alpn.map_or_else(
            || cfg.alpn.clone(),
            |a| a.iter().map(|s| (*s).to_string()).collect(),
        ),
        ca_file: stamped(cfg.ca_file.as_ref()),
        cert_file: stamped(cfg.cert_file.as_ref()),
        key_file: stamped(cfg.key_file.as_ref()),
        insecure: cfg.insecure_skip_verify,
    };
    cached(key)
}

fn cached(key: Key) -> Result<Arc<ClientConfig>, CheckError> {
    if let Some(c) = CACHE.lock().expect("poisoned").get(&key) {
        return Ok(c.clone());
    }
    let built = Arc::new(build(&key)?);
    let mut cache = CACHE.lock().expect("poisoned");
    // Stale entries (older mtimes) are dropped rather than kept forever.
    if cache.len() > 16 {
        cache.clear();
    }
    cache.insert(key, built.clone());
    Ok(built)
}

/// A client config from TLS files alone, for lb's other TLS clients (etcd discovery): CA
/// bundle or the system roots, optional client certificate and key, or no verification at all.
/// Cached like the checks' configs, so a rotated file is read again.
///
/// # Errors
/// [`CheckError::TlsConfig`] when a file cannot be read or used.
pub fn client_config_from_files(
    ca_file: Option<&PathBuf>,
    cert_file: Option<&PathBuf>,
    key_file: Option<&PathBuf>,
    insecure: bool,
    alpn: &[&str],
) -> Result<Arc<ClientConfig>, CheckError> {
    cached(Key {
        alpn: alpn.iter().map(|s| (*s).to_string()).collect(),
        ca_file: stamped(ca_file),
        cert_file: stamped(cert_file),
        key_file: stamped(key_file),
        insecure,
    })
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn config_error(what: &'static str, path: &Path, reason: impl ToString) -> CheckError {
    CheckError::TlsConfig {
        what,
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

fn build(key: &Key) -> Result<ClientConfig, CheckError> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| config_error("protocol versions", Path::new("-"), e))?;
    let builder = if key.insecure {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AcceptAnyCert(
                provider.signature_verification_algorithms,
            )))
    } else {
        builder.with_root_certificates(roots(key.ca_file.as_ref().map(|(p, _)| p.as_path()))?)
    };
    let mut config = match (&key.cert_file, &key.key_file) {
        (Some((cert, _)), Some((pkey, _))) => {
            let chain = pem(cert)
                .and_then(|b| {
                    CertificateDer::pem_slice_iter(&b)
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| e.to_string())
                })
                .map_err(|e| config_error("client certificate", cert, e))?;
            if chain.is_empty() {
                return Err(config_error(
                    "client certificate",
                    cert,
                    "no certificate in file",
                ));
            }
            let private = pem(pkey)
                .and_then(|b| PrivateKeyDer::from_pem_slice(&b).map_err(|e| e.to_string()))
                .map_err(|e| config_error("client key", pkey, e))?;
            builder
                .with_client_auth_cert(chain, private)
                .map_err(|e| config_error("client certificate", cert, e))?
        }
        (None, None) => builder.with_no_client_auth(),
        (Some((p, _)), None) | (None, Some((p, _))) => {
            return Err(config_error(
                "client certificate",
                p,
                "cert_file and key_file must be set together",
            ));
        }
    };
    config.alpn_protocols = key.alpn.iter().map(|p| p.as_bytes().to_vec()).collect();
    Ok(config)
}

/// A PEM file's bytes: a regular file of at most [`crate::files::INPUT_LIMIT`] bytes.
fn pem(path: &Path) -> Result<Vec<u8>, String> {
    crate::files::read_limited(path, crate::files::INPUT_LIMIT).map_err(|e| e.to_string())
}

/// Trust anchors from `ca_file` (PEM), or the system's store when absent.
fn roots(ca_file: Option<&Path>) -> Result<RootCertStore, CheckError> {
    let mut roots = RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let certs = pem(path)
                .and_then(|b| {
                    CertificateDer::pem_slice_iter(&b)
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| e.to_string())
                })
                .map_err(|e| config_error("CA file", path, e))?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(config_error("CA file", path, "no usable CA certificate"));
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                return Err(config_error(
                    "system CA store",
                    Path::new("-"),
                    "no system CA certificates found; set ca_file",
                ));
            }
        }
    }
    Ok(roots)
}

/// The name the server is verified against and sent as SNI: `sni`, else `host`, else the host
/// part of the target (an IP address is verified against the certificate's IP SANs, no SNI).
///
/// # Errors
/// [`CheckError::BadName`] when the name is neither a DNS name nor an IP address.
pub(super) fn server_name(
    cfg: &HealthConfig,
    host: &str,
) -> Result<ServerName<'static>, CheckError> {
    let name = cfg
        .sni
        .as_deref()
        .or(cfg.host.as_deref().map(strip_port))
        .unwrap_or(host);
    let name = name.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(name.to_string()).map_err(|_| CheckError::BadName(name.to_string()))
}

/// `example.com:443` → `example.com`; `[::1]:443` → `[::1]`; a name without a port is kept.
fn strip_port(host: &str) -> &str {
    match host.rsplit_once(':') {
        Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) && !h.ends_with(':') => h,
        _ => host,
    }
}

/// TLS handshake over `tcp` (a TCP stream, or any byte stream) with `cfg`'s settings, offering
/// `alpn` (the config's list when `None`).
///
/// # Errors
/// [`CheckError::TlsConfig`], [`CheckError::BadName`] or [`CheckError::Tls`] (handshake refused,
/// certificate not trusted, wrong name).
pub(super) async fn handshake<S>(
    cfg: &HealthConfig,
    host: &str,
    tcp: S,
    alpn: Option<&[&str]>,
) -> Result<TlsStream<S>, CheckError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let config = client_config(cfg, alpn)?;
    let name = server_name(cfg, host)?;
    TlsConnector::from(config)
        .connect(name, tcp)
        .await
        .map_err(CheckError::Tls)
}

/// `insecure_skip_verify`: any certificate is accepted, but handshake signatures are still
/// checked, so the session itself is sound.
#[derive(Debug)]
struct AcceptAnyCert(WebPkiSupportedAlgorithms);

impl ServerCertVerifier for AcceptAnyCert {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn name_precedence_and_ports() {
        let mut cfg = HealthConfig::default();
        assert_eq!(
            server_name(&cfg, "127.0.0.1").unwrap(),
            ServerName::try_from("127.0.0.1").unwrap()
        );
        cfg.host = Some("api.example:6443".into());
        assert_eq!(
            server_name(&cfg, "127.0.0.1").unwrap(),
            ServerName::try_from("api.example").unwrap()
        );
        cfg.sni = Some("sni.example".into());
        assert_eq!(
            server_name(&cfg, "127.0.0.1").unwrap(),
            ServerName::try_from("sni.example").unwrap()
        );
        assert_eq!(strip_port("[::1]:443"), "[::1]");
        assert_eq!(strip_port("::1"), "::1");
        assert!(matches!(
            server_name(&HealthConfig::default(), "bad name!"),
            Err(CheckError::BadName(_))
        ));
    }

    #[test]
    fn missing_files_name_the_file() {
        let cfg = HealthConfig {
            ca_file: Some("/nonexistent/ca.pem".into()),
            ..HealthConfig::default()
        };
        let e = client_config(&cfg, None).unwrap_err();
        assert!(
            matches!(
                &e,
                CheckError::TlsConfig {
                    what: "CA file",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("/nonexistent/ca.pem"), "{e}");
        let cfg = HealthConfig {
            insecure_skip_verify: true,
            cert_file: Some("/nonexistent/c.pem".into()),
            ..HealthConfig::default()
        };
        assert!(matches!(
            client_config(&cfg, None),
            Err(CheckError::TlsConfig { .. })
        ));
    }
}
