//! Prepare: read and validate each claim, then plan, record, create, hand out, and write the
//! claim's status to the background writer. Also the periodic retry of status writes that
//! failed.

use std::{
    collections::{BTreeMap, HashMap},
    time::{Duration, Instant},
};

use tokio_util::sync::CancellationToken;

use super::{ClaimFailure, Driver, PrepareResult, Step, on_device};
use crate::{
    cdi::ClaimDevice,
    checkpoint::{AllocationEntry, ClaimRecord, ClaimState, DeviceKind, DeviceRecord},
    claim_status::{self, DesiredStatus, StatusContext, StatusDevice, StatusRetryRound},
    claims::{self, AllocatedDevice, ClaimError, ClaimSource},
    events::ClaimEvent,
    gpus::GpuLocks,
    nvml::{MigModeChange, NvmlErrorKind, timing::NvmlClock},
    plan::{self, Rejection},
    state_dir::NodeLock,
};
use dra_kubelet::{ClaimRef, PreparedDevice};

impl<C: ClaimSource> Driver<C> {
    /// Prepares claims: one outcome per claim UID, with the typed failure.
    pub async fn prepare_claims(&self, claims: Vec<ClaimRef>) -> HashMap<String, PrepareResult> {
        let started = Instant::now();
        let nvml = NvmlClock::new();
        let mut outcomes = HashMap::with_capacity(claims.len());
        let mut pending = Vec::new();
        // The fast path answers without the node lock, so first catch up with what another
        // plugin instance (a rolling update) wrote: a claim it unprepared meanwhile must not
        // be answered from a stale copy. Unreadable, every claim takes the locked path.
        let fresh = match self.inner.journal.reload_if_changed() {
            Ok(_) => true,
            Err(e) => {
                tracing::warn!(error = %e, "cannot re-read the checkpoint; answering no claim from it before the node lock");
                false
            }
        };
        let fetching = Instant::now();
        let fetched = futures::future::join_all(claims.into_iter().map(|claim| async move {
            let devices = self.fetch_allocation(&claim).await;
            (claim, devices)
        }))
        .await;
        let api_wait = fetching.elapsed();
        let read: Vec<String> = fetched.iter().map(|(claim, _)| claim.uid.clone()).collect();
        for (claim, fetched) in fetched {
            // Idempotency without the node lock: a completed claim is answered from its record
            // unless the claim now has other devices. An unreadable claim proves no change.
            let record = fresh.then(|| self.inner.journal.completed(&claim.uid)).flatten();
            let answers = |record: &ClaimRecord| match &fetched {
                Ok((devices, _)) => record.made_for(devices.iter().map(AllocationEntry::from)),
                Err(_) => true,
            };
            match record {
                Some(record) if answers(&record) => {
                    self.inner.metrics.claim("prepare", true);
                    outcomes.insert(claim.uid.clone(), Ok(self.prepared_devices(&claim.uid, &record)));
                }
                _ => pending.push((claim, fetched)),
            }
        }

        let prepared = self
            .run_claims("prepare", &nvml, pending, |driver, node, claim, fetched| {
                let (devices, context) = fetched?;
                let admin_access = plan::admin_access(&devices)?;
                let (locks, earlier) = driver.release_earlier_allocation(node, claim, &devices)?;
                let reallocated = match &earlier {
                    Earlier::Released(released) => Some((
                        released.clone(),
                        devices.iter().map(|d| d.device.clone()).collect(),
                    )),
                    _ => None,
                };
                let (prepared, status, recorded) = match earlier {
                    Earlier::Prepared(record) => {
                        drop(locks);
                        let status = driver.recorded_status_devices(node, &claim.uid);
                        (driver.prepared_devices(&claim.uid, &record), status, true)
                    }
                    _ if admin_access => {
                        let (prepared, status) = driver.prepare_admin_access(&locks, claim, &devices)?;
                        (prepared, status, false)
                    }
                    _ => {
                        let prepared = driver.prepare_allocated(&locks, claim, devices)?;
                        // The status reads the GPUs' indexes under their locks again.
                        drop(locks);
                        (prepared, driver.recorded_status_devices(node, &claim.uid), true)
                    }
                };
                Ok(Prepared {
                    claim: claim.clone(),
                    devices: prepared,
                    status,
                    recorded,
                    context,
                    reallocated,
                })
            })
            .await;
        for uid in &read {
            self.inner.metrics.prepare_finished(uid);
        }
        // The checkpoint says prepared and every lock is released: the claims' status is
        // handed to the background writer; the kubelet's answer does not wait for it.
        for (uid, outcome) in prepared {
            let outcome = outcome.map(|done| {
                if let Some((released, prepared)) = &done.reallocated
                    && let Some(events) = self.inner.events.get()
                {
                    events.send(ClaimEvent::reallocated(&done.claim, released, prepared));
                }
                let desired = DesiredStatus::Ready {
                    devices: done.status,
                    recorded: done.recorded,
                };
                self.queue_claim_status(&done.claim, desired, done.context);
                done.devices
            });
            outcomes.insert(uid, outcome);
        }
        self.inner
            .metrics
            .call_with_nvml("prepare", started.elapsed(), &nvml, api_wait);
        outcomes
    }

