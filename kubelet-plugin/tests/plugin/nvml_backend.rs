//! The production `NvmlBackend` against the fake NVML library: every call goes through
//! nvml-wrapper and the C ABI into simulated GPUs that follow real NVML semantics.

use std::{
    path::Path,
    time::{Duration, Instant},
};

use migdra_api::{catalog, geometry::Architecture};
use migdra_fake_nvml::{
    FakeConfig, FaultConfig, GpuConfig, InstanceConfig, code,
    testing::{FakeGpuHost, HOST_LIBRARY},
};
use migdra_kubelet_plugin::nvml::{GpuBackend, MigModeChange, NvmlBackend, NvmlErrorKind, ReloadingNvml};

// Real GPU-instance profile IDs of the 8-slice parts.
const P_1G: u32 = 19;
const P_1G_ME: u32 = 20;
const P_1G_DOUBLE: u32 = 15;
const P_2G: u32 = 14;
const P_3G: u32 = 9;
const P_4G: u32 = 5;
const P_7G: u32 = 0;

fn host(gpus: &[(&str, bool)]) -> FakeGpuHost {
    FakeGpuHost::with_gpus(gpus).expect("fake GPU host")
}

fn host_with(config: FakeConfig) -> FakeGpuHost {
    FakeGpuHost::new(config).expect("fake GPU host")
}

fn backend(host: &FakeGpuHost) -> NvmlBackend {
    NvmlBackend::new(Some(&host.lib_path())).expect("NVML init against the fake")
}

fn kind<T: std::fmt::Debug>(result: Result<T, migdra_kubelet_plugin::nvml::BackendError>) -> NvmlErrorKind {
    result.expect_err("expected an NVML error").kind
}

fn cap_file(host: &FakeGpuHost, rel: &str) -> std::path::PathBuf {
    host.proc_root().join("driver/nvidia/capabilities").join(rel)
}

#[test]
fn discovery_reports_real_profile_ids_placements_and_identity() {
    let host = host(&[("H100-80GB", true), ("A100-SXM4-40GB", false), ("L4", false)]);
    let nvml = backend(&host);
    assert_eq!(nvml.driver_version().unwrap(), "580.82.07");
    let gpus = nvml.discover().unwrap();
    assert_eq!(gpus.len(), 3);

    let h100 = &gpus[0];
    assert_eq!((h100.index, h100.minor), (0, 0));
    assert!(h100.uuid.starts_with("GPU-"), "{}", h100.uuid);
    assert_eq!(h100.product_name, "NVIDIA H100 80GB HBM3");
    assert_eq!(h100.pci_bus_id.as_deref(), Some("0000:07:00.0"));
    assert_eq!(h100.architecture, Some(Architecture::Hopper));
    assert_eq!(h100.cuda_compute_capability, Some((9, 0)));
    assert_eq!(h100.memory_mib, 81559);
    let mig = h100.mig.as_ref().expect("H100 is MIG-capable");
    assert!(mig.enabled && mig.pending_enabled);
    // Index 0 is 1g with ID 19; index 9 (double memory) has ID 15 and size-2 placements.
    let by_index = |i: u32| mig.profiles.iter().find(|p| p.gi_profile_index == i).unwrap();
    assert_eq!(by_index(0).gi_profile_id, P_1G);
    assert_eq!(by_index(9).gi_profile_id, P_1G_DOUBLE);
    assert_eq!(by_index(9).placements, vec![0, 2, 4, 6]);
    assert_eq!(by_index(9).memory_slices, 2);
    assert_eq!(by_index(2).gi_profile_id, P_3G);
    assert_eq!(
        (by_index(2).placements.clone(), by_index(2).memory_slices),
        (vec![0, 4], 4)
    );
    assert_eq!(by_index(4).gi_profile_id, P_7G);
    assert_eq!(by_index(4).memory_slices, 8);
    assert_eq!(by_index(7).name.to_string(), "1g.10gb+me");

    let a100 = &gpus[1];
    let mig = a100.mig.as_ref().expect("A100 is MIG-capable");
    assert!(!mig.enabled && !mig.pending_enabled);
    // Profiles and placements are readable with MIG off.
    assert_eq!(mig.profiles.len(), 7);
    assert_eq!(a100.architecture, Some(Architecture::Ampere));
    assert_ne!(a100.uuid, h100.uuid);
    assert_eq!(a100.pci_bus_id.as_deref(), Some("0000:0f:00.0"));

    let l4 = &gpus[2];
    assert_eq!(l4.mig, None, "a GPU without MIG answers NOT_SUPPORTED");
    assert_eq!(l4.product_name, "NVIDIA L4");
}

