//! The GPU table: every GPU this node has (or had), its per-GPU operation lock, and what the
//! node reports about them (the GpuNode inventory and the kubelet's device health).
//!
//! [`Gpus`] is shared by the driver (which creates and destroys instances) and the status
//! loop (which refreshes the inventory). A GPU is changed only under its lock, and the lock
//! of a GPU the driver works on can only be had as part of a [`GpuLocks`], which only
//! [`NodeLock::lock_gpus`] makes: so GPU locks are always taken after the node lock, all at
//! once and in minor order, and released before it (the borrow checker enforces the last).
//! The inventory takes one GPU lock at a time and never waits for the node lock (it must keep
//! reporting while another plugin instance holds that), so it cannot deadlock with the driver.
//! Only to destroy instances left on a GPU while it was lost ([`crate::orphans`]) does it
//! take the node lock, before any GPU lock and only when it is free at once.
//!
//! The table also knows which GPUs hold a checkpoint record that startup recovery could not
//! repair ([`Gpus::mark_recovery_pending`]): such a GPU is reported unhealthy (so the
//! resource-health stream and the controller's policy keep new work off it) and refuses
//! prepares, until the repair succeeds ([`Gpus::clear_recovery_pending`]).

use std::{
    collections::{BTreeMap, BTreeSet},
    marker::PhantomData,
    sync::{
        Arc, Condvar, Mutex, OnceLock, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use migdra_api::{
    device_name::DeviceName,
    geometry::{MigGeometry, MigProfile, Placement},
    inventory::{GpuHealth, GpuInventory, InstanceOwner, MigInstance, MigInventory},
    slices::counter_model::engine_counters_overruled,
};

use crate::{
    checkpoint::{ClaimRecord, DeviceKind},
    journal::Journal,
    lock,
    metrics::Metrics,
    nvml::{BackendError, GpuBackend, GpuDescription, GpuInstanceRecord, NvmlErrorKind, bounded::NvmlCalls},
    orphans::{LostGpuOrphans, epoch_seconds},
    plan::{GpuView, mode_switchable},
    state_dir::{NodeGate, NodeLock},
};
use dra_kubelet::DeviceHealthReport;

// Poisoning is ignored, as in [`crate::lock`].
fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}

struct Gpu {
    description: RwLock<GpuDescription>,
    /// Counts changes the driver made to the GPU under its lock (a MIG mode switch): a
    /// description discovered while one happened is stale and must not replace the table's.
    changes: AtomicU64,
    /// The operation lock: a flag and a condition variable rather than a `Mutex<()>`, because
    /// its guard ([`HeldGpu`]) must own the GPU entry it locks.
    busy: Mutex<bool>,
    released: Condvar,
}

impl Gpu {
    fn new(description: GpuDescription) -> Arc<Self> {
        Arc::new(Self {
            description: RwLock::new(description),
            changes: AtomicU64::new(0),
            busy: Mutex::new(false),
            released: Condvar::new(),
        })
    }

    /// Waits for the GPU's operation lock.
    fn acquire(self: &Arc<Self>) -> HeldGpu {
        let mut busy = lock(&self.busy);
        while *busy {
            busy = self.released.wait(busy).unwrap_or_else(PoisonError::into_inner);
        }
        *busy = true;
        HeldGpu(self.clone())
    }
}

/// A held GPU operation lock; released on drop (also when a thread unwinds).
struct HeldGpu(Arc<Gpu>);

impl Drop for HeldGpu {
    fn drop(&mut self) {
        *lock(&self.0.busy) = false;
        self.0.released.notify_one();
    }
}

/// The operation locks of a set of GPUs, held together, borrowed from the node lock. The
/// GPUs a claim may touch are exactly the ones in here.
///
/// Taken after the node lock and released before it:
///
/// ```no_run
/// # use std::time::Duration;
/// # use migdra_kubelet_plugin::{gpus::Gpus, state_dir::NodeGate};
/// fn in_order(gpus: &Gpus, gate: &NodeGate) {
///     let node = gate.acquire(Duration::ZERO).unwrap();
///     let locks = node.lock_gpus(gpus, [0, 1]);
///     drop(locks);
///     drop(node);
/// }
/// ```
///
/// Keeping GPU locks past the node lock does not compile:
///
/// ```compile_fail,E0505
/// # use std::time::Duration;
/// # use migdra_kubelet_plugin::{gpus::Gpus, state_dir::NodeGate};
/// fn out_of_order(gpus: &Gpus, gate: &NodeGate) {
///     let node = gate.acquire(Duration::ZERO).unwrap();
///     let locks = node.lock_gpus(gpus, [0, 1]);
///     drop(node);
///     drop(locks);
/// }
/// ```
pub struct GpuLocks<'node> {
    held: BTreeMap<u32, HeldGpu>,
    _node: PhantomData<&'node NodeLock>,
}

