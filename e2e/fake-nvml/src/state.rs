//! The simulated GPUs' mutable state and its file.
//!
//! Everything a real GPU would remember (MIG mode, GPU and compute instances, who holds it)
//! lives in one JSON file. Every access takes an exclusive `flock` on a lock file next to
//! it, reads, mutates and writes atomically (tempfile + rename), so several processes that
//! load the fake see one GPU and the state survives a process restart.

use std::{
    collections::BTreeMap,
    fs::{File, OpenOptions},
    io::Write,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use crate::{
    FakeError,
    config::{DEFAULT_DRIVER_VERSION, DEFAULT_UUID_SEED, FakeConfig, FaultConfig, GpuQuirks},
    model::FakeModel,
    procfs,
};

/// Format version of the state file.
pub const STATE_VERSION: u32 = 1;

/// The state of every simulated GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FakeState {
    /// Format version.
    pub version: u32,
    /// Driver version the library reports.
    pub driver_version: String,
    /// Root of the simulated `/proc` the library maintains.
    pub proc_root: PathBuf,
    /// Next creation serial (GPU and compute instances); serials never repeat, which is how
    /// stale handles are detected.
    pub next_serial: u64,
    /// GPUs in NVML index order.
    pub gpus: Vec<GpuState>,
    /// Injected faults with their hit counters.
    #[serde(default)]
    pub faults: Vec<FaultState>,
    /// When present, every call that goes through fault injection is counted here by exported
    /// function name (tests turn it on to learn which NVML calls a client makes). Absent by
    /// default: counting writes the state on every call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call_log: Option<BTreeMap<String, u64>>,
    /// How often the driver was reloaded (a reboot, [`FakeState::reload_driver`]). A call held
    /// by a latency fault across a reload returns without acting: on a node the reboot ends it
    /// with its process.
    #[serde(default)]
    pub driver_loads: u64,
    /// How often the kernel driver was upgraded under running processes (no reboot). An NVML
    /// session initialised before an upgrade gets NVML_ERROR_LIB_RM_VERSION_MISMATCH from every
    /// call until it shuts down and initialises again, as a process that keeps the old
    /// user-space library does.
    #[serde(default)]
    pub driver_upgrades: u64,
}

/// One GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuState {
    /// NVML index.
    pub index: u32,
    /// Device minor (`/dev/nvidia<minor>`).
    pub minor: u32,
    /// `GPU-…` UUID.
    pub uuid: String,
    /// Model key (see [`FakeModel::lookup`]).
    pub model: String,
    /// PCI bus number (domain 0, device 0, function 0).
    pub pci_bus: u32,
    /// NUMA node.
    pub numa_node: u32,
    /// Whether MIG calls work at all (GetMigMode answers NOT_SUPPORTED otherwise).
    pub mig_capable: bool,
    /// GPU-instance IDs number the halves swapped.
    #[serde(default)]
    pub swap_halves: bool,
    /// Current MIG mode.
    pub mig_enabled: bool,
    /// Pending MIG mode (differs from the current one on Ampere until a reset).
    pub mig_pending: bool,
    /// A simulated client (another process) holds the GPU: mode changes and GPU-instance
    /// creation answer IN_USE.
    #[serde(default)]
    pub client_holds_gpu: bool,
    /// Other processes that hold the GPU: each blocks MIG-mode switches (IN_USE in the
    /// activation status) as `client_holds_gpu` does, and the process queries list the
    /// compute and graphics ones.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clients: Vec<GpuClient>,
    /// The GPU fell off the bus: every call concerning it answers GPU_IS_LOST.
    #[serde(default)]
    pub lost: bool,
    /// Auto-placement preference per GPU-instance profile ID (overrides the defaults).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub auto_placement: BTreeMap<u32, Vec<u32>>,
    /// How this GPU's driver deviates from the default simulation.
    #[serde(default)]
    pub quirks: GpuQuirks,
    /// GPU instances.
    #[serde(default)]
    pub gpu_instances: Vec<GpuInstanceState>,
}

/// Another process that holds a GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuClient {
    /// Process ID; its name is `<procRoot>/<pid>/comm`.
    pub pid: u32,
    /// What `/proc/<pid>/comm` holds (at most 15 bytes on Linux).
    pub name: String,
    pub kind: ClientKind,
    /// GPU memory it uses (MiB), as the process queries report it.
    #[serde(default)]
    pub used_memory_mib: u64,
}

