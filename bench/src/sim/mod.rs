//! Simulated GPU nodes: Node objects with capacity, conditions and a node Lease (as a kubelet
//! keeps them), and GpuNodes with the kubelet plugin's schema and heartbeat, so that the real
//! controller publishes real pools for them and the real scheduler allocates from them.
//!
//! [`objects`] builds what a node and its plugin would write; [`heartbeat`] is the one place
//! that knows how a plugin reports itself alive (its form changes with the controller's
//! heartbeat design); [`fleet`] creates the nodes and keeps them live; [`transport`] is the
//! connection stack the plugins' own clients share.

pub mod fleet;
pub mod heartbeat;
pub mod objects;
pub mod transport;
