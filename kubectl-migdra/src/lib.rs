//! `kubectl migdra`: what migdra's GPUs look like right now, read from plain Kubernetes
//! objects.
//!
//! The data flow is one way:
//!
//! 1. [`client`] (the only module that talks to the API server, with read-only `list` calls)
//!    fills a [`snapshot::Snapshot`]: GpuNodes, ResourceSlices, ResourceClaims, Pods, Events,
//!    MigPolicies and DeviceClasses, exactly as the API server returns them.
//! 2. [`usage`] joins them: which claim holds which published device, which pods use each
//!    claim, and what the plugin reported for it (MIG UUID, `Ready` condition).
//! 3. The views are pure functions of the snapshot: [`layout`] (per node and GPU, the
//!    memory-slice map with its instances, free placements and fragmentation), [`fits`]
//!    (where a new claim would land under the published device order) and [`claims`] (each
//!    claim with its pods, devices and state). Their serde form is the `-o json|yaml` schema.
//! 4. [`render`] prints a view as text, coloured on a terminal.
//!
//! The e2e demo prints its layouts with the same [`layout`] and [`render`] code.

pub mod claims;
pub mod cli;
pub mod client;
pub mod fits;
pub mod layout;
pub mod render;
pub mod snapshot;
pub mod usage;

/// `apiVersion` of every view's JSON/YAML form. Fields are only ever added within a version.
pub const VIEW_API_VERSION: &str = "kubectl.migdra.dev/v1alpha1";
