//! Kubernetes events about ResourceClaims: what went wrong with a user's claim on this node,
//! recorded on the claim (`kubectl describe resourceclaim`) with a stable CamelCase reason.
//!
//! The driver and the status loop only queue events ([`ClaimEvents::send`]: never blocking,
//! never under a lock; a full queue drops the event with a log line). One task
//! ([`publish_claim_events`]) writes them through kube's [`Recorder`], which counts a repeat
//! (same claim, reason and note, within minutes) on the first event, so a kubelet retrying a
//! failing prepare does not flood the API server. Reasons are those of
//! [`crate::driver::ClaimFailure::reason`] (the failure label of
//! `migdra_kubelet_plugin_claim_failures_total`), so alerts and events speak the same words;
//! plus `GpuUnhealthy` for claims on a GPU that became unhealthy, `Reallocated` for a claim
//! whose earlier devices were released because it was allocated others under the same UID, and
//! `RecoveryPending`/`RecoveryCompleted` for an interrupted operation not yet / now repaired.
//! Node-level events go to the GpuNode ([`crate::node_status`]).

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::{driver::ClaimFailure, gpus::PendingRepair};
use dra_kubelet::ClaimRef;

/// Events waiting to be written; more are dropped (each is also logged and counted).
pub const QUEUE_CAPACITY: usize = 256;

/// The API server's limit on an event's note.
const NOTE_LIMIT: usize = 1024;

/// One event about a ResourceClaim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimEvent {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub type_: EventType,
    /// Stable CamelCase reason.
    pub reason: &'static str,
    /// What the plugin was doing: `PrepareResourceClaim`, `UnprepareResourceClaim`,
    /// `CheckGpuHealth`.
    pub action: &'static str,
    /// The sentence for people (at most 1 KiB).
    pub note: String,
}

impl ClaimEvent {
    /// The Warning for a claim whose `operation` (`prepare` or `unprepare`) failed.
    pub fn failed(operation: &str, claim: &ClaimRef, failure: &ClaimFailure) -> Self {
        let action = match operation {
            "unprepare" => "UnprepareResourceClaim",
            _ => "PrepareResourceClaim",
        };
        Self {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            uid: claim.uid.clone(),
            type_: EventType::Warning,
            reason: failure.reason(),
            action,
            note: truncate_note(format!("{operation} failed on this node: {failure}")),
        }
    }

    /// The Normal event for a claim allocated other devices under the same UID while its
    /// unprepare was missed: the `released` devices were released before the `prepared` ones.
    pub fn reallocated(claim: &ClaimRef, released: &[String], prepared: &[String]) -> Self {
        Self {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            uid: claim.uid.clone(),
            type_: EventType::Normal,
            reason: "Reallocated",
            action: "PrepareResourceClaim",
            note: truncate_note(format!(
                "the claim was allocated other devices since it was prepared on this node: released {released:?}, prepared {prepared:?}"
            )),
        }
    }

    /// The Warning for a claim with a device on a GPU that became unhealthy.
    pub fn gpu_unhealthy(
        namespace: String,
        name: String,
        uid: String,
        gpu_minor: u32,
        gpu_uuid: &str,
        why: &str,
    ) -> Self {
        Self {
            namespace,
            name,
            uid,
            type_: EventType::Warning,
            reason: "GpuUnhealthy",
            action: "CheckGpuHealth",
            note: truncate_note(format!(
                "GPU {gpu_minor} ({gpu_uuid}), which holds this claim's device, is unhealthy: {why}"
            )),
        }
    }

    /// The Warning for a claim whose interrupted operation could not be repaired yet; `None`
    /// when the record's claim is not `namespace/name`.
    pub fn recovery_pending(repair: &PendingRepair) -> Option<Self> {
        let note = truncate_note(format!(
            "an interrupted operation of this claim could not be repaired yet (retried in the background; GPU(s) {:?} refuse new claims meanwhile): {}",
            repair.minors, repair.error
        ));
        Self::about_repair(repair, EventType::Warning, "RecoveryPending", note)
    }

    /// The Normal event for a claim whose pending repair is done (repaired, or torn down).
    pub fn recovery_completed(repair: &PendingRepair) -> Option<Self> {
        let note = format!(
            "the interrupted operation of this claim was repaired; GPU(s) {:?} are usable again",
            repair.minors
        );
        Self::about_repair(repair, EventType::Normal, "RecoveryCompleted", note)
    }

    fn about_repair(
        repair: &PendingRepair,
        type_: EventType,
        reason: &'static str,
        note: String,
    ) -> Option<Self> {
        let (namespace, name) = repair.claim.split_once('/')?;
        Some(Self {
            namespace: namespace.to_string(),
            name: name.to_string(),
            uid: repair.uid.clone(),
            type_,
            reason,
            action: "RecoverInterruptedOperation",
            note,
        })
    }

    pub fn regarding(&self) -> ObjectReference {
        ObjectReference {
            api_version: Some("resource.k8s.io/v1".into()),
            kind: Some("ResourceClaim".into()),
            namespace: Some(self.namespace.clone()),
            name: Some(self.name.clone()),
            uid: Some(self.uid.clone()),
            ..ObjectReference::default()
        }
    }
}

