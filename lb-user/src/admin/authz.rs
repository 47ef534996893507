//! Who may do what on the admin API.
//!
//! Each endpoint's rule is in the table of [`super::routes`]:
//!
//! - [`Rule::Open`] (`/livez`, `/readyz`): everyone who reaches the address.
//! - [`Rule::Read`] (`GET /status`, `/metrics`, `/check`): open too, unless `[admin] token_file`
//!   is set: then they want `Authorization: Bearer TOKEN`.
//! - [`Rule::Change`] (server sets, drain, kill, upgrade): taken from root or lb's own user, or
//!   with the token. The caller's user is the peer's credentials on
//!   the unix socket (`SO_PEERCRED`) and, for a loopback TCP peer, the owner of the peer's own
//!   socket, looked up through sock_diag ([`crate::sock_diag::tcp_socket_owner`]). A peer on
//!   another host has no user here: only the token lets it change anything.

use std::{net::SocketAddr, path::Path, sync::Arc};

use axum::{
    extract::{Request, State},
    http::{HeaderValue, StatusCode, header},
    middleware::Next,
    response::{IntoResponse as _, Response},
};
use tracing::{error, warn};

use super::{AdminState, ApiError};

/// Who may call an endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// Everyone who reaches the address (`/livez`, `/readyz`).
    Open,
    /// Reading: open, unless `[admin] token_file` is set; then `Authorization: Bearer TOKEN`.
    Read,
    /// Changing: root or lb's own user (by the peer's credentials), or the token.
    Change,
}

/// What the authorization layer of one endpoint holds: the admin state and the endpoint's rule.
#[derive(Clone)]
pub(super) struct Guard {
    /// The admin state (token file, daemon).
    pub(super) state: Arc<AdminState>,
    /// The endpoint's rule.
    pub(super) rule: Rule,
}

/// Where a request came from, attached to each connection's requests.
#[derive(Clone, Copy, Debug)]
pub(super) enum Peer {
    /// A TCP peer: lb's address and the peer's, as `accept` gave them.
    Tcp {
        /// lb's end.
        local: SocketAddr,
        /// The client's end.
        remote: SocketAddr,
    },
    /// A unix socket peer and its uid from `SO_PEERCRED` (`None` when unavailable).
    Unix {
        /// The peer process's effective uid.
        uid: Option<u32>,
    },
}

impl Peer {
    /// The peer's uid when it is on this host and known.
    async fn uid(self) -> Option<u32> {
        match self {
            Peer::Unix { uid } => uid,
            Peer::Tcp { local, remote } if remote.ip().is_loopback() => {
                // One netlink round trip, off the admin thread's only worker.
                let owner = tokio::task::spawn_blocking(move || {
                    crate::sock_diag::tcp_socket_owner(remote, local)
                })
                .await;
                match owner {
                    Ok(Ok(uid)) => uid,
                    Ok(Err(e)) => {
                        warn!(peer = %remote, error = %e, "cannot look up the admin peer's user");
                        None
                    }
                    Err(_) => None,
                }
            }
            Peer::Tcp { .. } => None,
        }
    }
}

/// Whether `uid` may change lb: root or lb's own effective user.
fn may_change(uid: Option<u32>) -> bool {
    let own = nix::unistd::geteuid().as_raw();
    uid.is_some_and(|u| u == 0 || u == own)
}

/// Compare without an early exit on the first differing byte.
pub(super) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether `req` carries the token of the file at `path`; `Err` with the reason when that
/// file is unreadable.
fn token_valid(s: &AdminState, req: &Request, path: &Path) -> Result<bool, super::TokenError> {
    let expected = s.token.get(path)?;
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    Ok(given.is_some_and(|g| constant_time_eq(g.as_bytes(), expected.as_bytes())))
}

fn unauthorized() -> Response {
    let mut resp = ApiError::new(
        StatusCode::UNAUTHORIZED,
        "a valid `Authorization: Bearer TOKEN` header is required",
    )
    .into_response();
    resp.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    resp
}

/// The rule of the module doc, as a route layer over each endpoint whose rule is not
/// [`Rule::Open`].
pub(super) async fn authorize(
    State(Guard { state: s, rule }): State<Guard>,
    req: Request,
    next: Next,
) -> Response {
    if rule == Rule::Open {
        return next.run(req).await;
    }
    let token_file = s.daemon.config().admin.token_file.clone();
    let token_ok = match &token_file {
        Some(path) => match token_valid(&s, &req, path) {
            Ok(ok) => ok,
            Err(reason) => {
                error!(file = %path.display(), %reason, "admin token file unreadable; refusing requests");
                return ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the admin token file is unreadable (see lb's log)",
                )
                .into_response();
            }
        },
        None => false,
    };
    if token_ok {
        return next.run(req).await;
    }
    if rule == Rule::Read {
        return if token_file.is_some() {
            unauthorized()
        } else {
            next.run(req).await
        };
    }
    let peer = req.extensions().get::<Peer>().copied();
    let uid = match peer {
        Some(p) => p.uid().await,
        None => None,
    };
    if may_change(uid) {
        return next.run(req).await;
    }
    warn!(method = %req.method(), path = req.uri().path(), peer = ?peer, uid, "admin change refused: not root or lb's user, and no valid token");
    if token_file.is_some() {
        return unauthorized();
    }
    ApiError::new(
        StatusCode::FORBIDDEN,
        format!(
            "changes are taken from root or lb's own user (uid {}) on this host, or with [admin] token_file's token; this caller is {}",
            nix::unistd::geteuid().as_raw(),
            uid.map_or_else(|| "of unknown user".to_string(), |u| format!("uid {u}"))
        ),
    )
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_compare() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
    }

    #[test]
    fn only_root_and_lbs_user_may_change() {
        assert!(may_change(Some(0)));
        assert!(may_change(Some(nix::unistd::geteuid().as_raw())));
        assert!(!may_change(None));
        let other = if nix::unistd::geteuid().is_root() {
            65534
        } else {
            0
        };
        assert_eq!(may_change(Some(other)), other == 0);
    }
}
