//! One reconciliation of one GpuNode: decide what the node's pool should be, diff it against
//! the cached slices, write the difference, record the outcome in the status.
//!
//! * Node gone → withdraw the pool (delete its slices), `Published=False NodeNotFound`.
//! * Plugin not live (see [`crate::liveness`]: unregistered, heartbeat expired, or its slices
//!   wiped by the kubelet and no heartbeat since) → withdraw, `Published=False
//!   PluginNotReady`; the plugin's next heartbeat brings the node back. Heartbeat expiry is
//!   held back while most heartbeats expire at once (control-plane trouble), withdraws only
//!   once a fresh read of the GpuNode and Lease confirms it (a lagging watch shows healthy
//!   heartbeats stale), and at most one pool per 10 s.
//! * Plugin live → policy, plan (keeping the devices claims hold), render, validate; an
//!   invalid policy or pool is reported (event + condition) and nothing is written; otherwise
//!   the pool is diffed and only a real change is written, with a new generation when the
//!   upstream slice controller would bump it. The expiry watch (see
//!   [`Context::take_expired`]) hands the node back at its heartbeat's expiry unless it was
//!   renewed, so a plugin that dies silently is noticed; otherwise a resync every
//!   [`LIVE_RESYNC`].
//! * Slices first, statuses after. While other reconciliations are writing slices (a publish
//!   burst, with the API server the bottleneck), a `Published=True` status that would change
//!   the GpuNode is not written: the scheduler needs the slices, the status (a large object's
//!   server-side apply) is for people and tools. The node is looked at again within 2 s and
//!   the status goes out once no slices have been written for [`STATUS_DEFER_QUIET`], or
//!   after [`STATUS_DEFER_MAX`] of waiting. A status that explains a withdrawal, a failure or a
//!   refused policy or pool is written at once.
//!
//! Short circuit. Most reconciliations change nothing (a resync, a GpuNode heartbeat
//! write). So a reconciliation that found the pool up to date leaves a [`Memo`]: a
//! hash of everything the pool is computed from (inventory, node identity and labels,
//! policies, held devices, published generation) and of the cached slices' versions. The next
//! one with the same hash skips planning, rendering, validating and comparing, and only
//! confirms the status. The inventory hash is reused while the GpuNode's resourceVersion is
//! unchanged (with heartbeat Leases, the GpuNode rarely changes). A reconciliation that
//! wrote the pool leaves the memo the caches will match once they show its writes (slice
//! versions from the server's answers, the status it wrote), so the reconciliations its own
//! events trigger skip the work too.

use std::{collections::BTreeSet, io, sync::Arc, time::Duration};

use k8s_openapi::{api::resource::v1::ResourceSlice, jiff::Timestamp};
use kube::{
    Resource, ResourceExt,
    runtime::{
        controller::Action,
        events::{Event, EventType},
        reflector::ObjectRef,
    },
};
use migdra_api::{
    inventory::{GpuNode, PublicationStatus, pool_name},
    policy::MigPolicy,
};
use sha2::{Digest, Sha256};
use tracing::Instrument;

use crate::{
    compare::{SliceMeta, cached_generation, diff_pool, keep_taint_times, tainted_replacements},
    context::Context,
    desired::{DesiredError, NodeRef, desired_pool},
    error::Error,
    liveness::{GoneReason, Liveness, beat, liveness},
    metrics::ExpiryCheck,
    publish::Publisher,
    status::{self, Published, reason, truncate},
};

/// How often a live node is reconciled when nothing changes: a safety net, as every input
/// is watched and the expiry watch (see [`crate::context::Context::take_expired`]) looks at
/// its heartbeat's expiry.
pub const LIVE_RESYNC: Duration = Duration::from_secs(300);
/// How often a node whose heartbeat expiry is held back (see [`crate::liveness`]) is looked
/// at again.
const HELD_RECHECK: Duration = Duration::from_secs(10);
/// Shortest requeue.
const MIN_REQUEUE: Duration = Duration::from_secs(1);
/// First error backoff.
const BACKOFF_BASE: Duration = Duration::from_secs(1);
/// Longest error backoff.
const BACKOFF_MAX: Duration = Duration::from_secs(120);
/// Default [`crate::context::ControllerConfig::status_defer_max`]: the longest a node's
/// `Published=True` status waits for other reconciliations' slice writes. A bound, so the
/// condition is at most this stale even while slices are written without pause (a long
/// cold start, continuous churn). Long enough for a cold start of 500 nodes (about a
/// minute of slice writes on a 2-core control plane): at 30 s the first pools' statuses
/// (313 server-side applies of large GpuNodes) went out in the middle of it, and the API
/// server spent 35% more CPU on the cold publish than on the same slices alone.
pub const STATUS_DEFER_MAX: Duration = Duration::from_secs(120);
/// Default [`crate::context::ControllerConfig::status_defer_quiet`]: statuses wait this
/// long after the last slice write, so a burst of large GpuNode status events does not delay
/// the slices' watch events (measured at 500 nodes: the last slices reached a watcher 6.7 s
/// after their write while the deferred statuses went out).
pub const STATUS_DEFER_QUIET: Duration = Duration::from_secs(2);
/// How soon a node whose status write was deferred is looked at again.
const STATUS_DEFER_RECHECK: Duration = Duration::from_secs(2);

