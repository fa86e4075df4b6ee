//! A hand-built cluster: one node with three GPUs and every case the views distinguish.
//!
//! * GPU 0 (H100, MIG on): `1g.10gb@0` created by migdra for `default/train-a-gpu` (pod
//!   `train-a` running, `Ready` condition and MIG UUID in the claim status); `1g.10gb@2`
//!   allocated to `default/infer-b-gpu` but not created (the pod's prepare failed); a foreign
//!   `3g.40gb@4`.
//! * GPU 1 (H100, MIG off, switchable): the whole GPU allocated to `default/whole`, used by
//!   pod `whole-pod` (running; the plugin wrote no status).
//! * GPU 2 (A100-40GB, MIG on, unhealthy): a migdra `1g.5gb@0` whose recorded claim is gone.
//! * A pending claim in `team-b` asking for the chart's MIG class, and a claim of another
//!   driver that every view must ignore.
//!
//! The ResourceSlices are what migdra-api's slice model publishes for this inventory.

use k8s_openapi::{
    api::{
        core::v1::{Event, Pod},
        resource::v1::{DeviceClass, ResourceClaim, ResourceSlice},
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kubectl_migdra::snapshot::Snapshot;
use migdra_api::{
    catalog,
    geometry::gpu_instance_id,
    inventory::{
        GpuHealth, GpuInventory, GpuNode, GpuNodeSpec, GpuNodeStatus, InstanceOwner, MigInstance,
        PublicationStatus, pool_name,
    },
    policy::EffectivePolicy,
    profile::ProfileName,
    slices::{PoolIdentity, plan_pool, render_pool},
};
use serde_json::{Value, json};

pub const DRIVER: &str = "gpu.migdra.dev";
pub const NODE: &str = "gpu-node-a";

fn instance(
    gpu: &GpuInventory,
    profile: &str,
    start: u32,
    owner: InstanceOwner,
    claim: Option<&str>,
) -> MigInstance {
    let mig = gpu.mig.as_ref().unwrap();
    let name: ProfileName = profile.parse().unwrap();
    let p = mig.geometry.profile_by_name(&name).unwrap();
    // Through serde, so fields later versions add (all optional) take their defaults.
    serde_json::from_value(json!({
        "profile": name.to_string(),
        "placement": {"profileId": p.gi_profile_id, "start": start},
        "gpuInstanceId": gpu_instance_id(start, p.memory_slices, mig.geometry.budget.memory_slices, false),
        "owner": owner,
        "claim": claim,
    }))
    .unwrap()
}

/// The node's GPU inventory.
pub fn gpus() -> Vec<GpuInventory> {
    let h100 = catalog::model("H100-80GB").unwrap();
    let a100 = catalog::model("A100-SXM4-40GB").unwrap();
    let mut gpu0 = h100.inventory(0, true);
    let instances = vec![
        instance(
            &gpu0,
            "1g.10gb",
            0,
            InstanceOwner::Migdra,
            Some("default/train-a-gpu"),
        ),
        instance(&gpu0, "3g.40gb", 4, InstanceOwner::Foreign, None),
    ];
    gpu0.mig.as_mut().unwrap().instances = instances;
    let gpu1 = h100.inventory(1, false);
    let mut gpu2 = a100.inventory(2, true);
    let leaked = instance(&gpu2, "1g.5gb", 0, InstanceOwner::Migdra, Some("default/gone"));
    gpu2.mig.as_mut().unwrap().instances = vec![leaked];
    gpu2.health = GpuHealth {
        healthy: false,
        reason: Some("XID 79: GPU has fallen off the bus".into()),
    };
    vec![gpu0, gpu1, gpu2]
}

fn meta(namespace: Option<&str>, name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: namespace.map(str::to_string),
        ..ObjectMeta::default()
    }
}

/// The GpuNode of [`NODE`] carrying `gpus`.
pub fn gpu_node(gpus: Vec<GpuInventory>) -> GpuNode {
    let mut node = GpuNode::new(
        NODE,
        GpuNodeSpec {
            node_name: NODE.into(),
            driver: DRIVER.into(),
        },
    );
    node.status = Some(GpuNodeStatus {
        plugin: Some(
            serde_json::from_value(json!({
                "version": "0.1.0",
                "registered": true,
                "startTime": "2026-12-01T20:00:00Z",
                "driverVersion": "580.82.07",
            }))
            .unwrap(),
        ),
        gpus: Some(gpus),
        publication: Some(PublicationStatus {
            pool: pool_name(NODE, DRIVER),
            generation: 1,
            gpus: 3,
            ..PublicationStatus::default()
        }),
        ..GpuNodeStatus::default()
    });
    node
}

/// The slices migdra-api's model publishes for `gpus` under `policy`.
pub fn slices(gpus: &[GpuInventory], policy: &EffectivePolicy) -> Vec<ResourceSlice> {
    let pool = pool_name(NODE, DRIVER);
    let plan = plan_pool(gpus, policy);
    let id = PoolIdentity {
        driver: DRIVER,
        node: NODE,
        pool: &pool,
        generation: 1,
        driver_version: Some("580.82.07"),
    };
    render_pool(&id, gpus, &plan)
        .into_iter()
        .enumerate()
        .map(|(i, spec)| ResourceSlice {
            metadata: meta(None, &format!("{NODE}-{DRIVER}-{i:03}")),
            spec,
        })
        .collect()
}

fn claim(namespace: &str, name: &str, status: Value) -> ResourceClaim {
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "mig.migdra.dev"}}]}},
        "status": status,
    }))
    .unwrap()
}

