//! Initialisation and error strings: `nvmlInit*` finds the configuration, creates the state
//! file on first use and counts references; `nvmlShutdown` releases one; `nvmlErrorString`
//! names the return codes. Until the first init and after the last shutdown every other
//! call answers UNINITIALIZED.

use std::{
    ffi::{CStr, OsStr, c_char, c_uint, c_void},
    os::unix::ffi::OsStrExt,
    path::PathBuf,
    sync::Mutex,
};

use nvml_wrapper_sys::bindings::nvmlReturn_t;

use super::call::{call, entry, lock};
use crate::{
    FakeError,
    code::*,
    config::{CONFIG_ENV, CONFIG_FILE_NAME, FakeConfig},
    state::ensure_state,
};

/// Which state file this copy of the library serves, how many inits are outstanding, and
/// the driver upgrade the session began under (see [`crate::FakeState::driver_upgrades`]).
struct Runtime {
    state_path: PathBuf,
    refs: u32,
    driver_upgrade: u64,
}

static RUNTIME: Mutex<Option<Runtime>> = Mutex::new(None);

/// The state file and the driver upgrade the session began under, or UNINITIALIZED.
pub(super) fn session() -> Result<(PathBuf, u64), u32> {
    lock(&RUNTIME)
        .as_ref()
        .map(|r| (r.state_path.clone(), r.driver_upgrade))
        .ok_or(UNINITIALIZED)
}

/// Prints a configuration or state error (NVML has no channel for it) and answers UNKNOWN.
pub(super) fn report(err: FakeError) -> u32 {
    eprintln!("migdra-fake-nvml: {err}");
    UNKNOWN
}

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
                    let state_path = config.state_path(&dir);
                    // A first init (no session outstanding) loads the library of the driver as it is now.
                    let driver_upgrade = crate::state::read_state(&state_path)
                        .map_err(report)?
                        .driver_upgrades;
                    *rt = Some(Runtime {
                        state_path,
                        refs: 1,
                        driver_upgrade,
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
        LIB_RM_VERSION_MISMATCH => c"RM has detected an NVML/RM version mismatch.",
        IN_USE => c"In use by another client",
        INSUFFICIENT_RESOURCES => c"Insufficient Resources",
        ARGUMENT_VERSION_MISMATCH => c"Argument version mismatch",
        _ => c"Unknown Error",
    };
    text.as_ptr()
}