/// What a reconciliation that found a node's pool up to date saw (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct Memo {
    /// The GpuNode's resourceVersion when its inventory was hashed.
    gpunode_version: Option<String>,
    /// Hash of the inventory part of the GpuNode.
    inventory: [u8; 16],
    /// Hash of all inputs, the inventory hash included.
    inputs: [u8; 16],
    /// The publication the status shows.
    publication: PublicationStatus,
    /// The message of the `Published` condition.
    message: String,
}

impl Memo {
    /// The hash of the inputs it was taken with.
    pub fn inputs(&self) -> [u8; 16] {
        self.inputs
    }

    /// The GpuNode resourceVersion its inventory hash belongs to.
    pub fn gpunode_version(&self) -> Option<&str> {
        self.gpunode_version.as_deref()
    }
}

/// Feeds what is written into a SHA-256.
struct HashWriter(Sha256);

impl io::Write for HashWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl HashWriter {
    fn new() -> Self {
        Self(Sha256::new())
    }

    fn add(&mut self, value: &impl serde::Serialize) {
        // Serializing plain data into a hasher cannot fail; a failure would only weaken the
        // memo, which the `0xff` marker then keeps from matching anything serialized.
        if serde_json::to_writer(&mut *self, value).is_err() {
            self.0.update([0xff]);
        }
        self.0.update([0]);
    }

    fn finish(self) -> [u8; 16] {
        let digest = self.0.finalize();
        let mut out = [0u8; 16];
        out.copy_from_slice(&digest[..16]);
        out
    }
}

/// Hash of what the pool takes from the GpuNode: its driver, inventory and driver version.
pub fn inventory_hash(gpunode: &GpuNode) -> [u8; 16] {
    let status = gpunode.status.as_ref();
    let mut h = HashWriter::new();
    h.add(&gpunode.spec.driver);
    h.add(&status.and_then(|s| s.gpus.as_ref()));
    h.add(
        &status
            .and_then(|s| s.plugin.as_ref())
            .and_then(|p| p.driver_version.as_ref()),
    );
    h.finish()
}

/// Everything else a node's pool and its diff depend on.
pub struct PoolInputs<'a> {
    /// [`inventory_hash`] of the GpuNode.
    pub inventory: [u8; 16],
    /// The node, its UID and labels.
    pub node: &'a NodeRef<'a>,
    /// Every MigPolicy.
    pub policies: &'a [Arc<MigPolicy>],
    /// The devices claims hold.
    pub allocated: &'a BTreeSet<String>,
    /// The generation the status records.
    pub published_generation: Option<i64>,
    /// The node's cached slices.
    pub cached: &'a [Arc<SliceMeta>],
}

impl PoolInputs<'_> {
    /// Their hash.
    pub fn hash(&self) -> [u8; 16] {
        let mut h = HashWriter::new();
        h.0.update(self.inventory);
        h.add(&(self.node.name, self.node.uid, self.node.labels));
        let mut policies: Vec<(&Option<String>, &migdra_api::policy::MigPolicySpec)> = self
            .policies
            .iter()
            .map(|p| (&p.metadata.name, &p.spec))
            .collect();
        policies.sort_by(|a, b| a.0.cmp(b.0));
        h.add(&policies);
        h.add(self.allocated);
        h.add(&self.published_generation);
        let slices: Vec<(&Option<String>, &Option<String>)> = self
            .cached
            .iter()
            .map(|s| (&s.metadata.name, &s.metadata.resource_version))
            .collect();
        h.add(&slices);
        h.finish()
    }
}

