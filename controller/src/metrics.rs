//! Prometheus metrics of the controller (prefix `migdra_controller_`): reconciliations and
//! their duration, ResourceSlice writes by kind, and per node what is published (devices,
//! slices, GPUs) and whether its plugin is live; the count of published pools; status writes
//! deferred while other pools were being written. The `node`
//! label is bounded by the cluster's GPU nodes, and a node's series go with its GpuNode.

use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex, PoisonError, atomic::AtomicU64},
    time::{Duration, Instant},
};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OperationLabels {
    operation: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

/// How a fresh read answered a heartbeat expiry seen in the cache, as counted in
/// `heartbeat_expiry_checks_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpiryCheck {
    /// The API server has the same stale heartbeat (or a plugin that is gone otherwise).
    Confirmed,
    /// The API server has a newer heartbeat: the cache lagged.
    Refuted,
    /// The reads failed or timed out; the pool was kept.
    Failed,
}

impl ExpiryCheck {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Confirmed => "confirmed",
            Self::Refuted => "refuted",
            Self::Failed => "failed",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeLabels {
    node: String,
}

/// A write to a ResourceSlice, as counted in `slice_writes_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SliceOperation {
    /// A new slice.
    Create,
    /// A replaced slice.
    Update,
    /// A deleted slice.
    Delete,
}

impl SliceOperation {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Create => "create",
            Self::Update => "update",
            Self::Delete => "delete",
        }
    }
}

