//! The world a trial runs in: one simulated node (the fake NVML host, the plugin's state and
//! CDI directories), an API server holding the ResourceClaims (whose GETs can be made to fail
//! or time out), and the plugin instances running on the node: production [`Driver`]s, each
//! with a step hook that can crash it. A crash is a panic at a [`Step`]; from then on every
//! step of that instance panics too, and nothing it answers reaches the kubelet, so the
//! instance behaves as a process that died there.
//!
//! The kubelet's side (calls with a deadline, retries) is in `kubelet.rs`; this module gives it
//! [`World::prepare`] and [`World::unprepare`], which go to the newest live instance as the
//! kubelet's newest registration would.

use std::{
    collections::{BTreeMap, HashMap},
    panic::AssertUnwindSafe,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use dra_kubelet::{ClaimRef, PreparedDevice};
use k8s_openapi::api::resource::v1::ResourceClaim;
use migdra_kubelet_plugin::{
    claims::ClaimSource,
    driver::{ClaimFailure, Driver, DriverConfig, Step, StepHook},
    metrics::Metrics,
    nvml::NvmlBackend,
};

use super::{kubelet::Pod, scenario::Scheduler};
use crate::plugin::{DRIVER, NODE, Node};

/// The driver under test: production code over the fake NVML library and the campaign's API.
pub type CampaignDriver = Driver<ApiClaims>;

/// How long the kubelet waits for one DRA call before it gives up (and retries later).
pub const KUBELET_DEADLINE: Duration = Duration::from_secs(1);
/// Marks the panics that simulate a crash (the campaign's panic hook keeps them quiet).
pub const CRASH_MARK: &str = "campaign: injected crash";

/// Locks a mutex of the campaign, ignoring poisoning (a simulated crash panics while the
/// campaign's own locks are never held, but a violation must not hide behind a poison).
pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Counters of one trial: faults injected and fired, by kind, and what was observed.
#[derive(Debug, Default)]
pub struct Tally {
    pub faults: BTreeMap<String, u64>,
    pub observed: BTreeMap<String, u64>,
    /// NVML (function, code) pairs whose fault fired at least once.
    pub fired_pairs: std::collections::BTreeSet<(String, u32)>,
}

impl Tally {
    pub fn fault(&mut self, kind: &str) {
        *self.faults.entry(kind.to_string()).or_default() += 1;
    }

    pub fn observe(&mut self, what: &str) {
        *self.observed.entry(what.to_string()).or_default() += 1;
    }
}

/// An invariant violation.
#[derive(Clone, Debug)]
pub struct Violation {
    pub kind: &'static str,
    pub detail: String,
}

/// What the plugin instances' hooks and the kubelet share with the campaign.
pub struct Shared {
    pub started: std::time::Instant,
    pub tally: Mutex<Tally>,
    pub violations: Mutex<Vec<Violation>>,
    /// The trial's log: every event, in order (printed with a violation).
    pub log: Mutex<Vec<String>>,
    /// The operation in flight per claim UID, with how many calls run it (to tell which
    /// operation a crash interrupted); a call the kubelet abandoned counts until it ends.
    pub in_flight: Mutex<HashMap<String, (&'static str, usize)>>,
    /// What a failure message may name as its cause instead of the claim: the texts of the
    /// NVML errors the trial caused, and the node lock.
    causes: Mutex<std::collections::BTreeSet<String>>,
}

impl Default for Shared {
    fn default() -> Self {
        Self {
            started: std::time::Instant::now(),
            tally: Mutex::default(),
            violations: Mutex::default(),
            log: Mutex::default(),
            in_flight: Mutex::default(),
            causes: Mutex::new(std::collections::BTreeSet::from([
                "holds the node lock".to_string()
            ])),
        }
    }
}

impl Shared {
    pub fn log(&self, line: String) {
        let ms = self.started.elapsed().as_millis();
        lock(&self.log).push(format!("{ms:>6} ms  {line}"));
    }

    pub fn violation(&self, kind: &'static str, detail: String) {
        self.log(format!("VIOLATION {kind}: {detail}"));
        lock(&self.violations).push(Violation { kind, detail });
    }

    pub fn fault(&self, kind: &str) {
        lock(&self.tally).fault(kind);
    }

    pub fn observe(&self, what: &str) {
        lock(&self.tally).observe(what);
    }

    /// The trial made NVML answer `code` somewhere: a message may name that as the cause.
    pub fn nvml_cause(&self, code: u32) {
        lock(&self.causes).insert(nvml_error_text(code));
    }

    /// A cause a failure message may name instead of the claim.
    pub fn cause(&self, text: &str) {
        lock(&self.causes).insert(text.to_string());
    }

    pub fn causes(&self) -> Vec<String> {
        lock(&self.causes).iter().cloned().collect()
    }
}

/// How the plugin words NVML error `code` in its messages (the NVML binding's text; the
/// plugin says what INSUFFICIENT_RESOURCES means itself).
pub fn nvml_error_text(code: u32) -> String {
    const INSUFFICIENT_RESOURCES: u32 = 23;
    if code == INSUFFICIENT_RESOURCES {
        return "insufficient resources".into();
    }
    nvml_wrapper::error::nvml_try(code)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default()
}

/// Faults of the claim GETs, consumed one GET at a time.
#[derive(Debug, Default)]
struct GetFaults {
    fail: u32,
    slow: u32,
    slow_ms: u64,
}

/// The API server's ResourceClaims.
#[derive(Clone)]
pub struct ApiClaims {
    claims: Arc<Mutex<HashMap<(String, String), ResourceClaim>>>,
    faults: Arc<Mutex<GetFaults>>,
    shared: Arc<Shared>,
}

impl ApiClaims {
    fn new(shared: Arc<Shared>) -> Self {
        Self {
            claims: Arc::default(),
            faults: Arc::default(),
            shared,
        }
    }

    pub fn put(&self, claim: ResourceClaim) {
        let key = (
            claim.metadata.namespace.clone().unwrap_or_default(),
            claim.metadata.name.clone().unwrap_or_default(),
        );
        lock(&self.claims).insert(key, claim);
    }

    pub fn remove(&self, name: &str) {
        lock(&self.claims).remove(&("default".to_string(), name.to_string()));
    }

    /// The next `count` GETs fail at once (connection refused).
    pub fn fail_next(&self, count: u32) {
        lock(&self.faults).fail += count;
    }

    /// The next `count` GETs hang for `ms` and then fail with a timeout.
    pub fn time_out_next(&self, count: u32, ms: u64) {
        let mut faults = lock(&self.faults);
        faults.slow += count;
        faults.slow_ms = ms;
    }

    pub fn clear_faults(&self) {
        *lock(&self.faults) = GetFaults::default();
    }
}

impl ClaimSource for ApiClaims {
    async fn get(&self, namespace: &str, name: &str) -> Result<Option<ResourceClaim>, kube::Error> {
        enum Fault {
            Fail,
            Slow(u64),
        }
        let fault = {
            let mut faults = lock(&self.faults);
            if faults.fail > 0 {
                faults.fail -= 1;
                Some(Fault::Fail)
            } else if faults.slow > 0 {
                faults.slow -= 1;
                Some(Fault::Slow(faults.slow_ms))
            } else {
                None
            }
        };
        match fault {
            Some(Fault::Fail) => {
                lock(&self.shared.tally).observe("claim GET failed");
                Err(kube::Error::ReadEvents(std::io::Error::other(
                    "connection refused (injected)",
                )))
            }
            Some(Fault::Slow(ms)) => {
                lock(&self.shared.tally).observe("claim GET timed out");
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Err(kube::Error::ReadEvents(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "request timed out (injected)",
                )))
            }
            None => Ok(lock(&self.claims)
                .get(&(namespace.to_string(), name.to_string()))
                .cloned()),
        }
    }

    /// Claim status writes succeed and are not kept: the campaign's invariants are about the
    /// node (NVML, checkpoint, CDI), and a status write never decides a prepare's outcome.
    async fn apply_status(
        &self,
        _namespace: &str,
        _name: &str,
        _field_manager: &str,
        _object: &serde_json::Value,
    ) -> Result<(), kube::Error> {
        Ok(())
    }
}

/// What a plugin instance's hook needs to crash it.
pub struct InstanceState {
    pub id: usize,
    pub dead: AtomicBool,
    /// Steps left before the crash; negative: no crash armed.
    pub crash_budget: AtomicI64,
    /// Set while `Driver::start` runs (a crash then is a crash in recovery).
    pub starting: AtomicBool,
    /// The background pass running on the instance, if any (`stale GC`, `background repair`).
    pub background: Mutex<Option<&'static str>>,
}

impl InstanceState {
    fn hook(self: &Arc<Self>, shared: Arc<Shared>) -> StepHook {
        let state = self.clone();
        Arc::new(move |uid: &str, step: Step| {
            if state.dead.load(Ordering::SeqCst) {
                panic!("{CRASH_MARK} (instance {} is dead)", state.id);
            }
            if state.crash_budget.load(Ordering::SeqCst) <= 0 {
                return;
            }
            if state.crash_budget.fetch_sub(1, Ordering::SeqCst) != 1 {
                return;
            }
            let during = if state.starting.load(Ordering::SeqCst) {
                "recovery"
            } else if let Some((op, _)) = lock(&shared.in_flight).get(uid).copied() {
                op
            } else {
                lock(&state.background).unwrap_or("background work")
            };
            state.dead.store(true, Ordering::SeqCst);
            let kind = format!("crash in {during}");
            shared.fault(&kind);
            shared.log(format!(
                "instance {} crashed at {step:?} of claim {uid} ({kind})",
                state.id
            ));
            panic!("{CRASH_MARK} at {step:?}");
        })
    }
}

/// A running plugin instance.
pub struct Instance {
    pub state: Arc<InstanceState>,
    pub driver: CampaignDriver,
}

/// The answer of one DRA call as the kubelet sees it.
pub enum Call<T> {
    /// The plugin answered, per claim UID.
    Answered(HashMap<String, Result<T, ClaimFailure>>),
    /// No plugin instance is registered.
    NoPlugin,
    /// The instance died during the call (the connection broke).
    Crashed,
    /// The deadline passed; the call may still be running in the plugin.
    Abandoned,
}

/// The node and everything running on it.
pub struct World {
    pub node: Node,
    pub api: ApiClaims,
    pub shared: Arc<Shared>,
    /// Live instances, oldest first; the kubelet talks to the last.
    pub plugins: Mutex<Vec<Arc<Instance>>>,
    next_instance: AtomicUsize,
    /// Calls the kubelet gave up on and background passes, awaited before checking.
    pub pending: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// When set, new instances start without an armed crash.
    pub settling: AtomicBool,
    pub starts: AtomicU64,
    pub scheduler: Mutex<Scheduler>,
    /// The node's boot ID (a reboot changes it).
    pub boot_id: Mutex<String>,
    pub reboots: AtomicU64,
}

impl World {
    pub fn new(node: Node, scheduler: Scheduler) -> Self {
        let shared = Arc::new(Shared::default());
        Self {
            api: ApiClaims::new(shared.clone()),
            shared,
            plugins: Mutex::default(),
            next_instance: AtomicUsize::new(1),
            pending: Mutex::default(),
            settling: AtomicBool::new(false),
            starts: AtomicU64::new(0),
            boot_id: Mutex::new(node.boot_id.clone()),
            reboots: AtomicU64::new(0),
            scheduler: Mutex::new(scheduler),
            node,
        }
    }

    /// Starts a plugin instance (it joins the live ones). `crash_after` arms a crash that
    /// many steps in (recovery's steps come first).
    pub async fn start_instance(&self, crash_after: Option<i64>) -> Result<Arc<Instance>, String> {
        let id = self.next_instance.fetch_add(1, Ordering::SeqCst);
        self.starts.fetch_add(1, Ordering::SeqCst);
        let state = Arc::new(InstanceState {
            id,
            dead: AtomicBool::new(false),
            crash_budget: AtomicI64::new(crash_after.unwrap_or(-1)),
            starting: AtomicBool::new(true),
            background: Mutex::new(None),
        });
        let hook = state.hook(self.shared.clone());
        let backend = NvmlBackend::new(Some(&self.node.host.lib_path()))
            .map_err(|e| format!("instance {id}: loading NVML: {e}"))?;
        let config = DriverConfig {
            driver_name: DRIVER.into(),
            node_name: NODE.into(),
            state_dir: self.node.state_dir(),
            boot_id: lock(&self.boot_id).clone(),
            lock_timeout: Duration::from_secs(2),
            // Short, so a hung call answers well within a trial.
            nvml_call_timeout: Duration::from_secs(2),
        };
        let (api, cdi) = (self.api.clone(), self.node.cdi());
        let started = tokio::task::spawn_blocking(move || {
            std::panic::catch_unwind(AssertUnwindSafe(|| {
                Driver::start(config, Arc::new(backend), api, cdi, Some(hook), Metrics::new())
            }))
        })
        .await;
        state.starting.store(false, Ordering::SeqCst);
        match started {
            Ok(Ok(Ok((driver, report)))) => {
                if !report.pending.is_empty() {
                    self.shared.observe("record left pending at start");
                }
                self.shared.log(format!(
                    "instance {id} started (rolled back {}, finished {}, CDI rewritten {}, pending {})",
                    report.rolled_back.len(),
                    report.unprepared.len(),
                    report.cdi_rewritten.len(),
                    report.pending.len()
                ));
                let instance = Arc::new(Instance { state, driver });
                lock(&self.plugins).push(instance.clone());
                Ok(instance)
            }
            Ok(Ok(Err(e))) => {
                self.shared.observe("plugin start failed");
                Err(format!("instance {id} failed to start: {e}"))
            }
            Ok(Err(_)) | Err(_) => Err(format!("instance {id} crashed while starting")),
        }
    }

    /// Drops dead instances from the live list; returns how many remain.
    pub fn reap(&self) -> usize {
        let mut plugins = lock(&self.plugins);
        plugins.retain(|p| !p.state.dead.load(Ordering::SeqCst));
        plugins.len()
    }

    /// The instance the kubelet talks to.
    pub fn kubelet_target(&self) -> Option<Arc<Instance>> {
        lock(&self.plugins)
            .iter()
            .rev()
            .find(|p| !p.state.dead.load(Ordering::SeqCst))
            .cloned()
    }

    /// A live instance for a background pass (`pick` chooses among them).
    pub fn any_instance(&self, pick: usize) -> Option<Arc<Instance>> {
        let plugins = lock(&self.plugins);
        let live: Vec<_> = plugins
            .iter()
            .filter(|p| !p.state.dead.load(Ordering::SeqCst))
            .collect();
        (!live.is_empty()).then(|| live[pick % live.len()].clone())
    }

    pub fn claim_refs(claims: &[(String, String)]) -> Vec<ClaimRef> {
        claims
            .iter()
            .map(|(uid, name)| ClaimRef {
                namespace: "default".into(),
                uid: uid.clone(),
                name: name.clone(),
            })
            .collect()
    }

    /// The kubelet's NodePrepareResources for `claims` (UID, name).
    pub async fn prepare(&self, claims: &[(String, String)]) -> Call<Vec<PreparedDevice>> {
        let Some(instance) = self.kubelet_target() else {
            return Call::NoPlugin;
        };
        let driver = instance.driver.clone();
        let refs = Self::claim_refs(claims);
        self.call(&instance, claims, "prepare", async move {
            driver.prepare_claims(refs).await
        })
        .await
    }

    /// The kubelet's NodeUnprepareResources for `claims` (UID, name).
    pub async fn unprepare(&self, claims: &[(String, String)]) -> Call<()> {
        let Some(instance) = self.kubelet_target() else {
            return Call::NoPlugin;
        };
        let driver = instance.driver.clone();
        let refs = Self::claim_refs(claims);
        self.call(&instance, claims, "unprepare", async move {
            driver.unprepare_claims(refs).await
        })
        .await
    }

    async fn call<T: Send + 'static>(
        &self,
        instance: &Instance,
        claims: &[(String, String)],
        operation: &'static str,
        work: impl Future<Output = HashMap<String, Result<T, ClaimFailure>>> + Send + 'static,
    ) -> Call<T> {
        let uids: Vec<String> = claims.iter().map(|(uid, _)| uid.clone()).collect();
        {
            let mut in_flight = lock(&self.shared.in_flight);
            for uid in &uids {
                let entry = in_flight.entry(uid.clone()).or_insert((operation, 0));
                *entry = (operation, entry.1 + 1);
            }
        }
        let shared = self.shared.clone();
        let mut task = tokio::spawn(async move {
            let outcomes = work.await;
            let mut in_flight = lock(&shared.in_flight);
            for uid in &uids {
                if let Some(entry) = in_flight.get_mut(uid) {
                    entry.1 -= 1;
                    if entry.1 == 0 {
                        in_flight.remove(uid);
                    }
                }
            }
            outcomes
        });
        let answer = tokio::time::timeout(KUBELET_DEADLINE, &mut task).await;
        match answer {
            Err(_) => {
                self.shared.observe("kubelet call abandoned at its deadline");
                // The plugin may still be working on it; it is awaited before the checks.
                lock(&self.pending).push(tokio::spawn(async move {
                    let _ = task.await;
                }));
                Call::Abandoned
            }
            Ok(_) if instance.state.dead.load(Ordering::SeqCst) => Call::Crashed,
            Ok(Err(_)) => Call::Crashed,
            Ok(Ok(outcomes)) => Call::Answered(outcomes),
        }
    }

    /// The pod is gone after its unprepare: the API server deletes its claims and the
    /// scheduler may hand their placements out again.
    pub fn delete_claims(&self, pod: &Pod) {
        for claim in &pod.claims {
            self.api.remove(&claim.name);
            lock(&self.scheduler).release(&claim.uid);
        }
    }

    /// The kubelet forgot the pod: its claims are deleted with no unprepare (or, with
    /// `replace`, re-created under the same name with a new UID and no allocation), so the
    /// plugin's records of them are stale.
    pub fn forget_claims(&self, pod: &Pod, replace: bool) {
        for claim in &pod.claims {
            if replace {
                let mut object = super::kubelet::PodClaim {
                    uid: format!("{}-replaced", claim.uid),
                    placements: Vec::new(),
                    ..claim.clone()
                }
                .object();
                object.status = None;
                self.api.put(object);
            } else {
                self.api.remove(&claim.name);
            }
            lock(&self.scheduler).release(&claim.uid);
        }
    }

    /// The node reboots: every plugin instance dies where it is (its calls and passes end at
    /// their next step, and all of them end before the GPUs reset, as nothing of the old boot
    /// runs after it), NVML comes back without instances (Hopper and later with MIG off,
    /// Ampere with its pending mode applied, lost GPUs back), the boot ID changes, and the
    /// files in `torn` are left half written, as a write the reboot overtook can be. Pods
    /// are told by the caller.
    pub async fn reboot(&self, torn: &[std::path::PathBuf]) {
        let instances = std::mem::take(&mut *lock(&self.plugins));
        for instance in &instances {
            instance.state.dead.store(true, Ordering::SeqCst);
        }
        self.quiesce().await;
        while !lock(&self.shared.in_flight).is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.quiesce().await;
        for path in torn {
            if let Ok(bytes) = std::fs::read(path) {
                let _ = std::fs::write(path, &bytes[..bytes.len() / 2]);
            }
        }
        self.node
            .host
            .update_state(|s| s.reload_driver())
            .expect("reboot the fake's GPUs");
        let n = self.reboots.fetch_add(1, Ordering::SeqCst) + 1;
        *lock(&self.boot_id) = format!("{}-after-reboot-{n}", self.node.boot_id);
    }

    /// Waits for every abandoned call and background pass.
    pub async fn quiesce(&self) {
        loop {
            let pending: Vec<_> = std::mem::take(&mut *lock(&self.pending));
            if pending.is_empty() {
                return;
            }
            for task in pending {
                let _ = task.await;
            }
        }
    }
}
