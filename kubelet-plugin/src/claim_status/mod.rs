//! What a prepared claim says about its devices: this driver's entries in the ResourceClaim's
//! `status.devices`.
//!
//! Once the checkpoint says a claim is prepared, the driver asks, outside the node and GPU
//! locks, for one entry per device of ours: a `Ready` condition and, as `data`, what the
//! device is on the hardware ([`DeviceDetails`]). At unprepare the entries are removed: the
//! instance they name is destroyed, and a claim that stays allocated (reused by the next pod)
//! must not show a destroyed MIG UUID as ready.
//!
//! Every write is a server-side apply of the `status` subresource with this driver's own
//! field manager, naming only this driver's entries, so the allocation, the reservations and
//! other drivers' entries are never touched. The kubelet's call never waits for a write:
//! prepare and unprepare only record the claim's desired status (the latest replacing one not
//! written yet) and a background writer ([`ClaimStatusWriter::write_queued`]) writes it, one
//! write at a time, so a claim prepared then quickly unprepared ends cleared. A failed write
//! is kept, and the periodic pass ([`ClaimStatusWriter::retry_pending`]) re-reads the claim
//! and writes again while it is still the claim that was prepared. The next start queues the
//! ready status of every prepared claim in the checkpoint.
//!
//! `entries.rs` builds what is written from plain values; `queue.rs` decides what to write
//! when and does the I/O through a [`crate::claims::ClaimSource`].

mod entries;
mod queue;

pub use entries::{
    DeviceDetails, MAX_CONDITION_MESSAGE_BYTES, MAX_DATA_BYTES, PlacementData, READY_CONDITION,
    StatusContext, StatusDevice, apply_object, now, status_entries,
};
pub use queue::{
    ClaimStatusWriter, DEFAULT_WRITE_TIMEOUT, DesiredStatus, StatusRetryRound, StatusWriteError, WriteOutcome,
};
