//! The GPU backend: everything migdra asks of NVML.
//!
//! [`NvmlBackend`] is nvml-wrapper plus raw calls through its `-sys` function table where the
//! safe API lacks GPU/compute-instance calls. Tests run it against the fake NVML library
//! (`e2e/fake-nvml`); there is no Rust-level mock of NVML. The driver and the GPU table hold it
//! as an `Arc<dyn GpuBackend>` so a test can wrap it to hold a call (an NVML call that hangs).
//! Every backend call's wall time is measured ([`timing`]) and attributed to the kubelet call
//! it was made for, and bounded ([`bounded`]): a call NVML does not answer in time fails, and
//! marks its GPU unhealthy until it returns.

pub mod bounded;
mod nvml_backend;
mod reloading;
pub mod timing;

use migdra_api::geometry::{Architecture, MigProfile};
pub use nvml_backend::{GpuProcess, NvmlBackend};
pub use reloading::ReloadingNvml;

/// A GPU as discovered through NVML.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuDescription {
    /// NVML enumeration index (what the backend methods take).
    pub index: u32,
    /// Device minor (`/dev/nvidia<minor>`).
    pub minor: u32,
    pub uuid: String,
    pub product_name: String,
    /// Kubernetes spelling (`0000:3b:00.0`).
    pub pci_bus_id: Option<String>,
    /// PCI device ID (vendor 0x10de), which identifies the model in the catalog.
    pub pci_device_id: Option<u16>,
    pub numa_node: Option<i64>,
    pub memory_mib: u64,
    /// `None` when it is not one migdra knows.
    pub architecture: Option<Architecture>,
    /// (major, minor).
    pub cuda_compute_capability: Option<(i32, i32)>,
    /// MIG state; `None` when the GPU is not MIG-capable (GetMigMode answers NOT_SUPPORTED).
    pub mig: Option<MigDescription>,
}

/// MIG state of a MIG-capable GPU.
#[derive(Clone, Debug, PartialEq)]
pub struct MigDescription {
    pub enabled: bool,
    /// Pending mode (differs from `enabled` on Ampere until a GPU reset).
    pub pending_enabled: bool,
    /// GPU-instance profiles (index order) with their possible placements.
    pub profiles: Vec<MigProfile>,
    /// The GPU is passed through to a VM: the driver cannot reset it, so a mode change that
    /// needs a reset (Ampere) would only ever be pending.
    pub passthrough: bool,
}

/// GPU `minor` exactly as the catalog describes model `key`; `mig` is its MIG mode (`None`:
/// not MIG-capable).
#[cfg(test)]
pub(crate) fn catalog_gpu(minor: u32, key: &str, mig: Option<bool>) -> GpuDescription {
    let model = migdra_api::catalog::model(key).expect("a catalog model");
    GpuDescription {
        index: minor,
        minor,
        uuid: model.uuid(minor),
        product_name: model.product_name.to_string(),
        pci_bus_id: None,
        pci_device_id: model.pci_device_ids.first().copied(),
        numa_node: None,
        memory_mib: model.memory_mib,
        architecture: Some(model.architecture),
        cuda_compute_capability: None,
        mig: mig.map(|enabled| MigDescription {
            enabled,
            pending_enabled: enabled,
            profiles: model.profiles.clone(),
            passthrough: false,
        }),
    }
}

/// A compute instance inside a GPU instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ComputeInstanceRecord {
    pub id: u32,
    pub profile_id: u32,
    /// `MIG-…` UUID of the MIG device this compute instance forms.
    pub mig_uuid: String,
}

/// A GPU instance that exists on a GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInstanceRecord {
    pub id: u32,
    pub profile_id: u32,
    /// Placement start and size, in memory slices.
    pub start: u32,
    pub size: u32,
    /// Its compute instances (empty for a GI left without a CI).
    pub compute_instances: Vec<ComputeInstanceRecord>,
}

/// What a newly created full compute instance is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CreatedComputeInstance {
    pub id: u32,
    /// `MIG-…` UUID of the new MIG device.
    pub mig_uuid: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MigModeChange {
    Applied,
    /// The mode is pending a GPU reset the driver could not do itself (Ampere with clients
    /// holding the GPU, or in a pass-through VM).
    PendingReset,
}

