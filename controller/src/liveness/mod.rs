//! Whether a node's kubelet plugin is alive: from the registration it reports in its
//! `GpuNode`, the renewals of its heartbeat Lease, and what the kubelet did to the node's
//! slices. [`tracker`] holds the controller's heartbeat state; this module the rules.
//!
//! A plugin is live while it reports itself registered with the kubelet, its heartbeat Lease
//! is fresh, and it has renewed the Lease since the kubelet last wiped the node's slices.
//!
//! The heartbeat. The plugin renews a Lease in the controller's namespace (named by
//! [`migdra_api::inventory::heartbeat_lease_name`], its node in `spec.holderIdentity`) every
//! interval (15 s by default), and at once when its kubelet registration changes, with
//! `leaseDurationSeconds` = 1.5 intervals ([`LeaseBeat`]). A renewal is a few hundred bytes,
//! where a GpuNode write carries the whole inventory: the plugin writes its GpuNode only when
//! something in it changes.
//!
//! Timing. The kubelet deletes a driver's node-local slices 30 s after the plugin's connection
//! drops (and all of them when it starts). A pool republished after that wipe advertises
//! devices nobody can prepare, so:
//!
//! * the heartbeat expires `max(timeout, leaseDurationSeconds)` after the last renewal; the
//!   default timeout (25 s) withdraws a dead plugin's pool before the kubelet's 30 s wipe,
//!   while tolerating one beat up to 10 s late;
//! * a wipe the controller did not cause marks the plugin gone until it renews *after* the
//!   wipe was observed ([`GoneReason::SlicesWiped`]): a dead plugin never does, a plugin that
//!   re-registers with a restarted kubelet does so at once. (Renewal times are the node's
//!   clock, the wipe time the controller's: clocks are assumed synchronised; a node clock
//!   behind by a few seconds only delays the return to the next beat);
//! * when more than a threshold fraction of all heartbeats expire at the same time, the
//!   likelier cause is a slow or partitioned control plane: expiry alone then withdraws
//!   nothing ([`HeartbeatCensus::mass_expiry`], [`Liveness::Held`]), like the node lifecycle
//!   controller's unhealthy-zone rule. "Not registered" and a kubelet wipe still withdraw;
//! * the cache is only as fresh as the watch: a single expiry is confirmed with a quorum
//!   read of the Lease before the pool goes (see `reconcile::heartbeat`).

pub mod tracker;

use std::time::Duration;

use k8s_openapi::{
    api::coordination::v1::Lease,
    jiff::{SignedDuration, Timestamp},
};
use migdra_api::inventory::{PluginStatus, heartbeat_lease_name};

pub use tracker::HeartbeatTracker;

/// Below the kubelet's 30 s wipe.
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(25);

/// Default fraction of registered plugins whose heartbeats must expire at once before the
/// controller blames the control plane instead (the node lifecycle controller's 0.55).
pub const DEFAULT_MASS_EXPIRY_THRESHOLD: f64 = 0.55;

/// Fewest expired heartbeats that count as a mass expiry (the node lifecycle controller also
/// needs more than two unready nodes): one or two dead plugins are just dead plugins.
pub const MASS_EXPIRY_MIN_NODES: usize = 3;

/// A renewal of a node's heartbeat Lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseBeat {
    /// `spec.renewTime`.
    pub renewed: Timestamp,
    /// `spec.leaseDurationSeconds`: how long the plugin vouches for this renewal.
    pub duration: Duration,
}

impl LeaseBeat {
    /// The renewal a heartbeat Lease records, if it has one.
    pub fn of(lease: &Lease) -> Option<Self> {
        let spec = lease.spec.as_ref()?;
        let renewed = spec.renew_time.as_ref()?.0;
        let duration = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map_or(Duration::ZERO, Duration::from_secs);
        Some(Self { renewed, duration })
    }

    /// The timeout that applies to this renewal: at least `timeout`, and at least the
    /// Lease's duration, so a plugin configured with a slow heartbeat is not declared dead
    /// between two punctual beats.
    pub fn timeout(&self, timeout: Duration) -> Duration {
        timeout.max(self.duration)
    }

