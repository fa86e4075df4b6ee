//! An NVML backend whose inventory can be made to hang.

use std::sync::{
    Mutex,
    atomic::{AtomicBool, AtomicUsize, Ordering},
};

use migdra_kubelet_plugin::nvml::{
    BackendError, CreatedComputeInstance, GpuBackend, GpuDescription, GpuInstanceRecord, MigModeChange,
    NvmlBackend,
};

/// A GPU backend whose `discover` (the first NVML work of every inventory) waits while its
/// gate is closed ([`GatedBackend::close`]): an NVML call that hangs. Everything else goes
/// straight to the wrapped NVML backend.
///
/// The gate opens when the guard `close` returns is dropped, so a failing test does not
/// leave a blocking thread waiting (the runtime would wait for it forever).
pub struct GatedBackend {
    inner: NvmlBackend,
    closed: Mutex<bool>,
    opened: std::sync::Condvar,
    waiting: AtomicUsize,
    /// The gate is after NVML's answer instead of before the call: a discovery that has read
    /// the GPUs and not yet reported them.
    after_discovery: AtomicBool,
}

impl GatedBackend {
    pub fn new(inner: NvmlBackend) -> Self {
        Self {
            inner,
            closed: Mutex::new(false),
            opened: std::sync::Condvar::new(),
            waiting: AtomicUsize::new(0),
            after_discovery: AtomicBool::new(false),
        }
    }

    /// Makes `discover` calls wait until the guard is dropped.
    pub fn close(&self) -> GateClosed<'_> {
        self.after_discovery.store(false, Ordering::SeqCst);
        *self.closed.lock().unwrap() = true;
        GateClosed(self)
    }

    /// Makes `discover` calls wait, with NVML's answer in hand, until the guard is dropped.
    pub fn close_after_discovery(&self) -> GateClosed<'_> {
        self.after_discovery.store(true, Ordering::SeqCst);
        *self.closed.lock().unwrap() = true;
        GateClosed(self)
    }

    /// How many `discover` calls wait at the closed gate now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    fn pass(&self) {
        let mut closed = self.closed.lock().unwrap();
        if *closed {
            self.waiting.fetch_add(1, Ordering::SeqCst);
            while *closed {
                closed = self.opened.wait(closed).unwrap();
            }
            self.waiting.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Keeps a [`GatedBackend`]'s gate closed; dropping it lets the waiting and later calls through.
pub struct GateClosed<'a>(&'a GatedBackend);

impl Drop for GateClosed<'_> {
    fn drop(&mut self) {
        *self.0.closed.lock().unwrap_or_else(|p| p.into_inner()) = false;
        self.0.opened.notify_all();
    }
}

impl GpuBackend for GatedBackend {
    fn driver_version(&self) -> Result<String, BackendError> {
        self.inner.driver_version()
    }

    fn discover(&self) -> Result<Vec<GpuDescription>, BackendError> {
        if self.after_discovery.load(Ordering::SeqCst) {
            let discovered = self.inner.discover();
            self.pass();
            return discovered;
        }
        self.pass();
        self.inner.discover()
    }

    fn list_gpu_instances(&self, gpu: u32) -> Result<Vec<GpuInstanceRecord>, BackendError> {
        self.inner.list_gpu_instances(gpu)
    }

    fn mig_enabled(&self, gpu: u32) -> Result<Option<bool>, BackendError> {
        self.inner.mig_enabled(gpu)
    }

    fn gpu_processes(&self, gpu: u32) -> Result<Vec<u32>, BackendError> {
        self.inner.gpu_processes(gpu)
    }

    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<MigModeChange, BackendError> {
        self.inner.set_mig_mode(gpu, enabled)
    }

    fn create_gpu_instance(&self, gpu: u32, profile_id: u32, start: u32) -> Result<u32, BackendError> {
        self.inner.create_gpu_instance(gpu, profile_id, start)
    }

    fn create_full_compute_instance(
        &self,
        gpu: u32,
        gpu_instance: u32,
    ) -> Result<CreatedComputeInstance, BackendError> {
        self.inner.create_full_compute_instance(gpu, gpu_instance)
    }

    fn destroy_compute_instance(
        &self,
        gpu: u32,
        gpu_instance: u32,
        compute_instance: u32,
    ) -> Result<(), BackendError> {
        self.inner
            .destroy_compute_instance(gpu, gpu_instance, compute_instance)
    }

    fn destroy_gpu_instance(&self, gpu: u32, gpu_instance: u32) -> Result<(), BackendError> {
        self.inner.destroy_gpu_instance(gpu, gpu_instance)
    }

    fn probe_health(&self, gpu: u32) -> Result<(), BackendError> {
        self.inner.probe_health(gpu)
    }
}
