//! What the controller expects its slice cache to show after its own writes, and which of
//! its slices disappeared without it.
//!
//! The slice cache lags behind the controller's writes; a reconcile between a write and its
//! watch event would see a half-updated pool and bump the generation again, forever. So every
//! write records an expectation (this slice at least at this resourceVersion, or gone), and a
//! pool is diffed only once the cache meets all of them, checked at reconcile time and as
//! watch events stream in (which covers a slice created and deleted before the reconcile).
//! Expectations expire after a TTL so a lost event cannot block a node forever: three times
//! the longest write-to-event delay of the last one to two minutes, within 15 s and 120 s,
//! because a saturated API server delivers events later than any fixed TTL, and writing
//! again through a cache that lags only fails with conflicts.
//!
//! Ownership: per node, the slices the controller published and has not deleted itself (it
//! records a slice as expected absent *before* sending the delete). An owned slice that goes
//! away otherwise (a delete event, or missing from the cache at reconcile time after a
//! relist) was wiped by someone else: in practice the kubelet, which deletes a driver's
//! node-local slices 30 s after its plugin disconnects and when it starts. The wipe time is
//! kept until the plugin heartbeats after it (see [`crate::liveness`]). A slice the cache has
//! never shown is only not seen yet (the watch can lag past the TTL); only one shown and then
//! gone is a wipe.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use kube::{ResourceExt, runtime::watcher};

use crate::{
    compare::SliceMeta,
    lag_windows::RecentMax,
    naming::slice_node,
    slice_index::{ByNode, remove},
};

/// The TTL's default floor.
pub const DEFAULT_TTL: Duration = Duration::from_secs(15);
/// The longest an unmet expectation holds a node's pool back, however slow the watch.
pub const MAX_TTL: Duration = Duration::from_secs(120);
/// The TTL in multiples of the recent watch lag: room for the lag to grow while the writes
/// of one reconciliation wait for their events.
const LAG_FACTOR: u32 = 3;

/// What a write leaves behind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expected {
    /// The slice exists at this resourceVersion (the write's answer) or a later one.
    Present(String),
    Absent,
}

#[derive(Debug)]
struct NodeExpectations {
    /// When the last of them was recorded: they expire a TTL after it.
    since: Instant,
    /// Per slice, what is expected and when it was recorded (to measure the watch lag).
    slices: BTreeMap<String, (Expected, Instant)>,
}

/// The TTL for a recent watch lag: [`LAG_FACTOR`] times it, within `floor` and
/// [`MAX_TTL`] (or `floor`, when that is longer).
fn ttl_for(lag: Duration, floor: Duration) -> Duration {
    (lag * LAG_FACTOR).clamp(floor, floor.max(MAX_TTL))
}

#[derive(Debug)]
struct State {
    pending: HashMap<String, NodeExpectations>,
    /// Write-to-event delays of the slice watch.
    lag: RecentMax,
    /// Slices per node the controller published and has not deleted itself.
    owned: ByNode,
    /// Per node, the owned slices whose write the cache has not shown yet.
    unseen: ByNode,
    /// When someone else was last seen deleting an owned slice of the node (the controller's
    /// monotonic clock, as the heartbeat observations it is compared with).
    wiped: HashMap<String, Instant>,
}

impl State {
    /// Drops `slice`'s expectation on `node`, and the node's entry when it was the last.
    fn settle(&mut self, node: &str, slice: &str) {
        if let Some(entry) = self.pending.get_mut(node) {
            entry.slices.remove(slice);
            if entry.slices.is_empty() {
                self.pending.remove(node);
            }
        }
    }
}

/// Expectations and ownership of every node.
#[derive(Debug)]
pub struct Expectations {
    /// The TTL's floor.
    ttl: Duration,
    state: Mutex<State>,
}

impl Default for Expectations {
    fn default() -> Self {
        Self::new(DEFAULT_TTL)
    }
}

