//! `cargo xtask`: setup, build, run, demo, test (and vm-test, bench).

mod bench;
mod demo;
mod setup;
mod util;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", about = "lb developer commands")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what is missing: apt packages, nightly rust-src, bpf-linker (idempotent).
    Setup,
    /// Build the kernel programs and the daemon (release).
    Build,
    /// Build, then `lb run` with the given arguments.
    Run {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Test hosts in namespaces, real traffic, a failover you can watch.
    Demo,
    /// Everything CI runs: fmt, clippy, unit and privileged integration tests, quick bench.
    Test,
    /// lb side by side with a direct connection, HAProxy and nginx; results in bench/results/.
    Bench {
        /// Fewer, shorter runs (a smoke check; results go to bench/results/raw/quick/).
        #[arg(long)]
        quick: bool,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Setup => setup::run(),
        Cmd::Build => {
            setup::run()?;
            util::build_release()
        }
        Cmd::Run { args } => {
            setup::run()?;
            util::build_release()?;
            let status = std::process::Command::new(util::root().join("target/release/lb"))
                .arg("run")
                .args(&args)
                .status()?;
            std::process::exit(status.code().unwrap_or(1));
        }
        Cmd::Demo => {
            setup::run()?;
            util::build_release()?;
            demo::run()
        }
        Cmd::Test => {
            setup::run()?;
            util::test()
        }
        Cmd::Bench { quick } => {
            setup::run()?;
            util::build_release()?;
            bench::run(quick)
        }
    }
}