    /// GETs a claim and extracts its devices of this driver and pool, and what its status
    /// entries need from it. No lock held.
    async fn fetch_allocation(
        &self,
        claim: &ClaimRef,
    ) -> Result<(Vec<AllocatedDevice>, StatusContext), ClaimFailure> {
        let key = format!("{}/{}", claim.namespace, claim.name);
        let driver = &self.inner.config.driver_name;
        let asked = Instant::now();
        let answer = self.inner.claims.get(&claim.namespace, &claim.name).await;
        self.inner.metrics.claim_get(asked.elapsed());
        match answer {
            Ok(Some(object)) => {
                self.inner.metrics.claim_read(&claim.uid, &object);
                let devices = claims::allocated_devices(&object, &claim.uid, driver, self.pool())?;
                Ok((
                    devices,
                    StatusContext::from_claim(&object, driver, claim_status::now()),
                ))
            }
            Ok(None) => Err(ClaimError::NotFound { claim: key }.into()),
            Err(source) => Err(ClaimError::Api { claim: key, source }.into()),
        }
    }

    /// The status entries' devices of a completed record (with the GPUs' NVML indexes, read
    /// under their locks).
    fn recorded_status_devices(&self, node: &NodeLock, uid: &str) -> Vec<StatusDevice> {
        let Some(record) = self.inner.journal.completed(uid) else {
            return Vec::new();
        };
        let locks = self.lock_record_gpus(node, &record);
        record
            .devices
            .iter()
            .filter_map(|d| StatusDevice::from_record(d, locks.index(d.gpu_minor)))
            .collect()
    }

    /// Prepares an `adminAccess` claim (whole GPUs, checked by [`plan::admin_access`]): a CDI
    /// spec with each GPU's device nodes, plus the MIG monitor capability on a GPU in MIG mode so
    /// the agent sees every instance. No plan, record (so it blocks no claim and is not counted as
    /// prepared), MIG-mode switch or instance. Unprepare removes the spec. Blocking.
    fn prepare_admin_access(
        &self,
        locks: &GpuLocks<'_>,
        claim: &ClaimRef,
        devices: &[AllocatedDevice],
    ) -> Result<(Vec<PreparedDevice>, Vec<StatusDevice>), ClaimFailure> {
        // The locks only read the GPUs' descriptions consistently; nothing on them changes.
        self.ensure_driver_spec()?;
        let mut cdi_devices = Vec::with_capacity(devices.len());
        let mut status = Vec::with_capacity(devices.len());
        for device in devices {
            let minor = device.name.minor();
            let description = locks.description(minor).ok_or_else(|| Rejection::NoSuchGpu {
                device: device.device.clone(),
                minor,
            })?;
            let mut env = device.config.env.clone();
            env.insert(uuid_variable(&device.device), description.uuid.clone());
            cdi_devices.push(ClaimDevice {
                device_name: device.device.clone(),
                gpu_minor: minor,
                mig: None,
                mig_monitor: description.mig.as_ref().is_some_and(|m| m.enabled),
                env,
            });
            status.push(StatusDevice::admin_gpu(
                &device.request,
                &device.pool,
                &device.device,
                &description.uuid,
                description.index,
                minor,
            ));
        }
        self.inner.cdi.write_claim_spec(claim, &cdi_devices)?;
        tracing::info!(claim = %format!("{}/{}", claim.namespace, claim.name), uid = %claim.uid, devices = devices.len(), "prepared for monitoring (adminAccess): nothing created, changed or reserved");
        let prepared = devices
            .iter()
            .map(|d| self.prepared_device(&claim.uid, &d.request, &d.pool, &d.device, None))
            .collect();
        Ok((prepared, status))
    }

