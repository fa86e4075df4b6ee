//! The `GpuNode` custom resource: one per GPU node, named after the node, written by the
//! kubelet plugin (what the node has) and read by the controller (what to publish).
//!
//! The plugin owns `status.plugin` and `status.gpus`; the controller owns
//! `status.publication` and `status.conditions`. Both write with server-side apply under
//! their own field managers, so neither clobbers the other.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{
    geometry::{Architecture, MigGeometry, Placement},
    profile::ProfileName,
};

/// API group of migdra's custom resources and opaque configuration.
pub const GROUP: &str = "gpu.migdra.dev";
/// API version of migdra's custom resources and opaque configuration.
pub const VERSION: &str = "v1alpha1";
/// `apiVersion` string of migdra's objects.
pub const API_VERSION: &str = "gpu.migdra.dev/v1alpha1";
/// Default DRA driver name.
pub const DEFAULT_DRIVER_NAME: &str = "gpu.migdra.dev";

/// Spec of a [`GpuNode`].
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "gpu.migdra.dev",
    version = "v1alpha1",
    kind = "GpuNode",
    plural = "gpunodes",
    shortname = "gpun",
    status = "GpuNodeStatus",
    printcolumn = r#"{"name":"Driver","type":"string","jsonPath":".spec.driver"}"#,
    printcolumn = r#"{"name":"GPUs","type":"integer","jsonPath":".status.publication.gpus"}"#,
    printcolumn = r#"{"name":"Registered","type":"boolean","jsonPath":".status.plugin.registered"}"#,
    printcolumn = r#"{"name":"Devices","type":"integer","jsonPath":".status.publication.devices"}"#,
    printcolumn = r#"{"name":"Heartbeat","type":"date","jsonPath":".status.plugin.heartbeatTime"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct GpuNodeSpec {
    /// The node this inventory describes (equal to `metadata.name`).
    pub node_name: String,
    /// The DRA driver name the node's plugin serves.
    pub driver: String,
}

/// Status of a [`GpuNode`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuNodeStatus {
    /// The kubelet plugin's liveness and registration (written by the plugin).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugin: Option<PluginStatus>,
    /// The GPUs of the node (written by the plugin).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus: Option<Vec<GpuInventory>>,
    /// What the controller published for this node (written by the controller).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publication: Option<PublicationStatus>,
    /// Conditions (written by the controller): `Published`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
}

/// The kubelet plugin's view of itself.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PluginStatus {
    /// migdra version of the plugin.
    pub version: String,
    /// True once the kubelet confirmed the plugin's registration.
    pub registered: bool,
    /// The kubelet's reason when it rejected the registration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registration_error: Option<String>,
    /// When the plugin process started.
    pub start_time: Time,
    /// Last time the plugin reported itself alive.
    pub heartbeat_time: Time,
    /// How often the plugin heartbeats; the controller allows at least one and a half intervals
    /// (its heartbeat timeout, 25 s by default) before it treats the plugin as gone.
    pub heartbeat_interval_seconds: u32,
    /// NVIDIA driver version reported by NVML.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_version: Option<String>,
}

/// One GPU as NVML reports it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuInventory {
    /// Device minor (`/dev/nvidia<minor>`); names the GPU in device names.
    pub minor: u32,
    /// NVML enumeration index.
    pub index: u32,
    /// GPU UUID (`GPU-…`).
    pub uuid: String,
    /// Product name, e.g. `NVIDIA H100 80GB HBM3`.
    pub product_name: String,
    /// Architecture, when NVML reports one migdra knows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<Architecture>,
    /// CUDA compute capability, e.g. `9.0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_compute_capability: Option<String>,
    /// PCI bus ID, e.g. `0000:3b:00.0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_bus_id: Option<String>,
    /// NUMA node, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<i64>,
    /// Total memory in MiB.
    pub memory_mib: u64,
    /// MIG state; absent when the GPU is not MIG-capable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigInventory>,
    /// Health of the GPU.
    pub health: GpuHealth,
}

/// Health of a GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuHealth {
    /// False when the GPU failed its last health probe.
    pub healthy: bool,
    /// Why it is unhealthy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl GpuHealth {
    /// A healthy GPU.
    pub fn healthy() -> Self {
        Self {
            healthy: true,
            reason: None,
        }
    }
}

