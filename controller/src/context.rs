//! What every reconciliation shares: the API handles, the caches fed by the watches, the
//! write expectations, which nodes are live, how many are writing slices and whose status
//! waits for that, the event recorder and the metrics.

use std::{
    collections::{HashMap, HashSet, hash_map::Entry},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::{
        coordination::v1::Lease,
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
        reflector::{ObjectRef, Store},
        watcher,
    },
};
use migdra_api::{
    inventory::{GpuNode, PluginStatus, heartbeat_lease_name},
    policy::MigPolicy,
};

use crate::{
    compare::SliceMeta,
    error::Error,
    expectations::Expectations,
    geometry_cache::GeometryCache,
    lag_windows::RecentDelays,
    liveness::{HeartbeatCensus, LeaseBeat, beat},
    metrics::Metrics,
    naming::slice_node,
    status::{FIELD_MANAGER, StatusLedger},
};

/// How long the reads that confirm a heartbeat expiry may take before the expiry counts as
/// unconfirmed (the pool is kept and the node retried with backoff).
pub const CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);

/// The most a slow control plane extends a heartbeat's timeout by (see
/// [`Context::heartbeat_allowance`]). A plugin that really died loses its slices to the
/// kubelet's wipe 30 s after its connection drops, whatever this is.
pub const MAX_HEARTBEAT_ALLOWANCE: Duration = Duration::from_secs(120);

/// How many recent renewal delays the allowance needs: fewer say nothing about the control
/// plane (and let no single node's clock decide).
pub const MIN_DELAY_SAMPLES: u64 = 20;

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
    /// [`Context::allow_expiry_withdrawal`]); zero: no limit.
    pub expiry_withdrawal_interval: Duration,
    /// Longest a node's `Published=True` status write waits for other reconciliations' slice
    /// writes (see [`Context::defer_status`]); zero: never waits.
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
    /// Settings.
    pub config: ControllerConfig,
    /// Cluster-wide ResourceSlice API.
    pub slice_api: Api<ResourceSlice>,
    /// Cluster-wide GpuNode API.
    pub gpunode_api: Api<GpuNode>,
    /// The heartbeat Leases' namespace.
    pub lease_api: Api<Lease>,
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
    /// Heartbeat Lease cache.
    pub leases: Store<Lease>,
    /// What the slice cache should show after our writes.
    pub expectations: Expectations,
    /// The last status written to each GpuNode (see [`StatusLedger`]).
    pub status_ledger: StatusLedger,
    /// The MIG geometries moved out of the cached GpuNodes.
    pub geometries: Arc<GeometryCache>,
    /// Kubernetes events.
    pub recorder: Recorder,
    /// Metrics.
    pub metrics: Metrics,
    failures: Mutex<HashMap<String, u32>>,
    holding: AtomicBool,
    census: Mutex<Option<(Instant, HeartbeatCensus, bool)>>,
    last_expiry_withdrawal: Mutex<Option<Instant>>,
    /// How late Lease renewals reached the controller recently (see
    /// [`Context::heartbeat_allowance`]).
    heartbeat_delays: Mutex<RecentDelays>,
    /// Nodes whose last reconciliation found the plugin live, with the heartbeat expiry it
    /// saw: a Lease renewal of theirs needs no reconciliation (the expiry watch re-checks
    /// them, see [`Context::take_expired`]), one of any other node does.
    live: Mutex<HashMap<String, Timestamp>>,
    /// The names of the cached slices per node, so a reconciliation looks at its node's
    /// slices only, not at every slice in the cache.
    slice_index: Mutex<SliceIndex>,
    /// Per node, what the last reconciliation that found the pool up to date saw.
    memos: Mutex<HashMap<String, crate::reconcile::Memo>>,
    /// Reconciliations writing slices right now (see [`Context::writing_slices`]).
    slice_writers: AtomicUsize,
    /// Per node, when its pending status write was first deferred.
    status_deferred: Mutex<HashMap<String, Instant>>,
    /// When the last slice write of any reconciliation ended.
    last_slice_write: Mutex<Option<Instant>>,
}

