//! Planning: the CDI `containerEdits` that hand a [`DriverFiles`] to a container. Pure.
//!
//! - every library, utility and firmware file is bind-mounted read-only at its path in the
//!   driver root ([`FILE_MOUNT_OPTIONS`]); sockets get [`IPC_MOUNT_OPTIONS`];
//! - with `nvidia-cdi-hook` on the host, the `createContainer` hooks NVIDIA's toolkit emits
//!   for `compute,utility`, in its order: `create-symlinks` (soname links and `libcuda.so`),
//!   `enable-cuda-compat --host-driver-version=<version>` (puts the image's CUDA
//!   forward-compatibility libraries first in the loader's path when they are newer than the
//!   host driver), `update-ldcache` (so the container's loader finds libraries in directories
//!   its own cache does not list) and `disable-device-node-modification` (hands the container
//!   a `/proc/driver/nvidia/params` with `ModifyDeviceFiles: 0`, so NVML and `nvidia-smi` in
//!   it never create or chmod device nodes). The last two need toolkit 1.17.8 or newer;
//! - without the hook, each soname link is a bind mount of its library instead, so
//!   `dlopen("libcuda.so.1")` still finds the library in the loader's default directories;
//! - `NVIDIA_VISIBLE_DEVICES=void` (a NVIDIA runtime, if it is the one running, then injects
//!   nothing itself) and `NVIDIA_CTK_LIBCUDA_DIR` (where the hook finds libcuda).

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use super::DriverFiles;

/// Mount options of libraries, utilities and firmware.
pub const FILE_MOUNT_OPTIONS: &[&str] = &["ro", "nosuid", "nodev", "rbind", "rprivate"];
/// Mount options of daemon sockets (writable: clients connect).
pub const IPC_MOUNT_OPTIONS: &[&str] = &["nosuid", "nodev", "rbind", "rprivate", "noexec"];
/// `argv[0]` of hook invocations when the hook path has no file name (otherwise its file
/// name is).
pub const HOOK_BINARY_NAME: &str = "nvidia-cdi-hook";
/// OCI hook stage the hooks run at: in the runtime namespace, after the container's
/// mounts exist and before `pivot_root`.
const HOOK_STAGE: &str = "createContainer";

/// A CDI `containerEdits` object (the fields this module fills).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    /// `KEY=value` entries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<Hook>,
}

/// A CDI mount.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    pub options: Vec<String>,
}

/// A CDI hook.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hook {
    /// OCI hook stage.
    pub hook_name: String,
    /// Executable on the host.
    pub path: String,
    /// Full argv, `argv[0]` first.
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
}

fn text(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

fn options(options: &[&str]) -> Vec<String> {
    options.iter().map(|o| o.to_string()).collect()
}

/// The container edits that give a container `files`: deterministic (mounts sorted by
/// container path, links by link path, folders sorted), no duplicate mount destinations.
pub fn container_edits(files: &DriverFiles) -> ContainerEdits {
    // Keyed by destination: one mount per container path, sorted (parents before children).
    let mut mounts: BTreeMap<String, Mount> = BTreeMap::new();
    let mut mount = |host: &Path, container: &Path, opts: &[&str]| {
        mounts.entry(text(container)).or_insert_with(|| Mount {
            host_path: text(host),
            container_path: text(container),
            options: options(opts),
        });
    };
    for file in files
        .libraries
        .iter()
        .chain(&files.binaries)
        .chain(&files.firmware)
    {
        mount(&file.host_path, &file.container_path, FILE_MOUNT_OPTIONS);
    }
    for file in &files.ipc {
        mount(&file.host_path, &file.container_path, IPC_MOUNT_OPTIONS);
    }

    let mut hooks = Vec::new();
    match &files.hook {
        Some(hook_path) => {
            let argv0 = hook_path
                .file_name()
                .map_or(HOOK_BINARY_NAME.to_string(), |name| {
                    name.to_string_lossy().into_owned()
                });
            let hook = |args: Vec<String>| Hook {
                hook_name: HOOK_STAGE.to_string(),
                path: text(hook_path),
                args: std::iter::once(argv0.clone()).chain(args).collect(),
                env: vec!["NVIDIA_CTK_DEBUG=false".to_string()],
            };
            let links: BTreeSet<(PathBuf, &str)> = files
                .soname_links
                .iter()
                .map(|l| (l.link.clone(), l.target.as_str()))
                .collect();
            if !links.is_empty() {
                let mut args = vec!["create-symlinks".to_string()];
                for (link, target) in &links {
                    args.push("--link".to_string());
                    args.push(format!("{target}::{}", text(link)));
                }
                hooks.push(hook(args));
            }
            // Before the cache update, so a forward-compatibility libcuda it selects is in
            // the container's cache.
            hooks.push(hook(vec![
                "enable-cuda-compat".to_string(),
                format!("--host-driver-version={}", files.version),
            ]));
            let dirs: BTreeSet<&PathBuf> = files.library_dirs.iter().collect();
            if !dirs.is_empty() {
                let mut args = vec!["update-ldcache".to_string()];
                for dir in dirs {
                    args.push("--folder".to_string());
                    args.push(text(dir));
                }
                hooks.push(hook(args));
            }
            hooks.push(hook(vec!["disable-device-node-modification".to_string()]));
        }
        None => {
            let host_of: BTreeMap<&Path, &Path> = files
                .libraries
                .iter()
                .map(|l| (l.container_path.as_path(), l.host_path.as_path()))
                .collect();
            for link in &files.soname_links {
                let Some(dir) = link.link.parent() else { continue };
                if let Some(host) = host_of.get(dir.join(&link.target).as_path()) {
                    mount(host, &link.link, FILE_MOUNT_OPTIONS);
                }
            }
        }
    }

    let mut env = vec!["NVIDIA_VISIBLE_DEVICES=void".to_string()];
    let libcuda_dir = files
        .libraries
        .iter()
        .map(|l| l.container_path.as_path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n == format!("libcuda.so.{}", files.version))
        })
        .and_then(Path::parent);
    if let Some(dir) = libcuda_dir {
        env.push(format!("NVIDIA_CTK_LIBCUDA_DIR={}", text(dir)));
    }
    env.sort();

    ContainerEdits {
        env,
        mounts: mounts.into_values().collect(),
        hooks,
    }
}
