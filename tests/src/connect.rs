//! A connect-time balancer under test: `lb` with `forwarding = "connect"` in front of test hosts,
//! its programs attached to a cgroup made for the test, and what the tests read back (server
//! states from `/status`, entries of lb's kernel maps through `bpftool`).

use std::{net::SocketAddr, time::Duration};

use anyhow::{Context as _, Result, ensure};

use crate::{Fixture, Host, Lb, Toml, wait_until};

/// lb with a connect-time balancer named `api` and the hosts behind it: a [`Fixture`] (hosts,
/// cgroup, lb attached to it, listener, config file) whose balancer forwards at connect time.
pub struct ConnectLb(Fixture);

impl std::ops::Deref for ConnectLb {
    type Target = Fixture;
    fn deref(&self) -> &Fixture {
        &self.0
    }
}

impl std::ops::DerefMut for ConnectLb {
    fn deref_mut(&mut self) -> &mut Fixture {
        &mut self.0
    }
}

impl ConnectLb {
    /// lb with the config `config` makes for the listener address (127.0.0.1 and a free port)
    /// in front of `hosts` (serving on port 9000); returns once no server is UNCHECKED and the
    /// table was written.
    ///
    /// # Errors
    /// lb does not start or settle, or the balancer does not forward at connect time.
    pub fn start(hosts: Vec<Host>, config: impl Fn(SocketAddr) -> Toml) -> Result<ConnectLb> {
        let s = Fixture::start(
            hosts,
            9000,
            |_, listen| config(listen),
            &["--cgroup", "{cgroup}"],
        )?;
        s.lb.wait_settled(Duration::from_secs(10))?;
        wait_until(Duration::from_secs(5), || {
            Ok(s.lb.log_text().contains("connect-time table updated"))
        })?;
        let st = s.lb.status()?;
        ensure!(
            st["balancers"][0]["forwarding"] == "connect",
            "forwarding should be connect: {st}\n{}",
            s.lb.log_text()
        );
        Ok(ConnectLb(s))
    }

    /// A connect-time config up to the balancer's own keys: `[datapath]` with `mode = "bpf"`,
    /// `forwarding = "connect"` and then `datapath` (more keys, or tables under it; empty for
    /// none), and balancer `api` listening on `listen` over `servers` (a TOML array's items, as
    /// [`crate::toml_addrs`] writes them) with `policy`. The test adds the balancer's other
    /// keys and its `[balancer.health]`.
    pub fn config(datapath: &Toml, listen: &[SocketAddr], servers: &str, policy: &str) -> Toml {
        let listen: Vec<String> = listen.iter().map(|a| format!("\"{a}\"")).collect();
        Toml::new()
            .table("datapath")
            .string("mode", "bpf")
            .string("forwarding", "connect")
            .lines(datapath.text())
            .array_table("balancer")
            .string("name", "api")
            .value("listen", format!("[{}]", listen.join(", ")))
            .value("servers", format!("[{servers}]"))
            .string("policy", policy)
    }

    /// `[balancer.health]` where a failure counts at once: http checks every `interval`, all
    /// sent to `check` (`shared_target`, so the other servers fail none), a 1 s timeout,
    /// `rise = 1`, `fall = 1`, passive health where `limit` resets (or server-failed connects)
    /// are one failed check, and a FAILED server's connections killed.
    pub fn shared_checks(check: &str, interval: &str, limit: u32) -> Toml {
        Toml::new()
            .table("balancer.health")
            .string("kind", "http")
            .string("url", &format!("http://{check}/healthz"))
            .value("shared_target", true)
            .string("interval", interval)
            .string("timeout", "1s")
            .value("rise", 1)
            .value("fall", 1)
            .value("passive", true)
            .value("passive_reset_limit", limit)
            .string("on_unhealthy", "kill")
    }

    /// A new `lb run` with this setup's config and cgroup on the pin directory of [`Self::lb`]
    /// (to adopt what it left pinned); returns once `/livez` answers.
    ///
    /// # Errors
    /// lb runs unpinned (no bpffs), or does not start (the error carries its log).
    pub fn start_again(&self) -> Result<Lb> {
        self.start_again_in(&self.cg.path)
    }

    /// [`ConnectLb::start_again`] attached to `cgroup` instead.
    ///
    /// # Errors
    /// As [`ConnectLb::start_again`].
    pub fn start_again_in(&self, cgroup: &std::path::Path) -> Result<Lb> {
        let dir = self
            .lb
            .pin_dir
            .clone()
            .context("lb runs without a pin directory (no bpffs mounted)")?;
        Lb::start_pinned(
            &dir,
            &[
                "--config",
                &self.config_path()?.display().to_string(),
                "--cgroup",
                &cgroup.display().to_string(),
            ],
        )
    }

    /// State and connection count of the server at `addr` from `/status`.
    ///
    /// # Errors
    /// `/status` fails or does not list `addr`.
    pub fn status_of(&self, addr: &str) -> Result<(String, u64)> {
        let st = self.lb.status()?;
        let s = st["balancers"][0]["servers"]
            .as_array()
            .context("servers")?
            .iter()
            .find(|s| s["address"] == addr)
            .with_context(|| format!("{addr} not in /status: {st}"))?;
        Ok((
            s["state"].as_str().unwrap_or("").to_string(),
            s["connections"].as_u64().unwrap_or(0),
        ))
    }

    /// Entries in this lb's kernel map `name` (see [`ConnectLb::map_dump`]).
    ///
    /// # Errors
    /// As [`ConnectLb::map_dump`].
    pub fn map_entries(&self, name: &str) -> Result<usize> {
        let entries: serde_json::Value = serde_json::from_str(&self.map_dump(name)?)?;
        Ok(entries.as_array().map_or(0, Vec::len))
    }

    /// `bpftool -j map dump` of this lb's kernel map `name` (the kernel keeps 15 characters of
    /// a map's name), found among the maps lb's process holds (the `map_id` of its descriptors
    /// in `/proc/<pid>/fdinfo`).
    ///
    /// # Errors
    /// `bpftool` fails or lb holds no such map.
    pub fn map_dump(&self, name: &str) -> Result<String> {
        let short: String = name.chars().take(15).collect();
        let dir = format!("/proc/{}/fdinfo", self.lb.pid());
        let mut ids: Vec<String> = std::fs::read_dir(&dir)?
            .filter_map(|e| std::fs::read_to_string(e.ok()?.path()).ok())
            .filter_map(|info| {
                info.lines()
                    .find_map(|l| l.strip_prefix("map_id:").map(|v| v.trim().to_string()))
            })
            .collect();
        ids.sort();
        ids.dedup();
        for id in ids {
            let show: serde_json::Value =
                serde_json::from_str(&crate::sh("bpftool", &["-j", "map", "show", "id", &id])?)?;
            if show["name"] == short.as_str() {
                return crate::sh("bpftool", &["-j", "map", "dump", "id", &id]);
            }
        }
        anyhow::bail!("lb holds no map {short}")
    }
}
