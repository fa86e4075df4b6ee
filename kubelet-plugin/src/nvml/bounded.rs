//! NVML calls with a time bound.
//!
//! A driver stuck in the kernel, or a GPU in a bad state, can make an NVML call never return.
//! [`BoundedBackend`] runs every call on a thread of its own and waits for it at most the
//! call timeout. A call that runs past it is *overdue*: the caller gets a `NotAnswering`
//! error at once, and from then on every call on that GPU (or, for a node-wide call such as
//! `discover`, every node-wide call) fails the same way without being made, until the
//! overdue call returns. So one stuck GPU costs at most one timeout per caller, never holds a
//! lock past it, and leaves at most one thread waiting in NVML per GPU.
//!
//! The plugin reads the overdue calls through [`NvmlCalls`]: the inventory reports their GPU
//! unhealthy (its health probe fails with the same error), the status loop refreshes as
//! soon as a call becomes overdue or returns, the driver reconciles what an overdue call did
//! once it returns, and a node where NVML answers nothing is no longer offered.

use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

use tokio::sync::watch;

use super::{
    BackendError, CreatedComputeInstance, GpuBackend, GpuDescription, GpuInstanceRecord, MigModeChange,
    NvmlErrorKind, timing,
};
use crate::{lock, metrics::Metrics};

/// What a call works on: one GPU (by NVML index) or the node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum CallScope {
    Gpu(u32),
    Node,
}

/// A call that ran past the timeout and has not returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OverdueCall {
    /// The backend function, e.g. `create_gpu_instance`.
    pub function: &'static str,
    pub scope: CallScope,
    pub started: Instant,
}

impl OverdueCall {
    /// Why calls in its scope fail while it is overdue (also the GPU's health reason).
    pub fn reason(&self) -> String {
        format!(
            "NVML is not answering: {} has not returned after {}s",
            self.function,
            self.started.elapsed().as_secs()
        )
    }
}

#[derive(Debug)]
struct InFlight {
    function: &'static str,
    scope: CallScope,
    started: Instant,
    overdue: bool,
}

/// The NVML calls in flight and which of them are overdue. Shared by the backend and
/// whoever watches NVML's health. Cheap to clone; clones share state.
#[derive(Clone, Debug)]
pub struct NvmlCalls {
    inner: Arc<CallsInner>,
}

#[derive(Debug)]
struct CallsInner {
    timeout: Duration,
    next_id: AtomicU64,
    in_flight: Mutex<BTreeMap<u64, InFlight>>,
    /// Bumped whenever a call becomes overdue or an overdue call returns.
    changes: watch::Sender<u64>,
    /// Bumped whenever an overdue call returns (its effects need reconciling).
    returns: watch::Sender<u64>,
}

impl NvmlCalls {
    pub fn new(timeout: Duration) -> Self {
        Self {
            inner: Arc::new(CallsInner {
                timeout,
                next_id: AtomicU64::new(0),
                in_flight: Mutex::new(BTreeMap::new()),
                changes: watch::Sender::new(0),
                returns: watch::Sender::new(0),
            }),
        }
    }

    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// The overdue calls, oldest first.
    pub fn overdue(&self) -> Vec<OverdueCall> {
        let mut overdue: Vec<OverdueCall> = lock(&self.inner.in_flight)
            .values()
            .filter(|c| c.overdue)
            .map(|c| OverdueCall {
                function: c.function,
                scope: c.scope,
                started: c.started,
            })
            .collect();
        overdue.sort_by_key(|c| c.started);
        overdue
    }

    /// The oldest overdue call in `scope`, if any.
    pub fn overdue_in(&self, scope: CallScope) -> Option<OverdueCall> {
        self.overdue().into_iter().find(|c| c.scope == scope)
    }

    /// Whether NVML answers nothing on this node: a node-wide call is overdue, or every one of
    /// `gpus` (NVML indices; at least one) has an overdue call.
    pub fn node_stuck(&self, gpus: impl IntoIterator<Item = u32>) -> Option<String> {
        let overdue = self.overdue();
        if let Some(call) = overdue.iter().find(|c| c.scope == CallScope::Node) {
            return Some(call.reason());
        }
        let mut gpus = gpus.into_iter().peekable();
        gpus.peek()?;
        let mut reasons = Vec::new();
        for gpu in gpus {
            let call = overdue.iter().find(|c| c.scope == CallScope::Gpu(gpu))?;
            reasons.push(format!("GPU index {gpu}: {}", call.reason()));
        }
        Some(reasons.join("; "))
    }

