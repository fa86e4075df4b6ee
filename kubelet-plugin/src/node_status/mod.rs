//! The node's `GpuNode` and heartbeat.
//!
//! The GpuNode ([`writer`]) is owned by the Node (so it is garbage-collected with it) and its
//! status is written whenever the inventory, the device health or the kubelet registration
//! state changes; from it the controller decides what to publish for this node. It is never
//! rewritten just to show the plugin is alive: its inventory is tens of kilobytes that every
//! controller replica decodes.
//!
//! The heartbeat ([`lease`]) is a Lease in the controller's namespace, renewed by a task of
//! its own, as the kubelet renews its node Lease apart from the node status: the status loop's
//! inventory refresh (NVML, unbounded), events and GpuNode writes never delay a renewal.
//!
//! The [`status_loop`] refreshes the inventory and device health every heartbeat interval and
//! drives both. It reads the GPU table ([`crate::gpus`]), never the driver: it keeps running
//! while another plugin instance holds the node lock.

mod lease;
mod status_loop;
mod writer;

use std::time::Duration;

pub use lease::{HeartbeatLease, heartbeat_client};
pub use status_loop::StatusLoop;
pub use writer::NodeStatusWriter;

pub const FIELD_MANAGER: &str = "migdra-kubelet-plugin";

/// How long one heartbeat-path write (the GpuNode, its status, a Lease renewal) may take: two
/// intervals. Unbounded, one hanging call would hold every later beat; bounded by one, every
/// write is cancelled once the server is that slow. A late write is a heartbeat; a cancelled
/// one is not.
fn write_bound(interval: Duration) -> Duration {
    interval.saturating_mul(2)
}

/// Runs one API call of the heartbeat path for at most `limit` (see [`write_bound`]; events
/// get one interval: they are no heartbeat). `None` (logged) when it did not answer in time.
async fn bounded<T>(limit: Duration, what: &str, call: impl Future<Output = T>) -> Option<T> {
    match tokio::time::timeout(limit, call).await {
        Ok(answer) => Some(answer),
        Err(_) => {
            tracing::warn!(timeout = ?limit, "{what}: no answer in time; the next beat tries again");
            None
        }
    }
}
