//! migdra's kubelet plugin: prepares allocated ResourceClaims by creating the allocated MIG
//! instance, hands it to containers through CDI, and destroys it after the pod is gone.
//!
//! Modules follow the data flow: the kubelet's gRPC calls ([`grpc`]) reach the
//! [`driver`] state machine, which reads claims ([`claims`]), records progress
//! ([`checkpoint`]), drives the GPU ([`nvml`]) and writes CDI specs ([`cdi`]).

pub mod cdi;
pub mod checkpoint;
pub mod claims;
pub mod driver;
pub mod driver_files;
pub use migdra_kubeletplugin as grpc;
pub mod metrics;
pub mod node_status;
pub mod nvml;
