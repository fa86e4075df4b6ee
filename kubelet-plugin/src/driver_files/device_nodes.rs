//! The control device nodes every CUDA container opens, checked on the host before a claim
//! is prepared, so a node without them fails with the reason instead of handing out a
//! device on which `cuInit` fails.
//!
//! The `nvidia-uvm` module does not create its device nodes; `nvidia-modprobe -u` does, when
//! something on the host runs it (a CUDA program does, through a setuid helper a container
//! lacks). [`create_missing_uvm_nodes`] makes them the way it does: the major the module
//! registered in `/proc/devices`, minors 0 and 1, mode 0666, owned by root.

use std::{
    fmt,
    path::{Path, PathBuf},
};

use super::DriverFilesError;

const UVM_MISSING: &str = "the nvidia-uvm kernel module is not loaded (no nvidia-uvm in /proc/devices; \
                           `nvidia-modprobe -u -c=0` on the host loads it)";

/// `/dev/nvidia-uvm` and `/dev/nvidia-uvm-tools`: file name under the device root and minor.
pub const UVM_NODES: &[(&str, u32)] = &[("nvidia-uvm", 0), ("nvidia-uvm-tools", 1)];

/// Mode `nvidia-modprobe` gives the nodes it makes (the driver's default `DeviceFileMode`).
const UVM_NODE_MODE: u32 = 0o666;

/// `/dev/nvidiactl` (driver control), `/dev/nvidia-uvm` and `/dev/nvidia-uvm-tools` (unified
/// memory: `cuInit` fails without them): file name under the device root, and why it is
/// usually missing.
const REQUIRED_DEVICE_NODES: &[(&str, &str)] = &[
    ("nvidiactl", "the nvidia kernel module is not loaded"),
    ("nvidia-uvm", UVM_MISSING),
    ("nvidia-uvm-tools", UVM_MISSING),
];

/// A missing required node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MissingDeviceNode {
    /// The node as a container names it, e.g. `/dev/nvidia-uvm`.
    pub node: String,
    pub looked_at: std::path::PathBuf,
    /// Why it is usually missing.
    pub cause: &'static str,
}

impl fmt::Display for MissingDeviceNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} missing: {}", self.node, self.cause)?;
        if self.looked_at != Path::new(&self.node) {
            write!(f, " (looked for {})", self.looked_at.display())?;
        }
        Ok(())
    }
}

/// Checks [`REQUIRED_DEVICE_NODES`] under `dev_root` (the host's `/dev` as this process
/// sees it) with `exists`, e.g. `|p| p.exists()`; every missing node is reported.
pub fn check_required_device_nodes(
    dev_root: &Path,
    exists: impl Fn(&Path) -> bool,
) -> Result<(), DriverFilesError> {
    let missing: Vec<MissingDeviceNode> = REQUIRED_DEVICE_NODES
        .iter()
        .filter_map(|&(name, cause)| {
            let path = dev_root.join(name);
            (!exists(&path)).then(|| MissingDeviceNode {
                node: format!("/dev/{name}"),
                looked_at: path,
                cause,
            })
        })
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(DriverFilesError::MissingDeviceNodes(missing))
    }
}

/// Creates the [`UVM_NODES`] missing under `dev_root` (the host's `/dev` as this process sees
/// it) as character devices of major `uvm_major`; returns the paths it made. Nothing without
/// a major: the module is not loaded, and [`check_required_device_nodes`] says so.
pub fn create_missing_uvm_nodes(
    dev_root: &Path,
    uvm_major: Option<u32>,
) -> Result<Vec<PathBuf>, DriverFilesError> {
    let Some(major) = uvm_major else {
        return Ok(Vec::new());
    };
    let mut created = Vec::new();
    for &(name, minor) in UVM_NODES {
        let path = dev_root.join(name);
        if path.symlink_metadata().is_ok() {
            continue;
        }
        match mknod_char(&path, major, minor) {
            Ok(()) => {}
            // Made by someone else meanwhile (nvidia-modprobe, another plugin instance).
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(source) => return Err(DriverFilesError::CreateDeviceNode { path, source }),
        }
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(UVM_NODE_MODE))
            .map_err(|source| DriverFilesError::CreateDeviceNode {
                path: path.clone(),
                source,
            })?;
        tracing::info!(path = %path.display(), major, minor, "created a missing nvidia-uvm device node");
        created.push(path);
    }
    Ok(created)
}

#[allow(unsafe_code)]
fn mknod_char(path: &Path, major: u32, minor: u32) -> std::io::Result<()> {
    use std::{ffi::CString, os::unix::ffi::OsStrExt};
    let c_path = CString::new(path.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // The umask applies to mknod's mode; the caller sets the final mode afterwards.
    // SAFETY: a valid NUL-terminated path that outlives the call; mknod reads nothing else.
    let rc = unsafe {
        libc::mknod(
            c_path.as_ptr(),
            libc::S_IFCHR | UVM_NODE_MODE,
            libc::makedev(major, minor),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
