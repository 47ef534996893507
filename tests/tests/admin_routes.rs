//! Every endpoint of the admin API, read from the table the router is built from
//! (`lb::admin::ENDPOINTS`), called for real as each kind of caller: root (this process), an
//! unprivileged user (uid and gid 65534 through `lbt client http`, whose socket the admin API
//! finds owned by that user) without and with the token. An endpoint's rule decides what each
//! must get: `Open` answers everyone; `Read` answers everyone, or only the token when
//! `[admin] token_file` is set; `Change` refuses the unprivileged user without the token (403,
//! or 401 with a token file) and changes nothing, and accepts it with the token, and root.
//!
//! A new endpoint gets a rule in the table by construction; this test then needs to know how to
//! call it (its request below) and fails naming it until it does.

use std::{
    net::SocketAddr,
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Context as _, Result, bail, ensure};
use lb::admin::{ENDPOINTS, Endpoint, Rule, SERVER_ACTIONS, Verb};
use lb_tests::{
    Host, TempDir, UpLb, free_port, http_get, http_request_with, lbt_bin, output_within,
    skip_unless_root, wait_until,
};
use serde_json::Value;

/// The unprivileged caller.
const NOBODY: u32 = 65534;
const TOKEN: &str = "walk-the-routes-token";

/// `lbt` where uid 65534 may run it: a copy in a directory of the test's own (mode 0755), as
/// the build directory may be closed to other users.
struct NobodyClient {
    dir: TempDir,
}

impl NobodyClient {
    fn new() -> Result<NobodyClient> {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = TempDir::new("lb-admin-routes")?;
        std::fs::copy(lbt_bin(), dir.join("lbt")).context("copying lbt")?;
        std::fs::set_permissions(dir.join("lbt"), std::fs::Permissions::from_mode(0o755))?;
        Ok(NobodyClient { dir })
    }

    /// `method path` to `admin` as uid/gid 65534 with no supplementary groups: (status, body).
    fn request(&self, admin: SocketAddr, req: &Req, token: Option<&str>) -> Result<(u16, String)> {
        let mut cmd = Command::new(self.dir.join("lbt"));
        cmd.args(["client", "--connect", &admin.to_string(), "http"])
            .args([req.method, &req.path])
            .uid(NOBODY)
            .gid(NOBODY);
        if let Some(body) = &req.body {
            cmd.args(["--body", body, "--header", "Content-Type:application/json"]);
        }
        if let Some(t) = token {
            cmd.args(["--header", &format!("Authorization:Bearer {t}")]);
        }
        let o = output_within(cmd, Duration::from_secs(60))?;
        let out = String::from_utf8_lossy(&o.stdout);
        let v: Value = serde_json::from_str(out.trim()).with_context(|| {
            format!(
                "lbt as uid {NOBODY} printed {out:?}, stderr {:?}",
                String::from_utf8_lossy(&o.stderr)
            )
        })?;
        ensure!(v["ok"] == true, "lbt as uid {NOBODY}: {v}");
        Ok((
            u16::try_from(v["status"].as_u64().context("status")?)?,
            v["body"].as_str().unwrap_or_default().to_string(),
        ))
    }
}

/// The same request from this process (root).
fn as_root(admin: SocketAddr, req: &Req, token: Option<&str>) -> Result<(u16, String)> {
    let auth = token.map(|t| format!("Bearer {t}"));
    let mut headers = vec![("Content-Type", "application/json")];
    if let Some(a) = &auth {
        headers.push(("Authorization", a));
    }
    http_request_with(admin, req.method, &req.path, &headers, req.body.as_deref())
}

/// One concrete request of an endpoint.
#[derive(Debug)]
struct Req {
    method: &'static str,
    path: String,
    body: Option<String>,
    /// The status an accepted call gets.
    ok: u16,
}

/// The servers the walk uses: `s0` and `s1` in the set, `s2` to add.
struct Servers {
    s: [String; 3],
}

