//! Which NVML calls the plugin makes, and every error code NVML defines: the campaign injects
//! each code on each call. The calls are not listed by hand: a probe run with the fake's call
//! log on walks the plugin through start, prepare (one and two devices, a MIG-mode switch
//! on and off, a whole GPU, adminAccess), the status
//! inventory, stale-claim collection, unprepare, a lost GPU and its return, and a restart,
//! and records every NVML function that was called.

use std::{collections::BTreeMap, sync::OnceLock};

use migdra_fake_nvml::config::{FakeConfig, GpuConfig, InstanceConfig};

use super::scenario::{device_name, profiles};
use crate::plugin::{Node, admin_claim, claim, prepare_one, unprepare_one};

/// Every NVML error code (`nvmlReturn_t` but SUCCESS), with its name.
pub const ERROR_CODES: [(u32, &str); 31] = [
    (1, "UNINITIALIZED"),
    (2, "INVALID_ARGUMENT"),
    (3, "NOT_SUPPORTED"),
    (4, "NO_PERMISSION"),
    (5, "ALREADY_INITIALIZED"),
    (6, "NOT_FOUND"),
    (7, "INSUFFICIENT_SIZE"),
    (8, "INSUFFICIENT_POWER"),
    (9, "DRIVER_NOT_LOADED"),
    (10, "TIMEOUT"),
    (11, "IRQ_ISSUE"),
    (12, "LIBRARY_NOT_FOUND"),
    (13, "FUNCTION_NOT_FOUND"),
    (14, "CORRUPTED_INFOROM"),
    (15, "GPU_IS_LOST"),
    (16, "RESET_REQUIRED"),
    (17, "OPERATING_SYSTEM"),
    (18, "LIB_RM_VERSION_MISMATCH"),
    (19, "IN_USE"),
    (20, "MEMORY"),
    (21, "NO_DATA"),
    (22, "VGPU_ECC_NOT_SUPPORTED"),
    (23, "INSUFFICIENT_RESOURCES"),
    (24, "FREQ_NOT_SUPPORTED"),
    (25, "ARGUMENT_VERSION_MISMATCH"),
    (26, "DEPRECATED"),
    (27, "NOT_READY"),
    (28, "GPU_NOT_FOUND"),
    (29, "INVALID_STATE"),
    (30, "RESET_TYPE_NOT_SUPPORTED"),
    (999, "UNKNOWN"),
];

/// The (function, code) pairs not injected: answers by which NVML says that a thing does
/// not exist, on the calls whose answer the plugin takes as "it does not exist". Real NVML
/// gives them only when that is true (the model's profiles are fixed, an instance that exists
/// is found), and a plugin that believed them would be right; injected while the thing
/// exists, they are a driver lying about the hardware, not a fault to ride out. Every other
/// code on these calls, and every code on every other call, is injected.
pub const ABSENCE_ANSWERS: [(&str, u32, &str); 8] = [
    ("nvmlDeviceGetMigMode", 3, "the GPU is not MIG-capable"),
    (
        "nvmlDeviceGetGpuInstanceProfileInfo",
        2,
        "the driver knows no such profile index",
    ),
    (
        "nvmlDeviceGetGpuInstanceProfileInfo",
        3,
        "the GPU has no such profile",
    ),
    (
        "nvmlDeviceGetGpuInstanceProfileInfoV",
        2,
        "the driver knows no such profile index",
    ),
    (
        "nvmlDeviceGetGpuInstanceProfileInfoV",
        3,
        "the GPU has no such profile",
    ),
    (
        "nvmlDeviceGetGpuInstances",
        3,
        "the profile is not supported, so it has no instances",
    ),
    ("nvmlDeviceGetGpuInstanceById", 6, "no GPU instance has that ID"),
    ("nvmlGpuInstanceDestroy", 6, "the GPU instance is gone"),
];

/// Whether NVML would answer `code` from `function` only if it were true (see
/// [`ABSENCE_ANSWERS`]).
pub fn is_absence_answer(function: &str, code: u32) -> bool {
    ABSENCE_ANSWERS
        .iter()
        .any(|(f, c, _)| *f == function && *c == code)
}

