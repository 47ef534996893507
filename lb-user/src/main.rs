//! `lb` binary: parse the command line, set up logging, call the library.

use std::process::ExitCode;

use clap::Parser as _;
use lb::{
    cli::{self, Cli, Command, ConfigCommand, LogFormat},
    config::{Config, EXIT_INVALID_CONFIG},
};

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

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(&cli);
    match cli.command {
        Command::Config(ConfigCommand::Check { file }) => cli::config::check(&file),
        Command::Completions(args) => cli::docs::completions(&args),
        Command::Man(args) => cli::docs::man(&args),
        Command::Status(args) => {
            client_runtime().map_or(ExitCode::FAILURE, |rt| rt.block_on(cli::status::run(&args)))
        }
        Command::Servers(args) => client_runtime().map_or(ExitCode::FAILURE, |rt| {
            rt.block_on(cli::servers::run(&args))
        }),
        Command::Check(args) => {
            client_runtime().map_or(ExitCode::FAILURE, |rt| rt.block_on(cli::check::run(&args)))
        }
        Command::Run(args) => {
            let overrides = args.overrides();
            let cfg = match Config::load(args.config.as_deref(), &overrides) {
                Ok(cfg) => cfg,
                Err(e) => {
                    eprintln!("lb: invalid configuration: {e}");
                    return ExitCode::from(u8::try_from(EXIT_INVALID_CONFIG).unwrap_or(2));
                }
            };
            raise_nofile_limit();
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("lb: cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match rt.block_on(lb::daemon::run(cfg, args.config, overrides)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("lb: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// A node daemon holds two descriptors per connection: raise the soft open-files limit to the
/// hard limit (as HAProxy does from its maxconn), and say what it is.
fn raise_nofile_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => tracing::info!(from = soft, to = hard, "raised the open-files limit"),
            Err(e) => tracing::warn!(soft, hard, error = %e, "cannot raise the open-files limit"),
        },
        Ok((soft, _)) => tracing::info!(limit = soft, "open-files limit"),
        Err(e) => tracing::warn!(error = %e, "cannot read the open-files limit"),
    }
}
