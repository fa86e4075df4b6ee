//! The journal: the one way the plugin reads and writes its [`Checkpoint`].
//!
//! It owns the checkpoint's mutex and names a claim record's transitions, so the protocol,
//! **record, act, record**, is in one place: the intent is written before the GPU is touched
//! ([`Journal::start_prepare`], [`Journal::start_unprepare`]), each instance as soon as it
//! exists ([`Journal::record_devices`]), the outcome afterwards ([`Journal::complete_prepare`],
//! [`Journal::forget`]). After a crash the journal describes every instance the plugin may
//! have created.
//!
//! The mutex is a leaf: held only inside these methods, never while another lock is taken or
//! the GPU is touched.
//!
//! During a rolling update two plugin instances share the file, so the copy in memory is a
//! cache: the driver calls [`Journal::reload_if_changed`] right after taking the node lock,
//! and the idempotent prepare answer and [`Journal::claims`] re-read too. A re-read parses
//! only when the file's bytes differ from the last ones this process read or wrote.

use std::{
    collections::BTreeMap,
    path::Path,
    sync::{Mutex, MutexGuard},
};

use crate::{
    checkpoint::{Checkpoint, CheckpointError, ClaimRecord, ClaimState, DeviceRecord, LoadOutcome},
    metrics::Metrics,
};

pub struct Journal {
    checkpoint: Mutex<Checkpoint>,
    /// Counts failed writes.
    metrics: Metrics,
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal")
            .field("checkpoint", &self.checkpoint)
            .finish_non_exhaustive()
    }
}

impl Journal {
    /// Opens the checkpoint in `dir` for boot `boot_id` (see [`Checkpoint::open`]); failed
    /// writes are counted in `metrics`.
    pub fn open(dir: &Path, boot_id: &str, metrics: Metrics) -> Result<(Self, LoadOutcome), CheckpointError> {
        let (checkpoint, outcome) = Checkpoint::open(dir, boot_id)?;
        let checkpoint = Mutex::new(checkpoint);
        Ok((Self { checkpoint, metrics }, outcome))
    }

