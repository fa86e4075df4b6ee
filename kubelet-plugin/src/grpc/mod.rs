//! The kubelet-facing gRPC servers: DRA (v1 and v1beta1) and resource health (v1alpha1 and
//! v1) on the DRA socket, plugin registration on the registration socket.
//!
//! The servers know nothing about GPUs: they translate the kubelet's protocols to
//! [`DraDriver`] calls and health snapshots.
//!
//! [`dra`] and [`health`] are the DRA-socket services, [`registration`] is served behind the
//! [`authority_proxy`] (the kubelet's `:authority` on that socket is not valid for `h2`), and
//! [`server`] binds both sockets in the order the kubelet needs: start with [`PluginServer`].

pub mod authority_proxy;
pub mod dra;
pub mod health;
pub mod registration;
pub mod server;

use std::{collections::HashMap, future::Future};

pub use server::{DraServing, PluginServer, PluginServerConfig, PluginServing, ServerError, SocketKind};

/// A claim as the kubelet names it in NodePrepareResources / NodeUnprepareResources.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ClaimRef {
    /// Claim namespace.
    pub namespace: String,
    /// Claim UID.
    pub uid: String,
    /// Claim name.
    pub name: String,
}

/// One prepared device, as returned to the kubelet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedDevice {
    /// Base request names this device serves (no `/subrequest` part).
    pub request_names: Vec<String>,
    /// Pool name.
    pub pool_name: String,
    /// Device name.
    pub device_name: String,
    /// Fully qualified CDI device IDs.
    pub cdi_device_ids: Vec<String>,
    /// Share ID for shared-capacity allocations (none for MIG).
    pub share_id: Option<String>,
}

/// Per-claim outcome of a prepare call: the devices, or a message for the kubelet's event.
pub type PrepareOutcome = Result<Vec<PreparedDevice>, String>;
/// Per-claim outcome of an unprepare call.
pub type UnprepareOutcome = Result<(), String>;

/// What the DRA service asks of the driver. Every claim UID in the input must appear in the
/// output map.
pub trait DraDriver: Send + Sync + 'static {
    /// Prepares claims; returns one outcome per claim UID.
    fn prepare(&self, claims: Vec<ClaimRef>) -> impl Future<Output = HashMap<String, PrepareOutcome>> + Send;
    /// Unprepares claims; returns one outcome per claim UID.
    fn unprepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> impl Future<Output = HashMap<String, UnprepareOutcome>> + Send;
}

/// Health of one published device, for the resource-health stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceHealthReport {
    /// Pool name.
    pub pool_name: String,
    /// Device name.
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
