//! Prints, for every GPU model, the devices and slices of a node with 8 such GPUs under the
//! default policy, MIG mode on (and, for Ampere, MIG off), with each pool validated.
//!
//! Run: `cargo run -p migdra-api --example pool_sizes`

use migdra_api::{
    catalog,
    policy::EffectivePolicy,
    slices::{PoolIdentity, plan_pool, render_pool, validate::validate_pool},
};

fn main() {
    const GPUS: u32 = 8;
    println!(
        "{:<16} {:>6} {:>9} {:>8} {:>9} {:>8} {:>7}",
        "model", "mode", "devices", "per GPU", "counters", "slices", "valid"
    );
    for model in catalog::models() {
        let modes: &[bool] = if model.architecture.mig_mode_switchable() {
            &[true]
        } else {
            &[true, false]
        };
        for &mig in modes {
            let gpus: Vec<_> = (0..GPUS).map(|m| model.inventory(m, mig)).collect();
            let plan = plan_pool(&gpus, &EffectivePolicy::default());
            let id = PoolIdentity {
                driver: "gpu.migdra.dev",
                node: "node",
                pool: "node/gpu.migdra.dev",
                generation: 1,
                driver_version: Some("580.82.07"),
            };
            let slices = render_pool(&id, &gpus, &plan);
            let valid = validate_pool(&slices).is_ok();
            let counters = slices.iter().filter(|s| s.shared_counters.is_some()).count();
            println!(
                "{:<16} {:>6} {:>9} {:>8} {:>9} {:>8} {:>7}",
                model.key,
                if mig { "MIG" } else { "whole" },
                plan.devices.len(),
                plan.devices.len() / GPUS as usize,
                counters,
                slices.len(),
                valid
            );
        }
    }
}
