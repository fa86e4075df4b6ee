//! The NVIDIA driver's user-space files a CUDA container needs, and the CDI container edits
//! that hand them over.
//!
//! A container started through CDI (how DRA delivers devices) gets only what the CDI spec
//! names, and device nodes alone do not run CUDA: it also needs the driver's libraries of
//! exactly the kernel module's version, its utilities, the GSP firmware and the daemons'
//! sockets, bind-mounted read-only from the driver root, plus the soname links and linker
//! cache that make the libraries loadable (made in the container by `nvidia-cdi-hook`).
//!
//! [`discover`] reads the driver root (linker cache [`ldcache`], listings, symbolic links,
//! all resolved inside the root, never against this process's `/`) into a [`DriverFiles`];
//! [`container_edits`] turns that, without I/O, into the mounts, hooks and environment of the
//! `containerEdits` every claim device's spec gets. [`DriverFilesCache`] repeats discovery
//! when its inputs (above all the NVML driver version) change.
//! [`check_required_device_nodes`] checks the control device nodes CUDA opens.
//!
//! What is looked for follows what NVIDIA's container toolkit injects (facts, not code):
//! every `*.so.<driver version>` library (and the legacy `libnvidia-nvvm70.so.*`), the
//! utilities in PATH-like directories, `nvidia/<version>/gsp*.bin` in the kernel's firmware
//! directories, and the persistenced and fabric manager sockets. Not the MPS daemon's pipe
//! directory: migdra offers no MPS, and that directory would connect every container on the
//! node to one MPS daemon.

mod device_nodes;
mod discover;
mod edits;
mod hook;
pub mod ldcache;

use std::{
    io,
    path::{Path, PathBuf},
    sync::Arc,
};

pub use device_nodes::{MissingDeviceNode, UVM_NODES, check_required_device_nodes, create_missing_uvm_nodes};
pub use discover::{
    BINARY_DIRS, DEFAULT_HOOK_PATH, IPC_PATHS, NVML_LIBRARY, discover, fallback_library_dirs, find_hook,
    find_nvml_library, firmware_dirs,
};
pub use edits::{
    ContainerEdits, FILE_MOUNT_OPTIONS, HOOK_BINARY_NAME, Hook, IPC_MOUNT_OPTIONS, Mount, container_edits,
};
pub use hook::{HookInstall, IMAGE_HOOK_PATH, ensure_hook, hook_visible_at, install_hook};
pub use ldcache::{LdCacheError, LibraryArch};

/// A host directory as the host sees it and as this process sees it (a DaemonSet mounts host
/// paths elsewhere, e.g. the host's `/` at `/host`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostDir {
    /// The path on the host: what CDI mounts name (the runtime runs on the host).
    pub on_host: PathBuf,
    /// Where this process reads it.
    pub visible_at: PathBuf,
}

/// What discovery needs to know.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiscoveryInputs {
    /// The driver root: `/` for a driver installed on the host, `/run/nvidia/driver` for
    /// NVIDIA's driver container.
    pub driver_root: HostDir,
    /// The driver version NVML reports (`nvmlSystemGetDriverVersion`), e.g. `575.57.08`.
    pub driver_version: String,
    /// The running kernel's release (`uname -r`), for firmware directories; see
    /// [`read_kernel_release`].
    pub kernel_release: String,
    /// Where this process sees the host's `/`: the hook runs on the host, so it is looked
    /// up there, not in the driver root.
    pub host_root: PathBuf,
    /// Host path of `nvidia-cdi-hook` ([`DEFAULT_HOOK_PATH`]).
    pub hook_path: PathBuf,
    /// Architecture of the linker-cache entries to take.
    pub arch: LibraryArch,
}

/// One discovered file: where it is on the host and where it goes in the container.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct DriverFile {
    /// Path on the host, symbolic links inside the driver root resolved (the runtime would
    /// resolve an absolute link against the host's `/`, not the driver root).
    pub host_path: PathBuf,
    /// Path in the container: the path in the driver root.
    pub container_path: PathBuf,
}

/// A symbolic link to make in the container next to a mounted library.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct SonameLink {
    /// The link's absolute path in the container, e.g. `/usr/lib/x86_64-linux-gnu/libcuda.so.1`.
    pub link: PathBuf,
    /// What it points to, relative to the link's directory, e.g. `libcuda.so.575.57.08`.
    pub target: String,
}

