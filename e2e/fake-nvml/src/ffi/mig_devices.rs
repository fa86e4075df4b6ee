//! MIG device handles: the per-GPU walk by index (ordered by GI ID, CI ID), the is-MIG
//! test, the GI and CI IDs of a MIG device, and its parent GPU. A MIG device is a compute
//! instance; its handle goes stale when the compute instance is destroyed.

use std::ffi::c_uint;

use nvml_wrapper_sys::bindings::{nvmlDevice_t, nvmlReturn_t};

use super::{
    call::{
        NullOut::{First, OnWrite},
        entry, get,
    },
    handles::{Handle, any_device, handle_ptr, mig_device, physical},
    memory::Ptr,
};
use crate::{
    code::{INVALID_ARGUMENT, NOT_FOUND},
    model::GiProfile,
    state::GpuState,
};

/// What a MIG device handle denotes right now.
pub(super) struct MigView {
    pub(super) uuid: String,
    pub(super) gi_id: u32,
    pub(super) ci_id: u32,
    pub(super) gi_profile: &'static GiProfile,
    pub(super) ci_slices: u32,
}

/// The MIG device of compute instance `ci_serial`; INVALID_ARGUMENT once it is gone.
pub(super) fn mig_view(g: &GpuState, ci_serial: u64) -> Result<MigView, u32> {
    let (gi, ci) = g.compute_instance_by_serial(ci_serial).ok_or(INVALID_ARGUMENT)?;
    let gi_profile = g.gi_profile(gi.profile_id).ok_or(INVALID_ARGUMENT)?;
    Ok(MigView {
        uuid: ci.uuid.clone(),
        gi_id: gi.id,
        ci_id: ci.id,
        gi_profile,
        ci_slices: ci.size,
    })
}

/// `3g.40gb` for a full compute instance, `1c.3g.40gb` for a part of one.
pub(super) fn mig_profile_name(view: &MigView) -> String {
    if view.ci_slices == view.gi_profile.compute_slices {
        view.gi_profile.name.to_string()
    } else {
        format!("{}c.{}", view.ci_slices, view.gi_profile.name)
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: nvmlDevice_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `count` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(count) };
    get(
        "nvmlDeviceGetMaxMigDeviceCount",
        physical(device),
        out,
        OnWrite,
        |g, _| Ok(g.max_mig_devices()),
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    index: c_uint,
    migDevice: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `migDevice` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(migDevice) };
    get(
        "nvmlDeviceGetMigDeviceHandleByIndex",
        physical(device),
        out,
        First,
        |g, gpu| {
            g.require_mig()?;
            if index >= g.max_mig_devices() {
                return Err(INVALID_ARGUMENT);
            }
            let devices = g.mig_devices();
            let (_, ci) = devices.get(index as usize).ok_or(NOT_FOUND)?;
            Ok(handle_ptr(Handle::Mig { gpu, ci: ci.serial }))
        },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    device: nvmlDevice_t,
    isMigDevice: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `isMigDevice` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(isMigDevice) };
    entry(|| {
        let handle = any_device(device)?;
        out.set(u32::from(matches!(handle, Handle::Mig { .. })))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(device: nvmlDevice_t, id: *mut c_uint) -> nvmlReturn_t {
    // SAFETY: NVML contract: `id` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(id) };
    get(
        "nvmlDeviceGetGpuInstanceId",
        mig_device(device),
        out,
        OnWrite,
        |g, (_, ci)| Ok(mig_view(g, ci)?.gi_id),
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `id` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(id) };
    get(
        "nvmlDeviceGetComputeInstanceId",
        mig_device(device),
        out,
        OnWrite,
        |g, (_, ci)| Ok(mig_view(g, ci)?.ci_id),
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    migDevice: nvmlDevice_t,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `device` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(device) };
    let function = "nvmlDeviceGetDeviceHandleFromMigDeviceHandle";
    get(function, mig_device(migDevice), out, OnWrite, |g, (gpu, ci)| {
        // The MIG device must still exist.
        mig_view(g, ci)?;
        Ok(handle_ptr(Handle::Gpu(gpu)))
    })
}