/// The requests that call `e` with the walk's balancer and servers: `{name}` is the balancer,
/// `{addr}` a server of the set (`s1`), `{action}` each of [`SERVER_ACTIONS`]; a body where the
/// endpoint takes one.
fn requests(e: &Endpoint, balancer: &str, sv: &Servers) -> Result<Vec<Req>> {
    let actions: Vec<&str> = if e.path.contains("{action}") {
        SERVER_ACTIONS.to_vec()
    } else {
        vec![""]
    };
    let body = match (e.method, e.path) {
        (Verb::Put, "/balancers/{name}/servers") => Some(format!(
            r#"{{"servers": ["{}", "{}"], "default": "{}"}}"#,
            sv.s[0], sv.s[1], sv.s[0]
        )),
        (Verb::Post, "/balancers/{name}/servers") => {
            Some(format!(r#"{{"server": "{}"}}"#, sv.s[2]))
        }
        (Verb::Get | Verb::Delete, _) => None,
        (Verb::Post, "/balancers/{name}/servers/{addr}/{action}" | "/upgrade") => None,
        (m, p) => bail!(
            "the walk does not know how to call {} {p}: add its request here",
            m.as_str()
        ),
    };
    // The upgrade's new binary exits at once (see `walk`): reaching the handler is 500.
    let ok = if e.path == "/upgrade" { 500 } else { 200 };
    let mut out = Vec::new();
    for action in actions {
        let path = e
            .path
            .replace("{name}", balancer)
            .replace("{addr}", &sv.s[1])
            .replace("{action}", action);
        ensure!(
            !path.contains('{'),
            "the walk has no value for a parameter of {}",
            e.path
        );
        out.push(Req {
            method: e.method.as_str(),
            path,
            body: body.clone(),
            ok,
        });
    }
    Ok(out)
}

/// Who calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Caller {
    /// This process, without a token.
    Root,
    /// uid 65534 without a token.
    Nobody,
    /// uid 65534 with the token.
    NobodyToken,
    /// uid 65534 with a wrong token.
    NobodyWrongToken,
}

/// What `caller` must get from an endpoint of `rule` whose accepted call answers `ok`.
fn want(rule: Rule, caller: Caller, token_file: bool, ok: u16) -> u16 {
    match (rule, caller, token_file) {
        (Rule::Open, ..)
        | (Rule::Read, _, false)
        | (Rule::Read | Rule::Change, Caller::NobodyToken, true)
        | (Rule::Change, Caller::Root, _) => ok,
        (Rule::Read, _, true) | (Rule::Change, _, true) => 401,
        (Rule::Change, _, false) => 403,
    }
}

/// One lb to walk: its admin address, the token it wants (if any) and the servers.
struct Walk<'a> {
    admin: SocketAddr,
    token: Option<&'a str>,
    servers: &'a Servers,
    nobody: &'a NobodyClient,
}

impl Walk<'_> {
    /// Back to the set `s0`, `s1` (default `s0`) with no hold, as root, and ready.
    fn reset(&self) -> Result<()> {
        let sv = &self.servers.s;
        let put = Req {
            method: "PUT",
            path: "/balancers/walk/servers".into(),
            body: Some(format!(
                r#"{{"servers": ["{}", "{}"], "default": "{}"}}"#,
                sv[0], sv[1], sv[0]
            )),
            ok: 200,
        };
        let enable = Req {
            method: "POST",
            path: format!("/balancers/walk/servers/{}/enable", sv[1]),
            body: None,
            ok: 200,
        };
        for r in [put, enable] {
            let (c, b) = as_root(self.admin, &r, None)?;
            ensure!(c == r.ok, "reset: {} {}: {c} {b}", r.method, r.path);
        }
        wait_until(Duration::from_secs(10), || {
            Ok(http_get(self.admin, "/readyz")?.0 == 200)
        })
        .context("not ready after the reset")?;
        Ok(())
    }

    /// The set as `/status` gives it: each server's address, hold and default flag.
    fn snapshot(&self) -> Result<Vec<(String, String, bool)>> {
        let req = Req {
            method: "GET",
            path: "/status".into(),
            body: None,
            ok: 200,
        };
        let (c, b) = as_root(self.admin, &req, self.token)?;
        ensure!(c == 200, "/status: {c} {b}");
        let v: Value = serde_json::from_str(&b)?;
        Ok(v["balancers"][0]["servers"]
            .as_array()
            .context("servers")?
            .iter()
            .map(|s| {
                (
                    s["address"].as_str().unwrap_or_default().to_string(),
                    s["hold"].as_str().unwrap_or_default().to_string(),
                    s["default"] == true,
                )
            })
            .collect())
    }

    fn call(&self, caller: Caller, req: &Req) -> Result<(u16, String)> {
        match caller {
            Caller::Root => as_root(self.admin, req, None),
            Caller::Nobody => self.nobody.request(self.admin, req, None),
            Caller::NobodyToken => self.nobody.request(self.admin, req, self.token),
            Caller::NobodyWrongToken => self.nobody.request(self.admin, req, Some("wrong")),
        }
    }

    /// Call every endpoint as every caller and check what each gets; returns one line per
    /// endpoint and caller.
    fn run(&self, callers: &[Caller]) -> Result<Vec<String>> {
        let token_file = self.token.is_some();
        let mut lines = Vec::new();
        for e in ENDPOINTS {
            // A method other than GET changes something: its rule must say so.
            ensure!(
                e.method == Verb::Get || e.rule == Rule::Change,
                "{} {} changes state but its rule is {:?}",
                e.method.as_str(),
                e.path,
                e.rule
            );
            for req in requests(e, "walk", self.servers)? {
                for &caller in callers {
                    self.reset()?;
                    let before = self.snapshot()?;
                    let (code, body) = self.call(caller, &req)?;
                    let want = want(e.rule, caller, token_file, req.ok);
                    let what = format!(
                        "{caller:?} {} {} ({:?}, token file {token_file})",
                        req.method, req.path, e.rule
                    );
                    ensure!(code == want, "{what}: {code} {body}, want {want}");
                    if code == 403 {
                        ensure!(body.contains(&format!("uid {NOBODY}")), "{what}: {body}");
                    }
                    if want != req.ok {
                        ensure!(
                            self.snapshot()? == before,
                            "{what} was refused but changed the set"
                        );
                    }
                    lines.push(format!("{what}: {code}"));
                }
            }
        }
        Ok(lines)
    }
}

