//! This driver's `status.devices` entries of a claim, built from plain values: each device's
//! `Ready` condition and [`DeviceDetails`], what the entries keep from the claim as last read
//! ([`StatusContext`]), and the partial ResourceClaim that is applied ([`apply_object`]).

use std::collections::BTreeMap;

use dra_kubelet::ClaimRef;
use k8s_openapi::{
    api::resource::v1::{AllocatedDeviceStatus, ResourceClaim},
    apimachinery::pkg::{
        apis::meta::v1::{Condition, Time},
        runtime::RawExtension,
    },
    jiff::Timestamp,
};
use migdra_api::device_name::DeviceName;
use serde::Serialize;
use serde_json::json;

use crate::{
    checkpoint::{DeviceKind, DeviceRecord},
    claims::driver_results,
};

pub const READY_CONDITION: &str = "Ready";
/// The API's limits on an entry's serialized `data` and on a condition message.
pub const MAX_DATA_BYTES: usize = 10 * 1024;
pub const MAX_CONDITION_MESSAGE_BYTES: usize = 32 * 1024;

/// Where a MIG device sits on its GPU, in memory slices.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PlacementData {
    pub start: u32,
    pub size: u32,
}

/// What a device is on the hardware: an entry's `data`, as the user reads it with
/// `kubectl get resourceclaim -o yaml`. The GPU index is left out when unknown; the GPU is
/// the parent GPU of a MIG device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "type", rename_all = "lowercase", rename_all_fields = "camelCase")]
pub enum DeviceDetails {
    Gpu {
        uuid: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        gpu_index: Option<u32>,
        gpu_minor: u32,
        /// Handed out for monitoring only.
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        admin_access: bool,
    },
    /// A MIG device created for the claim.
    Mig {
        uuid: String,
        #[serde(rename = "parentUUID")]
        parent_uuid: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        gpu_index: Option<u32>,
        gpu_minor: u32,
        #[serde(rename = "gpuInstanceID")]
        gpu_instance_id: u32,
        #[serde(rename = "computeInstanceID")]
        compute_instance_id: u32,
        /// Profile name, e.g. `1g.10gb`.
        profile: String,
        placement: PlacementData,
    },
}

/// One device of ours in a prepared claim, as its status entry describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatusDevice {
    /// The allocation result's request (matches the result, with its share ID if any).
    pub request: String,
    pub pool: String,
    pub device: String,
    pub details: DeviceDetails,
}

impl StatusDevice {
    /// A recorded device; `None` for a MIG device whose instance is not (fully) recorded yet.
    pub fn from_record(record: &DeviceRecord, gpu_index: Option<u32>) -> Option<Self> {
        let details = match &record.kind {
            DeviceKind::Gpu => DeviceDetails::Gpu {
                uuid: record.gpu_uuid.clone(),
                gpu_index,
                gpu_minor: record.gpu_minor,
                admin_access: false,
            },
            DeviceKind::Mig {
                profile_id,
                start,
                size,
                gpu_instance,
                compute_instance,
                mig_uuid,
            } => DeviceDetails::Mig {
                uuid: mig_uuid.clone()?,
                parent_uuid: record.gpu_uuid.clone(),
                gpu_index,
                gpu_minor: record.gpu_minor,
                gpu_instance_id: (*gpu_instance)?,
                compute_instance_id: (*compute_instance)?,
                profile: match record.device.parse::<DeviceName>() {
                    Ok(DeviceName::Mig { profile, .. }) => profile.to_string(),
                    // Device names are ours; a record with another one names the profile by ID.
                    _ => format!("profile-id-{profile_id}"),
                },
                placement: PlacementData {
                    start: *start,
                    size: *size,
                },
            },
        };
        Some(Self {
            request: record.request.clone(),
            pool: record.pool.clone(),
            device: record.device.clone(),
            details,
        })
    }

    /// A whole GPU handed out with `adminAccess`.
    pub fn admin_gpu(
        request: &str,
        pool: &str,
        device: &str,
        uuid: &str,
        gpu_index: u32,
        gpu_minor: u32,
    ) -> Self {
        Self {
            request: request.into(),
            pool: pool.into(),
            device: device.into(),
            details: DeviceDetails::Gpu {
                uuid: uuid.into(),
                gpu_index: Some(gpu_index),
                gpu_minor,
                admin_access: true,
            },
        }
    }
}

/// An entry's key in `status.devices` (the list is a map on driver, pool, device, share ID).
type EntryKey = (String, String, Option<String>);

