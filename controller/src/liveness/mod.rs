//! Whether a node's kubelet plugin is alive: from the registration it reports in its
//! `GpuNode`, the renewals of its heartbeat Lease, and what the kubelet did to the node's
//! slices. [`tracker`] holds the controller's heartbeat state; this module the rules.
//!
//! A plugin is live while it reports itself registered with the kubelet, the controller has
//! seen its heartbeat Lease renewed recently, and it has renewed the Lease since the kubelet
//! last wiped the node's slices.
//!
//! The heartbeat. The plugin renews a Lease in the controller's namespace (named by
//! [`migdra_api::inventory::heartbeat_lease_name`], its node in `spec.holderIdentity`) every
//! interval (15 s by default), and at once when its kubelet registration changes, with
//! `leaseDurationSeconds` = 1.5 intervals ([`LeaseBeat`]). A renewal is a few hundred bytes,
//! where a GpuNode write carries the whole inventory: the plugin writes its GpuNode only when
//! something in it changes.
//!
//! Clocks. `spec.renewTime` is the node's clock, which may be minutes off the controller's.
//! So, as the node lifecycle controller does with node Leases, liveness never compares it
//! with the controller's clock: what counts is *when the controller observed* a renewal (a
//! later `renewTime` or `resourceVersion` than the last one seen), on its own monotonic clock
//! ([`Heartbeat`]). A Lease first seen after the controller starts counts as observed then,
//! so a restarted controller gives every plugin a full timeout.
//!
//! Timing. The kubelet deletes a driver's node-local slices 30 s after the plugin's connection
//! drops (and all of them when it starts). A pool republished after that wipe advertises
//! devices nobody can prepare, so:
//!
//! * the heartbeat expires `max(timeout, leaseDurationSeconds)` after the last renewal was
//!   observed; the default timeout (25 s) withdraws a dead plugin's pool before the kubelet's
//!   30 s wipe, while tolerating one beat up to 10 s late;
//! * a wipe the controller did not cause marks the plugin gone until a renewal is observed
//!   *after* the wipe was ([`GoneReason::SlicesWiped`]; both instants on the controller's
//!   clock): a dead plugin never renews, a plugin that re-registers with a restarted kubelet
//!   does so at once;
//! * a heartbeat expiry counts only when the controller saw the node go on without the
//!   plugin: the node's kubelet Lease ([`NODE_LEASE_NAMESPACE`], named after the node, renewed
//!   by the kubelet every 10 s) is the witness. An expiry is *witnessed* when the controller
//!   observed the kubelet Lease renew after the plugin's next renewal fell due ([`Witness`]);
//!   an unwitnessed one means the controller's view of the node stopped (an API server
//!   outage, a lagging watch, the controller cut off) and withdraws nothing
//!   ([`Liveness::Held`]), on any number of nodes. When observations of the node resume after
//!   a gap, the heartbeat's timeout restarts from the first fresh one, so the time the
//!   controller could not see costs no plugin its pool. A node without a kubelet Lease has no
//!   witness: its expiry counts as witnessed;
//! * when more than a threshold fraction of all heartbeats (and at least
//!   [`MASS_EXPIRY_MIN_NODES`]) expire at the same time, the likelier cause is a slow or
//!   partitioned control plane: expiry alone then withdraws nothing
//!   ([`HeartbeatCensus::mass_expiry`], [`Liveness::Held`]), like the node lifecycle
//!   controller's unhealthy-zone rule. "Not registered" and a kubelet wipe still withdraw;
//! * the cache is only as fresh as the watch: a single expiry is confirmed with a quorum
//!   read of the Lease before the pool goes, and a newer renewal that read shows counts as
//!   observed then (see `reconcile::heartbeat`).

pub mod tracker;

use std::time::{Duration, Instant};

use k8s_openapi::{api::coordination::v1::Lease, jiff::Timestamp};
use migdra_api::inventory::{PluginStatus, heartbeat_lease_name};

pub use tracker::HeartbeatTracker;

use crate::expectations::version_at_least;

/// Below the kubelet's 30 s wipe.
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(25);

/// Default fraction of registered plugins whose heartbeats must expire at once before the
/// controller blames the control plane instead (the node lifecycle controller's 0.55).
pub const DEFAULT_MASS_EXPIRY_THRESHOLD: f64 = 0.55;

