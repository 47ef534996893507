//! Every admin endpoint in one table, [`ENDPOINTS`]: its method, its path and who may call it
//! ([`Rule`]). The router is built from the table alone and the authorization layer applies each
//! endpoint's own rule, so an endpoint cannot be added without saying who may call it (and the
//! route-walking test, `tests/tests/admin_routes.rs`, then calls it as each kind of caller).

use std::{sync::Arc, time::Duration};

use axum::{
    Router,
    extract::Request,
    middleware::{self, Next},
    routing::{MethodFilter, MethodRouter, on},
};

pub use super::authz::Rule;
use super::{AdminState, authz, bounded, check, probes, servers};

/// An endpoint's HTTP method (a `GET` endpoint also answers `HEAD`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verb {
    /// `GET` (and `HEAD`).
    Get,
    /// `POST`.
    Post,
    /// `PUT`.
    Put,
    /// `DELETE`.
    Delete,
}

impl Verb {
    /// The method as HTTP spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Verb::Get => "GET",
            Verb::Post => "POST",
            Verb::Put => "PUT",
            Verb::Delete => "DELETE",
        }
    }

    fn filter(self) -> MethodFilter {
        match self {
            Verb::Get => MethodFilter::GET,
            Verb::Post => MethodFilter::POST,
            Verb::Put => MethodFilter::PUT,
            Verb::Delete => MethodFilter::DELETE,
        }
    }
}

/// One admin endpoint: method, path (axum's syntax, `{name}` for a path parameter) and rule.
#[derive(Clone, Copy, Debug)]
pub struct Endpoint {
    /// The method.
    pub method: Verb,
    /// The path; `{name}` is a balancer's name, `{addr}` a server as `/status` names it and
    /// `{action}` one of [`SERVER_ACTIONS`].
    pub path: &'static str,
    /// Who may call it.
    pub rule: Rule,
    handler: Handler,
}

/// The handler behind an endpoint (private: the table is what others read).
#[derive(Clone, Copy, Debug)]
enum Handler {
    Livez,
    Readyz,
    Check,
    Status,
    Metrics,
    SetServers,
    AddServer,
    RemoveServer,
    ServerAction,
    Upgrade,
}

const fn endpoint(method: Verb, path: &'static str, rule: Rule, handler: Handler) -> Endpoint {
    Endpoint {
        method,
        path,
        rule,
        handler,
    }
}

/// Every endpoint of the admin API; the router serves these and nothing else.
pub const ENDPOINTS: &[Endpoint] = &[
    endpoint(Verb::Get, "/livez", Rule::Open, Handler::Livez),
    endpoint(Verb::Get, "/readyz", Rule::Open, Handler::Readyz),
    endpoint(Verb::Get, "/check", Rule::Read, Handler::Check),
    endpoint(Verb::Get, "/status", Rule::Read, Handler::Status),
    endpoint(Verb::Get, "/metrics", Rule::Read, Handler::Metrics),
    endpoint(
        Verb::Put,
        "/balancers/{name}/servers",
        Rule::Change,
        Handler::SetServers,
    ),
    endpoint(
        Verb::Post,
        "/balancers/{name}/servers",
        Rule::Change,
        Handler::AddServer,
    ),
    endpoint(
        Verb::Delete,
        "/balancers/{name}/servers/{addr}",
        Rule::Change,
        Handler::RemoveServer,
    ),
    endpoint(
        Verb::Post,
        "/balancers/{name}/servers/{addr}/{action}",
        Rule::Change,
        Handler::ServerAction,
    ),
    endpoint(Verb::Post, "/upgrade", Rule::Change, Handler::Upgrade),
];

/// The values of `{action}` in `POST /balancers/{name}/servers/{addr}/{action}`.
pub const SERVER_ACTIONS: [&str; 4] = servers::ACTIONS;

/// Bound on handling one request but `/check`'s and `/upgrade`'s, and the probes' (answered
/// from snapshots at once).
const fn time_limit(h: Handler) -> Option<Duration> {
    match h {
        Handler::Livez | Handler::Readyz => None,
        // `/check` has its own timeout, at most 60 s.
        Handler::Check => Some(check::MAX_TIMEOUT.saturating_add(Duration::from_secs(5))),
        Handler::Upgrade => Some(
            crate::daemon::upgrade::STEP_TIMEOUT
                .saturating_mul(3)
                .saturating_add(Duration::from_secs(10)),
        ),
        _ => Some(super::REQUEST_TIMEOUT),
    }
}

fn method_router(method: Verb, h: Handler) -> MethodRouter<Arc<AdminState>> {
    let f = method.filter();
    match h {
        Handler::Livez => on(f, probes::livez),
        Handler::Readyz => on(f, probes::readyz),
        Handler::Check => on(f, check::handler),
        Handler::Status => on(f, super::status_handler),
        Handler::Metrics => on(f, super::metrics),
        Handler::SetServers => on(f, servers::set),
        Handler::AddServer => on(f, servers::add),
        Handler::RemoveServer => on(f, servers::remove),
        Handler::ServerAction => on(f, servers::action),
        Handler::Upgrade => on(f, super::upgrade_handler),
    }
}

/// The routes of [`ENDPOINTS`], each bounded in time and guarded by its rule (checked first).
pub(super) fn routes(state: &Arc<AdminState>) -> Router<Arc<AdminState>> {
    ENDPOINTS.iter().fold(Router::new(), |app, e| {
        let mut route = method_router(e.method, e.handler);
        if let Some(limit) = time_limit(e.handler) {
            route = route.route_layer(middleware::from_fn(move |req: Request, next: Next| {
                bounded(limit, req, next)
            }));
        }
        if e.rule != Rule::Open {
            let guard = authz::Guard {
                state: state.clone(),
                rule: e.rule,
            };
            route = route.route_layer(middleware::from_fn_with_state(guard, authz::authorize));
        }
        app.route(e.path, route)
    })
}

/// The routes of [`ENDPOINTS`] without a daemon: each handler parses its request (path, query,
/// body) with the very functions the real one does, in the same order, and answers `200` with
/// what it parsed, or the error the real one would answer before it looks a balancer up. No
/// rule is applied. The admin API's fuzz target serves this.
#[cfg(feature = "fuzz")]
pub(super) fn parsing_router() -> Router {
    ENDPOINTS.iter().fold(Router::new(), |app, e| {
        let f = e.method.filter();
        let route: MethodRouter = match e.handler {
            Handler::Livez
            | Handler::Readyz
            | Handler::Status
            | Handler::Metrics
            | Handler::Upgrade => on(f, || async { "no input to parse" }),
            Handler::Check => on(f, check::parsed),
            Handler::SetServers => on(f, servers::parsed::set),
            Handler::AddServer => on(f, servers::parsed::add),
            Handler::RemoveServer => on(f, servers::parsed::remove),
            Handler::ServerAction => on(f, servers::parsed::action),
        };
        app.route(e.path, route)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_endpoint_is_listed_once_and_gets_reads_the_rest_change() {
        for (i, e) in ENDPOINTS.iter().enumerate() {
            assert!(
                !ENDPOINTS[..i]
                    .iter()
                    .any(|o| o.method == e.method && o.path == e.path),
                "{} {} listed twice",
                e.method.as_str(),
                e.path
            );
            // The documented rule: probes open, GET reads, every other method changes.
            let want = match (e.method, e.path) {
                (_, "/livez" | "/readyz") => Rule::Open,
                (Verb::Get, _) => Rule::Read,
                _ => Rule::Change,
            };
            assert_eq!(e.rule, want, "{} {}", e.method.as_str(), e.path);
        }
    }
}
