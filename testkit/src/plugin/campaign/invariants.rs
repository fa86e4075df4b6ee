//! The invariants checked once a trial has settled (faults cleared, every pod either running
//! or gone, no call in flight), from what is on the node: the fake's GPU state, the
//! checkpoint file, the orphan list and the CDI directory.
//!
//! - no foreign instance touched (each one that existed before the plugin still exists, with
//!   the same creation serial and the same compute instances);
//! - no two instances overlap on a GPU;
//! - no leaked instance: every instance not foreign is described by exactly one completed
//!   record of a claim whose pod runs (none at all once every pod is gone);
//! - every record is completed, belongs to a running pod's claim, lists exactly the allocated
//!   devices, and each of its devices exists in NVML with the recorded IDs and MIG UUID;
//! - the CDI directory holds exactly one spec per completed record, handing out the MIG UUIDs
//!   NVML has;
//! - every running pod's claims are prepared (converged), and nothing is left on the list of
//!   instances to destroy when a lost GPU returns.

use std::collections::{BTreeMap, BTreeSet};

use migdra_fake_nvml::FakeState;
use migdra_kubelet_plugin::{
    checkpoint::{CheckpointData, ClaimState, DeviceKind},
    orphans::ORPHANS_FILE,
};

use super::{
    kubelet::{Phase, Pod},
    world::{Violation, World, lock},
};

/// An instance that existed before the plugin: (GPU index, creation serial) and its
/// compute instances' UUIDs.
pub type Foreign = BTreeMap<(u32, u64), Vec<String>>;

pub fn foreign_instances(state: &FakeState) -> Foreign {
    state
        .gpus
        .iter()
        .flat_map(|g| {
            g.gpu_instances.iter().map(move |gi| {
                (
                    (g.index, gi.serial),
                    gi.compute_instances.iter().map(|c| c.uuid.clone()).collect(),
                )
            })
        })
        .collect()
}

fn read_checkpoint(world: &World) -> Result<CheckpointData, String> {
    let path = world.node.state_dir().join("checkpoint.json");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let file: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_value(file["data"].clone()).map_err(|e| format!("{}: data: {e}", path.display()))
}

fn read_orphans(world: &World) -> Vec<serde_json::Value> {
    let path = world.node.state_dir().join(ORPHANS_FILE);
    std::fs::read_to_string(&path)
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .and_then(|v| v["orphans"].as_array().cloned())
        .unwrap_or_default()
}

