//! Prometheus metrics of the controller (prefix `migdra_controller_`): reconciliations and
//! their duration, ResourceSlice writes by kind, and per node what is published (devices,
//! slices, GPUs) and whether its plugin is live; the count of published pools; status writes
//! deferred while other pools were being written. The `node` label is bounded by the cluster's GPU nodes, and a node's series go with its GpuNode.

use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex, atomic::AtomicU64},
    time::{Duration, Instant},
};

use prometheus_client::{
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

/// One `name="value"` label.
type Label = [(&'static str, &'static str); 1];
type NodeLabel = [(&'static str, String); 1];
type FloatGauge = Gauge<f64, AtomicU64>;

fn node_label(node: &str) -> NodeLabel {
    [("node", node.to_string())]
}

/// Declares [`Metrics`]: each metric's field, type, initial value, name and help, registered
/// in this order.
macro_rules! metrics {
    ($($field:ident: $ty:ty = $init:expr, $name:literal, $help:expr;)*) => {
        /// The controller's metrics. Cheap to clone.
        #[derive(Clone)]
        pub struct Metrics {
            $($field: $ty,)*
            /// The nodes with a published pool (devices > 0): a set, so an update costs a
            /// lookup, not a walk over every node.
            published_nodes: Arc<Mutex<BTreeSet<String>>>,
            registry: Arc<Registry>,
        }

        impl Metrics {
            pub fn new() -> Self {
                let mut registry = Registry::with_prefix("migdra_controller");
                $(
                    let $field: $ty = $init;
                    registry.register($name, $help, $field.clone());
                )*
                Self {
                    $($field,)*
                    published_nodes: Arc::default(),
                    registry: Arc::new(registry),
                }
            }
        }
    };
}

metrics! {
    reconciles: Family<Label, Counter> = Family::default(),
        "reconciles", "GpuNode reconciliations, by result";
    reconcile_errors: Family<Label, Counter> = Family::default(),
        "reconcile_errors", "Failed GpuNode reconciliations, by reason";
    slice_writes: Family<Label, Counter> = Family::default(),
        "slice_writes", "ResourceSlice writes, by operation (create, update, delete)";
    published_devices: Family<NodeLabel, Gauge> = Family::default(),
        "published_devices", "Devices currently published in each node's pool";
    published_slices: Family<NodeLabel, Gauge> = Family::default(),
        "published_slices",
        "ResourceSlices currently published in each node's pool (counter-set slices included)";
    published_gpus: Family<NodeLabel, Gauge> = Family::default(),
        "published_gpus", "GPUs currently published in each node's pool";
    pools: Gauge = Gauge::default(),
        "published_pools", "Nodes whose pool is published with at least one device";
    plugin_live: Family<NodeLabel, Gauge> = Family::default(),
        "plugin_live",
        "1 while the node's kubelet plugin is registered and heartbeating (its pool may be \
         published), else 0, at the node's last reconcile";
    reconcile_duration: Histogram =
        Histogram::new([0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]),
        "reconcile_duration_seconds", "Duration of GpuNode reconciliations";
    leader: Gauge = Gauge::default(),
        "leader", "1 while this replica holds the lease and runs the controller, else 0";
    slice_wipes: Counter = Counter::default(),
        "slice_wipes",
        "Published ResourceSlices deleted by someone other than the controller (the kubelet's wipe)";
    expired_heartbeats: Gauge = Gauge::default(),
        "expired_heartbeats",
        "Registered kubelet plugins whose heartbeat has expired, at the last reconcile";
    withdrawals_held: Gauge = Gauge::default(),
        "heartbeat_withdrawals_held",
        "1 while so many heartbeats expired at once that expiry alone withdraws no pool \
         (suspected control-plane trouble), else 0";
    expiry_checks: Family<Label, Counter> = Family::default(),
        "heartbeat_expiry_checks",
        "Heartbeat expiries seen in the cache and checked with a fresh read of the Lease \
         before withdrawing a pool, by outcome (refuted: the cache lagged)";
    status_writes_deferred: Counter = Counter::default(),
        "status_writes_deferred",
        "GpuNode status writes put off while other reconciliations were writing slices \
         (one per deferral: a node put off twice counts twice)";
    slice_watch_lag: FloatGauge = FloatGauge::default(),
        "slice_watch_lag_seconds",
        "Longest delay in the last one to two minutes between a ResourceSlice write and the \
         watch event that showed it";
    expectation_ttl: FloatGauge = FloatGauge::default(),
        "expectation_ttl_seconds",
        "How long a node's pool waits for the slice watch to show the controller's own writes \
         before trusting the cache anyway (follows the watch lag)";
    heartbeat_allowance: FloatGauge = FloatGauge::default(),
        "heartbeat_allowance_seconds",
        "How much later than its timeout a heartbeat may be before its expiry withdraws a \
         pool: the 99th percentile of how much later than the renewal before it each Lease \
         renewal reached the controller in the last one to two minutes (a fraction of a second \
         on a healthy control plane)";
    expiries_excused: Counter = Counter::default(),
        "heartbeat_expiries_excused",
        "Heartbeat expiries that withdrew no pool because the beat was no later than renewals \
         arrive right now (heartbeat_allowance_seconds)";
    expiries_unwitnessed: Counter = Counter::default(),
        "heartbeat_expiries_unwitnessed",
        "Heartbeat expiries that withdrew no pool because the node's kubelet Lease was not \
         observed renewing since the plugin's renewal fell due either (the controller could \
         not see the node); one per look at the node";
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Starts timing one reconciliation; the duration is observed when the guard drops.
    pub fn reconcile_timer(&self) -> ReconcileTimer {
        ReconcileTimer(self.reconcile_duration.clone(), Instant::now())
    }

    pub fn reconcile_ok(&self) {
        self.reconciles.get_or_create(&[("result", "success")]).inc();
    }

    pub fn reconcile_failed(&self, reason: &'static str) {
        self.reconciles.get_or_create(&[("result", "error")]).inc();
        self.reconcile_errors.get_or_create(&[("reason", reason)]).inc();
    }

    /// Counts one slice write: `operation` is `create`, `update` or `delete`.
    pub fn slice_write(&self, operation: &'static str) {
        self.slice_writes.get_or_create(&[("operation", operation)]).inc();
    }

    /// Sets the number of devices published for `node`. Zero means the pool is withdrawn:
    /// its slice and GPU counts go to zero too.
    pub fn set_published_devices(&self, node: &str, devices: u32) {
        let labels = node_label(node);
        self.published_devices
            .get_or_create(&labels)
            .set(i64::from(devices));
        if devices == 0 {
            self.published_slices.get_or_create(&labels).set(0);
            self.published_gpus.get_or_create(&labels).set(0);
        }
        let mut published = crate::lock(&self.published_nodes);
        if devices == 0 {
            published.remove(node);
        } else if !published.contains(node) {
            published.insert(node.to_string());
        }
        self.pools.set(count(published.len()));
    }

    pub fn set_published_pool(&self, node: &str, slices: usize, gpus: u32) {
        let labels = node_label(node);
        self.published_slices.get_or_create(&labels).set(count(slices));
        self.published_gpus.get_or_create(&labels).set(i64::from(gpus));
    }

    pub fn set_plugin_live(&self, node: &str, live: bool) {
        self.plugin_live
            .get_or_create(&node_label(node))
            .set(i64::from(live));
    }

    /// Forgets `node` (its GpuNode or Node is gone).
    pub fn forget_node(&self, node: &str) {
        let labels = node_label(node);
        for family in [
            &self.published_devices,
            &self.published_slices,
            &self.published_gpus,
            &self.plugin_live,
        ] {
            family.remove(&labels);
        }
        let mut published = crate::lock(&self.published_nodes);
        published.remove(node);
        self.pools.set(count(published.len()));
    }

    /// Counts owned slices found deleted by someone else.
    pub fn slices_wiped(&self, wiped: usize) {
        self.slice_wipes.inc_by(u64::try_from(wiped).unwrap_or(u64::MAX));
    }

    /// Records the slice watch's recent lag and the expectation TTL it gives.
    pub fn set_slice_watch_lag(&self, lag: Duration, ttl: Duration) {
        self.slice_watch_lag.set(lag.as_secs_f64());
        self.expectation_ttl.set(ttl.as_secs_f64());
    }

    pub fn set_heartbeat_allowance(&self, allowance: Duration) {
        self.heartbeat_allowance.set(allowance.as_secs_f64());
    }

    pub fn heartbeat_expiry_excused(&self) {
        self.expiries_excused.inc();
    }

    pub fn heartbeat_expiry_unwitnessed(&self) {
        self.expiries_unwitnessed.inc();
    }

    /// Records the heartbeat census: expired heartbeats, and whether withdrawals are held.
    pub fn set_heartbeat_census(&self, expired: usize, held: bool) {
        self.expired_heartbeats.set(count(expired));
        self.withdrawals_held.set(i64::from(held));
    }

    /// Counts one fresh-read check of a heartbeat expiry: `outcome` is `confirmed` (the
    /// server has the same stale heartbeat, or a plugin gone otherwise), `refuted` (the cache
    /// lagged) or `failed` (the read failed; the pool was kept).
    pub fn heartbeat_expiry_checked(&self, outcome: &'static str) {
        self.expiry_checks.get_or_create(&[("outcome", outcome)]).inc();
    }

    pub fn status_write_deferred(&self) {
        self.status_writes_deferred.inc();
    }

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

fn count(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Observes a reconciliation's duration on drop.
pub struct ReconcileTimer(Histogram, Instant);

impl Drop for ReconcileTimer {
    fn drop(&mut self) {
        self.0.observe(self.1.elapsed().as_secs_f64());
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
        m.slice_write("create");
        m.slice_write("delete");
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
        m.heartbeat_expiry_unwitnessed();
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
            "migdra_controller_heartbeat_expiries_unwitnessed_total 1",
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
