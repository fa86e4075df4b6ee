use migdra_api::{catalog, config::DeviceConfig};

use super::*;
use crate::{checkpoint::ClaimState, nvml::NvmlErrorKind};

const POOL: &str = "node/gpu.migdra.dev";
// Real GPU-instance profile IDs of the 8-slice parts.
const P_1G: u32 = 19;
const P_3G: u32 = 9;

use crate::nvml::catalog_gpu as gpu;

fn instance(id: u32, profile_id: u32, start: u32, size: u32) -> GpuInstanceRecord {
    GpuInstanceRecord {
        id,
        profile_id,
        start,
        size,
        compute_instances: Vec::new(),
    }
}

fn view(description: GpuDescription, instances: Vec<GpuInstanceRecord>) -> GpuView {
    GpuView {
        description,
        instances: Ok(instances),
    }
}

fn gpus(views: Vec<GpuView>) -> BTreeMap<u32, GpuView> {
    views.into_iter().map(|v| (v.description.minor, v)).collect()
}

fn allocated(names: &[&str]) -> Vec<AllocatedDevice> {
    names
        .iter()
        .enumerate()
        .map(|(i, name)| AllocatedDevice {
            request: format!("r{i}"),
            pool: POOL.into(),
            device: name.to_string(),
            name: name.parse().unwrap(),
            config: DeviceConfig::default(),
            share_id: None,
            admin_access: false,
        })
        .collect()
}

/// `allocated`, each device a share (share IDs `share-<i>`).
fn shares(names: &[&str]) -> Vec<AllocatedDevice> {
    let mut devices = allocated(names);
    for (i, d) in devices.iter_mut().enumerate() {
        d.share_id = Some(format!("share-{i}"));
    }
    devices
}

/// A claim holding a share of `device` (1g.10gb at `start` on GPU 0 of an H100), in
/// `state`, with instance IDs when `created`.
fn holder(uid: &str, state: ClaimState, start: u32, created: bool) -> (String, ClaimRecord) {
    let device = format!("gpu-0-mig-1g10gb-{start}");
    let (_, mut record) = other_mig(P_1G, start, 1, &device);
    record.name = uid.into();
    record.state = state;
    let d = &mut record.devices[0];
    d.share_id = Some(format!("share-of-{uid}"));
    d.gpu_uuid = catalog::model("H100-80GB").unwrap().uuid(0);
    if let DeviceKind::Mig {
        gpu_instance,
        compute_instance,
        mig_uuid,
        ..
    } = &mut d.kind
    {
        *gpu_instance = created.then_some(7);
        *compute_instance = created.then_some(0);
        *mig_uuid = created.then(|| "MIG-shared".to_string());
    }
    (uid.into(), record)
}

