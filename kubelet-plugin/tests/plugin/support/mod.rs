//! Shared setup for the driver tests: a simulated GPU host (the fake NVML library loaded by
//! the production NvmlBackend), a claim store, and claim builders.
#![allow(dead_code, clippy::unwrap_used)]

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use dra_kubelet::{ClaimRef, DraDriver, PrepareOutcome, UnprepareOutcome};
use k8s_openapi::api::resource::v1::{AllocatedDeviceStatus, ResourceClaim};
use migdra_fake_nvml::{
    config::FakeConfig,
    driver_root::{DriverRootOptions, create_driver_root},
    testing::FakeGpuHost,
};
use migdra_kubelet_plugin::{
    cdi::{CdiWriter, DriverSetup},
    claims::ClaimSource,
    driver::{Driver, DriverConfig, PrepareResult, RecoveryReport, StepHook, UnprepareResult},
    driver_files::HostDir,
    events::{ClaimEvent, ClaimEvents},
    metrics::Metrics,
    nvml::{
        BackendError, CreatedComputeInstance, GpuBackend, GpuDescription, GpuInstanceRecord, MigModeChange,
        NvmlBackend,
    },
};

/// The driver the tests run: production code over the fake NVML library.
pub type TestDriver = Driver<NvmlBackend, StaticClaims>;
use serde_json::json;

pub const DRIVER: &str = "gpu.migdra.dev";
pub const NODE: &str = "node-a";
pub const POOL: &str = "node-a/gpu.migdra.dev";
/// Host path of the fake `nvidia-cdi-hook` (under [`Node::host_root`]).
pub const HOOK_PATH: &str = "/usr/bin/nvidia-cdi-hook";
/// The node-wide driver device every prepared device names.
pub const DRIVER_DEVICE_ID: &str = "gpu.migdra.dev/driver=files";

/// Claims served from memory, as the API server would; [`StaticClaims::set_unreachable`]
/// makes every GET fail as if the API server could not be reached, and
/// [`StaticClaims::set_status_failing`] every status write. Status writes are recorded
/// ([`StaticClaims::status_writes`]) and applied as server-side apply would for one field
/// manager that owns all of its driver's entries: the stored claim's entries of that driver
/// are replaced by the applied ones, other drivers' entries stay, and a UID that does not
/// match is refused (422, as the API server refuses it), a missing claim is 404.
/// [`StaticClaims::block_status`] holds every status write until its guard is dropped (a slow
/// or stuck API server). [`StaticClaims::delay_gets`] makes every GET take a while (a slow
/// API server).
#[derive(Clone, Default)]
pub struct StaticClaims {
    claims: Arc<Mutex<HashMap<(String, String), ResourceClaim>>>,
    unreachable: Arc<AtomicBool>,
    status_failing: Arc<AtomicBool>,
    writes: Arc<Mutex<Vec<StatusWrite>>>,
    /// Status writes wait for a read lock; [`StaticClaims::block_status`] holds the write lock.
    status_gate: Arc<tokio::sync::RwLock<()>>,
    writes_started: Arc<AtomicUsize>,
    get_delay: Arc<Mutex<Duration>>,
}

/// One status write as the plugin sent it.
#[derive(Clone, Debug)]
pub struct StatusWrite {
    pub namespace: String,
    pub name: String,
    pub field_manager: String,
    pub object: serde_json::Value,
    /// Whether it was accepted.
    pub accepted: bool,
}

fn api_error(code: u16, reason: &str, message: &str) -> kube::Error {
    let status: kube::core::Status = serde_json::from_value(json!({
        "status": "Failure", "code": code, "reason": reason, "message": message,
    }))
    .unwrap();
    kube::Error::Api(Box::new(status))
}

impl StaticClaims {
    pub fn put(&self, claim: ResourceClaim) {
        let key = (
            claim.metadata.namespace.clone().unwrap_or_default(),
            claim.metadata.name.clone().unwrap_or_default(),
        );
        self.claims.lock().unwrap().insert(key, claim);
    }

    /// Every GET answers only after `delay`.
    pub fn delay_gets(&self, delay: Duration) {
        *self.get_delay.lock().unwrap() = delay;
    }