impl NodeLock {
    /// Locks the GPUs with these minors (those this node knows), in minor order so that two
    /// claims never wait on each other.
    pub fn lock_gpus(&self, gpus: &Gpus, minors: impl IntoIterator<Item = u32>) -> GpuLocks<'_> {
        let minors: BTreeSet<u32> = minors.into_iter().collect();
        let held = minors
            .into_iter()
            .filter_map(|minor| gpus.get(minor).map(|gpu| (minor, gpu.acquire())))
            .collect();
        GpuLocks {
            held,
            _node: PhantomData,
        }
    }
}

impl GpuLocks<'_> {
    pub fn description(&self, minor: u32) -> Option<GpuDescription> {
        self.held.get(&minor).map(|g| read(&g.0.description).clone())
    }

    pub fn index(&self, minor: u32) -> Option<u32> {
        self.held.get(&minor).map(|g| read(&g.0.description).index)
    }

    /// Records that a locked GPU's MIG mode is now `enabled`.
    pub fn set_mig_mode(&self, minor: u32, enabled: bool) {
        if let Some(gpu) = self.held.get(&minor) {
            gpu.0.changes.fetch_add(1, Ordering::SeqCst);
            if let Some(mig) = write(&gpu.0.description).mig.as_mut() {
                mig.enabled = enabled;
                mig.pending_enabled = enabled;
            }
        }
    }

    /// Destroys what teardown left on the locked GPUs while they were lost
    /// ([`crate::orphans`]), on those that answer now. Prepare calls it under the node lock
    /// (the journal just re-read) before planning, so a claim whose placement such an
    /// instance blocks does not wait for an inventory that finds the node lock free.
    pub fn destroy_orphans(&self, gpus: &Gpus, records: &BTreeMap<String, ClaimRecord>) {
        let Some(orphans) = gpus.orphans().filter(|o| !o.is_empty()) else {
            return;
        };
        for gpu in self.held.values() {
            let description = read(&gpu.0.description).clone();
            if gpus.inner.backend.probe_health(description.index).is_ok() {
                gpus.destroy_orphans(orphans, &description, records);
            }
        }
    }

    /// What planning needs of the locked GPUs: descriptions and existing instances.
    pub fn views(&self, gpus: &Gpus) -> BTreeMap<u32, GpuView> {
        let view = |description: GpuDescription| GpuView {
            instances: gpus.occupied(&description),
            description,
        };
        self.held
            .iter()
            .map(|(minor, gpu)| (*minor, view(read(&gpu.0.description).clone())))
            .collect()
    }
}

struct Inner {
    backend: Arc<dyn GpuBackend>,
    /// The backend's calls in flight, to tell a GPU (or the node) NVML does not answer.
    calls: NvmlCalls,
    /// This plugin instance's way to the node lock.
    node_gate: NodeGate,
    pool: String,
    journal: Arc<Journal>,
    metrics: Metrics,
    table: RwLock<BTreeMap<u32, Arc<Gpu>>>,
    /// Records recovery could not repair yet, by claim UID.
    recovery_pending: Mutex<BTreeMap<String, PendingRepair>>,
    /// Instances teardown left on lost GPUs (set by the driver).
    orphans: OnceLock<Arc<LostGpuOrphans>>,
}

