//! Instances left on a lost GPU: what teardown could not destroy because the GPU was gone.
//!
//! A lost GPU's (`NVML_ERROR_GPU_IS_LOST`) claims must still unprepare, or their pods never
//! terminate. Teardown then treats its instances as gone, but first lists each one here
//! ([`LostGpuOrphans::add`], before the claim is forgotten), because a GPU can come back with
//! its instances still configured. When the inventory sees the GPU healthy again it destroys
//! exactly these (same GPU UUID, profile, placement and, where known, GPU-instance ID);
//! instances no record or orphan describes stay foreign and untouched.
//!
//! The list also watches placements where an instance may still appear
//! ([`OrphanedInstance::awaited_until`]): a half-prepared claim rolled back while its
//! GPU-instance create had not returned (the plugin that called it crashed, or the call ran past
//! its bound). A create stuck in the driver completes whenever the driver lets it, with nobody
//! left to record it; without the watch its instance would count as foreign and never be
//! destroyed.
//!
//! The list is `<state dir>/lost-gpu-orphans.json`, written atomically and belonging to one
//! boot (instances never survive a reboot), and changed only under the node lock (and the
//! GPU's lock). Two plugin instances share it during a rolling update, so every read and
//! change starts from the file as it is now, and a change under the node lock cannot
//! overwrite what the other instance added.

use std::{
    path::{Path, PathBuf},
    sync::{Mutex, MutexGuard},
};

use serde::{Deserialize, Serialize};

use crate::{
    checkpoint::CheckpointError,
    state_dir::{Durability, write_atomically},
};

pub const ORPHANS_FILE: &str = "lost-gpu-orphans.json";

/// A MIG instance that a claim's teardown left on a lost GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OrphanedInstance {
    /// The GPU's UUID (its minor may change when it comes back).
    pub gpu_uuid: String,
    /// The GPU's minor when the instance was left.
    pub gpu_minor: u32,
    pub profile_id: u32,
    pub start: u32,
    /// When it was recorded.
    pub gpu_instance: Option<u32>,
    /// The claim it belonged to, `namespace/name`.
    pub claim: String,
    /// The device name it was allocated as.
    pub device: String,
    /// Set when the instance was not there yet: its create may still complete. Until this
    /// time (seconds since the Unix epoch) the entry stays while nothing is at its placement,
    /// and an instance that appears there while no record holds the placement is destroyed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub awaited_until: Option<u64>,
}

/// How long a placement whose create may still complete is watched. A create stuck in the
/// driver has no bound of its own; an hour is far past any NVML call that ever returns,
/// and short enough that an instance an admin makes by hand at the same placement later is
/// not taken for the late one.
pub const LATE_CREATE_WATCH: std::time::Duration = std::time::Duration::from_secs(60 * 60);

impl OrphanedInstance {
    /// Whether both describe the same instance (the watch deadline aside).
    fn same_instance(&self, other: &Self) -> bool {
        Self {
            awaited_until: None,
            ..self.clone()
        } == Self {
            awaited_until: None,
            ..other.clone()
        }
    }

    /// Whether the entry still watches for a late instance at `now` (seconds since the epoch).
    pub fn awaited_at(&self, now: u64) -> bool {
        self.awaited_until.is_some_and(|until| now < until)
    }
}

/// Seconds since the Unix epoch (0 if the clock is before it, which ends every watch).
pub fn epoch_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct OrphanFile {
    boot_id: String,
    orphans: Vec<OrphanedInstance>,
}

/// The persisted list of instances left on lost GPUs.
#[derive(Debug)]
pub struct LostGpuOrphans {
    path: PathBuf,
    boot_id: String,
    list: Mutex<Loaded>,
}

/// The list as last read or written, with the file's bytes then (to notice another
/// instance's change without parsing the file again every time).
#[derive(Debug, Default)]
struct Loaded {
    on_disk: Option<Vec<u8>>,
    orphans: Vec<OrphanedInstance>,
}

