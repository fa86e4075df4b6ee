//! One reconciliation of one GpuNode: decide what the node's pool should be, diff it against
//! the cached slices, write the difference, record the outcome in the status.
//!
//! * Node gone → withdraw the pool (delete its slices), `Published=False NodeNotFound`.
//! * Plugin not live (see [`crate::liveness`]) → withdraw, `Published=False PluginNotReady`;
//!   the plugin's next heartbeat brings the node back. Heartbeat expiry is held back while
//!   the node's kubelet Lease was not seen renewing either, or most heartbeats expire at once,
//!   withdraws only once a fresh read of the Lease confirms it, and at most one pool per 10 s.
//! * Plugin live → policy, plan (keeping the devices claims hold), render, validate; an
//!   invalid policy or pool is reported (event + condition) and nothing is written; otherwise
//!   only a real change is written, with a new generation when the upstream slice controller
//!   would bump it. The expiry watch hands the node back at its heartbeat's expiry unless it
//!   was renewed; otherwise a resync every [`LIVE_RESYNC`].
//! * Slices first, statuses after: a `Published=True` status that would change the GpuNode
//!   waits while other reconciliations write slices (see [`crate::status_deferral`]); the node
//!   is looked at again within `STATUS_DEFER_RECHECK`. A status that explains a withdrawal,
//!   a failure or a refused policy or pool is written at once.
//!
//! Short circuit. Most reconciliations change nothing (a resync, a MigPolicy change that
//! leaves this pool as it is, the events of the controller's own writes). So a reconciliation
//! that found the pool up to date leaves a [`memo::Memo`]: a hash of everything the pool is
//! computed from and of the cached slices' versions. The next one with the same hash only
//! confirms the status. A reconciliation that wrote the pool leaves the memo the caches will
//! match once they show its writes, so the reconciliations its own events trigger skip the
//! work too.
//!
//! The phases, one submodule each: `heartbeat` judges the plugin's liveness, `withdraw` takes
//! a pool down, `pool` computes and publishes a live node's pool, `status_write` records the
//! outcome.

mod heartbeat;
pub mod memo;
mod pool;
mod status_write;
mod withdraw;

use std::{sync::Arc, time::Duration};

use kube::{
    ResourceExt,
    runtime::{controller::Action, reflector::ObjectRef},
};
use migdra_api::inventory::{GpuNode, PublicationStatus};
use tracing::Instrument;

use crate::{compare::SliceMeta, context::Context, error::Error, liveness::Liveness, status::StatusUpdate};

/// How often a live node is reconciled when nothing changes: a safety net, as every input
/// is watched and the expiry watch looks at its heartbeat's expiry.
pub const LIVE_RESYNC: Duration = Duration::from_secs(300);
/// How often a node whose heartbeat expiry is held back is looked at again.
const HELD_RECHECK: Duration = Duration::from_secs(10);
const MIN_REQUEUE: Duration = Duration::from_secs(1);
/// How soon a node whose status write was deferred is looked at again.
const STATUS_DEFER_RECHECK: Duration = Duration::from_secs(2);

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
    fn published(requeue: Duration, status: &StatusUpdate) -> Self {
        let requeue = match status {
            StatusUpdate::Deferred(_) => requeue.min(STATUS_DEFER_RECHECK),
            _ => requeue,
        };
        Self::done(Action::requeue(requeue))
    }
}

/// What every phase of one reconciliation reads about its node.
struct NodeView<'a> {
    ctx: &'a Context,
    gpunode: &'a GpuNode,
    name: String,
    cached: Vec<Arc<SliceMeta>>,
    /// The publication the server has: the controller's last status write while the cache
    /// still shows the GpuNode as it was before it, else the cached status.
    published: Option<PublicationStatus>,
}

impl<'a> NodeView<'a> {
    fn observe(ctx: &'a Context, gpunode: &'a GpuNode) -> Self {
        let name = gpunode.name_any();
        let cached = ctx.slice_index.node_slices(&name);
        let published = ctx
            .status_ledger
            .publication(gpunode)
            .or_else(|| gpunode.status.as_ref().and_then(|s| s.publication.clone()));
        Self {
            ctx,
            gpunode,
            name,
            cached,
            published,
        }
    }

    fn published_generation(&self) -> Option<i64> {
        self.published.as_ref().map(|p| p.generation)
    }
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
                ctx.backoff.succeeded(&node);
                Ok(outcome.action)
            }
            Err(e) => {
                ctx.metrics.reconcile_failed(e.metric_label());
                if !e.is_transient() {
                    tracing::warn!(error = %e, "reconcile failed");
                    status_write::report_failure(&gpunode, &ctx, &e).await;
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

/// The error policy: requeue with the node's backoff (see [`crate::backoff`]).
pub fn error_policy(gpunode: Arc<GpuNode>, error: &Error, ctx: Arc<Context>) -> Action {
    let delay = ctx.backoff.failed(&gpunode.name_any());
    tracing::debug!(node = %gpunode.name_any(), %error, ?delay, "requeue after error");
    Action::requeue(delay)
}

/// Observe the node, judge its plugin's liveness, then withdraw the pool or publish it.
async fn reconcile_node(gpunode: &GpuNode, ctx: &Context) -> Result<Outcome, Error> {
    ctx.wait_ready().await?;
    let view = NodeView::observe(ctx, gpunode);
    if let Some(wait) = ctx.expectations.pending(&view.name, &view.cached) {
        tracing::debug!(?wait, "waiting for the slice cache to catch up with our writes");
        return Ok(Outcome::done(Action::requeue(wait.max(MIN_REQUEUE))));
    }
    if gpunode.spec.driver != ctx.config.driver {
        // Another driver's node: none of our slices belong there, and its status is not ours.
        tracing::debug!(driver = %gpunode.spec.driver, "GpuNode of another driver");
        withdraw::slices(&view).await?;
        return Ok(Outcome::done(Action::await_change()));
    }
    let Some(node) = ctx.stores.nodes.get(&ObjectRef::new(&view.name)) else {
        return withdraw::node_gone(&view).await;
    };
    let requeue = match heartbeat::judge(&view).await? {
        Liveness::Gone(why) => return withdraw::plugin_gone(&view, &why).await,
        Liveness::Held { .. } => HELD_RECHECK,
        // The expiry watch looks at the node at its heartbeat's expiry.
        Liveness::Live { .. } => LIVE_RESYNC,
    };
    pool::publish(&view, &node, requeue).await
}
