//! The pool validator: one test per API limit, each on the model's own output with one rule
//! broken.

use super::*;

fn valid_pool() -> Vec<ResourceSliceSpec> {
    let model = catalog::model("H100-80GB").unwrap();
    let gpus = node_of(model, 3, true);
    render(&gpus, &plan_pool(&gpus, &EffectivePolicy::default()))
}

fn errors(slices: &[ResourceSliceSpec]) -> Vec<PoolError> {
    validate_pool(slices).expect_err("pool should be invalid")
}

fn first_device(slices: &mut [ResourceSliceSpec]) -> &mut Device {
    slices
        .iter_mut()
        .find_map(|s| s.devices.as_mut().and_then(|d| d.first_mut()))
        .unwrap()
}

#[test]
fn validator_accepts_the_model_output() {
    validate_pool(&valid_pool()).unwrap();
}

#[test]
fn validator_rejects_empty_pool() {
    assert_eq!(errors(&[]), vec![PoolError::Empty]);
}

#[test]
fn validator_rejects_bad_driver_and_pool_names() {
    let mut pool = valid_pool();
    for s in &mut pool {
        s.driver = "Not_A_Domain".into();
    }
    assert!(errors(&pool).contains(&PoolError::DriverName("Not_A_Domain".into())));
    let mut pool = valid_pool();
    for s in &mut pool {
        s.pool.name = format!("{}/x", "a".repeat(260));
    }
    assert!(matches!(errors(&pool)[0], PoolError::PoolName(_)));
}

#[test]
fn validator_rejects_wrong_slice_count_and_mixed_generations() {
    let mut pool = valid_pool();
    pool.pop();
    assert!(
        errors(&pool)
            .iter()
            .any(|e| matches!(e, PoolError::SliceCount { .. }))
    );
    let mut pool = valid_pool();
    pool[1].pool.generation += 1;
    assert!(errors(&pool).contains(&PoolError::Inconsistent {
        slice: 1,
        field: "pool.generation"
    }));
    let mut pool = valid_pool();
    for s in &mut pool {
        s.pool.generation = -1;
    }
    assert!(errors(&pool).contains(&PoolError::Generation(-1)));
}

#[test]
fn validator_rejects_devices_and_counters_in_one_slice() {
    let mut pool = valid_pool();
    let counters = pool[0].shared_counters.clone();
    pool[1].shared_counters = counters;
    assert!(errors(&pool).contains(&PoolError::Mixed { slice: 1 }));
}

#[test]
fn validator_rejects_missing_node_selection() {
    let mut pool = valid_pool();
    pool[1].node_name = None;
    assert!(errors(&pool).contains(&PoolError::NodeSelection { slice: 1 }));
}

#[test]
fn validator_rejects_more_than_64_devices_with_counters() {
    let mut pool = valid_pool();
    let extra: Vec<_> = pool[2].devices.clone().unwrap();
    let devices = pool[1].devices.as_mut().unwrap();
    for (i, mut d) in extra.into_iter().enumerate() {
        d.name = format!("extra-{i}");
        devices.push(d);
    }
    assert!(
        errors(&pool)
            .iter()
            .any(|e| matches!(e, PoolError::TooManyDevices { limit: 64, .. }))
    );
}

#[test]
fn validator_rejects_more_than_8_counter_sets_per_slice() {
    let mut pool = valid_pool();
    let sets = pool[0].shared_counters.as_mut().unwrap();
    let template = sets[0].clone();
    for i in 0..6 {
        sets.push(CounterSet {
            name: format!("extra-{i}"),
            ..template.clone()
        });
    }
    assert!(
        errors(&pool)
            .iter()
            .any(|e| matches!(e, PoolError::TooManyCounterSets { count: 9, .. }))
    );
}

#[test]
fn validator_rejects_more_than_32_counters_per_set() {
    let mut pool = valid_pool();
    let set = &mut pool[0].shared_counters.as_mut().unwrap()[0];
    for i in 0..20 {
        set.counters.insert(
            format!("c-{i}"),
            Counter {
                value: Quantity("1".into()),
            },
        );
    }
    assert!(
        errors(&pool)
            .iter()
            .any(|e| matches!(e, PoolError::CounterSet { reason, .. } if reason.contains("counters")))
    );
}

#[test]
fn validator_rejects_duplicate_counter_sets_and_devices() {
    let mut pool = valid_pool();
    let sets = pool[0].shared_counters.as_mut().unwrap();
    let dup = sets[0].clone();
    sets.push(dup);
    assert!(errors(&pool).contains(&PoolError::DuplicateCounterSet("gpu-0".into())));
    let mut pool = valid_pool();
    let d = pool[1].devices.as_ref().unwrap()[0].clone();
    pool[2].devices.as_mut().unwrap().push(d.clone());
    assert!(errors(&pool).contains(&PoolError::DuplicateDevice(d.name)));
}

#[test]
fn validator_rejects_references_to_missing_counters() {
    let mut pool = valid_pool();
    first_device(&mut pool).consumes_counters.as_mut().unwrap()[0].counter_set = "gpu-99".into();
    assert!(
        errors(&pool)
            .iter()
            .any(|e| matches!(e, PoolError::Device { reason, .. } if reason.contains("gpu-99")))
    );
    let mut pool = valid_pool();
    first_device(&mut pool).consumes_counters.as_mut().unwrap()[0]
        .counters
        .insert(
            "memory-slice-9".into(),
            Counter {
                value: Quantity("1".into()),
            },
        );
    assert!(
        errors(&pool)
            .iter()
            .any(|e| matches!(e, PoolError::Device { reason, .. } if reason.contains("memory-slice-9")))
    );
}

