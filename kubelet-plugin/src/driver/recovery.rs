//! Recovery: repairs, from the journal alone, whatever a previous run left half done.
//!
//! At start every record is repaired once ([`Driver::repair_record`]). A record that cannot
//! be repaired then (NVML failing on one GPU, say) does not stop the plugin: it stays in the
//! journal as it was, its GPUs are reported unhealthy and refuse prepares
//! ([`crate::gpus::Gpus::mark_recovery_pending`]), and the background repair loop
//! ([`Driver::run_repair_loop`]) retries it with [`Backoff`] through the same routine, under
//! the node lock and the record's GPU locks. The kubelet's unprepare of such a claim tears
//! down the same record and, when it succeeds, ends the pending repair too.

use std::time::Duration;

use kube::runtime::events::EventType;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{ClaimFailure, Driver, DriverError};
use crate::{
    checkpoint::{ClaimRecord, ClaimState, LoadOutcome},
    claims::ClaimSource,
    gpus::PendingRepair,
    state_dir::NodeLock,
};

/// What startup recovery did; claims by UID.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    pub checkpoint: Option<LoadOutcome>,
    /// Half-prepared claims rolled back.
    pub rolled_back: Vec<String>,
    /// Half-unprepared claims finished.
    pub unprepared: Vec<String>,
    /// Completed claims whose missing CDI spec was rewritten.
    pub cdi_rewritten: Vec<String>,
    /// Claims whose CDI spec an earlier boot left (their instances died with it), removed.
    pub cdi_removed: Vec<String>,
    /// Records that could not be repaired at start: kept as they were and retried in the
    /// background.
    pub pending: Vec<PendingRepair>,
    /// What the recovery of a lost checkpoint did ([`Driver::recover_lost_records`]).
    pub lost_records: Option<super::OwnershipReport>,
}

impl RecoveryReport {
    /// A sentence for people (the GpuNode event), when anything was repaired.
    pub fn summary(&self) -> Option<String> {
        if self.rolled_back.is_empty() && self.unprepared.is_empty() && self.cdi_rewritten.is_empty() {
            return None;
        }
        Some(format!(
            "repaired interrupted operations at start: {} half-prepared claim(s) rolled back, {} half-unprepared claim(s) finished, {} CDI spec(s) rewritten",
            self.rolled_back.len(),
            self.unprepared.len(),
            self.cdi_rewritten.len()
        ))
    }

    /// A sentence for people (a Warning event), when records stay unrepaired.
    pub fn pending_summary(&self) -> Option<String> {
        if self.pending.is_empty() {
            return None;
        }
        let each: Vec<String> = self
            .pending
            .iter()
            .map(|p| format!("claim {} on GPU(s) {:?}: {}", p.claim, p.minors, p.error))
            .collect();
        Some(format!(
            "{} interrupted operation(s) could not be repaired at start and are retried in the background (their GPUs are unhealthy meanwhile): {}",
            self.pending.len(),
            each.join("; ")
        ))
    }
}

/// What repairing one record did (see [`RecoveryReport`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Repair {
    RolledBack,
    Unprepared,
    CdiRewritten,
    Nothing,
}

/// How long the background repair waits before each attempt: `initial`, doubling, at most
/// `max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(5 * 60),
        }
    }
}

impl Backoff {
    /// `attempt` is 0-based.
    pub fn delay(&self, attempt: u32) -> Duration {
        let factor = 2u32.checked_pow(attempt).unwrap_or(u32::MAX);
        self.initial.saturating_mul(factor).min(self.max)
    }
}

/// Something the status loop records as an event on the GpuNode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecoveryEvent {
    pub type_: EventType,
    /// A stable CamelCase reason (`RecoveryPending`, `RecoveryCompleted`, ...).
    pub reason: &'static str,
    /// The sentence for people.
    pub note: String,
}

impl RecoveryEvent {
    /// The Warning for records left unrepaired at start, if any.
    pub fn pending(report: &RecoveryReport) -> Option<Self> {
        report.pending_summary().map(|note| Self {
            type_: EventType::Warning,
            reason: "RecoveryPending",
            note,
        })
    }

