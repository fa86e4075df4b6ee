//! migdra's end-to-end harness: a local cluster made of upstream Kubernetes components, a
//! fake CRI runtime and simulated GPUs ([`cluster`]), workload helpers ([`workload`]) and the
//! MIG layout the demo prints, through kubectl-migdra's renderer ([`layout`]).

pub mod cluster;
pub mod layout;
pub mod workload;
