//! What a new user reads at the terminal from a real `lb` process: `lb run` exits 2 (a
//! configuration error, which systemd does not restart) for an admin address equal to a
//! listener and for a listener another program holds, naming that program; `lb config check`
//! prints a TOML syntax error with its line and a caret, and a check timeout longer than its
//! interval as a warning. Needs no privilege: lb stops before loading anything.

use std::{
    net::TcpListener,
    process::{Command, Output, Stdio},
    time::Duration,
};

use anyhow::{Context as _, Result, ensure};
use lb_tests::{TempDir, free_port, lb_bin, output_within};

fn lb(args: &[&str]) -> Result<Output> {
    let mut cmd = Command::new(lb_bin());
    cmd.args(args).stdin(Stdio::null());
    output_within(cmd, Duration::from_secs(60))
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `lb run` of one balancer made from flags (named `default`) on `listen`, its admin API on
/// `admin`.
fn lb_run_flags(listen: &str, admin: &str) -> Result<Output> {
    lb(&[
        "run",
        "--listen",
        listen,
        "--server",
        "198.18.0.2:6443",
        "--admin-listen",
        admin,
    ])
}

/// One balancer on `listen`, with `extra` appended.
fn config(listen: &str, extra: &str) -> String {
    format!(
        "[[balancer]]\nname = \"api\"\nlisten = [\"{listen}\"]\nservers = [\"198.18.0.2:6443\"]\n{extra}"
    )
}

#[test]
fn lb_run_refuses_an_admin_address_equal_to_a_listener_with_exit_2() -> Result<()> {
    let dir = TempDir::new("lb-cli-messages")?;
    let port = free_port()?;
    let addr = format!("127.0.0.1:{port}");
    let file = dir.join("lb.toml");
    std::fs::write(
        &file,
        config(&addr, &format!("[admin]\nlisten = \"{addr}\"\n")),
    )?;
    let file = file.to_str().context("path")?;
    for args in [vec!["config", "check", file], vec!["run", "--config", file]] {
        let o = lb(&args)?;
        let err = stderr(&o);
        ensure!(o.status.code() == Some(2), "{args:?}: {o:?}");
        ensure!(
            err.starts_with(&format!(
                "lb: invalid configuration: {file}: invalid value for `admin.listen` = \"{addr}\": is also balancer api's listener {addr}"
            )),
            "{args:?}: {err}"
        );
    }
    // The same from flags alone: the balancer they make is named `default`.
    let o = lb_run_flags(&addr, &addr)?;
    ensure!(o.status.code() == Some(2), "{o:?}");
    ensure!(
        stderr(&o).contains("is also balancer default's listener"),
        "{}",
        stderr(&o)
    );
    Ok(())
}

#[test]
fn lb_run_names_the_program_holding_its_listener() -> Result<()> {
    let held = TcpListener::bind("127.0.0.1:0")?;
    let addr = held.local_addr()?.to_string();
    let admin = format!("127.0.0.1:{}", free_port()?);
    let o = lb_run_flags(&addr, &admin)?;
    let err = stderr(&o);
    ensure!(o.status.code() == Some(2), "{o:?}");
    let comm = std::fs::read_to_string("/proc/self/comm")?;
    ensure!(
        err.contains(&format!(
            "{addr} (this configuration's listener of balancer default) is in use by pid {} ({})",
            std::process::id(),
            comm.trim()
        )),
        "{err}"
    );
    ensure!(
        !err.contains("another lb") && !err.contains("lb upgrade"),
        "{err}"
    );
    Ok(())
}

#[test]
fn lb_config_check_shows_where_and_warns() -> Result<()> {
    let dir = TempDir::new("lb-cli-messages")?;
    let broken = dir.join("broken.toml");
    std::fs::write(
        &broken,
        config("127.0.0.1:6443", "[balancer.health]\ninterval = \"soon\"\n"),
    )?;
    let o = lb(&["config", "check", broken.to_str().context("path")?])?;
    let err = stderr(&o);
    ensure!(o.status.code() == Some(2), "{o:?}");
    ensure!(
        err.contains("TOML parse error at line 6, column 12 (key `balancer[0].health.interval`)\n")
            && err.contains("6 | interval = \"soon\"\n")
            && err.contains("^^^^^^"),
        "{err}"
    );
    let slow = dir.join("slow.toml");
    std::fs::write(
        &slow,
        config(
            "127.0.0.1:6443",
            "[balancer.health]\ninterval = \"2s\"\ntimeout = \"5s\"\n",
        ),
    )?;
    let o = lb(&["config", "check", slow.to_str().context("path")?])?;
    let err = stderr(&o);
    ensure!(o.status.code() == Some(0), "{o:?}");
    ensure!(
        err.contains("lb: warning: ")
            && err.contains(
                "balancer[0].health.timeout = \"5s\" is longer than its interval = \"2s\""
            ),
        "{err}"
    );
    Ok(())
}
