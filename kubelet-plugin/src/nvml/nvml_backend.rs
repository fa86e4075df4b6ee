//! The production [`GpuBackend`]: nvml-wrapper's safe API where it exists and is correct,
//! raw calls through its function table (resolved with `nvml_sym`, checked with `nvml_try`)
//! for the GPU/compute-instance calls it lacks or gets wrong (possible placements).
//!
//! What real NVML leaves open is checked rather than assumed (`mig-nvml.md` §12): the MIG
//! UUID a compute instance's info leads to must be a `MIG-` one (else the MIG device handles
//! are walked), a MIG-mode switch's outcome is read back from the mode, NOT_SUPPORTED means
//! "MIG is off" only when the mode says so, and one failing profile skips only itself.
//!
//! Never calls the `NvmlLib::nvmlXxx()` convenience methods: they panic when a symbol is
//! missing from the loaded library.
#![allow(unsafe_code)]

use std::{
    collections::{BTreeMap, HashMap},
    path::Path,
    ptr,
    sync::Mutex,
};

use migdra_api::{
    catalog,
    geometry::{Architecture, Engines, MigProfile},
    nvml_constants::{
        CI_ENGINE_PROFILE_SHARED, GI_PROFILE_1_SLICE_ALL_ME, GI_PROFILE_1_SLICE_GFX,
        GI_PROFILE_1_SLICE_NO_ME, GI_PROFILE_1_SLICE_REV1, GI_PROFILE_2_SLICE_ALL_ME, GI_PROFILE_2_SLICE_GFX,
        GI_PROFILE_2_SLICE_NO_ME, GI_PROFILE_2_SLICE_REV1, GI_PROFILE_3_SLICE_GFX, GI_PROFILE_4_SLICE_GFX,
        full_compute_instance_profile,
    },
    profile::{ProfileName, ProfileVariant},
};
use nvml_wrapper::{
    Device, Nvml,
    enum_wrappers::device::GpuVirtualizationMode,
    error::{NvmlError, nvml_sym, nvml_try},
};
use nvml_wrapper_sys::bindings::{
    nvmlComputeInstance_t, nvmlComputeInstanceInfo_t, nvmlComputeInstanceProfileInfo_t, nvmlDevice_t,
    nvmlDeviceArchitecture_t, nvmlGpuInstance_t, nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t,
    nvmlGpuInstanceProfileInfo_v2_t, nvmlMemory_t,
};

use super::{
    BackendError, ComputeInstanceRecord, CreatedComputeInstance, GpuBackend, GpuDescription,
    GpuInstanceRecord, MigDescription, MigModeChange, NvmlErrorKind, timing,
};
use crate::lock;

/// NVML_ERROR_INSUFFICIENT_RESOURCES, which nvml-wrapper 0.13 has no variant for.
const INSUFFICIENT_RESOURCES: u32 = 23;
/// Upper bound of GPU instances of one profile (GI IDs run 0..=14).
const MAX_GPU_INSTANCES: u32 = 15;
/// Upper bound of compute instances in one GPU instance (CI IDs run 0..=7).
const MAX_COMPUTE_INSTANCES: u32 = 8;
const MIB: u64 = 1024 * 1024;

/// The function `$name` of the loaded library (`FailedToLoadSymbol` when it lacks it).
macro_rules! sym {
    ($self:ident, $name:ident) => {
        nvml_sym($self.nvml.lib().$name.as_ref())
    };
}

/// A device handle NVML gave us.
#[derive(Clone, Copy)]
struct RawDevice(nvmlDevice_t);

// SAFETY: an NVML device handle is an opaque token valid process-wide until nvmlShutdown
// (which only happens when the owning `Nvml` drops, after every user of the backend), and
// NVML is documented thread-safe, so it may be used from any thread.
unsafe impl Send for RawDevice {}
// SAFETY: as above; the handle is never dereferenced by us, only passed back to NVML.
unsafe impl Sync for RawDevice {}

/// The production GPU backend over the NVIDIA Management Library.
pub struct NvmlBackend {
    // Declared before `nvml` so cached handles are gone before NVML shuts down.
    devices: Mutex<HashMap<u32, RawDevice>>,
    /// The device minor each GPU (by index) had when last described: what the plugin's
    /// device names and CDI specs use, so a mode change that renumbers it is detected even
    /// on a later call that changes nothing.
    described_minors: Mutex<HashMap<u32, u32>>,
    nvml: Nvml,
}

impl std::fmt::Debug for NvmlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlBackend").finish_non_exhaustive()
    }
}

fn kind_of(err: &NvmlError) -> NvmlErrorKind {
    match err {
        NvmlError::InvalidArg => NvmlErrorKind::InvalidArgument,
        NvmlError::NotSupported => NvmlErrorKind::NotSupported,
        NvmlError::NoPermission => NvmlErrorKind::NoPermission,
        NvmlError::NotFound => NvmlErrorKind::NotFound,
        NvmlError::GpuLost => NvmlErrorKind::GpuLost,
        NvmlError::ResetRequired => NvmlErrorKind::ResetRequired,
        NvmlError::InUse => NvmlErrorKind::InUse,
        NvmlError::LibRmVersionMismatch => NvmlErrorKind::RmVersionMismatch,
        NvmlError::UnexpectedVariant(INSUFFICIENT_RESOURCES) => NvmlErrorKind::InsufficientResources,
        _ => NvmlErrorKind::Other,
    }
}

fn nvml_message(err: &NvmlError) -> String {
    match err {
        NvmlError::UnexpectedVariant(INSUFFICIENT_RESOURCES) => {
            "insufficient resources (placement occupied, overlapping or over budget)".to_string()
        }
        other => other.to_string(),
    }
}

fn error(operation: impl Into<String>, err: &NvmlError) -> BackendError {
    failure(operation, kind_of(err), nvml_message(err))
}