/// The result of a reconciliation that did not fail outright.
struct Outcome {
    action: Action,
    /// A problem reported in the status and an event, but not retried with backoff (it
    /// needs a policy or inventory change, which triggers a reconcile anyway).
    reported: Option<Error>,
}

impl Outcome {
    fn done(action: Action) -> Self {
        Self {
            action,
            reported: None,
        }
    }

    /// A reconciliation that kept or published the pool, requeued after `requeue`, or sooner
    /// when its status write was deferred (so it goes out soon after the slice writes).
    fn published(requeue: Duration, status: &status::StatusUpdate) -> Self {
        let requeue = match status {
            status::StatusUpdate::Deferred(_) => requeue.min(STATUS_DEFER_RECHECK),
            _ => requeue,
        };
        Self::done(Action::requeue(requeue))
    }
}

/// Whether a status write may wait for other reconciliations' slice writes (see the module
/// docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Urgency {
    /// `Published=True`: may wait.
    Deferrable,
    /// Explains why devices vanished or were refused: written at once.
    Now,
}

/// Reconciles one GpuNode (the kube-runtime reconciler).
pub async fn reconcile(gpunode: Arc<GpuNode>, ctx: Arc<Context>) -> Result<Action, Error> {
    let node = gpunode.name_any();
    let span = tracing::info_span!("reconcile", node = %node);
    async move {
        let _timer = ctx.metrics.reconcile_timer();
        match reconcile_node(&gpunode, &ctx).await {
            Ok(outcome) => {
                match &outcome.reported {
                    Some(e) => ctx.metrics.reconcile_failed(e.metric_label()),
                    None => ctx.metrics.reconcile_ok(),
                }
                ctx.reset_backoff(&node);
                Ok(outcome.action)
            }
            Err(e) => {
                ctx.metrics.reconcile_failed(e.metric_label());
                if !e.is_transient() {
                    tracing::warn!(error = %e, "reconcile failed");
                    report_failure(&gpunode, &ctx, &e).await;
                } else {
                    tracing::debug!(error = %e, "reconcile raced; retrying");
                }
                Err(e)
            }
        }
    }
    .instrument(span)
    .await
}

/// The error policy: requeue with an exponential backoff per GpuNode (1 s, 2 s, 4 s, … up
/// to 2 minutes), reset by the next success.
pub fn error_policy(gpunode: Arc<GpuNode>, error: &Error, ctx: Arc<Context>) -> Action {
    let attempt = ctx.next_attempt(&gpunode.name_any());
    let delay = backoff(attempt);
    tracing::debug!(node = %gpunode.name_any(), %error, ?delay, "requeue after error");
    Action::requeue(delay)
}

/// The backoff after `attempt` consecutive failures (1-based).
pub fn backoff(attempt: u32) -> Duration {
    let exponent = attempt.saturating_sub(1).min(16);
    BACKOFF_BASE.saturating_mul(1 << exponent).min(BACKOFF_MAX)
}