#[test]
fn discovered_profiles_equal_the_catalog_for_every_model_with_mig_on_and_off() {
    for model in catalog::models() {
        for mig_on in [true, false] {
            let host = host(&[(model.key, mig_on)]);
            let gpus = backend(&host).discover().unwrap();
            let mig = gpus[0].mig.as_ref().unwrap();
            // With MIG on the names come from the v3 info; with MIG off they are derived from
            // memory sizes as go-nvlib does. Both must give NVIDIA's names.
            assert_eq!(
                mig.profiles,
                model.profiles,
                "{} with MIG {}",
                model.key,
                if mig_on { "on" } else { "off" }
            );
            assert_eq!(gpus[0].memory_mib, model.memory_mib);
        }
    }
}

#[test]
fn creates_at_a_placement_with_full_compute_instance_and_mig_uuid() {
    let host = host(&[("H100-80GB", true)]);
    let nvml = backend(&host);
    let gi = nvml.create_gpu_instance(0, P_3G, 4).unwrap();
    assert_eq!(gi, 2, "3g at 4 is the second half");
    let ci = nvml.create_full_compute_instance(0, gi).unwrap();
    assert_eq!(ci.id, 0);
    let uuid = ci.mig_uuid.strip_prefix("MIG-").expect("MIG- prefix");
    assert!(uuid::Uuid::parse_str(uuid).is_ok(), "{}", ci.mig_uuid);

    let listed = nvml.list_gpu_instances(0).unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (
            listed[0].id,
            listed[0].profile_id,
            listed[0].start,
            listed[0].size
        ),
        (2, P_3G, 4, 4)
    );
    assert_eq!(listed[0].compute_instances.len(), 1);
    assert_eq!(listed[0].compute_instances[0].mig_uuid, ci.mig_uuid);
    // The full CI of a 3-slice GI is CI profile 2 (3_SLICE).
    assert_eq!(listed[0].compute_instances[0].profile_id, 2);

    let state = host.read_state().unwrap();
    let gi_state = &state.gpus[0].gpu_instances[0];
    assert_eq!((gi_state.start, gi_state.size), (4, 4));
    assert_eq!(gi_state.compute_instances[0].uuid, ci.mig_uuid);
}

#[test]
fn occupied_overlapping_and_invalid_placements_are_refused() {
    let host = host(&[("A100-80GB", true)]);
    let nvml = backend(&host);
    nvml.create_gpu_instance(0, P_3G, 4).unwrap();
    for (profile, start, refusal) in [
        (P_3G, 4, NvmlErrorKind::InsufficientResources),
        (P_2G, 4, NvmlErrorKind::InsufficientResources),
        (P_1G, 6, NvmlErrorKind::InsufficientResources),
        (P_7G, 0, NvmlErrorKind::InsufficientResources),
        (P_3G, 2, NvmlErrorKind::InvalidArgument),
        (77, 0, NvmlErrorKind::InvalidArgument),
    ] {
        assert_eq!(
            kind(nvml.create_gpu_instance(0, profile, start)),
            refusal,
            "profile {profile} at {start}"
        );
    }
    // 4g@0 + 3g@4 is a valid zero-waste layout.
    nvml.create_gpu_instance(0, P_4G, 0).unwrap();
    assert_eq!(host.read_state().unwrap().gpus[0].gpu_instances.len(), 2);
}

#[test]
fn only_one_media_engine_instance_fits() {
    let host = host(&[("H100-80GB", true)]);
    let nvml = backend(&host);
    nvml.create_gpu_instance(0, P_1G_ME, 0).unwrap();
    // No overlap at 3, but the single OFA engine is taken.
    assert_eq!(
        kind(nvml.create_gpu_instance(0, P_1G_ME, 3)),
        NvmlErrorKind::InsufficientResources
    );
    nvml.create_gpu_instance(0, P_1G, 3).unwrap();
}