/// The NVML functions the plugin calls, by exported name, and the (function, code) pairs
/// the campaign injects.
#[derive(Clone, Debug)]
pub struct NvmlCalls {
    pub functions: Vec<String>,
    /// Every (function, code) pair but the absence answers, ordered so that consecutive pairs
    /// are on different functions.
    pub injected: Vec<(String, u32, &'static str)>,
    /// The absence answers among the plugin's calls.
    pub excluded: Vec<(String, u32, &'static str)>,
}

impl NvmlCalls {
    fn new(functions: Vec<String>) -> Self {
        let (mut injected, mut excluded) = (Vec::new(), Vec::new());
        for (code, name) in ERROR_CODES {
            for function in &functions {
                let pair = (function.clone(), code, name);
                if is_absence_answer(function, code) {
                    excluded.push(pair);
                } else {
                    injected.push(pair);
                }
            }
        }
        Self {
            functions,
            injected,
            excluded,
        }
    }

    /// How many (function, code) pairs are injected.
    pub fn pairs(&self) -> usize {
        self.injected.len()
    }

    /// Injected pair `i` (modulo the count): `0..pairs()` walks every one once.
    pub fn pair(&self, i: usize) -> (&str, u32, &'static str) {
        let (function, code, name) = &self.injected[i % self.pairs()];
        (function, *code, name)
    }

    /// The calls, learnt once per process.
    pub async fn learn() -> Self {
        static CALLS: OnceLock<NvmlCalls> = OnceLock::new();
        if let Some(calls) = CALLS.get() {
            return calls.clone();
        }
        let calls = probe().await;
        CALLS.get_or_init(|| calls).clone()
    }
}

async fn probe() -> NvmlCalls {
    let models = ["H100-80GB", "A100-SXM4-40GB", "A30-24GB", "H100-80GB"];
    let node = Node::with_config(FakeConfig {
        // GPU 3 starts with MIG off: a MIG claim switches it on, a whole-GPU claim off.
        gpus: models
            .iter()
            .enumerate()
            .map(|(i, m)| GpuConfig::new(m, i != 3))
            .collect(),
        instances: vec![InstanceConfig {
            gpu: 0,
            profile_id: 19,
            start: 6,
        }],
        ..FakeConfig::default()
    });
    node.host
        .update_state(|s| s.call_log = Some(BTreeMap::new()))
        .expect("turn the call log on");
    let device = |gpu: u32, nth: usize| {
        let profiles = profiles(models[gpu as usize]);
        let profile = &profiles[nth % profiles.len()];
        device_name(gpu, profile, profile.starts[0])
    };
    node.claims.put(claim("u1", "c1", &[("gpu", &device(0, 0))]));
    node.claims
        .put(claim("u2", "c2", &[("a", &device(1, 0)), ("b", &device(2, 0))]));
    {
        let (driver, _) = node.start(None);
        prepare_one(&driver, "u1", "c1").await.expect("probe: prepare c1");
        prepare_one(&driver, "u2", "c2").await.expect("probe: prepare c2");
        node.claims.put(claim("u3", "c3", &[("gpu", &device(3, 0))]));
        prepare_one(&driver, "u3", "c3")
            .await
            .expect("probe: prepare c3 (MIG switched on)");
        unprepare_one(&driver, "u3", "c3")
            .await
            .expect("probe: unprepare c3");
        node.claims.put(claim("u4", "c4", &[("gpu", "gpu-3")]));
        prepare_one(&driver, "u4", "c4")
            .await
            .expect("probe: prepare c4 (MIG switched off)");
        node.claims.put(admin_claim("u5", "c5", &[("gpu", "gpu-1")]));
        prepare_one(&driver, "u5", "c5")
            .await
            .expect("probe: prepare c5 (adminAccess)");
        unprepare_one(&driver, "u5", "c5")
            .await
            .expect("probe: unprepare c5");
        unprepare_one(&driver, "u4", "c4")
            .await
            .expect("probe: unprepare c4");
        driver.gpus().inventory().expect("probe: inventory");
        node.claims.remove("default", "c1");
        driver.collect_stale_claims().await;
        node.host
            .update_state(|s| s.gpus[2].lost = true)
            .expect("lose GPU 2");
        unprepare_one(&driver, "u2", "c2")
            .await
            .expect("probe: unprepare on a lost GPU");
        let _ = driver.gpus().inventory();
        node.host
            .update_state(|s| s.gpus[2].lost = false)
            .expect("GPU 2 returns");
        driver
            .gpus()
            .inventory()
            .expect("probe: inventory after the return");
    }
    let (_driver, _) = node.start(None);
    let log = node
        .host
        .read_state()
        .expect("read the call log")
        .call_log
        .unwrap_or_default();
    assert!(
        !log.is_empty(),
        "the fake NVML library at {} kept no call log: it predates the call log (rebuild it, or point {} at a current build)",
        node.host.lib_path().display(),
        migdra_fake_nvml::testing::LIBRARY_ENV
    );
    NvmlCalls::new(log.into_keys().collect())
}
