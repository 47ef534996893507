//! Configuration: the TOML file, `LB_*` environment variables and flags merged into one validated
//! [`Config`]. Unknown keys are refused; every error names the key, the value and the reason.

mod datapath;
mod discovery;
mod duration;
mod failfast;
mod health;
mod metrics;
mod parse_error;
mod resolve;
pub mod schema;
mod validate;

pub use datapath::{DEFAULT_ORPHAN_TIMEOUT, DatapathConfig, DatapathMode, Forwarding, Namespaces};
pub use discovery::{
    DEFAULT_DISCOVERY_INTERVAL, DEFAULT_DISCOVERY_TIMEOUT, DEFAULT_FILE_INTERVAL, DiscoveryConfig,
    DnsDiscovery, EtcdDiscovery, FileDiscovery, MIN_DISCOVERY_INTERVAL, NameserverError,
    nameserver,
};
pub use duration::{Dur, DurationError, parse_duration};
pub use failfast::{FailFastConfig, SynTimeout};
pub use health::{CheckKind, HealthConfig, KillScope, OnUnhealthy, StatusMatch};
pub use metrics::{Compat, MetricsConfig, compat_name};
pub use resolve::{DEFAULT_RESOLVE_INTERVAL, DnsConfig, Resolve};
pub use validate::CredentialFiles;

use std::{
    fmt,
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{
    addr::{ProxyUrl, ServerAddr},
    files,
};

/// Exit code of `lb config check` and `lb run` for an invalid configuration.
pub const EXIT_INVALID_CONFIG: i32 = 2;

/// Default admin listen address: loopback only, port 9901.
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9901";
/// Default per-server dial timeout: 10 s, as the K3s agent load balancer uses.
pub const DEFAULT_DIAL_TIMEOUT: Duration = Duration::from_secs(10);
/// Default budget for one client's whole dial attempt across servers: 30 s.
pub const DEFAULT_CONNECT_BUDGET: Duration = Duration::from_secs(30);
/// Default bound on bytes queued toward one server per connection: 4 MiB.
pub const DEFAULT_MAX_BUFFERED_BYTES: u64 = 4 * 1024 * 1024;
/// Default grace period for draining connections on SIGTERM: 30 s.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// A configuration error: which key, which value, why.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The TOML did not parse or did not match the schema (unknown key, wrong type).
    #[error("{path}: {message}")]
    Parse {
        /// The file, or `<flags>`.
        path: String,
        /// toml's message (line, column, the line with a caret, the reason) with the full
        /// dotted key.
        message: String,
    },
    /// A value parsed but is not acceptable.
    #[error("invalid value for `{key}` = {value:?}: {reason}")]
    Invalid {
        /// Dotted key, e.g. `balancer[0].servers`.
        key: String,
        /// The offending value as given.
        value: String,
        /// Why it was refused.
        reason: String,
    },
}

impl ConfigError {
    /// Shorthand for [`ConfigError::Invalid`].
    pub fn invalid(
        key: impl Into<String>,
        value: impl fmt::Display,
        reason: impl Into<String>,
    ) -> Self {
        ConfigError::Invalid {
            key: key.into(),
            value: value.to_string(),
            reason: reason.into(),
        }
    }
}

/// Check that `path` is a regular file of at most [`files::INPUT_LIMIT`] bytes that can be read
/// (and, with `non_empty`, holds something).
fn readable_file(key: &str, path: &Path, non_empty: bool) -> Result<(), ConfigError> {
    match files::read_limited(path, files::INPUT_LIMIT) {
        Ok(bytes) if non_empty && bytes.iter().all(u8::is_ascii_whitespace) => Err(
            ConfigError::invalid(key, path.display(), "the file is empty"),
        ),
        Ok(_) => Ok(()),
        Err(files::ReadError::Io(e)) if path.starts_with(CREDENTIALS_DIR) => {
            Err(ConfigError::invalid(
                key,
                path.display(),
                format!(
                    "cannot read it: {e}; a systemd credential exists only while its unit runs: check the config with `lb config check --skip-files`"
                ),
            ))
        }
        Err(e) => Err(ConfigError::invalid(key, path.display(), e.to_string())),
    }
}

/// The config file's text, at most [`files::CONFIG_LIMIT`] bytes of a regular file.
fn read_config_text(path: &Path) -> Result<String, ConfigError> {
    files::read_limited_string(path, files::CONFIG_LIMIT).map_err(|e| ConfigError::Read {
        path: path.to_path_buf(),
        source: e.into(),
    })
}

/// Where systemd hands a unit its credentials (`LoadCredential=`), only while the unit runs.
const CREDENTIALS_DIR: &str = "/run/credentials";

