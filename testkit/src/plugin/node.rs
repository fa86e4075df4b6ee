//! A simulated GPU node (the fake NVML library loaded by the production `NvmlBackend`, a
//! state dir, a CDI dir and a claim store) and the calls tests make on its driver.

use std::{path::PathBuf, sync::Arc, time::Duration};

use dra_kubelet::{DraDriver, PrepareOutcome, UnprepareOutcome};
use migdra_fake_nvml::{
    config::{FakeConfig, GpuConfig, InstanceConfig},
    driver_root::{DriverRootOptions, create_driver_root},
    testing::FakeGpuHost,
};
use migdra_kubelet_plugin::{
    cdi::{CdiWriter, DriverSetup},
    driver::{Driver, DriverConfig, DriverError, PrepareResult, RecoveryReport, StepHook, UnprepareResult},
    driver_files::HostDir,
    events::{ClaimEvent, ClaimEvents},
    metrics::Metrics,
    nvml::{GpuBackend, NvmlBackend},
};

use super::{DRIVER, HOOK_PATH, NODE, StaticClaims, claim_ref};

/// The driver the tests run: production code over the fake NVML library.
pub type TestDriver = Driver<StaticClaims>;

/// A node: simulated GPUs, a state dir, a CDI dir and a claim store.
pub struct Node {
    pub host: FakeGpuHost,
    pub dir: tempfile::TempDir,
    pub claims: StaticClaims,
    pub boot_id: String,
    /// The drivers' NVML call timeout.
    pub nvml_call_timeout: Duration,
}

impl Node {
    pub fn new(gpus: &[(&str, bool)]) -> Self {
        Self::from_host(FakeGpuHost::with_gpus(gpus).unwrap())
    }

    pub fn with_config(config: FakeConfig) -> Self {
        Self::from_host(FakeGpuHost::new(config).unwrap())
    }

    /// Two H100s, GPU 0 holding someone else's 1g.10gb (profile 19) at start 6: an instance
    /// the driver must never touch.
    pub fn two_h100s_with_a_foreign_1g() -> Self {
        Self::with_config(FakeConfig {
            gpus: vec![
                GpuConfig::new("H100-80GB", true),
                GpuConfig::new("H100-80GB", true),
            ],
            instances: vec![InstanceConfig {
                gpu: 0,
                profile_id: 19,
                start: 6,
            }],
            ..FakeConfig::default()
        })
    }

