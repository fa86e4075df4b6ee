//! Compute instances inside a GPU instance: profile infos (by CI profile index, engine
//! profile SHARED only), remaining capacity and possible placements, creation, listing,
//! lookup by CI ID, info (which carries the MIG device handle), and destruction.

use std::ffi::c_uint;

use nvml_wrapper_sys::bindings::{
    nvmlComputeInstance_t, nvmlComputeInstanceInfo_t, nvmlComputeInstancePlacement_t,
    nvmlComputeInstanceProfileInfo_t, nvmlComputeInstanceProfileInfo_v2_t,
    nvmlComputeInstanceProfileInfo_v3_t, nvmlGpuInstance_t, nvmlReturn_t,
};

use super::{
    CI_PROFILE_INFO_V2, CI_PROFILE_INFO_V3,
    call::{NullOut::First, call, call_about, entry, get, get_about, gpu_mut, gpu_ref},
    handles::{Handle, ci_handle, gi_handle, handle_ptr},
    memory::{Array, Ptr, fixed_str},
};
use crate::{
    CiInfoDevice,
    code::{ARGUMENT_VERSION_MISMATCH, INVALID_ARGUMENT, NOT_FOUND},
    model::GiProfile,
    sim::{CI_ENGINE_PROFILE_SHARED, ComputeProfile},
    state::{GpuState, new_mig_uuid},
};

fn ci_profile_v1(cp: &ComputeProfile, gi: &GiProfile) -> nvmlComputeInstanceProfileInfo_t {
    nvmlComputeInstanceProfileInfo_t {
        id: cp.id,
        sliceCount: cp.slices,
        instanceCount: cp.instance_count,
        multiprocessorCount: cp.multiprocessors,
        sharedCopyEngineCount: gi.engines.copy_engines,
        sharedDecoderCount: gi.engines.decoders,
        sharedEncoderCount: gi.engines.encoders,
        sharedJpegCount: gi.engines.jpeg_engines,
        sharedOfaCount: gi.engines.ofa_engines,
    }
}

/// A versioned CI profile info built from the v1 fields every version shares, plus `own`.
macro_rules! ci_info_from_v1 {
    ($ty:ident, $v1:ident, $($own:tt)*) => {
        $ty {
            id: $v1.id,
            sliceCount: $v1.sliceCount,
            instanceCount: $v1.instanceCount,
            multiprocessorCount: $v1.multiprocessorCount,
            sharedCopyEngineCount: $v1.sharedCopyEngineCount,
            sharedDecoderCount: $v1.sharedDecoderCount,
            sharedEncoderCount: $v1.sharedEncoderCount,
            sharedJpegCount: $v1.sharedJpegCount,
            sharedOfaCount: $v1.sharedOfaCount,
            $($own)*
        }
    };
}