impl Expectations {
    /// Expectations that expire after `ttl`, or later while the watch lags.
    pub fn new(ttl: Duration) -> Self {
        let state = State {
            pending: HashMap::new(),
            lag: RecentMax::new(Instant::now()),
            owned: HashMap::new(),
            unseen: HashMap::new(),
            wiped: HashMap::new(),
        };
        Self {
            ttl,
            state: Mutex::new(state),
        }
    }

    /// The longest recent delay between a write and its watch event, and the TTL it gives.
    pub fn watch_lag_and_ttl(&self) -> (Duration, Duration) {
        let lag = self.lock().lag.get(Instant::now());
        (lag, ttl_for(lag, self.ttl))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        crate::lock(&self.state)
    }

    /// Records that the cache should show `slice` as `expected` for `node`.
    pub fn expect(&self, node: &str, slice: &str, expected: Expected) {
        let now = Instant::now();
        let mut state = self.lock();
        let entry = state
            .pending
            .entry(node.to_string())
            .or_insert_with(|| NodeExpectations {
                since: now,
                slices: BTreeMap::new(),
            });
        entry.since = now;
        entry.slices.insert(slice.to_string(), (expected, now));
    }

    /// Records a slice the controller has just written: it is owned, and the cache should
    /// show it at `resource_version` or later.
    pub fn written(&self, node: &str, slice: &str, resource_version: Option<String>) {
        let mut guard = self.lock();
        let state = &mut *guard;
        for set in [&mut state.owned, &mut state.unseen] {
            set.entry(node.to_string()).or_default().insert(slice.to_string());
        }
        drop(guard);
        if let Some(resource_version) = resource_version {
            self.expect(node, slice, Expected::Present(resource_version));
        }
    }

    /// Records, before the request goes out, that the controller is deleting `slice`: its
    /// delete event is then the controller's own, not a wipe.
    pub fn deleting(&self, node: &str, slice: &str) {
        let mut state = self.lock();
        if let Some(owned) = state.owned.get_mut(node) {
            owned.remove(slice);
        }
        remove(&mut state.unseen, node, slice);
        drop(state);
        self.expect(node, slice, Expected::Absent);
    }

    /// Undoes [`Self::deleting`] after the delete failed: the slice is still there.
    pub fn delete_failed(&self, node: &str, slice: &str) {
        let mut state = self.lock();
        state.settle(node, slice);
        state
            .owned
            .entry(node.to_string())
            .or_default()
            .insert(slice.to_string());
    }

    /// Replaces the set of slices the controller owns on `node` (after a reconcile that left
    /// exactly these in place; this also adopts the slices a previous leader wrote).
    pub fn own(&self, node: &str, slices: impl IntoIterator<Item = String>) {
        let slices: std::collections::BTreeSet<String> = slices.into_iter().collect();
        let mut state = self.lock();
        if let Some(unseen) = state.unseen.get_mut(node) {
            unseen.retain(|name| slices.contains(name));
            if unseen.is_empty() {
                state.unseen.remove(node);
            }
        }
        if slices.is_empty() {
            state.owned.remove(node);
        } else {
            state.owned.insert(node.to_string(), slices);
        }
    }

    /// Feeds one watch event of the slice cache. Returns how many owned slices it showed
    /// deleted by someone else (0 or 1).
    pub fn observe(&self, event: &watcher::Event<SliceMeta>) -> usize {
        match event {
            watcher::Event::Apply(slice) | watcher::Event::InitApply(slice) => {
                self.seen(slice, false);
                0
            }
            watcher::Event::Delete(slice) => usize::from(self.seen(slice, true)),
            watcher::Event::Init | watcher::Event::InitDone => 0,
        }
    }

