//! Unprepare (then the removal of the claim's status entries), and the one teardown routine
//! that also rolls back failed or interrupted prepares.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use super::{ClaimFailure, Driver, Step, UnprepareResult, on_device};
use crate::{
    checkpoint::{CheckpointError, ClaimRecord, ClaimState, DeviceKind},
    claim_status::{self, DesiredStatus, StatusContext},
    claims::ClaimSource,
    gpus::GpuLocks,
    nvml::{NvmlErrorKind, timing::NvmlClock},
    orphans::{LATE_CREATE_WATCH, OrphanedInstance, epoch_seconds},
    state_dir::NodeLock,
};
use dra_kubelet::ClaimRef;

impl<C: ClaimSource> Driver<C> {
    /// Unprepares claims: one outcome per claim UID, with the typed failure.
    pub async fn unprepare_claims(&self, claims: Vec<ClaimRef>) -> HashMap<String, UnprepareResult> {
        let started = Instant::now();
        let nvml = NvmlClock::new();
        let refs: HashMap<String, ClaimRef> = claims.iter().map(|c| (c.uid.clone(), c.clone())).collect();
        let items = claims.into_iter().map(|c| (c, ())).collect();
        let unprepared = self
            .run_claims("unprepare", &nvml, items, |driver, node, claim, ()| {
                driver.unprepare_claim(node, &claim.uid)
            })
            .await;
        // Outside the locks: a claim this node had prepared loses its status entries (what
        // they describe is gone), written in the background after any ready write still
        // queued or in flight for it. Claims never prepared here are not written.
        let mut outcomes = HashMap::with_capacity(unprepared.len());
        for (uid, outcome) in unprepared {
            if let (Ok(true), Some(claim)) = (&outcome, refs.get(&uid)) {
                self.queue_claim_status(
                    claim,
                    DesiredStatus::Cleared,
                    StatusContext::empty(claim_status::now()),
                );
            }
            outcomes.insert(uid, outcome.map(|_| ()));
        }
        self.inner
            .metrics
            .call_with_nvml("unprepare", started.elapsed(), &nvml, Duration::ZERO);
        outcomes
    }

    /// Unprepares one claim by UID; `Ok(true)` when there was something of it here (a record, or
    /// an `adminAccess` claim's CDI spec). Unknown claims succeed (the kubelet may ask for claims it
    /// never prepared here, or again after success). Blocking.
    fn unprepare_claim(&self, node: &NodeLock, uid: &str) -> Result<bool, ClaimFailure> {
        let Some(record) = self.inner.journal.get(uid) else {
            // An adminAccess claim left nothing but its spec.
            let had_spec = self.inner.cdi.has_claim_spec(uid);
            self.inner.cdi.remove_claim_spec(uid)?;
            if had_spec {
                tracing::info!(%uid, "unprepared (adminAccess: nothing was created)");
            }
            return Ok(had_spec);
        };
        let locks = self.lock_record_gpus(node, &record);
        // Re-read under the locks: a concurrent call may have finished it meanwhile.
        match self.inner.journal.get(uid) {
            Some(record) => self.tear_down(&locks, uid, &record).map(|()| true),
            None => Ok(true),
        }
    }

    /// Removes everything a recorded claim has, in any state: records `UnprepareStarted` for a
    /// prepared claim (a half-prepared one is rolled back without), destroys the record's instances
    /// (matched by placement, and by ID where recorded; a shared one only when no other record
    /// holds it), removes the CDI spec and forgets the claim.
    ///
    /// A half-prepared record may have been left by a plugin that died inside a create, so
    /// each of its placements with no instance yet is watched for a late one
    /// ([`crate::orphans`]).
    pub(super) fn tear_down(
        &self,
        locks: &GpuLocks<'_>,
        uid: &str,
        record: &ClaimRecord,
    ) -> Result<(), ClaimFailure> {
        self.tear_down_watching(locks, uid, record, LateCreates::Possible)
    }

