//! The campaign's summary: faults injected by kind, what the plugin was seen doing, invariant
//! violations by kind, NVML (function, code) coverage and wall time, as a Markdown table.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    time::Duration,
};

use super::{trial::TrialOutcome, world::Violation};

/// A failing trial: its seed (rerun it alone with `--seed <seed> --trials 1`), what broke and
/// its log.
#[derive(Debug)]
pub struct FailedTrial {
    pub seed: u64,
    pub violations: Vec<Violation>,
    pub log: Vec<String>,
}

#[derive(Debug, Default)]
pub struct CampaignReport {
    pub first_seed: u64,
    pub trials: u64,
    pub claims: u64,
    pub faults: BTreeMap<String, u64>,
    pub observed: BTreeMap<String, u64>,
    pub violations: BTreeMap<&'static str, u64>,
    pub failed: Vec<FailedTrial>,
    pub fired_pairs: BTreeSet<(String, u32)>,
    pub functions: usize,
    pub total_pairs: usize,
    /// Absence answers not injected (see `nvml_calls::ABSENCE_ANSWERS`), as `function/CODE`.
    pub excluded: Vec<String>,
    pub wall: Duration,
}

impl CampaignReport {
    pub fn add(&mut self, outcome: TrialOutcome) {
        self.trials += 1;
        self.claims += outcome.claims as u64;
        for (k, v) in outcome.tally.faults {
            *self.faults.entry(k).or_default() += v;
        }
        for (k, v) in outcome.tally.observed {
            *self.observed.entry(k).or_default() += v;
        }
        self.fired_pairs.extend(outcome.tally.fired_pairs);
        for v in &outcome.violations {
            *self.violations.entry(v.kind).or_default() += 1;
        }
        if !outcome.violations.is_empty() {
            self.failed.push(FailedTrial {
                seed: outcome.seed,
                violations: outcome.violations,
                log: outcome.log,
            });
        }
    }

    /// The Markdown table.
    pub fn table(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(t, "| | count |");
        let _ = writeln!(t, "|---|---:|");
        let _ = writeln!(
            t,
            "| trials (seeds {}..{}) | {} |",
            self.first_seed,
            self.first_seed.wrapping_add(self.trials.saturating_sub(1)),
            self.trials
        );
        let _ = writeln!(t, "| claims | {} |", self.claims);
        let _ = writeln!(t, "| wall time | {:.1} s |", self.wall.as_secs_f64());
        for (kind, n) in &self.faults {
            let _ = writeln!(t, "| fault: {kind} | {n} |");
        }
        let _ = writeln!(
            t,
            "| NVML (function, error code) pairs fired | {} of {} ({} functions × 31 codes, less {} absence answers) |",
            self.fired_pairs.len(),
            self.total_pairs,
            self.functions,
            self.excluded.len()
        );
        if !self.excluded.is_empty() {
            let _ = writeln!(
                t,
                "| absence answers not injected | {} |",
                self.excluded.join(", ")
            );
        }
        for (what, n) in &self.observed {
            let _ = writeln!(t, "| observed: {what} | {n} |");
        }
        if self.violations.is_empty() {
            let _ = writeln!(t, "| invariant violations | 0 |");
        }
        for (kind, n) in &self.violations {
            let _ = writeln!(t, "| violation: {kind} | {n} |");
        }
        t
    }

    /// Each failing trial's seed, violations and log (the minimal repro).
    pub fn failures(&self) -> String {
        let mut t = String::new();
        for failed in &self.failed {
            let _ = writeln!(
                t,
                "trial seed {} failed; rerun it alone: make fault-campaign TRIALS=1 SEED={}",
                failed.seed, failed.seed
            );
            for v in &failed.violations {
                let _ = writeln!(t, "  {}: {}", v.kind, v.detail);
            }
            let _ = writeln!(t, "  log:");
            for line in &failed.log {
                let _ = writeln!(t, "    {line}");
            }
        }
        t
    }
}
