//! The check of the engine counters against NVML's placement rules, and the fallback counters.

use super::*;
use crate::{
    geometry::MigGeometry,
    slices::counter_model::{
        engine_counter_conflicts, engine_counters_overruled, maximal_layouts, nvml_admits,
    },
};

/// Every MIG device set NVML's own rules allow (no engine or memory budget).
fn nvml_valid_sets(plan: &PoolPlan, geometry: &MigGeometry) -> BTreeSet<Vec<usize>> {
    admitted_sets(plan, &|layout, p| nvml_admits(geometry, layout, p))
}

/// An A100-80GB as drivers that report 2g/3g/4g decoders 2/3/4 describe it: 4g + 3g then
/// needs 7 decoders of the 7g's 5.
fn over_adding_a100() -> GpuInventory {
    let mut gpu = catalog::model("A100-80GB").unwrap().inventory(0, true);
    let mig = gpu.mig.as_mut().unwrap();
    let mut profiles = mig.geometry.profiles.clone();
    for p in &mut profiles {
        match p.compute_slices {
            2 => p.engines.decoders = 2,
            3 => p.engines.decoders = 3,
            4 => p.engines.decoders = 4,
            _ => {}
        }
    }
    mig.geometry = MigGeometry::new(profiles, gpu.memory_mib);
    mig.engine_counters_overruled = engine_counters_overruled(&mig.geometry);
    gpu
}

fn names(model: &GpuModel, layout: &[Placement]) -> BTreeSet<String> {
    layout
        .iter()
        .map(|p| {
            let profile = model.geometry().profile_by_id(p.profile_id).unwrap().name;
            format!("{profile}@{}", p.start)
        })
        .collect()
}

#[test]
fn catalog_counters_accept_every_layout_nvml_allows() {
    for model in catalog::models() {
        let geometry = model.geometry();
        assert_eq!(engine_counter_conflicts(&geometry), [], "{}", model.key);
        assert_eq!(
            model.inventory(0, true).mig.unwrap().engine_counters_overruled,
            None
        );
        let layouts = maximal_layouts(&geometry);
        assert!(
            layouts.len() > 3,
            "{}: {} maximal layouts",
            model.key,
            layouts.len()
        );
        for layout in &layouts {
            // Maximal: nothing more fits; and each instance was admissible in turn.
            for (p, start) in geometry.all_placements() {
                let more = Placement {
                    profile_id: p.gi_profile_id,
                    start,
                };
                assert!(
                    !nvml_admits(&geometry, layout, more),
                    "{}: {layout:?} + {more:?}",
                    model.key
                );
            }
            for (i, p) in layout.iter().enumerate() {
                assert!(
                    nvml_admits(&geometry, &layout[..i], *p),
                    "{}: {layout:?}",
                    model.key
                );
            }
        }
    }
}

#[test]
fn maximal_layouts_include_the_zero_waste_ones() {
    let h100 = catalog::model("H100-80GB").unwrap();
    let layouts: Vec<BTreeSet<String>> = maximal_layouts(&h100.geometry())
        .iter()
        .map(|l| names(h100, l))
        .collect();
    let set = |items: &[&str]| items.iter().map(ToString::to_string).collect::<BTreeSet<_>>();
    for expected in [
        set(&["7g.80gb@0"]),
        set(&["4g.40gb@0", "3g.40gb@4"]),
        set(&["1g.10gb@0", "1g.10gb@1", "2g.20gb@2", "3g.40gb@4"]),
        set(&[
            "1g.10gb+me@0",
            "1g.10gb@1",
            "1g.10gb@2",
            "1g.10gb@3",
            "1g.10gb@4",
            "1g.10gb@5",
            "1g.10gb@6",
        ]),
    ] {
        assert!(layouts.contains(&expected), "{expected:?} missing");
    }
    // A second +me instance is never part of a layout (one optical-flow engine).
    assert!(
        layouts
            .iter()
            .all(|l| l.iter().filter(|n| n.contains("+me")).count() <= 1)
    );
    // Not maximal: 4g alone leaves room for a 3g.
    assert!(!layouts.contains(&set(&["4g.40gb@0"])));
}

#[test]
fn over_adding_engine_counts_are_found() {
    let gpu = over_adding_a100();
    let geometry = &gpu.mig.as_ref().unwrap().geometry;
    let conflicts = engine_counter_conflicts(geometry);
    let counters: Vec<&str> = conflicts.iter().map(|c| c.counter).collect();
    assert_eq!(counters, ["decoders"]);
    assert!(conflicts[0].used > conflicts[0].budget);
    let why = gpu
        .mig
        .as_ref()
        .unwrap()
        .engine_counters_overruled
        .clone()
        .unwrap();
    assert!(why.contains("decoders counter (5 on the GPU)"), "{why}");
}

#[test]
fn overruled_counters_accept_exactly_the_layouts_nvml_allows() {
    let gpu = over_adding_a100();
    let geometry = gpu.mig.as_ref().unwrap().geometry.clone();
    let policy = EffectivePolicy {
        whole_gpus: false,
        ..Default::default()
    };
    let plan = plan_pool(std::slice::from_ref(&gpu), &policy);
    let (_, counters) = &plan.counter_sets[0];
    assert!(counters.contains_key("profile-20-instances"), "{counters:?}");
    assert!(!counters.contains_key("decoders") && !counters.contains_key(MEMORY_COUNTER));
    assert_eq!(counter_feasible_sets(&plan), nvml_valid_sets(&plan, &geometry));
    // Pruned as published, still the same layouts.
    let (published, _) = published_plan(std::slice::from_ref(&gpu), &policy, &BTreeSet::new());
    assert_eq!(
        counter_feasible_sets(&published),
        nvml_valid_sets(&published, &geometry)
    );

    // With the reported counts taken as budgets, 4g + 3g would be refused.
    let mut trusting = gpu.clone();
    trusting.mig.as_mut().unwrap().engine_counters_overruled = None;
    let plan = plan_pool(&[trusting], &policy);
    let index = |name: &str| {
        plan.devices
            .iter()
            .position(|d| d.name.to_string() == name)
            .unwrap()
    };
    let mut alloc = Allocator::new(&plan);
    assert!(alloc.take(index("gpu-0-mig-4g40gb-0")));
    assert!(!alloc.fits(index("gpu-0-mig-3g40gb-4")));
}

#[test]
fn foreign_instances_use_up_instance_counters() {
    let mut gpu = over_adding_a100();
    let mig = gpu.mig.as_mut().unwrap();
    mig.instances.push(MigInstance {
        placement: Placement {
            profile_id: 20,
            start: 3,
        },
        ..MigInstance::default()
    });
    let plan = plan_pool(
        &[gpu],
        &EffectivePolicy {
            whole_gpus: false,
            ..Default::default()
        },
    );
    let (_, counters) = &plan.counter_sets[0];
    assert_eq!(counters["profile-20-instances"], 0);
    assert_eq!(counters["profile-19-instances"], 7);
    assert_eq!(counters["memory-slice-3"], 0);
    // No +me device fits any more.
    assert!(!plan.devices.iter().any(|d| d.name.to_string().contains("me")));
}