/// How a client holds the GPU, which decides where NVML shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClientKind {
    /// An NVML session with the device open (nv-hostengine, dcgm-exporter, a second plugin
    /// pod): no GPU context, so no process query lists it.
    NvmlSession,
    /// A CUDA context: `nvmlDeviceGetComputeRunningProcesses` lists it.
    Compute,
    /// A graphics context: `nvmlDeviceGetGraphicsRunningProcesses` lists it.
    Graphics,
}

impl GpuClient {
    /// An NVML session such as DCGM's `nv-hostengine`.
    pub fn nvml_session(pid: u32, name: &str) -> Self {
        Self {
            pid,
            name: name.to_string(),
            kind: ClientKind::NvmlSession,
            used_memory_mib: 0,
        }
    }

    /// A process with a CUDA context using `used_memory_mib` of GPU memory.
    pub fn compute(pid: u32, name: &str, used_memory_mib: u64) -> Self {
        Self {
            pid,
            name: name.to_string(),
            kind: ClientKind::Compute,
            used_memory_mib,
        }
    }
}

/// One GPU instance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuInstanceState {
    /// GPU-instance ID.
    pub id: u32,
    /// GPU-instance profile ID.
    pub profile_id: u32,
    /// Placement start (memory slices).
    pub start: u32,
    /// Placement size (memory slices).
    pub size: u32,
    /// Creation serial.
    pub serial: u64,
    /// A simulated process uses the GPU instance directly: destroy answers IN_USE.
    #[serde(default)]
    pub busy: bool,
    /// Compute instances.
    #[serde(default)]
    pub compute_instances: Vec<ComputeInstanceState>,
}

/// One compute instance (one MIG device).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ComputeInstanceState {
    /// Compute-instance ID within its GPU instance.
    pub id: u32,
    /// Compute-instance profile ID (equal to its index).
    pub profile_id: u32,
    /// Placement start (compute slices within the GPU instance).
    pub start: u32,
    /// Placement size (compute slices).
    pub size: u32,
    /// `MIG-…` UUID, fresh for every creation.
    pub uuid: String,
    /// Creation serial.
    pub serial: u64,
    /// A simulated process runs on it: destroy answers IN_USE.
    #[serde(default)]
    pub busy: bool,
}

/// An injected fault and how often it fired.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FaultState {
    /// The fault.
    pub fault: FaultConfig,
    /// Calls it has hit so far.
    #[serde(default)]
    pub hits: u32,
}

impl FaultState {
    /// Whether the fault concerns a call of `function` on `gpu` about `profile` (however often
    /// it has fired).
    pub fn matches(&self, function: &str, gpu: Option<u32>, profile: Option<u32>) -> bool {
        (self.fault.function == function || self.fault.function == "*")
            && (self.fault.gpu.is_none() || self.fault.gpu == gpu)
            && (self.fault.profile.is_none() || self.fault.profile == profile)
    }
}

