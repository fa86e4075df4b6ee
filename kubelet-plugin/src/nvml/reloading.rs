//! NVML across a driver upgrade without a reboot. Once the kernel driver is reloaded, the
//! library this process loaded answers every call with NVML_ERROR_LIB_RM_VERSION_MISMATCH, and
//! only a new session fixes that: `nvmlShutdown` down to no session, unloading the library,
//! and loading and initialising it again (the path now leads to the new version). A new
//! session whose init still mismatches (the new library is installed, the old module still
//! loaded) is tried again on the next call.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
};

use super::{
    BackendError, CreatedComputeInstance, GpuBackend, GpuDescription, GpuInstanceRecord, MigModeChange,
    NvmlBackend, NvmlErrorKind,
};

/// The production backend: an [`NvmlBackend`] session, replaced by a new one when NVML reports
/// a version mismatch.
pub struct ReloadingNvml {
    lib_path: Option<PathBuf>,
    /// `None` after a session ended and its successor could not be initialised yet.
    session: RwLock<Option<Arc<NvmlBackend>>>,
}

impl std::fmt::Debug for ReloadingNvml {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReloadingNvml")
            .field("lib_path", &self.lib_path)
            .finish_non_exhaustive()
    }
}

impl ReloadingNvml {
    /// Loads NVML as [`NvmlBackend::new`] does.
    pub fn new(lib_path: Option<&Path>) -> Result<Self, BackendError> {
        let session = NvmlBackend::new(lib_path)?;
        Ok(Self {
            lib_path: lib_path.map(Path::to_path_buf),
            session: RwLock::new(Some(Arc::new(session))),
        })
    }

    /// The current session, initialising one when there is none.
    fn session(&self) -> Result<Arc<NvmlBackend>, BackendError> {
        if let Some(session) = self.session.read().unwrap_or_else(|e| e.into_inner()).as_ref() {
            return Ok(Arc::clone(session));
        }
        let mut slot = self.session.write().unwrap_or_else(|e| e.into_inner());
        if let Some(session) = slot.as_ref() {
            return Ok(Arc::clone(session));
        }
        let session = Arc::new(NvmlBackend::new(self.lib_path.as_deref())?);
        // A rescan: the GPUs as the reloaded driver numbers them (the session checks later
        // calls against the minors it described).
        match session.discover() {
            Ok(gpus) => tracing::info!(gpus = gpus.len(), "NVML initialised again after a driver change"),
            Err(e) => tracing::warn!(error = %e, "NVML initialised again, but discovery failed"),
        }
        *slot = Some(Arc::clone(&session));
        Ok(session)
    }

    /// Ends `stale` unless another call ended it already. It shuts down once the calls still
    /// running on it return (the last reference drops it).
    fn end_session(&self, stale: &Arc<NvmlBackend>, cause: &BackendError) {
        let mut slot = self.session.write().unwrap_or_else(|e| e.into_inner());
        if slot.as_ref().is_some_and(|s| Arc::ptr_eq(s, stale)) {
            tracing::warn!(error = %cause, "NVML no longer matches the kernel driver (upgraded or reloaded); initialising it again");
            *slot = None;
        }
    }

    /// Runs `f` on the session; on a version mismatch, once more on a new session.
    fn call<T>(&self, f: impl Fn(&NvmlBackend) -> Result<T, BackendError>) -> Result<T, BackendError> {
        let session = self.session()?;
        match f(&session) {
            Err(e) if e.kind == NvmlErrorKind::RmVersionMismatch => {
                self.end_session(&session, &e);
                drop(session);
                f(&*self.session()?)
            }
            other => other,
        }
    }
}

impl GpuBackend for ReloadingNvml {
    fn driver_version(&self) -> Result<String, BackendError> {
        self.call(|s| s.driver_version())
    }

    fn discover(&self) -> Result<Vec<GpuDescription>, BackendError> {
        self.call(|s| s.discover())
    }

    fn list_gpu_instances(&self, gpu: u32) -> Result<Vec<GpuInstanceRecord>, BackendError> {
        self.call(|s| s.list_gpu_instances(gpu))
    }

    fn mig_enabled(&self, gpu: u32) -> Result<Option<bool>, BackendError> {
        self.call(|s| s.mig_enabled(gpu))
    }

    fn gpu_processes(&self, gpu: u32) -> Result<Vec<u32>, BackendError> {
        self.call(|s| s.gpu_processes(gpu))
    }

    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<MigModeChange, BackendError> {
        self.call(|s| s.set_mig_mode(gpu, enabled))
    }

    fn create_gpu_instance(&self, gpu: u32, profile_id: u32, start: u32) -> Result<u32, BackendError> {
        self.call(|s| s.create_gpu_instance(gpu, profile_id, start))
    }

    fn create_full_compute_instance(
        &self,
        gpu: u32,
        gpu_instance: u32,
    ) -> Result<CreatedComputeInstance, BackendError> {
        self.call(|s| s.create_full_compute_instance(gpu, gpu_instance))
    }

    fn destroy_compute_instance(
        &self,
        gpu: u32,
        gpu_instance: u32,
        compute_instance: u32,
    ) -> Result<(), BackendError> {
        self.call(|s| s.destroy_compute_instance(gpu, gpu_instance, compute_instance))
    }

    fn destroy_gpu_instance(&self, gpu: u32, gpu_instance: u32) -> Result<(), BackendError> {
        self.call(|s| s.destroy_gpu_instance(gpu, gpu_instance))
    }

    fn probe_health(&self, gpu: u32) -> Result<(), BackendError> {
        self.call(|s| s.probe_health(gpu))
    }
}
