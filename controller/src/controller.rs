//! The kube-runtime Controller over GpuNodes and its watches:
//!
//! * GpuNodes (the primary resource): every change reconciles that node;
//! * Node metadata: a label or UID change, or a deletion, reconciles the same-named GpuNode
//!   (labels select the MigPolicy);
//! * MigPolicies: any change reconciles every GpuNode;
//! * this driver's ResourceSlices (field selector `spec.driver=<driver>`, metadata only: the
//!   diff compares the spec hash annotation, see [`crate::compare`]): a change reconciles the
//!   slice's node, which is how a kubelet wipe is noticed at once;
//! * ResourceClaims (cut down to this driver's allocation results): a change of what a claim
//!   holds reconciles the nodes of the pools it names, before and after (a device in use
//!   stays in its pool until released);
//! * the plugins' heartbeat Leases in the controller's namespace (label
//!   `gpu.migdra.dev/heartbeat=<driver>`, node in `spec.holderIdentity`): a renewal
//!   reconciles a node only when it is not considered live, so a steady heartbeat costs a
//!   cache update;
//! * the kubelets' node Leases in `kube-node-lease`, the witnesses of liveness (see
//!   [`crate::liveness`]): only noted, no cache, no reconciliation (a held node is looked at
//!   again on its own); without access to them every node goes without a witness;
//! * the expiry watch: every [`EXPIRY_SCAN`], live nodes whose heartbeat expired in the caches
//!   and were not renewed since are reconciled
//!   ([`crate::liveness::HeartbeatTracker::take_expired`]); a timer per node would reconcile
//!   every node each beat to find nothing to do.
//!
//! Each watch also fills the reconciler's cache, stripped of what it never reads (managed
//! fields, the GpuNode's foreign annotations). A sweeper deletes this driver's slices on
//! nodes without a GpuNode.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::{Duration, Instant},
};

use futures::{Stream, StreamExt, future};
use k8s_openapi::api::{coordination::v1::Lease, core::v1::Node, resource::v1::ResourceClaim};
use kube::{
    Api, Client, ResourceExt,
    core::PartialObjectMeta,
    runtime::{
        Controller, WatchStreamExt, controller,
        reflector::{self, ObjectRef, store::Writer},
        watcher::{self, watcher},
    },
};
use migdra_api::{
    inventory::{GpuNode, HEARTBEAT_LEASE_LABEL},
    policy::MigPolicy,
};
use tokio_util::sync::CancellationToken;

use crate::{
    claims::{ClaimChanges, strip_claim},
    compare::{PoolDiff, SliceDelete, SliceMeta},
    context::{Context, ControllerConfig, Stores},
    error::Error,
    liveness::{NODE_LEASE_NAMESPACE, lease_node},
    metrics::Metrics,
    naming::slice_node,
    reconcile::{error_policy, reconcile},
};

/// How often the sweeper looks for slices of nodes without a GpuNode.
const SWEEP_INTERVAL: Duration = Duration::from_secs(60);
/// How often the expiry watch looks for live nodes whose heartbeat expired.
pub const EXPIRY_SCAN: Duration = Duration::from_secs(1);
/// Collapses bursts of triggers (a pool write produces one event per slice).
const DEBOUNCE: Duration = Duration::from_millis(500);

pub fn slice_watch_config(driver: &str) -> watcher::Config {
    watcher::Config::default().fields(&format!("spec.driver={driver}"))
}

pub fn lease_watch_config(driver: &str) -> watcher::Config {
    watcher::Config::default().labels(&format!("{HEARTBEAT_LEASE_LABEL}={driver}"))
}

/// Passes on the Node events that matter to the pool: a new node, a changed label set or
/// UID, a deletion. Node status updates (frequent) are dropped.
#[derive(Debug, Default)]
pub struct NodeChanges {
    seen: HashMap<String, NodeKey>,
}

