//! Whether a node's kubelet plugin is alive, from what it writes into its `GpuNode` and from
//! what the kubelet did to the node's slices.
//!
//! A plugin is live while it reports itself registered with the kubelet, its heartbeat is
//! fresh, and it has heartbeated since the kubelet last wiped the node's slices.
//!
//! Timing. The plugin heartbeats every `heartbeatIntervalSeconds` (15 s by default) and at
//! once when its kubelet registration changes. The kubelet deletes a driver's node-local
//! slices 30 s after the plugin's connection drops (and all of them when it starts). A pool
//! republished after that wipe advertises devices nobody can prepare, so:
//!
//! * the heartbeat expires after `max(timeout, 1.5 × interval)`; the default timeout (25 s)
//!   withdraws a dead plugin's pool (last beat + 25 s, plus one reconcile) before the
//!   kubelet's 30 s wipe, while tolerating one beat up to 10 s late;
//! * a wipe the controller did not cause marks the plugin gone until it heartbeats again
//!   *after* the wipe was observed ([`GoneReason::SlicesWiped`]): a dead plugin never does, a
//!   plugin that re-registers with a restarted kubelet does so at once. (The heartbeat time
//!   is the node's clock, the wipe time the controller's, as for the expiry itself: clocks
//!   are assumed synchronised; a node clock behind by a few seconds only delays the return
//!   to the next beat);
//! * when more than a threshold fraction of all heartbeats expire at the same time, the
//!   likelier cause is a slow or partitioned control plane, not dead plugins: expiry alone
//!   then withdraws nothing ([`HeartbeatCensus::mass_expiry`], [`Liveness::Held`]), like the
//!   node lifecycle controller's unhealthy-zone rule. An explicit "not registered" and a
//!   kubelet wipe still withdraw;
//! * the cache is only as fresh as the watch: a single expiry is confirmed with a quorum
//!   read of the GpuNode and the Lease before the pool goes (see
//!   `reconcile::confirm_expiry`), so a watch that lags behind a saturated API server, by
//!   more than the margin between the heartbeat and the timeout, withdraws nothing.
//!
//! Two heartbeats. A plugin of this version renews a `coordination.k8s.io/v1` Lease
//! `<node>.<driver>` in the controller's namespace every beat ([`LeaseBeat`]: `renewTime`,
//! `leaseDurationSeconds` = 1.5 intervals), and rewrites its GpuNode only on change or every
//! few minutes, announcing that slow interval in `heartbeatIntervalSeconds` (so a controller
//! that reads only the GpuNode keeps its pool). Older plugins beat in the GpuNode only. The
//! Lease *counts* while it is younger than the GpuNode's own window
//! (`max(timeout, 1.5 × heartbeatIntervalSeconds)`): then the last beat is the newer of the
//! two and it expires `max(timeout, leaseDurationSeconds)` after it; a Lease left behind by a
//! downgraded plugin stops counting and the GpuNode alone decides, exactly as before. Why a
//! Lease: a renewal is a few hundred bytes the controller only re-checks liveness on, where a
//! GpuNode write carries the whole inventory, which every replica decodes and re-evaluates.

use std::time::Duration;

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use migdra_api::inventory::PluginStatus;

/// The timeout applied when nothing else is configured: below the kubelet's 30 s wipe.
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(25);

/// The kubelet deletes a driver's node-local slices this long after its plugin disconnects.
pub const KUBELET_WIPE_DELAY: Duration = Duration::from_secs(30);

/// Default fraction of registered plugins whose heartbeats must expire at once before the
/// controller blames the control plane instead (the node lifecycle controller's 0.55).
pub const DEFAULT_MASS_EXPIRY_THRESHOLD: f64 = 0.55;

/// Fewest expired heartbeats that count as a mass expiry (the node lifecycle controller also
/// needs more than two unready nodes): one or two dead plugins are just dead plugins, even on
/// a small cluster.
pub const MASS_EXPIRY_MIN_NODES: usize = 3;

