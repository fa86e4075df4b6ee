//! Slices first, statuses after. While reconciliations write slices (a publish burst, with the
//! API server the bottleneck), a `Published=True` status write that would change its GpuNode
//! waits: the scheduler needs the slices, the status (a server-side apply of a large object)
//! is for people and tools. A waiting status goes out once no slice has been written for the
//! quiet period, or once it has waited the longest allowed. A status that explains a
//! withdrawal, a failure or a refused policy or pool never waits (the caller decides).

use std::{
    collections::{HashMap, hash_map::Entry},
    sync::{
        Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use crate::lock;

/// Default longest wait of a status: a bound, so the condition is at most this stale even
/// while slices are written without pause (a long cold start, continuous churn), and long
/// enough that a cold start's statuses do not compete with its slice writes.
pub const MAX_WAIT: Duration = Duration::from_secs(120);
/// Default quiet period: statuses wait this long after the last slice write, so a burst of
/// large GpuNode status events does not delay the slices' watch events.
pub const QUIET: Duration = Duration::from_secs(2);

/// Which reconciliations write slices, and whose status writes wait for them.
#[derive(Debug)]
pub struct StatusDeferral {
    /// Longest a status waits; zero: statuses never wait.
    max_wait: Duration,
    /// How long after the last slice write statuses still wait; zero: only while slices are
    /// being written.
    quiet: Duration,
    /// Reconciliations writing slices right now.
    writers: AtomicUsize,
    /// When the last slice write of any reconciliation ended.
    last_write: Mutex<Option<Instant>>,
    /// Per node, when its pending status write was first deferred.
    first_deferred: Mutex<HashMap<String, Instant>>,
}

/// Counts one reconciliation as writing slices while it lives; dropping it, on success, error
/// or panic, ends that.
#[must_use = "the reconciliation counts as writing slices only while the guard lives"]
pub struct SliceWriting<'a>(&'a StatusDeferral);

impl Drop for SliceWriting<'_> {
    fn drop(&mut self) {
        *lock(&self.0.last_write) = Some(Instant::now());
        self.0.writers.fetch_sub(1, Ordering::Relaxed);
    }
}

impl StatusDeferral {
    pub fn new(max_wait: Duration, quiet: Duration) -> Self {
        Self {
            max_wait,
            quiet,
            writers: AtomicUsize::new(0),
            last_write: Mutex::new(None),
            first_deferred: Mutex::new(HashMap::new()),
        }
    }

    /// Counts the caller as writing slices until the guard drops.
    pub fn writing_slices(&self) -> SliceWriting<'_> {
        self.writers.fetch_add(1, Ordering::Relaxed);
        SliceWriting(self)
    }

    /// How many reconciliations are writing slices right now.
    pub fn slice_writers(&self) -> usize {
        self.writers.load(Ordering::Relaxed)
    }

    /// Whether `node`'s status write, which would change the GpuNode, waits: while slices are
    /// written (or were, within the quiet period), for at most the longest wait since its
    /// first deferral, which is recorded here and kept until [`Self::settled`].
    pub fn defer(&self, node: &str) -> bool {
        let written_lately =
            || !self.quiet.is_zero() && lock(&self.last_write).is_some_and(|at| at.elapsed() < self.quiet);
        if self.max_wait.is_zero() || (self.slice_writers() == 0 && !written_lately()) {
            return false;
        }
        match lock(&self.first_deferred).entry(node.to_string()) {
            Entry::Occupied(first) => first.get().elapsed() < self.max_wait,
            Entry::Vacant(first) => {
                first.insert(Instant::now());
                true
            }
        }
    }

    /// Forgets `node`'s deferred status write: written, no longer needed, or its GpuNode is
    /// gone.
    pub fn settled(&self, node: &str) {
        lock(&self.first_deferred).remove(node);
    }

    /// Forgets the deferred status writes of the nodes `keep` rejects (their GpuNodes are
    /// gone, so no reconciliation settles them).
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        lock(&self.first_deferred).retain(|node, _| keep(node));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_wait_only_while_slices_are_written_and_at_most_the_bound() {
        let deferral = StatusDeferral::new(MAX_WAIT, Duration::ZERO);
        assert!(!deferral.defer("a"), "no slice writes: no wait");
        let writing = deferral.writing_slices();
        assert_eq!(deferral.slice_writers(), 1);
        assert!(deferral.defer("a"));
        assert!(deferral.defer("a"), "still within the bound");
        drop(writing);
        assert_eq!(deferral.slice_writers(), 0);
        assert!(!deferral.defer("a"), "writes ended, no quiet period");

        let never = StatusDeferral::new(Duration::ZERO, QUIET);
        let _writing = never.writing_slices();
        assert!(!never.defer("a"), "a zero bound never waits");

        let bounded = StatusDeferral::new(Duration::from_millis(1), Duration::ZERO);
        let _writing = bounded.writing_slices();
        assert!(bounded.defer("a"));
        std::thread::sleep(Duration::from_millis(5));
        assert!(!bounded.defer("a"), "past the bound");
        bounded.retain(|_| false);
        assert!(bounded.defer("a"), "forgotten: waits afresh");
        bounded.settled("a");
        assert!(bounded.defer("a"));
    }

    #[test]
    fn statuses_wait_a_quiet_period_after_the_last_slice_write() {
        let deferral = StatusDeferral::new(MAX_WAIT, Duration::from_secs(60));
        assert!(!deferral.defer("a"), "nothing written yet");
        drop(deferral.writing_slices());
        assert!(deferral.defer("a"));
    }
}
