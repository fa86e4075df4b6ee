//! The fake's configuration file (`fake-nvml.json`): which GPUs exist, where the state and
//! the simulated `/proc` live, and which faults to inject. Read once per `nvmlInit`; the
//! mutable GPU state is created from it on the first init and lives in the state file.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use crate::FakeError;

/// Name of the configuration file the library looks for next to itself.
pub const CONFIG_FILE_NAME: &str = "fake-nvml.json";
/// Environment variable that overrides where the configuration file is.
pub const CONFIG_ENV: &str = "MIGDRA_FAKE_NVML_CONFIG";
/// Default state file name (relative to the configuration's directory).
pub const DEFAULT_STATE_FILE: &str = "fake-nvml-state.json";
/// Default simulated `/proc` directory (relative to the configuration's directory).
pub const DEFAULT_PROC_ROOT: &str = "proc-root";
/// Default driver version; 580.82+ so nvml-wrapper picks its current field-ID scheme.
pub const DEFAULT_DRIVER_VERSION: &str = "580.82.07";
/// Default seed of the deterministic GPU UUIDs.
pub const DEFAULT_UUID_SEED: &str = "migdra-fake-nvml";

/// The whole configuration file.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FakeConfig {
    /// GPU groups, enumerated in order (NVML indexes count up from 0; device minors are the
    /// index unless a group gives its own, see [`GpuConfig::minor`]).
    #[serde(default)]
    pub gpus: Vec<GpuConfig>,
    /// Driver version `nvmlSystemGetDriverVersion` reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_version: Option<String>,
    /// State file; relative paths are relative to the configuration's directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_file: Option<PathBuf>,
    /// Root of the simulated `/proc`; relative paths are relative to the configuration's
    /// directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proc_root: Option<PathBuf>,
    /// Seed of the deterministic GPU UUIDs (two hosts with different seeds get different UUIDs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid_seed: Option<String>,
    /// Faults to inject (copied into the state at first init; edit the state to change them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub faults: Vec<FaultConfig>,
    /// GPU instances that exist before anyone calls NVML (foreign instances); each gets its
    /// full compute instance.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub instances: Vec<InstanceConfig>,
}

/// One GPU, or `count` identical GPUs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuConfig {
    /// A model key of [`crate::model`] (the same keys as migdra's catalog) such as
    /// `H100-80GB`, or one of the fake's non-MIG models (`L4`, `A10`, `T4`).
    pub model: String,
    /// Whether MIG mode is on at first init.
    #[serde(default)]
    pub mig_enabled: bool,
    /// How many GPUs of this kind (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u32>,
    /// Device minor (`/dev/nvidia<minor>`, `nvmlDeviceGetMinorNumber`) of the group's first
    /// GPU; the group's other GPUs count up from it. Default: each GPU's NVML index. Real
    /// machines number indexes by PCI bus order, and minors can differ from them
    /// (`shared/reference/mig-nvml.md` §12). Minors must be unique on the host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<u32>,
    /// Number GPU-instance IDs with the two halves swapped, as some boards do.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub swap_halves: bool,
    /// Reports the GPU as not MIG-capable even if its model is (GetMigMode: NOT_SUPPORTED).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_capable: Option<bool>,
    /// NUMA node (default: lower half of the GPUs on node 0, upper half on node 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    /// Auto-placement preference per GPU-instance profile ID (starts in order), overriding
    /// the defaults of `nvmlDeviceCreateGpuInstance`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub auto_placement: BTreeMap<u32, Vec<u32>>,
    /// How this GPU's driver differs from the default simulation (documented NVML behaviour
    /// that varies by platform, driver or board).
    #[serde(default, skip_serializing_if = "GpuQuirks::is_default")]
    pub quirks: GpuQuirks,
}

/// What the compute-instance info's `device` field holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum CiInfoDevice {
    /// The MIG device handle (what NVIDIA's DRA driver relies on, on H100s).
    #[default]
    MigDevice,
    /// The parent GPU's handle (what `nvml.h` documents for the field).
    Parent,
}

