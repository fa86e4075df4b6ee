//! migdra's end-to-end harness: a local cluster made of upstream Kubernetes components, a
//! fake CRI runtime and simulated GPUs ([`cluster`]), workload helpers ([`workload`]) and the
//! MIG layout report the demo prints ([`layout`]).

pub mod cluster;
pub mod layout;
pub mod workload;