/// What the entries take from the claim as last read: its generation, the share IDs of our
/// allocation results, and since when our entries have been ready (kept across rewrites).
#[derive(Clone, Debug, PartialEq)]
pub struct StatusContext {
    /// `metadata.generation`, the conditions' `observedGeneration`.
    pub generation: Option<i64>,
    /// Share IDs of our allocation results, by (request, pool, device).
    pub share_ids: BTreeMap<(String, String, String), String>,
    /// `lastTransitionTime` of our entries' `Ready=True` conditions, by entry key.
    pub ready_since: BTreeMap<EntryKey, Time>,
    /// The time a condition that becomes ready now gets.
    pub now: Time,
}

impl StatusContext {
    /// Nothing known about the claim.
    pub fn empty(now: Time) -> Self {
        Self {
            generation: None,
            share_ids: BTreeMap::new(),
            ready_since: BTreeMap::new(),
            now,
        }
    }

    /// What `claim` says for `driver`'s entries.
    pub fn from_claim(claim: &ResourceClaim, driver: &str, now: Time) -> Self {
        let status = claim.status.as_ref();
        let share_ids = driver_results(claim, driver)
            .filter_map(|r| {
                let share = r.share_id.clone()?;
                Some(((r.request.clone(), r.pool.clone(), r.device.clone()), share))
            })
            .collect();
        let ready_since = status
            .and_then(|s| s.devices.as_ref())
            .into_iter()
            .flatten()
            .filter(|d| d.driver == driver)
            .filter_map(|d| {
                let ready = d
                    .conditions
                    .as_ref()?
                    .iter()
                    .find(|c| c.type_ == READY_CONDITION)?;
                (ready.status == "True").then(|| {
                    (
                        (d.pool.clone(), d.device.clone(), d.share_id.clone()),
                        ready.last_transition_time.clone(),
                    )
                })
            })
            .collect();
        Self {
            generation: claim.metadata.generation,
            share_ids,
            ready_since,
            now,
        }
    }
}

pub fn now() -> Time {
    Time(Timestamp::now())
}

/// The `status.devices` entries of `driver` for `devices`: each with a `Ready=True` condition
/// and its [`DeviceDetails`] as `data` (left out, with a warning, in the impossible case it
/// exceeds the API's limit, so the rest of the entry is still accepted).
pub fn status_entries(
    driver: &str,
    devices: &[StatusDevice],
    context: &StatusContext,
) -> Vec<AllocatedDeviceStatus> {
    devices
        .iter()
        .map(|device| {
            let share_id = context
                .share_ids
                .get(&(device.request.clone(), device.pool.clone(), device.device.clone()))
                .cloned();
            let key = (device.pool.clone(), device.device.clone(), share_id.clone());
            let since = context.ready_since.get(&key).unwrap_or(&context.now).clone();
            let (reason, mut message) = describe(&device.details);
            truncate(&mut message, MAX_CONDITION_MESSAGE_BYTES);
            let data = serde_json::to_value(&device.details).ok().filter(|value| {
                let size = value.to_string().len();
                if size > MAX_DATA_BYTES {
                    tracing::warn!(device = %device.device, size, "device data exceeds the API limit; left out");
                }
                size <= MAX_DATA_BYTES
            });
            AllocatedDeviceStatus {
                driver: driver.to_string(),
                pool: device.pool.clone(),
                device: device.device.clone(),
                share_id,
                conditions: Some(vec![Condition {
                    type_: READY_CONDITION.into(),
                    status: "True".into(),
                    reason: reason.into(),
                    message,
                    observed_generation: context.generation,
                    last_transition_time: since,
                }]),
                data: data.map(RawExtension),
                network_data: None,
            }
        })
        .collect()
}

/// The condition's reason and message for a device.
fn describe(details: &DeviceDetails) -> (&'static str, String) {
    match details {
        DeviceDetails::Gpu {
            uuid,
            gpu_minor,
            admin_access: true,
            ..
        } => (
            "AdminAccessGranted",
            format!(
                "GPU {uuid} (minor {gpu_minor}) is visible to the container for monitoring (adminAccess); nothing was created, changed or reserved for this claim, and other claims keep using the GPU"
            ),
        ),
        DeviceDetails::Gpu { uuid, gpu_minor, .. } => (
            "GpuPrepared",
            format!("GPU {uuid} (minor {gpu_minor}) is prepared for the container as a whole GPU"),
        ),
        DeviceDetails::Mig {
            uuid,
            parent_uuid,
            gpu_minor,
            gpu_instance_id,
            compute_instance_id,
            profile,
            placement,
            ..
        } => (
            "MigDeviceCreated",
            format!(
                "MIG device {uuid} ({profile} at memory slice {}, {} slice(s); GPU instance {gpu_instance_id}, compute instance {compute_instance_id}) was created on GPU {parent_uuid} (minor {gpu_minor}) for this claim",
                placement.start, placement.size
            ),
        ),
    }
}

