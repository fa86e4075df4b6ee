//! `kubectl migdra`: what migdra's GPUs look like right now, read from plain Kubernetes
//! objects. Data flows one way: [`client`] (the only module that talks to the API server,
//! with read-only `list` calls) fills a [`snapshot::Snapshot`]; [`usage`] joins claims, pods
//! and published devices; the views are pure functions of the snapshot ([`layout`], [`fits`],
//! [`claims`]) whose serde form is the `-o json|yaml` schema; [`render`] prints a view as text.
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
