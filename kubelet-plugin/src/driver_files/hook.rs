//! `nvidia-cdi-hook` on the host. The specs name it by a host path and the runtime runs it
//! there, so it must exist on the host in a version that knows every hook the specs name.
//! Hosts differ (the toolkit package puts it in `/usr/bin`, the GPU Operator in
//! `/usr/local/nvidia/toolkit`, many nodes have none), so the plugin image carries one and
//! [`install_hook`] copies it to a host directory the plugin owns.

use std::{
    fs, io,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
};

use super::DriverFilesError;
use crate::state_dir::{Durability, write_atomically};

/// Where the plugin image carries `nvidia-cdi-hook`.
pub const IMAGE_HOOK_PATH: &str = "/usr/local/bin/nvidia-cdi-hook";

/// Mode of the installed hook: the runtime executes it as root.
const HOOK_MODE: u32 = 0o755;

/// What [`install_hook`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HookInstall {
    /// The target was missing or differed and now holds the source's bytes.
    Installed,
    /// The target already held the source's bytes, executable: nothing was written.
    Unchanged,
}

/// Copies the hook at `source` to `target` (as this process sees the host path) unless it is
/// there already: a temp file in the target's directory renamed over it, so a runtime
/// starting a container meanwhile runs the old binary or the new one, never a torn one.
pub fn install_hook(source: &Path, target: &Path) -> Result<HookInstall, DriverFilesError> {
    let error = |path: &Path| {
        let path = path.to_path_buf();
        move |source: io::Error| DriverFilesError::InstallHook { path, source }
    };
    let bytes = fs::read(source).map_err(error(source))?;
    let current = match fs::read(target) {
        Ok(current) => Some(current),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(error(target)(e)),
    };
    let executable = fs::metadata(target).is_ok_and(|m| m.permissions().mode() & 0o777 == HOOK_MODE);
    if current.as_deref() == Some(bytes.as_slice()) && executable {
        return Ok(HookInstall::Unchanged);
    }
    if let Some(dir) = target.parent() {
        fs::create_dir_all(dir).map_err(error(dir))?;
    }
    write_atomically(target, &bytes, HOOK_MODE, Durability::AcrossReboots).map_err(error(target))?;
    Ok(HookInstall::Installed)
}

/// `hook_path` (a host path) under `host_root` (where this process sees the host's `/`).
pub fn hook_visible_at(host_root: &Path, hook_path: &Path) -> PathBuf {
    host_root.join(hook_path.strip_prefix("/").unwrap_or(hook_path))
}

/// Installs the hook from `source` when given, then checks that `hook_path` is on the host.
/// Returns why containers get none of the hook's edits (for a warning event), or `None` when
/// the hook is in place. `host_root` is where this process sees the host's `/`.
pub fn ensure_hook(source: Option<&Path>, host_root: &Path, hook_path: &Path) -> Option<String> {
    let mut install_error = None;
    if let Some(source) = source {
        let target = hook_visible_at(host_root, hook_path);
        match install_hook(source, &target) {
            Ok(HookInstall::Installed) => {
                tracing::info!(from = %source.display(), to = %hook_path.display(), "installed nvidia-cdi-hook on the host");
            }
            Ok(HookInstall::Unchanged) => {
                tracing::debug!(hook = %hook_path.display(), "nvidia-cdi-hook on the host is current");
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot install nvidia-cdi-hook on the host");
                install_error = Some(e.to_string());
            }
        }
    }
    let missing = match super::find_hook(host_root, hook_path) {
        Ok(Some(_)) => return None,
        Ok(None) => format!(
            "nvidia-cdi-hook is not an executable file at {} on the host",
            hook_path.display()
        ),
        Err(e) => format!("cannot check nvidia-cdi-hook at {}: {e}", hook_path.display()),
    };
    let cause = install_error.map_or(String::new(), |e| format!(" ({e})"));
    Some(format!(
        "{missing}{cause}: containers get the driver's soname links as read-only mounts and none \
         of its hooks (no linker cache update, no CUDA forward compatibility, no protection of \
         device nodes); set kubeletPlugin.cdiHook.source=image, or install NVIDIA's container \
         toolkit 1.17.8 or newer on the host"
    ))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    fn inode(path: &Path) -> u64 {
        fs::metadata(path).unwrap().ino()
    }

    #[test]
    fn installs_atomically_and_only_when_changed() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("image-hook");
        fs::write(&source, b"hook v1").unwrap();
        let host = dir.path().join("host");
        let hook_path = Path::new("/var/lib/migdra/bin/nvidia-cdi-hook");
        let target = hook_visible_at(&host, hook_path);
        assert_eq!(target, host.join("var/lib/migdra/bin/nvidia-cdi-hook"));

        assert_eq!(install_hook(&source, &target).unwrap(), HookInstall::Installed);
        assert_eq!(fs::read(&target).unwrap(), b"hook v1");
        assert_eq!(fs::metadata(&target).unwrap().permissions().mode() & 0o777, 0o755);
        let first = inode(&target);
        assert_eq!(install_hook(&source, &target).unwrap(), HookInstall::Unchanged);
        assert_eq!(inode(&target), first, "unchanged: not rewritten");

        // A new image: replaced by a rename, never written in place.
        fs::write(&source, b"hook v2").unwrap();
        assert_eq!(install_hook(&source, &target).unwrap(), HookInstall::Installed);
        assert_eq!(fs::read(&target).unwrap(), b"hook v2");
        assert_ne!(inode(&target), first);
        // Same bytes but not executable: installed again.
        fs::set_permissions(&target, fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(install_hook(&source, &target).unwrap(), HookInstall::Installed);
        assert_eq!(fs::metadata(&target).unwrap().permissions().mode() & 0o777, 0o755);
        let leftovers: Vec<_> = fs::read_dir(target.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(leftovers, ["nvidia-cdi-hook"], "no temp files left");
    }

    #[test]
    fn a_missing_hook_is_a_warning_that_names_the_path_and_the_cause() {
        let dir = tempfile::tempdir().unwrap();
        let host = dir.path().join("host");
        let hook_path = Path::new("/var/lib/migdra/bin/nvidia-cdi-hook");
        // The image lacks it: nothing installed, and the warning says why.
        let note = ensure_hook(Some(&dir.path().join("no-such-hook")), &host, hook_path).unwrap();
        assert!(
            note.starts_with("nvidia-cdi-hook is not an executable file at /var/lib/migdra/bin/nvidia-cdi-hook on the host (installing nvidia-cdi-hook:"),
            "{note}"
        );
        assert!(note.contains("no-such-hook"), "{note}");
        assert!(note.contains("none of its hooks"), "{note}");
        // A host-installed hook that is missing.
        let note = ensure_hook(None, &host, Path::new("/usr/bin/nvidia-cdi-hook")).unwrap();
        assert!(
            note.contains("at /usr/bin/nvidia-cdi-hook on the host:"),
            "{note}"
        );
        // Installed from the image: no warning.
        let source = dir.path().join("image-hook");
        fs::write(&source, b"hook").unwrap();
        assert_eq!(ensure_hook(Some(&source), &host, hook_path), None);
        assert!(hook_visible_at(&host, hook_path).is_file());
    }
}
