//! What a prepared claim says about its devices: this driver's entries in the ResourceClaim's
//! `status.devices` (DRAResourceClaimDeviceStatus).
//!
//! Once the checkpoint says a claim is prepared, the driver asks, outside the node and GPU
//! locks, for one entry per device of ours: a `Ready` condition and, as `data`, what the device is
//! on the hardware ([`DeviceDetails`]: the MIG UUID, parent GPU, GPU and compute instance IDs,
//! profile and placement; or the whole GPU's UUID). At unprepare the entries are removed rather
//! than left: the instance they name is destroyed, and a claim that stays allocated (a
//! user-created claim, reused by the next pod) must not show a destroyed MIG UUID as ready.
//!
//! Every write is a server-side apply of the `status` subresource with this driver's own
//! field manager, naming only this driver's entries: the scheduler's allocation, the
//! reservations and other drivers' entries are never part of what is applied, so they are
//! never touched. The kubelet's call never waits for a write (the pod can run without its
//! status): prepare and unprepare only record the claim's desired status (ready with its
//! devices, or cleared; one per claim UID, the latest replacing one not written yet) and a
//! background writer ([`ClaimStatusWriter::write_queued`]) writes it. One write at a time, so
//! a claim prepared then quickly unprepared ends cleared, never with a late ready write after
//! the clear. A failed write is logged, counted and kept, and the periodic pass
//! ([`ClaimStatusWriter::retry_pending`]) re-reads the claim and writes again while it is
//! still the claim that was prepared. A plugin that stops before a write leaves it to the
//! next start, which queues the ready status of every prepared claim in the checkpoint.
//!
//! [`StatusContext::from_claim`], [`status_entries`] and [`apply_object`] are pure; the
//! writer does the I/O through a [`ClaimSource`].

use std::{
    collections::BTreeMap,
    sync::{Mutex, PoisonError},
    time::Duration,
};

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
    claims::ClaimSource,
    metrics::Metrics,
};

/// The condition type every entry carries.
pub const READY_CONDITION: &str = "Ready";
/// The API's limit on an entry's `data` (serialized).
pub const MAX_DATA_BYTES: usize = 10 * 1024;
/// The API's limit on a condition message.
pub const MAX_CONDITION_MESSAGE_BYTES: usize = 32 * 1024;
/// How long one status write may take before it counts as failed (and is retried later), so
/// a slow API server does not hold up the writes queued behind it for long.
pub const DEFAULT_WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// Where a MIG device sits on its GPU, in memory slices.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PlacementData {
    /// First memory slice.
    pub start: u32,
    /// Number of memory slices.
    pub size: u32,
}

/// What a device is on the hardware: an entry's `data`, as the user reads it with
/// `kubectl get resourceclaim -o yaml`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum DeviceDetails {
    /// A whole GPU.
    Gpu {
        /// `GPU-…` UUID.
        uuid: String,
        /// NVML index, when known.
        #[serde(rename = "gpuIndex", skip_serializing_if = "Option::is_none")]
        gpu_index: Option<u32>,
        /// Device minor (`/dev/nvidia<minor>`).
        #[serde(rename = "gpuMinor")]
        gpu_minor: u32,
        /// Handed out for monitoring only (`adminAccess`).
        #[serde(rename = "adminAccess", skip_serializing_if = "std::ops::Not::not")]
        admin_access: bool,
    },
    /// A MIG device created for the claim.
    Mig {
        /// `MIG-…` UUID.
        uuid: String,
        /// The parent GPU's `GPU-…` UUID.
        #[serde(rename = "parentUUID")]
        parent_uuid: String,
        /// The parent GPU's NVML index, when known.
        #[serde(rename = "gpuIndex", skip_serializing_if = "Option::is_none")]
        gpu_index: Option<u32>,
        /// The parent GPU's device minor.
        #[serde(rename = "gpuMinor")]
        gpu_minor: u32,
        /// GPU-instance ID.
        #[serde(rename = "gpuInstanceID")]
        gpu_instance_id: u32,
        /// Compute-instance ID.
        #[serde(rename = "computeInstanceID")]
        compute_instance_id: u32,
        /// Profile name, e.g. `1g.10gb`.
        profile: String,
        /// Placement on the parent GPU.
        placement: PlacementData,
    },
}

