//! Command line: `lb run`, `lb config check`, and the admin client commands.

use std::{net::SocketAddr, path::PathBuf};

use clap::{Args, Parser, Subcommand};

use crate::config::{DatapathMode, Overrides};

/// lb: a client-side TCP load balancer with an eBPF splice data path.
#[derive(Debug, Parser)]
#[command(name = "lb", version, about)]
pub struct Cli {
    /// Log filter (tracing EnvFilter syntax), e.g. `info`, `lb=debug`.
    #[arg(long, global = true, env = "LB_LOG", default_value = "info")]
    pub log: String,
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon.
    Run(RunArgs),
    /// Configuration helpers.
    #[command(subcommand)]
    Config(ConfigCommand),
}

/// `lb run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// TOML config file.
    #[arg(long, env = "LB_CONFIG")]
    pub config: Option<PathBuf>,
    /// Listen address (repeat for several; IPv4 and IPv6).
    #[arg(long, env = "LB_LISTEN", value_delimiter = ',')]
    pub listen: Vec<SocketAddr>,
    /// Server `host:port` (repeat for several), in order of preference.
    #[arg(long, env = "LB_SERVER", value_delimiter = ',')]
    pub server: Vec<String>,
    /// Server of last resort.
    #[arg(long, env = "LB_DEFAULT_SERVER")]
    pub default_server: Option<String>,
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
        }
    }
}

/// `lb config ...`.
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Validate a config file: exit 0 when valid, 2 with the key and reason when not.
    Check {
        /// The file.
        file: PathBuf,
    },
}