fn failure(operation: impl Into<String>, kind: NvmlErrorKind, message: impl Into<String>) -> BackendError {
    BackendError {
        operation: operation.into(),
        kind,
        message: message.into(),
    }
}

/// Profile indexes asked about at most: a bound for a driver that never answers
/// INVALID_ARGUMENT.
const MAX_PROFILE_INDEXES: u32 = 64;

/// Walks profile indexes 0, 1, … with `info` until NVML answers INVALID_ARGUMENT, which nvml.h
/// gives for an index the driver does not know; an index answering NOT_SUPPORTED (the GPU lacks
/// that profile) is skipped. Yields the answers in between, failures included, with their
/// indexes. Lazy, so a caller that stops at an answer asks NVML nothing more. Not a fixed
/// count: a newer driver knows more indexes than the header migdra was built with.
fn walk_profile_indexes<T>(
    mut info: impl FnMut(u32) -> Result<T, NvmlError>,
) -> impl Iterator<Item = (u32, Result<T, NvmlError>)> {
    let mut ended = false;
    (0..MAX_PROFILE_INDEXES).filter_map(move |index| {
        if ended {
            return None;
        }
        match info(index) {
            Err(NvmlError::InvalidArg) => {
                ended = true;
                None
            }
            Err(NvmlError::NotSupported) => None,
            answer => Some((index, answer)),
        }
    })
}

/// Normalises NVML's `00000000:3B:00.0` to the Kubernetes spelling `0000:3b:00.0`.
fn normalize_bus_id(bus_id: &str) -> String {
    let lower = bus_id.to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => format!("{}:{rest}", &domain[domain.len() - 4..]),
        _ => lower,
    }
}

/// go-nvlib's memory size in a profile name: the profile's share of memory rounded up to
/// eighths, times the device memory rounded up to whole GiB, rounded.
fn profile_memory_gb(device_memory_bytes: u64, profile_memory_mib: u64) -> u32 {
    const GIB: u64 = 1024 * MIB;
    if device_memory_bytes == 0 {
        return 0;
    }
    let fraction = (profile_memory_mib * MIB) as f64 / device_memory_bytes as f64;
    let eighths = (fraction * 8.0).ceil() / 8.0;
    let device_gib = device_memory_bytes.div_ceil(GIB) as f64;
    (eighths * device_gib).round() as u32
}

/// The name variant go-nvlib derives from a GPU-instance profile index.
fn variant_of_index(index: u32) -> ProfileVariant {
    match index {
        GI_PROFILE_1_SLICE_REV1 | GI_PROFILE_2_SLICE_REV1 => ProfileVariant::MediaEngines,
        GI_PROFILE_1_SLICE_NO_ME | GI_PROFILE_2_SLICE_NO_ME => ProfileVariant::NoMediaEngines,
        GI_PROFILE_1_SLICE_ALL_ME | GI_PROFILE_2_SLICE_ALL_ME => ProfileVariant::AllMediaEngines,
        GI_PROFILE_1_SLICE_GFX | GI_PROFILE_2_SLICE_GFX | GI_PROFILE_4_SLICE_GFX | GI_PROFILE_3_SLICE_GFX => {
            ProfileVariant::Graphics
        }
        _ => ProfileVariant::Standard,
    }
}

impl NvmlBackend {
    /// Loads NVML from `lib_path` (default: `libnvidia-ml.so.1` through the loader's search
    /// path) and initialises it.
    pub fn new(lib_path: Option<&Path>) -> Result<Self, BackendError> {
        let mut builder = Nvml::builder();
        if let Some(path) = lib_path {
            builder.lib_path(path.as_os_str());
        }
        let nvml = builder.init().map_err(|e| {
            let what = lib_path.map_or("libnvidia-ml.so.1".into(), |p| p.display().to_string());
            error(format!("initialise NVML from {what}"), &e)
        })?;
        Ok(Self {
            devices: Mutex::new(HashMap::new()),
            described_minors: Mutex::new(HashMap::new()),
            nvml,
        })
    }

