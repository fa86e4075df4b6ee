//! The liveness phase: whether the node's plugin is live (see [`crate::liveness`]), with a
//! heartbeat expiry seen in the cache confirmed against the API server before it counts, and
//! what that means for the node's bookkeeping (live set, metrics, answered wipes).

use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

use super::NodeView;
use crate::{
    error::Error,
    liveness::{GoneReason, LeaseBeat, Liveness, liveness},
};

/// Judges the liveness of `view`'s plugin and records it.
pub(super) async fn judge(view: &NodeView<'_>) -> Result<Liveness, Error> {
    let (ctx, node) = (view.ctx, view.name.as_str());
    let (wiped_at, newly_missing) = ctx.expectations.wiped(node, &view.cached);
    if newly_missing > 0 {
        ctx.metrics.slices_wiped(newly_missing);
    }
    let now = Timestamp::now();
    let plugin = view.gpunode.status.as_ref().and_then(|s| s.plugin.as_ref());
    let lease = ctx.heartbeats.lease_beat(node);
    let (_, hold) = ctx.heartbeats.census(now);
    let judge = |lease: Option<&LeaseBeat>, now| {
        liveness(plugin, lease, now, ctx.config.heartbeat_timeout, wiped_at, hold)
    };
    let state = match judge(lease.as_ref(), now) {
        // Expiry alone is checked against the API server and rate-limited; a pool already
        // withdrawn needs neither.
        Liveness::Gone(GoneReason::HeartbeatExpired { last, timeout }) if !view.cached.is_empty() => {
            confirm_expiry(view, (last, timeout), judge).await?
        }
        state => state,
    };
    if let Liveness::Live { expires } = state {
        ctx.heartbeats.set_live(node, expires);
        ctx.metrics.set_plugin_live(node, true);
        if let Some(at) = wiped_at {
            tracing::info!(%at, "the plugin heartbeated after its slices were wiped; republishing");
            ctx.expectations.wipe_answered(node, at);
        }
    } else {
        ctx.heartbeats.set_not_live(node);
        ctx.metrics.set_plugin_live(node, false);
        if let Liveness::Held { last } = state {
            tracing::debug!(%last, "heartbeat expired, but expiry withdrawals are held back: keeping the pool");
        }
    }
    Ok(state)
}

/// What a heartbeat expiry seen in the cache (last beat `cached_last`, then `timeout`) really
/// is. A watch behind an overloaded API server makes every heartbeat look older, so before a
/// pool is withdrawn for expiry alone a quorum read of the Lease decides
/// ([`crate::liveness::HeartbeatTracker::fresh_lease_beat`]); no read is made when the rate
/// limit would hold the pool anyway or the beat is no later than renewals arrive right now
/// ([`crate::liveness::HeartbeatTracker::allowance`]). A failed read keeps the pool (an error,
/// retried with backoff); the kubelet still wipes a dead plugin's slices. `judge` gives the
/// liveness for a heartbeat at a time.
async fn confirm_expiry(
    view: &NodeView<'_>,
    (cached_last, timeout): (Timestamp, Duration),
    judge: impl Fn(Option<&LeaseBeat>, Timestamp) -> Liveness,
) -> Result<Liveness, Error> {
    let (ctx, heartbeats) = (view.ctx, &view.ctx.heartbeats);
    let allowance = heartbeats.allowance();
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
    if !heartbeats.expiry_withdrawal_due() {
        return Ok(held_by_rate_limit(cached_last));
    }
    let lease = match heartbeats.fresh_lease_beat(&view.name).await {
        Ok(fresh) => fresh,
        Err(e) => {
            ctx.metrics.heartbeat_expiry_checked("failed");
            tracing::warn!(error = %e, "keeping the pool: its heartbeat expiry could not be confirmed");
            return Err(e);
        }
    };
    let fresh = judge(lease.as_ref(), Timestamp::now());
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
            let fresh_last = lease.map_or(Timestamp::UNIX_EPOCH, |l| l.renewed);
            tracing::warn!(
                cached_last = %cached_last,
                fresh_last = %fresh_last,
                lag_seconds = fresh_last.duration_since(cached_last).as_secs_f64(),
                "the cache showed an expired heartbeat, the API server a live one: the \
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
fn held_by_rate_limit(last: Timestamp) -> Liveness {
    tracing::info!(%last, "heartbeat expired, but another pool was withdrawn for expiry moments ago: keeping this one for now");
    Liveness::Held { last }
}
