//! The kubelet plugin's integration tests, in one binary. They run the production code
//! (`NvmlBackend` included) against the fake NVML library; `migdra_testkit::plugin` builds the
//! simulated node, the claim store and the claims.

mod claim_status;
mod claims_api;
mod crash;
mod driver;
mod driver_files;
mod fault_campaign;
mod gpu_check;
mod hung_nvml;
mod lost_checkpoint;
mod lost_gpu;
mod mig_mode;
mod nvml_backend;
mod observability;
mod profile_tables;
mod read_only_state;
mod real_gpus;
mod reallocation;
mod recovery;
mod rolling_update;
mod sharing;
mod stale_gc;
