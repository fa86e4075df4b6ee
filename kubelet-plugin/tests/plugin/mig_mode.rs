//! MIG mode next to other GPU clients (dcgm-exporter, nv-hostengine, CUDA processes, a VM
//! without a GPU reset): what the node publishes under each MigPolicy `migMode`, and what a
//! prepare that needs a switch does, through the production NVML code against the fake.

use std::collections::BTreeSet;

use migdra_api::{
    inventory::GpuInventory,
    policy::{EffectivePolicy, MigMode},
    slices::{PlannedKind, plan_pool},
};
use migdra_fake_nvml::{FakeConfig, FaultConfig, GpuClient, GpuConfig, GpuQuirks, state::FakeState};
use migdra_kubelet_plugin::{driver::ClaimFailure, plan::Rejection};
use migdra_testkit::plugin::*;

const SET_MIG_MODE: &str = "nvmlDeviceSetMigMode";

/// A node with `gpus` whose fake counts the calls of nvmlDeviceSetMigMode (a fault that
/// changes nothing).
fn node_of(gpus: Vec<GpuConfig>) -> Node {
    Node::with_config(FakeConfig {
        gpus,
        faults: vec![FaultConfig::latency(SET_MIG_MODE, 0)],
        ..FakeConfig::default()
    })
}

/// How often nvmlDeviceSetMigMode was called.
fn mode_switch_calls(state: &FakeState) -> u32 {
    state
        .faults
        .iter()
        .filter(|f| f.fault.function == SET_MIG_MODE)
        .map(|f| f.hits)
        .sum()
}

fn policy(mig_mode: MigMode) -> EffectivePolicy {
    EffectivePolicy {
        mig_mode,
        ..EffectivePolicy::default()
    }
}

/// The device names the pool of `inventory` publishes under `mode`, per kind: (partitions of
/// each GPU minor, GPUs offered whole).
fn published(inventory: &[GpuInventory], mode: MigMode) -> (BTreeSet<u32>, BTreeSet<u32>) {
    let plan = plan_pool(inventory, &policy(mode));
    let mut partitions = BTreeSet::new();
    let mut whole = BTreeSet::new();
    for device in &plan.devices {
        match device.kind {
            PlannedKind::Mig { .. } => partitions.insert(device.gpu_minor),
            PlannedKind::Gpu => whole.insert(device.gpu_minor),
        };
    }
    (partitions, whole)
}

fn modes(state: &FakeState) -> Vec<(bool, bool)> {
    state
        .gpus
        .iter()
        .map(|g| (g.mig_enabled, g.mig_pending))
        .collect()
}

fn dcgm() -> GpuClient {
    GpuClient::nvml_session(4100, "nv-hostengine")
}

/// A GPU Operator node: dcgm-exporter's nv-hostengine holds both GPUs (one with MIG on, one
/// off). The default mode publishes what each GPU's mode serves, and prepares both kinds
/// without touching a mode.
#[tokio::test(flavor = "multi_thread")]
async fn the_default_mode_works_next_to_dcgm_without_a_switch() {
    let node = node_of(vec![
        GpuConfig::new("H100-80GB", true),
        GpuConfig::new("H100-80GB", false),
    ]);
    node.host
        .update_state(|s| s.gpus.iter_mut().for_each(|g| g.clients.push(dcgm())))
        .unwrap();
    let (driver, _) = node.start(None);
    let inventory = driver.gpus().inventory().unwrap();
    assert_eq!(
        published(&inventory, EffectivePolicy::default().mig_mode),
        (BTreeSet::from([0]), BTreeSet::from([1])),
        "partitions of the MIG GPU, the other GPU whole"
    );
    node.claims.put(claim(
        "uid-1",
        "both",
        &[("a", "gpu-0-mig-3g40gb-4"), ("b", "gpu-1")],
    ));
    prepare_one(&driver, "uid-1", "both").await.unwrap();
    assert_eq!(node.instances(0).len(), 1);
    let state = node.host.read_state().unwrap();
    assert_eq!(
        modes(&state),
        vec![(true, true), (false, false)],
        "no mode changed"
    );
    assert_eq!(mode_switch_calls(&state), 0);
}