/// Fewest expired heartbeats that count as a mass expiry while some heartbeats are still
/// observed (the node lifecycle controller also needs more than two unready nodes): one or
/// two dead plugins among live ones are just dead plugins.
pub const MASS_EXPIRY_MIN_NODES: usize = 3;

/// Namespace of the kubelets' node Leases, each named after its node: the witnesses.
pub const NODE_LEASE_NAMESPACE: &str = "kube-node-lease";

/// The kubelet's node Lease duration when the Lease does not say (the kubelet's default; it
/// renews every quarter of it).
pub const DEFAULT_NODE_LEASE_DURATION: Duration = Duration::from_secs(40);

/// A renewal of a node's heartbeat Lease, as the Lease records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseBeat {
    /// `spec.renewTime`, on the node's clock: shown in messages and compared only with the
    /// same node's other renewals.
    pub renewed: Timestamp,
    /// `spec.leaseDurationSeconds`: how long the plugin vouches for this renewal.
    pub duration: Duration,
    /// `metadata.resourceVersion`.
    pub version: Option<String>,
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
        let version = lease.metadata.resource_version.clone();
        Some(Self {
            renewed,
            duration,
            version,
        })
    }

    /// True when this is a later renewal than `earlier`: a later `renewTime`, or a later
    /// `resourceVersion` (so a node clock stepped back still renews, and a lagging watch
    /// delivering an older renewal does not).
    pub fn renews(&self, earlier: &Self) -> bool {
        self.renewed > earlier.renewed
            || match (&self.version, &earlier.version) {
                (Some(this), Some(before)) => this != before && version_at_least(Some(this), before),
                _ => false,
            }
    }
}

/// A renewal and when the controller first observed it (its own monotonic clock), with the
/// node's witness.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Heartbeat {
    pub beat: LeaseBeat,
    pub observed: Instant,
    /// The node's kubelet Lease as the controller observes it; `None` when the node has none.
    pub witness: Option<Witness>,
}

impl Heartbeat {
    /// The timeout that applies to this renewal: at least `timeout`, and at least the
    /// Lease's duration, so a plugin configured with a slow heartbeat is not declared dead
    /// between two punctual beats.
    pub fn timeout(&self, timeout: Duration) -> Duration {
        timeout.max(self.beat.duration)
    }

    /// When the timeout starts: when the renewal was observed, or when observations of the
    /// node resumed after a gap, whichever is later.
    pub fn since(&self) -> Instant {
        self.witness.map_or(self.observed, |w| w.since.max(self.observed))
    }

    /// When this renewal goes stale.
    pub fn expires(&self, timeout: Duration) -> Instant {
        later(self.since(), self.timeout(timeout))
    }

    /// When the plugin's next renewal falls due: a beat interval after [`Self::since`] (the
    /// plugin's Lease lasts 1.5 intervals).
    pub fn next_due(&self) -> Instant {
        later(self.since(), self.beat.duration.mul_f64(2.0 / 3.0))
    }

    /// True when the controller observed the node's kubelet Lease renew after the plugin's
    /// next renewal fell due, so the plugin's silence is the plugin's, not the controller's
    /// view of the node stopping. Without a witness, true.
    pub fn silence_witnessed(&self) -> bool {
        self.witness.is_none_or(|w| w.last >= self.next_due())
    }
}

/// A node's kubelet Lease, as the controller observes it: renewals observed one after
/// another, no two further apart than half its duration (the kubelet renews every quarter),
/// form an unbroken run; a longer gap means the controller could not see the node for a
/// while, and a new run starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Witness {
    /// When the controller observed the last renewal.
    pub last: Instant,
    /// When it observed the first renewal of the current run.
    pub since: Instant,
}

