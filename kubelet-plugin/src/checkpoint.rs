//! The on-disk record of what the plugin has prepared, and how far it got.
//!
//! Every claim moves through `PrepareStarted -> PrepareCompleted -> UnprepareStarted -> gone`.
//! The record of a claim is written *before* the plugin touches the GPU for it, so after a
//! crash every MIG instance the plugin created can be found from this file: anything it does
//! not describe was made by someone else and is never touched.
//!
//! The file is `{"checksum": "sha256:<hex>", "data": {...}}`, where the checksum covers the
//! exact bytes of `data` as written. Readers never re-serialise before checking, so a field
//! a binary does not know cannot break its checksum. Writes replace the file atomically
//! ([`replace_by_exchange`]) and are not fsynced: the file belongs to one boot
//! ([`crate::state_dir::Durability::ThisBoot`]). It is root-only (0600 in a 0700 directory).
//! The driver uses it only through [`crate::journal::Journal`].

use std::{
    collections::BTreeMap,
    fs,
    os::unix::fs::DirBuilderExt,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use crate::state_dir::{read_consistent, replace_by_exchange};

/// Format version of `data`.
pub const CHECKPOINT_VERSION: u32 = 1;

/// Where a claim is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClaimState {
    /// The plugin may have started creating instances for the claim.
    PrepareStarted,
    /// Everything for the claim exists and was handed to the kubelet.
    PrepareCompleted,
    /// The plugin may have started destroying the claim's instances.
    UnprepareStarted,
}

/// What a device of a claim is on the hardware.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "type")]
pub enum DeviceKind {
    Gpu,
    /// A MIG instance. The placement is recorded before creation; the IDs and UUID after.
    Mig {
        profile_id: u32,
        start: u32,
        size: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        gpu_instance: Option<u32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        compute_instance: Option<u32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mig_uuid: Option<String>,
    },
}

/// One allocated device of a claim.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceRecord {
    /// The allocation result's request (may be `<request>/<subrequest>`).
    pub request: String,
    pub pool: String,
    /// Device name in the pool.
    pub device: String,
    /// Parent GPU.
    pub gpu_uuid: String,
    pub gpu_minor: u32,
    #[serde(flatten)]
    pub kind: DeviceKind,
    /// Extra environment from the resolved opaque configuration.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Set when the device is shared (`allowMultipleAllocations`): the allocation's share ID.
    /// Several claims then hold the same MIG instance, each with a record of it carrying the
    /// same IDs; the records of a device's shares *are* its reference count (see
    /// [`DeviceRecord::same_shared_instance`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
}

impl DeviceRecord {
    pub fn is_share(&self) -> bool {
        self.share_id.is_some()
    }

    /// True when both are shares of the same shared device (same device of the same GPU), hence
    /// of one MIG instance, which lives while any such record exists: each holder is one record, so
    /// the count changes by one atomic checkpoint write and cannot drift after a crash.
    pub fn same_shared_instance(&self, other: &DeviceRecord) -> bool {
        self.is_share()
            && other.is_share()
            && self.gpu_minor == other.gpu_minor
            && self.gpu_uuid == other.gpu_uuid
            && self.device == other.device
    }
}

/// One claim's record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimRecord {
    pub namespace: String,
    pub name: String,
    pub state: ClaimState,
    pub devices: Vec<DeviceRecord>,
}

impl ClaimRecord {
    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// Whether the record was made for `allocation` (the claim's current devices of this driver
    /// and pool): the same request, pool, device and share for each, and no `adminAccess`
    /// device (those leave no record). A claim deallocated and allocated again under the same
    /// UID while its unprepare was missed has a record that answers for nothing.
    pub fn made_for<'a>(&self, allocation: impl IntoIterator<Item = AllocationEntry<'a>>) -> bool {
        let mut current = Vec::new();
        for entry in allocation {
            if entry.admin_access {
                return false;
            }
            current.push((entry.request, entry.pool, entry.device, entry.share_id));
        }
        let mut recorded: Vec<_> = self
            .devices
            .iter()
            .map(|d| {
                (
                    d.request.as_str(),
                    d.pool.as_str(),
                    d.device.as_str(),
                    d.share_id.as_deref(),
                )
            })
            .collect();
        current.sort_unstable();
        recorded.sort_unstable();
        current == recorded
    }

    /// The recorded device names, in order.
    pub fn device_names(&self) -> Vec<String> {
        self.devices.iter().map(|d| d.device.clone()).collect()
    }
}