/// Counts one reconciliation as writing slices while it lives (see
/// [`Context::writing_slices`]); dropping it, on success, error or panic, ends that.
#[must_use = "the reconciliation counts as writing slices only while the guard lives"]
pub struct SliceWriting<'a>(&'a Context);

impl Drop for SliceWriting<'_> {
    fn drop(&mut self) {
        *self.0.last_slice_write.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        self.0.slice_writers.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Slice names by node, maintained from the slice watch like the cache itself (a relist
/// builds a new index, swapped in when it is complete).
#[derive(Debug, Default)]
struct SliceIndex {
    by_node: HashMap<String, HashSet<String>>,
    relisting: Option<HashMap<String, HashSet<String>>>,
}

impl SliceIndex {
    fn observe(&mut self, event: &watcher::Event<SliceMeta>) {
        let entry = |index: &mut HashMap<String, HashSet<String>>, slice: &SliceMeta| {
            if let (Some(node), Some(name)) = (slice_node(slice), slice.metadata.name.as_ref()) {
                index.entry(node.to_string()).or_default().insert(name.clone());
            }
        };
        match event {
            watcher::Event::Apply(slice) => entry(&mut self.by_node, slice),
            watcher::Event::Delete(slice) => {
                if let (Some(node), Some(name)) = (slice_node(slice), slice.metadata.name.as_ref())
                    && let Some(names) = self.by_node.get_mut(node)
                {
                    names.remove(name);
                    if names.is_empty() {
                        self.by_node.remove(node);
                    }
                }
            }
            watcher::Event::Init => self.relisting = Some(HashMap::new()),
            watcher::Event::InitApply(slice) => {
                if let Some(index) = &mut self.relisting {
                    entry(index, slice);
                }
            }
            watcher::Event::InitDone => {
                if let Some(index) = self.relisting.take() {
                    self.by_node = index;
                }
            }
        }
    }
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
            lease_api: Api::namespaced(client.clone(), &config.heartbeat_namespace),
            recorder: Recorder::new(client, reporter),
            gpunodes: stores.gpunodes,
            nodes: stores.nodes,
            policies: stores.policies,
            slices: stores.slices,
            claims: stores.claims,
            leases: stores.leases,
            expectations: Expectations::default(),
            status_ledger: StatusLedger::default(),
            geometries: Arc::new(GeometryCache::default()),
            metrics,
            config,
            failures: Mutex::new(HashMap::new()),
            holding: AtomicBool::new(false),
            census: Mutex::new(None),
            last_expiry_withdrawal: Mutex::new(None),
            heartbeat_delays: Mutex::new(RecentDelays::new(Instant::now())),
            live: Mutex::new(HashMap::new()),
            slice_index: Mutex::new(SliceIndex::default()),
            memos: Mutex::new(HashMap::new()),
            slice_writers: AtomicUsize::new(0),
            status_deferred: Mutex::new(HashMap::new()),
            last_slice_write: Mutex::new(None),
        }
    }

    /// Feeds one event of the slice watch (after the cache applied it) to the slice index and
    /// the expectations; returns how many owned slices it showed wiped by someone else.
    pub fn observe_slice_event(&self, event: &watcher::Event<SliceMeta>) -> usize {
        self.slice_index
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .observe(event);
        self.expectations.observe(event)
    }

    /// The memo of `node`'s last up-to-date reconciliation.
    pub fn memo(&self, node: &str) -> Option<crate::reconcile::Memo> {
        self.memos
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(node)
            .cloned()
    }

    /// Records (or, with `None`, forgets) `node`'s memo.
    pub fn set_memo(&self, node: &str, memo: Option<crate::reconcile::Memo>) {
        let mut memos = self.memos.lock().unwrap_or_else(|p| p.into_inner());
        match memo {
            Some(memo) => memos.insert(node.to_string(), memo),
            None => memos.remove(node),
        };
    }

    /// Counts the caller as writing slices until the guard drops.
    pub fn writing_slices(&self) -> SliceWriting<'_> {
        self.slice_writers.fetch_add(1, Ordering::Relaxed);
        SliceWriting(self)
    }

    /// How many reconciliations are writing slices right now.
    pub fn slice_writers(&self) -> usize {
        self.slice_writers.load(Ordering::Relaxed)
    }

    /// Whether `node`'s status write, which would change the GpuNode, waits: while other
    /// reconciliations write slices, for at most [`ControllerConfig::status_defer_max`] since
    /// its first deferral, which is recorded here and kept until [`Self::status_settled`].
    pub fn defer_status(&self, node: &str) -> bool {
        let max = self.config.status_defer_max;
        if max.is_zero() || (self.slice_writers() == 0 && !self.slices_written_lately()) {
            return false;
        }
        let mut deferred = self.status_deferred.lock().unwrap_or_else(|p| p.into_inner());
        match deferred.entry(node.to_string()) {
            Entry::Occupied(first) => first.get().elapsed() < max,
            Entry::Vacant(first) => {
                first.insert(Instant::now());
                true
            }
        }
    }

    /// Whether a slice write ended less than [`ControllerConfig::status_defer_quiet`] ago.
    fn slices_written_lately(&self) -> bool {
        let quiet = self.config.status_defer_quiet;
        !quiet.is_zero()
            && self
                .last_slice_write
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_some_and(|at| at.elapsed() < quiet)
    }

    /// Forgets `node`'s deferred status write: written, no longer needed, or its GpuNode is
    /// gone.
    pub fn status_settled(&self, node: &str) {
        self.status_deferred
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(node);
    }

    /// Forgets the deferred status writes of the nodes `keep` rejects (their GpuNodes are
    /// gone, so no reconciliation settles them).
    pub fn retain_status_deferrals(&self, keep: impl Fn(&str) -> bool) {
        self.status_deferred
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|node, _| keep(node));
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
        // Without the Leases every new plugin's GpuNode heartbeat looks minutes old.
        wait_for("Lease", timeout, self.leases.wait_until_ready()).await?;
        Ok(())
    }

    /// The devices of `node`'s pool that claims hold.
    pub fn allocated_devices(&self, node: &str) -> std::collections::BTreeSet<String> {
        crate::claims::allocated_on(&self.claims.state(), &self.config.driver, node)
    }

    /// The cached slices of this driver on `node` (the watch selects the driver), by name.
    pub fn node_slices(&self, node: &str) -> Vec<Arc<SliceMeta>> {
        let index = self.slice_index.lock().unwrap_or_else(|p| p.into_inner());
        let Some(names) = index.by_node.get(node) else {
            return Vec::new();
        };
        let mut slices: Vec<Arc<SliceMeta>> = names
            .iter()
            .filter_map(|name| self.slices.get(&ObjectRef::new(name)))
            .filter(|s| slice_node(s) == Some(node))
            .collect();
        slices.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        slices
    }

    /// The last renewal of `node`'s heartbeat Lease, if it has one.
    pub fn lease_beat(&self, node: &str) -> Option<LeaseBeat> {
        let name = heartbeat_lease_name(node, &self.config.driver)?;
        let lease = self
            .leases
            .get(&ObjectRef::new(&name).within(&self.config.heartbeat_namespace))?;
        lease_beat(&lease)
    }

    /// Records how late a Lease renewal made at `renewed` (the plugin's clock) arrived: now,
    /// in a watch event. A renewal is stamped when the plugin sends it, so the delay is the
    /// API server's time to accept the write plus the watch's time to deliver it (plus any
    /// clock skew, which the quantile below keeps a few nodes' from deciding).
    pub fn record_heartbeat_delay(&self, renewed: Timestamp) {
        let delay = Timestamp::now()
            .duration_since(renewed)
            .try_into()
            .unwrap_or(Duration::ZERO);
        self.heartbeat_delays
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .record(Instant::now(), delay);
    }

    /// How much later than its timeout a heartbeat may be before its expiry withdraws the
    /// pool: the 99th percentile of how late renewals arrived in the last one to two minutes
    /// (at least [`MIN_DELAY_SAMPLES`] of them, else none), at most
    /// [`MAX_HEARTBEAT_ALLOWANCE`]. On a healthy control plane this is a fraction of a second.
    /// Behind a saturated API server every plugin's renewals land seconds late, and a beat
    /// that is late by what is normal right now is a slow control plane, not a dead plugin:
    /// at 2,000 nodes on the development machine, renewals took up to 9 s (p99) to be
    /// accepted and 40 to 70 healthy pools were withdrawn in one cold publish without this.
    pub fn heartbeat_allowance(&self) -> Duration {
        self.heartbeat_delays
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .quantile(Instant::now(), 0.99, MIN_DELAY_SAMPLES)
            .map_or(Duration::ZERO, |d| d.min(MAX_HEARTBEAT_ALLOWANCE))
    }

    /// Records that `node`'s plugin was found live until `expires`.
    pub fn set_live(&self, node: &str, expires: Timestamp) {
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(node.to_string(), expires);
    }

    /// Records that `node`'s plugin was not found live.
    pub fn set_not_live(&self, node: &str) {
        self.live.lock().unwrap_or_else(|p| p.into_inner()).remove(node);
    }

    /// True when the last reconciliation of `node` found its plugin live.
    pub fn is_live(&self, node: &str) -> bool {
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(node)
    }

    /// The heartbeat expiry `node` is next looked at, while it counts as live.
    pub fn live_until(&self, node: &str) -> Option<Timestamp> {
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(node)
            .copied()
    }

    /// The live nodes whose heartbeat expired by `now` in the caches, for a reconciliation
    /// (which decides, with the census, the rate limit and a fresh read, what the expiry
    /// means). They stop counting as live, so a late renewal of theirs triggers a
    /// reconciliation too. A live node whose heartbeat was renewed since is moved to its new
    /// expiry without one: a steady heartbeat costs a comparison, not a reconciliation.
    pub fn take_expired(&self, now: Timestamp) -> Vec<String> {
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        let mut expired = Vec::new();
        for (node, expires) in live.iter_mut() {
            if now < *expires {
                continue;
            }
            let renewed = self
                .gpunodes
                .get(&ObjectRef::new(node))
                .and_then(|g| {
                    let plugin = g.status.as_ref()?.plugin.as_ref()?;
                    let lease = self.lease_beat(node);
                    Some(beat(plugin, lease.as_ref(), now, self.config.heartbeat_timeout).expires)
                })
                .filter(|renewed| now < *renewed);
            match renewed {
                Some(renewed) => *expires = renewed,
                None => expired.push(node.clone()),
            }
        }
        for node in &expired {
            live.remove(node);
        }
        expired
    }

    /// The heartbeats of every GpuNode of this driver at `now` (reused for
    /// [`ControllerConfig::census_ttl`]); records in the metrics and the log whether heartbeat
    /// expiry is being held back.
    pub fn heartbeat_census(&self, now: Timestamp) -> (HeartbeatCensus, bool) {
        let mut cached = self.census.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, census, hold)) = *cached
            && at.elapsed() < self.config.census_ttl
        {
            return (census, hold);
        }
        let gpunodes = self.gpunodes.state();
        let census = HeartbeatCensus::take(
            gpunodes
                .iter()
                .filter(|g| g.spec.driver == self.config.driver)
                .map(|g| {
                    let plugin = g.status.as_ref().and_then(|s| s.plugin.as_ref());
                    let name = g.metadata.name.as_deref().unwrap_or_default();
                    let lease = plugin.and_then(|_| self.lease_beat(name));
                    (plugin, lease)
                }),
            now,
            self.config.heartbeat_timeout,
        );
        let hold = census.mass_expiry(self.config.mass_expiry_threshold);
        *cached = Some((Instant::now(), census, hold));
        drop(cached);
        self.metrics.set_heartbeat_census(census.expired, hold);
        self.metrics.set_heartbeat_allowance(self.heartbeat_allowance());
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

    /// Whether a pool may be withdrawn for heartbeat expiry alone now; true uses up the
    /// allowance. At most one per [`ControllerConfig::expiry_withdrawal_interval`], like the
    /// node lifecycle controller's eviction rate: heartbeats that go stale one after another
    /// while the API server struggles (each too few for the mass-expiry rule) then cost at
    /// most a few pools, not every one that happened to be late. A plugin that really died
    /// still loses its pool at once when its connection drops: the kubelet wipes its slices
    /// after 30 s, and a wipe withdraws without limit.
    pub fn allow_expiry_withdrawal(&self) -> bool {
        self.expiry_allowance(true)
    }

    /// Whether [`Self::allow_expiry_withdrawal`] would allow one now, without using it up
    /// (so a node that would be held anyway costs no confirming read).
    pub fn expiry_withdrawal_due(&self) -> bool {
        self.expiry_allowance(false)
    }

    fn expiry_allowance(&self, take: bool) -> bool {
        let interval = self.config.expiry_withdrawal_interval;
        if interval.is_zero() {
            return true;
        }
        let mut last = self
            .last_expiry_withdrawal
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match *last {
            Some(at) if at.elapsed() < interval => false,
            _ => {
                if take {
                    *last = Some(Instant::now());
                }
                true
            }
        }
    }

    /// `node`'s heartbeat as the API server has it now (a quorum read, not the cache): the
    /// plugin status of its GpuNode and its heartbeat Lease. An expiry seen in the cache is
    /// confirmed with this before a pool is withdrawn, because a watch that lags behind an
    /// overloaded API server shows every heartbeat older than it is. A missing GpuNode or
    /// Lease is `None`; no answer within [`CONFIRM_TIMEOUT`] is an error.
    pub async fn fresh_heartbeat(
        &self,
        node: &str,
    ) -> Result<(Option<PluginStatus>, Option<LeaseBeat>), Error> {
        let unconfirmed = |object: &'static str, reason: String| Error::HeartbeatUnconfirmed {
            node: node.to_string(),
            object,
            reason,
        };
        let read = async {
            let gpunode = self
                .gpunode_api
                .get_opt(node)
                .await
                .map_err(|e| unconfirmed("GpuNode", e.to_string()))?;
            let lease = match heartbeat_lease_name(node, &self.config.driver) {
                Some(name) => self
                    .lease_api
                    .get_opt(&name)
                    .await
                    .map_err(|e| unconfirmed("Lease", e.to_string()))?,
                None => None,
            };
            let plugin = gpunode.and_then(|g| g.status.and_then(|s| s.plugin));
            Ok((plugin, lease.as_ref().and_then(lease_beat)))
        };
        match tokio::time::timeout(CONFIRM_TIMEOUT, read).await {
            Ok(answer) => answer,
            Err(_) => Err(unconfirmed(
                "GpuNode and Lease",
                format!("no answer within {}s", CONFIRM_TIMEOUT.as_secs()),
            )),
        }
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

/// The renewal a heartbeat Lease records, if it has one.
pub fn lease_beat(lease: &Lease) -> Option<LeaseBeat> {
    let spec = lease.spec.as_ref()?;
    let renewed = spec.renew_time.as_ref()?.0;
    let duration = spec
        .lease_duration_seconds
        .and_then(|s| u64::try_from(s).ok())
        .map_or(Duration::ZERO, Duration::from_secs);
    Some(LeaseBeat { renewed, duration })
}