#[test]
fn gpu_instance_ids_follow_the_placement() {
    let host = host_with(FakeConfig {
        gpus: vec![
            GpuConfig::new("H100-80GB", true),
            GpuConfig::new("H100-80GB", true),
            GpuConfig {
                swap_halves: true,
                ..GpuConfig::new("H100-80GB", true)
            },
            GpuConfig::new("A30-24GB", true),
        ],
        ..FakeConfig::default()
    });
    let nvml = backend(&host);
    assert_eq!(nvml.create_gpu_instance(0, P_7G, 0).unwrap(), 0);
    assert_eq!(nvml.create_gpu_instance(1, P_1G, 6).unwrap(), 13);
    assert_eq!(nvml.create_gpu_instance(1, P_2G, 0).unwrap(), 3);
    assert_eq!(nvml.create_gpu_instance(1, P_1G_DOUBLE, 4).unwrap(), 5);
    // Swapped halves: the same placement gets the other half's ID.
    assert_eq!(nvml.create_gpu_instance(2, P_3G, 4).unwrap(), 1);
    assert_eq!(nvml.create_gpu_instance(2, P_4G, 0).unwrap(), 2);
    // A30: 4 memory slices; 4g (ID 0) is the whole GPU.
    assert_eq!(nvml.create_gpu_instance(3, 0, 0).unwrap(), 0);
    let ci = nvml.create_full_compute_instance(3, 0).unwrap();
    assert!(ci.mig_uuid.starts_with("MIG-"));
}

#[test]
fn destroy_compute_instance_then_gpu_instance() {
    let host = host(&[("H100-80GB", true)]);
    let nvml = backend(&host);
    let gi = nvml.create_gpu_instance(0, P_2G, 2).unwrap();
    let ci = nvml.create_full_compute_instance(0, gi).unwrap();
    // CI first: a GPU instance with a compute instance is in use.
    assert_eq!(kind(nvml.destroy_gpu_instance(0, gi)), NvmlErrorKind::InUse);
    nvml.destroy_compute_instance(0, gi, ci.id).unwrap();
    let listed = nvml.list_gpu_instances(0).unwrap();
    assert_eq!(listed.len(), 1);
    assert!(
        listed[0].compute_instances.is_empty(),
        "a GI left without a CI is listed as such"
    );
    nvml.destroy_gpu_instance(0, gi).unwrap();
    assert!(nvml.list_gpu_instances(0).unwrap().is_empty());
    assert!(host.read_state().unwrap().gpus[0].gpu_instances.is_empty());
}

#[test]
fn already_gone_instances_are_not_found() {
    let host = host(&[("H100-80GB", true), ("H100-80GB", false)]);
    let nvml = backend(&host);
    assert_eq!(kind(nvml.destroy_gpu_instance(0, 3)), NvmlErrorKind::NotFound);
    assert_eq!(
        kind(nvml.destroy_compute_instance(0, 3, 0)),
        NvmlErrorKind::NotFound
    );
    let gi = nvml.create_gpu_instance(0, P_1G, 0).unwrap();
    assert_eq!(
        kind(nvml.destroy_compute_instance(0, gi, 0)),
        NvmlErrorKind::NotFound
    );
    nvml.destroy_gpu_instance(0, gi).unwrap();
    assert_eq!(kind(nvml.destroy_gpu_instance(0, gi)), NvmlErrorKind::NotFound);
    // With MIG off no instance can exist.
    assert_eq!(kind(nvml.destroy_gpu_instance(1, 0)), NvmlErrorKind::NotFound);
}

#[test]
fn busy_compute_instances_cannot_be_destroyed() {
    let host = host(&[("H100-80GB", true)]);
    let nvml = backend(&host);
    let gi = nvml.create_gpu_instance(0, P_1G, 5).unwrap();
    let ci = nvml.create_full_compute_instance(0, gi).unwrap();
    host.update_state(|s| s.gpus[0].gpu_instances[0].compute_instances[0].busy = true)
        .unwrap();
    assert_eq!(
        kind(nvml.destroy_compute_instance(0, gi, ci.id)),
        NvmlErrorKind::InUse
    );
    host.update_state(|s| s.gpus[0].gpu_instances[0].compute_instances[0].busy = false)
        .unwrap();
    nvml.destroy_compute_instance(0, gi, ci.id).unwrap();
    nvml.destroy_gpu_instance(0, gi).unwrap();
}

