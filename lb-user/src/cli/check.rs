//! `lb check [--balancer NAME] [--timeout DUR]`: run the health checks now through `GET /check`;
//! exit 0 when healthy, 1 when unhealthy or the daemon cannot be reached (so it also serves as
//! an exec probe).

use std::{process::ExitCode, time::Duration};

use clap::Args;
use hyper::{Method, StatusCode};

use super::{AdminArgs, EXIT_FAILURE, Output, report_error, table};
use crate::{
    admin::{
        api::CheckReport,
        client::{ClientError, encode_segment, status_error},
    },
    config::parse_duration,
};

/// `lb check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// How the daemon is reached.
    #[command(flatten)]
    pub admin: AdminArgs,
    /// Check only this balancer (all when absent).
    #[arg(long, short, env = "LB_BALANCER")]
    pub balancer: Option<String>,
    /// How long to wait for the checks (the daemon clamps it to 100ms..60s; default 10s).
    #[arg(long, short, env = "LB_CHECK_TIMEOUT", value_parser = parse_duration)]
    pub timeout: Option<Duration>,
    /// `text` or `json` (the API's body).
    #[arg(long, short, env = "LB_OUTPUT", value_enum, default_value_t = Output::Text)]
    pub output: Output,
}

/// The `/check` path and query for these arguments.
pub fn path(balancer: Option<&str>, timeout: Option<Duration>) -> String {
    let mut q = Vec::new();
    if let Some(b) = balancer {
        q.push(format!("balancer={}", encode_segment(b)));
    }
    if let Some(t) = timeout {
        q.push(format!("timeout={}ms", t.as_millis()));
    }
    if q.is_empty() {
        "/check".into()
    } else {
        format!("/check?{}", q.join("&"))
    }
}

/// Render a report as text.
pub fn render(r: &CheckReport) -> String {
    let mut out = format!(
        "{}{} in {} ms\n",
        if r.healthy { "healthy" } else { "unhealthy" },
        if r.timed_out {
            format!(" (timed out after {} ms)", r.timeout_ms)
        } else {
            String::new()
        },
        r.elapsed_ms
    );
    for b in &r.balancers {
        out.push_str(&format!(
            "\nbalancer {}: {}\n",
            b.name,
            if b.healthy {
                "healthy"
            } else {
                "no usable server"
            }
        ));
        let rows: Vec<Vec<String>> = b
            .servers
            .iter()
            .map(|s| {
                vec![
                    s.address.clone(),
                    match s.ok {
                        Some(true) => "ok",
                        Some(false) => "failed",
                        None => "pending",
                    }
                    .to_string(),
                    s.state.name().to_string(),
                    s.error.clone().unwrap_or_else(|| "-".into()),
                ]
            })
            .collect();
        out.push_str(&table::render(
            "  ",
            &["SERVER", "CHECK", "STATE", "ERROR"],
            &rows,
        ));
    }
    out
}

/// Run `lb check`: 0 healthy, 1 unhealthy or unreachable, 2 refused as invalid (unknown
/// balancer).
pub async fn run(args: &CheckArgs) -> ExitCode {
    let wait = args
        .timeout
        .unwrap_or(Duration::from_secs(10))
        .min(Duration::from_secs(60));
    let client = match args.admin.client(wait) {
        Ok(c) => c,
        Err(e) => return report_error(&e),
    };
    let path = path(args.balancer.as_deref(), args.timeout);
    let (status, body) = match client.raw(Method::GET, &path, None).await {
        Ok(r) => r,
        Err(e) => return report_error(&e),
    };
    if status != StatusCode::OK && status != StatusCode::SERVICE_UNAVAILABLE {
        return report_error(&status_error(status, &body));
    }
    let report: CheckReport = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return report_error(&ClientError::Decode(e.to_string())),
    };
    match args.output {
        Output::Text => print!("{}", render(&report)),
        Output::Json => println!(
            "{}",
            serde_json::to_string_pretty(&report).unwrap_or_else(|e| e.to_string())
        ),
    }
    if report.healthy {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_FAILURE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query() {
        assert_eq!(path(None, None), "/check");
        assert_eq!(
            path(Some("api"), Some(Duration::from_millis(1500))),
            "/check?balancer=api&timeout=1500ms"
        );
    }
}