#[test]
fn a_share_joins_the_instance_of_a_prepared_holder_and_only_the_first_creates() {
    let device = "gpu-0-mig-1g10gb-6";
    let mig_on = || view(gpu(0, "H100-80GB", Some(true)), vec![instance(7, P_1G, 6, 1)]);
    // First share: planned like an exclusive device, remembered as a share.
    let first = plan(&shares(&[device]), &gpus(vec![h100(Some(true))]), &[]).unwrap();
    assert_eq!(first.devices[0].kind, mig(P_1G, 6, 1));
    assert_eq!(first.devices[0].share_id.as_deref(), Some("share-0"));
    // Second share: the holder's instance, nothing to create.
    let others = [holder("a", ClaimState::PrepareCompleted, 6, true)];
    let joined = plan(&shares(&[device]), &gpus(vec![mig_on()]), &others).unwrap();
    assert_eq!(joined.devices[0].kind, others[0].1.devices[0].kind);
    assert!(joined.mig_mode_changes.is_empty());
    // A half-prepared or half-unprepared holder alone cannot be joined.
    for state in [ClaimState::PrepareStarted, ClaimState::UnprepareStarted] {
        let others = [holder("a", state, 6, true)];
        assert!(
            matches!(
                plan(&shares(&[device]), &gpus(vec![mig_on()]), &others),
                Err(PlanError::Rejected(Rejection::SharedInstanceUnsettled { .. }))
            ),
            "{state:?}"
        );
    }
    // ...but next to a prepared one it does not matter.
    let others = [
        holder("a", ClaimState::UnprepareStarted, 6, true),
        holder("b", ClaimState::PrepareCompleted, 6, true),
    ];
    assert!(plan(&shares(&[device]), &gpus(vec![mig_on()]), &others).is_ok());
    // The holders' instance vanished from the GPU.
    let others = [holder("a", ClaimState::PrepareCompleted, 6, true)];
    assert!(matches!(
        plan(&shares(&[device]), &gpus(vec![h100(Some(true))]), &others),
        Err(PlanError::Rejected(Rejection::SharedInstanceMissing {
            gpu_instance: 7,
            ..
        }))
    ));
    // An exclusive allocation of a shared device, or a share next to an exclusive holder of
    // an overlapping placement, is a clash, as between exclusive devices.
    assert!(matches!(
        plan(&allocated(&[device]), &gpus(vec![mig_on()]), &others),
        Err(PlanError::Rejected(Rejection::InUseByClaim { .. }))
    ));
    let exclusive = [other_mig(P_3G, 4, 4, "gpu-0-mig-3g40gb-4")];
    assert!(matches!(
        plan(&shares(&[device]), &gpus(vec![h100(Some(true))]), &exclusive),
        Err(PlanError::Rejected(Rejection::InUseByClaim { .. }))
    ));
    // A share of another placement of the same profile is another instance.
    let elsewhere = plan(&shares(&["gpu-0-mig-1g10gb-5"]), &gpus(vec![mig_on()]), &others).unwrap();
    assert_eq!(elsewhere.devices[0].kind, mig(P_1G, 5, 1));
    // One claim, the same shared device twice.
    assert!(matches!(
        plan(&shares(&[device, device]), &gpus(vec![h100(Some(true))]), &[]),
        Err(PlanError::Rejected(Rejection::DuplicateShare { .. }))
    ));
}

/// Devices allocated with (`true`) or without admin access.
fn with_admin(names: &[(&str, bool)]) -> Vec<AllocatedDevice> {
    let plain: Vec<&str> = names.iter().map(|(n, _)| *n).collect();
    allocated(&plain)
        .into_iter()
        .zip(names)
        .map(|(d, (_, admin))| AllocatedDevice {
            admin_access: *admin,
            ..d
        })
        .collect()
}

#[test]
fn admin_access_is_whole_gpus_only_and_never_mixed() {
    // (what, devices, expected: Ok(is admin) or the rejection's reason)
    type Case<'a> = (&'a str, &'a [(&'a str, bool)], Result<bool, &'a str>);
    let cases: &[Case] = &[
        (
            "no admin access",
            &[("gpu-0", false), ("gpu-1-mig-1g10gb-0", false)],
            Ok(false),
        ),
        (
            "two whole GPUs with admin access",
            &[("gpu-0", true), ("gpu-1", true)],
            Ok(true),
        ),
        (
            "a MIG device with admin access",
            &[("gpu-0-mig-1g10gb-0", true)],
            Err("AdminAccessMigDevice"),
        ),
        (
            "a MIG device with admin access next to a whole GPU with it",
            &[("gpu-0", true), ("gpu-1-mig-3g40gb-4", true)],
            Err("AdminAccessMigDevice"),
        ),
        (
            "admin and ordinary",
            &[("gpu-0", true), ("gpu-1", false)],
            Err("AdminAccessMixed"),
        ),
        ("nothing", &[], Ok(false)),
    ];
    for (what, names, expected) in cases {
        let got = admin_access(&with_admin(names)).map_err(|r| r.reason());
        assert_eq!(got, *expected, "{what}");
    }
    let Err(rejection) = admin_access(&with_admin(&[("gpu-0-mig-1g10gb-0", true)])) else {
        panic!("expected a rejection")
    };
    assert!(
        rejection
            .to_string()
            .starts_with("device gpu-0-mig-1g10gb-0: adminAccess is only supported for whole GPUs"),
        "{rejection}"
    );
}

