//! The layout view: per node and GPU, which memory slices are in use and by what (migdra's
//! instances with their claims and pods, foreign instances, devices allocated but not created
//! yet), which placements are still free per profile, and how fragmented the free slices are.
//!
//! Instances come from the GpuNode status (what NVML reported at the plugin's last refresh);
//! their users come from the claims' allocation results, joined by device name
//! ([`crate::usage`]).

use migdra_api::{
    device_name::DeviceName,
    geometry::{MigGeometry, Placement},
    inventory::{GpuInventory, GpuNode, InstanceOwner, MigInventory},
};
use serde::Serialize;

use crate::{
    VIEW_API_VERSION,
    snapshot::{Snapshot, node_of, pool_of},
    usage::{DeviceUse, Usage},
};

/// The layout of every selected node.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LayoutView {
    pub api_version: String,
    pub kind: String,
    pub driver: String,
    pub nodes: Vec<NodeLayout>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeLayout {
    pub node: String,
    /// Pool its devices are published in.
    pub pool: String,
    /// The kubelet plugin's registration, as it last reported it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plugin: Option<PluginView>,
    /// Why nothing is shown for the node (no GpuNode, no inventory yet).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
    /// GPUs, by device minor.
    pub gpus: Vec<GpuLayout>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PluginView {
    /// True once the kubelet confirmed the registration.
    pub registered: bool,
    pub version: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum MigMode {
    Enabled,
    /// MIG off; `modeSwitchable` says whether the plugin may turn it on for a claim.
    Disabled,
    /// Not a MIG-capable GPU.
    Unsupported,
}

/// What holds one memory slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum SliceUse {
    Free,
    /// An instance migdra created.
    Migdra,
    /// An instance migdra did not create.
    Foreign,
    /// A device allocated to a claim whose instance does not exist (yet).
    Allocated,
    /// The whole GPU is allocated.
    WholeGpu,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuLayout {
    /// Device minor (names the GPU in device names).
    pub minor: u32,
    pub index: u32,
    pub uuid: String,
    pub product: String,
    pub healthy: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub health_reason: Option<String>,
    pub mig: MigMode,
    /// True when the plugin may switch MIG mode on demand.
    pub mode_switchable: bool,
    /// Memory slices of the GPU (0 when not MIG-capable).
    pub memory_slices: u32,
    /// What holds each memory slice, slice 0 first.
    pub slice_map: Vec<SliceUse>,
    pub whole_gpu: Vec<DeviceUse>,
    /// GPU instances (and allocated partitions not created yet), by start.
    pub instances: Vec<InstanceLayout>,
    /// Placements a new instance could take now, per profile (profile-table order).
    pub free: Vec<FreePlacements>,
    /// How much of the free memory the largest profile that still fits can use.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fragmentation: Option<Fragmentation>,
}

/// Who an instance entry belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum InstanceOwnerView {
    Migdra,
    /// Created by someone else; migdra never touches it.
    Foreign,
    /// Allocated to a claim by the scheduler; the plugin has not created it (yet).
    Allocated,
}

/// One GPU instance, or one allocated partition.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InstanceLayout {
    /// Profile name, when the GPU reports the profile.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    pub profile_id: u32,
    pub start: u32,
    pub memory_slices: Vec<u32>,
    /// NVML GPU-instance ID (absent for an allocated partition not created yet).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_instance_id: Option<u32>,
    pub owner: InstanceOwnerView,
    /// The published device it is (absent for foreign instances of unknown profiles).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// MIG UUID, as the plugin reported it in the claim's status.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mig_uuid: Option<String>,
    /// `namespace/name` of the claim the plugin recorded for the instance in the GpuNode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recorded_claim: Option<String>,
    /// Claims holding the device, with their pods.
    pub users: Vec<DeviceUse>,
}

/// The free placements of one profile.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FreePlacements {
    pub profile: String,
    pub memory_slices: u32,
    /// Starts where an instance could be created now.
    pub starts: Vec<u32>,
}

/// Fragmentation of a GPU's free memory slices.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Fragmentation {
    pub free_slices: u32,
    /// The largest profile (by memory slices) with a free placement.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub largest_fit: Option<String>,
    pub largest_fit_slices: u32,
    /// Free slices beyond what one instance of the largest fitting profile covers:
    /// `freeSlices - largestFitSlices`. They may still take smaller instances; what they
    /// measure is how far the free memory is from being one usable block.
    pub stranded_slices: u32,
    /// The fragmentation figure: `strandedSlices` as a percentage of `freeSlices`, rounded
    /// down (0 when nothing is free, 100 when free slices take no profile at all).
    pub percent: u32,
}

