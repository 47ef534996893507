//! The `lb` binary allocates with jemalloc under the options of `lb::memory::MALLOC_CONF`, so
//! its resident memory follows what it holds. jemalloc prints its options when asked for its
//! statistics at exit (`_RJEM_MALLOC_CONF=stats_print:true`); this test reads them back from
//! a real `lb --version`. Needs no privilege. glibc builds only: musl builds keep musl's malloc.

#![cfg(target_env = "gnu")]

use std::{process::Command, time::Duration};

use anyhow::{Result, ensure};
use lb_tests::{lb_bin, output_within};

#[test]
fn lb_runs_on_jemalloc_with_one_arena_no_thread_cache_and_no_decay_delay() -> Result<()> {
    let mut cmd = Command::new(lb_bin());
    cmd.arg("--version")
        .env("_RJEM_MALLOC_CONF", "stats_print:true");
    let o = output_within(cmd, Duration::from_secs(60))?;
    ensure!(o.status.success(), "lb --version failed: {o:?}");
    let stats = String::from_utf8_lossy(&o.stderr);
    let opt = |name: &str| {
        stats
            .lines()
            .find_map(|l| l.trim().strip_prefix(&format!("opt.{name}: ")))
            .map(|v| v.split_whitespace().next().unwrap_or_default().to_owned())
    };
    for (name, want) in [
        ("narenas", "1"),
        ("tcache", "false"),
        ("dirty_decay_ms", "0"),
        ("muzzy_decay_ms", "0"),
    ] {
        let got = opt(name);
        ensure!(
            got.as_deref() == Some(want),
            "jemalloc's opt.{name} is {got:?}, want {want}; its statistics were:\n{stats}"
        );
    }
    Ok(())
}
