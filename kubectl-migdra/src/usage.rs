//! Who uses which device: joins the claims' allocation results (driver, pool, device) with
//! the pods that reference each claim (`spec.resourceClaims`, `status.resourceClaimStatuses`,
//! and the claim's `status.reservedFor`) and with what the plugin reported in the claim's
//! `status.devices` (the MIG UUID in `data`, the `Ready` condition).

use std::{collections::BTreeMap, fmt};

use k8s_openapi::api::{
    core::v1::Pod,
    resource::v1::{AllocatedDeviceStatus, ResourceClaim},
};
use serde::Serialize;

use crate::snapshot::Snapshot;

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ObjectRef {
    pub namespace: String,
    pub name: String,
}

impl ObjectRef {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    /// Parses `namespace/name` (what GpuNode instances record as their claim).
    pub fn parse(s: &str) -> Option<Self> {
        let (namespace, name) = s.split_once('/')?;
        (!namespace.is_empty() && !name.is_empty()).then(|| Self::new(namespace, name))
    }

    pub fn of_claim(claim: &ResourceClaim) -> Self {
        Self::new(
            claim.metadata.namespace.clone().unwrap_or_default(),
            claim.metadata.name.clone().unwrap_or_default(),
        )
    }
}

impl fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A pod that uses a claim.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct PodUse {
    pub namespace: String,
    pub name: String,
    /// `status.phase` (`Pending`, `Running`, …), empty when not reported yet.
    pub phase: String,
}

impl fmt::Display for PodUse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The `Ready` condition the plugin wrote for a device in the claim's `status.devices`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReadyCondition {
    /// True when the condition's status is `True`.
    pub ready: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// One claim's hold on one device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceUse {
    pub claim: ObjectRef,
    /// The claim's request the device was allocated for.
    pub request: String,
    pub pods: Vec<PodUse>,
    /// MIG UUID the plugin reported in `status.devices[].data` (see [`mig_uuid`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mig_uuid: Option<String>,
    /// The plugin's `Ready` condition, when it wrote one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ready: Option<ReadyCondition>,
}

/// The joined view: device → claims holding it, claim → pods.
#[derive(Clone, Debug, Default)]
pub struct Usage {
    by_device: BTreeMap<(String, String), Vec<DeviceUse>>,
    pods_by_claim: BTreeMap<ObjectRef, Vec<PodUse>>,
}

impl Usage {
    pub fn build(snapshot: &Snapshot) -> Self {
        let mut pods_by_claim: BTreeMap<ObjectRef, Vec<PodUse>> = BTreeMap::new();
        let mut pods_by_name: BTreeMap<ObjectRef, PodUse> = BTreeMap::new();
        for pod in &snapshot.pods {
            let pod_use = pod_use(pod);
            pods_by_name.insert(ObjectRef::new(&pod_use.namespace, &pod_use.name), pod_use.clone());
            for claim in claim_names(pod) {
                pods_by_claim
                    .entry(ObjectRef::new(&pod_use.namespace, claim))
                    .or_default()
                    .push(pod_use.clone());
            }
        }
        // A pod the claim is reserved for uses it even when the pod list missed the reference
        // (for example a pod that is being deleted).
        for claim in &snapshot.claims {
            let key = ObjectRef::of_claim(claim);
            for consumer in claim
                .status
                .iter()
                .flat_map(|s| s.reserved_for.iter().flatten())
                .filter(|r| r.resource == "pods")
            {
                let pod = ObjectRef::new(&key.namespace, &consumer.name);
                let pod_use = pods_by_name.get(&pod).cloned().unwrap_or(PodUse {
                    namespace: pod.namespace,
                    name: pod.name,
                    phase: String::new(),
                });
                pods_by_claim.entry(key.clone()).or_default().push(pod_use);
            }
        }
        for pods in pods_by_claim.values_mut() {
            pods.sort();
            pods.dedup_by(|a, b| a.namespace == b.namespace && a.name == b.name);
        }

        let mut by_device: BTreeMap<(String, String), Vec<DeviceUse>> = BTreeMap::new();
        for claim in &snapshot.claims {
            let key = ObjectRef::of_claim(claim);
            for result in allocation_results(claim).filter(|r| r.driver == snapshot.driver) {
                let status = device_status(claim, &result.driver, &result.pool, &result.device);
                by_device
                    .entry((result.pool.clone(), result.device.clone()))
                    .or_default()
                    .push(DeviceUse {
                        claim: key.clone(),
                        request: result.request.clone(),
                        pods: pods_by_claim.get(&key).cloned().unwrap_or_default(),
                        mig_uuid: status.and_then(mig_uuid),
                        ready: status.and_then(ready_condition),
                    });
            }
        }
        for users in by_device.values_mut() {
            users.sort_by(|a, b| a.claim.cmp(&b.claim));
        }
        Self {
            by_device,
            pods_by_claim,
        }
    }