    /// The device handle of GPU `index`, cached: NVML handle lookups can be slow under load.
    fn device(&self, index: u32) -> Result<Device<'_>, BackendError> {
        let mut cache = lock(&self.devices);
        let raw = match cache.get(&index) {
            Some(raw) => *raw,
            None => {
                let device = self
                    .nvml
                    .device_by_index(index)
                    .map_err(|e| error(format!("get handle of GPU {index}"), &e))?;
                // SAFETY: reading the handle out of a Device we own; it stays valid while
                // `self.nvml` is initialised.
                let raw = RawDevice(unsafe { device.handle() });
                cache.insert(index, raw);
                raw
            }
        };
        // SAFETY: the handle came from `device_by_index` on this very `Nvml`.
        Ok(unsafe { Device::new(raw.0, &self.nvml) })
    }

    /// Whether the GPU's MIG partitions may be managed here: not in a vGPU guest or on a
    /// vGPU/vSGA hypervisor host (there the GPU is offered whole only). Bare metal and
    /// pass-through VMs manage MIG themselves; a driver without the call is bare metal.
    /// An unreadable mode is an error, not "no MIG": a MIG-capable GPU described without MIG
    /// would be handed out whole with its MIG mode (and instances) still on.
    fn manages_mig(&self, gpu: u32, device: &Device<'_>) -> Result<bool, NvmlError> {
        match device.virtualization_mode() {
            Ok(GpuVirtualizationMode::Bare | GpuVirtualizationMode::PassThrough) => Ok(true),
            Ok(mode) => {
                tracing::info!(gpu, ?mode, "GPU is virtualised; offered whole only, without MIG");
                Ok(false)
            }
            Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_) | NvmlError::FunctionNotFound) => {
                Ok(true)
            }
            Err(e) => Err(e),
        }
    }

    fn architecture(&self, device: &Device<'_>) -> Result<Option<Architecture>, NvmlError> {
        let f = sym!(self, nvmlDeviceGetArchitecture)?;
        let mut arch: nvmlDeviceArchitecture_t = 0;
        // SAFETY: valid device handle and a valid out pointer.
        unsafe { nvml_try(f(device.handle(), &mut arch))? };
        Ok(Architecture::from_nvml_value(arch))
    }

    /// Total memory in bytes (memory info v2, falling back to v1 for older drivers).
    fn memory_total(&self, device: &Device<'_>) -> Result<u64, NvmlError> {
        match device.memory_info() {
            Ok(info) => Ok(info.total),
            Err(NvmlError::FailedToLoadSymbol(_) | NvmlError::NotSupported) => {
                let f = sym!(self, nvmlDeviceGetMemoryInfo)?;
                // SAFETY: a C struct of integers, for which all zeros is a valid value.
                let mut info: nvmlMemory_t = unsafe { std::mem::zeroed() };
                // SAFETY: valid device handle and a valid out pointer.
                unsafe { nvml_try(f(device.handle(), &mut info))? };
                Ok(info.total)
            }
            Err(e) => Err(e),
        }
    }

    fn possible_placements(
        &self,
        device: &Device<'_>,
        profile_id: u32,
    ) -> Result<Vec<nvmlGpuInstancePlacement_t>, NvmlError> {
        // Not `Device::possible_placements`: it never sets the vector's length.
        let f = sym!(self, nvmlDeviceGetGpuInstancePossiblePlacements_v2)?;
        let mut count: u32 = 0;
        // SAFETY: valid device handle; a NULL array asks for the count only.
        unsafe { nvml_try(f(device.handle(), profile_id, ptr::null_mut(), &mut count))? };
        if count == 0 {
            return Ok(Vec::new());
        }
        let mut placements = vec![nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
        let buffer = placements.as_mut_ptr();
        // SAFETY: the buffer holds `count` entries, which NVML writes at most, updating count.
        unsafe { nvml_try(f(device.handle(), profile_id, buffer, &mut count))? };
        placements.truncate(count as usize);
        Ok(placements)
    }

    /// Every GPU-instance profile of a MIG-capable GPU, in index order, with real IDs and possible
    /// placements. A profile whose info or placements cannot be read is skipped with a warning, not
    /// taking the other profiles with it.
    ///
    /// Names do not depend on MIG mode (§12: the versioned info with the driver's name needs MIG
    /// on, and drivers' names drift): the catalog's name for the profile on a model it knows by PCI
    /// device ID, else the name go-nvlib derives from the v1 info.
    fn discover_profiles(&self, gpu: u32, device: &Device<'_>, memory_bytes: u64) -> Vec<MigProfile> {
        let known_model = device
            .pci_info()
            .ok()
            .and_then(|p| u16::try_from(p.pci_device_id >> 16).ok())
            .and_then(catalog::model_by_pci_device_id);
        let mut profiles = Vec::new();
        for (index, info) in walk_profile_indexes(|index| device.profile_info(index)) {
            // Graphics profiles are not offered: their containers would need the DRM nodes and
            // graphics libraries the CDI specs do not carry (docs/claims.md, "Graphics
            // profiles"); the standard profile of the same slices serves CUDA.
            if variant_of_index(index) == ProfileVariant::Graphics {
                continue;
            }
            let info = match info {
                Ok(info) => info,
                Err(e) => {
                    tracing::warn!(gpu, index, error = %e, "GPU-instance profile info unreadable; profile skipped");
                    continue;
                }
            };
            let placements = match self.possible_placements(device, info.id) {
                Ok(placements) => placements,
                Err(e) => {
                    tracing::warn!(gpu, profile_id = info.id, error = %e, "GPU-instance profile placements unreadable; profile skipped");
                    continue;
                }
            };
            let Some(size) = placements.first().map(|p| p.size) else {
                tracing::warn!(
                    gpu,
                    profile_id = info.id,
                    "GPU-instance profile has no placements; skipped"
                );
                continue;
            };
            let derived = ProfileName::new(
                info.slice_count,
                profile_memory_gb(memory_bytes, info.memory_size_mb),
                variant_of_index(index),
            );
            let name = known_model
                .and_then(|m| {
                    m.profiles
                        .iter()
                        .find(|p| p.gi_profile_id == info.id && p.gi_profile_index == index)
                })
                .map_or(derived, |p| p.name);
            profiles.push(MigProfile {
                name,
                gi_profile_id: info.id,
                gi_profile_index: index,
                compute_slices: info.slice_count,
                memory_slices: size,
                instance_count: info.instance_count,
                placements: placements.iter().map(|p| p.start).collect(),
                engines: Engines {
                    multiprocessors: info.multiprocessor_count,
                    copy_engines: info.copy_engine_count,
                    decoders: info.decoder_count,
                    encoders: info.encoder_count,
                    jpeg_engines: info.jpeg_count,
                    ofa_engines: info.ofa_count,
                },
                memory_mib: info.memory_size_mb,
            });
        }
        profiles
    }

    fn describe(&self, index: u32) -> Result<GpuDescription, BackendError> {
        let device = self.device(index)?;
        let op = |what: &str| format!("read {what} of GPU {index}");
        let uuid = device.uuid().map_err(|e| error(op("UUID"), &e))?;
        let product_name = device.name().map_err(|e| error(op("name"), &e))?;
        let minor = device.minor_number().map_err(|e| error(op("minor number"), &e))?;
        lock(&self.described_minors).insert(index, minor);
        let memory_bytes = self.memory_total(&device).map_err(|e| error(op("memory"), &e))?;
        let pci = device.pci_info().ok();
        let pci_bus_id = pci.as_ref().map(|p| normalize_bus_id(&p.bus_id));
        let pci_device_id = pci
            .as_ref()
            .and_then(|p| u16::try_from(p.pci_device_id >> 16).ok());
        let numa_node = device.numa_node_id().ok().map(i64::from);
        let architecture = self.architecture(&device).ok().flatten();
        let cuda_compute_capability = device.cuda_compute_capability().ok().map(|c| (c.major, c.minor));
        let manages_mig = || {
            self.manages_mig(index, &device)
                .map_err(|e| error(op("virtualization mode"), &e))
        };
        let mig = match device.mig_mode() {
            Ok(_) if !manages_mig()? => None,
            Ok(mode) => Some(MigDescription {
                enabled: mode.current != 0,
                pending_enabled: mode.pending != 0,
                profiles: self.discover_profiles(index, &device, memory_bytes),
                passthrough: matches!(
                    device.virtualization_mode(),
                    Ok(GpuVirtualizationMode::PassThrough)
                ),
            }),
            Err(NvmlError::NotSupported) => None,
            Err(e) => return Err(error(op("MIG mode"), &e)),
        };
        Ok(GpuDescription {
            index,
            minor,
            uuid,
            product_name,
            pci_bus_id,
            pci_device_id,
            numa_node,
            memory_mib: memory_bytes / MIB,
            architecture,
            cuda_compute_capability,
            mig,
        })
    }

    fn gpu_instance_by_id(&self, device: &Device<'_>, id: u32) -> Result<nvmlGpuInstance_t, NvmlError> {
        let f = sym!(self, nvmlDeviceGetGpuInstanceById)?;
        let mut gi: nvmlGpuInstance_t = ptr::null_mut();
        // SAFETY: valid device handle and a valid out pointer.
        unsafe { nvml_try(f(device.handle(), id, &mut gi))? };
        Ok(gi)
    }

    fn gpu_instance_info(&self, gi: nvmlGpuInstance_t) -> Result<nvmlGpuInstanceInfo_t, NvmlError> {
        let f = sym!(self, nvmlGpuInstanceGetInfo)?;
        // SAFETY: a C struct of integers and pointers, for which all zeros is a valid value.
        let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `gi` is a live GPU-instance handle from NVML; valid out pointer.
        unsafe { nvml_try(f(gi, &mut info))? };
        Ok(info)
    }

    fn compute_profile_info(
        &self,
        gi: nvmlGpuInstance_t,
        index: u32,
    ) -> Result<nvmlComputeInstanceProfileInfo_t, NvmlError> {
        let f = sym!(self, nvmlGpuInstanceGetComputeInstanceProfileInfo)?;
        // SAFETY: a C struct of integers, for which all zeros is a valid value.
        let mut info: nvmlComputeInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: live GPU-instance handle; valid out pointer.
        unsafe { nvml_try(f(gi, index, CI_ENGINE_PROFILE_SHARED, &mut info))? };
        Ok(info)
    }

    fn compute_instance_info(
        &self,
        ci: nvmlComputeInstance_t,
    ) -> Result<nvmlComputeInstanceInfo_t, NvmlError> {
        let f = sym!(self, nvmlComputeInstanceGetInfo_v2)?;
        // SAFETY: a C struct of integers and pointers, for which all zeros is a valid value.
        let mut info: nvmlComputeInstanceInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: live compute-instance handle; valid out pointer.
        unsafe { nvml_try(f(ci, &mut info))? };
        Ok(info)
    }

    /// The `MIG-…` UUID of the MIG device that compute instance `ci_id` of GPU instance
    /// `gi_id` forms. The compute-instance info's `device` is documented as the parent GPU
    /// but used as the MIG device by NVIDIA's driver (§12): it is trusted only when its UUID
    /// is a `MIG-` one; otherwise the parent's MIG device handles are walked and matched by
    /// GPU- and compute-instance ID. A `GPU-` UUID is never returned.
    fn mig_uuid(
        &self,
        parent: &Device<'_>,
        info_device: nvmlDevice_t,
        gi_id: u32,
        ci_id: u32,
        operation: &str,
    ) -> Result<String, BackendError> {
        if !info_device.is_null()
            // SAFETY: the handle came from NVML (ComputeInstanceGetInfo) on this `Nvml`.
            && let Ok(uuid) = unsafe { Device::new(info_device, &self.nvml) }.uuid()
            && uuid.starts_with("MIG-")
        {
            return Ok(uuid);
        }
        let mig_error = |e: &NvmlError| {
            error(
                format!("{operation}: find the MIG device of GPU instance {gi_id}, compute instance {ci_id}"),
                e,
            )
        };
        let count_of = sym!(self, nvmlDeviceGetMaxMigDeviceCount).map_err(|e| mig_error(&e))?;
        let by_index = sym!(self, nvmlDeviceGetMigDeviceHandleByIndex).map_err(|e| mig_error(&e))?;
        let gi_of = sym!(self, nvmlDeviceGetGpuInstanceId).map_err(|e| mig_error(&e))?;
        let ci_of = sym!(self, nvmlDeviceGetComputeInstanceId).map_err(|e| mig_error(&e))?;
        let mut count: u32 = 0;
        // SAFETY: valid device handle and a valid out pointer.
        unsafe { nvml_try(count_of(parent.handle(), &mut count)) }.map_err(|e| mig_error(&e))?;
        for index in 0..count {
            let mut mig: nvmlDevice_t = ptr::null_mut();
            // SAFETY: valid device handle and a valid out pointer.
            match unsafe { nvml_try(by_index(parent.handle(), index, &mut mig)) } {
                Ok(()) => {}
                // An empty slot.
                Err(NvmlError::NotFound) => continue,
                Err(e) => return Err(mig_error(&e)),
            }
            let (mut gi, mut ci) = (0u32, 0u32);
            // SAFETY: a MIG device handle NVML just returned; valid out pointers.
            unsafe {
                nvml_try(gi_of(mig, &mut gi)).map_err(|e| mig_error(&e))?;
                nvml_try(ci_of(mig, &mut ci)).map_err(|e| mig_error(&e))?;
            }
            if (gi, ci) != (gi_id, ci_id) {
                continue;
            }
            // SAFETY: as above.
            let uuid = unsafe { Device::new(mig, &self.nvml) }
                .uuid()
                .map_err(|e| mig_error(&e))?;
            if uuid.starts_with("MIG-") {
                return Ok(uuid);
            }
            return Err(failure(
                operation,
                NvmlErrorKind::Other,
                format!(
                    "the MIG device of GPU instance {gi_id}, compute instance {ci_id} has UUID {uuid}, not a MIG- one"
                ),
            ));
        }
        Err(failure(
            operation,
            NvmlErrorKind::NotFound,
            format!(
                "no MIG device of GPU instance {gi_id}, compute instance {ci_id} among the GPU's {count} MIG device slots"
            ),
        ))
    }

    fn gpu_instances_of_profile(
        &self,
        device: &Device<'_>,
        profile_id: u32,
        capacity: u32,
    ) -> Result<Vec<nvmlGpuInstance_t>, NvmlError> {
        let f = sym!(self, nvmlDeviceGetGpuInstances)?;
        // NVML has no size parameter here: the buffer must fit the profile's instance count.
        let mut handles: Vec<nvmlGpuInstance_t> =
            vec![ptr::null_mut(); capacity.max(MAX_GPU_INSTANCES) as usize];
        let mut count: u32 = 0;
        // SAFETY: valid device handle; the buffer holds at least as many entries as can exist.
        unsafe { nvml_try(f(device.handle(), profile_id, handles.as_mut_ptr(), &mut count))? };
        handles.truncate(count as usize);
        Ok(handles)
    }

    fn compute_instances_of_profile(
        &self,
        gi: nvmlGpuInstance_t,
        profile_id: u32,
        capacity: u32,
    ) -> Result<Vec<nvmlComputeInstance_t>, NvmlError> {
        let f = sym!(self, nvmlGpuInstanceGetComputeInstances)?;
        let mut handles: Vec<nvmlComputeInstance_t> =
            vec![ptr::null_mut(); capacity.max(MAX_COMPUTE_INSTANCES) as usize];
        let mut count: u32 = 0;
        // SAFETY: live GPU-instance handle; the buffer holds more entries than can exist.
        unsafe { nvml_try(f(gi, profile_id, handles.as_mut_ptr(), &mut count))? };
        handles.truncate(count as usize);
        Ok(handles)
    }

    /// The compute instances of a GPU instance. A compute-instance profile whose listing
    /// answers NOT_SUPPORTED is not supported in this GPU instance (§12), so it has none.
    fn compute_instances(
        &self,
        device: &Device<'_>,
        gi: nvmlGpuInstance_t,
        gi_id: u32,
        operation: &str,
    ) -> Result<Vec<ComputeInstanceRecord>, BackendError> {
        let mut records: Vec<ComputeInstanceRecord> = Vec::new();
        for (_, info) in walk_profile_indexes(|index| self.compute_profile_info(gi, index)) {
            let info = info.map_err(|e| error(operation, &e))?;
            let handles = match self.compute_instances_of_profile(gi, info.id, info.instanceCount) {
                Ok(handles) => handles,
                Err(NvmlError::NotSupported) => continue,
                Err(e) => return Err(error(operation, &e)),
            };
            for ci in handles {
                let ci_info = self.compute_instance_info(ci).map_err(|e| error(operation, &e))?;
                if records.iter().any(|r| r.id == ci_info.id) {
                    continue;
                }
                records.push(ComputeInstanceRecord {
                    id: ci_info.id,
                    profile_id: ci_info.profileId,
                    mig_uuid: self.mig_uuid(device, ci_info.device, gi_id, ci_info.id, operation)?,
                });
            }
        }
        records.sort_by_key(|r| r.id);
        Ok(records)
    }

    /// The GPU instance's compute slice count, from its profile's info.
    fn gpu_instance_slices(&self, device: &Device<'_>, profile_id: u32) -> Result<Option<u32>, NvmlError> {
        for (_, info) in walk_profile_indexes(|index| device.profile_info(index)) {
            let info = info?;
            if info.id == profile_id {
                return Ok(Some(info.slice_count));
            }
        }
        Ok(None)
    }

    fn create_compute_instance(
        &self,
        gi: nvmlGpuInstance_t,
        profile_id: u32,
    ) -> Result<nvmlComputeInstance_t, NvmlError> {
        let f = sym!(self, nvmlGpuInstanceCreateComputeInstance)?;
        let mut ci: nvmlComputeInstance_t = ptr::null_mut();
        // SAFETY: live GPU-instance handle; valid out pointer.
        unsafe { nvml_try(f(gi, profile_id, &mut ci))? };
        Ok(ci)
    }

    fn destroy_raw_compute_instance(&self, ci: nvmlComputeInstance_t) -> Result<(), NvmlError> {
        let f = sym!(self, nvmlComputeInstanceDestroy)?;
        // SAFETY: live compute-instance handle.
        unsafe { nvml_try(f(ci)) }
    }

    fn destroy_raw_gpu_instance(&self, gi: nvmlGpuInstance_t) -> Result<(), NvmlError> {
        let f = sym!(self, nvmlGpuInstanceDestroy)?;
        // SAFETY: live GPU-instance handle.
        unsafe { nvml_try(f(gi)) }
    }

    /// Looks a GPU instance up for destruction: a GPU instance that is gone, or cannot exist
    /// because MIG mode is off, is `NotFound`.
    fn existing_gpu_instance(
        &self,
        device: &Device<'_>,
        gpu: u32,
        gpu_instance: u32,
        operation: &str,
    ) -> Result<nvmlGpuInstance_t, BackendError> {
        match self.gpu_instance_by_id(device, gpu_instance) {
            Ok(gi) => Ok(gi),
            // NOT_SUPPORTED means "MIG is off" only if the mode says so.
            Err(NvmlError::NotSupported)
                if mig_mode(device).map_err(|e| error(operation, &e))? != Some(true) =>
            {
                Err(failure(
                    operation,
                    NvmlErrorKind::NotFound,
                    format!("MIG mode is off on GPU {gpu}, so GPU instance {gpu_instance} does not exist"),
                ))
            }
            Err(e) => Err(error(operation, &e)),
        }
    }
}

