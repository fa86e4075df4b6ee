//! What every reconciliation shares: the API handles, the caches fed by the watches, and
//! the parts with one concern each: the write [`Expectations`], the [`SliceIndex`], the
//! [`StatusLedger`] and [`StatusDeferral`], the reconciliations' [`Memos`] and [`Backoff`],
//! the [`HeartbeatTracker`] (which plugins are live), the event recorder and the metrics.

use std::{sync::Arc, time::Duration};

use k8s_openapi::api::{
    coordination::v1::Lease,
    core::v1::Node,
    resource::v1::{ResourceClaim, ResourceSlice},
};
use kube::{
    Api, Client,
    core::PartialObjectMeta,
    runtime::{
        events::{Recorder, Reporter},
        reflector::Store,
        watcher,
    },
};
use migdra_api::{inventory::GpuNode, policy::MigPolicy};

use crate::{
    backoff::Backoff,
    compare::SliceMeta,
    error::Error,
    expectations::Expectations,
    geometry_cache::GeometryCache,
    liveness::HeartbeatTracker,
    metrics::Metrics,
    publish::Publisher,
    reconcile::memo::Memos,
    slice_index::SliceIndex,
    status::{FIELD_MANAGER, StatusLedger},
    status_deferral::StatusDeferral,
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
    /// Namespace of the plugins' heartbeat Leases (the controller's own).
    pub heartbeat_namespace: String,
    /// How long one heartbeat census (a pass over every GpuNode) is reused by the
    /// reconciliations that follow it.
    pub census_ttl: Duration,
    /// Most nodes reconciled at once (0: unbounded).
    pub concurrency: u16,
    /// Heartbeat expiry alone withdraws at most one pool per this interval (see
    /// [`HeartbeatTracker::allow_expiry_withdrawal`]); zero: no limit.
    pub expiry_withdrawal_interval: Duration,
    /// Longest a node's `Published=True` status write waits for other reconciliations' slice
    /// writes (see [`crate::status_deferral`]); zero: never waits.
    pub status_defer_max: Duration,
    /// How long after the last slice write ended statuses still wait (within
    /// `status_defer_max`), so the slices' watch events reach the scheduler before a burst of
    /// large GpuNode status events; zero: only while slices are being written.
    pub status_defer_quiet: Duration,
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
    /// The metadata of this driver's ResourceSlices (see [`crate::compare`]).
    pub slices: Store<SliceMeta>,
    /// Every ResourceClaim, cut down to this driver's allocation results.
    pub claims: Store<ResourceClaim>,
    /// The plugins' heartbeat Leases of this driver.
    pub leases: Store<Lease>,
}

/// Shared state of the reconcilers.
pub struct Context {
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
    /// ResourceSlice metadata cache (this driver's only).
    pub slices: Store<SliceMeta>,
    /// ResourceClaim cache (this driver's allocation results only).
    pub claims: Store<ResourceClaim>,
    /// The slice cache by node.
    pub slice_index: SliceIndex,
    /// What the slice cache should show after our writes.
    pub expectations: Expectations,
    /// The last status written to each GpuNode (see [`StatusLedger`]).
    pub status_ledger: StatusLedger,
    /// Which reconciliations write slices, and whose status writes wait for them.
    pub status_deferral: StatusDeferral,
    /// Per node, what the last reconciliation that found the pool up to date saw.
    pub memos: Memos,
    /// Per node, the retry delay after failures.
    pub backoff: Backoff,
    /// The MIG geometries moved out of the cached GpuNodes.
    pub geometries: Arc<GeometryCache>,
    /// Kubernetes events.
    pub recorder: Recorder,
    pub metrics: Metrics,
    /// Which plugins are live: the Lease cache and the heartbeat state.
    pub heartbeats: HeartbeatTracker,
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
            heartbeats: HeartbeatTracker::new(
                client.clone(),
                &config,
                stores.gpunodes.clone(),
                stores.leases,
                metrics.clone(),
            ),
            recorder: Recorder::new(client, reporter),
            gpunodes: stores.gpunodes,
            nodes: stores.nodes,
            policies: stores.policies,
            slices: stores.slices.clone(),
            claims: stores.claims,
            slice_index: SliceIndex::new(stores.slices),
            expectations: Expectations::default(),
            status_ledger: StatusLedger::default(),
            status_deferral: StatusDeferral::new(config.status_defer_max, config.status_defer_quiet),
            memos: Memos::default(),
            backoff: Backoff::default(),
            geometries: Arc::new(GeometryCache::default()),
            metrics,
            config,
        }
    }

    /// Feeds one event of the slice watch (after the cache applied it) to the slice index and
    /// the expectations; returns how many owned slices it showed wiped by someone else.
    pub fn observe_slice_event(&self, event: &watcher::Event<SliceMeta>) -> usize {
        self.slice_index.observe(event);
        self.expectations.observe(event)
    }

    /// Writes `node`'s slices, recording the writes in the expectations and the metrics.
    pub fn publisher<'a>(&'a self, node: &'a str) -> Publisher<'a> {
        Publisher {
            api: &self.slice_api,
            expectations: &self.expectations,
            metrics: &self.metrics,
            node,
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
        // Without the Leases every plugin looks silent.
        wait_for("Lease", timeout, self.heartbeats.wait_ready()).await?;
        Ok(())
    }

    /// The devices of `node`'s pool that claims hold.
    pub fn allocated_devices(&self, node: &str) -> std::collections::BTreeSet<String> {
        crate::claims::allocated_on(&self.claims.state(), &self.config.driver, node)
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