/// One device of ours in a prepared claim, as its status entry describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatusDevice {
    /// The allocation result's request (matches the result, with its share ID if any).
    pub request: String,
    /// Pool name.
    pub pool: String,
    /// Device name.
    pub device: String,
    /// What it is.
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
    /// `metadata.generation` (→ `observedGeneration`).
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
        let share_ids = status
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.as_ref())
            .into_iter()
            .flatten()
            .filter(|r| r.driver == driver)
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

/// The current time as the API's `Time`.
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
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
}

/// The partial ResourceClaim server-side applied to the `status` subresource: type, name,
/// namespace, UID (so a claim replaced under the same name is refused, not written: the API
/// server answers 422, `metadata.uid` is immutable) and
/// `status.devices` = `entries`. An empty list removes every entry this field manager wrote.
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

/// What the status of a claim should be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DesiredStatus {
    /// Prepared: these devices are ready.
    Ready {
        /// The devices.
        devices: Vec<StatusDevice>,
        /// Whether the claim has a checkpoint record (an `adminAccess` claim has none); a
        /// recorded claim whose record is gone is not written any more.
        recorded: bool,
    },
    /// Unprepared: none of this driver's entries.
    Cleared,
}

impl DesiredStatus {
    fn operation(&self) -> &'static str {
        match self {
            Self::Ready { .. } => "ready",
            Self::Cleared => "clear",
        }
    }
}

/// Why a status write did not happen.
#[derive(Debug, thiserror::Error)]
pub enum StatusWriteError {
    /// The API server answered with an error, or could not be reached.
    #[error("writing the status of ResourceClaim {claim}: {source}")]
    Api {
        /// `namespace/name`.
        claim: String,
        /// Cause.
        #[source]
        source: kube::Error,
    },
    /// No answer in time.
    #[error("writing the status of ResourceClaim {claim}: no answer within {timeout:?}")]
    Timeout {
        /// `namespace/name`.
        claim: String,
        /// The limit.
        timeout: Duration,
    },
}

impl StatusWriteError {
    /// HTTP status of an API error.
    fn code(&self) -> Option<u16> {
        match self {
            Self::Api {
                source: kube::Error::Api(status),
                ..
            } => Some(status.code),
            _ => None,
        }
    }
}

/// What one write did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteOutcome {
    /// The claim's status is as desired.
    Written,
    /// Not written, and not retried: the claim is gone or replaced, or the API server refused
    /// the content (a retry would be refused the same way).
    Dropped,
    /// Not written; kept for the periodic retry.
    Failed,
}

impl WriteOutcome {
    fn label(self) -> &'static str {
        match self {
            Self::Written => "written",
            Self::Dropped => "dropped",
            Self::Failed => "failed",
        }
    }
}

/// What one retry pass did, by claim UID.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StatusRetryRound {
    /// Written now.
    pub written: Vec<String>,
    /// Given up (claim gone, replaced, unprepared or refused).
    pub dropped: Vec<String>,
    /// Still failing; kept.
    pub failed: Vec<String>,
}

#[derive(Clone, Debug)]
struct Pending {
    claim: ClaimRef,
    desired: DesiredStatus,
    /// Which request this is: a write settles its claim's entry only while no newer request
    /// replaced it, so a slow write never erases what came after it.
    seq: u64,
    /// Queued for the background writer, with what the prepare's GET said about the claim;
    /// `None`: waiting for the periodic retry (which reads the claim again first).
    queued: Option<StatusContext>,
}

/// The desired status of every claim not written yet: at most one entry per claim UID,
/// the latest request replacing what was there.
#[derive(Default)]
struct Queue {
    entries: BTreeMap<String, Pending>,
    next_seq: u64,
    /// A background writer is running (or was asked to start) and will see new entries.
    writer_running: bool,
}

impl Queue {
    fn waiting_for_retry(&self) -> usize {
        self.entries.values().filter(|p| p.queued.is_none()).count()
    }
}

