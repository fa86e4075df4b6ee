//! The control device nodes every CUDA container opens, checked on the host before a claim
//! is prepared, so a node without them fails with the reason instead of handing out a
//! device on which `cuInit` fails.

use std::{fmt, path::Path};

use super::DriverFilesError;

const UVM_MISSING: &str = "the nvidia-uvm kernel module is not loaded (or its device nodes were not \
                           created: `nvidia-modprobe -u -c=0` creates them)";

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