async fn reconcile_node(gpunode: &GpuNode, ctx: &Context) -> Result<Outcome, Error> {
    ctx.wait_ready().await?;
    let node_name = gpunode.name_any();
    let cached = ctx.node_slices(&node_name);
    if let Some(wait) = ctx.expectations.pending(&node_name, &cached) {
        tracing::debug!(?wait, "waiting for the slice cache to catch up with our writes");
        return Ok(Outcome::done(Action::requeue(wait.max(MIN_REQUEUE))));
    }
    if gpunode.spec.driver != ctx.config.driver {
        // Another driver's node: none of our slices belong there, and its status is not ours.
        tracing::debug!(driver = %gpunode.spec.driver, "GpuNode of another driver");
        withdraw(ctx, &node_name, &cached).await?;
        return Ok(Outcome::done(Action::await_change()));
    }
    // While the cache still shows the GpuNode as it was before the controller's last status
    // write, that write is what the server has.
    let written = ctx.status_ledger.publication(gpunode);
    let published = written
        .as_ref()
        .or_else(|| gpunode.status.as_ref().and_then(|s| s.publication.as_ref()));
    let Some(node) = ctx.nodes.get(&ObjectRef::new(&node_name)) else {
        tracing::info!("Node is gone; withdrawing its pool");
        ctx.set_not_live(&node_name);
        let publication = withdrawn(ctx, &node_name, &cached, published);
        withdraw(ctx, &node_name, &cached).await?;
        ctx.metrics.forget_node(&node_name);
        let message = format!("Node {node_name} does not exist; the pool is withdrawn");
        write_status(
            gpunode,
            ctx,
            publication,
            &Published::no(reason::NODE_NOT_FOUND, message),
            Urgency::Now,
        )
        .await?;
        return Ok(Outcome::done(Action::await_change()));
    };
    let (wiped_at, newly_missing) = ctx.expectations.wiped(&node_name, &cached);
    if newly_missing > 0 {
        ctx.metrics.slices_wiped(newly_missing);
    }
    let now = Timestamp::now();
    let plugin = gpunode.status.as_ref().and_then(|s| s.plugin.as_ref());
    let lease = ctx.lease_beat(&node_name);
    let (_, hold) = ctx.heartbeat_census(now);
    let state = liveness(
        plugin,
        lease.as_ref(),
        now,
        ctx.config.heartbeat_timeout,
        wiped_at,
        hold,
    );
    let state = match state {
        // Expiry alone is checked against the API server and rate-limited; a pool already
        // withdrawn needs neither.
        Liveness::Gone(GoneReason::HeartbeatExpired { last, timeout }) if !cached.is_empty() => {
            confirm_expiry(ctx, &node_name, (last, timeout), wiped_at, hold).await?
        }
        state => state,
    };
    let requeue = match state {
        Liveness::Gone(why) => {
            ctx.set_not_live(&node_name);
            ctx.metrics.set_plugin_live(&node_name, false);
            if !cached.is_empty() || matches!(why, GoneReason::SlicesWiped { .. }) {
                tracing::info!(reason = %why.message(), "plugin is not live; withdrawing the pool");
            }
            let publication = withdrawn(ctx, &node_name, &cached, published);
            withdraw(ctx, &node_name, &cached).await?;
            ctx.metrics.set_published_devices(&node_name, 0);
            let condition = Published::no(reason::PLUGIN_NOT_READY, why.message());
            write_status(gpunode, ctx, publication, &condition, Urgency::Now).await?;
            // The plugin's next heartbeat (a GpuNode change or a Lease renewal) brings the
            // node back.
            return Ok(Outcome::done(Action::await_change()));
        }
        Liveness::Held { last } => {
            ctx.set_not_live(&node_name);
            ctx.metrics.set_plugin_live(&node_name, false);
            tracing::debug!(%last, "heartbeat expired, but expiry withdrawals are held back: keeping the pool");
            HELD_RECHECK
        }
        Liveness::Live { expires } => {
            ctx.set_live(&node_name, expires);
            ctx.metrics.set_plugin_live(&node_name, true);
            if let Some(at) = wiped_at {
                tracing::info!(%at, "the plugin heartbeated after its slices were wiped; republishing");
                ctx.expectations.wipe_answered(&node_name, at);
            }
            // The expiry watch looks at the node at its heartbeat's expiry.
            LIVE_RESYNC
        }
    };

    let policies = ctx.policies.state();
    let node_ref = NodeRef {
        name: &node_name,
        uid: node.metadata.uid.as_deref(),
        labels: node.labels(),
    };
    let allocated = ctx.allocated_devices(&node_name);
    let memo = ctx.memo(&node_name);
    let gpunode_version = gpunode.metadata.resource_version.clone();
    let inventory = match &memo {
        Some(m) if gpunode_version.is_some() && m.gpunode_version == gpunode_version => m.inventory,
        _ => inventory_hash(&ctx.geometries.restore(gpunode)),
    };
    let inputs = PoolInputs {
        inventory,
        node: &node_ref,
        policies: &policies,
        allocated: &allocated,
        published_generation: published.map(|p| p.generation),
        cached: &cached,
    }
    .hash();
    if let Some(memo) = memo.filter(|m| m.inputs == inputs) {
        tracing::trace!("inputs and slices unchanged; pool up to date");
        ctx.metrics
            .set_published_devices(&node_name, memo.publication.devices);
        let condition = Published::yes(memo.message.clone());
        let update = write_status(gpunode, ctx, memo.publication, &condition, Urgency::Deferrable).await?;
        return Ok(Outcome::published(requeue, &update));
    }
    ctx.set_memo(&node_name, None);
    // The cached GpuNode holds no profile tables (see `crate::geometry_cache`).
    let full = ctx.geometries.restore(gpunode);
    let desired = match desired_pool(
        &full,
        node_ref,
        policies.iter().map(|p| p.as_ref()),
        &ctx.config.driver,
        &allocated,
    ) {
        Ok(desired) => desired,
        Err(problem) => {
            let error = match problem {
                DesiredError::Policy(source) => Error::Policy {
                    node: node_name.clone(),
                    source,
                },
                DesiredError::Invalid(problems) => Error::InvalidPool {
                    node: node_name.clone(),
                    problems: problems.join("; "),
                },
            };
            tracing::warn!(%error, "not publishing");
            let publication = published.cloned().unwrap_or_else(|| PublicationStatus {
                pool: pool_name(&node_name, &ctx.config.driver),
                ..PublicationStatus::default()
            });
            let condition = Published::no(error.reason(), error.to_string());
            if write_status(gpunode, ctx, publication, &condition, Urgency::Now)
                .await?
                .wrote()
            {
                publish_event(gpunode, ctx, &error).await;
            }
            return Ok(Outcome {
                action: Action::requeue(requeue),
                reported: Some(error),
            });
        }
    };

    if !desired.retention.kept.is_empty() || !desired.retention.dropped.is_empty() {
        tracing::debug!(
            kept = ?desired.retention.kept,
            dropped = ?desired.retention.dropped,
            "allocated devices that are no longer offered"
        );
    }
    let slices = desired.slices.len();
    let desired_names: Vec<String> = desired.slices.iter().map(|s| s.name_any()).collect();
    let mut diff = diff_pool(desired.slices, &cached, published.map(|p| p.generation));
    let tainted = tainted_replacements(&diff);
    if !tainted.is_empty() {
        // The cache has no specs: read the live slices whose taints a rewrite must keep the
        // times of (rare: only devices claims hold that the policy stopped offering).
        let live = live_slices(ctx, &tainted).await?;
        keep_taint_times(&mut diff, &live);
    }
    let diff_was_empty = diff.is_empty();
    let generation = diff.generation;
    let mut written = Vec::new();
    if diff_was_empty {
        tracing::debug!(generation, "pool unchanged");
    } else {
        tracing::info!(
            generation,
            writes = diff.writes.len(),
            deletes = diff.deletes.len(),
            devices = desired.devices,
            "publishing pool"
        );
        // Counted while it writes: the status writes of other nodes wait for it.
        let _writing = ctx.writing_slices();
        written = publisher(ctx, &node_name).apply(diff).await?;
    }
    ctx.expectations.own(&node_name, desired_names.clone());
    ctx.metrics.set_published_devices(&node_name, desired.devices);
    ctx.metrics.set_published_pool(&node_name, slices, desired.gpus);
    let publication = PublicationStatus {
        pool: desired.pool,
        generation,
        slices: u32::try_from(slices).unwrap_or(u32::MAX),
        devices: desired.devices,
        gpus: desired.gpus,
        policy: desired.policy,
    };
    let message = format!(
        "{} devices of {} GPUs in {} slices, generation {}",
        publication.devices, publication.gpus, publication.slices, publication.generation
    );
    if diff_was_empty {
        // The cache shows exactly the desired pool: the same inputs next time need no work.
        ctx.set_memo(
            &node_name,
            Some(Memo {
                gpunode_version,
                inventory,
                inputs,
                publication: publication.clone(),
                message: message.clone(),
            }),
        );
    }
    let update = write_status(
        gpunode,
        ctx,
        publication.clone(),
        &Published::yes(message.clone()),
        Urgency::Deferrable,
    )
    .await?;
    if !diff_was_empty && let Some(after) = cache_after_publish(&desired_names, &written, &cached) {
        // The pool was just written: the reconciliations its own slice and status events
        // trigger will see exactly these inputs once the caches caught up, so they need no
        // planning either (if anything else changed, the hash differs and they do the work).
        // A deferred status leaves the GpuNode as cached: they see the generation it shows
        // now, and the memo takes them straight to the status write.
        let published_generation = match update {
            status::StatusUpdate::Deferred(_) => published.map(|p| p.generation),
            _ => Some(generation),
        };
        let inputs = PoolInputs {
            inventory,
            node: &node_ref,
            policies: &policies,
            allocated: &allocated,
            published_generation,
            cached: &after,
        }
        .hash();
        ctx.set_memo(
            &node_name,
            Some(Memo {
                gpunode_version: update.version().map(str::to_string),
                inventory,
                inputs,
                publication,
                message,
            }),
        );
    }
    Ok(Outcome::published(requeue, &update))
}