    pub fn set_unreachable(&self, unreachable: bool) {
        self.unreachable.store(unreachable, Ordering::SeqCst);
    }

    /// Makes every status write fail (503) while `failing`.
    pub fn set_status_failing(&self, failing: bool) {
        self.status_failing.store(failing, Ordering::SeqCst);
    }

    /// Holds every status write (from its start) until the returned guard is dropped.
    pub async fn block_status(&self) -> tokio::sync::OwnedRwLockWriteGuard<()> {
        self.status_gate.clone().write_owned().await
    }

    /// How many status writes were sent so far, finished or not (held by
    /// [`StaticClaims::block_status`]).
    pub fn status_writes_started(&self) -> usize {
        self.writes_started.load(Ordering::SeqCst)
    }

    pub fn remove(&self, namespace: &str, name: &str) {
        self.claims
            .lock()
            .unwrap()
            .remove(&(namespace.to_string(), name.to_string()));
    }

    /// The stored claim (with the status writes applied).
    pub fn stored(&self, name: &str) -> Option<ResourceClaim> {
        self.claims
            .lock()
            .unwrap()
            .get(&("default".to_string(), name.to_string()))
            .cloned()
    }

    /// The stored claim's `status.devices` as JSON (`[]` when none).
    pub fn device_status(&self, name: &str) -> serde_json::Value {
        let claim = self.stored(name).unwrap_or_else(|| panic!("no claim {name}"));
        serde_json::to_value(claim.status.and_then(|s| s.devices).unwrap_or_default()).unwrap()
    }

    /// Every status write so far, in order.
    pub fn status_writes(&self) -> Vec<StatusWrite> {
        self.writes.lock().unwrap().clone()
    }

    fn apply(&self, namespace: &str, name: &str, object: &serde_json::Value) -> Result<(), kube::Error> {
        if self.status_failing.load(Ordering::SeqCst) {
            return Err(api_error(
                503,
                "ServiceUnavailable",
                "status writes fail (simulated)",
            ));
        }
        let mut claims = self.claims.lock().unwrap();
        let Some(claim) = claims.get_mut(&(namespace.to_string(), name.to_string())) else {
            return Err(api_error(404, "NotFound", "not found"));
        };
        if object["metadata"]["uid"].as_str() != claim.metadata.uid.as_deref() {
            // What the API server answers a server-side apply naming another UID.
            return Err(api_error(
                422,
                "Invalid",
                "metadata.uid: Invalid value: field is immutable",
            ));
        }
        let applied: Vec<AllocatedDeviceStatus> =
            serde_json::from_value(object["status"]["devices"].clone()).unwrap();
        let driver = applied
            .first()
            .map(|d| d.driver.clone())
            .unwrap_or_else(|| DRIVER.into());
        let status = claim.status.get_or_insert_with(Default::default);
        let mut devices: Vec<_> = status
            .devices
            .take()
            .unwrap_or_default()
            .into_iter()
            .filter(|d| d.driver != driver)
            .collect();
        devices.extend(applied);
        status.devices = (!devices.is_empty()).then_some(devices);
        Ok(())
    }
}

impl ClaimSource for StaticClaims {
    async fn get(&self, namespace: &str, name: &str) -> Result<Option<ResourceClaim>, kube::Error> {
        let delay = *self.get_delay.lock().unwrap();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if self.unreachable.load(Ordering::SeqCst) {
            return Err(kube::Error::ReadEvents(std::io::Error::other(
                "connection refused (simulated)",
            )));
        }
        Ok(self
            .claims
            .lock()
            .unwrap()
            .get(&(namespace.to_string(), name.to_string()))
            .cloned())
    }