#[test]
fn every_re_creation_mints_a_fresh_mig_uuid() {
    let host = host(&[("B200", true)]);
    let nvml = backend(&host);
    let mut uuids = Vec::new();
    for _ in 0..3 {
        let gi = nvml.create_gpu_instance(0, P_4G, 0).unwrap();
        assert_eq!(gi, 1);
        let ci = nvml.create_full_compute_instance(0, gi).unwrap();
        uuids.push(ci.mig_uuid);
        nvml.destroy_compute_instance(0, gi, ci.id).unwrap();
        nvml.destroy_gpu_instance(0, gi).unwrap();
    }
    uuids.sort();
    uuids.dedup();
    assert_eq!(uuids.len(), 3, "same placement, same GI ID, new UUID each time");
}

#[test]
fn double_memory_and_media_engine_gpu_instances_get_their_full_compute_instance() {
    let host = host(&[("GH200-144GB", true)]);
    let nvml = backend(&host);
    let gi = nvml.create_gpu_instance(0, P_1G_DOUBLE, 2).unwrap();
    nvml.create_full_compute_instance(0, gi).unwrap();
    let me = nvml.create_gpu_instance(0, P_1G_ME, 0).unwrap();
    nvml.create_full_compute_instance(0, me).unwrap();
    let listed = nvml.list_gpu_instances(0).unwrap();
    assert_eq!(listed.len(), 2);
    assert!(
        listed
            .iter()
            .all(|gi| gi.compute_instances.len() == 1 && gi.compute_instances[0].profile_id == 0)
    );
}

#[test]
fn falls_back_to_the_rev1_compute_profile_for_one_slice_instances() {
    let host = host_with(FakeConfig {
        gpus: vec![GpuConfig::new("H100-80GB", true)],
        // The first CI profile lookup (index 0) is refused, as some drivers do.
        faults: vec![
            FaultConfig::error(
                "nvmlGpuInstanceGetComputeInstanceProfileInfo",
                code::NOT_SUPPORTED,
            )
            .times(1),
        ],
        ..FakeConfig::default()
    });
    let nvml = backend(&host);
    let gi = nvml.create_gpu_instance(0, P_1G_DOUBLE, 6).unwrap();
    nvml.create_full_compute_instance(0, gi).unwrap();
    let state = host.read_state().unwrap();
    assert_eq!(state.gpus[0].gpu_instances[0].compute_instances[0].profile_id, 7);
}

#[test]
fn with_mig_off_creation_is_not_supported() {
    let host = host(&[("A100-SXM4-40GB", false), ("L4", false)]);
    let nvml = backend(&host);
    assert_eq!(
        kind(nvml.create_gpu_instance(0, P_1G, 0)),
        NvmlErrorKind::NotSupported
    );
    assert!(nvml.list_gpu_instances(0).unwrap().is_empty());
    assert!(nvml.list_gpu_instances(1).unwrap().is_empty());
    assert_eq!(
        kind(nvml.create_full_compute_instance(0, 0)),
        NvmlErrorKind::NotSupported
    );
    assert_eq!(kind(nvml.set_mig_mode(1, true)), NvmlErrorKind::NotSupported);
}

#[test]
fn hopper_switches_mig_mode_at_once_unless_in_use() {
    let host = host(&[("H100-80GB", false), ("H200-141GB", false)]);
    let nvml = backend(&host);
    assert_eq!(nvml.set_mig_mode(0, true).unwrap(), MigModeChange::Applied);
    let mig = nvml.discover().unwrap()[0].mig.clone().unwrap();
    assert!(mig.enabled && mig.pending_enabled);
    let gi = nvml.create_gpu_instance(0, P_7G, 0).unwrap();
    // Instances exist: the mode cannot be switched off.
    assert_eq!(kind(nvml.set_mig_mode(0, false)), NvmlErrorKind::InUse);
    nvml.destroy_gpu_instance(0, gi).unwrap();
    assert_eq!(nvml.set_mig_mode(0, false).unwrap(), MigModeChange::Applied);
    // A client holding the GPU blocks the switch.
    host.update_state(|s| s.gpus[1].client_holds_gpu = true).unwrap();
    assert_eq!(kind(nvml.set_mig_mode(1, true)), NvmlErrorKind::InUse);
    assert!(!nvml.discover().unwrap()[1].mig.clone().unwrap().pending_enabled);
    // Hopper loses MIG mode on driver reload.
    host.update_state(|s| s.gpus[1].client_holds_gpu = false).unwrap();
    nvml.set_mig_mode(1, true).unwrap();
    host.update_state(|s| s.reload_driver()).unwrap();
    assert!(!nvml.discover().unwrap()[1].mig.clone().unwrap().enabled);
}