/// One device of a claim's allocation, as [`ClaimRecord::made_for`] compares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocationEntry<'a> {
    pub request: &'a str,
    pub pool: &'a str,
    pub device: &'a str,
    pub share_id: Option<&'a str>,
    pub admin_access: bool,
}

/// The checkpoint's content.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointData {
    pub version: u32,
    /// MIG instances never survive a reboot, so a checkpoint belongs to one boot.
    pub boot_id: String,
    /// By UID.
    pub claims: BTreeMap<String, ClaimRecord>,
}

/// The file: `data` is kept as written, so its checksum covers exactly those bytes.
#[derive(Serialize, Deserialize)]
struct CheckpointFile<'a> {
    checksum: String,
    #[serde(borrow)]
    data: &'a RawValue,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A state file could not be replaced: what it records did not change.
    #[error("cannot write {path} (is the state directory read-only or full?): {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not a checkpoint, or its checksum does not match.
    #[error("checkpoint {path} is corrupt: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("serialising the checkpoint: {0}")]
    Encode(#[from] serde_json::Error),
}

/// How a checkpoint was loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadOutcome {
    /// No file existed.
    Fresh,
    /// The file was read.
    Loaded,
    /// The file belonged to an earlier boot and was discarded.
    PreviousBoot { old_boot_id: String },
    /// The file could not be used (corrupt, or a format newer than this binary's): an empty
    /// checkpoint is used, and the file was moved aside to `moved_aside` (`None` when that
    /// failed, a read-only state directory). The records it held are lost; what they described
    /// is recovered from what survives ([`crate::driver::OwnershipReport`]).
    Unreadable {
        reason: String,
        moved_aside: Option<PathBuf>,
    },
}

impl LoadOutcome {
    /// Whether records of this boot may have been lost.
    pub fn records_lost(&self) -> bool {
        matches!(self, Self::Unreadable { .. })
    }
}

/// The checkpoint file.
#[derive(Debug)]
pub struct Checkpoint {
    path: PathBuf,
    data: CheckpointData,
    /// The file's bytes as this process last read or wrote them (`None`: no file yet). Another
    /// plugin instance on the node (a rolling update) may have rewritten the file since;
    /// [`Checkpoint::reload_if_changed`] compares against these.
    on_disk: Option<Vec<u8>>,
}