/// The MIG UUIDs a CDI spec hands out (its `MIGDRA_DEVICE_UUID_*` variables).
fn spec_uuids(spec: &serde_json::Value) -> BTreeSet<String> {
    spec["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|d| d["containerEdits"]["env"].as_array().cloned().unwrap_or_default())
        .filter_map(|e| {
            e.as_str()
                .and_then(|e| e.split_once('='))
                .map(|(_, v)| v.to_string())
        })
        .filter(|v| v.starts_with("MIG-"))
        .collect()
}

/// Checks the settled node. `pods` are every pod of the trial; those Running must be
/// prepared, all others must have left nothing behind.
pub fn check(world: &World, foreign: &Foreign, pods: &[std::sync::Arc<Pod>], stage: &str) -> Vec<Violation> {
    let mut out = Vec::new();
    let mut violation = |kind: &'static str, detail: String| {
        out.push(Violation {
            kind,
            detail: format!("{stage}: {detail}"),
        })
    };
    let state = match world.node.host.read_state() {
        Ok(state) => state,
        Err(e) => {
            violation("node unreadable", format!("fake NVML state: {e}"));
            return out;
        }
    };
    let checkpoint = match read_checkpoint(world) {
        Ok(c) => c,
        Err(e) => {
            violation("checkpoint unreadable", e);
            return out;
        }
    };

    // Foreign instances.
    let now = foreign_instances(&state);
    for (key, cis) in foreign {
        match now.get(key) {
            None => violation(
                "foreign instance touched",
                format!("GPU {} instance #{} is gone", key.0, key.1),
            ),
            Some(now_cis) if now_cis != cis => violation(
                "foreign instance touched",
                format!(
                    "GPU {} instance #{}: compute instances {cis:?} became {now_cis:?}",
                    key.0, key.1
                ),
            ),
            Some(_) => {}
        }
    }

    // Overlaps.
    for gpu in &state.gpus {
        let mut spans: Vec<(u32, u32, u32)> = gpu
            .gpu_instances
            .iter()
            .map(|gi| (gi.start, gi.size, gi.id))
            .collect();
        spans.sort_unstable();
        for pair in spans.windows(2) {
            if pair[0].0 + pair[0].1 > pair[1].0 {
                violation(
                    "overlapping instances",
                    format!(
                        "GPU {}: instances {} and {} overlap",
                        gpu.index, pair[0].2, pair[1].2
                    ),
                );
            }
        }
    }

    // The claims that should be prepared.
    let running: BTreeMap<&str, &super::kubelet::PodClaim> = pods
        .iter()
        .filter(|p| p.phase() == Phase::Running)
        .flat_map(|p| p.claims.iter().map(|c| (c.uid.as_str(), c)))
        .collect();

    // Records against NVML and the pods.
    let gpu_by_uuid: BTreeMap<&str, &migdra_fake_nvml::GpuState> =
        state.gpus.iter().map(|g| (g.uuid.as_str(), g)).collect();
    let mut described: BTreeMap<(u32, u32), String> = BTreeMap::new();
    for (uid, record) in &checkpoint.claims {
        if record.state != ClaimState::PrepareCompleted {
            violation(
                "unfinished record",
                format!("claim {} ({uid}) is {:?}", record.key(), record.state),
            );
        }
        match running.get(uid.as_str()) {
            None => violation(
                "stale record",
                format!(
                    "claim {} ({uid}) is recorded but no running pod has it",
                    record.key()
                ),
            ),
            Some(claim) => {
                let mut want: Vec<&str> = claim.placements.iter().map(|p| p.device.as_str()).collect();
                let mut got: Vec<&str> = record.devices.iter().map(|d| d.device.as_str()).collect();
                want.sort_unstable();
                got.sort_unstable();
                if want != got {
                    violation(
                        "record differs from the allocation",
                        format!("claim {}: recorded {got:?}, allocated {want:?}", record.key()),
                    );
                }
            }
        }
        for device in &record.devices {
            let DeviceKind::Mig {
                profile_id,
                start,
                gpu_instance,
                mig_uuid,
                ..
            } = &device.kind
            else {
                continue;
            };
            let Some(gpu) = gpu_by_uuid.get(device.gpu_uuid.as_str()) else {
                violation(
                    "record without instance",
                    format!("{}: unknown GPU {}", device.device, device.gpu_uuid),
                );
                continue;
            };
            let found = gpu.gpu_instances.iter().find(|gi| {
                gi.profile_id == *profile_id && gi.start == *start && Some(gi.id) == *gpu_instance
            });
            match found {
                None => violation(
                    "record without instance",
                    format!(
                        "claim {} device {}: no GPU instance {gpu_instance:?} there",
                        record.key(),
                        device.device
                    ),
                ),
                Some(gi) => {
                    let uuids: Vec<&str> = gi.compute_instances.iter().map(|c| c.uuid.as_str()).collect();
                    if mig_uuid.as_deref().is_none_or(|u| uuids != [u]) {
                        violation(
                            "record disagrees with NVML",
                            format!(
                                "claim {} device {}: recorded {mig_uuid:?}, NVML has {uuids:?}",
                                record.key(),
                                device.device
                            ),
                        );
                    }
                    if let Some(other) = described.insert((gpu.index, gi.id), record.key()) {
                        violation(
                            "instance recorded twice",
                            format!(
                                "GPU {} instance {}: claims {other} and {}",
                                gpu.index,
                                gi.id,
                                record.key()
                            ),
                        );
                    }
                }
            }
        }
    }

    // Leaks: instances neither foreign nor described by a record.
    for gpu in &state.gpus {
        for gi in &gpu.gpu_instances {
            if foreign.contains_key(&(gpu.index, gi.serial)) || described.contains_key(&(gpu.index, gi.id)) {
                continue;
            }
            violation(
                "leaked instance",
                format!(
                    "GPU {} instance {} (profile {} at {})",
                    gpu.index, gi.id, gi.profile_id, gi.start
                ),
            );
        }
    }

    // Convergence: every running pod's claims are recorded as prepared.
    for (uid, claim) in &running {
        if !checkpoint.claims.contains_key(*uid) {
            violation(
                "claim did not converge",
                format!("{} ({uid}) is running but not recorded", claim.name),
            );
        }
    }
    for pod in pods {
        let status = lock(&pod.status);
        if status.phase == Phase::GaveUp {
            let names: Vec<&str> = pod.claims.iter().map(|c| c.name.as_str()).collect();
            violation(
                "claim did not converge",
                format!(
                    "pod {} ({names:?}) gave up after {} attempts; last error: {}",
                    pod.id,
                    status.attempts,
                    status.last_error.as_deref().unwrap_or("none")
                ),
            );
        }
    }

    // CDI specs against the records.
    let cdi = world.node.cdi();
    let specs: BTreeSet<std::path::PathBuf> = world.node.cdi_specs().into_iter().collect();
    let mut expected = BTreeSet::new();
    for (uid, record) in &checkpoint.claims {
        if record.state != ClaimState::PrepareCompleted {
            continue;
        }
        let path = cdi.spec_path(uid);
        expected.insert(path.clone());
        let Ok(text) = std::fs::read_to_string(&path) else {
            violation(
                "record without CDI spec",
                format!("claim {} ({uid})", record.key()),
            );
            continue;
        };
        let spec: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        let want: BTreeSet<String> = record
            .devices
            .iter()
            .filter_map(|d| match &d.kind {
                DeviceKind::Mig { mig_uuid, .. } => mig_uuid.clone(),
                DeviceKind::Gpu => None,
            })
            .collect();
        let got = spec_uuids(&spec);
        if got != want {
            violation(
                "CDI spec disagrees with NVML",
                format!(
                    "claim {}: spec hands out {got:?}, the instances are {want:?}",
                    record.key()
                ),
            );
        }
    }
    for path in specs.difference(&expected) {
        violation("CDI spec without record", path.display().to_string());
    }

    let orphans = read_orphans(world);
    if !orphans.is_empty() {
        violation(
            "orphan left",
            format!(
                "{} instance(s) still listed for destruction: {orphans:?}",
                orphans.len()
            ),
        );
    }
    out
}
