//! `kind = "etcd"`: the etcd member list, each voting member's client URL one server (what
//! K3s's etcd proxy does to keep its etcd load balancer current). Asked through etcd's JSON
//! gateway, `POST /v3/cluster/member/list` (etcd 3.4 and later; the same call as `etcdctl
//! member list`), over http or https with the configured CA and client certificate, trying the
//! endpoints in order until one answers.

use http_body_util::Full;
use hyper::{
    Request, Uri,
    body::Bytes,
    header::{CONNECTION, CONTENT_TYPE, HOST},
};
use serde::Deserialize;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::TlsConnector;

use super::{DiscoveryError, Found};
use crate::{addr::ServerAddr, config::EtcdDiscovery, net::Route};

/// The gateway path of the member list.
const MEMBER_LIST_PATH: &str = "/v3/cluster/member/list";
/// Largest member list read (bytes): thousands of members' worth.
const MAX_BODY: usize = 1024 * 1024;

/// The gateway's answer; only what lb uses.
#[derive(Debug, Deserialize)]
struct MemberList {
    #[serde(default)]
    members: Vec<Member>,
}

#[derive(Debug, Deserialize)]
struct Member {
    #[serde(default)]
    name: String,
    #[serde(default, rename = "clientURLs")]
    client_urls: Vec<String>,
    #[serde(default, rename = "isLearner")]
    is_learner: bool,
}

/// Servers from a member list body: every client URL of every voting member, in the list's
/// order, each once. A member that has not started yet has no client URL and is left out, as
/// is a learner (it serves no client requests until promoted) and a loopback URL (it names
/// the member's own machine, not one lb can reach).
///
/// # Errors
/// A message when the body is not a member list or a URL is not `scheme://host:port`.
pub(crate) fn servers_of(body: &[u8]) -> Result<Vec<ServerAddr>, String> {
    let list: MemberList =
        serde_json::from_slice(body).map_err(|e| format!("not a member list: {e}"))?;
    let mut out: Vec<ServerAddr> = Vec::new();
    for m in list.members.iter().filter(|m| !m.is_learner) {
        for url in &m.client_urls {
            let uri: Uri = url
                .parse()
                .map_err(|e| format!("member {:?}: client URL {url:?}: {e}", m.name))?;
            let host = uri
                .host()
                .ok_or_else(|| format!("member {:?}: client URL {url:?} has no host", m.name))?;
            let port = uri.port_u16().unwrap_or(2379);
            let spec = if host.contains(':') && !host.starts_with('[') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            };
            let server = ServerAddr::parse(&spec)
                .map_err(|e| format!("member {:?}: client URL {url:?}: {e}", m.name))?;
            let loopback = server.socket_addr().is_some_and(|sa| sa.ip().is_loopback())
                || host.eq_ignore_ascii_case("localhost");
            if !loopback && !out.contains(&server) {
                out.push(server);
            }
        }
    }
    Ok(out)
}

/// Ask the endpoints in order for the member list.
///
/// # Errors
/// [`DiscoveryError::Etcd`] with every endpoint's failure when none answered.
pub(super) async fn members(e: &EtcdDiscovery, route: &Route) -> Result<Found, DiscoveryError> {
    let mut failures = Vec::new();
    for endpoint in &e.endpoints {
        let per_endpoint = e.timeout.0 / u32::try_from(e.endpoints.len()).unwrap_or(1).max(1);
        match tokio::time::timeout(per_endpoint, ask(e, endpoint, route)).await {
            Ok(Ok(body)) => {
                let servers = servers_of(&body)
                    .map_err(|m| DiscoveryError::Etcd(format!("{endpoint}: {m}")))?;
                return Ok(Found {
                    servers,
                    default: None,
                    ttl: None,
                });
            }
            Ok(Err(m)) => failures.push(format!("{endpoint}: {m}")),
            Err(_) => failures.push(format!("{endpoint}: no answer within {per_endpoint:?}")),
        }
    }
    Err(DiscoveryError::Etcd(failures.join("; ")))
}

