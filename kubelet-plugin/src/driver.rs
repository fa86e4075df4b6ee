//! The prepare/unprepare state machine.
//!
//! Prepare, per claim: GET the claim and validate it (no lock held, nothing created), then,
//! under the node lock and the locks of the claim's GPUs: check the placements are free,
//! record `PrepareStarted` with the intended placements, create each GPU instance and its
//! full compute instance, write the CDI spec, record `PrepareCompleted`. Any failure after
//! the record rolls back what was created and forgets the claim.
//!
//! Unprepare, per claim: record `UnprepareStarted`, destroy compute then GPU instances,
//! remove the CDI spec, forget the claim. Already gone is success.
//!
//! Because the record is written before the GPU is touched, a crash between any two steps
//! is repaired from the checkpoint alone: at start, half-prepared claims are rolled back and
//! half-unprepared ones finished; every instance the checkpoint does not describe belongs
//! to someone else and is never touched.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fs::File,
    path::PathBuf,
    sync::{Arc, Mutex, MutexGuard, RwLock},
    time::{Duration, Instant},
};

use migdra_api::{
    device_name::DeviceName,
    geometry::{MigGeometry, MigProfile, Placement},
    inventory::{self, GpuHealth, GpuInventory, InstanceOwner, MigInstance, MigInventory},
};

use crate::{
    cdi::{CdiError, CdiWriter, ClaimDevice},
    checkpoint::{
        Checkpoint, CheckpointError, ClaimRecord, ClaimState, DeviceKind, DeviceRecord, LoadOutcome,
    },
    claims::{self, AllocatedDevice, ClaimError, ClaimSource},
    grpc::{ClaimRef, DeviceHealthReport, DraDriver, PrepareOutcome, PreparedDevice, UnprepareOutcome},
    metrics::Metrics,
    nvml::{BackendError, GpuBackend, GpuDescription, GpuInstanceRecord, MigModeChange, NvmlErrorKind},
};

/// A point between two steps of prepare or unprepare. Tests stop the driver at each one to
/// prove that a crash there is repaired.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Step {
    /// `PrepareStarted` written.
    PrepareRecorded,
    /// A GPU instance exists.
    GpuInstanceCreated,
    /// Its compute instance exists.
    ComputeInstanceCreated,
    /// The device's IDs are in the checkpoint.
    DeviceRecorded,
    /// The CDI spec is written.
    CdiWritten,
    /// `PrepareCompleted` written.
    PrepareCompleted,
    /// `UnprepareStarted` written.
    UnprepareRecorded,
    /// A compute instance was destroyed.
    ComputeInstanceDestroyed,
    /// A GPU instance was destroyed.
    GpuInstanceDestroyed,
    /// The CDI spec is removed.
    CdiRemoved,
    /// The claim is gone from the checkpoint.
    ClaimForgotten,
}

/// Called at every [`Step`] with the claim UID. Production passes a no-op.
pub type StepHook = Arc<dyn Fn(&str, Step) + Send + Sync>;

/// Static settings of the driver.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    /// DRA driver name.
    pub driver_name: String,
    /// This node's name.
    pub node_name: String,
    /// Directory of the checkpoint and the node lock.
    pub state_dir: PathBuf,
    /// Current boot ID.
    pub boot_id: String,
    /// How long a call waits for the node lock (another plugin instance) before failing.
    pub lock_timeout: Duration,
}

/// Driver failures that are not per-claim.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// The checkpoint could not be used.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// NVML failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// Startup recovery could not finish; the named claims stay recorded for the next try.
    #[error("recovery left {0} claim(s) unrepaired: {1}")]
    Recovery(usize, String),
}

/// Why one claim failed. Its message goes to the kubelet and from there into a pod event.
#[derive(Debug, thiserror::Error)]
enum ClaimFailure {
    #[error(transparent)]
    Claim(#[from] ClaimError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("writing the CDI spec: {0}")]
    Cdi(#[from] CdiError),
    #[error("{0}")]
    Rejected(String),
    #[error(
        "{0}; rolling back also failed: {1} (the claim stays recorded and is rolled back on the next attempt)"
    )]
    RollbackFailed(Box<ClaimFailure>, Box<ClaimFailure>),
}

/// One GPU as the driver tracks it. The mutex is the per-GPU operation lock.
struct Gpu {
    description: RwLock<GpuDescription>,
    lock: Mutex<()>,
}

struct Inner<B, C> {
    config: DriverConfig,
    pool: String,
    backend: Arc<B>,
    claims: C,
    cdi: CdiWriter,
    checkpoint: Mutex<Checkpoint>,
    gpus: RwLock<BTreeMap<u32, Arc<Gpu>>>,
    hook: StepHook,
    metrics: Metrics,
}

