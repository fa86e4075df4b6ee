//! GPU-instance profiles and placements: profile info by *index* (v1, works with MIG off)
//! and the versioned infos by index or *ID* (MIG on), the possible placements of a profile
//! ID (MIG on or off), and how many more instances of a profile fit.

use std::ffi::c_uint;

use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_t, nvmlGpuInstanceProfileInfo_v2_t,
    nvmlGpuInstanceProfileInfo_v3_t, nvmlReturn_t,
};

use super::{
    GI_PROFILE_INFO_V2, GI_PROFILE_INFO_V3,
    call::{NullOut::First, call_about, entry, get_about, gpu_ref},
    handles::physical,
    memory::{Array, Ptr, fixed_str},
};
use crate::{
    code::{ARGUMENT_VERSION_MISMATCH, INVALID_ARGUMENT, NOT_SUPPORTED},
    model::GiProfile,
    state::GpuState,
};

fn gi_profile_v1(p: &GiProfile) -> nvmlGpuInstanceProfileInfo_t {
    nvmlGpuInstanceProfileInfo_t {
        id: p.id,
        isP2pSupported: 0,
        sliceCount: p.compute_slices,
        instanceCount: p.instance_count,
        multiprocessorCount: p.engines.multiprocessors,
        copyEngineCount: p.engines.copy_engines,
        decoderCount: p.engines.decoders,
        encoderCount: p.engines.encoders,
        jpegCount: p.engines.jpeg_engines,
        ofaCount: p.engines.ofa_engines,
        memorySizeMB: p.memory_mib,
    }
}

/// A versioned GI profile info built from the v1 fields every version shares, plus `own`.
macro_rules! gi_info_from_v1 {
    ($ty:ident, $v1:ident, $($own:tt)*) => {
        $ty {
            id: $v1.id,
            sliceCount: $v1.sliceCount,
            instanceCount: $v1.instanceCount,
            multiprocessorCount: $v1.multiprocessorCount,
            copyEngineCount: $v1.copyEngineCount,
            decoderCount: $v1.decoderCount,
            encoderCount: $v1.encoderCount,
            jpegCount: $v1.jpegCount,
            ofaCount: $v1.ofaCount,
            memorySizeMB: $v1.memorySizeMB,
            $($own)*
        }
    };
}

/// Writes a v2 or v3 GI profile info, whichever version the caller preset.
fn put_gi_profile_versioned(
    out: &Ptr<nvmlGpuInstanceProfileInfo_v2_t>,
    g: &GpuState,
    p: &GiProfile,
) -> Result<(), u32> {
    let v1 = gi_profile_v1(p);
    // A driver may name a profile differently from the model table (quirks.profileNames).
    let name = match g.quirks.profile_names.get(&p.id) {
        Some(name) => fixed_str::<96>(&format!("MIG {name}")),
        None => fixed_str::<96>(&format!("MIG {}", p.name)),
    };
    match out.version()? {
        GI_PROFILE_INFO_V2 => out.set(gi_info_from_v1!(
            nvmlGpuInstanceProfileInfo_v2_t,
            v1,
            version: GI_PROFILE_INFO_V2,
            isP2pSupported: v1.isP2pSupported,
            name,
        )),
        GI_PROFILE_INFO_V3 => out
            .cast::<nvmlGpuInstanceProfileInfo_v3_t>()
            .set(gi_info_from_v1!(
                nvmlGpuInstanceProfileInfo_v3_t,
                v1,
                version: GI_PROFILE_INFO_V3,
                name,
                capabilities: 0,
            )),
        _ => Err(ARGUMENT_VERSION_MISMATCH),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `info` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(info) };
    get_about(
        "nvmlDeviceGetGpuInstanceProfileInfo",
        Some(profile),
        physical(device),
        out,
        First,
        |g, _| Ok(gi_profile_v1(g.gi_profile_by_index(profile)?)),
    )
}

/// Both versioned info calls: they need MIG mode on (the v1 call does not).
///
/// # Safety
/// `info` must be NULL or a versioned v2/v3 info (same size).
unsafe fn get_versioned_info(
    function: &str,
    device: nvmlDevice_t,
    profile_argument: u32,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
    profile: impl FnOnce(&GpuState) -> Result<&'static GiProfile, u32>,
) -> nvmlReturn_t {
    // SAFETY: forwarded from the caller.
    let out = unsafe { Ptr::new(info) };
    entry(|| {
        let gpu = physical(device)?;
        out.check()?;
        call_about(function, Some(gpu), Some(profile_argument), |s| {
            let g = gpu_ref(s, gpu)?;
            g.require_mig()?;
            put_gi_profile_versioned(&out, g, profile(g)?)
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoV(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `info` is NULL or a versioned v2/v3 info (same size).
    unsafe {
        get_versioned_info(
            "nvmlDeviceGetGpuInstanceProfileInfoV",
            device,
            profile,
            info,
            |g| g.gi_profile_by_index(profile),
        )
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoByIdV(
    device: nvmlDevice_t,
    profileId: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `info` is NULL or a versioned v2/v3 info (same size).
    unsafe {
        get_versioned_info(
            "nvmlDeviceGetGpuInstanceProfileInfoByIdV",
            device,
            profileId,
            info,
            |g| g.gi_profile(profileId).ok_or(INVALID_ARGUMENT),
        )
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    device: nvmlDevice_t,
    profileId: c_uint,
    placements: *mut nvmlGpuInstancePlacement_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `count` is NULL or valid; `placements` is NULL (count query) or
    // holds `*count` entries.
    let (array, count) = unsafe { (Array::new(placements), Ptr::new(count)) };
    entry(|| {
        let gpu = physical(device)?;
        count.check()?;
        let function = "nvmlDeviceGetGpuInstancePossiblePlacements_v2";
        call_about(function, Some(gpu), Some(profileId), |s| {
            let g = gpu_ref(s, gpu)?;
            if g.mig_table().is_none() {
                return Err(NOT_SUPPORTED);
            }
            let profile = g.gi_profile(profileId).ok_or(INVALID_ARGUMENT)?;
            let items = profile
                .starts
                .iter()
                .map(|start| nvmlGpuInstancePlacement_t {
                    start: *start,
                    size: profile.memory_slices,
                })
                .collect();
            array.fill_counted(&count, items)
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceRemainingCapacity(
    device: nvmlDevice_t,
    profileId: c_uint,
    count: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `count` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(count) };
    get_about(
        "nvmlDeviceGetGpuInstanceRemainingCapacity",
        Some(profileId),
        physical(device),
        out,
        First,
        |g, _| g.remaining_gpu_instance_capacity(profileId),
    )
}