/// A renewal of the node's heartbeat Lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseBeat {
    /// `spec.renewTime`.
    pub renewed: Timestamp,
    /// `spec.leaseDurationSeconds`: how long the plugin vouches for this renewal.
    pub duration: Duration,
}

/// The last beat of a plugin and when it goes stale, from its GpuNode heartbeat and its
/// Lease (see the module docs for how they combine).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Beat {
    /// Time of the last heartbeat.
    pub last: Timestamp,
    /// When it goes stale.
    pub expires: Timestamp,
    /// The timeout that applied.
    pub timeout: Duration,
}

/// Combines the GpuNode heartbeat of `plugin` with its Lease, at `now`.
pub fn beat(plugin: &PluginStatus, lease: Option<&LeaseBeat>, now: Timestamp, timeout: Duration) -> Beat {
    let gpunode_timeout = effective_timeout(timeout, plugin.heartbeat_interval_seconds);
    let gpunode_last = plugin.heartbeat_time.0;
    match lease {
        Some(lease) if now < add(lease.renewed, gpunode_timeout) => {
            let timeout = timeout.max(lease.duration);
            let last = gpunode_last.max(lease.renewed);
            Beat {
                last,
                expires: add(last, timeout),
                timeout,
            }
        }
        _ => Beat {
            last: gpunode_last,
            expires: add(gpunode_last, gpunode_timeout),
            timeout: gpunode_timeout,
        },
    }
}

fn add(t: Timestamp, d: Duration) -> Timestamp {
    let span = SignedDuration::try_from(d).unwrap_or(SignedDuration::MAX);
    t.checked_add(span).unwrap_or(Timestamp::MAX)
}

/// A plugin's liveness.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// The plugin is live until `expires` unless it heartbeats again.
    Live {
        /// When the current heartbeat goes stale.
        expires: Timestamp,
    },
    /// The heartbeat expired, but so did too many others at once to blame the plugin: the
    /// pool stays as published.
    Held {
        /// Time of the last heartbeat.
        last: Timestamp,
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
    /// Someone else (the kubelet) deleted the node's slices, and the plugin has not
    /// heartbeated since.
    SlicesWiped {
        /// When the controller observed the deletion.
        at: Timestamp,
        /// Time of the last heartbeat.
        last: Timestamp,
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
            Self::SlicesWiped { at, last } => format!(
                "the node's ResourceSlices were deleted by someone else (the kubelet does so when \
                 the plugin disconnects or the kubelet restarts) at {at}; the last heartbeat \
                 ({last}) is older, so the pool stays withdrawn until the plugin heartbeats again"
            ),
            Self::HeartbeatExpired { last, timeout } => format!(
                "the kubelet plugin's last heartbeat ({last}) is older than {}s",
                timeout.as_secs()
            ),
        }
    }
}

/// The timeout that applies to a plugin heartbeating every `interval_seconds`: at least one
/// and a half intervals, so a plugin configured with a slow heartbeat is not declared dead
/// between two punctual beats.
pub fn effective_timeout(timeout: Duration, interval_seconds: u32) -> Duration {
    timeout.max(Duration::from_millis(u64::from(interval_seconds) * 1500))
}

/// Decides whether the plugin described by `plugin` (and its heartbeat Lease, if any) is live
/// at `now`. `wiped_at` is when the controller last saw the node's slices deleted by someone
/// else, if that is still unanswered; `mass_expiry` says whether heartbeats are expiring en
/// masse ([`HeartbeatCensus::mass_expiry`]).
pub fn liveness(
    plugin: Option<&PluginStatus>,
    lease: Option<&LeaseBeat>,
    now: Timestamp,
    timeout: Duration,
    wiped_at: Option<Timestamp>,
    mass_expiry: bool,
) -> Liveness {
    let Some(plugin) = plugin else {
        return Liveness::Gone(GoneReason::NoStatus);
    };
    if !plugin.registered {
        return Liveness::Gone(GoneReason::NotRegistered {
            error: plugin.registration_error.clone(),
        });
    }
    let beat = beat(plugin, lease, now, timeout);
    let last = beat.last;
    if let Some(at) = wiped_at
        && last <= at
    {
        return Liveness::Gone(GoneReason::SlicesWiped { at, last });
    }
    if now < beat.expires {
        Liveness::Live {
            expires: beat.expires,
        }
    } else if mass_expiry {
        Liveness::Held { last }
    } else {
        Liveness::Gone(GoneReason::HeartbeatExpired {
            last,
            timeout: beat.timeout,
        })
    }
}