/// The pool follows each mode on the same node, and a switch that processes block is not
/// offered even under `Dynamic`.
#[tokio::test(flavor = "multi_thread")]
async fn the_pool_follows_each_mode() {
    let node = node_of(vec![
        GpuConfig::new("H100-80GB", true),
        GpuConfig::new("H100-80GB", false),
        GpuConfig::new("A100-SXM4-40GB", false),
        GpuConfig::new("L4", false),
    ]);
    let (driver, _) = node.start(None);
    let inventory = driver.gpus().inventory().unwrap();
    let set = |minors: &[u32]| minors.iter().copied().collect::<BTreeSet<u32>>();
    let table = [
        (MigMode::Current, set(&[0]), set(&[1, 2, 3])),
        (MigMode::Mig, set(&[0]), set(&[3])),
        (MigMode::Whole, set(&[]), set(&[1, 2, 3])),
        // The A100 would need a reset to switch: whole only, as its mode is.
        (MigMode::Dynamic, set(&[0, 1]), set(&[0, 1, 2, 3])),
    ];
    for (mode, partitions, whole) in table {
        assert_eq!(published(&inventory, mode), (partitions, whole), "{mode:?}");
    }
    // A CUDA process on the MIG-off H100: its partitions are no longer offered.
    node.host
        .update_state(|s| s.gpus[1].clients.push(GpuClient::compute(4242, "python3", 1024)))
        .unwrap();
    let inventory = driver.gpus().inventory().unwrap();
    assert!(!inventory[1].mig.as_ref().unwrap().mode_switchable);
    assert_eq!(
        published(&inventory, MigMode::Dynamic),
        (set(&[0]), set(&[0, 1, 2, 3]))
    );
}

/// `Dynamic`, a partition on a MIG-off GPU that a CUDA process holds (the pool was published
/// before it started): the claim fails at once, naming the process; nothing is created and
/// the mode is unchanged.
#[tokio::test(flavor = "multi_thread")]
async fn a_switch_blocked_by_a_process_fails_at_once_with_the_process_list() {
    let node = node_of(vec![GpuConfig::new("H100-80GB", false)]);
    let (driver, _) = node.start(None);
    node.host
        .update_state(|s| {
            s.gpus[0].clients.push(GpuClient::compute(4242, "python3", 1024));
            s.gpus[0].clients.push(dcgm());
        })
        .unwrap();
    node.claims
        .put(claim("uid-1", "c1", &[("gpu", "gpu-0-mig-1g10gb-0")]));
    let err = prepare_typed(&driver, "uid-1", "c1").await.unwrap_err();
    match &err {
        ClaimFailure::Rejected(Rejection::MigModeSwitchBlocked {
            minor: 0,
            enabled: true,
            holders,
            ..
        }) => assert_eq!(holders, &vec!["pid 4242 (python3)".to_string()]),
        other => panic!("{other}"),
    }
    assert_eq!(err.reason(), "MigModeSwitchBlocked");
    let message = err.to_string();
    assert!(
        message.contains("in use by other processes: pid 4242 (python3)"),
        "{message}"
    );
    assert!(message.contains("left unchanged"), "{message}");
    let state = node.host.read_state().unwrap();
    assert_eq!(modes(&state), vec![(false, false)]);
    assert_eq!(node.total_instances(), 0);
    assert!(node.cdi_specs().is_empty());
    assert_eq!(mode_switch_calls(&state), 0, "the GPU is not even asked");
}

/// `Dynamic`, held only by an NVML session (DCGM), which no process query lists: NVML refuses
/// the switch as in use, and the claim fails at once saying so, with the mode unchanged; a
/// whole GPU on an empty MIG-on GPU the same way.
#[tokio::test(flavor = "multi_thread")]
async fn a_switch_nvml_refuses_as_in_use_fails_at_once() {
    let node = node_of(vec![
        GpuConfig::new("H100-80GB", false),
        GpuConfig::new("H100-80GB", true),
    ]);
    let (driver, _) = node.start(None);
    node.host
        .update_state(|s| s.gpus.iter_mut().for_each(|g| g.clients.push(dcgm())))
        .unwrap();
    for (uid, device, minor, enabled) in [
        ("uid-1", "gpu-0-mig-1g10gb-0", 0, true),
        ("uid-2", "gpu-1", 1, false),
    ] {
        node.claims.put(claim(uid, uid, &[("gpu", device)]));
        let err = prepare_typed(&driver, uid, uid).await.unwrap_err();
        match &err {
            ClaimFailure::Rejected(Rejection::MigModeSwitchBlocked {
                minor: m,
                enabled: e,
                holders,
                ..
            }) => {
                assert_eq!((*m, *e), (minor, enabled));
                assert!(holders.is_empty());
            }
            other => panic!("{other}"),
        }
        assert!(err.to_string().contains("nv-hostengine"), "{err}");
    }
    let state = node.host.read_state().unwrap();
    assert_eq!(
        modes(&state),
        vec![(false, false), (true, true)],
        "nothing pending"
    );
    assert_eq!(node.total_instances(), 0);
    // Once DCGM is stopped, the same claim goes through.
    node.host
        .update_state(|s| s.gpus.iter_mut().for_each(|g| g.clients.clear()))
        .unwrap();
    prepare_one(&driver, "uid-1", "uid-1").await.unwrap();
    assert_eq!(node.instances(0).len(), 1);
}