/// A checkpoint record that recovery could not repair yet; it stays in the journal as it was
/// and is retried in the background.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingRepair {
    pub uid: String,
    /// The claim, `namespace/name`.
    pub claim: String,
    /// The GPUs the record touches (marked unhealthy meanwhile).
    pub minors: BTreeSet<u32>,
    /// Why the last attempt failed.
    pub error: String,
}

/// The GPU table. Cheap to clone; clones share state.
#[derive(Clone)]
pub struct Gpus {
    inner: Arc<Inner>,
}

impl Gpus {
    fn get(&self, minor: u32) -> Option<Arc<Gpu>> {
        read(&self.inner.table).get(&minor).cloned()
    }

    pub fn pool(&self) -> &str {
        &self.inner.pool
    }

    pub(crate) fn backend(&self) -> &Arc<dyn GpuBackend> {
        &self.inner.backend
    }

    pub fn nvml_calls(&self) -> &NvmlCalls {
        &self.inner.calls
    }

    /// This plugin instance's way to the node lock.
    pub fn node_gate(&self) -> &NodeGate {
        &self.inner.node_gate
    }

    /// Why NVML answers nothing on this node, if it does not: a node-wide call is overdue, or
    /// every GPU has an overdue call. Such a node is not offered (its heartbeat pauses).
    pub fn nvml_stuck(&self) -> Option<String> {
        let indices: Vec<u32> = read(&self.inner.table)
            .values()
            .map(|gpu| read(&gpu.description).index)
            .collect();
        self.inner.calls.node_stuck(indices)
    }

    /// Whether the table has GPU `minor`.
    pub fn knows(&self, minor: u32) -> bool {
        read(&self.inner.table).contains_key(&minor)
    }

    /// Adds the GPUs NVML describes now that the table lacks (lost or unreadable when the
    /// plugin started); known GPUs are left to the inventory, which updates them under their
    /// locks.
    pub fn learn_new_gpus(&self) -> Result<(), BackendError> {
        let discovered = self.inner.backend.discover()?;
        let mut table = write(&self.inner.table);
        let known_uuids: BTreeSet<String> = table
            .values()
            .map(|g| read(&g.description).uuid.clone())
            .collect();
        for description in discovered {
            if !table.contains_key(&description.minor) && !known_uuids.contains(&description.uuid) {
                tracing::info!(gpu = description.minor, uuid = %description.uuid, "found a GPU this plugin did not know");
                table.insert(description.minor, Gpu::new(description));
            }
        }
        Ok(())
    }

    /// Why NVML does not answer on GPU `minor`, if it has an overdue call.
    pub fn nvml_stuck_on(&self, minor: u32) -> Option<String> {
        let index = read(&self.get(minor)?.description).index;
        self.inner
            .calls
            .overdue_in(crate::nvml::bounded::CallScope::Gpu(index))
            .map(|call| call.reason())
    }

    /// Discovers the GPUs through `backend`, whose calls in flight `calls` tracks. `journal`
    /// says which instances are migdra's (for the inventory).
    pub fn discover(
        backend: Arc<dyn GpuBackend>,
        calls: NvmlCalls,
        node_gate: NodeGate,
        pool: String,
        journal: Arc<Journal>,
        metrics: Metrics,
    ) -> Result<Self, BackendError> {
        let table = backend
            .discover()?
            .into_iter()
            .map(|d| (d.minor, Gpu::new(d)))
            .collect();
        Ok(Self {
            inner: Arc::new(Inner {
                backend,
                calls,
                node_gate,
                pool,
                journal,
                metrics,
                table: RwLock::new(table),
                recovery_pending: Mutex::new(BTreeMap::new()),
                orphans: OnceLock::new(),
            }),
        })
    }

