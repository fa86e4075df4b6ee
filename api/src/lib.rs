//! migdra-api: the pure core of migdra. MIG geometry, the GPU catalog, device names,
//! custom resources, opaque claim configuration and the ResourceSlice model. No I/O.

pub mod catalog;
pub mod config;
pub mod device_name;
pub mod geometry;
pub mod inventory;
pub mod nvml_constants;
pub mod policy;
pub mod profile;
pub mod slices;