/// A process NVML lists as running on a GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuProcess {
    pub pid: u32,
    /// `compute` (CUDA context) or `graphics`.
    pub kind: &'static str,
    /// GPU and compute instance it runs in (MIG mode only).
    pub mig_instance: Option<(u32, u32)>,
}

impl NvmlBackend {
    /// The processes with a compute or graphics context on GPU `gpu` (with MIG on, those of
    /// every instance). Clients that only hold an NVML session (nv-hostengine, persistenced)
    /// are not listed by NVML.
    pub fn running_processes(&self, gpu: u32) -> Result<Vec<GpuProcess>, BackendError> {
        let device = self.device(gpu)?;
        let op = |kind: &str| format!("list the running {kind} processes of GPU {gpu}");
        let compute = device
            .running_compute_processes()
            .map_err(|e| error(op("compute"), &e))?;
        // A driver without graphics support on the GPU answers NOT_SUPPORTED: no graphics
        // processes then.
        let graphics = match device.running_graphics_processes() {
            Ok(list) => list,
            Err(NvmlError::NotSupported) => Vec::new(),
            Err(e) => return Err(error(op("graphics"), &e)),
        };
        let tag = |kind: &'static str| {
            move |p: nvml_wrapper::struct_wrappers::device::ProcessInfo| GpuProcess {
                pid: p.pid,
                kind,
                mig_instance: p.gpu_instance_id.zip(p.compute_instance_id),
            }
        };
        Ok(compute
            .into_iter()
            .map(tag("compute"))
            .chain(graphics.into_iter().map(tag("graphics")))
            .collect())
    }

    /// The names NVML gives GPU `gpu`'s GPU-instance profiles, by profile ID, from the
    /// versioned profile info (`MIG 1g.10gb` read as `1g.10gb`). Needs MIG mode on; the plugin
    /// does not use these names (drivers' names drift) but gpu-check shows them for a model
    /// the catalog does not know.
    pub fn gpu_instance_profile_names(&self, gpu: u32) -> Result<BTreeMap<u32, String>, BackendError> {
        let device = self.device(gpu)?;
        let op = |index: u32| {
            format!("read the versioned info of GPU-instance profile index {index} of GPU {gpu}")
        };
        let f = sym!(self, nvmlDeviceGetGpuInstanceProfileInfoV).map_err(|e| error(op(0), &e))?;
        let version = u32::try_from(std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>())
            .map_or(0, |size| size | (2 << 24));
        let read = |index: u32| {
            // SAFETY: a C struct of integers and a char array, for which all zeros is valid.
            let mut info: nvmlGpuInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
            info.version = version;
            // SAFETY: valid device handle; `info` is a v2 info with its version set.
            unsafe { nvml_try(f(device.handle(), index, &mut info)) }.map(|()| info)
        };
        let mut names = BTreeMap::new();
        for (index, info) in walk_profile_indexes(read) {
            let info = info.map_err(|e| error(op(index), &e))?;
            let bytes: Vec<u8> = info
                .name
                .iter()
                .take_while(|c| **c != 0)
                .map(|c| c.to_ne_bytes()[0])
                .collect();
            let name = String::from_utf8_lossy(&bytes);
            let name = name.trim();
            names.insert(info.id, name.strip_prefix("MIG ").unwrap_or(name).to_string());
        }
        Ok(names)
    }
}

