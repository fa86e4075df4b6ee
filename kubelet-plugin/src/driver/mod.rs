//! The prepare/unprepare state machine behind the kubelet's DRA calls.
//!
//! - `prepare.rs`: GET and validate the claim with no lock held (a record answers only for
//!   the allocation it was made for: one of other devices under the same UID is released like
//!   an unprepare first, with a `Reallocated` event); then, under the node lock and the
//!   claim's GPU locks, check the node can run CUDA containers, plan ([`crate::plan`]),
//!   record `PrepareStarted` with the planned placements, switch MIG mode if planned, create
//!   the instances, write the CDI spec, record `PrepareCompleted`. A failure after the first
//!   record tears down what was created. The claim's `status.devices` entries are queued
//!   outside every lock ([`crate::claim_status`]; never fails the prepare). An `adminAccess`
//!   claim (whole GPUs only) gets its CDI spec and status only.
//! - `unprepare.rs`: record `UnprepareStarted`, destroy compute then GPU instances, remove the
//!   CDI spec, forget the claim, clear its status entries; already gone is success. It is
//!   also the rollback of a failed or interrupted prepare.
//! - `recovery.rs`: at start, roll back half-prepared claims, finish half-unprepared ones,
//!   rewrite missing CDI specs. An unrepairable record makes its GPUs unhealthy and refuse
//!   prepares while a background loop retries it. On a lost GPU the instances count as gone
//!   (so pods terminate) and are listed in [`crate::orphans`] until the GPU is back.
//! - `overdue.rs`: once an NVML call that ran past the timeout returns, records it left half
//!   done are repaired as at start.
//! - `stale_gc.rs`: records whose ResourceClaim is gone, or now has other devices, are torn
//!   down the same way.
//!
//! Instances the journal does not describe are someone else's and never touched. The record
//! is written before the GPU is touched ([`crate::journal`]), so a crash between any two steps
//! is repaired from the checkpoint alone.
//!
//! Shared devices: each claim holding a MIG instance has its own record of it (same IDs, own
//! share ID). The first share's prepare creates the instance, later ones record the prepared
//! holder's IDs ([`crate::plan`]), and teardown destroys it only when no other record holds
//! it. The holder records are the reference count, changed by atomic checkpoint writes.
//!
//! # Lock order
//!
//! The node lock ([`NodeLock`], a file lock shared with other plugin instances; taking it
//! re-reads the checkpoint; kubelet calls share it, maintenance takes it alone), then the
//! claim's GPU locks ([`GpuLocks`], all at once, in minor order), then briefly the journal's
//! mutex. Types enforce it: GPU locks exist only as a [`GpuLocks`] borrowed from
//! [`NodeLock::lock_gpus`], every step that plans, creates or destroys takes a `&GpuLocks`, and
//! the journal's mutex never leaves [`crate::journal::Journal`]. Claims of one kubelet call, and
//! concurrent kubelet calls, run in parallel: only GPU locks keep them apart, so an NVML call
//! stuck on one GPU holds no other GPU's claims. The inventory ([`Gpus::inventory`]) takes one
//! GPU lock at a time and never the node lock, so it keeps reporting while another plugin
//! instance works.

mod lost_records;
mod overdue;
mod prepare;
mod recovery;
mod stale_gc;
mod unprepare;

use std::{collections::HashMap, path::PathBuf, sync::Arc, time::Duration};

use migdra_api::inventory;

pub use self::{
    lost_records::OwnershipReport,
    prepare::uuid_variable,
    recovery::{Backoff, RecoveryEvent, RecoveryReport, Repair, RepairRound},
    stale_gc::{ReleasedClaim, StaleCause, StaleGcRound, stale_cause},
};
pub use crate::gpus::PendingRepair;
use crate::{
    cdi::{CdiError, CdiWriter},
    checkpoint::{CheckpointError, ClaimRecord, LoadOutcome},
    claim_status::ClaimStatusWriter,
    claims::{ClaimError, ClaimSource},
    events::{ClaimEvent, ClaimEvents},
    gpus::{GpuLocks, Gpus},
    journal::Journal,
    metrics::Metrics,
    nvml::{
        BackendError, GpuBackend, NvmlErrorKind,
        bounded::{BoundedBackend, NvmlCalls},
        timing::NvmlClock,
    },
    orphans::LostGpuOrphans,
    plan::{PlanError, Rejection},
    state_dir::{NodeGate, NodeLock, NodeLockError},
};
use dra_kubelet::{ClaimRef, DraDriver, PrepareOutcome, UnprepareOutcome};

