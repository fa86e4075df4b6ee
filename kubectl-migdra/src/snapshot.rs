//! The input of every view: plain Kubernetes objects as the API server returns them. Tests
//! build snapshots by hand; [`crate::client`] fills them from a cluster.

use k8s_openapi::api::{
    core::v1::{Event, Pod},
    resource::v1::{DeviceClass, ResourceClaim, ResourceSlice},
};
use migdra_api::{inventory::GpuNode, policy::MigPolicy};

/// Everything the views read, for one DRA driver.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// The DRA driver name whose devices are shown (`gpu.migdra.dev` by default).
    pub driver: String,
    /// migdra's per-node inventories.
    pub gpu_nodes: Vec<GpuNode>,
    /// ResourceSlices (other drivers' slices are ignored).
    pub slices: Vec<ResourceSlice>,
    /// ResourceClaims (claims without devices of the driver are ignored).
    pub claims: Vec<ResourceClaim>,
    /// Pods, to name the users of each claim.
    pub pods: Vec<Pod>,
    /// Warning events, for the plugin's messages on failed prepares.
    pub events: Vec<Event>,
    /// MigPolicies, to explain why a profile is not published.
    pub policies: Vec<MigPolicy>,
    /// DeviceClasses, to recognise unallocated claims that ask for the driver's devices.
    pub device_classes: Vec<DeviceClass>,
    /// What could not be read (for example a list the user's RBAC forbids); shown with the view.
    pub warnings: Vec<String>,
}

impl Snapshot {
    pub fn new(driver: impl Into<String>) -> Self {
        Self {
            driver: driver.into(),
            ..Self::default()
        }
    }

    pub fn gpu_node(&self, node: &str) -> Option<&GpuNode> {
        self.gpu_nodes.iter().find(|g| node_of(g) == node)
    }
}

/// The node a GpuNode describes (`spec.nodeName`, or its name when that is empty).
pub fn node_of(gpu_node: &GpuNode) -> &str {
    if gpu_node.spec.node_name.is_empty() {
        gpu_node.metadata.name.as_deref().unwrap_or_default()
    } else {
        &gpu_node.spec.node_name
    }
}

/// The pool a GpuNode's devices are published in: what the controller reports, else the
/// name it would use.
pub fn pool_of(gpu_node: &GpuNode, driver: &str) -> String {
    gpu_node
        .status
        .as_ref()
        .and_then(|s| s.publication.as_ref())
        .map(|p| p.pool.clone())
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| migdra_api::inventory::pool_name(node_of(gpu_node), driver))
}
