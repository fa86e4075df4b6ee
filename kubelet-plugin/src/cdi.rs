//! Container Device Interface specs: one transient spec file per claim that tells the
//! container runtime which device nodes and environment a container gets, and one node-wide
//! driver spec with what every CUDA container needs besides its devices.
//!
//! The node-wide spec (kind `<vendor>/driver`, one device [`DRIVER_DEVICE`]) carries the
//! driver's files as read-only bind mounts, the `nvidia-cdi-hook` hooks and
//! `NVIDIA_VISIBLE_DEVICES=void` ([`crate::driver_files::container_edits`]). Every prepared
//! device names it as a second CDI device ID, so a container with devices of several
//! requests or claims gets the driver's edits once (runtimes inject a device named twice
//! once): no environment variable is set by two devices with different values. It is
//! rewritten atomically at start and after a driver change, and never removed (claims may
//! reference it at any time). A claim's own spec keeps only device nodes and per-device
//! environment.
//!
//! Every device node is written with an explicit type, major and minor, so the runtime
//! creates it inside the container even when the host node does not exist (the kernel driver
//! does not create `/dev/nvidia-caps/*` for instances made through NVML) and the CDI library
//! never has to stat a host path.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use dra_kubelet::ClaimRef;
use serde::Serialize;

use crate::{
    driver_files::{
        self, DiscoveryInputs, DriverFiles, DriverFilesCache, DriverFilesError, HostDir, LibraryArch,
    },
    state_dir::{Durability, write_atomically},
};

/// Explicit device-node fields and dots in the vendor name and annotations need nothing newer.
const CDI_VERSION: &str = "0.6.0";
/// CDI class of per-claim specs.
const CDI_CLASS: &str = "claim";
/// CDI class of the node-wide driver spec.
const DRIVER_CLASS: &str = "driver";
/// The one device of the node-wide driver spec.
pub const DRIVER_DEVICE: &str = "files";
/// Major number of `/dev/nvidia*` (fixed by the NVIDIA kernel driver).
const NVIDIA_MAJOR: u32 = 195;
const NVIDIACTL_MINOR: u32 = 255;
/// Minor of `/dev/nvidia-modeset` (the nvidia-modeset module's node, same major).
const NVIDIA_MODESET_MINOR: u32 = 254;

#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A /proc file lacks what we need.
    #[error("{path}: {what}")]
    Missing { path: PathBuf, what: String },
    /// Writing or removing a spec failed.
    #[error("CDI spec {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("encoding a CDI spec: {0}")]
    Encode(#[from] serde_json::Error),
    /// The node lacks what every CUDA container needs (driver files, control device nodes).
    #[error("this node cannot run CUDA containers: {0}")]
    DriverFiles(#[from] DriverFilesError),
}

/// A device node in a CDI spec.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    /// Path inside the container.
    pub path: String,
    /// `c` for character devices.
    #[serde(rename = "type")]
    pub node_type: String,
    pub major: u32,
    pub minor: u32,
    pub file_mode: u32,
}

/// Minor and mode of a capability from its file (`DeviceFileMinor:` / `DeviceFileMode:`).
fn read_capability(path: &Path) -> Result<(u32, u32), CdiError> {
    let text = fs::read_to_string(path).map_err(|source| CdiError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse::<u32>().ok()))
            .ok_or_else(|| CdiError::Missing {
                path: path.to_path_buf(),
                what: format!("no {name} line"),
            })
    };
    Ok((
        field("DeviceFileMinor:")?,
        field("DeviceFileMode:").unwrap_or(0o444),
    ))
}

fn char_node(path: String, major: u32, minor: u32, file_mode: u32) -> DeviceNode {
    DeviceNode {
        path,
        node_type: "c".into(),
        major,
        minor,
        file_mode,
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ContainerEdits {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    env: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    device_nodes: Vec<DeviceNode>,
}

/// A CDI spec file; `E` is the devices' container edits.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Spec<E> {
    cdi_version: &'static str,
    kind: String,
    annotations: BTreeMap<String, String>,
    devices: Vec<SpecDevice<E>>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct SpecDevice<E> {
    name: String,
    container_edits: E,
}

/// What goes into the container for one allocated device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimDevice {
    /// Device name in the pool (becomes part of the CDI device name).
    pub device_name: String,
    pub gpu_minor: u32,
    /// `(GPU instance, compute instance)` for a MIG device.
    pub mig: Option<(u32, u32)>,
    /// Also the MIG monitor capability (`mig/monitor`), with which NVML inside the container
    /// lists every MIG instance of the GPU: for a whole GPU in MIG mode handed out with
    /// `adminAccess` to a monitoring agent.
    pub mig_monitor: bool,
    /// The device's own UUID variable and the configured ones.
    pub env: BTreeMap<String, String>,
}

/// A claim spec as read back from the spec directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WrittenClaimSpec {
    pub uid: String,
    /// `(namespace, name)` of the claim, when the spec names them.
    pub claim: Option<(String, String)>,
    /// Each device's name in the pool and its environment.
    pub devices: Vec<(String, BTreeMap<String, String>)>,
}

