//! How a simulated kubelet plugin reports itself: the first report (GpuNode object, then its
//! status with the inventory and `registered: true`) and the periodic heartbeat. This is the
//! only module that knows the heartbeat's form, so the bench can simulate the plugin of
//! either controller design with the same fleet ([`HeartbeatForm`]).

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

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

/// How the plugin heartbeats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum HeartbeatForm {
    /// Every beat applies the GpuNode's `status.plugin` and `status.gpus` (the whole
    /// inventory), as plugins before the Lease heartbeat do.
    GpuNodeStatus,
    /// Every beat renews a per-node Lease `<node>.<driver>` in the driver's namespace (merge
    /// patch of `spec.renewTime`); the GpuNode status is written at the start and then every
    /// [`SLOW_GPUNODE_INTERVAL_SECONDS`], announced as its heartbeat interval, as
    /// `kubelet-plugin/src/node_status.rs` does.
    Lease,
}

/// With a Lease heartbeat, how often the plugin still refreshes the GpuNode status.
pub const SLOW_GPUNODE_INTERVAL_SECONDS: u32 = 300;

impl HeartbeatForm {
    /// How the table names it.
    pub fn describe(self) -> &'static str {
        match self {
            Self::GpuNodeStatus => "GpuNode status apply (plugin status + whole inventory) per beat",
            Self::Lease => {
                "Lease renew (merge patch of spec.renewTime) per beat (GpuNode status every 300 s)"
            }
        }
    }
}

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

/// Writes plugin reports of one form, switchable while the fleet runs (to measure an old and a
/// new controller in one run); clones share the form.
#[derive(Clone)]
pub struct Heartbeat {
    /// True while the form is [`HeartbeatForm::Lease`].
    lease_form: Arc<AtomicBool>,
    /// Heartbeat interval, seconds (the plugin's default is 15).
    pub interval_seconds: u32,
    driver: String,
    /// The heartbeat Leases' namespace.
    namespace: String,
}

impl Heartbeat {
    /// A writer of `form` for `driver`; Leases live in `namespace` (the driver's).
    pub fn new(form: HeartbeatForm, driver: &str, namespace: &str, interval_seconds: u32) -> Self {
        Self {
            lease_form: Arc::new(AtomicBool::new(form == HeartbeatForm::Lease)),
            interval_seconds,
            driver: driver.to_string(),
            namespace: namespace.to_string(),
        }
    }

    /// The current form.
    pub fn form(&self) -> HeartbeatForm {
        if self.lease_form.load(Ordering::Relaxed) {
            HeartbeatForm::Lease
        } else {
            HeartbeatForm::GpuNodeStatus
        }
    }

    /// Switches every clone to `form`; each plugin's next beat adapts (a missing Lease is
    /// created, with a status write announcing the new interval, as the plugin does).
    pub fn set_form(&self, form: HeartbeatForm) {
        self.lease_form
            .store(form == HeartbeatForm::Lease, Ordering::Relaxed);
    }

    /// The heartbeat interval the GpuNode announces.
    fn announced_interval(&self) -> u32 {
        match self.form() {
            HeartbeatForm::GpuNodeStatus => self.interval_seconds,
            HeartbeatForm::Lease => SLOW_GPUNODE_INTERVAL_SECONDS,
        }
    }

    fn leases(&self, plugin: &SimPlugin) -> Api<Lease> {
        Api::namespaced(plugin.heartbeat_client.clone(), &self.namespace)
    }

    fn apply() -> PatchParams {
        PatchParams::apply(PLUGIN_FIELD_MANAGER).force()
    }

    /// The plugin's first report: the GpuNode object and a full status.
    pub async fn announce(&self, plugin: &SimPlugin) -> Result<(), kube::Error> {
        let object = gpunode_object(&plugin.node, &plugin.node_uid, &self.driver);
        plugin
            .gpunodes()
            .patch(&plugin.node, &Self::apply(), &Patch::Apply(object))
            .await?;
        if self.form() == HeartbeatForm::Lease {
            self.apply_lease(plugin).await?;
        }
        self.write_status(plugin).await
    }

    /// Applies the whole heartbeat Lease of `plugin`.
    async fn apply_lease(&self, plugin: &SimPlugin) -> Result<(), kube::Error> {
        if let Some(name) = heartbeat_lease_name(&plugin.node, &self.driver) {
            let now = MicroTime(Timestamp::now());
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
                    "renewTime": now,
                },
            });
            self.leases(plugin)
                .patch(&name, &Self::apply(), &Patch::Apply(lease))
                .await?;
        }
        self.write_status(plugin).await
    }

    /// Heartbeat number `beat` (counting from 1) of a plugin.
    pub async fn beat(&self, plugin: &SimPlugin, beat: u64) -> Result<(), kube::Error> {
        match self.form() {
            HeartbeatForm::GpuNodeStatus => self.write_status(plugin).await,
            HeartbeatForm::Lease => {
                // Names too long for a Lease heartbeat in the GpuNode, as the plugin does.
                let Some(name) = heartbeat_lease_name(&plugin.node, &self.driver) else {
                    return self.write_status(plugin).await;
                };
                let renew = json!({"spec": {"renewTime": MicroTime(Timestamp::now())}});
                match self
                    .leases(plugin)
                    .patch(&name, &PatchParams::default(), &Patch::Merge(renew))
                    .await
                {
                    Ok(_) => {}
                    // No Lease yet (first beat after a switch): create it and announce the
                    // slow GpuNode interval.
                    Err(kube::Error::Api(e)) if e.code == 404 => {
                        self.apply_lease(plugin).await?;
                        return self.write_status(plugin).await;
                    }
                    Err(e) => return Err(e),
                }
                let every = u64::from((SLOW_GPUNODE_INTERVAL_SECONDS / self.interval_seconds.max(1)).max(1));
                if beat.is_multiple_of(every) {
                    self.write_status(plugin).await?;
                }
                Ok(())
            }
        }
    }

    async fn write_status(&self, plugin: &SimPlugin) -> Result<(), kube::Error> {
        let status = status_patch(
            &plugin_status(plugin.started, Timestamp::now(), self.announced_interval()),
            &plugin.gpus,
        );
        plugin
            .gpunodes()
            .patch_status(&plugin.node, &Self::apply(), &Patch::Apply(status))
            .await?;
        Ok(())
    }
}
