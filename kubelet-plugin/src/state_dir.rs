//! Files the plugin keeps on the node: atomic writes (shared by the checkpoint and the CDI
//! specs), the kernel boot ID, and the node lock file.
//!
//! The node lock ([`NodeLock`]) is a file lock in the state directory, so two plugin
//! instances on one node (a rolling update) never operate at the same time; threads of one
//! process share it or queue for it in memory and are woken at once when it is released.
//! Holding its guard is what lets the driver lock GPUs (see [`crate::gpus::GpuLocks`]).

use std::{
    fs::{self, File},
    io::Write,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    sync::{
        Arc, Condvar, Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

/// Name of the node lock file in the state directory.
pub const NODE_LOCK_FILE: &str = "plugin.lock";

/// How long a file written by [`write_atomically`] must stay whole. Readers on this boot see
/// it through the page cache, so a process crash loses nothing written; an fsync only
/// matters across an OS crash or power loss, and those reboot the node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// The file describes this boot only and is discarded after a reboot: no fsync.
    ThisBoot,
    /// The file is read after a reboot too (CDI specs): its data is synced before the
    /// rename, so whichever version a power loss leaves is whole. The directory is not
    /// synced: a lost rename leaves the previous whole version, as a power loss just before
    /// the rename would.
    AcrossReboots,
}

static FSYNCS: AtomicU64 = AtomicU64::new(0);

/// How many fsyncs [`write_atomically`] has made in this process (the prepare benchmark
/// counts them).
pub fn fsync_count() -> u64 {
    FSYNCS.load(Ordering::Relaxed)
}

/// Writes `bytes` to `path` so that readers see either the old or the new file, never a mix:
/// a temp file in the same directory, renamed over the target.
pub fn write_atomically(path: &Path, bytes: &[u8], mode: u32, durability: Durability) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let mut tmp = tempfile::Builder::new().prefix(".tmp-").tempfile_in(dir)?;
    tmp.as_file().set_permissions(fs::Permissions::from_mode(mode))?;
    tmp.write_all(bytes)?;
    if durability == Durability::AcrossReboots {
        tmp.as_file().sync_data()?;
        FSYNCS.fetch_add(1, Ordering::Relaxed);
    }
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

/// Replaces the content of `path` for readers of this boot without creating or deleting a
/// file: the bytes go into a scratch file next to it (`.<name>.next`, kept between writes)
/// and the names are swapped atomically (`renameat2` with `RENAME_EXCHANGE`), so a reader,
/// or a crash, sees the old content or the new one, whole. Not fsynced: for
/// [`Durability::ThisBoot`] files only. Unlike [`write_atomically`] it costs no inode
/// allocation, deletion or ext4 `auto_da_alloc` writeback (see docs/benchmarks.md).
///
/// Writers serialize on `.<name>.lock` and [`read_consistent`] readers take it shared: the
/// scratch inode is the previous version, which a reader may still hold open. A missing
/// `path`, or a file system without the exchange, falls back to [`write_atomically`].
pub fn replace_by_exchange(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};

    let lock = exchange_lock(path)?;
    lock.lock()?;
    if !path.exists() {
        return write_atomically(path, bytes, mode, Durability::ThisBoot);
    }
    let scratch = sibling(path, "next");
    let file = File::options()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(mode)
        .open(&scratch)?;
    if file.metadata()?.permissions().mode() & 0o7777 != mode {
        file.set_permissions(fs::Permissions::from_mode(mode))?;
    }
    file.write_all_at(bytes, 0)?;
    file.set_len(bytes.len() as u64)?;
    drop(file);
    match exchange(&scratch, path) {
        Ok(()) => Ok(()),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP | libc::EXDEV)
            ) =>
        {
            write_atomically(path, bytes, mode, Durability::ThisBoot)
        }
        Err(e) => Err(e),
    }
}

/// Reads `path` (`None` when it does not exist) holding the lock of [`replace_by_exchange`]
/// shared, so no writer reuses the inode while it is read. Where the lock file neither exists
/// nor can be made (a read-only state directory), nobody can write the file either, so it is
/// read without the lock.
pub fn read_consistent(path: &Path) -> std::io::Result<Option<Vec<u8>>> {
    let _lock = match exchange_lock(path) {
        Ok(lock) => {
            lock.lock_shared()?;
            Some(lock)
        }
        Err(e) if cannot_write(&e) => None,
        Err(e) => return Err(e),
    };
    match fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// `.<name>.<suffix>` next to `path`.
fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default();
    path.with_file_name(format!(".{name}.{suffix}"))
}

