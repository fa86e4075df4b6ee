//! `make bench`: migdra measured at cluster scale on the e2e cluster (upstream control plane,
//! the real kubelet with the fake CRI and fake NVML for what needs pods running, simulated GPU
//! nodes for scale), each figure printed next to its anchor measured in the same run.
//!
//! Data flow: [`cli`] says what to run; [`sim`] keeps simulated nodes live so the real
//! controller publishes real pools for them; [`measure`] runs B1–B7 and returns table rows
//! ([`packing`] is B7's simulation; [`first_fit`] counts what a device order costs the
//! allocator before its first fit);
//! [`probe`] and [`prom`] read the processes and their metrics; [`retry`] rides out a loaded
//! API server's transient errors; [`stats`] summarises samples;
//! [`table`] prints the one table. Nothing here asserts speed: only correctness is checked
//! (and reported in the table).

pub mod cli;
pub mod first_fit;
pub mod measure;
pub mod packing;
pub mod probe;
pub mod prom;
pub mod retry;
pub mod sim;
pub mod stats;
pub mod table;