/// One `POST` of the member list to `endpoint`; the body of a 200 answer.
async fn ask(e: &EtcdDiscovery, endpoint: &str, route: &Route) -> Result<Vec<u8>, String> {
    let uri: Uri = endpoint.parse().map_err(|err| format!("bad URL: {err}"))?;
    let tls = uri.scheme_str() == Some("https");
    let host = uri.host().ok_or("no host")?;
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let port = uri.port_u16().unwrap_or(if tls { 443 } else { 80 });
    let spec = if bare.contains(':') {
        format!("[{bare}]:{port}")
    } else {
        format!("{bare}:{port}")
    };
    let server = ServerAddr::parse(&spec).map_err(|err| err.to_string())?;
    let tcp = crate::net::connect(&server, route)
        .await
        .map_err(|err| format!("connect: {err}"))?;
    let authority = uri
        .authority()
        .map_or_else(|| spec.clone(), ToString::to_string);
    if tls {
        let config = crate::health::client_config_from_files(
            e.ca_file.as_ref(),
            e.cert_file.as_ref(),
            e.key_file.as_ref(),
            e.insecure_skip_verify,
            &["http/1.1"],
        )
        .map_err(|err| err.to_string())?;
        let name = rustls::pki_types::ServerName::try_from(bare.to_string())
            .map_err(|_| format!("{bare:?} is not a name TLS can verify"))?;
        let stream = TlsConnector::from(config)
            .connect(name, tcp)
            .await
            .map_err(|err| format!("TLS handshake: {err}"))?;
        post(stream, &authority).await
    } else {
        post(tcp, &authority).await
    }
}

async fn post<S>(io: S, authority: &str) -> Result<Vec<u8>, String>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let req = Request::post(MEMBER_LIST_PATH)
        .header(HOST, authority)
        .header(CONTENT_TYPE, "application/json")
        .header(CONNECTION, "close")
        .body(Full::new(Bytes::from_static(b"{}")))
        .map_err(|e| e.to_string())?;
    let resp = crate::http1::exchange(io, req, None)
        .await
        .map_err(|e| e.to_string())?;
    let status = resp.status();
    let body = resp
        .body(Some(MAX_BODY))
        .await
        .map_err(|e| format!("reading the answer: {e}"))?;
    if !status.is_success() {
        let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
        return Err(format!("HTTP {status}: {text}"));
    }
    Ok(body.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_list_gives_voting_members_client_urls() {
        // The shape etcd 3.4's gateway answers with (IDs are strings in its JSON).
        let body = br#"{"header":{"cluster_id":"1","member_id":"2","raft_term":"3"},
          "members":[
            {"ID":"11","name":"m1","peerURLs":["http://198.18.1.2:2380"],"clientURLs":["http://198.18.1.2:2379","http://127.0.0.1:2379"]},
            {"ID":"12","name":"m2","peerURLs":["http://198.18.1.3:2380"],"clientURLs":["https://[fd00::3]:2379"]},
            {"ID":"13","name":"","peerURLs":["http://198.18.1.4:2380"]},
            {"ID":"14","name":"l1","peerURLs":["http://198.18.1.5:2380"],"clientURLs":["http://198.18.1.5:2379"],"isLearner":true},
            {"ID":"15","name":"m5","clientURLs":["http://198.18.1.2:2379"]}
          ]}"#;
        let got: Vec<String> = servers_of(body)
            .unwrap()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(got, ["198.18.1.2:2379", "[fd00::3]:2379"]);
        assert!(servers_of(b"{}").unwrap().is_empty());
        assert!(
            servers_of(b"<html>")
                .unwrap_err()
                .contains("not a member list")
        );
        let bad = br#"{"members":[{"name":"x","clientURLs":["http://:2379"]}]}"#;
        assert!(servers_of(bad).is_err());
    }
}
