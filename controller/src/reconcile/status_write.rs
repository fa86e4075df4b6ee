//! Recording a reconciliation's outcome: the GpuNode status (written only on change, and
//! deferred while slices are written when [`Urgency`] allows) and, for a problem, a Warning
//! event.

use k8s_openapi::jiff::Timestamp;
use kube::{
    Resource, ResourceExt,
    runtime::events::{Event, EventType},
};
use migdra_api::inventory::{GpuNode, PublicationStatus, pool_name};

use super::NodeView;
use crate::{
    context::Context,
    error::Error,
    status::{self, Published, StatusUpdate, truncate},
};

/// Whether a status write may wait for other reconciliations' slice writes (see
/// [`crate::status_deferral`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Urgency {
    /// `Published=True`: may wait.
    Deferrable,
    /// Explains why devices vanished or were refused: written at once.
    Now,
}

impl NodeView<'_> {
    pub(super) async fn write_status(
        &self,
        publication: PublicationStatus,
        published: &Published,
        urgency: Urgency,
    ) -> Result<StatusUpdate, Error> {
        write(self.gpunode, self.ctx, publication, published, urgency).await
    }
}

/// Writes the status unless the GpuNode shows it already, or, when `urgency` allows, while
/// other reconciliations are writing slices.
async fn write(
    gpunode: &GpuNode,
    ctx: &Context,
    publication: PublicationStatus,
    published: &Published,
    urgency: Urgency,
) -> Result<StatusUpdate, Error> {
    let node = gpunode.name_any();
    let desired = status::desired_status(gpunode, publication, published, Timestamp::now());
    let defer = || urgency == Urgency::Deferrable && ctx.status_deferral.defer(&node);
    let update = status::update(&ctx.gpunode_api, &ctx.status_ledger, gpunode, &desired, defer).await?;
    if matches!(update, StatusUpdate::Deferred(_)) {
        ctx.metrics.status_write_deferred();
        tracing::debug!(
            slice_writers = ctx.status_deferral.slice_writers(),
            "other reconciliations are writing slices: the status write waits"
        );
    } else {
        ctx.status_deferral.settled(&node);
    }
    Ok(update)
}

/// Reports a failed reconciliation: a Warning event, and the condition (publication kept).
pub(super) async fn report_failure(gpunode: &GpuNode, ctx: &Context, error: &Error) {
    publish_event(gpunode, ctx, error).await;
    if matches!(error, Error::StatusPatch { .. }) {
        return;
    }
    let published = gpunode.status.as_ref().and_then(|s| s.publication.clone());
    let publication = kept(published, &gpunode.name_any(), ctx);
    let condition = Published::no(error.reason(), error.to_string());
    if let Err(e) = write(gpunode, ctx, publication, &condition, Urgency::Now).await {
        tracing::warn!(error = %e, "recording the failure in the status failed");
    }
}

/// `published`, or else an empty publication of `node`'s pool.
pub(super) fn kept(published: Option<PublicationStatus>, node: &str, ctx: &Context) -> PublicationStatus {
    published.unwrap_or_else(|| PublicationStatus {
        pool: pool_name(node, &ctx.config.driver),
        ..PublicationStatus::default()
    })
}

/// Publishes a Warning event about `gpunode` for `error`.
pub(super) async fn publish_event(gpunode: &GpuNode, ctx: &Context, error: &Error) {
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
