//! Prometheus metrics of the kubelet plugin (prefix `migdra_kubelet_plugin_`): claim outcomes
//! and failure causes, call durations, startup repairs, repairs left pending and their retries, stale claims released,
//! claim status writes (and those waiting for a retry), and gauges from the inventory.

use std::{sync::Arc, time::Duration};

use migdra_api::inventory::{GpuInventory, InstanceOwner};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
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

/// The plugin's metrics. Cheap to clone.
#[derive(Clone)]
pub struct Metrics {
    claims: Family<ClaimLabels, Counter>,
    claim_failures: Family<FailureLabels, Counter>,
    call_duration: Family<OperationLabels, Histogram>,
    recoveries: Family<ActionLabels, Counter>,
    repair_attempts: Family<OutcomeLabels, Counter>,
    pending_repairs: Gauge,
    stale_claims_released: Family<ReasonLabels, Counter>,
    claim_status_writes: Family<StatusWriteLabels, Counter>,
    claim_status_pending: Gauge,
    prepared_claims: Gauge,
    mig_instances: Family<OwnerLabels, Gauge>,
    gpus: Family<HealthLabels, Gauge>,
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
        let mut registry = Registry::with_prefix("migdra_kubelet_plugin");
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
            "ResourceClaim status writes that failed and wait for the periodic retry",
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
        Self {
            claims,
            claim_failures,
            call_duration,
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
    /// API server refused the content) or `deferred` (not tried, after another write of the
    /// same kubelet call failed; retried later)).
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

    /// Updates the gauges from an inventory.
    pub fn observe_inventory(&self, inventory: &[GpuInventory], prepared_claims: usize) {
        self.prepared_claims
            .set(i64::try_from(prepared_claims).unwrap_or(i64::MAX));
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