    /// The claims holding `device` of `pool`.
    pub fn device(&self, pool: &str, device: &str) -> &[DeviceUse] {
        self.by_device
            .get(&(pool.to_string(), device.to_string()))
            .map_or(&[], Vec::as_slice)
    }

    /// Every allocated device of `pool`, by device name.
    pub fn pool_devices<'a>(
        &'a self,
        pool: &'a str,
    ) -> impl Iterator<Item = (&'a str, &'a [DeviceUse])> + 'a {
        self.by_device
            .iter()
            .filter(move |((p, _), _)| p == pool)
            .map(|((_, d), users)| (d.as_str(), users.as_slice()))
    }

    /// Pods using `claim`.
    pub fn pods_of(&self, claim: &ObjectRef) -> &[PodUse] {
        self.pods_by_claim.get(claim).map_or(&[], Vec::as_slice)
    }
}

fn pod_use(pod: &Pod) -> PodUse {
    PodUse {
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        name: pod.metadata.name.clone().unwrap_or_default(),
        phase: pod
            .status
            .as_ref()
            .and_then(|s| s.phase.clone())
            .unwrap_or_default(),
    }
}

/// Names of the ResourceClaims a pod uses: the ones it names directly and the ones generated
/// for it from templates (`status.resourceClaimStatuses`).
pub fn claim_names(pod: &Pod) -> Vec<String> {
    let direct = pod
        .spec
        .iter()
        .flat_map(|s| s.resource_claims.iter().flatten())
        .filter_map(|c| c.resource_claim_name.clone());
    let generated = pod
        .status
        .iter()
        .flat_map(|s| s.resource_claim_statuses.iter().flatten())
        .filter_map(|c| c.resource_claim_name.clone());
    let mut names: Vec<String> = direct.chain(generated).collect();
    names.sort();
    names.dedup();
    names
}

/// A claim's allocation results (all drivers).
pub fn allocation_results(
    claim: &ResourceClaim,
) -> impl Iterator<Item = &k8s_openapi::api::resource::v1::DeviceRequestAllocationResult> {
    claim
        .status
        .iter()
        .flat_map(|s| s.allocation.as_ref())
        .flat_map(|a| a.devices.as_ref())
        .flat_map(|d| d.results.iter().flatten())
}

/// The claim's `status.devices` entry of one device.
pub fn device_status<'a>(
    claim: &'a ResourceClaim,
    driver: &str,
    pool: &str,
    device: &str,
) -> Option<&'a AllocatedDeviceStatus> {
    claim
        .status
        .as_ref()?
        .devices
        .iter()
        .flatten()
        .find(|d| d.driver == driver && d.pool == pool && d.device == device)
}

/// The `Ready` condition of a device status.
pub fn ready_condition(status: &AllocatedDeviceStatus) -> Option<ReadyCondition> {
    let condition = status.conditions.iter().flatten().find(|c| c.type_ == "Ready")?;
    Some(ReadyCondition {
        ready: condition.status == "True",
        reason: Some(condition.reason.clone()).filter(|r| !r.is_empty()),
        message: Some(condition.message.clone()).filter(|m| !m.is_empty()),
    })
}

/// The MIG UUID in a device status's `data`. The plugin writes `{"type": "mig", "uuid":
/// "MIG-…", "parentUUID": …}` for a MIG device (and `"type": "gpu"` with the GPU's UUID for a
/// whole GPU, which is not a MIG UUID); a `migUUID` key is accepted as well.
pub fn mig_uuid(status: &AllocatedDeviceStatus) -> Option<String> {
    let data = &status.data.as_ref()?.0;
    let tagged = (data.get("type").and_then(|t| t.as_str()) == Some("mig"))
        .then(|| data.get("uuid"))
        .flatten();
    tagged
        .or_else(|| data.get("migUUID"))
        .and_then(|v| v.as_str())
        .filter(|u| u.starts_with("MIG-"))
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::json;

    use super::*;

    fn status(data: serde_json::Value) -> AllocatedDeviceStatus {
        serde_json::from_value(json!({"driver": "d", "pool": "p", "device": "x", "data": data})).unwrap()
    }

    #[test]
    fn only_a_mig_entry_yields_a_mig_uuid() {
        let mig = status(json!({"type": "mig", "uuid": "MIG-abc", "parentUUID": "GPU-1"}));
        assert_eq!(mig_uuid(&mig).as_deref(), Some("MIG-abc"));
        let whole = status(json!({"type": "gpu", "uuid": "GPU-1"}));
        assert_eq!(mig_uuid(&whole), None);
        assert_eq!(
            mig_uuid(&status(json!({"migUUID": "MIG-def"}))).as_deref(),
            Some("MIG-def")
        );
        assert_eq!(mig_uuid(&status(json!({"type": "mig", "uuid": "garbage"}))), None);
    }

    #[test]
    fn namespaced_names_parse_only_with_both_parts() {
        assert_eq!(ObjectRef::parse("ns/name"), Some(ObjectRef::new("ns", "name")));
        assert_eq!(ObjectRef::parse("name"), None);
        assert_eq!(ObjectRef::parse("/name"), None);
    }
}