fn exchange_lock(path: &Path) -> std::io::Result<File> {
    open_lock_file(&sibling(path, "lock"))
}

/// Opens a lock file, creating it (0600) only when it is missing: a file lock needs no write
/// access, so an existing one opens read-only, also in a read-only state directory.
fn open_lock_file(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    match File::open(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => File::options()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(path),
        other => other,
    }
}

/// Whether `e` says the file system refuses writes here (read-only, or not ours to write).
fn cannot_write(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ReadOnlyFilesystem | std::io::ErrorKind::PermissionDenied
    )
}

#[allow(unsafe_code)]
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::{ffi::CString, os::unix::ffi::OsStrExt};
    let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other);
    let (a, b) = (c(a)?, c(b)?);
    // SAFETY: both are valid NUL-terminated paths that outlive the call.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// A file of the state directory could not be used.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {source}")]
pub struct StateFileError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

pub fn read_boot_id(path: &Path) -> Result<String, StateFileError> {
    fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(|source| StateFileError {
            path: path.to_path_buf(),
            source,
        })
}

#[derive(Debug, thiserror::Error)]
pub enum NodeLockError {
    #[error(transparent)]
    File(#[from] StateFileError),
    /// Another plugin instance held it for the whole timeout.
    #[error("{path}: another plugin instance holds the node lock")]
    Held { path: PathBuf },
}

/// The node-wide lock: held while prepare, unprepare or recovery run, so that two plugin
/// instances never work on the node at the same time. Within this process the kubelet's calls
/// share it ([`NodeGate::acquire_shared`]): they exclude each other only through the GPU locks,
/// so a call stuck in NVML on one GPU never holds up another GPU's claims. Maintenance (startup
/// recovery, repairs, stale-claim release) takes it alone ([`NodeGate::acquire`]). Dropping the
/// last holder releases the file lock, then wakes the waiters (also when a thread unwinds).
#[derive(Debug)]
pub struct NodeLock {
    _ticket: GateTicket,
}

/// How a holder shares the node lock with the other threads of this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Access {
    Shared,
    Exclusive,
}

/// The in-process side of a node lock file: who holds it in this process, and the file lock
/// held on their behalf while anyone does. Waiters sleep on a condition variable instead of
/// polling the file lock, which only another process (a second plugin instance during a
/// rolling update) still needs.
#[derive(Debug, Default)]
struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct GateState {
    shared: usize,
    exclusive: bool,
    /// Exclusive waiters; shared holders do not join while one waits, so maintenance is never
    /// starved by a steady stream of kubelet calls.
    exclusive_waiting: usize,
    /// A thread is taking the file lock for this process.
    taking_file: bool,
    /// The file lock, held while `shared > 0 || exclusive`.
    file: Option<File>,
}

impl GateState {
    fn admits(&self, access: Access) -> bool {
        if self.taking_file || self.exclusive {
            return false;
        }
        match access {
            Access::Shared => self.exclusive_waiting == 0,
            Access::Exclusive => self.shared == 0,
        }
    }
}

/// This process's hold on one node lock; dropping it releases the file lock with the last
/// holder and wakes the waiters.
#[derive(Debug)]
struct GateTicket {
    gate: Arc<Gate>,
    access: Access,
}

impl Drop for GateTicket {
    fn drop(&mut self) {
        let mut state = self.gate.state.lock().unwrap_or_else(PoisonError::into_inner);
        match self.access {
            Access::Shared => state.shared = state.shared.saturating_sub(1),
            Access::Exclusive => state.exclusive = false,
        }
        if state.shared == 0 && !state.exclusive {
            // The file lock goes before anyone is woken, so the next holder finds it free.
            state.file = None;
        }
        drop(state);
        self.gate.changed.notify_all();
    }
}

