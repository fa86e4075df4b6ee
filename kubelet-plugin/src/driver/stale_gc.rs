//! Garbage collection of stale claims: checkpoint records whose ResourceClaim is gone.
//!
//! A claim deleted while the plugin was down, or one a kubelet never unprepared, would keep
//! its MIG instance (and block that placement) forever. At start, after recovery, and then
//! every interval, each recorded claim is looked up with no lock held. It is stale only when
//! the API answers clearly: not found, another UID (replaced), an allocation that no longer
//! names this driver and pool, or one with other devices than the record's (the claim was
//! deallocated and allocated again under the same UID while its unprepare was missed); an
//! error or a timeout proves nothing. A stale claim is
//! torn down like the kubelet's unprepare, under the node lock and its GPU locks, after the
//! record is read again there. A prepare holds the node lock from its first record to its
//! last, so a half-prepared record seen under it is one whose prepare died; its claim being
//! gone, no kubelet will retry it, so it is rolled back. Each release is counted and becomes
//! a `StaleClaimReleased` event on the GpuNode. An `adminAccess` claim has no record, only a
//! CDI spec naming it; a pass removes the specs of those gone or replaced the same way.

use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::runtime::events::EventType;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{ClaimFailure, Driver, RecoveryEvent};
use crate::{
    checkpoint::{AllocationEntry, ClaimRecord},
    claims::{ClaimSource, driver_results},
};

/// How long one claim's GET may take before the claim is kept (a timeout is not "gone").
pub(super) const GET_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a recorded claim is stale.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StaleCause {
    /// The API server says the claim does not exist.
    NotFound,
    /// A claim of that name exists with another UID: the recorded one was deleted.
    Replaced { current_uid: String },
    /// The claim exists but its allocation no longer names this driver and pool.
    NotAllocatedHere,
    /// The claim is allocated here, but other devices than the record's.
    Reallocated,
}

impl StaleCause {
    /// A stable CamelCase label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NotFound => "ClaimNotFound",
            Self::Replaced { .. } => "ClaimReplaced",
            Self::NotAllocatedHere => "NotAllocatedHere",
            Self::Reallocated => "Reallocated",
        }
    }

    fn describe(&self) -> String {
        match self {
            Self::NotFound => "the ResourceClaim no longer exists".into(),
            Self::Replaced { current_uid } => {
                format!("the ResourceClaim was replaced (it now has UID {current_uid})")
            }
            Self::NotAllocatedHere => "the ResourceClaim is no longer allocated from this node's pool".into(),
            Self::Reallocated => {
                "the ResourceClaim was allocated other devices since they were prepared".into()
            }
        }
    }
}

/// A stale claim that was released.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReleasedClaim {
    pub uid: String,
    /// `namespace/name`.
    pub claim: String,
    pub cause: StaleCause,
}

/// What one garbage-collection pass did.
#[derive(Debug, Default)]
pub struct StaleGcRound {
    pub released: Vec<ReleasedClaim>,
    /// Claims kept because the API server could not be asked (error or timeout), by UID.
    pub unknown: Vec<String>,
    /// Stale claims whose teardown failed (retried at the next pass), with the failure.
    pub failed: Vec<(ReleasedClaim, ClaimFailure)>,
}

impl RecoveryEvent {
    /// The Normal event for a stale claim that was released.
    pub fn stale_released(released: &ReleasedClaim) -> Self {
        Self {
            type_: EventType::Normal,
            reason: "StaleClaimReleased",
            note: format!(
                "released claim {} (UID {}): {}; its MIG instances were destroyed",
                released.claim,
                released.uid,
                released.cause.describe()
            ),
        }
    }
}

/// Whether `found` (the API server's answer for `record`'s claim) makes the record stale.
pub fn stale_cause(
    uid: &str,
    record: &ClaimRecord,
    found: Option<&ResourceClaim>,
    driver: &str,
    pool: &str,
) -> Option<StaleCause> {
    let Some(claim) = found else {
        return Some(StaleCause::NotFound);
    };
    let current_uid = claim.metadata.uid.as_deref().unwrap_or_default();
    if current_uid != uid {
        return Some(StaleCause::Replaced {
            current_uid: current_uid.to_string(),
        });
    }
    let mut here = driver_results(claim, driver)
        .filter(|r| r.pool == pool)
        .peekable();
    if here.peek().is_none() {
        return Some(StaleCause::NotAllocatedHere);
    }
    (!record.made_for(here.map(AllocationEntry::from))).then_some(StaleCause::Reallocated)
}

impl<C: ClaimSource> Driver<C> {
    /// Looks up every recorded claim and releases the stale ones.
    pub async fn collect_stale_claims(&self) -> StaleGcRound {
        let mut round = StaleGcRound::default();
        let mut stale = Vec::new();
        for (uid, record) in self.recorded_claims() {
            match self.look_up(&uid, &record).await {
                Ok(Some(cause)) => stale.push((
                    ReleasedClaim {
                        uid,
                        claim: record.key(),
                        cause,
                    },
                    record,
                )),
                Ok(None) => {}
                Err(error) => {
                    tracing::debug!(claim = %record.key(), %uid, %error, "cannot tell whether the claim still exists; keeping it");
                    round.unknown.push(uid);
                }
            }
        }
        self.collect_unrecorded_specs(&mut round).await;
        for (released, judged) in stale {
            let driver = self.clone();
            let (uid, cause) = (released.uid.clone(), released.cause.clone());
            let outcome =
                tokio::task::spawn_blocking(move || driver.release_stale(&uid, &cause, &judged)).await;
            match outcome {
                Ok(Ok(true)) => {
                    tracing::info!(claim = %released.claim, uid = %released.uid, cause = ?released.cause, "released a stale claim");
                    self.inner.metrics.stale_claim_released(released.cause.reason());
                    round.released.push(released);
                }
                Ok(Ok(false)) => {}
                Ok(Err(e)) => {
                    tracing::warn!(claim = %released.claim, uid = %released.uid, error = %e, "releasing a stale claim failed; retrying at the next pass");
                    round.failed.push((released, e));
                }
                Err(e) => tracing::error!(error = %e, "stale claim release task failed"),
            }
        }
        round
    }