/// A point between two steps of prepare or unprepare, named after the step just done. Tests
/// stop the driver at each one to prove that a crash there is repaired.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Step {
    PrepareRecorded,
    /// A GPU's MIG mode was switched for the claim (before its first device is created).
    MigModeSwitched,
    /// NVML left a MIG-mode switch pending a GPU reset; the change is not yet withdrawn.
    MigModeChangePending,
    /// A share joined the MIG instance its other holders recorded (the record, written at
    /// `PrepareRecorded`, already carries the instance's IDs).
    ShareJoined,
    GpuInstanceCreated,
    ComputeInstanceCreated,
    /// The device's IDs are in the checkpoint.
    DeviceRecorded,
    CdiWritten,
    PrepareCompleted,
    UnprepareRecorded,
    ComputeInstanceDestroyed,
    GpuInstanceDestroyed,
    /// Instances on a lost GPU were listed for destruction on its return (the claim is not
    /// forgotten yet).
    OrphansListed,
    /// A share was let go without destroying the instance, which other claims still hold.
    ShareReleased,
    CdiRemoved,
    /// The claim is gone from the checkpoint.
    ClaimForgotten,
}

/// Names the claim's device in a failed NVML call's message (the call names only the GPU and
/// what it did, which the pod's event does not connect to the claim).
fn on_device(device: &str) -> impl FnOnce(BackendError) -> BackendError + '_ {
    move |mut e| {
        e.operation = format!("device {device}: {}", e.operation);
        e
    }
}

/// Called at every [`Step`] with the claim UID. Production passes a no-op.
pub type StepHook = Arc<dyn Fn(&str, Step) + Send + Sync>;

#[derive(Clone, Debug)]
pub struct DriverConfig {
    pub driver_name: String,
    pub node_name: String,
    /// Directory of the checkpoint and the node lock.
    pub state_dir: PathBuf,
    pub boot_id: String,
    /// How long a call waits for the node lock (another plugin instance) before failing.
    pub lock_timeout: Duration,
    /// How long one NVML call may take before its GPU counts as not answering
    /// ([`crate::nvml::bounded`]).
    pub nvml_call_timeout: Duration,
}

/// Driver failures that are not per-claim.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    NodeAccess(#[from] NodeAccessError),
    #[error("background task failed: {0}")]
    Task(String),
}

/// Why the node could not be taken for an operation. Shared by every claim of a kubelet call
/// (hence the `Arc`s).
#[derive(Clone, Debug, thiserror::Error)]
pub enum NodeAccessError {
    #[error("node lock: {0}")]
    Lock(Arc<NodeLockError>),
    /// The checkpoint, which another plugin instance may have changed, could not be re-read.
    #[error("re-reading the checkpoint under the node lock: {0}")]
    Reload(Arc<CheckpointError>),
}