    fn lock(&self) -> MutexGuard<'_, Checkpoint> {
        // The copy in memory changes only with a successful file write: nothing half-done.
        crate::lock(&self.checkpoint)
    }

    /// Writes `record` as the claim's, counting a failed write.
    fn put(&self, uid: &str, record: ClaimRecord) -> Result<(), CheckpointError> {
        let result = self.lock().put(uid, record);
        self.count(result)
    }

    fn count(&self, result: Result<(), CheckpointError>) -> Result<(), CheckpointError> {
        if let Err(e) = &result {
            tracing::error!(error = %e, "the checkpoint write failed");
            self.metrics.state_write_failed("checkpoint");
        }
        result
    }

    /// Re-reads the checkpoint when another plugin instance on the node changed the file (see
    /// [`Checkpoint::reload_if_changed`]); returns whether it did. The driver calls it right
    /// after taking the node lock, so records are read and written against the latest file.
    pub fn reload_if_changed(&self) -> Result<bool, CheckpointError> {
        self.lock().reload_if_changed()
    }

    pub fn get(&self, uid: &str) -> Option<ClaimRecord> {
        self.lock().claim(uid).cloned()
    }

    /// A claim's record when the claim is fully prepared.
    pub fn completed(&self, uid: &str) -> Option<ClaimRecord> {
        self.get(uid).filter(|r| r.state == ClaimState::PrepareCompleted)
    }

    /// A copy of every record, by claim UID, as the file has them now: another plugin instance
    /// may have changed it (the inventory must know its instances as migdra's too). Reading
    /// without the node lock is safe because the file is replaced atomically; when it cannot
    /// be read, the copy in memory is returned.
    pub fn claims(&self) -> BTreeMap<String, ClaimRecord> {
        let mut checkpoint = self.lock();
        // Best effort: acting on records always reloads under the node lock, where a failure
        // is an error.
        if let Err(e) = checkpoint.reload_if_changed() {
            tracing::warn!(error = %e, "cannot re-read the checkpoint; reporting the copy in memory");
        }
        checkpoint.data().claims.clone()
    }

    /// Every record except `uid`'s: what a new claim must not collide with.
    pub fn others(&self, uid: &str) -> Vec<(String, ClaimRecord)> {
        self.others_where(uid, |_| true)
    }

    /// The other claims holding shares of `device` (a shared device's record): uid, record and
    /// their record of the device. The instance must outlive each of them.
    pub fn other_holders(&self, uid: &str, device: &DeviceRecord) -> Vec<(String, ClaimRecord)> {
        self.others_where(uid, |r| r.devices.iter().any(|d| d.same_shared_instance(device)))
    }

    fn others_where(&self, uid: &str, keep: impl Fn(&ClaimRecord) -> bool) -> Vec<(String, ClaimRecord)> {
        let checkpoint = self.lock();
        let others = checkpoint
            .data()
            .claims
            .iter()
            .filter(|(other, r)| *other != uid && keep(r));
        others.map(|(u, r)| (u.clone(), r.clone())).collect()
    }

    /// Records the intent to prepare: the claim and the placements it will create, before
    /// anything is created.
    pub fn start_prepare(
        &self,
        uid: &str,
        namespace: &str,
        name: &str,
        devices: Vec<DeviceRecord>,
    ) -> Result<ClaimRecord, CheckpointError> {
        let record = ClaimRecord {
            namespace: namespace.to_string(),
            name: name.to_string(),
            state: ClaimState::PrepareStarted,
            devices,
        };
        self.put(uid, record.clone())?;
        Ok(record)
    }

    /// Records what a half-prepared claim created so far (IDs and UUIDs of its instances).
    pub fn record_devices(&self, uid: &str, record: &ClaimRecord) -> Result<(), CheckpointError> {
        self.put(uid, record.clone())
    }

    /// Records that everything of the claim exists.
    pub fn complete_prepare(&self, uid: &str, record: &mut ClaimRecord) -> Result<(), CheckpointError> {
        record.state = ClaimState::PrepareCompleted;
        self.put(uid, record.clone())
    }

    /// Records the intent to unprepare a prepared claim, before anything is destroyed.
    /// Returns whether a record was written: a half-prepared claim is rolled back without
    /// one, and a claim already being unprepared keeps its record.
    pub fn start_unprepare(&self, uid: &str, record: &ClaimRecord) -> Result<bool, CheckpointError> {
        if record.state != ClaimState::PrepareCompleted {
            return Ok(false);
        }
        let mut started = record.clone();
        started.state = ClaimState::UnprepareStarted;
        self.put(uid, started)?;
        Ok(true)
    }

    /// Forgets a claim whose instances are gone.
    pub fn forget(&self, uid: &str) -> Result<(), CheckpointError> {
        let result = self.lock().remove(uid);
        self.count(result)
    }

    /// Records a claim whose record was lost as it is found now (see
    /// [`crate::driver::OwnershipReport`]): prepared, or being unprepared.
    pub fn restore(&self, uid: &str, record: &ClaimRecord) -> Result<(), CheckpointError> {
        self.put(uid, record.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::DeviceKind;

    fn device() -> DeviceRecord {
        DeviceRecord {
            request: "gpu".into(),
            pool: "node/gpu.migdra.dev".into(),
            device: "gpu-0".into(),
            gpu_uuid: "GPU-1".into(),
            gpu_minor: 0,
            kind: DeviceKind::Gpu,
            env: BTreeMap::new(),
            share_id: None,
        }
    }

    #[test]
    fn the_holders_of_a_shared_device_are_the_other_records_of_its_shares() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, _) = Journal::open(dir.path(), "boot", Metrics::new()).unwrap();
        let share = |id: &str| DeviceRecord {
            device: "gpu-0-mig-1g10gb-6".into(),
            share_id: Some(id.into()),
            ..device()
        };
        journal
            .start_prepare("u1", "ns", "c1", vec![share("s1")])
            .unwrap();
        journal
            .start_prepare("u2", "ns", "c2", vec![share("s2")])
            .unwrap();
        // An exclusive record of the same device name is not a holder of the shared instance.
        let exclusive = DeviceRecord {
            device: "gpu-0-mig-1g10gb-6".into(),
            ..device()
        };
        journal.start_prepare("u3", "ns", "c3", vec![exclusive]).unwrap();
        let holders = |uid: &str| -> Vec<String> {
            journal
                .other_holders(uid, &share("x"))
                .into_iter()
                .map(|(u, _)| u)
                .collect()
        };
        assert_eq!(holders("u1"), ["u2"]);
        assert_eq!(holders("u2"), ["u1"]);
        journal.forget("u2").unwrap();
        assert!(holders("u1").is_empty(), "the last holder");
    }

    #[test]
    fn a_claim_moves_through_the_protocol_and_each_step_is_durable() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, _) = Journal::open(dir.path(), "boot", Metrics::new()).unwrap();
        let mut record = journal.start_prepare("u", "ns", "c", vec![device()]).unwrap();
        assert_eq!(record.state, ClaimState::PrepareStarted);
        assert!(journal.completed("u").is_none());
        assert!(
            !journal.start_unprepare("u", &record).unwrap(),
            "a half-prepared claim is rolled back, not unprepared"
        );
        journal.complete_prepare("u", &mut record).unwrap();
        let (reopened, _) = Journal::open(dir.path(), "boot", Metrics::new()).unwrap();
        assert_eq!(reopened.completed("u"), Some(record.clone()));
        assert!(journal.start_unprepare("u", &record).unwrap());
        let unpreparing = journal.get("u").unwrap();
        assert_eq!(unpreparing.state, ClaimState::UnprepareStarted);
        assert!(!journal.start_unprepare("u", &unpreparing).unwrap());
        assert_eq!(journal.others("v").len(), 1);
        assert!(journal.others("u").is_empty());
        journal.forget("u").unwrap();
        assert!(journal.claims().is_empty());
        let (reopened, _) = Journal::open(dir.path(), "boot", Metrics::new()).unwrap();
        assert!(reopened.get("u").is_none());
    }
}
