//! Reading a driver root: the only part of [`super`] that touches the filesystem.
//!
//! Every path is resolved inside its root: a symbolic link is followed as the container
//! would follow it, an absolute target restarting at the root (a driver container's
//! `/usr/lib/…/libcuda.so.1 -> /usr/lib/…` must not land in this process's `/usr/lib`).

use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::OsString,
    fs, io,
    os::unix::fs::PermissionsExt,
    path::{Component, Path, PathBuf},
};

use super::{
    DiscoveryInputs, DriverFile, DriverFiles, DriverFilesError, SonameLink,
    ldcache::{self, LibraryArch},
};

/// Host path of NVIDIA's CDI hook, as the container toolkit installs it.
pub const DEFAULT_HOOK_PATH: &str = "/usr/bin/nvidia-cdi-hook";

/// Directories (in the driver root) searched for utilities, in order.
pub const BINARY_DIRS: &[&str] = &["/usr/bin", "/usr/sbin", "/bin", "/sbin"];

/// Utilities mounted into containers when present.
const BINARIES: &[&str] = &[
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "nvidia-debugdump",
    "nvidia-imex",
    "nvidia-imex-ctl",
    "nvidia-persistenced",
    "nvidia-smi",
];

/// IPC endpoints (in the driver root): for each, the candidates in order; the first that
/// exists is mounted. The host's MPS pipe directory (`/tmp/nvidia-mps`) is deliberately not
/// one of them: every container would share the host's MPS daemon through it, a channel
/// between tenants, and migdra offers no MPS sharing a claim could ask for. A container may
/// still run an MPS daemon of its own, for its own processes (the utilities are mounted).
pub const IPC_PATHS: &[&[&str]] = &[
    &[
        "/run/nvidia-persistenced/socket",
        "/var/run/nvidia-persistenced/socket",
    ],
    &[
        "/run/nvidia-fabricmanager/socket",
        "/var/run/nvidia-fabricmanager/socket",
    ],
];

/// Libraries that must exist: without them no CUDA (or NVML) program runs.
const REQUIRED_LIBRARIES: &[&str] = &["libcuda", "libnvidia-ml"];

/// Libraries whose unversioned development name (`<stem>.so`) is also linked, to their
/// `.so.1` soname: CUDA programs and the toolkit's hooks `dlopen("libcuda.so")`.
const DEV_LINKED_LIBRARIES: &[&str] = &["libcuda", "libnvidia-opticalflow"];

/// Prefix of the legacy NVVM library, versioned by its own number rather than the driver's.
const LEGACY_NVVM_PREFIX: &str = "libnvidia-nvvm70.so.";

/// Symbolic links followed per lookup before giving up (Linux's limit).
const MAX_SYMLINK_HOPS: usize = 40;

/// Directories (in the driver root) searched for libraries when it has no linker cache, in
/// order; for each file name the first directory that has it wins (so RHEL's 32-bit
/// `/usr/lib` copies lose to `/usr/lib64`). Each directory's `vdpau` subdirectory follows it.
pub fn fallback_library_dirs(arch: LibraryArch) -> Vec<PathBuf> {
    let multiarch = arch.multiarch();
    let dirs = [
        "/usr/lib64".to_string(),
        format!("/usr/lib/{multiarch}"),
        "/lib64".to_string(),
        format!("/lib/{multiarch}"),
        "/usr/lib".to_string(),
        "/lib".to_string(),
    ];
    dirs.iter()
        .flat_map(|dir| [PathBuf::from(dir), Path::new(dir).join("vdpau")])
        .collect()
}

/// Directories (in the driver root) the kernel loads firmware from, in its order.
pub fn firmware_dirs(kernel_release: &str) -> Vec<PathBuf> {
    vec![
        PathBuf::from(format!("/lib/firmware/updates/{kernel_release}")),
        PathBuf::from("/lib/firmware/updates"),
        PathBuf::from(format!("/lib/firmware/{kernel_release}")),
        PathBuf::from("/lib/firmware"),
    ]
}

/// A root directory, as the host names it and as this process reads it.
struct Root<'a> {
    on_host: &'a Path,
    visible_at: &'a Path,
}

fn relative(path_in_root: &Path) -> &Path {
    path_in_root.strip_prefix("/").unwrap_or(path_in_root)
}

fn read_error(path: PathBuf) -> impl FnOnce(io::Error) -> DriverFilesError {
    move |source| DriverFilesError::Read { path, source }
}