    async fn apply_status(
        &self,
        namespace: &str,
        name: &str,
        field_manager: &str,
        object: &serde_json::Value,
    ) -> Result<(), kube::Error> {
        self.writes_started.fetch_add(1, Ordering::SeqCst);
        let _open = self.status_gate.read().await;
        let result = if self.unreachable.load(Ordering::SeqCst) {
            Err(kube::Error::ReadEvents(std::io::Error::other(
                "connection refused (simulated)",
            )))
        } else {
            self.apply(namespace, name, object)
        };
        self.writes.lock().unwrap().push(StatusWrite {
            namespace: namespace.into(),
            name: name.into(),
            field_manager: field_manager.into(),
            object: object.clone(),
            accepted: result.is_ok(),
        });
        result
    }
}

/// A claim allocated from this node's pool.
pub fn claim(uid: &str, name: &str, results: &[(&str, &str)]) -> ResourceClaim {
    claim_with(uid, name, POOL, results, json!([]))
}

/// A claim with explicit pool and allocation config entries.
pub fn claim_with(
    uid: &str,
    name: &str,
    pool: &str,
    results: &[(&str, &str)],
    config: serde_json::Value,
) -> ResourceClaim {
    let results: Vec<_> = results
        .iter()
        .map(
            |(request, device)| json!({"request": request, "driver": DRIVER, "pool": pool, "device": device}),
        )
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default", "uid": uid},
        "spec": {"devices": {"requests": []}},
        "status": {"allocation": {"devices": {"results": results, "config": config}}},
    }))
    .unwrap()
}

/// A claim whose every result was allocated with `adminAccess`.
pub fn admin_claim(uid: &str, name: &str, results: &[(&str, &str)]) -> ResourceClaim {
    let mut claim = claim(uid, name, results);
    let devices = claim
        .status
        .as_mut()
        .and_then(|s| s.allocation.as_mut())
        .and_then(|a| a.devices.as_mut())
        .unwrap();
    for result in devices.results.iter_mut().flatten() {
        result.admin_access = Some(true);
    }
    claim
}

pub fn claim_ref(uid: &str, name: &str) -> ClaimRef {
    ClaimRef {
        namespace: "default".into(),
        uid: uid.into(),
        name: name.into(),
    }
}

/// A node: simulated GPUs, a state dir, a CDI dir and a claim store.
pub struct Node {
    pub host: FakeGpuHost,
    pub dir: tempfile::TempDir,
    pub claims: StaticClaims,
    pub boot_id: String,
}

impl Node {
    pub fn new(gpus: &[(&str, bool)]) -> Self {
        Self::from_host(FakeGpuHost::with_gpus(gpus).unwrap())
    }

    pub fn with_config(config: FakeConfig) -> Self {
        Self::from_host(FakeGpuHost::new(config).unwrap())
    }