/// How many registered plugins there are, and how many of their heartbeats have expired, at
/// one moment: the cluster-wide view a single node's reconcile needs to tell dead plugins
/// from a sick control plane.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeartbeatCensus {
    /// Plugins that report themselves registered.
    pub registered: usize,
    /// Of those, the ones whose heartbeat has expired.
    pub expired: usize,
}

impl HeartbeatCensus {
    /// Counts `plugins` (one entry per GpuNode of this driver, with its Lease) at `now`.
    pub fn take<'a>(
        plugins: impl IntoIterator<Item = (Option<&'a PluginStatus>, Option<LeaseBeat>)>,
        now: Timestamp,
        timeout: Duration,
    ) -> Self {
        let mut census = Self::default();
        for (plugin, lease) in plugins {
            let Some(plugin) = plugin.filter(|p| p.registered) else {
                continue;
            };
            census.registered += 1;
            if now >= beat(plugin, lease.as_ref(), now, timeout).expires {
                census.expired += 1;
            }
        }
        census
    }

    /// True when more than `threshold` of the registered plugins (and at least
    /// [`MASS_EXPIRY_MIN_NODES`]) have expired heartbeats.
    pub fn mass_expiry(&self, threshold: f64) -> bool {
        self.expired >= MASS_EXPIRY_MIN_NODES && self.expired as f64 > threshold * self.registered as f64
    }
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

    fn live(p: &PluginStatus, now: Timestamp, timeout: Duration) -> Liveness {
        liveness(Some(p), None, now, timeout, None, false)
    }

    #[test]
    fn live_until_the_timeout() {
        let timeout = Duration::from_secs(25);
        let p = plugin(true, ts(0), 15);
        assert_eq!(live(&p, ts(10), timeout), Liveness::Live { expires: ts(25) });
        assert_eq!(live(&p, ts(24), timeout), Liveness::Live { expires: ts(25) });
        assert!(matches!(
            live(&p, ts(25), timeout),
            Liveness::Gone(GoneReason::HeartbeatExpired { timeout: t, .. }) if t == timeout
        ));
    }

    #[test]
    fn the_default_timeout_withdraws_before_the_kubelet_wipes() {
        // A plugin dies right after a beat on the default 15 s interval: its pool must be
        // gone before the kubelet deletes the slices 30 s after the disconnect, and a beat
        // that is a few seconds late must not withdraw it.
        let p = plugin(true, ts(0), 15);
        let timeout = effective_timeout(DEFAULT_HEARTBEAT_TIMEOUT, 15);
        assert!(timeout < KUBELET_WIPE_DELAY, "{timeout:?}");
        assert!(timeout > Duration::from_secs(15 + 5), "{timeout:?}");
        assert!(matches!(
            live(&p, ts(20), DEFAULT_HEARTBEAT_TIMEOUT),
            Liveness::Live { .. }
        ));
        assert!(matches!(
            live(&p, ts(29), DEFAULT_HEARTBEAT_TIMEOUT),
            Liveness::Gone(GoneReason::HeartbeatExpired { .. })
        ));
    }

    #[test]
    fn slow_heartbeats_stretch_the_timeout() {
        let p = plugin(true, ts(0), 60);
        assert_eq!(
            effective_timeout(Duration::from_secs(25), 60),
            Duration::from_secs(90)
        );
        assert_eq!(
            effective_timeout(Duration::from_secs(25), 3),
            Duration::from_secs(25)
        );
        assert_eq!(
            live(&p, ts(89), Duration::from_secs(25)),
            Liveness::Live { expires: ts(90) }
        );
        assert!(matches!(
            live(&p, ts(90), Duration::from_secs(25)),
            Liveness::Gone(GoneReason::HeartbeatExpired { .. })
        ));
    }