/// `at + by`, or as far after `at` as an `Instant` goes when that overflows.
pub fn later(at: Instant, by: Duration) -> Instant {
    at.checked_add(by)
        .or_else(|| at.checked_add(Duration::from_secs(u64::from(u32::MAX))))
        .unwrap_or(at)
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
    Live { expires: Instant },
    /// The heartbeat (last renewed at `last`, the node's clock) expired, but the expiry is
    /// not the plugin's to blame (unwitnessed, too many others at once, or not confirmed yet):
    /// the pool stays as published.
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
    /// Someone else (the kubelet) deleted the node's slices, and no renewal has been observed
    /// since; `last` is the last renewal's `renewTime`.
    SlicesWiped { last: Timestamp },
    /// No renewal observed for the `timeout` that applied; `last` is the last one's
    /// `renewTime`.
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
            Self::SlicesWiped { last } => format!(
                "the node's ResourceSlices were deleted by someone else (the kubelet does so when \
                 the plugin disconnects or the kubelet restarts), and no heartbeat has arrived \
                 since (the last one says {last}), so the pool stays withdrawn until the plugin \
                 heartbeats again"
            ),
            Self::HeartbeatExpired { last, timeout } => format!(
                "the kubelet plugin's last heartbeat (renewTime {last}, the node's clock) is older \
                 than {}s by the time the controller observed it",
                timeout.as_secs()
            ),
        }
    }
}

