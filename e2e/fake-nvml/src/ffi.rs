//! The exported NVML C API.
//!
//! Every function resolves its handles through a per-process registry (so a foreign or
//! stale pointer is never dereferenced), applies injected faults, and runs its logic on the
//! shared state file under its lock. Struct layouts are nvml-wrapper-sys's bindings, which
//! are generated from the NVML header.
#![allow(unsafe_code)]
// Exported names and parameters follow the NVML header.
#![allow(non_snake_case)]

use std::{
    collections::HashMap,
    ffi::{CStr, OsStr, c_char, c_int, c_uint, c_void},
    os::unix::ffi::OsStrExt,
    panic::AssertUnwindSafe,
    path::PathBuf,
    sync::{LazyLock, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use migdra_api::{geometry::MigProfile, nvml_constants::CI_ENGINE_PROFILE_SHARED};
use nvml_wrapper_sys::bindings::{
    nvmlComputeInstance_t, nvmlComputeInstanceInfo_t, nvmlComputeInstancePlacement_t,
    nvmlComputeInstanceProfileInfo_t, nvmlComputeInstanceProfileInfo_v2_t,
    nvmlComputeInstanceProfileInfo_v3_t, nvmlDevice_t, nvmlDeviceArchitecture_t, nvmlDeviceAttributes_t,
    nvmlGpuInstance_t, nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_t,
    nvmlGpuInstanceProfileInfo_v2_t, nvmlGpuInstanceProfileInfo_v3_t, nvmlMemory_t, nvmlMemory_v2_t,
    nvmlPciInfo_t, nvmlReturn_t,
};

use crate::{
    FakeError,
    code::*,
    config::{CONFIG_ENV, CONFIG_FILE_NAME, FakeConfig},
    sim::ComputeProfile,
    state::{FakeState, GpuState, ensure_state, new_mig_uuid, update_state},
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

// ---------------------------------------------------------------------------------------
// Process-wide runtime: which state file this copy of the library serves.

struct Runtime {
    state_path: PathBuf,
    refs: u32,
}

static RUNTIME: Mutex<Option<Runtime>> = Mutex::new(None);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn state_path() -> Result<PathBuf, u32> {
    lock(&RUNTIME)
        .as_ref()
        .map(|r| r.state_path.clone())
        .ok_or(UNINITIALIZED)
}

fn report(err: FakeError) -> u32 {
    eprintln!("migdra-fake-nvml: {err}");
    UNKNOWN
}

// ---------------------------------------------------------------------------------------
// Handles: stable addresses of leaked boxes, mapped to what they denote. GPU and compute
// instances are named by creation serial, so a handle outliving its instance is detected.

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Handle {
    Gpu(u32),
    Mig { gpu: u32, ci: u64 },
    Gi { gpu: u32, gi: u64 },
    Ci { gpu: u32, ci: u64 },
}

impl Handle {
    fn gpu(self) -> u32 {
        match self {
            Handle::Gpu(gpu) | Handle::Mig { gpu, .. } | Handle::Gi { gpu, .. } | Handle::Ci { gpu, .. } => {
                gpu
            }
        }
    }
}

#[derive(Default)]
struct Registry {
    by_addr: HashMap<usize, Handle>,
    by_handle: HashMap<Handle, &'static u64>,
}

static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(Mutex::default);

fn handle_ptr<T>(handle: Handle) -> *mut T {
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
fn any_device(device: nvmlDevice_t) -> Result<Handle, u32> {
    match lookup(device) {
        Some(h @ (Handle::Gpu(_) | Handle::Mig { .. })) => Ok(h),
        _ => Err(INVALID_ARGUMENT),
    }
}

/// A physical GPU handle; MIG device handles answer NOT_SUPPORTED.
fn physical(device: nvmlDevice_t) -> Result<u32, u32> {
    match any_device(device)? {
        Handle::Gpu(gpu) => Ok(gpu),
        _ => Err(NOT_SUPPORTED),
    }
}

fn gi_handle(gi: nvmlGpuInstance_t) -> Result<(u32, u64), u32> {
    match lookup(gi) {
        Some(Handle::Gi { gpu, gi }) => Ok((gpu, gi)),
        _ => Err(INVALID_ARGUMENT),
    }
}

fn ci_handle(ci: nvmlComputeInstance_t) -> Result<(u32, u64), u32> {
    match lookup(ci) {
        Some(Handle::Ci { gpu, ci }) => Ok((gpu, ci)),
        _ => Err(INVALID_ARGUMENT),
    }
}

// ---------------------------------------------------------------------------------------
// Caller memory. Each wrapper is created (unsafely) from a pointer the caller passed under
// NVML's contract; using it afterwards is safe.

/// A pointer parameter: NULL, or valid for reads and writes of one `T` during the call.
struct Ptr<T>(*mut T);

impl<T> Ptr<T> {
    /// # Safety
    /// `ptr` must be NULL or valid for reads and writes of a `T` for the rest of the call.
    unsafe fn new(ptr: *mut T) -> Self {
        Ptr(ptr)
    }

    fn check(&self) -> Result<(), u32> {
        if self.0.is_null() {
            Err(INVALID_ARGUMENT)
        } else {
            Ok(())
        }
    }

    fn set(&self, value: T) -> Result<(), u32> {
        self.check()?;
        // SAFETY: non-NULL, and valid for writes per the constructor's contract.
        unsafe { self.0.write(value) };
        Ok(())
    }

    fn get(&self) -> Result<T, u32>
    where
        T: Copy,
    {
        self.check()?;
        // SAFETY: non-NULL, and valid for reads per the constructor's contract.
        Ok(unsafe { self.0.read() })
    }

    /// The leading `version` field of a versioned NVML struct.
    fn version(&self) -> Result<u32, u32> {
        self.check()?;
        // SAFETY: every versioned NVML struct starts with its u32 version; valid per contract.
        Ok(unsafe { self.0.cast::<u32>().read() })
    }

    /// Reinterprets the storage as another version of the same-sized struct.
    fn cast<U>(&self) -> Ptr<U> {
        assert!(size_of::<U>() <= size_of::<T>(), "cast to a larger struct");
        Ptr(self.0.cast())
    }
}

/// An array parameter: NULL, or valid for writes of as many `T` as NVML's contract for the
/// function promises (the in/out count, or the profile's instance count).
struct Array<T>(*mut T);

impl<T> Array<T> {
    /// # Safety
    /// `ptr` must be NULL or valid for writes of the number of `T`s the function's NVML
    /// contract requires the caller to provide.
    unsafe fn new(ptr: *mut T) -> Self {
        Array(ptr)
    }

    fn is_null(&self) -> bool {
        self.0.is_null()
    }

    fn fill(&self, items: Vec<T>) -> Result<(), u32> {
        if self.0.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        for (i, item) in items.into_iter().enumerate() {
            // SAFETY: within the capacity the caller promised (checked against the count
            // where NVML passes one).
            unsafe { self.0.add(i).write(item) };
        }
        Ok(())
    }
}

/// A string buffer parameter with its length.
struct StrBuf(*mut c_char, c_uint);

impl StrBuf {
    /// # Safety
    /// `ptr` must be NULL or valid for writes of `len` bytes.
    unsafe fn new(ptr: *mut c_char, len: c_uint) -> Self {
        StrBuf(ptr, len)
    }

    fn set(&self, s: &str) -> Result<(), u32> {
        if self.0.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        if (self.1 as usize) < s.len() + 1 {
            return Err(INSUFFICIENT_SIZE);
        }
        for (i, b) in s.bytes().chain(std::iter::once(0)).enumerate() {
            // SAFETY: i < len, checked above; valid per the constructor's contract.
            unsafe { self.0.add(i).write(b as c_char) };
        }
        Ok(())
    }
}

fn fixed_str<const N: usize>(s: &str) -> [c_char; N] {
    let mut out = [0 as c_char; N];
    for (slot, b) in out.iter_mut().zip(s.bytes().take(N - 1)) {
        *slot = b as c_char;
    }
    out
}

// ---------------------------------------------------------------------------------------
// Calls: panic containment, faults, state transactions.

fn entry(f: impl FnOnce() -> Result<(), u32>) -> nvmlReturn_t {
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => UNKNOWN,
    }
}

/// Counts hits of the faults matching this call; returns (latency ms, error).
fn fire_faults(state: &mut FakeState, function: &str, gpu: Option<u32>) -> (u64, Option<u32>) {
    let mut latency = 0;
    let mut error = None;
    for f in &mut state.faults {
        let matches = (f.fault.function == function || f.fault.function == "*")
            && (f.fault.gpu.is_none() || f.fault.gpu == gpu)
            && f.fault.times.is_none_or(|t| f.hits < t);
        if matches {
            f.hits += 1;
            latency += f.fault.latency_ms.unwrap_or(0);
            error = error.or(f.fault.error);
        }
    }
    (latency, error)
}

enum Step<T> {
    Done(Result<T, u32>),
    Delayed(u64, Option<u32>),
}

/// Runs `body` on the state under the lock, after applying the faults for `function`.
/// Latency is spent outside the lock, as a slow driver call would not block other processes'
/// bookkeeping.
fn call<T>(
    function: &str,
    gpu: Option<u32>,
    body: impl FnOnce(&mut FakeState) -> Result<T, u32>,
) -> Result<T, u32> {
    let path = state_path()?;
    let mut body = Some(body);
    let step = update_state(&path, |state| match fire_faults(state, function, gpu) {
        (0, None) => Step::Done(body.take().map_or(Err(UNKNOWN), |b| b(state))),
        (latency, error) => Step::Delayed(latency, error),
    })
    .map_err(report)?;
    match step {
        Step::Done(result) => result,
        Step::Delayed(latency, error) => {
            std::thread::sleep(Duration::from_millis(latency));
            if let Some(code) = error {
                return Err(code);
            }
            let body = body.take().ok_or(UNKNOWN)?;
            update_state(&path, body).map_err(report)?
        }
    }
}

fn gpu_ref(state: &FakeState, gpu: u32) -> Result<&GpuState, u32> {
    let g = state.gpus.get(gpu as usize).ok_or(INVALID_ARGUMENT)?;
    if g.lost { Err(GPU_IS_LOST) } else { Ok(g) }
}

fn gpu_mut(state: &mut FakeState, gpu: u32) -> Result<&mut GpuState, u32> {
    let g = state.gpus.get_mut(gpu as usize).ok_or(INVALID_ARGUMENT)?;
    if g.lost { Err(GPU_IS_LOST) } else { Ok(g) }
}

/// What a MIG device handle denotes right now.
struct MigView {
    uuid: String,
    gi_id: u32,
    ci_id: u32,
    gi_profile: MigProfile,
    ci_slices: u32,
}

fn mig_view(g: &GpuState, ci_serial: u64) -> Result<MigView, u32> {
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

fn mig_profile_name(view: &MigView) -> String {
    if view.ci_slices == view.gi_profile.compute_slices {
        view.gi_profile.name.to_string()
    } else {
        format!("{}c.{}", view.ci_slices, view.gi_profile.name)
    }
}

// ---------------------------------------------------------------------------------------
// Initialisation.

/// The path of this loaded library, found through the dynamic loader.
fn own_library_path() -> Option<PathBuf> {
    // A private static: unlike an exported function, its address cannot be interposed by
    // another object that exports the same NVML names (such as a test binary).
    static ANCHOR: u8 = 0;
    let addr = std::ptr::addr_of!(ANCHOR).cast::<c_void>();
    // SAFETY: Dl_info is plain data; all-zero is a valid value for it.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only inspects the address and fills `info`.
    let found = unsafe { libc::dladdr(addr, &mut info) };
    if found == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader, valid while loaded.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    let path = PathBuf::from(OsStr::from_bytes(name.to_bytes()));
    std::path::absolute(&path).ok()
}

fn locate_config() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os(CONFIG_ENV) {
        return std::path::absolute(PathBuf::from(path)).ok();
    }
    Some(own_library_path()?.parent()?.join(CONFIG_FILE_NAME))
}

fn init() -> nvmlReturn_t {
    entry(|| {
        {
            let mut rt = lock(&RUNTIME);
            match rt.as_mut() {
                Some(r) => r.refs += 1,
                None => {
                    let Some(config_path) = locate_config() else {
                        eprintln!("migdra-fake-nvml: cannot locate {CONFIG_FILE_NAME}");
                        return Err(DRIVER_NOT_LOADED);
                    };
                    if !config_path.exists() {
                        eprintln!("migdra-fake-nvml: no configuration at {}", config_path.display());
                        return Err(DRIVER_NOT_LOADED);
                    }
                    let config = FakeConfig::load(&config_path).map_err(report)?;
                    let dir = config_path.parent().map(PathBuf::from).unwrap_or_default();
                    ensure_state(&config, &dir).map_err(report)?;
                    *rt = Some(Runtime {
                        state_path: config.state_path(&dir),
                        refs: 1,
                    });
                }
            }
        }
        if let Err(code) = call("nvmlInit_v2", None, |_| Ok(())) {
            release();
            return Err(code);
        }
        Ok(())
    })
}

fn release() -> bool {
    let mut rt = lock(&RUNTIME);
    match rt.as_mut() {
        Some(r) if r.refs > 1 => {
            r.refs -= 1;
            true
        }
        Some(_) => {
            *rt = None;
            true
        }
        None => false,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    init()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit() -> nvmlReturn_t {
    init()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    init()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    entry(|| if release() { Ok(()) } else { Err(UNINITIALIZED) })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    let text: &'static CStr = match result {
        SUCCESS => c"Success",
        UNINITIALIZED => c"Uninitialized",
        INVALID_ARGUMENT => c"Invalid Argument",
        NOT_SUPPORTED => c"Not Supported",
        NO_PERMISSION => c"Insufficient Permissions",
        NOT_FOUND => c"Not Found",
        INSUFFICIENT_SIZE => c"Insufficient Size",
        DRIVER_NOT_LOADED => c"Driver Not Loaded",
        GPU_IS_LOST => c"GPU is lost",
        RESET_REQUIRED => c"GPU requires reset",
        IN_USE => c"In use by another client",
        INSUFFICIENT_RESOURCES => c"Insufficient Resources",
        ARGUMENT_VERSION_MISMATCH => c"Argument version mismatch",
        _ => c"Unknown Error",
    };
    text.as_ptr()
}

// ---------------------------------------------------------------------------------------
// System and device queries.

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

fn handle_by_index(index: c_uint, device: *mut nvmlDevice_t, function: &str) -> nvmlReturn_t {
    // SAFETY: NVML contract: `device` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(device) };
    entry(|| {
        call(function, Some(index), |s| {
            gpu_ref(s, index)?;
            out.set(handle_ptr(Handle::Gpu(index)))
        })
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
    entry(|| {
        let gpu = physical(device)?;
        call("nvmlDeviceGetIndex", Some(gpu), |s| {
            out.set(gpu_ref(s, gpu)?.index)
        })
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
    entry(|| {
        let handle = any_device(device)?;
        call("nvmlDeviceGetUUID", Some(handle.gpu()), |s| {
            let g = gpu_ref(s, handle.gpu())?;
            match handle {
                Handle::Mig { ci, .. } => out.set(&mig_view(g, ci)?.uuid),
                _ => out.set(&g.uuid),
            }
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `name` is NULL or holds `length` bytes.
    let out = unsafe { StrBuf::new(name, length) };
    entry(|| {
        let handle = any_device(device)?;
        call("nvmlDeviceGetName", Some(handle.gpu()), |s| {
            let g = gpu_ref(s, handle.gpu())?;
            let product = g.fake_model().ok_or(UNKNOWN)?.product_name;
            match handle {
                Handle::Mig { ci, .. } => {
                    out.set(&format!("{product} MIG {}", mig_profile_name(&mig_view(g, ci)?)))
                }
                _ => out.set(product),
            }
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    device: nvmlDevice_t,
    minorNumber: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `minorNumber` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(minorNumber) };
    entry(|| {
        let gpu = physical(device)?;
        call("nvmlDeviceGetMinorNumber", Some(gpu), |s| {
            out.set(gpu_ref(s, gpu)?.minor)
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `pci` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(pci) };
    entry(|| {
        let handle = any_device(device)?;
        call("nvmlDeviceGetPciInfo_v3", Some(handle.gpu()), |s| {
            let g = gpu_ref(s, handle.gpu())?;
            let model = g.fake_model().ok_or(UNKNOWN)?;
            out.set(nvmlPciInfo_t {
                busIdLegacy: fixed_str(&format!("0000:{:02X}:00.0", g.pci_bus)),
                domain: 0,
                bus: g.pci_bus,
                device: 0,
                pciDeviceId: (u32::from(model.pci_device_id) << 16) | 0x10DE,
                pciSubSystemId: (0x1463 << 16) | 0x10DE,
                busId: fixed_str(&format!("00000000:{:02X}:00.0", g.pci_bus)),
            })
        })
    })
}

/// (total, used) bytes of a device or MIG device.
fn memory_of(s: &FakeState, handle: Handle) -> Result<(u64, u64), u32> {
    let g = gpu_ref(s, handle.gpu())?;
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
    entry(|| {
        let handle = any_device(device)?;
        call("nvmlDeviceGetMemoryInfo", Some(handle.gpu()), |s| {
            let (total, used) = memory_of(s, handle)?;
            out.set(nvmlMemory_t {
                total,
                free: total - used,
                used,
            })
        })
    })
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
            let (total, used) = memory_of(s, handle)?;
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
    entry(|| {
        let handle = any_device(device)?;
        call("nvmlDeviceGetArchitecture", Some(handle.gpu()), |s| {
            out.set(
                gpu_ref(s, handle.gpu())?
                    .fake_model()
                    .ok_or(UNKNOWN)?
                    .architecture,
            )
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNumaNodeId(device: nvmlDevice_t, node: *mut c_uint) -> nvmlReturn_t {
    // SAFETY: NVML contract: `node` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(node) };
    entry(|| {
        let gpu = physical(device)?;
        call("nvmlDeviceGetNumaNodeId", Some(gpu), |s| {
            out.set(gpu_ref(s, gpu)?.numa_node)
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    device: nvmlDevice_t,
    attributes: *mut nvmlDeviceAttributes_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `attributes` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(attributes) };
    entry(|| {
        let handle = any_device(device)?;
        call("nvmlDeviceGetAttributes_v2", Some(handle.gpu()), |s| {
            let g = gpu_ref(s, handle.gpu())?;
            let model = g.fake_model().ok_or(UNKNOWN)?;
            let attrs = match handle {
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
            };
            out.set(attrs)
        })
    })
}

// ---------------------------------------------------------------------------------------
// MIG mode.

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
            if g.geometry().is_none() {
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

// ---------------------------------------------------------------------------------------
// GPU-instance profiles and placements.

fn gi_profile_v1(p: &MigProfile) -> nvmlGpuInstanceProfileInfo_t {
    nvmlGpuInstanceProfileInfo_t {
        id: p.gi_profile_id,
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

/// Writes a v2 or v3 GI profile info, whichever version the caller preset.
fn put_gi_profile_versioned(out: &Ptr<nvmlGpuInstanceProfileInfo_v2_t>, p: &MigProfile) -> Result<(), u32> {
    let v1 = gi_profile_v1(p);
    let name = fixed_str::<96>(&format!("MIG {}", p.name));
    match out.version()? {
        GI_PROFILE_INFO_V2 => out.set(nvmlGpuInstanceProfileInfo_v2_t {
            version: GI_PROFILE_INFO_V2,
            id: v1.id,
            isP2pSupported: v1.isP2pSupported,
            sliceCount: v1.sliceCount,
            instanceCount: v1.instanceCount,
            multiprocessorCount: v1.multiprocessorCount,
            copyEngineCount: v1.copyEngineCount,
            decoderCount: v1.decoderCount,
            encoderCount: v1.encoderCount,
            jpegCount: v1.jpegCount,
            ofaCount: v1.ofaCount,
            memorySizeMB: v1.memorySizeMB,
            name,
        }),
        GI_PROFILE_INFO_V3 => {
            out.cast::<nvmlGpuInstanceProfileInfo_v3_t>()
                .set(nvmlGpuInstanceProfileInfo_v3_t {
                    version: GI_PROFILE_INFO_V3,
                    id: v1.id,
                    sliceCount: v1.sliceCount,
                    instanceCount: v1.instanceCount,
                    multiprocessorCount: v1.multiprocessorCount,
                    copyEngineCount: v1.copyEngineCount,
                    decoderCount: v1.decoderCount,
                    encoderCount: v1.encoderCount,
                    jpegCount: v1.jpegCount,
                    ofaCount: v1.ofaCount,
                    memorySizeMB: v1.memorySizeMB,
                    name,
                    capabilities: 0,
                })
        }
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
    entry(|| {
        let gpu = physical(device)?;
        out.check()?;
        call("nvmlDeviceGetGpuInstanceProfileInfo", Some(gpu), |s| {
            out.set(gi_profile_v1(&gpu_ref(s, gpu)?.gi_profile_by_index(profile)?))
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
    let out = unsafe { Ptr::new(info) };
    entry(|| {
        let gpu = physical(device)?;
        out.check()?;
        call("nvmlDeviceGetGpuInstanceProfileInfoV", Some(gpu), |s| {
            let g = gpu_ref(s, gpu)?;
            // The versioned info needs MIG mode on (the v1 call does not).
            g.require_mig()?;
            put_gi_profile_versioned(&out, &g.gi_profile_by_index(profile)?)
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoByIdV(
    device: nvmlDevice_t,
    profileId: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `info` is NULL or a versioned v2/v3 info (same size).
    let out = unsafe { Ptr::new(info) };
    entry(|| {
        let gpu = physical(device)?;
        out.check()?;
        call("nvmlDeviceGetGpuInstanceProfileInfoByIdV", Some(gpu), |s| {
            let g = gpu_ref(s, gpu)?;
            g.require_mig()?;
            put_gi_profile_versioned(&out, &g.gi_profile(profileId).ok_or(INVALID_ARGUMENT)?)
        })
    })
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
        call("nvmlDeviceGetGpuInstancePossiblePlacements_v2", Some(gpu), |s| {
            let g = gpu_ref(s, gpu)?;
            if g.geometry().is_none() {
                return Err(NOT_SUPPORTED);
            }
            let profile = g.gi_profile(profileId).ok_or(INVALID_ARGUMENT)?;
            let items: Vec<nvmlGpuInstancePlacement_t> = profile
                .placements
                .iter()
                .map(|start| nvmlGpuInstancePlacement_t {
                    start: *start,
                    size: profile.memory_slices,
                })
                .collect();
            let n = u32::try_from(items.len()).map_err(|_| UNKNOWN)?;
            if array.is_null() {
                return count.set(n);
            }
            if count.get()? < n {
                count.set(n)?;
                return Err(INSUFFICIENT_SIZE);
            }
            array.fill(items)?;
            count.set(n)
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
    entry(|| {
        let gpu = physical(device)?;
        out.check()?;
        call("nvmlDeviceGetGpuInstanceRemainingCapacity", Some(gpu), |s| {
            out.set(gpu_ref(s, gpu)?.remaining_gpu_instance_capacity(profileId)?)
        })
    })
}

// ---------------------------------------------------------------------------------------
// GPU instances.

fn create_gi(
    function: &str,
    device: nvmlDevice_t,
    profile_id: u32,
    placement: Option<nvmlGpuInstancePlacement_t>,
    out: &Ptr<nvmlGpuInstance_t>,
) -> Result<(), u32> {
    let gpu = physical(device)?;
    out.check()?;
    call(function, Some(gpu), |s| {
        let serial = s.next_serial;
        let g = gpu_mut(s, gpu)?;
        if let Some(p) = placement {
            // The size must be the profile's; anything else is an invalid placement.
            let geometry = g.require_mig()?;
            let profile = geometry.profile_by_id(profile_id).ok_or(INVALID_ARGUMENT)?;
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
        call("nvmlDeviceGetGpuInstances", Some(gpu), |s| {
            let g = gpu_ref(s, gpu)?;
            g.require_mig()?;
            g.gi_profile(profileId).ok_or(INVALID_ARGUMENT)?;
            let handles: Vec<nvmlGpuInstance_t> = g
                .gpu_instances
                .iter()
                .filter(|gi| gi.profile_id == profileId)
                .map(|gi| handle_ptr(Handle::Gi { gpu, gi: gi.serial }))
                .collect();
            let n = u32::try_from(handles.len()).map_err(|_| UNKNOWN)?;
            array.fill(handles)?;
            count.set(n)
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
    entry(|| {
        let gpu = physical(device)?;
        out.check()?;
        call("nvmlDeviceGetGpuInstanceById", Some(gpu), |s| {
            let g = gpu_ref(s, gpu)?;
            g.require_mig()?;
            let gi = g.gpu_instance_by_id(id).ok_or(NOT_FOUND)?;
            out.set(handle_ptr(Handle::Gi { gpu, gi: gi.serial }))
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetInfo(
    gpuInstance: nvmlGpuInstance_t,
    info: *mut nvmlGpuInstanceInfo_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `info` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(info) };
    entry(|| {
        let (gpu, serial) = gi_handle(gpuInstance)?;
        out.check()?;
        call("nvmlGpuInstanceGetInfo", Some(gpu), |s| {
            let gi = gpu_ref(s, gpu)?
                .gpu_instance_by_serial(serial)
                .ok_or(INVALID_ARGUMENT)?;
            out.set(nvmlGpuInstanceInfo_t {
                device: handle_ptr(Handle::Gpu(gpu)),
                id: gi.id,
                profileId: gi.profile_id,
                placement: nvmlGpuInstancePlacement_t {
                    start: gi.start,
                    size: gi.size,
                },
            })
        })
    })
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

// ---------------------------------------------------------------------------------------
// Compute instances.

fn ci_profile_v1(cp: &ComputeProfile, gi: &MigProfile) -> nvmlComputeInstanceProfileInfo_t {
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

/// The compute profile `index` of the GPU instance `serial`, with its GPU-instance profile.
fn ci_profile_lookup(
    s: &FakeState,
    gpu: u32,
    serial: u64,
    index: u32,
    eng_profile: u32,
) -> Result<(ComputeProfile, MigProfile), u32> {
    let g = gpu_ref(s, gpu)?;
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
    entry(|| {
        let (gpu, serial) = gi_handle(gpuInstance)?;
        out.check()?;
        call("nvmlGpuInstanceGetComputeInstanceProfileInfo", Some(gpu), |s| {
            let (cp, gi) = ci_profile_lookup(s, gpu, serial, profile, engProfile)?;
            out.set(ci_profile_v1(&cp, &gi))
        })
    })
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
        call("nvmlGpuInstanceGetComputeInstanceProfileInfoV", Some(gpu), |s| {
            let (cp, gi) = ci_profile_lookup(s, gpu, serial, profile, engProfile)?;
            let v1 = ci_profile_v1(&cp, &gi);
            let name_text = if cp.slices == gi.compute_slices {
                format!("MIG {}", gi.name)
            } else {
                format!("MIG {}c.{}", cp.slices, gi.name)
            };
            let name = fixed_str::<96>(&name_text);
            match version {
                CI_PROFILE_INFO_V2 => out.set(nvmlComputeInstanceProfileInfo_v2_t {
                    version,
                    id: v1.id,
                    sliceCount: v1.sliceCount,
                    instanceCount: v1.instanceCount,
                    multiprocessorCount: v1.multiprocessorCount,
                    sharedCopyEngineCount: v1.sharedCopyEngineCount,
                    sharedDecoderCount: v1.sharedDecoderCount,
                    sharedEncoderCount: v1.sharedEncoderCount,
                    sharedJpegCount: v1.sharedJpegCount,
                    sharedOfaCount: v1.sharedOfaCount,
                    name,
                }),
                CI_PROFILE_INFO_V3 => {
                    // SAFETY: the caller preset the v3 version, so the storage is a v3 struct.
                    let v3 = unsafe { Ptr::new(out.0.cast::<nvmlComputeInstanceProfileInfo_v3_t>()) };
                    v3.set(nvmlComputeInstanceProfileInfo_v3_t {
                        version,
                        id: v1.id,
                        sliceCount: v1.sliceCount,
                        instanceCount: v1.instanceCount,
                        multiprocessorCount: v1.multiprocessorCount,
                        sharedCopyEngineCount: v1.sharedCopyEngineCount,
                        sharedDecoderCount: v1.sharedDecoderCount,
                        sharedEncoderCount: v1.sharedEncoderCount,
                        sharedJpegCount: v1.sharedJpegCount,
                        sharedOfaCount: v1.sharedOfaCount,
                        name,
                        capabilities: 0,
                    })
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
    entry(|| {
        let (gpu, serial) = gi_handle(gpuInstance)?;
        out.check()?;
        call(
            "nvmlGpuInstanceGetComputeInstanceRemainingCapacity",
            Some(gpu),
            |s| {
                let g = gpu_ref(s, gpu)?;
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
                out.set(u32::try_from(free.len()).unwrap_or(u32::MAX).min(by_count))
            },
        )
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
                let items: Vec<nvmlComputeInstancePlacement_t> =
                    crate::sim::compute_instance_placements(cp.slices, gi_slices)
                        .into_iter()
                        .map(|start| nvmlComputeInstancePlacement_t {
                            start,
                            size: cp.slices,
                        })
                        .collect();
                let n = u32::try_from(items.len()).map_err(|_| UNKNOWN)?;
                if array.is_null() {
                    return count.set(n);
                }
                if count.get()? < n {
                    count.set(n)?;
                    return Err(INSUFFICIENT_SIZE);
                }
                array.fill(items)?;
                count.set(n)
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
    entry(|| {
        create_ci(
            "nvmlGpuInstanceCreateComputeInstance",
            gpuInstance,
            profileId,
            None,
            &out,
        )
    })
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
    entry(|| {
        let p = placement.get()?;
        create_ci(
            "nvmlGpuInstanceCreateComputeInstanceWithPlacement",
            gpuInstance,
            profileId,
            Some(p.start),
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
        call("nvmlGpuInstanceGetComputeInstances", Some(gpu), |s| {
            let g = gpu_ref(s, gpu)?;
            g.compute_profile(serial, profileId)?;
            let gi = g.gpu_instance_by_serial(serial).ok_or(INVALID_ARGUMENT)?;
            let handles: Vec<nvmlComputeInstance_t> = gi
                .compute_instances
                .iter()
                .filter(|ci| ci.profile_id == profileId)
                .map(|ci| handle_ptr(Handle::Ci { gpu, ci: ci.serial }))
                .collect();
            let n = u32::try_from(handles.len()).map_err(|_| UNKNOWN)?;
            array.fill(handles)?;
            count.set(n)
        })
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
    entry(|| {
        let (gpu, serial) = gi_handle(gpuInstance)?;
        out.check()?;
        call("nvmlGpuInstanceGetComputeInstanceById", Some(gpu), |s| {
            let gi = gpu_ref(s, gpu)?
                .gpu_instance_by_serial(serial)
                .ok_or(INVALID_ARGUMENT)?;
            let ci = gi
                .compute_instances
                .iter()
                .find(|ci| ci.id == id)
                .ok_or(NOT_FOUND)?;
            out.set(handle_ptr(Handle::Ci { gpu, ci: ci.serial }))
        })
    })
}

fn compute_instance_info(
    ci: nvmlComputeInstance_t,
    out: &Ptr<nvmlComputeInstanceInfo_t>,
    function: &str,
) -> Result<(), u32> {
    let (gpu, serial) = ci_handle(ci)?;
    out.check()?;
    call(function, Some(gpu), |s| {
        let (gi, ci) = gpu_ref(s, gpu)?
            .compute_instance_by_serial(serial)
            .ok_or(INVALID_ARGUMENT)?;
        out.set(nvmlComputeInstanceInfo_t {
            device: handle_ptr(Handle::Mig { gpu, ci: serial }),
            gpuInstance: handle_ptr(Handle::Gi { gpu, gi: gi.serial }),
            id: ci.id,
            profileId: ci.profile_id,
            placement: nvmlComputeInstancePlacement_t {
                start: ci.start,
                size: ci.size,
            },
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo_v2(
    computeInstance: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `info` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(info) };
    entry(|| compute_instance_info(computeInstance, &out, "nvmlComputeInstanceGetInfo_v2"))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo(
    computeInstance: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `info` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(info) };
    entry(|| compute_instance_info(computeInstance, &out, "nvmlComputeInstanceGetInfo"))
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

// ---------------------------------------------------------------------------------------
// MIG device handles.

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: nvmlDevice_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `count` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(count) };
    entry(|| {
        let gpu = physical(device)?;
        call("nvmlDeviceGetMaxMigDeviceCount", Some(gpu), |s| {
            out.set(gpu_ref(s, gpu)?.max_mig_devices())
        })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    index: c_uint,
    migDevice: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `migDevice` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(migDevice) };
    entry(|| {
        let gpu = physical(device)?;
        out.check()?;
        call("nvmlDeviceGetMigDeviceHandleByIndex", Some(gpu), |s| {
            let g = gpu_ref(s, gpu)?;
            g.require_mig()?;
            if index >= g.max_mig_devices() {
                return Err(INVALID_ARGUMENT);
            }
            let devices = g.mig_devices();
            let (_, ci) = devices.get(index as usize).ok_or(NOT_FOUND)?;
            out.set(handle_ptr(Handle::Mig { gpu, ci: ci.serial }))
        })
    })
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

fn mig_query(
    device: nvmlDevice_t,
    function: &str,
    f: impl FnOnce(u32, MigView) -> Result<(), u32>,
) -> Result<(), u32> {
    let Handle::Mig { gpu, ci } = any_device(device)? else {
        return Err(NOT_SUPPORTED);
    };
    call(function, Some(gpu), |s| {
        let view = mig_view(gpu_ref(s, gpu)?, ci)?;
        f(gpu, view)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(device: nvmlDevice_t, id: *mut c_uint) -> nvmlReturn_t {
    // SAFETY: NVML contract: `id` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(id) };
    entry(|| mig_query(device, "nvmlDeviceGetGpuInstanceId", |_, v| out.set(v.gi_id)))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `id` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(id) };
    entry(|| mig_query(device, "nvmlDeviceGetComputeInstanceId", |_, v| out.set(v.ci_id)))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    migDevice: nvmlDevice_t,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    // SAFETY: NVML contract: `device` is NULL or a valid out pointer.
    let out = unsafe { Ptr::new(device) };
    entry(|| {
        mig_query(
            migDevice,
            "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
            |gpu, _| out.set(handle_ptr(Handle::Gpu(gpu))),
        )
    })
}
