use std::collections::BTreeSet;

use k8s_openapi::{
    api::resource::v1::{Counter, CounterSet, DeviceAttribute, DeviceCounterConsumption, DeviceTaint},
    apimachinery::pkg::api::resource::Quantity,
};
use proptest::prelude::*;

use super::{
    allocator::Allocator,
    validate::{PoolError, validate_pool},
    *,
};
use crate::{
    catalog::{self, GpuModel},
    geometry::Placement,
    inventory::{GpuHealth, MigInstance},
    policy::DeviceOrder,
};

mod counter_model;
mod mig_mode;
mod sharing;
mod validate;

const DRIVER: &str = "gpu.migdra.dev";

/// The default policy, switching MIG modes: what most tests of the slice model exercise,
/// because it offers every device kind a GPU can have.
fn dynamic() -> EffectivePolicy {
    EffectivePolicy {
        mig_mode: MigMode::Dynamic,
        ..EffectivePolicy::default()
    }
}

fn node_of(model: &GpuModel, gpus: u32, mig_enabled: bool) -> Vec<GpuInventory> {
    (0..gpus).map(|m| model.inventory(m, mig_enabled)).collect()
}

fn render(gpus: &[GpuInventory], plan: &PoolPlan) -> Vec<ResourceSliceSpec> {
    let id = PoolIdentity {
        driver: DRIVER,
        node: "node-a",
        pool: "node-a/gpu.migdra.dev",
        generation: 3,
        driver_version: Some("580.82.07"),
    };
    render_pool(&id, gpus, plan)
}

fn mig_placement(d: &PlannedDevice) -> Option<Placement> {
    match &d.kind {
        PlannedKind::Mig { profile, start } => Some(Placement {
            profile_id: profile.gi_profile_id,
            start: *start,
        }),
        PlannedKind::Gpu => None,
    }
}

/// Every device set the counters accept, found by depth-first search over the pool.
fn counter_feasible_sets(plan: &PoolPlan) -> BTreeSet<Vec<usize>> {
    fn dfs(
        plan: &PoolPlan,
        alloc: &mut Allocator<'_>,
        from: usize,
        current: &mut Vec<usize>,
        out: &mut BTreeSet<Vec<usize>>,
    ) {
        out.insert(current.clone());
        for i in from..plan.devices.len() {
            if alloc.fits(i) {
                let mut next = alloc.clone();
                next.take(i);
                current.push(i);
                dfs(plan, &mut next, i + 1, current, out);
                current.pop();
            }
        }
    }
    let mut out = BTreeSet::new();
    dfs(plan, &mut Allocator::new(plan), 0, &mut Vec::new(), &mut out);
    out
}

/// Every MIG device set of the pool whose placements `admits` lets join one by one, by
/// depth-first search.
fn admitted_sets(plan: &PoolPlan, admits: &dyn Fn(&[Placement], Placement) -> bool) -> BTreeSet<Vec<usize>> {
    fn dfs(
        plan: &PoolPlan,
        admits: &dyn Fn(&[Placement], Placement) -> bool,
        from: usize,
        current: &mut Vec<usize>,
        out: &mut BTreeSet<Vec<usize>>,
    ) {
        out.insert(current.clone());
        let layout: Vec<Placement> = current
            .iter()
            .filter_map(|i| mig_placement(&plan.devices[*i]))
            .collect();
        for i in from..plan.devices.len() {
            let Some(p) = mig_placement(&plan.devices[i]) else {
                continue;
            };
            if admits(&layout, p) {
                current.push(i);
                dfs(plan, admits, i + 1, current, out);
                current.pop();
            }
        }
    }
    let mut out = BTreeSet::new();
    dfs(plan, admits, 0, &mut Vec::new(), &mut out);
    out
}

/// Every MIG device set that is physically valid (the geometry's rules, budgets included).
fn physically_valid_sets(plan: &PoolPlan, geometry: &crate::geometry::MigGeometry) -> BTreeSet<Vec<usize>> {
    admitted_sets(plan, &|layout, p| geometry.check_add(layout, p).is_ok())
}

