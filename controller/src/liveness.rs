//! Whether a node's kubelet plugin is alive, from what it writes into its `GpuNode`.
//!
//! A plugin is live while it reports itself registered with the kubelet and its heartbeat
//! is fresh. The heartbeat expires after `max(timeout, 3 × heartbeatIntervalSeconds)`, so a
//! plugin configured with a slow heartbeat is not declared dead between two beats.

use std::time::Duration;

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use migdra_api::inventory::PluginStatus;

/// Heartbeats a plugin may miss before it counts as gone.
pub const MISSED_HEARTBEATS: u32 = 3;

/// A plugin's liveness.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// The plugin is live until `expires` unless it heartbeats again.
    Live {
        /// When the current heartbeat goes stale.
        expires: Timestamp,
    },
    /// The plugin is gone: its pool must be withdrawn.
    Gone(GoneReason),
}

/// Why a plugin counts as gone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GoneReason {
    /// The plugin never wrote its status.
    NoStatus,
    /// The kubelet has not (or no longer) registered the plugin.
    NotRegistered {
        /// The registration error the plugin reported, if any.
        error: Option<String>,
    },
    /// The last heartbeat is older than the timeout.
    HeartbeatExpired {
        /// Time of the last heartbeat.
        last: Timestamp,
        /// The timeout that applied.
        timeout: Duration,
    },
}

impl GoneReason {
    /// A human-readable explanation, for conditions and logs.
    pub fn message(&self) -> String {
        match self {
            Self::NoStatus => "the kubelet plugin has not reported its status".to_string(),
            Self::NotRegistered { error: None } => {
                "the kubelet plugin is not registered with the kubelet".to_string()
            }
            Self::NotRegistered { error: Some(e) } => {
                format!("the kubelet plugin is not registered with the kubelet: {e}")
            }
            Self::HeartbeatExpired { last, timeout } => format!(
                "the kubelet plugin's last heartbeat ({last}) is older than {}s",
                timeout.as_secs()
            ),
        }
    }
}

/// The timeout that applies to a plugin heartbeating every `interval_seconds`.
pub fn effective_timeout(timeout: Duration, interval_seconds: u32) -> Duration {
    timeout.max(Duration::from_secs(
        u64::from(interval_seconds) * u64::from(MISSED_HEARTBEATS),
    ))
}

/// Decides whether the plugin described by `plugin` is live at `now`.
pub fn liveness(plugin: Option<&PluginStatus>, now: Timestamp, timeout: Duration) -> Liveness {
    let Some(plugin) = plugin else {
        return Liveness::Gone(GoneReason::NoStatus);
    };
    if !plugin.registered {
        return Liveness::Gone(GoneReason::NotRegistered {
            error: plugin.registration_error.clone(),
        });
    }
    let timeout = effective_timeout(timeout, plugin.heartbeat_interval_seconds);
    let last = plugin.heartbeat_time.0;
    let span = SignedDuration::try_from(timeout).unwrap_or(SignedDuration::MAX);
    let expires = last.checked_add(span).unwrap_or(Timestamp::MAX);
    if now >= expires {
        Liveness::Gone(GoneReason::HeartbeatExpired { last, timeout })
    } else {
        Liveness::Live { expires }
    }
}

/// How long from `now` until `expires`, at least `min`. A heartbeat from a clock ahead of
/// ours cannot push the wait beyond `cap`.
pub fn until(expires: Timestamp, now: Timestamp, min: Duration, cap: Duration) -> Duration {
    let wait = expires.duration_since(now);
    Duration::try_from(wait)
        .unwrap_or(Duration::ZERO)
        .clamp(min, cap.max(min))
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;

    fn plugin(registered: bool, heartbeat: Timestamp, interval: u32) -> PluginStatus {
        PluginStatus {
            version: "0.1.0".into(),
            registered,
            registration_error: (!registered).then(|| "socket gone".to_string()),
            start_time: Time(heartbeat),
            heartbeat_time: Time(heartbeat),
            heartbeat_interval_seconds: interval,
            driver_version: None,
        }
    }

    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + s).unwrap()
    }

    #[test]
    fn live_until_the_timeout() {
        let timeout = Duration::from_secs(60);
        let p = plugin(true, ts(0), 15);
        assert_eq!(
            liveness(Some(&p), ts(10), timeout),
            Liveness::Live { expires: ts(60) }
        );
        assert_eq!(
            liveness(Some(&p), ts(59), timeout),
            Liveness::Live { expires: ts(60) }
        );
        assert!(matches!(
            liveness(Some(&p), ts(60), timeout),
            Liveness::Gone(GoneReason::HeartbeatExpired { timeout: t, .. }) if t == timeout
        ));
    }

    #[test]
    fn slow_heartbeats_stretch_the_timeout() {
        let p = plugin(true, ts(0), 30);
        assert_eq!(
            effective_timeout(Duration::from_secs(60), 30),
            Duration::from_secs(90)
        );
        assert_eq!(
            liveness(Some(&p), ts(89), Duration::from_secs(60)),
            Liveness::Live { expires: ts(90) }
        );
        assert!(matches!(
            liveness(Some(&p), ts(90), Duration::from_secs(60)),
            Liveness::Gone(GoneReason::HeartbeatExpired { .. })
        ));
    }

    #[test]
    fn unregistered_or_silent_plugins_are_gone() {
        assert_eq!(
            liveness(None, ts(0), Duration::from_secs(60)),
            Liveness::Gone(GoneReason::NoStatus)
        );
        let p = plugin(false, ts(0), 15);
        let gone = liveness(Some(&p), ts(1), Duration::from_secs(60));
        assert_eq!(
            gone,
            Liveness::Gone(GoneReason::NotRegistered {
                error: Some("socket gone".into())
            })
        );
        let Liveness::Gone(reason) = gone else {
            unreachable!()
        };
        assert!(reason.message().contains("socket gone"));
    }

    #[test]
    fn requeue_delay_is_bounded() {
        let min = Duration::from_secs(1);
        let cap = Duration::from_secs(60);
        assert_eq!(until(ts(30), ts(0), min, cap), Duration::from_secs(30));
        assert_eq!(until(ts(0), ts(30), min, cap), min, "already expired");
        assert_eq!(until(ts(3600), ts(0), min, cap), cap, "clock skew");
    }
}
