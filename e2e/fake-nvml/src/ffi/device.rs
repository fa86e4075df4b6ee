//! Device queries: handles by index and UUID, identity (index, UUID, name, minor, PCI, NUMA,
//! architecture, compute capability), memory and attributes. UUID, name, memory, PCI and
//! attributes also answer for MIG device handles; the rest are physical-GPU-only.

use std::ffi::{CStr, c_char, c_int, c_uint};

use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlDeviceArchitecture_t, nvmlDeviceAttributes_t, nvmlMemory_t, nvmlMemory_v2_t,
    nvmlPciInfo_t, nvmlReturn_t,
};

use super::{
    MEMORY_V2,
    call::{NullOut::OnWrite, call, entry, get, gpu_ref},
    handles::{Handle, any_device, handle_ptr, physical},
    memory::{Ptr, StrBuf, fixed_str},
    mig_devices::{mig_profile_name, mig_view},
};
use crate::{
    code::{ARGUMENT_VERSION_MISMATCH, INVALID_ARGUMENT, NOT_FOUND, UNKNOWN},
    state::GpuState,
};

fn handle_by_index(index: c_uint, device: *mut nvmlDevice_t, function: &str) -> nvmlReturn_t {
    // SAFETY: NVML contract: `device` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(device) };
    get(function, Ok(index), out, OnWrite, |_, gpu| {
        Ok(handle_ptr(Handle::Gpu(gpu)))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    handle_by_index(index, device, "nvmlDeviceGetHandleByIndex_v2")
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    handle_by_index(index, device, "nvmlDeviceGetHandleByIndex")
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `device` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(device) };
    let wanted = if uuid.is_null() {
        None
    } else {
        // SAFETY: NVML contract: a non-NULL `uuid` is a NUL-terminated string.
        Some(unsafe { CStr::from_ptr(uuid) }.to_string_lossy().into_owned())
    };
    entry(|| {
        let wanted = wanted.ok_or(INVALID_ARGUMENT)?;
        call("nvmlDeviceGetHandleByUUID", None, |s| {
            if let Some(g) = s.gpus.iter().find(|g| g.uuid == wanted) {
                gpu_ref(s, g.index)?;
                return out.set(handle_ptr(Handle::Gpu(g.index)));
            }
            let (gpu, gi_id, ci_id) = s.find_mig_uuid(&wanted).ok_or(NOT_FOUND)?;
            let g = gpu_ref(s, gpu)?;
            let ci = g
                .gpu_instance_by_id(gi_id)
                .and_then(|gi| gi.compute_instances.iter().find(|ci| ci.id == ci_id))
                .ok_or(NOT_FOUND)?;
            out.set(handle_ptr(Handle::Mig { gpu, ci: ci.serial }))
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut c_uint) -> nvmlReturn_t {
    // SAFETY: NVML contract: `index` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(index) };
    get("nvmlDeviceGetIndex", physical(device), out, OnWrite, |g, _| {
        Ok(g.index)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `uuid` is NULL or holds `length` bytes.
    let out = unsafe { StrBuf::new(uuid, length) };
    get(
        "nvmlDeviceGetUUID",
        any_device(device),
        out,
        OnWrite,
        |g, handle| match handle {
            Handle::Mig { ci, .. } => Ok(mig_view(g, ci)?.uuid),
            _ => Ok(g.uuid.clone()),
        },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `name` is NULL or holds `length` bytes.
    let out = unsafe { StrBuf::new(name, length) };
    get(
        "nvmlDeviceGetName",
        any_device(device),
        out,
        OnWrite,
        |g, handle| {
            let model = g.fake_model().ok_or(UNKNOWN)?;
            let product = g.quirks.product_name.as_deref().unwrap_or(model.product_name);
            match handle {
                Handle::Mig { ci, .. } => {
                    Ok(format!("{product} MIG {}", mig_profile_name(&mig_view(g, ci)?)))
                }
                _ => Ok(product.to_string()),
            }
        },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    device: nvmlDevice_t,
    minorNumber: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `minorNumber` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(minorNumber) };
    get(
        "nvmlDeviceGetMinorNumber",
        physical(device),
        out,
        OnWrite,
        |g, _| Ok(g.minor),
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `pci` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(pci) };
    get(
        "nvmlDeviceGetPciInfo_v3",
        any_device(device),
        out,
        OnWrite,
        |g, _| {
            let model = g.fake_model().ok_or(UNKNOWN)?;
            Ok(nvmlPciInfo_t {
                busIdLegacy: fixed_str(&format!("0000:{:02X}:00.0", g.pci_bus)),
                domain: 0,
                bus: g.pci_bus,
                device: 0,
                pciDeviceId: (u32::from(g.quirks.pci_device_id.unwrap_or(model.pci_device_id)) << 16)
                    | 0x10DE,
                pciSubSystemId: (0x1463 << 16) | 0x10DE,
                busId: fixed_str(&format!("00000000:{:02X}:00.0", g.pci_bus)),
            })
        },
    )
}

/// (total, used) bytes of a device or MIG device.
fn memory_of(g: &GpuState, handle: Handle) -> Result<(u64, u64), u32> {
    let model = g.fake_model().ok_or(UNKNOWN)?;
    match handle {
        Handle::Mig { ci, .. } => Ok((mig_view(g, ci)?.gi_profile.memory_mib * 1024 * 1024, 0)),
        // The driver reserves a little of a whole GPU's memory.
        _ => Ok((model.memory_bytes(), 512 * 1024 * 1024)),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `memory` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(memory) };
    get(
        "nvmlDeviceGetMemoryInfo",
        any_device(device),
        out,
        OnWrite,
        |g, handle| {
            let (total, used) = memory_of(g, handle)?;
            Ok(nvmlMemory_t {
                total,
                free: total - used,
                used,
            })
        },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `memory` is NULL or points to a versioned nvmlMemory_v2_t.
    let out = unsafe { Ptr::new(memory) };
    entry(|| {
        let handle = any_device(device)?;
        if out.version()? != MEMORY_V2 {
            return Err(ARGUMENT_VERSION_MISMATCH);
        }
        call("nvmlDeviceGetMemoryInfo_v2", Some(handle.gpu()), |s| {
            let (total, used) = memory_of(gpu_ref(s, handle.gpu())?, handle)?;
            out.set(nvmlMemory_v2_t {
                version: MEMORY_V2,
                total,
                reserved: used,
                free: total - used,
                used: 0,
            })
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    device: nvmlDevice_t,
    major: *mut c_int,
    minor: *mut c_int,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: both are NULL or valid out pointers.
    let (major, minor) = unsafe { (Ptr::new(major), Ptr::new(minor)) };
    entry(|| {
        let handle = any_device(device)?;
        major.check()?;
        minor.check()?;
        call("nvmlDeviceGetCudaComputeCapability", Some(handle.gpu()), |s| {
            let (ma, mi) = gpu_ref(s, handle.gpu())?
                .fake_model()
                .ok_or(UNKNOWN)?
                .cuda_compute_capability;
            major.set(ma)?;
            minor.set(mi)
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetArchitecture(
    device: nvmlDevice_t,
    arch: *mut nvmlDeviceArchitecture_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `arch` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(arch) };
    get(
        "nvmlDeviceGetArchitecture",
        any_device(device),
        out,
        OnWrite,
        |g, _| match g.quirks.architecture {
            Some(architecture) => Ok(architecture),
            None => Ok(g.fake_model().ok_or(UNKNOWN)?.architecture),
        },
    )
}

/// `nvmlDeviceGetVirtualizationMode`: whether the GPU is bare metal (0), passed through to a
/// VM (1), a vGPU inside a guest (2) or a hypervisor host's (3, 4); `quirks.virtualizationMode`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetVirtualizationMode(
    device: nvmlDevice_t,
    mode: *mut nvml_wrapper_sys::bindings::nvmlGpuVirtualizationMode_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `mode` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(mode) };
    get(
        "nvmlDeviceGetVirtualizationMode",
        physical(device),
        out,
        OnWrite,
        |g, _| Ok(g.quirks.virtualization_mode),
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNumaNodeId(device: nvmlDevice_t, node: *mut c_uint) -> nvmlReturn_t {
    // SAFETY: NVML contract: `node` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(node) };
    get(
        "nvmlDeviceGetNumaNodeId",
        physical(device),
        out,
        OnWrite,
        |g, _| Ok(g.numa_node),
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    device: nvmlDevice_t,
    attributes: *mut nvmlDeviceAttributes_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `attributes` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(attributes) };
    get(
        "nvmlDeviceGetAttributes_v2",
        any_device(device),
        out,
        OnWrite,
        attributes_of,
    )
}

/// A MIG device's share of its GPU instance, or a whole GPU.
fn attributes_of(g: &GpuState, handle: Handle) -> Result<nvmlDeviceAttributes_t, u32> {
    let model = g.fake_model().ok_or(UNKNOWN)?;
    Ok(match handle {
        Handle::Mig { ci, .. } => {
            let view = mig_view(g, ci)?;
            let e = view.gi_profile.engines;
            let gi_slices = view.gi_profile.compute_slices.max(1);
            nvmlDeviceAttributes_t {
                multiprocessorCount: e.multiprocessors * view.ci_slices / gi_slices,
                sharedCopyEngineCount: e.copy_engines,
                sharedDecoderCount: e.decoders,
                sharedEncoderCount: e.encoders,
                sharedJpegCount: e.jpeg_engines,
                sharedOfaCount: e.ofa_engines,
                gpuInstanceSliceCount: view.gi_profile.compute_slices,
                computeInstanceSliceCount: view.ci_slices,
                memorySizeMB: view.gi_profile.memory_mib,
            }
        }
        _ => nvmlDeviceAttributes_t {
            multiprocessorCount: model.multiprocessors,
            sharedCopyEngineCount: 0,
            sharedDecoderCount: 0,
            sharedEncoderCount: 0,
            sharedJpegCount: 0,
            sharedOfaCount: 0,
            gpuInstanceSliceCount: 0,
            computeInstanceSliceCount: 0,
            memorySizeMB: model.memory_mib,
        },
    })
}