/// Another claim, prepared, holding MIG `profile_id` at `start` (size `size`) on GPU 0.
fn other_mig(profile_id: u32, start: u32, size: u32, device: &str) -> (String, ClaimRecord) {
    other(
        DeviceKind::Mig {
            profile_id,
            start,
            size,
            gpu_instance: Some(1),
            compute_instance: Some(0),
            mig_uuid: Some("MIG-x".into()),
        },
        device,
    )
}

fn other(kind: DeviceKind, device: &str) -> (String, ClaimRecord) {
    (
        "uid-other".into(),
        ClaimRecord {
            namespace: "ns".into(),
            name: "other".into(),
            state: ClaimState::PrepareCompleted,
            devices: vec![DeviceRecord {
                request: "gpu".into(),
                pool: POOL.into(),
                device: device.into(),
                gpu_uuid: "GPU-0".into(),
                gpu_minor: 0,
                kind,
                env: BTreeMap::new(),
                share_id: None,
            }],
        },
    )
}

fn h100(mig: Option<bool>) -> GpuView {
    view(gpu(0, "H100-80GB", mig), Vec::new())
}

fn mig(profile_id: u32, start: u32, size: u32) -> DeviceKind {
    DeviceKind::Mig {
        profile_id,
        start,
        size,
        gpu_instance: None,
        compute_instance: None,
        mig_uuid: None,
    }
}

#[test]
fn accepted_plans() {
    struct Case {
        what: &'static str,
        gpus: Vec<GpuView>,
        others: Vec<(String, ClaimRecord)>,
        devices: &'static [&'static str],
        kinds: Vec<DeviceKind>,
        mode_changes: Vec<(u32, bool)>,
    }
    let cases = vec![
        Case {
            what: "a partition on a GPU in MIG mode",
            gpus: vec![h100(Some(true))],
            others: vec![],
            devices: &["gpu-0-mig-3g40gb-4"],
            kinds: vec![mig(P_3G, 4, 4)],
            mode_changes: vec![],
        },
        Case {
            what: "a partition on a switchable GPU with MIG off switches it on",
            gpus: vec![h100(Some(false))],
            others: vec![],
            devices: &["gpu-0-mig-3g40gb-0"],
            kinds: vec![mig(P_3G, 0, 4)],
            mode_changes: vec![(0, true)],
        },
        Case {
            what: "a whole GPU with MIG off",
            gpus: vec![h100(Some(false))],
            others: vec![],
            devices: &["gpu-0"],
            kinds: vec![DeviceKind::Gpu],
            mode_changes: vec![],
        },
        Case {
            what: "a whole, empty, switchable GPU in MIG mode switches it off",
            gpus: vec![h100(Some(true))],
            others: vec![],
            devices: &["gpu-0"],
            kinds: vec![DeviceKind::Gpu],
            mode_changes: vec![(0, false)],
        },
        Case {
            what: "a whole GPU that is not MIG-capable",
            gpus: vec![h100(None)],
            others: vec![],
            devices: &["gpu-0"],
            kinds: vec![DeviceKind::Gpu],
            mode_changes: vec![],
        },
        Case {
            what: "two partitions side by side, next to another claim's instance",
            gpus: vec![view(
                gpu(0, "H100-80GB", Some(true)),
                vec![instance(1, P_1G, 6, 1)],
            )],
            others: vec![other_mig(P_1G, 6, 1, "gpu-0-mig-1g10gb-6")],
            devices: &["gpu-0-mig-3g40gb-0", "gpu-0-mig-1g10gb-4"],
            kinds: vec![mig(P_3G, 0, 4), mig(P_1G, 4, 1)],
            mode_changes: vec![],
        },
        Case {
            what: "partitions of two GPUs, one of them switched on",
            gpus: vec![
                h100(Some(true)),
                view(gpu(1, "H100-80GB", Some(false)), Vec::new()),
            ],
            others: vec![],
            devices: &["gpu-0-mig-3g40gb-0", "gpu-1-mig-3g40gb-4"],
            kinds: vec![mig(P_3G, 0, 4), mig(P_3G, 4, 4)],
            mode_changes: vec![(1, true)],
        },
        Case {
            what: "a partition of an Ampere GPU with MIG off asks NVML to switch it on",
            gpus: vec![view(gpu(0, "A100-SXM4-40GB", Some(false)), Vec::new())],
            others: vec![],
            devices: &["gpu-0-mig-1g5gb-0"],
            kinds: vec![mig(P_1G, 0, 1)],
            mode_changes: vec![(0, true)],
        },
        Case {
            what: "a whole, empty Ampere GPU in MIG mode asks NVML to switch it off",
            gpus: vec![view(gpu(0, "A100-SXM4-40GB", Some(true)), Vec::new())],
            others: vec![],
            devices: &["gpu-0"],
            kinds: vec![DeviceKind::Gpu],
            mode_changes: vec![(0, false)],
        },
        Case {
            what: "a listing failure does not matter when the decision does not need it",
            gpus: vec![GpuView {
                description: gpu(0, "H100-80GB", Some(false)),
                instances: Err(listing_failed()),
            }],
            others: vec![],
            devices: &["gpu-0"],
            kinds: vec![DeviceKind::Gpu],
            mode_changes: vec![],
        },
    ];
    for case in cases {
        let views = gpus(case.gpus);
        let devices = allocated(case.devices);
        let plan = plan(&devices, &views, &case.others).unwrap_or_else(|e| panic!("{}: {e}", case.what));
        let kinds: Vec<DeviceKind> = plan.devices.iter().map(|d| d.kind.clone()).collect();
        assert_eq!(kinds, case.kinds, "{}", case.what);
        assert_eq!(
            plan.mig_mode_changes,
            case.mode_changes.into_iter().collect::<BTreeMap<_, _>>(),
            "{}",
            case.what
        );
        for (record, device) in plan.devices.iter().zip(&devices) {
            assert_eq!(record.device, device.device, "{}", case.what);
            assert_eq!(record.request, device.request, "{}", case.what);
            assert_eq!(record.gpu_minor, device.name.minor(), "{}", case.what);
            assert_eq!(
                record.gpu_uuid,
                views[&device.name.minor()].description.uuid,
                "{}",
                case.what
            );
        }
    }
}

