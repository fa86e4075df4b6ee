//! GPU instances: creation (with an explicit placement, or NVML's auto-placement), listing
//! per profile, lookup by GPU-instance ID, the authoritative info (ID, profile, placement),
//! and destruction.

use std::ffi::c_uint;

use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlGpuInstance_t, nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t, nvmlReturn_t,
};

use super::{
    call::{NullOut::First, call, call_about, entry, get, gpu_mut, gpu_ref},
    handles::{Handle, gi_handle, handle_ptr, physical},
    memory::{Array, Ptr},
};
use crate::code::{INVALID_ARGUMENT, NOT_FOUND};

fn create_gi(
    function: &str,
    device: nvmlDevice_t,
    profile_id: u32,
    placement: Option<nvmlGpuInstancePlacement_t>,
    out: &Ptr<nvmlGpuInstance_t>,
) -> Result<(), u32> {
    let gpu = physical(device)?;
    out.check()?;
    // The profile ID is a profile argument: faults may be limited to it.
    call_about(function, Some(gpu), Some(profile_id), |s| {
        let serial = s.next_serial;
        let g = gpu_mut(s, gpu)?;
        if let Some(p) = placement {
            // The size must be the profile's; anything else is an invalid placement.
            let profile = g
                .require_mig()?
                .profile_by_id(profile_id)
                .ok_or(INVALID_ARGUMENT)?;
            if profile.memory_slices != p.size {
                return Err(INVALID_ARGUMENT);
            }
        }
        g.create_gpu_instance(profile_id, placement.map(|p| p.start), serial)?;
        s.next_serial += 1;
        out.set(handle_ptr(Handle::Gi { gpu, gi: serial }))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstance(
    device: nvmlDevice_t,
    profileId: c_uint,
    gpuInstance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `gpuInstance` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(gpuInstance) };
    entry(|| create_gi("nvmlDeviceCreateGpuInstance", device, profileId, None, &out))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstanceWithPlacement(
    device: nvmlDevice_t,
    profileId: c_uint,
    placement: *const nvmlGpuInstancePlacement_t,
    gpuInstance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `placement` is NULL or readable; `gpuInstance` NULL or writable.
    let (placement, out) = unsafe { (Ptr::new(placement.cast_mut()), Ptr::new(gpuInstance)) };
    entry(|| {
        let p = placement.get()?;
        create_gi(
            "nvmlDeviceCreateGpuInstanceWithPlacement",
            device,
            profileId,
            Some(p),
            &out,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstances(
    device: nvmlDevice_t,
    profileId: c_uint,
    gpuInstances: *mut nvmlGpuInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `gpuInstances` is NULL or holds the profile's instanceCount
    // entries; `count` is NULL or a valid out pointer.
    let (array, count) = unsafe { (Array::new(gpuInstances), Ptr::new(count)) };
    entry(|| {
        let gpu = physical(device)?;
        count.check()?;
        if array.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        call_about("nvmlDeviceGetGpuInstances", Some(gpu), Some(profileId), |s| {
            let g = gpu_ref(s, gpu)?;
            g.require_mig()?;
            g.gi_profile(profileId).ok_or(INVALID_ARGUMENT)?;
            let handles = g
                .gpu_instances
                .iter()
                .filter(|gi| gi.profile_id == profileId)
                .map(|gi| handle_ptr(Handle::Gi { gpu, gi: gi.serial }))
                .collect();
            array.fill_listed(&count, handles)
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceById(
    device: nvmlDevice_t,
    id: c_uint,
    gpuInstance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `gpuInstance` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(gpuInstance) };
    get(
        "nvmlDeviceGetGpuInstanceById",
        physical(device),
        out,
        First,
        |g, gpu| {
            g.require_mig()?;
            let gi = g.gpu_instance_by_id(id).ok_or(NOT_FOUND)?;
            Ok(handle_ptr(Handle::Gi { gpu, gi: gi.serial }))
        },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetInfo(
    gpuInstance: nvmlGpuInstance_t,
    info: *mut nvmlGpuInstanceInfo_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `info` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(info) };
    get(
        "nvmlGpuInstanceGetInfo",
        gi_handle(gpuInstance),
        out,
        First,
        |g, (gpu, serial)| {
            let gi = g.gpu_instance_by_serial(serial).ok_or(INVALID_ARGUMENT)?;
            Ok(nvmlGpuInstanceInfo_t {
                device: handle_ptr(Handle::Gpu(gpu)),
                id: gi.id,
                profileId: gi.profile_id,
                placement: nvmlGpuInstancePlacement_t {
                    start: gi.start,
                    size: gi.size,
                },
            })
        },
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlGpuInstanceDestroy(gpuInstance: nvmlGpuInstance_t) -> nvmlReturn_t {
    entry(|| {
        let (gpu, serial) = gi_handle(gpuInstance)?;
        call("nvmlGpuInstanceDestroy", Some(gpu), |s| {
            gpu_mut(s, gpu)?.destroy_gpu_instance(serial)
        })
    })
}