/// MIG state of a MIG-capable GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigInventory {
    /// Current MIG mode.
    pub enabled: bool,
    /// True when a mode change is pending (Ampere: needs a GPU reset).
    #[serde(default)]
    pub change_pending: bool,
    /// True when the plugin may switch MIG mode on demand (no reset needed: Hopper and later).
    pub mode_switchable: bool,
    /// Profiles, placements and budgets as NVML reports them.
    pub geometry: MigGeometry,
    /// GPU instances that exist now.
    #[serde(default)]
    pub instances: Vec<MigInstance>,
}

/// Who made a GPU instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum InstanceOwner {
    /// Created by migdra for a claim.
    Migdra,
    /// Created by someone else (an admin, mig-parted, another driver); migdra never touches it.
    Foreign,
}

/// A GPU instance that exists on a GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigInstance {
    /// Profile name, when the profile ID is one the GPU reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<ProfileName>,
    /// GPU-instance profile ID and placement start.
    pub placement: Placement,
    /// NVML GPU-instance ID.
    pub gpu_instance_id: u32,
    /// Who created it.
    pub owner: InstanceOwner,
    /// `namespace/name` of the claim it serves, for migdra's instances.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<String>,
}

/// What the controller published for a node.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PublicationStatus {
    /// Pool name.
    pub pool: String,
    /// Pool generation last written.
    pub generation: i64,
    /// Slices in the pool.
    pub slices: u32,
    /// Devices in the pool.
    pub devices: u32,
    /// GPUs published.
    pub gpus: u32,
    /// Name of the MigPolicy applied, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
}

/// The pool name of a node. Pools are named per driver, `<node>/<driver>`, because schedulers
/// without kubernetes/kubernetes#140434's fix share counter accounting between same-named
/// pools of different drivers.
pub fn pool_name(node: &str, driver: &str) -> String {
    format!("{node}/{driver}")
}

/// Label on every plugin heartbeat Lease; its value is the driver name (the controller's
/// watch selects on it).
pub const HEARTBEAT_LEASE_LABEL: &str = "gpu.migdra.dev/heartbeat";

/// Longest object name (a DNS subdomain).
const MAX_OBJECT_NAME: usize = 253;

/// The name of the `coordination.k8s.io/v1` Lease the plugin of `driver` on `node` renews as
/// its heartbeat, in the plugin's namespace: `<node>.<driver>`. `None` when that is longer
/// than an object name may be; the plugin then heartbeats in its GpuNode only.
pub fn heartbeat_lease_name(node: &str, driver: &str) -> Option<String> {
    let name = format!("{node}.{driver}");
    (name.len() <= MAX_OBJECT_NAME).then_some(name)
}

/// The node a heartbeat Lease named by [`heartbeat_lease_name`] belongs to.
pub fn heartbeat_lease_node<'a>(lease: &'a str, driver: &str) -> Option<&'a str> {
    lease
        .strip_suffix(driver)?
        .strip_suffix('.')
        .filter(|node| !node.is_empty())
}

#[cfg(test)]
mod lease_name_tests {
    use super::*;

    #[test]
    fn lease_names_round_trip_and_are_bounded() {
        let name = heartbeat_lease_name("node-a", DEFAULT_DRIVER_NAME).unwrap();
        assert_eq!(name, "node-a.gpu.migdra.dev");
        assert_eq!(heartbeat_lease_node(&name, DEFAULT_DRIVER_NAME), Some("node-a"));
        assert_eq!(
            heartbeat_lease_node("node-a.other.dev", DEFAULT_DRIVER_NAME),
            None
        );
        assert_eq!(heartbeat_lease_node(".gpu.migdra.dev", DEFAULT_DRIVER_NAME), None);
        assert_eq!(
            heartbeat_lease_node("migdra-controller", DEFAULT_DRIVER_NAME),
            None
        );
        let long = "n".repeat(253 - DEFAULT_DRIVER_NAME.len() - 1);
        assert!(heartbeat_lease_name(&long, DEFAULT_DRIVER_NAME).is_some());
        assert!(heartbeat_lease_name(&format!("{long}x"), DEFAULT_DRIVER_NAME).is_none());
    }
}