impl Checkpoint {
    /// Opens `<dir>/checkpoint.json` for boot `boot_id`, creating the directory (0700).
    /// A checkpoint from another boot, or an unreadable one, yields an empty checkpoint. Nothing
    /// is written here (the first record replaces the file), so a read-only state directory
    /// opens too.
    pub fn open(dir: &Path, boot_id: &str) -> Result<(Self, LoadOutcome), CheckpointError> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| CheckpointError::Io {
                path: dir.to_path_buf(),
                source,
            })?;
        let path = dir.join("checkpoint.json");
        let empty = CheckpointData {
            version: CHECKPOINT_VERSION,
            boot_id: boot_id.to_string(),
            claims: BTreeMap::new(),
        };
        let bytes = match read_consistent(&path) {
            Ok(Some(bytes)) => bytes,
            Ok(None) => {
                let checkpoint = Self {
                    path,
                    data: empty,
                    on_disk: None,
                };
                return Ok((checkpoint, LoadOutcome::Fresh));
            }
            Err(source) => return Err(CheckpointError::Io { path, source }),
        };
        // The bytes stay what this process "read" while they are still on disk, so a re-read
        // sees no change until someone writes the file.
        let (outcome, on_disk) = match decode(&bytes) {
            Ok(data) if data.boot_id == boot_id => {
                let checkpoint = Self {
                    path,
                    data,
                    on_disk: Some(bytes),
                };
                return Ok((checkpoint, LoadOutcome::Loaded));
            }
            Ok(data) => {
                let outcome = LoadOutcome::PreviousBoot {
                    old_boot_id: data.boot_id,
                };
                (outcome, Some(bytes))
            }
            Err(reason) => {
                let aside = dir.join(format!("checkpoint.json.unreadable-{}", std::process::id()));
                match fs::rename(&path, &aside) {
                    Ok(()) => {
                        tracing::error!(path = %path.display(), %reason, aside = %aside.display(), "checkpoint is unreadable; moved it aside, starting empty");
                        let outcome = LoadOutcome::Unreadable {
                            reason,
                            moved_aside: Some(aside),
                        };
                        (outcome, None)
                    }
                    Err(e) => {
                        tracing::error!(path = %path.display(), %reason, error = %e, "checkpoint is unreadable and cannot be moved aside; starting empty, the first record replaces it");
                        let outcome = LoadOutcome::Unreadable {
                            reason,
                            moved_aside: None,
                        };
                        (outcome, Some(bytes))
                    }
                }
            }
        };
        let checkpoint = Self {
            path,
            data: empty,
            on_disk,
        };
        Ok((checkpoint, outcome))
    }

    pub fn data(&self) -> &CheckpointData {
        &self.data
    }

    pub fn claim(&self, uid: &str) -> Option<&ClaimRecord> {
        self.data.claims.get(uid)
    }

    /// Sets a claim's record and writes the file. On a write failure the in-memory state is
    /// left as it was, so memory never claims more than the disk holds.
    pub fn put(&mut self, uid: &str, record: ClaimRecord) -> Result<(), CheckpointError> {
        let previous = self.data.claims.insert(uid.to_string(), record);
        self.persist_or_restore(uid, previous)
    }

    /// Removes a claim's record and writes the file.
    pub fn remove(&mut self, uid: &str) -> Result<(), CheckpointError> {
        let Some(previous) = self.data.claims.remove(uid) else {
            return Ok(());
        };
        self.persist_or_restore(uid, Some(previous))
    }

    fn persist_or_restore(
        &mut self,
        uid: &str,
        previous: Option<ClaimRecord>,
    ) -> Result<(), CheckpointError> {
        let result = self.persist();
        if result.is_err() {
            match previous {
                Some(record) => self.data.claims.insert(uid.to_string(), record),
                None => self.data.claims.remove(uid),
            };
        }
        result
    }

    fn persist(&mut self) -> Result<(), CheckpointError> {
        let bytes = encode(&self.data)?;
        replace_by_exchange(&self.path, &bytes, 0o600).map_err(|source| CheckpointError::Write {
            path: self.path.clone(),
            source,
        })?;
        self.on_disk = Some(bytes);
        Ok(())
    }

    /// Re-reads the file when its bytes differ from what this process last read or wrote (another
    /// plugin instance changed it; bytes, unlike inode or mtime, compare exactly); returns whether
    /// the content was replaced. Call it under the node lock before acting on records and before
    /// writing. An unusable file is an error, not moved aside: the other instance may be writing it.
    pub fn reload_if_changed(&mut self) -> Result<bool, CheckpointError> {
        let bytes = read_consistent(&self.path).map_err(|source| CheckpointError::Io {
            path: self.path.clone(),
            source,
        })?;
        if bytes == self.on_disk {
            return Ok(false);
        }
        let data = match &bytes {
            // Nobody writes the file away; a missing one (a wiped state dir) holds no claims.
            None => CheckpointData {
                claims: BTreeMap::new(),
                ..self.data.clone()
            },
            Some(bytes) => {
                let data = decode(bytes).map_err(|reason| CheckpointError::Corrupt {
                    path: self.path.clone(),
                    reason,
                })?;
                if data.boot_id != self.data.boot_id {
                    return Err(CheckpointError::Corrupt {
                        path: self.path.clone(),
                        reason: format!(
                            "another instance wrote it for boot {}, this is boot {}",
                            data.boot_id, self.data.boot_id
                        ),
                    });
                }
                data
            }
        };
        tracing::debug!(path = %self.path.display(), claims = data.claims.len(), "checkpoint changed on disk; reloaded");
        self.data = data;
        self.on_disk = bytes;
        Ok(true)
    }
}