#[test]
fn counters_accept_exactly_the_physically_valid_layouts_on_every_model() {
    for model in catalog::models() {
        let gpus = node_of(model, 1, true);
        let policy = EffectivePolicy {
            whole_gpus: false,
            ..Default::default()
        };
        let plan = plan_pool(&gpus, &policy);
        let geometry = model.geometry();
        let by_counters = counter_feasible_sets(&plan);
        let physical = physically_valid_sets(&plan, &geometry);
        // Soundness: nothing the scheduler could co-allocate overlaps or exceeds NVML's limits.
        let names = |set: &Vec<usize>| -> Vec<String> {
            set.iter().map(|i| plan.devices[*i].name.to_string()).collect()
        };
        if let Some(set) = by_counters.difference(&physical).next() {
            panic!(
                "{}: counters accept {:?}, which NVML would refuse",
                model.key,
                names(set)
            );
        }
        // Completeness: every layout NVML accepts is reachable through the counters.
        if let Some(set) = physical.difference(&by_counters).next() {
            panic!(
                "{}: NVML accepts {:?}, but the counters refuse it",
                model.key,
                names(set)
            );
        }
        assert!(
            by_counters.len() > 10,
            "{}: only {} layouts",
            model.key,
            by_counters.len()
        );
    }
}

#[test]
fn whole_gpu_and_partitions_exclude_each_other() {
    for model in catalog::models()
        .iter()
        .filter(|m| m.architecture.mig_mode_switchable())
    {
        let gpus = node_of(model, 1, false);
        let plan = plan_pool(&gpus, &dynamic());
        let whole = plan
            .devices
            .iter()
            .position(|d| d.kind == PlannedKind::Gpu)
            .expect("whole GPU device");
        for i in (0..plan.devices.len()).filter(|i| *i != whole) {
            let mut alloc = Allocator::new(&plan);
            assert!(alloc.take(i));
            assert!(
                !alloc.fits(whole),
                "{}: whole GPU fits next to {}",
                model.key,
                plan.devices[i].name
            );
            let mut alloc = Allocator::new(&plan);
            assert!(alloc.take(whole));
            assert!(
                !alloc.fits(i),
                "{}: {} fits next to the whole GPU",
                model.key,
                plan.devices[i].name
            );
        }
    }
}

#[test]
fn eight_gpu_nodes_render_valid_minimal_pools() {
    for model in catalog::models() {
        let gpus = node_of(model, 8, true);
        let plan = plan_pool(&gpus, &dynamic());
        let slices = render(&gpus, &plan);
        validate_pool(&slices).unwrap_or_else(|e| panic!("{}: {e:?}", model.key));
        let per_gpu: usize = model.profiles.iter().map(|p| p.placements.len()).sum::<usize>()
            + usize::from(model.architecture.mig_mode_switchable());
        assert_eq!(plan.devices.len(), 8 * per_gpu, "{}", model.key);
        assert_eq!(plan.counter_sets.len(), 8);
        // Minimal: one counter slice for 8 sets, device slices packed to the 64-device limit.
        assert_eq!(
            slices.len(),
            1 + (8 * per_gpu).div_ceil(MAX_DEVICES_PER_SLICE),
            "{}",
            model.key
        );
        assert!(slices[0].shared_counters.is_some() && slices[0].devices.is_none());
        assert!(slices[1..].iter().all(|s| s.shared_counters.is_none()));
    }
}

#[test]
fn more_than_eight_gpus_get_more_counter_slices() {
    let model = catalog::model("H100-80GB").unwrap();
    let gpus = node_of(model, 17, true);
    let plan = plan_pool(&gpus, &dynamic());
    let slices = render(&gpus, &plan);
    validate_pool(&slices).unwrap();
    assert_eq!(plan.counter_slices(), 3);
}

#[test]
fn devices_carry_the_documented_attributes() {
    let model = catalog::model("H100-80GB").unwrap();
    let gpus = node_of(model, 1, true);
    let plan = plan_pool(&gpus, &dynamic());
    let slices = render(&gpus, &plan);
    let devices: Vec<_> = slices.iter().flat_map(|s| s.devices.iter().flatten()).collect();
    let mig = devices
        .iter()
        .find(|d| d.name == "gpu-0-mig-3g40gb-4")
        .expect("3g.40gb@4");
    let attrs = mig.attributes.as_ref().unwrap();
    let s = |k: &str| attrs.get(k).and_then(|a| a.string.clone());
    let i = |k: &str| attrs.get(k).and_then(|a| a.int);
    assert_eq!(s("type").as_deref(), Some("mig"));
    assert_eq!(s("profile").as_deref(), Some("3g.40gb"));
    assert_eq!(s("parentUUID"), Some(model.uuid(0)));
    assert_eq!(s("productName").as_deref(), Some("NVIDIA H100 80GB HBM3"));
    assert_eq!(i("placementStart"), Some(4));
    assert_eq!(i("memorySlices"), Some(4));
    assert_eq!(attrs["cudaComputeCapability"].version.as_deref(), Some("9.0.0"));
    assert_eq!(attrs["driverVersion"].version.as_deref(), Some("580.82.7"));
    assert!(s("pciBusID").is_some());
    assert_eq!(i("numaNode"), Some(0));
    let cap = mig.capacity.as_ref().unwrap();
    assert_eq!(cap["memory"].value.0, "40448Mi");
    assert_eq!(cap["multiprocessors"].value.0, "60");
    let consumption = &mig.consumes_counters.as_ref().unwrap()[0];
    assert_eq!(consumption.counter_set, "gpu-0");
    let slices_used: Vec<_> = consumption
        .counters
        .keys()
        .filter(|k| k.starts_with("memory-slice-"))
        .collect();
    assert_eq!(
        slices_used,
        [
            "memory-slice-4",
            "memory-slice-5",
            "memory-slice-6",
            "memory-slice-7"
        ]
    );
    let whole = devices.iter().find(|d| d.name == "gpu-0").unwrap();
    assert_eq!(
        whole.attributes.as_ref().unwrap()["type"].string.as_deref(),
        Some("gpu")
    );
    assert!(
        whole
            .attributes
            .as_ref()
            .unwrap()
            .contains_key("resource.kubernetes.io/pciBusID")
    );
}

