//! Files the plugin keeps on the node: atomic writes (shared by the checkpoint and the CDI
//! specs), the kernel boot ID, and the node lock file.
//!
//! The node lock ([`NodeLock`]) is a file lock in the state directory, so two plugin
//! instances on one node (a rolling update) never operate at the same time. Holding its guard
//! is what lets the driver lock GPUs (see [`crate::gpus::GpuLocks`]).

use std::{
    fs::{self, File},
    io::Write,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

/// Name of the node lock file in the state directory.
pub const NODE_LOCK_FILE: &str = "plugin.lock";

/// Writes `bytes` to `path` so that readers see either the old or the new file, never a mix:
/// a temp file in the same directory, fsync, rename over the target, fsync the directory.
pub fn write_atomically(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let mut tmp = tempfile::Builder::new().prefix(".tmp-").tempfile_in(dir)?;
    tmp.as_file().set_permissions(fs::Permissions::from_mode(mode))?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    File::open(dir).and_then(|d| d.sync_all())?;
    Ok(())
}

/// A file of the state directory could not be used.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {source}")]
pub struct StateFileError {
    /// The file.
    pub path: PathBuf,
    /// Cause.
    #[source]
    pub source: std::io::Error,
}

/// Reads the kernel's boot ID.
pub fn read_boot_id(path: &Path) -> Result<String, StateFileError> {
    fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(|source| StateFileError {
            path: path.to_path_buf(),
            source,
        })
}

/// The node lock could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum NodeLockError {
    /// Opening or locking the file failed.
    #[error(transparent)]
    File(#[from] StateFileError),
    /// Another plugin instance held it for the whole timeout.
    #[error("{path}: another plugin instance holds the node lock")]
    Held {
        /// The lock file.
        path: PathBuf,
    },
}

/// The node-wide lock: held while prepare, unprepare or recovery run. Dropping it releases
/// the file lock (also when a thread unwinds).
#[derive(Debug)]
pub struct NodeLock {
    _file: File,
}

impl NodeLock {
    /// Takes `<state_dir>/plugin.lock`, waiting up to `timeout`. Polls, because std's file
    /// locks have no timed wait.
    pub fn acquire(state_dir: &Path, timeout: Duration) -> Result<Self, NodeLockError> {
        let path = state_dir.join(NODE_LOCK_FILE);
        let io = |source| StateFileError {
            path: path.clone(),
            source,
        };
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(io)?;
        let deadline = Instant::now() + timeout;
        loop {
            match file.try_lock() {
                Ok(()) => return Ok(Self { _file: file }),
                Err(std::fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(std::fs::TryLockError::WouldBlock) => return Err(NodeLockError::Held { path }),
                Err(std::fs::TryLockError::Error(e)) => return Err(io(e).into()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_the_file_with_the_given_mode() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.json");
        write_atomically(&path, b"one", 0o600).unwrap();
        write_atomically(&path, b"two", 0o644).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o644);
        let leftovers = fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(leftovers, 1, "no temp file left behind");
    }

    #[test]
    fn boot_id_is_trimmed_and_a_missing_file_names_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("boot_id");
        fs::write(&path, "abc-123\n").unwrap();
        assert_eq!(read_boot_id(&path).unwrap(), "abc-123");
        let err = read_boot_id(&dir.path().join("missing")).unwrap_err();
        assert!(err.path.ends_with("missing"));
    }

    #[test]
    fn a_held_node_lock_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let held = NodeLock::acquire(dir.path(), Duration::ZERO).unwrap();
        let err = NodeLock::acquire(dir.path(), Duration::from_millis(100)).unwrap_err();
        assert!(matches!(err, NodeLockError::Held { .. }), "{err}");
        drop(held);
        NodeLock::acquire(dir.path(), Duration::ZERO).unwrap();
    }
}