/// Why one claim failed. Its message goes to the kubelet and from there into a pod event;
/// [`ClaimFailure::reason`] labels it in metrics.
#[derive(Debug, thiserror::Error)]
pub enum ClaimFailure {
    /// The claim could not be read, or its allocation is not ours to serve.
    #[error(transparent)]
    Claim(#[from] ClaimError),
    /// The allocation cannot be prepared on this node as it is.
    #[error(transparent)]
    Rejected(#[from] Rejection),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("writing the CDI spec: {0}")]
    Cdi(#[from] CdiError),
    /// The node lacks the driver's files or control device nodes every CUDA container
    /// needs (checked before anything is created).
    #[error("{0}")]
    NodeNotReady(CdiError),
    #[error(transparent)]
    NodeAccess(#[from] NodeAccessError),
    /// The operation failed and undoing it failed too.
    #[error(
        "{0}; rolling back also failed: {1} (the claim stays recorded and is rolled back on the next attempt)"
    )]
    RollbackFailed(Box<ClaimFailure>, Box<ClaimFailure>),
}

impl From<PlanError> for ClaimFailure {
    fn from(e: PlanError) -> Self {
        match e {
            PlanError::Rejected(r) => Self::Rejected(r),
            PlanError::Backend(b) => Self::Backend(b),
        }
    }
}

impl ClaimFailure {
    /// Whether NVML stopped answering (then what the call did is unknown until it returns).
    pub fn nvml_not_answering(&self) -> bool {
        match self {
            Self::Backend(e) => e.kind == NvmlErrorKind::NotAnswering,
            Self::RollbackFailed(failure, rollback) => {
                failure.nvml_not_answering() || rollback.nvml_not_answering()
            }
            _ => false,
        }
    }

    /// A stable CamelCase label of the cause (a bounded set, for metrics).
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Claim(e) => e.reason(),
            Self::Rejected(r) => r.reason(),
            Self::Backend(e) if e.kind == NvmlErrorKind::NotAnswering => "NvmlNotAnswering",
            Self::Backend(_) => "NvmlError",
            Self::Checkpoint(_) => "CheckpointError",
            Self::Cdi(_) => "CdiError",
            Self::NodeNotReady(_) => "DriverFilesUnavailable",
            Self::NodeAccess(NodeAccessError::Lock(_)) => "NodeLockUnavailable",
            Self::NodeAccess(NodeAccessError::Reload(_)) => "CheckpointError",
            Self::RollbackFailed(..) => "RollbackFailed",
        }
    }
}

/// Per-claim outcome of [`Driver::prepare_claims`].
pub type PrepareResult = Result<Vec<dra_kubelet::PreparedDevice>, ClaimFailure>;
/// Per-claim outcome of [`Driver::unprepare_claims`].
pub type UnprepareResult = Result<(), ClaimFailure>;

struct Inner<C> {
    config: DriverConfig,
    claims: C,
    cdi: CdiWriter,
    journal: Arc<Journal>,
    gpus: Gpus,
    hook: StepHook,
    metrics: Metrics,
    events: std::sync::OnceLock<ClaimEvents>,
    status: ClaimStatusWriter,
    /// The checkpoint was unreadable or missing at start: records of this boot may be lost
    /// ([`Driver::recover_lost_records`]).
    records_lost: bool,
}

/// The driver. Cheap to clone; clones share state.
pub struct Driver<C> {
    inner: Arc<Inner<C>>,
}

