//! The write queue: the desired status of each claim not written yet, the background writer
//! that writes it one claim at a time, and the periodic retry of failed writes.

use std::{collections::BTreeMap, sync::Mutex, time::Duration};

use dra_kubelet::ClaimRef;
use k8s_openapi::api::resource::v1::ResourceClaim;

use super::entries::{StatusContext, StatusDevice, apply_object, now, status_entries};
use crate::{
    claims::{ClaimSource, driver_results},
    metrics::Metrics,
};

/// How long one status write may take before it counts as failed (and is retried later), so
/// a slow API server does not hold up the writes queued behind it for long.
pub const DEFAULT_WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// What the status of a claim should be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DesiredStatus {
    /// Prepared: these devices are ready.
    Ready {
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

/// Why a status write did not happen. `claim` is `namespace/name`.
#[derive(Debug, thiserror::Error)]
pub enum StatusWriteError {
    /// The API server answered with an error, or could not be reached.
    #[error("writing the status of ResourceClaim {claim}: {source}")]
    Api {
        claim: String,
        #[source]
        source: kube::Error,
    },
    #[error("writing the status of ResourceClaim {claim}: no answer within {timeout:?}")]
    Timeout { claim: String, timeout: Duration },
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

/// What one retry pass did, by claim UID.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StatusRetryRound {
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

/// Writes this driver's `status.devices` entries in the background from each claim's desired
/// status (ready with its devices, or cleared), keeping failed writes for a retry. The kubelet's
/// calls only queue ([`ClaimStatusWriter::queue_write`]); one writer at a time does the I/O, so
/// a claim's writes land in order and a newer request replaces one not yet written.
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
        crate::lock(&self.queue)
    }

    /// Counts what a write of `operation` did.
    fn counted(&self, operation: &'static str, outcome: WriteOutcome) -> WriteOutcome {
        let label = match outcome {
            WriteOutcome::Written => "written",
            WriteOutcome::Dropped => "dropped",
            WriteOutcome::Failed => "failed",
        };
        self.metrics.claim_status_write(operation, label);
        outcome
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

    /// The background writer: writes queued statuses one at a time until none is left
    /// ([`ClaimStatusWriter::queue_write`] asks for a new one then). Never fails: a failed write,
    /// and everything else queued at that moment, is logged, counted and kept for the retry pass.
    /// A recorded claim's ready status is dropped once `still_prepared` says it is no longer
    /// prepared here (another plugin instance unprepared it after this one answered the prepare).
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
                self.counted(pending.desired.operation(), WriteOutcome::Dropped)
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
        let apply = claims.apply_status(&claim.namespace, &claim.name, &self.field_manager, &object);
        let result = match tokio::time::timeout(self.timeout, apply).await {
            Ok(result) => result.map_err(|source| StatusWriteError::Api {
                claim: key.clone(),
                source,
            }),
            Err(_) => Err(StatusWriteError::Timeout {
                claim: key.clone(),
                timeout: self.timeout,
            }),
        };
        let outcome = match result {
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
        self.counted(operation, outcome)
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
                    self.counted(operation, WriteOutcome::Failed);
                    round.failed.push(uid);
                    continue;
                }
            };
            let current = object.filter(|c| c.metadata.uid.as_deref() == Some(uid.as_str()));
            let drop = |why: &str| {
                tracing::info!(claim = %claim.name, %uid, operation, "{why}; its status is not written");
                self.counted(operation, WriteOutcome::Dropped)
            };
            let outcome = match (desired, &current) {
                (_, None) => drop("the claim is gone or was replaced"),
                (DesiredStatus::Ready { recorded: true, .. }, _) if !is_recorded(&uid) => {
                    drop("the claim is no longer prepared here")
                }
                (DesiredStatus::Ready { devices, .. }, Some(c)) if !allocates(c, &self.driver, devices) => {
                    drop("the claim no longer allocates these devices")
                }
                (DesiredStatus::Cleared, Some(c)) if !has_entries(c, &self.driver) => {
                    self.counted(operation, WriteOutcome::Written)
                }
                (_, Some(c)) => {
                    let context = StatusContext::from_claim(c, &self.driver, now());
                    self.write(claims, claim, desired.clone(), &context).await
                }
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

/// Whether the claim's allocation still has every device (driver, pool, device, request).
fn allocates(claim: &ResourceClaim, driver: &str, devices: &[StatusDevice]) -> bool {
    let results: Vec<_> = driver_results(claim, driver).collect();
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