    /// Asks for `claim`'s status to become `desired` and makes sure a background writer
    /// ([`crate::claim_status::ClaimStatusWriter::write_queued`]) runs. Nobody awaits it: at
    /// shutdown it drops with the runtime, and the next start queues every prepared claim's status.
    pub(super) fn queue_claim_status(
        &self,
        claim: &ClaimRef,
        desired: DesiredStatus,
        context: StatusContext,
    ) {
        if self.inner.status.queue_write(claim, desired, context) {
            let driver = self.clone();
            tokio::spawn(async move {
                let journal = &driver.inner.journal;
                // Another plugin instance (a rolling update) may have unprepared the claim
                // since: re-read the checkpoint; unreadable, this instance's copy decides.
                let still_prepared = |uid: &str| {
                    if let Err(e) = journal.reload_if_changed() {
                        tracing::debug!(error = %e, "cannot re-read the checkpoint before a claim status write");
                    }
                    journal.completed(uid).is_some()
                };
                driver
                    .inner
                    .status
                    .write_queued(&driver.inner.claims, still_prepared)
                    .await;
            });
        }
    }

    /// See [`crate::claim_status::ClaimStatusWriter::pending_claims`].
    pub fn claim_status_pending(&self) -> Vec<String> {
        self.inner.status.pending_claims()
    }

    /// Empty once every prepare's and unprepare's status write was tried.
    pub fn claim_status_queued(&self) -> Vec<String> {
        self.inner.status.queued_claims()
    }

    pub async fn retry_claim_status(&self) -> StatusRetryRound {
        let journal = &self.inner.journal;
        // Another plugin instance (a rolling update) may have unprepared claims since this
        // one last read the checkpoint; their status must not be written back as ready.
        if let Err(e) = journal.reload_if_changed() {
            tracing::warn!(error = %e, "cannot re-read the checkpoint; claim status retries wait for the next pass");
            return StatusRetryRound::default();
        }
        self.inner
            .status
            .retry_pending(&self.inner.claims, |uid| journal.completed(uid).is_some())
            .await
    }

    /// Queues a status write for every claim the checkpoint holds as prepared (a previous run may
    /// have stopped before writing it) for the next retry pass. GPU indexes come from `inventory`.
    pub fn queue_recorded_claim_status(&self, inventory: &[migdra_api::inventory::GpuInventory]) {
        let index = |minor: u32| inventory.iter().find(|g| g.minor == minor).map(|g| g.index);
        for (uid, record) in self.inner.journal.claims() {
            if record.state != ClaimState::PrepareCompleted {
                continue;
            }
            let devices = record
                .devices
                .iter()
                .filter_map(|d| StatusDevice::from_record(d, index(d.gpu_minor)))
                .collect();
            let claim = ClaimRef {
                namespace: record.namespace.clone(),
                uid,
                name: record.name.clone(),
            };
            self.inner.status.enqueue_ready(claim, devices);
        }
    }

