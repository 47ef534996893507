//! `lb config check [--skip-files] FILE`: validate a config file without starting anything.

use std::{path::Path, process::ExitCode};

use crate::config::{
    BalancerConfig, Config, ConfigError, CredentialFiles, EXIT_INVALID_CONFIG, Forwarding,
    Namespaces, Resolve,
};

/// Validate `file`, reading the credential files it names or not as `files` says: print a
/// summary (one line, then one per balancer saying how it forwards and which network
/// namespaces its kernel programs act in) and exit 0, or print the error (naming the key, the
/// value and the reason) and exit 2. Each balancer line also says whether its host names
/// follow DNS (`resolve`).
pub fn check(file: &Path, files: CredentialFiles) -> ExitCode {
    match Config::from_file_with(file, files) {
        Ok(cfg) => {
            let names: Vec<&str> = cfg.balancers.iter().map(|b| b.name.as_str()).collect();
            println!(
                "{}: valid ({} balancer(s): {})",
                file.display(),
                cfg.balancers.len(),
                names.join(", ")
            );
            for b in &cfg.balancers {
                println!("  {}", describe(&cfg, b));
            }
            ExitCode::SUCCESS
        }
        // A read or parse error names the file already.
        Err(e @ (ConfigError::Read { .. } | ConfigError::Parse { .. })) => {
            eprintln!("lb: invalid: {e}");
            ExitCode::from(u8::try_from(EXIT_INVALID_CONFIG).unwrap_or(2))
        }
        Err(e) => {
            eprintln!("lb: {}: invalid: {e}", file.display());
            ExitCode::from(u8::try_from(EXIT_INVALID_CONFIG).unwrap_or(2))
        }
    }
}

/// One balancer's forwarding and namespace scope, as `lb config check` prints it.
fn describe(cfg: &Config, b: &BalancerConfig) -> String {
    let forwarding = match cfg.forwarding_of(b) {
        Forwarding::Auto if b.proxy.is_some() => {
            "auto (splice: its servers are dialed through a proxy)"
        }
        Forwarding::Auto => "auto (connect-time where the kernel has the hooks, else splice)",
        Forwarding::Splice => "splice",
        Forwarding::Connect => "connect",
    };
    let namespaces = cfg.namespaces_of(b);
    let scope = match namespaces {
        Namespaces::Own => "the kernel acts on clients in lb's network namespace only",
        Namespaces::All => "the kernel acts on clients in every network namespace under the cgroup",
    };
    let resolve = match cfg.resolve_of(b) {
        Resolve::Follow => "follow (host names are re-resolved at their DNS TTL)",
        Resolve::Once => "once (host names keep the addresses they had when they entered the set)",
    };
    format!(
        "balancer {}: forwarding {forwarding}, namespaces {namespaces} ({scope}), resolve {resolve}",
        b.name
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn describes_forwarding_and_namespaces() {
        let text = r#"
[datapath]
namespaces = "all"

[[balancer]]
name = "api"
listen = ["127.0.0.1:6443"]
servers = ["198.18.0.2:6443"]
forwarding = "connect"
namespaces = "own"

[[balancer]]
name = "etcd"
listen = ["127.0.0.1:2379"]
servers = ["198.18.0.2:2379"]
forwarding = "splice"
resolve = "once"

[[balancer]]
name = "supervisor"
listen = ["127.0.0.1:9345"]
servers = ["198.18.0.2:9345"]
"#;
        let cfg = Config::from_toml(text, "test").unwrap();
        assert_eq!(
            describe(&cfg, &cfg.balancers[0]),
            "balancer api: forwarding connect, namespaces own (the kernel acts on clients in lb's network namespace only), resolve follow (host names are re-resolved at their DNS TTL)"
        );
        assert_eq!(
            describe(&cfg, &cfg.balancers[1]),
            "balancer etcd: forwarding splice, namespaces all (the kernel acts on clients in every network namespace under the cgroup), resolve once (host names keep the addresses they had when they entered the set)"
        );
        assert_eq!(
            describe(&cfg, &cfg.balancers[2]),
            "balancer supervisor: forwarding auto (connect-time where the kernel has the hooks, else splice), namespaces all (the kernel acts on clients in every network namespace under the cgroup), resolve follow (host names are re-resolved at their DNS TTL)"
        );
    }
}
