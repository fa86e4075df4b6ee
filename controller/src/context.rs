//! What every reconciliation shares: the API handles, the caches fed by the watches, the
//! write expectations, the event recorder and the metrics.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use k8s_openapi::{
    api::{
        core::v1::Node,
        resource::v1::{ResourceClaim, ResourceSlice},
    },
    jiff::Timestamp,
};
use kube::{
    Api, Client,
    core::PartialObjectMeta,
    runtime::{
        events::{Recorder, Reporter},
        reflector::Store,
    },
};
use migdra_api::{inventory::GpuNode, policy::MigPolicy};

use crate::{
    error::Error, expectations::Expectations, liveness::HeartbeatCensus, metrics::Metrics,
    status::FIELD_MANAGER,
};

/// Settings of the reconciler.
#[derive(Clone, Debug)]
pub struct ControllerConfig {
    /// DRA driver name: the slices' `spec.driver`.
    pub driver: String,
    /// A plugin is gone when its heartbeat is older than `max(this, 1.5 × its interval)`.
    pub heartbeat_timeout: Duration,
    /// Heartbeat expiry alone withdraws nothing while more than this fraction of registered
    /// plugins have expired heartbeats (see [`crate::liveness::HeartbeatCensus`]).
    pub mass_expiry_threshold: f64,
    /// This replica's identity (the events' reporting instance).
    pub identity: String,
    /// How long a reconciliation waits for the caches to fill before failing.
    pub ready_timeout: Duration,
}

/// The caches the reconciler reads.
#[derive(Clone)]
pub struct Stores {
    /// Every GpuNode (the controller's primary resource), for the heartbeat census.
    pub gpunodes: Store<GpuNode>,
    /// Node metadata (labels, UID), by name.
    pub nodes: Store<PartialObjectMeta<Node>>,
    /// All MigPolicies.
    pub policies: Store<MigPolicy>,
    /// This driver's ResourceSlices.
    pub slices: Store<ResourceSlice>,
    /// Every ResourceClaim, cut down to this driver's allocation results.
    pub claims: Store<ResourceClaim>,
}

/// Shared state of the reconcilers.
pub struct Context {
    /// Settings.
    pub config: ControllerConfig,
    /// Cluster-wide ResourceSlice API.
    pub slice_api: Api<ResourceSlice>,
    /// Cluster-wide GpuNode API.
    pub gpunode_api: Api<GpuNode>,
    /// GpuNode cache.
    pub gpunodes: Store<GpuNode>,
    /// Node metadata cache.
    pub nodes: Store<PartialObjectMeta<Node>>,
    /// MigPolicy cache.
    pub policies: Store<MigPolicy>,
    /// ResourceSlice cache (this driver's only).
    pub slices: Store<ResourceSlice>,
    /// ResourceClaim cache (this driver's allocation results only).
    pub claims: Store<ResourceClaim>,
    /// What the slice cache should show after our writes.
    pub expectations: Expectations,
    /// Kubernetes events.
    pub recorder: Recorder,
    /// Metrics.
    pub metrics: Metrics,
    failures: Mutex<HashMap<String, u32>>,
    holding: AtomicBool,
}

impl Context {
    /// A context over `stores`.
    pub fn new(client: Client, config: ControllerConfig, stores: Stores, metrics: Metrics) -> Self {
        let reporter = Reporter {
            controller: FIELD_MANAGER.to_string(),
            instance: Some(config.identity.clone()),
        };
        Self {
            slice_api: Api::all(client.clone()),
            gpunode_api: Api::all(client.clone()),
            recorder: Recorder::new(client, reporter),
            gpunodes: stores.gpunodes,
            nodes: stores.nodes,
            policies: stores.policies,
            slices: stores.slices,
            claims: stores.claims,
            expectations: Expectations::default(),
            metrics,
            config,
            failures: Mutex::new(HashMap::new()),
            holding: AtomicBool::new(false),
        }
    }

    /// Waits until every cache has its initial list (a pool computed from a half-filled policy
    /// or slice cache would be wrong).
    pub async fn wait_ready(&self) -> Result<(), Error> {
        let timeout = self.config.ready_timeout;
        wait_for("GpuNode", timeout, self.gpunodes.wait_until_ready()).await?;
        wait_for("Node", timeout, self.nodes.wait_until_ready()).await?;
        wait_for("MigPolicy", timeout, self.policies.wait_until_ready()).await?;
        wait_for("ResourceSlice", timeout, self.slices.wait_until_ready()).await?;
        // A pool computed without the claims could drop a device that is in use.
        wait_for("ResourceClaim", timeout, self.claims.wait_until_ready()).await?;
        Ok(())
    }

    /// The devices of `node`'s pool that claims hold.
    pub fn allocated_devices(&self, node: &str) -> std::collections::BTreeSet<String> {
        crate::claims::allocated_on(&self.claims.state(), &self.config.driver, node)
    }

    /// The cached slices of this driver on `node`.
    pub fn node_slices(&self, node: &str) -> Vec<Arc<ResourceSlice>> {
        self.slices.state_filter(|s| {
            s.spec.driver == self.config.driver && s.spec.node_name.as_deref() == Some(node)
        })
    }

    /// The heartbeats of every GpuNode of this driver at `now`; records in the metrics and
    /// the log whether heartbeat expiry is being held back.
    pub fn heartbeat_census(&self, now: Timestamp) -> (HeartbeatCensus, bool) {
        let gpunodes = self.gpunodes.state();
        let census = HeartbeatCensus::take(
            gpunodes
                .iter()
                .filter(|g| g.spec.driver == self.config.driver)
                .map(|g| g.status.as_ref().and_then(|s| s.plugin.as_ref())),
            now,
            self.config.heartbeat_timeout,
        );
        let hold = census.mass_expiry(self.config.mass_expiry_threshold);
        self.metrics.set_heartbeat_census(census.expired, hold);
        if self.holding.swap(hold, Ordering::Relaxed) != hold {
            if hold {
                tracing::warn!(
                    expired = census.expired,
                    registered = census.registered,
                    threshold = self.config.mass_expiry_threshold,
                    "too many plugin heartbeats expired at once: suspecting the control plane, \
                     withdrawing no pool on heartbeat expiry alone"
                );
            } else {
                tracing::info!(
                    expired = census.expired,
                    registered = census.registered,
                    "plugin heartbeats recovered: heartbeat expiry withdraws pools again"
                );
            }
        }
        (census, hold)
    }

    /// Counts one more consecutive failure of `node`; returns the count.
    pub fn next_attempt(&self, node: &str) -> u32 {
        let mut failures = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        let count = failures.entry(node.to_string()).or_insert(0);
        *count = count.saturating_add(1);
        *count
    }

    /// Forgets `node`'s failures after a success.
    pub fn reset_backoff(&self, node: &str) {
        self.failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(node);
    }
}

async fn wait_for<E>(
    what: &'static str,
    timeout: Duration,
    ready: impl std::future::Future<Output = Result<(), E>>,
) -> Result<(), Error> {
    match tokio::time::timeout(timeout, ready).await {
        Ok(Ok(())) => Ok(()),
        _ => Err(Error::NotReady { what }),
    }
}