/// A client certificate and its key go together: the one given without the other is named.
fn paired_files(
    prefix: &str,
    cert: Option<&PathBuf>,
    key: Option<&PathBuf>,
) -> Result<(), ConfigError> {
    match (cert, key) {
        (Some(p), None) => Err(ConfigError::invalid(
            format!("{prefix}.cert_file"),
            p.display(),
            "needs key_file beside it",
        )),
        (None, Some(p)) => Err(ConfigError::invalid(
            format!("{prefix}.key_file"),
            p.display(),
            "needs cert_file beside it",
        )),
        _ => Ok(()),
    }
}

/// Server selection policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// K3s: one ACTIVE server at a time, fail over in preference order, fail back.
    #[default]
    Failover,
    /// Rotate over usable servers.
    RoundRobin,
    /// Power of two random choices by open connections.
    LeastConnections,
    /// Uniformly random usable server.
    Random,
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Policy::Failover => "failover",
            Policy::RoundRobin => "round-robin",
            Policy::LeastConnections => "least-connections",
            Policy::Random => "random",
        })
    }
}

/// `[admin]`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Admin HTTP listen address; default `127.0.0.1:9901`.
    #[schemars(with = "schema::ListenAddr")]
    pub listen: SocketAddr,
    /// Also serve on this unix socket (mode 0600).
    pub unix_socket: Option<PathBuf>,
    /// File holding a bearer token: required on every request but `/livez` and `/readyz`,
    /// and what lets a caller other than root or lb's user make changes.
    pub token_file: Option<PathBuf>,
    /// Allow a non-loopback `listen` without `token_file` (anyone who reaches it may read
    /// `/status` and `/metrics`; changes still come only from root or lb's user on this host).
    pub allow_without_token: bool,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: DEFAULT_ADMIN_LISTEN.parse().expect("constant address"),
            unix_socket: None,
            token_file: None,
            allow_without_token: false,
        }
    }
}

/// `all_failed`: a client's fate when every server is FAILED.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum AllFailed {
    /// Dial every server at once, bounded by `dial_timeout` and `connect_budget`; the first
    /// to answer serves the client, which is reset as soon as all have failed (K3s #10240:
    /// never refuse while a dial could still work).
    #[default]
    Try,
    /// Reset the client at once (HAProxy's behaviour with no server up).
    Refuse,
}

/// `[[balancer]]`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BalancerConfig {
    /// Unique name, used in metrics, the admin API and the state file.
    pub name: String,
    /// Listen addresses (IPv4 and IPv6).
    #[schemars(with = "Vec<schema::ListenAddr>")]
    pub listen: Vec<SocketAddr>,
    /// Servers as `host:port` (host names resolve to every A/AAAA record). May be empty when
    /// `discovery` is set: the set then comes from the state file or the first discovery run.
    #[serde(default)]
    pub servers: Vec<ServerAddr>,
    /// Keep the server list current from a source (DNS, etcd member list, file).
    #[serde(default)]
    pub discovery: Option<DiscoveryConfig>,
    /// Server of last resort; kept as STANDBY when not in `servers`.
    #[serde(default)]
    pub default_server: Option<ServerAddr>,
    /// follow | once: whether host names in `servers` and `default_server` are re-resolved
    /// at their TTL or pinned when they enter the set; `[dns] resolve` when absent.
    #[serde(default)]
    pub resolve: Option<Resolve>,
    /// failover | round-robin | least-connections | random.
    #[serde(default)]
    pub policy: Policy,
    /// Fail back to a more preferred server when it recovers (failover policy); default true.
    #[serde(default = "default_true")]
    pub failback: bool,
    /// Bound on one dial; default 10 s.
    #[serde(default = "default_dial_timeout")]
    pub dial_timeout: Dur,
    /// Bound on one client's whole dial attempt; default 30 s.
    #[serde(default = "default_connect_budget")]
    pub connect_budget: Dur,
    /// What a client gets when every server is FAILED: `try` (dial them all at once, K3s's rule
    /// never to refuse while a dial could still work) or `refuse` (reset it at once).
    #[serde(default)]
    pub all_failed: AllFailed,
    /// JSON file remembering servers and default across restarts.
    #[serde(default)]
    pub state_file: Option<PathBuf>,
    /// Dial through this HTTP CONNECT proxy (`http://host:port`); NO_PROXY is honoured.
    #[serde(default)]
    pub proxy: Option<ProxyUrl>,
    /// auto | splice | connect; `[datapath] forwarding` when absent.
    #[serde(default)]
    pub forwarding: Option<Forwarding>,
    /// own | all: the network namespaces whose sockets the kernel programs rewrite or register;
    /// `[datapath] namespaces` when absent.
    #[serde(default)]
    pub namespaces: Option<Namespaces>,
    /// Connect-time fail fast; `[datapath.fail_fast]` when absent.
    #[serde(default)]
    pub fail_fast: Option<FailFastConfig>,
    /// The `name` label of the `[metrics] compat` series; K3s's service name for the balancers
    /// of the shipped K3s and RKE2 layouts, the balancer's `name` for others.
    #[serde(default)]
    pub metrics_name: Option<String>,
    /// Most client connections through lb (splice or copy) at once; beyond it a new client is
    /// reset at once and counted. None: no limit. Connect-time clients never reach lb.
    #[serde(default)]
    pub max_connections: Option<u32>,
    /// Close a connection through lb that carried no byte either way for this long; none (the
    /// default): never, as watches are long and quiet.
    #[serde(default)]
    pub idle_timeout: Option<Dur>,
    /// Health checking.
    #[serde(default)]
    pub health: HealthConfig,
}