#[test]
fn validator_rejects_consumption_beyond_the_counter() {
    let mut pool = valid_pool();
    first_device(&mut pool).consumes_counters.as_mut().unwrap()[0]
        .counters
        .insert(
            "ofa-engines".into(),
            Counter {
                value: Quantity("2".into()),
            },
        );
    assert!(
        errors(&pool)
            .iter()
            .any(|e| matches!(e, PoolError::Device { reason, .. } if reason.contains("never be allocated")))
    );
}

#[test]
fn validator_rejects_more_than_two_consumptions() {
    let mut pool = valid_pool();
    let device = first_device(&mut pool);
    let entry = device.consumes_counters.as_ref().unwrap()[0].clone();
    let sets = ["gpu-1", "gpu-2"];
    for set in sets {
        device
            .consumes_counters
            .as_mut()
            .unwrap()
            .push(DeviceCounterConsumption {
                counter_set: set.into(),
                ..entry.clone()
            });
    }
    assert!(
        errors(&pool)
            .iter()
            .any(|e| matches!(e, PoolError::Device { reason, .. } if reason.contains("consumptions")))
    );
    let mut pool = valid_pool();
    let device = first_device(&mut pool);
    device.consumes_counters.as_mut().unwrap().push(entry);
    assert!(
        errors(&pool)
            .iter()
            .any(|e| matches!(e, PoolError::Device { reason, .. } if reason.contains("twice")))
    );
}

#[test]
fn validator_rejects_more_than_32_attributes_and_capacities() {
    let mut pool = valid_pool();
    let attrs = first_device(&mut pool).attributes.as_mut().unwrap();
    for i in 0..30 {
        attrs.insert(
            format!("extra{i}"),
            DeviceAttribute {
                int: Some(1),
                ..Default::default()
            },
        );
    }
    assert!(errors(&pool).iter().any(
        |e| matches!(e, PoolError::Device { reason, .. } if reason.contains("attributes and capacities"))
    ));
}

#[test]
fn validator_rejects_bad_attributes() {
    let cases: [(&str, DeviceAttribute, &str); 5] = [
        (
            "bad-name",
            DeviceAttribute {
                int: Some(1),
                ..Default::default()
            },
            "qualified name",
        ),
        (
            "two",
            DeviceAttribute {
                int: Some(1),
                bool: Some(true),
                ..Default::default()
            },
            "exactly one",
        ),
        ("none", DeviceAttribute::default(), "exactly one"),
        (
            "long",
            DeviceAttribute {
                string: Some("x".repeat(65)),
                ..Default::default()
            },
            "longer than",
        ),
        (
            "ver",
            DeviceAttribute {
                version: Some("580.82.07".into()),
                ..Default::default()
            },
            "semantic version",
        ),
    ];
    for (name, value, expected) in cases {
        let mut pool = valid_pool();
        first_device(&mut pool)
            .attributes
            .as_mut()
            .unwrap()
            .insert(name.into(), value);
        assert!(
            errors(&pool)
                .iter()
                .any(|e| matches!(e, PoolError::Device { reason, .. } if reason.contains(expected))),
            "{name}"
        );
    }
}

#[test]
fn validator_rejects_too_many_taints_and_bad_device_names() {
    let mut pool = valid_pool();
    let taint = DeviceTaint {
        key: "k".into(),
        effect: "NoSchedule".into(),
        ..Default::default()
    };
    first_device(&mut pool).taints = Some(vec![taint; 17]);
    assert!(
        errors(&pool)
            .iter()
            .any(|e| matches!(e, PoolError::Device { reason, .. } if reason.contains("taints")))
    );
    let mut pool = valid_pool();
    first_device(&mut pool).name = "GPU_0".into();
    assert!(errors(&pool).contains(&PoolError::DeviceName("GPU_0".into())));
}

proptest! {
    #[test]
    fn any_mix_of_models_modes_and_foreign_instances_renders_a_valid_pool(
        picks in proptest::collection::vec((0usize..9, any::<bool>(), any::<bool>(), 0usize..30), 0..12),
        order in 0usize..3,
    ) {
        let models = catalog::models();
        let gpus: Vec<GpuInventory> = picks.iter().enumerate().map(|(minor, (m, mig, healthy, foreign))| {
            let model = &models[m % models.len()];
            let mut gpu = model.inventory(minor as u32, *mig);
            if !healthy {
                gpu.health = GpuHealth { healthy: false, reason: Some("lost".into()) };
            }
            let geometry = model.geometry();
            let placements: Vec<_> = geometry.all_placements().collect();
            let (profile, start) = placements[foreign % placements.len()];
            if *mig && foreign % 3 == 0 {
                gpu.mig.as_mut().unwrap().instances.push(MigInstance {
                    profile: Some(profile.name),
                    placement: Placement { profile_id: profile.gi_profile_id, start },
                    gpu_instance_id: 1,
                    owner: InstanceOwner::Foreign,
                    ..MigInstance::default()
                });
            }
            gpu
        }).collect();
        let policy = EffectivePolicy {
            device_order: [DeviceOrder::Packed, DeviceOrder::Naive, DeviceOrder::Spread][order],
            unhealthy_gpus: if order == 1 { crate::policy::UnhealthyGpus::Taint } else { crate::policy::UnhealthyGpus::Omit },
            ..Default::default()
        };
        let plan = plan_pool(&gpus, &policy);
        let slices = render(&gpus, &plan);
        prop_assert!(validate_pool(&slices).is_ok(), "{:?}", validate_pool(&slices));
        prop_assert_eq!(slices.len(), plan.slice_count());
    }
}
