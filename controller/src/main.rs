//! `migdra-controller`: the cluster half of migdra.

use clap::Parser;

fn main() -> anyhow::Result<()> {
    let args = migdra_controller::cli::Args::parse();
    migdra_runtime::async_runtime(args.process.worker_threads)?.block_on(migdra_controller::run(args))
}