fn default_true() -> bool {
    true
}
fn default_dial_timeout() -> Dur {
    Dur(DEFAULT_DIAL_TIMEOUT)
}
fn default_connect_budget() -> Dur {
    Dur(DEFAULT_CONNECT_BUDGET)
}

/// The whole configuration.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `[admin]`: the admin HTTP API's address, unix socket and token.
    #[serde(default)]
    pub admin: AdminConfig,
    /// `[datapath]`: the data path (kernel splice, copy, connect-time) and its bounds.
    #[serde(default)]
    pub datapath: DatapathConfig,
    /// `[metrics]`: K3s or RKE2 series and a listener for `GET /metrics` alone.
    #[serde(default)]
    pub metrics: MetricsConfig,
    /// `[dns]`: how host names of server lists are resolved.
    #[serde(default)]
    pub dns: DnsConfig,
    /// Grace period for draining on SIGTERM; default 30 s.
    #[serde(default = "default_shutdown_grace")]
    pub shutdown_grace: Dur,
    /// `[[balancer]]` tables: each one's listeners, servers and health check.
    #[serde(default, rename = "balancer")]
    pub balancers: Vec<BalancerConfig>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            admin: AdminConfig::default(),
            datapath: DatapathConfig::default(),
            metrics: MetricsConfig::default(),
            dns: DnsConfig::default(),
            shutdown_grace: default_shutdown_grace(),
            balancers: Vec::new(),
        }
    }
}

fn default_shutdown_grace() -> Dur {
    Dur(DEFAULT_SHUTDOWN_GRACE)
}

/// Overrides from flags and `LB_*` variables (clap reads both; flags win).
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    /// `--listen` (defines or replaces the single balancer's listeners).
    pub listen: Vec<SocketAddr>,
    /// `--server`.
    pub servers: Vec<ServerAddr>,
    /// `--default-server`.
    pub default_server: Option<ServerAddr>,
    /// `--datapath`.
    pub datapath: Option<DatapathMode>,
    /// `--admin-listen`.
    pub admin_listen: Option<SocketAddr>,
    /// `--health-loop`.
    pub health_loop: Option<bool>,
    /// `--cgroup`.
    pub cgroup: Option<PathBuf>,
    /// `--forwarding`: every balancer's forwarding.
    pub forwarding: Option<Forwarding>,
    /// `--namespaces`: every balancer's network namespace scope.
    pub namespaces: Option<Namespaces>,
    /// `--pin-dir`.
    pub pin_dir: Option<PathBuf>,
}

impl Config {
    /// The forwarding `b` asked for: its own, else `[datapath] forwarding`.
    pub fn forwarding_of(&self, b: &BalancerConfig) -> Forwarding {
        b.forwarding.unwrap_or(self.datapath.forwarding)
    }

    /// Whether `b` takes connect-time forwarding when the kernel has it: `connect`, or `auto`
    /// without a `proxy` (clients that connect straight to a server cannot go through one).
    pub fn wants_connect(&self, b: &BalancerConfig) -> bool {
        match self.forwarding_of(b) {
            Forwarding::Connect => true,
            Forwarding::Auto => b.proxy.is_none(),
            Forwarding::Splice => false,
        }
    }

    /// The `fail_fast` of `b`: its own, else `[datapath.fail_fast]`.
    pub fn fail_fast_of(&self, b: &BalancerConfig) -> FailFastConfig {
        b.fail_fast.unwrap_or(self.datapath.fail_fast)
    }

    /// The network namespaces `b`'s kernel programs act in: its own `namespaces`, else
    /// `[datapath] namespaces`.
    pub fn namespaces_of(&self, b: &BalancerConfig) -> Namespaces {
        b.namespaces.unwrap_or(self.datapath.namespaces)
    }

    /// Whether `b`'s host names follow DNS: its own `resolve`, else `[dns] resolve`.
    pub fn resolve_of(&self, b: &BalancerConfig) -> Resolve {
        b.resolve.unwrap_or(self.dns.resolve)
    }