    /// Removes the CDI specs of `adminAccess` claims (which have no record) that are gone or
    /// replaced: their pods were deleted without an unprepare.
    async fn collect_unrecorded_specs(&self, round: &mut StaleGcRound) {
        for (uid, claim) in self.inner.cdi.named_claim_specs() {
            if self.inner.journal.get(&uid).is_some() {
                continue;
            }
            let Some((namespace, name)) = claim.split_once('/') else {
                continue;
            };
            let cause = match tokio::time::timeout(GET_TIMEOUT, self.inner.claims.get(namespace, name)).await
            {
                Ok(Ok(None)) => StaleCause::NotFound,
                Ok(Ok(Some(found))) => match found.metadata.uid {
                    Some(current_uid) if current_uid != uid => StaleCause::Replaced { current_uid },
                    _ => continue,
                },
                Ok(Err(_)) | Err(_) => {
                    round.unknown.push(uid);
                    continue;
                }
            };
            let driver = self.clone();
            let spec_uid = uid.clone();
            let removed = tokio::task::spawn_blocking(move || driver.remove_unrecorded_spec(&spec_uid)).await;
            match removed {
                Ok(Ok(true)) => {
                    tracing::info!(%claim, %uid, ?cause, "removed the CDI spec of a stale adminAccess claim");
                    self.inner.metrics.stale_claim_released(cause.reason());
                    round.released.push(ReleasedClaim { uid, claim, cause });
                }
                Ok(Ok(false)) => {}
                Ok(Err(e)) => {
                    tracing::warn!(%claim, %uid, error = %e, "removing the CDI spec of a stale adminAccess claim failed; retrying at the next pass")
                }
                Err(e) => tracing::error!(error = %e, "stale CDI spec removal task failed"),
            }
        }
    }

    /// Removes the spec of a claim with no record, under the node lock (an unprepare of the
    /// claim may be removing it too). Blocking.
    fn remove_unrecorded_spec(&self, uid: &str) -> Result<bool, ClaimFailure> {
        let _node = self.node_lock()?;
        if self.inner.journal.get(uid).is_some() || !self.inner.cdi.has_claim_spec(uid) {
            return Ok(false);
        }
        self.inner.cdi.remove_claim_spec(uid)?;
        Ok(true)
    }

    async fn look_up(&self, uid: &str, record: &ClaimRecord) -> Result<Option<StaleCause>, String> {
        let get = self.inner.claims.get(&record.namespace, &record.name);
        match tokio::time::timeout(GET_TIMEOUT, get).await {
            Err(_) => Err(format!("no answer within {GET_TIMEOUT:?}")),
            Ok(Err(e)) => Err(e.to_string()),
            Ok(Ok(found)) => Ok(stale_cause(
                uid,
                record,
                found.as_ref(),
                &self.inner.config.driver_name,
                self.pool(),
            )),
        }
    }

    /// Tears down a stale claim under the node lock and its GPU locks, unless the record is
    /// gone by then (a half-prepared one included: under the node lock no prepare is running).
    /// A claim stale for its devices (`Reallocated`) is kept when its record is no longer the
    /// `judged` one: the kubelet's prepare released it and prepared the new devices meanwhile.
    /// Returns whether it was torn down. Blocking.
    fn release_stale(
        &self,
        uid: &str,
        cause: &StaleCause,
        judged: &ClaimRecord,
    ) -> Result<bool, ClaimFailure> {
        let node = self.node_lock()?;
        let Some(record) = self.inner.journal.get(uid) else {
            return Ok(false);
        };
        if *cause == StaleCause::Reallocated && judged.devices != record.devices {
            return Ok(false);
        }
        let locks = self.lock_record_gpus(&node, &record);
        match self.inner.journal.get(uid) {
            Some(record) => self.tear_down(&locks, uid, &record).map(|()| true),
            None => Ok(false),
        }
    }

    /// Runs a pass now and then every `interval` until `shutdown`; each released claim is
    /// sent to `events`. A zero interval disables the collection.
    pub async fn run_stale_claim_gc(
        self,
        interval: Duration,
        events: mpsc::UnboundedSender<RecoveryEvent>,
        shutdown: CancellationToken,
    ) {
        if interval.is_zero() {
            tracing::info!("stale claim garbage collection is disabled");
            return;
        }
        loop {
            let round = tokio::select! {
                _ = shutdown.cancelled() => return,
                round = self.collect_stale_claims() => round,
            };
            for released in &round.released {
                // A closed channel only means nobody records events any more.
                let _ = events.send(RecoveryEvent::stale_released(released));
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(interval) => {}
            }
        }
    }
}
