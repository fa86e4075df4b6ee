//! Wall time spent inside NVML, attributed to the kubelet call it was spent for.
//!
//! Each [`crate::nvml::GpuBackend`] method of [`crate::nvml::NvmlBackend`] runs inside
//! [`timed`]. A kubelet call's blocking work runs on threads that have its [`NvmlClock`]
//! installed ([`NvmlClock::install`]); `timed` adds each call's duration to the clock of the
//! thread it runs on. Claims of one kubelet call run on threads of their own, each with that
//! call's clock, and a concurrent call has its own clock, so two calls never mix; NVML calls
//! on threads without a clock (the status loop's inventory, health probes) are not counted
//! for any call. The driver turns a call's clock into metrics when the call ends
//! ([`crate::metrics::Metrics::call_with_nvml`]).

use std::{
    cell::RefCell,
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

/// One timed NVML backend call: the backend method (a fixed name) and its wall time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NvmlCall {
    /// The [`crate::nvml::GpuBackend`] method, e.g. `create_gpu_instance`.
    pub function: &'static str,
    pub duration: Duration,
}

/// The NVML calls made on behalf of one kubelet call. Cheap to clone; clones share the
/// record, so the threads of one call add to one clock.
#[derive(Clone, Debug, Default)]
pub struct NvmlClock {
    calls: Arc<Mutex<Vec<NvmlCall>>>,
}

thread_local! {
    /// The clock of the kubelet call this thread works for, if any.
    static CURRENT: RefCell<Option<NvmlClock>> = const { RefCell::new(None) };
    /// Set while a timed call runs, so a backend method that calls another one is counted once.
    static INSIDE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// While alive, NVML time on this thread goes to its clock; dropping it (also on unwind)
/// puts back the clock that was installed before.
#[must_use = "the clock is uninstalled when this guard is dropped"]
pub struct InstalledClock {
    previous: Option<NvmlClock>,
}

impl Drop for InstalledClock {
    fn drop(&mut self) {
        let previous = self.previous.take();
        CURRENT.with(|c| *c.borrow_mut() = previous);
    }
}

impl NvmlClock {
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts NVML calls made on this thread for this clock until the guard is dropped.
    pub fn install(&self) -> InstalledClock {
        let previous = CURRENT.with(|c| c.borrow_mut().replace(self.clone()));
        InstalledClock { previous }
    }

    fn calls_mut(&self) -> MutexGuard<'_, Vec<NvmlCall>> {
        crate::lock(&self.calls)
    }

    /// The calls recorded so far, in the order they ended.
    pub fn calls(&self) -> Vec<NvmlCall> {
        self.calls_mut().clone()
    }
}

/// The clock installed on this thread, if any: a call run on another thread on this one's
/// behalf installs it there.
pub fn current_clock() -> Option<NvmlClock> {
    CURRENT.with(|c| c.borrow().clone())
}

/// Runs one NVML backend call, adding its wall time to this thread's clock (if any). A timed
/// call inside another is part of the outer one and not counted again.
pub fn timed<T>(function: &'static str, call: impl FnOnce() -> T) -> T {
    if INSIDE.with(|i| i.replace(true)) {
        return call();
    }
    // Reset even when the call unwinds.
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            INSIDE.with(|i| i.set(false));
        }
    }
    let _leave = Leave;
    let started = Instant::now();
    let out = call();
    let duration = started.elapsed();
    CURRENT.with(|c| {
        if let Some(clock) = c.borrow().as_ref() {
            clock.calls_mut().push(NvmlCall { function, duration });
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_go_to_the_clock_of_their_thread_and_nested_calls_count_once() {
        let (a, b) = (NvmlClock::new(), NvmlClock::new());
        timed("before_any_clock", || ());
        std::thread::scope(|s| {
            s.spawn(|| {
                let _installed = a.install();
                timed("outer", || timed("inner", || ()));
                timed("second", || ());
            });
            s.spawn(|| {
                let _installed = b.install();
                timed("other_call", || ());
            });
        });
        let names = |c: &NvmlClock| c.calls().iter().map(|c| c.function).collect::<Vec<_>>();
        assert_eq!(names(&a), ["outer", "second"]);
        assert_eq!(names(&b), ["other_call"]);
    }

    #[test]
    fn dropping_the_guard_restores_the_previous_clock() {
        let (outer, inner) = (NvmlClock::new(), NvmlClock::new());
        let _outer = outer.install();
        {
            let _inner = inner.install();
            timed("in_inner", || ());
        }
        timed("in_outer", || ());
        assert_eq!(inner.calls().len(), 1);
        assert_eq!(outer.calls()[0].function, "in_outer");
        assert_eq!(outer.calls().len(), 1);
    }
}