    /// Uses `orphans` as the list of instances left on lost GPUs: the inventory destroys them
    /// when their GPU is back.
    pub fn with_orphans(self, orphans: Arc<LostGpuOrphans>) -> Self {
        if self.inner.orphans.set(orphans).is_err() {
            tracing::warn!("the list of instances left on lost GPUs was already set; kept the first");
        }
        self
    }

    /// The list of instances left on lost GPUs, if the driver set one.
    pub fn orphans(&self) -> Option<&Arc<LostGpuOrphans>> {
        self.inner.orphans.get()
    }

    /// Destroys the instances teardown left on `gpu` while it was lost, now that it answers again:
    /// exactly those (same profile, placement and GPU-instance ID where recorded). One that is gone
    /// is forgotten; one that cannot be destroyed stays listed for the next pass. An orphan whose
    /// placement a recorded claim holds is forgotten too: the instance there is the claim's (an
    /// orphan recorded before its instance had an ID would otherwise match it). A watched
    /// placement ([`crate::orphans::OrphanedInstance::awaited_until`]) stays listed, gone or
    /// held, until its watch ends or a late instance there is destroyed. Called under the GPU's
    /// lock and the node lock.
    fn destroy_orphans(
        &self,
        orphans: &LostGpuOrphans,
        gpu: &GpuDescription,
        records: &BTreeMap<String, ClaimRecord>,
    ) {
        let listed = orphans.on_gpu(&gpu.uuid);
        if listed.is_empty() {
            return;
        }
        let claimed = |profile: u32, at: u32| {
            records.values().flat_map(|r| &r.devices).any(|d| {
                d.gpu_uuid == gpu.uuid
                    && matches!(d.kind, DeviceKind::Mig { profile_id, start, .. } if profile_id == profile && start == at)
            })
        };
        // Asked of NVML, not of `gpu.mig`: a rescan that could not read everything may describe
        // the GPU without MIG, and "no instances" must not be concluded from that.
        let instances = match self.listed(gpu.index) {
            Ok(instances) => instances,
            Err(e) => {
                tracing::warn!(gpu = gpu.minor, error = %e, "listing GPU instances to destroy those left while the GPU was lost failed; retrying later");
                return;
            }
        };
        let backend = &self.inner.backend;
        let now = epoch_seconds();
        for orphan in listed {
            let is_orphan = |gi: &&GpuInstanceRecord| {
                (gi.profile_id, gi.start) == (orphan.profile_id, orphan.start)
                    && orphan.gpu_instance.is_none_or(|id| id == gi.id)
            };
            let awaited = orphan.awaited_at(now);
            if claimed(orphan.profile_id, orphan.start) {
                if awaited {
                    // The instance there is the claim's; a late one may still appear after it.
                    continue;
                }
                tracing::info!(gpu = gpu.minor, claim = %orphan.claim, device = %orphan.device, "the placement of an instance left while the GPU was lost belongs to a recorded claim now; forgetting it");
            } else if let Some(gi) = instances.iter().find(is_orphan) {
                let destroyed = gi
                    .compute_instances
                    .iter()
                    .map(|ci| backend.destroy_compute_instance(gpu.index, gi.id, ci.id))
                    .chain(std::iter::once_with(|| {
                        backend.destroy_gpu_instance(gpu.index, gi.id)
                    }))
                    .find_map(|r| r.err().filter(|e| e.kind != NvmlErrorKind::NotFound));
                if let Some(e) = destroyed {
                    tracing::warn!(gpu = gpu.minor, claim = %orphan.claim, device = %orphan.device, error = %e, "destroying an instance left while the GPU was lost failed; retrying later");
                    continue;
                }
                if orphan.awaited_until.is_some() {
                    tracing::warn!(gpu = gpu.minor, claim = %orphan.claim, device = %orphan.device, gpu_instance = gi.id, "destroyed an instance whose create completed after its claim was rolled back");
                } else {
                    tracing::info!(gpu = gpu.minor, claim = %orphan.claim, device = %orphan.device, gpu_instance = gi.id, "destroyed an instance left while the GPU was lost");
                }
            } else if awaited {
                continue;
            } else if orphan.awaited_until.is_some() {
                tracing::info!(gpu = gpu.minor, claim = %orphan.claim, device = %orphan.device, "no late instance appeared at a rolled-back claim's placement; no longer watching it");
            } else {
                tracing::info!(gpu = gpu.minor, claim = %orphan.claim, device = %orphan.device, "an instance left while the GPU was lost is gone");
            }
            if let Err(e) = orphans.remove(&orphan) {
                tracing::warn!(error = %e, "forgetting an instance left while the GPU was lost failed; retrying later");
            }
        }
    }

