//! A [`Context`] over caches the test fills by hand, with a scripted API server behind its
//! client: [`Harness::reconcile`] runs one reconciliation against a [`Scenario`].

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use http::{Request, Response};
use k8s_openapi::{
    api::{
        coordination::v1::Lease,
        core::v1::Node,
        resource::v1::{ResourceClaim, ResourceSlice},
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
    jiff::Timestamp,
};
use kube::{
    Client,
    client::Body,
    core::PartialObjectMeta,
    runtime::{
        controller::Action,
        reflector::{self, store::Writer},
        watcher,
    },
};
use migdra_api::{inventory::GpuNode, policy::MigPolicy};
use migdra_controller::{
    context::{Context, ControllerConfig, Stores},
    metrics::Metrics,
};
use tower_test::mock;

use super::{DRIVER, HEARTBEAT_TIMEOUT, NAMESPACE, NODE, POOL, Scenario, Served, lease, node_lease};

pub(super) type Handle = mock::Handle<Request<Body>, Response<Body>>;

/// The controller settings of the tests: [`DRIVER`] in [`NAMESPACE`], the default heartbeat
/// timeout and withdrawal rate limit, no census reuse, and statuses that wait only while
/// slices are written.
pub fn config() -> ControllerConfig {
    ControllerConfig {
        driver: DRIVER.into(),
        pool: migdra_controller::desired::PoolSettings::default(),
        heartbeat_timeout: HEARTBEAT_TIMEOUT,
        mass_expiry_threshold: 0.55,
        identity: "controller-0".into(),
        ready_timeout: Duration::from_secs(1),
        heartbeat_namespace: NAMESPACE.into(),
        census_ttl: Duration::ZERO,
        concurrency: 0,
        expiry_withdrawal_interval: Duration::from_secs(10),
        status_defer_max: migdra_controller::status_deferral::MAX_WAIT,
        status_defer_quiet: Duration::ZERO,
    }
}

/// The controller's clock `age` ago.
pub fn before_now(age: Duration) -> Instant {
    Instant::now()
        .checked_sub(age)
        .expect("the monotonic clock goes back that far")
}

/// A Context over stores the test fills by hand, and the mock API behind its client.
pub struct Harness {
    pub ctx: Arc<Context>,
    pub gpunodes: Writer<GpuNode>,
    pub nodes: Writer<PartialObjectMeta<Node>>,
    pub policies: Writer<MigPolicy>,
    pub slices: Writer<PartialObjectMeta<ResourceSlice>>,
    pub claims: Writer<ResourceClaim>,
    pub leases: Writer<Lease>,
    handle: Option<Handle>,
    rv: u64,
    /// Lease writes so far: the resourceVersion of the next one.
    lease_writes: u64,
}

impl Default for Harness {
    /// Empty, ready caches plus the Node `node-a`.
    fn default() -> Self {
        Self::with_config(|_| {})
    }
}

impl Harness {
    /// Empty, ready caches plus the Node `node-a` and its plugin's heartbeat Lease, renewed
    /// now.
    pub fn new() -> Self {
        Self::default()
    }

    /// [`Self::new`], with the controller settings changed by `configure`.
    pub fn with_config(configure: impl FnOnce(&mut ControllerConfig)) -> Self {
        let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(service, "default");
        let (gpunodes_store, mut gpunodes) = reflector::store();
        let (nodes_store, mut nodes) = reflector::store();
        let (policies_store, mut policies) = reflector::store();
        let (slices_store, mut slices) = reflector::store();
        let (claims_store, mut claims) = reflector::store();
        let (leases_store, mut leases) = reflector::store();
        leases.apply_watcher_event(&watcher::Event::InitDone);
        gpunodes.apply_watcher_event(&watcher::Event::InitDone);
        nodes.apply_watcher_event(&watcher::Event::InitDone);
        policies.apply_watcher_event(&watcher::Event::InitDone);
        slices.apply_watcher_event(&watcher::Event::InitDone);
        claims.apply_watcher_event(&watcher::Event::InitDone);
        let mut config = config();
        configure(&mut config);
        let stores = Stores {
            gpunodes: gpunodes_store,
            nodes: nodes_store,
            policies: policies_store,
            slices: slices_store,
            claims: claims_store,
            leases: leases_store,
        };
        let ctx = Arc::new(Context::new(client, config, stores, Metrics::new()));
        let mut h = Self {
            ctx,
            gpunodes,
            nodes,
            policies,
            slices,
            claims,
            leases,
            handle: Some(handle),
            rv: 100,
            lease_writes: 0,
        };
        h.add_node(NODE, &[("gpu", "h100")]);
        h.put_lease(NODE, Timestamp::now());
        h
    }

    pub fn add_node(&mut self, name: &str, labels: &[(&str, &str)]) {
        let node = PartialObjectMeta::<Node> {
            metadata: ObjectMeta {
                name: Some(name.into()),
                uid: Some(format!("uid-{name}")),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                ..Default::default()
            },
            ..Default::default()
        };
        self.nodes.apply_watcher_event(&watcher::Event::Apply(node));
    }

    pub fn delete_node(&mut self, name: &str) {
        let node = PartialObjectMeta::<Node> {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        self.nodes.apply_watcher_event(&watcher::Event::Delete(node));
    }

    /// Puts a claim holding `devices` of node-a's pool into the claim cache (or, with no
    /// devices, shows it released).
    pub fn claim(&mut self, name: &str, devices: &[&str]) {
        use k8s_openapi::api::resource::v1::{
            AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult, ResourceClaimStatus,
        };
        let results: Vec<DeviceRequestAllocationResult> = devices
            .iter()
            .map(|d| DeviceRequestAllocationResult {
                driver: DRIVER.into(),
                pool: POOL.into(),
                device: d.to_string(),
                request: "gpu".into(),
                ..Default::default()
            })
            .collect();
        let claim = ResourceClaim {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("default".into()),
                ..Default::default()
            },
            spec: Default::default(),
            status: (!results.is_empty()).then(|| ResourceClaimStatus {
                allocation: Some(AllocationResult {
                    devices: Some(DeviceAllocationResult {
                        results: Some(results),
                        config: None,
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
        };
        self.claims.apply_watcher_event(&watcher::Event::Apply(claim));
    }

    /// Puts a GpuNode into the GpuNode cache (the heartbeat census reads it).
    pub fn put_gpunode(&mut self, gpunode: &GpuNode) {
        self.gpunodes
            .apply_watcher_event(&watcher::Event::Apply(gpunode.clone()));
    }

    /// Removes a GpuNode from the GpuNode cache (a watch delete event).
    pub fn remove_gpunode(&mut self, gpunode: &GpuNode) {
        self.gpunodes
            .apply_watcher_event(&watcher::Event::Delete(gpunode.clone()));
    }

    /// Puts `node`'s heartbeat Lease, renewed at `renewed`, into the Lease cache, as the watch
    /// delivers it on a node whose clock agrees with the controller's: observed `renewed`
    /// ago (now, for a time in the future). Returns the instant of the observation.
    pub fn put_lease(&mut self, node: &str, renewed: Timestamp) -> Instant {
        let age = Duration::try_from(Timestamp::now().duration_since(renewed)).unwrap_or(Duration::ZERO);
        self.put_lease_observed(node, renewed, before_now(age))
    }

    /// Puts `node`'s heartbeat Lease, stamped `renewed` by the node's clock, into the Lease
    /// cache as a watch event the controller received at `observed`: a write of its own (a
    /// new resourceVersion), whatever the stamp. Returns `observed`.
    pub fn put_lease_observed(&mut self, node: &str, renewed: Timestamp, observed: Instant) -> Instant {
        let mut lease = lease(node, renewed);
        self.lease_writes += 1;
        lease.metadata.resource_version = Some(self.lease_writes.to_string());
        self.leases
            .apply_watcher_event(&watcher::Event::Apply(lease.clone()));
        self.ctx.heartbeats.observe(&lease, observed);
        observed
    }

    /// Delivers a renewal of `node`'s kubelet Lease as the `kube-node-lease` watch does,
    /// received `age` ago on a node whose clock agrees. Returns the instant of the
    /// observation.
    pub fn renew_node_lease(&mut self, node: &str, age: Duration) -> Instant {
        let observed = before_now(age);
        let renewed = Timestamp::now() - age;
        self.lease_writes += 1;
        let lease = node_lease(node, renewed, self.lease_writes);
        self.ctx.heartbeats.observe_node_lease(&lease, observed);
        observed
    }

    /// [`Self::renew_node_lease`] every 10 s (the kubelet's interval), from `from` ago to `to`
    /// ago.
    pub fn renew_node_lease_between(&mut self, node: &str, from: Duration, to: Duration) {
        let mut age = from;
        while age >= to {
            self.renew_node_lease(node, age);
            match age.checked_sub(Duration::from_secs(10)) {
                Some(next) => age = next,
                None => break,
            }
        }
    }

    pub fn add_policy(&mut self, policy: MigPolicy) {
        self.policies.apply_watcher_event(&watcher::Event::Apply(policy));
    }

    /// Feeds a watch event to the slice cache and to the expectations, as the controller's
    /// slice watch does: metadata only.
    pub fn slice_event(&mut self, event: watcher::Event<ResourceSlice>) {
        let meta = |s: ResourceSlice| PartialObjectMeta::<ResourceSlice> {
            metadata: s.metadata,
            ..Default::default()
        };
        let event = match event {
            watcher::Event::Apply(s) => watcher::Event::Apply(meta(s)),
            watcher::Event::InitApply(s) => watcher::Event::InitApply(meta(s)),
            watcher::Event::Delete(s) => watcher::Event::Delete(meta(s)),
            watcher::Event::Init => watcher::Event::Init,
            watcher::Event::InitDone => watcher::Event::InitDone,
        };
        self.slices.apply_watcher_event(&event);
        let wiped = self.ctx.observe_slice_event(&event);
        self.ctx.metrics.slices_wiped(wiped);
    }

    /// Puts what the API server stored into the slice cache.
    pub fn store_slices(&mut self, stored: &[ResourceSlice]) {
        for s in stored {
            self.slice_event(watcher::Event::Apply(s.clone()));
        }
    }

    /// Removes slices from the cache (a deletion observed by the watch).
    pub fn wipe_slices(&mut self, stored: &[ResourceSlice]) {
        for s in stored {
            self.slice_event(watcher::Event::Delete(s.clone()));
        }
    }

    /// Replaces the slice cache by a relist that shows only `stored` (no delete events).
    pub fn relist_slices(&mut self, stored: &[ResourceSlice]) {
        self.slice_event(watcher::Event::Init);
        for s in stored {
            self.slice_event(watcher::Event::InitApply(s.clone()));
        }
        self.slice_event(watcher::Event::InitDone);
    }

    /// Runs one reconciliation against `scenario`; returns its result and what the server
    /// stored for each write.
    pub async fn reconcile(
        &mut self,
        gpunode: &GpuNode,
        scenario: Scenario,
    ) -> (Result<Action, migdra_controller::Error>, Served) {
        let handle = self.handle.take().expect("one reconciliation at a time");
        let start_rv = self.rv;
        let verifier = tokio::spawn(scenario.serve(handle, start_rv));
        self.put_gpunode(gpunode);
        let result = tokio::time::timeout(
            Duration::from_secs(10),
            migdra_controller::reconcile::reconcile(Arc::new(gpunode.clone()), self.ctx.clone()),
        )
        .await;
        let (handle, served) = match verifier.await {
            Ok(done) => done,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        };
        self.handle = Some(handle);
        self.rv = served.next_rv;
        (result.expect("reconcile hung"), served)
    }
}