/// Writes this driver's `status.devices` entries, in the background, from the desired status
/// of each claim (ready with its devices, or cleared), and keeps the writes that failed for a
/// retry. The kubelet's calls only queue ([`ClaimStatusWriter::queue_write`]); one writer at a
/// time ([`ClaimStatusWriter::write_queued`], or a retry pass) does the I/O, so for one claim
/// the writes land in the order they were asked for, and a newer request replaces an older one
/// not written yet (latest wins).
pub struct ClaimStatusWriter {
    driver: String,
    field_manager: String,
    timeout: Duration,
    queue: Mutex<Queue>,
    writes: tokio::sync::Mutex<()>,
    metrics: Metrics,
}

impl ClaimStatusWriter {
    /// A writer for `driver`'s entries; its field manager is `<driver>/kubelet-plugin`.
    pub fn new(driver: &str, metrics: Metrics) -> Self {
        Self {
            driver: driver.into(),
            field_manager: format!("{driver}/kubelet-plugin"),
            timeout: DEFAULT_WRITE_TIMEOUT,
            queue: Mutex::new(Queue::default()),
            writes: tokio::sync::Mutex::new(()),
            metrics,
        }
    }

    /// The server-side apply field manager.
    pub fn field_manager(&self) -> &str {
        &self.field_manager
    }

    /// UIDs of the claims whose status write failed (or was deferred) and waits for a retry.
    pub fn pending_claims(&self) -> Vec<String> {
        self.claims_where(false)
    }

    /// UIDs of the claims whose status write is queued for the background writer (or being
    /// written now).
    pub fn queued_claims(&self) -> Vec<String> {
        self.claims_where(true)
    }

