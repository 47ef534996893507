//! Command line: `lb run`, the admin client commands (`lb status`, `lb servers`, `lb check`),
//! `lb config check` and `lb config schema`, `lb cleanup` (the connect-time pins), and `lb completions` / `lb man`. One file per subcommand under `cli/`;
//! every option also reads an `LB_*` environment variable (flags win).
//!
//! Exit codes: 0 success (for `lb check`: healthy); 1 failure (`lb check`: unhealthy or the
//! daemon unreachable); 2 invalid usage or configuration (clap's own usage errors are 2 too).

pub mod check;
pub mod cleanup;
mod compat;
pub mod config;
pub mod docs;
mod man;
mod owner;
mod process;
pub mod run;
pub mod servers;
pub mod status;
mod table;
pub mod takeover;
pub mod upgrade;

use std::{net::SocketAddr, path::PathBuf, process::ExitCode, time::Duration};

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::{
    addr::ServerAddr,
    admin::client::{AdminClient, ClientError, Endpoint},
    config::{
        DEFAULT_ADMIN_LISTEN, DatapathMode, Forwarding, Namespaces, Overrides, parse_duration,
    },
};

/// Exit code for a failure (and for `lb check`, unhealthy).
pub const EXIT_FAILURE: u8 = 1;
/// Exit code for invalid usage or configuration.
pub const EXIT_USAGE: u8 = 2;

/// A client-side TCP load balancer with an eBPF splice data path.
#[derive(Debug, Parser)]
#[command(name = "lb", version, about, propagate_version = true)]
pub struct Cli {
    /// Log filter (tracing EnvFilter syntax), e.g. `info`, `lb=debug`; `RUST_LOG` when absent,
    /// else `info`. `info,lb::kernel=debug` adds the kernel programs' events (read at start).
    #[arg(
        long = "log-level",
        visible_alias = "log",
        global = true,
        env = "LB_LOG"
    )]
    pub log_level: Option<String>,
    /// Log format.
    #[arg(long, global = true, env = "LB_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// `--log-format`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// `--output` of the client commands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// A table for people.
    #[default]
    Text,
    /// The admin API's JSON, for programs.
    Json,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon.
    Run(RunArgs),
    /// Show every balancer and its servers (state, connections, last check).
    Status(status::StatusArgs),
    /// Change a balancer's servers: set, add, remove, drain, enable, disable, kill.
    Servers(servers::ServersArgs),
    /// Run the health checks now; exit 0 when healthy, 1 when not.
    Check(check::CheckArgs),
    /// Replace the running daemon with the binary now at its path without dropping a
    /// connection; exit 0 once the new one serves, 1 (old one serving on) with the reason.
    Upgrade(upgrade::UpgradeArgs),
    /// Configuration helpers.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Detach the connect-time programs a stopped lb left pinned and remove the pins; refused
    /// while a lb holds them. Not for a stop hook: the pins serve clients between runs.
    Cleanup(cleanup::CleanupArgs),
    /// Print a shell completion script to stdout.
    Completions(docs::CompletionsArgs),
    /// Print the man page to stdout, or write one page per command into a directory.
    Man(docs::ManArgs),
    /// lb's own helper on kernels without `SO_NETNS_COOKIE` (before 5.14): join cgroup
    /// `--cgroup` and connect to `127.0.0.1:--port`, so the connect program records this
    /// network namespace's cookie. lb runs it; it is not for operators.
    #[command(hide = true, name = "netns-probe")]
    NetnsProbe(NetnsProbeArgs),
}

/// `lb netns-probe` (hidden): what lb passes its probe process.
#[derive(Debug, Args)]
pub struct NetnsProbeArgs {
    /// The cgroup to join (lb makes it under the data path's cgroup and removes it after).
    #[arg(long)]
    pub cgroup: std::path::PathBuf,
    /// The loopback port to connect to (nothing listens there).
    #[arg(long)]
    pub port: u16,
}

/// How the client commands reach the daemon.
#[derive(Clone, Debug, Args)]
pub struct AdminArgs {
    /// Admin API: `host:port`, `http://host:port`, `unix:/path` or `/path`.
    #[arg(long, global = true, env = "LB_ADMIN", default_value = DEFAULT_ADMIN_LISTEN)]
    pub admin: Endpoint,
    /// File holding the admin bearer token (`[admin] token_file` of the daemon).
    #[arg(long, global = true, env = "LB_ADMIN_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Bound on one request to the admin API (`lb check` adds its own timeout).
    #[arg(long, global = true, env = "LB_ADMIN_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub request_timeout: Duration,
}

impl AdminArgs {
    /// A client with these settings, its request bound raised by `extra`.
    ///
    /// # Errors
    /// [`ClientError::Token`] when the token file is unusable.
    pub fn client(&self, extra: Duration) -> Result<AdminClient, ClientError> {
        AdminClient::new(
            self.admin.clone(),
            self.token_file.as_deref(),
            self.request_timeout + extra,
        )
    }
}