/// An Ampere passed through to a VM applies a mode change only with a reset the VM cannot do
/// (RESET_REQUIRED): refused before NVML is asked, so nothing is ever enabled and withdrawn.
/// Where NVML still answers with a pending change (a driver reset that failed on bare metal),
/// the change is put back at once.
#[tokio::test(flavor = "multi_thread")]
async fn reset_required_refuses_and_leaves_nothing_pending() {
    let no_reset = GpuQuirks {
        no_driver_reset: true,
        ..GpuQuirks::default()
    };
    let in_vm = GpuQuirks {
        virtualization_mode: 1,
        ..no_reset.clone()
    };
    let node = node_of(vec![
        GpuConfig::new("A100-SXM4-40GB", false).with_quirks(in_vm),
        GpuConfig::new("A100-SXM4-40GB", false).with_quirks(no_reset),
    ]);
    let (driver, _) = node.start(None);
    node.claims
        .put(claim("uid-1", "ampere", &[("gpu", "gpu-0-mig-1g5gb-0")]));
    let err = prepare_typed(&driver, "uid-1", "ampere").await.unwrap_err();
    assert!(
        matches!(
            err,
            ClaimFailure::Rejected(Rejection::MigModeNeedsReset {
                minor: 0,
                enabled: true,
                ..
            })
        ),
        "{err}"
    );
    assert!(err.to_string().contains("reset that this VM cannot do"), "{err}");
    let state = node.host.read_state().unwrap();
    assert_eq!(mode_switch_calls(&state), 0, "Ampere's mode is never touched");
    node.claims
        .put(claim("uid-2", "pending", &[("gpu", "gpu-1-mig-1g5gb-0")]));
    let err = prepare_typed(&driver, "uid-2", "pending").await.unwrap_err();
    assert!(
        matches!(
            err,
            ClaimFailure::Rejected(Rejection::MigModeChangePending { minor: 1, .. })
        ),
        "{err}"
    );
    let state = node.host.read_state().unwrap();
    assert_eq!(
        modes(&state),
        vec![(false, false), (false, false)],
        "nothing left pending"
    );
    assert_eq!(mode_switch_calls(&state), 2, "the change, and putting it back");
    assert_eq!(node.total_instances(), 0);
}

/// The slow calls of real drivers, set per test: a GPU-instance destroy of about a second and
/// a slow GetHandleByUUID (the re-open after a mode switch) stay inside the NVML call bound,
/// so a switching prepare and its unprepare go through.
#[tokio::test(flavor = "multi_thread")]
async fn slow_destroy_and_handle_lookup_are_waited_for() {
    let node = Node::with_config(FakeConfig {
        gpus: vec![GpuConfig::new("H100-80GB", false)],
        faults: vec![
            FaultConfig::latency("nvmlGpuInstanceDestroy", 1000),
            FaultConfig::latency("nvmlDeviceGetHandleByUUID", 300),
        ],
        ..FakeConfig::default()
    });
    let (driver, _) = node.start(None);
    node.claims
        .put(claim("uid-1", "c1", &[("gpu", "gpu-0-mig-1g10gb-0")]));
    prepare_one(&driver, "uid-1", "c1").await.unwrap();
    assert_eq!(node.instances(0).len(), 1);
    unprepare_one(&driver, "uid-1", "c1").await.unwrap();
    assert_eq!(node.total_instances(), 0);
    let state = node.host.read_state().unwrap();
    for function in ["nvmlGpuInstanceDestroy", "nvmlDeviceGetHandleByUUID"] {
        let hits: u32 = state
            .faults
            .iter()
            .filter(|f| f.fault.function == function)
            .map(|f| f.hits)
            .sum();
        assert!(hits >= 1, "{function} was slowed {hits} times");
    }
}