fn is_absent(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
    )
}

impl Root<'_> {
    fn local(&self, path_in_root: &Path) -> PathBuf {
        self.visible_at.join(relative(path_in_root))
    }

    fn host(&self, path_in_root: &Path) -> PathBuf {
        self.on_host.join(relative(path_in_root))
    }

    /// `path_in_root` with every symbolic link resolved inside the root; `None` when it (or
    /// a link on the way) does not exist, or links loop.
    fn resolve(&self, path_in_root: &Path) -> Result<Option<PathBuf>, DriverFilesError> {
        fn push_reversed(pending: &mut Vec<OsString>, path: &Path) {
            let parts: Vec<OsString> = path
                .components()
                .filter_map(|c| match c {
                    Component::Normal(name) => Some(name.to_os_string()),
                    Component::ParentDir => Some(OsString::from("..")),
                    Component::RootDir | Component::CurDir | Component::Prefix(_) => None,
                })
                .collect();
            pending.extend(parts.into_iter().rev());
        }
        let mut pending = Vec::new();
        push_reversed(&mut pending, path_in_root);
        let mut resolved = PathBuf::from("/");
        let mut hops = 0;
        while let Some(part) = pending.pop() {
            if part == ".." {
                resolved.pop();
                continue;
            }
            let candidate = resolved.join(&part);
            let local = self.local(&candidate);
            match fs::symlink_metadata(&local) {
                Ok(meta) if meta.file_type().is_symlink() => {
                    hops += 1;
                    if hops > MAX_SYMLINK_HOPS {
                        tracing::warn!(path = %local.display(), "symbolic links loop; skipping");
                        return Ok(None);
                    }
                    let target = fs::read_link(&local).map_err(read_error(local.clone()))?;
                    if target.is_absolute() {
                        resolved = PathBuf::from("/");
                    }
                    push_reversed(&mut pending, &target);
                }
                Ok(_) => resolved = candidate,
                Err(e) if is_absent(&e) => return Ok(None),
                Err(source) => return Err(DriverFilesError::Read { path: local, source }),
            }
        }
        Ok(Some(resolved))
    }

    /// Metadata of a resolved path (no links left to follow).
    fn metadata(&self, resolved: &Path) -> Result<Option<fs::Metadata>, DriverFilesError> {
        let local = self.local(resolved);
        match fs::metadata(&local) {
            Ok(meta) => Ok(Some(meta)),
            Err(e) if is_absent(&e) => Ok(None),
            Err(source) => Err(DriverFilesError::Read { path: local, source }),
        }
    }

    /// The resolved path of a regular file (executable when asked), if there is one.
    fn find_file(&self, path_in_root: &Path, executable: bool) -> Result<Option<PathBuf>, DriverFilesError> {
        let Some(resolved) = self.resolve(path_in_root)? else {
            return Ok(None);
        };
        let Some(meta) = self.metadata(&resolved)? else {
            return Ok(None);
        };
        let ok = meta.is_file() && (!executable || meta.permissions().mode() & 0o111 != 0);
        Ok(ok.then_some(resolved))
    }

    /// The names in a resolved directory; empty when it does not exist.
    fn list(&self, resolved_dir: &Path) -> Result<Vec<String>, DriverFilesError> {
        let local = self.local(resolved_dir);
        let entries = match fs::read_dir(&local) {
            Ok(entries) => entries,
            Err(e) if is_absent(&e) => return Ok(Vec::new()),
            Err(source) => return Err(DriverFilesError::Read { path: local, source }),
        };
        let mut names = Vec::new();
        for entry in entries {
            let entry = entry.map_err(read_error(local.clone()))?;
            match entry.file_name().into_string() {
                Ok(name) => names.push(name),
                Err(name) => tracing::debug!(?name, dir = %local.display(), "skipping a non-UTF-8 name"),
            }
        }
        names.sort();
        Ok(names)
    }
}

/// True for a driver library's file name: `lib*.so.<version>`, or the legacy NVVM.
fn is_driver_library(name: &str, version: &str) -> bool {
    (name.starts_with("lib")
        && name
            .strip_suffix(version)
            .is_some_and(|stem| stem.ends_with(".so.") && stem.len() > ".so.".len()))
        || name.starts_with(LEGACY_NVVM_PREFIX)
}