/// Cuts a note to the API server's limit, at a character boundary.
fn truncate_note(mut note: String) -> String {
    if note.len() > NOTE_LIMIT {
        note.truncate(note.floor_char_boundary(NOTE_LIMIT - 3));
        note.push_str("...");
    }
    note
}

/// Where claim events are queued. Cheap to clone; the default discards everything (tests and
/// tools that run the driver without an API server).
#[derive(Clone, Debug, Default)]
pub struct ClaimEvents {
    sender: Option<mpsc::Sender<ClaimEvent>>,
}

impl ClaimEvents {
    /// A queue of [`QUEUE_CAPACITY`] events and its receiving end.
    pub fn channel() -> (Self, mpsc::Receiver<ClaimEvent>) {
        let (sender, receiver) = mpsc::channel(QUEUE_CAPACITY);
        (Self { sender: Some(sender) }, receiver)
    }

    /// Queues an event without waiting; a full or closed queue drops it (logged).
    pub fn send(&self, event: ClaimEvent) {
        let Some(sender) = &self.sender else { return };
        if let Err(e) = sender.try_send(event) {
            let event = e.into_inner();
            tracing::warn!(claim = %format!("{}/{}", event.namespace, event.name), reason = event.reason, "claim event dropped: the event queue is full or closed");
        }
    }
}

/// Writes queued claim events until `shutdown` (or until every sender is gone). A failed
/// write is logged and dropped: events are for people, never a reason to stop.
pub async fn publish_claim_events(
    recorder: Recorder,
    mut events: mpsc::Receiver<ClaimEvent>,
    shutdown: CancellationToken,
) {
    loop {
        let event = tokio::select! {
            () = shutdown.cancelled() => None,
            event = events.recv() => event,
        };
        let Some(event) = event else { break };
        let published = Event {
            type_: event.type_,
            reason: event.reason.into(),
            note: Some(event.note.clone()),
            action: event.action.into(),
            secondary: None,
        };
        if let Err(e) = recorder.publish(&published, &event.regarding()).await {
            tracing::warn!(error = %e, claim = %format!("{}/{}", event.namespace, event.name), reason = event.reason, "recording a claim event failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Rejection;

    fn claim() -> ClaimRef {
        ClaimRef {
            namespace: "team-a".into(),
            name: "train".into(),
            uid: "uid-1".into(),
        }
    }

    #[test]
    fn a_failed_prepare_is_a_warning_on_the_claim_with_the_failure_reason() {
        let failure = ClaimFailure::Rejected(Rejection::MigModeChangePending {
            device: "gpu-2-mig-1g5gb-0".into(),
            minor: 2,
        });
        let event = ClaimEvent::failed("prepare", &claim(), &failure);
        assert_eq!(event.reason, "MigModeChangePending");
        assert_eq!(event.action, "PrepareResourceClaim");
        assert_eq!(event.type_, EventType::Warning);
        assert!(
            event.note.starts_with("prepare failed on this node: "),
            "{}",
            event.note
        );
        assert!(event.note.contains(&failure.to_string()), "{}", event.note);
        let regarding = event.regarding();
        assert_eq!(regarding.kind.as_deref(), Some("ResourceClaim"));
        assert_eq!(regarding.namespace.as_deref(), Some("team-a"));
        assert_eq!(regarding.name.as_deref(), Some("train"));
        assert_eq!(regarding.uid.as_deref(), Some("uid-1"));
        let unprepare = ClaimEvent::failed("unprepare", &claim(), &failure);
        assert_eq!(unprepare.action, "UnprepareResourceClaim");
    }

    #[test]
    fn notes_are_cut_to_the_api_limit_at_a_character_boundary() {
        let long = "é".repeat(NOTE_LIMIT);
        let note = truncate_note(long);
        assert!(note.len() <= NOTE_LIMIT, "{}", note.len());
        assert!(note.ends_with("..."));
        assert_eq!(truncate_note("short".into()), "short");
    }

    #[test]
    fn gpu_unhealthy_names_the_claim_and_the_gpu() {
        let event = ClaimEvent::gpu_unhealthy(
            "team-a".into(),
            "train".into(),
            "uid-1".into(),
            3,
            "GPU-x",
            "GPU is lost",
        );
        assert_eq!(
            (event.namespace.as_str(), event.name.as_str()),
            ("team-a", "train")
        );
        assert_eq!(event.reason, "GpuUnhealthy");
        assert!(event.note.contains("GPU 3 (GPU-x)") && event.note.ends_with("GPU is lost"));
    }

    #[tokio::test]
    async fn a_full_queue_drops_instead_of_blocking() {
        let (events, mut receiver) = ClaimEvents::channel();
        let failure = ClaimFailure::Rejected(Rejection::GpuGone { minor: 0 });
        for _ in 0..QUEUE_CAPACITY + 5 {
            events.send(ClaimEvent::failed("prepare", &claim(), &failure));
        }
        let mut queued = 0;
        while receiver.try_recv().is_ok() {
            queued += 1;
        }
        assert_eq!(queued, QUEUE_CAPACITY);
        ClaimEvents::default().send(ClaimEvent::failed("prepare", &claim(), &failure));
    }
}