fn listing_failed() -> BackendError {
    BackendError {
        operation: "list GPU instances on GPU 0".into(),
        kind: NvmlErrorKind::Other,
        message: "boom".into(),
    }
}

#[test]
fn rejected_plans() {
    let foreign_1g_at_6 = || view(gpu(0, "H100-80GB", Some(true)), vec![instance(3, P_1G, 6, 1)]);
    // (what, GPUs, other claims, allocated devices, expected reason)
    type Case = (
        &'static str,
        Vec<GpuView>,
        Vec<(String, ClaimRecord)>,
        &'static [&'static str],
        &'static str,
    );
    let cases: Vec<Case> = vec![
        (
            "no such GPU",
            vec![h100(Some(true))],
            vec![],
            &["gpu-7-mig-3g40gb-4"],
            "NoSuchGpu",
        ),
        (
            "whole GPU after its partition",
            vec![h100(Some(true))],
            vec![],
            &["gpu-0-mig-3g40gb-4", "gpu-0"],
            "WholeGpuAlsoPartitioned",
        ),
        (
            "partition after its whole GPU",
            vec![h100(Some(false))],
            vec![],
            &["gpu-0", "gpu-0-mig-3g40gb-4"],
            "PartitionOfWholeGpu",
        ),
        (
            "the same GPU twice",
            vec![h100(Some(false))],
            vec![],
            &["gpu-0", "gpu-0"],
            "DuplicateDevice",
        ),
        (
            "whole GPU with another claim's partition",
            vec![h100(Some(true))],
            vec![other_mig(P_3G, 0, 4, "gpu-0-mig-3g40gb-0")],
            &["gpu-0"],
            "InUseByClaim",
        ),
        (
            "partition overlapping another claim's partition",
            vec![h100(Some(true))],
            vec![other_mig(P_3G, 4, 4, "gpu-0-mig-3g40gb-4")],
            &["gpu-0-mig-1g10gb-5"],
            "InUseByClaim",
        ),
        (
            "partition of another claim's whole GPU",
            vec![h100(Some(false))],
            vec![other(DeviceKind::Gpu, "gpu-0")],
            &["gpu-0-mig-1g10gb-0"],
            "InUseByClaim",
        ),
        (
            "partition of a GPU without MIG",
            vec![h100(None)],
            vec![],
            &["gpu-0-mig-3g40gb-4"],
            "NotMigCapable",
        ),
        (
            "profile the GPU lacks",
            vec![h100(Some(true))],
            vec![],
            &["gpu-0-mig-1g5gb-0"],
            "UnknownProfile",
        ),
        (
            "invalid start",
            vec![h100(Some(true))],
            vec![],
            &["gpu-0-mig-3g40gb-2"],
            "InvalidPlacement",
        ),
        (
            "overlaps a foreign instance",
            vec![foreign_1g_at_6()],
            vec![],
            &["gpu-0-mig-3g40gb-4"],
            "PlacementOverlap",
        ),
        (
            "two devices of the claim overlap",
            vec![h100(Some(true))],
            vec![],
            &["gpu-0-mig-3g40gb-4", "gpu-0-mig-2g20gb-4"],
            "PlacementOverlap",
        ),
        (
            "whole GPU with a foreign instance",
            vec![foreign_1g_at_6()],
            vec![],
            &["gpu-0"],
            "ForeignInstances",
        ),
    ];
    for (what, views, others, names, reason) in cases {
        let devices = allocated(names);
        match plan(&devices, &gpus(views), &others) {
            Err(PlanError::Rejected(rejection)) => {
                assert_eq!(rejection.reason(), reason, "{what}: {rejection}")
            }
            other => panic!("{what}: expected a rejection {reason}, got {other:?}"),
        }
    }
}

