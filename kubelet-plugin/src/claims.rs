//! The ResourceClaims API as the plugin uses it: the GET per claim at prepare time, the pure
//! interpretation of the allocation (which devices are ours, with which configuration), and
//! the server-side apply of this driver's `status.devices` entries ([`crate::claim_status`]
//! builds them).

use std::future::Future;

use crate::checkpoint::AllocationEntry;
use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};
use kube::{
    Api, Client,
    api::{Patch, PatchParams},
};
use migdra_api::{
    config::{self, ConfigEntry, ConfigError, DeviceConfig},
    device_name::{DeviceName, InvalidDeviceName},
};

/// Where claims come from: the API server ([`KubeClaims`]), or a test double.
pub trait ClaimSource: Send + Sync + 'static {
    /// GETs a claim; `Ok(None)` when it does not exist.
    fn get(
        &self,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<Option<ResourceClaim>, kube::Error>> + Send;

    /// Server-side applies `object` (a partial ResourceClaim: type, name, namespace, UID and
    /// `status.devices`) to the claim's `status` subresource as `field_manager`, forcing
    /// ownership of the fields it names. Entries this manager applied before and `object`
    /// leaves out are removed; other managers' entries stay.
    fn apply_status(
        &self,
        namespace: &str,
        name: &str,
        field_manager: &str,
        object: &serde_json::Value,
    ) -> impl Future<Output = Result<(), kube::Error>> + Send;
}

/// Claims read from the API server.
#[derive(Clone)]
pub struct KubeClaims {
    client: Client,
}

impl KubeClaims {
    pub fn new(client: Client) -> Self {
        Self { client }
    }
}

impl ClaimSource for KubeClaims {
    async fn get(&self, namespace: &str, name: &str) -> Result<Option<ResourceClaim>, kube::Error> {
        Api::<ResourceClaim>::namespaced(self.client.clone(), namespace)
            .get_opt(name)
            .await
    }

    async fn apply_status(
        &self,
        namespace: &str,
        name: &str,
        field_manager: &str,
        object: &serde_json::Value,
    ) -> Result<(), kube::Error> {
        Api::<ResourceClaim>::namespaced(self.client.clone(), namespace)
            .patch_status(
                name,
                &PatchParams::apply(field_manager).force(),
                &Patch::Apply(object),
            )
            .await
            .map(|_| ())
    }
}

/// Why a claim cannot be prepared on this node. Each message is what the user sees in the
/// pod's `FailedPrepareDynamicResources` event, so it says what is wrong and with what.
/// `claim` is `namespace/name`.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error("reading ResourceClaim {claim}: {source}")]
    Api {
        claim: String,
        #[source]
        source: kube::Error,
    },
    #[error("ResourceClaim {claim} not found")]
    NotFound { claim: String },
    /// The claim was deleted and re-created under the same name.
    #[error(
        "ResourceClaim {claim} has UID {actual}, but the kubelet asked for UID {expected}: the claim was replaced"
    )]
    Replaced {
        claim: String,
        expected: String,
        actual: String,
    },
    #[error("ResourceClaim {claim} is not allocated")]
    NotAllocated { claim: String },
    /// Allocated from another node's pool.
    #[error(
        "ResourceClaim {claim}: device {device} was allocated from pool {pool}, but this node serves pool {expected}"
    )]
    OtherPool {
        claim: String,
        device: String,
        pool: String,
        /// This node's pool.
        expected: String,
    },
    /// A device name that is not one of ours.
    #[error("ResourceClaim {claim}: {source}")]
    DeviceName {
        claim: String,
        #[source]
        source: InvalidDeviceName,
    },
    /// Bad opaque configuration for `request`.
    #[error("ResourceClaim {claim}, request {request}: {source}")]
    Config {
        claim: String,
        request: String,
        #[source]
        source: ConfigError,
    },
}

impl ClaimError {
    /// A stable CamelCase label of the cause (a bounded set, for metrics).
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Api { .. } => "ClaimReadFailed",
            Self::NotFound { .. } => "ClaimNotFound",
            Self::Replaced { .. } => "ClaimReplaced",
            Self::NotAllocated { .. } => "ClaimNotAllocated",
            Self::OtherPool { .. } => "OtherPool",
            Self::DeviceName { .. } => "InvalidDeviceName",
            Self::Config { .. } => "InvalidConfig",
        }
    }
}

