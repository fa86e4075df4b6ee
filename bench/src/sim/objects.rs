//! What one simulated node consists of: the Node (labels, capacity, Ready and pressure
//! conditions), its node Lease, and the GpuNode the kubelet plugin would write, all built from
//! migdra's own types (`migdra_api::inventory`, the GPU catalog the fake NVML also uses).

use anyhow::Context as _;
use k8s_openapi::{
    api::core::v1::Node,
    apimachinery::pkg::apis::meta::v1::{MicroTime, Time},
    jiff::Timestamp,
};
use migdra_api::{
    catalog,
    inventory::{API_VERSION, GpuInventory, PluginStatus},
};
use serde_json::{Value, json};

/// Label on every simulated Node (workloads of the scheduling measure select it).
pub const SIMULATED_LABEL: &str = "bench.migdra.dev/simulated";
/// The simulated GPU model (8 per node, as an HGX H100 board).
pub const GPU_MODEL: &str = "H100-80GB";
/// Namespace of the kubelets' node Leases.
pub const NODE_LEASE_NAMESPACE: &str = "kube-node-lease";
/// The kubelet's node Lease duration.
pub const NODE_LEASE_SECONDS: i32 = 40;

/// The name of simulated node `i`.
pub fn node_name(i: usize) -> String {
    format!("sim-gpu-{i:04}")
}

/// The GPUs of a simulated node: `gpus` MIG-enabled GPUs of [`GPU_MODEL`] from the catalog,
/// with UUIDs unique to the node (a GPU's UUID is global; two nodes never share one).
pub fn node_gpus(node: &str, gpus: u32) -> anyhow::Result<Vec<GpuInventory>> {
    let model = catalog::model(GPU_MODEL).with_context(|| format!("{GPU_MODEL} is not in the catalog"))?;
    Ok((0..gpus)
        .map(|minor| {
            let mut gpu = model.inventory(minor, true);
            let id = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, format!("{node}/{minor}").as_bytes());
            gpu.uuid = format!("GPU-{id}");
            gpu
        })
        .collect())
}

/// The Node a kubelet would register: hostname/os/arch labels plus [`SIMULATED_LABEL`],
/// capacity for many pods, Ready and no pressure.
pub fn node_object(name: &str, now: Timestamp) -> anyhow::Result<Node> {
    let now = Time(now);
    let condition = |type_: &str, status: &str, reason: &str| {
        json!({"type": type_, "status": status, "reason": reason,
               "message": "simulated by migdra-bench", "lastHeartbeatTime": now, "lastTransitionTime": now})
    };
    let resources = json!({"cpu": "192", "memory": "2Ti", "pods": "250", "ephemeral-storage": "10Ti"});
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                SIMULATED_LABEL: "true",
            },
        },
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [
                condition("Ready", "True", "KubeletReady"),
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID"),
            ],
            "addresses": [{"type": "Hostname", "address": name}],
            "nodeInfo": {
                "machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": "",
                "osImage": "simulated", "containerRuntimeVersion": "simulated://0",
                "kubeletVersion": "simulated", "kubeProxyVersion": "",
                "operatingSystem": "linux", "architecture": "amd64",
            },
        },
    }))?)
}

/// The node Lease a kubelet keeps (renewed every 10 s), owned by the Node.
pub fn node_lease(name: &str, node_uid: &str, now: Timestamp) -> Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": name,
            "namespace": NODE_LEASE_NAMESPACE,
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": name, "uid": node_uid}],
        },
        "spec": {"holderIdentity": name, "leaseDurationSeconds": NODE_LEASE_SECONDS, "renewTime": MicroTime(now)},
    })
}

/// The GpuNode's metadata and spec as the plugin applies them (owned by the Node).
pub fn gpunode_object(node: &str, node_uid: &str, driver: &str) -> Value {
    json!({
        "apiVersion": API_VERSION,
        "kind": "GpuNode",
        "metadata": {
            "name": node,
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}],
        },
        "spec": {"nodeName": node, "driver": driver},
    })
}

/// The plugin's part of the GpuNode status.
pub fn plugin_status(started: Timestamp) -> PluginStatus {
    PluginStatus {
        version: env!("CARGO_PKG_VERSION").to_string(),
        registered: true,
        registration_error: None,
        start_time: Time(started),
        // The driver version the fake NVML reports: the simulated nodes claim the same.
        driver_version: Some(migdra_fake_nvml::config::DEFAULT_DRIVER_VERSION.to_string()),
    }
}

/// The plugin's status apply patch: `status.plugin` and `status.gpus`.
pub fn status_patch(plugin: &PluginStatus, gpus: &[GpuInventory]) -> Value {
    json!({
        "apiVersion": API_VERSION,
        "kind": "GpuNode",
        "status": {"plugin": plugin, "gpus": gpus},
    })
}

#[cfg(test)]
mod tests {
    use migdra_api::inventory::GpuNode;

    use super::*;

    #[test]
    fn simulated_gpunode_has_the_plugin_schema() {
        let now = Timestamp::now();
        let gpus = node_gpus("sim-gpu-0007", 8).expect("catalog model");
        let mut object = gpunode_object("sim-gpu-0007", "uid-1", "gpu.migdra.dev");
        object["status"] = status_patch(&plugin_status(now), &gpus)["status"].clone();
        // The real type reads it back unchanged: same fields, names and nesting.
        let parsed: GpuNode = serde_json::from_value(object.clone()).expect("a GpuNode");
        assert_eq!(
            serde_json::to_value(&parsed).expect("serializes")["status"],
            object["status"]
        );
        assert_eq!(parsed.spec.node_name, "sim-gpu-0007");
        let status = parsed.status.expect("status");
        let plugin = status.plugin.expect("plugin status");
        assert!(plugin.registered);
        let parsed_gpus = status.gpus.expect("gpus");
        assert_eq!(parsed_gpus, gpus);
        assert_eq!(parsed_gpus.len(), 8);
        assert!(
            parsed_gpus
                .iter()
                .all(|g| g.mig.as_ref().is_some_and(|m| m.enabled))
        );
    }

    #[test]
    fn gpu_uuids_are_unique_across_nodes() {
        let mut seen = std::collections::BTreeSet::new();
        for i in 0..50 {
            for gpu in node_gpus(&node_name(i), 8).expect("catalog model") {
                assert!(seen.insert(gpu.uuid.clone()), "duplicate {}", gpu.uuid);
            }
        }
        assert_eq!(seen.len(), 400);
    }

    #[test]
    fn node_is_ready_with_capacity() {
        let node = node_object("sim-gpu-0001", Timestamp::now()).expect("a Node");
        let status = node.status.expect("status");
        let ready = status
            .conditions
            .expect("conditions")
            .into_iter()
            .find(|c| c.type_ == "Ready")
            .expect("Ready condition");
        assert_eq!(ready.status, "True");
        assert!(status.allocatable.expect("allocatable").contains_key("pods"));
        assert_eq!(
            node.metadata
                .labels
                .expect("labels")
                .get(SIMULATED_LABEL)
                .map(String::as_str),
            Some("true")
        );
    }
}
