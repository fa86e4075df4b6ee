//! One trial: from a seed, a node (8 GPUs, foreign instances), pods whose claims are
//! prepared and unprepared concurrently, and a schedule of faults interleaved with them.
//! Then the trial settles (faults cleared, lost GPUs back, one plugin instance running, every
//! pod either running or deleted) and the invariants are checked twice: with the running
//! pods' claims prepared, and once every pod is deleted.
//!
//! The seed fixes the node, the pods, their allocations and the fault schedule; thread
//! interleavings still vary between runs, so a rerun of a failing seed reproduces the same
//! faults, not necessarily the same order of every NVML call.

use std::{
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

use migdra_fake_nvml::{FaultState, config::FaultConfig};

use migdra_kubelet_plugin::orphans::ORPHANS_FILE;

use super::{
    invariants::{self, foreign_instances},
    kubelet::{Phase, Pod, PodClaim, run_pod},
    nvml_calls::{ERROR_CODES, NvmlCalls},
    published,
    rng::Rng,
    scenario::{ClaimKind, GPUS, Placement, Scenario, Scheduler},
    world::{Tally, Violation, World, lock},
};

const SET_MIG_MODE: &str = "nvmlDeviceSetMigMode";
const IN_USE: u32 = 19;
const GPU_IS_LOST: u32 = 15;
use crate::plugin::Node;

/// Most claims a trial creates.
pub const MAX_CLAIMS: usize = 64;
/// NVML (function, code) pairs each trial injects. Trial `s` injects pairs
/// `s * PAIRS_PER_TRIAL ..`, so consecutive seeds walk every pair.
pub const PAIRS_PER_TRIAL: usize = 8;

/// What a trial did and found.
#[derive(Debug)]
pub struct TrialOutcome {
    pub seed: u64,
    pub claims: usize,
    pub tally: Tally,
    pub violations: Vec<Violation>,
    pub log: Vec<String>,
    pub elapsed: Duration,
}

#[derive(Clone, Copy, Debug)]
enum Event {
    CreatePod,
    DeletePod,
    ForgetPod,
    NvmlError,
    NvmlLatency,
    LoseGpu,
    ReturnGpu,
    GetFailures,
    GetTimeouts,
    ArmCrash,
    Restart,
    OverlapStart,
    OverlapEnd,
    StaleGc,
    Repair,
    Inventory,
    MigModeError,
    ClientHoldsGpu,
    ClientLeavesGpu,
    Reboot,
    NvmlHang,
    NvmlHangEnds,
}

/// Events but the NVML errors, with their weights. A hang makes one NVML call on one GPU block
/// for minutes, until a later event (or the settling) ends it: the plugin's call time bound
/// answers the kubelet meanwhile, and what the call did is reconciled once it returns.
const WEIGHTED: [(Event, u64); 21] = [
    (Event::CreatePod, 16),
    (Event::DeletePod, 9),
    (Event::ForgetPod, 3),
    (Event::NvmlLatency, 2),
    (Event::LoseGpu, 3),
    (Event::ReturnGpu, 3),
    (Event::GetFailures, 3),
    (Event::GetTimeouts, 2),
    (Event::ArmCrash, 6),
    (Event::Restart, 2),
    (Event::OverlapStart, 2),
    (Event::OverlapEnd, 2),
    (Event::StaleGc, 4),
    (Event::Repair, 3),
    (Event::Inventory, 4),
    (Event::MigModeError, 2),
    (Event::ClientHoldsGpu, 2),
    (Event::ClientLeavesGpu, 2),
    (Event::Reboot, 1),
    (Event::NvmlHang, 2),
    (Event::NvmlHangEnds, 2),
];

/// A hung call's latency: longer than any trial, so only removing the fault ends it.
const HANG_MS: u64 = 600_000;

fn schedule(rng: &mut Rng) -> Vec<Event> {
    let total: u64 = WEIGHTED.iter().map(|(_, w)| w).sum();
    let count = rng.range(40, 70);
    let mut events: Vec<Event> = (0..count)
        .map(|_| {
            let mut roll = rng.below(total);
            for (event, weight) in WEIGHTED {
                if roll < weight {
                    return event;
                }
                roll -= weight;
            }
            Event::CreatePod
        })
        .collect();
    for _ in 0..PAIRS_PER_TRIAL {
        let at = rng.below(events.len() as u64 + 1) as usize;
        events.insert(at, Event::NvmlError);
    }
    events
}

struct Trial {
    world: Arc<World>,
    rng: Rng,
    seed: u64,
    calls: NvmlCalls,
    pods: Vec<Arc<Pod>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    claims: usize,
    nvml_errors: usize,
    lost: Vec<u32>,
    /// Devices are chosen from the pool published for the plugin's inventory, not by the
    /// oracle scheduler.
    published: bool,
    /// The last inventory the plugin reported (what the controller last published from).
    inventory: Option<Vec<migdra_api::inventory::GpuInventory>>,
    /// Instances that existed before the plugin (none after a reboot).
    foreign: invariants::Foreign,
}

/// Runs the trial of `seed`.
pub async fn run_trial(seed: u64, calls: &NvmlCalls) -> TrialOutcome {
    let started = Instant::now();
    let mut rng = Rng::new(seed);
    let scenario = Scenario::generate(&mut rng);
    let node = Node::with_config(scenario.fake_config());
    let foreign = foreign_instances(&node.host.read_state().expect("read the fake's state"));
    let world = Arc::new(World::new(node, Scheduler::new(&scenario)));
    // Every third trial allocates from the published pool instead of the oracle.
    let published = seed.is_multiple_of(3);
    world.shared.log(format!(
        "seed {seed}: GPUs {:?}, MIG on {:?}, allocation from {}; foreign instances {:?}",
        scenario.models,
        scenario.mig_on,
        if published {
            "the published pool"
        } else {
            "the oracle"
        },
        scenario
            .foreign
            .iter()
            .map(|f| f.device.as_str())
            .collect::<Vec<_>>()
    ));
    let mut trial = Trial {
        world: world.clone(),
        rng: rng.fork(),
        seed,
        calls: calls.clone(),
        pods: Vec::new(),
        tasks: Vec::new(),
        claims: 0,
        nvml_errors: 0,
        lost: Vec::new(),
        published,
        inventory: None,
        foreign,
    };
    let events = schedule(&mut rng);
    trial.ensure_plugin().await;
    for _ in 0..rng.range(4, 10) {
        trial.create_pod().await;
    }
    for event in events {
        trial.apply(event).await;
        tokio::time::sleep(Duration::from_millis(trial.rng.range(0, 6))).await;
        // The DaemonSet restarts a dead plugin, with a back-off.
        if trial.rng.percent(60) {
            trial.ensure_plugin().await;
        }
    }
    let violations = trial.settle().await;
    for v in &violations {
        world.shared.log(format!("VIOLATION {}: {}", v.kind, v.detail));
    }
    let mut all = std::mem::take(&mut *lock(&world.shared.violations));
    all.extend(violations);
    lock(&world.plugins).clear();
    TrialOutcome {
        seed,
        claims: trial.claims,
        tally: std::mem::take(&mut *lock(&world.shared.tally)),
        violations: all,
        log: std::mem::take(&mut *lock(&world.shared.log)),
        elapsed: started.elapsed(),
    }
}

impl Trial {
    fn log(&self, line: String) {
        self.world.shared.log(line);
    }

    fn fault(&self, kind: &str) {
        self.world.shared.fault(kind);
    }

    /// Starts an instance if none is live; outside the settling phase it may come with a
    /// crash armed a few steps in (often inside recovery).
    async fn ensure_plugin(&mut self) -> bool {
        if self.world.reap() > 0 {
            return true;
        }
        let settling = self.world.settling.load(Ordering::SeqCst);
        let crash = (!settling && self.rng.percent(25)).then(|| self.rng.range(1, 6) as i64);
        match self.world.start_instance(crash).await {
            Ok(instance) => {
                self.log(format!(
                    "instance {} is serving (crash armed: {crash:?})",
                    instance.state.id
                ));
                true
            }
            Err(e) => {
                self.log(e);
                false
            }
        }
    }

    /// The plugin's inventory now (what its status loop would write into the GpuNode), or the
    /// last one it reported when it cannot answer.
    async fn inventory(&mut self) -> Option<Vec<migdra_api::inventory::GpuInventory>> {
        if let Some(instance) = self.world.kubelet_target() {
            let driver = instance.driver.clone();
            if let Ok(Ok(inventory)) = tokio::task::spawn_blocking(move || driver.gpus().inventory()).await {
                self.inventory = Some(inventory);
            }
        }
        self.inventory.clone()
    }

    /// Devices for a new claim: from the published pool or the oracle.
    async fn allocate(&mut self, uid: &str, kind: ClaimKind, devices: usize) -> Option<Vec<Placement>> {
        if self.published {
            let inventory = self.inventory().await?;
            let mut scheduler = lock(&self.world.scheduler);
            return match published::allocate(&inventory, scheduler.allocated(), &mut self.rng, kind, devices)
            {
                Ok(Some(placements)) => {
                    scheduler.record(uid, placements.clone());
                    Some(placements)
                }
                Ok(None) => None,
                Err(e) => {
                    drop(scheduler);
                    self.log(format!("the published pool cannot be built: {e}"));
                    None
                }
            };
        }
        let state = self.world.node.host.read_state().expect("read the fake's state");
        let mut scheduler = lock(&self.world.scheduler);
        let occupied = scheduler.unexplained(&state);
        scheduler.allocate(&mut self.rng, uid, kind, devices, &self.lost, &occupied)
    }

    async fn create_pod(&mut self) {
        if self.claims >= MAX_CLAIMS {
            return;
        }
        let id = self.pods.len();
        let count = if self.rng.percent(25) { 2 } else { 1 };
        let mut claims = Vec::new();
        for _ in 0..count.min(MAX_CLAIMS - self.claims) {
            let n = self.claims;
            let uid = format!("uid-{}-{n}", self.seed);
            let kind = ClaimKind::pick(&mut self.rng);
            let devices = match kind {
                ClaimKind::WholeGpu => 1,
                _ if self.rng.percent(20) => 2,
                _ => 1,
            };
            let Some(placements) = self.allocate(&uid, kind, devices).await else {
                continue;
            };
            self.claims += 1;
            self.world.shared.observe(&format!("{} claim", kind.name()));
            let claim = PodClaim {
                uid,
                name: format!("c{n}"),
                kind,
                placements,
            };
            self.world.api.put(claim.object());
            claims.push(claim);
        }
        if claims.is_empty() {
            return;
        }
        self.log(format!(
            "pod {id} created with {:?}",
            claims
                .iter()
                .map(|c| (
                    c.name.as_str(),
                    c.kind.name(),
                    c.placements.iter().map(|p| p.device.as_str()).collect::<Vec<_>>()
                ))
                .collect::<Vec<_>>()
        ));
        let pod = Arc::new(Pod::new(id, claims));
        self.pods.push(pod.clone());
        self.tasks
            .push(tokio::spawn(run_pod(self.world.clone(), pod, self.rng.fork())));
    }

    /// Files a reboot may leave half written: the checkpoint, the orphan list, claims' CDI
    /// specs (each with some chance).
    fn torn_files(&mut self) -> Vec<std::path::PathBuf> {
        let state = self.world.node.state_dir();
        let mut candidates = vec![state.join("checkpoint.json"), state.join(ORPHANS_FILE)];
        candidates.extend(self.world.node.cdi_specs());
        candidates
            .into_iter()
            .filter(|path| path.exists() && self.rng.percent(40))
            .collect()
    }

    /// A pod that has not been deleted yet, preferring running ones.
    fn live_pod(&mut self) -> Option<Arc<Pod>> {
        let live: Vec<_> = self
            .pods
            .iter()
            .filter(|p| !p.deleted.load(Ordering::SeqCst))
            .cloned()
            .collect();
        let running: Vec<_> = live
            .iter()
            .filter(|p| p.phase() == Phase::Running)
            .cloned()
            .collect();
        let from = if !running.is_empty() && self.rng.percent(80) {
            running
        } else {
            live
        };
        (!from.is_empty()).then(|| self.rng.pick(&from).clone())
    }

    fn add_fault(&self, fault: FaultConfig) {
        self.world
            .node
            .host
            .update_state(|s| s.faults.push(FaultState { fault, hits: 0 }))
            .expect("add a fault");
    }

    async fn apply(&mut self, event: Event) {
        match event {
            Event::CreatePod => self.create_pod().await,
            Event::DeletePod => {
                if let Some(pod) = self.live_pod() {
                    self.log(format!("pod {} deleted", pod.id));
                    pod.delete();
                }
            }
            Event::ForgetPod => {
                if let Some(pod) = self.live_pod() {
                    let replace = self.rng.percent(30);
                    self.log(format!(
                        "pod {} forgotten by the kubelet (claims replaced: {replace})",
                        pod.id
                    ));
                    self.fault(if replace {
                        "claim replaced under the same name, never unprepared"
                    } else {
                        "claim deleted, never unprepared"
                    });
                    self.world.forget_claims(&pod, replace);
                    pod.forget();
                }
            }
            Event::NvmlError => {
                let pair = (self.seed as usize)
                    .wrapping_mul(PAIRS_PER_TRIAL)
                    .wrapping_add(self.nvml_errors)
                    % self.calls.pairs();
                self.nvml_errors += 1;
                let (function, code, name) = self.calls.pair(pair);
                let mut fault = FaultConfig::error(function, code).times(self.rng.range(1, 3) as u32);
                if self.rng.percent(30) {
                    fault = fault.on_gpu(self.rng.below(u64::from(GPUS)) as u32);
                }
                self.log(format!(
                    "NVML fault: {function} -> {name} ({code}), gpu {:?}, {:?} times",
                    fault.gpu, fault.times
                ));
                self.fault("NVML error injected");
                self.world.shared.nvml_cause(code);
                self.add_fault(fault);
            }
            Event::NvmlLatency => {
                let function = self.rng.pick(&self.calls.functions).clone();
                let ms = self.rng.range(5, 40);
                self.log(format!("NVML latency: {function} +{ms} ms"));
                self.fault("NVML call slowed");
                let times = self.rng.range(1, 4) as u32;
                self.add_fault(FaultConfig::latency(&function, ms).times(times));
            }
            Event::NvmlHang => {
                let function = self.rng.pick(&self.calls.functions).clone();
                let gpu = self.rng.below(u64::from(GPUS)) as u32;
                self.log(format!("NVML hang: {function} on GPU {gpu}"));
                self.fault("NVML call hung");
                self.world.shared.cause("NVML is not answering");
                self.add_fault(FaultConfig::latency(&function, HANG_MS).on_gpu(gpu).times(1));
            }
            Event::NvmlHangEnds => {
                let ended = self
                    .world
                    .node
                    .host
                    .update_state(|s| {
                        let at = s
                            .faults
                            .iter()
                            .position(|f| f.fault.latency_ms == Some(HANG_MS))?;
                        Some(s.faults.remove(at).fault.function)
                    })
                    .expect("end a hang");
                if let Some(function) = ended {
                    self.log(format!("NVML hang of {function} ended"));
                    self.fault("NVML hang ended");
                }
            }
            Event::LoseGpu => {
                let gpu = self.rng.below(u64::from(GPUS)) as u32;
                if !self.lost.contains(&gpu) {
                    self.lost.push(gpu);
                    self.log(format!("GPU {gpu} lost"));
                    self.fault("GPU lost");
                    self.world.shared.nvml_cause(GPU_IS_LOST);
                    self.set_lost(gpu, true);
                }
            }
            Event::ReturnGpu => {
                if !self.lost.is_empty() {
                    let at = self.rng.below(self.lost.len() as u64) as usize;
                    let gpu = self.lost.remove(at);
                    self.log(format!("GPU {gpu} returned"));
                    self.fault("GPU returned");
                    self.set_lost(gpu, false);
                }
            }
            Event::GetFailures => {
                let count = self.rng.range(1, 4) as u32;
                self.log(format!("the next {count} claim GETs fail"));
                self.fault("claim GETs set to fail");
                self.world.api.fail_next(count);
            }
            Event::GetTimeouts => {
                let count = self.rng.range(1, 3) as u32;
                let ms = self.rng.range(20, 400);
                self.log(format!("the next {count} claim GETs time out after {ms} ms"));
                self.fault("claim GETs set to time out");
                self.world.api.time_out_next(count, ms);
            }
            Event::ArmCrash => {
                if let Some(instance) = self.world.kubelet_target() {
                    let steps = self.rng.range(1, 12) as i64;
                    self.log(format!(
                        "instance {} will crash {steps} step(s) from now",
                        instance.state.id
                    ));
                    instance.state.crash_budget.store(steps, Ordering::SeqCst);
                }
            }
            Event::Restart => {
                let stopped = std::mem::take(&mut *lock(&self.world.plugins));
                if !stopped.is_empty() {
                    self.log("plugin restarted (every instance stopped)".into());
                    self.fault("plugin restart");
                }
                self.ensure_plugin().await;
            }
            Event::OverlapStart => {
                if self.world.reap() == 1 {
                    let crash = self.rng.percent(20).then(|| self.rng.range(1, 8) as i64);
                    self.fault("second plugin instance started (rolling update)");
                    match self.world.start_instance(crash).await {
                        Ok(i) => self.log(format!(
                            "instance {} started next to the running one (crash armed: {crash:?})",
                            i.state.id
                        )),
                        Err(e) => self.log(e),
                    }
                }
            }
            Event::OverlapEnd => {
                let mut plugins = lock(&self.world.plugins);
                if plugins.len() > 1 {
                    let old = plugins.remove(0);
                    self.world
                        .shared
                        .log(format!("instance {} stopped (rolling update done)", old.state.id));
                }
            }
            Event::MigModeError => {
                let (code, name) = *self.rng.pick(&ERROR_CODES);
                let mut fault = FaultConfig::error(SET_MIG_MODE, code).times(self.rng.range(1, 3) as u32);
                if self.rng.percent(50) {
                    fault = fault.on_gpu(self.rng.below(u64::from(GPUS)) as u32);
                }
                self.log(format!(
                    "NVML fault: {SET_MIG_MODE} -> {name} ({code}), gpu {:?}, {:?} times",
                    fault.gpu, fault.times
                ));
                self.fault("MIG-mode switch fault injected");
                self.world.shared.nvml_cause(code);
                self.add_fault(fault);
            }
            Event::ClientHoldsGpu => {
                let gpu = self.rng.below(u64::from(GPUS)) as u32;
                self.log(format!("a process holds GPU {gpu}"));
                self.fault("a process holds a GPU (MIG-mode switches stay pending)");
                self.world.shared.nvml_cause(IN_USE);
                self.set_client(Some(gpu));
            }
            Event::ClientLeavesGpu => self.set_client(None),
            Event::Reboot => {
                let torn = self.torn_files();
                self.log(format!("the node reboots; torn files: {torn:?}"));
                self.fault("node reboot");
                if !torn.is_empty() {
                    self.fault("file torn by a reboot");
                }
                self.world.reboot(&torn).await;
                self.lost.clear();
                // Instances do not survive a reboot, foreign ones neither.
                self.foreign.clear();
                for pod in &self.pods {
                    pod.reboot();
                }
                self.ensure_plugin().await;
            }
            Event::StaleGc => self.background(Background::StaleGc),
            Event::Repair => self.background(Background::Repair),
            Event::Inventory => self.background(Background::Inventory),
        }
    }

    /// A process holds GPU `gpu` (`None`: every GPU is let go).
    fn set_client(&self, gpu: Option<u32>) {
        self.world
            .node
            .host
            .update_state(|s| {
                for g in &mut s.gpus {
                    g.client_holds_gpu = Some(g.index) == gpu;
                }
            })
            .expect("set a process on a GPU");
    }

    fn set_lost(&self, gpu: u32, lost: bool) {
        self.world
            .node
            .host
            .update_state(|s| s.gpus[gpu as usize].lost = lost)
            .expect("set a GPU lost or back");
    }

    /// Runs one pass of a background loop on some live instance, concurrently.
    fn background(&mut self, kind: Background) {
        let pick = self.rng.below(2) as usize;
        let Some(instance) = self.world.any_instance(pick) else {
            return;
        };
        self.world.shared.observe(kind.name());
        let task = tokio::spawn(run_background(instance, kind));
        lock(&self.world.pending).push(task);
    }

    /// Clears every fault, lets the pods finish, and checks the invariants.
    async fn settle(&mut self) -> Vec<Violation> {
        let foreign = &self.foreign.clone();
        let world = self.world.clone();
        world.settling.store(true, Ordering::SeqCst);
        world.shared.log("settling: faults cleared, GPUs back".into());
        let faults = world
            .node
            .host
            .update_state(|s| {
                for gpu in &mut s.gpus {
                    gpu.lost = false;
                    gpu.client_holds_gpu = false;
                }
                std::mem::take(&mut s.faults)
            })
            .expect("clear the faults");
        {
            let mut tally = lock(&world.shared.tally);
            for f in faults.iter().filter(|f| f.hits > 0) {
                if let Some(code) = f.fault.error {
                    tally.fault("NVML error fired");
                    tally.fired_pairs.insert((f.fault.function.clone(), code));
                }
            }
        }
        world.api.clear_faults();
        for p in lock(&world.plugins).iter() {
            p.state.crash_budget.store(-1, Ordering::SeqCst);
        }
        world.quiesce().await;
        world.reap();
        {
            let mut plugins = lock(&world.plugins);
            let keep = plugins.len().saturating_sub(1);
            plugins.drain(..keep);
        }
        let mut violations = Vec::new();
        let mut started = false;
        for _ in 0..5 {
            if self.ensure_plugin().await {
                started = true;
                break;
            }
        }
        if !started {
            violations.push(Violation {
                kind: "plugin cannot start",
                detail: "no instance started with every fault cleared".into(),
            });
            return violations;
        }
        self.passes().await;
        self.wait_for_pods(&[Phase::Running, Phase::Gone, Phase::GaveUp])
            .await;
        world.shared.log("pods settled".into());
        world.quiesce().await;
        world.shared.log("quiesced".into());
        self.passes().await;
        violations.extend(invariants::check(
            &world,
            foreign,
            &self.pods,
            "with pods running",
        ));
        world
            .shared
            .log("checked with pods running; deleting every pod".into());

        for pod in &self.pods {
            pod.delete();
        }
        self.wait_for_pods(&[Phase::Gone, Phase::GaveUp]).await;
        world.quiesce().await;
        self.passes().await;
        violations.extend(invariants::check(
            &world,
            foreign,
            &self.pods,
            "after every pod was deleted",
        ));
        world.shared.log("checked after every pod was deleted".into());
        for task in self.tasks.drain(..) {
            task.abort();
        }
        violations
    }

    /// The background loops' work, once each: repairs, the status inventory (which destroys
    /// what lost GPUs left behind), stale-claim collection.
    async fn passes(&self) {
        let Some(instance) = self.world.kubelet_target() else {
            return;
        };
        for kind in [
            Background::Repair,
            Background::OverdueReconcile,
            Background::Inventory,
            Background::StaleGc,
            Background::Inventory,
        ] {
            let t = Instant::now();
            run_background(instance.clone(), kind).await;
            self.world
                .shared
                .log(format!("{} pass took {:?}", kind.name(), t.elapsed()));
        }
    }

    /// Waits until every pod is in one of `done` (a pod's attempts are bounded once the
    /// trial settles, see `kubelet::SETTLE_ATTEMPTS`).
    async fn wait_for_pods(&self, done: &[Phase]) {
        while !self.pods.iter().all(|p| done.contains(&p.phase())) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Background {
    StaleGc,
    Repair,
    Inventory,
    OverdueReconcile,
}

impl Background {
    fn name(self) -> &'static str {
        match self {
            Self::StaleGc => "stale GC",
            Self::Repair => "background repair",
            Self::Inventory => "status inventory",
            Self::OverdueReconcile => "reconcile after overdue NVML calls",
        }
    }
}

async fn run_background(instance: Arc<super::world::Instance>, kind: Background) {
    *lock(&instance.state.background) = Some(kind.name());
    let driver = instance.driver.clone();
    match kind {
        Background::StaleGc => {
            // A crash inside panics a blocking task; the pass logs it and goes on.
            let _ = tokio::spawn(async move { driver.collect_stale_claims().await }).await;
        }
        Background::Repair => {
            let _ = tokio::task::spawn_blocking(move || driver.retry_pending_repairs()).await;
        }
        Background::Inventory => {
            let _ = tokio::task::spawn_blocking(move || driver.gpus().inventory()).await;
        }
        Background::OverdueReconcile => {
            let _ = tokio::task::spawn_blocking(move || driver.reconcile_after_overdue()).await;
        }
    }
    *lock(&instance.state.background) = None;
}