fn file_name(path: &Path) -> Option<&str> {
    path.file_name().and_then(|n| n.to_str())
}

/// Libraries and links found so far, keyed by container path.
#[derive(Default)]
struct LibrarySet {
    libraries: BTreeSet<PathBuf>,
    /// Library file names already taken (first directory wins in the fallback search).
    names: BTreeSet<String>,
    links: BTreeMap<PathBuf, String>,
}

impl LibrarySet {
    fn add_library(&mut self, resolved: PathBuf) -> bool {
        let Some(name) = file_name(&resolved).map(str::to_string) else {
            return false;
        };
        if resolved.to_str().is_none() {
            return false;
        }
        self.names.insert(name);
        self.libraries.insert(resolved);
        true
    }

    /// A link `<dir of library>/<link_name>` → library, unless the name is the file's own.
    fn add_link(&mut self, library: &Path, link_name: &str) {
        let (Some(dir), Some(target)) = (library.parent(), file_name(library)) else {
            return;
        };
        if link_name == target || link_name.contains('/') || link_name.is_empty() {
            return;
        }
        self.links
            .entry(dir.join(link_name))
            .or_insert_with(|| target.to_string());
    }

    /// `<stem>.so` → `<stem>.so.1` next to each `<stem>.so.1` soname link.
    fn add_dev_links(&mut self) {
        let mut dev_links = Vec::new();
        for link in self.links.keys() {
            let (Some(dir), Some(name)) = (link.parent(), file_name(link)) else {
                continue;
            };
            for stem in DEV_LINKED_LIBRARIES {
                if name == format!("{stem}.so.1") {
                    dev_links.push((dir.join(format!("{stem}.so")), name.to_string()));
                }
            }
        }
        for (link, target) in dev_links {
            self.links.entry(link).or_insert(target);
        }
    }
}

/// Adds the driver libraries of one directory (resolved, in the root), with the soname
/// links that sit beside them.
fn scan_library_dir(
    root: &Root,
    dir: &Path,
    version: &str,
    set: &mut LibrarySet,
) -> Result<(), DriverFilesError> {
    let Some(dir) = root.resolve(dir)? else {
        return Ok(());
    };
    let names = root.list(&dir)?;
    let mut link_candidates = Vec::new();
    for name in &names {
        if is_driver_library(name, version) {
            if set.names.contains(name) {
                continue;
            }
            if let Some(resolved) = root.find_file(&dir.join(name), false)? {
                set.add_library(resolved);
            }
        } else if name.contains(".so.") {
            link_candidates.push(name);
        }
    }
    // Links whose target is a library taken from this directory: `libcuda.so.1`, not the
    // development link `libcuda.so` (that one is made by `add_dev_links`).
    for name in link_candidates {
        if let Some(resolved) = root.resolve(&dir.join(name))?
            && resolved.parent() == Some(dir.as_path())
            && set.libraries.contains(&resolved)
        {
            set.add_link(&resolved, name);
        }
    }
    Ok(())
}

/// Libraries named by the linker cache, plus the `vdpau` subdirectories of their
/// directories (the cache does not list VDPAU drivers).
fn libraries_from_cache(
    root: &Root,
    entries: &[ldcache::LdCacheEntry],
    inputs: &DiscoveryInputs,
    set: &mut LibrarySet,
) -> Result<(), DriverFilesError> {
    let version = &inputs.driver_version;
    for entry in entries.iter().filter(|e| inputs.arch.accepts(e.flags)) {
        let Some(soname) = entry.soname.to_str() else {
            continue;
        };
        // Entries name paths in the root; a cache written from outside it may carry the
        // root's host path as a prefix.
        let path = match entry.path.strip_prefix(root.on_host) {
            Ok(inner) if root.on_host != Path::new("/") => Path::new("/").join(inner),
            _ => entry.path.clone(),
        };
        if !path.is_absolute() {
            continue;
        }
        let Some(resolved) = root.find_file(&path, false)? else {
            tracing::trace!(path = %path.display(), "linker cache entry does not resolve to a file");
            continue;
        };
        if file_name(&resolved).is_some_and(|name| is_driver_library(name, version))
            && set.add_library(resolved.clone())
        {
            set.add_link(&resolved, soname);
        }
    }
    let dirs: BTreeSet<PathBuf> = set
        .libraries
        .iter()
        .filter_map(|lib| lib.parent().map(|dir| dir.join("vdpau")))
        .collect();
    for dir in dirs {
        scan_library_dir(root, &dir, version, set)?;
    }
    Ok(())
}