impl Loaded {
    /// Follows the file's current bytes (`None`: no file): a list of another boot is empty,
    /// an unreadable one is logged (once per content) and treated as empty (its instances
    /// then show as foreign, which is safe: they are never destroyed).
    fn follow(&mut self, path: &Path, boot_id: &str, bytes: Option<Vec<u8>>) {
        if bytes == self.on_disk {
            return;
        }
        self.orphans = match &bytes {
            None => Vec::new(),
            Some(bytes) => match serde_json::from_slice::<OrphanFile>(bytes) {
                Ok(file) if file.boot_id == boot_id => file.orphans,
                Ok(_) => Vec::new(),
                Err(e) => {
                    tracing::error!(path = %path.display(), error = %e, "the list of instances left on lost GPUs is unreadable; treating it as empty");
                    Vec::new()
                }
            },
        };
        self.on_disk = bytes;
    }
}

impl LostGpuOrphans {
    /// Loads the list of boot `boot_id` from `state_dir` (which exists; see [`Loaded::follow`]).
    pub fn open(state_dir: &Path, boot_id: &str) -> Result<Self, CheckpointError> {
        let path = state_dir.join(ORPHANS_FILE);
        let mut list = Loaded::default();
        list.follow(&path, boot_id, read_bytes(&path)?);
        Ok(Self {
            path,
            boot_id: boot_id.to_string(),
            list: Mutex::new(list),
        })
    }

    /// The list as the file has it now (another plugin instance may have changed it). When
    /// the file cannot be read the last list this process knew stands.
    fn lock(&self) -> MutexGuard<'_, Loaded> {
        let mut list = crate::lock(&self.list);
        match read_bytes(&self.path) {
            Ok(bytes) => list.follow(&self.path, &self.boot_id, bytes),
            Err(e) => {
                tracing::warn!(error = %e, "re-reading the list of instances left on lost GPUs failed; using the last one read")
            }
        }
        list
    }

    pub fn all(&self) -> Vec<OrphanedInstance> {
        self.lock().orphans.clone()
    }

    pub fn is_empty(&self) -> bool {
        self.lock().orphans.is_empty()
    }

    pub fn on_gpu(&self, gpu_uuid: &str) -> Vec<OrphanedInstance> {
        self.lock()
            .orphans
            .iter()
            .filter(|o| o.gpu_uuid == gpu_uuid)
            .cloned()
            .collect()
    }

    /// Adds instances (each once; a second watch of the same instance keeps the later
    /// deadline) and writes the file; on failure nothing is added. Callers hold the node lock,
    /// so the file read here is not changed before it is written.
    pub fn add(&self, new: impl IntoIterator<Item = OrphanedInstance>) -> Result<(), CheckpointError> {
        self.change(|list| {
            for orphan in new {
                match list.iter_mut().find(|o| o.same_instance(&orphan)) {
                    Some(listed) => {
                        listed.awaited_until = match (listed.awaited_until, orphan.awaited_until) {
                            (Some(a), Some(b)) => Some(a.max(b)),
                            // One entry destroys whatever is there: it needs no deadline.
                            _ => None,
                        }
                    }
                    None => list.push(orphan),
                }
            }
        })
    }

    /// Removes an instance (destroyed, or found gone) and writes the file (under the node
    /// lock, like [`Self::add`]).
    pub fn remove(&self, orphan: &OrphanedInstance) -> Result<(), CheckpointError> {
        self.change(|list| list.retain(|o| o != orphan))
    }

    /// Applies `edit` to the list as the file has it now and writes the result, if it differs.
    fn change(&self, edit: impl FnOnce(&mut Vec<OrphanedInstance>)) -> Result<(), CheckpointError> {
        let mut list = self.lock();
        let mut orphans = list.orphans.clone();
        edit(&mut orphans);
        if orphans == list.orphans {
            return Ok(());
        }
        let file = OrphanFile {
            boot_id: self.boot_id.clone(),
            orphans,
        };
        let mut bytes = serde_json::to_vec(&file)?;
        bytes.push(b'\n');
        write_atomically(&self.path, &bytes, 0o600, Durability::AcrossReboots).map_err(|source| {
            CheckpointError::Write {
                path: self.path.clone(),
                source,
            }
        })?;
        list.orphans = file.orphans;
        list.on_disk = Some(bytes);
        Ok(())
    }
}