/// One of our devices in a claim's allocation.
#[derive(Clone, Debug, PartialEq)]
pub struct AllocatedDevice {
    /// Allocation result's request (may be `<request>/<subrequest>`).
    pub request: String,
    pub pool: String,
    /// Device name as allocated, and parsed.
    pub device: String,
    pub name: DeviceName,
    /// Resolved opaque configuration.
    pub config: DeviceConfig,
    /// The allocation's share of a shared device (`allowMultipleAllocations`); `None` for an
    /// exclusive device.
    pub share_id: Option<String>,
    /// Allocated with `adminAccess`: access to a device that may be in use by others, for
    /// monitoring; nothing is created or reserved for it.
    pub admin_access: bool,
}

impl<'a> From<&'a AllocatedDevice> for AllocationEntry<'a> {
    fn from(device: &'a AllocatedDevice) -> Self {
        Self {
            request: &device.request,
            pool: &device.pool,
            device: &device.device,
            share_id: device.share_id.as_deref(),
            admin_access: device.admin_access,
        }
    }
}

impl<'a> From<&'a DeviceRequestAllocationResult> for AllocationEntry<'a> {
    fn from(result: &'a DeviceRequestAllocationResult) -> Self {
        Self {
            request: &result.request,
            pool: &result.pool,
            device: &result.device,
            share_id: result.share_id.as_deref(),
            admin_access: result.admin_access == Some(true),
        }
    }
}

/// Extracts this driver's devices from a claim, validating that the claim is the one the
/// kubelet asked for, that it is allocated from this node's pool, and that every opaque
/// configuration for our driver that applies to our devices is valid.
pub fn allocated_devices(
    claim: &ResourceClaim,
    expected_uid: &str,
    driver: &str,
    pool: &str,
) -> Result<Vec<AllocatedDevice>, ClaimError> {
    let key = format!(
        "{}/{}",
        claim.metadata.namespace.as_deref().unwrap_or_default(),
        claim.metadata.name.as_deref().unwrap_or_default()
    );
    let actual = claim.metadata.uid.as_deref().unwrap_or_default();
    if actual != expected_uid {
        return Err(ClaimError::Replaced {
            claim: key,
            expected: expected_uid.into(),
            actual: actual.into(),
        });
    }
    let allocation = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .ok_or_else(|| ClaimError::NotAllocated { claim: key.clone() })?;

    // Class configuration first, then the claim's, each in order (the API keeps that order
    // within each source; sorting stably by source restores it across sources).
    let mut configs: Vec<_> = allocation
        .config
        .iter()
        .flatten()
        .filter_map(|c| c.opaque.as_ref().filter(|o| o.driver == driver).map(|o| (c, o)))
        .collect();
    configs.sort_by_key(|(c, _)| if c.source == "FromClass" { 0 } else { 1 });
    let no_requests: Vec<String> = Vec::new();
    let entries: Vec<ConfigEntry<'_>> = configs
        .iter()
        .map(|(c, o)| ConfigEntry {
            requests: c.requests.as_ref().unwrap_or(&no_requests),
            parameters: &o.parameters.0,
        })
        .collect();

    let mut devices = Vec::new();
    for result in allocation.results.iter().flatten().filter(|r| r.driver == driver) {
        if result.pool != pool {
            return Err(ClaimError::OtherPool {
                claim: key,
                device: result.device.clone(),
                pool: result.pool.clone(),
                expected: pool.into(),
            });
        }
        let name: DeviceName = result.device.parse().map_err(|source| ClaimError::DeviceName {
            claim: key.clone(),
            source,
        })?;
        let config = config::resolve(&entries, &result.request).map_err(|source| ClaimError::Config {
            claim: key.clone(),
            request: result.request.clone(),
            source,
        })?;
        devices.push(AllocatedDevice {
            request: result.request.clone(),
            pool: result.pool.clone(),
            device: result.device.clone(),
            name,
            config,
            share_id: result.share_id.clone(),
            admin_access: result.admin_access == Some(true),
        });
    }
    Ok(devices)
}

/// The allocation results of `driver` in `claim`.
pub fn driver_results<'a>(
    claim: &'a ResourceClaim,
    driver: &'a str,
) -> impl Iterator<Item = &'a DeviceRequestAllocationResult> {
    let status = claim.status.as_ref();
    let allocated = status.and_then(|s| s.allocation.as_ref()?.devices.as_ref()?.results.as_ref());
    allocated
        .into_iter()
        .flatten()
        .filter(move |r| r.driver == driver)
}

/// The base request name (`<request>` of `<request>/<subrequest>`), which is what the kubelet
/// matches containers' claim references against.
pub fn base_request(request: &str) -> &str {
    request.split('/').next().unwrap_or(request)
}