#[test]
fn ampere_mig_mode_stays_pending_until_a_reset_when_the_driver_cannot_reset() {
    // A pass-through VM: the driver cannot reset the GPU itself (§12).
    let host = host_with(FakeConfig {
        gpus: vec![
            GpuConfig::new("A100-80GB", false).with_quirks(migdra_fake_nvml::GpuQuirks {
                no_driver_reset: true,
                ..Default::default()
            }),
        ],
        ..FakeConfig::default()
    });
    let nvml = backend(&host);
    assert_eq!(nvml.set_mig_mode(0, true).unwrap(), MigModeChange::PendingReset);
    let mig = nvml.discover().unwrap()[0].mig.clone().unwrap();
    assert!(!mig.enabled && mig.pending_enabled);
    assert_eq!(
        kind(nvml.create_gpu_instance(0, P_1G, 0)),
        NvmlErrorKind::NotSupported
    );
    host.update_state(|s| s.reset_gpu(0)).unwrap();
    let mig = nvml.discover().unwrap()[0].mig.clone().unwrap();
    assert!(mig.enabled && mig.pending_enabled);
    nvml.create_gpu_instance(0, P_1G, 0).unwrap();
    // Ampere keeps the mode over a driver reload; the instances are gone.
    host.update_state(|s| s.reload_driver()).unwrap();
    assert!(nvml.discover().unwrap()[0].mig.clone().unwrap().enabled);
    assert!(nvml.list_gpu_instances(0).unwrap().is_empty());
}

/// A second, independent copy of the library (as another process would load) that serves the
/// same GPUs: its configuration points at the first host's state and `/proc`.
fn second_library_for(host: &FakeGpuHost) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let lib = dir.path().join(HOST_LIBRARY);
    std::fs::copy(host.lib_path(), &lib).expect("copy the library");
    let config = FakeConfig {
        state_file: Some(host.state_path()),
        proc_root: Some(host.proc_root()),
        ..host.config().clone()
    };
    let text = serde_json::to_string(&config).expect("serialize config");
    std::fs::write(dir.path().join("fake-nvml.json"), text).expect("write config");
    (dir, lib)
}

#[test]
fn two_library_instances_share_one_gpu_and_state_survives_restart() {
    let host = host(&[("H100-80GB", true)]);
    let (_dir, second_lib) = second_library_for(&host);
    let first = backend(&host);
    let second = NvmlBackend::new(Some(Path::new(&second_lib))).unwrap();
    assert_eq!(
        first.discover().unwrap()[0].uuid,
        second.discover().unwrap()[0].uuid
    );

    let gi = first.create_gpu_instance(0, P_3G, 0).unwrap();
    let ci = first.create_full_compute_instance(0, gi).unwrap();
    // The other instance sees it and cannot take the same slices.
    let seen = second.list_gpu_instances(0).unwrap();
    assert_eq!(seen[0].compute_instances[0].mig_uuid, ci.mig_uuid);
    assert_eq!(
        kind(second.create_gpu_instance(0, P_3G, 0)),
        NvmlErrorKind::InsufficientResources
    );
    second.create_gpu_instance(0, P_3G, 4).unwrap();

    // A restarted process finds the GPU as it was left.
    drop(first);
    let restarted = backend(&host);
    let listed = restarted.list_gpu_instances(0).unwrap();
    assert_eq!(listed.iter().map(|g| g.start).collect::<Vec<_>>(), vec![0, 4]);
    restarted.destroy_compute_instance(0, gi, ci.id).unwrap();
    restarted.destroy_gpu_instance(0, gi).unwrap();
    assert_eq!(second.list_gpu_instances(0).unwrap().len(), 1);
}

