//! The liveness phase: whether the node's plugin is live (see [`crate::liveness`]), with a
//! heartbeat expiry seen in the cache confirmed against the API server before it counts, and
//! what that means for the node's bookkeeping (live set, metrics, answered wipes).

use std::time::Instant;

use super::NodeView;
use crate::{
    error::Error,
    liveness::{GoneReason, Heartbeat, Liveness, later, liveness},
};

/// Judges the liveness of `view`'s plugin and records it.
pub(super) async fn judge(view: &NodeView<'_>) -> Result<Liveness, Error> {
    let (ctx, node) = (view.ctx, view.name.as_str());
    let (wiped_at, newly_missing) = ctx.expectations.wiped(node, &view.cached);
    if newly_missing > 0 {
        ctx.metrics.slices_wiped(newly_missing);
    }
    let now = Instant::now();
    let plugin = view.gpunode.status.as_ref().and_then(|s| s.plugin.as_ref());
    let heartbeat = ctx.heartbeats.heartbeat(node);
    let (_, hold) = ctx.heartbeats.census(now);
    let judge = |heartbeat: Option<&Heartbeat>, now| {
        liveness(
            plugin,
            heartbeat,
            now,
            ctx.config.heartbeat_timeout,
            wiped_at,
            hold,
        )
    };
    let state = match (judge(heartbeat.as_ref(), now), &heartbeat) {
        // Expiry alone is checked against the API server and rate-limited; a pool already
        // withdrawn needs neither.
        (Liveness::Gone(GoneReason::HeartbeatExpired { .. }), Some(cached)) if !view.cached.is_empty() => {
            confirm_expiry(view, cached, judge).await?
        }
        (state, _) => state,
    };
    if let Liveness::Live { expires } = state {
        ctx.heartbeats.set_live(node, expires);
        ctx.metrics.set_plugin_live(node, true);
        if let Some(at) = wiped_at {
            tracing::info!("the plugin heartbeated after its slices were wiped; republishing");
            ctx.expectations.wipe_answered(node, at);
        }
    } else {
        ctx.heartbeats.set_not_live(node);
        ctx.metrics.set_plugin_live(node, false);
        match (&state, &heartbeat) {
            (Liveness::Held { last }, Some(heartbeat)) if !heartbeat.silence_witnessed() => {
                ctx.metrics.heartbeat_expiry_unwitnessed();
                tracing::debug!(
                    %last,
                    "heartbeat expired, but the node's kubelet Lease was not observed renewing \
                     since the plugin's renewal fell due either (the controller's view of the \
                     node stopped, not the plugin): keeping the pool"
                );
            }
            (Liveness::Held { last }, _) => {
                tracing::debug!(%last, "heartbeat expired, but expiry withdrawals are held back: keeping the pool");
            }
            _ => {}
        }
    }
    Ok(state)
}

/// What a heartbeat expiry seen in the cache (the `cached` heartbeat) really is. A watch
/// behind an overloaded API server delivers renewals late, so before a pool is withdrawn for
/// expiry alone a quorum read of the Lease decides
/// ([`crate::liveness::HeartbeatTracker::fresh_heartbeat`]; a later renewal it shows counts as
/// observed now); no read is made when the rate limit would hold the pool anyway or the beat
/// is no later than renewals arrive right now
/// ([`crate::liveness::HeartbeatTracker::allowance`]). A failed read keeps the pool (an error,
/// retried with backoff); the kubelet still wipes a dead plugin's slices. `judge` gives the
/// liveness for a heartbeat at an instant.
async fn confirm_expiry(
    view: &NodeView<'_>,
    cached: &Heartbeat,
    judge: impl Fn(Option<&Heartbeat>, Instant) -> Liveness,
) -> Result<Liveness, Error> {
    let (ctx, heartbeats) = (view.ctx, &view.ctx.heartbeats);
    let cached_last = cached.beat.renewed;
    let allowance = heartbeats.allowance();
    let excused_until = later(cached.expires(ctx.config.heartbeat_timeout), allowance);
    let now = Instant::now();
    if now < excused_until {
        ctx.metrics.heartbeat_expiry_excused();
        tracing::info!(
            last = %cached_last,
            allowance_seconds = allowance.as_secs_f64(),
            excused_for_seconds = excused_until.duration_since(now).as_secs_f64(),
            "heartbeat expired, but renewals reach the controller this late right now (the \
             control plane is slow): keeping the pool"
        );
        return Ok(Liveness::Held { last: cached_last });
    }
    if !heartbeats.expiry_withdrawal_due() {
        return Ok(held_by_rate_limit(cached_last));
    }
    let fresh_heartbeat = match heartbeats.fresh_heartbeat(&view.name).await {
        Ok(fresh) => fresh,
        Err(e) => {
            ctx.metrics.heartbeat_expiry_checked("failed");
            tracing::warn!(error = %e, "keeping the pool: its heartbeat expiry could not be confirmed");
            return Err(e);
        }
    };
    let fresh = judge(fresh_heartbeat.as_ref(), Instant::now());
    ctx.metrics
        .heartbeat_expiry_checked(if matches!(fresh, Liveness::Live { .. }) {
            "refuted"
        } else {
            "confirmed"
        });
    match fresh {
        Liveness::Gone(GoneReason::HeartbeatExpired { last, .. })
            if !heartbeats.allow_expiry_withdrawal() =>
        {
            Ok(held_by_rate_limit(last))
        }
        Liveness::Live { .. } => {
            tracing::warn!(
                cached_last = %cached_last,
                fresh_last = ?fresh_heartbeat.map(|h| h.beat.renewed),
                "the cache showed an expired heartbeat, the API server a later renewal: the \
                 controller's watch lags; keeping the pool"
            );
            Ok(fresh)
        }
        // Gone for another reason (the Lease was deleted) is the server's word too.
        other => Ok(other),
    }
}

/// An expiry the withdrawal rate limit holds back (see
/// [`crate::liveness::HeartbeatTracker::allow_expiry_withdrawal`]).
fn held_by_rate_limit(last: k8s_openapi::jiff::Timestamp) -> Liveness {
    tracing::info!(%last, "heartbeat expired, but another pool was withdrawn for expiry moments ago: keeping this one for now");
    Liveness::Held { last }
}
