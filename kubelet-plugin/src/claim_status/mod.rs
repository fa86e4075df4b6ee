//! What a prepared claim says about its devices: this driver's entries in the ResourceClaim's
//! `status.devices` (DRAResourceClaimDeviceStatus).
//!
//! Once the checkpoint says a claim is prepared, the driver asks, outside the node and GPU
//! locks, for one entry per device of ours: a `Ready` condition and, as `data`, what the device is
//! on the hardware ([`DeviceDetails`]: the MIG UUID, parent GPU, GPU and compute instance IDs,
//! profile and placement; or the whole GPU's UUID). At unprepare the entries are removed rather
//! than left: the instance they name is destroyed, and a claim that stays allocated (a
//! user-created claim, reused by the next pod) must not show a destroyed MIG UUID as ready.
//!
//! Every write is a server-side apply of the `status` subresource with this driver's own
//! field manager, naming only this driver's entries: the scheduler's allocation, the
//! reservations and other drivers' entries are never part of what is applied, so they are
//! never touched. The kubelet's call never waits for a write (the pod can run without its
//! status): prepare and unprepare only record the claim's desired status (ready with its
//! devices, or cleared; one per claim UID, the latest replacing one not written yet) and a
//! background writer ([`ClaimStatusWriter::write_queued`]) writes it. One write at a time, so
//! a claim prepared then quickly unprepared ends cleared, never with a late ready write after
//! the clear. A failed write is logged, counted and kept, and the periodic pass
//! ([`ClaimStatusWriter::retry_pending`]) re-reads the claim and writes again while it is
//! still the claim that was prepared. A plugin that stops before a write leaves it to the
//! next start, which queues the ready status of every prepared claim in the checkpoint.
//!
//! `entries.rs` builds what is written from plain values (pure); `queue.rs` decides what to
//! write when and does the I/O through a [`crate::claims::ClaimSource`].

mod entries;
mod queue;

pub use entries::{
    DeviceDetails, MAX_CONDITION_MESSAGE_BYTES, MAX_DATA_BYTES, PlacementData, READY_CONDITION,
    StatusContext, StatusDevice, apply_object, now, status_entries,
};
pub use queue::{
    ClaimStatusWriter, DEFAULT_WRITE_TIMEOUT, DesiredStatus, StatusRetryRound, StatusWriteError, WriteOutcome,
};
