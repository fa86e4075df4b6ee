//! Taking a node's pool down: its slices deleted, the status saying why.

use kube::runtime::controller::Action;
use migdra_api::inventory::{PublicationStatus, pool_name};

use super::{NodeView, Outcome, status_write::Urgency};
use crate::{
    compare::{cached_generation, diff_pool},
    error::Error,
    liveness::GoneReason,
    status::{Published, reason},
};

/// The Node is gone: withdraw the pool and forget the node's metrics.
pub(super) async fn node_gone(view: &NodeView<'_>) -> Result<Outcome, Error> {
    tracing::info!("Node is gone; withdrawing its pool");
    let (ctx, node) = (view.ctx, view.name.as_str());
    ctx.heartbeats.set_not_live(node);
    let publication = withdrawn(view);
    slices(view).await?;
    ctx.metrics.forget_node(node);
    let message = format!("Node {node} does not exist; the pool is withdrawn");
    let condition = Published::no(reason::NODE_NOT_FOUND, message);
    view.write_status(publication, &condition, Urgency::Now).await?;
    Ok(Outcome::done(Action::await_change()))
}

/// The plugin is not live (for `why`): withdraw the pool until its next heartbeat (a GpuNode
/// change or a Lease renewal) brings the node back.
pub(super) async fn plugin_gone(view: &NodeView<'_>, why: &GoneReason) -> Result<Outcome, Error> {
    if !view.cached.is_empty() || matches!(why, GoneReason::SlicesWiped { .. }) {
        tracing::info!(reason = %why.message(), "plugin is not live; withdrawing the pool");
    }
    let publication = withdrawn(view);
    slices(view).await?;
    view.ctx.metrics.set_published_devices(&view.name, 0);
    let condition = Published::no(reason::PLUGIN_NOT_READY, why.message());
    view.write_status(publication, &condition, Urgency::Now).await?;
    Ok(Outcome::done(Action::await_change()))
}

/// Deletes every cached slice of the node.
pub(super) async fn slices(view: &NodeView<'_>) -> Result<(), Error> {
    view.ctx.memos.set(&view.name, None);
    let diff = diff_pool(Vec::new(), &view.cached, None);
    if !diff.is_empty() {
        crate::publish::apply(view.ctx, &view.name, diff).await?;
    }
    Ok(())
}

/// The publication of a withdrawn pool: nothing, but the last generation is kept so the next
/// publication continues above it.
fn withdrawn(view: &NodeView<'_>) -> PublicationStatus {
    let generation = view
        .cached
        .iter()
        .filter_map(|s| cached_generation(s))
        .chain(view.published_generation())
        .max()
        .unwrap_or(0);
    PublicationStatus {
        pool: pool_name(&view.name, &view.ctx.config.driver),
        generation,
        ..PublicationStatus::default()
    }
}
