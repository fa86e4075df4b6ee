//! Devices in use never vanish from the pool.
//!
//! The scheduler counts a device's counter consumption only while the device is in the pool.
//! If a MigPolicy, health or MIG-mode change stops offering a device that a claim holds, and
//! the device simply disappeared, the scheduler would see its memory slices and engines as
//! free and hand out overlapping placements. So every allocated device the plan no longer
//! offers is put back, with exactly what it consumes (and its GPU's counter set, when the plan
//! dropped that too), tainted [`super::NOT_OFFERED_TAINT`] (`NoSchedule`) so nothing new is
//! allocated on it; it goes once its claim releases it.
//!
//! Only a device whose GPU is gone from the inventory (or that cannot be expressed on it any
//! more: no MIG geometry, unknown profile or placement, a budget that can no longer hold it)
//! is dropped; nothing the scheduler could allocate overlaps it then.

use std::collections::BTreeSet;

use super::{
    Counters, PlannedDevice, PlannedKind, PoolPlan, counter_set_name, fits_in, gpu_counters, mig_consumption,
};
use crate::{device_name::DeviceName, inventory::GpuInventory};

/// Why an allocated device could not be kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// Not a device name of this driver.
    NotOurs,
    GpuGone,
    /// Its GPU reports no MIG geometry any more.
    NoGeometry,
    /// The GPU has no such profile or placement.
    UnknownPlacement,
    /// What it consumes exceeds what the GPU's counter set holds now.
    BudgetExceeded,
}

/// What [`retain_allocated`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Retention {
    /// Allocated devices that were no longer offered and are kept, tainted.
    pub kept: Vec<String>,
    /// Allocated devices that could not be kept, and why.
    pub dropped: Vec<(String, DropReason)>,
}

/// Adds every device in `allocated` (device names of this pool that claims hold) that `plan`
/// does not offer, tainted, at the end of the plan (tainted devices are never first-fit
/// candidates, so their place in the order does not matter).
pub fn retain_allocated(
    plan: &mut PoolPlan,
    gpus: &[GpuInventory],
    allocated: &BTreeSet<String>,
) -> Retention {
    let offered: BTreeSet<String> = plan.devices.iter().map(|d| d.name.to_string()).collect();
    let mut retention = Retention::default();
    let mut missing: Vec<(String, DeviceName)> = Vec::new();
    for name in allocated.iter().filter(|n| !offered.contains(*n)) {
        match name.parse::<DeviceName>() {
            Ok(parsed) => missing.push((name.clone(), parsed)),
            Err(_) => retention.dropped.push((name.clone(), DropReason::NotOurs)),
        }
    }
    // Partitions first: a whole GPU kept next to them must consume their counter set.
    missing.sort_by_key(|(_, d)| (matches!(d, DeviceName::Gpu { .. }), *d));
    let mut kept = Vec::new();
    for (name, device) in missing {
        let Some(gpu) = gpus.iter().find(|g| g.minor == device.minor()) else {
            retention.dropped.push((name, DropReason::GpuGone));
            continue;
        };
        match keep(plan, gpu, device) {
            Ok(planned) => {
                retention.kept.push(name);
                kept.push(planned);
            }
            Err(reason) => retention.dropped.push((name, reason)),
        }
    }
    // A whole GPU published without counters would be co-allocatable with a kept partition
    // of the same GPU: once the GPU has a counter set, the whole GPU consumes all of it.
    for device in plan.devices.iter_mut().filter(|d| d.kind == PlannedKind::Gpu) {
        if device.counter_set.is_none()
            && let Some(counters) = set_of(&plan.counter_sets, device.gpu_minor)
        {
            device.counter_set = Some(counter_set_name(device.gpu_minor));
            device.consumes = counters.clone();
        }
    }
    plan.devices.extend(kept);
    retention
}

