//! The published pool: what the controller publishes for the simulated GPUs before any
//! workload runs.

use std::collections::BTreeMap;

use anyhow::{Context, ensure};
use migdra_api::{catalog, device_name::DeviceName, slices::validate::validate_pool};
use migdra_e2e::cluster::Cluster;

use crate::support::slices;

tests![slices_match_the_model];

async fn slices_match_the_model(cluster: &mut Cluster) -> anyhow::Result<()> {
    let slices = slices(cluster).await?;
    let specs: Vec<_> = slices.iter().map(|s| s.spec.clone()).collect();
    validate_pool(&specs).map_err(|e| anyhow::anyhow!("published pool is invalid: {e:?}"))?;
    let generation = specs[0].pool.generation;
    ensure!(
        specs.iter().all(|s| s.pool.generation == generation),
        "mixed generations"
    );
    ensure!(
        specs.len() as i64 == specs[0].pool.resource_slice_count,
        "pool incomplete"
    );
    // Devices per GPU and profile, as published...
    let mut published: BTreeMap<(u32, String), usize> = BTreeMap::new();
    for device in specs.iter().flat_map(|s| s.devices.iter().flatten()) {
        let key = match device.name.parse::<DeviceName>()? {
            DeviceName::Gpu { minor } => (minor, "whole".to_string()),
            DeviceName::Mig { minor, profile, .. } => (minor, profile.to_string()),
        };
        *published.entry(key).or_default() += 1;
    }
    // ...and as the model says: every placement of every profile, whole GPUs only where
    // MIG mode can be switched without a reset (Hopper), none on the A100 in MIG mode.
    let mut expected: BTreeMap<(u32, String), usize> = BTreeMap::new();
    for gpu in cluster.gpus()?.gpus {
        let model = catalog::model(&gpu.model).context("model")?;
        for p in &model.profiles {
            expected.insert((gpu.minor, p.name.to_string()), p.placements.len());
        }
        if model.architecture.mig_mode_switchable() {
            expected.insert((gpu.minor, "whole".into()), 1);
        }
    }
    ensure!(
        published == expected,
        "published {published:?}\nexpected {expected:?}"
    );
    // The counter sets are in their own slices, one per GPU.
    let sets: usize = specs
        .iter()
        .map(|s| s.shared_counters.as_ref().map_or(0, Vec::len))
        .sum();
    ensure!(sets == 3, "{sets} counter sets");
    Ok(())
}