    /// Records (or updates) a record recovery could not repair: its GPUs turn unhealthy.
    pub fn mark_recovery_pending(&self, pending: PendingRepair) {
        let mut map = lock(&self.inner.recovery_pending);
        map.insert(pending.uid.clone(), pending);
        self.inner.metrics.pending_repairs(map.len());
    }

    /// Forgets a pending repair (repaired, or torn down by the kubelet's unprepare); returns
    /// whether one was pending.
    pub fn clear_recovery_pending(&self, uid: &str) -> bool {
        let mut map = lock(&self.inner.recovery_pending);
        let was = map.remove(uid).is_some();
        self.inner.metrics.pending_repairs(map.len());
        was
    }

    pub fn recovery_pending(&self) -> Vec<PendingRepair> {
        lock(&self.inner.recovery_pending).values().cloned().collect()
    }

    /// A pending repair of a record on GPU `minor`, other than claim `except_uid`'s (a claim's
    /// own half-done record does not keep that claim off the GPU: preparing it again tears
    /// the record down first).
    pub fn recovery_pending_on(&self, minor: u32, except_uid: Option<&str>) -> Option<PendingRepair> {
        lock(&self.inner.recovery_pending)
            .values()
            .find(|p| Some(p.uid.as_str()) != except_uid && p.minors.contains(&minor))
            .cloned()
    }

    /// The recorded claims with a device on GPU `minor`, as `(uid, namespace, name)`, by UID.
    pub fn recorded_claims_on(&self, minor: u32) -> Vec<(String, String, String)> {
        self.inner
            .journal
            .claims()
            .into_iter()
            .filter(|(_, r)| r.devices.iter().any(|d| d.gpu_minor == minor))
            .map(|(uid, r)| (uid, r.namespace, r.name))
            .collect()
    }

    /// GPU instances present on a GPU (none when MIG is off).
    fn occupied(&self, gpu: &GpuDescription) -> Result<Vec<GpuInstanceRecord>, BackendError> {
        match &gpu.mig {
            Some(mig) if mig.enabled => self.listed(gpu.index),
            _ => Ok(Vec::new()),
        }
    }

    /// GPU instances NVML lists on GPU `index` (none when its MIG mode is off now).
    fn listed(&self, index: u32) -> Result<Vec<GpuInstanceRecord>, BackendError> {
        match self.inner.backend.list_gpu_instances(index) {
            // Nothing exists only if MIG mode really went off since discovery.
            Err(e) if e.kind == NvmlErrorKind::NotSupported => match self.inner.backend.mig_enabled(index)? {
                Some(true) => Err(e),
                Some(false) | None => Ok(Vec::new()),
            },
            other => other,
        }
    }