impl FakeState {
    /// Builds the initial state from a configuration: GPUs in order, then the configured
    /// pre-existing instances (each with its full compute instance).
    pub fn from_config(config: &FakeConfig, proc_root: &Path) -> Result<Self, FakeError> {
        let seed = config.uuid_seed.as_deref().unwrap_or(DEFAULT_UUID_SEED);
        let total: u32 = config.gpus.iter().map(|g| g.count.unwrap_or(1)).sum();
        let mut gpus = Vec::new();
        for gpu in &config.gpus {
            let model = FakeModel::lookup(&gpu.model).ok_or_else(|| {
                FakeError::Config(format!(
                    "unknown GPU model {:?}; known: {}",
                    gpu.model,
                    FakeModel::keys().join(", ")
                ))
            })?;
            let mig_capable = model.mig.is_some() && gpu.mig_capable.unwrap_or(true);
            for nth in 0..gpu.count.unwrap_or(1) {
                let index =
                    u32::try_from(gpus.len()).map_err(|_| FakeError::Config("too many GPUs".into()))?;
                let minor = match gpu.minor {
                    Some(first) => first.checked_add(nth).ok_or_else(|| {
                        FakeError::Config(format!("device minor {first} + {nth} overflows"))
                    })?,
                    None => index,
                };
                if let Some(other) = gpus.iter().find(|g: &&GpuState| g.minor == minor) {
                    return Err(FakeError::Config(format!(
                        "device minor {minor} is given to GPU {} and GPU {index}; minors must be unique",
                        other.index
                    )));
                }
                let enabled = mig_capable && gpu.mig_enabled;
                gpus.push(GpuState {
                    index,
                    minor,
                    uuid: gpu_uuid(seed, index),
                    model: model.key.to_string(),
                    pci_bus: pci_bus(index),
                    numa_node: gpu
                        .numa_node
                        .unwrap_or(if total > 1 && index >= total / 2 { 1 } else { 0 }),
                    mig_capable,
                    swap_halves: gpu.swap_halves,
                    mig_enabled: enabled,
                    mig_pending: enabled,
                    client_holds_gpu: false,
                    clients: Vec::new(),
                    lost: false,
                    auto_placement: gpu.auto_placement.clone(),
                    quirks: gpu.quirks.clone(),
                    gpu_instances: Vec::new(),
                });
            }
        }
        let mut state = FakeState {
            version: STATE_VERSION,
            driver_version: config
                .driver_version
                .clone()
                .unwrap_or_else(|| DEFAULT_DRIVER_VERSION.to_string()),
            proc_root: proc_root.to_path_buf(),
            next_serial: 1,
            gpus,
            faults: config
                .faults
                .iter()
                .map(|f| FaultState {
                    fault: f.clone(),
                    hits: 0,
                })
                .collect(),
            call_log: None,
            driver_loads: 0,
            driver_upgrades: 0,
        };
        for instance in &config.instances {
            state
                .create_full_instance(instance.gpu, instance.profile_id, instance.start)
                .map_err(|code| {
                    FakeError::Config(format!(
                        "pre-created instance {instance:?} cannot be created: NVML error {code}"
                    ))
                })?;
        }
        Ok(state)
    }

    /// Takes a fresh creation serial.
    pub fn take_serial(&mut self) -> u64 {
        let serial = self.next_serial;
        self.next_serial += 1;
        serial
    }

    /// Creates a GPU instance at a placement plus its full compute instance, as an admin with
    /// nvidia-smi would (`-cgi <id> -C`). Returns the (GI ID, CI ID).
    pub fn create_full_instance(&mut self, gpu: u32, profile_id: u32, start: u32) -> Result<(u32, u32), u32> {
        let gi_serial = self.take_serial();
        let ci_serial = self.take_serial();
        let g = self
            .gpus
            .get_mut(gpu as usize)
            .ok_or(crate::code::INVALID_ARGUMENT)?;
        let gi = g.create_gpu_instance(profile_id, Some(start), gi_serial)?;
        let slices = g
            .gpu_instance_by_serial(gi_serial)
            .and_then(|gi| g.gi_profile(gi.profile_id))
            .map(|p| p.compute_slices);
        let ci_profile = slices.and_then(crate::sim::full_compute_instance_profile);
        let ci = ci_profile
            .ok_or(crate::code::NOT_SUPPORTED)
            .and_then(|p| g.create_compute_instance(gi_serial, p, ci_serial, new_mig_uuid()));
        match ci {
            Ok(ci) => Ok((gi, ci)),
            Err(code) => {
                g.gpu_instances.retain(|i| i.serial != gi_serial);
                Err(code)
            }
        }
    }

    /// Simulates a GPU reset: pending MIG mode takes effect (Ampere), every GPU and compute
    /// instance is gone (their configuration never survives a reset), clients are gone.
    pub fn reset_gpu(&mut self, gpu: u32) {
        if let Some(g) = self.gpus.get_mut(gpu as usize) {
            g.mig_enabled = g.mig_pending;
            g.gpu_instances.clear();
            g.client_holds_gpu = false;
            g.clients.clear();
            g.lost = false;
        }
    }

    /// Simulates a driver reload or reboot: instances are gone; Ampere applies its pending
    /// mode (it persists), Hopper and later lose MIG mode.
    pub fn reload_driver(&mut self) {
        self.driver_loads += 1;
        for g in &mut self.gpus {
            let switchable = g
                .fake_model()
                .is_some_and(|m| m.mig.is_some() && m.mig_mode_switchable());
            if switchable {
                g.mig_pending = false;
            }
            g.mig_enabled = g.mig_pending;
            g.gpu_instances.clear();
            g.client_holds_gpu = false;
            g.clients.clear();
            g.lost = false;
        }
    }

