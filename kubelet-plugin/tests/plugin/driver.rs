//! The prepare/unprepare state machine, through the production NVML backend against the
//! fake NVML library: creation and destruction, user errors, conflicts, idempotency.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::collections::BTreeMap;

use migdra_api::geometry::PlacementError;
use migdra_api::inventory::InstanceOwner;
use migdra_fake_nvml::config::{FakeConfig, GpuConfig, InstanceConfig};
use migdra_kubelet_plugin::{
    checkpoint::ClaimState,
    claims::ClaimError,
    driver::{ClaimFailure, NodeAccessError},
    metrics::Metrics,
    nvml::{BackendError, NvmlErrorKind},
    plan::Rejection,
    state_dir::NodeLockError,
};
use migdra_testkit::plugin::*;
use serde_json::json;

const H100_3G_AT_4: &str = "gpu-0-mig-3g40gb-4";

#[tokio::test(flavor = "multi_thread")]
async fn prepare_creates_the_allocated_instance_and_unprepare_destroys_it() {
    let node = Node::new(&[("H100-80GB", true)]);
    let (driver, _) = node.start(None);
    node.claims.put(claim("uid-1", "c1", &[("gpu", H100_3G_AT_4)]));

    let devices = prepare_one(&driver, "uid-1", "c1").await.unwrap();
    assert_eq!(devices.len(), 1);
    assert_eq!(devices[0].pool_name, POOL);
    assert_eq!(devices[0].device_name, H100_3G_AT_4);
    assert_eq!(devices[0].request_names, vec!["gpu".to_string()]);
    assert_eq!(
        devices[0].cdi_device_ids,
        vec![
            format!("gpu.migdra.dev/claim=uid-1-{H100_3G_AT_4}"),
            DRIVER_DEVICE_ID.to_string()
        ],
        "the claim's device and the node-wide driver device"
    );

    // Exactly the allocated placement exists: 3g is GI profile 9, at memory slice 4.
    let instances = node.instances(0);
    assert_eq!(instances.len(), 1);
    let (profile, start, cis) = &instances[0];
    assert_eq!((*profile, *start), (9, 4));
    assert_eq!(cis.len(), 1, "the full compute instance exists");
    let mig_uuid = &cis[0];
    assert!(mig_uuid.starts_with("MIG-"));

    // The CDI spec hands the container exactly that instance.
    let spec = node.cdi_spec("uid-1");
    let edits = &spec["devices"][0]["containerEdits"];
    assert_eq!(
        edits["env"],
        json!([format!("MIGDRA_DEVICE_UUID_GPU_0_MIG_3G40GB_4={mig_uuid}")]),
        "only the device's own UUID variable; NVIDIA_VISIBLE_DEVICES is the driver spec's"
    );
    let paths: Vec<&str> = edits["deviceNodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["path"].as_str().unwrap())
        .collect();
    assert_eq!(
        &paths[..4],
        [
            "/dev/nvidia0",
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/nvidia-uvm-tools"
        ]
    );
    assert_eq!(paths.len(), 6, "plus the GI and CI capability nodes: {paths:?}");
    assert!(
        paths[4].starts_with("/dev/nvidia-caps/nvidia-cap")
            && paths[5].starts_with("/dev/nvidia-caps/nvidia-cap")
    );

    // Idempotent: a second prepare answers the same without creating anything.
    let again = prepare_one(&driver, "uid-1", "c1").await.unwrap();
    assert_eq!(again, devices);
    assert_eq!(node.total_instances(), 1);
    assert_eq!(
        node.instances(0)[0].2[0],
        *mig_uuid,
        "the same instance, not a re-created one"
    );

    unprepare_one(&driver, "uid-1", "c1").await.unwrap();
    assert_eq!(node.total_instances(), 0);
    assert!(node.cdi_specs().is_empty());
    assert!(driver.recorded_claims().is_empty());
    // Unprepare is idempotent too, and unknown claims succeed.
    unprepare_one(&driver, "uid-1", "c1").await.unwrap();
    unprepare_one(&driver, "never-prepared", "x").await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn recreating_an_instance_yields_a_fresh_mig_uuid() {
    let node = Node::new(&[("A100-SXM4-40GB", true)]);
    let (driver, _) = node.start(None);
    node.claims
        .put(claim("uid-1", "c1", &[("gpu", "gpu-0-mig-1g5gb-3")]));
    prepare_one(&driver, "uid-1", "c1").await.unwrap();
    let first = node.instances(0)[0].2[0].clone();
    unprepare_one(&driver, "uid-1", "c1").await.unwrap();
    node.claims
        .put(claim("uid-2", "c2", &[("gpu", "gpu-0-mig-1g5gb-3")]));
    prepare_one(&driver, "uid-2", "c2").await.unwrap();
    let second = node.instances(0)[0].2[0].clone();
    assert_ne!(first, second);
    assert_eq!(
        node.cdi_spec("uid-2")["devices"][0]["containerEdits"]["env"][0],
        format!("MIGDRA_DEVICE_UUID_GPU_0_MIG_1G5GB_3={second}")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn several_devices_and_requests_in_one_claim() {
    let node = Node::new(&[("H100-80GB", true), ("H100-80GB", true)]);
    let (driver, _) = node.start(None);
    node.claims.put(claim(
        "uid-1",
        "c1",
        &[
            ("a", "gpu-0-mig-1g10gb-0"),
            ("a", "gpu-0-mig-1g10gb-1"),
            ("b/small", "gpu-1-mig-2g20gb-2"),
        ],
    ));
    let devices = prepare_one(&driver, "uid-1", "c1").await.unwrap();
    assert_eq!(devices.len(), 3);
    assert_eq!(
        devices[2].request_names,
        vec!["b".to_string()],
        "subrequests are reported by their base request"
    );
    assert_eq!(node.instances(0).len(), 2);
    assert_eq!(node.instances(1).len(), 1);
    let spec = node.cdi_spec("uid-1");
    let env = |i: usize| {
        spec["devices"][i]["containerEdits"]["env"][0]
            .as_str()
            .unwrap()
            .to_string()
    };
    // Each device sets only its own variable, so a container with all of them sees each.
    let uuid_of = |gpu: usize, start: u32| {
        node.instances(gpu)
            .iter()
            .find(|i| i.1 == start)
            .map(|i| i.2[0].clone())
            .unwrap()
    };
    assert_eq!(
        env(0),
        format!("MIGDRA_DEVICE_UUID_GPU_0_MIG_1G10GB_0={}", uuid_of(0, 0))
    );
    assert_eq!(
        env(1),
        format!("MIGDRA_DEVICE_UUID_GPU_0_MIG_1G10GB_1={}", uuid_of(0, 1))
    );
    assert_eq!(
        env(2),
        format!("MIGDRA_DEVICE_UUID_GPU_1_MIG_2G20GB_2={}", uuid_of(1, 2))
    );
    for device in &devices {
        assert_eq!(device.cdi_device_ids[1], DRIVER_DEVICE_ID);
    }
    unprepare_one(&driver, "uid-1", "c1").await.unwrap();
    assert_eq!(node.total_instances(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn whole_gpu_switches_mig_mode_where_no_reset_is_needed() {
    let node = Node::new(&[("H100-80GB", true)]);
    let (driver, _) = node.start(None);
    node.claims.put(claim("uid-1", "whole", &[("gpu", "gpu-0")]));
    let devices = prepare_one(&driver, "uid-1", "whole").await.unwrap();
    assert_eq!(devices[0].device_name, "gpu-0");
    let state = node.host.read_state().unwrap();
    assert!(
        !state.gpus[0].mig_enabled,
        "MIG mode switched off for the whole GPU"
    );
    let env = node.cdi_spec("uid-1")["devices"][0]["containerEdits"]["env"][0]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(env, format!("MIGDRA_DEVICE_UUID_GPU_0={}", state.gpus[0].uuid));
    unprepare_one(&driver, "uid-1", "whole").await.unwrap();

    node.claims.put(claim("uid-2", "mig", &[("gpu", H100_3G_AT_4)]));
    prepare_one(&driver, "uid-2", "mig").await.unwrap();
    assert!(
        node.host.read_state().unwrap().gpus[0].mig_enabled,
        "switched back on for a partition"
    );
    assert_eq!(node.instances(0).len(), 1);
}

/// Asserts that a failed prepare left nothing behind.
fn assert_nothing_created(node: &Node, driver: &TestDriver) {
    assert_eq!(node.total_instances(), 0);
    assert!(node.cdi_specs().is_empty());
    assert!(driver.recorded_claims().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn user_errors_are_clear_and_create_nothing() {
    let node = Node::new(&[("H100-80GB", true)]);
    let (driver, _) = node.start(None);
    let cases: Vec<(&str, k8s_openapi::api::resource::v1::ResourceClaim, &str)> = vec![
        (
            "unknown profile",
            claim("u1", "c1", &[("gpu", "gpu-0-mig-1g5gb-0")]),
            "UnknownProfile",
        ),
        (
            "invalid start",
            claim("u2", "c2", &[("gpu", "gpu-0-mig-3g40gb-2")]),
            "InvalidPlacement",
        ),
        (
            "no such GPU",
            claim("u3", "c3", &[("gpu", "gpu-7-mig-3g40gb-4")]),
            "NoSuchGpu",
        ),
        (
            "foreign device name",
            claim("u4", "c4", &[("gpu", "nic-0")]),
            "InvalidDeviceName",
        ),
        (
            "another node",
            claim_with(
                "u5",
                "c5",
                "node-b/gpu.migdra.dev",
                &[("gpu", H100_3G_AT_4)],
                json!([]),
            ),
            "OtherPool",
        ),
        (
            "unknown config field",
            claim_with(
                "u6",
                "c6",
                POOL,
                &[("gpu", H100_3G_AT_4)],
                json!([{"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {"apiVersion": "gpu.migdra.dev/v1alpha1", "kind": "DeviceConfig", "sharing": "mps"}}}]),
            ),
            "InvalidConfig",
        ),
        (
            "unknown config kind",
            claim_with(
                "u7",
                "c7",
                POOL,
                &[("gpu", H100_3G_AT_4)],
                json!([{"source": "FromClass", "opaque": {"driver": DRIVER, "parameters": {"apiVersion": "gpu.migdra.dev/v1alpha1", "kind": "GpuConfig"}}}]),
            ),
            "InvalidConfig",
        ),
        (
            "overlapping devices in one claim",
            claim(
                "u8",
                "c8",
                &[("a", "gpu-0-mig-3g40gb-4"), ("b", "gpu-0-mig-2g20gb-4")],
            ),
            "PlacementOverlap",
        ),
        (
            "whole GPU and a partition of it",
            claim("u9", "c9", &[("a", "gpu-0-mig-3g40gb-4"), ("b", "gpu-0")]),
            "WholeGpuAlsoPartitioned",
        ),
        (
            "partition of a GPU allocated whole",
            claim("u11", "c11", &[("b", "gpu-0"), ("a", "gpu-0-mig-3g40gb-4")]),
            "PartitionOfWholeGpu",
        ),
    ];
    for (what, object, expected) in cases {
        let uid = object.metadata.uid.clone().unwrap();
        let name = object.metadata.name.clone().unwrap();
        node.claims.put(object);
        let err = prepare_typed(&driver, &uid, &name).await.expect_err(what);
        assert_eq!(err.reason(), expected, "{what}: {err}");
        assert_nothing_created(&node, &driver);
    }
    // A config for another driver is none of our business.
    node.claims.put(claim_with(
        "u10",
        "c10",
        POOL,
        &[("gpu", H100_3G_AT_4)],
        json!([{"source": "FromClaim", "opaque": {"driver": "other.example.com", "parameters": {"anything": 1}}}]),
    ));
    prepare_one(&driver, "u10", "c10").await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn configured_environment_reaches_the_cdi_spec() {
    let node = Node::new(&[("H100-80GB", true)]);
    let (driver, _) = node.start(None);
    let config = json!([
        {"source": "FromClass", "opaque": {"driver": DRIVER, "parameters": {"apiVersion": "gpu.migdra.dev/v1alpha1", "kind": "DeviceConfig", "env": {"A": "class", "B": "class"}}}},
        {"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {"apiVersion": "gpu.migdra.dev/v1alpha1", "kind": "DeviceConfig", "env": {"A": "claim"}}}}
    ]);
    node.claims
        .put(claim_with("u1", "c1", POOL, &[("gpu", H100_3G_AT_4)], config));
    prepare_one(&driver, "u1", "c1").await.unwrap();
    let env: Vec<String> =
        serde_json::from_value(node.cdi_spec("u1")["devices"][0]["containerEdits"]["env"].clone()).unwrap();
    assert!(
        env.contains(&"A=claim".to_string()) && env.contains(&"B=class".to_string()),
        "{env:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn claim_lookup_failures_are_reported_per_claim() {
    let node = Node::new(&[("H100-80GB", true)]);
    let (driver, _) = node.start(None);
    node.claims
        .put(claim("uid-new", "replaced", &[("gpu", H100_3G_AT_4)]));
    let mut not_allocated = claim("uid-na", "pending", &[]);
    not_allocated.status = None;
    node.claims.put(not_allocated);
    node.claims
        .put(claim("uid-ok", "fine", &[("gpu", "gpu-0-mig-1g10gb-0")]));
    let out = driver
        .prepare_claims(vec![
            claim_ref("uid-old", "replaced"),
            claim_ref("uid-na", "pending"),
            claim_ref("uid-x", "missing"),
            claim_ref("uid-ok", "fine"),
        ])
        .await;
    assert_eq!(out.len(), 4);
    assert!(matches!(
        out["uid-old"],
        Err(ClaimFailure::Claim(ClaimError::Replaced { ref expected, ref actual, .. }))
            if expected == "uid-old" && actual == "uid-new"
    ));
    assert!(matches!(
        out["uid-na"],
        Err(ClaimFailure::Claim(ClaimError::NotAllocated { .. }))
    ));
    assert!(matches!(
        out["uid-x"],
        Err(ClaimFailure::Claim(ClaimError::NotFound { ref claim })) if claim == "default/missing"
    ));
    assert!(out["uid-ok"].is_ok(), "one bad claim does not fail the others");
    assert_eq!(node.total_instances(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn foreign_instances_block_their_placement_and_are_never_touched() {
    let node = Node::with_config(FakeConfig {
        gpus: vec![GpuConfig::new("H100-80GB", true)],
        instances: vec![InstanceConfig {
            gpu: 0,
            profile_id: 19,
            start: 6,
        }],
        ..FakeConfig::default()
    });
    let foreign = node.instances(0);
    assert_eq!(foreign.len(), 1);
    let (driver, _) = node.start(None);
    node.claims.put(claim("u1", "c1", &[("gpu", H100_3G_AT_4)]));
    let err = prepare_typed(&driver, "u1", "c1").await.unwrap_err();
    assert!(
        matches!(
            err,
            ClaimFailure::Rejected(Rejection::PlacementUnavailable {
                cause: PlacementError::Overlap { other_start: 6, .. },
                ..
            })
        ),
        "{err}"
    );
    node.claims
        .put(claim("u2", "c2", &[("gpu", "gpu-0-mig-4g40gb-0")]));
    prepare_one(&driver, "u2", "c2").await.unwrap();
    unprepare_one(&driver, "u2", "c2").await.unwrap();
    assert_eq!(node.instances(0), foreign, "the foreign instance survived");

    // The inventory reports it as foreign, ours as ours.
    node.claims
        .put(claim("u3", "c3", &[("gpu", "gpu-0-mig-2g20gb-0")]));
    prepare_one(&driver, "u3", "c3").await.unwrap();
    let inventory = driver.gpus().inventory().unwrap();
    let owners: BTreeMap<u32, InstanceOwner> = inventory[0]
        .mig
        .as_ref()
        .unwrap()
        .instances
        .iter()
        .map(|i| (i.placement.start, i.owner))
        .collect();
    assert_eq!(
        owners,
        BTreeMap::from([(0, InstanceOwner::Migdra), (6, InstanceOwner::Foreign)])
    );
    let ours = inventory[0]
        .mig
        .as_ref()
        .unwrap()
        .instances
        .iter()
        .find(|i| i.owner == InstanceOwner::Migdra)
        .unwrap();
    assert_eq!(ours.claim.as_deref(), Some("default/c3"));
}

#[tokio::test(flavor = "multi_thread")]
async fn devices_of_another_prepared_claim_are_refused() {
    let node = Node::new(&[("H100-80GB", true)]);
    let (driver, _) = node.start(None);
    node.claims.put(claim("u1", "c1", &[("gpu", H100_3G_AT_4)]));
    prepare_one(&driver, "u1", "c1").await.unwrap();
    node.claims
        .put(claim("u2", "c2", &[("gpu", "gpu-0-mig-1g10gb-5")]));
    let held_by_c1 = |err: &ClaimFailure| {
        matches!(err, ClaimFailure::Rejected(Rejection::InUseByClaim { other_claim, other_uid, .. })
            if other_claim == "default/c1" && other_uid == "u1")
    };
    let err = prepare_typed(&driver, "u2", "c2").await.unwrap_err();
    assert!(held_by_c1(&err), "{err}");
    node.claims.put(claim("u3", "c3", &[("gpu", "gpu-0")]));
    let err = prepare_typed(&driver, "u3", "c3").await.unwrap_err();
    assert!(held_by_c1(&err), "{err}");
    // The kubelet sees the same cause as a message naming the other claim.
    let message = prepare_one(&driver, "u3", "c3").await.unwrap_err();
    assert!(
        message.contains("already prepared for claim default/c1"),
        "{message}"
    );
    assert_eq!(node.total_instances(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn busy_instances_fail_unprepare_until_released() {
    let node = Node::new(&[("H100-80GB", true)]);
    let (driver, _) = node.start(None);
    node.claims.put(claim("u1", "c1", &[("gpu", H100_3G_AT_4)]));
    prepare_one(&driver, "u1", "c1").await.unwrap();
    node.host
        .update_state(|s| s.gpus[0].gpu_instances[0].compute_instances[0].busy = true)
        .unwrap();
    let err = unprepare_typed(&driver, "u1", "c1").await.unwrap_err();
    assert!(
        matches!(err, ClaimFailure::Backend(BackendError { kind: NvmlErrorKind::InUse, ref operation, .. })
            if operation.contains("destroy compute instance")),
        "{err}"
    );
    assert_eq!(driver.recorded_claims()["u1"].state, ClaimState::UnprepareStarted);
    assert_eq!(node.total_instances(), 1);
    node.host
        .update_state(|s| s.gpus[0].gpu_instances[0].compute_instances[0].busy = false)
        .unwrap();
    unprepare_one(&driver, "u1", "c1").await.unwrap();
    assert_eq!(node.total_instances(), 0);
    assert!(driver.recorded_claims().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn nvml_create_failure_rolls_back_the_claim() {
    let node = Node::with_config(FakeConfig {
        gpus: vec![GpuConfig::new("H100-80GB", true)],
        faults: vec![
            migdra_fake_nvml::config::FaultConfig::error("nvmlGpuInstanceCreateComputeInstance", 999)
                .times(1),
        ],
        ..FakeConfig::default()
    });
    let (driver, _) = node.start(None);
    node.claims.put(claim(
        "u1",
        "c1",
        &[("a", "gpu-0-mig-1g10gb-0"), ("b", "gpu-0-mig-1g10gb-1")],
    ));
    let err = prepare_typed(&driver, "u1", "c1").await.unwrap_err();
    assert!(
        matches!(err, ClaimFailure::Backend(ref e) if e.operation.contains("compute instance")),
        "{err}"
    );
    assert_nothing_created(&node, &driver);
    // The fault fired once; the kubelet's retry succeeds.
    let devices = prepare_one(&driver, "u1", "c1").await.unwrap();
    assert_eq!(devices.len(), 2);
    assert_eq!(node.total_instances(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_plugin_instance_waits_for_the_node_lock() {
    let node = Node::new(&[("H100-80GB", true)]);
    let (driver, _) = node.start(None);
    node.claims.put(claim("u1", "c1", &[("gpu", H100_3G_AT_4)]));
    let lock = std::fs::File::options()
        .write(true)
        .open(node.state_dir().join("plugin.lock"))
        .unwrap();
    lock.lock().unwrap();
    let err = prepare_typed(&driver, "u1", "c1").await.unwrap_err();
    assert!(
        matches!(err, ClaimFailure::NodeAccess(NodeAccessError::Lock(ref e)) if matches!(**e, NodeLockError::Held { .. })),
        "{err}"
    );
    let message = prepare_one(&driver, "u1", "c1").await.unwrap_err();
    assert!(
        message.contains("another plugin instance holds the node lock"),
        "{message}"
    );
    assert_eq!(node.total_instances(), 0);
    lock.unlock().unwrap();
    prepare_one(&driver, "u1", "c1").await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn health_follows_the_parent_gpu() {
    let node = Node::new(&[("H100-80GB", true), ("A100-SXM4-40GB", true)]);
    let (driver, _) = node.start(None);
    let inventory = driver.gpus().inventory().unwrap();
    let reports = driver.gpus().device_health(&inventory);
    // H100: 25 placements + whole GPU; A100: 25 placements + whole GPU (health covers every
    // device the node could publish).
    assert_eq!(reports.len(), 52);
    assert!(
        reports
            .iter()
            .all(|r| r.healthy == Some(true) && r.pool_name == POOL)
    );
    node.host.update_state(|s| s.gpus[1].lost = true).unwrap();
    let inventory = driver.gpus().inventory().unwrap();
    assert!(!inventory[1].health.healthy);
    let reports = driver.gpus().device_health(&inventory);
    assert!(
        reports
            .iter()
            .filter(|r| r.device_name.starts_with("gpu-1"))
            .all(|r| r.healthy == Some(false) && !r.message.is_empty())
    );
    assert!(
        reports
            .iter()
            .filter(|r| r.device_name.starts_with("gpu-0"))
            .all(|r| r.healthy == Some(true))
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn failures_are_counted_by_reason() {
    let node = Node::new(&[("H100-80GB", true)]);
    let metrics = Metrics::new();
    let (driver, _) = node.try_start_with(None, metrics.clone()).unwrap();
    node.claims
        .put(claim("u1", "c1", &[("gpu", "gpu-0-mig-1g5gb-0")]));
    node.claims.put(claim("u2", "c2", &[("gpu", H100_3G_AT_4)]));
    let out = driver
        .prepare_claims(vec![
            claim_ref("u1", "c1"),
            claim_ref("u2", "c2"),
            claim_ref("u3", "gone"),
        ])
        .await;
    assert_eq!(out["u1"].as_ref().unwrap_err().reason(), "UnknownProfile");
    assert_eq!(out["u3"].as_ref().unwrap_err().reason(), "ClaimNotFound");
    assert!(out["u2"].is_ok());
    let text = metrics.encode();
    for reason in ["UnknownProfile", "ClaimNotFound"] {
        let line = format!(
            r#"migdra_kubelet_plugin_claim_failures_total{{operation="prepare",reason="{reason}"}} 1"#
        );
        assert!(text.contains(&line), "{line} in\n{text}");
    }
    assert_eq!(
        text.matches("migdra_kubelet_plugin_claim_failures_total{")
            .count(),
        2,
        "the successful claim is no failure: {text}"
    );
}