/// The current MIG mode; `None` on a GPU without MIG.
fn mig_mode(device: &Device<'_>) -> Result<Option<bool>, NvmlError> {
    match device.mig_mode() {
        Ok(mode) => Ok(Some(mode.current != 0)),
        Err(NvmlError::NotSupported) => Ok(None),
        Err(e) => Err(e),
    }
}

impl GpuBackend for NvmlBackend {
    fn driver_version(&self) -> Result<String, BackendError> {
        timing::timed("driver_version", || {
            self.nvml
                .sys_driver_version()
                .map_err(|e| error("read driver version", &e))
        })
    }

    fn discover(&self) -> Result<Vec<GpuDescription>, BackendError> {
        timing::timed("discover", || {
            let count = self.nvml.device_count().map_err(|e| error("count GPUs", &e))?;
            // One failing GPU (lost, fallen off the bus) must not hide the others; the driver
            // reports a GPU it knew but no longer discovers as unhealthy.
            let mut gpus = Vec::new();
            let mut last_error = None;
            for index in 0..count {
                match self.describe(index) {
                    Ok(gpu) => gpus.push(gpu),
                    Err(e) => {
                        tracing::warn!(gpu = index, error = %e, "GPU could not be described; skipped");
                        last_error = Some(e);
                    }
                }
            }
            match last_error {
                Some(e) if gpus.is_empty() => Err(e),
                _ => Ok(gpus),
            }
        })
    }