/// NVML return codes migdra distinguishes (`NVML_ERROR_<NAME>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NvmlErrorKind {
    InvalidArgument,
    NotSupported,
    NoPermission,
    NotFound,
    /// NVML_ERROR_GPU_IS_LOST.
    GpuLost,
    ResetRequired,
    InUse,
    /// Occupied, overlapping or over budget.
    InsufficientResources,
    /// The call did not return within the call timeout, or another call on the same GPU has
    /// not ([`bounded`]); not an NVML return code.
    NotAnswering,
    /// NVML_ERROR_LIB_RM_VERSION_MISMATCH: the loaded library is not the kernel driver's
    /// version (the driver was upgraded or reloaded under this process).
    RmVersionMismatch,
    /// Any other failure, including a missing library or symbol.
    Other,
}

/// A failed backend call, with what was being done.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{operation} failed: {message}")]
pub struct BackendError {
    /// What was being done, e.g. `create GPU instance 3g.40gb@4 on GPU 0`.
    pub operation: String,
    pub kind: NvmlErrorKind,
    /// NVML's message or the underlying error.
    pub message: String,
}

/// Everything migdra needs from NVML. GPUs are addressed by NVML index.
///
/// Safe to call from several threads; migdra serialises operations per GPU itself.
pub trait GpuBackend: Send + Sync {
    /// NVIDIA driver version (`nvmlSystemGetDriverVersion`).
    fn driver_version(&self) -> Result<String, BackendError>;

    /// Discovers every GPU, its MIG mode and, for MIG-capable GPUs, every GPU-instance profile
    /// with its real profile ID and its possible placements.
    fn discover(&self) -> Result<Vec<GpuDescription>, BackendError>;

    /// Lists the GPU instances of a GPU with their compute instances. Empty when MIG is off.
    /// A profile whose listing NVML does not support is skipped (it cannot have instances).
    /// Each compute instance carries its `MIG-` UUID, never a `GPU-` one.
    fn list_gpu_instances(&self, gpu: u32) -> Result<Vec<GpuInstanceRecord>, BackendError>;

    /// The current MIG mode; `None` on a GPU without MIG.
    fn mig_enabled(&self, gpu: u32) -> Result<Option<bool>, BackendError>;

    /// The PIDs of the compute and graphics processes running on a GPU (ascending, each
    /// once). NVML cannot list other NVML sessions (DCGM, a second plugin): they hold the
    /// GPU without showing here.
    fn gpu_processes(&self, gpu: u32) -> Result<Vec<u32>, BackendError>;

    /// Switches MIG mode and reads back what happened: `Applied`, `PendingReset` (the
    /// change waits for a reset the driver could not do), or the activation status as the
    /// error (for example `InUse`). The GPU is re-opened afterwards; a GPU that NVML
    /// renumbered (index or minor) is an error, since it must be rediscovered.
    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<MigModeChange, BackendError>;

    /// Creates a GPU instance of `profile_id` at `start` and returns its GPU-instance ID.
    /// An occupied or over-budget placement fails with `InsufficientResources`.
    fn create_gpu_instance(&self, gpu: u32, profile_id: u32, start: u32) -> Result<u32, BackendError>;

    /// Creates the compute instance that spans the whole GPU instance.
    fn create_full_compute_instance(
        &self,
        gpu: u32,
        gpu_instance: u32,
    ) -> Result<CreatedComputeInstance, BackendError>;

    /// Destroys a compute instance. A missing GPU or compute instance fails with `NotFound`.
    fn destroy_compute_instance(
        &self,
        gpu: u32,
        gpu_instance: u32,
        compute_instance: u32,
    ) -> Result<(), BackendError>;

    /// Destroys a GPU instance (its compute instances must be gone first, or `InUse`).
    /// A missing GPU instance fails with `NotFound`.
    fn destroy_gpu_instance(&self, gpu: u32, gpu_instance: u32) -> Result<(), BackendError>;

    /// Probes a GPU; `Err` (for example `GpuLost`) means it is unhealthy.
    fn probe_health(&self, gpu: u32) -> Result<(), BackendError>;
}