/// The driver. Cheap to clone; clones share state.
pub struct Driver<B, C> {
    inner: Arc<Inner<B, C>>,
}

impl<B, C> Clone for Driver<B, C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves no half-written data behind (all durable
    // state is in files written atomically), so a poisoned lock is safe to keep using.
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What startup recovery did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// How the checkpoint was loaded.
    pub checkpoint: Option<LoadOutcome>,
    /// Half-prepared claims rolled back.
    pub rolled_back: Vec<String>,
    /// Half-unprepared claims finished.
    pub unprepared: Vec<String>,
    /// Completed claims whose CDI spec was missing and rewritten.
    pub cdi_rewritten: Vec<String>,
}

impl<B: GpuBackend + 'static, C: ClaimSource> Driver<B, C> {
    /// Opens the checkpoint, discovers the GPUs and repairs whatever a previous run left half
    /// done. Instances that no record describes are left alone.
    pub fn start(
        config: DriverConfig,
        backend: Arc<B>,
        claims: C,
        cdi: CdiWriter,
        hook: Option<StepHook>,
        metrics: Metrics,
    ) -> Result<(Self, RecoveryReport), DriverError> {
        let (checkpoint, outcome) = Checkpoint::open(&config.state_dir, &config.boot_id)?;
        if let LoadOutcome::PreviousBoot { old_boot_id } = &outcome {
            tracing::info!(%old_boot_id, "checkpoint is from a previous boot; MIG instances do not survive a reboot, starting empty");
        }
        let gpus = backend
            .discover()?
            .into_iter()
            .map(|d| {
                (
                    d.minor,
                    Arc::new(Gpu {
                        description: RwLock::new(d),
                        lock: Mutex::new(()),
                    }),
                )
            })
            .collect();
        let driver = Self {
            inner: Arc::new(Inner {
                pool: inventory::pool_name(&config.node_name, &config.driver_name),
                config,
                backend,
                claims,
                cdi,
                checkpoint: Mutex::new(checkpoint),
                gpus: RwLock::new(gpus),
                hook: hook.unwrap_or_else(|| Arc::new(|_, _| {})),
                metrics,
            }),
        };
        let mut report = driver.recover()?;
        report.checkpoint = Some(outcome);
        Ok((driver, report))
    }

    /// This node's pool name.
    pub fn pool(&self) -> &str {
        &self.inner.pool
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<B> {
        &self.inner.backend
    }

    /// A copy of the checkpoint's claims.
    pub fn recorded_claims(&self) -> BTreeMap<String, ClaimRecord> {
        lock(&self.inner.checkpoint).data().claims.clone()
    }

    fn recover(&self) -> Result<RecoveryReport, DriverError> {
        let _node = self.node_lock()?;
        let mut report = RecoveryReport::default();
        let mut failures = Vec::new();
        for (uid, record) in self.recorded_claims() {
            let result = match record.state {
                ClaimState::PrepareStarted => {
                    self.inner.metrics.recovery("rollback");
                    self.with_gpu_locks(&record, || self.roll_back(&uid, &record))
                        .map(|()| report.rolled_back.push(uid.clone()))
                }
                ClaimState::UnprepareStarted => {
                    self.inner.metrics.recovery("finish_unprepare");
                    self.with_gpu_locks(&record, || self.unprepare_recorded(&uid, &record))
                        .map(|()| report.unprepared.push(uid.clone()))
                }
                ClaimState::PrepareCompleted if !self.inner.cdi.has_claim_spec(&uid) => {
                    // /var/run/cdi is a tmpfs on many hosts; the instances are still there, so
                    // the spec is rebuilt from the record rather than re-preparing.
                    self.inner.metrics.recovery("rewrite_cdi");
                    self.write_cdi(&uid, &record.devices)
                        .map(|()| report.cdi_rewritten.push(uid.clone()))
                }
                ClaimState::PrepareCompleted => Ok(()),
            };
            if let Err(e) = result {
                tracing::error!(claim = %record.key(), %uid, error = %e, "recovery failed");
                failures.push(format!("{}: {e}", record.key()));
            }
        }
        if failures.is_empty() {
            tracing::info!(?report, "recovery finished");
            Ok(report)
        } else {
            Err(DriverError::Recovery(failures.len(), failures.join("; ")))
        }
    }

    /// Takes the node-wide lock file, so two plugin instances on one node (a rolling update)
    /// never operate at the same time. Polls, because std's file locks have no timed wait.
    fn node_lock(&self) -> Result<File, CheckpointError> {
        let path = self.inner.config.state_dir.join("plugin.lock");
        let io = |source| CheckpointError::Io {
            path: path.clone(),
            source,
        };
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(io)?;
        let deadline = Instant::now() + self.inner.config.lock_timeout;
        loop {
            match file.try_lock() {
                Ok(()) => return Ok(file),
                Err(std::fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(std::fs::TryLockError::WouldBlock) => {
                    return Err(io(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "another plugin instance holds the node lock",
                    )));
                }
                Err(std::fs::TryLockError::Error(e)) => return Err(io(e)),
            }
        }
    }

    fn gpu(&self, minor: u32) -> Option<Arc<Gpu>> {
        read(&self.inner.gpus).get(&minor).cloned()
    }

    /// Runs `f` holding the locks of every GPU `record` touches, in minor order (no deadlock).
    fn with_gpu_locks<T>(&self, record: &ClaimRecord, f: impl FnOnce() -> T) -> T {
        let minors: BTreeSet<u32> = record.devices.iter().map(|d| d.gpu_minor).collect();
        self.with_minor_locks(&minors, f)
    }

    fn with_minor_locks<T>(&self, minors: &BTreeSet<u32>, f: impl FnOnce() -> T) -> T {
        let gpus: Vec<Arc<Gpu>> = minors.iter().filter_map(|m| self.gpu(*m)).collect();
        let _guards: Vec<MutexGuard<'_, ()>> = gpus.iter().map(|g| lock(&g.lock)).collect();
        f()
    }

    fn step(&self, uid: &str, step: Step) {
        (self.inner.hook)(uid, step);
    }

    fn put_record(&self, uid: &str, record: ClaimRecord) -> Result<(), CheckpointError> {
        lock(&self.inner.checkpoint).put(uid, record)
    }

    // ---- prepare ----------------------------------------------------------------------

    /// Prepares one claim whose allocation was already read and validated. Blocking.
    fn prepare_allocated(
        &self,
        claim: &ClaimRef,
        devices: Vec<AllocatedDevice>,
    ) -> Result<Vec<PreparedDevice>, ClaimFailure> {
        let minors: BTreeSet<u32> = devices.iter().map(|d| d.name.minor()).collect();
        self.with_minor_locks(&minors, || {
            // Re-check under the locks: a concurrent call may have finished it meanwhile.
            let existing = lock(&self.inner.checkpoint).claim(&claim.uid).cloned();
            match existing {
                Some(record) if record.state == ClaimState::PrepareCompleted => return Ok(self.prepared_devices(&claim.uid, &record)),
                Some(record) if record.state == ClaimState::PrepareStarted => {
                    tracing::info!(claim = %record.key(), "rolling back an earlier, interrupted prepare");
                    self.roll_back(&claim.uid, &record)?;
                }
                Some(record) => {
                    tracing::info!(claim = %record.key(), "finishing an earlier, interrupted unprepare before preparing");
                    self.unprepare_recorded(&claim.uid, &record)?;
                }
                None => {}
            }
            let records = self.plan(claim, &devices)?;
            let mut record = ClaimRecord {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                state: ClaimState::PrepareStarted,
                devices: records,
            };
            self.put_record(&claim.uid, record.clone())?;
            self.step(&claim.uid, Step::PrepareRecorded);
            match self.create_all(&claim.uid, &mut record) {
                Ok(()) => Ok(self.prepared_devices(&claim.uid, &record)),
                Err(failure) => {
                    tracing::warn!(claim = %record.key(), error = %failure, "prepare failed; rolling back");
                    let latest = lock(&self.inner.checkpoint).claim(&claim.uid).cloned().unwrap_or(record);
                    match self.roll_back(&claim.uid, &latest) {
                        Ok(()) => Err(failure),
                        Err(rollback) => Err(ClaimFailure::RollbackFailed(Box::new(failure), Box::new(rollback))),
                    }
                }
            }
        })
    }

    /// Validates every device against the hardware and the checkpoint, and builds the records
    /// of what will be created. Touches nothing.
    fn plan(&self, claim: &ClaimRef, devices: &[AllocatedDevice]) -> Result<Vec<DeviceRecord>, ClaimFailure> {
        let others: Vec<(String, ClaimRecord)> = lock(&self.inner.checkpoint)
            .data()
            .claims
            .iter()
            .filter(|(uid, _)| **uid != claim.uid)
            .map(|(u, r)| (u.clone(), r.clone()))
            .collect();
        let mut records = Vec::with_capacity(devices.len());
        let mut planned: HashMap<u32, Vec<(Placement, u32)>> = HashMap::new();
        let mut whole: BTreeSet<u32> = BTreeSet::new();
        for device in devices {
            let minor = device.name.minor();
            let gpu = self.gpu(minor).ok_or_else(|| {
                ClaimFailure::Rejected(format!(
                    "device {}: this node has no GPU with minor number {minor}",
                    device.device
                ))
            })?;
            let description = read(&gpu.description).clone();
            let env = device.config.env.clone();
            let kind = match device.name {
                DeviceName::Gpu { .. } => {
                    if planned.contains_key(&minor) {
                        return Err(ClaimFailure::Rejected(format!(
                            "device {} is GPU {minor} whole, which this claim also allocates partitions of",
                            device.device
                        )));
                    }
                    if !whole.insert(minor) {
                        return Err(ClaimFailure::Rejected(format!(
                            "device {} is allocated twice in this claim",
                            device.device
                        )));
                    }
                    if let Some((uid, other, d)) = find_other(&others, |d| d.gpu_minor == minor) {
                        return Err(conflict(&device.device, d, other, uid));
                    }
                    self.check_whole_gpu_usable(&description)?;
                    DeviceKind::Gpu
                }
                DeviceName::Mig { profile, start, .. } => {
                    let geometry = geometry_of(&description).ok_or_else(|| {
                        ClaimFailure::Rejected(format!(
                            "device {}: GPU {minor} ({}) is not MIG-capable",
                            device.device, description.product_name
                        ))
                    })?;
                    let p = geometry.profile_by_name(&profile).ok_or_else(|| {
                        ClaimFailure::Rejected(format!(
                            "device {}: GPU {minor} ({}) has no MIG profile {profile} (it offers {})",
                            device.device,
                            description.product_name,
                            geometry
                                .profiles
                                .iter()
                                .map(|p| p.name.to_string())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ))
                    })?;
                    if whole.contains(&minor) {
                        return Err(ClaimFailure::Rejected(format!(
                            "device {} is on GPU {minor}, which this claim also allocates whole",
                            device.device
                        )));
                    }
                    let size = p.memory_slices;
                    let clash = find_other(&others, |d| {
                        d.gpu_minor == minor
                            && match d.kind {
                                DeviceKind::Gpu => true,
                                DeviceKind::Mig {
                                    start: s, size: z, ..
                                } => start < s + z && s < start + size,
                            }
                    });
                    if let Some((uid, other, d)) = clash {
                        return Err(conflict(&device.device, d, other, uid));
                    }
                    let placement = Placement {
                        profile_id: p.gi_profile_id,
                        start,
                    };
                    let mut layout: Vec<Placement> = self
                        .occupied(&description)?
                        .iter()
                        .map(|gi| Placement {
                            profile_id: gi.profile_id,
                            start: gi.start,
                        })
                        .collect();
                    let mine = planned.entry(minor).or_default();
                    layout.extend(mine.iter().map(|(p, _)| *p));
                    geometry.check_add(&layout, placement).map_err(|e| {
                        ClaimFailure::Rejected(format!(
                            "device {}: cannot create {profile} at memory slice {start} on GPU {minor}: {e}",
                            device.device
                        ))
                    })?;
                    self.check_mig_usable(&description)?;
                    mine.push((placement, p.memory_slices));
                    DeviceKind::Mig {
                        profile_id: p.gi_profile_id,
                        start,
                        size: p.memory_slices,
                        gpu_instance: None,
                        compute_instance: None,
                        mig_uuid: None,
                    }
                }
            };
            records.push(DeviceRecord {
                request: device.request.clone(),
                pool: device.pool.clone(),
                device: device.device.clone(),
                gpu_uuid: description.uuid.clone(),
                gpu_minor: minor,
                kind,
                env,
            });
        }
        Ok(records)
    }

    /// GPU instances present on a GPU (none when MIG is off).
    fn occupied(&self, gpu: &GpuDescription) -> Result<Vec<GpuInstanceRecord>, BackendError> {
        match &gpu.mig {
            Some(mig) if mig.enabled => match self.inner.backend.list_gpu_instances(gpu.index) {
                Err(e) if e.kind == NvmlErrorKind::NotSupported => Ok(Vec::new()),
                other => other,
            },
            _ => Ok(Vec::new()),
        }
    }

    fn check_mig_usable(&self, gpu: &GpuDescription) -> Result<(), ClaimFailure> {
        match &gpu.mig {
            Some(mig) if mig.enabled => Ok(()),
            Some(_) if mode_switchable(gpu) => Ok(()),
            Some(_) => Err(ClaimFailure::Rejected(format!(
                "GPU {} ({}) has MIG mode disabled, and switching it needs a GPU reset on this architecture",
                gpu.minor, gpu.product_name
            ))),
            None => Err(ClaimFailure::Rejected(format!(
                "GPU {} ({}) is not MIG-capable",
                gpu.minor, gpu.product_name
            ))),
        }
    }

    fn check_whole_gpu_usable(&self, gpu: &GpuDescription) -> Result<(), ClaimFailure> {
        match &gpu.mig {
            Some(mig) if mig.enabled && !mode_switchable(gpu) => Err(ClaimFailure::Rejected(format!(
                "GPU {} ({}) is in MIG mode, and switching it off needs a GPU reset on this architecture",
                gpu.minor, gpu.product_name
            ))),
            Some(mig) if mig.enabled => {
                let instances = self.occupied(gpu)?;
                if instances.is_empty() {
                    Ok(())
                } else {
                    Err(ClaimFailure::Rejected(format!(
                        "GPU {} has {} MIG instance(s) that migdra does not own; it cannot be handed out whole",
                        gpu.minor,
                        instances.len()
                    )))
                }
            }
            _ => Ok(()),
        }
    }

    /// Switches MIG mode when needed (and allowed) and refreshes the GPU's description.
    fn ensure_mig_mode(&self, minor: u32, enabled: bool) -> Result<(), ClaimFailure> {
        let gpu = self
            .gpu(minor)
            .ok_or_else(|| ClaimFailure::Rejected(format!("GPU {minor} disappeared")))?;
        let (index, current) = {
            let d = read(&gpu.description);
            (d.index, d.mig.as_ref().map(|m| m.enabled))
        };
        match current {
            None if enabled => Err(ClaimFailure::Rejected(format!("GPU {minor} is not MIG-capable"))),
            None => Ok(()),
            Some(mode) if mode == enabled => Ok(()),
            Some(_) => {
                tracing::info!(gpu = minor, enabled, "switching MIG mode");
                match self.inner.backend.set_mig_mode(index, enabled)? {
                    MigModeChange::Applied => {
                        if let Some(mig) = write(&gpu.description).mig.as_mut() {
                            mig.enabled = enabled;
                            mig.pending_enabled = enabled;
                        }
                        Ok(())
                    }
                    MigModeChange::PendingReset => Err(ClaimFailure::Rejected(format!(
                        "switching MIG mode on GPU {minor} needs a GPU reset; the change is pending"
                    ))),
                }
            }
        }
    }

    fn create_all(&self, uid: &str, record: &mut ClaimRecord) -> Result<(), ClaimFailure> {
        for i in 0..record.devices.len() {
            let device = &record.devices[i];
            let minor = device.gpu_minor;
            let DeviceKind::Mig {
                profile_id, start, ..
            } = device.kind
            else {
                self.ensure_mig_mode(minor, false)?;
                continue;
            };
            self.ensure_mig_mode(minor, true)?;
            let index = self.gpu_index(minor)?;
            let gi = self.inner.backend.create_gpu_instance(index, profile_id, start)?;
            self.step(uid, Step::GpuInstanceCreated);
            let ci = self.inner.backend.create_full_compute_instance(index, gi)?;
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
            self.put_record(uid, record.clone())?;
            self.step(uid, Step::DeviceRecorded);
            tracing::info!(claim = %record.key(), device = %record.devices[i].device, gpu_instance = gi, compute_instance = ci.id, mig_uuid = %ci.mig_uuid, "created MIG instance");
        }
        self.write_cdi(uid, &record.devices)?;
        self.step(uid, Step::CdiWritten);
        record.state = ClaimState::PrepareCompleted;
        self.put_record(uid, record.clone())?;
        self.step(uid, Step::PrepareCompleted);
        Ok(())
    }

    fn gpu_index(&self, minor: u32) -> Result<u32, ClaimFailure> {
        self.gpu(minor)
            .map(|g| read(&g.description).index)
            .ok_or_else(|| ClaimFailure::Rejected(format!("GPU {minor} disappeared")))
    }

    fn write_cdi(&self, uid: &str, devices: &[DeviceRecord]) -> Result<(), ClaimFailure> {
        // NVIDIA_VISIBLE_DEVICES lists every device of the same request, so a container that
        // references one request sees exactly that request's devices.
        let mut by_request: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        for d in devices {
            by_request
                .entry(claims::base_request(&d.request))
                .or_default()
                .push(visible_id(d));
        }
        let cdi_devices: Vec<ClaimDevice> = devices
            .iter()
            .map(|d| {
                let mut env = d.env.clone();
                let ids = by_request
                    .get(claims::base_request(&d.request))
                    .map(|v| v.join(","))
                    .unwrap_or_default();
                env.insert("NVIDIA_VISIBLE_DEVICES".into(), ids);
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
                cdi_device_ids: vec![self.inner.cdi.device_id(uid, &d.device)],
                share_id: None,
            })
            .collect()
    }

    // ---- unprepare and rollback -------------------------------------------------------

    /// Undoes an interrupted or failed prepare: destroys the instances the record intended
    /// (only those: matched by placement, and by ID where recorded), removes the spec and
    /// forgets the claim.
    fn roll_back(&self, uid: &str, record: &ClaimRecord) -> Result<(), ClaimFailure> {
        self.destroy_instances(uid, record)?;
        self.inner.cdi.remove_claim_spec(uid)?;
        self.step(uid, Step::CdiRemoved);
        lock(&self.inner.checkpoint).remove(uid)?;
        self.step(uid, Step::ClaimForgotten);
        tracing::info!(claim = %record.key(), %uid, "rolled back");
        Ok(())
    }

    /// Unprepares a recorded claim (any state).
    fn unprepare_recorded(&self, uid: &str, record: &ClaimRecord) -> Result<(), ClaimFailure> {
        if record.state == ClaimState::PrepareStarted {
            return self.roll_back(uid, record);
        }
        if record.state != ClaimState::UnprepareStarted {
            let mut started = record.clone();
            started.state = ClaimState::UnprepareStarted;
            self.put_record(uid, started)?;
            self.step(uid, Step::UnprepareRecorded);
        }
        self.destroy_instances(uid, record)?;
        self.inner.cdi.remove_claim_spec(uid)?;
        self.step(uid, Step::CdiRemoved);
        lock(&self.inner.checkpoint).remove(uid)?;
        self.step(uid, Step::ClaimForgotten);
        tracing::info!(claim = %record.key(), %uid, "unprepared");
        Ok(())
    }

    fn destroy_instances(&self, uid: &str, record: &ClaimRecord) -> Result<(), ClaimFailure> {
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
            let Some(gpu) = self.gpu(device.gpu_minor) else {
                tracing::warn!(device = %device.device, "GPU is gone; nothing to destroy");
                continue;
            };
            let index = read(&gpu.description).index;
            let instances = match self.inner.backend.list_gpu_instances(index) {
                Ok(list) => list,
                // MIG was switched off (or the GPU reset): every instance is gone.
                Err(e) if e.kind == NvmlErrorKind::NotSupported => continue,
                Err(e) => return Err(e.into()),
            };
            let ours = instances.iter().find(|gi| {
                gi.profile_id == *profile_id
                    && gi.start == *start
                    && gpu_instance.is_none_or(|id| id == gi.id)
            });
            let Some(gi) = ours else {
                tracing::debug!(device = %device.device, "instance already gone");
                continue;
            };
            for ci in &gi.compute_instances {
                match self.inner.backend.destroy_compute_instance(index, gi.id, ci.id) {
                    Err(e) if e.kind != NvmlErrorKind::NotFound => return Err(e.into()),
                    _ => self.step(uid, Step::ComputeInstanceDestroyed),
                }
            }
            match self.inner.backend.destroy_gpu_instance(index, gi.id) {
                Err(e) if e.kind != NvmlErrorKind::NotFound => return Err(e.into()),
                _ => self.step(uid, Step::GpuInstanceDestroyed),
            }
            tracing::info!(claim = %record.key(), device = %device.device, gpu_instance = gi.id, "destroyed MIG instance");
        }
        Ok(())
    }

    // ---- inventory and health ---------------------------------------------------------

    /// Re-discovers the GPUs (a rescan, so added or reset GPUs are noticed) and describes them
    /// for the GpuNode: geometry, instances (ours or foreign) and health.
    pub fn inventory(&self) -> Result<Vec<GpuInventory>, BackendError> {
        let mut discovered = self.inner.backend.discover()?;
        // GPUs known from earlier that NVML no longer describes are kept, so they show up as
        // unhealthy (their probe fails) instead of silently vanishing.
        for gpu in read(&self.inner.gpus).values() {
            let known = read(&gpu.description).clone();
            if !discovered.iter().any(|d| d.minor == known.minor) {
                discovered.push(known);
            }
        }
        discovered.sort_by_key(|d| d.minor);
        let mut inventory = Vec::with_capacity(discovered.len());
        for description in discovered {
            let gpu = {
                let mut gpus = write(&self.inner.gpus);
                gpus.entry(description.minor)
                    .or_insert_with(|| {
                        Arc::new(Gpu {
                            description: RwLock::new(description.clone()),
                            lock: Mutex::new(()),
                        })
                    })
                    .clone()
            };
            // Under the GPU lock, so an instance being created is always already recorded.
            let _guard = lock(&gpu.lock);
            *write(&gpu.description) = description.clone();
            let records = self.recorded_claims();
            let health = match self.inner.backend.probe_health(description.index) {
                Ok(()) => GpuHealth::healthy(),
                Err(e) => GpuHealth {
                    healthy: false,
                    reason: Some(e.to_string()),
                },
            };
            let mig = match &description.mig {
                None => None,
                Some(mig) => {
                    let instances = self.occupied(&description).unwrap_or_else(|e| {
                        tracing::warn!(gpu = description.minor, error = %e, "listing GPU instances failed");
                        Vec::new()
                    });
                    let geometry = MigGeometry::new(mig.profiles.clone(), description.memory_mib);
                    let instances = instances
                        .iter()
                        .map(|gi| describe_instance(gi, &geometry, description.minor, &records))
                        .collect();
                    Some(MigInventory {
                        enabled: mig.enabled,
                        change_pending: mig.enabled != mig.pending_enabled,
                        mode_switchable: mode_switchable(&description),
                        geometry,
                        instances,
                    })
                }
            };
            inventory.push(GpuInventory {
                minor: description.minor,
                index: description.index,
                uuid: description.uuid.clone(),
                product_name: description.product_name.clone(),
                architecture: description.architecture,
                cuda_compute_capability: description
                    .cuda_compute_capability
                    .map(|(a, b)| format!("{a}.{b}")),
                pci_bus_id: description.pci_bus_id.clone(),
                numa_node: description.numa_node,
                memory_mib: description.memory_mib,
                mig,
                health,
            });
        }
        self.inner
            .metrics
            .observe_inventory(&inventory, self.recorded_claims().len());
        Ok(inventory)
    }

    /// The health of every device this node could publish: each GPU whole and at each of its
    /// MIG placements, healthy exactly when the parent GPU is.
    pub fn device_health(&self, inventory: &[GpuInventory]) -> Vec<DeviceHealthReport> {
        let mut reports = Vec::new();
        for gpu in inventory {
            let message = gpu.health.reason.clone().unwrap_or_default();
            let mut push = |name: DeviceName| {
                reports.push(DeviceHealthReport {
                    pool_name: self.inner.pool.clone(),
                    device_name: name.to_string(),
                    healthy: Some(gpu.health.healthy),
                    message: message.clone(),
                })
            };
            push(DeviceName::Gpu { minor: gpu.minor });
            if let Some(mig) = &gpu.mig {
                for (profile, start) in mig.geometry.all_placements() {
                    push(DeviceName::Mig {
                        minor: gpu.minor,
                        profile: profile.name,
                        start,
                    });
                }
            }
        }
        reports
    }
}