    fn from_host(host: FakeGpuHost) -> Self {
        let node = Self {
            host,
            dir: tempfile::tempdir().unwrap(),
            claims: StaticClaims::default(),
            boot_id: "boot-1".into(),
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
    pub fn driver_setup(&self) -> DriverSetup {
        DriverSetup {
            driver_root: HostDir::same(self.driver_root()),
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

    pub fn try_start(
        &self,
        hook: Option<StepHook>,
    ) -> Result<(TestDriver, RecoveryReport), migdra_kubelet_plugin::driver::DriverError> {
        self.try_start_with(hook, Metrics::new())
    }

    /// Starts a driver that counts into `metrics`.
    pub fn try_start_with(
        &self,
        hook: Option<StepHook>,
        metrics: Metrics,
    ) -> Result<(TestDriver, RecoveryReport), migdra_kubelet_plugin::driver::DriverError> {
        self.start_over(Arc::new(self.nvml()), hook, metrics)
    }

    /// A new NVML session on the fake library.
    pub fn nvml(&self) -> NvmlBackend {
        NvmlBackend::new(Some(&self.host.lib_path())).expect("load the fake NVML")
    }

    /// Starts a driver over `backend` (one wrapping [`Node::nvml`]).
    pub fn start_over<B: GpuBackend + 'static>(
        &self,
        backend: Arc<B>,
        hook: Option<StepHook>,
        metrics: Metrics,
    ) -> Result<(Driver<B, StaticClaims>, RecoveryReport), migdra_kubelet_plugin::driver::DriverError> {
        let config = DriverConfig {
            driver_name: DRIVER.into(),
            node_name: NODE.into(),
            state_dir: self.state_dir(),
            boot_id: self.boot_id.clone(),
            lock_timeout: Duration::from_secs(2),
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

/// `claim` reserved for `pods` (its `status.reservedFor`, as the scheduler writes it).
pub fn reserved_for(mut claim: ResourceClaim, pods: &[&str]) -> ResourceClaim {
    let entries = pods
        .iter()
        .map(|pod| json!({"resource": "pods", "name": pod, "uid": format!("uid-of-{pod}")}))
        .collect::<Vec<_>>();
    let status = claim.status.get_or_insert_with(Default::default);
    status.reserved_for = Some(serde_json::from_value(json!(entries)).unwrap());
    claim
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

/// A GPU backend whose `discover` (the first NVML work of every inventory) waits while its
/// gate is closed ([`GatedBackend::close`]): an NVML call that hangs. Everything else goes
/// straight to the wrapped backend.
///
/// The gate opens when the guard `close` returns is dropped, so a failing test does not
/// leave a blocking thread waiting (the runtime would wait for it forever).
pub struct GatedBackend<B> {
    inner: B,
    closed: Mutex<bool>,
    opened: std::sync::Condvar,
    waiting: AtomicUsize,
}

impl<B> GatedBackend<B> {
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            closed: Mutex::new(false),
            opened: std::sync::Condvar::new(),
            waiting: AtomicUsize::new(0),
        }
    }

    /// Makes `discover` calls wait until the guard is dropped.
    pub fn close(&self) -> GateClosed<'_, B> {
        *self.closed.lock().unwrap() = true;
        GateClosed(self)
    }

    /// How many `discover` calls wait at the closed gate now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    fn pass(&self) {
        let mut closed = self.closed.lock().unwrap();
        if *closed {
            self.waiting.fetch_add(1, Ordering::SeqCst);
            while *closed {
                closed = self.opened.wait(closed).unwrap();
            }
            self.waiting.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Keeps a [`GatedBackend`]'s gate closed; dropping it lets the waiting and later calls through.
pub struct GateClosed<'a, B>(&'a GatedBackend<B>);

impl<B> Drop for GateClosed<'_, B> {
    fn drop(&mut self) {
        *self.0.closed.lock().unwrap_or_else(|p| p.into_inner()) = false;
        self.0.opened.notify_all();
    }
}

impl<B: GpuBackend> GpuBackend for GatedBackend<B> {
    fn driver_version(&self) -> Result<String, BackendError> {
        self.inner.driver_version()
    }

    fn discover(&self) -> Result<Vec<GpuDescription>, BackendError> {
        self.pass();
        self.inner.discover()
    }

    fn list_gpu_instances(&self, gpu: u32) -> Result<Vec<GpuInstanceRecord>, BackendError> {
        self.inner.list_gpu_instances(gpu)
    }

    fn mig_enabled(&self, gpu: u32) -> Result<Option<bool>, BackendError> {
        self.inner.mig_enabled(gpu)
    }

    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<MigModeChange, BackendError> {
        self.inner.set_mig_mode(gpu, enabled)
    }

    fn create_gpu_instance(&self, gpu: u32, profile_id: u32, start: u32) -> Result<u32, BackendError> {
        self.inner.create_gpu_instance(gpu, profile_id, start)
    }

    fn create_full_compute_instance(
        &self,
        gpu: u32,
        gpu_instance: u32,
    ) -> Result<CreatedComputeInstance, BackendError> {
        self.inner.create_full_compute_instance(gpu, gpu_instance)
    }

    fn destroy_compute_instance(
        &self,
        gpu: u32,
        gpu_instance: u32,
        compute_instance: u32,
    ) -> Result<(), BackendError> {
        self.inner
            .destroy_compute_instance(gpu, gpu_instance, compute_instance)
    }

    fn destroy_gpu_instance(&self, gpu: u32, gpu_instance: u32) -> Result<(), BackendError> {
        self.inner.destroy_gpu_instance(gpu, gpu_instance)
    }

    fn probe_health(&self, gpu: u32) -> Result<(), BackendError> {
        self.inner.probe_health(gpu)
    }
}