/// Prepare enforces what NVML enforces (known profile and start, memory-slice overlap,
/// the profile's instance count) and nothing more: summed engine budgets are the
/// published counters' business.
#[test]
fn prepare_enforces_only_what_nvml_enforces() {
    // A30 IDs: 1g+me 21, 2g+me 6 (both with the single OFA); H100: 1g+me 20, 1g 19.
    // (what, model, existing GPU instances (profile ID, start, size), allocated
    // (profile ID, start), expected rejection reason or None)
    type Case = (
        &'static str,
        &'static str,
        &'static [(u32, u32, u32)],
        &'static [(u32, u32)],
        Option<&'static str>,
    );
    let cases: &[Case] = &[
        (
            "two OFA users next to each other (NVML creates both)",
            "A30-24GB",
            &[(21, 0, 1)],
            &[(6, 2)],
            None,
        ),
        (
            "two OFA users in one claim",
            "A30-24GB",
            &[],
            &[(21, 0), (6, 2)],
            None,
        ),
        (
            "the second 1g+me is over the instance count",
            "H100-80GB",
            &[(20, 0, 1)],
            &[(20, 1)],
            Some("InstanceLimit"),
        ),
        (
            "two 1g+me in one claim",
            "H100-80GB",
            &[],
            &[(20, 0), (20, 1)],
            Some("InstanceLimit"),
        ),
        (
            "memory slices overlap",
            "A30-24GB",
            &[(21, 2, 1)],
            &[(6, 2)],
            Some("PlacementOverlap"),
        ),
        (
            "seven 1g next to each other",
            "H100-80GB",
            &[
                (19, 0, 1),
                (19, 1, 1),
                (19, 2, 1),
                (19, 3, 1),
                (19, 4, 1),
                (19, 5, 1),
            ],
            &[(19, 6)],
            None,
        ),
        (
            "not a placement of the profile",
            "H100-80GB",
            &[],
            &[(19, 7)],
            Some("InvalidPlacement"),
        ),
    ];
    for (what, key, existing, wanted, expected) in cases {
        let model = catalog::model(key).unwrap();
        let instances = existing
            .iter()
            .enumerate()
            .map(|(i, (id, start, size))| instance(i as u32 + 1, *id, *start, *size))
            .collect();
        let names: Vec<String> = wanted
            .iter()
            .map(|(id, start)| {
                let profile = model.profiles.iter().find(|p| p.gi_profile_id == *id).unwrap();
                DeviceName::Mig {
                    minor: 0,
                    profile: profile.name,
                    start: *start,
                }
                .to_string()
            })
            .collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let result = plan(
            &allocated(&names),
            &gpus(vec![view(gpu(0, key, Some(true)), instances)]),
            &[],
        );
        match (expected, result) {
            (None, Ok(plan)) => assert_eq!(plan.devices.len(), wanted.len(), "{what}"),
            (Some(reason), Err(PlanError::Rejected(rejection))) => {
                assert_eq!(rejection.reason(), *reason, "{what}: {rejection}")
            }
            (expected, result) => panic!("{what}: expected {expected:?}, got {result:?}"),
        }
    }
}