#[test]
fn instances_created_by_someone_else_are_listed() {
    let host = host_with(FakeConfig {
        gpus: vec![GpuConfig::new("H100-80GB", true)],
        instances: vec![
            InstanceConfig {
                gpu: 0,
                profile_id: P_4G,
                start: 0,
            },
            InstanceConfig {
                gpu: 0,
                profile_id: P_1G,
                start: 6,
            },
        ],
        ..FakeConfig::default()
    });
    let nvml = backend(&host);
    let listed = nvml.list_gpu_instances(0).unwrap();
    assert_eq!(
        listed.iter().map(|g| (g.profile_id, g.start)).collect::<Vec<_>>(),
        vec![(P_4G, 0), (P_1G, 6)]
    );
    assert!(listed.iter().all(|g| g.compute_instances.len() == 1));
    assert_eq!(
        kind(nvml.create_gpu_instance(0, P_3G, 4)),
        NvmlErrorKind::InsufficientResources
    );
}

#[test]
fn injected_faults_fail_and_delay_calls() {
    let host = host_with(FakeConfig {
        gpus: vec![
            GpuConfig::new("H100-80GB", true),
            GpuConfig::new("H100-80GB", true),
        ],
        faults: vec![
            FaultConfig::error("nvmlDeviceCreateGpuInstanceWithPlacement", code::GPU_IS_LOST)
                .times(1)
                .on_gpu(0),
            FaultConfig::latency("nvmlGpuInstanceDestroy", 300).on_gpu(1),
        ],
        ..FakeConfig::default()
    });
    let nvml = backend(&host);
    assert_eq!(kind(nvml.create_gpu_instance(0, P_1G, 0)), NvmlErrorKind::GpuLost);
    // The fault fired once; the next call goes through.
    nvml.create_gpu_instance(0, P_1G, 0).unwrap();
    assert_eq!(host.read_state().unwrap().faults[0].hits, 1);

    let gi = nvml.create_gpu_instance(1, P_1G, 0).unwrap();
    let started = Instant::now();
    nvml.destroy_gpu_instance(1, gi).unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "the injected latency was spent"
    );
    assert!(host.read_state().unwrap().gpus[1].gpu_instances.is_empty());
    // A fault added at run time applies at once.
    host.update_state(|s| {
        s.faults.push(migdra_fake_nvml::FaultState {
            fault: FaultConfig::error("nvmlGpuInstanceCreateComputeInstance", code::IN_USE),
            hits: 0,
        })
    })
    .unwrap();
    assert_eq!(
        kind(nvml.create_full_compute_instance(0, 7)),
        NvmlErrorKind::InUse
    );
}

#[test]
fn lost_gpus_fail_the_health_probe() {
    let host = host(&[("H100-80GB", true), ("H100-80GB", true)]);
    let nvml = backend(&host);
    nvml.probe_health(0).unwrap();
    host.update_state(|s| s.gpus[1].lost = true).unwrap();
    assert_eq!(kind(nvml.probe_health(1)), NvmlErrorKind::GpuLost);
    nvml.probe_health(0).unwrap();
    assert_eq!(kind(nvml.create_gpu_instance(1, P_1G, 0)), NvmlErrorKind::GpuLost);
}