    /// Rolls back this prepare's own record after `failure`: its creates returned, unless
    /// NVML stopped answering during one.
    pub(super) fn roll_back_failed_prepare(
        &self,
        locks: &GpuLocks<'_>,
        uid: &str,
        record: &ClaimRecord,
        failure: &ClaimFailure,
    ) -> Result<(), ClaimFailure> {
        let late = if failure.nvml_not_answering() {
            LateCreates::Possible
        } else {
            LateCreates::Impossible
        };
        self.tear_down_watching(locks, uid, record, late)
    }

    fn tear_down_watching(
        &self,
        locks: &GpuLocks<'_>,
        uid: &str,
        record: &ClaimRecord,
        late: LateCreates,
    ) -> Result<(), ClaimFailure> {
        // The record describes the instances either way: one that cannot say "unpreparing" (a
        // read-only or full state directory) still lets the GPU be freed. The CDI spec then
        // stays with the prepared record, which recovery leaves alone, and the claim fails with
        // the write error; a retry, once the file can be written, finds the instances gone and
        // finishes.
        let recorded = match self.inner.journal.start_unprepare(uid, record) {
            Ok(true) => {
                self.step(uid, Step::UnprepareRecorded);
                Ok(())
            }
            Ok(false) => Ok(()),
            Err(e @ CheckpointError::Write { .. }) => {
                tracing::error!(claim = %record.key(), %uid, error = %e, "cannot record the unprepare; destroying the instances anyway");
                Err(e)
            }
            Err(e) => return Err(e.into()),
        };
        self.destroy_instances(locks, uid, record, late)?;
        recorded?;
        self.inner.cdi.remove_claim_spec(uid)?;
        self.step(uid, Step::CdiRemoved);
        self.inner.journal.forget(uid)?;
        self.step(uid, Step::ClaimForgotten);
        // Whoever tore it down (recovery, the background repair, the kubelet's unprepare or a
        // retried prepare), nothing is left to repair.
        if self.inner.gpus.clear_recovery_pending(uid) {
            tracing::info!(claim = %record.key(), %uid, "pending recovery resolved");
        }
        if record.state == ClaimState::PrepareStarted {
            tracing::info!(claim = %record.key(), %uid, "rolled back");
        } else {
            tracing::info!(claim = %record.key(), %uid, "unprepared");
        }
        Ok(())
    }

    /// Destroys the record's instances. On a lost GPU (or one NVML no longer has) they count
    /// as gone, so the claim can be forgotten and its pod terminate; they are listed as
    /// orphans first ([`crate::orphans`]), to be destroyed if the GPU comes back with them.
    fn destroy_instances(
        &self,
        locks: &GpuLocks<'_>,
        uid: &str,
        record: &ClaimRecord,
        late: LateCreates,
    ) -> Result<(), ClaimFailure> {
        let mut orphans = Vec::new();
        let result = self.destroy_reachable_instances(locks, uid, record, late, &mut orphans);
        if !orphans.is_empty() {
            match self.inner.gpus.orphans() {
                Some(list) => {
                    list.add(orphans).inspect_err(|_| {
                        self.inner.metrics.state_write_failed("lost_gpu_orphans");
                    })?;
                    self.step(uid, Step::OrphansListed);
                }
                None => {
                    tracing::warn!(claim = %record.key(), "instances on a lost GPU are not tracked; they stay if it comes back")
                }
            }
        }
        result
    }

