//! The measures, in the order the bench runs them: the real node first while the cluster is
//! quiet ([`node`]: B4, B5, B6 plugin), then the scheduler over simulated nodes
//! ([`scheduling`]: B1), then the controller at each node count ([`publish`]: B2, B3, B6
//! controller), and the packing simulation ([`packing`]: B7). [`pods`] holds the workload
//! helpers they share.

pub mod levers;
pub mod node;
pub mod packing;
pub mod pods;
pub mod profile;
pub mod publish;
pub mod scheduling;