impl<C> Clone for Driver<C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<C: ClaimSource> Driver<C> {
    /// Opens the checkpoint, discovers the GPUs and repairs what a previous run left half done;
    /// instances no record describes are left alone. Records not repairable now do not fail the
    /// start: they are in [`RecoveryReport::pending`], for [`Driver::run_repair_loop`].
    pub fn start(
        config: DriverConfig,
        backend: Arc<dyn GpuBackend>,
        claims: C,
        cdi: CdiWriter,
        hook: Option<StepHook>,
        metrics: Metrics,
    ) -> Result<(Self, RecoveryReport), DriverError> {
        let (journal, outcome) = Journal::open(&config.state_dir, &config.boot_id, metrics.clone())?;
        let cdi = cdi.for_boot(&config.boot_id);
        if let LoadOutcome::PreviousBoot { old_boot_id } = &outcome {
            tracing::info!(%old_boot_id, "checkpoint is from a previous boot; MIG instances do not survive a reboot, starting empty");
        }
        // A missing checkpoint is lost too when this boot's claims left CDI specs (a wiped state
        // directory); on a fresh node the evidence is simply empty.
        let records_lost = matches!(outcome, LoadOutcome::Fresh) || outcome.records_lost();
        let journal = Arc::new(journal);
        let pool = inventory::pool_name(&config.node_name, &config.driver_name);
        let orphans = Arc::new(LostGpuOrphans::open(&config.state_dir, &config.boot_id)?);
        let calls = NvmlCalls::new(config.nvml_call_timeout);
        let backend = Arc::new(BoundedBackend::new(backend, calls.clone(), metrics.clone()));
        let node_gate = NodeGate::new(&config.state_dir);
        let gpus = Gpus::discover(backend, calls, node_gate, pool, journal.clone(), metrics.clone())?
            .with_orphans(orphans);
        let status = ClaimStatusWriter::new(&config.driver_name, metrics.clone());
        let driver = Self {
            inner: Arc::new(Inner {
                config,
                claims,
                cdi,
                journal,
                gpus,
                hook: hook.unwrap_or_else(|| Arc::new(|_, _| {})),
                status,
                metrics,
                events: std::sync::OnceLock::new(),
                records_lost,
            }),
        };
        // Discovered once at start; a failure is not fatal (the plugin keeps serving and
        // reporting), every prepare fails with it until it is fixed.
        if let Err(e) = driver.ensure_driver_spec() {
            tracing::error!(error = %e, "this node cannot hand out GPUs until this is fixed; every prepare fails with this error");
        }
        let mut report = driver.recover()?;
        report.checkpoint = Some(outcome);
        // Before serving: no spec of a claim from an earlier boot stays for the runtime to find.
        match driver.inner.cdi.remove_specs_of_other_boots() {
            Ok(removed) => {
                if !removed.is_empty() {
                    tracing::info!(claims = ?removed, "removed CDI specs an earlier boot left");
                }
                report.cdi_removed = removed;
            }
            Err(e) => tracing::warn!(error = %e, "cannot look for CDI specs an earlier boot left"),
        }
        Ok((driver, report))
    }

    /// Makes sure the node-wide driver CDI spec matches the driver version NVML reports now
    /// (discovering the driver's files again after a driver change) and that the node has
    /// what every CUDA container needs.
    pub fn ensure_driver_spec(&self) -> Result<(), ClaimFailure> {
        let version = self.backend().driver_version()?;
        self.inner
            .cdi
            .ensure_driver_spec(&version)
            .map_err(ClaimFailure::NodeNotReady)
    }

    /// Sends an event about every claim that fails to prepare or unprepare to `events` (once;
    /// later calls are ignored). Without it failures are only logged and counted.
    pub fn set_claim_events(&self, events: ClaimEvents) {
        if self.inner.events.set(events).is_err() {
            tracing::debug!("claim events were already set up");
        }
    }

    /// Whether the checkpoint was unreadable or missing at start (see
    /// [`Driver::recover_lost_records`]).
    pub fn records_lost(&self) -> bool {
        self.inner.records_lost
    }

    pub fn pool(&self) -> &str {
        self.inner.gpus.pool()
    }

    fn backend(&self) -> &Arc<dyn GpuBackend> {
        self.inner.gpus.backend()
    }

    pub fn gpus(&self) -> &Gpus {
        &self.inner.gpus
    }

    pub fn recorded_claims(&self) -> std::collections::BTreeMap<String, ClaimRecord> {
        self.inner.journal.claims()
    }

    /// Takes the node lock alone (maintenance: recovery, repairs, stale claims) and brings the
    /// journal up to date with the file (another plugin instance may have changed claims
    /// meanwhile). Every path that acts on or writes records goes through here or
    /// [`Self::node_lock_shared`] first.
    fn node_lock(&self) -> Result<NodeLock, NodeAccessError> {
        self.take_node_lock(NodeGate::acquire)
    }

    /// Takes the node lock together with this process's other kubelet calls, which exclude each
    /// other only through GPU locks.
    fn node_lock_shared(&self) -> Result<NodeLock, NodeAccessError> {
        self.take_node_lock(NodeGate::acquire_shared)
    }