    fn destroy_reachable_instances(
        &self,
        locks: &GpuLocks<'_>,
        uid: &str,
        record: &ClaimRecord,
        late: LateCreates,
        orphans: &mut Vec<OrphanedInstance>,
    ) -> Result<(), ClaimFailure> {
        for device in &record.devices {
            let DeviceKind::Mig {
                profile_id,
                start,
                gpu_instance,
                ..
            } = &device.kind
            else {
                continue;
            };
            if device.is_share() {
                let holders = self.inner.journal.other_holders(uid, device);
                if let Some((_, holder)) = holders.first() {
                    // Not the last share: the instance stays for the others.
                    tracing::info!(claim = %record.key(), device = %device.device, holders = holders.len(), holder = %holder.key(), "released a share; the MIG instance stays for the claims still holding it");
                    self.step(uid, Step::ShareReleased);
                    continue;
                }
            }
            let orphan = || OrphanedInstance {
                gpu_uuid: device.gpu_uuid.clone(),
                gpu_minor: device.gpu_minor,
                profile_id: *profile_id,
                start: *start,
                gpu_instance: *gpu_instance,
                claim: record.key(),
                device: device.device.clone(),
                awaited_until: None,
            };
            let Some(index) = locks.index(device.gpu_minor) else {
                tracing::warn!(device = %device.device, "GPU is gone; its instance counts as gone (destroyed if the GPU comes back)");
                orphans.push(orphan());
                continue;
            };
            let instances = match self.backend().list_gpu_instances(index) {
                Ok(list) => list,
                Err(e) if e.kind == NvmlErrorKind::GpuLost => {
                    tracing::warn!(claim = %record.key(), device = %device.device, error = %e, "GPU is lost; its instance counts as gone (destroyed if the GPU comes back)");
                    orphans.push(orphan());
                    continue;
                }
                // NOT_SUPPORTED means "gone" only when MIG mode is off (every instance went
                // with it); with MIG on the instance may still exist, so the claim stays.
                Err(e) if e.kind == NvmlErrorKind::NotSupported => match self
                    .backend()
                    .mig_enabled(index)
                    .map_err(on_device(&device.device))?
                {
                    Some(true) => return Err(on_device(&device.device)(e).into()),
                    Some(false) | None => {
                        tracing::debug!(device = %device.device, "MIG mode is off; the instance is gone");
                        continue;
                    }
                },
                Err(e) => return Err(on_device(&device.device)(e).into()),
            };
            let ours = instances.iter().find(|gi| {
                gi.profile_id == *profile_id
                    && gi.start == *start
                    && gpu_instance.is_none_or(|id| id == gi.id)
            });
            let Some(gi) = ours else {
                // No ID recorded: its create had not returned when the record was last written.
                if late == LateCreates::Possible
                    && record.state == ClaimState::PrepareStarted
                    && gpu_instance.is_none()
                {
                    tracing::info!(claim = %record.key(), device = %device.device, watch = ?LATE_CREATE_WATCH, "no instance yet; its create may still complete, so the placement is watched and a late instance destroyed");
                    orphans.push(OrphanedInstance {
                        awaited_until: Some(epoch_seconds().saturating_add(LATE_CREATE_WATCH.as_secs())),
                        ..orphan()
                    });
                } else {
                    tracing::debug!(device = %device.device, "instance already gone");
                }
                continue;
            };
            // The GPU may be lost between listing and destroying.
            let lost = |e: &crate::nvml::BackendError| e.kind == NvmlErrorKind::GpuLost;
            let mut gone_with_gpu = false;
            for ci in &gi.compute_instances {
                match self.backend().destroy_compute_instance(index, gi.id, ci.id) {
                    Err(e) if lost(&e) => {
                        gone_with_gpu = true;
                        break;
                    }
                    Err(e) if e.kind != NvmlErrorKind::NotFound => {
                        return Err(on_device(&device.device)(e).into());
                    }
                    _ => self.step(uid, Step::ComputeInstanceDestroyed),
                }
            }
            if !gone_with_gpu {
                match self.backend().destroy_gpu_instance(index, gi.id) {
                    Err(e) if lost(&e) => gone_with_gpu = true,
                    Err(e) if e.kind != NvmlErrorKind::NotFound => {
                        return Err(on_device(&device.device)(e).into());
                    }
                    _ => self.step(uid, Step::GpuInstanceDestroyed),
                }
            }
            if gone_with_gpu {
                tracing::warn!(claim = %record.key(), device = %device.device, "GPU was lost while its instance was destroyed; it counts as gone (destroyed if the GPU comes back)");
                orphans.push(OrphanedInstance {
                    gpu_instance: Some(gi.id),
                    ..orphan()
                });
                continue;
            }
            tracing::info!(claim = %record.key(), device = %device.device, gpu_instance = gi.id, "destroyed MIG instance");
        }
        Ok(())
    }
}

/// Whether a half-prepared record's creates may complete after it is torn down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LateCreates {
    /// Every create it started has returned.
    Impossible,
    /// It may have been left by a plugin that died inside a create, or a create ran past its
    /// bound.
    Possible,
}