fn driver_file(root: &Root, resolved: &Path, container_path: &Path) -> DriverFile {
    DriverFile {
        host_path: root.host(resolved),
        container_path: container_path.to_path_buf(),
    }
}

/// The first of `lookups` that `find` resolves.
fn first_found(
    root: &Root,
    lookups: impl IntoIterator<Item = PathBuf>,
    find: impl Fn(&Path) -> Result<Option<PathBuf>, DriverFilesError>,
) -> Result<Option<DriverFile>, DriverFilesError> {
    for lookup in lookups {
        if let Some(resolved) = find(&lookup)? {
            return Ok(Some(driver_file(root, &resolved, &lookup)));
        }
    }
    Ok(None)
}

fn validate_version(version: &str) -> Result<(), DriverFilesError> {
    if version.is_empty() || version.contains('/') || version.contains(char::is_whitespace) {
        return Err(DriverFilesError::InvalidVersion(version.to_string()));
    }
    Ok(())
}

/// `hook_path` (a host path), when it is an executable file on the host; `host_root` is where
/// this process sees the host's `/` (links are resolved inside it, as the runtime on the host
/// would resolve them).
pub fn find_hook(host_root: &Path, hook_path: &Path) -> Result<Option<PathBuf>, DriverFilesError> {
    let root = Root {
        on_host: Path::new("/"),
        visible_at: host_root,
    };
    Ok(root.find_file(hook_path, true)?.map(|_| hook_path.to_path_buf()))
}

