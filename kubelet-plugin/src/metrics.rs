//! Prometheus metrics of the kubelet plugin (prefix `migdra_kubelet_plugin_`; in production
//! every series carries the node's name as `node`, see [`Metrics::for_node`]), all listed in
//! the `metrics!` table. Per-GPU series name the GPU as DCGM's exporter does (`gpu` = NVML
//! index) plus `gpu_minor` and `gpu_uuid`; `mig_instance_info` carries what joins DCGM's
//! per-instance series to the pod.
//!
//! Every label value comes from a bounded set: fixed words, profile names, and the node's own
//! GPUs and instances (at most a few dozen series per node). Series of GPUs and instances that
//! are gone are removed, not left at their last value.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::{Arc, Mutex},
    time::Duration,
};

use k8s_openapi::api::resource::v1::ResourceClaim;
use migdra_api::{
    device_name::DeviceName,
    inventory::{GpuInventory, InstanceOwner},
};
use prometheus_client::{
    encoding::{EncodeMetric, MetricEncoder},
    metrics::{MetricType, counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::{Metric, Registry},
};

use crate::{
    checkpoint::{ClaimRecord, DeviceKind},
    lock,
    nvml::timing::NvmlClock,
};

/// A label set of fixed words, as `(name, value)` pairs in output order.
type Words<const N: usize> = [(&'static str, &'static str); N];
/// A label set naming a GPU or a MIG instance, as `(name, value)` pairs in output order.
type Named = Vec<(&'static str, String)>;

const CALL_BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
// Fine enough at the low end to read a p99 of a few milliseconds (B4 of `make bench`).
const FINE_BUCKETS: [f64; 22] = [
    0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.5, 0.75, 1.0, 2.0, 5.0,
];
const NVML_BUCKETS: [f64; 14] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

/// The pods a claim is reserved for, and whether the prepare that read them still runs.
#[derive(Debug)]
struct ClaimPods {
    pods: Vec<String>,
    preparing: bool,
}

/// A gauge family whose whole set of series is replaced at each observation: series not in
/// the new set are removed (a GPU or instance that is gone leaves no stale series).
#[derive(Clone, Debug, Default)]
struct GaugeSet {
    family: Family<Named, Gauge>,
    present: Arc<Mutex<HashSet<Named>>>,
}

impl EncodeMetric for GaugeSet {
    fn encode(&self, encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        self.family.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        self.family.metric_type()
    }

    fn is_empty(&self) -> bool {
        self.family.is_empty()
    }
}

impl GaugeSet {
    fn replace(&self, values: impl IntoIterator<Item = (Named, i64)>) {
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

fn count(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn register<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register(name, help, metric.clone());
    metric
}

fn owner_word(owner: InstanceOwner) -> &'static str {
    match owner {
        InstanceOwner::Migdra => "migdra",
        InstanceOwner::Foreign => "foreign",
    }
}

/// `gpu` is the NVML index (DCGM exporter's `gpu` label), `gpu_minor` the device minor (what
/// migdra's device names use).
fn gpu_labels(g: &GpuInventory, extra: impl IntoIterator<Item = (&'static str, String)>) -> Named {
    let mut labels = vec![
        ("gpu", g.index.to_string()),
        ("gpu_minor", g.minor.to_string()),
        ("gpu_uuid", g.uuid.clone()),
    ];
    labels.extend(extra);
    labels
}

/// Declares the plugin's metrics once, as a table: the fields that only support them
/// (`Default` at start), then each registered metric's field, type, name, help and empty value.
macro_rules! metrics {
    (
        support { $($(#[$sdoc:meta])* $sfield:ident: $sty:ty,)* }
        $($(#[$doc:meta])* $field:ident: $ty:ty = $name:literal, $help:literal, $init:expr;)*
    ) => {
        /// The plugin's metrics. Cheap to clone.
        #[derive(Clone)]
        pub struct Metrics {
            $($(#[$doc])* $field: $ty,)*
            $($(#[$sdoc])* $sfield: $sty,)*
            registry: Arc<Registry>,
        }

        impl Metrics {
            fn with_registry(mut registry: Registry) -> Self {
                Self {
                    $($field: register(&mut registry, $name, $help, $init),)*
                    $($sfield: Default::default(),)*
                    registry: Arc::new(registry),
                }
            }
        }
    };
}

metrics! {
    support {
        /// NVML index by GPU minor, from the last inventory (the checkpoint records minors).
        gpu_index: Arc<Mutex<BTreeMap<u32, u32>>>,
        /// Pods each claim (by UID) is reserved for, from its last GET.
        claim_pods: Arc<Mutex<HashMap<String, ClaimPods>>>,
    }
    claims: Family<Words<2>, Counter> =
        "claims", "Claims prepared or unprepared, by result", Family::default();
    claim_failures: Family<Words<2>, Counter> =
        "claim_failures", "Claims that failed to prepare or unprepare, by cause", Family::default();
    call_duration: Family<Words<1>, Histogram> =
        "call_duration_seconds", "Duration of kubelet prepare/unprepare calls",
        Family::new_with_constructor(|| Histogram::new(CALL_BUCKETS));
    call_nvml_duration: Family<Words<1>, Histogram> =
        "call_nvml_duration_seconds",
        "Wall time inside NVML per kubelet prepare/unprepare call (the sum of the NVML calls made for it)",
        Family::new_with_constructor(|| Histogram::new(FINE_BUCKETS));
    call_outside_nvml_duration: Family<Words<1>, Histogram> =
        "call_outside_nvml_duration_seconds",
        "Duration of kubelet prepare/unprepare calls minus their time inside NVML",
        Family::new_with_constructor(|| Histogram::new(FINE_BUCKETS));
    call_own_duration: Family<Words<1>, Histogram> =
        "call_own_duration_seconds",
        "Duration of kubelet prepare/unprepare calls minus their time inside NVML and minus the \
         time they waited for their claim GETs: the driver's own work (checkpoint, planning, \
         CDI specs, lock waits)",
        Family::new_with_constructor(|| Histogram::new(FINE_BUCKETS));
    claim_read_duration: Histogram =
        "claim_read_duration_seconds",
        "Duration of the claim GET a prepare makes (the API server's part of a prepare, inside \
         call_outside_nvml_duration_seconds)",
        Histogram::new(FINE_BUCKETS);
    nvml_call_duration: Family<Words<1>, Histogram> =
        "nvml_call_duration_seconds",
        "Wall time of one NVML backend call made for a kubelet call, by backend function",
        Family::new_with_constructor(|| Histogram::new(NVML_BUCKETS));
    nvml_calls_overdue: Family<Words<1>, Counter> =
        "nvml_calls_overdue",
        "NVML calls that did not return within the call timeout (their GPU, or the node for a \
         node-wide call, is unhealthy until they do), by backend function",
        Family::default();
    nvml_calls_stuck: Gauge =
        "nvml_calls_stuck",
        "NVML calls past the call timeout that have not returned yet",
        Gauge::default();
    recoveries: Family<Words<1>, Counter> =
        "recoveries", "Repairs of interrupted operations at start", Family::default();
    repair_attempts: Family<Words<1>, Counter> =
        "repair_attempts",
        "Attempts to repair a checkpoint record recovery left unrepaired (at start and in the background), by outcome",
        Family::default();
    pending_repairs: Gauge =
        "pending_repairs",
        "Checkpoint records recovery could not repair yet (their GPUs are reported unhealthy)",
        Gauge::default();
    stale_claims_released: Family<Words<1>, Counter> =
        "stale_claims_released",
        "Recorded claims released because their ResourceClaim is gone, replaced or no longer allocated here, by cause",
        Family::default();
    claim_status_writes: Family<Words<2>, Counter> =
        "claim_status_writes",
        "Writes of this driver's ResourceClaim status.devices entries (operation ready or clear), by outcome (written, failed, dropped, deferred)",
        Family::default();
    claim_status_pending: Gauge =
        "claim_status_pending",
        "ResourceClaim status writes that failed (or were deferred after a failure) and wait for the periodic retry; writes queued for the background writer are not counted",
        Gauge::default();
    state_write_failures: Family<Words<1>, Counter> =
        "state_write_failures",
        "Writes of a state file that failed (file: checkpoint or lost_gpu_orphans); the claim \
         whose progress it recorded failed with the error",
        Family::default();
    lost_record_instances: Family<Words<1>, Counter> =
        "lost_record_instances",
        "MIG instances judged at start because the checkpoint was unreadable, by verdict: kept \
         (a claim allocated here still owns it), destroyed (migdra's, no claim owns it), \
         foreign (no sign of migdra, untouched), undecided (the claim could not be read; \
         untouched), failed (the verdict could not be carried out)",
        Family::default();
    prepared_claims: Gauge = "prepared_claims", "Claims currently recorded in the checkpoint", Gauge::default();
    mig_instances: Family<Words<1>, Gauge> =
        "mig_instances", "MIG GPU instances on the node, by creator", Family::default();
    gpus: Family<Words<1>, Gauge> = "gpus", "GPUs on the node, by health", Family::default();
    gpu_healthy: GaugeSet =
        "gpu_healthy", "1 while the GPU passes its health probe and has no repair pending, else 0",
        GaugeSet::default();
    gpu_mig_mode: GaugeSet =
        "gpu_mig_mode", "1 while MIG mode is enabled on the GPU, 0 while disabled (MIG-capable GPUs only)",
        GaugeSet::default();
    gpu_memory_slices: GaugeSet =
        "gpu_memory_slices", "Memory slices of a MIG-enabled GPU, by state (used by any instance, or free)",
        GaugeSet::default();
    gpu_mig_instances: GaugeSet =
        "gpu_mig_instances", "MIG GPU instances on the GPU, by profile and creator", GaugeSet::default();
    /// `gpu_uuid` and `gi` are what DCGM exporter's `UUID` and `GPU_I_ID` carry; `pod` lists
    /// the pods the claim is reserved for (empty when the plugin has not read the claim since
    /// it started).
    mig_instance_info: GaugeSet =
        "mig_instance_info",
        "One series (value 1) per MIG instance migdra created, naming its GPU, GPU and \
         compute instance IDs, MIG UUID, profile, placement start and claim; join on \
         gpu_uuid/gi with DCGM exporter's UUID/GPU_I_ID",
        GaugeSet::default();
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

    /// Counts one claim's outcome.
    pub fn claim(&self, operation: &'static str, ok: bool) {
        let result = if ok { "success" } else { "error" };
        self.claims
            .get_or_create(&[("operation", operation), ("result", result)])
            .inc();
    }

    /// Counts one claim's failure by its cause (`ClaimFailure::reason`, a bounded set).
    pub fn claim_failure(&self, operation: &'static str, reason: &'static str) {
        self.claim_failures
            .get_or_create(&[("operation", operation), ("reason", reason)])
            .inc();
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
        let calls = nvml.calls();
        let inside: Duration = calls.iter().map(|c| c.duration).sum();
        let outside = duration.saturating_sub(inside);
        let labels = [("operation", operation)];
        for (family, value) in [
            (&self.call_duration, duration),
            (&self.call_nvml_duration, inside),
            (&self.call_outside_nvml_duration, outside),
            (&self.call_own_duration, outside.saturating_sub(api_wait)),
        ] {
            family.get_or_create(&labels).observe(value.as_secs_f64());
        }
        for call in calls {
            self.nvml_call_duration
                .get_or_create(&[("function", call.function)])
                .observe(call.duration.as_secs_f64());
        }
    }

    /// Observes one claim GET of a prepare (answered or not).
    pub fn claim_get(&self, duration: Duration) {
        self.claim_read_duration.observe(duration.as_secs_f64());
    }

    /// Counts one startup repair.
    pub fn recovery(&self, action: &'static str) {
        self.recoveries.get_or_create(&[("action", action)]).inc();
    }

    /// Counts one repair attempt of a record (`outcome`: `repaired` or `failed`).
    pub fn repair_attempt(&self, repaired: bool) {
        let outcome = if repaired { "repaired" } else { "failed" };
        self.repair_attempts.get_or_create(&[("outcome", outcome)]).inc();
    }

    /// Sets how many records wait for repair.
    pub fn pending_repairs(&self, n: usize) {
        self.pending_repairs.set(count(n));
    }

    /// Counts an NVML call that ran past the call timeout; `stuck` are those not returned yet.
    pub fn nvml_call_overdue(&self, function: &'static str, stuck: usize) {
        self.nvml_calls_overdue
            .get_or_create(&[("function", function)])
            .inc();
        self.nvml_call_stuck(stuck);
    }

    /// Sets how many overdue NVML calls have not returned yet.
    pub fn nvml_call_stuck(&self, stuck: usize) {
        self.nvml_calls_stuck.set(count(stuck));
    }

    /// Counts one failed write of a state file (`file`: `checkpoint` or `lost_gpu_orphans`).
    pub fn state_write_failed(&self, file: &'static str) {
        self.state_write_failures.get_or_create(&[("file", file)]).inc();
    }

    /// Counts one instance judged after the checkpoint was lost (`verdict`: see the help).
    pub fn lost_record_instance(&self, verdict: &'static str) {
        self.lost_record_instances
            .get_or_create(&[("verdict", verdict)])
            .inc();
    }

    /// Counts one stale claim released (`reason`: a [`crate::driver::StaleCause::reason`]).
    pub fn stale_claim_released(&self, reason: &'static str) {
        self.stale_claims_released
            .get_or_create(&[("reason", reason)])
            .inc();
    }

    /// Counts one claim status write (`operation`: `ready` or `clear`; `outcome`: `written`,
    /// `failed` (retried later), `dropped` (not retried: the claim is gone, replaced, or the
    /// API server refused the content) or `deferred` (queued, not tried, after another write
    /// failed; retried later)).
    pub fn claim_status_write(&self, operation: &'static str, outcome: &'static str) {
        self.claim_status_writes
            .get_or_create(&[("operation", operation), ("outcome", outcome)])
            .inc();
    }

    /// Sets how many claim status writes wait for a retry.
    pub fn claim_status_pending(&self, n: usize) {
        self.claim_status_pending.set(count(n));
    }

    /// Remembers the pods `claim` (UID `uid`) is reserved for (`status.reservedFor` entries of
    /// kind Pod), for its instances' info series. The entry outlives [`Self::observe_claims`]
    /// passes without a record for the claim until [`Self::prepare_finished`]: the GET comes
    /// before the prepare writes its record, and an inventory pass in between must not drop it.
    pub fn claim_read(&self, uid: &str, claim: &ResourceClaim) {
        let mut pods: Vec<String> = claim
            .status
            .iter()
            .flat_map(|s| s.reserved_for.iter().flatten())
            .filter(|r| r.resource == "pods" && r.api_group.as_deref().unwrap_or_default().is_empty())
            .map(|r| r.name.clone())
            .collect();
        pods.sort();
        pods.dedup();
        lock(&self.claim_pods).insert(
            uid.to_string(),
            ClaimPods {
                pods,
                preparing: true,
            },
        );
    }

    /// The prepare that read claim `uid` ended (either way): from now on its pods are kept
    /// only while a record holds the claim.
    pub fn prepare_finished(&self, uid: &str) {
        if let Some(entry) = lock(&self.claim_pods).get_mut(uid) {
            entry.preparing = false;
        }
    }

    /// Updates the per-instance info series from the checkpoint's records: one series per MIG
    /// instance a record says exists (created, IDs recorded), none for claims that are gone.
    /// Called after every kubelet call and with every inventory.
    pub fn observe_claims(&self, records: &BTreeMap<String, ClaimRecord>) {
        let gpu_index = lock(&self.gpu_index).clone();
        let mut pods = lock(&self.claim_pods);
        pods.retain(|uid, entry| entry.preparing || records.contains_key(uid));
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
                let index = gpu_index.get(&device.gpu_minor).map(u32::to_string);
                let labels = vec![
                    ("gpu_uuid", device.gpu_uuid.clone()),
                    ("gpu", index.unwrap_or_default()),
                    ("gpu_minor", device.gpu_minor.to_string()),
                    ("gi", gi.to_string()),
                    ("ci", ci.to_string()),
                    ("mig_uuid", mig_uuid.clone()),
                    ("profile", profile),
                    ("placement", start.to_string()),
                    ("namespace", record.namespace.clone()),
                    ("pod", pods.get(uid).map(|p| p.pods.join(",")).unwrap_or_default()),
                    ("claim", record.name.clone()),
                ];
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
        let instances = || {
            inventory
                .iter()
                .filter_map(|g| g.mig.as_ref())
                .flat_map(|m| &m.instances)
        };
        for owner in [InstanceOwner::Migdra, InstanceOwner::Foreign] {
            let n = instances().filter(|i| i.owner == owner).count();
            self.mig_instances
                .get_or_create(&[("owner", owner_word(owner))])
                .set(count(n));
        }
        let healthy = inventory.iter().filter(|g| g.health.healthy).count();
        self.gpus
            .get_or_create(&[("health", "healthy")])
            .set(count(healthy));
        self.gpus
            .get_or_create(&[("health", "unhealthy")])
            .set(count(inventory.len() - healthy));
    }

    /// The per-GPU series of an inventory.
    fn observe_gpus(&self, inventory: &[GpuInventory]) {
        self.gpu_healthy.replace(
            inventory
                .iter()
                .map(|g| (gpu_labels(g, []), i64::from(g.health.healthy))),
        );
        let mig_gpus = || inventory.iter().filter_map(|g| g.mig.as_ref().map(|m| (g, m)));
        self.gpu_mig_mode
            .replace(mig_gpus().map(|(g, m)| (gpu_labels(g, []), i64::from(m.enabled))));
        self.gpu_memory_slices
            .replace(mig_gpus().filter(|(_, m)| m.enabled).flat_map(|(g, m)| {
                let used = m.used_memory_slices().len();
                let total = usize::try_from(m.geometry.budget.memory_slices).unwrap_or(usize::MAX);
                [
                    (gpu_labels(g, [("state", "used".into())]), count(used)),
                    (
                        gpu_labels(g, [("state", "free".into())]),
                        count(total.saturating_sub(used)),
                    ),
                ]
            }));
        let mut by_profile: BTreeMap<(u32, String, &'static str), (&GpuInventory, i64)> = BTreeMap::new();
        for (g, m) in mig_gpus() {
            for instance in &m.instances {
                let profile = instance
                    .profile
                    .map_or_else(|| "unknown".to_string(), |p| p.to_string());
                by_profile
                    .entry((g.minor, profile, owner_word(instance.owner)))
                    .or_insert((g, 0))
                    .1 += 1;
            }
        }
        self.gpu_mig_instances
            .replace(by_profile.into_iter().map(|((_, profile, owner), (g, n))| {
                (gpu_labels(g, [("profile", profile), ("owner", owner.into())]), n)
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

    fn prepared_record() -> BTreeMap<String, ClaimRecord> {
        let device = crate::checkpoint::DeviceRecord {
            request: "gpu".into(),
            pool: "node-a-gpu.migdra.dev".into(),
            device: "gpu-0-mig-1g10gb-0".into(),
            gpu_uuid: "GPU-0".into(),
            gpu_minor: 0,
            kind: DeviceKind::Mig {
                profile_id: 19,
                start: 0,
                size: 1,
                gpu_instance: Some(9),
                compute_instance: Some(0),
                mig_uuid: Some("MIG-0".into()),
            },
            env: BTreeMap::new(),
            share_id: None,
        };
        let record = ClaimRecord {
            namespace: "default".into(),
            name: "train".into(),
            state: crate::checkpoint::ClaimState::PrepareCompleted,
            devices: vec![device],
        };
        BTreeMap::from([("uid-1".to_string(), record)])
    }

    fn reserved_for(pod: &str) -> ResourceClaim {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "train", "namespace": "default", "uid": "uid-1"},
            "spec": {},
            "status": {"reservedFor": [{"resource": "pods", "name": pod, "uid": "pod-uid"}]},
        }))
        .unwrap()
    }

    fn info_pods(metrics: &Metrics) -> Vec<String> {
        metrics
            .encode()
            .lines()
            .filter(|l| l.starts_with("migdra_kubelet_plugin_mig_instance_info{"))
            .filter_map(|l| l.split("pod=\"").nth(1)?.split('"').next().map(str::to_string))
            .collect()
    }

    #[test]
    fn an_inventory_pass_between_the_claim_read_and_its_record_keeps_the_pod() {
        let metrics = Metrics::new();
        metrics.claim_read("uid-1", &reserved_for("trainer-0"));
        // An inventory pass while the prepare has not written its record yet.
        metrics.observe_claims(&BTreeMap::new());
        metrics.observe_claims(&prepared_record());
        metrics.prepare_finished("uid-1");
        assert_eq!(info_pods(&metrics), vec!["trainer-0"]);
    }

    #[test]
    fn a_finished_prepare_without_a_record_forgets_the_pods() {
        let metrics = Metrics::new();
        metrics.claim_read("uid-1", &reserved_for("trainer-0"));
        metrics.prepare_finished("uid-1");
        metrics.observe_claims(&BTreeMap::new());
        // A record appearing later (another plugin instance's) has no pods read by this one.
        metrics.observe_claims(&prepared_record());
        assert_eq!(info_pods(&metrics), vec![""]);
    }

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
