//! `cargo xtask`: setup, build, run, demo, test (and fuzz, vm-test, bench, dist).

mod bench;
mod demo;
mod dist;
mod fuzz;
mod musl;
mod previous;
mod setup;
mod test;
mod util;
mod vm;

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
    Build {
        /// A static build for x86_64-unknown-linux-musl or aarch64-unknown-linux-musl (cross
        /// compiled) into target/<TARGET>/release/, instead of the host's target/release/.
        #[arg(long)]
        target: Option<String>,
    },
    /// Build, then `lb run` with the given arguments.
    Run {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Test hosts in namespaces, real traffic, a failover you can watch.
    Demo,
    /// Everything CI runs: fmt, clippy, unit and privileged integration tests, each fuzz target
    /// for 20 s, the quick bench,
    /// the 6.1 and 6.12 VM runs, then the packages (`dist --check`).
    Test,
    /// Build the fuzz targets of `fuzz/` (pinned nightly, cargo-fuzz) and run each on its seed
    /// corpus; fails naming the target and the input of a crash, hang or unbounded allocation.
    Fuzz {
        /// How long each target runs, in seconds.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// Run this target only (`fuzz/Cargo.toml` lists them).
        #[arg(long)]
        target: Option<String>,
    },
    /// lb (splice, copy and connect-time) side by side with a direct connection, HAProxy and
    /// nginx; results in bench/results/.
    Bench {
        /// Fewer, shorter runs (a smoke check; results go to bench/results/raw/quick/).
        #[arg(long)]
        quick: bool,
        /// Run one scenario only (its table goes to bench/results/raw/<name>/, never latest):
        /// `upgrade` (8), `crash` (9, kill -9 and restart), `kill` (5 and 7, idle connections
        /// and their kill), `bulk` (1 and 4, with 15 runs per contender instead of 5) or `soak`
        /// (the churn soak, about 10 minutes: lb alone, its memory, descriptors, tasks and map
        /// entries back at their baseline after a million short connections and thousands of
        /// long streams while the server set changes every second).
        #[arg(long, value_parser = ["upgrade", "crash", "kill", "bulk", "soak"])]
        only: Option<String>,
        /// Run the `lb` and `lbt` in DIR (e.g. target/x86_64-unknown-linux-musl/release, as
        /// `cargo xtask test`'s quick bench does) instead of building target/release.
        #[arg(long, value_name = "DIR")]
        bins: Option<std::path::PathBuf>,
    },
    /// The privileged integration tests inside qemu guests on Debian kernels.
    VmTest {
        /// Guest architecture: amd64 (KVM when it boots, else TCG) or arm64 (TCG).
        #[arg(long, default_value = "amd64", value_parser = ["amd64", "arm64"])]
        arch: String,
        /// Which kernel: 5.10, 6.1, 6.12 or all [default: all on amd64, 6.1 on arm64].
        #[arg(long, value_parser = ["5.10", "6.1", "6.12", "all"])]
        kernel: Option<String>,
        /// Which tests: all (every VM test target) or smoke (one test per part a new
        /// architecture could break) [default: all on amd64, smoke on arm64].
        #[arg(long, value_parser = ["all", "smoke"])]
        tests: Option<String>,
        /// Hard limit for one guest, boot to power-off, in seconds.
        #[arg(long, default_value_t = vm::DEFAULT_TIMEOUT.as_secs())]
        timeout: u64,
        /// Only this test target (repeatable), e.g. `--target connect_time_pins`.
        #[arg(long = "target", value_name = "TARGET")]
        targets: Vec<String>,
        /// Run the test list this many times in one boot, stopping after a round that failed.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
        repeat: u32,
        /// Virtual CPUs of the guest.
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=8))]
        smp: u32,
        /// Under TCG, emulate each virtual CPU on a host thread of its own (`-accel
        /// tcg,thread=multi`) instead of all on one (`thread=single`, the default: guests under
        /// multi-threaded TCG locked up, see docs/kernels.md).
        #[arg(long)]
        tcg_multi_thread: bool,
        /// Instead of the tests, crash the guest's kernel from a test (SysRq c) and check that
        /// the run names that test and prints the kernel's stacks.
        #[arg(long, conflicts_with_all = ["tests", "targets", "test_args"])]
        crash: bool,
        /// Passed to each test executable in the guest, e.g. a test name filter (with
        /// `--tests all`).
        #[arg(last = true)]
        test_args: Vec<String>,
    },
    /// Build the previous release's `lb` from this repository's history (cached in
    /// target/previous/), then run the takeover test that upgrades from it by restart.
    Previous,
    /// Static binaries, .deb and .rpm packages for amd64 and arm64, an OCI image archive and
    /// SHA256SUMS, in target/dist/.
    Dist {
        /// Then check them: install the amd64 .deb here and purge it, query the .rpm files,
        /// read the OCI archive back (needs root).
        #[arg(long)]
        check: bool,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Setup => setup::run(),
        Cmd::Build { target: None } => {
            setup::run()?;
            util::build_release()
        }
        Cmd::Build {
            target: Some(triple),
        } => {
            let arch = musl::arch(&triple)?;
            setup::run()?;
            // With the VM runs' test executables, as `dist` and `vm-test` build: one selection
            // of packages and targets, so each finds the others' build fresh.
            let bins = musl::build(arch, &vm::built_targets(arch))?;
            eprintln!("xtask: built {}", bins.lb.display());
            Ok(())
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
            test::run()
        }
        Cmd::Previous => {
            setup::run()?;
            let bin = previous::build()?;
            let status = std::process::Command::new(env!("CARGO"))
                .args(["test", "-p", "lb-tests", "--test", "connect_time_takeover"])
                .args(["--", "--nocapture", "previous_release"])
                .env("LB_PREVIOUS_LB", &bin)
                .current_dir(util::root())
                .status()?;
            std::process::exit(status.code().unwrap_or(1));
        }
        Cmd::Fuzz { seconds, target } => {
            setup::run()?;
            fuzz::run(seconds, target.as_deref())
        }
        Cmd::Bench { quick, only, bins } => {
            setup::run()?;
            let bins = match bins {
                Some(dir) => dir,
                None => {
                    util::build_release()?;
                    util::root().join("target/release")
                }
            };
            bench::run(quick, only.as_deref(), &bins)
        }
        Cmd::VmTest {
            arch,
            kernel,
            tests,
            timeout,
            targets,
            repeat,
            smp,
            tcg_multi_thread,
            crash,
            test_args,
        } => {
            let arch = vm::arch(&arch)?;
            let labels: Vec<&str> = match kernel.as_deref() {
                None => arch.default_kernels.to_vec(),
                Some("all") => vm::SERIES.iter().map(|s| s.label).collect(),
                Some(one) => vec![one],
            };
            let tests = match tests.as_deref() {
                _ if crash => vm::Tests::Crash,
                None | Some("all") if !targets.is_empty() => vm::Tests::Only {
                    targets: &targets,
                    args: &test_args,
                },
                None if test_args.is_empty() => arch.default_tests,
                None | Some("all") => vm::Tests::All(&test_args),
                Some(_) if !targets.is_empty() => {
                    anyhow::bail!(
                        "--tests smoke runs its own targets: --target goes with --tests all"
                    )
                }
                Some(_) if test_args.is_empty() => vm::Tests::Smoke,
                Some(_) => anyhow::bail!(
                    "--tests smoke runs its own test names: arguments after -- go with --tests all"
                ),
            };
            setup::run()?;
            let opts = vm::Options {
                timeout: std::time::Duration::from_secs(timeout),
                repeat,
                smp,
                tcg_multi_thread,
                lockup_retries: 0,
            };
            let outcomes = vm::run(arch, &labels, &opts, tests)?;
            if crash {
                vm::crash_verdict(&outcomes)
            } else {
                vm::verdict(&outcomes)
            }
        }
        Cmd::Dist { check } => {
            setup::run()?;
            let dist = dist::run()?;
            if check {
                dist::check::run(&dist)
            } else {
                Ok(())
            }
        }
    }
}