    /// Parse TOML text.
    ///
    /// # Errors
    /// [`ConfigError::Parse`] naming the key (unknown keys are refused), then whatever
    /// [`Config::validate`] refuses.
    pub fn from_toml(text: &str, origin: &str) -> Result<Config, ConfigError> {
        Config::from_toml_with(text, origin, CredentialFiles::Read)
    }

    /// Parse TOML text, reading the credential files it names or not as `files` says.
    ///
    /// # Errors
    /// As [`Config::from_toml`], without the unreadable-file refusals under
    /// [`CredentialFiles::Skip`].
    pub fn from_toml_with(
        text: &str,
        origin: &str,
        files: CredentialFiles,
    ) -> Result<Config, ConfigError> {
        let cfg: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: origin.to_string(),
            message: parse_error::message(&e, text),
        })?;
        cfg.validate_with(files)?;
        Ok(cfg)
    }

    /// Read and parse a file.
    ///
    /// # Errors
    /// [`ConfigError::Read`] or as [`Config::from_toml`].
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        Config::from_file_with(path, CredentialFiles::Read)
    }

    /// Read and parse a file, reading the credential files it names or not as `files` says.
    ///
    /// # Errors
    /// [`ConfigError::Read`] or as [`Config::from_toml_with`].
    pub fn from_file_with(path: &Path, files: CredentialFiles) -> Result<Config, ConfigError> {
        let text = read_config_text(path)?;
        Config::from_toml_with(&text, &path.display().to_string(), files)
    }

    /// Build from an optional file plus overrides, then validate.
    ///
    /// With no file, `--listen` and `--server` define one balancer named `default`. With a file,
    /// `--listen`/`--server`/`--default-server` apply to the file's only balancer (an error with
    /// several).
    ///
    /// # Errors
    /// As [`Config::from_file`], or [`ConfigError::Invalid`] for overrides that do not fit.
    #[expect(
        clippy::too_many_lines,
        reason = "the file, the environment and the flags applied in precedence order, each override a line"
    )]
    pub fn load(file: Option<&Path>, o: &Overrides) -> Result<Config, ConfigError> {
        let mut cfg = match file {
            Some(path) => {
                let text = read_config_text(path)?;
                toml::from_str::<Config>(&text).map_err(|e| ConfigError::Parse {
                    path: path.display().to_string(),
                    message: parse_error::message(&e, &text),
                })?
            }
            None => Config::default(),
        };
        let touches_balancer =
            !o.listen.is_empty() || !o.servers.is_empty() || o.default_server.is_some();
        if touches_balancer {
            if cfg.balancers.is_empty() {
                cfg.balancers.push(BalancerConfig {
                    name: "default".into(),
                    listen: Vec::new(),
                    servers: Vec::new(),
                    discovery: None,
                    default_server: None,
                    resolve: None,
                    policy: Policy::Failover,
                    failback: true,
                    dial_timeout: default_dial_timeout(),
                    connect_budget: default_connect_budget(),
                    all_failed: AllFailed::Try,
                    state_file: None,
                    proxy: None,
                    forwarding: None,
                    namespaces: None,
                    fail_fast: None,
                    metrics_name: None,
                    max_connections: None,
                    idle_timeout: None,
                    health: HealthConfig::default(),
                });
            }
            if cfg.balancers.len() > 1 {
                return Err(ConfigError::invalid(
                    "--listen/--server/--default-server",
                    format!("{} balancers", cfg.balancers.len()),
                    "flags can only shape a config with a single [[balancer]]",
                ));
            }
            let b = &mut cfg.balancers[0];
            if !o.listen.is_empty() {
                b.listen.clone_from(&o.listen);
            }
            if !o.servers.is_empty() {
                b.servers.clone_from(&o.servers);
            }
            if o.default_server.is_some() {
                b.default_server.clone_from(&o.default_server);
            }
        }
        if let Some(mode) = o.datapath {
            cfg.datapath.mode = mode;
        }
        if let Some(listen) = o.admin_listen {
            cfg.admin.listen = listen;
        }
        if let Some(enabled) = o.health_loop {
            for b in &mut cfg.balancers {
                b.health.loop_enabled = enabled;
            }
        }
        if o.cgroup.is_some() {
            cfg.datapath.cgroup.clone_from(&o.cgroup);
        }
        if let Some(f) = o.forwarding {
            cfg.datapath.forwarding = f;
            for b in &mut cfg.balancers {
                b.forwarding = Some(f);
            }
        }
        if o.pin_dir.is_some() {
            cfg.datapath.pin_dir.clone_from(&o.pin_dir);
        }
        if let Some(n) = o.namespaces {
            cfg.datapath.namespaces = n;
            for b in &mut cfg.balancers {
                b.namespaces = Some(n);
            }
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests;