    fn take_node_lock(
        &self,
        acquire: fn(&NodeGate, Duration) -> Result<NodeLock, crate::state_dir::NodeLockError>,
    ) -> Result<NodeLock, NodeAccessError> {
        let node = acquire(self.inner.gpus.node_gate(), self.inner.config.lock_timeout)
            .map_err(|e| NodeAccessError::Lock(Arc::new(e)))?;
        if self
            .inner
            .journal
            .reload_if_changed()
            .map_err(|e| NodeAccessError::Reload(Arc::new(e)))?
        {
            tracing::info!("the checkpoint was changed by another plugin instance; reloaded it");
        }
        Ok(node)
    }

    fn lock_record_gpus<'n>(&self, node: &'n NodeLock, record: &ClaimRecord) -> GpuLocks<'n> {
        node.lock_gpus(&self.inner.gpus, record.devices.iter().map(|d| d.gpu_minor))
    }

    fn step(&self, uid: &str, step: Step) {
        (self.inner.hook)(uid, step);
    }

    /// Runs `work` for each claim under the shared node lock on blocking threads, claims in
    /// parallel (each takes its own GPUs' locks), with `nvml` installed on each thread to sum the call's NVML
    /// time. Returns one logged and counted outcome per claim; a claim whose thread panicked gets
    /// none, and the gRPC layer reports it as failed.
    async fn run_claims<I, T>(
        &self,
        operation: &'static str,
        nvml: &NvmlClock,
        items: Vec<(ClaimRef, I)>,
        work: impl Fn(&Self, &NodeLock, &ClaimRef, I) -> Result<T, ClaimFailure> + Send + Sync + 'static,
    ) -> HashMap<String, Result<T, ClaimFailure>>
    where
        I: Send + 'static,
        T: Send + 'static,
    {
        let driver = self.clone();
        let nvml = nvml.clone();
        let task = tokio::task::spawn_blocking(move || {
            let _clock = nvml.install();
            let node = driver.node_lock_shared();
            let run = |claim: ClaimRef, item: I| {
                let outcome = match &node {
                    Err(e) => Err(ClaimFailure::from(e.clone())),
                    Ok(node) => work(&driver, node, &claim, item),
                };
                (claim, outcome)
            };
            // One claim (the kubelet's usual call) runs on this thread: a thread of its own
            // would only add its start to the call.
            if items.len() == 1 {
                return items.into_iter().map(|(claim, item)| run(claim, item)).collect();
            }
            std::thread::scope(|scope| {
                let handles: Vec<_> = items
                    .into_iter()
                    .map(|(claim, item)| {
                        let (run, nvml) = (&run, &nvml);
                        scope.spawn(move || {
                            // This claim's NVML time counts for this kubelet call.
                            let _clock = nvml.install();
                            run(claim, item)
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
                // The locks are released: events are queued (never awaited) from here.
                for (claim, outcome) in results {
                    if let Err(e) = &outcome {
                        let key = format!("{}/{}", claim.namespace, claim.name);
                        tracing::warn!(claim = %key, uid = %claim.uid, error = %e, reason = e.reason(), "{operation} failed");
                        self.inner.metrics.claim_failure(operation, e.reason());
                        if let Some(events) = self.inner.events.get() {
                            events.send(ClaimEvent::failed(operation, &claim, e));
                        }
                    }
                    self.inner.metrics.claim(operation, outcome.is_ok());
                    outcomes.insert(claim.uid, outcome);
                }
            }
            Err(e) => tracing::error!(error = %e, "{operation} worker failed"),
        }
        // Instances created or destroyed show in (or leave) the info series at once.
        self.inner.metrics.observe_claims(&self.inner.journal.claims());
        outcomes
    }
}

impl<C: ClaimSource> DraDriver for Driver<C> {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> HashMap<String, PrepareOutcome> {
        with_messages(self.prepare_claims(claims).await)
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> HashMap<String, UnprepareOutcome> {
        with_messages(self.unprepare_claims(claims).await)
    }
}

/// The kubelet gets each failure as its message.
fn with_messages<T>(
    outcomes: HashMap<String, Result<T, ClaimFailure>>,
) -> HashMap<String, Result<T, String>> {
    outcomes
        .into_iter()
        .map(|(uid, outcome)| (uid, outcome.map_err(|e| e.to_string())))
        .collect()
}
