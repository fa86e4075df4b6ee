//! What real GPU nodes do that the default simulation does not: the production NVML code
//! against the fake configured with the quirks and faults the reference documents
//! (`shared/reference/mig-nvml.md` §12): the compute-instance info naming the parent device,
//! MIG-mode switches reported through the activation status, renumbered GPUs,
//! per-profile NOT_SUPPORTED, failing profiles, vGPU guests, the 7-slice NVL compute
//! profile, architectures newer than migdra knows, and NVML indexes that differ from device
//! minors.

use migdra_fake_nvml::{
    CiInfoDevice, FakeConfig, FaultConfig, FaultState, GpuConfig, GpuQuirks, code,
    procfs::{ci_cap_minor, gi_cap_minor},
    testing::FakeGpuHost,
};
use migdra_kubelet_plugin::{
    nvml::{GpuBackend, MigModeChange, NvmlBackend, NvmlErrorKind},
    plan::mode_switchable,
};

use migdra_testkit::plugin::*;

const P_1G: u32 = 19;
const P_3G: u32 = 9;
const P_7G: u32 = 0;

fn host_of(gpus: Vec<GpuConfig>, faults: Vec<FaultConfig>) -> FakeGpuHost {
    FakeGpuHost::new(FakeConfig {
        gpus,
        faults,
        ..FakeConfig::default()
    })
    .expect("fake GPU host")
}

fn quirky(model: &str, mig: bool, quirks: GpuQuirks) -> GpuConfig {
    GpuConfig::new(model, mig).with_quirks(quirks)
}

fn backend(host: &FakeGpuHost) -> NvmlBackend {
    NvmlBackend::new(Some(&host.lib_path())).expect("NVML init against the fake")
}

#[test]
fn the_mig_uuid_is_found_whatever_the_compute_instance_info_device_is() {
    for ci_info_device in [CiInfoDevice::MigDevice, CiInfoDevice::Parent] {
        let quirks = GpuQuirks {
            ci_info_device,
            ..GpuQuirks::default()
        };
        let host = host_of(vec![quirky("H100-80GB", true, quirks)], vec![]);
        let nvml = backend(&host);
        // A second instance first, so the MIG device slot of ours is not slot 0.
        let other = nvml.create_gpu_instance(0, P_1G, 0).unwrap();
        nvml.create_full_compute_instance(0, other).unwrap();
        let gi = nvml.create_gpu_instance(0, P_3G, 4).unwrap();
        let ci = nvml.create_full_compute_instance(0, gi).unwrap();

        let state = host.read_state().unwrap();
        let truth = state.gpus[0]
            .gpu_instances
            .iter()
            .find(|i| i.id == gi)
            .map(|i| i.compute_instances[0].uuid.clone())
            .unwrap();
        assert!(truth.starts_with("MIG-"), "{truth}");
        assert_eq!(ci.mig_uuid, truth, "{ci_info_device:?}");
        let listed = nvml.list_gpu_instances(0).unwrap();
        let ours = listed.iter().find(|r| r.id == gi).unwrap();
        assert_eq!(ours.compute_instances[0].mig_uuid, truth, "{ci_info_device:?}");
    }
}

#[test]
fn mig_mode_outcomes_are_read_back_from_the_mode() {
    let no_reset = GpuQuirks {
        no_driver_reset: true,
        ..GpuQuirks::default()
    };
    let host = host_of(
        vec![
            GpuConfig::new("A100-80GB", false),
            quirky("A100-80GB", false, no_reset),
            GpuConfig::new("A100-80GB", false),
            GpuConfig::new("H100-80GB", false),
        ],
        vec![],
    );
    host.update_state(|s| {
        s.gpus[2].client_holds_gpu = true;
        s.gpus[3].client_holds_gpu = true;
    })
    .unwrap();
    let nvml = backend(&host);
    // Idle bare-metal Ampere: the driver resets the GPU itself; no reset is needed.
    assert_eq!(nvml.set_mig_mode(0, true).unwrap(), MigModeChange::Applied);
    // The driver cannot reset it (pass-through): pending.
    assert_eq!(nvml.set_mig_mode(1, true).unwrap(), MigModeChange::PendingReset);
    // A client blocks the reset: pending too.
    assert_eq!(nvml.set_mig_mode(2, true).unwrap(), MigModeChange::PendingReset);
    // Hopper with a client: nothing changed, the activation status says why.
    assert_eq!(nvml.set_mig_mode(3, true).unwrap_err().kind, NvmlErrorKind::InUse);
    let gpus = nvml.discover().unwrap();
    let modes: Vec<(bool, bool)> = gpus
        .iter()
        .map(|g| g.mig.as_ref().map(|m| (m.enabled, m.pending_enabled)).unwrap())
        .collect();
    assert_eq!(
        modes,
        vec![(true, true), (false, true), (false, true), (false, false)]
    );
    assert!(nvml.list_gpu_instances(0).unwrap().is_empty());
    nvml.create_gpu_instance(0, P_1G, 0).unwrap();
}