impl Gate {
    fn lock_state(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until this process admits `access`, then takes the file lock unless this process
    /// holds it already; gives up at `deadline`.
    fn enter(
        self: Arc<Self>,
        path: &Path,
        access: Access,
        deadline: Instant,
    ) -> Result<GateTicket, NodeLockError> {
        let mut state = self.lock_state();
        if access == Access::Exclusive {
            state.exclusive_waiting += 1;
        }
        let wait = deadline.saturating_duration_since(Instant::now());
        let (waited, _) = self
            .changed
            .wait_timeout_while(state, wait, |state| !state.admits(access))
            .unwrap_or_else(PoisonError::into_inner);
        state = waited;
        if access == Access::Exclusive {
            state.exclusive_waiting -= 1;
        }
        if !state.admits(access) {
            drop(state);
            // A shared waiter held back by this exclusive waiter may go now.
            self.changed.notify_all();
            return Err(NodeLockError::Held {
                path: path.to_path_buf(),
            });
        }
        if state.file.is_none() {
            state.taking_file = true;
            drop(state);
            let taken = take_file_lock(path, deadline);
            state = self.lock_state();
            state.taking_file = false;
            match taken {
                Ok(file) => state.file = Some(file),
                Err(e) => {
                    drop(state);
                    self.changed.notify_all();
                    return Err(e);
                }
            }
        }
        match access {
            Access::Shared => state.shared += 1,
            Access::Exclusive => state.exclusive = true,
        }
        drop(state);
        Ok(GateTicket { gate: self, access })
    }
}

/// Takes the lock file's file lock, polling until `deadline` (std's file locks have no timed
/// wait).
fn take_file_lock(path: &Path, deadline: Instant) -> Result<File, NodeLockError> {
    let io = |source| StateFileError {
        path: path.to_path_buf(),
        source,
    };
    let file = match open_lock_file(path) {
        Ok(file) => file,
        // Every instance on a read-only state directory finds the lock file missing and locks
        // the directory instead, so they still exclude each other.
        Err(e) if cannot_write(&e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot create the node lock file; locking the state directory instead");
            File::open(path.parent().unwrap_or_else(|| Path::new("."))).map_err(io)?
        }
        Err(e) => return Err(io(e).into()),
    };
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(file),
            Err(std::fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(OTHER_PROCESS_POLL);
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(NodeLockError::Held {
                    path: path.to_path_buf(),
                });
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io(e).into()),
        }
    }
}

/// One plugin instance's way to the node lock of a state directory: its threads share the
/// gate, and another instance (another process, or another gate in tests) is kept out by the
/// file lock. Cheap to clone; clones share the gate.
#[derive(Clone, Debug)]
pub struct NodeGate {
    path: PathBuf,
    gate: Arc<Gate>,
}

impl NodeGate {
    /// The gate of `<state_dir>/plugin.lock`.
    pub fn new(state_dir: &Path) -> Self {
        Self {
            path: state_dir.join(NODE_LOCK_FILE),
            gate: Arc::default(),
        }
    }

    /// Takes the node lock alone, waiting up to `timeout`.
    pub fn acquire(&self, timeout: Duration) -> Result<NodeLock, NodeLockError> {
        self.enter(Access::Exclusive, timeout)
    }

    /// Takes the node lock together with the other shared holders of this instance, waiting up
    /// to `timeout`.
    pub fn acquire_shared(&self, timeout: Duration) -> Result<NodeLock, NodeLockError> {
        self.enter(Access::Shared, timeout)
    }

    fn enter(&self, access: Access, timeout: Duration) -> Result<NodeLock, NodeLockError> {
        let deadline = Instant::now() + timeout;
        let ticket = self.gate.clone().enter(&self.path, access, deadline)?;
        Ok(NodeLock { _ticket: ticket })
    }
}

