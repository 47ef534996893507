//! Server set changes: `PUT /balancers/NAME/servers` (replace the set), `POST
//! /balancers/NAME/servers` (add one), `DELETE /balancers/NAME/servers/ADDR` (remove one) and
//! `POST /balancers/NAME/servers/ADDR/{drain,disable,enable,kill}`.
//!
//! Bodies are parsed here rather than by axum's `Json` so every malformed body, unknown field or
//! wrong type is a 400 with serde's message (axum would answer 415 or 422).

use std::sync::Arc;

use axum::{
    Json,
    body::Bytes,
    extract::{
        Path, State,
        rejection::{BytesRejection, PathRejection},
    },
    http::StatusCode,
};
use serde::de::DeserializeOwned;

use super::{
    AdminState, ApiError,
    api::{ActionResponse, AddServerRequest, ServersResponse, SetServersRequest},
};
use crate::{
    addr::{self, ServerAddr, SetError},
    balancer::{Balancer, Hold, KillReason},
};

/// The actions of `POST /balancers/NAME/servers/ADDR/ACTION`.
pub(super) const ACTIONS: [&str; 4] = ["drain", "disable", "enable", "kill"];

/// The body as JSON of `T`. A body over [`super::MAX_BODY_BYTES`] is 413 naming the limit (as
/// JSON, like every other error, rather than axum's plain text).
fn parse_body<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let body = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                e.status(),
                format!(
                    "the request body is larger than {} bytes",
                    super::MAX_BODY_BYTES
                ),
            )
        } else {
            ApiError::new(
                e.status(),
                format!("cannot read the request body: {}", e.body_text()),
            )
        }
    })?;
    if body.is_empty() {
        return Err(ApiError::bad_request("a JSON body is required"));
    }
    serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

/// The body of `PUT /balancers/NAME/servers`: the servers in order and the default.
///
/// # Errors
/// 400 (413 past [`super::MAX_BODY_BYTES`]) naming what is wrong with the body or which entry
/// is not `host:port`.
fn set_request(
    body: Result<Bytes, BytesRejection>,
) -> Result<(Vec<ServerAddr>, Option<ServerAddr>), ApiError> {
    let req: SetServersRequest = parse_body(body)?;
    let servers = addr::parse_all(&req.servers).map_err(set_error)?;
    let default = req
        .default
        .as_deref()
        .map(addr::parse_one)
        .transpose()
        .map_err(set_error)?;
    Ok((servers, default))
}

/// The body of `POST /balancers/NAME/servers`: the server to add.
///
/// # Errors
/// As [`set_request`].
fn add_request(body: Result<Bytes, BytesRejection>) -> Result<ServerAddr, ApiError> {
    let req: AddServerRequest = parse_body(body)?;
    addr::parse_one(&req.server).map_err(set_error)
}

/// One of [`ACTIONS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Drain,
    Disable,
    Enable,
    Kill,
}

/// The `{action}` of `POST /balancers/NAME/servers/ADDR/{action}`.
///
/// # Errors
/// 404 naming the actions there are.
fn action_of(action: &str) -> Result<Action, ApiError> {
    match action {
        "drain" => Ok(Action::Drain),
        "disable" => Ok(Action::Disable),
        "enable" => Ok(Action::Enable),
        "kill" => Ok(Action::Kill),
        other => Err(ApiError::not_found(format!(
            "no action {other:?}: use one of {}",
            ACTIONS.join(", ")
        ))),
    }
}

fn find(s: &AdminState, name: &str) -> Result<Arc<Balancer>, ApiError> {
    s.daemon
        .balancer(name)
        .ok_or_else(|| ApiError::not_found(format!("no balancer named {name:?}")))
}

/// A balancer fed by discovery: its source owns the list, so a set change through the API
/// would last only until the next run. 409 naming the source (holds and kills still work).
fn owned_by_discovery(b: &Balancer) -> Result<(), ApiError> {
    match &b.config().discovery {
        Some(d) => Err(ApiError::new(
            StatusCode::CONFLICT,
            format!(
                "balancer {:?} takes its servers from {} discovery ({}); change them there",
                b.name,
                d.kind(),
                d.source()
            ),
        )),
        None => Ok(()),
    }
}

fn set_error(e: SetError) -> ApiError {
    match e {
        SetError::UnknownServer(_) => ApiError::not_found(e.to_string()),
        SetError::Empty
        | SetError::TooMany(_)
        | SetError::Duplicate(_)
        | SetError::Unparsable { .. }
        | SetError::OwnListener(_)
        | SetError::Pinned(_) => ApiError::bad_request(e.to_string()),
    }
}