#[test]
fn a_gpu_renumbered_by_a_mode_change_is_an_error_not_a_success() {
    let quirks = GpuQuirks {
        minor_after_mode_change: Some(7),
        ..GpuQuirks::default()
    };
    let host = host_of(vec![quirky("H100-80GB", false, quirks)], vec![]);
    let nvml = backend(&host);
    nvml.discover().unwrap();
    let err = nvml.set_mig_mode(0, true).unwrap_err();
    assert!(err.message.contains("minor 0 -> 7"), "{err}");
    // Asking again changes nothing, but the GPU is still not the one described.
    let err = nvml.set_mig_mode(0, true).unwrap_err();
    assert!(err.message.contains("minor 0 -> 7"), "{err}");
    // The handle was re-opened: the backend reads the new minor.
    let gpu = &nvml.discover().unwrap()[0];
    assert_eq!(gpu.minor, 7);
    assert!(gpu.mig.as_ref().unwrap().enabled);
}

#[test]
fn per_profile_not_supported_skips_that_profile_only() {
    let host = host_of(
        vec![GpuConfig::new("H100-80GB", true)],
        vec![FaultConfig::error("nvmlDeviceGetGpuInstances", code::NOT_SUPPORTED).on_profile(P_3G)],
    );
    let nvml = backend(&host);
    nvml.create_gpu_instance(0, P_1G, 0).unwrap();
    let listed = nvml.list_gpu_instances(0).unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!((listed[0].profile_id, listed[0].start), (P_1G, 0));
}

