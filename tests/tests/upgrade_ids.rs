//! `lb upgrade` and what the old and new lb write into the kernel's maps: a balancer keeps its
//! id across an upgrade whose config lists the balancers in another order (the connect-time
//! tables, counts and socket records are kept under ids), the new lb writes its listener maps
//! only once it has taken over, and the old lb stops checking, syncing tables and reading the
//! kernel's rings before the new one starts. Servers on test hosts in network namespaces,
//! clients in a child cgroup (where the connect-time programs rewrite their `connect()`s).

use std::{net::SocketAddr, time::Duration};

use anyhow::{Context as _, Result, bail, ensure};
use lb_tests::{
    Fixture, Holder, Host, TempDir, TestCgroup, Toml, UpLb, free_port, run_client,
    skip_unless_kernel, skip_unless_root,
};

/// Bound on any one client.
const T: Duration = Duration::from_secs(60);

/// Root and a kernel with the getpeername hooks (5.8); prints the skip reason otherwise.
fn skip() -> bool {
    skip_unless_root() || skip_unless_kernel((5, 8), "cgroup getpeername4/6 hooks")
}

/// One balancer of a config: name, listener, server, its own lines (such as `forwarding`) and
/// its `[balancer.health]` lines.
struct Balancer<'a> {
    name: &'a str,
    listen: SocketAddr,
    server: SocketAddr,
    extra: &'a str,
    health: &'a str,
}