/// Builds the layout of `nodes` (every node with a GpuNode when empty).
pub fn build(snapshot: &Snapshot, nodes: &[String]) -> LayoutView {
    let usage = Usage::build(snapshot);
    let mut gpu_nodes: Vec<&GpuNode> = snapshot.gpu_nodes.iter().collect();
    gpu_nodes.sort_by(|a, b| node_of(a).cmp(node_of(b)));
    let mut out = Vec::new();
    if nodes.is_empty() {
        out.extend(gpu_nodes.iter().map(|g| node_layout(snapshot, &usage, g)));
    } else {
        let mut wanted: Vec<&String> = nodes.iter().collect();
        wanted.sort();
        wanted.dedup();
        for node in wanted {
            match gpu_nodes.iter().find(|g| node_of(g) == node) {
                Some(g) => out.push(node_layout(snapshot, &usage, g)),
                None => out.push(NodeLayout {
                    node: node.clone(),
                    pool: migdra_api::inventory::pool_name(node, &snapshot.driver),
                    plugin: None,
                    problem: Some("no GpuNode: migdra's kubelet plugin has not reported this node".into()),
                    gpus: Vec::new(),
                }),
            }
        }
    }
    LayoutView {
        api_version: VIEW_API_VERSION.into(),
        kind: "Layout".into(),
        driver: snapshot.driver.clone(),
        nodes: out,
    }
}

fn node_layout(snapshot: &Snapshot, usage: &Usage, gpu_node: &GpuNode) -> NodeLayout {
    let pool = pool_of(gpu_node, &snapshot.driver);
    let status = gpu_node.status.as_ref();
    let plugin = status.and_then(|s| s.plugin.as_ref()).map(|p| PluginView {
        registered: p.registered,
        version: p.version.clone(),
    });
    let inventory = status.and_then(|s| s.gpus.as_ref());
    let mut gpus: Vec<&GpuInventory> = inventory.iter().flat_map(|g| g.iter()).collect();
    gpus.sort_by_key(|g| g.minor);
    NodeLayout {
        node: node_of(gpu_node).to_string(),
        problem: inventory
            .is_none()
            .then(|| "the GpuNode has no GPU inventory yet".to_string()),
        gpus: gpus.into_iter().map(|g| gpu_layout(usage, &pool, g)).collect(),
        pool,
        plugin,
    }
}

fn gpu_layout(usage: &Usage, pool: &str, gpu: &GpuInventory) -> GpuLayout {
    let whole_gpu = usage
        .device(pool, &DeviceName::Gpu { minor: gpu.minor }.to_string())
        .to_vec();
    let mut layout = GpuLayout {
        minor: gpu.minor,
        index: gpu.index,
        uuid: gpu.uuid.clone(),
        product: gpu.product_name.clone(),
        healthy: gpu.health.healthy,
        health_reason: gpu.health.reason.clone(),
        mig: MigMode::Unsupported,
        mode_switchable: false,
        memory_slices: 0,
        slice_map: Vec::new(),
        whole_gpu,
        instances: Vec::new(),
        free: Vec::new(),
        fragmentation: None,
    };
    if let Some(mig) = &gpu.mig {
        mig_layout(&mut layout, usage, pool, mig);
    }
    layout
}

