//! Instances left on a lost GPU: what teardown could not destroy because the GPU was gone.
//!
//! When a GPU is lost (`NVML_ERROR_GPU_IS_LOST`: fallen off the bus, or mid driver reset)
//! its claims must still unprepare, or their pods never terminate. Teardown then treats the
//! GPU's instances as gone, but writes each one it could not destroy here first
//! ([`LostGpuOrphans::add`], before the claim is forgotten), because a GPU can come back
//! with its instances still configured. When the inventory sees the GPU healthy again it
//! destroys exactly these instances (same GPU UUID, profile, placement and, where known,
//! GPU-instance ID) and nothing else; instances no record and no orphan describes stay
//! foreign and untouched.
//!
//! The list is `<state dir>/lost-gpu-orphans.json`, written atomically like the checkpoint,
//! and belongs to one boot (instances never survive a reboot). It is the node's, not one
//! plugin instance's: during a rolling update the instance that left an orphan may not be
//! the one running when the GPU returns. So every access reads the file again, and it is
//! changed only under the node lock (teardown and the inventory's orphan pass both hold it),
//! so that two instances never overwrite each other's entries.

use std::{
    path::{Path, PathBuf},
    sync::{Mutex, MutexGuard},
};

use serde::{Deserialize, Serialize};

use crate::{checkpoint::CheckpointError, state_dir::write_atomically};

/// Name of the file in the state directory.
pub const ORPHANS_FILE: &str = "lost-gpu-orphans.json";

/// A MIG instance that a claim's teardown left on a lost GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OrphanedInstance {
    /// The GPU's UUID (its minor may change when it comes back).
    pub gpu_uuid: String,
    /// The GPU's minor when the instance was left.
    pub gpu_minor: u32,
    /// GPU-instance profile ID.
    pub profile_id: u32,
    /// Placement start.
    pub start: u32,
    /// GPU-instance ID, when it was recorded.
    pub gpu_instance: Option<u32>,
    /// The claim it belonged to, `namespace/name`.
    pub claim: String,
    /// The device name it was allocated as.
    pub device: String,
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
    state_dir: PathBuf,
    path: PathBuf,
    boot_id: String,
    orphans: Mutex<Vec<OrphanedInstance>>,
}

impl LostGpuOrphans {
    /// Loads the list of boot `boot_id` from `state_dir` (which exists). A list of another
    /// boot is empty; an unreadable one is logged and treated as empty (its instances then
    /// show as foreign, which is safe: they are never destroyed).
    pub fn open(state_dir: &Path, boot_id: &str) -> Result<Self, CheckpointError> {
        let path = state_dir.join(ORPHANS_FILE);
        let orphans = match read_file(&path, boot_id) {
            Ok(orphans) => orphans,
            Err(ReadError::Io(source)) => return Err(CheckpointError::Io { path, source }),
            Err(ReadError::Parse(e)) => {
                tracing::error!(path = %path.display(), error = %e, "the list of instances left on lost GPUs is unreadable; starting empty");
                Vec::new()
            }
        };
        Ok(Self {
            state_dir: state_dir.to_path_buf(),
            path,
            boot_id: boot_id.to_string(),
            orphans: Mutex::new(orphans),
        })
    }

    /// The state directory (holds the node lock).
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// The list, as the file has it now (another plugin instance may have changed it); if the
    /// file cannot be read, as last read.
    fn lock(&self) -> MutexGuard<'_, Vec<OrphanedInstance>> {
        let mut orphans = self
            .orphans
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match read_file(&self.path, &self.boot_id) {
            Ok(now) => *orphans = now,
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot re-read the list of instances left on lost GPUs; using the last one read")
            }
        }
        orphans
    }

    /// Every orphaned instance.
    pub fn all(&self) -> Vec<OrphanedInstance> {
        self.lock().clone()
    }

    /// Whether any instance is orphaned.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// The instances orphaned on the GPU with this UUID.
    pub fn on_gpu(&self, gpu_uuid: &str) -> Vec<OrphanedInstance> {
        self.lock()
            .iter()
            .filter(|o| o.gpu_uuid == gpu_uuid)
            .cloned()
            .collect()
    }

    /// Adds instances (each once) and writes the file; on failure nothing is added.
    pub fn add(&self, new: impl IntoIterator<Item = OrphanedInstance>) -> Result<(), CheckpointError> {
        let mut orphans = self.lock();
        let mut next = orphans.clone();
        for orphan in new {
            if !next.contains(&orphan) {
                next.push(orphan);
            }
        }
        if next.len() == orphans.len() {
            return Ok(());
        }
        self.persist(&next)?;
        *orphans = next;
        Ok(())
    }

    /// Removes an instance (destroyed, or found gone) and writes the file.
    pub fn remove(&self, orphan: &OrphanedInstance) -> Result<(), CheckpointError> {
        let mut orphans = self.lock();
        let next: Vec<_> = orphans.iter().filter(|o| *o != orphan).cloned().collect();
        if next.len() == orphans.len() {
            return Ok(());
        }
        self.persist(&next)?;
        *orphans = next;
        Ok(())
    }

    fn persist(&self, orphans: &[OrphanedInstance]) -> Result<(), CheckpointError> {
        let file = OrphanFile {
            boot_id: self.boot_id.clone(),
            orphans: orphans.to_vec(),
        };
        let mut bytes = serde_json::to_vec(&file)?;
        bytes.push(b'\n');
        write_atomically(&self.path, &bytes, 0o600).map_err(|source| CheckpointError::Io {
            path: self.path.clone(),
            source,
        })
    }
}

#[derive(Debug, thiserror::Error)]
enum ReadError {
    #[error(transparent)]
    Io(std::io::Error),
    #[error(transparent)]
    Parse(serde_json::Error),
}

/// The list in `path` for boot `boot_id`: empty when the file is missing or of another boot.
fn read_file(path: &Path, boot_id: &str) -> Result<Vec<OrphanedInstance>, ReadError> {
    match std::fs::read(path) {
        Ok(bytes) => match serde_json::from_slice::<OrphanFile>(&bytes) {
            Ok(file) if file.boot_id == boot_id => Ok(file.orphans),
            Ok(_) => Ok(Vec::new()),
            Err(e) => Err(ReadError::Parse(e)),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(ReadError::Io(e)),
    }
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
        }
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
    fn two_lists_of_one_node_see_each_others_changes() {
        let dir = tempfile::tempdir().unwrap();
        let one = LostGpuOrphans::open(dir.path(), "boot-a").unwrap();
        let other = LostGpuOrphans::open(dir.path(), "boot-a").unwrap();
        one.add([orphan(0)]).unwrap();
        other.add([orphan(4)]).unwrap();
        assert_eq!(
            one.all(),
            [orphan(0), orphan(4)],
            "the other's addition kept mine"
        );
        one.remove(&orphan(4)).unwrap();
        assert_eq!(other.on_gpu("GPU-1"), [orphan(0)]);
        assert!(!other.is_empty());
    }

    #[test]
    fn an_unreadable_file_starts_empty() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(ORPHANS_FILE), b"{not json").unwrap();
        assert!(LostGpuOrphans::open(dir.path(), "boot-a").unwrap().is_empty());
    }
}