/// The compute profile `index` of the GPU instance `serial`, with its GPU-instance profile.
fn ci_profile_lookup(
    g: &GpuState,
    serial: u64,
    index: u32,
    eng_profile: u32,
) -> Result<(ComputeProfile, &'static GiProfile), u32> {
    let gi = g.gpu_instance_by_serial(serial).ok_or(INVALID_ARGUMENT)?;
    if eng_profile != CI_ENGINE_PROFILE_SHARED {
        return Err(INVALID_ARGUMENT);
    }
    let gi_profile = g.gi_profile(gi.profile_id).ok_or(INVALID_ARGUMENT)?;
    Ok((g.compute_profile(serial, index)?, gi_profile))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfo(
    gpuInstance: nvmlGpuInstance_t,
    profile: c_uint,
    engProfile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `info` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(info) };
    let function = "nvmlGpuInstanceGetComputeInstanceProfileInfo";
    get_about(
        function,
        Some(profile),
        gi_handle(gpuInstance),
        out,
        First,
        |g, (_, serial)| {
            let (cp, gi) = ci_profile_lookup(g, serial, profile, engProfile)?;
            Ok(ci_profile_v1(&cp, gi))
        },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfoV(
    gpuInstance: nvmlGpuInstance_t,
    profile: c_uint,
    engProfile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `info` is NULL or a versioned v2/v3 info; v3 is 4 bytes larger
    // and only written when the caller preset the v3 version.
    let out = unsafe { Ptr::new(info) };
    entry(|| {
        let (gpu, serial) = gi_handle(gpuInstance)?;
        let version = out.version()?;
        let function = "nvmlGpuInstanceGetComputeInstanceProfileInfoV";
        call_about(function, Some(gpu), Some(profile), |s| {
            let (cp, gi) = ci_profile_lookup(gpu_ref(s, gpu)?, serial, profile, engProfile)?;
            let v1 = ci_profile_v1(&cp, gi);
            let name_text = if cp.slices == gi.compute_slices {
                format!("MIG {}", gi.name)
            } else {
                format!("MIG {}c.{}", cp.slices, gi.name)
            };
            let name = fixed_str::<96>(&name_text);
            match version {
                CI_PROFILE_INFO_V2 => out.set(ci_info_from_v1!(
                    nvmlComputeInstanceProfileInfo_v2_t,
                    v1,
                    version,
                    name
                )),
                CI_PROFILE_INFO_V3 => {
                    // SAFETY: the caller preset the v3 version, so the storage is a v3 struct.
                    let v3 = unsafe { Ptr::new(out.0.cast::<nvmlComputeInstanceProfileInfo_v3_t>()) };
                    v3.set(ci_info_from_v1!(
                        nvmlComputeInstanceProfileInfo_v3_t,
                        v1,
                        version,
                        name,
                        capabilities: 0,
                    ))
                }
                _ => Err(ARGUMENT_VERSION_MISMATCH),
            }
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
    gpuInstance: nvmlGpuInstance_t,
    profileId: c_uint,
    count: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `count` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(count) };
    let function = "nvmlGpuInstanceGetComputeInstanceRemainingCapacity";
    get(function, gi_handle(gpuInstance), out, First, |g, (_, serial)| {
        let cp = g.compute_profile(serial, profileId)?;
        // Placements of one size are aligned and never overlap each other, so every
        // free one can be used at once.
        let free = g.free_compute_placements(serial, profileId)?;
        let existing = g
            .gpu_instance_by_serial(serial)
            .map(|gi| {
                gi.compute_instances
                    .iter()
                    .filter(|ci| ci.profile_id == cp.id)
                    .count()
            })
            .unwrap_or(0);
        let by_count = cp
            .instance_count
            .saturating_sub(u32::try_from(existing).unwrap_or(u32::MAX));
        Ok(u32::try_from(free.len()).unwrap_or(u32::MAX).min(by_count))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstancePossiblePlacements(
    gpuInstance: nvmlGpuInstance_t,
    profileId: c_uint,
    placements: *mut nvmlComputeInstancePlacement_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `count` is NULL or valid; `placements` is NULL (count query) or
    // holds `*count` entries.
    let (array, count) = unsafe { (Array::new(placements), Ptr::new(count)) };
    entry(|| {
        let (gpu, serial) = gi_handle(gpuInstance)?;
        count.check()?;
        call(
            "nvmlGpuInstanceGetComputeInstancePossiblePlacements",
            Some(gpu),
            |s| {
                let g = gpu_ref(s, gpu)?;
                let cp = g.compute_profile(serial, profileId)?;
                let gi_slices = g
                    .gpu_instance_by_serial(serial)
                    .and_then(|gi| g.gi_profile(gi.profile_id))
                    .map(|p| p.compute_slices)
                    .unwrap_or(0);
                let items = crate::sim::compute_instance_placements(cp.slices, gi_slices)
                    .into_iter()
                    .map(|start| nvmlComputeInstancePlacement_t {
                        start,
                        size: cp.slices,
                    })
                    .collect();
                array.fill_counted(&count, items)
            },
        )
    })
}

fn create_ci(
    function: &str,
    gpu_instance: nvmlGpuInstance_t,
    profile_id: u32,
    start: Option<u32>,
    out: &Ptr<nvmlComputeInstance_t>,
) -> Result<(), u32> {
    let (gpu, gi_serial) = gi_handle(gpu_instance)?;
    out.check()?;
    call(function, Some(gpu), |s| {
        let serial = s.next_serial;
        gpu_mut(s, gpu)?.create_compute_instance_at(gi_serial, profile_id, start, serial, new_mig_uuid())?;
        s.next_serial += 1;
        out.set(handle_ptr(Handle::Ci { gpu, ci: serial }))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstance(
    gpuInstance: nvmlGpuInstance_t,
    profileId: c_uint,
    computeInstance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `computeInstance` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(computeInstance) };
    let function = "nvmlGpuInstanceCreateComputeInstance";
    entry(|| create_ci(function, gpuInstance, profileId, None, &out))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstanceWithPlacement(
    gpuInstance: nvmlGpuInstance_t,
    profileId: c_uint,
    placement: *const nvmlComputeInstancePlacement_t,
    computeInstance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `placement` is NULL or readable; `computeInstance` NULL or
    // writable.
    let (placement, out) = unsafe { (Ptr::new(placement.cast_mut()), Ptr::new(computeInstance)) };
    let function = "nvmlGpuInstanceCreateComputeInstanceWithPlacement";
    entry(|| {
        create_ci(
            function,
            gpuInstance,
            profileId,
            Some(placement.get()?.start),
            &out,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstances(
    gpuInstance: nvmlGpuInstance_t,
    profileId: c_uint,
    computeInstances: *mut nvmlComputeInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `computeInstances` is NULL or holds the profile's
    // instanceCount entries; `count` is NULL or a valid out pointer.
    let (array, count) = unsafe { (Array::new(computeInstances), Ptr::new(count)) };
    entry(|| {
        let (gpu, serial) = gi_handle(gpuInstance)?;
        count.check()?;
        if array.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        call_about(
            "nvmlGpuInstanceGetComputeInstances",
            Some(gpu),
            Some(profileId),
            |s| {
                let g = gpu_ref(s, gpu)?;
                g.compute_profile(serial, profileId)?;
                let gi = g.gpu_instance_by_serial(serial).ok_or(INVALID_ARGUMENT)?;
                let handles = gi
                    .compute_instances
                    .iter()
                    .filter(|ci| ci.profile_id == profileId)
                    .map(|ci| handle_ptr(Handle::Ci { gpu, ci: ci.serial }))
                    .collect();
                array.fill_listed(&count, handles)
            },
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceById(
    gpuInstance: nvmlGpuInstance_t,
    id: c_uint,
    computeInstance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `computeInstance` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(computeInstance) };
    let function = "nvmlGpuInstanceGetComputeInstanceById";
    get(
        function,
        gi_handle(gpuInstance),
        out,
        First,
        |g, (gpu, serial)| {
            let gi = g.gpu_instance_by_serial(serial).ok_or(INVALID_ARGUMENT)?;
            let ci = gi
                .compute_instances
                .iter()
                .find(|ci| ci.id == id)
                .ok_or(NOT_FOUND)?;
            Ok(handle_ptr(Handle::Ci { gpu, ci: ci.serial }))
        },
    )
}

/// `nvmlComputeInstanceInfo_t` of a compute instance; `device` is its MIG device handle, or
/// the parent GPU's where `quirks.ciInfoDevice` says so (nvml.h documents the parent; §12).
fn compute_instance_info(g: &GpuState, (gpu, serial): (u32, u64)) -> Result<nvmlComputeInstanceInfo_t, u32> {
    let (gi, ci) = g.compute_instance_by_serial(serial).ok_or(INVALID_ARGUMENT)?;
    let device = match g.quirks.ci_info_device {
        CiInfoDevice::MigDevice => handle_ptr(Handle::Mig { gpu, ci: serial }),
        CiInfoDevice::Parent => handle_ptr(Handle::Gpu(gpu)),
    };
    Ok(nvmlComputeInstanceInfo_t {
        device,
        gpuInstance: handle_ptr(Handle::Gi { gpu, gi: gi.serial }),
        id: ci.id,
        profileId: ci.profile_id,
        placement: nvmlComputeInstancePlacement_t {
            start: ci.start,
            size: ci.size,
        },
    })
}

/// Both info calls: `nvmlComputeInstanceInfo_t` of a compute instance.
///
/// # Safety
/// `info` must be NULL or a valid out pointer.
unsafe fn get_compute_instance_info(
    function: &str,
    compute_instance: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    // SAFETY: forwarded from the caller.
    let out = unsafe { Ptr::new(info) };
    get(
        function,
        ci_handle(compute_instance),
        out,
        First,
        compute_instance_info,
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo_v2(
    computeInstance: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `info` is NULL or a valid out pointer.
    unsafe { get_compute_instance_info("nvmlComputeInstanceGetInfo_v2", computeInstance, info) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo(
    computeInstance: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `info` is NULL or a valid out pointer.
    unsafe { get_compute_instance_info("nvmlComputeInstanceGetInfo", computeInstance, info) }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlComputeInstanceDestroy(computeInstance: nvmlComputeInstance_t) -> nvmlReturn_t {
    entry(|| {
        let (gpu, serial) = ci_handle(computeInstance)?;
        call("nvmlComputeInstanceDestroy", Some(gpu), |s| {
            gpu_mut(s, gpu)?.destroy_compute_instance(serial)
        })
    })
}