/// What of a Node matters to its pool: its UID (a re-created node needs new owner
/// references) and its labels (policy selection).
type NodeKey = (Option<String>, Option<std::collections::BTreeMap<String, String>>);

impl NodeChanges {
    /// The node a watch event should reconcile, if any.
    pub fn admit(
        &mut self,
        event: &watcher::Event<PartialObjectMeta<Node>>,
    ) -> Option<PartialObjectMeta<Node>> {
        match event {
            watcher::Event::Apply(node) | watcher::Event::InitApply(node) => {
                let key = (node.metadata.uid.clone(), node.metadata.labels.clone());
                let name = node.name_any();
                if self.seen.get(&name) == Some(&key) {
                    None
                } else {
                    self.seen.insert(name, key);
                    Some(node.clone())
                }
            }
            watcher::Event::Delete(node) => {
                self.seen.remove(&node.name_any());
                Some(node.clone())
            }
            watcher::Event::Init | watcher::Event::InitDone => None,
        }
    }
}

/// Slices (of this driver: the watch selects it) on nodes that have no GpuNode, with their
/// node: nobody will reconcile them.
pub fn orphaned_slices(slices: &[Arc<SliceMeta>], gpunodes: &HashSet<String>) -> Vec<(String, SliceDelete)> {
    slices
        .iter()
        .filter_map(|s| {
            let node = slice_node(s).filter(|n| !gpunodes.contains(*n))?;
            let delete = SliceDelete {
                name: s.name_any(),
                uid: s.metadata.uid.clone(),
            };
            Some((node.to_string(), delete))
        })
        .collect()
}

/// Drops what the controller never reads from a cached slice: managed fields, and every
/// annotation but its own two.
pub fn strip_slice(slice: &mut SliceMeta) {
    slice.metadata.managed_fields = None;
    if let Some(annotations) = &mut slice.metadata.annotations {
        annotations.retain(|k, _| {
            k == crate::compare::SPEC_HASH_ANNOTATION || k == crate::compare::GENERATION_ANNOTATION
        });
    }
}

/// Drops what the controller never reads from a cached GpuNode: managed fields and
/// annotations (a `kubectl apply` leaves the whole object in one).
pub fn strip_gpunode(gpunode: &mut GpuNode) {
    gpunode.metadata.managed_fields = None;
    gpunode.metadata.annotations = None;
}

/// The writers that fill the caches of a [`Context`] from the watches.
struct CacheWriters {
    gpunodes: Writer<GpuNode>,
    nodes: Writer<PartialObjectMeta<Node>>,
    policies: Writer<MigPolicy>,
    slices: Writer<SliceMeta>,
    claims: Writer<ResourceClaim>,
    leases: Writer<Lease>,
}

/// A context over empty caches, and the writers that fill them.
fn build_context(client: Client, config: ControllerConfig, metrics: Metrics) -> (Arc<Context>, CacheWriters) {
    let (gpunodes, gpunodes_writer) = reflector::store();
    let (nodes, nodes_writer) = reflector::store();
    let (policies, policies_writer) = reflector::store();
    let (slices, slices_writer) = reflector::store();
    let (claims, claims_writer) = reflector::store();
    let (leases, leases_writer) = reflector::store();
    let writers = CacheWriters {
        gpunodes: gpunodes_writer,
        nodes: nodes_writer,
        policies: policies_writer,
        slices: slices_writer,
        claims: claims_writer,
        leases: leases_writer,
    };
    let stores = Stores {
        gpunodes,
        nodes,
        policies,
        slices,
        claims,
        leases,
    };
    (Arc::new(Context::new(client, config, stores, metrics)), writers)
}

