//! The fixture the privileged suites share: test hosts serving `lbt`, a child cgroup for
//! clients, and an `lb` process in front of them, started from a config written with [`Toml`]
//! into a file removed on drop, or from arguments alone.

use std::{fmt::Display, net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{Context as _, Result};

use crate::{Host, Lb, Place, TestCgroup, UpLb, free_port, wait_server_state};

/// A TOML config built table by table: `Toml::new().array_table("balancer").string("name",
/// "api").value("rise", 2)`. Values given with [`Toml::value`] are TOML text as written (a
/// number, a list, an inline table); [`Toml::lines`] adds lines a test passes through as they
/// are.
#[derive(Clone, Debug, Default)]
pub struct Toml(String);

impl Toml {
    /// An empty config.
    pub fn new() -> Toml {
        Toml::default()
    }

    /// A `[name]` table header.
    #[must_use]
    pub fn table(self, name: &str) -> Toml {
        self.line(&format!("\n[{name}]"))
    }

    /// A `[[name]]` header: one more element of the array of tables `name`.
    #[must_use]
    pub fn array_table(self, name: &str) -> Toml {
        self.line(&format!("\n[[{name}]]"))
    }

    /// `key = value`, `value` being TOML text as written.
    #[must_use]
    pub fn value(self, key: &str, value: impl Display) -> Toml {
        self.line(&format!("{key} = {value}"))
    }

    /// `key = "value"` (`value` holds no quote or backslash).
    #[must_use]
    pub fn string(self, key: &str, value: &str) -> Toml {
        self.line(&format!("{key} = \"{value}\""))
    }

    /// `text` as it is (any number of lines, or none).
    #[must_use]
    pub fn lines(self, text: &str) -> Toml {
        if text.is_empty() {
            self
        } else {
            self.line(text.trim_end())
        }
    }

    /// The config as text.
    pub fn text(&self) -> &str {
        &self.0
    }

    fn line(mut self, line: &str) -> Toml {
        self.0.push_str(line);
        self.0.push('\n');
        self
    }
}

/// A config file of the test's own, removed on drop.
struct ConfigFile(PathBuf);

impl ConfigFile {
    /// Write `config` to a file named after this process and `port` in the temporary directory.
    fn write(port: u16, config: &Toml) -> Result<ConfigFile> {
        let path =
            std::env::temp_dir().join(format!("lb-fixture-{}-{port}.toml", std::process::id()));
        std::fs::write(&path, config.text())?;
        Ok(ConfigFile(path))
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// What lb's config file holds, made for the test's cgroup and the listener address (none:
/// lb runs from arguments alone).
type Config<'a> = Option<&'a dyn Fn(&TestCgroup, SocketAddr) -> Toml>;

/// Hosts, a cgroup and `lb` ([`Lb`], or [`UpLb`] for one followed across `lb upgrade`) with a
/// config file of the test's own; everything is removed on drop, also when the test fails.
pub struct Fixture<L = Lb> {
    /// The servers' hosts.
    pub hosts: Vec<Host>,
    /// How `/status` names each host's server (`address:port` unless a test says otherwise).
    pub names: Vec<String>,
    /// A child cgroup made for the test (lb attaches to it when started with `--cgroup`).
    pub cg: TestCgroup,
    /// The lb process.
    pub lb: L,
    /// The balancer's listener: 127.0.0.1 and a free port.
    pub listen: SocketAddr,
    /// The config file, when lb was started with one.
    config: Option<ConfigFile>,
}

impl Fixture {
    /// `lb --config FILE ARGS` in front of `hosts`, their servers on `port`: FILE holds what
    /// `config` returns for the test's cgroup and the listener address; in `args`, `{listen}`
    /// stands for that address and `{cgroup}` for the cgroup's path. Returns once lb's admin
    /// API answers.
    ///
    /// # Errors
    /// The cgroup, the config file or lb cannot be made.
    pub fn start(
        hosts: Vec<Host>,
        port: u16,
        config: impl Fn(&TestCgroup, SocketAddr) -> Toml,
        args: &[&str],
    ) -> Result<Fixture> {
        Fixture::start_via(&[], hosts, port, config, args)
    }

    /// [`Fixture::start`] with lb run through `wrapper` (e.g. `prlimit --nofile=64 --`; see
    /// [`Lb::start_via`]).
    ///
    /// # Errors
    /// As [`Fixture::start`].
    pub fn start_via(
        wrapper: &[&str],
        hosts: Vec<Host>,
        port: u16,
        config: impl Fn(&TestCgroup, SocketAddr) -> Toml,
        args: &[&str],
    ) -> Result<Fixture> {
        Fixture::launch(hosts, port, Some(&config), args, |argv| {
            Lb::start_via(wrapper, argv)
        })
    }

    /// `lb ARGS` in front of `hosts`, their servers on `port`, with no config file (`{listen}`
    /// and `{cgroup}` in `args` as for [`Fixture::start`]). Returns once lb's admin API
    /// answers.
    ///
    /// # Errors
    /// The cgroup or lb cannot be made.
    pub fn start_args(hosts: Vec<Host>, port: u16, args: &[&str]) -> Result<Fixture> {
        Fixture::launch(hosts, port, None, args, Lb::start)
    }

    /// Wait until every server of balancer `balancer` is `want`.
    ///
    /// # Errors
    /// One is not within `within` (see [`wait_server_state`]).
    pub fn wait_all(&self, balancer: &str, want: &str, within: Duration) -> Result<()> {
        for name in &self.names {
            wait_server_state(&self.lb, balancer, name, want, within)?;
        }
        Ok(())
    }
}

impl Fixture<UpLb> {
    /// `lb run ARGS` ([`UpLb`], with `env` added to its environment) in front of `hosts`, their
    /// servers on `port`, with no config file (`{listen}` and `{cgroup}` in `args` as for
    /// [`Fixture::start`]). Returns once `/livez` answers.
    ///
    /// # Errors
    /// The cgroup or lb cannot be made.
    pub fn upgradable(
        hosts: Vec<Host>,
        port: u16,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Fixture<UpLb>> {
        Fixture::launch(hosts, port, None, args, |argv| UpLb::start(argv, env))
    }

    /// [`Fixture::upgradable`] started with `--config FILE` ahead of `args`, FILE as for
    /// [`Fixture::start`].
    ///
    /// # Errors
    /// The cgroup, the config file or lb cannot be made.
    pub fn upgradable_with_config(
        hosts: Vec<Host>,
        port: u16,
        config: impl Fn(&TestCgroup, SocketAddr) -> Toml,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Fixture<UpLb>> {
        Fixture::launch(hosts, port, Some(&config), args, |argv| {
            UpLb::start(argv, env)
        })
    }
}

impl<L> Fixture<L> {
    /// Where clients run: in [`Fixture::cg`].
    pub fn place(&self) -> Place<'_> {
        Place::cgroup(&self.cg.path)
    }

    /// lb's config file.
    ///
    /// # Errors
    /// lb was started without one.
    pub fn config_path(&self) -> Result<&std::path::Path> {
        Ok(&self.config.as_ref().context("lb has no config file")?.0)
    }

    /// Write `config` over lb's config file (for a reload or an upgrade to read).
    ///
    /// # Errors
    /// lb was started without a config file, or the file cannot be written.
    pub fn write_config(&self, config: &Toml) -> Result<()> {
        std::fs::write(self.config_path()?, config.text())?;
        Ok(())
    }

    /// Make the cgroup, pick the listener, write the config file and start lb with `start`
    /// (`--config FILE` first when there is a config, then `args` filled in).
    fn launch(
        hosts: Vec<Host>,
        port: u16,
        config: Config<'_>,
        args: &[&str],
        start: impl FnOnce(&[&str]) -> Result<L>,
    ) -> Result<Fixture<L>> {
        let cg = TestCgroup::new()?;
        let listen: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        let config = config
            .map(|c| ConfigFile::write(listen.port(), &c(&cg, listen)))
            .transpose()?;
        let cgroup = cg.path.display().to_string();
        let mut argv: Vec<String> = config
            .iter()
            .flat_map(|c| ["--config".to_string(), c.0.display().to_string()])
            .collect();
        argv.extend(args.iter().map(|a| {
            a.replace("{listen}", &listen.to_string())
                .replace("{cgroup}", &cgroup)
        }));
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let lb = start(&argv)?;
        let names = hosts.iter().map(|h| h.addr(port).to_string()).collect();
        Ok(Fixture {
            hosts,
            names,
            cg,
            lb,
            listen,
            config,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_is_written_table_by_table() {
        let t = Toml::new()
            .array_table("balancer")
            .string("name", "api")
            .value("servers", "[\"a:1\", \"b:2\"]")
            .lines("")
            .table("balancer.health")
            .value("fall", 2)
            .lines("loop = false\n");
        assert_eq!(
            t.text(),
            "\n[[balancer]]\nname = \"api\"\nservers = [\"a:1\", \"b:2\"]\n\n[balancer.health]\nfall = 2\nloop = false\n"
        );
        let parsed: Result<toml::Value, _> = t.text().parse();
        assert!(parsed.is_ok(), "{parsed:?}");
    }
}
