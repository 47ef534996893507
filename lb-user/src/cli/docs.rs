//! `lb completions SHELL` and `lb man [--dir DIR]`, generated from the clap definitions so they
//! never drift from the real command line (the man pages' extra sections: `man`).

use std::{io::Write as _, path::PathBuf, process::ExitCode};

use clap::{Args, CommandFactory as _};

use super::{Cli, EXIT_FAILURE};

/// `lb completions`.
#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// bash, zsh, fish, elvish or powershell.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

/// `lb man`.
#[derive(Debug, Args)]
pub struct ManArgs {
    /// Write `lb.1` and one `lb-COMMAND.1` per subcommand into this directory instead of
    /// printing `lb.1`.
    #[arg(long, env = "LB_MAN_DIR")]
    pub dir: Option<PathBuf>,
}

/// Print the completion script.
pub fn completions(args: &CompletionsArgs) -> ExitCode {
    let mut cmd = Cli::command();
    clap_complete::generate(args.shell, &mut cmd, "lb", &mut std::io::stdout());
    ExitCode::SUCCESS
}

/// Print or write the man pages.
pub fn man(args: &ManArgs) -> ExitCode {
    let cmd = Cli::command();
    let result = match &args.dir {
        Some(dir) => std::fs::create_dir_all(dir)
            .and_then(|()| super::man::generate_to(cmd, dir))
            .map(|()| eprintln!("man pages written to {}", dir.display())),
        None => {
            let mut out = Vec::new();
            super::man::render(cmd, &mut out).and_then(|()| std::io::stdout().write_all(&out))
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lb: man: {e}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}
