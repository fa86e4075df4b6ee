//! Prints, for every GPU model, the devices, counters and slices of a node with 8 such GPUs
//! under the default policy, MIG mode on (and, for Ampere, MIG off), with each pool validated.
//! Counters are shown before and after the never-binding ones are left out
//! (`migdra_api::slices::prune`): per counter set, and summed over every device's consumption
//! (what the scheduler checks for each device it considers); the last column is that sum with
//! the `memory` counter kept for quotas (`--keep-memory-counter`).
//!
//! Run: `cargo run -p migdra-api --example pool_sizes`

use migdra_api::{
    catalog,
    policy::EffectivePolicy,
    slices::{
        MEMORY_COUNTER, PoolIdentity, PoolPlan, plan_pool, prune::prune_counters, render_pool,
        validate::validate_pool,
    },
};

fn counters_per_set(plan: &PoolPlan) -> usize {
    plan.counter_sets.first().map_or(0, |(_, c)| c.len())
}

fn consumed(plan: &PoolPlan) -> usize {
    plan.devices.iter().map(|d| d.consumes.len()).sum()
}

fn main() {
    const GPUS: u32 = 8;
    println!(
        "{:<16} {:>6} {:>8} {:>8} {:>13} {:>15} {:>7} {:>6} {:>13}",
        "model",
        "mode",
        "devices",
        "per GPU",
        "counters/set",
        "consumed/node",
        "slices",
        "valid",
        "with memory"
    );
    for model in catalog::models() {
        let modes: &[bool] = if model.architecture.mig_mode_switchable() {
            &[true]
        } else {
            &[true, false]
        };
        for &mig in modes {
            let gpus: Vec<_> = (0..GPUS).map(|m| model.inventory(m, mig)).collect();
            let full = plan_pool(&gpus, &EffectivePolicy::default());
            let mut plan = full.clone();
            prune_counters(&mut plan, &[]);
            let mut with_memory = full.clone();
            prune_counters(&mut with_memory, &[MEMORY_COUNTER]);
            let id = PoolIdentity {
                driver: "gpu.migdra.dev",
                node: "node",
                pool: "node/gpu.migdra.dev",
                generation: 1,
                driver_version: Some("580.82.07"),
            };
            let slices = render_pool(&id, &gpus, &plan);
            let valid = validate_pool(&slices).is_ok();
            println!(
                "{:<16} {:>6} {:>8} {:>8} {:>13} {:>15} {:>7} {:>6} {:>13}",
                model.key,
                if mig { "MIG" } else { "whole" },
                plan.devices.len(),
                plan.devices.len() / GPUS as usize,
                format!("{} -> {}", counters_per_set(&full), counters_per_set(&plan)),
                format!("{} -> {}", consumed(&full), consumed(&plan)),
                slices.len(),
                valid,
                consumed(&with_memory)
            );
        }
    }
}