    /// The Normal event for a record the background repair finished.
    pub fn completed(repaired: &PendingRepair) -> Self {
        Self {
            type_: EventType::Normal,
            reason: "RecoveryCompleted",
            note: format!(
                "the interrupted operation of claim {} was repaired; GPU(s) {:?} are usable again",
                repaired.claim, repaired.minors
            ),
        }
    }
}

/// What one round of background repair did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RepairRound {
    /// Repairs that are no longer pending (repaired now, or torn down meanwhile).
    pub completed: Vec<PendingRepair>,
    /// Repairs still pending, with the latest error.
    pub pending: Vec<PendingRepair>,
}

impl<C: ClaimSource> Driver<C> {
    pub(super) fn recover(&self) -> Result<RecoveryReport, DriverError> {
        let node = self.node_lock()?;
        let mut report = RecoveryReport::default();
        for (uid, record) in self.recorded_claims() {
            match self.repair_record(&node, &uid, &record) {
                Ok(Repair::RolledBack) => report.rolled_back.push(uid),
                Ok(Repair::Unprepared) => report.unprepared.push(uid),
                Ok(Repair::CdiRewritten) => report.cdi_rewritten.push(uid),
                Ok(Repair::Nothing) => {}
                Err(e) => {
                    tracing::error!(claim = %record.key(), %uid, error = %e, "recovery failed; the record stays and is retried in the background, its GPUs are unhealthy meanwhile");
                    let pending = pending_repair(&uid, &record, &e);
                    self.inner.gpus.mark_recovery_pending(pending.clone());
                    report.pending.push(pending);
                }
            }
        }
        tracing::info!(?report, "recovery finished");
        Ok(report)
    }

    /// Repairs one record, under `node` and its GPU locks: rolls back a half-prepared claim,
    /// finishes a half-unprepared one, rewrites a completed claim's missing CDI spec. Success ends
    /// the record's pending repair; failure leaves the record as it was. Blocking.
    pub fn repair_record(
        &self,
        node: &NodeLock,
        uid: &str,
        record: &ClaimRecord,
    ) -> Result<Repair, ClaimFailure> {
        let needs_work = match record.state {
            ClaimState::PrepareStarted | ClaimState::UnprepareStarted => true,
            ClaimState::PrepareCompleted => !self.inner.cdi.has_claim_spec(uid),
        };
        if !needs_work {
            self.inner.gpus.clear_recovery_pending(uid);
            return Ok(Repair::Nothing);
        }
        let locks = self.lock_record_gpus(node, record);
        // Re-read under the locks: the kubelet may have unprepared it meanwhile.
        let Some(record) = self.inner.journal.get(uid) else {
            self.inner.gpus.clear_recovery_pending(uid);
            return Ok(Repair::Nothing);
        };
        let result = match record.state {
            ClaimState::PrepareStarted => {
                self.inner.metrics.recovery("rollback");
                self.tear_down(&locks, uid, &record).map(|()| Repair::RolledBack)
            }
            ClaimState::UnprepareStarted => {
                self.inner.metrics.recovery("finish_unprepare");
                self.tear_down(&locks, uid, &record).map(|()| Repair::Unprepared)
            }
            ClaimState::PrepareCompleted if !self.inner.cdi.has_claim_spec(uid) => {
                // /var/run/cdi is a tmpfs on many hosts; the instances are still there, so
                // the spec is rebuilt from the record rather than re-preparing.
                self.inner.metrics.recovery("rewrite_cdi");
                self.write_cdi(uid, &record).map(|()| Repair::CdiRewritten)
            }
            ClaimState::PrepareCompleted => Ok(Repair::Nothing),
        };
        self.inner.metrics.repair_attempt(result.is_ok());
        if result.is_ok() {
            self.inner.gpus.clear_recovery_pending(uid);
        }
        result
    }

    pub fn pending_repairs(&self) -> Vec<PendingRepair> {
        self.inner.gpus.recovery_pending()
    }