/// Where the node's driver installation is and what the node-wide spec needs to find it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverSetup {
    /// The driver root on the host and where this process sees it.
    pub driver_root: HostDir,
    /// Where this process sees the host's `/` (the hook is looked up there).
    pub host_root: PathBuf,
    /// Host path of `nvidia-cdi-hook`.
    pub hook_path: PathBuf,
    /// Where this process sees the host's `/dev` (for the required control nodes).
    pub dev_root: PathBuf,
    /// The running kernel's release (for firmware directories); empty when unknown.
    pub kernel_release: String,
}

/// The driver setup with the last discovery and the files the node-wide spec was written
/// from.
#[derive(Debug)]
struct DriverSpecState {
    setup: DriverSetup,
    cache: Mutex<(DriverFilesCache, Option<Arc<DriverFiles>>)>,
}

/// Major numbers of the NVIDIA character devices, from `/proc/devices`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Majors {
    /// `nvidia-uvm`, when the module is loaded.
    pub uvm: Option<u32>,
    /// `nvidia-caps`, when MIG capabilities exist.
    pub caps: Option<u32>,
}

/// Mode of every spec file: claim specs carry the claim's environment (user values), and
/// the container runtimes that read CDI specs (containerd, CRI-O) run as root.
const SPEC_MODE: u32 = 0o600;

/// Writes and removes per-claim CDI specs and writes the node-wide driver spec.
#[derive(Clone, Debug)]
pub struct CdiWriter {
    spec_dir: PathBuf,
    vendor: String,
    proc_root: PathBuf,
    driver: Option<Arc<DriverSpecState>>,
    /// The boot claim specs are written for (see [`CdiWriter::for_boot`]).
    boot_id: Option<String>,
}

impl CdiWriter {
    /// `vendor` is the DRA driver name; `proc_root` is where `/proc` is (for majors and
    /// capability minors).
    pub fn new(
        spec_dir: impl Into<PathBuf>,
        vendor: impl Into<String>,
        proc_root: impl Into<PathBuf>,
    ) -> Self {
        Self {
            spec_dir: spec_dir.into(),
            vendor: vendor.into(),
            proc_root: proc_root.into(),
            driver: None,
            boot_id: None,
        }
    }

    /// Where `/proc` is.
    pub fn proc_root(&self) -> &std::path::Path {
        &self.proc_root
    }

    /// Writes claim specs for boot `boot_id`, named in an annotation (`<vendor>/boot-id`),
    /// without an fsync: after a reboot [`Self::remove_specs_of_other_boots`] removes every
    /// spec an earlier boot left, whole or torn. A writer without a boot syncs each spec, as
    /// the runtime may read it after a reboot.
    pub fn for_boot(mut self, boot_id: &str) -> Self {
        self.boot_id = Some(boot_id.to_string());
        self
    }

    fn claim_spec_durability(&self) -> Durability {
        match self.boot_id {
            Some(_) => Durability::ThisBoot,
            None => Durability::AcrossReboots,
        }
    }

    fn boot_annotation(&self) -> String {
        format!("{}/boot-id", self.vendor)
    }