fn truncate(text: &mut String, max: usize) {
    text.truncate(text.floor_char_boundary(max));
}

/// The partial ResourceClaim applied to the `status` subresource. The UID makes the API
/// server refuse (422) a claim replaced under the same name. An empty `entries` removes every
/// entry this field manager wrote.
pub fn apply_object(claim: &ClaimRef, entries: &[AllocatedDeviceStatus]) -> serde_json::Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": claim.name,
            "namespace": claim.namespace,
            "uid": claim.uid,
        },
        "status": {"devices": entries},
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::collections::BTreeMap;

    use super::*;
    use crate::checkpoint::{DeviceKind, DeviceRecord};

    const DRIVER: &str = "gpu.migdra.dev";
    const POOL: &str = "node-a/gpu.migdra.dev";

    fn time(text: &str) -> Time {
        Time(text.parse().unwrap())
    }

    fn mig_record() -> DeviceRecord {
        DeviceRecord {
            request: "gpu".into(),
            pool: POOL.into(),
            device: "gpu-1-mig-3g40gb-4".into(),
            gpu_uuid: "GPU-parent".into(),
            gpu_minor: 1,
            kind: DeviceKind::Mig {
                profile_id: 9,
                start: 4,
                size: 4,
                gpu_instance: Some(2),
                compute_instance: Some(0),
                mig_uuid: Some("MIG-child".into()),
            },
            env: BTreeMap::new(),
            share_id: None,
        }
    }

    fn gpu_record() -> DeviceRecord {
        DeviceRecord {
            request: "whole".into(),
            device: "gpu-0".into(),
            gpu_uuid: "GPU-whole".into(),
            gpu_minor: 0,
            kind: DeviceKind::Gpu,
            ..mig_record()
        }
    }

    #[test]
    fn a_mig_device_says_what_was_created_and_where() {
        let device = StatusDevice::from_record(&mig_record(), Some(0)).unwrap();
        let context = StatusContext {
            generation: Some(3),
            ..StatusContext::empty(time("2026-12-01T10:00:00Z"))
        };
        let entries = status_entries(DRIVER, &[device], &context);
        assert_eq!(entries.len(), 1);
        let entry = serde_json::to_value(&entries[0]).unwrap();
        assert_eq!(
            entry,
            json!({
                "driver": DRIVER,
                "pool": POOL,
                "device": "gpu-1-mig-3g40gb-4",
                "conditions": [{
                    "type": "Ready",
                    "status": "True",
                    "reason": "MigDeviceCreated",
                    "message": "MIG device MIG-child (3g.40gb at memory slice 4, 4 slice(s); GPU instance 2, compute instance 0) was created on GPU GPU-parent (minor 1) for this claim",
                    "observedGeneration": 3,
                    "lastTransitionTime": "2026-12-01T10:00:00Z",
                }],
                "data": {
                    "type": "mig",
                    "uuid": "MIG-child",
                    "parentUUID": "GPU-parent",
                    "gpuIndex": 0,
                    "gpuMinor": 1,
                    "gpuInstanceID": 2,
                    "computeInstanceID": 0,
                    "profile": "3g.40gb",
                    "placement": {"start": 4, "size": 4},
                },
            })
        );
    }

    #[test]
    fn a_whole_gpu_says_its_uuid_and_admin_access_says_nothing_is_reserved() {
        let whole = StatusDevice::from_record(&gpu_record(), Some(1)).unwrap();
        let admin = StatusDevice::admin_gpu("monitor", POOL, "gpu-2", "GPU-watched", 2, 2);
        let entries = status_entries(DRIVER, &[whole, admin], &StatusContext::empty(now()));
        let data: Vec<_> = entries.iter().map(|e| e.data.clone().unwrap().0).collect();
        assert_eq!(
            data,
            vec![
                json!({"type": "gpu", "uuid": "GPU-whole", "gpuIndex": 1, "gpuMinor": 0}),
                json!({"type": "gpu", "uuid": "GPU-watched", "gpuIndex": 2, "gpuMinor": 2, "adminAccess": true}),
            ]
        );
        let reasons: Vec<_> = entries
            .iter()
            .map(|e| e.conditions.as_ref().unwrap()[0].reason.as_str())
            .collect();
        assert_eq!(reasons, ["GpuPrepared", "AdminAccessGranted"]);
        let message = &entries[1].conditions.as_ref().unwrap()[0].message;
        assert!(
            message.contains("nothing was created, changed or reserved"),
            "{message}"
        );
    }

    #[test]
    fn a_mig_device_without_its_instance_recorded_has_no_entry() {
        let mut record = mig_record();
        if let DeviceKind::Mig { compute_instance, .. } = &mut record.kind {
            *compute_instance = None;
        }
        assert_eq!(StatusDevice::from_record(&record, None), None);
    }

    /// A claim as the API server has it: allocated our MIG device (with a share ID) and another
    /// driver's, with entries of both drivers.
    fn claim() -> ResourceClaim {
        serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "ns", "uid": "uid-1", "generation": 2},
            "spec": {"devices": {"requests": []}},
            "status": {
                "allocation": {"devices": {"results": [
                    {"request": "gpu", "driver": DRIVER, "pool": POOL, "device": "gpu-1-mig-3g40gb-4", "shareID": "5d7e1c2a-0000-4000-8000-000000000001"},
                    {"request": "nic", "driver": "net.example.com", "pool": "p", "device": "eth0"},
                ]}},
                "devices": [
                    {"driver": DRIVER, "pool": POOL, "device": "gpu-1-mig-3g40gb-4", "shareID": "5d7e1c2a-0000-4000-8000-000000000001",
                     "conditions": [{"type": "Ready", "status": "True", "reason": "MigDeviceCreated", "message": "m",
                                     "lastTransitionTime": "2026-11-30T08:00:00Z"}]},
                    {"driver": "net.example.com", "pool": "p", "device": "eth0",
                     "conditions": [{"type": "Ready", "status": "True", "reason": "Up", "message": "m",
                                     "lastTransitionTime": "2026-11-29T08:00:00Z"}]},
                ],
            },
        }))
        .unwrap()
    }

    #[test]
    fn a_rewrite_keeps_the_share_id_and_the_time_it_became_ready() {
        let context = StatusContext::from_claim(&claim(), DRIVER, time("2026-12-01T10:00:00Z"));
        assert_eq!(context.generation, Some(2));
        let device = StatusDevice::from_record(&mig_record(), Some(0)).unwrap();
        let entries = status_entries(DRIVER, &[device], &context);
        assert_eq!(
            entries[0].share_id.as_deref(),
            Some("5d7e1c2a-0000-4000-8000-000000000001")
        );
        let condition = &entries[0].conditions.as_ref().unwrap()[0];
        assert_eq!(condition.last_transition_time, time("2026-11-30T08:00:00Z"));
        assert_eq!(condition.observed_generation, Some(2));
        // Another driver's entry gives us nothing.
        assert_eq!(context.ready_since.len(), 1);
    }

    #[test]
    fn the_applied_object_names_only_the_claim_and_our_entries() {
        let claim_ref = ClaimRef {
            namespace: "ns".into(),
            uid: "uid-1".into(),
            name: "c".into(),
        };
        let device = StatusDevice::from_record(&gpu_record(), None).unwrap();
        let entries = status_entries(DRIVER, &[device], &StatusContext::empty(now()));
        let object = apply_object(&claim_ref, &entries);
        assert_eq!(
            object["metadata"],
            json!({"name": "c", "namespace": "ns", "uid": "uid-1"})
        );
        let keys: Vec<_> = object.as_object().unwrap().keys().cloned().collect();
        assert_eq!(keys, ["apiVersion", "kind", "metadata", "status"]);
        let status: Vec<_> = object["status"].as_object().unwrap().keys().cloned().collect();
        assert_eq!(status, ["devices"], "no allocation, no reservedFor");
        assert_eq!(object["status"]["devices"][0]["driver"], DRIVER);
        // Clearing applies an empty list (removing what this manager applied before).
        assert_eq!(apply_object(&claim_ref, &[])["status"], json!({"devices": []}));
    }

    #[test]
    fn entries_stay_within_the_api_limits() {
        let mut record = mig_record();
        record.gpu_uuid = format!("GPU-{}", "f".repeat(200));
        let device = StatusDevice::from_record(&record, Some(u32::MAX)).unwrap();
        let entries = status_entries(DRIVER, &[device], &StatusContext::empty(now()));
        let data = entries[0].data.as_ref().unwrap().0.to_string();
        assert!(data.len() <= MAX_DATA_BYTES, "{}", data.len());
        let conditions = entries[0].conditions.as_ref().unwrap();
        assert!(conditions.len() <= 8);
        assert!(conditions[0].message.len() <= MAX_CONDITION_MESSAGE_BYTES);
        // The reason matches the API's pattern for condition reasons.
        let reason = &conditions[0].reason;
        assert!(
            reason.chars().next().unwrap().is_ascii_alphabetic()
                && reason
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_,:".contains(c)),
            "{reason}"
        );
    }

    #[test]
    fn over_long_messages_are_cut_at_a_character_boundary() {
        let mut text = "é".repeat(10);
        truncate(&mut text, 5);
        assert_eq!(text, "éé");
    }
}
