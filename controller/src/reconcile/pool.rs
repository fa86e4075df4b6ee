//! A live node's pool: confirmed from the memo when nothing changed (see
//! [`super::memo`]), else computed ([`desired_pool`]), refused when its policy or the pool
//! is invalid, or diffed against the cached slices and written, and recorded in the status.

use std::time::Duration;

use k8s_openapi::api::{core::v1::Node, resource::v1::ResourceSlice};
use kube::{ResourceExt, core::PartialObjectMeta, runtime::controller::Action};
use migdra_api::inventory::PublicationStatus;

use super::{
    NodeView, Outcome,
    memo::{Memo, PoolInputs, cache_after_publish, inventory_hash},
    status_write::{Urgency, kept, publish_event},
};
use crate::{
    compare::{diff_pool, keep_taint_times, tainted_replacements},
    desired::{DesiredError, DesiredPool, NodeRef, desired_pool},
    error::Error,
    status::{Published, StatusUpdate},
};

/// Publishes the pool of `view`'s node (`node` is its metadata), requeued after `requeue`.
pub(super) async fn publish(
    view: &NodeView<'_>,
    node: &PartialObjectMeta<Node>,
    requeue: Duration,
) -> Result<Outcome, Error> {
    let ctx = view.ctx;
    let policies = ctx.stores.policies.state();
    let node_ref = NodeRef {
        name: &view.name,
        uid: node.metadata.uid.as_deref(),
        labels: node.labels(),
    };
    let allocated = ctx.allocated_devices(&view.name);
    let memo = ctx.memos.get(&view.name);
    let inputs = PoolInputs {
        inventory: inventory(view, memo.as_ref()),
        node: &node_ref,
        policies: &policies,
        allocated: &allocated,
    };
    let hash = inputs.hash(view.published_generation(), &view.cached);
    if let Some(memo) = memo.filter(|m| m.inputs == hash) {
        tracing::trace!("inputs and slices unchanged; pool up to date");
        ctx.metrics
            .set_published_devices(&view.name, memo.publication.devices);
        let condition = Published::yes(memo.message.clone());
        let update = view
            .write_status(memo.publication, &condition, Urgency::Deferrable)
            .await?;
        return Ok(Outcome::published(requeue, &update));
    }
    ctx.memos.set(&view.name, None);
    // The cached GpuNode holds no profile tables (see `crate::geometry_cache`).
    let full = ctx.geometries.restore(view.gpunode);
    let desired = desired_pool(
        &full,
        node_ref,
        policies.iter().map(|p| p.as_ref()),
        &ctx.config.driver,
        ctx.config.pool,
        &allocated,
    );
    match desired {
        Ok(desired) => {
            let publication = write(view, desired).await?;
            record(view, &inputs, hash, publication, requeue).await
        }
        Err(problem) => refuse(view, problem, requeue).await,
    }
}

/// The inventory hash of `view`'s GpuNode: the memo's while the GpuNode is the version it
/// was taken of, else computed.
fn inventory(view: &NodeView<'_>, memo: Option<&Memo>) -> [u8; 16] {
    let version = &view.gpunode.metadata.resource_version;
    match memo {
        Some(m) if version.is_some() && &m.gpunode_version == version => m.inventory,
        _ => inventory_hash(&view.ctx.geometries.restore(view.gpunode)),
    }
}

/// What a publication left behind.
struct Publication {
    status: PublicationStatus,
    names: Vec<String>,
    /// The slices written, with the resourceVersions the server gave them; `None` when the
    /// pool was up to date.
    written: Option<Vec<(String, Option<String>)>>,
}

