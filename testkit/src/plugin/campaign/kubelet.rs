//! The kubelet's side of a trial: each simulated pod has one or two claims, and a task that
//! prepares them (retrying every failure, as the kubelet does while the pod waits in
//! ContainerCreating), keeps them while the pod runs, and unprepares them after the pod is
//! deleted (retrying until it succeeds; only then does the API server delete the claims).
//! A force-deleted pod is one the kubelet forgets: its claims vanish from the API server with
//! no unprepare, which leaves the plugin a stale record for its garbage collection.
//!
//! Every answer is checked as it comes: prepared devices must be the allocated ones, and a
//! failure must carry a message that names the claim or the cause.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use migdra_kubelet_plugin::driver::ClaimFailure;
use serde_json::json;
use tokio::sync::Notify;

use super::{
    rng::Rng,
    scenario::{ClaimKind, Placement, Usage},
    world::{Call, World, lock},
};
use crate::plugin::{DRIVER, POOL};

/// One claim of a pod.
#[derive(Clone, Debug)]
pub struct PodClaim {
    pub uid: String,
    pub name: String,
    pub kind: ClaimKind,
    pub placements: Vec<Placement>,
}

impl PodClaim {
    /// The ResourceClaim as the scheduler left it: allocated from this node's pool (a share
    /// with its share ID, an `adminAccess` device marked so).
    pub fn object(&self) -> k8s_openapi::api::resource::v1::ResourceClaim {
        let results: Vec<_> = self
            .placements
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let mut result =
                    json!({"request": format!("gpu{i}"), "driver": DRIVER, "pool": POOL, "device": p.device});
                match &p.usage {
                    Usage::Share(id) => result["shareID"] = json!(id),
                    Usage::Admin => result["adminAccess"] = json!(true),
                    Usage::Exclusive | Usage::Whole => {}
                }
                result
            })
            .collect();
        serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": self.name, "namespace": "default", "uid": self.uid},
            "spec": {"devices": {"requests": []}},
            "status": {"allocation": {"devices": {"results": results, "config": []}}},
        }))
        .unwrap_or_else(|e| panic!("claim {}: {e}", self.name))
    }

    pub fn is_admin(&self) -> bool {
        self.kind == ClaimKind::AdminAccess
    }
}

/// Where a pod is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Preparing,
    Running,
    Unpreparing,
    /// Unprepared (or forgotten) and its claims deleted.
    Gone,
    /// Stopped retrying after the faults were cleared (reported as a violation).
    GaveUp,
}

#[derive(Debug)]
pub struct PodStatus {
    pub phase: Phase,
    pub attempts: u32,
    /// Attempts since the trial started settling, and how many of them the plugin answered
    /// with a failure.
    pub settle_attempts: u32,
    pub settle_failures: u32,
    pub last_error: Option<String>,
}

/// A pod and what the campaign tells it.
pub struct Pod {
    pub id: usize,
    pub claims: Vec<PodClaim>,
    pub deleted: AtomicBool,
    /// Deleted without the kubelet ever unpreparing (it lost the pod).
    pub forgotten: AtomicBool,
    /// The node rebooted: a running pod's containers are gone, and the kubelet prepares its
    /// claims again before restarting them.
    pub rebooted: AtomicBool,
    pub wake: Notify,
    pub status: Mutex<PodStatus>,
}

/// Failures a pod accepts once the faults are cleared before it gives up.
pub const SETTLE_ATTEMPTS: u32 = 60;

impl Pod {
    pub fn new(id: usize, claims: Vec<PodClaim>) -> Self {
        Self {
            id,
            claims,
            deleted: AtomicBool::new(false),
            forgotten: AtomicBool::new(false),
            rebooted: AtomicBool::new(false),
            wake: Notify::new(),
            status: Mutex::new(PodStatus {
                phase: Phase::Preparing,
                attempts: 0,
                settle_attempts: 0,
                settle_failures: 0,
                last_error: None,
            }),
        }
    }

    pub fn phase(&self) -> Phase {
        lock(&self.status).phase
    }

    pub fn delete(&self) {
        self.deleted.store(true, Ordering::SeqCst);
        self.wake.notify_one();
    }

