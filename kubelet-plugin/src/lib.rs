//! migdra's kubelet plugin: prepares allocated ResourceClaims by creating the allocated MIG
//! instance, hands it to containers through CDI, and destroys it after the pod is gone.

pub mod grpc;
pub mod nvml;
