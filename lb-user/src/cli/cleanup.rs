//! `lb cleanup [--config FILE] [--pin-dir DIR]`: detach the connect-time programs a lb left
//! pinned and remove every pin and the directory. Refused while a live lb holds the directory.
//! Not for a service's stop hook: between a stop and the next start the pinned programs are
//! what keeps connect-time clients served.

use std::{path::PathBuf, process::ExitCode};

use clap::Args;

use super::{EXIT_FAILURE, EXIT_USAGE};
use crate::{config::Config, datapath};

/// `lb cleanup`.
#[derive(Debug, Args)]
pub struct CleanupArgs {
    /// TOML config file whose `[datapath] pin_dir` to clean.
    #[arg(long, env = "LB_CONFIG")]
    pub config: Option<PathBuf>,
    /// The pin directory (wins over the config's; default `<bpffs>/lb/default`).
    #[arg(long, env = "LB_PIN_DIR")]
    pub pin_dir: Option<PathBuf>,
}

/// Clean the pin directory the arguments name: exit 0 when nothing is left (also when there
/// was nothing), 1 when a live lb holds it or a pin could not be removed, 2 for a bad config.
pub fn cleanup(args: &CleanupArgs) -> ExitCode {
    let configured = match (&args.pin_dir, &args.config) {
        (Some(dir), _) => Some(dir.clone()),
        (None, Some(file)) => match Config::from_file(file) {
            Ok(cfg) => cfg.datapath.pin_dir,
            Err(e) => {
                eprintln!("{}", super::config::invalid(Some(file), &e));
                return ExitCode::from(EXIT_USAGE);
            }
        },
        (None, None) => None,
    };
    let Some(dir) = datapath::resolve_dir(configured.as_deref()) else {
        println!("no bpffs is mounted and no pin directory is given: nothing to clean");
        return ExitCode::SUCCESS;
    };
    match datapath::cleanup(&dir) {
        Ok(c) if c == datapath::Cleaned::default() => {
            println!("{}: nothing pinned", dir.display());
            ExitCode::SUCCESS
        }
        Ok(c) => {
            println!(
                "{}: {} link(s) detached, {} map pin(s) removed, directory removed",
                dir.display(),
                c.links,
                c.maps
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("lb: cleanup refused: {}", crate::errors::chain(&e));
            ExitCode::from(EXIT_FAILURE)
        }
    }
}