    /// Changes whenever a call becomes overdue or an overdue call returns.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.inner.changes.subscribe()
    }

    /// Changes whenever an overdue call returns.
    pub fn subscribe_returns(&self) -> watch::Receiver<u64> {
        self.inner.returns.subscribe()
    }

    fn start(&self, function: &'static str, scope: CallScope) -> Result<u64, BackendError> {
        let mut in_flight = lock(&self.inner.in_flight);
        if let Some(stuck) = in_flight.values().find(|c| c.scope == scope && c.overdue) {
            let call = OverdueCall {
                function: stuck.function,
                scope,
                started: stuck.started,
            };
            return Err(not_answering(function, scope, call.reason()));
        }
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        in_flight.insert(
            id,
            InFlight {
                function,
                scope,
                started: Instant::now(),
                overdue: false,
            },
        );
        Ok(id)
    }

    /// Marks call `id` overdue; false if it has returned meanwhile.
    fn mark_overdue(&self, id: u64) -> bool {
        let marked = lock(&self.inner.in_flight)
            .get_mut(&id)
            .map(|c| c.overdue = true)
            .is_some();
        if marked {
            self.inner.changes.send_modify(|n| *n += 1);
        }
        marked
    }

    /// Forgets call `id`; returns how long it ran if it was overdue.
    fn finish(&self, id: u64) -> Option<(Duration, &'static str, CallScope)> {
        let call = lock(&self.inner.in_flight).remove(&id)?;
        if !call.overdue {
            return None;
        }
        self.inner.changes.send_modify(|n| *n += 1);
        self.inner.returns.send_modify(|n| *n += 1);
        Some((call.started.elapsed(), call.function, call.scope))
    }
}

fn scope_text(scope: CallScope) -> String {
    match scope {
        CallScope::Gpu(index) => format!("GPU index {index}"),
        CallScope::Node => "the node".to_string(),
    }
}

fn not_answering(function: &'static str, scope: CallScope, message: String) -> BackendError {
    BackendError {
        operation: format!("{function} on {}", scope_text(scope)),
        kind: NvmlErrorKind::NotAnswering,
        message,
    }
}

/// A [`GpuBackend`] whose calls return within the timeout of its [`NvmlCalls`].
pub struct BoundedBackend {
    inner: Arc<dyn GpuBackend>,
    calls: NvmlCalls,
    metrics: Metrics,
}

impl BoundedBackend {
    pub fn new(inner: Arc<dyn GpuBackend>, calls: NvmlCalls, metrics: Metrics) -> Self {
        Self {
            inner,
            calls,
            metrics,
        }
    }

    /// Runs `call` on a thread of its own and waits for it at most the timeout.
    fn call<T: Send + 'static>(
        &self,
        function: &'static str,
        scope: CallScope,
        call: impl FnOnce(&dyn GpuBackend) -> Result<T, BackendError> + Send + 'static,
    ) -> Result<T, BackendError> {
        let id = self.calls.start(function, scope)?;
        let (send, receive) = mpsc::sync_channel(1);
        let (inner, calls, metrics) = (self.inner.clone(), self.calls.clone(), self.metrics.clone());
        // The NVML time still counts for the kubelet call it is made for.
        let clock = timing::current_clock();
        let spawned = std::thread::Builder::new().name("nvml-call".into()).spawn(move || {
            let _clock = clock.as_ref().map(|c| c.install());
            let result = call(&*inner);
            if let Some((took, function, scope)) = calls.finish(id) {
                metrics.nvml_call_stuck(calls.overdue().len());
                tracing::warn!(function, scope = %scope_text(scope), took_seconds = took.as_secs_f64(), ok = result.is_ok(), "an overdue NVML call returned; reconciling what it did");
            }
            // The caller may have given up waiting; then nobody needs the result.
            let _ = send.send(result);
        });
        if let Err(e) = spawned {
            self.calls.finish(id);
            return Err(BackendError {
                operation: format!("{function} on {}", scope_text(scope)),
                kind: NvmlErrorKind::Other,
                message: format!("cannot start a thread for the NVML call: {e}"),
            });
        }
        match receive.recv_timeout(self.calls.timeout()) {
            Ok(result) => result,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if !self.calls.mark_overdue(id) {
                    // It returned just now.
                    return receive.recv().unwrap_or_else(|_| Err(vanished(function, scope)));
                }
                self.metrics
                    .nvml_call_overdue(function, self.calls.overdue().len());
                tracing::error!(function, scope = %scope_text(scope), timeout_seconds = self.calls.timeout().as_secs_f64(), "an NVML call did not return within the timeout; its GPU counts as unhealthy until it does");
                Err(not_answering(
                    function,
                    scope,
                    format!(
                        "NVML is not answering: {function} did not return within {}s",
                        self.calls.timeout().as_secs()
                    ),
                ))
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(vanished(function, scope)),
        }
    }
}