/// What the slice cache will show for a node once it caught up with a publication: every
/// desired slice, with the resourceVersion of the write when it was written and as cached
/// otherwise (only names and versions: what [`PoolInputs`] hashes), in the cache's order
/// (by name). `None` when a desired slice is neither written nor cached (nothing to predict).
pub fn cache_after_publish(
    desired: &[String],
    written: &[(String, Option<String>)],
    cached: &[Arc<SliceMeta>],
) -> Option<Vec<Arc<SliceMeta>>> {
    let mut after = desired
        .iter()
        .map(|name| {
            let version = match written.iter().find(|(w, _)| w == name) {
                Some((_, version)) => version.clone(),
                None => cached
                    .iter()
                    .find(|s| s.metadata.name.as_ref() == Some(name))?
                    .metadata
                    .resource_version
                    .clone(),
            };
            Some(Arc::new(SliceMeta {
                metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                    name: Some(name.clone()),
                    resource_version: version,
                    ..Default::default()
                },
                ..Default::default()
            }))
        })
        .collect::<Option<Vec<_>>>()?;
    after.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    Some(after)
}

fn publisher<'a>(ctx: &'a Context, node: &'a str) -> Publisher<'a> {
    Publisher {
        api: &ctx.slice_api,
        expectations: &ctx.expectations,
        metrics: &ctx.metrics,
        node,
    }
}

