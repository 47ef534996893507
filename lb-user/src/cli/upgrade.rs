//! `lb upgrade`: ask the running daemon (`POST /upgrade`) to hand everything to a new lb started
//! from the binary now at its path, without dropping a connection. Exit 0 once the new process
//! serves (the old one exits), 1 with the reason when it did not take over (the old one serves
//! on unchanged) or the admin API could not be reached, 2 when the daemon refused at once
//! (another upgrade under way: 409) or the command itself cannot run (a bad flag, an
//! unreadable token file). With `-o json` the API's body is printed on failure too.

use std::process::ExitCode;

use clap::Args;
use hyper::Method;

use super::{AdminArgs, EXIT_FAILURE, Output, report_error};
use crate::{
    admin::client::{ClientError, status_error},
    daemon::upgrade::{STEP_TIMEOUT, Upgraded},
};

/// `lb upgrade`.
#[derive(Debug, Args)]
pub struct UpgradeArgs {
    /// How the daemon is reached.
    #[command(flatten)]
    pub admin: AdminArgs,
    /// `text` (one line) or `json` (the API's body).
    #[arg(long, short, env = "LB_OUTPUT", value_enum, default_value_t = Output::Text)]
    pub output: Output,
}

/// Run `lb upgrade`.
pub async fn run(args: &UpgradeArgs) -> ExitCode {
    let client = match args.admin.client(STEP_TIMEOUT * 3) {
        Ok(c) => c,
        Err(e) => return report_error(&e),
    };
    let (status, body) = match client.raw(Method::POST, "/upgrade", None).await {
        Ok(r) => r,
        Err(e) => {
            if let Output::Json = args.output {
                println!("{}", serde_json::json!({ "error": e.to_string() }));
            }
            return report_error(&e);
        }
    };
    if !status.is_success() {
        if let Output::Json = args.output {
            // The API's error body as it is (`{"error": ...}`), so a script reads one format.
            println!("{}", String::from_utf8_lossy(&body));
        }
        let e = status_error(status, &body);
        if let ClientError::Status { message, .. } = &e
            && status.is_server_error()
        {
            eprintln!("lb: upgrade failed, the running lb serves on: {message}");
            return ExitCode::from(EXIT_FAILURE);
        }
        return report_error(&e);
    }
    match args.output {
        Output::Json => println!("{}", String::from_utf8_lossy(&body)),
        Output::Text => match serde_json::from_slice::<Upgraded>(&body) {
            Ok(u) => println!(
                "upgraded: pid {} -> {} ({}), {} connections handed over in {} ms, accepting paused {} ms",
                u.old_pid,
                u.new_pid,
                u.binary.display(),
                u.connections,
                u.elapsed_ms,
                u.accept_pause_ms
            ),
            Err(e) => {
                eprintln!("lb: upgraded, but the answer did not decode: {e}");
            }
        },
    }
    ExitCode::SUCCESS
}