    /// When this renewal goes stale.
    pub fn expires(&self, timeout: Duration) -> Timestamp {
        let span = SignedDuration::try_from(self.timeout(timeout)).unwrap_or(SignedDuration::MAX);
        self.renewed.checked_add(span).unwrap_or(Timestamp::MAX)
    }
}

/// The node a heartbeat Lease of `driver` belongs to: its `spec.holderIdentity`, provided the
/// Lease carries the name [`heartbeat_lease_name`] gives that node (a Lease named for one node
/// but held by another is nobody's heartbeat).
pub fn lease_node<'a>(lease: &'a Lease, driver: &str) -> Option<&'a str> {
    let node = lease.spec.as_ref()?.holder_identity.as_deref()?;
    let name = lease.metadata.name.as_deref()?;
    (!node.is_empty() && heartbeat_lease_name(node, driver) == name).then_some(node)
}

/// A plugin's liveness.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// The plugin is live until `expires` unless it heartbeats again.
    Live { expires: Timestamp },
    /// The heartbeat (last renewed at `last`) expired, but so did too many others at once to
    /// blame the plugin: the pool stays as published.
    Held { last: Timestamp },
    /// The plugin is gone: its pool must be withdrawn.
    Gone(GoneReason),
}

/// Why a plugin counts as gone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GoneReason {
    /// The plugin never wrote its status.
    NoStatus,
    /// The kubelet has not (or no longer) registered the plugin; the error the plugin
    /// reported, if any.
    NotRegistered { error: Option<String> },
    /// The plugin has no heartbeat Lease (none yet, or it was deleted).
    NoHeartbeat,
    /// Someone else (the kubelet) deleted the node's slices (observed `at`), and the plugin
    /// has not heartbeated since `last`.
    SlicesWiped { at: Timestamp, last: Timestamp },
    /// The last heartbeat is older than the `timeout` that applied.
    HeartbeatExpired { last: Timestamp, timeout: Duration },
}