/// The live versions of the named slices (those that exist).
async fn live_slices(ctx: &Context, names: &[String]) -> Result<Vec<ResourceSlice>, Error> {
    let mut live = Vec::with_capacity(names.len());
    for name in names {
        match ctx.slice_api.get_opt(name).await {
            Ok(Some(slice)) => live.push(slice),
            Ok(None) => {}
            Err(e) => return Err(Error::slice_write("get", name, e)),
        }
    }
    Ok(live)
}

/// What a heartbeat expiry seen in the cache (last beat `cached_last`, after which `timeout`
/// applied) really is. The cache
/// is only as fresh as the watch, and a watch behind an overloaded API server makes every
/// heartbeat look older than it is; so before a pool is withdrawn for expiry alone, a quorum
/// read of the node's GpuNode and Lease decides ([`Context::fresh_heartbeat`]). When the
/// rate limit would hold the pool anyway, or the beat is no later than renewals arrive right
/// now ([`Context::heartbeat_allowance`]), no read is made. A failed read keeps the pool
/// (an error: retried with backoff); the kubelet still wipes the slices of a plugin that
/// really died.
async fn confirm_expiry(
    ctx: &Context,
    node: &str,
    (cached_last, timeout): (Timestamp, Duration),
    wiped_at: Option<Timestamp>,
    hold: bool,
) -> Result<Liveness, Error> {
    let allowance = ctx.heartbeat_allowance();
    let excused_until = cached_last + timeout + allowance;
    if Timestamp::now() < excused_until {
        ctx.metrics.heartbeat_expiry_excused();
        tracing::info!(
            last = %cached_last,
            allowance_seconds = allowance.as_secs_f64(),
            until = %excused_until,
            "heartbeat expired, but renewals reach the controller this late right now (the \
             control plane is slow): keeping the pool"
        );
        return Ok(Liveness::Held { last: cached_last });
    }
    if !ctx.expiry_withdrawal_due() {
        return Ok(held_by_rate_limit(cached_last));
    }
    let (plugin, lease) = match ctx.fresh_heartbeat(node).await {
        Ok(fresh) => fresh,
        Err(e) => {
            ctx.metrics.heartbeat_expiry_checked(ExpiryCheck::Failed);
            tracing::warn!(error = %e, "keeping the pool: its heartbeat expiry could not be confirmed");
            return Err(e);
        }
    };
    let now = Timestamp::now();
    let fresh = liveness(
        plugin.as_ref(),
        lease.as_ref(),
        now,
        ctx.config.heartbeat_timeout,
        wiped_at,
        hold,
    );
    match fresh {
        Liveness::Gone(GoneReason::HeartbeatExpired { last, .. }) => {
            ctx.metrics.heartbeat_expiry_checked(ExpiryCheck::Confirmed);
            if ctx.allow_expiry_withdrawal() {
                Ok(fresh)
            } else {
                Ok(held_by_rate_limit(last))
            }
        }
        Liveness::Live { expires } => {
            ctx.metrics.heartbeat_expiry_checked(ExpiryCheck::Refuted);
            let fresh_last = plugin.as_ref().map_or(Timestamp::UNIX_EPOCH, |p| {
                beat(p, lease.as_ref(), now, ctx.config.heartbeat_timeout).last
            });
            tracing::warn!(
                cached_last = %cached_last,
                fresh_last = %fresh_last,
                lag_seconds = fresh_last.duration_since(cached_last).as_secs_f64(),
                "the cache showed an expired heartbeat, the API server a live one: the \
                 controller's watch lags; keeping the pool"
            );
            Ok(Liveness::Live { expires })
        }
        // Gone for another reason (unregistered, no status) is the server's word too.
        other => {
            ctx.metrics.heartbeat_expiry_checked(ExpiryCheck::Confirmed);
            Ok(other)
        }
    }
}

