//! The objects the controller reads, as the plugin, the kubelet and the API server write
//! them.

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time},
    jiff::Timestamp,
};
use migdra_api::{
    catalog,
    inventory::{GpuInventory, GpuNode, GpuNodeSpec, GpuNodeStatus, PluginStatus, heartbeat_lease_name},
};
use serde_json::Value;

use super::{DRIVER, NAMESPACE, NODE};

/// `count` H100 GPUs.
pub fn h100s(count: u32) -> Vec<GpuInventory> {
    let model = catalog::model("H100-80GB").expect("the H100 is in the catalog");
    (0..count).map(|minor| model.inventory(minor, true)).collect()
}

/// The plugin status of a registered plugin (its heartbeat is its Lease: see [`lease`]).
pub fn live_plugin() -> PluginStatus {
    plugin(true, Timestamp::now())
}

/// The plugin status of a plugin started at `started`.
pub fn plugin(registered: bool, started: Timestamp) -> PluginStatus {
    PluginStatus {
        version: "0.1.0".into(),
        registered,
        registration_error: None,
        start_time: Time(started),
        driver_version: Some("580.82.07".into()),
    }
}

/// A time `seconds` ago, in whole seconds: the Lease in the cache and the one a GET returns
/// then say the same.
pub fn ago(seconds: i64) -> Timestamp {
    let now = Timestamp::now().as_second();
    Timestamp::from_second(now - seconds).expect("a time after the epoch")
}

/// The GpuNode of `node-a` as the plugin writes it.
pub fn gpunode(plugin: Option<PluginStatus>, gpus: Vec<GpuInventory>) -> GpuNode {
    let mut g = GpuNode::new(
        NODE,
        GpuNodeSpec {
            node_name: NODE.into(),
            driver: DRIVER.into(),
        },
    );
    g.metadata.generation = Some(1);
    g.metadata.resource_version = Some("1".into());
    g.status = Some(GpuNodeStatus {
        plugin,
        gpus: Some(gpus),
        ..Default::default()
    });
    g
}

/// The GpuNode with the controller's status from a status patch merged in.
pub fn with_status_patch(mut g: GpuNode, patch: &Value) -> GpuNode {
    let status = g.status.get_or_insert_default();
    status.publication =
        serde_json::from_value(patch["status"]["publication"].clone()).expect("a publication");
    status.conditions = serde_json::from_value(patch["status"]["conditions"].clone()).expect("conditions");
    g
}

/// The heartbeat Lease of `node` as the plugin writes it (15 s interval: 23 s duration).
pub fn lease(node: &str, renewed: Timestamp) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(heartbeat_lease_name(node, DRIVER)),
            namespace: Some(NAMESPACE.into()),
            labels: Some([("gpu.migdra.dev/heartbeat".to_string(), DRIVER.to_string())].into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(node.into()),
            lease_duration_seconds: Some(23),
            renew_time: Some(MicroTime(renewed)),
            ..Default::default()
        }),
    }
}

/// The kubelet's node Lease of `node` in `kube-node-lease`, renewed at `renewed` (the
/// kubelet's default 40 s duration: it renews every 10 s), at `resource_version`.
pub fn node_lease(node: &str, renewed: Timestamp, resource_version: u64) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(node.into()),
            namespace: Some("kube-node-lease".into()),
            resource_version: Some(resource_version.to_string()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(node.into()),
            lease_duration_seconds: Some(40),
            renew_time: Some(MicroTime(renewed)),
            ..Default::default()
        }),
    }
}