impl GoneReason {
    /// For conditions and logs.
    pub fn message(&self) -> String {
        match self {
            Self::NoStatus => "the kubelet plugin has not reported its status".to_string(),
            Self::NotRegistered { error: None } => {
                "the kubelet plugin is not registered with the kubelet".to_string()
            }
            Self::NotRegistered { error: Some(e) } => {
                format!("the kubelet plugin is not registered with the kubelet: {e}")
            }
            Self::NoHeartbeat => "the kubelet plugin has no heartbeat Lease".to_string(),
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

/// Decides whether the plugin described by `plugin`, heartbeating through `lease`, is live at
/// `now`. `wiped_at` is when the controller last saw the node's slices deleted by someone
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
    let Some(lease) = lease else {
        return Liveness::Gone(GoneReason::NoHeartbeat);
    };
    let last = lease.renewed;
    if let Some(at) = wiped_at
        && last <= at
    {
        return Liveness::Gone(GoneReason::SlicesWiped { at, last });
    }
    let expires = lease.expires(timeout);
    if now < expires {
        Liveness::Live { expires }
    } else if mass_expiry {
        Liveness::Held { last }
    } else {
        Liveness::Gone(GoneReason::HeartbeatExpired {
            last,
            timeout: lease.timeout(timeout),
        })
    }
}

/// How many registered plugins there are, and how many of their heartbeats have expired, at
/// one moment: the cluster-wide view a single node's reconcile needs to tell dead plugins
/// from a sick control plane.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeartbeatCensus {
    pub registered: usize,
    /// Registered plugins whose heartbeat has expired (or that have no Lease).
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
            if !plugin.is_some_and(|p| p.registered) {
                continue;
            }
            census.registered += 1;
            if lease.is_none_or(|lease| now >= lease.expires(timeout)) {
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
    use k8s_openapi::{
        api::coordination::v1::LeaseSpec,
        apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time},
    };
    use migdra_api::inventory::DEFAULT_DRIVER_NAME;

    use super::*;

    /// The kubelet deletes a driver's node-local slices this long after its plugin disconnects.
    const KUBELET_WIPE_DELAY: Duration = Duration::from_secs(30);

    fn plugin(registered: bool) -> PluginStatus {
        PluginStatus {
            version: "0.1.0".into(),
            registered,
            registration_error: (!registered).then(|| "socket gone".to_string()),
            start_time: Time(ts(0)),
            driver_version: None,
        }
    }

    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + s).unwrap()
    }

    /// A renewal at `renewed` of a plugin beating every 15 s (a 23 s Lease).
    fn lease(renewed: Timestamp) -> LeaseBeat {
        LeaseBeat {
            renewed,
            duration: Duration::from_secs(23),
        }
    }

    fn live(renewed: Timestamp, now: Timestamp, timeout: Duration) -> Liveness {
        liveness(
            Some(&plugin(true)),
            Some(&lease(renewed)),
            now,
            timeout,
            None,
            false,
        )
    }

    #[test]
    fn live_until_the_timeout() {
        let timeout = Duration::from_secs(25);
        assert_eq!(live(ts(0), ts(10), timeout), Liveness::Live { expires: ts(25) });
        assert_eq!(live(ts(0), ts(24), timeout), Liveness::Live { expires: ts(25) });
        assert!(matches!(
            live(ts(0), ts(25), timeout),
            Liveness::Gone(GoneReason::HeartbeatExpired { timeout: t, .. }) if t == timeout
        ));
    }

    #[test]
    fn the_default_timeout_withdraws_before_the_kubelet_wipes() {
        // A plugin dies right after a beat on the default 15 s interval: its pool must be
        // gone before the kubelet deletes the slices 30 s after the disconnect, and a beat
        // that is a few seconds late must not withdraw it.
        let timeout = lease(ts(0)).timeout(DEFAULT_HEARTBEAT_TIMEOUT);
        assert!(timeout < KUBELET_WIPE_DELAY, "{timeout:?}");
        assert!(timeout > Duration::from_secs(15 + 5), "{timeout:?}");
        assert!(matches!(
            live(ts(0), ts(20), DEFAULT_HEARTBEAT_TIMEOUT),
            Liveness::Live { .. }
        ));
        assert!(matches!(
            live(ts(0), ts(29), DEFAULT_HEARTBEAT_TIMEOUT),
            Liveness::Gone(GoneReason::HeartbeatExpired { .. })
        ));
    }

    #[test]
    fn slow_heartbeats_stretch_the_timeout() {
        // A plugin beating every 60 s vouches for 90 s.
        let slow = LeaseBeat {
            renewed: ts(0),
            duration: Duration::from_secs(90),
        };
        let timeout = Duration::from_secs(25);
        assert_eq!(slow.timeout(timeout), Duration::from_secs(90));
        assert_eq!(
            LeaseBeat {
                duration: Duration::from_secs(5),
                ..slow
            }
            .timeout(timeout),
            timeout
        );
        let at = |now| liveness(Some(&plugin(true)), Some(&slow), now, timeout, None, false);
        assert_eq!(at(ts(89)), Liveness::Live { expires: ts(90) });
        assert_eq!(
            at(ts(90)),
            Liveness::Gone(GoneReason::HeartbeatExpired {
                last: ts(0),
                timeout: Duration::from_secs(90)
            })
        );
    }

    #[test]
    fn unregistered_silent_or_leaseless_plugins_are_gone() {
        let timeout = Duration::from_secs(60);
        assert_eq!(
            liveness(None, Some(&lease(ts(0))), ts(0), timeout, None, false),
            Liveness::Gone(GoneReason::NoStatus)
        );
        let gone = liveness(
            Some(&plugin(false)),
            Some(&lease(ts(0))),
            ts(1),
            timeout,
            None,
            false,
        );
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
        // Registered but without a Lease: gone, even while heartbeats expire en masse.
        assert_eq!(
            liveness(Some(&plugin(true)), None, ts(1), timeout, None, true),
            Liveness::Gone(GoneReason::NoHeartbeat)
        );
    }

    #[test]
    fn a_wipe_holds_until_a_renewal_after_it() {
        let timeout = Duration::from_secs(25);
        let p = plugin(true);
        // The renewal is fresh, but older than the wipe: gone.
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
        // A renewal at the very instant of the wipe does not prove the plugin outlived it.
        assert!(matches!(
            liveness(
                Some(&p),
                Some(&lease(ts(105))),
                ts(106),
                timeout,
                Some(ts(105)),
                false
            ),
            Liveness::Gone(GoneReason::SlicesWiped { .. })
        ));
        // The plugin re-registered and renewed after the wipe: live again.
        assert_eq!(
            liveness(
                Some(&p),
                Some(&lease(ts(106))),
                ts(107),
                timeout,
                Some(ts(105)),
                false
            ),
            Liveness::Live { expires: ts(131) }
        );
        // A wipe withdraws even while heartbeats are expiring en masse.
        assert!(matches!(
            liveness(Some(&p), Some(&lease(ts(0))), ts(100), timeout, Some(ts(1)), true),
            Liveness::Gone(GoneReason::SlicesWiped { .. })
        ));
        // And "not registered" wins over everything.
        assert!(matches!(
            liveness(
                Some(&plugin(false)),
                Some(&lease(ts(3))),
                ts(4),
                timeout,
                Some(ts(1)),
                true
            ),
            Liveness::Gone(GoneReason::NotRegistered { .. })
        ));
    }

    #[test]
    fn mass_expiry_holds_only_heartbeat_expiry() {
        let timeout = Duration::from_secs(25);
        let p = plugin(true);
        assert_eq!(
            liveness(Some(&p), Some(&lease(ts(0))), ts(60), timeout, None, true),
            Liveness::Held { last: ts(0) }
        );
        assert!(matches!(
            liveness(Some(&p), Some(&lease(ts(0))), ts(10), timeout, None, true),
            Liveness::Live { .. }
        ));
    }

    #[test]
    fn census_counts_registered_plugins_and_their_expired_heartbeats() {
        let timeout = Duration::from_secs(25);
        let (registered, unregistered) = (plugin(true), plugin(false));
        let census = |stale: usize, fresh: usize| {
            let plugins = std::iter::repeat_n((Some(&registered), Some(lease(ts(50)))), stale)
                .chain(std::iter::repeat_n(
                    (Some(&registered), Some(lease(ts(90)))),
                    fresh,
                ))
                .chain([(Some(&unregistered), Some(lease(ts(0)))), (None, None)]);
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
        // A registered plugin without a Lease has no fresh heartbeat.
        assert_eq!(
            HeartbeatCensus::take([(Some(&registered), None)], ts(100), timeout),
            HeartbeatCensus {
                registered: 1,
                expired: 1
            }
        );
    }

    fn lease_object(name: &str, holder: Option<&str>) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(Into::into),
                lease_duration_seconds: Some(23),
                renew_time: Some(MicroTime(ts(7))),
                ..LeaseSpec::default()
            }),
        }
    }

    #[test]
    fn a_lease_maps_to_the_node_holding_it_under_that_nodes_name() {
        let driver = DEFAULT_DRIVER_NAME;
        let short = lease_object("node-a.gpu.migdra.dev", Some("node-a"));
        assert_eq!(lease_node(&short, driver), Some("node-a"));
        assert_eq!(LeaseBeat::of(&short), Some(lease(ts(7))));
        // A node name too long for `<node>.<driver>`: the Lease name is cut and hashed, the
        // holder identity carries the whole name.
        let long_node = format!("{}.example.com", "n".repeat(240));
        let long = lease_object(&heartbeat_lease_name(&long_node, driver), Some(&long_node));
        assert_eq!(lease_node(&long, driver), Some(long_node.as_str()));
        // Held by another node than the name says, of another driver, or by nobody: no node.
        let other_holder = lease_object("node-a.gpu.migdra.dev", Some("node-b"));
        assert_eq!(lease_node(&other_holder, driver), None);
        assert_eq!(lease_node(&short, "other.example.com"), None);
        assert_eq!(
            lease_node(&lease_object("node-a.gpu.migdra.dev", None), driver),
            None
        );
        assert_eq!(
            lease_node(&lease_object("migdra-controller", Some("")), driver),
            None
        );
    }
}