    /// The node rebooted under the pod.
    pub fn reboot(&self) {
        self.rebooted.store(true, Ordering::SeqCst);
        self.wake.notify_one();
    }

    pub fn forget(&self) {
        self.forgotten.store(true, Ordering::SeqCst);
        self.delete();
    }

    fn set_phase(&self, phase: Phase) {
        lock(&self.status).phase = phase;
    }

    fn refs(&self) -> Vec<(String, String)> {
        self.claims
            .iter()
            .map(|c| (c.uid.clone(), c.name.clone()))
            .collect()
    }

    /// Counts an attempt; false when the pod gives up (only while settling, after
    /// [`SETTLE_ATTEMPTS`] answered failures, or ten times as many calls that got no answer,
    /// so that a slow machine is not mistaken for a claim that cannot converge).
    fn attempt(&self, world: &World) -> bool {
        let mut status = lock(&self.status);
        status.attempts += 1;
        if world.settling.load(Ordering::SeqCst) {
            status.settle_attempts += 1;
            if status.settle_failures > SETTLE_ATTEMPTS || status.settle_attempts > 10 * SETTLE_ATTEMPTS {
                status.phase = Phase::GaveUp;
                return false;
            }
        }
        true
    }

    /// Records an answered failure.
    fn failed(&self, world: &World, message: String) {
        let mut status = lock(&self.status);
        if world.settling.load(Ordering::SeqCst) {
            status.settle_failures += 1;
        }
        status.last_error = Some(message);
    }
}

/// True when a failure message says what failed: it is not empty and names the claim (its
/// name or UID) or one of its devices, or the cause the campaign put there: the text of an
/// NVML error it injected (or a lost GPU's, or a busy GPU's), or the node lock another call
/// holds (`causes`, see [`super::world::Shared::causes`]).
pub fn clear_message(message: &str, claim: &PodClaim, causes: &[String]) -> bool {
    !message.trim().is_empty()
        && (message.contains(&claim.name)
            || message.contains(&claim.uid)
            || claim.placements.iter().any(|p| names_device(message, &p.device))
            || causes.iter().any(|c| message.contains(c.as_str())))
}

/// Whether `message` names `device` itself (`gpu-1` is not named by `gpu-12`, nor by
/// `gpu-1-mig-…`).
fn names_device(message: &str, device: &str) -> bool {
    message.match_indices(device).any(|(at, _)| {
        let next = message[at + device.len()..].chars().next();
        !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-')
    })
}

fn check_failure(world: &World, pod: &Pod, claim: &PodClaim, operation: &str, failure: &ClaimFailure) {
    let message = failure.to_string();
    if !clear_message(&message, claim, &world.shared.causes()) {
        world.shared.violation(
            "unclear failure message",
            format!(
                "{operation} of {} ({}): {message:?}",
                claim.name,
                failure.reason()
            ),
        );
    }
    pod.failed(world, format!("{operation}: {message}"));
}

fn log_call<T>(world: &World, pod: &Pod, operation: &str, call: &Call<T>) {
    let what = match call {
        Call::NoPlugin => "no plugin registered".to_string(),
        Call::Crashed => "the plugin died during the call".to_string(),
        Call::Abandoned => "abandoned at the deadline".to_string(),
        Call::Answered(outcomes) => pod
            .claims
            .iter()
            .map(|c| match outcomes.get(&c.uid) {
                Some(Ok(_)) => format!("{}: ok", c.name),
                Some(Err(e)) => format!("{}: {e}", c.name),
                None => format!("{}: no outcome", c.name),
            })
            .collect::<Vec<_>>()
            .join("; "),
    };
    world.shared.log(format!("pod {} {operation}: {what}", pod.id));
}

