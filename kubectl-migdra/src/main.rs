//! `kubectl-migdra`: see [`kubectl_migdra::cli`].

use std::{io::Write, process::ExitCode};

use clap::Parser;
use kubectl_migdra::cli::{Cli, run};

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(outcome) => {
            for warning in &outcome.warnings {
                eprintln!("warning: {warning}");
            }
            let mut stdout = std::io::stdout().lock();
            // A closed pipe (`| head`) is not an error worth reporting.
            let _ = stdout.write_all(outcome.stdout.as_bytes());
            let _ = stdout.flush();
            ExitCode::from(outcome.exit_code)
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
