//! What the controller expects its slice cache to show after its own writes.
//!
//! The reconciler reads slices from a watch cache, which lags behind the writes it just
//! made. Without care, a reconcile triggered between a write and its watch event (by the
//! status patch, or by the event of the first of several slices) would see a half-updated
//! pool, call it changed and bump the generation again, forever. So every write records an
//! expectation — this slice at (at least) this resourceVersion, or this slice gone — and a
//! node's pool is only diffed once the cache has caught up with all of them. Expectations are
//! met by the cache contents at reconcile time or by watch events as they stream in (which
//! also covers a slice created and deleted again before the reconcile ran: the kubelet's
//! wipe), and they expire after a TTL so a lost event cannot block a node forever.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::{ResourceExt, runtime::watcher};

/// How long an unmet expectation holds a node's pool back.
pub const DEFAULT_TTL: Duration = Duration::from_secs(15);

/// What a write leaves behind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expected {
    /// The slice exists at this resourceVersion or a later one.
    Present {
        /// The resourceVersion the write returned.
        resource_version: String,
    },
    /// The slice is gone.
    Absent,
}

#[derive(Debug)]
struct NodeExpectations {
    deadline: Instant,
    slices: BTreeMap<String, Expected>,
}

/// Expectations of every node. Cheap to share.
#[derive(Debug)]
pub struct Expectations {
    ttl: Duration,
    nodes: Mutex<HashMap<String, NodeExpectations>>,
}

impl Default for Expectations {
    fn default() -> Self {
        Self::new(DEFAULT_TTL)
    }
}

impl Expectations {
    /// Expectations that expire after `ttl`.
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            nodes: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, NodeExpectations>> {
        // A panic while holding this lock leaves plain data behind; keep using it.
        self.nodes.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Records that the cache should show `slice` as `expected` for `node`.
    pub fn expect(&self, node: &str, slice: &str, expected: Expected) {
        let mut nodes = self.lock();
        let entry = nodes.entry(node.to_string()).or_insert_with(|| NodeExpectations {
            deadline: Instant::now() + self.ttl,
            slices: BTreeMap::new(),
        });
        entry.deadline = Instant::now() + self.ttl;
        entry.slices.insert(slice.to_string(), expected);
    }

    /// Feeds one watch event of the slice cache.
    pub fn observe(&self, event: &watcher::Event<ResourceSlice>) {
        match event {
            watcher::Event::Apply(slice) | watcher::Event::InitApply(slice) => self.seen(slice, false),
            watcher::Event::Delete(slice) => self.seen(slice, true),
            watcher::Event::Init | watcher::Event::InitDone => {}
        }
    }

    fn seen(&self, slice: &ResourceSlice, deleted: bool) {
        let Some(node) = slice.spec.node_name.as_deref() else {
            return;
        };
        let name = slice.name_any();
        let mut nodes = self.lock();
        let Some(entry) = nodes.get_mut(node) else {
            return;
        };
        let met = match entry.slices.get(&name) {
            None => false,
            // A deletion settles any expectation: whatever was expected, the slice is gone
            // now, and the next diff must see that.
            Some(_) if deleted => true,
            Some(Expected::Present { resource_version }) => {
                version_at_least(slice.resource_version().as_deref(), resource_version)
            }
            Some(Expected::Absent) => false,
        };
        if met {
            entry.slices.remove(&name);
            if entry.slices.is_empty() {
                nodes.remove(node);
            }
        }
    }

    /// Checks `node`'s expectations against `cached` (the node's slices in the cache):
    /// `None` when the cache can be trusted, or how long to wait for it.
    pub fn pending(&self, node: &str, cached: &[Arc<ResourceSlice>]) -> Option<Duration> {
        let mut nodes = self.lock();
        let entry = nodes.get_mut(node)?;
        let now = Instant::now();
        if now >= entry.deadline {
            tracing::debug!(node, unmet = ?entry.slices, "expectations expired; trusting the cache");
            nodes.remove(node);
            return None;
        }
        entry.slices.retain(|name, expected| {
            let have = cached
                .iter()
                .find(|s| s.metadata.name.as_deref() == Some(name.as_str()));
            let met = match (expected, have) {
                (Expected::Absent, None) => true,
                (Expected::Absent, Some(_)) => false,
                (Expected::Present { .. }, None) => false,
                (Expected::Present { resource_version }, Some(s)) => {
                    version_at_least(s.metadata.resource_version.as_deref(), resource_version)
                }
            };
            !met
        });
        if entry.slices.is_empty() {
            nodes.remove(node);
            None
        } else {
            Some(entry.deadline.saturating_duration_since(now))
        }
    }

    /// Drops every expectation of `node`.
    pub fn forget(&self, node: &str) {
        self.lock().remove(node);
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
    use k8s_openapi::{
        api::resource::v1::{ResourcePool, ResourceSliceSpec},
        apimachinery::pkg::apis::meta::v1::ObjectMeta,
    };

    use super::*;

    fn slice(name: &str, rv: &str) -> ResourceSlice {
        ResourceSlice {
            metadata: ObjectMeta {
                name: Some(name.into()),
                resource_version: Some(rv.into()),
                ..Default::default()
            },
            spec: ResourceSliceSpec {
                driver: "d".into(),
                node_name: Some("n".into()),
                pool: ResourcePool::default(),
                ..Default::default()
            },
        }
    }

    fn present(rv: &str) -> Expected {
        Expected::Present {
            resource_version: rv.into(),
        }
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
    fn expectations_expire() {
        let e = Expectations::new(Duration::ZERO);
        e.expect("n", "a", present("10"));
        assert_eq!(e.pending("n", &[]), None);
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