/// The call's thread ended without a result (it panicked).
fn vanished(function: &'static str, scope: CallScope) -> BackendError {
    BackendError {
        operation: format!("{function} on {}", scope_text(scope)),
        kind: NvmlErrorKind::Other,
        message: "the NVML call ended without a result".to_string(),
    }
}

impl GpuBackend for BoundedBackend {
    fn driver_version(&self) -> Result<String, BackendError> {
        self.call("driver_version", CallScope::Node, |b| b.driver_version())
    }

    fn discover(&self) -> Result<Vec<GpuDescription>, BackendError> {
        self.call("discover", CallScope::Node, |b| b.discover())
    }

    fn list_gpu_instances(&self, gpu: u32) -> Result<Vec<GpuInstanceRecord>, BackendError> {
        self.call("list_gpu_instances", CallScope::Gpu(gpu), move |b| {
            b.list_gpu_instances(gpu)
        })
    }

    fn mig_enabled(&self, gpu: u32) -> Result<Option<bool>, BackendError> {
        self.call("mig_enabled", CallScope::Gpu(gpu), move |b| b.mig_enabled(gpu))
    }

    fn gpu_processes(&self, gpu: u32) -> Result<Vec<u32>, BackendError> {
        self.call("gpu_processes", CallScope::Gpu(gpu), move |b| {
            b.gpu_processes(gpu)
        })
    }

    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<MigModeChange, BackendError> {
        self.call("set_mig_mode", CallScope::Gpu(gpu), move |b| {
            b.set_mig_mode(gpu, enabled)
        })
    }

    fn create_gpu_instance(&self, gpu: u32, profile_id: u32, start: u32) -> Result<u32, BackendError> {
        self.call("create_gpu_instance", CallScope::Gpu(gpu), move |b| {
            b.create_gpu_instance(gpu, profile_id, start)
        })
    }

    fn create_full_compute_instance(
        &self,
        gpu: u32,
        gpu_instance: u32,
    ) -> Result<CreatedComputeInstance, BackendError> {
        self.call("create_full_compute_instance", CallScope::Gpu(gpu), move |b| {
            b.create_full_compute_instance(gpu, gpu_instance)
        })
    }

    fn destroy_compute_instance(
        &self,
        gpu: u32,
        gpu_instance: u32,
        compute_instance: u32,
    ) -> Result<(), BackendError> {
        self.call("destroy_compute_instance", CallScope::Gpu(gpu), move |b| {
            b.destroy_compute_instance(gpu, gpu_instance, compute_instance)
        })
    }

    fn destroy_gpu_instance(&self, gpu: u32, gpu_instance: u32) -> Result<(), BackendError> {
        self.call("destroy_gpu_instance", CallScope::Gpu(gpu), move |b| {
            b.destroy_gpu_instance(gpu, gpu_instance)
        })
    }

    fn probe_health(&self, gpu: u32) -> Result<(), BackendError> {
        self.call("probe_health", CallScope::Gpu(gpu), move |b| b.probe_health(gpu))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Condvar, atomic::AtomicUsize};

    use super::*;

    /// A backend whose health probes wait while their GPU is held, and count how often they
    /// reach it; every other call fails at once.
    #[derive(Default)]
    struct HeldProbes {
        held: Mutex<Vec<u32>>,
        released: Condvar,
        reached: AtomicUsize,
    }

    impl HeldProbes {
        fn hold(&self, gpu: u32) {
            lock(&self.held).push(gpu);
        }

        fn release_all(&self) {
            lock(&self.held).clear();
            self.released.notify_all();
        }
    }

