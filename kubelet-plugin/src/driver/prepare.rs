//! Prepare: read and validate each claim, then plan, record, create, hand out.

use std::{
    collections::{BTreeMap, HashMap},
    time::Instant,
};

use super::{ClaimFailure, Driver, PrepareResult, Step};
use crate::{
    cdi::ClaimDevice,
    checkpoint::{ClaimRecord, ClaimState, DeviceKind, DeviceRecord},
    claims::{self, AllocatedDevice, ClaimError, ClaimSource},
    gpus::GpuLocks,
    nvml::{GpuBackend, MigModeChange, NvmlErrorKind},
    plan::{self, Rejection},
    state_dir::NodeLock,
};
use migdra_kubeletplugin::{ClaimRef, PreparedDevice};

impl<B: GpuBackend + 'static, C: ClaimSource> Driver<B, C> {
    /// Prepares claims: one outcome per claim UID, with the typed failure. (The kubelet's
    /// [`migdra_kubeletplugin::DraDriver::prepare`] is this, with the failures as messages.)
    pub async fn prepare_claims(&self, claims: Vec<ClaimRef>) -> HashMap<String, PrepareResult> {
        let started = Instant::now();
        let mut outcomes = HashMap::with_capacity(claims.len());
        let mut pending = Vec::new();
        // The fast path below answers without the node lock, so first catch up with what
        // another plugin instance (a rolling update) wrote: a claim it unprepared meanwhile
        // must not be answered from this instance's stale copy. The file is replaced
        // atomically, so reading it without the lock sees one whole version. When it cannot
        // be read, every claim takes the locked path, which reports why.
        let fresh = match self.inner.journal.reload_if_changed() {
            Ok(_) => true,
            Err(e) => {
                tracing::warn!(error = %e, "cannot re-read the checkpoint; answering no claim from it before the node lock");
                false
            }
        };
        for claim in claims {
            // Idempotency without an API call: a completed claim is answered from the record.
            let completed = if fresh {
                self.inner.journal.completed(&claim.uid)
            } else {
                None
            };
            match completed {
                Some(record) => {
                    self.inner.metrics.claim("prepare", true);
                    outcomes.insert(claim.uid.clone(), Ok(self.prepared_devices(&claim.uid, &record)));
                }
                None => pending.push(claim),
            }
        }
        let fetched = futures::future::join_all(pending.into_iter().map(|claim| async move {
            let devices = self.fetch_allocation(&claim).await;
            (claim, devices)
        }))
        .await;

        let prepared = self
            .run_claims("prepare", fetched, |driver, node, claim, devices| {
                driver.prepare_allocated(node, claim, devices?)
            })
            .await;
        outcomes.extend(prepared);
        self.inner.metrics.call("prepare", started.elapsed());
        outcomes
    }

    /// GETs a claim and extracts its devices of this driver and pool. No lock held.
    async fn fetch_allocation(&self, claim: &ClaimRef) -> Result<Vec<AllocatedDevice>, ClaimFailure> {
        let key = format!("{}/{}", claim.namespace, claim.name);
        match self.inner.claims.get(&claim.namespace, &claim.name).await {
            Ok(Some(object)) => Ok(claims::allocated_devices(
                &object,
                &claim.uid,
                &self.inner.config.driver_name,
                self.pool(),
            )?),
            Ok(None) => Err(ClaimError::NotFound { claim: key }.into()),
            Err(source) => Err(ClaimError::Api { claim: key, source }.into()),
        }
    }

    /// Prepares one claim whose allocation was already read and validated. Blocking.
    fn prepare_allocated(
        &self,
        node: &NodeLock,
        claim: &ClaimRef,
        devices: Vec<AllocatedDevice>,
    ) -> Result<Vec<PreparedDevice>, ClaimFailure> {
        let locks = node.lock_gpus(&self.inner.gpus, devices.iter().map(|d| d.name.minor()));
        // Re-check under the locks: a concurrent call may have finished it meanwhile.
        match self.inner.journal.get(&claim.uid) {
            Some(record) if record.state == ClaimState::PrepareCompleted => {
                return Ok(self.prepared_devices(&claim.uid, &record));
            }
            Some(record) => {
                if record.state == ClaimState::PrepareStarted {
                    tracing::info!(claim = %record.key(), "rolling back an earlier, interrupted prepare");
                } else {
                    tracing::info!(claim = %record.key(), "finishing an earlier, interrupted unprepare before preparing");
                }
                self.tear_down(&locks, &claim.uid, &record)?;
            }
            None => {}
        }
        // A GPU with another claim's record that recovery could not repair is off limits: what
        // is on it is not known to be what the journal says.
        for device in &devices {
            let minor = device.name.minor();
            if let Some(pending) = self.inner.gpus.recovery_pending_on(minor, Some(&claim.uid)) {
                return Err(Rejection::GpuRecoveryPending {
                    device: device.device.clone(),
                    minor,
                    claim: pending.claim,
                    error: pending.error,
                }
                .into());
            }
        }
        // A lost GPU answers nothing; say so rather than fail somewhere in planning.
        for device in &devices {
            let minor = device.name.minor();
            if let Some(index) = locks.index(minor)
                && let Err(e) = self.backend().probe_health(index)
                && e.kind == NvmlErrorKind::GpuLost
            {
                return Err(Rejection::GpuLost {
                    device: device.device.clone(),
                    minor,
                    message: e.to_string(),
                }
                .into());
            }
        }
        // Instances a lost GPU kept for claims already torn down may block the placements.
        locks.destroy_orphans(&self.inner.gpus, &self.inner.journal.claims());
        // Before anything is created: a node that cannot run CUDA containers hands out nothing.
        self.ensure_driver_spec()?;
        let others = self.inner.journal.others(&claim.uid);
        let plan = plan::plan(&devices, &locks.views(&self.inner.gpus), &others)?;
        let mut record =
            self.inner
                .journal
                .start_prepare(&claim.uid, &claim.namespace, &claim.name, plan.devices)?;
        self.step(&claim.uid, Step::PrepareRecorded);
        match self.create_all(&locks, &claim.uid, &mut record, plan.mig_mode_changes) {
            Ok(()) => Ok(self.prepared_devices(&claim.uid, &record)),
            Err(failure) => {
                tracing::warn!(claim = %record.key(), error = %failure, "prepare failed; rolling back");
                let latest = self.inner.journal.get(&claim.uid).unwrap_or(record);
                match self.tear_down(&locks, &claim.uid, &latest) {
                    Ok(()) => Err(failure),
                    Err(rollback) => Err(ClaimFailure::RollbackFailed(
                        Box::new(failure),
                        Box::new(rollback),
                    )),
                }
            }
        }
    }

    /// Switches a locked GPU's MIG mode and refreshes its description.
    fn switch_mig_mode(&self, locks: &GpuLocks<'_>, minor: u32, enabled: bool) -> Result<(), ClaimFailure> {
        let index = locks.index(minor).ok_or(Rejection::GpuGone { minor })?;
        tracing::info!(gpu = minor, enabled, "switching MIG mode");
        match self.backend().set_mig_mode(index, enabled)? {
            MigModeChange::Applied => {
                locks.set_mig_mode(minor, enabled);
                Ok(())
            }
            MigModeChange::PendingReset => {
                // Withdraw the pending change, so a later reset does not switch a GPU that no
                // claim asked for any more; the claim is refused either way.
                match self.backend().set_mig_mode(index, !enabled) {
                    Ok(_) => tracing::info!(gpu = minor, "withdrew the pending MIG-mode change"),
                    Err(e) => {
                        tracing::warn!(gpu = minor, error = %e, "could not withdraw the pending MIG-mode change")
                    }
                }
                Err(Rejection::MigModeChangePending { minor }.into())
            }
        }
    }

    /// Carries out a recorded plan: MIG-mode switches, then each instance (recorded as soon as
    /// it exists), the CDI spec, and the completion record.
    fn create_all(
        &self,
        locks: &GpuLocks<'_>,
        uid: &str,
        record: &mut ClaimRecord,
        mut mig_mode_changes: BTreeMap<u32, bool>,
    ) -> Result<(), ClaimFailure> {
        for i in 0..record.devices.len() {
            let device = &record.devices[i];
            let minor = device.gpu_minor;
            // A GPU's mode is switched when its first device is reached.
            if let Some(enabled) = mig_mode_changes.remove(&minor) {
                self.switch_mig_mode(locks, minor, enabled)?;
            }
            let DeviceKind::Mig {
                profile_id, start, ..
            } = device.kind
            else {
                continue;
            };
            let index = locks.index(minor).ok_or(Rejection::GpuGone { minor })?;
            let gi = self.backend().create_gpu_instance(index, profile_id, start)?;
            self.step(uid, Step::GpuInstanceCreated);
            let ci = self.backend().create_full_compute_instance(index, gi)?;
            self.step(uid, Step::ComputeInstanceCreated);
            if let DeviceKind::Mig {
                gpu_instance,
                compute_instance,
                mig_uuid,
                ..
            } = &mut record.devices[i].kind
            {
                *gpu_instance = Some(gi);
                *compute_instance = Some(ci.id);
                *mig_uuid = Some(ci.mig_uuid.clone());
            }
            self.inner.journal.record_devices(uid, record)?;
            self.step(uid, Step::DeviceRecorded);
            tracing::info!(claim = %record.key(), device = %record.devices[i].device, gpu_instance = gi, compute_instance = ci.id, mig_uuid = %ci.mig_uuid, "created MIG instance");
        }
        self.write_cdi(uid, &record.devices)?;
        self.step(uid, Step::CdiWritten);
        self.inner.journal.complete_prepare(uid, record)?;
        self.step(uid, Step::PrepareCompleted);
        Ok(())
    }

    /// Writes a claim's CDI spec from its device records. Each device's environment is its
    /// configured variables plus its own UUID variable ([`uuid_variable`]): no two devices
    /// set the same variable, so a container with several devices gets all of them.
    pub(super) fn write_cdi(&self, uid: &str, devices: &[DeviceRecord]) -> Result<(), ClaimFailure> {
        let cdi_devices: Vec<ClaimDevice> = devices
            .iter()
            .map(|d| {
                let mut env = d.env.clone();
                env.insert(uuid_variable(&d.device), device_uuid(d));
                let mig = match &d.kind {
                    DeviceKind::Mig {
                        gpu_instance: Some(gi),
                        compute_instance: Some(ci),
                        ..
                    } => Some((*gi, *ci)),
                    _ => None,
                };
                ClaimDevice {
                    device_name: d.device.clone(),
                    gpu_minor: d.gpu_minor,
                    mig,
                    env,
                }
            })
            .collect();
        self.inner.cdi.write_claim_spec(uid, &cdi_devices)?;
        Ok(())
    }

    fn prepared_devices(&self, uid: &str, record: &ClaimRecord) -> Vec<PreparedDevice> {
        record
            .devices
            .iter()
            .map(|d| PreparedDevice {
                request_names: vec![claims::base_request(&d.request).to_string()],
                pool_name: d.pool.clone(),
                device_name: d.device.clone(),
                cdi_device_ids: self.inner.cdi.device_ids(uid, &d.device),
                share_id: None,
            })
            .collect()
    }
}

/// The device's UUID: the MIG device's, or the GPU's.
fn device_uuid(device: &DeviceRecord) -> String {
    match &device.kind {
        DeviceKind::Mig {
            mig_uuid: Some(uuid), ..
        } => uuid.clone(),
        _ => device.gpu_uuid.clone(),
    }
}

/// The environment variable that carries a device's UUID in the container:
/// `MIGDRA_DEVICE_UUID_<device name>`, upper-cased, other characters as `_`. Device names
/// are unique on a node, so two devices in one container never set the same variable.
pub fn uuid_variable(device_name: &str) -> String {
    let suffix: String = device_name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("{}{suffix}", migdra_api::config::DEVICE_UUID_ENV_PREFIX)
}