fn mig_layout(layout: &mut GpuLayout, usage: &Usage, pool: &str, mig: &MigInventory) {
    let geometry = &mig.geometry;
    let minor = layout.minor;
    layout.mig = if mig.enabled {
        MigMode::Enabled
    } else {
        MigMode::Disabled
    };
    layout.mode_switchable = mig.mode_switchable;
    layout.memory_slices = geometry.budget.memory_slices;

    let mut instances: Vec<InstanceLayout> = mig
        .instances
        .iter()
        .map(|instance| {
            let profile = instance.profile.or_else(|| {
                geometry
                    .profile_by_id(instance.placement.profile_id)
                    .map(|p| p.name)
            });
            let device = profile.map(|profile| {
                DeviceName::Mig {
                    minor,
                    profile,
                    start: instance.placement.start,
                }
                .to_string()
            });
            let users = device
                .as_deref()
                .map(|d| usage.device(pool, d).to_vec())
                .unwrap_or_default();
            InstanceLayout {
                profile: profile.map(|p| p.to_string()),
                profile_id: instance.placement.profile_id,
                start: instance.placement.start,
                memory_slices: covered(geometry, instance.placement),
                gpu_instance_id: Some(instance.gpu_instance_id),
                owner: match instance.owner {
                    InstanceOwner::Migdra => InstanceOwnerView::Migdra,
                    InstanceOwner::Foreign => InstanceOwnerView::Foreign,
                },
                mig_uuid: users
                    .iter()
                    .find_map(|u| u.mig_uuid.clone())
                    .or_else(|| recorded_mig_uuid(instance)),
                device,
                recorded_claim: instance.claim.clone(),
                users,
            }
        })
        .collect();

    // Partitions the scheduler allocated whose instance the plugin has not created (or the
    // GpuNode does not show yet): they hold their slices all the same.
    for (device, users) in usage.pool_devices(pool) {
        let Ok(DeviceName::Mig {
            minor: device_minor,
            profile,
            start,
        }) = device.parse::<DeviceName>()
        else {
            continue;
        };
        if device_minor != minor || instances.iter().any(|i| i.device.as_deref() == Some(device)) {
            continue;
        }
        let Some(p) = geometry.profile_by_name(&profile) else {
            continue;
        };
        let placement = Placement {
            profile_id: p.gi_profile_id,
            start,
        };
        instances.push(InstanceLayout {
            profile: Some(profile.to_string()),
            profile_id: p.gi_profile_id,
            start,
            memory_slices: covered(geometry, placement),
            gpu_instance_id: None,
            owner: InstanceOwnerView::Allocated,
            device: Some(device.to_string()),
            mig_uuid: users.iter().find_map(|u| u.mig_uuid.clone()),
            recorded_claim: None,
            users: users.to_vec(),
        });
    }
    instances.sort_by_key(|i| (i.start, i.memory_slices.len()));

    let whole = !layout.whole_gpu.is_empty();
    let existing: Vec<Placement> = instances
        .iter()
        .filter(|i| geometry.profile_by_id(i.profile_id).is_some())
        .map(|i| Placement {
            profile_id: i.profile_id,
            start: i.start,
        })
        .collect();
    layout.slice_map = (0..geometry.budget.memory_slices)
        .map(|s| {
            if whole {
                return SliceUse::WholeGpu;
            }
            instances
                .iter()
                .find(|i| i.memory_slices.contains(&s))
                .map_or(SliceUse::Free, |i| match i.owner {
                    InstanceOwnerView::Migdra => SliceUse::Migdra,
                    InstanceOwnerView::Foreign => SliceUse::Foreign,
                    InstanceOwnerView::Allocated => SliceUse::Allocated,
                })
        })
        .collect();
    layout.instances = instances;

    // Placements are free only where NVML would create an instance: MIG on, or switchable on
    // demand, and the whole GPU not taken.
    if whole || !(mig.enabled || mig.mode_switchable) {
        return;
    }
    layout.free = free_placements(geometry, &existing);
    let free_slices = count_u32(layout.slice_map.iter().filter(|s| **s == SliceUse::Free).count());
    let largest = layout
        .free
        .iter()
        .filter_map(|f| geometry.profile_by_name(&f.profile.parse().ok()?))
        // The first of the largest in profile-table order: the plain profile before its variants.
        .min_by_key(|p| std::cmp::Reverse((p.memory_slices, p.compute_slices)));
    let largest_fit_slices = largest.map_or(0, |p| p.memory_slices).min(free_slices);
    let stranded_slices = free_slices - largest_fit_slices;
    layout.fragmentation = Some(Fragmentation {
        free_slices,
        largest_fit: largest.map(|p| p.name.to_string()),
        largest_fit_slices,
        stranded_slices,
        percent: (stranded_slices * 100).checked_div(free_slices).unwrap_or(0),
    });
}

/// The placements of every profile that [`MigGeometry::check_add`] accepts next to `existing`.
pub fn free_placements(geometry: &MigGeometry, existing: &[Placement]) -> Vec<FreePlacements> {
    geometry
        .profiles
        .iter()
        .filter_map(|profile| {
            let starts: Vec<u32> = profile
                .placements
                .iter()
                .copied()
                .filter(|&start| {
                    let profile_id = profile.gi_profile_id;
                    geometry
                        .check_add(existing, Placement { profile_id, start })
                        .is_ok()
                })
                .collect();
            (!starts.is_empty()).then(|| FreePlacements {
                profile: profile.name.to_string(),
                memory_slices: profile.memory_slices,
                starts,
            })
        })
        .collect()
}

/// The MIG UUID the plugin recorded for an instance in the GpuNode (`migUuid`).
fn recorded_mig_uuid(instance: &migdra_api::inventory::MigInstance) -> Option<String> {
    instance.mig_uuid.clone().filter(|u| u.starts_with("MIG-"))
}

fn covered(geometry: &MigGeometry, placement: Placement) -> Vec<u32> {
    geometry
        .profile_by_id(placement.profile_id)
        .map(|p| p.memory_range(placement.start).collect())
        .unwrap_or_else(|| vec![placement.start])
}

fn count_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}
