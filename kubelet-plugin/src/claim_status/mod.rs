//! What a prepared claim says about its devices: this driver's entries in the ResourceClaim's
//! `status.devices`.
//!
//! Once the checkpoint says a claim is prepared, the driver asks (outside the node and GPU
//! locks) for one entry per device of ours: a `Ready` condition and, as `data`, what the
//! device is on the hardware ([`DeviceDetails`]). Unprepare removes them: a claim that stays
//! allocated (reused by the next pod) must not show a destroyed MIG UUID as ready.
//!
//! Every write is a server-side apply of the `status` subresource with this driver's field
//! manager naming only its entries, so the allocation, reservations and other drivers'
//! entries are never touched. The kubelet's call never waits: prepare and unprepare record the
//! claim's desired status (the latest replaces one not yet written) and a background writer
//! ([`ClaimStatusWriter::write_queued`]) writes one at a time, so a claim prepared then quickly
//! unprepared ends cleared. A failed write is kept and retried by
//! [`ClaimStatusWriter::retry_pending`], which re-reads the claim and writes while it is still
//! the one prepared. Each start queues the ready status of every checkpointed claim.
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