/// Discovers the driver's container files under `inputs.driver_root`.
///
/// Libraries come from the root's `etc/ld.so.cache` ([`super::ldcache`]), and also from
/// [`fallback_library_dirs`] when there is none or it lacks libcuda and libnvidia-ml of the
/// version. Missing `libcuda.so.<version>` or `libnvidia-ml.so.<version>` is an error; missing
/// utilities, firmware, sockets or hook are not (logged at debug).
pub fn discover(inputs: &DiscoveryInputs) -> Result<DriverFiles, DriverFilesError> {
    let version = inputs.driver_version.as_str();
    validate_version(version)?;
    let root = Root {
        on_host: &inputs.driver_root.on_host,
        visible_at: &inputs.driver_root.visible_at,
    };

    let mut set = LibrarySet::default();
    let cache_path = Path::new("/etc/ld.so.cache");
    let mut searched = Vec::new();
    match root.find_file(cache_path, false)? {
        Some(resolved) => {
            let local = root.local(&resolved);
            let bytes = fs::read(&local).map_err(read_error(local.clone()))?;
            let entries = ldcache::parse(&bytes).map_err(|source| DriverFilesError::CorruptLdCache {
                path: root.host(&resolved),
                source,
            })?;
            libraries_from_cache(&root, &entries, inputs, &mut set)?;
            tracing::debug!(
                cache = %root.host(&resolved).display(),
                entries = entries.len(),
                libraries = set.libraries.len(),
                "read the driver root's linker cache"
            );
            searched.push(root.host(cache_path));
        }
        None => tracing::debug!(
            root = %root.on_host.display(),
            "driver root has no linker cache; searching library directories"
        ),
    }
    let missing_required = |set: &LibrarySet| {
        REQUIRED_LIBRARIES
            .iter()
            .find(|library| !set.names.contains(&format!("{library}.so.{version}")))
            .copied()
    };
    // A cache that does not name the driver (ldconfig not run since the driver was
    // installed) is no reason to give up before looking in the usual directories.
    if missing_required(&set).is_some() {
        if !searched.is_empty() {
            tracing::warn!(
                root = %root.on_host.display(),
                version,
                "the driver root's linker cache names no libcuda or libnvidia-ml of this version; \
                 searching library directories too"
            );
        }
        let dirs = fallback_library_dirs(inputs.arch);
        for dir in &dirs {
            scan_library_dir(&root, dir, version, &mut set)?;
        }
        searched.extend(dirs.iter().map(|dir| root.host(dir)));
    }
    if let Some(library) = missing_required(&set) {
        return Err(DriverFilesError::MissingLibrary {
            library,
            version: version.to_string(),
            root: root.on_host.to_path_buf(),
            searched,
        });
    }
    set.add_dev_links();

    let mut binaries = Vec::new();
    for name in BINARIES {
        let lookups = BINARY_DIRS.iter().map(|dir| Path::new(dir).join(name));
        match first_found(&root, lookups, |path| root.find_file(path, true))? {
            Some(file) => binaries.push(file),
            None => tracing::debug!(binary = name, "driver utility not found; not mounting it"),
        }
    }

    let mut firmware: BTreeMap<String, DriverFile> = BTreeMap::new();
    for dir in firmware_dirs(&inputs.kernel_release) {
        let dir = dir.join("nvidia").join(version);
        let Some(resolved_dir) = root.resolve(&dir)? else {
            continue;
        };
        for name in root.list(&resolved_dir)? {
            if !(name.starts_with("gsp") && name.ends_with(".bin")) || firmware.contains_key(&name) {
                continue;
            }
            if let Some(resolved) = root.find_file(&resolved_dir.join(&name), false)? {
                let file = driver_file(&root, &resolved, &dir.join(&name));
                firmware.insert(name, file);
            }
        }
    }
    if firmware.is_empty() {
        tracing::debug!(version, "no GSP firmware found; not mounting any");
    }

    let mut ipc = Vec::new();
    for candidates in IPC_PATHS {
        let exists = |path: &Path| match root.resolve(path)? {
            Some(resolved) if root.metadata(&resolved)?.is_some() => Ok(Some(resolved)),
            _ => Ok(None),
        };
        match first_found(&root, candidates.iter().map(PathBuf::from), exists)? {
            Some(file) => ipc.push(file),
            None => tracing::debug!(candidates = ?candidates, "IPC endpoint not found; not mounting it"),
        }
    }

    let hook = find_hook(&inputs.host_root, &inputs.hook_path)?;
    if hook.is_none() {
        tracing::warn!(
            hook = %inputs.hook_path.display(),
            "nvidia-cdi-hook not found on the host; containers get the soname links as mounts \
             and none of its hooks (no linker cache update, CUDA compatibility libraries or \
             device-node protection)"
        );
    }

    let library_dirs: BTreeSet<PathBuf> = set
        .libraries
        .iter()
        .filter_map(|lib| lib.parent().map(Path::to_path_buf))
        .collect();
    let by_container_path = |a: &DriverFile, b: &DriverFile| a.container_path.cmp(&b.container_path);
    binaries.sort_by(by_container_path);
    ipc.sort_by(by_container_path);
    let mut firmware: Vec<DriverFile> = firmware.into_values().collect();
    firmware.sort_by(by_container_path);
    let files = DriverFiles {
        version: version.to_string(),
        libraries: set
            .libraries
            .iter()
            .map(|lib| driver_file(&root, lib, lib))
            .collect(),
        binaries,
        firmware,
        ipc,
        soname_links: set
            .links
            .into_iter()
            .map(|(link, target)| SonameLink { link, target })
            .collect(),
        library_dirs: library_dirs.into_iter().collect(),
        hook,
    };
    tracing::info!(
        version,
        root = %root.on_host.display(),
        libraries = files.libraries.len(),
        binaries = files.binaries.len(),
        firmware = files.firmware.len(),
        ipc = files.ipc.len(),
        hook = files.hook.is_some(),
        "discovered the driver's container files"
    );
    Ok(files)
}

/// The NVML library's soname, what NVIDIA's tools load.
pub const NVML_LIBRARY: &str = "libnvidia-ml.so.1";

/// Where this process finds [`NVML_LIBRARY`] under the driver root it sees at
/// `driver_root_visible`: the first of [`fallback_library_dirs`] of `arch` that has it (so
/// `usr/lib64` on RHEL, `usr/lib/<triplet>` on Debian and Ubuntu, for the host's architecture
/// only), links resolved inside the root. `None` when no directory has it.
pub fn find_nvml_library(driver_root_visible: &Path, arch: LibraryArch) -> Option<PathBuf> {
    let root = Root {
        on_host: Path::new("/"),
        visible_at: driver_root_visible,
    };
    fallback_library_dirs(arch).iter().find_map(|dir| {
        let resolved = root
            .find_file(&dir.join(NVML_LIBRARY), false)
            .unwrap_or_else(|e| {
                tracing::debug!(error = %e, dir = %dir.display(), "skipping a library directory");
                None
            })?;
        Some(root.local(&resolved))
    })
}