    /// Every claim spec file of this vendor in the spec directory: claim UID, path and content
    /// (`None` when unreadable or torn).
    fn claim_spec_files(&self) -> Result<Vec<(String, PathBuf, Option<serde_json::Value>)>, CdiError> {
        let entries = match fs::read_dir(&self.spec_dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => {
                return Err(CdiError::Read {
                    path: self.spec_dir.clone(),
                    source,
                });
            }
        };
        let prefix = format!("{}-{CDI_CLASS}_", self.vendor);
        let mut files = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(uid) = name.strip_prefix(&prefix).and_then(|n| n.strip_suffix(".json")) else {
                continue;
            };
            let spec = fs::read(entry.path())
                .ok()
                .and_then(|bytes| serde_json::from_slice::<serde_json::Value>(&bytes).ok());
            files.push((uid.to_string(), entry.path(), spec));
        }
        files.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(files)
    }

    fn annotation<'a>(&self, spec: &'a serde_json::Value, key: &str) -> Option<&'a str> {
        spec.pointer("/annotations")?
            .get(format!("{}/{key}", self.vendor))?
            .as_str()
    }

    /// Removes every claim spec of this vendor in the spec directory that does not name this
    /// writer's boot: another boot's, or a torn one. Returns the removed specs' claim UIDs.
    /// Nothing without a boot ([`Self::for_boot`]).
    pub fn remove_specs_of_other_boots(&self) -> Result<Vec<String>, CdiError> {
        let Some(boot_id) = &self.boot_id else {
            return Ok(Vec::new());
        };
        let mut removed = Vec::new();
        for (uid, path, spec) in self.claim_spec_files()? {
            let written_for = spec.as_ref().and_then(|s| self.annotation(s, "boot-id"));
            if written_for != Some(boot_id.as_str()) && remove_file(path)? {
                removed.push(uid);
            }
        }
        Ok(removed)
    }

    /// The claim specs written in this writer's boot, as read back (torn ones and those of
    /// other boots are skipped): what survives of the claims prepared on this boot when the
    /// checkpoint is lost.
    pub fn claim_specs_of_this_boot(&self) -> Result<Vec<WrittenClaimSpec>, CdiError> {
        let Some(boot_id) = &self.boot_id else {
            return Ok(Vec::new());
        };
        let mut specs = Vec::new();
        for (uid, _, spec) in self.claim_spec_files()? {
            let Some(spec) = spec.filter(|s| self.annotation(s, "boot-id") == Some(boot_id.as_str())) else {
                continue;
            };
            let claim = self
                .annotation(&spec, "claim-namespace")
                .zip(self.annotation(&spec, "claim-name"))
                .map(|(ns, name)| (ns.to_string(), name.to_string()));
            let device_prefix = format!("{uid}-");
            let devices = spec
                .get("devices")
                .and_then(|d| d.as_array())
                .into_iter()
                .flatten()
                .filter_map(|device| {
                    let name = device.get("name")?.as_str()?.strip_prefix(&device_prefix)?;
                    let env = device
                        .pointer("/containerEdits/env")
                        .and_then(|e| e.as_array())
                        .into_iter()
                        .flatten()
                        .filter_map(|v| v.as_str()?.split_once('='))
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect();
                    Some((name.to_string(), env))
                })
                .collect();
            specs.push(WrittenClaimSpec { uid, claim, devices });
        }
        Ok(specs)
    }

    /// The claim specs of this boot with the claim they name, as (claim UID, `namespace/name`):
    /// how stale-claim collection finds the spec of an `adminAccess` claim (which has no
    /// record) deleted without an unprepare. Unreadable ones are skipped.
    pub fn named_claim_specs(&self) -> Vec<(String, String)> {
        match self.claim_specs_of_this_boot() {
            Ok(specs) => specs
                .into_iter()
                .filter_map(|s| {
                    s.claim
                        .map(|(namespace, name)| (s.uid, format!("{namespace}/{name}")))
                })
                .collect(),
            Err(e) => {
                tracing::warn!(error = %e, "cannot list the claim CDI specs");
                Vec::new()
            }
        }
    }

    /// Hands every claim device the driver's files through the node-wide driver spec. A
    /// writer without it writes claim specs with device nodes only (benchmarks, tests of
    /// the state machine); the plugin always sets it.
    pub fn with_driver(mut self, setup: DriverSetup) -> Self {
        self.driver = Some(Arc::new(DriverSpecState {
            setup,
            cache: Mutex::new((DriverFilesCache::default(), None)),
        }));
        self
    }

    /// Path of the node-wide driver spec.
    pub fn driver_spec_path(&self) -> PathBuf {
        self.spec_dir.join(format!("{}-{DRIVER_CLASS}.json", self.vendor))
    }

    /// The CDI device IDs a prepared claim device hands the runtime: its own and, with a
    /// driver setup, the node-wide driver device.
    pub fn device_ids(&self, claim_uid: &str, device_name: &str) -> Vec<String> {
        let driver = self
            .driver
            .as_ref()
            .map(|_| format!("{}/{DRIVER_CLASS}={DRIVER_DEVICE}", self.vendor));
        std::iter::once(self.device_id(claim_uid, device_name))
            .chain(driver)
            .collect()
    }

    /// Checks that the node can run CUDA containers with driver `driver_version` (control device
    /// nodes, driver libraries) and that the driver spec describes that version's files:
    /// rediscovering after a version change or failure, rewriting when the files changed or the
    /// spec is gone. Called before anything is created for a claim.
    pub fn ensure_driver_spec(&self, driver_version: &str) -> Result<(), CdiError> {
        let Some(driver) = &self.driver else {
            return Ok(());
        };
        let setup = &driver.setup;
        driver_files::create_missing_uvm_nodes(&setup.dev_root, self.majors()?.uvm)?;
        driver_files::check_required_device_nodes(&setup.dev_root, |p| p.exists())?;
        let inputs = DiscoveryInputs {
            driver_root: setup.driver_root.clone(),
            driver_version: driver_version.to_string(),
            kernel_release: setup.kernel_release.clone(),
            host_root: setup.host_root.clone(),
            hook_path: setup.hook_path.clone(),
            arch: LibraryArch::HOST,
        };
        let mut guard = crate::lock(&driver.cache);
        let (cache, written) = &mut *guard;
        let files = cache.get(&inputs)?;
        let path = self.driver_spec_path();
        if written.as_ref().is_some_and(|w| Arc::ptr_eq(w, &files)) && path.exists() {
            return Ok(());
        }
        let spec = Spec {
            cdi_version: CDI_VERSION,
            kind: format!("{}/{DRIVER_CLASS}", self.vendor),
            annotations: BTreeMap::from([(format!("{}/driver-version", self.vendor), files.version.clone())]),
            devices: vec![SpecDevice {
                name: DRIVER_DEVICE.into(),
                container_edits: driver_files::container_edits(&files),
            }],
        };
        self.write_spec(&path, &spec, Durability::AcrossReboots)?;
        tracing::info!(
            path = %path.display(),
            version = %files.version,
            libraries = files.libraries.len(),
            hooks = files.hook.is_some(),
            "wrote the node-wide driver CDI spec"
        );
        *written = Some(files);
        Ok(())
    }

    /// Writes a spec atomically (runtimes read the directory concurrently).
    fn write_spec<E: Serialize>(
        &self,
        path: &Path,
        spec: &Spec<E>,
        durability: Durability,
    ) -> Result<(), CdiError> {
        fs::create_dir_all(&self.spec_dir).map_err(|source| CdiError::Write {
            path: self.spec_dir.clone(),
            source,
        })?;
        let mut bytes = serde_json::to_vec_pretty(spec)?;
        bytes.push(b'\n');
        write_atomically(path, &bytes, SPEC_MODE, durability).map_err(|source| CdiError::Write {
            path: path.to_path_buf(),
            source,
        })
    }

    /// The fully qualified CDI device ID of a claim's device.
    fn device_id(&self, claim_uid: &str, device_name: &str) -> String {
        format!("{}/{CDI_CLASS}={claim_uid}-{device_name}", self.vendor)
    }

    /// Path of a claim's spec file.
    pub fn spec_path(&self, claim_uid: &str) -> PathBuf {
        self.spec_dir
            .join(format!("{}-{CDI_CLASS}_{claim_uid}.json", self.vendor))
    }

    pub fn majors(&self) -> Result<Majors, CdiError> {
        let path = self.proc_root.join("devices");
        let text = fs::read_to_string(&path).map_err(|source| CdiError::Read {
            path: path.clone(),
            source,
        })?;
        let mut majors = Majors {
            uvm: None,
            caps: None,
        };
        let mut in_char = false;
        for line in text.lines().map(str::trim) {
            if line.ends_with(':') {
                in_char = line == "Character devices:";
                continue;
            }
            let Some((major, name)) = line.split_once(char::is_whitespace).filter(|_| in_char) else {
                continue;
            };
            let Ok(major) = major.parse() else { continue };
            match name.trim() {
                "nvidia-uvm" => majors.uvm = Some(major),
                "nvidia-caps" => majors.caps = Some(major),
                _ => {}
            }
        }
        Ok(majors)
    }

    /// Minor and mode of a MIG capability, from the per-instance access file, which exists
    /// only while the instance exists (so a stale minor is never handed out).
    pub fn capability(&self, gpu_minor: u32, gi: u32, ci: Option<u32>) -> Result<(u32, u32), CdiError> {
        let mut path = self
            .proc_root
            .join(format!("driver/nvidia/capabilities/gpu{gpu_minor}/mig/gi{gi}"));
        if let Some(ci) = ci {
            path.push(format!("ci{ci}"));
        }
        path.push("access");
        read_capability(&path)
    }

    /// The device nodes a container needs for a device.
    pub fn device_nodes(&self, device: &ClaimDevice, majors: Majors) -> Result<Vec<DeviceNode>, CdiError> {
        let missing = |what: &str| CdiError::Missing {
            path: self.proc_root.join("devices"),
            what: what.into(),
        };
        // CUDA cannot initialise without unified memory: no node, no device.
        let uvm = majors.uvm.ok_or_else(|| {
            missing("no nvidia-uvm character device: the nvidia-uvm kernel module is not loaded")
        })?;
        let mut nodes = vec![
            char_node(
                format!("/dev/nvidia{}", device.gpu_minor),
                NVIDIA_MAJOR,
                device.gpu_minor,
                0o666,
            ),
            char_node("/dev/nvidiactl".into(), NVIDIA_MAJOR, NVIDIACTL_MINOR, 0o666),
            char_node("/dev/nvidia-uvm".into(), uvm, 0, 0o666),
            char_node("/dev/nvidia-uvm-tools".into(), uvm, 1, 0o666),
        ];
        // As NVIDIA's toolkit: passed on when the host has it (nvidia-modeset loaded), for
        // the programs that open it; CUDA does not need it.
        if self
            .driver
            .as_ref()
            .is_some_and(|d| d.setup.dev_root.join("nvidia-modeset").exists())
        {
            nodes.push(char_node(
                "/dev/nvidia-modeset".into(),
                NVIDIA_MAJOR,
                NVIDIA_MODESET_MINOR,
                0o666,
            ));
        }
        let caps_major = || {
            majors
                .caps
                .ok_or_else(|| missing("no nvidia-caps character device (MIG capabilities unavailable)"))
        };
        let cap_node = |(minor, mode): (u32, u32)| {
            Ok::<_, CdiError>(char_node(
                format!("/dev/nvidia-caps/nvidia-cap{minor}"),
                caps_major()?,
                minor,
                mode,
            ))
        };
        if device.mig_monitor {
            // Readable by everyone.
            let monitor = self.proc_root.join("driver/nvidia/capabilities/mig/monitor");
            nodes.push(cap_node(read_capability(&monitor)?)?);
        }
        if let Some((gi, ci)) = device.mig {
            caps_major()?;
            for ci in [None, Some(ci)] {
                nodes.push(cap_node(self.capability(device.gpu_minor, gi, ci)?)?);
            }
        }
        Ok(nodes)
    }

    /// Writes a claim's spec, naming the claim (UID, namespace and name) and the boot in its
    /// annotations.
    pub fn write_claim_spec(&self, claim: &ClaimRef, devices: &[ClaimDevice]) -> Result<PathBuf, CdiError> {
        let claim_uid = claim.uid.as_str();
        let majors = self.majors()?;
        let devices = devices
            .iter()
            .map(|device| {
                Ok(SpecDevice {
                    name: format!("{claim_uid}-{}", device.device_name),
                    container_edits: ContainerEdits {
                        env: device.env.iter().map(|(k, v)| format!("{k}={v}")).collect(),
                        device_nodes: self.device_nodes(device, majors)?,
                    },
                })
            })
            .collect::<Result<_, CdiError>>()?;
        let mut annotations = BTreeMap::from([
            (format!("{}/claim-uid", self.vendor), claim_uid.to_string()),
            (
                format!("{}/claim-namespace", self.vendor),
                claim.namespace.clone(),
            ),
            (format!("{}/claim-name", self.vendor), claim.name.clone()),
        ]);
        if let Some(boot) = &self.boot_id {
            annotations.insert(self.boot_annotation(), boot.clone());
        }
        let spec = Spec {
            cdi_version: CDI_VERSION,
            kind: format!("{}/{CDI_CLASS}", self.vendor),
            annotations,
            devices,
        };
        let path = self.spec_path(claim_uid);
        self.write_spec(&path, &spec, self.claim_spec_durability())?;
        Ok(path)
    }

    /// Removes a claim's spec; a missing file is fine.
    pub fn remove_claim_spec(&self, claim_uid: &str) -> Result<(), CdiError> {
        remove_file(self.spec_path(claim_uid)).map(|_| ())
    }

    pub fn has_claim_spec(&self, claim_uid: &str) -> bool {
        self.spec_path(claim_uid).exists()
    }
}

