//! Device order: the scheduler allocates the first device in pool order whose counters fit,
//! so the order we publish decides where partitions land, and how fragmented GPUs become.
//! The packing simulation (`bench/src/packing.rs`, B7 in docs/benchmarks.md) compares the
//! strategies; `Packed` is the default because it accepts the most claims there.

use super::{PlannedDevice, PlannedKind};
use crate::{
    geometry::{MigGeometry, MigProfile},
    policy::DeviceOrder,
};

/// Memory slices that no placement of the smallest size can cover. On 8-slice GPUs this is
/// slice 7: 1g instances can never use it, only the double-memory 1g at 6, 3g at 4 and 7g.
pub fn dead_slices(geometry: &MigGeometry) -> Vec<u32> {
    let smallest = geometry
        .profiles
        .iter()
        .map(|p| p.memory_slices)
        .min()
        .unwrap_or(1);
    (0..geometry.budget.memory_slices)
        .filter(|s| {
            !geometry
                .all_placements()
                .any(|(p, start)| p.memory_slices == smallest && p.memory_range(start).contains(s))
        })
        .collect()
}

/// Rank of a device within its GPU under `Packed`/`Spread`:
/// * smaller profiles first, plain before media variants (best fit for requests that accept
///   several profiles; the single media-engine budget is not used up by accident);
/// * placements that use a dead slice first (that capacity is otherwise stranded);
/// * then ascending start, so partly used pairs and quads fill up before new ones are broken
///   and the high half stays whole for the 3g placement that also uses the dead slice;
/// * the whole GPU last.
///
/// The packing simulation compares this with the naive order, descending starts, NVIDIA's
/// auto-placement preference and a least-blocking order.
fn packed_key(dead: &[u32], device: &PlannedDevice) -> (u8, u32, u32, u64, u8, bool, u32) {
    match &device.kind {
        PlannedKind::Mig { profile, start } => (
            0,
            profile.memory_slices,
            profile.compute_slices,
            profile.memory_mib,
            variant_rank(profile),
            !profile.memory_range(*start).any(|s| dead.contains(&s)),
            *start,
        ),
        PlannedKind::Gpu => (1, 0, 0, 0, 0, false, 0),
    }
}

fn variant_rank(profile: &MigProfile) -> u8 {
    profile.name.variant as u8
}

/// Naive order: whole GPU, then the profile table in NVML index order, starts ascending.
fn naive_key(geometry: Option<&MigGeometry>, device: &PlannedDevice) -> (u8, usize, u32) {
    match (&device.kind, geometry) {
        (PlannedKind::Mig { profile, start }, Some(g)) => (
            1,
            g.profiles
                .iter()
                .position(|p| p.gi_profile_id == profile.gi_profile_id)
                .unwrap_or(usize::MAX),
            *start,
        ),
        _ => (0, 0, 0),
    }
}

/// Orders the devices of a node, given per GPU (in minor order) its geometry and devices.
pub fn order(
    per_gpu: Vec<(u32, Option<MigGeometry>, Vec<PlannedDevice>)>,
    strategy: DeviceOrder,
) -> Vec<PlannedDevice> {
    match strategy {
        DeviceOrder::Naive => per_gpu
            .into_iter()
            .flat_map(|(_, geometry, mut devices)| {
                devices.sort_by_key(|d| naive_key(geometry.as_ref(), d));
                devices
            })
            .collect(),
        DeviceOrder::Packed => per_gpu
            .into_iter()
            .flat_map(|(_, geometry, mut devices)| {
                let dead = geometry.as_ref().map(dead_slices).unwrap_or_default();
                devices.sort_by_key(|d| packed_key(&dead, d));
                devices
            })
            .collect(),
        DeviceOrder::Spread => {
            let mut ranked: Vec<(usize, u32, PlannedDevice)> = Vec::new();
            for (minor, geometry, mut devices) in per_gpu {
                let dead = geometry.as_ref().map(dead_slices).unwrap_or_default();
                devices.sort_by_key(|d| packed_key(&dead, d));
                ranked.extend(devices.into_iter().enumerate().map(|(rank, d)| (rank, minor, d)));
            }
            ranked.sort_by_key(|(rank, minor, _)| (*rank, *minor));
            ranked.into_iter().map(|(_, _, d)| d).collect()
        }
    }
}