/// Runs a pod to its end.
pub async fn run_pod(world: Arc<World>, pod: Arc<Pod>, mut rng: Rng) {
    loop {
        if !prepare_pod(&world, &pod, &mut rng).await {
            return;
        }
        // Run until deleted, or prepare again after a reboot.
        loop {
            let woken = pod.wake.notified();
            if pod.deleted.load(Ordering::SeqCst) || pod.rebooted.load(Ordering::SeqCst) {
                break;
            }
            woken.await;
        }
        if pod.deleted.load(Ordering::SeqCst) {
            break;
        }
        if pod.rebooted.swap(false, Ordering::SeqCst) {
            pod.set_phase(Phase::Preparing);
            world
                .shared
                .log(format!("pod {} prepares again after the reboot", pod.id));
        }
    }
    if pod.forgotten.load(Ordering::SeqCst) {
        // The campaign removed (or replaced) its claims already.
        pod.set_phase(Phase::Gone);
        return;
    }
    pod.set_phase(Phase::Unpreparing);
    let refs = pod.refs();
    let mut backoff = Backoff::default();
    loop {
        if !pod.attempt(&world) {
            return;
        }
        let call = world.unprepare(&refs).await;
        log_call(&world, &pod, "unprepare", &call);
        if let Call::Answered(outcomes) = call {
            let mut all = true;
            for claim in &pod.claims {
                match outcomes.get(&claim.uid) {
                    Some(Ok(())) => {}
                    Some(Err(failure)) => {
                        all = false;
                        check_failure(&world, &pod, claim, "unprepare", failure);
                    }
                    None => {
                        all = false;
                        world.shared.violation(
                            "no outcome",
                            format!("unprepare answered without an outcome for {}", claim.name),
                        );
                    }
                }
            }
            if all {
                break;
            }
        }
        backoff.wait(&mut rng).await;
    }
    world.delete_claims(&pod);
    pod.set_phase(Phase::Gone);
    world.shared.log(format!("pod {} unprepared and gone", pod.id));
}

/// Prepares the pod's claims until it works (true: the pod runs) or the pod is deleted (true:
/// it goes on to its unprepare) or gives up (false).
async fn prepare_pod(world: &World, pod: &Pod, rng: &mut Rng) -> bool {
    let refs = pod.refs();
    let mut backoff = Backoff::default();
    loop {
        if pod.deleted.load(Ordering::SeqCst) {
            return true;
        }
        if !pod.attempt(world) {
            return false;
        }
        let call = world.prepare(&refs).await;
        log_call(world, pod, "prepare", &call);
        if let Call::Answered(outcomes) = call {
            let mut all = true;
            for claim in &pod.claims {
                match outcomes.get(&claim.uid) {
                    Some(Ok(devices)) => check_prepared(world, claim, devices),
                    Some(Err(failure)) => {
                        all = false;
                        check_failure(world, pod, claim, "prepare", failure);
                    }
                    None => {
                        all = false;
                        world.shared.violation(
                            "no outcome",
                            format!("prepare answered without an outcome for {}", claim.name),
                        );
                    }
                }
            }
            if all {
                pod.set_phase(Phase::Running);
                world.shared.log(format!("pod {} running", pod.id));
                return true;
            }
        }
        backoff.wait(rng).await;
    }
}

/// The prepared devices must be the allocated ones, each share with its own share ID.
fn check_prepared(world: &World, claim: &PodClaim, devices: &[dra_kubelet::PreparedDevice]) {
    let mut got: Vec<(&str, Option<&str>)> = devices
        .iter()
        .map(|d| (d.device_name.as_str(), d.share_id.as_deref()))
        .collect();
    let mut want: Vec<(&str, Option<&str>)> = claim
        .placements
        .iter()
        .map(|p| (p.device.as_str(), p.share_id()))
        .collect();
    got.sort_unstable();
    want.sort_unstable();
    if got != want {
        world.shared.violation(
            "prepared devices differ from the allocation",
            format!("{}: prepared {got:?}, allocated {want:?}", claim.name),
        );
    }
}

/// The kubelet's retry back-off (its pod workers back off exponentially too), jittered.
struct Backoff {
    next_ms: u64,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { next_ms: 4 }
    }
}

impl Backoff {
    const MAX_MS: u64 = 80;

    async fn wait(&mut self, rng: &mut Rng) {
        let ms = self.next_ms / 2 + rng.below(self.next_ms / 2 + 1);
        self.next_ms = (self.next_ms * 2).min(Self::MAX_MS);
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}