    fn list_gpu_instances(&self, gpu: u32) -> Result<Vec<GpuInstanceRecord>, BackendError> {
        timing::timed("list_gpu_instances", || {
            let device = self.device(gpu)?;
            let op = || format!("list GPU instances of GPU {gpu}");
            if mig_mode(&device).map_err(|e| error(op(), &e))? != Some(true) {
                return Ok(Vec::new());
            }
            let mut records = Vec::new();
            for (_, info) in walk_profile_indexes(|index| device.profile_info(index)) {
                let info = info.map_err(|e| error(op(), &e))?;
                let handles = match self.gpu_instances_of_profile(&device, info.id, info.instance_count) {
                    Ok(handles) => handles,
                    // This profile is not supported here (§12), which says nothing about the others.
                    Err(NvmlError::NotSupported) => {
                        tracing::debug!(
                            gpu,
                            profile_id = info.id,
                            "listing GPU instances of a profile is not supported; skipped"
                        );
                        continue;
                    }
                    Err(e) => return Err(error(op(), &e)),
                };
                for gi in handles {
                    let gi_info = self.gpu_instance_info(gi).map_err(|e| error(op(), &e))?;
                    records.push(GpuInstanceRecord {
                        id: gi_info.id,
                        profile_id: gi_info.profileId,
                        start: gi_info.placement.start,
                        size: gi_info.placement.size,
                        compute_instances: self.compute_instances(&device, gi, gi_info.id, &op())?,
                    });
                }
            }
            records.sort_by_key(|r| r.id);
            Ok(records)
        })
    }