fn read_bytes(path: &Path) -> Result<Option<Vec<u8>>, CheckpointError> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_error(path, e)),
    }
}

fn io_error(path: &Path, source: std::io::Error) -> CheckpointError {
    let path = path.to_path_buf();
    CheckpointError::Io { path, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn orphan(start: u32) -> OrphanedInstance {
        OrphanedInstance {
            gpu_uuid: "GPU-1".into(),
            gpu_minor: 0,
            profile_id: 9,
            start,
            gpu_instance: Some(2),
            claim: "ns/c".into(),
            device: format!("gpu-0-mig-3g40gb-{start}"),
            awaited_until: None,
        }
    }

    #[test]
    fn a_watched_placement_is_listed_once_with_the_later_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let list = LostGpuOrphans::open(dir.path(), "boot-a").unwrap();
        let watched = |until| OrphanedInstance {
            gpu_instance: None,
            awaited_until: Some(until),
            ..orphan(0)
        };
        list.add([watched(100), watched(50)]).unwrap();
        assert_eq!(list.all(), [watched(100)]);
        assert!(list.all()[0].awaited_at(99));
        assert!(!list.all()[0].awaited_at(100));
        // A lost GPU's instance at the same placement needs no deadline: it is destroyed
        // whenever found, and forgotten only then or when found gone.
        list.add([OrphanedInstance {
            gpu_instance: None,
            ..orphan(0)
        }])
        .unwrap();
        assert_eq!(list.all()[0].awaited_until, None);
        // An entry without a deadline is written without the field.
        let old = r#"{"bootId":"boot-a","orphans":[{"gpuUuid":"GPU-1","gpuMinor":0,"profileId":9,"start":4,"gpuInstance":2,"claim":"ns/c","device":"d"}]}"#;
        std::fs::write(dir.path().join(ORPHANS_FILE), old).unwrap();
        assert_eq!(list.all()[0].awaited_until, None);
    }

    #[test]
    fn survives_a_restart_of_the_same_boot_only() {
        let dir = tempfile::tempdir().unwrap();
        let list = LostGpuOrphans::open(dir.path(), "boot-a").unwrap();
        assert!(list.is_empty());
        list.add([orphan(0), orphan(4), orphan(0)]).unwrap();
        assert_eq!(list.all(), [orphan(0), orphan(4)]);
        let again = LostGpuOrphans::open(dir.path(), "boot-a").unwrap();
        assert_eq!(again.on_gpu("GPU-1"), [orphan(0), orphan(4)]);
        assert!(again.on_gpu("GPU-2").is_empty());
        again.remove(&orphan(0)).unwrap();
        assert_eq!(
            LostGpuOrphans::open(dir.path(), "boot-a").unwrap().all(),
            [orphan(4)]
        );
        assert!(LostGpuOrphans::open(dir.path(), "boot-b").unwrap().is_empty());
    }

    #[test]
    fn two_instances_sharing_the_file_see_and_keep_each_others_orphans() {
        let dir = tempfile::tempdir().unwrap();
        let old = LostGpuOrphans::open(dir.path(), "boot-a").unwrap();
        let new = LostGpuOrphans::open(dir.path(), "boot-a").unwrap();
        old.add([orphan(0)]).unwrap();
        // The other instance sees it, and its own addition keeps it.
        assert_eq!(new.on_gpu("GPU-1"), [orphan(0)]);
        new.add([orphan(4)]).unwrap();
        assert_eq!(old.all(), [orphan(0), orphan(4)]);
        // A removal by one is seen by the other and does not bring back what it removed.
        new.remove(&orphan(0)).unwrap();
        assert_eq!(old.all(), [orphan(4)]);
        old.remove(&orphan(4)).unwrap();
        assert!(new.is_empty());
        assert!(LostGpuOrphans::open(dir.path(), "boot-a").unwrap().is_empty());
    }

    #[test]
    fn an_unreadable_file_starts_empty() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(ORPHANS_FILE), b"{not json").unwrap();
        assert!(LostGpuOrphans::open(dir.path(), "boot-a").unwrap().is_empty());
    }
}