/// Per-GPU deviations from the default simulation. Every one models something the reference
/// (`shared/reference/mig-nvml.md` §6, §10, §12) says real NVML may do.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuQuirks {
    /// What `nvmlComputeInstanceGetInfo[_v2]` puts in `device` (§12: unverified either way).
    #[serde(default, skip_serializing_if = "is_default")]
    pub ci_info_device: CiInfoDevice,
    /// The GPU cannot be reset by the driver (pass-through VM): enabling MIG on Ampere stays
    /// pending with activation status RESET_REQUIRED (§12).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_driver_reset: bool,
    /// Device minor the GPU has after its MIG mode changed (§12: "the minor may change").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor_after_mode_change: Option<u32>,
    /// `nvmlDeviceGetVirtualizationMode` answer (0 none, 1 pass-through, 2 vGPU guest,
    /// 3 vGPU host, 4 vSGA host).
    #[serde(default, skip_serializing_if = "is_default")]
    pub virtualization_mode: u32,
    /// `nvmlDeviceGetArchitecture` answer instead of the model's (e.g. a newer one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<u32>,
    /// CI profile index 8 (`7_SLICE_NVL`) is supported for 7-slice GPU instances (it is
    /// NOT_SUPPORTED by default, as on A100; §3, §11 rule 7).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ci_7_slice_nvl: bool,
    /// GPU-instance profile indexes by profile ID, instead of the model's: a driver newer than
    /// nvml.h v13 may number profiles past `NVML_GPU_INSTANCE_PROFILE_COUNT`. Indexes up to the
    /// highest one given are valid (NOT_SUPPORTED where no profile sits), the next is
    /// INVALID_ARGUMENT.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub profile_indexes: BTreeMap<u32, u32>,
    /// Names the versioned profile infos report (`MIG <name>`), by GPU-instance profile ID,
    /// instead of the model's: drivers' names drift (§12 "Profile names").
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub profile_names: BTreeMap<u32, String>,
    /// PCI device ID and product name reported instead of the model's: a board whose MIG
    /// tables are the model's but which a catalog may not know (a new SKU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_device_id: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub product_name: Option<String>,
}

fn is_default<T: Default + PartialEq>(value: &T) -> bool {
    *value == T::default()
}

impl GpuQuirks {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

impl GpuConfig {
    /// A single GPU of `model` with MIG on or off.
    pub fn new(model: &str, mig_enabled: bool) -> Self {
        Self {
            model: model.to_string(),
            mig_enabled,
            count: None,
            minor: None,
            swap_halves: false,
            mig_capable: None,
            numa_node: None,
            auto_placement: BTreeMap::new(),
            quirks: GpuQuirks::default(),
        }
    }

    /// The same GPU with device minor `minor` (instead of its NVML index).
    pub fn with_minor(mut self, minor: u32) -> Self {
        self.minor = Some(minor);
        self
    }

    /// The same GPU with `quirks`.
    pub fn with_quirks(mut self, quirks: GpuQuirks) -> Self {
        self.quirks = quirks;
        self
    }
}

/// A fault: calls to `function` (on GPU `gpu`, if given) wait `latency_ms` and/or fail with
/// `error`, `times` times (always when absent). `function` `"*"` matches every function.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FaultConfig {
    /// Exported NVML function name, e.g. `nvmlDeviceCreateGpuInstanceWithPlacement`, or `*`.
    pub function: String,
    /// Only calls concerning this GPU index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<u32>,
    /// Only calls whose profile argument equals this: the profile **ID** for calls that take
    /// one (`nvmlDeviceGetGpuInstances`, `…PossiblePlacements_v2`, …), the profile **index**
    /// for the calls that take an index (`nvmlDeviceGetGpuInstanceProfileInfo[V]`,
    /// `nvmlGpuInstanceGetComputeInstanceProfileInfo[V]`). Calls without a profile argument
    /// never match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<u32>,
    /// NVML return code to fail with (none: the call goes through after the latency).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<u32>,
    /// Delay before the call, in milliseconds. A call already waiting ends its wait early
    /// when the fault is removed from the state or its latency lowered (a hang a test ends).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<u64>,
    /// How many calls the fault hits (absent: every call).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub times: Option<u32>,
}