    /// Every `interval` until `shutdown`, retries the claim status writes that failed. The
    /// first pass runs at once and covers every claim a previous run prepared.
    pub async fn run_claim_status_retries(self, interval: Duration, shutdown: CancellationToken) {
        let gpus = self.inner.gpus.clone();
        match tokio::task::spawn_blocking(move || gpus.inventory()).await {
            Ok(Ok(inventory)) => self.queue_recorded_claim_status(&inventory),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "no GPU inventory; recorded claims' status is not refreshed at start")
            }
            Err(e) => tracing::warn!(error = %e, "GPU inventory task failed"),
        }
        loop {
            let round = self.retry_claim_status().await;
            if round != StatusRetryRound::default() {
                tracing::info!(
                    written = round.written.len(),
                    dropped = round.dropped.len(),
                    failed = round.failed.len(),
                    "claim status retry pass"
                );
            }
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = shutdown.cancelled() => return,
            }
        }
    }

    /// Locks the GPUs of `devices` and of the claim's record, and releases a record that does
    /// not answer for `devices` the way an unprepare does: one left half done, or one made for
    /// an earlier allocation (the claim was deallocated and allocated again under the same UID
    /// while its unprepare was missed), so its placements are free for the new devices. Each
    /// step of the release is recorded, so a crash in it is repaired like an unprepare's and
    /// the kubelet's retry finds no record. Blocking.
    fn release_earlier_allocation<'n>(
        &self,
        node: &'n NodeLock,
        claim: &ClaimRef,
        devices: &[AllocatedDevice],
    ) -> Result<(GpuLocks<'n>, Earlier), ClaimFailure> {
        let record = self.inner.journal.get(&claim.uid);
        let recorded_minors = record.iter().flat_map(|r| r.devices.iter().map(|d| d.gpu_minor));
        let minors: Vec<u32> = devices
            .iter()
            .map(|d| d.name.minor())
            .chain(recorded_minors)
            .collect();
        // A GPU lost (or not yet answering) when the plugin started is unknown until a rescan.
        if minors.iter().any(|m| !self.inner.gpus.knows(*m))
            && let Err(e) = self.inner.gpus.learn_new_gpus()
        {
            tracing::warn!(error = %e, "rescanning for GPUs this plugin does not know yet failed");
        }
        let locks = node.lock_gpus(&self.inner.gpus, minors);
        // Re-read under the locks: a concurrent call may have finished it meanwhile.
        let Some(record) = self.inner.journal.get(&claim.uid) else {
            return Ok((locks, Earlier::None));
        };
        let same = record.made_for(devices.iter().map(AllocationEntry::from));
        if same && record.state == ClaimState::PrepareCompleted {
            return Ok((locks, Earlier::Prepared(record)));
        }
        if !same {
            let now: Vec<&str> = devices.iter().map(|d| d.device.as_str()).collect();
            tracing::warn!(claim = %record.key(), uid = %claim.uid, recorded = ?record.device_names(), allocated = ?now, "the claim was allocated other devices under the same UID; releasing the recorded ones first");
        } else if record.state == ClaimState::PrepareStarted {
            tracing::info!(claim = %record.key(), "rolling back an earlier, interrupted prepare");
        } else {
            tracing::info!(claim = %record.key(), "finishing an earlier, interrupted unprepare before preparing");
        }
        self.tear_down(&locks, &claim.uid, &record)?;
        let earlier = if same {
            Earlier::None
        } else {
            Earlier::Released(record.device_names())
        };
        Ok((locks, earlier))
    }

    /// Prepares one claim whose allocation was already read and validated, with its GPUs
    /// locked and no record of it left. Blocking.
    fn prepare_allocated(
        &self,
        locks: &GpuLocks<'_>,
        claim: &ClaimRef,
        devices: Vec<AllocatedDevice>,
    ) -> Result<Vec<PreparedDevice>, ClaimFailure> {
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
        match self.create_all(locks, &claim.uid, &mut record, plan.mig_mode_changes) {
            Ok(()) => Ok(self.prepared_devices(&claim.uid, &record)),
            Err(failure) => {
                tracing::warn!(claim = %record.key(), error = %failure, "prepare failed; rolling back");
                let latest = self.inner.journal.get(&claim.uid).unwrap_or(record);
                match self.roll_back_failed_prepare(locks, &claim.uid, &latest, &failure) {
                    Ok(()) => Err(failure),
                    Err(rollback) => Err(ClaimFailure::RollbackFailed(
                        Box::new(failure),
                        Box::new(rollback),
                    )),
                }
            }
        }
    }

    /// Switches a locked GPU's MIG mode and refreshes its description. Refused without
    /// touching the GPU when the change needs a reset the driver cannot do (Ampere passed
    /// through to a VM), or when processes NVML lists hold it; a switch NVML refuses as in use fails the claim at once. A change
    /// NVML leaves pending is withdrawn, so no later reset switches a GPU nobody asked for.
    fn switch_mig_mode(
        &self,
        locks: &GpuLocks<'_>,
        uid: &str,
        device: &str,
        minor: u32,
        enabled: bool,
    ) -> Result<(), ClaimFailure> {
        let description = locks.description(minor).ok_or(Rejection::GpuGone { minor })?;
        let index = description.index;
        let in_vm = description.mig.as_ref().is_some_and(|m| m.passthrough);
        if in_vm && !crate::plan::mode_switchable(&description) {
            return Err(Rejection::MigModeNeedsReset {
                device: device.to_string(),
                minor,
                enabled,
            }
            .into());
        }
        let pids = self.backend().gpu_processes(index).map_err(on_device(device))?;
        if !pids.is_empty() {
            return Err(Rejection::MigModeSwitchBlocked {
                device: device.to_string(),
                minor,
                enabled,
                holders: self.describe_processes(&pids),
            }
            .into());
        }
        tracing::info!(gpu = minor, enabled, "switching MIG mode");
        match self.backend().set_mig_mode(index, enabled) {
            Ok(MigModeChange::Applied) => {
                locks.set_mig_mode(minor, enabled);
                self.step(uid, Step::MigModeSwitched);
                Ok(())
            }
            Ok(MigModeChange::PendingReset) => {
                self.step(uid, Step::MigModeChangePending);
                match self.backend().set_mig_mode(index, !enabled) {
                    Ok(MigModeChange::Applied) => {
                        tracing::info!(gpu = minor, "withdrew the pending MIG-mode change")
                    }
                    Ok(MigModeChange::PendingReset) => {
                        tracing::warn!(gpu = minor, "the withdrawn MIG-mode change is still pending")
                    }
                    Err(e) => {
                        tracing::warn!(gpu = minor, error = %e, "could not withdraw the pending MIG-mode change")
                    }
                }
                Err(Rejection::MigModeChangePending {
                    device: device.to_string(),
                    minor,
                }
                .into())
            }
            Err(e) if e.kind == NvmlErrorKind::InUse => {
                tracing::info!(gpu = minor, error = %e, "MIG-mode switch refused: the GPU is in use");
                Err(Rejection::MigModeSwitchBlocked {
                    device: device.to_string(),
                    minor,
                    enabled,
                    holders: Vec::new(),
                }
                .into())
            }
            Err(e) => Err(on_device(device)(e).into()),
        }
    }

    /// `pid 4242 (python3)` for each PID, the name from `/proc/<pid>/comm` where this process
    /// can see it (another PID namespace hides it).
    fn describe_processes(&self, pids: &[u32]) -> Vec<String> {
        pids.iter()
            .map(|pid| {
                let comm = self.inner.cdi.proc_root().join(pid.to_string()).join("comm");
                match std::fs::read_to_string(comm) {
                    Ok(name) if !name.trim().is_empty() => format!("pid {pid} ({})", name.trim()),
                    _ => format!("pid {pid}"),
                }
            })
            .collect()
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
                self.switch_mig_mode(locks, uid, &device.device, minor, enabled)?;
            }
            let DeviceKind::Mig {
                profile_id,
                start,
                gpu_instance,
                ..
            } = device.kind
            else {
                continue;
            };
            if device.is_share()
                && let Some(gi) = gpu_instance
            {
                // Planned as a join: the instance exists and the record already names it.
                self.step(uid, Step::ShareJoined);
                tracing::info!(claim = %record.key(), device = %device.device, gpu_instance = gi, "joined the shared MIG instance other claims hold");
                continue;
            }
            let index = locks.index(minor).ok_or(Rejection::GpuGone { minor })?;
            let named = &record.devices[i].device;
            let gi = self
                .backend()
                .create_gpu_instance(index, profile_id, start)
                .map_err(on_device(named))?;
            self.step(uid, Step::GpuInstanceCreated);
            let ci = self
                .backend()
                .create_full_compute_instance(index, gi)
                .map_err(on_device(named))?;
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
        self.write_cdi(uid, record)?;
        self.step(uid, Step::CdiWritten);
        self.inner.journal.complete_prepare(uid, record)?;
        self.step(uid, Step::PrepareCompleted);
        Ok(())
    }

    /// Writes a claim's CDI spec from its record. Each device's environment is its
    /// configured variables plus its own UUID variable ([`uuid_variable`]): no two devices
    /// set the same variable, so a container with several devices gets all of them.
    pub(super) fn write_cdi(&self, uid: &str, record: &ClaimRecord) -> Result<(), ClaimFailure> {
        let cdi_devices: Vec<ClaimDevice> = record
            .devices
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
                    mig_monitor: false,
                    env,
                }
            })
            .collect();
        let claim = ClaimRef {
            namespace: record.namespace.clone(),
            uid: uid.to_string(),
            name: record.name.clone(),
        };
        self.inner.cdi.write_claim_spec(&claim, &cdi_devices)?;
        Ok(())
    }

    fn prepared_devices(&self, uid: &str, record: &ClaimRecord) -> Vec<PreparedDevice> {
        record
            .devices
            .iter()
            .map(|d| self.prepared_device(uid, &d.request, &d.pool, &d.device, d.share_id.clone()))
            .collect()
    }

    fn prepared_device(
        &self,
        uid: &str,
        request: &str,
        pool: &str,
        device: &str,
        share_id: Option<String>,
    ) -> PreparedDevice {
        PreparedDevice {
            request_names: vec![claims::base_request(request).to_string()],
            pool_name: pool.to_string(),
            device_name: device.to_string(),
            cdi_device_ids: self.inner.cdi.device_ids(uid, device),
            share_id,
        }
    }
}

/// A claim prepared under the locks, with what its status write needs.
struct Prepared {
    claim: ClaimRef,
    devices: Vec<PreparedDevice>,
    status: Vec<StatusDevice>,
    recorded: bool,
    context: StatusContext,
    /// The device names released and prepared when the claim was allocated other devices
    /// under the same UID.
    reallocated: Option<(Vec<String>, Vec<String>)>,
}

/// What [`Driver::release_earlier_allocation`] found of a claim's record.
enum Earlier {
    /// No record, or one left half done for the same devices, now released.
    None,
    /// Completed for exactly the claim's current devices.
    Prepared(ClaimRecord),
    /// Made for other devices (these names), now released.
    Released(Vec<String>),
}

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