/// An expiry the withdrawal rate limit holds back (see `Context::allow_expiry_withdrawal`).
fn held_by_rate_limit(last: Timestamp) -> Liveness {
    tracing::info!(%last, "heartbeat expired, but another pool was withdrawn for expiry moments ago: keeping this one for now");
    Liveness::Held { last }
}

/// Deletes every cached slice of the node.
async fn withdraw(ctx: &Context, node: &str, cached: &[Arc<SliceMeta>]) -> Result<(), Error> {
    ctx.set_memo(node, None);
    let diff = diff_pool(Vec::new(), cached, None);
    if !diff.is_empty() {
        publisher(ctx, node).apply(diff).await?;
    }
    Ok(())
}

/// The publication of a withdrawn pool: nothing, but the last generation is kept so the next
/// publication continues above it.
fn withdrawn(
    ctx: &Context,
    node: &str,
    cached: &[Arc<SliceMeta>],
    published: Option<&PublicationStatus>,
) -> PublicationStatus {
    let generation = cached
        .iter()
        .filter_map(|s| cached_generation(s))
        .chain(published.map(|p| p.generation))
        .max()
        .unwrap_or(0);
    PublicationStatus {
        pool: pool_name(node, &ctx.config.driver),
        generation,
        ..PublicationStatus::default()
    }
}

/// Writes the status unless the GpuNode shows it already, or, when `urgency` allows, while
/// other reconciliations are writing slices (see [`Context::defer_status`]).
async fn write_status(
    gpunode: &GpuNode,
    ctx: &Context,
    publication: PublicationStatus,
    published: &Published,
    urgency: Urgency,
) -> Result<status::StatusUpdate, Error> {
    let node = gpunode.name_any();
    let desired = status::desired_status(gpunode, publication, published, Timestamp::now());
    let defer = || urgency == Urgency::Deferrable && ctx.defer_status(&node);
    let update = status::update(&ctx.gpunode_api, &ctx.status_ledger, gpunode, &desired, defer).await?;
    if matches!(update, status::StatusUpdate::Deferred(_)) {
        ctx.metrics.status_write_deferred();
        tracing::debug!(
            slice_writers = ctx.slice_writers(),
            "other reconciliations are writing slices: the status write waits"
        );
    } else {
        ctx.status_settled(&node);
    }
    Ok(update)
}

/// Reports a failed reconciliation: a Warning event, and the condition (publication kept).
async fn report_failure(gpunode: &GpuNode, ctx: &Context, error: &Error) {
    publish_event(gpunode, ctx, error).await;
    if matches!(error, Error::StatusPatch { .. }) {
        return;
    }
    let node = gpunode.name_any();
    let publication = gpunode
        .status
        .as_ref()
        .and_then(|s| s.publication.clone())
        .unwrap_or_else(|| PublicationStatus {
            pool: pool_name(&node, &ctx.config.driver),
            ..PublicationStatus::default()
        });
    let condition = Published::no(error.reason(), error.to_string());
    if let Err(e) = write_status(gpunode, ctx, publication, &condition, Urgency::Now).await {
        tracing::warn!(error = %e, "recording the failure in the status failed");
    }
}

