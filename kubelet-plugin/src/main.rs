//! `migdra-kubelet-plugin`: the node half of migdra (and its `gpu-check` subcommand).

use migdra_kubelet_plugin::{cli::Invocation, gpu_check};

fn main() -> anyhow::Result<()> {
    match Invocation::parse() {
        Invocation::GpuCheck(args) => std::process::exit(gpu_check::run(&args)),
        Invocation::Plugin(args) => migdra_runtime::async_runtime(args.process.worker_threads)?
            .block_on(migdra_kubelet_plugin::run(*args)),
    }
}
