//! `lb config check [--skip-files] FILE`: validate a config file without starting anything;
//! `lb config schema`: print the config file's JSON Schema.

use std::{io::Write as _, path::Path, process::ExitCode};

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
            for w in cfg.warnings() {
                eprintln!("lb: warning: {}: {w}", file.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{}", invalid(Some(file), &e));
            ExitCode::from(u8::try_from(EXIT_INVALID_CONFIG).unwrap_or(2))
        }
    }
}

/// Print the config file's JSON Schema ([`crate::config::schema`]) to stdout, indented, and
/// exit 0; 1 when stdout cannot take it.
pub fn schema() -> ExitCode {
    let text = serde_json::to_string_pretty(&crate::config::schema::schema())
        .expect("a JSON value serialises");
    match writeln!(std::io::stdout(), "{text}") {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lb: config schema: cannot write to stdout: {e}");
            ExitCode::from(super::EXIT_FAILURE)
        }
    }
}

/// What every command prints for a configuration it refuses (`lb config check`, `lb run`,
/// `lb cleanup`): `lb: invalid configuration: FILE: ...`; without a file (flags alone) the
/// file is left out. A TOML syntax error keeps toml's lines: the line, a caret under the
/// value, and the reason.
pub fn invalid(file: Option<&Path>, e: &ConfigError) -> String {
    match (file, e) {
        // A read or parse error names the file already.
        (Some(_), ConfigError::Read { .. } | ConfigError::Parse { .. }) | (None, _) => {
            format!("lb: invalid configuration: {e}")
        }
        (Some(file), ConfigError::Invalid { .. }) => {
            format!("lb: invalid configuration: {}: {e}", file.display())
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

    /// One balancer on 127.0.0.1:6443 with `extra` appended.
    fn one(extra: &str) -> String {
        format!(
            "[[balancer]]\nname = \"api\"\nlisten = [\"127.0.0.1:6443\"]\n\
             servers = [\"198.18.0.2:6443\"]\n{extra}"
        )
    }

    fn refusal(text: &str) -> String {
        let e = Config::from_toml(text, "lb.toml").unwrap_err();
        invalid(Some(Path::new("lb.toml")), &e)
    }

    #[test]
    fn parse_errors_keep_the_line_and_a_caret() {
        let msg = refusal(&one("[balancer.health]\ninterval = \"bogus\"\n"));
        assert!(
            msg.starts_with(
                "lb: invalid configuration: lb.toml: TOML parse error at line 6, column 12 (key `balancer[0].health.interval`)\n"
            ),
            "{msg}"
        );
        assert!(msg.contains("6 | interval = \"bogus\"\n"), "{msg}");
        assert!(msg.contains("  |            ^^^^^^^\n"), "{msg}");
        assert!(
            msg.ends_with("`bogus` is not a duration like 250ms, 10s or 1m (expected number at 0)"),
            "{msg}"
        );
    }

    #[test]
    fn every_refusal_has_one_prefix() {
        let msg = refusal(&one("[balancer.health]\nrise = 0\n"));
        assert!(
            msg.starts_with(
                "lb: invalid configuration: lb.toml: invalid value for `balancer[0].health.rise`"
            ),
            "{msg}"
        );
        let e = Config::from_file(Path::new("/nonexistent/lb.toml")).unwrap_err();
        assert_eq!(
            invalid(Some(Path::new("/nonexistent/lb.toml")), &e),
            "lb: invalid configuration: cannot read config file /nonexistent/lb.toml: No such file or directory (os error 2)"
        );
        let e = Config::load(None, &crate::config::Overrides::default()).unwrap_err();
        assert!(
            invalid(None, &e)
                .starts_with("lb: invalid configuration: invalid value for `balancer`"),
            "{e}"
        );
    }

    #[test]
    fn values_are_printed_as_written() {
        let msg = refusal(&one(
            "[balancer.health]\nkind = \"http\"\nurl = \"http://{server}/\"\nexpect_status = [700]\n",
        ));
        assert!(
            msg.ends_with(
                "`balancer[0].health.expect_status` = \"700\": HTTP status codes are 100-599"
            ),
            "{msg}"
        );
        let msg = refusal(&one(
            "[balancer.health]\nkind = \"http\"\nurl = \"http://{server}/\"\nexpect_status = [\"200-700\"]\n",
        ));
        assert!(msg.contains("= \"200-700\": HTTP status"), "{msg}");
        let msg = refusal(&one("").replace(
            "\"198.18.0.2:6443\"]",
            "\"198.18.0.2:6443\", \"127.0.0.1:6443\"]",
        ));
        assert!(
            msg.ends_with("`balancer[0].servers` = \"127.0.0.1:6443\": server 127.0.0.1:6443 is this balancer's own listen address"),
            "{msg}"
        );
    }

    #[test]
    fn a_server_on_another_balancers_listener_names_it() {
        let text = format!(
            "{}[[balancer]]\nname = \"etcd\"\nlisten = [\"127.0.0.1:2379\"]\nservers = [\"127.0.0.1:6443\"]\n",
            one("")
        );
        assert_eq!(
            refusal(&text),
            "lb: invalid configuration: lb.toml: invalid value for `balancer[1].servers` = \"127.0.0.1:6443\": server 127.0.0.1:6443 is balancer api's listener, one of lb's own listen addresses: lb would dial itself"
        );
    }

    #[test]
    fn the_admin_address_is_no_listener() {
        let msg = refusal(&format!(
            "[admin]\nlisten = \"127.0.0.1:6443\"\n{}",
            one("")
        ));
        assert!(
            msg.ends_with("`admin.listen` = \"127.0.0.1:6443\": is also balancer api's listener 127.0.0.1:6443: the admin API and a balancer cannot share an address (set [admin] listen or --admin-listen to another port)"),
            "{msg}"
        );
        // From flags too, and a wildcard listener takes the loopback admin port.
        let flags = crate::config::Overrides {
            listen: vec!["0.0.0.0:9901".parse().unwrap()],
            servers: vec!["198.18.0.2:6443".parse().unwrap()],
            ..Default::default()
        };
        let e = Config::load(None, &flags).unwrap_err();
        assert!(
            invalid(None, &e).contains("`admin.listen` = \"127.0.0.1:9901\": is also balancer default's listener 0.0.0.0:9901"),
            "{e}"
        );
    }

    #[test]
    fn a_timeout_past_the_interval_is_a_warning() {
        let cfg = Config::from_toml(
            &one("[balancer.health]\ninterval = \"1s\"\ntimeout = \"5s\"\n"),
            "t",
        )
        .unwrap();
        assert_eq!(
            cfg.warnings(),
            [
                "balancer[0].health.timeout = \"5s\" is longer than its interval = \"1s\": one check runs at a time per server, so a server that stops answering is checked every 5s and found FAILED after fall × timeout"
            ]
        );
        let cfg = Config::from_toml(&one(""), "t").unwrap();
        assert!(cfg.warnings().is_empty());
    }
}