/// Runs the controller until `shutdown` fires (graceful: in-flight reconciliations finish).
pub async fn run(
    client: Client,
    config: ControllerConfig,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let driver = config.driver.clone();
    let concurrency = config.concurrency;
    let (ctx, writers) = build_context(client.clone(), config, metrics);
    let controller = Controller::for_stream(
        gpunode_triggers(&client, &ctx, writers.gpunodes),
        ctx.stores.gpunodes.clone(),
    )
    .with_config(
        controller::Config::default()
            .debounce(DEBOUNCE)
            .concurrency(concurrency),
    )
    .watches_stream(node_triggers(&client, writers.nodes), |node| {
        Some(ObjectRef::<GpuNode>::new(&node.name_any()))
    })
    .watches_stream(slice_triggers(&client, &ctx, writers.slices), |slice| {
        slice_node(&slice).map(ObjectRef::<GpuNode>::new)
    })
    .reconcile_all_on(policy_triggers(&client, writers.policies))
    .reconcile_on(claim_triggers(&client, &driver, writers.claims))
    .reconcile_on(lease_triggers(&client, &ctx, writers.leases))
    .reconcile_on(expiry_triggers(&ctx))
    .graceful_shutdown_on(shutdown.clone().cancelled_owned());
    // The sweeper lives in this task (not a spawned one), so aborting the task on a lost
    // lease stops it too.
    let sweeper = sweep(ctx.clone(), shutdown.clone());
    tracing::info!(driver = %driver, "controller running");
    let synced = log_when_synced(ctx.clone(), shutdown.clone());
    let witnesses = observe_node_leases(&client, &ctx)
        .take_until(shutdown.clone().cancelled_owned())
        .for_each(|()| future::ready(()));
    let controller = controller.run(reconcile, error_policy, ctx).for_each(|result| {
        match result {
            Ok((object, _)) => tracing::trace!(node = %object.name, "reconciled"),
            Err(controller::Error::ReconcilerFailed(e, object)) => {
                tracing::debug!(node = %object.name, error = %e, "reconcile failed")
            }
            Err(e) => tracing::warn!(error = %e, "controller error"),
        }
        future::ready(())
    });
    futures::join!(controller, sweeper, synced, witnesses);
    tracing::info!("controller stopped");
    Ok(())
}

/// Drops a watch's errors, logged (the watcher retries them with backoff).
fn warn_on_error<T>(what: &'static str) -> impl FnMut(Result<T, watcher::Error>) -> future::Ready<Option<T>> {
    move |result| {
        future::ready(
            result
                .map_err(|e| tracing::warn!(error = %e, "{what} watch failed"))
                .ok(),
        )
    }
}

fn gpunode_refs(nodes: impl IntoIterator<Item = String>) -> impl Stream<Item = ObjectRef<GpuNode>> {
    futures::stream::iter(nodes.into_iter().map(|node| ObjectRef::new(&node)))
}

