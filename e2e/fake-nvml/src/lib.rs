//! A fake `libnvidia-ml.so` that simulates MIG-capable NVIDIA GPUs with real NVML semantics.
//!
//! Built as a `cdylib`, it exports the NVML C functions migdra's production NVML backend
//! calls through nvml-wrapper, so the code that runs on real GPUs is the code under test.
//! Its MIG rules ([`sim`]) and per-model tables ([`model`]) are written here from NVML's
//! documented behaviour (`shared/reference/mig-nvml.md`), sharing no code with migdra-api,
//! so the fake is an independent witness of migdra's geometry and catalog (the cross-check
//! is the test `tests/fake/independent_rules.rs`). GPU state lives in a JSON file shared
//! (under `flock`) by every process that loads the library. See `README.md` for the
//! configuration format and where each rule and table comes from.
//!
//! As an `rlib` it gives tests the configuration and state types, [`read_state`] and
//! [`update_state`] to inspect or poke the simulated GPUs, and [`testing::FakeGpuHost`].

pub mod config;
pub mod driver_root;
mod ffi;
pub mod model;
pub mod procfs;
pub mod sim;
pub mod state;
pub mod testing;

use std::path::{Path, PathBuf};

pub use config::{CiInfoDevice, FakeConfig, FaultConfig, GpuConfig, GpuQuirks, InstanceConfig};
pub use state::{
    ClientKind, ComputeInstanceState, FakeState, FaultState, GpuClient, GpuInstanceState, GpuState,
    read_state, update_state,
};

/// NVML return codes the fake uses (`nvmlReturn_t`).
pub mod code {
    /// NVML_SUCCESS.
    pub const SUCCESS: u32 = 0;
    /// NVML_ERROR_UNINITIALIZED.
    pub const UNINITIALIZED: u32 = 1;
    /// NVML_ERROR_INVALID_ARGUMENT.
    pub const INVALID_ARGUMENT: u32 = 2;
    /// NVML_ERROR_NOT_SUPPORTED.
    pub const NOT_SUPPORTED: u32 = 3;
    /// NVML_ERROR_NO_PERMISSION.
    pub const NO_PERMISSION: u32 = 4;
    /// NVML_ERROR_NOT_FOUND.
    pub const NOT_FOUND: u32 = 6;
    /// NVML_ERROR_INSUFFICIENT_SIZE.
    pub const INSUFFICIENT_SIZE: u32 = 7;
    /// NVML_ERROR_DRIVER_NOT_LOADED.
    pub const DRIVER_NOT_LOADED: u32 = 9;
    /// NVML_ERROR_GPU_IS_LOST.
    pub const GPU_IS_LOST: u32 = 15;
    /// NVML_ERROR_RESET_REQUIRED.
    pub const RESET_REQUIRED: u32 = 16;
    /// NVML_ERROR_LIB_RM_VERSION_MISMATCH.
    pub const LIB_RM_VERSION_MISMATCH: u32 = 18;
    /// NVML_ERROR_IN_USE.
    pub const IN_USE: u32 = 19;
    /// NVML_ERROR_INSUFFICIENT_RESOURCES.
    pub const INSUFFICIENT_RESOURCES: u32 = 23;
    /// NVML_ERROR_ARGUMENT_VERSION_MISMATCH.
    pub const ARGUMENT_VERSION_MISMATCH: u32 = 25;
    /// NVML_ERROR_UNKNOWN.
    pub const UNKNOWN: u32 = 999;
}

/// Errors of the fake's configuration, state file and test helpers.
#[derive(Debug, thiserror::Error)]
pub enum FakeError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A configuration or state file is not valid JSON of the expected shape.
    #[error("{path}: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// The configuration is inconsistent.
    #[error("invalid fake NVML configuration: {0}")]
    Config(String),
    /// The built fake library could not be found or built.
    #[error("fake NVML library: {0}")]
    Library(String),
}

impl FakeError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        FakeError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}
