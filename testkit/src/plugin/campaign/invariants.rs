//! The invariants checked once a trial has settled (faults cleared, every pod either running
//! or gone, no call in flight), from what is on the node: the fake's GPU state, the
//! checkpoint file, the orphan list and the CDI directory.
//!
//! - no foreign instance touched (each one that existed before the plugin still exists, with
//!   the same creation serial and the same compute instances);
//! - no two instances overlap on a GPU;
//! - no leaked instance: every instance not foreign is described by exactly one completed
//!   record of a claim whose pod runs, or by one per share when it is a shared device's (none
//!   at all once every pod is gone), and all running holders of a shared device record the
//!   same instance, so it was destroyed only with its last holder;
//! - a whole GPU's record finds MIG off and no instance on it, a MIG record finds MIG on;
//!   no GPU's MIG mode is left pending a reset;
//! - an `adminAccess` claim has a CDI spec while its pod runs and never a record (it creates
//!   and reserves nothing: anything it created would be a leaked instance);
//! - every record is completed, belongs to a running pod's claim, lists exactly the allocated
//!   devices, and each of its devices exists in NVML with the recorded IDs and MIG UUID;
//! - the CDI directory holds exactly one spec per completed record, handing out the MIG UUIDs
//!   NVML has;
//! - every running pod's claims are prepared (converged), and nothing is left on the list of
//!   instances to destroy when a lost GPU returns.

use std::collections::{BTreeMap, BTreeSet};

use migdra_fake_nvml::FakeState;
use migdra_kubelet_plugin::{
    checkpoint::{CheckpointData, ClaimRecord, ClaimState, DeviceKind},
    orphans::ORPHANS_FILE,
};

use super::{
    kubelet::{Phase, Pod, PodClaim},
    scenario::SHARES,
    world::{Violation, World, lock},
};

/// A record holding an instance.
struct Holder {
    claim: String,
    device: String,
    share: bool,
}

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