/// Run a set change on the blocking pool: it resolves new host names with the system
/// resolver, which must not stall the admin thread (and with it `/livez` and `/readyz`).
async fn off_thread<T: Send + 'static>(
    b: &Arc<Balancer>,
    f: impl FnOnce(&Arc<Balancer>) -> T + Send + 'static,
) -> Result<T, ApiError> {
    let b = b.clone();
    tokio::task::spawn_blocking(move || f(&b))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

fn path_error(e: PathRejection) -> ApiError {
    ApiError::bad_request(e.body_text())
}

/// `PUT /balancers/NAME/servers` `{"servers": [...], "default": "..."}`.
pub(super) async fn set(
    State(s): State<Arc<AdminState>>,
    name: Result<Path<String>, PathRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<ServersResponse>, ApiError> {
    let Path(name) = name.map_err(path_error)?;
    let b = find(&s, &name)?;
    owned_by_discovery(&b)?;
    let (servers, default) = set_request(body)?;
    let changed = off_thread(&b, move |b| b.set_servers(&servers, default.as_ref()))
        .await?
        .map_err(set_error)?;
    Ok(Json(ServersResponse {
        balancer: b.name.clone(),
        changed,
        servers: b.status(),
    }))
}

/// `POST /balancers/NAME/servers` `{"server": "host:port"}`: 409 when it is already there.
pub(super) async fn add(
    State(s): State<Arc<AdminState>>,
    name: Result<Path<String>, PathRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<ServersResponse>, ApiError> {
    let Path(name) = name.map_err(path_error)?;
    let b = find(&s, &name)?;
    owned_by_discovery(&b)?;
    let server = add_request(body)?;
    let changed = off_thread(&b, move |b| b.add_server(&server))
        .await?
        .map_err(|e| match e {
            SetError::Duplicate(_) => ApiError::new(StatusCode::CONFLICT, e.to_string()),
            other => set_error(other),
        })?;
    Ok(Json(ServersResponse {
        balancer: b.name.clone(),
        changed,
        servers: b.status(),
    }))
}

/// `DELETE /balancers/NAME/servers/ADDR`: 404 for a server not in the set, 400 for the last one.
pub(super) async fn remove(
    State(s): State<Arc<AdminState>>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<ServersResponse>, ApiError> {
    let Path((name, addr)) = path.map_err(path_error)?;
    let b = find(&s, &name)?;
    owned_by_discovery(&b)?;
    let changed = b.remove_server(&addr).map_err(set_error)?;
    Ok(Json(ServersResponse {
        balancer: b.name.clone(),
        changed,
        servers: b.status(),
    }))
}

/// `POST /balancers/NAME/servers/ADDR/{drain,disable,enable,kill}`.
pub(super) async fn action(
    State(s): State<Arc<AdminState>>,
    path: Result<Path<(String, String, String)>, PathRejection>,
) -> Result<Json<ActionResponse>, ApiError> {
    let Path((name, addr, action)) = path.map_err(path_error)?;
    let b = find(&s, &name)?;
    let killed = match action_of(&action)? {
        Action::Drain => b.set_hold(&addr, Hold::Drain),
        Action::Disable => b.set_hold(&addr, Hold::Disabled),
        Action::Enable => b.set_hold(&addr, Hold::None),
        Action::Kill => b.kill_server(&addr, KillReason::Admin),
    }
    .map_err(set_error)?;
    Ok(Json(ActionResponse {
        balancer: b.name.clone(),
        server: addr,
        action,
        killed,
        servers: b.status(),
    }))
}

/// The server set changes' input as the handlers above parse it, before they look a balancer
/// up or change anything: what [`super::routes::parsing_router`] answers with (the admin API's
/// fuzz target).
#[cfg(feature = "fuzz")]
pub(super) mod parsed {
    use super::{
        ApiError, Bytes, BytesRejection, Path, PathRejection, ServerAddr, SetError, action_of,
        add_request, path_error, set_error, set_request,
    };

    /// `PUT /balancers/NAME/servers`.
    pub(in super::super) async fn set(
        name: Result<Path<String>, PathRejection>,
        body: Result<Bytes, BytesRejection>,
    ) -> Result<String, ApiError> {
        let Path(name) = name.map_err(path_error)?;
        let (servers, default) = set_request(body)?;
        Ok(format!("{name}: {servers:?} default {default:?}"))
    }

    /// `POST /balancers/NAME/servers`.
    pub(in super::super) async fn add(
        name: Result<Path<String>, PathRejection>,
        body: Result<Bytes, BytesRejection>,
    ) -> Result<String, ApiError> {
        let Path(name) = name.map_err(path_error)?;
        Ok(format!("{name}: {}", add_request(body)?))
    }

    /// `DELETE /balancers/NAME/servers/ADDR`.
    pub(in super::super) async fn remove(
        path: Result<Path<(String, String)>, PathRejection>,
    ) -> Result<String, ApiError> {
        let Path((name, addr)) = path.map_err(path_error)?;
        Ok(format!("{name}: {}", as_balancer_parses(addr)?))
    }

    /// `POST /balancers/NAME/servers/ADDR/{action}`.
    pub(in super::super) async fn action(
        path: Result<Path<(String, String, String)>, PathRejection>,
    ) -> Result<String, ApiError> {
        let Path((name, addr, action)) = path.map_err(path_error)?;
        let action = action_of(&action)?;
        Ok(format!("{name}: {} {action:?}", as_balancer_parses(addr)?))
    }

    /// A server named in a path as the balancer parses it to look it up; one that does not
    /// parse is a server it does not have (404).
    fn as_balancer_parses(addr: String) -> Result<ServerAddr, ApiError> {
        ServerAddr::parse(&addr).map_err(|_| set_error(SetError::UnknownServer(addr)))
    }
}