    fn gpu_processes(&self, gpu: u32) -> Result<Vec<u32>, BackendError> {
        timing::timed("gpu_processes", || {
            let pids: std::collections::BTreeSet<u32> =
                self.running_processes(gpu)?.iter().map(|p| p.pid).collect();
            Ok(pids.into_iter().collect())
        })
    }

    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<MigModeChange, BackendError> {
        timing::timed("set_mig_mode", || {
            let device = self.device(gpu)?;
            let op = format!(
                "{} MIG mode on GPU {gpu}",
                if enabled { "enable" } else { "disable" }
            );
            let fail = |e: NvmlError| error(&op, &e);
            let uuid = device.uuid().map_err(fail)?;
            let described = lock(&self.described_minors).get(&gpu).copied();
            let minor = described.map_or_else(|| device.minor_number().map_err(fail), Ok)?;
            // NVML reports a switch it could not make through the activation status, not the
            // return code (§12), so the outcome is read back from the mode, as mig-parted does.
            let activation = device.set_mig_mode(enabled).map_err(fail)?;
            // The switch may reset or rebind the GPU: handles, index and minor may change.
            lock(&self.devices).clear();
            let device = self
                .nvml
                .device_by_uuid(uuid.as_str())
                .map_err(|e| error(format!("{op}: re-open the GPU by UUID {uuid}"), &e))?;
            let new_index = device.index().map_err(fail)?;
            let new_minor = device.minor_number().map_err(fail)?;
            if (new_index, new_minor) != (gpu, minor) {
                return Err(failure(
                    &op,
                    NvmlErrorKind::Other,
                    format!(
                        "the GPU was renumbered by the mode change (index {gpu} -> {new_index}, minor {minor} -> {new_minor}); it must be rediscovered"
                    ),
                ));
            }
            let mode = device.mig_mode().map_err(fail)?;
            let wanted = u32::from(enabled);
            if mode.current == wanted {
                Ok(MigModeChange::Applied)
            } else if mode.pending == wanted {
                tracing::info!(gpu, activation, "MIG mode change is pending a GPU reset");
                Ok(MigModeChange::PendingReset)
            } else {
                Err(fail(NvmlError::from(activation)))
            }
        })
    }

    fn create_gpu_instance(&self, gpu: u32, profile_id: u32, start: u32) -> Result<u32, BackendError> {
        timing::timed("create_gpu_instance", || {
            let device = self.device(gpu)?;
            let op = format!("create GPU instance of profile {profile_id} at {start} on GPU {gpu}");
            let fail = |e: NvmlError| error(&op, &e);
            // Every placement of a profile has the same size; NVML validates the start.
            let placements = self.possible_placements(&device, profile_id).map_err(fail)?;
            let size = placements.first().map(|p| p.size).ok_or_else(|| {
                failure(
                    &op,
                    NvmlErrorKind::InvalidArgument,
                    "the profile has no placements",
                )
            })?;
            let f = sym!(self, nvmlDeviceCreateGpuInstanceWithPlacement).map_err(fail)?;
            let placement = nvmlGpuInstancePlacement_t { start, size };
            let mut gi: nvmlGpuInstance_t = ptr::null_mut();
            // SAFETY: valid device handle, a placement that lives across the call, valid out pointer.
            unsafe { nvml_try(f(device.handle(), profile_id, &placement, &mut gi)) }.map_err(fail)?;
            match self.gpu_instance_info(gi) {
                Ok(info) => Ok(info.id),
                Err(e) => {
                    // Without its ID nobody could ever destroy it: roll back.
                    if let Err(undo) = self.destroy_raw_gpu_instance(gi) {
                        tracing::warn!(gpu, profile_id, start, error = %undo, "rolling back an unidentifiable GPU instance failed");
                    }
                    Err(fail(e))
                }
            }
        })
    }

