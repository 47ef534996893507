//! `lb config check [--skip-files] FILE`: validate a config file without starting anything.

use std::{path::Path, process::ExitCode};

use crate::config::{Config, ConfigError, CredentialFiles, EXIT_INVALID_CONFIG};

/// Validate `file`, reading the credential files it names or not as `files` says: print a
/// summary and exit 0, or print the error (naming the key, the value and the reason) and exit 2.
pub fn check(file: &Path, files: CredentialFiles) -> ExitCode {
    match Config::from_file_with(file, files) {
        Ok(cfg) => {
            let names: Vec<&str> = cfg.balancers.iter().map(|b| b.name.as_str()).collect();
            println!(
                "{}: valid ({} balancer(s): {})",
                file.display(),
                cfg.balancers.len(),
                names.join(", ")
            );
            ExitCode::SUCCESS
        }
        // A read or parse error names the file already.
        Err(e @ (ConfigError::Read { .. } | ConfigError::Parse { .. })) => {
            eprintln!("lb: invalid: {e}");
            ExitCode::from(u8::try_from(EXIT_INVALID_CONFIG).unwrap_or(2))
        }
        Err(e) => {
            eprintln!("lb: {}: invalid: {e}", file.display());
            ExitCode::from(u8::try_from(EXIT_INVALID_CONFIG).unwrap_or(2))
        }
    }
}
