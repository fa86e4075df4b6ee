//! How a simulated kubelet plugin reports itself: the first report (GpuNode object, then its
//! status with the inventory and `registered: true`) and the periodic heartbeat. This is the
//! only module that knows the heartbeat's form, so the bench can simulate the plugin of
//! either controller design with the same fleet ([`HeartbeatForm`]).

use std::sync::Arc;

use k8s_openapi::jiff::Timestamp;
use kube::{
    Api, Client,
    api::{Patch, PatchParams},
};
use migdra_api::inventory::{GpuInventory, GpuNode};

use super::objects::{gpunode_object, plugin_status, status_patch};

/// Field manager of the plugin's writes (the plugin's own name: the controller and the
/// admission policy see the same managers as with a real plugin).
pub const PLUGIN_FIELD_MANAGER: &str = "migdra-kubelet-plugin";

/// How the plugin heartbeats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum HeartbeatForm {
    /// Every beat applies the GpuNode's `status.plugin` and `status.gpus` (the whole
    /// inventory), as `kubelet-plugin/src/node_status.rs` does on `main`.
    GpuNodeStatus,
}

impl HeartbeatForm {
    /// How the table names it.
    pub fn describe(self) -> &'static str {
        match self {
            Self::GpuNodeStatus => "GpuNode status apply (plugin status + whole inventory) per beat",
        }
    }
}

/// One simulated plugin's identity and inventory.
#[derive(Clone, Debug)]
pub struct SimPlugin {
    /// Node name.
    pub node: String,
    /// The Node's UID (owner of the GpuNode).
    pub node_uid: String,
    /// The node's GPUs.
    pub gpus: Arc<Vec<GpuInventory>>,
    /// When the simulated plugin started.
    pub started: Timestamp,
}

/// Writes plugin reports of one form.
#[derive(Clone)]
pub struct Heartbeat {
    /// The form.
    pub form: HeartbeatForm,
    /// Heartbeat interval, seconds (the plugin's default is 15).
    pub interval_seconds: u32,
    driver: String,
    gpunodes: Api<GpuNode>,
}

impl Heartbeat {
    /// A writer of `form` for `driver`.
    pub fn new(client: Client, form: HeartbeatForm, driver: &str, interval_seconds: u32) -> Self {
        Self {
            form,
            interval_seconds,
            driver: driver.to_string(),
            gpunodes: Api::all(client),
        }
    }

    fn apply() -> PatchParams {
        PatchParams::apply(PLUGIN_FIELD_MANAGER).force()
    }

    /// The plugin's first report: the GpuNode object and a full status.
    pub async fn announce(&self, plugin: &SimPlugin) -> Result<(), kube::Error> {
        let object = gpunode_object(&plugin.node, &plugin.node_uid, &self.driver);
        self.gpunodes
            .patch(&plugin.node, &Self::apply(), &Patch::Apply(object))
            .await?;
        self.write_status(plugin).await
    }

    /// One heartbeat.
    pub async fn beat(&self, plugin: &SimPlugin) -> Result<(), kube::Error> {
        match self.form {
            HeartbeatForm::GpuNodeStatus => self.write_status(plugin).await,
        }
    }

    async fn write_status(&self, plugin: &SimPlugin) -> Result<(), kube::Error> {
        let status = status_patch(
            &plugin_status(plugin.started, Timestamp::now(), self.interval_seconds),
            &plugin.gpus,
        );
        self.gpunodes
            .patch_status(&plugin.node, &Self::apply(), &Patch::Apply(status))
            .await?;
        Ok(())
    }
}
