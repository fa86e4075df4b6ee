//! Test support: [`FakeGpuHost`] sets up one independent simulated GPU host in a temporary
//! directory (its own copy of the library, configuration, state and `/proc`), so tests can
//! run several hosts in one process and in parallel.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::OnceLock,
    time::SystemTime,
};

use crate::{
    FakeError,
    config::{CONFIG_FILE_NAME, FakeConfig, GpuConfig},
    state::{FakeState, ensure_state, read_state, update_state},
};

/// File name cargo gives the built library.
pub const BUILT_LIBRARY: &str = "libmigdra_fake_nvml.so";
/// Name the host's copy gets: NVML's default soname.
pub const HOST_LIBRARY: &str = "libnvidia-ml.so.1";
/// Environment variable naming the built library explicitly (skips the search).
pub const LIBRARY_ENV: &str = "MIGDRA_FAKE_NVML_LIB";

/// The most recently built `libmigdra_fake_nvml.so`, building it if no build exists.
///
/// Search order: `$MIGDRA_FAKE_NVML_LIB`; next to the running executable, its `deps/` and
/// its parent (test binaries run from `target/<profile>/deps`, where cargo also puts the
/// cdylib it builds for a dev-dependency; other binaries run from `target/<profile>`); then
/// `cargo build -p migdra-fake-nvml` once per process.
pub fn fake_library_path() -> Result<PathBuf, FakeError> {
    static FOUND: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    FOUND
        .get_or_init(|| locate_or_build().map_err(|e| e.to_string()))
        .clone()
        .map_err(FakeError::Library)
}

fn locate_or_build() -> Result<PathBuf, FakeError> {
    if let Some(path) = std::env::var_os(LIBRARY_ENV) {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(FakeError::Library(format!(
                "{LIBRARY_ENV}={} does not exist",
                path.display()
            )))
        };
    }
    let exe = std::env::current_exe().map_err(|e| FakeError::Library(format!("current_exe: {e}")))?;
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(dir) = exe.parent() {
        dirs.push(dir.to_path_buf());
        dirs.push(dir.join("deps"));
        if let Some(parent) = dir.parent() {
            dirs.push(parent.to_path_buf());
        }
    }
    if let Some(found) = newest(&dirs) {
        return Ok(found);
    }
    build()?;
    newest(&target_dirs()).ok_or_else(|| {
        FakeError::Library(format!(
            "cargo build -p migdra-fake-nvml produced no {BUILT_LIBRARY} in {:?}",
            target_dirs()
        ))
    })
}

fn newest(dirs: &[PathBuf]) -> Option<PathBuf> {
    dirs.iter()
        .map(|d| d.join(BUILT_LIBRARY))
        .filter_map(|p| {
            let modified = p.metadata().and_then(|m| m.modified()).ok()?;
            Some((modified, p))
        })
        .max_by_key(|(m, _): &(SystemTime, PathBuf)| *m)
        .map(|(_, p)| p)
}

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn target_dirs() -> Vec<PathBuf> {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest_dir().join("../../target"));
    vec![target.join("debug"), target.join("debug/deps")]
}

fn build() -> Result<(), FakeError> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "-p", "migdra-fake-nvml", "--manifest-path"])
        .arg(manifest_dir().join("Cargo.toml"))
        .status()
        .map_err(|e| FakeError::Library(format!("running cargo build: {e}")))?;
    if status.success() {
        Ok(())
    } else {
        Err(FakeError::Library(format!(
            "cargo build -p migdra-fake-nvml failed: {status}"
        )))
    }
}

/// One simulated GPU host in a temporary directory.
///
/// The directory holds a *copy* of the library named `libnvidia-ml.so.1` (a copy, not a link:
/// the dynamic loader shares one instance per file, and each host needs its own), its
/// `fake-nvml.json`, the state file and the simulated `/proc`. The state exists as soon as
/// the host does, so tests can edit it before anything loads the library.
#[derive(Debug)]
pub struct FakeGpuHost {
    dir: tempfile::TempDir,
    config: FakeConfig,
}

impl FakeGpuHost {
    /// Sets up a host for `config`.
    pub fn new(config: FakeConfig) -> Result<Self, FakeError> {
        let library = fake_library_path()?;
        let dir = tempfile::Builder::new()
            .prefix("fake-nvml-")
            .tempdir()
            .map_err(|e| FakeError::io(&std::env::temp_dir(), e))?;
        let lib = dir.path().join(HOST_LIBRARY);
        std::fs::copy(&library, &lib).map_err(|e| FakeError::io(&lib, e))?;
        let config_path = dir.path().join(CONFIG_FILE_NAME);
        let text = serde_json::to_string_pretty(&config)
            .map_err(|e| FakeError::Config(format!("serialize config: {e}")))?;
        std::fs::write(&config_path, text).map_err(|e| FakeError::io(&config_path, e))?;
        ensure_state(&config, dir.path())?;
        Ok(Self { dir, config })
    }

    /// A host with one GPU per `(model, MIG enabled)` pair.
    pub fn with_gpus(gpus: &[(&str, bool)]) -> Result<Self, FakeError> {
        Self::new(FakeConfig {
            gpus: gpus
                .iter()
                .map(|(model, mig)| GpuConfig::new(model, *mig))
                .collect(),
            ..FakeConfig::default()
        })
    }

    /// The host's directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The library to load (`Nvml::builder().lib_path(..)`).
    pub fn lib_path(&self) -> PathBuf {
        self.dir.path().join(HOST_LIBRARY)
    }

    /// The configuration file.
    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join(CONFIG_FILE_NAME)
    }

    /// The configuration the host was made from.
    pub fn config(&self) -> &FakeConfig {
        &self.config
    }

    /// The state file.
    pub fn state_path(&self) -> PathBuf {
        self.config.state_path(self.dir.path())
    }

    /// The simulated `/proc`.
    pub fn proc_root(&self) -> PathBuf {
        self.config.proc_root(self.dir.path())
    }

    /// Reads the GPUs' current state.
    pub fn read_state(&self) -> Result<FakeState, FakeError> {
        read_state(&self.state_path())
    }

    /// Edits the GPUs' state (mark a compute instance busy, reset a GPU, add a fault, ...).
    pub fn update_state<T>(&self, f: impl FnOnce(&mut FakeState) -> T) -> Result<T, FakeError> {
        update_state(&self.state_path(), f)
    }
}