/// A config of one balancer `walk` over `s0` and `s1` on the copy path, with `token_file`.
fn config(listen: SocketAddr, sv: &Servers, token_file: Option<&Path>) -> String {
    let admin = token_file.map_or_else(String::new, |t| {
        format!("[admin]\ntoken_file = \"{}\"\n", t.display())
    });
    format!(
        "{admin}[datapath]\nmode = \"userspace\"\n\n[[balancer]]\nname = \"walk\"\nlisten = [\"{listen}\"]\nservers = [\"{}\", \"{}\"]\n",
        sv.s[0], sv.s[1]
    )
}

/// Start lb from `config` (its `lb upgrade` binary one that exits at once) and walk it.
fn walk(with_token: bool) -> Result<()> {
    let mut h = Host::new()?;
    for (i, port) in [9000, 9001, 9002].into_iter().enumerate() {
        h.serve(port, &format!("s{i}"))?;
    }
    let servers = Servers {
        s: [9000, 9001, 9002].map(|p| h.addr(p).to_string()),
    };
    let dir = TempDir::new("lb-admin-routes-cfg")?;
    let token_path: PathBuf = dir.join("token");
    std::fs::write(&token_path, format!("{TOKEN}\n"))?;
    let cfg = dir.join("lb.toml");
    let listen: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
    std::fs::write(
        &cfg,
        config(listen, &servers, with_token.then_some(token_path.as_path())),
    )?;
    let lb = UpLb::start(&["--config", cfg.to_str().context("path")?], &[])?;
    lb.replace_binary(b"#!/bin/sh\nexit 3\n")?;
    let nobody = NobodyClient::new()?;
    let w = Walk {
        admin: lb.admin,
        token: with_token.then_some(TOKEN),
        servers: &servers,
        nobody: &nobody,
    };
    let callers: &[Caller] = if with_token {
        &[
            Caller::Root,
            Caller::Nobody,
            Caller::NobodyToken,
            Caller::NobodyWrongToken,
        ]
    } else {
        &[Caller::Root, Caller::Nobody]
    };
    let lines = w.run(callers)?;
    println!(
        "{} endpoints, {} calls (token file: {with_token}):\n  {}",
        ENDPOINTS.len(),
        lines.len(),
        lines.join("\n  ")
    );
    ensure!(
        lb.log_text().contains("admin change refused"),
        "the refusals are not logged"
    );
    ensure!(http_get(lb.admin, "/livez")?.0 == 200, "lb stopped serving");
    Ok(())
}

#[test]
fn every_endpoint_keeps_its_rule_without_a_token_file() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    walk(false)
}

#[test]
fn every_endpoint_keeps_its_rule_with_a_token_file() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    walk(true)
}