/// Removes a spec file; `Ok(false)` when it did not exist.
fn remove_file(path: PathBuf) -> Result<bool, CdiError> {
    match fs::remove_file(&path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(CdiError::Write { path, source }),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn claim(uid: &str) -> ClaimRef {
        ClaimRef {
            namespace: "ns".into(),
            uid: uid.into(),
            name: format!("claim-{uid}"),
        }
    }

    fn proc_root(dir: &Path) {
        fs::write(
            dir.join("devices"),
            "Character devices:\n  1 mem\n195 nvidia\n195 nvidiactl\n510 nvidia-uvm\n508 nvidia-caps\n\nBlock devices:\n  8 sd\n",
        )
        .unwrap();
        let gi = dir.join("driver/nvidia/capabilities/gpu1/mig/gi2");
        fs::create_dir_all(gi.join("ci0")).unwrap();
        fs::write(
            gi.join("access"),
            "DeviceFileMinor: 156\nDeviceFileMode: 292\nDeviceFileModify: 1\n",
        )
        .unwrap();
        fs::write(
            gi.join("ci0/access"),
            "DeviceFileMinor: 157\nDeviceFileMode: 292\nDeviceFileModify: 1\n",
        )
        .unwrap();
    }

    #[test]
    fn specs_an_earlier_boot_left_are_removed_and_this_boots_are_not_synced() {
        let dir = tempfile::tempdir().unwrap();
        proc_root(dir.path());
        let cdi = dir.path().join("cdi");
        let device = || ClaimDevice {
            device_name: "gpu-1-mig-3g40gb-4".into(),
            gpu_minor: 1,
            mig: Some((2, 0)),
            mig_monitor: false,
            env: BTreeMap::new(),
        };
        let before_reboot = CdiWriter::new(&cdi, "gpu.migdra.dev", dir.path()).for_boot("boot-1");
        before_reboot
            .write_claim_spec(&claim("uid-1"), &[device()])
            .unwrap();
        let after_reboot = CdiWriter::new(&cdi, "gpu.migdra.dev", dir.path()).for_boot("boot-2");
        let path = after_reboot
            .write_claim_spec(&claim("uid-2"), &[device()])
            .unwrap();
        assert_eq!(after_reboot.claim_spec_durability(), Durability::ThisBoot);
        // The spec holds the claim's environment: readable by root only.
        assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let spec: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        assert_eq!(spec["annotations"]["gpu.migdra.dev/boot-id"], "boot-2");
        // Torn by a power loss; another driver's spec of the earlier boot; this driver's
        // node-wide driver spec.
        fs::write(
            cdi.join("gpu.migdra.dev-claim_uid-3.json"),
            "{\"cdiVersion\": \"0.6",
        )
        .unwrap();
        let other = r#"{"annotations":{"other.example.com/boot-id":"boot-1"}}"#;
        fs::write(cdi.join("other.example.com-claim_uid-5.json"), other).unwrap();
        fs::write(cdi.join("gpu.migdra.dev-driver.json"), "{}").unwrap();

        assert_eq!(
            after_reboot.remove_specs_of_other_boots().unwrap(),
            ["uid-1", "uid-3"]
        );
        let specs = after_reboot.claim_specs_of_this_boot().unwrap();
        let expected = WrittenClaimSpec {
            uid: "uid-2".into(),
            claim: Some(("ns".into(), "claim-uid-2".into())),
            devices: vec![("gpu-1-mig-3g40gb-4".into(), BTreeMap::new())],
        };
        assert_eq!(specs, [expected]);
        assert!(before_reboot.claim_specs_of_this_boot().unwrap().is_empty());
        let mut left: Vec<String> = fs::read_dir(&cdi)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                "gpu.migdra.dev-claim_uid-2.json",
                "gpu.migdra.dev-driver.json",
                "other.example.com-claim_uid-5.json"
            ]
        );
        // A writer without a boot syncs its specs and removes nothing.
        let unbooted = CdiWriter::new(&cdi, "gpu.migdra.dev", dir.path());
        unbooted.write_claim_spec(&claim("uid-6"), &[device()]).unwrap();
        assert_eq!(unbooted.claim_spec_durability(), Durability::AcrossReboots);
        assert!(unbooted.remove_specs_of_other_boots().unwrap().is_empty());
    }

    #[test]
    fn writes_mig_spec_with_explicit_nodes() {
        let dir = tempfile::tempdir().unwrap();
        proc_root(dir.path());
        let writer = CdiWriter::new(dir.path().join("cdi"), "gpu.migdra.dev", dir.path());
        let device = ClaimDevice {
            device_name: "gpu-1-mig-3g40gb-4".into(),
            gpu_minor: 1,
            mig: Some((2, 0)),
            mig_monitor: false,
            env: BTreeMap::from([("MIGDRA_DEVICE_UUID_GPU_1_MIG_3G40GB_4".into(), "MIG-abc".into())]),
        };
        let path = writer.write_claim_spec(&claim("uid-1"), &[device]).unwrap();
        assert!(path.ends_with("gpu.migdra.dev-claim_uid-1.json"));
        let spec: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        assert_eq!(spec["kind"], "gpu.migdra.dev/claim");
        let dev = &spec["devices"][0];
        assert_eq!(dev["name"], "uid-1-gpu-1-mig-3g40gb-4");
        assert_eq!(
            dev["containerEdits"]["env"][0],
            "MIGDRA_DEVICE_UUID_GPU_1_MIG_3G40GB_4=MIG-abc"
        );
        let nodes = dev["containerEdits"]["deviceNodes"].as_array().unwrap();
        let paths: Vec<&str> = nodes.iter().map(|n| n["path"].as_str().unwrap()).collect();
        assert_eq!(
            paths,
            [
                "/dev/nvidia1",
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools",
                "/dev/nvidia-caps/nvidia-cap156",
                "/dev/nvidia-caps/nvidia-cap157"
            ]
        );
        assert_eq!(nodes[4]["major"], 508);
        assert_eq!(nodes[4]["fileMode"], 292);
        assert_eq!(nodes[2]["major"], 510);
        assert!(nodes.iter().all(|n| n["type"] == "c"));
        assert_eq!(
            writer.device_id("uid-1", "gpu-1"),
            "gpu.migdra.dev/claim=uid-1-gpu-1"
        );
        writer.remove_claim_spec("uid-1").unwrap();
        assert!(!path.exists());
        writer.remove_claim_spec("uid-1").unwrap();
    }

    #[test]
    fn a_monitored_gpu_gets_the_mig_monitor_capability_and_no_instance_capability() {
        let dir = tempfile::tempdir().unwrap();
        proc_root(dir.path());
        let writer = CdiWriter::new(dir.path().join("cdi"), "gpu.migdra.dev", dir.path());
        let device = ClaimDevice {
            device_name: "gpu-1".into(),
            gpu_minor: 1,
            mig: None,
            mig_monitor: true,
            env: BTreeMap::new(),
        };
        // Without the driver's monitor capability file the spec is refused, not made smaller.
        let err = writer
            .write_claim_spec(&claim("uid-m"), std::slice::from_ref(&device))
            .unwrap_err();
        assert!(err.to_string().contains("mig/monitor"), "{err}");
        fs::create_dir_all(dir.path().join("driver/nvidia/capabilities/mig")).unwrap();
        fs::write(
            dir.path().join("driver/nvidia/capabilities/mig/monitor"),
            "DeviceFileMinor: 2\nDeviceFileMode: 292\nDeviceFileModify: 1\n",
        )
        .unwrap();
        let path = writer.write_claim_spec(&claim("uid-m"), &[device]).unwrap();
        let spec: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        let nodes = spec["devices"][0]["containerEdits"]["deviceNodes"]
            .as_array()
            .unwrap();
        let caps: Vec<_> = nodes
            .iter()
            .filter(|n| n["path"].as_str().unwrap().starts_with("/dev/nvidia-caps/"))
            .collect();
        assert_eq!(caps.len(), 1, "{nodes:?}");
        assert_eq!(caps[0]["path"], "/dev/nvidia-caps/nvidia-cap2");
        assert_eq!(caps[0]["major"], 508);
        assert_eq!(caps[0]["minor"], 2);
        assert_eq!(caps[0]["fileMode"], 292);
    }

    #[test]
    fn missing_capability_file_fails_instead_of_guessing() {
        let dir = tempfile::tempdir().unwrap();
        proc_root(dir.path());
        let writer = CdiWriter::new(dir.path().join("cdi"), "gpu.migdra.dev", dir.path());
        let device = ClaimDevice {
            device_name: "gpu-1-mig-1g10gb-0".into(),
            gpu_minor: 1,
            mig: Some((9, 0)),
            mig_monitor: false,
            env: BTreeMap::new(),
        };
        let err = writer.write_claim_spec(&claim("uid-2"), &[device]).unwrap_err();
        assert!(err.to_string().contains("gi9"), "{err}");
        assert!(!writer.has_claim_spec("uid-2"));
    }

    #[test]
    fn no_uvm_major_is_an_error_not_a_smaller_spec() {
        let dir = tempfile::tempdir().unwrap();
        proc_root(dir.path());
        fs::write(
            dir.path().join("devices"),
            "Character devices:\n195 nvidia\n508 nvidia-caps\n",
        )
        .unwrap();
        let writer = CdiWriter::new(dir.path().join("cdi"), "gpu.migdra.dev", dir.path());
        let device = ClaimDevice {
            device_name: "gpu-1".into(),
            gpu_minor: 1,
            mig: None,
            mig_monitor: false,
            env: BTreeMap::new(),
        };
        let err = writer.write_claim_spec(&claim("uid-3"), &[device]).unwrap_err();
        assert!(
            err.to_string()
                .contains("the nvidia-uvm kernel module is not loaded"),
            "{err}"
        );
        assert!(!writer.has_claim_spec("uid-3"));
    }

    #[test]
    fn driver_spec_is_written_once_and_rewritten_when_gone() {
        let dir = tempfile::tempdir().unwrap();
        proc_root(dir.path());
        let version = "580.82.07";
        let root = dir.path().join("driver-root");
        fs::create_dir_all(&root).unwrap();
        migdra_fake_nvml::driver_root::create_driver_root(&root, version, &Default::default()).unwrap();
        // A host running an MPS control daemon: its pipe directory never reaches a spec.
        fs::create_dir_all(root.join("tmp/nvidia-mps")).unwrap();
        fs::write(root.join("tmp/nvidia-mps/control"), b"").unwrap();
        let dev = dir.path().join("dev");
        fs::create_dir_all(&dev).unwrap();
        for name in ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"] {
            fs::write(dev.join(name), b"").unwrap();
        }
        let writer =
            CdiWriter::new(dir.path().join("cdi"), "gpu.migdra.dev", dir.path()).with_driver(DriverSetup {
                driver_root: HostDir {
                    on_host: root.clone(),
                    visible_at: root.clone(),
                },
                host_root: dir.path().join("no-host"),
                hook_path: PathBuf::from(driver_files::DEFAULT_HOOK_PATH),
                dev_root: dev,
                kernel_release: String::new(),
            });
        assert_eq!(
            writer.device_ids("u", "gpu-1"),
            ["gpu.migdra.dev/claim=u-gpu-1", "gpu.migdra.dev/driver=files"]
        );
        writer.ensure_driver_spec(version).unwrap();
        let path = writer.driver_spec_path();
        // An atomic write replaces the file: the same inode means it was not rewritten.
        let inode = |p: &Path| std::os::unix::fs::MetadataExt::ino(&fs::metadata(p).unwrap());
        let first = inode(&path);
        writer.ensure_driver_spec(version).unwrap();
        assert_eq!(inode(&path), first, "unchanged inputs: not rewritten");
        fs::remove_file(&path).unwrap();
        writer.ensure_driver_spec(version).unwrap();
        let text = fs::read_to_string(&path).unwrap();
        assert!(!text.contains("nvidia-mps"), "{text}");
        let spec: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert!(
            !spec["devices"][0]["containerEdits"]["mounts"]
                .as_array()
                .unwrap()
                .is_empty(),
            "the driver's files are mounted"
        );
        assert_eq!(spec["kind"], "gpu.migdra.dev/driver");
        assert_eq!(spec["devices"][0]["name"], DRIVER_DEVICE);
        assert!(
            spec["devices"][0]["containerEdits"]["env"]
                .as_array()
                .unwrap()
                .contains(&serde_json::json!("NVIDIA_VISIBLE_DEVICES=void"))
        );
    }
}