/// A config for `cgroup` (forwarding `connect` unless a balancer says otherwise) with
/// `balancers` in this order.
fn config(cgroup: &std::path::Path, balancers: &[Balancer<'_>]) -> String {
    let mut text = format!(
        "[datapath]\nmode = \"bpf\"\ncgroup = \"{}\"\nforwarding = \"connect\"\n",
        cgroup.display()
    );
    for b in balancers {
        text.push_str(&format!(
            "\n[[balancer]]\nname = \"{}\"\nlisten = [\"{}\"]\nservers = [\"{}\"]\n{}\n\n\
             [balancer.health]\n{}\n",
            b.name, b.listen, b.server, b.extra, b.health
        ));
    }
    text
}

/// The config of `layout`: `a` serves `s0`, `b` serves `s1` (with `b_forwarding`), both
/// checked every second over TCP.
fn text(
    cg: &TestCgroup,
    servers: [SocketAddr; 2],
    listen: [SocketAddr; 2],
    b_forwarding: &str,
    layout: Layout,
) -> Toml {
    let swap = usize::from(layout.listeners_swapped);
    let balancers: Vec<Balancer<'_>> = layout
        .order
        .iter()
        .map(|name| {
            let i = usize::from(*name == "b");
            Balancer {
                name,
                listen: listen[i ^ swap],
                server: servers[i],
                extra: if i == 1 { b_forwarding } else { "" },
                health: "kind = \"tcp\"\ninterval = \"1s\"",
            }
        })
        .collect();
    Toml::new().lines(&config(&cg.path, &balancers))
}

/// How a [`TwoBalancers`]' config lays its two balancers out.
#[derive(Clone, Copy)]
struct Layout {
    /// Balancer names in config order.
    order: [&'static str; 2],
    /// `a` listens on `listen[1]` and `b` on `listen[0]` (else the other way round).
    listeners_swapped: bool,
}

/// `a` then `b`, `a` on `listen[0]`.
const FIRST: Layout = Layout {
    order: ["a", "b"],
    listeners_swapped: false,
};

/// Two balancers, `a` (connect-time) in front of host `s0` and `b` in front of `s1`, each on a
/// loopback port of its own, behind an lb whose config file the test rewrites.
struct TwoBalancers {
    /// Hosts, cgroup, lb and its config file.
    f: Fixture<UpLb>,
    /// Two loopback listeners, `a`'s and `b`'s at first.
    listen: [SocketAddr; 2],
    /// `b`'s `forwarding` line (empty: connect-time, as `a`).
    b_forwarding: &'static str,
}

impl std::ops::Deref for TwoBalancers {
    type Target = Fixture<UpLb>;
    fn deref(&self) -> &Fixture<UpLb> {
        &self.f
    }
}

impl std::ops::DerefMut for TwoBalancers {
    fn deref_mut(&mut self) -> &mut Fixture<UpLb> {
        &mut self.f
    }
}

impl TwoBalancers {
    /// lb with the [`FIRST`] layout, `b_forwarding` in `b`'s table and `env` added to its
    /// environment; returns once each listener's clients reach its own balancer's server.
    fn new(env: &[(&str, &str)], b_forwarding: &'static str) -> Result<TwoBalancers> {
        let hosts = lb_tests::serving_hosts(2, 9000, |i| format!("s{i}"))?;
        let second = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        let servers = [hosts[0].addr(9000), hosts[1].addr(9000)];
        let f = Fixture::upgradable_with_config(
            hosts,
            9000,
            |cg, first| text(cg, servers, [first, second], b_forwarding, FIRST),
            &[],
            env,
        )?;
        let s = TwoBalancers {
            listen: [f.listen, second],
            f,
            b_forwarding,
        };
        s.lb.wait_settled()?;
        // The tables are written once the first checks are in: wait until each listener's
        // clients are sent to its server.
        lb_tests::wait_until(Duration::from_secs(10), || {
            Ok(s.reaches(0)? == "s0" && s.reaches(1)? == "s1")
        })
        .with_context(|| s.lb.log_text())?;
        Ok(s)
    }

    /// Rewrite the config with `layout`.
    fn write(&self, layout: Layout) -> Result<()> {
        let servers = [self.hosts[0].addr(9000), self.hosts[1].addr(9000)];
        self.write_config(&text(
            &self.cg,
            servers,
            self.listen,
            self.b_forwarding,
            layout,
        ))
    }

    /// The server (`s0`, `s1`) a new client of listener `i` reaches.
    fn reaches(&self, i: usize) -> Result<String> {
        Ok(self.peer(i)?.0)
    }

    /// The server a new client of listener `i` reaches, and whether it reaches it directly
    /// (the server sees the client's own socket: the connect programs rewrote its connect).
    fn peer(&self, i: usize) -> Result<(String, bool)> {
        let v = run_client(&self.place(), self.listen[i], &["peer"], T)?;
        ensure!(v["ok"] == true, "peer client of listener {i} failed: {v}");
        Ok((
            v["server"].as_str().unwrap_or_default().to_string(),
            v["server_sees"] == v["local"],
        ))
    }

    /// Established connect-time connections of balancer `name`'s only server, from `/status`.
    fn connections(&self, name: &str) -> Result<u64> {
        let st = self.lb.status()?;
        let b = st["balancers"]
            .as_array()
            .and_then(|v| v.iter().find(|b| b["name"] == name))
            .with_context(|| format!("no balancer {name} in /status: {st}"))?;
        ensure!(
            b["forwarding"] == "connect",
            "{name} is not connect-time: {b}"
        );
        Ok(b["servers"][0]["connections"].as_u64().unwrap_or(0))
    }

    /// A held connection through listener `i`, connected to server `s<i>`.
    fn hold(&self, i: usize) -> Result<Holder> {
        let h = Holder::start(&self.place(), self.listen[i], 0, 600_000)?;
        let ev = h.wait_for("connected", Duration::from_secs(10))?;
        ensure!(
            ev["server"] == format!("s{i}").as_str(),
            "listener {i}: {ev}"
        );
        Ok(h)
    }
}

/// Fail when holder `h` saw anything (its connection should be untouched).
fn untouched(h: &Holder, what: &str) -> Result<()> {
    if let Ok(ev) = h.next(Duration::from_millis(10)) {
        bail!("{what} saw {ev}");
    }
    Ok(())
}

/// An upgrade whose config lists the two connect-time balancers the other way round: each
/// listener's new clients still reach its own balancer's server, and the connections made
/// before the upgrade are still counted and killed under their balancer.
#[test]
fn upgrade_with_balancers_swapped_keeps_their_ids() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let mut s = TwoBalancers::new(&[], "")?;
    let held = [s.hold(0)?, s.hold(1)?];
    lb_tests::wait_until(Duration::from_secs(5), || {
        Ok(s.connections("a")? == 1 && s.connections("b")? == 1)
    })?;
    s.write(Layout {
        order: ["b", "a"],
        listeners_swapped: false,
    })?;
    s.lb.upgrade_ok()?;
    ensure!(
        s.reaches(0)? == "s0" && s.reaches(1)? == "s1",
        "a listener reaches another balancer's server after the upgrade: {}",
        s.lb.log_text()
    );
    let counts = (s.connections("a")?, s.connections("b")?);
    ensure!(
        counts == (1, 1),
        "the connections made before the upgrade are not counted under their balancer (a, b): {counts:?}"
    );
    let out = std::process::Command::new(lb_tests::lb_bin())
        .args(["servers", "--balancer", "a", "kill"])
        .arg(s.hosts[0].addr(9000).to_string())
        .args(["--admin", &s.lb.admin.to_string()])
        .output()?;
    ensure!(out.status.success(), "lb servers kill: {out:?}");
    let closed = held[0]
        .wait_for("closed", Duration::from_secs(5))
        .context("a's connection made before the upgrade was not killed")?;
    ensure!(
        closed["how"] == "connection reset" || closed["how"] == "connection aborted",
        "{closed}"
    );
    untouched(&held[1], "b's connection")
}

/// An upgrade with the balancers swapped whose new lb dies just before Done: the old lb serves
/// on with each listener still sending its clients to its own balancer's server (the new lb
/// wrote no listener map), and its connections are counted as before.
#[test]
fn upgrade_failing_before_done_leaves_the_listener_maps_alone() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let mut s = TwoBalancers::new(&[("LB_UPGRADE_FAULT", "before_done")], "")?;
    let held = [s.hold(0)?, s.hold(1)?];
    let pid = s.lb.pid;
    s.write(Layout {
        order: ["b", "a"],
        listeners_swapped: false,
    })?;
    let out = s.lb.upgrade()?;
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    ensure!(
        out.status.code() == Some(1) && err.contains("exit status: 70"),
        "lb upgrade should fail as its new lb exits before Done: {}: {err}",
        out.status
    );
    ensure!(s.lb.pid == pid, "the pid changed");
    for i in 0..2 {
        let got = s.reaches(i)?;
        ensure!(
            got == format!("s{i}"),
            "after the failed upgrade listener {i} sends its clients to {got}: {}",
            s.lb.log_text()
        );
    }
    let counts = (s.connections("a")?, s.connections("b")?);
    ensure!(
        counts == (1, 1),
        "counts (a, b) after the failed upgrade: {counts:?}"
    );
    untouched(&held[0], "a's connection")?;
    untouched(&held[1], "b's connection")
}