    /// Retries every pending repair once, under the node lock. Blocking.
    pub fn retry_pending_repairs(&self) -> Result<RepairRound, DriverError> {
        let mut round = RepairRound::default();
        let pending = self.pending_repairs();
        if pending.is_empty() {
            return Ok(round);
        }
        let node = self.node_lock()?;
        for repair in pending {
            let Some(record) = self.inner.journal.get(&repair.uid) else {
                // Torn down by the kubelet's unprepare meanwhile.
                self.inner.gpus.clear_recovery_pending(&repair.uid);
                round.completed.push(repair);
                continue;
            };
            match self.repair_record(&node, &repair.uid, &record) {
                Ok(done) => {
                    tracing::info!(claim = %repair.claim, uid = %repair.uid, ?done, "background repair succeeded");
                    round.completed.push(repair);
                }
                Err(e) => {
                    tracing::warn!(claim = %repair.claim, uid = %repair.uid, error = %e, "background repair failed; retrying later");
                    let latest = self.inner.journal.get(&repair.uid).unwrap_or(record);
                    let updated = pending_repair(&repair.uid, &latest, &e);
                    self.inner.gpus.mark_recovery_pending(updated.clone());
                    round.pending.push(updated);
                }
            }
        }
        Ok(round)
    }

    /// Retries the pending repairs with `backoff` until none is left or `shutdown`; each
    /// finished repair is sent to `events`. NVML work runs on blocking threads.
    pub async fn run_repair_loop(
        self,
        backoff: Backoff,
        events: mpsc::UnboundedSender<RecoveryEvent>,
        shutdown: CancellationToken,
    ) {
        if self.pending_repairs().is_empty() {
            return;
        }
        let mut attempt = 0u32;
        while !self.pending_repairs().is_empty() {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(backoff.delay(attempt)) => {}
            }
            attempt = attempt.saturating_add(1);
            let driver = self.clone();
            match tokio::task::spawn_blocking(move || driver.retry_pending_repairs()).await {
                Ok(Ok(round)) => {
                    for repaired in &round.completed {
                        // A closed channel only means nobody records events any more.
                        let _ = events.send(RecoveryEvent::completed(repaired));
                    }
                }
                Ok(Err(e)) => tracing::warn!(error = %e, "background repair could not run; retrying later"),
                Err(e) => tracing::error!(error = %e, "background repair task failed"),
            }
        }
        tracing::info!("every repair left pending at start is done");
    }
}

fn pending_repair(uid: &str, record: &ClaimRecord, error: &ClaimFailure) -> PendingRepair {
    PendingRepair {
        uid: uid.to_string(),
        claim: record.key(),
        minors: record.devices.iter().map(|d| d.gpu_minor).collect(),
        error: error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_only_when_something_was_repaired() {
        let mut report = RecoveryReport {
            checkpoint: Some(LoadOutcome::Loaded),
            ..RecoveryReport::default()
        };
        assert_eq!(report.summary(), None);
        assert_eq!(report.pending_summary(), None);
        report.rolled_back.push("u1".into());
        report.cdi_rewritten.push("u2".into());
        let summary = report.summary().unwrap();
        assert!(summary.contains("1 half-prepared claim(s) rolled back, 0 half-unprepared claim(s) finished, 1 CDI spec(s) rewritten"), "{summary}");
        report.pending.push(PendingRepair {
            uid: "u3".into(),
            claim: "ns/c3".into(),
            minors: [1].into(),
            error: "NVML failed".into(),
        });
        let warning = RecoveryEvent::pending(&report).unwrap();
        assert_eq!(warning.reason, "RecoveryPending");
        assert!(
            warning.note.contains("claim ns/c3 on GPU(s) {1}: NVML failed"),
            "{}",
            warning.note
        );
    }

    #[test]
    fn backoff_doubles_up_to_the_maximum() {
        let backoff = Backoff::default();
        let delays: Vec<u64> = (0..12).map(|a| backoff.delay(a).as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300]);
        assert_eq!(backoff.delay(u32::MAX), Duration::from_secs(300));
        let tiny = Backoff {
            initial: Duration::from_millis(3),
            max: Duration::from_millis(10),
        };
        assert_eq!(
            (0..4).map(|a| tiny.delay(a)).collect::<Vec<_>>(),
            [3, 6, 10, 10].map(Duration::from_millis)
        );
    }
}