    fn from_host(host: FakeGpuHost) -> Self {
        let node = Self {
            host,
            dir: tempfile::tempdir().unwrap(),
            claims: StaticClaims::default(),
            boot_id: "boot-1".into(),
            nvml_call_timeout: Duration::from_secs(20),
        };
        // A driver installation of the version the fake NVML reports, the control device
        // nodes (existence is all that is checked) and the hook on the "host".
        let version = node.driver_version();
        std::fs::create_dir_all(node.driver_root()).unwrap();
        create_driver_root(&node.driver_root(), &version, &DriverRootOptions::default()).unwrap();
        std::fs::create_dir_all(node.dev_root()).unwrap();
        for name in ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"] {
            std::fs::write(node.dev_root().join(name), b"").unwrap();
        }
        let hook = node.host_root().join(HOOK_PATH.trim_start_matches('/'));
        std::fs::create_dir_all(hook.parent().unwrap()).unwrap();
        std::fs::write(&hook, b"#!/bin/sh\nexit 0\n").unwrap();
        std::fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        node
    }

    /// The driver version the fake NVML reports.
    pub fn driver_version(&self) -> String {
        self.host.read_state().unwrap().driver_version
    }

    /// The fake driver root (seen at its "host" path).
    pub fn driver_root(&self) -> PathBuf {
        self.dir.path().join("driver-root")
    }

    /// The fake host's `/dev`.
    pub fn dev_root(&self) -> PathBuf {
        self.dir.path().join("dev")
    }

    /// The fake host's `/` (holds the hook).
    pub fn host_root(&self) -> PathBuf {
        self.dir.path().join("host")
    }

    /// Where the plugin finds the driver.
    fn driver_setup(&self) -> DriverSetup {
        DriverSetup {
            driver_root: HostDir {
                on_host: self.driver_root(),
                visible_at: self.driver_root(),
            },
            host_root: self.host_root(),
            hook_path: PathBuf::from(HOOK_PATH),
            dev_root: self.dev_root(),
            kernel_release: "6.8.0-test".into(),
        }
    }

    /// The node-wide driver spec.
    pub fn driver_spec(&self) -> serde_json::Value {
        let path = self.cdi().driver_spec_path();
        serde_json::from_slice(&std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
            .unwrap()
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    pub fn cdi_dir(&self) -> PathBuf {
        self.dir.path().join("cdi")
    }

    pub fn cdi(&self) -> CdiWriter {
        CdiWriter::new(self.cdi_dir(), DRIVER, self.host.proc_root()).with_driver(self.driver_setup())
    }

    /// Starts a plugin process' driver (a new NVML session each time, as after a restart).
    pub fn start(&self, hook: Option<StepHook>) -> (TestDriver, RecoveryReport) {
        self.try_start(hook).expect("driver start")
    }

    pub fn try_start(&self, hook: Option<StepHook>) -> Result<(TestDriver, RecoveryReport), DriverError> {
        self.try_start_with(hook, Metrics::new())
    }

    /// Starts a driver that counts into `metrics`.
    pub fn try_start_with(
        &self,
        hook: Option<StepHook>,
        metrics: Metrics,
    ) -> Result<(TestDriver, RecoveryReport), DriverError> {
        self.start_over(Arc::new(self.nvml()), hook, metrics)
    }

    /// A new NVML session on the fake library.
    pub fn nvml(&self) -> NvmlBackend {
        NvmlBackend::new(Some(&self.host.lib_path())).expect("load the fake NVML")
    }

    /// Starts a driver over `backend` (one wrapping [`Node::nvml`]).
    pub fn start_over(
        &self,
        backend: Arc<dyn GpuBackend>,
        hook: Option<StepHook>,
        metrics: Metrics,
    ) -> Result<(TestDriver, RecoveryReport), DriverError> {
        let config = DriverConfig {
            driver_name: DRIVER.into(),
            node_name: NODE.into(),
            state_dir: self.state_dir(),
            boot_id: self.boot_id.clone(),
            lock_timeout: Duration::from_secs(2),
            nvml_call_timeout: self.nvml_call_timeout,
        };
        Driver::start(config, backend, self.claims.clone(), self.cdi(), hook, metrics)
    }

    /// GPU instances on GPU `index`: (profile ID, start, compute-instance UUIDs).
    pub fn instances(&self, index: usize) -> Vec<(u32, u32, Vec<String>)> {
        let state = self.host.read_state().unwrap();
        state.gpus[index]
            .gpu_instances
            .iter()
            .map(|gi| {
                (
                    gi.profile_id,
                    gi.start,
                    gi.compute_instances.iter().map(|c| c.uuid.clone()).collect(),
                )
            })
            .collect()
    }

    pub fn total_instances(&self) -> usize {
        self.host
            .read_state()
            .unwrap()
            .gpus
            .iter()
            .map(|g| g.gpu_instances.len())
            .sum()
    }

    /// The claims' CDI specs (not the node-wide driver spec, which stays).
    pub fn cdi_specs(&self) -> Vec<PathBuf> {
        let driver_spec = self.cdi().driver_spec_path();
        match std::fs::read_dir(self.cdi_dir()) {
            Ok(entries) => entries
                .map(|e| e.unwrap().path())
                .filter(|p| !p.file_name().unwrap().to_string_lossy().starts_with('.'))
                .filter(|p| *p != driver_spec)
                .collect(),
            Err(_) => Vec::new(),
        }
    }

    pub fn cdi_spec(&self, uid: &str) -> serde_json::Value {
        let path = self.cdi().spec_path(uid);
        serde_json::from_slice(&std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
            .unwrap()
    }
}

pub async fn prepare_one<D: DraDriver>(driver: &D, uid: &str, name: &str) -> PrepareOutcome {
    let mut out = driver.prepare(vec![claim_ref(uid, name)]).await;
    out.remove(uid).unwrap_or_else(|| Err("no outcome".into()))
}

pub async fn unprepare_one<D: DraDriver>(driver: &D, uid: &str, name: &str) -> UnprepareOutcome {
    let mut out = driver.unprepare(vec![claim_ref(uid, name)]).await;
    out.remove(uid).unwrap_or_else(|| Err("no outcome".into()))
}

/// Prepares one claim through the driver's typed API (the failure as a `ClaimFailure`).
pub async fn prepare_typed(driver: &TestDriver, uid: &str, name: &str) -> PrepareResult {
    let mut out = driver.prepare_claims(vec![claim_ref(uid, name)]).await;
    out.remove(uid).expect("one outcome per claim")
}

/// Unprepares one claim through the driver's typed API.
pub async fn unprepare_typed(driver: &TestDriver, uid: &str, name: &str) -> UnprepareResult {
    let mut out = driver.unprepare_claims(vec![claim_ref(uid, name)]).await;
    out.remove(uid).expect("one outcome per claim")
}

/// Polls `condition` until it holds; panics, naming `what`, after 20 s (a bound for a stuck
/// test, not a timing expectation).
pub async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !condition() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits until the background writer tried every queued claim status write.
pub async fn status_written(driver: &TestDriver) {
    wait_until("the queued claim status writes were tried", || {
        driver.claim_status_queued().is_empty()
    })
    .await;
}

/// Records the claim events `driver` emits: what the event task would write to the API server.
pub fn record_claim_events(driver: &TestDriver) -> tokio::sync::mpsc::Receiver<ClaimEvent> {
    let (events, receiver) = ClaimEvents::channel();
    driver.set_claim_events(events);
    receiver
}

/// The claim events queued so far.
pub fn queued_events(receiver: &mut tokio::sync::mpsc::Receiver<ClaimEvent>) -> Vec<ClaimEvent> {
    std::iter::from_fn(|| receiver.try_recv().ok()).collect()
}
