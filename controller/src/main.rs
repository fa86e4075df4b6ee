//! `migdra-controller`: the cluster half of migdra.

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    migdra_controller::run(migdra_controller::cli::Args::parse()).await
}