/// How often a node lock another process holds is tried again.
const OTHER_PROCESS_POLL: Duration = Duration::from_millis(50);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_the_file_with_the_given_mode() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.json");
        write_atomically(&path, b"one", 0o600, Durability::ThisBoot).unwrap();
        let synced = fsync_count();
        write_atomically(&path, b"two", 0o644, Durability::AcrossReboots).unwrap();
        assert!(fsync_count() > synced);
        assert_eq!(fs::read(&path).unwrap(), b"two");
        assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o644);
        let leftovers = fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(leftovers, 1, "no temp file left behind");
    }

    #[test]
    fn replacing_by_exchange_keeps_one_file_and_reuses_the_scratch_inode() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        // Created the ordinary way when missing.
        replace_by_exchange(&path, b"first version", 0o600).unwrap();
        assert_eq!(
            read_consistent(&path).unwrap().as_deref(),
            Some(&b"first version"[..])
        );
        let first = fs::metadata(&path).unwrap().ino();
        replace_by_exchange(&path, b"second, longer version", 0o600).unwrap();
        let second = fs::metadata(&path).unwrap().ino();
        replace_by_exchange(&path, b"third", 0o600).unwrap();
        let third = fs::metadata(&path).unwrap().ino();
        assert_eq!(
            fs::read(&path).unwrap(),
            b"third",
            "shorter content is not padded"
        );
        assert_ne!(first, second);
        assert_eq!(first, third, "two inodes take turns: nothing created or deleted");
        assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let mut names: Vec<String> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                ".checkpoint.json.lock",
                ".checkpoint.json.next",
                "checkpoint.json"
            ]
        );
        assert_eq!(read_consistent(&dir.path().join("missing")).unwrap(), None);
    }

    #[test]
    fn readers_never_see_a_version_being_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        // Each version is one repeated byte, of a length that differs between versions, so a
        // mix of two versions is recognisable.
        // Large versions, so that reads take long enough for writes to land in the middle.
        const WRITES: usize = 600;
        let version = |i: usize| vec![b'a' + (i % 26) as u8; 256 * 1024 + (i * 4099) % 65536];
        replace_by_exchange(&path, &version(0), 0o600).unwrap();
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                for i in 1..WRITES {
                    replace_by_exchange(&path, &version(i), 0o600).unwrap();
                }
                done.store(true, Ordering::Relaxed);
            });
            let read = || {
                let mut reads = 0;
                while !done.load(Ordering::Relaxed) || reads == 0 {
                    let bytes = read_consistent(&path).unwrap().unwrap();
                    let first = bytes[0];
                    assert!(
                        bytes.iter().all(|b| *b == first),
                        "a torn read of {} bytes",
                        bytes.len()
                    );
                    let i = (first - b'a') as usize;
                    assert!((0..WRITES).any(|v| v % 26 == i && version(v).len() == bytes.len()));
                    reads += 1;
                }
            };
            s.spawn(read);
            s.spawn(read);
        });
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
        let gate = NodeGate::new(dir.path());
        let held = gate.acquire(Duration::ZERO).unwrap();
        let err = gate.acquire(Duration::from_millis(100)).unwrap_err();
        assert!(matches!(err, NodeLockError::Held { .. }), "{err}");
        drop(held);
        gate.acquire(Duration::ZERO).unwrap();
    }

    #[test]
    fn a_waiter_of_this_process_gets_the_lock_when_the_holder_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let gate = NodeGate::new(dir.path());
        let order = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            let held = gate.acquire(Duration::ZERO).unwrap();
            let waiter = s.spawn(|| {
                let lock = gate.acquire(Duration::from_secs(30)).unwrap();
                order.lock().unwrap().push("waiter");
                drop(lock);
            });
            // Let the waiter queue up; whatever the timing, it gets the lock only after this.
            std::thread::sleep(Duration::from_millis(20));
            order.lock().unwrap().push("holder");
            drop(held);
            waiter.join().unwrap();
        });
        assert_eq!(*order.lock().unwrap(), ["holder", "waiter"]);
        gate.acquire(Duration::ZERO).unwrap();
    }

    #[test]
    fn shared_holders_overlap_and_an_exclusive_one_waits_for_them() {
        let dir = tempfile::tempdir().unwrap();
        let gate = NodeGate::new(dir.path());
        let first = gate.acquire_shared(Duration::ZERO).unwrap();
        // A second kubelet call does not wait for the first.
        let second = gate.acquire_shared(Duration::ZERO).unwrap();
        let err = gate.acquire(Duration::from_millis(50)).unwrap_err();
        assert!(matches!(err, NodeLockError::Held { .. }), "{err}");
        drop(first);
        let err = gate.acquire(Duration::from_millis(50)).unwrap_err();
        assert!(
            matches!(err, NodeLockError::Held { .. }),
            "one shared holder is left: {err}"
        );
        drop(second);
        let exclusive = gate.acquire(Duration::ZERO).unwrap();
        let err = gate.acquire_shared(Duration::from_millis(50)).unwrap_err();
        assert!(matches!(err, NodeLockError::Held { .. }), "{err}");
        drop(exclusive);
        gate.acquire_shared(Duration::ZERO).unwrap();
    }

    #[test]
    fn a_waiting_exclusive_holder_goes_before_later_shared_ones() {
        let dir = tempfile::tempdir().unwrap();
        let gate = NodeGate::new(dir.path());
        let order = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            let shared = gate.acquire_shared(Duration::ZERO).unwrap();
            let exclusive = s.spawn(|| {
                let lock = gate.acquire(Duration::from_secs(30)).unwrap();
                order.lock().unwrap().push("exclusive");
                drop(lock);
            });
            // Until the exclusive waiter has queued, a shared one still joins; after, it waits.
            let queued = Instant::now() + Duration::from_secs(30);
            while gate.acquire_shared(Duration::ZERO).is_ok() {
                assert!(Instant::now() < queued, "the exclusive waiter never queued");
                std::thread::sleep(Duration::from_millis(5));
            }
            let later = s.spawn(|| {
                let lock = gate.acquire_shared(Duration::from_secs(30)).unwrap();
                order.lock().unwrap().push("shared");
                drop(lock);
            });
            std::thread::sleep(Duration::from_millis(20));
            drop(shared);
            exclusive.join().unwrap();
            later.join().unwrap();
        });
        assert_eq!(*order.lock().unwrap(), ["exclusive", "shared"]);
    }

    #[test]
    fn shared_holders_keep_another_process_out_until_the_last_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let gate = NodeGate::new(dir.path());
        let path = dir.path().join(NODE_LOCK_FILE);
        let first = gate.acquire_shared(Duration::ZERO).unwrap();
        let second = gate.acquire_shared(Duration::ZERO).unwrap();
        // Another open file description stands for another process.
        let other = File::options().write(true).open(&path).unwrap();
        drop(first);
        assert!(other.try_lock().is_err(), "released with a shared holder left");
        drop(second);
        other.try_lock().unwrap();
    }

    #[test]
    fn two_instances_exclude_each_other_even_when_sharing() {
        // Two gates on one directory stand for two plugin instances (a rolling update).
        let dir = tempfile::tempdir().unwrap();
        let (old, new) = (NodeGate::new(dir.path()), NodeGate::new(dir.path()));
        let held = old.acquire_shared(Duration::ZERO).unwrap();
        let err = new.acquire_shared(Duration::from_millis(120)).unwrap_err();
        assert!(matches!(err, NodeLockError::Held { .. }), "{err}");
        drop(held);
        let taken = new.acquire_shared(Duration::ZERO).unwrap();
        let err = old.acquire(Duration::from_millis(120)).unwrap_err();
        assert!(matches!(err, NodeLockError::Held { .. }), "{err}");
        drop(taken);
        old.acquire(Duration::ZERO).unwrap();
    }

    #[test]
    fn a_holder_that_panics_releases_the_lock() {
        let dir = tempfile::tempdir().unwrap();
        let gate = NodeGate::new(dir.path());
        let crashed = std::thread::scope(|s| {
            s.spawn(|| {
                let _lock = gate.acquire(Duration::ZERO).unwrap();
                panic!("a step failed while holding the node lock");
            })
            .join()
        });
        assert!(crashed.is_err());
        gate.acquire(Duration::ZERO).unwrap();
    }

    #[test]
    fn a_lock_another_process_holds_times_out_after_the_gate() {
        // Another open file description stands for another process: its flock conflicts,
        // and it never passed this process's gate.
        let dir = tempfile::tempdir().unwrap();
        let gate = NodeGate::new(dir.path());
        let other = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.path().join(NODE_LOCK_FILE))
            .unwrap();
        other.lock().unwrap();
        let err = gate.acquire(Duration::from_millis(120)).unwrap_err();
        assert!(matches!(err, NodeLockError::Held { .. }), "{err}");
        other.unlock().unwrap();
        gate.acquire(Duration::ZERO).unwrap();
    }
}