fn describe_instance(
    gi: &GpuInstanceRecord,
    geometry: &MigGeometry,
    minor: u32,
    records: &BTreeMap<String, ClaimRecord>,
) -> MigInstance {
    let owner = records.values().find(|r| {
        r.devices.iter().any(|d| {
            d.gpu_minor == minor
                && matches!(d.kind, DeviceKind::Mig { profile_id, start, gpu_instance, .. }
                    if profile_id == gi.profile_id && start == gi.start && gpu_instance.is_none_or(|id| id == gi.id))
        })
    });
    MigInstance {
        profile: geometry.profile_by_id(gi.profile_id).map(|p: &MigProfile| p.name),
        placement: Placement {
            profile_id: gi.profile_id,
            start: gi.start,
        },
        gpu_instance_id: gi.id,
        owner: if owner.is_some() {
            InstanceOwner::Migdra
        } else {
            InstanceOwner::Foreign
        },
        claim: owner.map(ClaimRecord::key),
    }
}

fn geometry_of(gpu: &GpuDescription) -> Option<MigGeometry> {
    gpu.mig
        .as_ref()
        .map(|m| MigGeometry::new(m.profiles.clone(), gpu.memory_mib))
}

fn mode_switchable(gpu: &GpuDescription) -> bool {
    gpu.architecture.is_some_and(|a| a.mig_mode_switchable())
}

