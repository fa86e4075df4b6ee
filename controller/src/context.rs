//! What every reconciliation shares: the API handles, the caches fed by the watches, the
//! write expectations, the event recorder and the metrics.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use k8s_openapi::api::{core::v1::Node, resource::v1::ResourceSlice};
use kube::{
    Api, Client,
    core::PartialObjectMeta,
    runtime::{
        events::{Recorder, Reporter},
        reflector::Store,
    },
};
use migdra_api::{inventory::GpuNode, policy::MigPolicy};

use crate::{error::Error, expectations::Expectations, metrics::Metrics, status::FIELD_MANAGER};

/// Settings of the reconciler.
#[derive(Clone, Debug)]
pub struct ControllerConfig {
    /// DRA driver name: the slices' `spec.driver`.
    pub driver: String,
    /// A plugin is gone when its heartbeat is older than `max(this, 3 × its interval)`.
    pub heartbeat_timeout: Duration,
    /// This replica's identity (the events' reporting instance).
    pub identity: String,
    /// How long a reconciliation waits for the caches to fill before failing.
    pub ready_timeout: Duration,
}

/// The caches the reconciler reads.
#[derive(Clone)]
pub struct Stores {
    /// Node metadata (labels, UID), by name.
    pub nodes: Store<PartialObjectMeta<Node>>,
    /// All MigPolicies.
    pub policies: Store<MigPolicy>,
    /// This driver's ResourceSlices.
    pub slices: Store<ResourceSlice>,
}

/// Shared state of the reconcilers.
pub struct Context {
    /// Settings.
    pub config: ControllerConfig,
    /// Cluster-wide ResourceSlice API.
    pub slice_api: Api<ResourceSlice>,
    /// Cluster-wide GpuNode API.
    pub gpunode_api: Api<GpuNode>,
    /// Node metadata cache.
    pub nodes: Store<PartialObjectMeta<Node>>,
    /// MigPolicy cache.
    pub policies: Store<MigPolicy>,
    /// ResourceSlice cache (this driver's only).
    pub slices: Store<ResourceSlice>,
    /// What the slice cache should show after our writes.
    pub expectations: Expectations,
    /// Kubernetes events.
    pub recorder: Recorder,
    /// Metrics.
    pub metrics: Metrics,
    failures: Mutex<HashMap<String, u32>>,
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
            nodes: stores.nodes,
            policies: stores.policies,
            slices: stores.slices,
            expectations: Expectations::default(),
            metrics,
            config,
            failures: Mutex::new(HashMap::new()),
        }
    }

    /// Waits until every cache has its initial list (a pool computed from a half-filled policy
    /// or slice cache would be wrong).
    pub async fn wait_ready(&self) -> Result<(), Error> {
        let timeout = self.config.ready_timeout;
        wait_for("Node", timeout, self.nodes.wait_until_ready()).await?;
        wait_for("MigPolicy", timeout, self.policies.wait_until_ready()).await?;
        wait_for("ResourceSlice", timeout, self.slices.wait_until_ready()).await?;
        Ok(())
    }

    /// The cached slices of this driver on `node`.
    pub fn node_slices(&self, node: &str) -> Vec<Arc<ResourceSlice>> {
        self.slices.state_filter(|s| {
            s.spec.driver == self.config.driver && s.spec.node_name.as_deref() == Some(node)
        })
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
