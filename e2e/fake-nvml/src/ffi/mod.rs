//! The exported NVML C API.
//!
//! Every function resolves its handles through a per-process registry (so a foreign or
//! stale pointer is never dereferenced), applies injected faults, and runs its logic on the
//! shared state file under its lock. Struct layouts are nvml-wrapper-sys's bindings, which
//! are generated from the NVML header.
//!
//! The plumbing comes first (`memory`: caller-owned pointers; `handles`: the handle
//! registry; `call`: panic containment, faults, state transactions and the one-value
//! getter), then one module per section of the NVML API, in the order a client walks it:
//! initialisation, system, devices, MIG mode, GPU-instance profiles, GPU instances,
//! compute instances, MIG device handles.
#![allow(unsafe_code)]
// Exported names and parameters follow the NVML header.
#![allow(non_snake_case)]

mod call;
mod compute_instances;
mod device;
mod gi_profiles;
mod gpu_instances;
mod handles;
mod init;
mod memory;
mod mig_devices;
mod mig_mode;
mod processes;
mod system;

use nvml_wrapper_sys::bindings::{
    nvmlComputeInstanceInfo_t, nvmlComputeInstanceProfileInfo_t, nvmlComputeInstanceProfileInfo_v2_t,
    nvmlComputeInstanceProfileInfo_v3_t, nvmlGpuInstanceInfo_t, nvmlGpuInstanceProfileInfo_t,
    nvmlGpuInstanceProfileInfo_v2_t, nvmlGpuInstanceProfileInfo_v3_t, nvmlMemory_v2_t,
};

/// `nvmlGpuInstanceProfileInfo_v2_t` version: `sizeof | 2 << 24`.
pub const GI_PROFILE_INFO_V2: u32 = 0x0200_0098;
/// `nvmlGpuInstanceProfileInfo_v3_t` version.
pub const GI_PROFILE_INFO_V3: u32 = 0x0300_0098;
/// `nvmlComputeInstanceProfileInfo_v2_t` version.
pub const CI_PROFILE_INFO_V2: u32 = 0x0200_0088;
/// `nvmlComputeInstanceProfileInfo_v3_t` version.
pub const CI_PROFILE_INFO_V3: u32 = 0x0300_008C;
/// `nvmlMemory_v2_t` version.
pub const MEMORY_V2: u32 = 0x0200_0028;

const _: () = {
    assert!(size_of::<nvmlGpuInstanceProfileInfo_t>() == 48);
    assert!(size_of::<nvmlGpuInstanceProfileInfo_v2_t>() == (GI_PROFILE_INFO_V2 & 0xFF_FFFF) as usize);
    assert!(size_of::<nvmlGpuInstanceProfileInfo_v3_t>() == (GI_PROFILE_INFO_V3 & 0xFF_FFFF) as usize);
    assert!(size_of::<nvmlComputeInstanceProfileInfo_t>() == 36);
    assert!(size_of::<nvmlComputeInstanceProfileInfo_v2_t>() == (CI_PROFILE_INFO_V2 & 0xFF_FFFF) as usize);
    assert!(size_of::<nvmlComputeInstanceProfileInfo_v3_t>() == (CI_PROFILE_INFO_V3 & 0xFF_FFFF) as usize);
    assert!(size_of::<nvmlGpuInstanceInfo_t>() == 24);
    assert!(size_of::<nvmlComputeInstanceInfo_t>() == 32);
    assert!(size_of::<nvmlMemory_v2_t>() == (MEMORY_V2 & 0xFF_FFFF) as usize);
};