#[test]
fn mig_mode_decides_what_ampere_offers() {
    let a100 = catalog::model("A100-SXM4-40GB").unwrap();
    let on = plan_pool(&node_of(a100, 1, true), &dynamic());
    assert!(
        on.devices
            .iter()
            .all(|d| matches!(d.kind, PlannedKind::Mig { .. })),
        "no whole GPU while MIG is on"
    );
    let off = plan_pool(&node_of(a100, 1, false), &dynamic());
    assert_eq!(off.devices.len(), 1);
    assert_eq!(off.devices[0].kind, PlannedKind::Gpu);
    assert!(off.counter_sets.is_empty(), "a lone whole GPU needs no counters");
    let h100 = catalog::model("H100-80GB").unwrap();
    let hopper = plan_pool(&node_of(h100, 1, false), &dynamic());
    assert!(hopper.devices.iter().any(|d| d.kind == PlannedKind::Gpu));
    assert!(
        hopper
            .devices
            .iter()
            .any(|d| matches!(d.kind, PlannedKind::Mig { .. }))
    );
}

#[test]
fn non_mig_gpus_publish_whole_devices_without_counters() {
    let mut gpu = catalog::model("H100-80GB").unwrap().inventory(0, false);
    gpu.mig = None;
    let plan = plan_pool(std::slice::from_ref(&gpu), &dynamic());
    let slices = render(std::slice::from_ref(&gpu), &plan);
    validate_pool(&slices).unwrap();
    assert_eq!(slices.len(), 1);
    assert_eq!(slices[0].devices.as_ref().unwrap().len(), 1);
    assert!(slices[0].devices.as_ref().unwrap()[0].consumes_counters.is_none());
}

#[test]
fn foreign_instances_remove_their_placements_and_budget() {
    let model = catalog::model("H100-80GB").unwrap();
    let mut gpu = model.inventory(0, true);
    let geometry = model.geometry();
    let me = geometry.profile_by_name(&"1g.10gb+me".parse().unwrap()).unwrap();
    gpu.mig.as_mut().unwrap().instances.push(MigInstance {
        profile: Some(me.name),
        placement: Placement {
            profile_id: me.gi_profile_id,
            start: 6,
        },
        gpu_instance_id: 13,
        owner: InstanceOwner::Foreign,
        ..MigInstance::default()
    });
    let plan = plan_pool(std::slice::from_ref(&gpu), &dynamic());
    let names: Vec<String> = plan.devices.iter().map(|d| d.name.to_string()).collect();
    assert!(
        !names.iter().any(|n| n == "gpu-0"),
        "no whole GPU while a foreign instance exists"
    );
    assert!(
        !names
            .iter()
            .any(|n| n.ends_with("-6") || n == "gpu-0-mig-3g40gb-4" || n == "gpu-0-mig-7g80gb-0")
    );
    assert!(
        !names.iter().any(|n| n.contains("-me-")),
        "the only OFA engine is taken: no +me device"
    );
    assert!(names.iter().any(|n| n == "gpu-0-mig-4g40gb-0"));
    assert_eq!(plan.counter_sets[0].1["memory-slice-6"], 0);
    validate_pool(&render(std::slice::from_ref(&gpu), &plan)).unwrap();
    // A migdra-owned instance is the scheduler's own allocation: it changes nothing here.
    gpu.mig.as_mut().unwrap().instances[0].owner = InstanceOwner::Migdra;
    let plan = plan_pool(std::slice::from_ref(&gpu), &dynamic());
    assert!(plan.devices.iter().any(|d| d.name.to_string() == "gpu-0"));
}

