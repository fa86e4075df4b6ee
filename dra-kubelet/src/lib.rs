//! The node half of a Kubernetes DRA driver: everything between the kubelet and a driver's
//! prepare/unprepare logic (what the Go package
//! `k8s.io/dynamic-resource-allocation/kubeletplugin` does for Go drivers). A driver implements
//! [`DraDriver`]; [`PluginServer`] serves the DRA socket (DRA `v1`, `v1beta1`, resource health
//! `v1alpha1`, `v1`) and then the registration socket, names both per instance during rolling
//! updates, fixes the `:authority` kubelets send, and removes the sockets on shutdown.
//!
//! Device health and the registration outcome are plain data and travel through
//! [`tokio::sync::watch`] channels: the driver publishes the current [`DeviceHealthReport`] list
//! whenever it changes and reads the kubelet's verdict as [`RegistrationState`].
//!
//! Data flow: kubelet → socket (`sockets`) → `:authority` fix (`authority_proxy`) → tonic →
//! DRA service (`dra`) → [`DraDriver`]; health snapshots → `health` → kubelet; the kubelet's
//! registration calls → `registration` → [`RegistrationState`].
//!
//! ```no_run
//! use std::{collections::HashMap, sync::Arc};
//!
//! use dra_kubelet::{
//!     ClaimRef, DraDriver, PluginServer, PluginServerConfig, PrepareOutcome, PreparedDevice,
//!     RegistrationState, UnprepareOutcome,
//! };
//! use tokio::sync::watch;
//! use tokio_util::sync::CancellationToken;
//!
//! /// Gives every claim one device, `dev-0` of pool `node-a`.
//! struct OneDevice;
//!
//! impl DraDriver for OneDevice {
//!     async fn prepare(&self, claims: Vec<ClaimRef>) -> HashMap<String, PrepareOutcome> {
//!         let device = PreparedDevice {
//!             request_names: vec!["req".to_string()],
//!             pool_name: "node-a".to_string(),
//!             device_name: "dev-0".to_string(),
//!             cdi_device_ids: vec!["example.com/device=dev-0".to_string()],
//!             share_id: None,
//!         };
//!         claims.into_iter().map(|claim| (claim.uid, Ok(vec![device.clone()]))).collect()
//!     }
//!
//!     async fn unprepare(&self, claims: Vec<ClaimRef>) -> HashMap<String, UnprepareOutcome> {
//!         claims.into_iter().map(|claim| (claim.uid, Ok(()))).collect()
//!     }
//! }
//!
//! # async fn example() -> Result<(), dra_kubelet::ServerError> {
//! let (health, health_rx) = watch::channel(Vec::new()); // send DeviceHealthReports here
//! let (registration_tx, registration) = watch::channel(RegistrationState::default());
//! let config = PluginServerConfig::new("/var/lib/kubelet", "dra.example.com");
//! let shutdown = CancellationToken::new();
//! PluginServer::new(config, Arc::new(OneDevice), health_rx, registration_tx)
//!     .run(shutdown) // until cancelled; or serve_dra() → register() → wait()
//!     .await
//! # }
//! ```

mod authority_proxy;
mod dra;
mod health;
mod registration;
mod sockets;

use std::{collections::HashMap, future::Future};

pub use sockets::{
    DraServing, PluginServer, PluginServerConfig, PluginServing, SOCKET_MODE, ServerError, SocketKind,
};

/// A claim as the kubelet names it in NodePrepareResources / NodeUnprepareResources.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ClaimRef {
    pub namespace: String,
    pub uid: String,
    pub name: String,
}

/// One prepared device, as returned to the kubelet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedDevice {
    /// Base request names this device serves (no `/subrequest` part).
    pub request_names: Vec<String>,
    pub pool_name: String,
    pub device_name: String,
    /// Fully qualified CDI device IDs.
    pub cdi_device_ids: Vec<String>,
    /// Share ID for shared-capacity allocations; `v1beta1` cannot carry it and drops it.
    pub share_id: Option<String>,
}

/// Per-claim outcome of a prepare call: the devices, or a message for the kubelet's event.
pub type PrepareOutcome = Result<Vec<PreparedDevice>, String>;
pub type UnprepareOutcome = Result<(), String>;

/// What a DRA driver implements. The helper calls it one call at a time (prepare and unprepare
/// alike), so implementations need no locking against each other.
///
/// Every claim UID in the input should appear in the output map: the helper answers a missing UID
/// with an error, drops UIDs that were not asked for, and replaces an empty error message (which
/// the kubelet would read as success).
pub trait DraDriver: Send + Sync + 'static {
    fn prepare(&self, claims: Vec<ClaimRef>) -> impl Future<Output = HashMap<String, PrepareOutcome>> + Send;
    fn unprepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> impl Future<Output = HashMap<String, UnprepareOutcome>> + Send;
}

/// Health of one published device, for the resource-health stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceHealthReport {
    pub pool_name: String,
    pub device_name: String,
    /// `Some(true)` healthy, `Some(false)` unhealthy, `None` unknown.
    pub healthy: Option<bool>,
    /// Human-readable detail (at most 1024 characters are sent).
    pub message: String,
}

/// Registration state as the kubelet reported it through NotifyRegistrationStatus.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegistrationState {
    /// True after the kubelet confirmed the registration.
    pub registered: bool,
    /// The kubelet's error when it rejected it.
    pub error: Option<String>,
}