#[test]
fn capability_files_exist_exactly_while_their_instances_do() {
    let host = host(&[("H100-80GB", true), ("H100-80GB", true)]);
    let nvml = backend(&host);
    let minors = std::fs::read_to_string(host.proc_root().join("driver/nvidia-caps/mig-minors")).unwrap();
    assert!(minors.contains("\ngpu1/gi2/access 156\n"));
    assert!(minors.contains("\ngpu1/gi2/ci0/access 157\n"));
    let devices = std::fs::read_to_string(host.proc_root().join("devices")).unwrap();
    assert!(devices.contains("\n508 nvidia-caps\n"));

    let gi = nvml.create_gpu_instance(1, P_3G, 4).unwrap();
    let gi_file = cap_file(&host, "gpu1/mig/gi2/access");
    let ci_file = cap_file(&host, "gpu1/mig/gi2/ci0/access");
    assert_eq!(
        std::fs::read_to_string(&gi_file).unwrap(),
        "DeviceFileMinor: 156\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
    );
    assert!(!ci_file.exists());
    let ci = nvml.create_full_compute_instance(1, gi).unwrap();
    assert!(
        std::fs::read_to_string(&ci_file)
            .unwrap()
            .starts_with("DeviceFileMinor: 157\n")
    );
    assert!(
        !cap_file(&host, "gpu0/mig/gi2").exists(),
        "GPU 0 has no instances"
    );

    nvml.destroy_compute_instance(1, gi, ci.id).unwrap();
    assert!(!ci_file.exists());
    assert!(gi_file.exists());
    nvml.destroy_gpu_instance(1, gi).unwrap();
    assert!(!gi_file.exists());
}

#[test]
fn a_missing_library_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().expect("temp dir");
    let err = NvmlBackend::new(Some(&dir.path().join("libnvidia-ml.so.1"))).expect_err("no library there");
    assert_eq!(err.kind, NvmlErrorKind::Other);
    assert!(err.operation.contains("initialise NVML"), "{err}");
    // A library without its configuration behaves like a machine without the driver.
    std::fs::copy(
        migdra_fake_nvml::testing::fake_library_path().expect("built fake"),
        dir.path().join(HOST_LIBRARY),
    )
    .expect("copy");
    let err = NvmlBackend::new(Some(&dir.path().join(HOST_LIBRARY))).expect_err("no configuration");
    assert!(err.message.contains("not loaded"), "{err}");
}

/// A driver upgrade without a reboot: the kernel driver is loaded again under the plugin.
fn reload_driver(host: &FakeGpuHost, version: &str) {
    host.update_state(|s| {
        s.driver_upgrades += 1;
        s.driver_version = version.to_string();
    })
    .expect("reload the fake driver");
}

#[test]
fn a_session_from_before_a_driver_reload_mismatches_until_it_ends() {
    let host = host(&[("H100-80GB", true)]);
    let stale = backend(&host);
    reload_driver(&host, "590.10.01");
    // Every call of the old session, however often: only a new session helps.
    for _ in 0..2 {
        assert_eq!(kind(stale.driver_version()), NvmlErrorKind::RmVersionMismatch);
        assert_eq!(kind(stale.discover()), NvmlErrorKind::RmVersionMismatch);
    }
    drop(stale);
    assert_eq!(backend(&host).driver_version().unwrap(), "590.10.01");
}

#[test]
fn nvml_is_initialised_again_after_a_driver_reload() {
    let host = host(&[("H100-80GB", true), ("A100-SXM4-40GB", false)]);
    let nvml = ReloadingNvml::new(Some(&host.lib_path())).unwrap();
    let before = nvml.discover().unwrap();
    reload_driver(&host, "590.10.01");
    // The call that meets the mismatch ends the session and succeeds on a new one.
    assert_eq!(nvml.driver_version().unwrap(), "590.10.01");
    assert_eq!(nvml.discover().unwrap(), before, "the same GPUs after the rescan");
    nvml.create_gpu_instance(0, P_3G, 4).unwrap();
    assert_eq!(nvml.list_gpu_instances(0).unwrap().len(), 1);

    // The new library is installed but its init still mismatches (the old module is still
    // loaded): the call fails with the cause, and the next one initialises again.
    reload_driver(&host, "590.20.02");
    host.update_state(|s| {
        s.faults.push(migdra_fake_nvml::FaultState {
            fault: FaultConfig {
                times: Some(1),
                ..FaultConfig::error("nvmlInit_v2", code::LIB_RM_VERSION_MISMATCH)
            },
            hits: 0,
        })
    })
    .unwrap();
    let err = nvml.driver_version().unwrap_err();
    assert_eq!(err.kind, NvmlErrorKind::RmVersionMismatch, "{err}");
    assert!(err.to_string().contains("initialise NVML"), "{err}");
    assert_eq!(nvml.driver_version().unwrap(), "590.20.02");
    assert_eq!(nvml.list_gpu_instances(0).unwrap().len(), 1, "instances survive");
}