    fn create_full_compute_instance(
        &self,
        gpu: u32,
        gpu_instance: u32,
    ) -> Result<CreatedComputeInstance, BackendError> {
        timing::timed("create_full_compute_instance", || {
            let device = self.device(gpu)?;
            let op = format!("create the compute instance of GPU instance {gpu_instance} on GPU {gpu}");
            let fail = |e: NvmlError| error(&op, &e);
            let gi = self.gpu_instance_by_id(&device, gpu_instance).map_err(fail)?;
            let gi_info = self.gpu_instance_info(gi).map_err(fail)?;
            let slices = self
                .gpu_instance_slices(&device, gi_info.profileId)
                .map_err(fail)?
                .ok_or_else(|| {
                    let message = format!(
                        "GPU-instance profile {} is not among the GPU's profiles",
                        gi_info.profileId
                    );
                    failure(&op, NvmlErrorKind::NotSupported, message)
                })?;
            // Every CI profile spanning the whole GPU instance, the plain one first: a 1-slice GI
            // may need `1_SLICE_REV1` (GH200), and a 7-slice one may also offer `7_SLICE_NVL`
            // (index 8), which go-nvlib maps to "7c" like the plain one (NVIDIA's DRA driver issue
            // #1480): a duplicate of the same size is only tried when the plain one is refused.
            let plain = full_compute_instance_profile(slices);
            let mut last_error = NvmlError::NotSupported;
            let mut candidates: Vec<(u32, u32)> = Vec::new();
            for (index, info) in walk_profile_indexes(|index| self.compute_profile_info(gi, index)) {
                match info {
                    Ok(p) if p.sliceCount == slices => candidates.push((index, p.id)),
                    Ok(_) => {}
                    Err(e) => return Err(fail(e)),
                }
            }
            candidates.sort_by_key(|(index, _)| Some(*index) != plain);
            let candidates = candidates.into_iter().map(|(_, id)| id);
            let mut created = None;
            for profile_id in candidates {
                match self.create_compute_instance(gi, profile_id) {
                    Ok(ci) => {
                        created = Some(ci);
                        break;
                    }
                    Err(e @ (NvmlError::NotSupported | NvmlError::InvalidArg)) => last_error = e,
                    Err(e) => return Err(fail(e)),
                }
            }
            let ci = created.ok_or_else(|| fail(last_error))?;
            let identified = self.compute_instance_info(ci).map_err(fail).and_then(|info| {
                Ok(CreatedComputeInstance {
                    id: info.id,
                    mig_uuid: self.mig_uuid(&device, info.device, gi_info.id, info.id, &op)?,
                })
            });
            identified.inspect_err(|_| {
                // A MIG device nobody can name is useless; do not leave it behind.
                if let Err(undo) = self.destroy_raw_compute_instance(ci) {
                    tracing::warn!(gpu, gpu_instance, error = %undo, "rolling back an unidentifiable compute instance failed");
                }
            })
        })
    }

    fn destroy_compute_instance(
        &self,
        gpu: u32,
        gpu_instance: u32,
        compute_instance: u32,
    ) -> Result<(), BackendError> {
        timing::timed("destroy_compute_instance", || {
            let device = self.device(gpu)?;
            let op = format!(
                "destroy compute instance {compute_instance} of GPU instance {gpu_instance} on GPU {gpu}"
            );
            let fail = |e: NvmlError| error(&op, &e);
            let gi = self.existing_gpu_instance(&device, gpu, gpu_instance, &op)?;
            let f = sym!(self, nvmlGpuInstanceGetComputeInstanceById).map_err(fail)?;
            let mut ci: nvmlComputeInstance_t = ptr::null_mut();
            // SAFETY: live GPU-instance handle; valid out pointer.
            unsafe { nvml_try(f(gi, compute_instance, &mut ci)) }.map_err(fail)?;
            self.destroy_raw_compute_instance(ci).map_err(fail)
        })
    }

    fn destroy_gpu_instance(&self, gpu: u32, gpu_instance: u32) -> Result<(), BackendError> {
        timing::timed("destroy_gpu_instance", || {
            let device = self.device(gpu)?;
            let op = format!("destroy GPU instance {gpu_instance} on GPU {gpu}");
            let gi = self.existing_gpu_instance(&device, gpu, gpu_instance, &op)?;
            self.destroy_raw_gpu_instance(gi).map_err(|e| error(&op, &e))
        })
    }

    fn mig_enabled(&self, gpu: u32) -> Result<Option<bool>, BackendError> {
        timing::timed("mig_enabled", || {
            mig_mode(&self.device(gpu)?).map_err(|e| error(format!("read MIG mode of GPU {gpu}"), &e))
        })
    }

    fn probe_health(&self, gpu: u32) -> Result<(), BackendError> {
        timing::timed("probe_health", || {
            let device = self.device(gpu)?;
            device
                .uuid()
                .map(|_| ())
                .map_err(|e| error(format!("probe GPU {gpu}"), &e))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_use_the_kubernetes_spelling() {
        assert_eq!(normalize_bus_id("00000000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(normalize_bus_id("0000:3b:00.0"), "0000:3b:00.0");
    }

    #[test]
    fn derived_names_match_published_profile_names() {
        let gib = 1024 * MIB;
        // A100-40GB: 40960 MiB.
        assert_eq!(profile_memory_gb(40 * gib, 4864), 5);
        assert_eq!(profile_memory_gb(40 * gib, 9856), 10);
        assert_eq!(profile_memory_gb(40 * gib, 40192), 40);
        // B200: 183359 MiB, 1g is 22528 MiB and named 23gb.
        assert_eq!(profile_memory_gb(183_359 * MIB, 22528), 23);
        // H200: 3g at 71168 MiB of 143771 is 71gb.
        assert_eq!(profile_memory_gb(143_771 * MIB, 71168), 71);
        assert_eq!(
            variant_of_index(GI_PROFILE_1_SLICE_REV1),
            ProfileVariant::MediaEngines
        );
        assert_eq!(variant_of_index(9), ProfileVariant::Standard);
    }

    #[test]
    fn insufficient_resources_has_its_own_kind() {
        assert_eq!(
            kind_of(&NvmlError::UnexpectedVariant(23)),
            NvmlErrorKind::InsufficientResources
        );
        assert_eq!(kind_of(&NvmlError::UnexpectedVariant(25)), NvmlErrorKind::Other);
        assert_eq!(kind_of(&NvmlError::InUse), NvmlErrorKind::InUse);
    }
}
