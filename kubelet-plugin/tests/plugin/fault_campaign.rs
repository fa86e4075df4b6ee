//! A bounded run of the randomized fault campaign ([`migdra_testkit::plugin::campaign`]): consecutive seeds,
//! every invariant held after each trial. The benchmark mode runs more
//! (`make fault-campaign TRIALS=1000`); `MIGDRA_CAMPAIGN_TRIALS` and `MIGDRA_CAMPAIGN_SEED`
//! change this run's count and first seed (a failing seed is printed with its log).

use migdra_testkit::plugin::campaign::{Options, run};

/// Trials per test run, at `JOBS` at once: small enough for a loaded two-core machine with
/// the debug build of the fake NVML.
const TRIALS: u64 = 4;
const JOBS: usize = 4;

fn env(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|s| s.parse().ok())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_seeded_fault_campaign_leaks_nothing_and_every_claim_converges() {
    let trials = env("MIGDRA_CAMPAIGN_TRIALS").unwrap_or(TRIALS);
    let report = run(Options {
        trials,
        seed: env("MIGDRA_CAMPAIGN_SEED").unwrap_or(1),
        progress: false,
        log: false,
        jobs: JOBS,
    })
    .await;
    println!("{}", report.table());
    assert_eq!(report.trials, trials);
    assert!(
        report.claims >= trials * 8,
        "too few claims ran: {}",
        report.claims
    );
    assert!(
        report.faults.keys().any(|k| k.starts_with("crash in ")),
        "no simulated crash fired: {:?}",
        report.faults
    );
    assert!(
        report.faults.get("NVML error fired").copied().unwrap_or(0) > 0,
        "no injected NVML error was hit: {:?}",
        report.faults
    );
    for kind in [
        "MIG claim",
        "shared MIG claim",
        "whole GPU claim",
        "adminAccess claim",
    ] {
        assert!(
            report.observed.get(kind).copied().unwrap_or(0) > 0,
            "no {kind} ran: {:?}",
            report.observed
        );
    }
    assert!(
        report.failed.is_empty(),
        "{}\n{}",
        report.table(),
        report.failures()
    );
}
