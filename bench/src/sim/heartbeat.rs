//! How a simulated kubelet plugin reports itself: the first report (GpuNode object, heartbeat
//! Lease, then the GpuNode status with the inventory and `registered: true`) and the periodic
//! heartbeat, a Lease renewal, as `kubelet-plugin/src/node_status/` does.

use std::sync::Arc;

use k8s_openapi::{
    api::coordination::v1::Lease, apimachinery::pkg::apis::meta::v1::MicroTime, jiff::Timestamp,
};
use kube::{
    Api, Client,
    api::{Patch, PatchParams},
};
use migdra_api::inventory::{GpuInventory, GpuNode, HEARTBEAT_LEASE_LABEL, heartbeat_lease_name};
use serde_json::json;

use super::objects::{gpunode_object, plugin_status, status_patch};

/// Field manager of the plugin's writes (the plugin's own name: the controller and the
/// admission policy see the same managers as with a real plugin).
pub const PLUGIN_FIELD_MANAGER: &str = "migdra-kubelet-plugin";

/// One simulated plugin's identity and inventory.
#[derive(Clone)]
pub struct SimPlugin {
    /// Node name.
    pub node: String,
    /// The Node's UID (owner of the GpuNode).
    pub node_uid: String,
    /// The node's GPUs.
    pub gpus: Arc<Vec<GpuInventory>>,
    /// When the simulated plugin started.
    pub started: Timestamp,
    /// The client its writes go through: its own, as the plugin's ServiceAccount bound to the
    /// node, or the bench's shared admin client ([`crate::cli::Args::plugin_identity`]).
    pub client: Client,
    /// The client its heartbeat Lease renewals go through: without kube's own retries, as
    /// the plugin's (the same as `client` when they share the admin's).
    pub heartbeat_client: Client,
}

impl SimPlugin {
    fn gpunodes(&self) -> Api<GpuNode> {
        Api::all(self.client.clone())
    }
}

/// Writes plugin reports: the first one, then a Lease renewal per beat, as the plugin does.
#[derive(Clone)]
pub struct Heartbeat {
    /// Heartbeat interval, seconds (the plugin's default is 15).
    pub interval_seconds: u32,
    driver: String,
    /// The heartbeat Leases' namespace.
    namespace: String,
}

impl Heartbeat {
    /// A writer for `driver`; Leases live in `namespace` (the driver's).
    pub fn new(driver: &str, namespace: &str, interval_seconds: u32) -> Self {
        Self {
            interval_seconds,
            driver: driver.to_string(),
            namespace: namespace.to_string(),
        }
    }

    fn leases(&self, plugin: &SimPlugin) -> Api<Lease> {
        Api::namespaced(plugin.heartbeat_client.clone(), &self.namespace)
    }

    fn apply() -> PatchParams {
        PatchParams::apply(PLUGIN_FIELD_MANAGER).force()
    }

    /// The plugin's first report: the GpuNode object, its heartbeat Lease and a full status
    /// (which never changes after: the simulated inventory is fixed).
    pub async fn announce(&self, plugin: &SimPlugin) -> Result<(), kube::Error> {
        let object = gpunode_object(&plugin.node, &plugin.node_uid, &self.driver);
        plugin
            .gpunodes()
            .patch(&plugin.node, &Self::apply(), &Patch::Apply(object))
            .await?;
        self.apply_lease(plugin).await?;
        self.write_status(plugin).await
    }

    /// Applies the whole heartbeat Lease of `plugin`.
    async fn apply_lease(&self, plugin: &SimPlugin) -> Result<(), kube::Error> {
        let name = heartbeat_lease_name(&plugin.node, &self.driver);
        let lease = json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": name,
                "labels": {HEARTBEAT_LEASE_LABEL: self.driver},
                "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": plugin.node, "uid": plugin.node_uid}],
            },
            "spec": {
                "holderIdentity": plugin.node,
                // ceil(1.5 × interval)
                "leaseDurationSeconds": (self.interval_seconds * 3).div_ceil(2),
                "acquireTime": MicroTime(plugin.started),
                "renewTime": MicroTime(Timestamp::now()),
            },
        });
        self.leases(plugin)
            .patch(&name, &Self::apply(), &Patch::Apply(lease))
            .await?;
        Ok(())
    }

    /// One heartbeat of a plugin: a merge patch of the Lease's `spec.renewTime` (the whole
    /// Lease again when it is gone).
    pub async fn beat(&self, plugin: &SimPlugin) -> Result<(), kube::Error> {
        let name = heartbeat_lease_name(&plugin.node, &self.driver);
        let renew = json!({"spec": {"renewTime": MicroTime(Timestamp::now())}});
        match self
            .leases(plugin)
            .patch(&name, &PatchParams::default(), &Patch::Merge(renew))
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => self.apply_lease(plugin).await,
            Err(e) => Err(e),
        }
    }

    async fn write_status(&self, plugin: &SimPlugin) -> Result<(), kube::Error> {
        let status = status_patch(&plugin_status(plugin.started), &plugin.gpus);
        plugin
            .gpunodes()
            .patch_status(&plugin.node, &Self::apply(), &Patch::Apply(status))
            .await?;
        Ok(())
    }
}
