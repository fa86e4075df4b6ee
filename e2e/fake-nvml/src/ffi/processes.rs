//! The process queries: which compute and graphics processes run on a GPU. An NVML session
//! (DCGM, another plugin) has no context on the GPU, so neither lists it.

use std::ffi::c_uint;

use nvml_wrapper_sys::bindings::{nvmlDevice_t, nvmlProcessInfo_t, nvmlReturn_t};

use super::{
    call::{call, entry, gpu_ref},
    handles::physical,
    memory::{Array, Ptr},
};
use crate::{
    code::{INSUFFICIENT_SIZE, UNKNOWN},
    state::ClientKind,
};

/// `GpuInstanceId`/`ComputeInstanceId` of a process not inside a MIG device.
const NO_INSTANCE: u32 = u32::MAX;

/// nvml.h's protocol: `*infoCount` is the array's capacity in, the number of processes out;
/// a capacity too small (0 asks for the count, with `infos` NULL) gives INSUFFICIENT_SIZE,
/// except that no process at all is SUCCESS with 0.
fn running_processes(
    function: &str,
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
    kind: ClientKind,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `count` is a valid in/out pointer; `infos` is NULL or holds
    // `*count` entries.
    let (count, infos) = unsafe { (Ptr::new(count), Array::new(infos)) };
    entry(|| {
        let gpu = physical(device)?;
        count.check()?;
        call(function, Some(gpu), |s| {
            let g = gpu_ref(s, gpu)?;
            let listed: Vec<nvmlProcessInfo_t> = g
                .clients
                .iter()
                .filter(|c| c.kind == kind)
                .map(|c| nvmlProcessInfo_t {
                    pid: c.pid,
                    usedGpuMemory: c.used_memory_mib * 1024 * 1024,
                    gpuInstanceId: NO_INSTANCE,
                    computeInstanceId: NO_INSTANCE,
                })
                .collect();
            let n = u32::try_from(listed.len()).map_err(|_| UNKNOWN)?;
            if n == 0 {
                return count.set(0);
            }
            if count.get()? < n {
                count.set(n)?;
                return Err(INSUFFICIENT_SIZE);
            }
            infos.fill(listed)?;
            count.set(n)
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    infoCount: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    running_processes(
        "nvmlDeviceGetComputeRunningProcesses_v3",
        device,
        infoCount,
        infos,
        ClientKind::Compute,
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGraphicsRunningProcesses_v3(
    device: nvmlDevice_t,
    infoCount: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    running_processes(
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        device,
        infoCount,
        infos,
        ClientKind::Graphics,
    )
}