#[test]
fn a_listing_failure_fails_the_plan_only_where_the_list_is_needed() {
    let failing = |mig| {
        gpus(vec![GpuView {
            description: gpu(0, "H100-80GB", Some(mig)),
            instances: Err(listing_failed()),
        }])
    };
    for names in [&["gpu-0-mig-3g40gb-4"][..], &["gpu-0"][..]] {
        let result = plan(&allocated(names), &failing(true), &[]);
        assert_eq!(result, Err(PlanError::Backend(listing_failed())), "{names:?}");
    }
    // A rejection decided before the list is needed wins.
    let result = plan(&allocated(&["gpu-0-mig-1g5gb-0"]), &failing(true), &[]);
    assert!(
        matches!(result, Err(PlanError::Rejected(Rejection::UnknownProfile { .. }))),
        "{result:?}"
    );
}

#[test]
fn instances_of_other_gpus_do_not_block() {
    let views = gpus(vec![
        h100(Some(true)),
        view(gpu(1, "H100-80GB", Some(true)), vec![instance(1, P_3G, 4, 4)]),
    ]);
    plan(&allocated(&["gpu-0-mig-3g40gb-4"]), &views, &[]).unwrap();
}

#[test]
fn messages_name_the_device_and_the_cause() {
    let devices = allocated(&["gpu-0-mig-1g5gb-0"]);
    let Err(PlanError::Rejected(rejection)) = plan(&devices, &gpus(vec![h100(Some(true))]), &[]) else {
        panic!("expected a rejection")
    };
    let message = rejection.to_string();
    assert!(
        message.starts_with("device gpu-0-mig-1g5gb-0: GPU 0 (")
            && message.contains("has no MIG profile 1g.5gb (it offers 1g.10gb, "),
        "{message}"
    );
    let devices = allocated(&["gpu-0-mig-1g10gb-5"]);
    let others = [other_mig(P_3G, 4, 4, "gpu-0-mig-3g40gb-4")];
    let Err(PlanError::Rejected(rejection)) = plan(&devices, &gpus(vec![h100(Some(true))]), &others) else {
        panic!("expected a rejection")
    };
    assert_eq!(
        rejection.to_string(),
        "device gpu-0-mig-1g10gb-5 overlaps device gpu-0-mig-3g40gb-4 already prepared for claim ns/other (uid-other)"
    );
    let devices = allocated(&["gpu-0-mig-3g40gb-4"]);
    let Err(PlanError::Rejected(rejection)) = plan(&devices, &gpus(vec![foreign_overlap()]), &[]) else {
        panic!("expected a rejection")
    };
    let message = rejection.to_string();
    assert!(
        message.starts_with("device gpu-0-mig-3g40gb-4: cannot create 3g.40gb at memory slice 4 on GPU 0: ")
            && message.contains("overlaps the existing 1g.10gb@6"),
        "{message}"
    );
}

fn foreign_overlap() -> GpuView {
    view(gpu(0, "H100-80GB", Some(true)), vec![instance(3, P_1G, 6, 1)])
}
