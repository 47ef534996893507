//! `lb run`: load the config, start the daemon, put the admin API in front of it, and serve
//! until SIGTERM/SIGINT. Only wiring: each piece is built by its own module.

use std::process::ExitCode;

use super::RunArgs;
use crate::{
    config::{Config, EXIT_INVALID_CONFIG},
    daemon::Daemon,
};

/// Run the daemon as `args` say: exit 0 after a clean shutdown, 2 for an invalid config, 1 when
/// the data path, a listener or the admin API cannot start.
pub fn run(args: &RunArgs) -> ExitCode {
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
    let config_path = args.config.clone();
    let served = rt.block_on(async move {
        let daemon = Daemon::start(cfg, config_path, overrides).await?;
        crate::admin::start(daemon.handle()).await?;
        daemon.run_until_signalled().await
    });
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lb: {e:#}");
            ExitCode::FAILURE
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