/// The driver's container files, as found under a driver root.
///
/// Every list is sorted by container path (links by link path) and has no duplicates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverFiles {
    pub version: String,
    /// Versioned libraries (always including `libcuda.so.<version>` and
    /// `libnvidia-ml.so.<version>` when discovered).
    pub libraries: Vec<DriverFile>,
    /// Utilities (`nvidia-smi`, …) that exist.
    pub binaries: Vec<DriverFile>,
    /// GSP firmware.
    pub firmware: Vec<DriverFile>,
    /// Daemon sockets that exist (persistenced, fabric manager).
    pub ipc: Vec<DriverFile>,
    /// Soname (and `libcuda.so`) links to make in the container.
    pub soname_links: Vec<SonameLink>,
    /// Container directories holding the libraries (for the container's linker cache).
    pub library_dirs: Vec<PathBuf>,
    /// Host path of `nvidia-cdi-hook`, when it exists; without it the spec carries no hooks.
    pub hook: Option<PathBuf>,
}

/// Why the driver's files could not be discovered (or a node cannot run CUDA containers).
#[derive(Debug, thiserror::Error)]
pub enum DriverFilesError {
    #[error("driver version {0:?} is not a version (empty, or contains '/' or whitespace)")]
    InvalidVersion(String),
    #[error(
        "no {library}.so.{version} found under {root} (searched: {}); is the driver root \
         right and does its version match the loaded kernel module?",
        display_paths(.searched)
    )]
    /// `library` (`libcuda` or `libnvidia-ml`) is not under the driver root (host paths).
    MissingLibrary {
        library: &'static str,
        version: String,
        root: PathBuf,
        searched: Vec<PathBuf>,
    },
    /// The driver root's linker cache (`path` on the host) is not a valid glibc cache.
    #[error("corrupt linker cache {path}: {source}")]
    CorruptLdCache {
        path: PathBuf,
        #[source]
        source: LdCacheError,
    },
    /// A path (as this process sees it) exists but could not be read.
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Device nodes CUDA opens are missing on the host.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    MissingDeviceNodes(Vec<MissingDeviceNode>),
    /// `nvidia-cdi-hook` could not be installed on the host (`path` as this process sees it).
    #[error("installing nvidia-cdi-hook: {path}: {source}")]
    InstallHook {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A missing device node (path as this process sees it) could not be created.
    #[error("creating device node {path}: {source}")]
    CreateDeviceNode {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

fn display_paths(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The running kernel's release, from `<proc_root>/sys/kernel/osrelease`.
pub fn read_kernel_release(proc_root: &Path) -> Result<String, DriverFilesError> {
    let path = proc_root.join("sys/kernel/osrelease");
    let text = std::fs::read_to_string(&path).map_err(|source| DriverFilesError::Read {
        path: path.clone(),
        source,
    })?;
    Ok(text.trim().to_string())
}

/// The last discovery, repeated when its inputs change: the whole [`DiscoveryInputs`] is the
/// key, so a new driver version (whose old files are gone), root or hook path rediscovers.
/// Failed discoveries are not kept: the next call tries again.
#[derive(Debug, Default)]
pub struct DriverFilesCache {
    last: Option<(DiscoveryInputs, Arc<DriverFiles>)>,
}

impl DriverFilesCache {
    /// The files for `inputs`, discovered now unless the last discovery had the same inputs.
    pub fn get(&mut self, inputs: &DiscoveryInputs) -> Result<Arc<DriverFiles>, DriverFilesError> {
        self.get_with(inputs, discover)
    }

    /// [`Self::get`] with the discovery function given (for tests).
    pub fn get_with(
        &mut self,
        inputs: &DiscoveryInputs,
        discover: impl FnOnce(&DiscoveryInputs) -> Result<DriverFiles, DriverFilesError>,
    ) -> Result<Arc<DriverFiles>, DriverFilesError> {
        if let Some((last_inputs, files)) = &self.last
            && last_inputs == inputs
        {
            return Ok(Arc::clone(files));
        }
        if let Some((last_inputs, _)) = &self.last {
            tracing::info!(
                old_version = %last_inputs.driver_version,
                new_version = %inputs.driver_version,
                driver_root = %inputs.driver_root.on_host.display(),
                "driver discovery inputs changed; discovering the driver's files again"
            );
        }
        self.last = None;
        let files = Arc::new(discover(inputs)?);
        self.last = Some((inputs.clone(), Arc::clone(&files)));
        Ok(files)
    }
}

#[cfg(test)]
mod tests;