    #[test]
    fn unregistered_or_silent_plugins_are_gone() {
        assert_eq!(
            liveness(None, None, ts(0), Duration::from_secs(60), None, false),
            Liveness::Gone(GoneReason::NoStatus)
        );
        let p = plugin(false, ts(0), 15);
        let gone = live(&p, ts(1), Duration::from_secs(60));
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
    fn a_wipe_holds_until_a_newer_heartbeat() {
        let timeout = Duration::from_secs(25);
        // The heartbeat is fresh, but older than the wipe: gone.
        let p = plugin(true, ts(0), 15);
        assert_eq!(
            liveness(Some(&p), None, ts(2), timeout, Some(ts(1)), false),
            Liveness::Gone(GoneReason::SlicesWiped {
                at: ts(1),
                last: ts(0)
            })
        );
        // A heartbeat at the very instant of the wipe does not prove the plugin outlived it.
        assert!(matches!(
            liveness(Some(&p), None, ts(2), timeout, Some(ts(0)), false),
            Liveness::Gone(GoneReason::SlicesWiped { .. })
        ));
        // The plugin re-registered and beat after the wipe: live again.
        let p = plugin(true, ts(3), 15);
        assert_eq!(
            liveness(Some(&p), None, ts(4), timeout, Some(ts(1)), false),
            Liveness::Live { expires: ts(28) }
        );
        // A wipe withdraws even while heartbeats are expiring en masse.
        let p = plugin(true, ts(0), 15);
        assert!(matches!(
            liveness(Some(&p), None, ts(100), timeout, Some(ts(1)), true),
            Liveness::Gone(GoneReason::SlicesWiped { .. })
        ));
        // And "not registered" wins over everything.
        let p = plugin(false, ts(3), 15);
        assert!(matches!(
            liveness(Some(&p), None, ts(4), timeout, Some(ts(1)), true),
            Liveness::Gone(GoneReason::NotRegistered { .. })
        ));
    }

    #[test]
    fn mass_expiry_holds_only_heartbeat_expiry() {
        let timeout = Duration::from_secs(25);
        let p = plugin(true, ts(0), 15);
        assert_eq!(
            liveness(Some(&p), None, ts(60), timeout, None, true),
            Liveness::Held { last: ts(0) }
        );
        assert!(matches!(
            liveness(Some(&p), None, ts(10), timeout, None, true),
            Liveness::Live { .. }
        ));
    }

    #[test]
    fn census_counts_registered_plugins_and_their_expired_heartbeats() {
        let timeout = Duration::from_secs(25);
        let fresh = plugin(true, ts(90), 15);
        let stale = plugin(true, ts(0), 15);
        let unregistered = plugin(false, ts(0), 15);
        let census = |stale_count: usize, fresh_count: usize| {
            let plugins = std::iter::repeat_n(Some(&stale), stale_count)
                .chain(std::iter::repeat_n(Some(&fresh), fresh_count))
                .chain([Some(&unregistered), None])
                .map(|p| (p, None));
            HeartbeatCensus::take(plugins, ts(100), timeout)
        };
        assert_eq!(
            census(3, 2),
            HeartbeatCensus {
                registered: 5,
                expired: 3
            }
        );
        // 3 of 5 (60 %) is more than 55 %.
        assert!(census(3, 2).mass_expiry(0.55));
        // 3 of 6 (50 %) is not.
        assert!(!census(3, 3).mass_expiry(0.55));
        // Two dead plugins are two dead plugins, even when they are all there is.
        assert!(!census(2, 0).mass_expiry(0.55));
        assert!(census(3, 0).mass_expiry(0.55));
        // A threshold of 1 disables the rule.
        assert!(!census(10, 0).mass_expiry(1.0));
    }

    fn lease(renewed: Timestamp) -> LeaseBeat {
        LeaseBeat {
            renewed,
            duration: Duration::from_secs(23),
        }
    }

    #[test]
    fn a_lease_renewal_is_a_heartbeat_and_a_silent_lease_expires() {
        let timeout = Duration::from_secs(25);
        // A plugin of this version: the GpuNode is written every 300 s, the Lease every 15 s.
        let p = plugin(true, ts(0), 300);
        let l = lease(ts(100));
        assert_eq!(
            liveness(Some(&p), Some(&l), ts(110), timeout, None, false),
            Liveness::Live { expires: ts(125) }
        );
        // The plugin died after its renewal at 100: gone 25 s later, not 450 s after the
        // GpuNode's beat.
        assert_eq!(
            liveness(Some(&p), Some(&l), ts(125), timeout, None, false),
            Liveness::Gone(GoneReason::HeartbeatExpired {
                last: ts(100),
                timeout
            })
        );
        // A GpuNode write newer than the Lease (a registration change) counts as a beat too.
        let p_newer = plugin(true, ts(110), 300);
        assert_eq!(
            liveness(Some(&p_newer), Some(&l), ts(120), timeout, None, false),
            Liveness::Live { expires: ts(135) }
        );
        // A Lease that claims a longer window gets it.
        let slow = LeaseBeat {
            renewed: ts(100),
            duration: Duration::from_secs(90),
        };
        assert!(matches!(
            liveness(Some(&p), Some(&slow), ts(180), timeout, None, false),
            Liveness::Live { .. }
        ));
    }

    #[test]
    fn an_old_plugin_without_lease_and_a_leftover_lease_keep_the_gpunode_rule() {
        let timeout = Duration::from_secs(25);
        // An old plugin: GpuNode beats every 15 s, no Lease.
        let p = plugin(true, ts(100), 15);
        assert_eq!(
            liveness(Some(&p), None, ts(110), timeout, None, false),
            Liveness::Live { expires: ts(125) }
        );
        // Downgraded: the new plugin's Lease is left behind, older than the GpuNode's 25 s
        // window: it no longer counts, the GpuNode beats decide.
        let leftover = lease(ts(0));
        assert_eq!(
            liveness(Some(&p), Some(&leftover), ts(110), timeout, None, false),
            Liveness::Live { expires: ts(125) }
        );
        // An old controller's view of a new plugin (GpuNode only, interval 300): 450 s of
        // grace, which is what the new plugin's slow GpuNode heartbeat relies on.
        let new_plugin = plugin(true, ts(0), 300);
        assert!(matches!(
            liveness(Some(&new_plugin), None, ts(449), timeout, None, false),
            Liveness::Live { .. }
        ));
    }

    #[test]
    fn a_wipe_needs_a_lease_renewal_after_it() {
        let timeout = Duration::from_secs(25);
        let p = plugin(true, ts(0), 300);
        assert_eq!(
            liveness(
                Some(&p),
                Some(&lease(ts(100))),
                ts(106),
                timeout,
                Some(ts(105)),
                false
            ),
            Liveness::Gone(GoneReason::SlicesWiped {
                at: ts(105),
                last: ts(100)
            })
        );
        assert!(matches!(
            liveness(
                Some(&p),
                Some(&lease(ts(106))),
                ts(107),
                timeout,
                Some(ts(105)),
                false
            ),
            Liveness::Live { .. }
        ));
    }

    #[test]
    fn census_counts_lease_heartbeats() {
        let timeout = Duration::from_secs(25);
        let p = plugin(true, ts(0), 300);
        let census = HeartbeatCensus::take(
            [
                (Some(&p), Some(lease(ts(90)))),
                (Some(&p), Some(lease(ts(50)))),
                (Some(&p), None),
            ],
            ts(100),
            timeout,
        );
        assert_eq!(
            census,
            HeartbeatCensus {
                registered: 3,
                expired: 1
            },
            "the GpuNode alone (300 s interval) has not expired; the Lease renewed at 50 has"
        );
    }
}
