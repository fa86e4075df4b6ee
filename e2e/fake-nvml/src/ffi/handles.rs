//! Handles: stable addresses of leaked boxes, mapped to what they denote. GPU and compute
//! instances are named by creation serial, so a handle outliving its instance is detected.
//! A pointer the library never handed out is INVALID_ARGUMENT and is never dereferenced.

use std::{
    collections::HashMap,
    sync::{LazyLock, Mutex},
};

use nvml_wrapper_sys::bindings::{nvmlComputeInstance_t, nvmlDevice_t, nvmlGpuInstance_t};

use super::call::lock;
use crate::code::{INVALID_ARGUMENT, NOT_SUPPORTED};

/// What a handle denotes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Handle {
    /// A physical GPU, by index.
    Gpu(u32),
    /// A MIG device, by its compute instance's serial.
    Mig { gpu: u32, ci: u64 },
    /// A GPU instance, by serial.
    Gi { gpu: u32, gi: u64 },
    /// A compute instance, by serial.
    Ci { gpu: u32, ci: u64 },
}

impl Handle {
    pub(super) fn gpu(self) -> u32 {
        match self {
            Handle::Gpu(gpu) | Handle::Mig { gpu, .. } | Handle::Gi { gpu, .. } | Handle::Ci { gpu, .. } => {
                gpu
            }
        }
    }
}

/// A resolved handle argument: knows the GPU it concerns (for faults and the GPU lookup).
pub(super) trait Target: Copy {
    fn gpu(self) -> u32;
}

impl Target for Handle {
    fn gpu(self) -> u32 {
        Handle::gpu(self)
    }
}

/// A GPU index.
impl Target for u32 {
    fn gpu(self) -> u32 {
        self
    }
}

/// (GPU index, instance serial).
impl Target for (u32, u64) {
    fn gpu(self) -> u32 {
        self.0
    }
}

#[derive(Default)]
struct Registry {
    by_addr: HashMap<usize, Handle>,
    by_handle: HashMap<Handle, &'static u64>,
}

static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(Mutex::default);

/// The stable pointer for `handle` (the same pointer every time).
pub(super) fn handle_ptr<T>(handle: Handle) -> *mut T {
    let mut reg = lock(&REGISTRY);
    let slot: &'static u64 = match reg.by_handle.get(&handle) {
        Some(slot) => slot,
        None => {
            let slot: &'static u64 = Box::leak(Box::new(0));
            reg.by_addr.insert(std::ptr::from_ref(slot).addr(), handle);
            reg.by_handle.insert(handle, slot);
            slot
        }
    };
    std::ptr::from_ref(slot).cast_mut().cast()
}

fn lookup<T>(ptr: *const T) -> Option<Handle> {
    lock(&REGISTRY).by_addr.get(&ptr.addr()).copied()
}

/// A physical GPU or MIG device handle.
pub(super) fn any_device(device: nvmlDevice_t) -> Result<Handle, u32> {
    match lookup(device) {
        Some(h @ (Handle::Gpu(_) | Handle::Mig { .. })) => Ok(h),
        _ => Err(INVALID_ARGUMENT),
    }
}

/// A physical GPU handle; MIG device handles answer NOT_SUPPORTED.
pub(super) fn physical(device: nvmlDevice_t) -> Result<u32, u32> {
    match any_device(device)? {
        Handle::Gpu(gpu) => Ok(gpu),
        _ => Err(NOT_SUPPORTED),
    }
}

/// A MIG device handle as (GPU, compute-instance serial); physical handles answer
/// NOT_SUPPORTED.
pub(super) fn mig_device(device: nvmlDevice_t) -> Result<(u32, u64), u32> {
    match any_device(device)? {
        Handle::Mig { gpu, ci } => Ok((gpu, ci)),
        _ => Err(NOT_SUPPORTED),
    }
}

/// A GPU-instance handle as (GPU, serial).
pub(super) fn gi_handle(gi: nvmlGpuInstance_t) -> Result<(u32, u64), u32> {
    match lookup(gi) {
        Some(Handle::Gi { gpu, gi }) => Ok((gpu, gi)),
        _ => Err(INVALID_ARGUMENT),
    }
}

/// A compute-instance handle as (GPU, serial).
pub(super) fn ci_handle(ci: nvmlComputeInstance_t) -> Result<(u32, u64), u32> {
    match lookup(ci) {
        Some(Handle::Ci { gpu, ci }) => Ok((gpu, ci)),
        _ => Err(INVALID_ARGUMENT),
    }
}