async fn publish_event(gpunode: &GpuNode, ctx: &Context, error: &Error) {
    let event = Event {
        type_: EventType::Warning,
        reason: error.reason().to_string(),
        note: Some(truncate(&error.to_string(), 1024)),
        action: "Publish".to_string(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &gpunode.object_ref(&())).await {
        tracing::warn!(error = %e, "publishing an event failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_inputs_hash_changes_with_every_input() {
        use std::collections::BTreeMap;

        use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
        use migdra_api::{
            catalog,
            inventory::{GpuNodeSpec, GpuNodeStatus},
            policy::MigPolicySpec,
        };

        let mut g = GpuNode::new(
            "n",
            GpuNodeSpec {
                node_name: "n".into(),
                driver: "gpu.migdra.dev".into(),
            },
        );
        let model = catalog::model("H100-80GB").unwrap();
        g.status = Some(GpuNodeStatus {
            gpus: Some(vec![model.inventory(0, true)]),
            ..Default::default()
        });
        let inventory = inventory_hash(&g);
        let mut unhealthy = g.clone();
        unhealthy.status.as_mut().unwrap().gpus.as_mut().unwrap()[0]
            .health
            .healthy = false;
        assert_ne!(inventory_hash(&unhealthy), inventory);

        let labels = BTreeMap::from([("gpu".to_string(), "h100".to_string())]);
        let node = NodeRef {
            name: "n",
            uid: Some("u1"),
            labels: &labels,
        };
        let policies = vec![Arc::new(MigPolicy::new("p", MigPolicySpec::default()))];
        let allocated = BTreeSet::new();
        let slice = |rv: &str| {
            Arc::new(SliceMeta {
                metadata: ObjectMeta {
                    name: Some("s".into()),
                    resource_version: Some(rv.into()),
                    ..Default::default()
                },
                ..Default::default()
            })
        };
        let cached = vec![slice("1")];
        let base = PoolInputs {
            inventory,
            node: &node,
            policies: &policies,
            allocated: &allocated,
            published_generation: Some(1),
            cached: &cached,
        };
        let hash = base.hash();
        assert_eq!(hash, base.hash(), "deterministic");

        let other_inventory = PoolInputs {
            inventory: inventory_hash(&unhealthy),
            ..base
        };
        let relabelled = BTreeMap::from([("gpu".to_string(), "a100".to_string())]);
        let relabelled_node = NodeRef {
            labels: &relabelled,
            ..node
        };
        let recreated_node = NodeRef {
            uid: Some("u2"),
            ..node
        };
        let changed_policy = vec![Arc::new(MigPolicy::new(
            "p",
            MigPolicySpec {
                profiles: vec!["1g".into()],
                ..Default::default()
            },
        ))];
        let held = BTreeSet::from(["gpu-0-mig-1g10gb-0".to_string()]);
        let rewritten = vec![slice("2")];
        let variants = [
            other_inventory.hash(),
            PoolInputs {
                node: &relabelled_node,
                ..base
            }
            .hash(),
            PoolInputs {
                node: &recreated_node,
                ..base
            }
            .hash(),
            PoolInputs {
                policies: &changed_policy,
                ..base
            }
            .hash(),
            PoolInputs {
                allocated: &held,
                ..base
            }
            .hash(),
            PoolInputs {
                published_generation: Some(2),
                ..base
            }
            .hash(),
            PoolInputs {
                cached: &rewritten,
                ..base
            }
            .hash(),
        ];
        for (i, v) in variants.iter().enumerate() {
            assert_ne!(*v, hash, "variant {i}");
        }
    }

    #[test]
    fn the_cache_after_a_publish_has_the_written_versions_and_keeps_the_rest() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
        let slice = |name: &str, rv: &str| {
            Arc::new(SliceMeta {
                metadata: ObjectMeta {
                    name: Some(name.into()),
                    resource_version: Some(rv.into()),
                    ..Default::default()
                },
                ..Default::default()
            })
        };
        let names = |v: &[Arc<SliceMeta>]| -> Vec<(Option<String>, Option<String>)> {
            v.iter()
                .map(|s| (s.metadata.name.clone(), s.metadata.resource_version.clone()))
                .collect()
        };
        // b rewritten, a unchanged, c deleted (not desired), d created.
        let cached = vec![slice("a", "1"), slice("b", "2"), slice("c", "3")];
        let desired = vec!["d".to_string(), "b".to_string(), "a".to_string()];
        let written = vec![
            ("b".to_string(), Some("10".to_string())),
            ("d".to_string(), Some("11".to_string())),
        ];
        let after = cache_after_publish(&desired, &written, &cached).expect("predictable");
        let some = |s: &str| Some(s.to_string());
        assert_eq!(
            names(&after),
            vec![
                (some("a"), some("1")),
                (some("b"), some("10")),
                (some("d"), some("11"))
            ]
        );
        // A desired slice neither written nor cached: nothing to predict.
        let missing = vec!["a".to_string(), "e".to_string()];
        assert!(cache_after_publish(&missing, &written, &cached).is_none());
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        assert_eq!(backoff(1), Duration::from_secs(1));
        assert_eq!(backoff(2), Duration::from_secs(2));
        assert_eq!(backoff(5), Duration::from_secs(16));
        assert_eq!(backoff(8), BACKOFF_MAX);
        assert_eq!(backoff(u32::MAX), BACKOFF_MAX);
    }
}
