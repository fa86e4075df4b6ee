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
    /// Settings of every pool (`--keep-memory-counter`, `--default-mig-mode`).
    pub pool: crate::desired::PoolSettings,
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
    /// How long one heartbeat census (a pass over every GpuNode) is reused.
    pub census_ttl: Duration,
    /// Most nodes reconciled at once (0: unbounded).
    pub concurrency: u16,
    /// Heartbeat expiry alone withdraws at most one pool per this interval; zero: no limit.
    pub expiry_withdrawal_interval: Duration,
    /// Longest a node's `Published=True` status write waits for other reconciliations' slice
    /// writes (see [`crate::status_deferral`]); zero: never waits.
    pub status_defer_max: Duration,
    /// How long after the last slice write ended statuses still wait (within
    /// `status_defer_max`); zero: only while slices are being written.
    pub status_defer_quiet: Duration,
}

/// The caches the reconciler reads.
#[derive(Clone)]
pub struct Stores {
    pub gpunodes: Store<GpuNode>,
    /// Node metadata (labels, UID), by name.
    pub nodes: Store<PartialObjectMeta<Node>>,
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
    pub slice_api: Api<ResourceSlice>,
    pub gpunode_api: Api<GpuNode>,
    pub stores: Stores,
    pub slice_index: SliceIndex,
    /// What the slice cache should show after our writes.
    pub expectations: Expectations,
    pub status_ledger: StatusLedger,
    pub status_deferral: StatusDeferral,
    pub memos: Memos,
    pub backoff: Backoff,
    /// The MIG geometries moved out of the cached GpuNodes.
    pub geometries: Arc<GeometryCache>,
    pub recorder: Recorder,
    pub metrics: Metrics,
    /// Which plugins are live: the Lease cache and the heartbeat state.
    pub heartbeats: HeartbeatTracker,
}

impl Context {
    pub fn new(client: Client, config: ControllerConfig, stores: Stores, metrics: Metrics) -> Self {
        let reporter = Reporter {
            controller: FIELD_MANAGER.to_string(),
            instance: Some(config.identity.clone()),
        };
        Self {
            slice_api: Api::all(client.clone()),
            gpunode_api: Api::all(client.clone()),
            heartbeats: HeartbeatTracker::new(client.clone(), &config, &stores, metrics.clone()),
            recorder: Recorder::new(client, reporter),
            slice_index: SliceIndex::new(stores.slices.clone()),
            stores,
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

    /// Waits until every cache has its initial list (a pool computed from a half-filled policy
    /// or slice cache would be wrong; without the claims it could drop a device in use;
    /// without the Leases every plugin looks silent).
    pub async fn wait_ready(&self) -> Result<(), Error> {
        let s = &self.stores;
        wait_for("GpuNode", self, s.gpunodes.wait_until_ready()).await?;
        wait_for("Node", self, s.nodes.wait_until_ready()).await?;
        wait_for("MigPolicy", self, s.policies.wait_until_ready()).await?;
        wait_for("ResourceSlice", self, s.slices.wait_until_ready()).await?;
        wait_for("ResourceClaim", self, s.claims.wait_until_ready()).await?;
        wait_for("Lease", self, s.leases.wait_until_ready()).await
    }

    /// The devices of `node`'s pool that claims hold.
    pub fn allocated_devices(&self, node: &str) -> std::collections::BTreeSet<String> {
        crate::claims::allocated_on(&self.stores.claims.state(), &self.config.driver, node)
    }
}

async fn wait_for<E>(
    what: &'static str,
    ctx: &Context,
    ready: impl std::future::Future<Output = Result<(), E>>,
) -> Result<(), Error> {
    match tokio::time::timeout(ctx.config.ready_timeout, ready).await {
        Ok(Ok(())) => Ok(()),
        _ => Err(Error::NotReady { what }),
    }
}