/// The first device of another recorded claim that matches `pred`.
fn find_other(
    others: &[(String, ClaimRecord)],
    pred: impl Fn(&DeviceRecord) -> bool,
) -> Option<(&str, &ClaimRecord, &DeviceRecord)> {
    others
        .iter()
        .find_map(|(uid, r)| r.devices.iter().find(|d| pred(d)).map(|d| (uid.as_str(), r, d)))
}

fn conflict(device: &str, existing: &DeviceRecord, other: &ClaimRecord, uid: &str) -> ClaimFailure {
    ClaimFailure::Rejected(format!(
        "device {device} overlaps device {} already prepared for claim {} ({uid})",
        existing.device,
        other.key()
    ))
}

fn visible_id(device: &DeviceRecord) -> String {
    match &device.kind {
        DeviceKind::Mig {
            mig_uuid: Some(uuid), ..
        } => uuid.clone(),
        _ => device.gpu_uuid.clone(),
    }
}

impl<B: GpuBackend + 'static, C: ClaimSource> DraDriver for Driver<B, C> {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> HashMap<String, PrepareOutcome> {
        let started = Instant::now();
        let mut outcomes = HashMap::with_capacity(claims.len());
        let mut pending = Vec::new();
        for claim in claims {
            // Idempotency without an API call: a completed claim is answered from the record.
            let completed = lock(&self.inner.checkpoint)
                .claim(&claim.uid)
                .filter(|r| r.state == ClaimState::PrepareCompleted)
                .cloned();
            match completed {
                Some(record) => {
                    self.inner.metrics.claim("prepare", true);
                    outcomes.insert(claim.uid.clone(), Ok(self.prepared_devices(&claim.uid, &record)));
                }
                None => pending.push(claim),
            }
        }
        let fetched = futures::future::join_all(pending.into_iter().map(|claim| async move {
            let key = format!("{}/{}", claim.namespace, claim.name);
            let devices = match self.inner.claims.get(&claim.namespace, &claim.name).await {
                Ok(Some(object)) => claims::allocated_devices(
                    &object,
                    &claim.uid,
                    &self.inner.config.driver_name,
                    &self.inner.pool,
                )
                .map_err(ClaimFailure::from),
                Ok(None) => Err(ClaimError::NotFound { claim: key }.into()),
                Err(source) => Err(ClaimError::Api { claim: key, source }.into()),
            };
            (claim, devices)
        }))
        .await;

        let prepared = self
            .run_claims("prepare", fetched, |driver, claim, devices| {
                driver.prepare_allocated(claim, devices?)
            })
            .await;
        outcomes.extend(prepared);
        self.inner.metrics.call("prepare", started.elapsed());
        outcomes
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> HashMap<String, UnprepareOutcome> {
        let started = Instant::now();
        let items = claims.into_iter().map(|c| (c, ())).collect();
        let outcomes = self
            .run_claims("unprepare", items, |driver, claim, ()| {
                driver.unprepare_claim(&claim.uid)
            })
            .await;
        self.inner.metrics.call("unprepare", started.elapsed());
        outcomes
    }
}

