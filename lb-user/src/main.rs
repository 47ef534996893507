//! `lb` binary: parse the command line, set up logging, call the library.

use std::process::ExitCode;

use clap::Parser as _;
use lb::{
    cli::{Cli, Command, ConfigCommand},
    config::{Config, EXIT_INVALID_CONFIG},
};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Command::Config(ConfigCommand::Check { file }) => match Config::from_file(&file) {
            Ok(cfg) => {
                println!(
                    "{}: valid ({} balancer(s))",
                    file.display(),
                    cfg.balancers.len()
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::from(EXIT_INVALID_CONFIG as u8)
            }
        },
        Command::Run(args) => {
            let overrides = args.overrides();
            let cfg = match Config::load(args.config.as_deref(), &overrides) {
                Ok(cfg) => cfg,
                Err(e) => {
                    eprintln!("lb: invalid configuration: {e}");
                    return ExitCode::from(EXIT_INVALID_CONFIG as u8);
                }
            };
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
