//! `lb servers set|add|remove|drain|enable|disable|kill`: change a balancer's servers through
//! the admin API, then print its server table.

use std::{process::ExitCode, time::Duration};

use clap::{Args, Subcommand};
use hyper::Method;

use super::{AdminArgs, EXIT_USAGE, Output, report_error, table};
use crate::admin::{
    api::{ActionResponse, AddServerRequest, ServersResponse, SetServersRequest, StatusBody},
    client::{AdminClient, ClientError, encode_segment},
};

/// `lb servers`.
#[derive(Debug, Args)]
pub struct ServersArgs {
    /// How the daemon is reached.
    #[command(flatten)]
    pub admin: AdminArgs,
    /// The balancer; may be left out when the daemon runs only one.
    #[arg(long, short, global = true, env = "LB_BALANCER")]
    pub balancer: Option<String>,
    /// `text` (a table) or `json` (the API's answer).
    #[arg(long, short, global = true, env = "LB_OUTPUT", value_enum, default_value_t = Output::Text)]
    pub output: Output,
    /// What to do.
    #[command(subcommand)]
    pub command: ServersCommand,
}

/// The server changes.
#[derive(Debug, Subcommand)]
pub enum ServersCommand {
    /// Replace the whole set (in order of preference).
    Set {
        /// Server of last resort (none when absent).
        #[arg(long = "default", env = "LB_DEFAULT_SERVER")]
        default: Option<String>,
        /// `host:port` entries.
        #[arg(required = true)]
        servers: Vec<String>,
    },
    /// Add a server at the end of the set.
    Add {
        /// `host:port`.
        server: String,
    },
    /// Remove a server from the set (its connections are closed).
    Remove {
        /// `host:port`.
        server: String,
    },
    /// No new connections to the server; existing ones stay.
    Drain {
        /// `host:port`.
        server: String,
    },
    /// No new connections to the server and its connections are reset.
    Disable {
        /// `host:port`.
        server: String,
    },
    /// Undo drain or disable.
    Enable {
        /// `host:port`.
        server: String,
    },
    /// Reset every connection to the server (it stays in the set).
    Kill {
        /// `host:port`.
        server: String,
    },
}

/// The balancer named on the command line, or the daemon's only one.
async fn balancer_name(
    client: &AdminClient,
    given: Option<&str>,
) -> Result<Result<String, String>, ClientError> {
    if let Some(b) = given {
        return Ok(Ok(b.to_string()));
    }
    let status: StatusBody = client.json(Method::GET, "/status", None::<&()>).await?;
    Ok(match status.balancers.as_slice() {
        [only] => Ok(only.name.clone()),
        many => Err(format!(
            "the daemon runs {} balancers ({}): pass --balancer",
            many.len(),
            many.iter()
                .map(|b| b.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )),
    })
}

fn print_servers(
    output: Output,
    balancer: &str,
    json: &impl serde::Serialize,
    servers: &[crate::balancer::ServerStatus],
) {
    match output {
        Output::Text => {
            println!("balancer {balancer}");
            print!("{}", table::servers("  ", servers));
        }
        Output::Json => println!(
            "{}",
            serde_json::to_string_pretty(json).unwrap_or_else(|e| e.to_string())
        ),
    }
}

async fn apply(client: &AdminClient, args: &ServersArgs, name: &str) -> Result<(), ClientError> {
    let base = format!("/balancers/{}/servers", encode_segment(name));
    let action = |verb: &str, server: &str| format!("{base}/{}/{verb}", encode_segment(server));
    match &args.command {
        ServersCommand::Set { default, servers } => {
            let req = SetServersRequest {
                servers: servers.clone(),
                default: default.clone(),
            };
            let r: ServersResponse = client.json(Method::PUT, &base, Some(&req)).await?;
            print_servers(args.output, &r.balancer, &r, &r.servers);
        }
        ServersCommand::Add { server } => {
            let req = AddServerRequest {
                server: server.clone(),
            };
            let r: ServersResponse = client.json(Method::POST, &base, Some(&req)).await?;
            print_servers(args.output, &r.balancer, &r, &r.servers);
        }
        ServersCommand::Remove { server } => {
            let path = format!("{base}/{}", encode_segment(server));
            let r: ServersResponse = client.json(Method::DELETE, &path, None::<&()>).await?;
            print_servers(args.output, &r.balancer, &r, &r.servers);
        }
        ServersCommand::Drain { server }
        | ServersCommand::Disable { server }
        | ServersCommand::Enable { server }
        | ServersCommand::Kill { server } => {
            let verb = match &args.command {
                ServersCommand::Drain { .. } => "drain",
                ServersCommand::Disable { .. } => "disable",
                ServersCommand::Enable { .. } => "enable",
                _ => "kill",
            };
            let r: ActionResponse = client
                .json(Method::POST, &action(verb, server), None::<&()>)
                .await?;
            if args.output == Output::Text && r.killed > 0 {
                println!("{verb} {}: reset {} connection(s)", r.server, r.killed);
            }
            print_servers(args.output, &r.balancer, &r, &r.servers);
        }
    }
    Ok(())
}

/// Run `lb servers ...`: exit 0 when applied, 2 when the daemon refused it as invalid (unknown
/// balancer or server, bad address, empty set), 1 when it could not be reached.
pub async fn run(args: &ServersArgs) -> ExitCode {
    let client = match args.admin.client(Duration::ZERO) {
        Ok(c) => c,
        Err(e) => return report_error(&e),
    };
    let name = match balancer_name(&client, args.balancer.as_deref()).await {
        Ok(Ok(n)) => n,
        Ok(Err(e)) => {
            eprintln!("lb: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
        Err(e) => return report_error(&e),
    };
    match apply(&client, args, &name).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => report_error(&e),
    }
}