impl<B: GpuBackend + 'static, C: ClaimSource> Driver<B, C> {
    /// Runs `work` for each claim under the node lock, on blocking threads, the claims in
    /// parallel (each takes the locks of its own GPUs). Returns one outcome per claim, each
    /// logged and counted. A claim whose thread panicked gets no outcome; the gRPC layer
    /// reports it as failed.
    async fn run_claims<I, T>(
        &self,
        operation: &'static str,
        items: Vec<(ClaimRef, I)>,
        work: impl Fn(&Self, &ClaimRef, I) -> Result<T, ClaimFailure> + Send + Sync + 'static,
    ) -> HashMap<String, Result<T, String>>
    where
        I: Send + 'static,
        T: Send + 'static,
    {
        let driver = self.clone();
        let task = tokio::task::spawn_blocking(move || {
            let node = driver.node_lock();
            std::thread::scope(|scope| {
                let handles: Vec<_> = items
                    .into_iter()
                    .map(|(claim, item)| {
                        let (node, driver, work) = (&node, &driver, &work);
                        scope.spawn(move || {
                            let outcome = match node {
                                Err(e) => Err(format!("node lock: {e}")),
                                Ok(_) => work(driver, &claim, item).map_err(|e| e.to_string()),
                            };
                            (claim, outcome)
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .filter_map(|h| h.join().ok())
                    .collect::<Vec<_>>()
            })
        });
        let mut outcomes = HashMap::new();
        match task.await {
            Ok(results) => {
                for (claim, outcome) in results {
                    if let Err(e) = &outcome {
                        let key = format!("{}/{}", claim.namespace, claim.name);
                        tracing::warn!(claim = %key, uid = %claim.uid, error = %e, "{operation} failed");
                    }
                    self.inner.metrics.claim(operation, outcome.is_ok());
                    outcomes.insert(claim.uid, outcome);
                }
            }
            Err(e) => tracing::error!(error = %e, "{operation} worker failed"),
        }
        outcomes
    }

    /// Unprepares one claim by UID. Unknown claims succeed (the kubelet may ask for claims it
    /// never prepared here, or again after success). Blocking.
    fn unprepare_claim(&self, uid: &str) -> Result<(), ClaimFailure> {
        let Some(record) = lock(&self.inner.checkpoint).claim(uid).cloned() else {
            return Ok(());
        };
        self.with_gpu_locks(&record, || {
            // Re-read under the locks: a concurrent call may have finished it meanwhile. (The
            // guard must be dropped before unpreparing, which writes the checkpoint.)
            let current = lock(&self.inner.checkpoint).claim(uid).cloned();
            match current {
                Some(record) => self.unprepare_recorded(uid, &record),
                None => Ok(()),
            }
        })
    }
}
