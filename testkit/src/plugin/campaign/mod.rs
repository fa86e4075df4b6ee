//! The randomized fault campaign: seeded trials that run the real plugin code (driver,
//! journal, checkpoint, CDI, NVML backend) against the fake NVML library while faults are
//! injected, then check that nothing leaked and every claim converged.
//!
//! A trial ([`trial`]) builds a node of 8 simulated GPUs ([`scenario`]: H100, A100 and A30
//! boards, some with MIG off, some with an instance someone else created), runs up to 64
//! claims of every kind (exclusive MIG devices, shares of shared MIG devices, whole GPUs,
//! `adminAccess`) through kubelet-style pods ([`kubelet`]: concurrent prepares and unprepares,
//! retried on failure, calls abandoned at a deadline), and interleaves faults: crashes at
//! random steps of prepare (the MIG-mode switch included), unprepare (the orphan-list write
//! included), recovery, stale-claim collection and background repair ([`world`]), every NVML
//! error code on every NVML call the plugin makes ([`nvml_calls`]) and more on the MIG-mode
//! switch, a process holding a GPU (so a switch stays pending), slow NVML calls, GPUs lost
//! and returning, claim GETs that fail or time out, plugin restarts, two plugin instances
//! overlapping, claims deleted or replaced without an unprepare, and reboots that leave
//! files half written. Most trials allocate with an oracle scheduler; every third one from
//! the pool published for the plugin's own inventory ([`published`]). Once the faults are
//! cleared and the pods have settled, [`invariants`] checks the node.
//!
//! NVML calls that never return are not injected yet; hang trials plug in at
//! `trial::WEIGHTED`.
//!
//! The plugin test binary runs a bounded campaign (`fault_campaign.rs`); the example
//! `fault_campaign` runs any number of trials and prints the [`report`] table
//! (`make fault-campaign TRIALS=1000 [SEED=S]`).

pub mod invariants;
pub mod kubelet;
pub mod nvml_calls;
pub mod published;
pub mod report;
pub mod rng;
pub mod scenario;
pub mod trial;
pub mod world;

use std::{sync::Once, time::Instant};

use futures::StreamExt as _;

pub use report::CampaignReport;

/// What to run.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    pub trials: u64,
    /// Seed of the first trial; trial `i` runs seed `seed + i`.
    pub seed: u64,
    /// Print one line per trial.
    pub progress: bool,
    /// Print every trial's log (what the seed scheduled and what happened).
    pub log: bool,
    /// Trials run at once (each on its own simulated node; most of a trial's time is spent
    /// waiting on locks, back-offs and deadlines, so a few at once use the machine better).
    pub jobs: usize,
}

/// Keeps the simulated crashes (panics at a step) off stderr; every other panic goes to the
/// hook installed before.
pub fn quiet_simulated_crashes() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info
                .payload()
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| info.payload().downcast_ref::<&str>().copied())
                .unwrap_or_default();
            if !payload.contains(world::CRASH_MARK) {
                previous(info);
            }
        }));
    });
}

/// Runs the campaign, one trial after the other.
pub async fn run(options: Options) -> CampaignReport {
    quiet_simulated_crashes();
    let started = Instant::now();
    let calls = nvml_calls::NvmlCalls::learn().await;
    let mut report = CampaignReport {
        first_seed: options.seed,
        functions: calls.functions.len(),
        total_pairs: calls.pairs(),
        excluded: calls
            .excluded
            .iter()
            .map(|(function, _, name)| format!("{function}/{name}"))
            .collect(),
        ..CampaignReport::default()
    };
    let mut outcomes: Vec<trial::TrialOutcome> = futures::stream::iter(0..options.trials)
        .map(|i| {
            let calls = calls.clone();
            let seed = options.seed.wrapping_add(i);
            async move {
                let outcome = trial::run_trial(seed, &calls).await;
                if options.progress {
                    println!(
                        "trial seed {seed}: {} claims, {} violation(s), {:.2} s",
                        outcome.claims,
                        outcome.violations.len(),
                        outcome.elapsed.as_secs_f64()
                    );
                }
                outcome
            }
        })
        .buffer_unordered(options.jobs.max(1))
        .collect()
        .await;
    outcomes.sort_by_key(|o| o.seed.wrapping_sub(options.seed));
    for outcome in outcomes {
        if options.log {
            println!("trial seed {}:", outcome.seed);
            for line in &outcome.log {
                println!("  {line}");
            }
        }
        report.add(outcome);
    }
    report.wall = started.elapsed();
    report
}