/// Diffs the `desired` pool against the cached slices and writes the difference; the
/// controller owns the pool's slices from then on.
async fn write(view: &NodeView<'_>, desired: DesiredPool) -> Result<Publication, Error> {
    let DesiredPool {
        pool,
        slices,
        devices,
        gpus,
        policy,
        retention,
    } = desired;
    if !retention.kept.is_empty() || !retention.dropped.is_empty() {
        tracing::debug!(
            kept = ?retention.kept,
            dropped = ?retention.dropped,
            "allocated devices that are no longer offered"
        );
    }
    let names: Vec<String> = slices.iter().map(|s| s.name_any()).collect();
    let mut diff = diff_pool(slices, &view.cached, view.published_generation());
    let tainted = tainted_replacements(&diff);
    if !tainted.is_empty() {
        // The cache has no specs: read the live slices whose taints a rewrite must keep the
        // times of (rare: only devices claims hold that the policy stopped offering).
        let live = live_slices(view, &tainted).await?;
        keep_taint_times(&mut diff, &live);
    }
    let generation = diff.generation;
    let written = if diff.is_empty() {
        tracing::debug!(generation, "pool unchanged");
        None
    } else {
        tracing::info!(
            generation,
            writes = diff.writes.len(),
            deletes = diff.deletes.len(),
            devices,
            "publishing pool"
        );
        // Counted while it writes: the status writes of other nodes wait for it.
        let _writing = view.ctx.status_deferral.writing_slices();
        Some(crate::publish::apply(view.ctx, &view.name, diff).await?)
    };
    view.ctx.expectations.own(&view.name, names.clone());
    view.ctx.metrics.set_published_devices(&view.name, devices);
    view.ctx.metrics.set_published_pool(&view.name, names.len(), gpus);
    let status = PublicationStatus {
        pool,
        generation,
        slices: u32::try_from(names.len()).unwrap_or(u32::MAX),
        devices,
        gpus,
        policy,
    };
    Ok(Publication {
        status,
        names,
        written,
    })
}

/// Records `publication` in the status and leaves the memo of the pool it published (`hash`
/// is the hash of `inputs` before it).
async fn record(
    view: &NodeView<'_>,
    inputs: &PoolInputs<'_>,
    hash: [u8; 16],
    publication: Publication,
    requeue: Duration,
) -> Result<Outcome, Error> {
    let Publication {
        status,
        names,
        written,
    } = publication;
    let message = format!(
        "{} devices of {} GPUs in {} slices, generation {}",
        status.devices, status.gpus, status.slices, status.generation
    );
    let memo = |inputs_hash: [u8; 16], gpunode_version: Option<String>| Memo {
        gpunode_version,
        inventory: inputs.inventory,
        inputs: inputs_hash,
        publication: status.clone(),
        message: message.clone(),
    };
    if written.is_none() {
        // The cache shows exactly the desired pool: the same inputs next time need no work.
        let version = view.gpunode.metadata.resource_version.clone();
        view.ctx.memos.set(&view.name, Some(memo(hash, version)));
    }
    let condition = Published::yes(message.clone());
    let update = view
        .write_status(status.clone(), &condition, Urgency::Deferrable)
        .await?;
    if let Some(written) = written
        && let Some(after) = cache_after_publish(&names, &written, &view.cached)
    {
        // The pool was just written: the reconciliations its own events trigger see exactly these
        // inputs once the caches catch up, so they skip planning too (anything else changed, the hash
        // differs). A deferred status leaves the GpuNode as cached, with the generation it shows now.
        let generation_after = match update {
            StatusUpdate::Deferred(_) => view.published_generation(),
            _ => Some(status.generation),
        };
        let hash_after = inputs.hash(generation_after, &after);
        let version = update.version().map(str::to_string);
        view.ctx.memos.set(&view.name, Some(memo(hash_after, version)));
    }
    Ok(Outcome::published(requeue, &update))
}

/// Reports a policy or pool that cannot be published (event + condition) and writes nothing;
/// the publication the status shows is kept.
async fn refuse(view: &NodeView<'_>, problem: DesiredError, requeue: Duration) -> Result<Outcome, Error> {
    let node = view.name.clone();
    let error = match problem {
        DesiredError::Policy(source) => Error::Policy { node, source },
        DesiredError::Invalid(problems) => Error::InvalidPool {
            node,
            problems: problems.join("; "),
        },
    };
    tracing::warn!(%error, "not publishing");
    let publication = kept(view.published.clone(), &view.name, view.ctx);
    let condition = Published::no(error.reason(), error.to_string());
    if view
        .write_status(publication, &condition, Urgency::Now)
        .await?
        .wrote()
    {
        publish_event(view.gpunode, view.ctx, &error).await;
    }
    Ok(Outcome {
        action: Action::requeue(requeue),
        reported: Some(error),
    })
}

/// The live versions of the named slices (those that exist).
async fn live_slices(view: &NodeView<'_>, names: &[String]) -> Result<Vec<ResourceSlice>, Error> {
    let mut live = Vec::with_capacity(names.len());
    for name in names {
        match view.ctx.slice_api.get_opt(name).await {
            Ok(Some(slice)) => live.push(slice),
            Ok(None) => {}
            Err(e) => return Err(Error::slice_write("get", name, e)),
        }
    }
    Ok(live)
}