fn set_of(sets: &[(String, Counters)], minor: u32) -> Option<&Counters> {
    let name = counter_set_name(minor);
    sets.iter().find(|(n, _)| *n == name).map(|(_, c)| c)
}

/// Makes sure the plan has `gpu`'s counter set (in GPU order); returns it.
fn ensure_set(plan: &mut PoolPlan, gpu: &GpuInventory) -> Option<Counters> {
    if let Some(counters) = set_of(&plan.counter_sets, gpu.minor) {
        return Some(counters.clone());
    }
    let (counters, _) = gpu_counters(gpu.mig.as_ref()?);
    let name = counter_set_name(gpu.minor);
    // Sets are in GPU order; names sort like minors only up to 9, so compare minors.
    let position = plan
        .counter_sets
        .iter()
        .position(|(n, _)| {
            n.strip_prefix("gpu-")
                .and_then(|m| m.parse::<u32>().ok())
                .is_some_and(|m| m > gpu.minor)
        })
        .unwrap_or(plan.counter_sets.len());
    plan.counter_sets.insert(position, (name, counters.clone()));
    Some(counters)
}

fn keep(plan: &mut PoolPlan, gpu: &GpuInventory, device: DeviceName) -> Result<PlannedDevice, DropReason> {
    let unhealthy =
        (!gpu.health.healthy).then(|| gpu.health.reason.clone().unwrap_or_else(|| "unhealthy".into()));
    let (kind, counter_set, consumes) = match device {
        DeviceName::Mig { profile, start, .. } => {
            let mig = gpu.mig.as_ref().ok_or(DropReason::NoGeometry)?;
            let profile = mig
                .geometry
                .profile_by_name(&profile)
                .filter(|p| p.placements.contains(&start))
                .ok_or(DropReason::UnknownPlacement)?
                .clone();
            let consumes = mig_consumption(mig, &profile, start);
            let available = set_of(&plan.counter_sets, gpu.minor)
                .cloned()
                .unwrap_or_else(|| gpu_counters(mig).0);
            if !fits_in(&consumes, &available) {
                return Err(DropReason::BudgetExceeded);
            }
            ensure_set(plan, gpu);
            let set = Some(counter_set_name(gpu.minor));
            (PlannedKind::Mig { profile, start }, set, consumes)
        }
        DeviceName::Gpu { .. } => {
            // With MIG geometry the whole GPU takes its entire counter set, which excludes any
            // partition; without, it never had counters.
            let counters = ensure_set(plan, gpu);
            let set = counters.as_ref().map(|_| counter_set_name(gpu.minor));
            (PlannedKind::Gpu, set, counters.unwrap_or_default())
        }
    };
    Ok(PlannedDevice {
        gpu_minor: gpu.minor,
        name: device,
        kind,
        counter_set,
        consumes,
        unhealthy,
        not_offered: true,
        shares: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        catalog,
        policy::{EffectivePolicy, ProfileMatcher},
        slices::{UNHEALTHY_TAINT, allocator::Allocator, plan_pool, render_pool, validate::validate_pool},
    };

    fn h100s(count: u32) -> Vec<GpuInventory> {
        let model = catalog::model("H100-80GB").unwrap();
        (0..count).map(|m| model.inventory(m, true)).collect()
    }

    fn only(profiles: &[&str]) -> EffectivePolicy {
        EffectivePolicy {
            profiles: profiles
                .iter()
                .map(|p| ProfileMatcher::parse(p).unwrap())
                .collect(),
            whole_gpus: false,
            ..EffectivePolicy {
                mig_mode: crate::policy::MigMode::Dynamic,
                ..EffectivePolicy::default()
            }
        }
    }

    fn allocated(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    fn index(plan: &PoolPlan, name: &str) -> usize {
        plan.devices
            .iter()
            .position(|d| d.name.to_string() == name)
            .unwrap_or_else(|| panic!("{name} not in the pool"))
    }

    fn render_valid(
        gpus: &[GpuInventory],
        plan: &PoolPlan,
    ) -> Vec<k8s_openapi::api::resource::v1::ResourceSliceSpec> {
        let specs = render_pool(&crate::slices::test_pool_identity(), gpus, plan);
        validate_pool(&specs).unwrap_or_else(|e| panic!("invalid pool: {e:?}"));
        specs
    }

    #[test]
    fn an_allocated_3g_survives_a_policy_offering_only_1g_and_still_blocks_its_slices() {
        let gpus = h100s(1);
        let mut plan = plan_pool(&gpus, &only(&["1g"]));
        let offered = plan.devices.len();
        assert!(
            plan.devices
                .iter()
                .all(|d| d.name.to_string().contains("-mig-1g")),
            "the policy offers 1g only"
        );
        let retention = retain_allocated(&mut plan, &gpus, &allocated(&["gpu-0-mig-3g40gb-4"]));
        assert_eq!(retention.kept, ["gpu-0-mig-3g40gb-4"]);
        assert!(retention.dropped.is_empty());
        assert_eq!(plan.devices.len(), offered + 1);

        let kept = index(&plan, "gpu-0-mig-3g40gb-4");
        let device = &plan.devices[kept];
        assert!(device.not_offered);
        assert_eq!(device.counter_set.as_deref(), Some("gpu-0"));
        for s in 4..8 {
            assert_eq!(
                device.consumes.get(&format!("memory-slice-{s}")),
                Some(&1),
                "slice {s}"
            );
        }
        assert_eq!(device.consumes.get("memory-slice-3"), None);

        // Rendered with its consumption and the NoSchedule taint; the pool stays valid.
        let specs = render_valid(&gpus, &plan);
        let rendered = specs
            .iter()
            .flat_map(|s| s.devices.iter().flatten())
            .find(|d| d.name == "gpu-0-mig-3g40gb-4")
            .unwrap();
        let taints = rendered.taints.as_ref().unwrap();
        assert_eq!(taints.len(), 1);
        assert_eq!(
            (taints[0].key.as_str(), taints[0].effect.as_str()),
            (NOT_OFFERED, "NoSchedule")
        );
        assert!(rendered.consumes_counters.as_ref().is_some_and(|c| c.len() == 1));
        // Offered devices are untouched.
        let one_g = specs
            .iter()
            .flat_map(|s| s.devices.iter().flatten())
            .find(|d| d.name == "gpu-0-mig-1g10gb-0")
            .unwrap();
        assert!(one_g.taints.is_none());

        // What the scheduler sees: the claim's 3g at 4 holds slices 4-7, so no 1g at 4, 5 or
        // 6 fits, while 1g at 0-3 still does.
        let mut alloc = Allocator::new(&plan);
        assert!(alloc.take(kept));
        for start in [4, 5, 6] {
            let i = index(&plan, &format!("gpu-0-mig-1g10gb-{start}"));
            assert!(!alloc.fits(i), "1g at {start} overlaps the allocated 3g");
        }
        for start in [0, 1, 2, 3] {
            let i = index(&plan, &format!("gpu-0-mig-1g10gb-{start}"));
            assert!(alloc.fits(i), "1g at {start} is free");
        }
    }

    const NOT_OFFERED: &str = crate::slices::NOT_OFFERED_TAINT;

    #[test]
    fn a_partition_kept_after_mig_is_switched_off_brings_its_counters_and_binds_the_whole_gpu() {
        let gpus = h100s(1);
        let policy = EffectivePolicy {
            mig: false,
            ..EffectivePolicy {
                mig_mode: crate::policy::MigMode::Dynamic,
                ..EffectivePolicy::default()
            }
        };
        let mut plan = plan_pool(&gpus, &policy);
        assert!(
            plan.counter_sets.is_empty(),
            "a whole GPU alone needs no counters"
        );
        let retention = retain_allocated(&mut plan, &gpus, &allocated(&["gpu-0-mig-1g10gb-0"]));
        assert_eq!(retention.kept, ["gpu-0-mig-1g10gb-0"]);
        assert_eq!(plan.counter_sets.len(), 1);
        let whole = index(&plan, "gpu-0");
        let kept = index(&plan, "gpu-0-mig-1g10gb-0");
        assert!(!plan.devices[whole].not_offered);
        assert_eq!(plan.devices[whole].counter_set.as_deref(), Some("gpu-0"));
        render_valid(&gpus, &plan);
        let mut alloc = Allocator::new(&plan);
        assert!(alloc.take(kept));
        assert!(
            !alloc.fits(whole),
            "the whole GPU overlaps the allocated partition"
        );
    }

    #[test]
    fn a_kept_whole_gpu_consumes_every_counter() {
        let gpus = h100s(1);
        let mut plan = plan_pool(&gpus, &only(&["1g"]));
        let retention = retain_allocated(&mut plan, &gpus, &allocated(&["gpu-0"]));
        assert_eq!(retention.kept, ["gpu-0"]);
        render_valid(&gpus, &plan);
        let mut alloc = Allocator::new(&plan);
        assert!(alloc.take(index(&plan, "gpu-0")));
        assert!(
            (0..plan.devices.len()).all(|i| !alloc.fits(i)),
            "nothing fits next to an allocated whole GPU"
        );
    }

    #[test]
    fn devices_of_an_omitted_unhealthy_gpu_are_kept_with_both_taints() {
        let mut gpus = h100s(2);
        gpus[1].health.healthy = false;
        gpus[1].health.reason = Some("XID 79".into());
        let mut plan = plan_pool(
            &gpus,
            &EffectivePolicy {
                mig_mode: crate::policy::MigMode::Dynamic,
                ..EffectivePolicy::default()
            },
        );
        assert!(
            plan.devices.iter().all(|d| d.gpu_minor == 0),
            "unhealthy GPUs are omitted"
        );
        let retention = retain_allocated(&mut plan, &gpus, &allocated(&["gpu-1-mig-2g20gb-2"]));
        assert_eq!(retention.kept, ["gpu-1-mig-2g20gb-2"]);
        assert_eq!(
            plan.counter_sets
                .iter()
                .map(|(n, _)| n.as_str())
                .collect::<Vec<_>>(),
            ["gpu-0", "gpu-1"]
        );
        let specs = render_valid(&gpus, &plan);
        let rendered = specs
            .iter()
            .flat_map(|s| s.devices.iter().flatten())
            .find(|d| d.name == "gpu-1-mig-2g20gb-2")
            .unwrap();
        let keys: Vec<&str> = rendered.taints.iter().flatten().map(|t| t.key.as_str()).collect();
        assert_eq!(keys, [UNHEALTHY_TAINT, NOT_OFFERED]);
    }

    #[test]
    fn offered_unknown_and_vanished_devices() {
        let gpus = h100s(1);
        let mut plan = plan_pool(
            &gpus,
            &EffectivePolicy {
                mig_mode: crate::policy::MigMode::Dynamic,
                ..EffectivePolicy::default()
            },
        );
        let before = plan.clone();
        let retention = retain_allocated(
            &mut plan,
            &gpus,
            &allocated(&[
                "gpu-0-mig-1g10gb-3", // still offered: nothing to do
                "gpu-7-mig-1g10gb-0", // GPU gone
                "gpu-0-mig-3g40gb-1", // no such placement
                "not-a-device",
            ]),
        );
        assert_eq!(plan, before);
        assert!(retention.kept.is_empty());
        let mut dropped = retention.dropped;
        dropped.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            dropped,
            [
                ("gpu-0-mig-3g40gb-1".to_string(), DropReason::UnknownPlacement),
                ("gpu-7-mig-1g10gb-0".to_string(), DropReason::GpuGone),
                ("not-a-device".to_string(), DropReason::NotOurs),
            ]
        );
    }
}