#[test]
fn not_supported_while_mig_is_on_does_not_make_an_instance_gone() {
    let host = host_of(vec![GpuConfig::new("H100-80GB", true)], vec![]);
    let nvml = backend(&host);
    let gi = nvml.create_gpu_instance(0, P_3G, 4).unwrap();
    host.update_state(|s| {
        s.faults.push(FaultState {
            fault: FaultConfig::error("nvmlDeviceGetGpuInstanceById", code::NOT_SUPPORTED),
            hits: 0,
        })
    })
    .unwrap();
    // MIG is on, so the instance may well exist: not NotFound.
    assert_eq!(
        nvml.destroy_gpu_instance(0, gi).unwrap_err().kind,
        NvmlErrorKind::NotSupported
    );
    host.update_state(|s| {
        s.faults.clear();
        s.gpus[0].gpu_instances.clear();
        s.gpus[0].mig_enabled = false;
        s.gpus[0].mig_pending = false;
    })
    .unwrap();
    // With MIG off it is gone.
    assert_eq!(
        nvml.destroy_gpu_instance(0, gi).unwrap_err().kind,
        NvmlErrorKind::NotFound
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn unprepare_keeps_the_claim_when_not_supported_comes_while_mig_is_on() {
    let node = Node::new(&[("H100-80GB", true)]);
    let (driver, _) = node.start(None);
    node.claims
        .put(claim("uid-1", "c1", &[("gpu", "gpu-0-mig-3g40gb-4")]));
    prepare_one(&driver, "uid-1", "c1").await.unwrap();
    node.host
        .update_state(|s| {
            s.faults.push(FaultState {
                fault: FaultConfig::error("nvmlGpuInstanceGetInfo", code::NOT_SUPPORTED),
                hits: 0,
            })
        })
        .unwrap();
    let failed = unprepare_typed(&driver, "uid-1", "c1").await;
    assert!(failed.is_err(), "NOT_SUPPORTED with MIG on is not 'gone'");
    assert_eq!(node.instances(0).len(), 1);
    node.host.update_state(|s| s.faults.clear()).unwrap();
    // The claim stayed recorded, so the retry destroys the instance.
    unprepare_typed(&driver, "uid-1", "c1").await.unwrap();
    assert!(node.instances(0).is_empty());
}

#[test]
fn profile_names_do_not_change_with_mig_mode() {
    // A driver that names the 3g profile after its memory ("3g.39gb"), unlike the catalog.
    let quirks = GpuQuirks {
        profile_names: [(P_3G, "3g.39gb".to_string())].into(),
        ..GpuQuirks::default()
    };
    let host = host_of(vec![quirky("A100-80GB", false, quirks)], vec![]);
    let nvml = backend(&host);
    let names = |nvml: &NvmlBackend| -> Vec<String> {
        nvml.discover().unwrap()[0]
            .mig
            .as_ref()
            .unwrap()
            .profiles
            .iter()
            .map(|p| p.name.to_string())
            .collect()
    };
    let before = names(&nvml);
    assert_eq!(nvml.set_mig_mode(0, true).unwrap(), MigModeChange::Applied);
    let after = names(&nvml);
    assert_eq!(before, after);
    assert!(after.contains(&"3g.40gb".to_string()), "{after:?}");
}

#[test]
fn a_failing_profile_is_skipped_not_the_gpu() {
    let host = host_of(
        vec![
            GpuConfig::new("H100-80GB", true),
            GpuConfig::new("H100-80GB", false),
        ],
        vec![
            FaultConfig::error("nvmlDeviceGetGpuInstancePossiblePlacements_v2", code::UNKNOWN)
                .on_profile(P_3G)
                .on_gpu(0),
            // Index 0 is the 1g profile.
            FaultConfig::error("nvmlDeviceGetGpuInstanceProfileInfo", code::UNKNOWN)
                .on_profile(0)
                .on_gpu(1),
        ],
    );
    let gpus = backend(&host).discover().unwrap();
    assert_eq!(gpus.len(), 2);
    let ids = |i: usize| -> Vec<u32> {
        gpus[i]
            .mig
            .as_ref()
            .unwrap()
            .profiles
            .iter()
            .map(|p| p.gi_profile_id)
            .collect()
    };
    assert!(!ids(0).contains(&P_3G) && ids(0).contains(&P_1G), "{:?}", ids(0));
    assert!(!ids(1).contains(&P_1G) && ids(1).contains(&P_3G), "{:?}", ids(1));
    assert_eq!(ids(0).len(), 6);
}

#[test]
fn vgpu_guests_are_offered_whole_only() {
    let mode = |virtualization_mode| GpuQuirks {
        virtualization_mode,
        ..GpuQuirks::default()
    };
    let host = host_of(
        vec![
            quirky("H100-80GB", true, mode(2)),
            quirky("H100-80GB", true, mode(1)),
            quirky("H100-80GB", true, mode(3)),
        ],
        vec![],
    );
    let gpus = backend(&host).discover().unwrap();
    assert_eq!(gpus[0].mig, None, "vGPU guest");
    assert!(gpus[1].mig.is_some(), "pass-through manages MIG");
    assert_eq!(gpus[2].mig, None, "vGPU host");
}

#[test]
fn the_full_compute_instance_may_need_the_nvl_profile() {
    let quirks = GpuQuirks {
        ci_7_slice_nvl: true,
        ..GpuQuirks::default()
    };
    let host = host_of(
        vec![quirky("H100-80GB", true, quirks)],
        // The plain 7-slice compute profile (index 4) is not offered.
        vec![
            FaultConfig::error(
                "nvmlGpuInstanceGetComputeInstanceProfileInfo",
                code::NOT_SUPPORTED,
            )
            .on_profile(4),
        ],
    );
    let nvml = backend(&host);
    let gi = nvml.create_gpu_instance(0, P_7G, 0).unwrap();
    let ci = nvml.create_full_compute_instance(0, gi).unwrap();
    assert!(ci.mig_uuid.starts_with("MIG-"));
    let state = host.read_state().unwrap();
    assert_eq!(state.gpus[0].gpu_instances[0].compute_instances[0].profile_id, 8);
}

#[test]
fn an_architecture_newer_than_migdra_knows_switches_like_hopper() {
    let quirks = GpuQuirks {
        architecture: Some(11),
        ..GpuQuirks::default()
    };
    let host = host_of(vec![quirky("H100-80GB", false, quirks)], vec![]);
    let gpu = backend(&host).discover().unwrap().remove(0);
    assert_eq!(gpu.architecture, None);
    assert!(mode_switchable(&gpu));
}

/// A GPU that a MIG-mode change renumbered: the claim that switched it fails (its device
/// name has the old minor), and the next inventory moves the GPU to its new minor rather
/// than keeping a ghost at the old one.
#[tokio::test(flavor = "multi_thread")]
async fn a_renumbered_gpu_moves_to_its_new_minor() {
    let quirks = GpuQuirks {
        minor_after_mode_change: Some(7),
        ..GpuQuirks::default()
    };
    let node = Node::with_config(FakeConfig {
        gpus: vec![quirky("H100-80GB", false, quirks)],
        ..FakeConfig::default()
    });
    let (driver, _) = node.start(None);
    node.claims
        .put(claim("uid-1", "c1", &[("gpu", "gpu-0-mig-3g40gb-4")]));
    let err = prepare_typed(&driver, "uid-1", "c1").await.unwrap_err();
    assert!(err.to_string().contains("renumbered"), "{err}");
    assert_eq!(node.total_instances(), 0, "nothing was created for the old minor");
    let inventory = driver.gpus().inventory().unwrap();
    let minors: Vec<u32> = inventory.iter().map(|g| g.minor).collect();
    assert_eq!(minors, vec![7]);
    assert!(inventory[0].health.healthy);
    // The same claim against the new name works.
    node.claims
        .put(claim("uid-2", "c2", &[("gpu", "gpu-7-mig-3g40gb-4")]));
    prepare_one(&driver, "uid-2", "c2").await.unwrap();
    assert_eq!(node.instances(0).len(), 1);
}

/// Whether an Ampere GPU's MIG mode can be switched is NVML's answer, not the plan's: an
/// idle bare-metal GPU is reset by the driver itself; one the driver cannot reset stays
/// pending, and the claim is refused as such.
#[tokio::test(flavor = "multi_thread")]
async fn ampere_mode_switches_are_left_to_nvml() {
    let no_reset = GpuQuirks {
        no_driver_reset: true,
        ..GpuQuirks::default()
    };
    let node = Node::with_config(FakeConfig {
        gpus: vec![
            GpuConfig::new("A100-SXM4-40GB", false),
            GpuConfig::new("A100-SXM4-40GB", true),
            quirky("A100-SXM4-40GB", false, no_reset),
        ],
        ..FakeConfig::default()
    });
    let (driver, _) = node.start(None);
    node.claims
        .put(claim("uid-1", "mig-on-idle", &[("gpu", "gpu-0-mig-1g5gb-0")]));
    prepare_one(&driver, "uid-1", "mig-on-idle").await.unwrap();
    node.claims
        .put(claim("uid-2", "whole-on-mig", &[("gpu", "gpu-1")]));
    prepare_one(&driver, "uid-2", "whole-on-mig").await.unwrap();
    node.claims
        .put(claim("uid-3", "mig-no-reset", &[("gpu", "gpu-2-mig-1g5gb-0")]));
    let err = prepare_typed(&driver, "uid-3", "mig-no-reset").await.unwrap_err();
    assert!(
        matches!(
            err,
            migdra_kubelet_plugin::driver::ClaimFailure::Rejected(
                migdra_kubelet_plugin::plan::Rejection::MigModeChangePending { minor: 2, .. }
            )
        ),
        "{err}"
    );
    let state = node.host.read_state().unwrap();
    let modes: Vec<(bool, bool)> = state
        .gpus
        .iter()
        .map(|g| (g.mig_enabled, g.mig_pending))
        .collect();
    // The refused switch is withdrawn: nothing is left pending for a later reset.
    assert_eq!(modes, vec![(true, true), (false, false), (false, false)]);
    assert_eq!(node.instances(0).len(), 1);
}

/// The `(path, minor)` of every device node a claim's CDI spec hands its container.
fn cdi_device_nodes(node: &Node, uid: &str) -> Vec<(String, u64)> {
    node.cdi_spec(uid)["devices"][0]["containerEdits"]["deviceNodes"]
        .as_array()
        .expect("device nodes")
        .iter()
        .map(|n| {
            (
                n["path"].as_str().expect("path").to_string(),
                n["minor"].as_u64().expect("minor"),
            )
        })
        .collect()
}

/// The fake's position (its NVML index) of the GPU with device `minor`.
fn state_index_of_minor(node: &Node, minor: u32) -> usize {
    node.host
        .read_state()
        .expect("fake state")
        .gpus
        .iter()
        .position(|g| g.minor == minor)
        .unwrap_or_else(|| panic!("no GPU with minor {minor}"))
}

/// NVML numbers GPUs by PCI order, the driver by device minor, and the two can differ
/// (§12). Two identical H100s whose minors are swapped relative to their indexes: a device
/// name carries the minor, so every claim must land on the GPU with that minor, and its
/// CDI spec must name that minor's device node and capability minors.
#[tokio::test(flavor = "multi_thread")]
async fn devices_are_addressed_by_minor_when_indexes_differ() {
    let node = Node::with_config(FakeConfig {
        gpus: vec![
            GpuConfig::new("H100-80GB", true).with_minor(1),
            GpuConfig::new("H100-80GB", true).with_minor(0),
        ],
        ..FakeConfig::default()
    });
    assert_eq!(
        (state_index_of_minor(&node, 0), state_index_of_minor(&node, 1)),
        (1, 0)
    );
    let (driver, _) = node.start(None);

    // A 3g at 4 on minor 0 (index 1) and a 1g at 0 on minor 1 (index 0).
    node.claims
        .put(claim("uid-1", "on-minor-0", &[("gpu", "gpu-0-mig-3g40gb-4")]));
    node.claims
        .put(claim("uid-2", "on-minor-1", &[("gpu", "gpu-1-mig-1g10gb-0")]));
    prepare_one(&driver, "uid-1", "on-minor-0").await.unwrap();
    prepare_one(&driver, "uid-2", "on-minor-1").await.unwrap();
    let on = |minor| node.instances(state_index_of_minor(&node, minor));
    let (on_minor_0, on_minor_1) = (on(0), on(1));
    assert_eq!(on_minor_0.len(), 1, "{on_minor_0:?}");
    assert_eq!((on_minor_0[0].0, on_minor_0[0].1), (P_3G, 4));
    assert_eq!(on_minor_1.len(), 1, "{on_minor_1:?}");
    assert_eq!((on_minor_1[0].0, on_minor_1[0].1), (P_1G, 0));

    let state = node.host.read_state().unwrap();
    for (uid, minor, device) in [
        ("uid-1", 0, "GPU_0_MIG_3G40GB_4"),
        ("uid-2", 1, "GPU_1_MIG_1G10GB_0"),
    ] {
        let gpu = &state.gpus[state_index_of_minor(&node, minor)];
        let gi = &gpu.gpu_instances[0];
        let nodes = cdi_device_nodes(&node, uid);
        assert_eq!(
            nodes[0],
            (format!("/dev/nvidia{minor}"), u64::from(minor)),
            "{uid}: {nodes:?}"
        );
        assert!(
            !nodes
                .iter()
                .any(|(p, _)| *p == format!("/dev/nvidia{}", 1 - minor)),
            "{uid}: the other GPU's node: {nodes:?}"
        );
        let gi_cap = gi_cap_minor(minor, gi.id);
        let ci_cap = ci_cap_minor(minor, gi.id, gi.compute_instances[0].id);
        for cap in [gi_cap, ci_cap] {
            assert!(
                nodes.contains(&(format!("/dev/nvidia-caps/nvidia-cap{cap}"), u64::from(cap))),
                "{uid}: capability minor {cap} of GPU minor {minor} missing from {nodes:?}"
            );
        }
        let env = &node.cdi_spec(uid)["devices"][0]["containerEdits"]["env"][0];
        assert_eq!(
            env.as_str().unwrap(),
            format!("MIGDRA_DEVICE_UUID_{device}={}", gi.compute_instances[0].uuid)
        );
    }

    // Unprepare destroys the instance on minor 0 only.
    unprepare_one(&driver, "uid-1", "on-minor-0").await.unwrap();
    assert!(on(0).is_empty());
    assert_eq!(on(1).len(), 1, "the other GPU's instance stays");

    // Minor 0 whole: its MIG mode goes off (Hopper, idle), minor 1 keeps its instance.
    node.claims.put(claim("uid-3", "whole", &[("gpu", "gpu-0")]));
    let devices = prepare_one(&driver, "uid-3", "whole").await.unwrap();
    assert_eq!(devices[0].device_name, "gpu-0");
    let state = node.host.read_state().unwrap();
    let (minor_0, minor_1) = (
        &state.gpus[state_index_of_minor(&node, 0)],
        &state.gpus[state_index_of_minor(&node, 1)],
    );
    assert!(!minor_0.mig_enabled, "MIG switched off on minor 0");
    assert!(minor_1.mig_enabled && minor_1.gpu_instances.len() == 1);
    let nodes = cdi_device_nodes(&node, "uid-3");
    assert_eq!(nodes[0], ("/dev/nvidia0".to_string(), 0), "{nodes:?}");
    assert!(!nodes.iter().any(|(p, _)| p == "/dev/nvidia1"), "{nodes:?}");
    assert_eq!(
        node.cdi_spec("uid-3")["devices"][0]["containerEdits"]["env"][0],
        format!("MIGDRA_DEVICE_UUID_GPU_0={}", minor_0.uuid)
    );
    unprepare_one(&driver, "uid-3", "whole").await.unwrap();
    unprepare_one(&driver, "uid-2", "on-minor-1").await.unwrap();
    assert_eq!(node.total_instances(), 0);
}