    /// Re-discovers the GPUs (a rescan, so added or reset GPUs are noticed) and describes them
    /// for the GpuNode: geometry, instances (ours or foreign) and health.
    pub fn inventory(&self) -> Result<Vec<GpuInventory>, BackendError> {
        let changes_before: BTreeMap<u32, u64> = read(&self.inner.table)
            .iter()
            .map(|(minor, gpu)| (*minor, gpu.changes.load(Ordering::SeqCst)))
            .collect();
        let mut discovered = self.inner.backend.discover()?;
        // Instances left on lost GPUs are destroyed only under the node lock (no other plugin
        // instance is working), taken before any GPU lock and only if free at once; the journal is
        // re-read under it, as another instance may have prepared a claim at an orphan's placement.
        let orphans = self.orphans().filter(|o| !o.is_empty()).and_then(|o| {
            let node = match self.inner.node_gate.acquire(Duration::ZERO) {
                Ok(node) => node,
                Err(e) => {
                    tracing::debug!(error = %e, "node lock busy; instances left on lost GPUs are destroyed at a later pass");
                    return None;
                }
            };
            match self.inner.journal.reload_if_changed() {
                Ok(_) => Some((o.clone(), node)),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot re-read the checkpoint; instances left on lost GPUs are destroyed at a later pass");
                    None
                }
            }
        });
        // GPUs NVML no longer describes are kept, so they show as unhealthy (their probe fails)
        // instead of vanishing. A GPU NVML renumbered (a MIG-mode change may change the minor, §12)
        // moves to its new minor; mode changes happen only without instances, so no record refers to
        // the old one.
        let mut renumbered = Vec::new();
        for (minor, gpu) in read(&self.inner.table).iter() {
            let known = read(&gpu.description).clone();
            if discovered.iter().any(|d| d.minor == known.minor) {
                continue;
            }
            match discovered.iter().find(|d| d.uuid == known.uuid) {
                Some(now) => {
                    tracing::warn!(gpu = %known.uuid, from = known.minor, to = now.minor, "GPU was renumbered; its devices move to the new minor");
                    renumbered.push(*minor);
                }
                None => discovered.push(known),
            }
        }
        if !renumbered.is_empty() {
            write(&self.inner.table).retain(|minor, _| !renumbered.contains(minor));
        }
        discovered.sort_by_key(|d| d.minor);
        let mut inventory = Vec::with_capacity(discovered.len());
        for description in discovered {
            let gpu = write(&self.inner.table)
                .entry(description.minor)
                .or_insert_with(|| Gpu::new(description.clone()))
                .clone();
            // Under the GPU lock, so an instance being created is always already recorded.
            let _held = gpu.acquire();
            let description =
                if changes_before.get(&description.minor) == Some(&gpu.changes.load(Ordering::SeqCst)) {
                    *write(&gpu.description) = description.clone();
                    description
                } else {
                    // The driver switched the mode after the rescan began: the table is newer.
                    read(&gpu.description).clone()
                };
            let records = self.inner.journal.claims();
            let probe = self.inner.backend.probe_health(description.index).err();
            let probe = probe.map(|e| e.to_string());
            if probe.is_none()
                && let Some((orphans, _node)) = &orphans
            {
                self.destroy_orphans(orphans, &description, &records);
            }
            let pending = self.recovery_pending_on(description.minor, None);
            let reasons: Vec<String> = probe
                .into_iter()
                .chain(pending.map(|p| format!("recovery of claim {} pending: {}", p.claim, p.error)))
                .collect();
            // Instances that cannot be listed may occupy any placement: the GPU is reported
            // unhealthy so none of its free-looking placements is offered.
            let (instances, listing) = match self.occupied(&description) {
                Ok(instances) => (instances, None),
                Err(e) => {
                    tracing::warn!(gpu = description.minor, error = %e, "listing GPU instances failed");
                    (
                        Vec::new(),
                        Some(format!("its MIG instances cannot be listed: {e}")),
                    )
                }
            };
            let reasons: Vec<String> = reasons.into_iter().chain(listing).collect();
            let health = GpuHealth {
                healthy: reasons.is_empty(),
                reason: (!reasons.is_empty()).then(|| reasons.join("; ")),
            };
            // A switch another process would block is not offered: only NVML sessions (DCGM)
            // stay unseen, and fail the claim at prepare.
            let switchable = mode_switchable(&description)
                && description.mig.is_some()
                && match self.inner.backend.gpu_processes(description.index) {
                    Ok(pids) => pids.is_empty(),
                    Err(e) => {
                        tracing::debug!(gpu = description.minor, error = %e, "listing GPU processes failed");
                        false
                    }
                };
            inventory.push(gpu_inventory(
                &description,
                &instances,
                &records,
                health,
                switchable,
            ));
        }
        self.inner
            .metrics
            .observe_inventory(&inventory, &self.inner.journal.claims());
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

/// What the node reports about `gpu` with these instances: each is migdra's when a record
/// describes it (same placement, and same ID where recorded), foreign otherwise.
pub fn gpu_inventory(
    gpu: &GpuDescription,
    instances: &[GpuInstanceRecord],
    records: &BTreeMap<String, ClaimRecord>,
    health: GpuHealth,
    mode_switchable: bool,
) -> GpuInventory {
    GpuInventory {
        minor: gpu.minor,
        index: gpu.index,
        uuid: gpu.uuid.clone(),
        product_name: gpu.product_name.clone(),
        architecture: gpu.architecture,
        cuda_compute_capability: gpu.cuda_compute_capability.map(|(a, b)| format!("{a}.{b}")),
        pci_bus_id: gpu.pci_bus_id.clone(),
        numa_node: gpu.numa_node,
        memory_mib: gpu.memory_mib,
        mig: gpu.mig.as_ref().map(|mig| {
            let geometry = MigGeometry::new(mig.profiles.clone(), gpu.memory_mib);
            let instances = instances
                .iter()
                .map(|gi| describe_instance(gi, &geometry, gpu.minor, records))
                .collect();
            MigInventory {
                enabled: mig.enabled,
                change_pending: mig.enabled != mig.pending_enabled,
                mode_switchable,
                engine_counters_overruled: counters_overruled_once(&geometry),
                geometry,
                instances,
            }
        }),
        health,
    }
}

/// The engine-counter check of a geometry ([`engine_counters_overruled`]), run once per
/// distinct geometry: it is an exhaustive search, and every refresh describes the same GPUs
/// again, under their locks.
fn counters_overruled_once(geometry: &MigGeometry) -> Option<String> {
    static CHECKED: Mutex<Vec<(MigGeometry, Option<String>)>> = Mutex::new(Vec::new());
    let mut checked = lock(&CHECKED);
    if let Some((_, why)) = checked.iter().find(|(known, _)| known == geometry) {
        return why.clone();
    }
    let why = engine_counters_overruled(geometry);
    checked.push((geometry.clone(), why.clone()));
    why
}

fn describe_instance(
    gi: &GpuInstanceRecord,
    geometry: &MigGeometry,
    minor: u32,
    records: &BTreeMap<String, ClaimRecord>,
) -> MigInstance {
    let owner = records.iter().find_map(|(uid, r)| {
        r.devices
            .iter()
            .find(|d| {
                d.gpu_minor == minor
                    && matches!(d.kind, DeviceKind::Mig { profile_id, start, gpu_instance, .. }
                    if profile_id == gi.profile_id && start == gi.start && gpu_instance.is_none_or(|id| id == gi.id))
            })
            .map(|d| (uid, r, d))
    });
    let (compute_instance_id, mig_uuid) = match owner.map(|(_, _, d)| &d.kind) {
        Some(DeviceKind::Mig {
            compute_instance,
            mig_uuid,
            ..
        }) => (*compute_instance, mig_uuid.clone()),
        _ => (None, None),
    };
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
        claim: owner.map(|(_, r, _)| r.key()),
        claim_uid: owner.map(|(uid, _, _)| uid.clone()),
        compute_instance_id,
        mig_uuid,
    }
}
