//! `lb` binary: parse the command line, set up logging, call the library.

#![deny(unsafe_code)]
#![warn(clippy::too_many_lines, clippy::undocumented_unsafe_blocks)]

use std::process::ExitCode;

use clap::Parser as _;
use lb::{
    cli::{self, Cli, Command, ConfigCommand, LogFormat},
    config::CredentialFiles,
};

/// jemalloc on glibc builds; see [`lb::memory`] for why and how it is configured.
#[cfg(target_env = "gnu")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options ([`lb::memory::MALLOC_CONF`]), found by jemalloc under this symbol name.
#[cfg(target_env = "gnu")]
#[expect(
    unsafe_code,
    reason = "jemalloc reads its compile-time options from an exported symbol"
)]
// SAFETY: the symbol name is the one tikv-jemalloc-sys's prefixed jemalloc reads; the value is a
// pointer to a NUL-terminated byte string that lives for the whole process and is never written.
#[unsafe(export_name = "_rjem_malloc_conf")]
static MALLOC_CONF: &u8 = &lb::memory::MALLOC_CONF[0];

fn init_logging(cli: &Cli) {
    let filter = cli
        .log_level
        .clone()
        .or_else(|| std::env::var("RUST_LOG").ok())
        .unwrap_or_else(|| "info".into());
    let filter = tracing_subscriber::EnvFilter::try_new(&filter).unwrap_or_else(|e| {
        eprintln!("lb: invalid log filter {filter:?} ({e}); using info");
        tracing_subscriber::EnvFilter::new("info")
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// A small runtime for the client commands.
fn client_runtime() -> Option<tokio::runtime::Runtime> {
    match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => Some(rt),
        Err(e) => {
            eprintln!("lb: cannot start the runtime: {e}");
            None
        }
    }
}

/// A printing command ends quietly when its reader goes away (`lb status | head`), as Unix
/// tools do: SIGPIPE goes back to its default action (Rust starts programs with it ignored, and
/// `println!` then panics on the broken pipe). `lb run` keeps it ignored.
fn default_sigpipe() {
    use nix::sys::signal::{SigHandler, Signal, signal};
    // SAFETY: restores the default disposition before any other thread exists; no handler runs.
    #[expect(unsafe_code, reason = "signal(2) has no safe wrapper")]
    let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) };
}

/// `lb run` ignores SIGHUP and SIGUSR2 until its daemon listens for them (reload and upgrade):
/// their default action would end a process still starting (loading programs, binding
/// listeners, or taking over from an old lb). One sent that early is dropped; send it again
/// once `/readyz` answers.
fn ignore_until_handled() {
    use nix::sys::signal::{SigHandler, Signal, signal};
    for sig in [Signal::SIGHUP, Signal::SIGUSR2] {
        // SAFETY: sets a disposition before any other thread exists; no handler runs.
        #[expect(unsafe_code, reason = "signal(2) has no safe wrapper")]
        let _ = unsafe { signal(sig, SigHandler::SigIgn) };
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if matches!(cli.command, Command::Run(_)) {
        ignore_until_handled();
    } else {
        default_sigpipe();
    }
    init_logging(&cli);
    match cli.command {
        Command::Config(ConfigCommand::Check { file, skip_files }) => {
            let files = if skip_files {
                CredentialFiles::Skip
            } else {
                CredentialFiles::Read
            };
            cli::config::check(&file, files)
        }
        Command::Config(ConfigCommand::Schema) => cli::config::schema(),
        Command::Completions(args) => cli::docs::completions(&args),
        Command::Man(args) => cli::docs::man(&args),
        Command::NetnsProbe(args) => lb::datapath::netns_probe_child(&args.cgroup, args.port),
        Command::Status(args) => {
            client_runtime().map_or(ExitCode::FAILURE, |rt| rt.block_on(cli::status::run(&args)))
        }
        Command::Servers(args) => client_runtime().map_or(ExitCode::FAILURE, |rt| {
            rt.block_on(cli::servers::run(&args))
        }),
        Command::Check(args) => {
            client_runtime().map_or(ExitCode::FAILURE, |rt| rt.block_on(cli::check::run(&args)))
        }
        Command::Upgrade(args) => client_runtime().map_or(ExitCode::FAILURE, |rt| {
            rt.block_on(cli::upgrade::run(&args))
        }),
        Command::Run(args) => cli::run::run(&args),
        Command::Cleanup(args) => cli::cleanup::cleanup(&args),
    }
}
