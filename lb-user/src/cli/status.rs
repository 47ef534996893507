//! `lb status [--output text|json]`: every balancer and its servers, from `GET /status`.

use std::{process::ExitCode, time::Duration};

use clap::Args;
use hyper::Method;

use super::{AdminArgs, Output, report_error, table};
use crate::admin::api::{BalancerStatus, KernelCounters, StatusBody};

/// `lb status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// How the daemon is reached.
    #[command(flatten)]
    pub admin: AdminArgs,
    /// `text` (a table) or `json` (the API's body).
    #[arg(long, short, env = "LB_OUTPUT", value_enum, default_value_t = Output::Text)]
    pub output: Output,
}

/// Render `/status` as text: one block per balancer with its server table.
pub fn render(s: &StatusBody) -> String {
    let mut out = format!("datapath: {}", s.datapath);
    if let Some(why) = &s.datapath_fallback {
        out.push_str(&format!(" (fell back: {why})"));
    }
    if let Some(p) = &s.pins {
        out.push_str(&format!(
            "\nconnect-time pins: {} ({}), heartbeat {}",
            p.dir.display(),
            match (&p.rebuilt, p.adopted) {
                (Some(why), _) => format!("rebuilt: {why}"),
                (None, true) => "adopted".to_string(),
                (None, false) => "pinned by this lb".to_string(),
            },
            p.heartbeat_age_seconds
                .map_or_else(|| "unknown".to_string(), |a| format!("{a:.1} s ago")),
        ));
    }
    out.push('\n');
    for b in &s.balancers {
        render_balancer(&mut out, b);
    }
    out
}

/// One balancer's block of [`render`]: its header line, discovery, names and server table.
fn render_balancer(out: &mut String, b: &BalancerStatus) {
    let listen: Vec<String> = b.listen.iter().map(ToString::to_string).collect();
    out.push_str(&format!(
        "\nbalancer {}  listen {}  policy {}  forwarding {}",
        b.name,
        listen.join(","),
        b.policy,
        if b.forwarding.is_empty() {
            "splice"
        } else {
            &b.forwarding
        },
    ));
    if let Some(why) = &b.forwarding_fallback {
        out.push_str(&format!(" (connect unavailable: {why})"));
    }
    if !b.namespaces.is_empty() {
        out.push_str(&format!("  namespaces {}", b.namespaces));
    }
    out.push('\n');
    if let Some(d) = &b.discovery {
        out.push_str(&format!(
            "  discovery {} {}  every {}s  last success {}  servers {}",
            d.kind,
            d.source,
            d.interval_seconds,
            table::age(d.last_success),
            d.servers,
        ));
        if let Some(e) = &d.last_error {
            out.push_str(&format!(
                "  last error ({}): {e}",
                table::age(d.last_error_at)
            ));
        }
        out.push('\n');
    }
    for n in &b.names {
        let addrs: Vec<String> = n
            .addresses
            .iter()
            .map(|a| {
                a.pin()
                    .map_or_else(|| "unresolved".into(), |ip| ip.to_string())
            })
            .collect();
        out.push_str(&format!(
            "  name {} ({})  addresses {}  resolved {}",
            n.name,
            b.resolve,
            addrs.join(","),
            table::age(n.last_resolved),
        ));
        if let Some(e) = &n.last_error {
            out.push_str(&format!(
                "  last error ({}): {e}",
                table::age(n.last_error_at)
            ));
        }
        out.push('\n');
    }
    if let Some(k) = &b.kernel {
        kernel_line(out, k);
    }
    out.push_str(&table::servers("  ", &b.servers));
}

/// Run `lb status`: exit 0, or 1 when the daemon cannot be reached.
pub async fn run(args: &StatusArgs) -> ExitCode {
    let client = match args.admin.client(Duration::ZERO) {
        Ok(c) => c,
        Err(e) => return report_error(&e),
    };
    match client
        .json::<StatusBody>(Method::GET, "/status", None::<&()>)
        .await
    {
        Ok(s) => {
            match args.output {
                Output::Text => print!("{}", render(&s)),
                Output::Json => println!(
                    "{}",
                    serde_json::to_string_pretty(&s).unwrap_or_else(|e| e.to_string())
                ),
            }
            ExitCode::SUCCESS
        }
        Err(e) => report_error(&e),
    }
}

/// The kernel's "left undone" counters of one balancer, one line, only those above 0 (nothing
/// when all are 0): `  kernel: not registered for the splice sockhash 3; connects not
/// rewritten no_servers 12`.
fn kernel_line(out: &mut String, k: &KernelCounters) {
    let nonzero = |m: &std::collections::BTreeMap<String, u64>| {
        m.iter()
            .filter(|(_, n)| **n > 0)
            .map(|(l, n)| format!("{l} {n}"))
            .collect::<Vec<_>>()
    };
    let parts: Vec<String> = [
        (
            "not registered for the splice",
            nonzero(&k.register_failures),
        ),
        ("connects not rewritten", nonzero(&k.unrewritten_connects)),
    ]
    .into_iter()
    .filter(|(_, v)| !v.is_empty())
    .map(|(what, v)| format!("{what} {}", v.join(", ")))
    .collect();
    if !parts.is_empty() {
        out.push_str(&format!("  kernel: {}\n", parts.join("; ")));
    }
}