/// The GpuNode watch, filling the cache the reconciler and the heartbeat census read.
fn gpunode_triggers(
    client: &Client,
    ctx: &Context,
    writer: Writer<GpuNode>,
) -> impl Stream<Item = Result<GpuNode, watcher::Error>> + use<> {
    let geometries = ctx.geometries.clone();
    watcher(Api::<GpuNode>::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .modify(move |gpunode| {
            strip_gpunode(gpunode);
            geometries.take(gpunode);
        })
        .reflect(writer)
        .applied_objects()
}

/// The Node metadata watch: the nodes whose label set or UID changed, or that were deleted.
fn node_triggers(
    client: &Client,
    writer: Writer<PartialObjectMeta<Node>>,
) -> impl Stream<Item = Result<PartialObjectMeta<Node>, watcher::Error>> + use<> {
    let mut node_changes = NodeChanges::default();
    watcher(Api::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .filter_map(move |event| {
            future::ready(match event {
                Ok(event) => node_changes.admit(&event).map(Ok),
                Err(e) => Some(Err(e)),
            })
        })
}

/// The MigPolicy watch: any change.
fn policy_triggers(client: &Client, writer: Writer<MigPolicy>) -> impl Stream<Item = ()> + use<> {
    watcher(Api::<MigPolicy>::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .touched_objects()
        .filter_map(warn_on_error("MigPolicy"))
        .map(|_| ())
}

/// The watch of this driver's slices (metadata only), feeding the slice index and the
/// expectations as events arrive.
fn slice_triggers(
    client: &Client,
    ctx: &Arc<Context>,
    writer: Writer<SliceMeta>,
) -> impl Stream<Item = Result<SliceMeta, watcher::Error>> + use<> {
    let ctx = ctx.clone();
    watcher(Api::all(client.clone()), slice_watch_config(&ctx.config.driver))
        .default_backoff()
        .modify(strip_slice)
        .reflect(writer)
        .inspect(move |event| {
            if let Ok(event) = event {
                let wiped = ctx.observe_slice_event(event);
                if wiped > 0 {
                    ctx.metrics.slices_wiped(wiped);
                }
                let (lag, ttl) = ctx.expectations.watch_lag_and_ttl();
                ctx.metrics.set_slice_watch_lag(lag, ttl);
            }
        })
        .touched_objects()
}

/// The ResourceClaim watch (cut down to `driver`'s allocation results): the nodes whose held
/// devices changed.
fn claim_triggers(
    client: &Client,
    driver: &str,
    writer: Writer<ResourceClaim>,
) -> impl Stream<Item = ObjectRef<GpuNode>> + use<> {
    let mut claim_changes = ClaimChanges::default();
    let (claim_driver, strip_driver) = (driver.to_string(), driver.to_string());
    watcher(Api::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .modify(move |claim| strip_claim(claim, &strip_driver))
        .reflect(writer)
        .filter_map(warn_on_error("ResourceClaim"))
        .flat_map(move |event| gpunode_refs(claim_changes.admit(&event, &claim_driver)))
}

/// The heartbeat Lease watch: notes when each renewal is observed (see [`crate::liveness`]),
/// and triggers the nodes the controller does not consider live.
fn lease_triggers(
    client: &Client,
    ctx: &Arc<Context>,
    writer: Writer<Lease>,
) -> impl Stream<Item = ObjectRef<GpuNode>> + use<> {
    let (observe_ctx, lease_ctx) = (ctx.clone(), ctx.clone());
    watcher(
        Api::<Lease>::namespaced(client.clone(), &ctx.config.heartbeat_namespace),
        lease_watch_config(&ctx.config.driver),
    )
    .default_backoff()
    .modify(|lease| lease.metadata.managed_fields = None)
    .reflect(writer)
    .inspect(move |event| {
        // Liveness runs on when the controller observes renewals, not on their renewTime.
        let heartbeats = &observe_ctx.heartbeats;
        match event {
            Ok(watcher::Event::Apply(lease)) => heartbeats.observe(lease, Instant::now()),
            Ok(watcher::Event::InitApply(lease)) => heartbeats.observe_listed(lease, Instant::now()),
            Ok(watcher::Event::Delete(lease)) => heartbeats.forget(lease),
            _ => {}
        }
    })
    .touched_objects()
    .filter_map(warn_on_error("heartbeat Lease"))
    .filter_map(move |lease| {
        future::ready(
            lease_node(&lease, &lease_ctx.config.driver)
                .filter(|node| !lease_ctx.heartbeats.is_live(node))
                .map(ObjectRef::<GpuNode>::new),
        )
    })
}

/// The watch of the kubelets' node Leases: notes each renewal as the node's witness, and
/// forgets the nodes whose Lease a relist no longer shows.
fn observe_node_leases(client: &Client, ctx: &Arc<Context>) -> impl Stream<Item = ()> + use<> {
    let ctx = ctx.clone();
    let mut listed = HashSet::new();
    watcher(
        Api::<Lease>::namespaced(client.clone(), NODE_LEASE_NAMESPACE),
        watcher::Config::default(),
    )
    .default_backoff()
    .filter_map(warn_on_error("kubelet node Lease"))
    .map(move |event| {
        let heartbeats = &ctx.heartbeats;
        match event {
            watcher::Event::Apply(lease) => heartbeats.observe_node_lease(&lease, Instant::now()),
            watcher::Event::InitApply(lease) => {
                heartbeats.observe_node_lease(&lease, Instant::now());
                listed.insert(lease.name_any());
            }
            watcher::Event::Delete(lease) => heartbeats.forget_node_lease(&lease.name_any()),
            watcher::Event::Init => listed.clear(),
            watcher::Event::InitDone => heartbeats.retain_node_leases(|node| listed.contains(node)),
        }
    })
}

/// The expiry watch: every [`EXPIRY_SCAN`], the live nodes whose heartbeat expired.
fn expiry_triggers(ctx: &Arc<Context>) -> impl Stream<Item = ObjectRef<GpuNode>> + use<> {
    let mut scans = tokio::time::interval(EXPIRY_SCAN);
    scans.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    futures::stream::unfold((scans, ctx.clone()), |(mut scans, ctx)| async move {
        scans.tick().await;
        Some((ctx.heartbeats.take_expired(Instant::now()), (scans, ctx)))
    })
    .flat_map(gpunode_refs)
}

/// Logs when every cache has its initial list (the first reconciliations wait for it): a
/// cold start's milestone.
async fn log_when_synced(ctx: Arc<Context>, shutdown: CancellationToken) {
    let began = Instant::now();
    tokio::select! {
        _ = shutdown.cancelled() => {}
        ready = ctx.wait_ready() => match ready {
            Ok(()) => tracing::info!(after = ?began.elapsed(), "caches synced"),
            Err(e) => tracing::warn!(error = %e, "caches did not sync"),
        },
    }
}

/// Deletes slices of nodes without a GpuNode, every [`SWEEP_INTERVAL`], and forgets their
/// metrics and deferred status writes.
async fn sweep(ctx: Arc<Context>, shutdown: CancellationToken) {
    let gpunodes = &ctx.stores.gpunodes;
    let ready = async { gpunodes.wait_until_ready().await.is_ok() && ctx.wait_ready().await.is_ok() };
    tokio::select! {
        _ = shutdown.cancelled() => return,
        ok = ready => if !ok { return },
    }
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(SWEEP_INTERVAL) => {}
        }
        let names: HashSet<String> = gpunodes.state().iter().map(|g| g.name_any()).collect();
        ctx.geometries.retain(|name| names.contains(name));
        ctx.status_deferral.retain(|name| names.contains(name));
        for (node, orphan) in orphaned_slices(&ctx.stores.slices.state(), &names) {
            tracing::info!(slice = %orphan.name, %node, "deleting a slice of a node without GpuNode");
            ctx.metrics.forget_node(&node);
            let diff = PoolDiff {
                deletes: vec![orphan],
                ..Default::default()
            };
            if let Err(e) = crate::publish::apply(&ctx, &node, diff).await {
                tracing::warn!(error = %e, "deleting an orphaned slice failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    fn node(name: &str, uid: &str, labels: &[(&str, &str)]) -> PartialObjectMeta<Node> {
        PartialObjectMeta::<Node> {
            metadata: ObjectMeta {
                name: Some(name.into()),
                uid: Some(uid.into()),
                resource_version: Some("1".into()),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect::<BTreeMap<_, _>>(),
                ),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn node_events_pass_only_on_relevant_changes() {
        let mut f = NodeChanges::default();
        let a = node("a", "u1", &[("gpu", "h100")]);
        assert!(f.admit(&watcher::Event::InitApply(a.clone())).is_some());
        let mut status_only = a.clone();
        status_only.metadata.resource_version = Some("2".into());
        assert!(f.admit(&watcher::Event::Apply(status_only)).is_none());
        let relabelled = node("a", "u1", &[("gpu", "a100")]);
        assert!(f.admit(&watcher::Event::Apply(relabelled.clone())).is_some());
        let recreated = node("a", "u2", &[("gpu", "a100")]);
        assert!(f.admit(&watcher::Event::Apply(recreated)).is_some());
        assert!(f.admit(&watcher::Event::Delete(relabelled.clone())).is_some());
        assert!(
            f.admit(&watcher::Event::Apply(relabelled)).is_some(),
            "back after deletion"
        );
        assert!(f.admit(&watcher::Event::InitDone).is_none());
    }

    #[test]
    fn lease_watch_selects_the_driver() {
        let config = lease_watch_config("gpu.migdra.dev");
        assert_eq!(
            config.label_selector.as_deref(),
            Some("gpu.migdra.dev/heartbeat=gpu.migdra.dev")
        );
    }

    #[test]
    fn slice_watch_selects_the_driver() {
        let config = slice_watch_config("gpu.migdra.dev");
        assert_eq!(
            config.field_selector.as_deref(),
            Some("spec.driver=gpu.migdra.dev")
        );
    }

    #[test]
    fn orphans_are_slices_of_nodes_without_gpunode() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
        let slice = |name: &str, label: Option<&str>, owner: Option<&str>| {
            Arc::new(SliceMeta {
                metadata: ObjectMeta {
                    name: Some(name.into()),
                    uid: Some(format!("uid-{name}")),
                    labels: label
                        .map(|n| BTreeMap::from([(crate::naming::NODE_LABEL.to_string(), n.to_string())])),
                    owner_references: owner.map(|n| {
                        vec![OwnerReference {
                            api_version: "v1".into(),
                            kind: "Node".into(),
                            name: n.into(),
                            uid: format!("uid-{n}"),
                            ..Default::default()
                        }]
                    }),
                    ..Default::default()
                },
                ..Default::default()
            })
        };
        let slices = [
            slice("kept", Some("a"), Some("a")),
            slice("orphan", Some("b"), Some("b")),
            slice("orphan-long-name", None, Some("c")),
            slice("no-node", None, None),
        ];
        let gpunodes = HashSet::from(["a".to_string()]);
        assert_eq!(
            orphaned_slices(&slices, &gpunodes),
            vec![
                (
                    "b".to_string(),
                    SliceDelete {
                        name: "orphan".into(),
                        uid: Some("uid-orphan".into())
                    }
                ),
                (
                    "c".to_string(),
                    SliceDelete {
                        name: "orphan-long-name".into(),
                        uid: Some("uid-orphan-long-name".into())
                    }
                )
            ]
        );
    }

    #[test]
    fn cached_objects_keep_only_what_is_read() {
        let mut slice = SliceMeta {
            metadata: ObjectMeta {
                name: Some("s".into()),
                managed_fields: Some(vec![Default::default()]),
                annotations: Some(BTreeMap::from([
                    (crate::compare::SPEC_HASH_ANNOTATION.to_string(), "h".to_string()),
                    (crate::compare::GENERATION_ANNOTATION.to_string(), "3".to_string()),
                    ("other".to_string(), "x".repeat(1000)),
                ])),
                ..Default::default()
            },
            ..Default::default()
        };
        strip_slice(&mut slice);
        assert!(slice.metadata.managed_fields.is_none());
        assert_eq!(
            slice.annotations().keys().collect::<Vec<_>>(),
            [
                crate::compare::GENERATION_ANNOTATION,
                crate::compare::SPEC_HASH_ANNOTATION
            ]
        );
        let mut g = GpuNode::new(
            "n",
            migdra_api::inventory::GpuNodeSpec {
                node_name: "n".into(),
                driver: "d".into(),
            },
        );
        g.metadata.managed_fields = Some(vec![Default::default()]);
        g.metadata.annotations = Some(BTreeMap::from([("a".to_string(), "b".to_string())]));
        strip_gpunode(&mut g);
        assert!(g.metadata.managed_fields.is_none() && g.metadata.annotations.is_none());
    }
}
