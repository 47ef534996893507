//! What an upgrade cannot change, checked by the new process before it takes anything over: the
//! listeners, the data path mode and cgroup, and each balancer's forwarding. Each refusal is an
//! [`Incompatible`] naming what differs and that a restart changes it.

use std::{net::SocketAddr, path::PathBuf};

use crate::{
    config::{Config, DatapathMode},
    handover::Hello,
};

/// Why the new config cannot take over from the running lb.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Incompatible {
    /// The listeners differ (both sets sorted).
    #[error(
        "the listeners differ (running: {}; new config: {}): an upgrade keeps them, restart lb to change them",
        join(running),
        join(new)
    )]
    Listeners {
        /// The running lb's.
        running: Vec<SocketAddr>,
        /// The new config's.
        new: Vec<SocketAddr>,
    },
    /// The running lb has the kernel data path and the new config asks for userspace.
    #[error(
        "the running lb has the kernel data path and the new config asks for userspace: restart lb to change it"
    )]
    ToUserspace,
    /// The running lb copies in userspace and the new config asks for bpf.
    #[error(
        "the running lb copies in userspace and the new config asks for bpf: restart lb to change it"
    )]
    ToBpf,
    /// The programs are attached to another cgroup than the new config names.
    #[error(
        "the running lb's programs are attached to {} and the new config names {}: restart lb to change it",
        running.display(),
        new.display()
    )]
    Cgroup {
        /// Where the running lb's programs are attached.
        running: PathBuf,
        /// What the new config names.
        new: PathBuf,
    },
    /// A balancer's forwarding differs.
    #[error(
        "balancer {balancer}: forwarding {running} in the running lb, {new} in the new config: an upgrade keeps the connect-time programs and tables as they are, restart lb to change it"
    )]
    Forwarding {
        /// The balancer.
        balancer: String,
        /// Its forwarding in the running lb.
        running: String,
        /// Its forwarding in the new config.
        new: String,
    },
    /// A new balancer asks for connect-time while the running lb has no connect-time programs.
    #[error(
        "balancer {0}: forwarding = \"connect\" but the running lb has no connect-time programs attached (none of its balancers asked for them): restart lb to turn it on"
    )]
    ConnectNotAttached(String),
}

fn join(v: &[SocketAddr]) -> String {
    v.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Check that `cfg` can take over from the lb that sent `hello`.
///
/// # Errors
/// The first [`Incompatible`] found: listeners, then data path, then forwarding.
pub fn compatible(cfg: &Config, hello: &Hello) -> Result<(), Incompatible> {
    compatible_listeners(cfg, hello)?;
    compatible_datapath(cfg, hello)?;
    let running_connect = hello.forwarding.iter().any(|(_, f)| f == "connect");
    for b in &cfg.balancers {
        let want = cfg.forwarding_of(b).to_string();
        match hello.forwarding.iter().find(|(name, _)| *name == b.name) {
            Some((_, had)) if *had != want => {
                return Err(Incompatible::Forwarding {
                    balancer: b.name.clone(),
                    running: had.clone(),
                    new: want,
                });
            }
            None if want == "connect" && !running_connect => {
                return Err(Incompatible::ConnectNotAttached(b.name.clone()));
            }
            _ => {}
        }
    }
    Ok(())
}

/// The listeners must be the running lb's.
fn compatible_listeners(cfg: &Config, hello: &Hello) -> Result<(), Incompatible> {
    let mut new: Vec<_> = cfg
        .balancers
        .iter()
        .flat_map(|b| b.listen.iter().copied())
        .collect();
    let mut running: Vec<_> = hello.listeners.iter().map(|(a, _)| *a).collect();
    new.sort();
    running.sort();
    if new != running {
        return Err(Incompatible::Listeners { running, new });
    }
    Ok(())
}

/// The data path mode and cgroup must be the running lb's.
fn compatible_datapath(cfg: &Config, hello: &Hello) -> Result<(), Incompatible> {
    match (&hello.datapath, cfg.datapath.mode) {
        (Some(_), DatapathMode::Userspace) => Err(Incompatible::ToUserspace),
        (None, DatapathMode::Bpf) => Err(Incompatible::ToBpf),
        // A configured directory stands for the cgroup v2 mount found below it, as at start.
        (Some(offer), _) => match &cfg.datapath.cgroup {
            Some(c)
                if crate::datapath::resolve_cgroup(c).unwrap_or_else(|_| c.clone())
                    != offer.cgroup =>
            {
                Err(Incompatible::Cgroup {
                    running: offer.cgroup.clone(),
                    new: c.clone(),
                })
            }
            _ => Ok(()),
        },
        (None, _) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(listeners: &[&str], forwarding: &[(&str, &str)]) -> Hello {
        Hello {
            version: crate::handover::VERSION,
            pid: 1,
            lb_version: "test".into(),
            listeners: listeners
                .iter()
                .enumerate()
                .map(|(i, a)| (a.parse().unwrap(), i))
                .collect(),
            admin_tcp: None,
            admin_unix: None,
            datapath: None,
            forwarding: forwarding
                .iter()
                .map(|(n, f)| (n.to_string(), f.to_string()))
                .collect(),
            balancer_ids: Vec::new(),
            retired_balancer_ids: Vec::new(),
        }
    }

    fn config(text: &str) -> Config {
        Config::from_toml(text, "test").unwrap()
    }

    const ONE: &str = "[datapath]\nmode = \"userspace\"\n\n[[balancer]]\nname = \"a\"\nlisten = [\"127.0.0.1:7000\"]\nservers = [\"198.18.0.2:9000\"]\n";

    #[test]
    fn each_difference_is_its_own_refusal() {
        let cfg = config(ONE);
        let asked = cfg.forwarding_of(&cfg.balancers[0]).to_string();
        assert_eq!(
            compatible(&cfg, &hello(&["127.0.0.1:7000"], &[("a", &asked)])),
            Ok(())
        );
        assert!(matches!(
            compatible(&cfg, &hello(&["127.0.0.1:7001"], &[("a", &asked)])),
            Err(Incompatible::Listeners { .. })
        ));
        assert!(matches!(
            compatible(&cfg, &hello(&["127.0.0.1:7000"], &[("a", "connect")])),
            Err(Incompatible::Forwarding { balancer, running, new })
                if balancer == "a" && running == "connect" && new == asked
        ));
        let bpf = config(&ONE.replace("userspace", "bpf"));
        assert_eq!(
            compatible(&bpf, &hello(&["127.0.0.1:7000"], &[("a", &asked)])),
            Err(Incompatible::ToBpf)
        );
        let connect = config(&ONE.replace("servers = [", "forwarding = \"connect\"\nservers = ["));
        assert_eq!(
            compatible(&connect, &hello(&["127.0.0.1:7000"], &[])),
            Err(Incompatible::ConnectNotAttached("a".into()))
        );
        let e = Incompatible::Listeners {
            running: vec!["127.0.0.1:1".parse().unwrap()],
            new: vec!["127.0.0.1:2".parse().unwrap()],
        };
        assert!(
            e.to_string().starts_with(
                "the listeners differ (running: 127.0.0.1:1; new config: 127.0.0.1:2)"
            )
        );
    }
}