/// The claims the checkpoint holds for this boot (none when there is no file yet, or it is
/// of an earlier boot: the plugin starts empty from either).
fn read_checkpoint(world: &World) -> Result<BTreeMap<String, ClaimRecord>, String> {
    let path = world.node.state_dir().join("checkpoint.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let file: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let data: CheckpointData =
        serde_json::from_value(file["data"].clone()).map_err(|e| format!("{}: data: {e}", path.display()))?;
    Ok(if data.boot_id == *lock(&world.boot_id) {
        data.claims
    } else {
        BTreeMap::new()
    })
}

/// The orphan list of this boot (a list of an earlier boot is void).
fn read_orphans(world: &World) -> Vec<serde_json::Value> {
    let path = world.node.state_dir().join(ORPHANS_FILE);
    let file = std::fs::read_to_string(&path)
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .unwrap_or_default();
    if file["bootId"].as_str() != Some(lock(&world.boot_id).as_str()) {
        return Vec::new();
    }
    file["orphans"].as_array().cloned().unwrap_or_default()
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
    let claims = match read_checkpoint(world) {
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

    // MIG mode: never left pending a reset.
    for gpu in &state.gpus {
        if gpu.mig_pending != gpu.mig_enabled {
            violation(
                "MIG mode left pending",
                format!(
                    "GPU {}: MIG {} with {} pending",
                    gpu.index,
                    if gpu.mig_enabled { "on" } else { "off" },
                    if gpu.mig_pending { "on" } else { "off" }
                ),
            );
        }
    }

    // The claims that should be prepared (an adminAccess claim has a CDI spec and no record).
    let running_all: BTreeMap<&str, &PodClaim> = pods
        .iter()
        .filter(|p| p.phase() == Phase::Running)
        .flat_map(|p| p.claims.iter().map(|c| (c.uid.as_str(), c)))
        .collect();
    let running: BTreeMap<&str, &PodClaim> = running_all
        .iter()
        .filter(|(_, c)| !c.is_admin())
        .map(|(u, c)| (*u, *c))
        .collect();
    let admin: BTreeSet<&str> = pods
        .iter()
        .flat_map(|p| p.claims.iter().filter(|c| c.is_admin()).map(|c| c.uid.as_str()))
        .collect();

    // Records against NVML and the pods.
    let gpu_by_uuid: BTreeMap<&str, &migdra_fake_nvml::GpuState> =
        state.gpus.iter().map(|g| (g.uuid.as_str(), g)).collect();
    let mut described: BTreeMap<(u32, u32), Vec<Holder>> = BTreeMap::new();
    for (uid, record) in &claims {
        if record.state != ClaimState::PrepareCompleted {
            violation(
                "unfinished record",
                format!("claim {} ({uid}) is {:?}", record.key(), record.state),
            );
        }
        if admin.contains(uid.as_str()) {
            violation(
                "adminAccess claim recorded",
                format!(
                    "claim {} ({uid}) reserves devices: {:?}",
                    record.key(),
                    record.device_names()
                ),
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
            let Some(gpu) = gpu_by_uuid.get(device.gpu_uuid.as_str()) else {
                violation(
                    "record without instance",
                    format!("{}: unknown GPU {}", device.device, device.gpu_uuid),
                );
                continue;
            };
            let DeviceKind::Mig {
                profile_id,
                start,
                gpu_instance,
                mig_uuid,
                ..
            } = &device.kind
            else {
                // A whole GPU: MIG off and nothing on it.
                if gpu.mig_enabled || !gpu.gpu_instances.is_empty() {
                    violation(
                        "whole GPU not whole",
                        format!(
                            "claim {} has GPU {} whole, but MIG is {} with {} instance(s)",
                            record.key(),
                            gpu.index,
                            if gpu.mig_enabled { "on" } else { "off" },
                            gpu.gpu_instances.len()
                        ),
                    );
                }
                continue;
            };
            if !gpu.mig_enabled {
                violation(
                    "record without instance",
                    format!(
                        "claim {} device {}: MIG is off on GPU {}",
                        record.key(),
                        device.device,
                        gpu.index
                    ),
                );
                continue;
            }
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
                    described.entry((gpu.index, gi.id)).or_default().push(Holder {
                        claim: record.key(),
                        device: device.device.clone(),
                        share: device.is_share(),
                    });
                }
            }
        }
    }

    // An instance has one record, or one per share of the one shared device it is: the last
    // holder's teardown is the one that destroys it.
    for ((gpu, gi), holders) in &described {
        let one_shared_device = holders.iter().all(|h| h.share && h.device == holders[0].device);
        if holders.len() > 1 && !one_shared_device || holders.len() > SHARES as usize {
            violation(
                "instance recorded twice",
                format!(
                    "GPU {gpu} instance {gi}: {:?}",
                    holders
                        .iter()
                        .map(|h| format!("claim {} device {} (share: {})", h.claim, h.device, h.share))
                        .collect::<Vec<_>>()
                ),
            );
        }
    }
    // Every running holder of a shared device holds the same instance.
    let mut shared: BTreeMap<&str, BTreeSet<(u32, u32)>> = BTreeMap::new();
    for (key, holders) in &described {
        for h in holders.iter().filter(|h| h.share) {
            shared.entry(h.device.as_str()).or_default().insert(*key);
        }
    }
    for (device, instances) in shared.iter().filter(|(_, i)| i.len() > 1) {
        violation(
            "shared device split",
            format!("the holders of {device} record different instances: {instances:?}"),
        );
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
        if !claims.contains_key(*uid) {
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
    for (uid, record) in &claims {
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
    for (uid, claim) in running_all.iter().filter(|(_, c)| c.is_admin()) {
        let path = cdi.spec_path(uid);
        if !path.exists() {
            violation(
                "adminAccess claim without CDI spec",
                format!("{} ({uid}) is running", claim.name),
            );
        }
        expected.insert(path);
    }
    for path in specs.difference(&expected) {
        violation("CDI spec without record", path.display().to_string());
    }

    // A watched placement (a rolled-back create that may still complete) stays listed for its
    // whole watch; an instance appearing there unowned is a leak the instance check reports.
    let orphans: Vec<_> = read_orphans(world)
        .into_iter()
        .filter(|o| o.get("awaitedUntil").is_none())
        .collect();
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