    /// UIDs of the entries that are (`queued`) or are not owned by the background writer.
    fn claims_where(&self, queued: bool) -> Vec<String> {
        let queue = self.queue();
        queue
            .entries
            .iter()
            .filter(|(_, p)| p.queued.is_some() == queued)
            .map(|(uid, _)| uid.clone())
            .collect()
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn insert(queue: &mut Queue, claim: ClaimRef, desired: DesiredStatus, queued: Option<StatusContext>) {
        queue.next_seq += 1;
        let seq = queue.next_seq;
        queue.entries.insert(
            claim.uid.clone(),
            Pending {
                claim,
                desired,
                seq,
                queued,
            },
        );
    }

    /// Asks for `claim`'s status to become `desired`, replacing whatever was asked before and
    /// not written yet. `context` is what the caller last read of the claim (for a ready
    /// status: the prepare's GET). Returns whether the caller must start a background writer
    /// ([`ClaimStatusWriter::write_queued`]): true when none is running.
    #[must_use = "when true, a background writer must be started"]
    pub fn queue_write(&self, claim: &ClaimRef, desired: DesiredStatus, context: StatusContext) -> bool {
        let mut queue = self.queue();
        Self::insert(&mut queue, claim.clone(), desired, Some(context));
        self.metrics.claim_status_pending(queue.waiting_for_retry());
        !std::mem::replace(&mut queue.writer_running, true)
    }

    /// Queues a ready status for the next retry pass unless something is already queued for
    /// the claim (used at start, for claims a previous run prepared: it may have answered the
    /// kubelet and stopped before the write).
    pub fn enqueue_ready(&self, claim: ClaimRef, devices: Vec<StatusDevice>) {
        let mut queue = self.queue();
        if !queue.entries.contains_key(&claim.uid) {
            let desired = DesiredStatus::Ready {
                devices,
                recorded: true,
            };
            Self::insert(&mut queue, claim, desired, None);
        }
        self.metrics.claim_status_pending(queue.waiting_for_retry());
    }

    /// The background writer: writes queued statuses, one at a time, until none is left
    /// (then returns; [`ClaimStatusWriter::queue_write`] asks for a new one). Never fails: a
    /// failed write is logged, counted and kept for the retry pass, and so is everything else
    /// queued at that moment (the API server just failed; the next try is the retry pass).
    /// A ready status of a recorded claim is dropped, not written, once `still_prepared` says
    /// the claim is no longer prepared here (another plugin instance, during a rolling update,
    /// unprepared it after this one answered the prepare, and cleared or will clear it).
    pub async fn write_queued<C: ClaimSource>(&self, claims: &C, still_prepared: impl Fn(&str) -> bool) {
        loop {
            let _one_at_a_time = self.writes.lock().await;
            let next = {
                let mut queue = self.queue();
                let next = queue.entries.values().find(|p| p.queued.is_some()).cloned();
                if next.is_none() {
                    // Under the queue's lock: a request after this starts a new writer.
                    queue.writer_running = false;
                }
                next
            };
            let Some(pending) = next else { return };
            let context = pending
                .queued
                .clone()
                .unwrap_or_else(|| StatusContext::empty(now()));
            let unprepared = matches!(pending.desired, DesiredStatus::Ready { recorded: true, .. })
                && !still_prepared(&pending.claim.uid);
            let outcome = if unprepared {
                tracing::info!(claim = %pending.claim.name, uid = %pending.claim.uid, "the claim is no longer prepared here; its ready status is not written");
                self.metrics
                    .claim_status_write(pending.desired.operation(), WriteOutcome::Dropped.label());
                WriteOutcome::Dropped
            } else {
                self.write(claims, &pending.claim, pending.desired.clone(), &context)
                    .await
            };
            self.settle(&pending, outcome);
            if outcome == WriteOutcome::Failed {
                self.defer_queued();
            }
        }
    }

    /// Moves every queued write to the retry pass, without trying it.
    fn defer_queued(&self) {
        let mut queue = self.queue();
        for pending in queue.entries.values_mut() {
            if pending.queued.take().is_some() {
                self.metrics
                    .claim_status_write(pending.desired.operation(), "deferred");
            }
        }
        self.metrics.claim_status_pending(queue.waiting_for_retry());
    }

    /// Records what the write of `done` did, unless a newer request replaced it meanwhile
    /// (that one is still to be written): a failure waits for the retry pass, anything else
    /// is finished.
    fn settle(&self, done: &Pending, outcome: WriteOutcome) {
        let mut queue = self.queue();
        let current = queue.entries.get_mut(&done.claim.uid);
        match current {
            Some(current) if current.seq == done.seq => {
                if outcome == WriteOutcome::Failed {
                    current.queued = None;
                } else {
                    queue.entries.remove(&done.claim.uid);
                }
            }
            _ => {}
        }
        self.metrics.claim_status_pending(queue.waiting_for_retry());
    }

    async fn write<C: ClaimSource>(
        &self,
        claims: &C,
        claim: &ClaimRef,
        desired: DesiredStatus,
        context: &StatusContext,
    ) -> WriteOutcome {
        let key = format!("{}/{}", claim.namespace, claim.name);
        let operation = desired.operation();
        let entries = match &desired {
            DesiredStatus::Ready { devices, .. } => status_entries(&self.driver, devices, context),
            DesiredStatus::Cleared => Vec::new(),
        };
        let object = apply_object(claim, &entries);
        let result = tokio::time::timeout(
            self.timeout,
            claims.apply_status(&claim.namespace, &claim.name, &self.field_manager, &object),
        )
        .await;
        let result = match result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(source)) => Err(StatusWriteError::Api {
                claim: key.clone(),
                source,
            }),
            Err(_) => Err(StatusWriteError::Timeout {
                claim: key.clone(),
                timeout: self.timeout,
            }),
        };
        let outcome = match &result {
            Ok(()) => {
                tracing::debug!(claim = %key, uid = %claim.uid, operation, entries = entries.len(), "claim status written");
                WriteOutcome::Written
            }
            // Gone: nothing to show the status on, or to clear.
            Err(e) if e.code() == Some(404) => {
                tracing::debug!(claim = %key, uid = %claim.uid, operation, "claim is gone; status not written");
                WriteOutcome::Dropped
            }
            // Invalid content (for example the allocation no longer names the device): the
            // same write would be refused again.
            Err(e) if matches!(e.code(), Some(400 | 422)) => {
                tracing::warn!(claim = %key, uid = %claim.uid, operation, error = %e, "the API server refused the claim status; not retried");
                WriteOutcome::Dropped
            }
            Err(e) => {
                tracing::warn!(claim = %key, uid = %claim.uid, operation, error = %e, "claim status not written; retried periodically (the pod is not affected)");
                WriteOutcome::Failed
            }
        };
        self.metrics.claim_status_write(operation, outcome.label());
        outcome
    }

    /// Retries every write that waits for a retry. Each claim is read first: a claim that is
    /// gone, replaced, no longer allocated these devices, or (`is_recorded` false) no longer
    /// prepared here is dropped; a clear whose claim has none of our entries left is done.
    /// Writes queued for the background writer are its own, not retried here.
    pub async fn retry_pending<C: ClaimSource>(
        &self,
        claims: &C,
        is_recorded: impl Fn(&str) -> bool,
    ) -> StatusRetryRound {
        let mut round = StatusRetryRound::default();
        let uids = self.pending_claims();
        for uid in uids {
            let _one_at_a_time = self.writes.lock().await;
            // A prepare or unprepare may have asked for another status meanwhile.
            let pending = match self.queue().entries.get(&uid) {
                Some(pending) if pending.queued.is_none() => pending.clone(),
                _ => continue,
            };
            let Pending { claim, desired, .. } = &pending;
            let operation = desired.operation();
            let object = match claims.get(&claim.namespace, &claim.name).await {
                Ok(object) => object,
                Err(e) => {
                    tracing::debug!(claim = %claim.name, %uid, error = %e, "reading the claim for a status retry failed");
                    self.metrics
                        .claim_status_write(operation, WriteOutcome::Failed.label());
                    round.failed.push(uid);
                    continue;
                }
            };
            let current = object.filter(|c| c.metadata.uid.as_deref() == Some(uid.as_str()));
            let verdict = match (desired, &current) {
                (_, None) => Verdict::Drop("the claim is gone or was replaced"),
                (DesiredStatus::Ready { recorded: true, .. }, _) if !is_recorded(&uid) => {
                    Verdict::Drop("the claim is no longer prepared here")
                }
                (DesiredStatus::Ready { devices, .. }, Some(c)) if !allocates(c, &self.driver, devices) => {
                    Verdict::Drop("the claim no longer allocates these devices")
                }
                (DesiredStatus::Cleared, Some(c)) if !has_entries(c, &self.driver) => Verdict::Done,
                (_, Some(c)) => Verdict::Write(StatusContext::from_claim(c, &self.driver, now())),
            };
            let outcome = match verdict {
                Verdict::Drop(why) => {
                    tracing::info!(claim = %claim.name, %uid, operation, "{why}; its status is not written");
                    self.metrics
                        .claim_status_write(operation, WriteOutcome::Dropped.label());
                    WriteOutcome::Dropped
                }
                Verdict::Done => {
                    self.metrics
                        .claim_status_write(operation, WriteOutcome::Written.label());
                    WriteOutcome::Written
                }
                Verdict::Write(context) => self.write(claims, claim, desired.clone(), &context).await,
            };
            self.settle(&pending, outcome);
            match outcome {
                WriteOutcome::Written => round.written.push(uid),
                WriteOutcome::Dropped => round.dropped.push(uid),
                WriteOutcome::Failed => round.failed.push(uid),
            }
        }
        round
    }
}

enum Verdict {
    Drop(&'static str),
    Done,
    Write(StatusContext),
}

/// Whether the claim's allocation still has every device (driver, pool, device, request).
fn allocates(claim: &ResourceClaim, driver: &str, devices: &[StatusDevice]) -> bool {
    let results: Vec<_> = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref())
        .into_iter()
        .flatten()
        .filter(|r| r.driver == driver)
        .collect();
    devices.iter().all(|d| {
        results
            .iter()
            .any(|r| r.pool == d.pool && r.device == d.device && r.request == d.request)
    })
}

/// Whether the claim has entries of `driver`.
fn has_entries(claim: &ResourceClaim, driver: &str) -> bool {
    claim
        .status
        .as_ref()
        .and_then(|s| s.devices.as_ref())
        .is_some_and(|devices| devices.iter().any(|d| d.driver == driver))
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
