//! Support for the controller's integration tests: a [`Harness`] that runs the reconciler
//! against a scripted API server ([`Scenario`]: the exact calls one reconciliation must make),
//! a stateful fake API server for whole loops ([`router`]), and fixtures of the objects the
//! controller reads ([`fixtures`]).

pub mod fixtures;
pub mod harness;
pub mod router;
pub mod scenario;

use std::time::Duration;

pub use fixtures::*;
pub use harness::*;
pub use scenario::*;

pub const NODE: &str = "node-a";
pub const NODE_UID: &str = "uid-node-a";
pub const DRIVER: &str = "gpu.migdra.dev";
pub const POOL: &str = "node-a/gpu.migdra.dev";
pub const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(25);
pub const NAMESPACE: &str = "migdra-system";