impl FaultConfig {
    /// A fault that fails every call of `function` with `error`.
    pub fn error(function: &str, error: u32) -> Self {
        Self {
            function: function.to_string(),
            gpu: None,
            profile: None,
            error: Some(error),
            latency_ms: None,
            times: None,
        }
    }

    /// A fault that delays every call of `function` by `latency_ms`.
    pub fn latency(function: &str, latency_ms: u64) -> Self {
        Self {
            function: function.to_string(),
            gpu: None,
            profile: None,
            error: None,
            latency_ms: Some(latency_ms),
            times: None,
        }
    }

    /// Limits the fault to `times` calls.
    pub fn times(mut self, times: u32) -> Self {
        self.times = Some(times);
        self
    }

    /// Limits the fault to calls about one profile ID (or index; see [`FaultConfig::profile`]).
    pub fn on_profile(mut self, profile: u32) -> Self {
        self.profile = Some(profile);
        self
    }

    /// Limits the fault to one GPU.
    pub fn on_gpu(mut self, gpu: u32) -> Self {
        self.gpu = Some(gpu);
        self
    }
}

/// A GPU instance that exists at first init.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstanceConfig {
    /// GPU index.
    pub gpu: u32,
    /// GPU-instance profile **ID**.
    pub profile_id: u32,
    /// Placement start.
    pub start: u32,
}

impl FakeConfig {
    /// Reads and parses a configuration file.
    pub fn load(path: &Path) -> Result<Self, FakeError> {
        let text = std::fs::read_to_string(path).map_err(|e| FakeError::io(path, e))?;
        serde_json::from_str(&text).map_err(|e| FakeError::Parse {
            path: path.to_path_buf(),
            source: e,
        })
    }

    /// The state file path, resolved against the configuration's directory.
    pub fn state_path(&self, config_dir: &Path) -> PathBuf {
        config_dir.join(
            self.state_file
                .as_deref()
                .unwrap_or(Path::new(DEFAULT_STATE_FILE)),
        )
    }

    /// The simulated `/proc` root, resolved against the configuration's directory.
    pub fn proc_root(&self, config_dir: &Path) -> PathBuf {
        config_dir.join(self.proc_root.as_deref().unwrap_or(Path::new(DEFAULT_PROC_ROOT)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_format() {
        let config: FakeConfig = serde_json::from_str(
            r#"{
                "gpus": [{"model": "H100-80GB", "migEnabled": true, "count": 2, "swapHalves": true},
                         {"model": "A100-SXM4-40GB", "migEnabled": false, "minor": 5, "autoPlacement": {"19": [0, 1]}}],
                "driverVersion": "570.1.2",
                "stateFile": "s.json",
                "faults": [{"function": "nvmlDeviceCreateGpuInstanceWithPlacement", "gpu": 1,
                            "error": 23, "latencyMs": 5, "times": 2}],
                "instances": [{"gpu": 0, "profileId": 9, "start": 4}]
            }"#,
        )
        .unwrap();
        assert_eq!(config.gpus[0].count, Some(2));
        assert!(config.gpus[0].swap_halves);
        assert_eq!(config.gpus[1].auto_placement[&19], vec![0, 1]);
        assert_eq!((config.gpus[0].minor, config.gpus[1].minor), (None, Some(5)));
        assert_eq!(config.faults[0].times, Some(2));
        assert_eq!(config.instances[0].profile_id, 9);
        assert_eq!(config.state_path(Path::new("/x")), PathBuf::from("/x/s.json"));
        assert_eq!(config.proc_root(Path::new("/x")), PathBuf::from("/x/proc-root"));
    }

    #[test]
    fn rejects_misspelt_fields() {
        assert!(
            serde_json::from_str::<FakeConfig>(r#"{"gpus": [{"model": "B200", "migEnable": true}]}"#)
                .is_err()
        );
    }
}