    /// Finds a compute instance by `MIG-` UUID: (GPU index, GI ID, CI ID).
    pub fn find_mig_uuid(&self, uuid: &str) -> Option<(u32, u32, u32)> {
        self.gpus.iter().find_map(|g| {
            g.gpu_instances.iter().find_map(|gi| {
                gi.compute_instances
                    .iter()
                    .find(|ci| ci.uuid == uuid)
                    .map(|ci| (g.index, gi.id, ci.id))
            })
        })
    }
}

/// A fresh random MIG UUID.
pub fn new_mig_uuid() -> String {
    format!("MIG-{}", uuid::Uuid::new_v4())
}

/// The deterministic UUID of GPU `index` under `seed`.
pub fn gpu_uuid(seed: &str, index: u32) -> String {
    let name = format!("{seed}/gpu/{index}");
    format!(
        "GPU-{}",
        uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, name.as_bytes())
    )
}

/// PCI bus numbers of a DGX-style 8-GPU board, then counting up.
fn pci_bus(index: u32) -> u32 {
    const BUSES: [u32; 8] = [0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD];
    BUSES.get(index as usize).copied().unwrap_or(0xC0 + index)
}

fn lock_path(state_path: &Path) -> PathBuf {
    let mut name = state_path
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(".lock");
    state_path.with_file_name(name)
}

/// An exclusive lock on a state file, held until dropped.
struct StateLock {
    file: File,
}

impl StateLock {
    fn acquire(state_path: &Path) -> Result<Self, FakeError> {
        let path = lock_path(state_path);
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| FakeError::io(&path, e))?;
        // std's lock is flock(LOCK_EX) on Linux: exclusive across processes and across
        // separately opened descriptors within one process.
        file.lock().map_err(|e| FakeError::io(&path, e))?;
        Ok(Self { file })
    }
}

impl Drop for StateLock {
    fn drop(&mut self) {
        let _ = self.file.unlock();
    }
}

fn load(state_path: &Path) -> Result<(FakeState, String), FakeError> {
    let text = std::fs::read_to_string(state_path).map_err(|e| FakeError::io(state_path, e))?;
    let state = serde_json::from_str(&text).map_err(|e| FakeError::Parse {
        path: state_path.to_path_buf(),
        source: e,
    })?;
    Ok((state, text))
}

fn store(state_path: &Path, state: &FakeState, text: &str) -> Result<(), FakeError> {
    let dir = state_path.parent().unwrap_or(Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(|e| FakeError::io(dir, e))?;
    tmp.write_all(text.as_bytes())
        .map_err(|e| FakeError::io(tmp.path(), e))?;
    tmp.persist(state_path)
        .map_err(|e| FakeError::io(state_path, e.error))?;
    procfs::sync(state)
}

fn serialize(state: &FakeState) -> Result<String, FakeError> {
    serde_json::to_string_pretty(state).map_err(|e| FakeError::Config(format!("serialize state: {e}")))
}

/// Creates the state file from `config` unless it exists already, and (re)writes the static
/// `/proc` files. Returns whether it was created.
pub fn ensure_state(config: &FakeConfig, config_dir: &Path) -> Result<bool, FakeError> {
    let state_path = config.state_path(config_dir);
    if let Some(dir) = state_path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| FakeError::io(dir, e))?;
    }
    let _lock = StateLock::acquire(&state_path)?;
    if state_path.exists() {
        let (state, _) = load(&state_path)?;
        procfs::write_static(&state)?;
        procfs::sync(&state)?;
        return Ok(false);
    }
    let state = FakeState::from_config(config, &config.proc_root(config_dir))?;
    procfs::write_static(&state)?;
    store(&state_path, &state, &serialize(&state)?)?;
    Ok(true)
}

/// Reads the state under the lock.
pub fn read_state(state_path: &Path) -> Result<FakeState, FakeError> {
    let _lock = StateLock::acquire(state_path)?;
    Ok(load(state_path)?.0)
}

/// Runs `f` on the state under the lock and writes the result back (only if it changed),
/// keeping the simulated `/proc` in step.
pub fn update_state<T>(state_path: &Path, f: impl FnOnce(&mut FakeState) -> T) -> Result<T, FakeError> {
    let _lock = StateLock::acquire(state_path)?;
    let (mut state, before) = load(state_path)?;
    let out = f(&mut state);
    let after = serialize(&state)?;
    if after != before {
        store(state_path, &state, &after)?;
    }
    Ok(out)
}