#[test]
fn unhealthy_gpus_are_omitted_or_tainted() {
    let model = catalog::model("H100-80GB").unwrap();
    let mut gpus = node_of(model, 2, true);
    gpus[1].health = GpuHealth {
        healthy: false,
        reason: Some("GPU is lost".into()),
    };
    let omitted = plan_pool(&gpus, &dynamic());
    assert!(omitted.devices.iter().all(|d| d.gpu_minor == 0));
    let policy = EffectivePolicy {
        unhealthy_gpus: crate::policy::UnhealthyGpus::Taint,
        ..Default::default()
    };
    let tainted = plan_pool(&gpus, &policy);
    let slices = render(&gpus, &tainted);
    validate_pool(&slices).unwrap();
    let devices: Vec<_> = slices.iter().flat_map(|s| s.devices.iter().flatten()).collect();
    assert!(
        devices
            .iter()
            .filter(|d| d.name.starts_with("gpu-1"))
            .all(|d| d.taints.as_ref().is_some_and(|t| t[0].key == UNHEALTHY_TAINT))
    );
    assert!(
        devices
            .iter()
            .filter(|d| d.name.starts_with("gpu-0"))
            .all(|d| d.taints.is_none())
    );
}

#[test]
fn policy_profile_lists_filter_devices() {
    let model = catalog::model("A100-SXM4-40GB").unwrap();
    let gpus = node_of(model, 1, true);
    let policy = crate::policy::MigPolicy::new(
        "p",
        crate::policy::MigPolicySpec {
            profiles: vec!["1g".into(), "3g.20gb".into()],
            exclude_profiles: vec!["1g+me".into()],
            ..Default::default()
        },
    )
    .effective(crate::policy::MigMode::default())
    .unwrap();
    let plan = plan_pool(&gpus, &policy);
    let profiles: BTreeSet<String> = plan
        .devices
        .iter()
        .filter_map(|d| match &d.kind {
            PlannedKind::Mig { profile, .. } => Some(profile.name.to_string()),
            PlannedKind::Gpu => None,
        })
        .collect();
    assert_eq!(
        profiles,
        BTreeSet::from(["1g.5gb".to_string(), "1g.10gb".to_string(), "3g.20gb".to_string()])
    );
}

#[test]
fn empty_inventory_still_publishes_one_slice() {
    let plan = plan_pool(&[], &dynamic());
    let slices = render(&[], &plan);
    assert_eq!(slices.len(), 1);
    validate_pool(&slices).unwrap();
}

#[test]
fn packed_order_uses_the_dead_slice_first_and_fills_upwards() {
    let model = catalog::model("H100-80GB").unwrap();
    let plan = plan_pool(&node_of(model, 1, true), &dynamic());
    let names: Vec<String> = plan.devices.iter().map(|d| d.name.to_string()).collect();
    let of = |prefix: &str| -> Vec<&str> {
        names
            .iter()
            .map(String::as_str)
            .filter(|n| n.starts_with(prefix))
            .collect()
    };
    // 1g cannot use slice 7: fill from slice 0 up, so pairs fill before new ones are broken.
    assert_eq!(
        of("gpu-0-mig-1g10gb-")[..3],
        ["gpu-0-mig-1g10gb-0", "gpu-0-mig-1g10gb-1", "gpu-0-mig-1g10gb-2"]
    );
    // Placements that use slice 7 go first: it is stranded otherwise.
    assert_eq!(of("gpu-0-mig-1g20gb-")[0], "gpu-0-mig-1g20gb-6");
    assert_eq!(
        of("gpu-0-mig-3g40gb-")[0],
        "gpu-0-mig-3g40gb-4",
        "3g@4 also keeps 4g@0 possible"
    );
    // Smaller profiles before larger ones, the whole GPU last.
    let pos = |n: &str| names.iter().position(|x| x == n).unwrap();
    assert!(pos("gpu-0-mig-1g10gb-6") < pos("gpu-0-mig-2g20gb-0"));
    assert!(pos("gpu-0-mig-2g20gb-4") < pos("gpu-0-mig-3g40gb-4"));
    assert_eq!(names.last().unwrap(), "gpu-0");
    assert_eq!(order::dead_slices(&model.geometry()), vec![7]);
    assert!(order::dead_slices(&catalog::model("A30-24GB").unwrap().geometry()).is_empty());
}