/// The controller's metrics. Cheap to clone.
#[derive(Clone)]
pub struct Metrics {
    reconciles: Family<ResultLabels, Counter>,
    reconcile_errors: Family<ReasonLabels, Counter>,
    slice_writes: Family<OperationLabels, Counter>,
    published_devices: Family<NodeLabels, Gauge>,
    published_slices: Family<NodeLabels, Gauge>,
    published_gpus: Family<NodeLabels, Gauge>,
    pools: Gauge,
    plugin_live: Family<NodeLabels, Gauge>,
    /// The nodes with a published pool (devices > 0), to count them: a set, so an update
    /// costs a lookup, not a walk over every node.
    published_nodes: Arc<Mutex<BTreeSet<String>>>,
    reconcile_duration: Histogram,
    leader: Gauge,
    slice_wipes: Counter,
    expired_heartbeats: Gauge,
    withdrawals_held: Gauge,
    expiry_checks: Family<OutcomeLabels, Counter>,
    status_writes_deferred: Counter,
    slice_watch_lag: Gauge<f64, AtomicU64>,
    heartbeat_allowance: Gauge<f64, AtomicU64>,
    expiries_excused: Counter,
    expectation_ttl: Gauge<f64, AtomicU64>,
    registry: Arc<Registry>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates the metrics and their registry.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("migdra_controller");
        let reconciles = Family::<ResultLabels, Counter>::default();
        registry.register(
            "reconciles",
            "GpuNode reconciliations, by result",
            reconciles.clone(),
        );
        let reconcile_errors = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "reconcile_errors",
            "Failed GpuNode reconciliations, by reason",
            reconcile_errors.clone(),
        );
        let slice_writes = Family::<OperationLabels, Counter>::default();
        registry.register(
            "slice_writes",
            "ResourceSlice writes, by operation (create, update, delete)",
            slice_writes.clone(),
        );
        let published_devices = Family::<NodeLabels, Gauge>::default();
        registry.register(
            "published_devices",
            "Devices currently published in each node's pool",
            published_devices.clone(),
        );
        let published_slices = Family::<NodeLabels, Gauge>::default();
        registry.register(
            "published_slices",
            "ResourceSlices currently published in each node's pool (counter-set slices included)",
            published_slices.clone(),
        );
        let published_gpus = Family::<NodeLabels, Gauge>::default();
        registry.register(
            "published_gpus",
            "GPUs currently published in each node's pool",
            published_gpus.clone(),
        );
        let pools = Gauge::default();
        registry.register(
            "published_pools",
            "Nodes whose pool is published with at least one device",
            pools.clone(),
        );
        let plugin_live = Family::<NodeLabels, Gauge>::default();
        registry.register(
            "plugin_live",
            "1 while the node's kubelet plugin is registered and heartbeating (its pool may be \
             published), else 0, at the node's last reconcile",
            plugin_live.clone(),
        );
        let reconcile_duration = Histogram::new([
            0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
        ]);
        registry.register(
            "reconcile_duration_seconds",
            "Duration of GpuNode reconciliations",
            reconcile_duration.clone(),
        );
        let leader = Gauge::default();
        registry.register(
            "leader",
            "1 while this replica holds the lease and runs the controller, else 0",
            leader.clone(),
        );
        let slice_wipes = Counter::default();
        registry.register(
            "slice_wipes",
            "Published ResourceSlices deleted by someone other than the controller (the kubelet's wipe)",
            slice_wipes.clone(),
        );
        let expired_heartbeats = Gauge::default();
        registry.register(
            "expired_heartbeats",
            "Registered kubelet plugins whose heartbeat has expired, at the last reconcile",
            expired_heartbeats.clone(),
        );
        let withdrawals_held = Gauge::default();
        registry.register(
            "heartbeat_withdrawals_held",
            "1 while so many heartbeats expired at once that expiry alone withdraws no pool \
             (suspected control-plane trouble), else 0",
            withdrawals_held.clone(),
        );
        let expiry_checks = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "heartbeat_expiry_checks",
            "Heartbeat expiries seen in the cache and checked with a fresh read of the Lease \
             before withdrawing a pool, by outcome (refuted: the cache lagged)",
            expiry_checks.clone(),
        );
        let status_writes_deferred = Counter::default();
        registry.register(
            "status_writes_deferred",
            "GpuNode status writes put off while other reconciliations were writing slices \
             (one per deferral: a node put off twice counts twice)",
            status_writes_deferred.clone(),
        );
        let slice_watch_lag = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "slice_watch_lag_seconds",
            "Longest delay in the last one to two minutes between a ResourceSlice write and the \
             watch event that showed it",
            slice_watch_lag.clone(),
        );
        let expectation_ttl = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "expectation_ttl_seconds",
            "How long a node's pool waits for the slice watch to show the controller's own writes \
             before trusting the cache anyway (follows the watch lag)",
            expectation_ttl.clone(),
        );
        let heartbeat_allowance = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "heartbeat_allowance_seconds",
            "How much later than its timeout a heartbeat may be before its expiry withdraws a \
             pool: the 99th percentile of how late Lease renewals arrived in the last one to two \
             minutes (0 on a healthy control plane)",
            heartbeat_allowance.clone(),
        );
        let expiries_excused = Counter::default();
        registry.register(
            "heartbeat_expiries_excused",
            "Heartbeat expiries that withdrew no pool because the beat was no later than renewals \
             arrive right now (heartbeat_allowance_seconds)",
            expiries_excused.clone(),
        );
        Self {
            heartbeat_allowance,
            expiries_excused,
            slice_watch_lag,
            expectation_ttl,
            expiry_checks,
            status_writes_deferred,
            slice_wipes,
            expired_heartbeats,
            withdrawals_held,
            reconciles,
            reconcile_errors,
            slice_writes,
            published_devices,
            published_slices,
            published_gpus,
            pools,
            plugin_live,
            published_nodes: Arc::default(),
            reconcile_duration,
            leader,
            registry: Arc::new(registry),
        }
    }

    /// Starts timing one reconciliation; the duration is observed when the guard drops.
    pub fn reconcile_timer(&self) -> ReconcileTimer {
        ReconcileTimer {
            histogram: self.reconcile_duration.clone(),
            start: Instant::now(),
        }
    }

    /// Counts a successful reconciliation.
    pub fn reconcile_ok(&self) {
        self.reconciles
            .get_or_create(&ResultLabels { result: "success" })
            .inc();
    }

    /// Counts a failed reconciliation with its reason.
    pub fn reconcile_failed(&self, reason: &'static str) {
        self.reconciles
            .get_or_create(&ResultLabels { result: "error" })
            .inc();
        self.reconcile_errors
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// Counts one slice write.
    pub fn slice_write(&self, operation: SliceOperation) {
        self.slice_writes
            .get_or_create(&OperationLabels {
                operation: operation.as_str(),
            })
            .inc();
    }

    /// Sets the number of devices published for `node`. Zero means the pool is withdrawn:
    /// its slice and GPU counts go to zero too.
    pub fn set_published_devices(&self, node: &str, devices: u32) {
        let labels = NodeLabels {
            node: node.to_string(),
        };
        self.published_devices
            .get_or_create(&labels)
            .set(i64::from(devices));
        if devices == 0 {
            self.published_slices.get_or_create(&labels).set(0);
            self.published_gpus.get_or_create(&labels).set(0);
        }
        let mut published = self
            .published_nodes
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if devices > 0 {
            if !published.contains(node) {
                published.insert(node.to_string());
            }
        } else {
            published.remove(node);
        }
        self.set_pool_count(&published);
    }

    /// Sets the slices and GPUs published in `node`'s pool.
    pub fn set_published_pool(&self, node: &str, slices: usize, gpus: u32) {
        let labels = NodeLabels {
            node: node.to_string(),
        };
        self.published_slices
            .get_or_create(&labels)
            .set(i64::try_from(slices).unwrap_or(i64::MAX));
        self.published_gpus.get_or_create(&labels).set(i64::from(gpus));
    }

    /// Records whether `node`'s plugin is live.
    pub fn set_plugin_live(&self, node: &str, live: bool) {
        self.plugin_live
            .get_or_create(&NodeLabels {
                node: node.to_string(),
            })
            .set(i64::from(live));
    }

    fn set_pool_count(&self, published: &BTreeSet<String>) {
        self.pools.set(i64::try_from(published.len()).unwrap_or(i64::MAX));
    }

    /// Forgets `node` (its GpuNode or Node is gone).
    pub fn forget_node(&self, node: &str) {
        let labels = NodeLabels {
            node: node.to_string(),
        };
        self.published_devices.remove(&labels);
        self.published_slices.remove(&labels);
        self.published_gpus.remove(&labels);
        self.plugin_live.remove(&labels);
        let mut published = self
            .published_nodes
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        published.remove(node);
        self.set_pool_count(&published);
    }

    /// Counts owned slices found deleted by someone else.
    pub fn slices_wiped(&self, count: usize) {
        self.slice_wipes.inc_by(u64::try_from(count).unwrap_or(u64::MAX));
    }

    /// Records the slice watch's recent lag and the expectation TTL it gives.
    pub fn set_slice_watch_lag(&self, lag: Duration, ttl: Duration) {
        self.slice_watch_lag.set(lag.as_secs_f64());
        self.expectation_ttl.set(ttl.as_secs_f64());
    }

    /// Records the heartbeat allowance a slow control plane gives.
    pub fn set_heartbeat_allowance(&self, allowance: Duration) {
        self.heartbeat_allowance.set(allowance.as_secs_f64());
    }

    /// Counts a heartbeat expiry excused by the allowance.
    pub fn heartbeat_expiry_excused(&self) {
        self.expiries_excused.inc();
    }

    /// Records the heartbeat census: expired heartbeats, and whether withdrawals are held.
    pub fn set_heartbeat_census(&self, expired: usize, held: bool) {
        self.expired_heartbeats
            .set(i64::try_from(expired).unwrap_or(i64::MAX));
        self.withdrawals_held.set(i64::from(held));
    }

    /// Counts one fresh-read check of a heartbeat expiry.
    pub fn heartbeat_expiry_checked(&self, outcome: ExpiryCheck) {
        self.expiry_checks
            .get_or_create(&OutcomeLabels {
                outcome: outcome.as_str(),
            })
            .inc();
    }

    /// Counts one deferred status write.
    pub fn status_write_deferred(&self) {
        self.status_writes_deferred.inc();
    }

    /// Sets the is-leader gauge.
    pub fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
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

/// Observes a reconciliation's duration on drop.
pub struct ReconcileTimer {
    histogram: Histogram,
    start: Instant,
}

impl ReconcileTimer {
    /// Time since the reconciliation started.
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }
}

