//! System queries: driver and NVML versions, and the number of GPUs.

use std::ffi::{c_char, c_uint};

use nvml_wrapper_sys::bindings::nvmlReturn_t;

use super::{
    call::{call, entry},
    memory::{Ptr, StrBuf},
};
use crate::code::UNKNOWN;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) -> nvmlReturn_t {
    // SAFETY: NVML contract: `version` is NULL or holds `length` bytes.
    let out = unsafe { StrBuf::new(version, length) };
    entry(|| call("nvmlSystemGetDriverVersion", None, |s| out.set(&s.driver_version)))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(version: *mut c_char, length: c_uint) -> nvmlReturn_t {
    // SAFETY: NVML contract: `version` is NULL or holds `length` bytes.
    let out = unsafe { StrBuf::new(version, length) };
    entry(|| {
        call("nvmlSystemGetNVMLVersion", None, |s| {
            out.set(&format!("13.{}", s.driver_version))
        })
    })
}

fn device_count(count: *mut c_uint, function: &str) -> nvmlReturn_t {
    // SAFETY: NVML contract: `count` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(count) };
    entry(|| {
        call(function, None, |s| {
            out.set(u32::try_from(s.gpus.len()).map_err(|_| UNKNOWN)?)
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(deviceCount: *mut c_uint) -> nvmlReturn_t {
    device_count(deviceCount, "nvmlDeviceGetCount_v2")
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount(deviceCount: *mut c_uint) -> nvmlReturn_t {
    device_count(deviceCount, "nvmlDeviceGetCount")
}