/// Print a client error and pick the exit code: 2 for requests the daemon refused as invalid
/// (400, 404, 409, 413), 1 otherwise.
pub fn report_error(e: &ClientError) -> ExitCode {
    eprintln!("lb: {e}");
    match e {
        ClientError::Status { status, .. }
            if status.is_client_error() && status.as_u16() != 401 =>
        {
            ExitCode::from(EXIT_USAGE)
        }
        ClientError::Token { .. } => ExitCode::from(EXIT_USAGE),
        _ => ExitCode::from(EXIT_FAILURE),
    }
}

/// `lb run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// TOML config file.
    #[arg(long, env = "LB_CONFIG")]
    pub config: Option<PathBuf>,
    /// Listen address (repeat for several; IPv4 and IPv6). Without --config, --listen and
    /// --server make one balancer named `default` (`lb servers ... -b default`).
    #[arg(long, env = "LB_LISTEN", value_delimiter = ',')]
    pub listen: Vec<SocketAddr>,
    /// Server `host:port` (repeat for several), in order of preference.
    #[arg(long, env = "LB_SERVER", value_delimiter = ',')]
    pub server: Vec<ServerAddr>,
    /// Server of last resort.
    #[arg(long, env = "LB_DEFAULT_SERVER")]
    pub default_server: Option<ServerAddr>,
    /// Data path: auto (kernel splice, falling back with a warning), bpf, userspace.
    #[arg(long, env = "LB_DATAPATH", value_enum)]
    pub datapath: Option<DatapathMode>,
    /// Admin HTTP listen address (default 127.0.0.1:9901).
    #[arg(long, env = "LB_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
    /// Run the periodic health check loop (false: checks run before dials and on /check).
    #[arg(long, env = "LB_HEALTH_LOOP", action = clap::ArgAction::Set, num_args = 1)]
    pub health_loop: Option<bool>,
    /// cgroup v2 directory for the sockops program (detected when absent).
    #[arg(long, env = "LB_CGROUP")]
    pub cgroup: Option<PathBuf>,
    /// Forwarding of every balancer: splice (through lb) or connect (the kernel sends clients
    /// in the cgroup straight to the chosen server at connect(); kernel 5.8+).
    #[arg(long, env = "LB_FORWARDING", value_enum)]
    pub forwarding: Option<Forwarding>,
    /// Network namespaces every balancer's kernel programs act in: own (lb's, where its
    /// listeners live) or all (every namespace under the cgroup).
    #[arg(long, env = "LB_NAMESPACES", value_enum)]
    pub namespaces: Option<Namespaces>,
    /// Directory in a bpffs for the connect-time pins (`[datapath] pin_dir`).
    #[arg(long, env = "LB_PIN_DIR")]
    pub pin_dir: Option<PathBuf>,
}

impl RunArgs {
    /// The overrides these flags carry.
    pub fn overrides(&self) -> Overrides {
        Overrides {
            listen: self.listen.clone(),
            servers: self.server.clone(),
            default_server: self.default_server.clone(),
            datapath: self.datapath,
            admin_listen: self.admin_listen,
            health_loop: self.health_loop,
            cgroup: self.cgroup.clone(),
            forwarding: self.forwarding,
            namespaces: self.namespaces,
            pin_dir: self.pin_dir.clone(),
        }
    }
}

/// `lb config ...`.
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Validate a config file: exit 0 when valid, 2 with the key, value and reason when not.
    Check {
        /// The file.
        file: PathBuf,
        /// Do not read the credential files the config names (`[admin] token_file`; the
        /// `ca_file`, `cert_file` and `key_file` of health checks and etcd discovery), for a
        /// machine without them. Every other key is still checked, a certificate still needs its
        /// key beside it.
        #[arg(long)]
        skip_files: bool,
    },
    /// Print a JSON Schema of the config file, for editors that check TOML (taplo, VS Code).
    ///
    /// It has every key with its type, default and description, and the spelling of every
    /// value; `lb config check` also checks the rules between keys. Exit 0, or 1 when standard
    /// output cannot take it.
    Schema,
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::*;

    #[test]
    fn command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn client_commands_parse() {
        let cli = Cli::try_parse_from([
            "lb",
            "servers",
            "--admin",
            "unix:/run/lb.sock",
            "set",
            "--balancer",
            "api",
            "198.18.0.2:80",
            "198.18.0.3:80",
        ])
        .unwrap();
        let Command::Servers(s) = cli.command else {
            panic!("not servers")
        };
        assert_eq!(s.admin.admin, Endpoint::Unix("/run/lb.sock".into()));
        let check = Cli::try_parse_from(["lb", "check", "--timeout", "250ms"]).unwrap();
        let Command::Check(c) = check.command else {
            panic!("not check")
        };
        assert_eq!(c.timeout, Some(Duration::from_millis(250)));
        assert!(Cli::try_parse_from(["lb", "check", "--timeout", "soon"]).is_err());
        assert!(Cli::try_parse_from(["lb", "status", "--output", "yaml"]).is_err());
        let config = Cli::try_parse_from(["lb", "config", "check", "--skip-files", "f.toml"]);
        let Command::Config(ConfigCommand::Check { file, skip_files }) = config.unwrap().command
        else {
            panic!("not config check")
        };
        assert_eq!((file, skip_files), (PathBuf::from("f.toml"), true));
    }
}
