//! Test support shared by migdra's test suites and examples, one module per suite, each behind
//! the feature of the same name. Dev-only: product crates take it as a dev-dependency.

#[cfg(feature = "controller")]
pub mod controller;
#[cfg(feature = "dra-kubelet")]
pub mod dra_kubelet;
#[cfg(feature = "plugin")]
pub mod plugin;