    fn refused() -> BackendError {
        BackendError {
            operation: "test".into(),
            kind: NvmlErrorKind::Other,
            message: "not in this test".into(),
        }
    }

    impl GpuBackend for HeldProbes {
        fn driver_version(&self) -> Result<String, BackendError> {
            Ok("580.1".into())
        }
        fn discover(&self) -> Result<Vec<GpuDescription>, BackendError> {
            Err(refused())
        }
        fn list_gpu_instances(&self, _: u32) -> Result<Vec<GpuInstanceRecord>, BackendError> {
            Err(refused())
        }
        fn mig_enabled(&self, _: u32) -> Result<Option<bool>, BackendError> {
            Err(refused())
        }
        fn gpu_processes(&self, _: u32) -> Result<Vec<u32>, BackendError> {
            Err(refused())
        }
        fn set_mig_mode(&self, _: u32, _: bool) -> Result<MigModeChange, BackendError> {
            Err(refused())
        }
        fn create_gpu_instance(&self, _: u32, _: u32, _: u32) -> Result<u32, BackendError> {
            Err(refused())
        }
        fn create_full_compute_instance(
            &self,
            _: u32,
            _: u32,
        ) -> Result<CreatedComputeInstance, BackendError> {
            Err(refused())
        }
        fn destroy_compute_instance(&self, _: u32, _: u32, _: u32) -> Result<(), BackendError> {
            Err(refused())
        }
        fn destroy_gpu_instance(&self, _: u32, _: u32) -> Result<(), BackendError> {
            Err(refused())
        }
        fn probe_health(&self, gpu: u32) -> Result<(), BackendError> {
            self.reached.fetch_add(1, Ordering::SeqCst);
            let mut held = lock(&self.held);
            while held.contains(&gpu) {
                held = self
                    .released
                    .wait(held)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
            Ok(())
        }
    }

    fn bounded(timeout: Duration) -> (Arc<HeldProbes>, NvmlCalls, BoundedBackend) {
        let inner = Arc::new(HeldProbes::default());
        let calls = NvmlCalls::new(timeout);
        let backend = BoundedBackend::new(inner.clone(), calls.clone(), Metrics::new());
        (inner, calls, backend)
    }

    #[test]
    fn an_overdue_call_fails_its_gpu_fast_until_it_returns() {
        let (inner, calls, backend) = bounded(Duration::from_millis(100));
        let mut changes = calls.subscribe();
        let returns = calls.subscribe_returns();
        inner.hold(0);
        let err = backend.probe_health(0).unwrap_err();
        assert_eq!(err.kind, NvmlErrorKind::NotAnswering);
        assert!(err.message.contains("did not return within"), "{err}");
        assert!(changes.has_changed().unwrap());
        changes.mark_unchanged();
        assert_eq!(
            calls.overdue_in(CallScope::Gpu(0)).map(|c| c.function),
            Some("probe_health")
        );

        // Later calls on GPU 0 fail without reaching NVML; GPU 1 and the node still answer.
        let err = backend.probe_health(0).unwrap_err();
        assert_eq!(err.kind, NvmlErrorKind::NotAnswering);
        assert!(err.message.contains("has not returned after"), "{err}");
        assert_eq!(inner.reached.load(Ordering::SeqCst), 1);
        backend.probe_health(1).unwrap();
        assert_eq!(backend.driver_version().unwrap(), "580.1");
        assert_eq!(calls.node_stuck([0, 1]), None);
        assert!(calls.node_stuck([0]).is_some(), "GPU 0 alone is the whole node");
        assert!(!returns.has_changed().unwrap());

        inner.release_all();
        let deadline = Instant::now() + Duration::from_secs(20);
        while calls.overdue_in(CallScope::Gpu(0)).is_some() {
            assert!(Instant::now() < deadline, "the held call never returned");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(returns.has_changed().unwrap());
        assert!(changes.has_changed().unwrap());
        backend.probe_health(0).unwrap();
    }

    #[test]
    fn calls_within_the_timeout_are_not_overdue() {
        let (_, calls, backend) = bounded(Duration::from_secs(20));
        for gpu in 0..4 {
            backend.probe_health(gpu).unwrap();
        }
        assert!(calls.overdue().is_empty());
        assert_eq!(calls.node_stuck([]), None, "a node without GPUs is not stuck");
        assert!(!calls.subscribe().has_changed().unwrap());
    }
}