/// Decides whether the plugin described by `plugin`, heartbeating `heartbeat`, is live at
/// `now`. `wiped_at` is when the controller last saw the node's slices deleted by someone
/// else, if that is still unanswered; `mass_expiry` says whether heartbeats are expiring en
/// masse ([`HeartbeatCensus::mass_expiry`]). An expiry is held unless its silence was
/// witnessed ([`Heartbeat::silence_witnessed`]).
pub fn liveness(
    plugin: Option<&PluginStatus>,
    heartbeat: Option<&Heartbeat>,
    now: Instant,
    timeout: Duration,
    wiped_at: Option<Instant>,
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
    let Some(heartbeat) = heartbeat else {
        return Liveness::Gone(GoneReason::NoHeartbeat);
    };
    let last = heartbeat.beat.renewed;
    if wiped_at.is_some_and(|at| heartbeat.observed <= at) {
        return Liveness::Gone(GoneReason::SlicesWiped { last });
    }
    let expires = heartbeat.expires(timeout);
    if now < expires {
        Liveness::Live { expires }
    } else if mass_expiry || !heartbeat.silence_witnessed() {
        Liveness::Held { last }
    } else {
        Liveness::Gone(GoneReason::HeartbeatExpired {
            last,
            timeout: heartbeat.timeout(timeout),
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
    /// Counts `plugins` (one entry per GpuNode of this driver, with its heartbeat) at `now`.
    pub fn take<'a>(
        plugins: impl IntoIterator<Item = (Option<&'a PluginStatus>, Option<Heartbeat>)>,
        now: Instant,
        timeout: Duration,
    ) -> Self {
        let mut census = Self::default();
        for (plugin, heartbeat) in plugins {
            if !plugin.is_some_and(|p| p.registered) {
                continue;
            }
            census.registered += 1;
            if heartbeat.is_none_or(|h| now >= h.expires(timeout)) {
                census.expired += 1;
            }
        }
        census
    }

    /// True when the registered plugins' heartbeats expire en masse: more than `threshold`
    /// of them, and at least [`MASS_EXPIRY_MIN_NODES`]. A threshold of 1 disables the rule.
    pub fn mass_expiry(&self, threshold: f64) -> bool {
        threshold < 1.0
            && self.expired >= MASS_EXPIRY_MIN_NODES
            && self.expired as f64 > threshold * self.registered as f64
    }
}

#[cfg(test)]
mod tests {
    use std::sync::LazyLock;

    use k8s_openapi::{
        api::coordination::v1::LeaseSpec,
        apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time},
        jiff::SignedDuration,
    };
    use migdra_api::inventory::DEFAULT_DRIVER_NAME;

    use super::*;

    /// The kubelet deletes a driver's node-local slices this long after its plugin disconnects.
    const KUBELET_WIPE_DELAY: Duration = Duration::from_secs(30);

    /// The controller's clock at the start of every test's story.
    static START: LazyLock<Instant> = LazyLock::new(Instant::now);

    fn plugin(registered: bool) -> PluginStatus {
        PluginStatus {
            version: "0.1.0".into(),
            registered,
            registration_error: (!registered).then(|| "socket gone".to_string()),
            start_time: Time(ts(0)),
            driver_version: None,
        }
    }

    /// A time on a node's clock.
    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + s).unwrap()
    }

    /// An instant `s` seconds into the story, on the controller's clock.
    fn at(s: u64) -> Instant {
        *START + Duration::from_secs(s)
    }

    /// A renewal of a plugin beating every 15 s (a 23 s Lease), stamped `renewed` by the
    /// node and observed by the controller at `observed`.
    fn beat(renewed: Timestamp, observed: Instant) -> Heartbeat {
        Heartbeat {
            beat: LeaseBeat {
                renewed,
                duration: Duration::from_secs(23),
                version: None,
            },
            observed,
            witness: None,
        }
    }

    /// A renewal observed `s` seconds into the story, on a node whose clock agrees.
    fn synced(s: u64) -> Heartbeat {
        beat(ts(s as i64), at(s))
    }

    fn live(heartbeat: &Heartbeat, now: Instant, timeout: Duration) -> Liveness {
        liveness(Some(&plugin(true)), Some(heartbeat), now, timeout, None, false)
    }

    #[test]
    fn live_until_the_timeout() {
        let timeout = Duration::from_secs(25);
        let h = synced(0);
        assert_eq!(live(&h, at(10), timeout), Liveness::Live { expires: at(25) });
        assert_eq!(live(&h, at(24), timeout), Liveness::Live { expires: at(25) });
        assert!(matches!(
            live(&h, at(25), timeout),
            Liveness::Gone(GoneReason::HeartbeatExpired { timeout: t, .. }) if t == timeout
        ));
    }

    #[test]
    fn the_default_timeout_withdraws_before_the_kubelet_wipes() {
        // A plugin dies right after a beat on the default 15 s interval: its pool must be
        // gone before the kubelet deletes the slices 30 s after the disconnect, and a beat
        // that is a few seconds late must not withdraw it.
        let timeout = synced(0).timeout(DEFAULT_HEARTBEAT_TIMEOUT);
        assert!(timeout < KUBELET_WIPE_DELAY, "{timeout:?}");
        assert!(timeout > Duration::from_secs(15 + 5), "{timeout:?}");
        assert!(matches!(
            live(&synced(0), at(20), DEFAULT_HEARTBEAT_TIMEOUT),
            Liveness::Live { .. }
        ));
        assert!(matches!(
            live(&synced(0), at(29), DEFAULT_HEARTBEAT_TIMEOUT),
            Liveness::Gone(GoneReason::HeartbeatExpired { .. })
        ));
    }

    #[test]
    fn slow_heartbeats_stretch_the_timeout() {
        // A plugin beating every 60 s vouches for 90 s.
        let mut slow = synced(0);
        slow.beat.duration = Duration::from_secs(90);
        let timeout = Duration::from_secs(25);
        assert_eq!(slow.timeout(timeout), Duration::from_secs(90));
        let mut fast = slow.clone();
        fast.beat.duration = Duration::from_secs(5);
        assert_eq!(fast.timeout(timeout), timeout);
        let at_ = |now| liveness(Some(&plugin(true)), Some(&slow), now, timeout, None, false);
        assert_eq!(at_(at(89)), Liveness::Live { expires: at(90) });
        assert_eq!(
            at_(at(90)),
            Liveness::Gone(GoneReason::HeartbeatExpired {
                last: ts(0),
                timeout: Duration::from_secs(90)
            })
        );
    }

    #[test]
    fn node_clock_skew_neither_shortens_nor_stretches_a_heartbeat() {
        let timeout = Duration::from_secs(25);
        let minute = SignedDuration::from_secs(60);
        for skew in [-minute, minute] {
            // Renewals stamped a minute off the controller's clock, observed as they arrive:
            // live for the whole timeout after each observation, whatever the stamp says.
            let h = beat(ts(100) + skew, at(100));
            assert_eq!(live(&h, at(124), timeout), Liveness::Live { expires: at(125) });
            // A plugin whose clock runs ahead stops renewing: gone the timeout after the last
            // renewal was observed, though its stamp is still in the controller's future.
            assert!(matches!(
                live(&h, at(125), timeout),
                Liveness::Gone(GoneReason::HeartbeatExpired { last, .. }) if last == ts(100) + skew
            ));
        }
    }

    #[test]
    fn unregistered_silent_or_leaseless_plugins_are_gone() {
        let timeout = Duration::from_secs(60);
        assert_eq!(
            liveness(None, Some(&synced(0)), at(0), timeout, None, false),
            Liveness::Gone(GoneReason::NoStatus)
        );
        let gone = liveness(
            Some(&plugin(false)),
            Some(&synced(0)),
            at(1),
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
            liveness(Some(&plugin(true)), None, at(1), timeout, None, true),
            Liveness::Gone(GoneReason::NoHeartbeat)
        );
    }

    #[test]
    fn a_wipe_holds_until_a_renewal_observed_after_it() {
        let timeout = Duration::from_secs(25);
        let p = plugin(true);
        let judge =
            |h: &Heartbeat, now, wiped, hold| liveness(Some(&p), Some(h), now, timeout, Some(wiped), hold);
        // The renewal is fresh, but observed before the wipe: gone.
        assert_eq!(
            judge(&synced(100), at(106), at(105), false),
            Liveness::Gone(GoneReason::SlicesWiped { last: ts(100) })
        );
        // A renewal observed at the very instant of the wipe does not prove the plugin
        // outlived it.
        assert!(matches!(
            judge(&synced(105), at(106), at(105), false),
            Liveness::Gone(GoneReason::SlicesWiped { .. })
        ));
        // The plugin re-registered and renewed after the wipe: live again.
        assert_eq!(
            judge(&synced(106), at(107), at(105), false),
            Liveness::Live { expires: at(131) }
        );
        // Only the observation counts: a renewal stamped a minute ahead, observed before the
        // wipe, does not answer it; one stamped a minute behind, observed after, does.
        let ahead = beat(ts(160), at(100));
        assert!(matches!(
            judge(&ahead, at(106), at(105), false),
            Liveness::Gone(GoneReason::SlicesWiped { .. })
        ));
        let behind = beat(ts(46), at(106));
        assert!(matches!(
            judge(&behind, at(107), at(105), false),
            Liveness::Live { .. }
        ));
        // A wipe withdraws even while heartbeats are expiring en masse.
        assert!(matches!(
            judge(&synced(0), at(100), at(1), true),
            Liveness::Gone(GoneReason::SlicesWiped { .. })
        ));
        // And "not registered" wins over everything.
        assert!(matches!(
            liveness(
                Some(&plugin(false)),
                Some(&synced(3)),
                at(4),
                timeout,
                Some(at(1)),
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
            liveness(Some(&p), Some(&synced(0)), at(60), timeout, None, true),
            Liveness::Held { last: ts(0) }
        );
        assert!(matches!(
            liveness(Some(&p), Some(&synced(0)), at(10), timeout, None, true),
            Liveness::Live { .. }
        ));
    }

    /// `h` with a node whose kubelet renewed from `since` to `last` (seconds into the story).
    fn witnessed(mut h: Heartbeat, since: u64, last: u64) -> Heartbeat {
        h.witness = Some(Witness {
            last: at(last),
            since: at(since),
        });
        h
    }

    #[test]
    fn an_expiry_counts_only_when_the_kubelet_renewed_after_the_plugins_renewal_fell_due() {
        let timeout = Duration::from_secs(25);
        // The plugin beats every 15 s (a 23 s Lease): its renewal after the one observed at
        // 100 falls due at 115.33.
        let h = synced(100);
        assert_eq!(h.next_due(), at(100) + Duration::from_secs(23).mul_f64(2.0 / 3.0));
        // The kubelet was seen renewing at 120: the plugin's silence was witnessed, and its
        // expiry withdraws the pool, on one node too.
        assert!(matches!(
            live(&witnessed(h.clone(), 0, 120), at(125), timeout),
            Liveness::Gone(GoneReason::HeartbeatExpired { .. })
        ));
        // The kubelet was last seen at 110, before the renewal fell due: the controller's view
        // of the node stopped, not (only) the plugin. Held, as long as nothing new is seen.
        for now in [125, 200, 1000] {
            assert_eq!(
                live(&witnessed(h.clone(), 0, 110), at(now), timeout),
                Liveness::Held { last: ts(100) }
            );
        }
        // Not expired yet: live, witness or not.
        assert!(matches!(
            live(&witnessed(h.clone(), 0, 110), at(124), timeout),
            Liveness::Live { .. }
        ));
        // An unwitnessed expiry still yields to "not registered" and a wipe.
        assert!(matches!(
            liveness(
                Some(&plugin(false)),
                Some(&witnessed(h.clone(), 0, 110)),
                at(200),
                timeout,
                None,
                false
            ),
            Liveness::Gone(GoneReason::NotRegistered { .. })
        ));
        assert!(matches!(
            liveness(
                Some(&plugin(true)),
                Some(&witnessed(h, 0, 110)),
                at(200),
                timeout,
                Some(at(150)),
                false
            ),
            Liveness::Gone(GoneReason::SlicesWiped { .. })
        ));
    }

    #[test]
    fn a_new_run_of_kubelet_renewals_restarts_the_timeout() {
        let timeout = Duration::from_secs(25);
        // The plugin's last renewal was observed at 100; the controller saw nothing of the
        // node from 110 until the kubelet's renewal at 300.
        let resumed = witnessed(synced(100), 300, 300);
        assert_eq!(resumed.since(), at(300));
        assert_eq!(
            live(&resumed, at(310), timeout),
            Liveness::Live { expires: at(325) }
        );
        // 25 s after that, with the kubelet renewing: gone.
        assert!(matches!(
            live(&witnessed(synced(100), 300, 320), at(325), timeout),
            Liveness::Gone(GoneReason::HeartbeatExpired { .. })
        ));
        // A run that began before the renewal changes nothing; nor does the wipe rule, which
        // compares when the renewal itself was observed.
        assert_eq!(witnessed(synced(100), 0, 120).since(), at(100));
        assert!(matches!(
            liveness(
                Some(&plugin(true)),
                Some(&resumed),
                at(310),
                timeout,
                Some(at(150)),
                false
            ),
            Liveness::Gone(GoneReason::SlicesWiped { .. })
        ));
    }

    #[test]
    fn census_counts_registered_plugins_and_their_expired_heartbeats() {
        let timeout = Duration::from_secs(25);
        let (registered, unregistered) = (plugin(true), plugin(false));
        let census = |stale: usize, fresh: usize| {
            let plugins = std::iter::repeat_n((Some(&registered), Some(synced(50))), stale)
                .chain(std::iter::repeat_n((Some(&registered), Some(synced(90))), fresh))
                .chain([(Some(&unregistered), Some(synced(0))), (None, None)]);
            HeartbeatCensus::take(plugins, at(100), timeout)
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
        // One or two dead plugins among live ones are dead plugins.
        assert!(!census(1, 1).mass_expiry(0.55));
        assert!(!census(2, 1).mass_expiry(0.55));
        // On one or two nodes even every heartbeat expiring is no mass expiry (the node's
        // kubelet Lease tells a dead plugin from a silent control plane there). Three of three
        // is one.
        assert!(!census(1, 0).mass_expiry(0.55));
        assert!(!census(2, 0).mass_expiry(0.55));
        assert!(census(3, 0).mass_expiry(0.55));
        // Nothing registered, nothing expired: nothing to hold.
        assert!(!census(0, 0).mass_expiry(0.55));
        // A threshold of 1 disables the rule.
        assert!(!census(10, 0).mass_expiry(1.0));
        assert!(!census(1, 0).mass_expiry(1.0));
        // A registered plugin without a Lease has no fresh heartbeat.
        assert_eq!(
            HeartbeatCensus::take([(Some(&registered), None)], at(100), timeout),
            HeartbeatCensus {
                registered: 1,
                expired: 1
            }
        );
    }

    #[test]
    fn a_later_renew_time_or_resource_version_is_a_renewal() {
        let lease = |renewed: i64, version: Option<&str>| LeaseBeat {
            renewed: ts(renewed),
            duration: Duration::from_secs(23),
            version: version.map(Into::into),
        };
        assert!(lease(15, None).renews(&lease(0, None)));
        assert!(!lease(0, None).renews(&lease(0, None)));
        // An older renewal a lagging watch delivers late renews nothing.
        assert!(!lease(0, Some("5")).renews(&lease(15, Some("7"))));
        // The node's clock stepped back, the write is still newer.
        assert!(lease(-30, Some("8")).renews(&lease(15, Some("7"))));
        assert!(!lease(15, Some("7")).renews(&lease(15, Some("7"))));
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
        assert_eq!(LeaseBeat::of(&short), Some(beat(ts(7), at(0)).beat));
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