fn encode(data: &CheckpointData) -> Result<Vec<u8>, CheckpointError> {
    let raw = serde_json::value::to_raw_value(data)?;
    let checksum = checksum(raw.get().as_bytes());
    let mut bytes = serde_json::to_vec(&CheckpointFile { checksum, data: &raw })?;
    bytes.push(b'\n');
    Ok(bytes)
}

fn decode(bytes: &[u8]) -> Result<CheckpointData, String> {
    let file: CheckpointFile<'_> =
        serde_json::from_slice(bytes).map_err(|e| format!("not a checkpoint: {e}"))?;
    let actual = checksum(file.data.get().as_bytes());
    if actual != file.checksum {
        return Err(format!(
            "checksum mismatch (file says {}, content hashes to {actual})",
            file.checksum
        ));
    }
    let data: CheckpointData =
        serde_json::from_str(file.data.get()).map_err(|e| format!("bad content: {e}"))?;
    if data.version > CHECKPOINT_VERSION {
        return Err(format!(
            "version {} is newer than this binary's {CHECKPOINT_VERSION}",
            data.version
        ));
    }
    Ok(data)
}

fn checksum(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn record(state: ClaimState) -> ClaimRecord {
        ClaimRecord {
            namespace: "ns".into(),
            name: "claim".into(),
            state,
            devices: vec![DeviceRecord {
                request: "gpu".into(),
                pool: "node/gpu.migdra.dev".into(),
                device: "gpu-0-mig-3g40gb-4".into(),
                gpu_uuid: "GPU-1".into(),
                gpu_minor: 0,
                kind: DeviceKind::Mig {
                    profile_id: 9,
                    start: 4,
                    size: 4,
                    gpu_instance: Some(2),
                    compute_instance: Some(0),
                    mig_uuid: Some("MIG-1".into()),
                },
                env: BTreeMap::new(),
                share_id: None,
            }],
        }
    }

    #[test]
    fn round_trips_and_is_root_only() {
        let dir = tempfile::tempdir().unwrap();
        let (mut cp, outcome) = Checkpoint::open(dir.path(), "boot-a").unwrap();
        assert_eq!(outcome, LoadOutcome::Fresh);
        cp.put("uid-1", record(ClaimState::PrepareCompleted)).unwrap();
        let mode = fs::metadata(&cp.path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let (cp2, outcome) = Checkpoint::open(dir.path(), "boot-a").unwrap();
        assert_eq!(outcome, LoadOutcome::Loaded);
        assert_eq!(cp2.claim("uid-1"), Some(&record(ClaimState::PrepareCompleted)));
    }

    #[test]
    fn another_boot_starts_empty() {
        let dir = tempfile::tempdir().unwrap();
        let (mut cp, _) = Checkpoint::open(dir.path(), "boot-a").unwrap();
        cp.put("uid-1", record(ClaimState::PrepareCompleted)).unwrap();
        let (cp2, outcome) = Checkpoint::open(dir.path(), "boot-b").unwrap();
        assert_eq!(
            outcome,
            LoadOutcome::PreviousBoot {
                old_boot_id: "boot-a".into()
            }
        );
        assert!(cp2.data().claims.is_empty());
        assert_eq!(cp2.data().boot_id, "boot-b");
    }

    #[test]
    fn tampered_file_is_moved_aside() {
        let dir = tempfile::tempdir().unwrap();
        let (mut cp, _) = Checkpoint::open(dir.path(), "boot-a").unwrap();
        cp.put("uid-1", record(ClaimState::PrepareStarted)).unwrap();
        let text = fs::read_to_string(&cp.path)
            .unwrap()
            .replace("PrepareStarted", "PrepareCompleted");
        fs::write(&cp.path, text).unwrap();
        let (cp2, outcome) = Checkpoint::open(dir.path(), "boot-a").unwrap();
        let LoadOutcome::Unreadable {
            moved_aside: Some(aside),
            ..
        } = outcome
        else {
            panic!("expected unreadable, got {outcome:?}")
        };
        assert!(aside.exists());
        assert!(cp2.data().claims.is_empty());
    }

    #[test]
    fn a_newer_format_is_unreadable_and_opening_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let data = r#"{"version":99,"bootId":"boot-a","claims":{}}"#;
        let file = format!(r#"{{"checksum":"{}","data":{data}}}"#, checksum(data.as_bytes()));
        fs::write(dir.path().join("checkpoint.json"), file).unwrap();
        let (_, outcome) = Checkpoint::open(dir.path(), "boot-a").unwrap();
        let LoadOutcome::Unreadable { reason, moved_aside } = &outcome else {
            panic!("expected unreadable, got {outcome:?}")
        };
        assert!(reason.contains("version 99 is newer"), "{reason}");
        assert!(moved_aside.is_some());
        assert!(outcome.records_lost());
        assert!(
            !dir.path().join("checkpoint.json").exists(),
            "no empty checkpoint is written at open"
        );
    }

    #[test]
    fn unknown_fields_from_a_newer_writer_keep_the_checksum_valid() {
        // A later version adds a field: the checksum is over the bytes as written, so this
        // binary still accepts the file and ignores the field.
        let dir = tempfile::tempdir().unwrap();
        let data = r#"{"version":1,"bootId":"boot-a","claims":{},"futureField":{"x":1}}"#;
        let file = format!(r#"{{"checksum":"{}","data":{data}}}"#, checksum(data.as_bytes()));
        fs::write(dir.path().join("checkpoint.json"), file).unwrap();
        let (_, outcome) = Checkpoint::open(dir.path(), "boot-a").unwrap();
        assert_eq!(outcome, LoadOutcome::Loaded);
    }

    #[test]
    fn a_checkpoint_without_share_ids_loads_with_exclusive_devices() {
        // Exclusive devices are written without a shareId.
        let dir = tempfile::tempdir().unwrap();
        let data = r#"{"version":1,"bootId":"boot-a","claims":{"uid-1":{"namespace":"ns","name":"claim","state":"PrepareCompleted","devices":[{"request":"gpu","pool":"node/gpu.migdra.dev","device":"gpu-0-mig-3g40gb-4","gpuUuid":"GPU-1","gpuMinor":0,"type":"mig","profile_id":9,"start":4,"size":4,"gpu_instance":2,"compute_instance":0,"mig_uuid":"MIG-1"}]}}}"#;
        let file = format!(r#"{{"checksum":"{}","data":{data}}}"#, checksum(data.as_bytes()));
        fs::write(dir.path().join("checkpoint.json"), file).unwrap();
        decode(fs::read(dir.path().join("checkpoint.json")).unwrap().as_slice())
            .expect("a checkpoint without share IDs decodes");
        let (cp, outcome) = Checkpoint::open(dir.path(), "boot-a").unwrap();
        assert_eq!(outcome, LoadOutcome::Loaded);
        let loaded = cp.claim("uid-1").unwrap();
        assert_eq!(loaded, &record(ClaimState::PrepareCompleted));
        assert!(!loaded.devices[0].is_share());
    }

    #[test]
    fn shares_round_trip_and_name_one_instance() {
        let dir = tempfile::tempdir().unwrap();
        let (mut cp, _) = Checkpoint::open(dir.path(), "boot-a").unwrap();
        let mut shared = record(ClaimState::PrepareCompleted);
        shared.devices[0].share_id = Some("share-a".into());
        cp.put("uid-1", shared.clone()).unwrap();
        let (reopened, _) = Checkpoint::open(dir.path(), "boot-a").unwrap();
        assert_eq!(reopened.claim("uid-1"), Some(&shared));
        let mut other = shared.devices[0].clone();
        other.share_id = Some("share-b".into());
        assert!(shared.devices[0].same_shared_instance(&other));
        let exclusive = record(ClaimState::PrepareCompleted).devices[0].clone();
        assert!(!shared.devices[0].same_shared_instance(&exclusive));
        other.gpu_minor = 1;
        assert!(!shared.devices[0].same_shared_instance(&other));
    }

    #[test]
    fn a_record_is_made_for_its_own_allocation_only() {
        let record = record(ClaimState::PrepareCompleted);
        let entry = AllocationEntry {
            request: "gpu",
            pool: "node/gpu.migdra.dev",
            device: "gpu-0-mig-3g40gb-4",
            share_id: None,
            admin_access: false,
        };
        assert!(record.made_for([entry]));
        let other_device = AllocationEntry {
            device: "gpu-0-mig-3g40gb-0",
            ..entry
        };
        assert!(!record.made_for([other_device]));
        assert!(!record.made_for([entry, other_device]), "a device more");
        assert!(!record.made_for([]), "a device less");
        let other_request = AllocationEntry {
            request: "other",
            ..entry
        };
        assert!(!record.made_for([other_request]));
        let shared = AllocationEntry {
            share_id: Some("share-a"),
            ..entry
        };
        assert!(!record.made_for([shared]));
        let admin = AllocationEntry {
            admin_access: true,
            ..entry
        };
        assert!(!record.made_for([admin]));
    }

    #[test]
    fn remove_is_persisted() {
        let dir = tempfile::tempdir().unwrap();
        let (mut cp, _) = Checkpoint::open(dir.path(), "b").unwrap();
        cp.put("u", record(ClaimState::UnprepareStarted)).unwrap();
        cp.remove("u").unwrap();
        cp.remove("never-there").unwrap();
        let (cp2, _) = Checkpoint::open(dir.path(), "b").unwrap();
        assert!(cp2.claim("u").is_none());
    }

    #[test]
    fn reload_picks_up_another_writer_and_only_then() {
        let dir = tempfile::tempdir().unwrap();
        let (mut a, _) = Checkpoint::open(dir.path(), "boot-a").unwrap();
        let (mut b, _) = Checkpoint::open(dir.path(), "boot-a").unwrap();
        assert!(!b.reload_if_changed().unwrap(), "nothing written yet");
        a.put("uid-1", record(ClaimState::PrepareCompleted)).unwrap();
        assert!(!a.reload_if_changed().unwrap(), "its own write is not a change");
        assert!(b.reload_if_changed().unwrap());
        assert_eq!(b.claim("uid-1"), Some(&record(ClaimState::PrepareCompleted)));
        assert!(!b.reload_if_changed().unwrap());
        b.remove("uid-1").unwrap();
        assert!(a.reload_if_changed().unwrap());
        assert!(a.data().claims.is_empty());
    }

    #[test]
    fn a_reload_of_a_corrupt_file_fails_and_keeps_the_copy_in_memory() {
        let dir = tempfile::tempdir().unwrap();
        let (mut a, _) = Checkpoint::open(dir.path(), "boot-a").unwrap();
        a.put("uid-1", record(ClaimState::PrepareCompleted)).unwrap();
        fs::write(&a.path, b"{\"checksum\": \"sha256:00\", \"data\": {}}").unwrap();
        let err = a.reload_if_changed().unwrap_err();
        assert!(matches!(err, CheckpointError::Corrupt { .. }), "{err}");
        assert!(a.claim("uid-1").is_some());
        assert!(dir.path().join("checkpoint.json").exists(), "not moved aside");
    }
}
