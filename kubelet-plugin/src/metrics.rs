//! Prometheus metrics of the kubelet plugin (prefix `migdra_kubelet_plugin_`; in production
//! every series carries the node's name as `node`, see [`Metrics::for_node`]): claim outcomes
//! and failure causes, call durations (with their time inside NVML, outside it, and outside
//! both NVML and the claim GETs: the driver's own work; and each
//! NVML call's time by backend function), startup repairs, repairs left pending and their
//! retries, stale claims released, claim status writes (and those waiting for a retry); from
//! the inventory, per GPU (`gpu` = NVML index as DCGM's exporter labels it, `gpu_minor`,
//! `gpu_uuid`) its MIG mode, health, used and free memory slices and instances by profile;
//! and one `mig_instance_info` series per MIG instance migdra created, carrying what joins
//! DCGM's per-instance series to the pod.
//!
//! Every label value comes from a bounded set: fixed words, profile names, and the node's own
//! GPUs and instances (at most a few dozen series per node). Series of GPUs and instances that
//! are gone are removed, not left at their last value.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    hash::Hash,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use k8s_openapi::api::resource::v1::ResourceClaim;
use migdra_api::{
    device_name::DeviceName,
    inventory::{GpuInventory, InstanceOwner},
};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

use crate::{
    checkpoint::{ClaimRecord, DeviceKind},
    nvml::timing::NvmlClock,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClaimLabels {
    operation: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FailureLabels {
    operation: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OperationLabels {
    operation: &'static str,
}

/// A [`crate::nvml::GpuBackend`] method (a fixed set of names).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FunctionLabels {
    function: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ActionLabels {
    action: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusWriteLabels {
    operation: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OwnerLabels {
    owner: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HealthLabels {
    health: &'static str,
}

/// Names one GPU: `gpu` is the NVML index (DCGM exporter's `gpu` label), `gpu_minor` the
/// device minor (what migdra's device names use).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabels {
    gpu: String,
    gpu_minor: String,
    gpu_uuid: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuSliceLabels {
    gpu: String,
    gpu_minor: String,
    gpu_uuid: String,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuProfileLabels {
    gpu: String,
    gpu_minor: String,
    gpu_uuid: String,
    profile: String,
    owner: &'static str,
}

/// One MIG instance migdra created. `gpu_uuid` and `gi` are what DCGM exporter's `UUID` and
/// `GPU_I_ID` carry; `namespace`/`claim` name the ResourceClaim, `pod` the pods it is reserved
/// for (comma-separated; empty when the plugin has not read the claim since it started).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct InstanceInfoLabels {
    gpu_uuid: String,
    gpu: String,
    gpu_minor: String,
    gi: String,
    ci: String,
    mig_uuid: String,
    profile: String,
    placement: String,
    namespace: String,
    pod: String,
    claim: String,
}

/// A gauge family whose whole set of series is replaced at each observation: series not in
/// the new set are removed (a GPU or instance that is gone leaves no stale series).
#[derive(Clone)]
struct GaugeSet<L> {
    family: Family<L, Gauge>,
    present: Arc<Mutex<HashSet<L>>>,
}

impl<L: Clone + Hash + Eq + EncodeLabelSet + std::fmt::Debug + Send + Sync + 'static> GaugeSet<L> {
    fn new() -> Self {
        Self {
            family: Family::default(),
            present: Arc::default(),
        }
    }

    fn replace(&self, values: impl IntoIterator<Item = (L, i64)>) {
        let mut present = lock(&self.present);
        let mut next = HashSet::new();
        for (labels, value) in values {
            self.family.get_or_create(&labels).set(value);
            next.insert(labels);
        }
        for gone in present.difference(&next) {
            self.family.remove(gone);
        }
        *present = next;
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // The maps only cache label values; a panic elsewhere leaves them usable.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn count(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The pods a claim is reserved for (`status.reservedFor` entries of kind Pod), sorted.
pub fn reserved_pods(claim: &ResourceClaim) -> Vec<String> {
    let mut pods: Vec<String> = claim
        .status
        .iter()
        .flat_map(|s| s.reserved_for.iter().flatten())
        .filter(|r| r.resource == "pods" && r.api_group.as_deref().unwrap_or_default().is_empty())
        .map(|r| r.name.clone())
        .collect();
    pods.sort();
    pods.dedup();
    pods
}

/// The plugin's metrics. Cheap to clone.
#[derive(Clone)]
pub struct Metrics {
    claims: Family<ClaimLabels, Counter>,
    claim_failures: Family<FailureLabels, Counter>,
    call_duration: Family<OperationLabels, Histogram>,
    call_nvml_duration: Family<OperationLabels, Histogram>,
    call_outside_nvml_duration: Family<OperationLabels, Histogram>,
    call_own_duration: Family<OperationLabels, Histogram>,
    claim_read_duration: Histogram,
    nvml_call_duration: Family<FunctionLabels, Histogram>,
    recoveries: Family<ActionLabels, Counter>,
    repair_attempts: Family<OutcomeLabels, Counter>,
    pending_repairs: Gauge,
    stale_claims_released: Family<ReasonLabels, Counter>,
    claim_status_writes: Family<StatusWriteLabels, Counter>,
    claim_status_pending: Gauge,
    prepared_claims: Gauge,
    mig_instances: Family<OwnerLabels, Gauge>,
    gpus: Family<HealthLabels, Gauge>,
    gpu_healthy: GaugeSet<GpuLabels>,
    gpu_mig_mode: GaugeSet<GpuLabels>,
    gpu_memory_slices: GaugeSet<GpuSliceLabels>,
    gpu_mig_instances: GaugeSet<GpuProfileLabels>,
    mig_instance_info: GaugeSet<InstanceInfoLabels>,
    /// NVML index by GPU minor, from the last inventory (the checkpoint records minors).
    gpu_index: Arc<Mutex<BTreeMap<u32, u32>>>,
    /// Pods each claim (by UID) is reserved for, from its last GET.
    claim_pods: Arc<Mutex<HashMap<String, Vec<String>>>>,
    registry: Arc<Registry>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates the metrics and their registry, without a node label (tests).
    pub fn new() -> Self {
        Self::with_registry(Registry::with_prefix("migdra_kubelet_plugin"))
    }

    /// The metrics of the plugin on `node`: every series carries `node="<node>"`, so the
    /// series of all nodes stay apart whatever target labels the scraper adds, and the
    /// instance series join DCGM's (whose `Hostname` is the node) by node too.
    pub fn for_node(node: &str) -> Self {
        let labels = [("node".into(), node.to_string().into())];
        Self::with_registry(Registry::with_prefix_and_labels(
            "migdra_kubelet_plugin",
            labels.into_iter(),
        ))
    }

    fn with_registry(mut registry: Registry) -> Self {
        let claims = Family::<ClaimLabels, Counter>::default();
        registry.register(
            "claims",
            "Claims prepared or unprepared, by result",
            claims.clone(),
        );
        let claim_failures = Family::<FailureLabels, Counter>::default();
        registry.register(
            "claim_failures",
            "Claims that failed to prepare or unprepare, by cause",
            claim_failures.clone(),
        );
        let call_duration = Family::<OperationLabels, Histogram>::new_with_constructor(|| {
            Histogram::new([
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            ])
        });
        registry.register(
            "call_duration_seconds",
            "Duration of kubelet prepare/unprepare calls",
            call_duration.clone(),
        );
        // Fine enough at the low end to read a p99 of a few milliseconds (B4 of `make bench`).
        let fine = || {
            Histogram::new([
                0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0,
            ])
        };
        let call_nvml_duration = Family::<OperationLabels, Histogram>::new_with_constructor(fine);
        registry.register(
            "call_nvml_duration_seconds",
            "Wall time inside NVML per kubelet prepare/unprepare call (the sum of the NVML calls made for it)",
            call_nvml_duration.clone(),
        );
        let call_outside_nvml_duration = Family::<OperationLabels, Histogram>::new_with_constructor(fine);
        registry.register(
            "call_outside_nvml_duration_seconds",
            "Duration of kubelet prepare/unprepare calls minus their time inside NVML",
            call_outside_nvml_duration.clone(),
        );
        let call_own_duration = Family::<OperationLabels, Histogram>::new_with_constructor(fine);
        registry.register(
            "call_own_duration_seconds",
            "Duration of kubelet prepare/unprepare calls minus their time inside NVML and minus the \
             time they waited for their claim GETs: the driver's own work (checkpoint, planning, \
             CDI specs, lock waits)",
            call_own_duration.clone(),
        );
        let claim_read_duration = fine();
        registry.register(
            "claim_read_duration_seconds",
            "Duration of the claim GET a prepare makes (the API server's part of a prepare, inside \
             call_outside_nvml_duration_seconds)",
            claim_read_duration.clone(),
        );
        let nvml_call_duration = Family::<FunctionLabels, Histogram>::new_with_constructor(|| {
            Histogram::new([
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
            ])
        });
        registry.register(
            "nvml_call_duration_seconds",
            "Wall time of one NVML backend call made for a kubelet call, by backend function",
            nvml_call_duration.clone(),
        );
        let recoveries = Family::<ActionLabels, Counter>::default();
        registry.register(
            "recoveries",
            "Repairs of interrupted operations at start",
            recoveries.clone(),
        );
        let repair_attempts = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "repair_attempts",
            "Attempts to repair a checkpoint record recovery left unrepaired (at start and in the background), by outcome",
            repair_attempts.clone(),
        );
        let pending_repairs = Gauge::default();
        registry.register(
            "pending_repairs",
            "Checkpoint records recovery could not repair yet (their GPUs are reported unhealthy)",
            pending_repairs.clone(),
        );
        let stale_claims_released = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "stale_claims_released",
            "Recorded claims released because their ResourceClaim is gone, replaced or no longer allocated here, by cause",
            stale_claims_released.clone(),
        );
        let claim_status_writes = Family::<StatusWriteLabels, Counter>::default();
        registry.register(
            "claim_status_writes",
            "Writes of this driver's ResourceClaim status.devices entries (operation ready or clear), by outcome (written, failed, dropped, deferred)",
            claim_status_writes.clone(),
        );
        let claim_status_pending = Gauge::default();
        registry.register(
            "claim_status_pending",
            "ResourceClaim status writes that failed (or were deferred after a failure) and wait for the periodic retry; writes queued for the background writer are not counted",
            claim_status_pending.clone(),
        );
        let prepared_claims = Gauge::default();
        registry.register(
            "prepared_claims",
            "Claims currently recorded in the checkpoint",
            prepared_claims.clone(),
        );
        let mig_instances = Family::<OwnerLabels, Gauge>::default();
        registry.register(
            "mig_instances",
            "MIG GPU instances on the node, by creator",
            mig_instances.clone(),
        );
        let gpus = Family::<HealthLabels, Gauge>::default();
        registry.register("gpus", "GPUs on the node, by health", gpus.clone());
        let gpu_healthy = GaugeSet::new();
        registry.register(
            "gpu_healthy",
            "1 while the GPU passes its health probe and has no repair pending, else 0",
            gpu_healthy.family.clone(),
        );
        let gpu_mig_mode = GaugeSet::new();
        registry.register(
            "gpu_mig_mode",
            "1 while MIG mode is enabled on the GPU, 0 while disabled (MIG-capable GPUs only)",
            gpu_mig_mode.family.clone(),
        );
        let gpu_memory_slices = GaugeSet::new();
        registry.register(
            "gpu_memory_slices",
            "Memory slices of a MIG-enabled GPU, by state (used by any instance, or free)",
            gpu_memory_slices.family.clone(),
        );
        let gpu_mig_instances = GaugeSet::new();
        registry.register(
            "gpu_mig_instances",
            "MIG GPU instances on the GPU, by profile and creator",
            gpu_mig_instances.family.clone(),
        );
        let mig_instance_info = GaugeSet::new();
        registry.register(
            "mig_instance_info",
            "One series (value 1) per MIG instance migdra created, naming its GPU, GPU and \
             compute instance IDs, MIG UUID, profile, placement start and claim; join on \
             gpu_uuid/gi with DCGM exporter's UUID/GPU_I_ID",
            mig_instance_info.family.clone(),
        );
        Self {
            gpu_healthy,
            gpu_mig_mode,
            gpu_memory_slices,
            gpu_mig_instances,
            mig_instance_info,
            gpu_index: Arc::default(),
            claim_pods: Arc::default(),
            claims,
            claim_failures,
            call_duration,
            call_nvml_duration,
            call_outside_nvml_duration,
            call_own_duration,
            claim_read_duration,
            nvml_call_duration,
            recoveries,
            repair_attempts,
            pending_repairs,
            stale_claims_released,
            claim_status_writes,
            claim_status_pending,
            prepared_claims,
            mig_instances,
            gpus,
            registry: Arc::new(registry),
        }
    }

    /// Counts one claim's outcome.
    pub fn claim(&self, operation: &'static str, ok: bool) {
        let result = if ok { "success" } else { "error" };
        self.claims
            .get_or_create(&ClaimLabels { operation, result })
            .inc();
    }

    /// Counts one claim's failure by its cause (`ClaimFailure::reason`, a bounded set).
    pub fn claim_failure(&self, operation: &'static str, reason: &'static str) {
        self.claim_failures
            .get_or_create(&FailureLabels { operation, reason })
            .inc();
    }

    /// Observes the duration of one kubelet call.
    pub fn call(&self, operation: &'static str, duration: Duration) {
        self.call_duration
            .get_or_create(&OperationLabels { operation })
            .observe(duration.as_secs_f64());
    }

    /// Observes one kubelet call: its duration, its time inside NVML (the calls `nvml`
    /// recorded for it; zero when it made none), the difference, that difference minus
    /// `api_wait` (how long the call waited for its claim GETs, which run side by side, so
    /// their wall time, not their sum), and each NVML call.
    pub fn call_with_nvml(
        &self,
        operation: &'static str,
        duration: Duration,
        nvml: &NvmlClock,
        api_wait: Duration,
    ) {
        self.call(operation, duration);
        let calls = nvml.calls();
        let inside: Duration = calls.iter().map(|c| c.duration).sum();
        let labels = OperationLabels { operation };
        self.call_nvml_duration
            .get_or_create(&labels)
            .observe(inside.as_secs_f64());
        let outside = duration.saturating_sub(inside);
        self.call_outside_nvml_duration
            .get_or_create(&labels)
            .observe(outside.as_secs_f64());
        self.call_own_duration
            .get_or_create(&labels)
            .observe(outside.saturating_sub(api_wait).as_secs_f64());
        for call in calls {
            self.nvml_call_duration
                .get_or_create(&FunctionLabels {
                    function: call.function,
                })
                .observe(call.duration.as_secs_f64());
        }
    }

    /// Observes one claim GET of a prepare (answered or not).
    pub fn claim_get(&self, duration: Duration) {
        self.claim_read_duration.observe(duration.as_secs_f64());
    }

    /// Counts one startup repair.
    pub fn recovery(&self, action: &'static str) {
        self.recoveries.get_or_create(&ActionLabels { action }).inc();
    }

    /// Counts one repair attempt of a record (`outcome`: `repaired` or `failed`).
    pub fn repair_attempt(&self, repaired: bool) {
        let outcome = if repaired { "repaired" } else { "failed" };
        self.repair_attempts
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    /// Sets how many records wait for repair.
    pub fn pending_repairs(&self, count: usize) {
        self.pending_repairs.set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    /// Counts one stale claim released (`reason`: a [`crate::driver::StaleCause::reason`]).
    pub fn stale_claim_released(&self, reason: &'static str) {
        self.stale_claims_released
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// Counts one claim status write (`operation`: `ready` or `clear`; `outcome`: `written`,
    /// `failed` (retried later), `dropped` (not retried: the claim is gone, replaced, or the
    /// API server refused the content) or `deferred` (queued, not tried, after another write
    /// failed; retried later)).
    pub fn claim_status_write(&self, operation: &'static str, outcome: &'static str) {
        self.claim_status_writes
            .get_or_create(&StatusWriteLabels { operation, outcome })
            .inc();
    }

    /// Sets how many claim status writes wait for a retry.
    pub fn claim_status_pending(&self, count: usize) {
        self.claim_status_pending
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    /// Remembers the pods `claim` (UID `uid`) is reserved for, for its instances' info series.
    pub fn claim_read(&self, uid: &str, claim: &ResourceClaim) {
        lock(&self.claim_pods).insert(uid.to_string(), reserved_pods(claim));
    }

    /// Updates the per-instance info series from the checkpoint's records: one series per MIG
    /// instance a record says exists (created, IDs recorded), none for claims that are gone.
    /// Called after every kubelet call and with every inventory.
    pub fn observe_claims(&self, records: &BTreeMap<String, ClaimRecord>) {
        let gpu_index = lock(&self.gpu_index).clone();
        let mut pods = lock(&self.claim_pods);
        pods.retain(|uid, _| records.contains_key(uid));
        let mut series = Vec::new();
        for (uid, record) in records {
            for device in &record.devices {
                let DeviceKind::Mig {
                    start,
                    gpu_instance: Some(gi),
                    compute_instance: Some(ci),
                    mig_uuid: Some(mig_uuid),
                    ..
                } = &device.kind
                else {
                    continue;
                };
                let profile = match device.device.parse::<DeviceName>() {
                    Ok(DeviceName::Mig { profile, .. }) => profile.to_string(),
                    _ => String::new(),
                };
                let index = gpu_index
                    .get(&device.gpu_minor)
                    .map(u32::to_string)
                    .unwrap_or_default();
                let labels = InstanceInfoLabels {
                    gpu_uuid: device.gpu_uuid.clone(),
                    gpu: index,
                    gpu_minor: device.gpu_minor.to_string(),
                    gi: gi.to_string(),
                    ci: ci.to_string(),
                    mig_uuid: mig_uuid.clone(),
                    profile,
                    placement: start.to_string(),
                    namespace: record.namespace.clone(),
                    pod: pods.get(uid).map(|p| p.join(",")).unwrap_or_default(),
                    claim: record.name.clone(),
                };
                series.push((labels, 1));
            }
        }
        drop(pods);
        self.mig_instance_info.replace(series);
        self.prepared_claims.set(count(records.len()));
    }

    /// Updates the gauges from an inventory and the checkpoint's records.
    pub fn observe_inventory(&self, inventory: &[GpuInventory], records: &BTreeMap<String, ClaimRecord>) {
        *lock(&self.gpu_index) = inventory.iter().map(|g| (g.minor, g.index)).collect();
        self.observe_claims(records);
        self.observe_gpus(inventory);
        let instances = inventory
            .iter()
            .filter_map(|g| g.mig.as_ref())
            .flat_map(|m| &m.instances);
        let (mut ours, mut foreign) = (0, 0);
        for instance in instances {
            match instance.owner {
                InstanceOwner::Migdra => ours += 1,
                InstanceOwner::Foreign => foreign += 1,
            }
        }
        self.mig_instances
            .get_or_create(&OwnerLabels { owner: "migdra" })
            .set(ours);
        self.mig_instances
            .get_or_create(&OwnerLabels { owner: "foreign" })
            .set(foreign);
        let healthy = inventory.iter().filter(|g| g.health.healthy).count();
        let total = inventory.len();
        self.gpus
            .get_or_create(&HealthLabels { health: "healthy" })
            .set(healthy as i64);
        self.gpus
            .get_or_create(&HealthLabels { health: "unhealthy" })
            .set((total - healthy) as i64);
    }

    /// The per-GPU series of an inventory.
    fn observe_gpus(&self, inventory: &[GpuInventory]) {
        let gpu = |g: &GpuInventory| GpuLabels {
            gpu: g.index.to_string(),
            gpu_minor: g.minor.to_string(),
            gpu_uuid: g.uuid.clone(),
        };
        self.gpu_healthy
            .replace(inventory.iter().map(|g| (gpu(g), i64::from(g.health.healthy))));
        let mig_gpus = || inventory.iter().filter_map(|g| g.mig.as_ref().map(|m| (g, m)));
        self.gpu_mig_mode
            .replace(mig_gpus().map(|(g, m)| (gpu(g), i64::from(m.enabled))));
        self.gpu_memory_slices
            .replace(mig_gpus().filter(|(_, m)| m.enabled).flat_map(|(g, m)| {
                let used = m.used_memory_slices().len();
                let total = usize::try_from(m.geometry.budget.memory_slices).unwrap_or(usize::MAX);
                let labels = |state| GpuSliceLabels {
                    gpu: g.index.to_string(),
                    gpu_minor: g.minor.to_string(),
                    gpu_uuid: g.uuid.clone(),
                    state,
                };
                [
                    (labels("used"), count(used)),
                    (labels("free"), count(total.saturating_sub(used))),
                ]
            }));
        let mut by_profile: BTreeMap<(u32, String, &'static str), (GpuLabels, i64)> = BTreeMap::new();
        for (g, m) in mig_gpus() {
            for instance in &m.instances {
                let profile = instance
                    .profile
                    .map_or_else(|| "unknown".to_string(), |p| p.to_string());
                let owner = match instance.owner {
                    InstanceOwner::Migdra => "migdra",
                    InstanceOwner::Foreign => "foreign",
                };
                by_profile
                    .entry((g.minor, profile, owner))
                    .or_insert_with(|| (gpu(g), 0))
                    .1 += 1;
            }
        }
        self.gpu_mig_instances
            .replace(by_profile.into_iter().map(|((_, profile, owner), (g, n))| {
                let labels = GpuProfileLabels {
                    gpu: g.gpu,
                    gpu_minor: g.gpu_minor,
                    gpu_uuid: g.gpu_uuid,
                    profile,
                    owner,
                };
                (labels, n)
            }));
    }

    /// Renders the OpenMetrics text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!(error = %e, "encoding metrics failed");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn for_node_puts_the_node_on_every_series() {
        let metrics = Metrics::for_node("gpu-node-1");
        metrics.claim("prepare", true);
        metrics.pending_repairs(2);
        let text = metrics.encode();
        assert!(
            text.contains(r#"migdra_kubelet_plugin_claims_total{node="gpu-node-1",operation="prepare",result="success"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"migdra_kubelet_plugin_pending_repairs{node="gpu-node-1"} 2"#),
            "{text}"
        );
    }

    #[test]
    fn failures_are_counted_by_operation_and_reason() {
        let metrics = Metrics::new();
        metrics.claim_failure("prepare", "UnknownProfile");
        metrics.claim_failure("prepare", "UnknownProfile");
        metrics.claim_failure("unprepare", "NvmlError");
        let text = metrics.encode();
        assert!(
            text.contains(
                r#"migdra_kubelet_plugin_claim_failures_total{operation="prepare",reason="UnknownProfile"} 2"#
            ),
            "{text}"
        );
        assert!(
            text.contains(
                r#"migdra_kubelet_plugin_claim_failures_total{operation="unprepare",reason="NvmlError"} 1"#
            ),
            "{text}"
        );
    }
}
