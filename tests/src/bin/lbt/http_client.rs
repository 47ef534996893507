//! `lbt client --connect ADDR http METHOD PATH`: one HTTP/1.1 request to lb's admin API from
//! this process, so a test can make it as another user (the admin API authorizes a loopback TCP
//! peer by the owner of its socket).

use std::{io, net::SocketAddr};

use clap::Subcommand;
use serde_json::json;

#[derive(Subcommand, Clone)]
pub(crate) enum HttpAction {
    /// Send `METHOD PATH` with `--header NAME:VALUE` fields and `--body`, then print
    /// `{"ok": true, "status": N, "body": "..."}` (4xx and 5xx are answers, not errors).
    Http {
        method: String,
        path: String,
        /// A header field as `NAME:VALUE`; repeatable.
        #[arg(long)]
        header: Vec<String>,
        /// The request body (sent with its `Content-Length`).
        #[arg(long)]
        body: Option<String>,
    },
}

pub(crate) fn run(addr: SocketAddr, action: HttpAction) -> io::Result<serde_json::Value> {
    let HttpAction::Http {
        method,
        path,
        header,
        body,
    } = action;
    let mut headers = Vec::new();
    for h in &header {
        let (k, v) = h.split_once(':').ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("--header {h:?} is not NAME:VALUE"),
            )
        })?;
        headers.push((k.trim(), v.trim()));
    }
    let (status, body) =
        lb_tests::http_request_with(addr, &method, &path, &headers, body.as_deref())
            .map_err(|e| io::Error::other(format!("{e:#}")))?;
    Ok(json!({"ok": true, "status": status, "body": body}))
}