    /// Settles expectations with one observed slice; true when it was an owned slice deleted
    /// by someone else.
    fn seen(&self, slice: &SliceMeta, deleted: bool) -> bool {
        let Some(node) = slice_node(slice) else {
            return false;
        };
        let name = slice.name_any();
        let mut state = self.lock();
        remove(&mut state.unseen, node, &name);
        let pending = state.pending.get(node).and_then(|e| e.slices.get(&name)).cloned();
        let ours = matches!(pending, Some((Expected::Absent, _)));
        let wiped = deleted && !ours && state.owned.get_mut(node).is_some_and(|owned| owned.remove(&name));
        if wiped {
            state.wiped.insert(node.to_string(), Instant::now());
        }
        let Some((expected, at)) = pending else {
            return wiped;
        };
        // Whether this event is the one the write expected (its delay is the watch lag),
        // and whether it settles the expectation. A deletion settles any expectation:
        // whatever was expected, the slice is gone now, and the next diff must see that.
        let (answers, met) = match &expected {
            Expected::Absent => (deleted, deleted),
            Expected::Present(resource_version) => {
                let reached = version_at_least(slice.resource_version().as_deref(), resource_version);
                (reached && !deleted, reached || deleted)
            }
        };
        let now = Instant::now();
        if answers {
            state.lag.record(now, now.saturating_duration_since(at));
        }
        if met {
            state.settle(node, &name);
        }
        wiped
    }

    /// Checks `node`'s expectations against `cached` (the node's slices in the cache):
    /// `None` when the cache can be trusted, or how long to wait for it.
    pub fn pending(&self, node: &str, cached: &[Arc<SliceMeta>]) -> Option<Duration> {
        let mut guard = self.lock();
        let state = &mut *guard;
        let entry = state.pending.get_mut(node)?;
        let now = Instant::now();
        let ttl = ttl_for(state.lag.get(now), self.ttl);
        let deadline = entry.since + ttl;
        if now >= deadline {
            tracing::debug!(node, unmet = ?entry.slices, ?ttl, "expectations expired; trusting the cache");
            state.pending.remove(node);
            return None;
        }
        entry.slices.retain(|name, (expected, _)| {
            let have = cached
                .iter()
                .find(|s| s.metadata.name.as_deref() == Some(name.as_str()));
            let met = match (expected, have) {
                (Expected::Absent, have) => have.is_none(),
                (Expected::Present(version), Some(s)) => {
                    version_at_least(s.metadata.resource_version.as_deref(), version)
                }
                (Expected::Present(_), None) => false,
            };
            !met
        });
        if entry.slices.is_empty() {
            state.pending.remove(node);
            None
        } else {
            Some(deadline.saturating_duration_since(now))
        }
    }

    /// When the node's owned slices were last seen wiped by someone else, unless answered by
    /// [`Self::wipe_answered`], and how many slices this call newly found missing. Call once the
    /// cache is trusted ([`Self::pending`] is `None`): owned slices it has shown and `cached` lacks
    /// are a wipe observed now (a relist hid the delete event); slices never shown are not.
    pub fn wiped(&self, node: &str, cached: &[Arc<SliceMeta>]) -> (Option<Instant>, usize) {
        let mut guard = self.lock();
        let state = &mut *guard;
        let mut missing = 0;
        let unseen = state.unseen.get(node);
        if let Some(owned) = state.owned.get_mut(node) {
            let before = owned.len();
            owned.retain(|name| {
                unseen.is_some_and(|u| u.contains(name))
                    || cached.iter().any(|s| s.metadata.name.as_deref() == Some(name))
            });
            missing = before - owned.len();
        }
        if missing > 0 {
            state.wiped.insert(node.to_string(), Instant::now());
        }
        (state.wiped.get(node).copied(), missing)
    }

    /// Forgets the wipe of `node` observed at `at` (the plugin has heartbeated since). A
    /// newer wipe observed meanwhile is kept.
    pub fn wipe_answered(&self, node: &str, at: Instant) {
        let mut state = self.lock();
        if state.wiped.get(node) == Some(&at) {
            state.wiped.remove(node);
        }
    }
}

