//! The MIG-mode rule: what each GPU offers under each [`MigMode`], and that only `Dynamic`
//! ever offers a device whose use needs a mode switch.

use proptest::prelude::*;

use super::{super::*, node_of};
use crate::{
    catalog,
    geometry::Placement,
    inventory::MigInstance,
    policy::{EffectivePolicy, MigMode},
};

fn policy(mig_mode: MigMode) -> EffectivePolicy {
    EffectivePolicy {
        mig_mode,
        ..EffectivePolicy::default()
    }
}

/// (partitions, whole GPU) in the plan of one GPU.
fn kinds(gpu: &GpuInventory, policy: &EffectivePolicy) -> (bool, bool) {
    let plan = plan_pool(std::slice::from_ref(gpu), policy);
    (
        plan.devices
            .iter()
            .any(|d| matches!(d.kind, PlannedKind::Mig { .. })),
        plan.devices.iter().any(|d| d.kind == PlannedKind::Gpu),
    )
}

#[test]
fn each_mode_offers_what_the_table_says() {
    let h100 = catalog::model("H100-80GB").unwrap();
    let on = h100.inventory(0, true);
    let off = h100.inventory(0, false);
    let mut held_off = off.clone();
    held_off.mig.as_mut().unwrap().mode_switchable = false;
    let mut held_on = on.clone();
    held_on.mig.as_mut().unwrap().mode_switchable = false;
    // (mode, gpu, expected (partitions, whole))
    let table = [
        (MigMode::Current, &on, (true, false)),
        (MigMode::Current, &off, (false, true)),
        (MigMode::Mig, &on, (true, false)),
        (MigMode::Mig, &off, (false, false)),
        (MigMode::Whole, &on, (false, false)),
        (MigMode::Whole, &off, (false, true)),
        (MigMode::Dynamic, &on, (true, true)),
        (MigMode::Dynamic, &off, (true, true)),
        // A switch that cannot happen now (a process holds the GPU, or Ampere) is not offered.
        (MigMode::Dynamic, &held_on, (true, false)),
        (MigMode::Dynamic, &held_off, (false, true)),
    ];
    for (mode, gpu, expected) in table {
        let enabled = gpu.mig.as_ref().unwrap().enabled;
        assert_eq!(kinds(gpu, &policy(mode)), expected, "{mode:?}, MIG on: {enabled}");
    }
}

#[test]
fn gpus_without_mig_are_whole_in_every_mode() {
    let mut l4 = catalog::model("H100-80GB").unwrap().inventory(0, false);
    l4.mig = None;
    for mode in [MigMode::Current, MigMode::Mig, MigMode::Whole, MigMode::Dynamic] {
        assert_eq!(kinds(&l4, &policy(mode)), (false, true), "{mode:?}");
        let narrowed = EffectivePolicy {
            whole_gpus: false,
            ..policy(mode)
        };
        assert_eq!(
            kinds(&l4, &narrowed),
            (false, false),
            "{mode:?} without whole GPUs"
        );
    }
}

#[test]
fn the_old_booleans_narrow_every_mode() {
    let h100 = catalog::model("H100-80GB").unwrap();
    for enabled in [true, false] {
        let gpu = h100.inventory(0, enabled);
        for mode in [MigMode::Current, MigMode::Mig, MigMode::Whole, MigMode::Dynamic] {
            let (partitions, whole) = kinds(&gpu, &policy(mode));
            let no_mig = EffectivePolicy {
                mig: false,
                ..policy(mode)
            };
            assert_eq!(kinds(&gpu, &no_mig), (false, whole), "{mode:?} mig: false");
            let no_whole = EffectivePolicy {
                whole_gpus: false,
                ..policy(mode)
            };
            assert_eq!(
                kinds(&gpu, &no_whole),
                (partitions, false),
                "{mode:?} wholeGpus: false"
            );
        }
    }
}

#[test]
fn a_foreign_instance_keeps_dynamic_from_offering_the_whole_gpu() {
    let h100 = catalog::model("H100-80GB").unwrap();
    let mut gpu = h100.inventory(0, true);
    let profile = h100
        .geometry()
        .profile_by_name(&"1g.10gb".parse().unwrap())
        .unwrap()
        .clone();
    gpu.mig.as_mut().unwrap().instances.push(MigInstance {
        profile: Some(profile.name),
        placement: Placement {
            profile_id: profile.gi_profile_id,
            start: 0,
        },
        gpu_instance_id: 9,
        owner: InstanceOwner::Foreign,
        ..MigInstance::default()
    });
    assert_eq!(kinds(&gpu, &policy(MigMode::Dynamic)), (true, false));
}

proptest! {
    /// Outside `Dynamic`, no published device needs the GPU's MIG mode switched: partitions
    /// only on GPUs with MIG on, whole GPUs only on GPUs with MIG off (or without MIG),
    /// whatever the model, modes, switchability and booleans.
    #[test]
    fn only_dynamic_offers_a_device_that_needs_a_switch(
        model in 0..catalog::models().len(),
        modes in proptest::collection::vec((any::<bool>(), any::<bool>(), any::<bool>()), 1..5),
        mode in prop_oneof![Just(MigMode::Current), Just(MigMode::Mig), Just(MigMode::Whole)],
        mig in any::<bool>(),
        whole_gpus in any::<bool>(),
    ) {
        let model = &catalog::models()[model];
        let mut gpus = node_of(model, u32::try_from(modes.len()).unwrap(), false);
        for (gpu, (enabled, switchable, capable)) in gpus.iter_mut().zip(&modes) {
            if *capable {
                let m = gpu.mig.as_mut().unwrap();
                m.enabled = *enabled;
                m.mode_switchable = *switchable;
            } else {
                gpu.mig = None;
            }
        }
        let policy = EffectivePolicy { mig_mode: mode, mig, whole_gpus, ..EffectivePolicy::default() };
        let plan = plan_pool(&gpus, &policy);
        for device in &plan.devices {
            let gpu = gpus.iter().find(|g| g.minor == device.gpu_minor).unwrap();
            let enabled = gpu.mig.as_ref().map(|m| m.enabled);
            match device.kind {
                PlannedKind::Mig { .. } => prop_assert_eq!(enabled, Some(true), "{}", device.name),
                PlannedKind::Gpu => prop_assert_ne!(enabled, Some(true), "{}", device.name),
            }
        }
        // And every GPU offers something unless its mode or the booleans rule it out.
        for gpu in &gpus {
            let offered = plan.devices.iter().any(|d| d.gpu_minor == gpu.minor);
            let expected = match gpu.mig.as_ref().map(|m| m.enabled) {
                None => whole_gpus,
                Some(true) => mig && mode != MigMode::Whole,
                Some(false) => whole_gpus && mode != MigMode::Mig,
            };
            prop_assert_eq!(offered, expected, "GPU {} under {:?}", gpu.minor, mode);
        }
    }
}
