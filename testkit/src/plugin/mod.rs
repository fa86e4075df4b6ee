//! Support for the kubelet plugin's tests and its fault campaign: a simulated GPU node running
//! the production driver over the fake NVML library ([`Node`]), claims served from memory
//! ([`StaticClaims`]) and their builders, an NVML backend that can hang ([`GatedBackend`]),
//! and the randomized fault campaign ([`campaign`]).
// Setup that fails fails the test that asked for it.
#![allow(clippy::unwrap_used)]

pub mod campaign;
mod claims;
mod gated_backend;
mod node;

pub use claims::{StaticClaims, StatusWrite, admin_claim, claim, claim_ref, claim_with, reserved_for};
pub use gated_backend::{GateClosed, GatedBackend};
pub use node::{
    Node, TestDriver, prepare_one, prepare_typed, queued_events, record_claim_events, status_written,
    unprepare_one, unprepare_typed, wait_until,
};

pub const DRIVER: &str = "gpu.migdra.dev";
pub const NODE: &str = "node-a";
pub const POOL: &str = "node-a/gpu.migdra.dev";
/// Host path of the fake `nvidia-cdi-hook` (under [`Node::host_root`]).
pub const HOOK_PATH: &str = "/usr/bin/nvidia-cdi-hook";
/// The node-wide driver device every prepared device names.
pub const DRIVER_DEVICE_ID: &str = "gpu.migdra.dev/driver=files";