fn allocated(device: &str, driver: &str, reserved_for: &[&str]) -> Value {
    json!({
        "allocation": {"devices": {"results": [
            {"request": "gpu", "driver": driver, "pool": pool_name(NODE, driver), "device": device}
        ]}},
        "reservedFor": reserved_for.iter().map(|p| json!({"resource": "pods", "name": p, "uid": format!("uid-{p}")})).collect::<Vec<_>>(),
    })
}

/// The claims.
pub fn claims() -> Vec<ResourceClaim> {
    let pool = pool_name(NODE, DRIVER);
    let mut train = allocated("gpu-0-mig-1g10gb-0", DRIVER, &["train-a"]);
    train["devices"] = json!([{
        "driver": DRIVER, "pool": pool, "device": "gpu-0-mig-1g10gb-0",
        "conditions": [{"type": "Ready", "status": "True", "reason": "Prepared", "message": "MIG instance created",
            "lastTransitionTime": "2026-12-01T20:00:00Z"}],
        "data": {"type": "mig", "uuid": "MIG-11111111-2222-3333-4444-555555555555", "parentUUID": "GPU-x",
            "gpuIndex": 0, "gpuMinor": 0, "gpuInstanceID": 7, "computeInstanceID": 0, "profile": "1g.10gb",
            "placement": {"start": 0, "size": 1}},
    }]);
    vec![
        claim("default", "train-a-gpu", train),
        claim(
            "default",
            "infer-b-gpu",
            allocated("gpu-0-mig-1g10gb-2", DRIVER, &["infer-b"]),
        ),
        claim("default", "whole", allocated("gpu-1", DRIVER, &["whole-pod"])),
        claim("team-b", "waiting", json!({})),
        claim(
            "default",
            "other-driver",
            allocated("nic-0", "net.example.com", &[]),
        ),
    ]
}

fn pod(name: &str, phase: &str, claim: Value) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": claim["namespace"].as_str().unwrap_or("default"), "uid": format!("uid-{name}")},
        "spec": {"containers": [{"name": "main", "image": "busybox"}], "resourceClaims": claim["spec"].clone()},
        "status": {"phase": phase, "resourceClaimStatuses": claim["status"].clone()},
    }))
    .unwrap()
}

/// The pods: two use claims generated from templates, one names its claim directly.
pub fn pods() -> Vec<Pod> {
    let generated = |claim: &str| {
        json!({"spec": [{"name": "gpu", "resourceClaimTemplateName": "t"}],
               "status": [{"name": "gpu", "resourceClaimName": claim}]})
    };
    let mut waiting = generated("waiting");
    waiting["namespace"] = json!("team-b");
    vec![
        pod("train-a", "Running", generated("train-a-gpu")),
        pod("infer-b", "Pending", generated("infer-b-gpu")),
        pod(
            "whole-pod",
            "Running",
            json!({"spec": [{"name": "gpu", "resourceClaimName": "whole"}], "status": []}),
        ),
        pod("waiter", "Pending", waiting),
    ]
}

/// The kubelet's prepare failure on `infer-b`, as it reports a plugin error.
pub fn events() -> Vec<Event> {
    let event = |name: &str, time: &str, message: &str| -> Event {
        serde_json::from_value(json!({
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": "default"},
            "involvedObject": {"kind": "Pod", "namespace": "default", "name": "infer-b"},
            "reason": "FailedPrepareDynamicResources",
            "type": "Warning",
            "lastTimestamp": time,
            "message": message,
        }))
        .unwrap()
    };
    vec![
        event("infer-b.1", "2026-12-01T20:00:01Z", "older message"),
        event(
            "infer-b.2",
            "2026-12-01T20:00:05Z",
            "Failed to prepare dynamic resources: prepare dynamic resources: NodePrepareResources failed for ResourceClaim infer-b-gpu: creating GPU instance 1g.10gb@2 on GPU 0: NVML: Insufficient resources",
        ),
    ]
}

fn device_class() -> DeviceClass {
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "mig.migdra.dev"},
        "spec": {"selectors": [{"cel": {"expression": "device.driver == \"gpu.migdra.dev\" && device.attributes[\"gpu.migdra.dev\"].type == \"mig\""}}]},
    }))
    .unwrap()
}

/// The default policy in `Dynamic` MIG mode: the fixture's GPUs offer partitions and whole
/// GPUs whatever their mode.
pub fn dynamic() -> EffectivePolicy {
    EffectivePolicy {
        mig_mode: migdra_api::policy::MigMode::Dynamic,
        ..EffectivePolicy::default()
    }
}

/// The whole snapshot.
pub fn snapshot() -> Snapshot {
    let gpus = gpus();
    let mut snapshot = Snapshot::new(DRIVER);
    snapshot.slices = slices(&gpus, &dynamic());
    snapshot.gpu_nodes = vec![gpu_node(gpus)];
    snapshot.claims = claims();
    snapshot.pods = pods();
    snapshot.events = events();
    snapshot.device_classes = vec![device_class()];
    snapshot
}
