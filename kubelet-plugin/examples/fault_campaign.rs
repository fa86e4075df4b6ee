//! The randomized fault campaign in benchmark mode: runs `--trials N` seeded trials
//! (starting at `--seed S`, default 1) of the plugin test binary's campaign and prints the
//! table of faults injected by kind, invariant violations by kind and wall time. Exits
//! non-zero when any trial violated an invariant, after printing each failing seed with its
//! log. `make fault-campaign TRIALS=1000 [SEED=S]` runs it.

use std::process::ExitCode;

use migdra_testkit::plugin::campaign;

fn usage() -> ExitCode {
    eprintln!("usage: fault_campaign [--trials N] [--seed S] [--jobs J] [--progress] [--log]");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let mut options = campaign::Options {
        trials: 100,
        seed: 1,
        progress: false,
        log: false,
        jobs: 4,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = |args: &mut dyn Iterator<Item = String>| args.next().and_then(|v| v.parse::<u64>().ok());
        match arg.as_str() {
            "--trials" => match value(&mut args) {
                Some(n) => options.trials = n,
                None => return usage(),
            },
            "--seed" => match value(&mut args) {
                Some(s) => options.seed = s,
                None => return usage(),
            },
            "--jobs" => match value(&mut args) {
                Some(j) => options.jobs = j as usize,
                None => return usage(),
            },
            "--progress" => options.progress = true,
            "--log" => options.log = true,
            _ => return usage(),
        }
    }
    // MIGDRA_CAMPAIGN_LOG=info (a tracing filter) shows what the plugin did, for debugging
    // one seed with --jobs 1.
    if let Ok(filter) = std::env::var("MIGDRA_CAMPAIGN_LOG")
        && let Err(e) = migdra_runtime::init_logging(migdra_runtime::LogFormat::Text, &filter)
    {
        eprintln!("logging: {e}");
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let report = runtime.block_on(campaign::run(options));
    println!(
        "fault campaign: {} trial(s) from seed {}, {} NVML functions\n",
        report.trials, options.seed, report.functions
    );
    println!("{}", report.table());
    if report.failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        println!("{}", report.failures());
        ExitCode::FAILURE
    }
}
