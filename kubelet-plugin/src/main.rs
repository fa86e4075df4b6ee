//! `migdra-kubelet-plugin`: the node half of migdra.

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    migdra_kubelet_plugin::run(migdra_kubelet_plugin::cli::Args::parse()).await
}
