//! MIG mode: reading the current and pending mode, and switching it (Ampere waits for a
//! reset; Hopper and later switch at once when the GPU is idle).

use std::ffi::c_uint;

use nvml_wrapper_sys::bindings::{nvmlDevice_t, nvmlReturn_t};

use super::{
    call::{call, entry, gpu_mut, gpu_ref},
    handles::physical,
    memory::Ptr,
};
use crate::code::{INVALID_ARGUMENT, NOT_SUPPORTED, SUCCESS};

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: nvmlDevice_t,
    currentMode: *mut c_uint,
    pendingMode: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: both are NULL or valid out pointers.
    let (current, pending) = unsafe { (Ptr::new(currentMode), Ptr::new(pendingMode)) };
    entry(|| {
        let gpu = physical(device)?;
        current.check()?;
        pending.check()?;
        call("nvmlDeviceGetMigMode", Some(gpu), |s| {
            let g = gpu_ref(s, gpu)?;
            if g.mig_table().is_none() {
                return Err(NOT_SUPPORTED);
            }
            current.set(u32::from(g.mig_enabled))?;
            pending.set(u32::from(g.mig_pending))
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceSetMigMode(
    device: nvmlDevice_t,
    mode: c_uint,
    activationStatus: *mut nvmlReturn_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `activationStatus` is NULL or a valid out pointer.
    let status = unsafe { Ptr::new(activationStatus) };
    entry(|| {
        let gpu = physical(device)?;
        status.check()?;
        if mode > 1 {
            return Err(INVALID_ARGUMENT);
        }
        call("nvmlDeviceSetMigMode", Some(gpu), |s| {
            let (ret, activation) = gpu_mut(s, gpu)?.set_mig_mode(mode == 1);
            status.set(activation)?;
            if ret == SUCCESS { Ok(()) } else { Err(ret) }
        })
    })
}
