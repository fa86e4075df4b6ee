//! Allocation from the published pool, for trials without the oracle scheduler: the plugin's
//! own inventory ([`migdra_kubelet_plugin::gpus::Gpus::inventory`]) goes into a GpuNode's
//! status, comes back out of it as the controller reads it, becomes the node's ResourceSlices
//! through migdra-api ([`published_plan`], [`render_pool`]) with the devices claims hold kept
//! counted, and each device is chosen among the published, untainted devices whose counters
//! still fit ([`Allocator`], the scheduler's rules; an `adminAccess` device must fit too but
//! takes nothing), at random rather than first fit so that trials spread over the pool. What the plugin reports decides what it is asked to prepare.

use std::collections::{BTreeMap, BTreeSet};

use migdra_api::{
    inventory::{GpuInventory, GpuNode, GpuNodeSpec, GpuNodeStatus},
    policy::{EffectivePolicy, MigMode, ProfileMatcher},
    slices::{PlannedKind, PoolIdentity, allocator::Allocator, published_plan, render_pool},
};

use super::{
    rng::Rng,
    scenario::{ClaimKind, Placement, Usage, share_id},
};
use crate::plugin::{DRIVER, NODE, POOL};

/// The node's MigPolicy: every profile offered, whole GPUs too, MIG modes switched at prepare
/// (the campaign injects faults into switches), `1g` profiles shared.
pub fn policy() -> EffectivePolicy {
    EffectivePolicy {
        mig_mode: MigMode::Dynamic,
        shared_profiles: vec![ProfileMatcher::parse("1g").expect("1g is a profile class")],
        ..EffectivePolicy::default()
    }
}

/// The inventory as the controller reads it: written into a GpuNode's status, read back.
fn through_gpunode(inventory: &[GpuInventory]) -> Result<Vec<GpuInventory>, String> {
    let mut node = GpuNode::new(
        NODE,
        GpuNodeSpec {
            node_name: NODE.into(),
            driver: DRIVER.into(),
        },
    );
    node.status = Some(GpuNodeStatus {
        gpus: Some(inventory.to_vec()),
        ..GpuNodeStatus::default()
    });
    let json = serde_json::to_value(&node).map_err(|e| format!("GpuNode to JSON: {e}"))?;
    let back: GpuNode = serde_json::from_value(json).map_err(|e| format!("GpuNode from JSON: {e}"))?;
    Ok(back.status.and_then(|s| s.gpus).unwrap_or_default())
}

/// Chooses `count` devices of `kind` from the pool published for `inventory`, next to the
/// `allocated` claims' devices. `Ok(None)`: the pool has no room.
pub fn allocate(
    inventory: &[GpuInventory],
    allocated: &BTreeMap<String, Vec<Placement>>,
    rng: &mut Rng,
    kind: ClaimKind,
    count: usize,
) -> Result<Option<Vec<Placement>>, String> {
    let gpus = through_gpunode(inventory)?;
    let policy = policy();
    let held: BTreeSet<String> = allocated
        .values()
        .flatten()
        .filter(|p| p.usage != Usage::Admin)
        .map(|p| p.device.clone())
        .collect();
    let (plan, _) = published_plan(&gpus, &policy, &held);
    let id = PoolIdentity {
        driver: DRIVER,
        node: NODE,
        pool: POOL,
        generation: 1,
        driver_version: None,
    };
    // What the scheduler can pick: published devices without a taint.
    let offered: BTreeSet<String> = render_pool(&id, &gpus, &plan)
        .iter()
        .flat_map(|spec| spec.devices.iter().flatten())
        .filter(|d| d.taints.as_ref().is_none_or(Vec::is_empty))
        .map(|d| d.name.clone())
        .collect();
    let index_of = |name: &str| plan.devices.iter().position(|d| d.name.to_string() == name);
    let mut allocator = Allocator::new(&plan);
    // GPUs where a held device could not be charged again (its counters changed under it):
    // nothing new goes there, as the scheduler would still count the holder.
    let mut uncounted: BTreeSet<u32> = BTreeSet::new();
    for p in allocated.values().flatten().filter(|p| p.usage != Usage::Admin) {
        match index_of(&p.device) {
            Some(i) if allocator.take(i) => {}
            _ => {
                uncounted.insert(p.gpu);
            }
        }
    }
    let mut chosen: Vec<Placement> = Vec::new();
    for _ in 0..count {
        let candidates: Vec<usize> = (0..plan.devices.len())
            .filter(|i| {
                let d = &plan.devices[*i];
                let name = d.name.to_string();
                let wanted = match (&d.kind, kind) {
                    (PlannedKind::Gpu, ClaimKind::WholeGpu | ClaimKind::AdminAccess) => true,
                    (PlannedKind::Mig { .. }, ClaimKind::Mig) => d.shares.is_none(),
                    (PlannedKind::Mig { .. }, ClaimKind::Shared) => d.shares.is_some(),
                    _ => false,
                };
                wanted
                    && offered.contains(&name)
                    && !uncounted.contains(&d.gpu_minor)
                    && !chosen.iter().any(|c| c.device == name)
                    // The scheduler checks counters for adminAccess too; it only takes none.
                    && allocator.fits(*i)
            })
            .collect();
        if candidates.is_empty() {
            return Ok(None);
        }
        let i = *rng.pick(&candidates);
        if kind != ClaimKind::AdminAccess {
            allocator.take(i);
        }
        let d = &plan.devices[i];
        let gpu = d.gpu_minor;
        chosen.push(match &d.kind {
            PlannedKind::Gpu => Placement::whole(
                gpu,
                if kind == ClaimKind::AdminAccess {
                    Usage::Admin
                } else {
                    Usage::Whole
                },
            ),
            PlannedKind::Mig { profile, start } => Placement {
                gpu,
                profile_id: profile.gi_profile_id,
                start: *start,
                size: profile.memory_slices,
                device: d.name.to_string(),
                usage: if d.shares.is_some() {
                    Usage::Share(share_id(rng))
                } else {
                    Usage::Exclusive
                },
            },
        });
    }
    Ok(Some(chosen))
}