impl Drop for ReconcileTimer {
    fn drop(&mut self) {
        self.histogram.observe(self.start.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposes_every_family_under_the_prefix() {
        let m = Metrics::new();
        m.reconcile_ok();
        m.reconcile_failed("conflict");
        m.slice_write(SliceOperation::Create);
        m.slice_write(SliceOperation::Delete);
        m.set_published_devices("node-a", 42);
        m.set_published_pool("node-a", 3, 2);
        m.set_plugin_live("node-a", true);
        m.set_published_devices("node-b", 7);
        m.set_published_pool("node-b", 2, 1);
        m.set_published_devices("node-b", 0);
        m.set_leader(true);
        m.slices_wiped(3);
        m.set_heartbeat_census(4, true);
        m.status_write_deferred();
        m.set_slice_watch_lag(Duration::from_millis(7500), Duration::from_millis(22500));
        m.set_heartbeat_allowance(Duration::from_secs(8));
        m.heartbeat_expiry_excused();
        drop(m.reconcile_timer());
        let text = m.encode();
        for needle in [
            "migdra_controller_reconciles_total{result=\"success\"} 1",
            "migdra_controller_reconciles_total{result=\"error\"} 1",
            "migdra_controller_reconcile_errors_total{reason=\"conflict\"} 1",
            "migdra_controller_slice_writes_total{operation=\"create\"} 1",
            "migdra_controller_slice_writes_total{operation=\"delete\"} 1",
            "migdra_controller_published_devices{node=\"node-a\"} 42",
            "migdra_controller_published_slices{node=\"node-a\"} 3",
            "migdra_controller_published_gpus{node=\"node-a\"} 2",
            "migdra_controller_plugin_live{node=\"node-a\"} 1",
            "migdra_controller_published_slices{node=\"node-b\"} 0",
            "migdra_controller_published_gpus{node=\"node-b\"} 0",
            "migdra_controller_published_pools 1",
            "migdra_controller_leader 1",
            "migdra_controller_slice_wipes_total 3",
            "migdra_controller_expired_heartbeats 4",
            "migdra_controller_heartbeat_withdrawals_held 1",
            "migdra_controller_status_writes_deferred_total 1",
            "migdra_controller_slice_watch_lag_seconds 7.5",
            "migdra_controller_expectation_ttl_seconds 22.5",
            "migdra_controller_heartbeat_allowance_seconds 8.0",
            "migdra_controller_heartbeat_expiries_excused_total 1",
            "migdra_controller_reconcile_duration_seconds_count 1",
        ] {
            assert!(text.contains(needle), "{needle} missing from\n{text}");
        }
        m.forget_node("node-a");
        let text = m.encode();
        assert!(!text.contains("node=\"node-a\""), "{text}");
        assert!(text.contains("migdra_controller_published_pools 0"), "{text}");
    }
}