/// An upgrade that swaps the listeners of a connect-time balancer `a` and a splice one `b`
/// (names and forwarding kept): the listener `b` takes is no longer rewritten by the connect
/// programs (its clients go through lb to `b`'s server), the one `a` takes is.
#[test]
fn upgrade_moving_listeners_rewrites_only_connect_time_ones() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let mut s = TwoBalancers::new(&[], "forwarding = \"splice\"")?;
    let before = [s.peer(0)?, s.peer(1)?];
    let want = [("s0".to_string(), true), ("s1".to_string(), false)];
    ensure!(
        before == want,
        "before the upgrade (server, direct): {before:?}"
    );
    s.write(Layout {
        order: ["a", "b"],
        listeners_swapped: true,
    })?;
    s.lb.upgrade_ok()?;
    let after = [s.peer(0)?, s.peer(1)?];
    ensure!(
        after == [want[1].clone(), want[0].clone()],
        "after swapping the listeners (server, direct) per listener: {after:?}\n{}",
        s.lb.log_text()
    );
    Ok(())
}

/// `TcpPassiveOpens` of host `h`'s network namespace: connections its servers accepted.
fn passive_opens(h: &Host) -> Result<u64> {
    let snmp = h.exec_ok("cat", &["/proc/net/snmp"])?;
    let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
    let (names, values) = (tcp.next(), tcp.next());
    let (Some(names), Some(values)) = (names, values) else {
        bail!("no Tcp lines in /proc/net/snmp: {snmp}");
    };
    let i = names
        .split_whitespace()
        .position(|n| n == "PassiveOpens")
        .context("no PassiveOpens")?;
    values
        .split_whitespace()
        .nth(i)
        .context("short Tcp line")?
        .parse()
        .context("PassiveOpens")
}

/// The old lb checks its server every 20 ms; the new config turns the loop off. Once `lb
/// upgrade` has answered, the server sees no connection at all: the old lb stopped its health
/// loops (with its table sync and ring readers) at Done, before the new one took over.
#[test]
fn upgrade_old_lb_stops_checking_at_done() -> Result<()> {
    if skip() {
        return Ok(());
    }
    let hosts = lb_tests::serving_hosts(1, 9000, |i| format!("s{i}"))?;
    let cg = TestCgroup::new()?;
    let dir = TempDir::new("lb-upgrade-ids")?;
    let path = dir.join("lb.toml");
    let listen = SocketAddr::from(([127, 0, 0, 1], free_port()?));
    let text = |health: &str| {
        config(
            &cg.path,
            &[Balancer {
                name: "a",
                listen,
                server: hosts[0].addr(9000),
                extra: "",
                health,
            }],
        )
    };
    std::fs::write(&path, text("kind = \"tcp\"\ninterval = \"20ms\""))?;
    let mut lb = UpLb::start(&["--config", &path.display().to_string()], &[])?;
    lb.wait_settled()?;
    // The old lb's checks reach the server.
    let c = passive_opens(&hosts[0])?;
    lb_tests::wait_until(Duration::from_secs(5), || {
        Ok(passive_opens(&hosts[0])? > c + 3)
    })
    .context("the old lb does not check every 20 ms")?;
    std::fs::write(
        &path,
        text("kind = \"tcp\"\ninterval = \"20ms\"\nloop = false"),
    )?;
    let answer = lb.request_upgrade()?;
    ensure!(
        answer.new_pid.is_some(),
        "lb upgrade failed: {}\n{}",
        String::from_utf8_lossy(&answer.output.stderr),
        lb.log_text()
    );
    let at_answer = passive_opens(&hosts[0])?;
    lb.follow(&answer)?;
    let after = passive_opens(&hosts[0])?;
    ensure!(
        after == at_answer,
        "the server accepted {} connections after lb upgrade answered: the old lb still checked",
        after - at_answer
    );
    Ok(())
}