/// True when `observed` is `expected` or later. Kubernetes resourceVersions are opaque but,
/// in practice, etcd revisions: compare numerically when both are numbers, else for equality.
pub fn version_at_least(observed: Option<&str>, expected: &str) -> bool {
    let Some(observed) = observed else {
        return false;
    };
    match (observed.parse::<u64>(), expected.parse::<u64>()) {
        (Ok(o), Ok(e)) => o >= e,
        _ => observed == expected,
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;
    use crate::naming::NODE_LABEL;

    fn slice(name: &str, rv: &str) -> SliceMeta {
        SliceMeta {
            metadata: ObjectMeta {
                name: Some(name.into()),
                resource_version: Some(rv.into()),
                labels: Some([(NODE_LABEL.to_string(), "n".to_string())].into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn present(rv: &str) -> Expected {
        Expected::Present(rv.into())
    }

    #[test]
    fn cache_must_catch_up_with_writes() {
        let e = Expectations::default();
        assert_eq!(e.pending("n", &[]), None, "nothing expected");
        e.expect("n", "a", present("10"));
        e.expect("n", "b", Expected::Absent);
        let stale = [Arc::new(slice("a", "9")), Arc::new(slice("b", "3"))];
        assert!(e.pending("n", &stale).is_some());
        let half = [Arc::new(slice("a", "10")), Arc::new(slice("b", "3"))];
        assert!(e.pending("n", &half).is_some(), "b is still there");
        let done = [Arc::new(slice("a", "12"))];
        assert_eq!(e.pending("n", &done), None);
        assert_eq!(e.pending("n", &[]), None, "met expectations are dropped");
    }

    #[test]
    fn watch_events_meet_expectations() {
        let e = Expectations::default();
        e.expect("n", "a", present("10"));
        e.observe(&watcher::Event::Apply(slice("a", "9")));
        assert!(e.pending("n", &[]).is_some());
        // Created, then wiped before any reconcile looked: the delete settles it, and the
        // empty cache is trusted (so the slice is re-created).
        e.observe(&watcher::Event::Apply(slice("a", "10")));
        e.expect("n", "a", present("11"));
        e.observe(&watcher::Event::Delete(slice("a", "11")));
        assert_eq!(e.pending("n", &[]), None);
    }

    #[test]
    fn only_deletions_of_owned_slices_by_others_are_wipes() {
        let e = Expectations::default();
        // Not owned (never written, not adopted): a deletion is nobody's business here.
        assert_eq!(e.observe(&watcher::Event::Delete(slice("x", "5"))), 0);
        assert_eq!(e.wiped("n", &[]).0, None);

        e.written("n", "a", Some("10".into()));
        e.written("n", "b", Some("11".into()));
        e.observe(&watcher::Event::Apply(slice("a", "10")));
        e.observe(&watcher::Event::Apply(slice("b", "11")));
        // The controller deletes b itself: its delete event is no wipe.
        e.deleting("n", "b");
        assert_eq!(e.observe(&watcher::Event::Delete(slice("b", "11"))), 0);
        let cached = [Arc::new(slice("a", "10"))];
        assert_eq!(e.pending("n", &cached), None);
        assert_eq!(e.wiped("n", &cached), (None, 0));

        // Someone else deletes a: a wipe, observed now.
        let before = Instant::now();
        assert_eq!(e.observe(&watcher::Event::Delete(slice("a", "10"))), 1);
        let (at, newly) = e.wiped("n", &[]);
        let at = at.expect("a wipe");
        assert!(at >= before);
        assert_eq!(newly, 0, "already counted by the event");
        // Answered by a heartbeat after it: forgotten; a stale answer is ignored.
        e.wipe_answered("n", before - Duration::from_secs(1));
        assert_eq!(e.wiped("n", &[]).0, Some(at));
        e.wipe_answered("n", at);
        assert_eq!(e.wiped("n", &[]).0, None);
    }

    #[test]
    fn owned_slices_missing_from_a_relisted_cache_are_a_wipe() {
        let e = Expectations::default();
        // Adopted from the cache (a previous leader wrote them).
        e.own("n", ["a".to_string(), "b".to_string()]);
        let cached = [Arc::new(slice("a", "3"))];
        let (at, newly) = e.wiped("n", &cached);
        assert!(at.is_some());
        assert_eq!(newly, 1);
        // Counted once.
        assert_eq!(e.wiped("n", &cached).1, 0);
    }

    #[test]
    fn a_written_slice_the_lagging_cache_never_showed_is_no_wipe() {
        // The write's expectation expired (TTL 0) before the watch delivered the slice: the
        // cache is trusted, shows nothing, and that is no wipe.
        let e = Expectations::new(Duration::ZERO);
        e.written("n", "a", Some("10".into()));
        e.own("n", ["a".to_string()]);
        assert_eq!(e.pending("n", &[]), None);
        assert_eq!(e.wiped("n", &[]), (None, 0));
        // Once the cache has shown it, its absence after a relist is a wipe.
        e.observe(&watcher::Event::Apply(slice("a", "10")));
        let (at, newly) = e.wiped("n", &[]);
        assert!(at.is_some());
        assert_eq!(newly, 1);
    }

    #[test]
    fn a_failed_delete_keeps_the_slice_owned_and_the_node_unblocked() {
        let e = Expectations::default();
        e.own("n", ["a".to_string()]);
        e.deleting("n", "a");
        let cached = [Arc::new(slice("a", "3"))];
        assert!(e.pending("n", &cached).is_some());
        e.delete_failed("n", "a");
        assert_eq!(e.pending("n", &cached), None);
        assert_eq!(e.observe(&watcher::Event::Delete(slice("a", "3"))), 1);
    }

    #[test]
    fn expectations_expire() {
        let e = Expectations::new(Duration::ZERO);
        e.expect("n", "a", present("10"));
        assert_eq!(e.pending("n", &[]), None);
    }

    #[test]
    fn the_ttl_follows_the_watch_lag_within_its_floor_and_cap() {
        let floor = Duration::from_secs(15);
        assert_eq!(ttl_for(Duration::ZERO, floor), floor);
        assert_eq!(
            ttl_for(Duration::from_secs(4), floor),
            floor,
            "3 × 4 s is below the floor"
        );
        assert_eq!(ttl_for(Duration::from_secs(24), floor), Duration::from_secs(72));
        assert_eq!(ttl_for(Duration::from_secs(90), floor), MAX_TTL);
        assert_eq!(
            ttl_for(Duration::from_secs(90), Duration::from_secs(300)),
            Duration::from_secs(300),
            "a floor above the cap wins"
        );
    }

    #[test]
    fn a_lagging_watch_lengthens_the_ttl() {
        // Floor 0: without an observed lag an expectation expires at once.
        let e = Expectations::new(Duration::ZERO);
        e.expect("n", "a", present("10"));
        assert_eq!(e.pending("n", &[]), None);
        // The event of a write arrives 50 ms after it: the TTL becomes at least 150 ms.
        e.expect("n", "a", present("11"));
        std::thread::sleep(Duration::from_millis(50));
        e.observe(&watcher::Event::Apply(slice("a", "11")));
        let (lag, ttl) = e.watch_lag_and_ttl();
        assert!(lag >= Duration::from_millis(50), "{lag:?}");
        assert_eq!(ttl, lag * 3);
        // A stale event (an older version) measures nothing.
        e.expect("n", "b", present("20"));
        std::thread::sleep(Duration::from_millis(lag.as_millis() as u64 + 100));
        e.observe(&watcher::Event::Apply(slice("b", "19")));
        assert_eq!(e.watch_lag_and_ttl().0, lag);
        // So the next write's expectation waits for the cache instead of expiring at once.
        e.expect("n", "c", present("30"));
        let wait = e.pending("n", &[]).expect("waits for the lagging cache");
        assert!(wait <= ttl, "{wait:?} > {ttl:?}");
    }

    #[test]
    fn resource_versions() {
        assert!(version_at_least(Some("10"), "9"));
        assert!(version_at_least(Some("10"), "10"));
        assert!(!version_at_least(Some("9"), "10"));
        assert!(version_at_least(Some("x"), "x"));
        assert!(!version_at_least(Some("y"), "x"));
        assert!(!version_at_least(None, "1"));
    }
}
