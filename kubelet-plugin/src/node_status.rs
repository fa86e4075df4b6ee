//! The node's `GpuNode` and heartbeat: the GpuNode is created with a Node owner reference (so
//! it is garbage-collected with the node) and kept current with the inventory and the kubelet
//! registration state, from which the controller decides what to publish for this node.
//!
//! The heartbeat. With a namespace (the chart's pod namespace), the plugin renews a
//! `coordination.k8s.io/v1` Lease `<node>.<driver>` there every heartbeat interval, as the
//! kubelet renews its node Lease: a ~400-byte merge patch that the controller only checks
//! liveness on. The GpuNode status, whose inventory is tens of kilobytes that every
//! controller replica decodes and re-evaluates, is then written only when something in it
//! other than the heartbeat time changed, and otherwise every
//! `gpunode_heartbeat_interval` (5 minutes by default), announcing that interval in
//! `heartbeatIntervalSeconds`: a controller that predates the Lease reads only the GpuNode and
//! allows 1.5 of those intervals, so it keeps the pool (it still notices a dead plugin by the
//! kubelet's slice wipe). Without a namespace, or when renewals fail or fall behind, the
//! GpuNode carries the heartbeat as before. See the controller's `liveness` module for how
//! the two combine.
//!
//! The Lease is renewed by a task of its own on its own timer (as the kubelet renews its node
//! Lease apart from the node status), started once the GpuNode exists: the status loop's
//! inventory refresh (NVML, unbounded), events and GpuNode writes never delay a renewal.
//!
//! [`StatusLoop`] reads the GPU table ([`crate::gpus`]), never the driver: it keeps running
//! while another plugin instance holds the node lock.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use k8s_openapi::{
    api::{coordination::v1::Lease, core::v1::Node},
    apimachinery::pkg::apis::meta::v1::{MicroTime, OwnerReference, Time},
    jiff::Timestamp,
};
use kube::{
    Api, Client, Resource,
    api::{Patch, PatchParams},
    runtime::events::{Event, EventType, Recorder, Reporter},
};
use migdra_api::inventory::{
    API_VERSION, GpuInventory, GpuNode, HEARTBEAT_LEASE_LABEL, NodeSummary, PluginStatus, RenewalRetry,
    heartbeat_lease_name,
};
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::{
    driver::RecoveryEvent,
    events::{ClaimEvent, ClaimEvents},
    gpus::{Gpus, PendingRepair},
    nvml::GpuBackend,
};
use dra_kubelet::{DeviceHealthReport, RegistrationState};

/// Field manager of the plugin's writes.
pub const FIELD_MANAGER: &str = "migdra-kubelet-plugin";

/// By event type and reason: the note of the last event recorded, and its recorder.
type LastEvents = HashMap<(EventType, String), (String, Recorder)>;

/// The heartbeat Lease of this node.
#[derive(Clone)]
struct HeartbeatLease {
    api: Api<Lease>,
    name: String,
    /// False until the whole object was applied (and again after a renewal found it gone).
    exists: bool,
}

/// Writes this node's GpuNode and renews its heartbeat Lease.
#[derive(Clone)]
pub struct NodeStatusWriter {
    api: Api<GpuNode>,
    nodes: Api<Node>,
    node: String,
    node_uid: String,
    driver: String,
    started: Timestamp,
    heartbeat_interval: Duration,
    client: Client,
    recorders: Arc<Mutex<LastEvents>>,
    gpunode_interval: Duration,
    lease: Option<HeartbeatLease>,
    reference: Option<k8s_openapi::api::core::v1::ObjectReference>,
}

impl NodeStatusWriter {
    /// A writer for `node`, serving `driver`.
    pub fn new(client: Client, node: &str, driver: &str, heartbeat_interval: Duration) -> Self {
        Self {
            api: Api::all(client.clone()),
            nodes: Api::all(client.clone()),
            node: node.to_string(),
            node_uid: String::new(),
            driver: driver.to_string(),
            started: Timestamp::now(),
            heartbeat_interval,
            client,
            recorders: Arc::default(),
            gpunode_interval: heartbeat_interval,
            lease: None,
            reference: None,
        }
    }

    /// The recorder for an event of `type_` and `reason` with `note`. kube's [`Recorder`] folds
    /// every event of one type and reason on one object into a single series that keeps the
    /// first note, so the release of a second claim (or a second GPU turning unhealthy) would
    /// show the first one's message. A repeat of the last note of that type and reason stays
    /// in its series; another note gets a recorder, and so an event, of its own.
    fn recorder(&self, type_: EventType, reason: &str, note: &str) -> Recorder {
        let mut recorders = self
            .recorders
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let key = (type_, reason.to_string());
        if let Some((last, recorder)) = recorders.get(&key)
            && last == note
        {
            return recorder.clone();
        }
        let recorder = Recorder::new(
            self.client.clone(),
            Reporter {
                controller: FIELD_MANAGER.into(),
                instance: Some(self.node.clone()),
            },
        );
        recorders.insert(key, (note.to_string(), recorder.clone()));
        recorder
    }

    /// Heartbeats through the Lease `<node>.<driver>` in `namespace`, and writes the GpuNode
    /// status only on change or every `gpunode_interval`. Without a valid Lease name (an
    /// over-long node name) the GpuNode keeps carrying the heartbeat.
    pub fn with_heartbeat_lease(
        mut self,
        client: Client,
        namespace: &str,
        gpunode_interval: Duration,
    ) -> Self {
        match heartbeat_lease_name(&self.node, &self.driver) {
            Some(name) => {
                self.lease = Some(HeartbeatLease {
                    api: Api::namespaced(client, namespace),
                    name,
                    exists: false,
                });
                self.gpunode_interval = gpunode_interval.max(self.heartbeat_interval);
            }
            None => tracing::warn!(
                node = %self.node,
                "the node name is too long for a heartbeat Lease; heartbeating in the GpuNode"
            ),
        }
        self
    }

    /// True when heartbeats go to a Lease.
    pub fn has_heartbeat_lease(&self) -> bool {
        self.lease.is_some()
    }

    /// The longest time between two GpuNode status writes.
    pub fn gpunode_interval(&self) -> Duration {
        self.gpunode_interval
    }

    /// Creates or adopts the GpuNode (metadata and spec), owned by the Node.
    pub async fn ensure_object(&mut self) -> Result<(), kube::Error> {
        let node = self.nodes.get(&self.node).await?;
        self.node_uid = node.meta().uid.clone().unwrap_or_default();
        let owner = self.owner();
        let object = json!({
            "apiVersion": API_VERSION,
            "kind": "GpuNode",
            "metadata": { "name": self.node, "ownerReferences": [owner] },
            "spec": { "nodeName": self.node, "driver": self.driver },
        });
        let written = self
            .api
            .patch(
                &self.node,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(object),
            )
            .await?;
        self.reference = Some(written.object_ref(&()));
        Ok(())
    }

    fn owner(&self) -> OwnerReference {
        OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: self.node.clone(),
            uid: self.node_uid.clone(),
            ..OwnerReference::default()
        }
    }

    /// The whole heartbeat Lease as the plugin applies it.
    pub fn lease_object(&self, name: &str, now: Timestamp) -> serde_json::Value {
        json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": name,
                "labels": { HEARTBEAT_LEASE_LABEL: self.driver },
                "ownerReferences": [self.owner()],
            },
            "spec": {
                "holderIdentity": self.node,
                "leaseDurationSeconds": lease_duration_seconds(self.heartbeat_interval),
                "acquireTime": MicroTime(self.started),
                "renewTime": MicroTime(now),
            },
        })
    }

    /// Renews the heartbeat Lease (applies it whole the first time and after it vanished).
    /// Does nothing without a Lease. Call after [`Self::ensure_object`] (the owner UID).
    pub async fn renew_lease(&mut self) -> Result<(), kube::Error> {
        let now = Timestamp::now();
        let Some(lease) = &self.lease else {
            return Ok(());
        };
        if lease.exists {
            let renew = json!({ "spec": { "renewTime": MicroTime(now) } });
            match lease
                .api
                .patch(&lease.name, &PatchParams::default(), &Patch::Merge(renew))
                .await
            {
                Ok(_) => return Ok(()),
                Err(kube::Error::Api(e)) if e.code == 404 => {
                    tracing::info!(lease = %lease.name, "the heartbeat Lease is gone; re-creating it");
                }
                Err(e) => return Err(e),
            }
        }
        let object = self.lease_object(&lease.name, now);
        let (api, name) = (lease.api.clone(), lease.name.clone());
        api.patch(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(object),
        )
        .await?;
        if let Some(lease) = &mut self.lease {
            lease.exists = true;
        }
        Ok(())
    }

    /// Records a Kubernetes event on the GpuNode (once it exists). Failures are only logged:
    /// events are for people, never a reason to stop.
    pub async fn event(&self, type_: EventType, reason: &str, note: String) {
        let Some(reference) = &self.reference else { return };
        let recorder = self.recorder(type_, reason, &note);
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: reason.into(),
            secondary: None,
        };
        if let Err(e) = recorder.publish(&event, reference).await {
            tracing::warn!(error = %e, reason, "recording an event failed");
        }
    }

    /// The plugin's part of the status at `now`. `heartbeatIntervalSeconds` is how often the
    /// GpuNode itself is rewritten: the heartbeat interval without a Lease, the (longer) GpuNode
    /// interval with one.
    pub fn plugin_status(
        &self,
        registration: &RegistrationState,
        driver_version: Option<String>,
        now: Timestamp,
    ) -> PluginStatus {
        let interval = if self.lease.is_some() {
            self.gpunode_interval
        } else {
            self.heartbeat_interval
        };
        PluginStatus {
            version: env!("CARGO_PKG_VERSION").to_string(),
            registered: registration.registered,
            registration_error: registration.error.clone(),
            start_time: Time(self.started),
            heartbeat_time: Time(now),
            heartbeat_interval_seconds: u32::try_from(interval.as_secs()).unwrap_or(u32::MAX),
            driver_version,
        }
    }

    /// Writes the plugin's part of the status.
    pub async fn publish(
        &self,
        registration: &RegistrationState,
        driver_version: Option<String>,
        gpus: &[GpuInventory],
    ) -> Result<(), kube::Error> {
        let plugin = self.plugin_status(registration, driver_version, Timestamp::now());
        let status = json!({
            "apiVersion": API_VERSION,
            "kind": "GpuNode",
            "status": { "plugin": plugin, "gpus": gpus, "summary": NodeSummary::of(gpus) },
        });
        self.api
            .patch_status(
                &self.node,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(status),
            )
            .await?;
        Ok(())
    }
}

/// How long one heartbeat write (the GpuNode, its status, the Lease) may take: two intervals.
/// The client's own read timeout is minutes, and one call hanging on an overloaded API server
/// would otherwise hold every later beat; but a bound of one interval cancels every write once
/// the server answers writes more slowly than that, and then no beat lands at all (the bench's
/// real node, beating every 3 s while a saturated API server took 3 s and more per write, had
/// its pool withdrawn and no beat of it reached the controller for ten minutes). A write
/// answered late is a heartbeat; a cancelled one is not.
fn write_bound(interval: Duration) -> Duration {
    interval.saturating_mul(2)
}

/// Runs one API call of the heartbeat loop for at most `limit` (see [`write_bound`]; events
/// get one interval: they are no heartbeat). `None` (logged) when it did not answer in time.
async fn bounded<T>(limit: Duration, what: &str, call: impl Future<Output = T>) -> Option<T> {
    match tokio::time::timeout(limit, call).await {
        Ok(answer) => Some(answer),
        Err(_) => {
            tracing::warn!(timeout = ?limit, "{what}: no answer in time; the next beat tries again");
            None
        }
    }
}

/// The status loop: refreshes the inventory and device health every `interval`, and
/// immediately when the kubelet's registration state changes; publishes them in the GpuNode
/// (when there is a writer) with events for GPU health changes and startup repairs. With a
/// heartbeat Lease, it starts the Lease's own renewal task once the GpuNode exists and writes
/// the GpuNode at its next beat whenever that task's renewals fail or fall behind.
pub struct StatusLoop<B> {
    /// The GPU table the inventory comes from.
    pub gpus: Gpus<B>,
    /// Writes the GpuNode; `None` only refreshes the device health.
    pub writer: Option<NodeStatusWriter>,
    /// What startup recovery repaired, recorded once as an event (see
    /// [`crate::driver::RecoveryReport::summary`]).
    pub recovery_note: Option<String>,
    /// Driver events to record (records left unrepaired at start, repairs finished in the
    /// background, stale claims released); kept until the GpuNode exists.
    pub recovery_events: Option<mpsc::UnboundedReceiver<RecoveryEvent>>,
    /// The kubelet's registration state.
    pub registration: watch::Receiver<RegistrationState>,
    /// Where the device health goes (the resource-health stream).
    pub health: watch::Sender<Vec<DeviceHealthReport>>,
    /// Time between refreshes (the heartbeat).
    pub interval: Duration,
    /// Where events about claims go: a GPU turning unhealthy is also a Warning on each claim
    /// with a device on it; a repair left pending and its completion are events on the claim.
    pub claim_events: ClaimEvents,
}

impl<B: GpuBackend + 'static> StatusLoop<B> {
    /// Runs until `shutdown`; then stops the Lease renewals and reports the plugin as
    /// unregistered so the controller withdraws the pool without waiting for the heartbeat to
    /// go stale. Dropping the future (an aborted task) stops the Lease renewals too.
    pub async fn run(self, shutdown: CancellationToken) {
        let Self {
            gpus,
            mut writer,
            mut recovery_note,
            mut recovery_events,
            mut registration,
            health,
            interval,
            claim_events,
        } = self;
        let driver_version = gpus.backend().driver_version().ok();
        let mut object_ready = false;
        let mut registration_open = true;
        let mut health_seen: std::collections::BTreeMap<u32, bool> = std::collections::BTreeMap::new();
        let mut repairs_seen = std::collections::BTreeMap::new();
        let mut last_written: Option<WrittenStatus> = None;
        let mut lease: Option<LeaseTask> = None;
        loop {
            let beat_started = tokio::time::Instant::now();
            let inventory = refresh(&gpus).await;
            let refresh_took = beat_started.elapsed();
            if let Some(inventory) = &inventory {
                let reports = gpus.device_health(inventory);
                health.send_if_modified(|current| {
                    let changed = *current != reports;
                    if changed {
                        *current = reports;
                    }
                    changed
                });
            }
            // Repairs that became pending or are done: an event on their claim.
            for event in repair_claim_events(&mut repairs_seen, gpus.recovery_pending()) {
                claim_events.send(event);
            }
            // GPU health changes: a Warning on each claim using a GPU that became unhealthy
            // (queued, with or without a GpuNode writer), and an event on the GpuNode.
            let mut health_changes = Vec::new();
            for gpu in inventory.iter().flatten() {
                let before = health_seen.insert(gpu.minor, gpu.health.healthy);
                match (before, gpu.health.healthy) {
                    (Some(true) | None, false) => {
                        let reason = gpu.health.reason.clone().unwrap_or_default();
                        for event in unhealthy_gpu_claim_events(&gpus, gpu, &reason) {
                            claim_events.send(event);
                        }
                        let note = format!("GPU {} ({}) is unhealthy: {reason}", gpu.minor, gpu.uuid);
                        health_changes.push((EventType::Warning, "GpuUnhealthy", note));
                    }
                    (Some(false), true) => {
                        let note = format!("GPU {} ({}) is healthy again", gpu.minor, gpu.uuid);
                        health_changes.push((EventType::Normal, "GpuHealthy", note));
                    }
                    _ => {}
                }
            }
            if let (Some(writer), Some(inventory)) = (&mut writer, &inventory) {
                if !object_ready {
                    match bounded(
                        write_bound(interval),
                        "creating the GpuNode",
                        writer.ensure_object(),
                    )
                    .await
                    {
                        Some(Ok(())) => object_ready = true,
                        Some(Err(e)) => tracing::warn!(error = %e, "creating the GpuNode failed; retrying"),
                        None => {}
                    }
                }
                if object_ready
                    && writer.has_heartbeat_lease()
                    && lease.as_ref().is_none_or(|l| l.node_uid != writer.node_uid)
                {
                    // The Lease's owner is the Node: started once its UID is known, and
                    // restarted (re-applying the Lease) if the Node turned out replaced.
                    lease = Some(LeaseTask::start(writer.clone(), interval, &shutdown));
                }
                if object_ready && let Some(note) = recovery_note.take() {
                    let event = writer.event(EventType::Warning, "RecoveredInterruptedOperations", note);
                    bounded(interval, "recording an event", event).await;
                }
                if object_ready && let Some(events) = &mut recovery_events {
                    while let Ok(event) = events.try_recv() {
                        let event = writer.event(event.type_, event.reason, event.note);
                        bounded(interval, "recording an event", event).await;
                    }
                }
                for (type_, reason, note) in health_changes {
                    bounded(interval, "recording an event", writer.event(type_, reason, note)).await;
                }
                if object_ready {
                    let state = registration.borrow().clone();
                    let content = WrittenStatus {
                        registration: state.clone(),
                        driver_version: driver_version.clone(),
                        gpus: inventory.clone(),
                        at: tokio::time::Instant::now(),
                    };
                    // A failing or late Lease makes this beat a GpuNode write, so liveness
                    // never depends on the Lease alone.
                    let lease_live = lease.as_ref().is_some_and(|l| l.live(content.at, interval));
                    if !lease_live || gpunode_due(last_written.as_ref(), &content, writer.gpunode_interval())
                    {
                        let publish = writer.publish(&state, driver_version.clone(), inventory);
                        match bounded(write_bound(interval), "updating the GpuNode status", publish).await {
                            Some(Ok(())) => last_written = Some(content),
                            Some(Err(e)) => {
                                tracing::warn!(error = %e, "updating the GpuNode status failed; retrying");
                                object_ready = false;
                                last_written = None;
                            }
                            // No answer says nothing about the object: the next beat writes
                            // the status again, without first re-creating the GpuNode (one
                            // more slow write on a server that is already slow).
                            None => last_written = None,
                        }
                    }
                }
            }
            let beat_took = beat_started.elapsed();
            if beat_took > interval {
                tracing::warn!(
                    ?interval,
                    refresh = ?refresh_took,
                    api_calls = ?beat_took.saturating_sub(refresh_took),
                    "a status beat took longer than the heartbeat interval; the next one is late"
                );
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(interval) => {}
                changed = registration.changed(), if registration_open => {
                    // A closed channel means the registration server is gone; from then on the
                    // timer alone drives the heartbeat.
                    registration_open = changed.is_ok();
                }
            }
        }
        // No renewal after the plugin reported itself gone.
        if let Some(lease) = lease {
            lease.stop().await;
        }
        if let (Some(writer), Some(inventory)) = (&writer, refresh(&gpus).await) {
            let gone = RegistrationState {
                registered: false,
                error: Some("plugin shut down".into()),
            };
            if let Err(e) = writer.publish(&gone, driver_version, &inventory).await {
                tracing::warn!(error = %e, "reporting shutdown in the GpuNode failed");
            }
        }
    }
}

/// How the heartbeat Lease's renewals are going, as its task reports them to the status loop.
#[derive(Clone, Copy, Debug, Default)]
struct LeaseRenewals {
    /// When a renewal last succeeded.
    last_renewed: Option<tokio::time::Instant>,
    /// The latest renewal failed or did not answer in time.
    failing: bool,
}

impl LeaseRenewals {
    /// True when the Lease carries the heartbeat at `now`: the latest renewal succeeded, no
    /// longer ago than the Lease's own duration (one and a half intervals, see
    /// [`lease_duration_seconds`]). Later than that, a renewal is stuck.
    fn live(&self, now: tokio::time::Instant, interval: Duration) -> bool {
        !self.failing
            && self
                .last_renewed
                .is_some_and(|at| now.saturating_duration_since(at) <= interval + interval / 2)
    }
}

/// The task renewing the heartbeat Lease every interval, apart from the status loop.
/// Dropping it stops the task (the status loop aborted in a hand-over, or restarting it).
struct LeaseTask {
    renewals: watch::Receiver<LeaseRenewals>,
    /// The Node UID the Lease's owner reference carries.
    node_uid: String,
    cancel_on_drop: tokio_util::sync::DropGuard,
    task: tokio::task::JoinHandle<()>,
}

impl LeaseTask {
    /// Starts renewing through `writer` (after its [`NodeStatusWriter::ensure_object`]) every
    /// `interval`, until `shutdown` or until this is dropped or stopped.
    fn start(writer: NodeStatusWriter, interval: Duration, shutdown: &CancellationToken) -> Self {
        let stop = shutdown.child_token();
        let (report, renewals) = watch::channel(LeaseRenewals::default());
        let node_uid = writer.node_uid.clone();
        let task = tokio::spawn(renew_lease_every(writer, interval, report, stop.clone()));
        Self {
            renewals,
            node_uid,
            cancel_on_drop: stop.drop_guard(),
            task,
        }
    }

    fn live(&self, now: tokio::time::Instant, interval: Duration) -> bool {
        self.renewals.borrow().live(now, interval)
    }

    /// Stops the task and waits until it ended (an unanswered renewal is dropped).
    async fn stop(self) {
        drop(self.cancel_on_drop);
        if let Err(e) = self.task.await {
            tracing::warn!(error = %e, "heartbeat Lease task failed");
        }
    }
}

/// Renews the heartbeat Lease every `interval` (each renewal bounded by [`write_bound`]) until
/// `stop`, reporting each outcome to `report`. A renewal refused by an answer that can change
/// on its own (429 from API Priority and Fairness, 5xx, no connection) is tried again, with a
/// fresh `renewTime`, after a [`RenewalRetry`] delay, while that comes before the next beat:
/// one refused renewal would otherwise let the heartbeat expire (see [`RenewalRetry`]).
async fn renew_lease_every(
    mut writer: NodeStatusWriter,
    interval: Duration,
    report: watch::Sender<LeaseRenewals>,
    stop: CancellationToken,
) {
    let mut timer = tokio::time::interval(interval);
    // After a renewal that hit its bound, the next one goes at once, then on the beat again.
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut retry = RenewalRetry::default();
    let mut next_beat = tokio::time::Instant::now();
    let mut retry_at: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            beat = timer.tick() => next_beat = beat + interval,
            _ = sleep_until_some(retry_at) => {}
        }
        retry_at = None;
        let outcome = tokio::select! {
            _ = stop.cancelled() => break,
            outcome = bounded(write_bound(interval), "renewing the heartbeat Lease", writer.renew_lease()) => outcome,
        };
        let renewed = match outcome {
            Some(Ok(())) => {
                if retry.failures() > 0 {
                    tracing::info!(
                        failed = retry.failures(),
                        "renewed the heartbeat Lease after failed attempts"
                    );
                }
                retry.succeeded();
                true
            }
            Some(Err(e)) => {
                let status = match &e {
                    kube::Error::Api(status) => Some(status.code),
                    _ => None,
                };
                let until_next_beat = next_beat.saturating_duration_since(tokio::time::Instant::now());
                let delay = RenewalRetry::retryable(status)
                    .then(|| retry.failed_now(until_next_beat))
                    .flatten();
                retry_at = delay.map(|d| tokio::time::Instant::now() + d);
                if retry.failures() <= 1 {
                    tracing::warn!(error = %e, retry_in = ?delay, "renewing the heartbeat Lease failed; until it succeeds, beats go to the GpuNode");
                } else {
                    tracing::debug!(error = %e, failed = retry.failures(), retry_in = ?delay, "renewing the heartbeat Lease failed again");
                }
                false
            }
            // Unanswered within its bound: the next beat is due already.
            None => false,
        };
        report.send_modify(|r| {
            if renewed {
                r.last_renewed = Some(tokio::time::Instant::now());
            }
            r.failing = !renewed;
        });
    }
}

/// The client the heartbeat Lease is renewed through: `config` without kube's own retry of
/// 429/503/504, which would resend the same request, `renewTime` and all, after the API
/// server's Retry-After; [`renew_lease_every`] retries with a fresh one instead. A client of
/// its own also keeps renewals off the connection the GpuNode and event writes queue on, as
/// the kubelet keeps its node Lease on a heartbeat client.
pub fn heartbeat_client(mut config: kube::Config) -> Result<Client, kube::Error> {
    config.default_retry = false;
    Client::try_from(config)
}

/// Sleeps until `at`, or forever without one.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The events for repairs that appeared in `now` (pending) or left it (completed) since
/// `seen`, which becomes `now`.
fn repair_claim_events(
    seen: &mut std::collections::BTreeMap<String, PendingRepair>,
    now: Vec<PendingRepair>,
) -> Vec<ClaimEvent> {
    let now: std::collections::BTreeMap<String, PendingRepair> =
        now.into_iter().map(|p| (p.uid.clone(), p)).collect();
    let pending = now
        .iter()
        .filter(|(uid, _)| !seen.contains_key(*uid))
        .filter_map(|(_, p)| ClaimEvent::recovery_pending(p));
    let completed = seen
        .iter()
        .filter(|(uid, _)| !now.contains_key(*uid))
        .filter_map(|(_, p)| ClaimEvent::recovery_completed(p));
    let events = pending.chain(completed).collect();
    *seen = now;
    events
}

/// The events for the recorded claims with a device on `gpu`, which became unhealthy.
fn unhealthy_gpu_claim_events<B: GpuBackend + 'static>(
    gpus: &Gpus<B>,
    gpu: &GpuInventory,
    why: &str,
) -> Vec<ClaimEvent> {
    gpus.recorded_claims_on(gpu.minor)
        .into_iter()
        .map(|(uid, namespace, name)| {
            ClaimEvent::gpu_unhealthy(namespace, name, uid, gpu.minor, &gpu.uuid, why)
        })
        .collect()
}

/// What the last GpuNode status write carried, and when.
struct WrittenStatus {
    registration: RegistrationState,
    driver_version: Option<String>,
    gpus: Vec<GpuInventory>,
    at: tokio::time::Instant,
}

/// True when the GpuNode status must be written: never written, something other than the
/// heartbeat time changed, or `interval` passed since the last write.
fn gpunode_due(last: Option<&WrittenStatus>, now: &WrittenStatus, interval: Duration) -> bool {
    let Some(last) = last else { return true };
    last.registration != now.registration
        || last.driver_version != now.driver_version
        || last.gpus != now.gpus
        || now.at.saturating_duration_since(last.at) >= interval
}

/// The Lease's `leaseDurationSeconds`: one and a half heartbeat intervals (rounded up), the
/// window in which the controller expects the next renewal.
pub fn lease_duration_seconds(interval: Duration) -> i32 {
    let millis = interval.as_millis().saturating_mul(3).div_ceil(2);
    i32::try_from(millis.div_ceil(1000)).unwrap_or(i32::MAX)
}

/// One inventory, on a blocking thread (NVML calls block); `None` when it failed (logged).
async fn refresh<B: GpuBackend + 'static>(gpus: &Gpus<B>) -> Option<Vec<GpuInventory>> {
    let gpus = gpus.clone();
    match tokio::task::spawn_blocking(move || gpus.inventory()).await {
        Ok(Ok(inventory)) => Some(inventory),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "GPU discovery failed");
            None
        }
        Err(e) => {
            tracing::error!(error = %e, "inventory task failed");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use http::{Method, Request, Response};
    use k8s_openapi::api::core::v1::ObjectReference;
    use kube::client::Body;
    use tower_test::mock;

    use super::*;

    /// What the API server was asked: (method, event name, note), answering each request with
    /// its own body (which is the event for a create and for the recorder's merge patch).
    async fn serve_events(
        mut handle: mock::Handle<Request<Body>, Response<Body>>,
        count: usize,
    ) -> Vec<(Method, String, String)> {
        let mut seen = Vec::new();
        for _ in 0..count {
            let (request, send) = handle.next_request().await.expect("the writer stopped asking");
            let method = request.method().clone();
            let path = request.uri().path().to_string();
            let body = request.into_body().collect_bytes().await.expect("request body");
            let event: serde_json::Value = serde_json::from_slice(&body).expect("an event");
            let name = match method {
                Method::POST => event["metadata"]["name"].as_str().unwrap_or_default().to_string(),
                _ => path.rsplit('/').next().unwrap_or_default().to_string(),
            };
            seen.push((
                method,
                name,
                event["note"].as_str().unwrap_or_default().to_string(),
            ));
            send.send_response(
                Response::builder()
                    .body(Body::from(body.to_vec()))
                    .expect("response"),
            );
        }
        seen
    }

    #[tokio::test]
    async fn events_with_another_note_are_not_folded_into_the_first() {
        let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let mut writer = NodeStatusWriter::new(
            Client::new(service, "default"),
            "node-a",
            "gpu.migdra.dev",
            Duration::from_secs(15),
        );
        writer.reference = Some(ObjectReference {
            api_version: Some(API_VERSION.into()),
            kind: Some("GpuNode".into()),
            name: Some("node-a".into()),
            uid: Some("uid-1".into()),
            ..ObjectReference::default()
        });
        let server = tokio::spawn(serve_events(handle, 3));
        for claim in ["ns/a", "ns/b", "ns/b"] {
            writer
                .event(
                    EventType::Normal,
                    "StaleClaimReleased",
                    format!("released claim {claim}"),
                )
                .await;
        }
        let seen = server.await.expect("server");
        let [
            (first, a, note_a),
            (second, b, note_b),
            (third, again, note_again),
        ] = &seen[..]
        else {
            panic!("expected three requests, got {seen:?}")
        };
        // Each claim's release is an event of its own, with its own message...
        assert_eq!((first, second), (&Method::POST, &Method::POST), "{seen:?}");
        assert_ne!(a, b);
        assert_eq!(
            (note_a.as_str(), note_b.as_str()),
            ("released claim ns/a", "released claim ns/b")
        );
        // ...and a repeat of the same message counts up the series of its event.
        assert_eq!(third, &Method::PATCH);
        assert_eq!(again, b);
        assert_eq!(note_again, "released claim ns/b");
    }

    fn client() -> Client {
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        Client::try_from(config).unwrap()
    }

    fn status(gpus: usize, registered: bool, at: tokio::time::Instant) -> WrittenStatus {
        let model = migdra_api::catalog::model("H100-80GB").unwrap();
        WrittenStatus {
            registration: RegistrationState {
                registered,
                error: None,
            },
            driver_version: Some("580.82.07".into()),
            gpus: (0..gpus as u32).map(|m| model.inventory(m, true)).collect(),
            at,
        }
    }

    #[test]
    fn the_gpunode_is_written_on_change_or_when_its_interval_passed() {
        let t0 = tokio::time::Instant::now();
        let interval = Duration::from_secs(300);
        let first = status(2, true, t0);
        assert!(gpunode_due(None, &first, interval), "never written");
        let beat = status(2, true, t0 + Duration::from_secs(15));
        assert!(!gpunode_due(Some(&first), &beat, interval), "a heartbeat alone");
        let gpu_gone = status(1, true, t0 + Duration::from_secs(15));
        assert!(
            gpunode_due(Some(&first), &gpu_gone, interval),
            "inventory changed"
        );
        let unregistered = status(2, false, t0 + Duration::from_secs(15));
        assert!(
            gpunode_due(Some(&first), &unregistered, interval),
            "registration changed"
        );
        let late = status(2, true, t0 + interval);
        assert!(gpunode_due(Some(&first), &late, interval), "the slow heartbeat");
    }

    #[test]
    fn lease_duration_is_one_and_a_half_intervals_rounded_up() {
        assert_eq!(lease_duration_seconds(Duration::from_secs(15)), 23);
        assert_eq!(lease_duration_seconds(Duration::from_secs(10)), 15);
        assert_eq!(lease_duration_seconds(Duration::from_secs(1)), 2);
    }

    #[tokio::test]
    async fn with_a_lease_the_gpunode_announces_its_own_slow_interval() {
        let registration = RegistrationState {
            registered: true,
            error: None,
        };
        let now = Timestamp::now();
        let plain = NodeStatusWriter::new(client(), "node-a", "gpu.migdra.dev", Duration::from_secs(15));
        assert!(!plain.has_heartbeat_lease());
        assert_eq!(
            plain
                .plugin_status(&registration, None, now)
                .heartbeat_interval_seconds,
            15
        );
        let leased = plain
            .clone()
            .with_heartbeat_lease(client(), "migdra-system", Duration::from_secs(300));
        assert!(leased.has_heartbeat_lease());
        let plugin = leased.plugin_status(&registration, None, now);
        assert_eq!(plugin.heartbeat_interval_seconds, 300);
        assert_eq!(plugin.heartbeat_time, Time(now));
        // The GpuNode interval is never shorter than the heartbeat.
        let fast = plain
            .clone()
            .with_heartbeat_lease(client(), "migdra-system", Duration::from_secs(1));
        assert_eq!(fast.gpunode_interval(), Duration::from_secs(15));
        // No Lease for a node whose Lease name would be too long.
        let long = NodeStatusWriter::new(
            client(),
            &"n".repeat(250),
            "gpu.migdra.dev",
            Duration::from_secs(15),
        )
        .with_heartbeat_lease(client(), "migdra-system", Duration::from_secs(300));
        assert!(!long.has_heartbeat_lease());
        assert_eq!(
            long.plugin_status(&registration, None, now)
                .heartbeat_interval_seconds,
            15
        );
    }

    /// Answers the next request on `handle` with `code` and `body`; returns (method, path,
    /// content type, body) of the request.
    async fn answer(
        handle: &mut tower_test::mock::Handle<
            http::Request<kube::client::Body>,
            http::Response<kube::client::Body>,
        >,
        code: u16,
        body: serde_json::Value,
    ) -> (String, String, String, serde_json::Value) {
        let (request, send) = handle.next_request().await.expect("a request");
        let (parts, req_body) = request.into_parts();
        let bytes = req_body.collect_bytes().await.unwrap();
        let content_type = parts
            .headers
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        send.send_response(
            http::Response::builder()
                .status(code)
                .header("content-type", "application/json")
                .body(kube::client::Body::from(serde_json::to_vec(&body).unwrap()))
                .unwrap(),
        );
        (
            parts.method.to_string(),
            parts.uri.path().to_string(),
            content_type,
            serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
        )
    }

    #[tokio::test]
    async fn the_lease_is_applied_once_then_renewed_by_merge_patch_and_recreated_when_gone() {
        let (service, mut handle) =
            tower_test::mock::pair::<http::Request<kube::client::Body>, http::Response<kube::client::Body>>();
        let mock = Client::new(service, "default");
        let mut writer =
            NodeStatusWriter::new(mock.clone(), "node-a", "gpu.migdra.dev", Duration::from_secs(15))
                .with_heartbeat_lease(mock, "migdra-system", Duration::from_secs(300));
        let path = "/apis/coordination.k8s.io/v1/namespaces/migdra-system/leases/node-a.gpu.migdra.dev";
        let lease = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                           "metadata": {"name": "node-a.gpu.migdra.dev", "namespace": "migdra-system"}});
        let not_found = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                               "reason": "NotFound", "code": 404, "message": "not found"});

        let server = tokio::spawn(async move {
            let mut seen = Vec::new();
            // First beat: the whole object, server-side applied.
            seen.push(answer(&mut handle, 200, lease.clone()).await);
            // Second beat: only renewTime, merge-patched.
            seen.push(answer(&mut handle, 200, lease.clone()).await);
            // Third beat: the Lease was deleted meanwhile: merge patch 404, then apply again.
            seen.push(answer(&mut handle, 404, not_found).await);
            seen.push(answer(&mut handle, 200, lease).await);
            seen
        });
        for _ in 0..3 {
            writer.renew_lease().await.unwrap();
        }
        let seen = server.await.unwrap();
        for (method, p, _, _) in &seen {
            assert_eq!((method.as_str(), p.as_str()), ("PATCH", path));
        }
        let kinds: Vec<&str> = seen.iter().map(|(_, _, ct, _)| ct.as_str()).collect();
        assert_eq!(
            kinds,
            [
                "application/apply-patch+yaml",
                "application/merge-patch+json",
                "application/merge-patch+json",
                "application/apply-patch+yaml"
            ]
        );
        assert_eq!(seen[0].3["spec"]["holderIdentity"], "node-a");
        assert_eq!(
            seen[0].3["metadata"]["labels"][HEARTBEAT_LEASE_LABEL],
            "gpu.migdra.dev"
        );
        let renewal = seen[1].3.as_object().unwrap();
        assert_eq!(renewal.len(), 1, "a renewal carries only the spec: {renewal:?}");
        let spec = seen[1].3["spec"].as_object().unwrap();
        assert_eq!(spec.keys().collect::<Vec<_>>(), ["renewTime"]);
    }

    #[test]
    fn the_lease_is_live_while_its_latest_renewal_succeeded_within_its_duration() {
        let interval = Duration::from_secs(10);
        let t0 = tokio::time::Instant::now();
        assert!(!LeaseRenewals::default().live(t0, interval), "never renewed");
        let renewed = LeaseRenewals {
            last_renewed: Some(t0),
            failing: false,
        };
        assert!(
            renewed.live(t0 + Duration::from_secs(15), interval),
            "within 1.5 intervals"
        );
        assert!(
            !renewed.live(t0 + Duration::from_secs(16), interval),
            "a renewal is stuck"
        );
        let failed = LeaseRenewals {
            failing: true,
            ..renewed
        };
        assert!(
            !failed.live(t0 + Duration::from_secs(1), interval),
            "the latest renewal failed"
        );
    }

    #[tokio::test]
    async fn the_lease_task_reports_each_renewal_and_stops_when_asked() {
        let (service, mut handle) =
            tower_test::mock::pair::<http::Request<kube::client::Body>, http::Response<kube::client::Body>>();
        let mock = Client::new(service, "default");
        let interval = Duration::from_millis(50);
        let writer = NodeStatusWriter::new(mock.clone(), "node-a", "gpu.migdra.dev", interval)
            .with_heartbeat_lease(mock, "migdra-system", Duration::from_secs(300));
        let lease = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                           "metadata": {"name": "node-a.gpu.migdra.dev", "namespace": "migdra-system"}});
        let forbidden = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                               "reason": "Forbidden", "code": 403, "message": "forbidden"});
        let shutdown = CancellationToken::new();
        let task = LeaseTask::start(writer, interval, &shutdown);
        let mut renewals = task.renewals.clone();

        answer(&mut handle, 200, lease).await;
        let renewed = *renewals.wait_for(|r| r.last_renewed.is_some()).await.unwrap();
        assert!(!renewed.failing);
        answer(&mut handle, 403, forbidden).await;
        let failed = *renewals.wait_for(|r| r.failing).await.unwrap();
        assert_eq!(
            failed.last_renewed, renewed.last_renewed,
            "kept from the last success"
        );
        // A renewal in flight, unanswered: stopping ends the task anyway.
        let (_request, _unanswered) = handle.next_request().await.expect("a renewal");
        tokio::time::timeout(Duration::from_secs(10), task.stop())
            .await
            .expect("the Lease task stopped");
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_renewal_is_tried_again_before_the_next_beat_unless_it_would_be_refused_again() {
        let (service, mut handle) =
            tower_test::mock::pair::<http::Request<kube::client::Body>, http::Response<kube::client::Body>>();
        let mock = Client::new(service, "default");
        let interval = Duration::from_secs(15);
        let mut writer = NodeStatusWriter::new(mock.clone(), "node-a", "gpu.migdra.dev", interval)
            .with_heartbeat_lease(mock, "migdra-system", Duration::from_secs(300));
        if let Some(lease) = &mut writer.lease {
            lease.exists = true;
        }
        let lease = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                           "metadata": {"name": "node-a.gpu.migdra.dev", "namespace": "migdra-system"}});
        let status = |code: u16, reason: &str| {
            json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                   "reason": reason, "code": code, "message": reason})
        };
        let shutdown = CancellationToken::new();
        let task = LeaseTask::start(writer, interval, &shutdown);
        let mut renewals = task.renewals.clone();
        let renew_time = |body: &serde_json::Value| body["spec"]["renewTime"].as_str().map(str::to_string);

        // Beat 1: refused by flow control twice, then renewed, all before beat 2.
        let beat = tokio::time::Instant::now();
        let (method, _, _, first) = answer(&mut handle, 429, status(429, "TooManyRequests")).await;
        assert_eq!(method, "PATCH");
        assert!(renew_time(&first).is_some(), "a renewal: {first}");
        let (_, _, _, second) = answer(&mut handle, 503, status(503, "ServiceUnavailable")).await;
        let first_retry = beat.elapsed();
        assert!(
            first_retry >= RenewalRetry::FIRST_DELAY / 2 && first_retry <= RenewalRetry::FIRST_DELAY,
            "the first retry after {first_retry:?}"
        );
        assert!(renew_time(&second) >= renew_time(&first), "stamped again");
        assert!(renewals.borrow().failing);
        answer(&mut handle, 200, lease.clone()).await;
        let retried = beat.elapsed();
        assert!(retried < interval, "renewed {retried:?} into the beat");
        assert!(
            retried >= first_retry + RenewalRetry::FIRST_DELAY,
            "the delay doubled: {retried:?}"
        );
        let renewed = *renewals.wait_for(|r| !r.failing).await.unwrap();
        assert!(renewed.last_renewed.is_some());

        // Beat 2: refused by the admission policy; that is not tried again until beat 3.
        answer(&mut handle, 403, status(403, "Forbidden")).await;
        let refused = beat.elapsed();
        assert!(refused >= interval, "beat 2 on time: {refused:?}");
        renewals.wait_for(|r| r.failing).await.unwrap();
        answer(&mut handle, 200, lease).await;
        assert!(
            beat.elapsed() >= 2 * interval,
            "the 403 was not retried before beat 3 ({:?})",
            beat.elapsed()
        );
        renewals.wait_for(|r| !r.failing).await.unwrap();
        tokio::time::timeout(Duration::from_secs(60), task.stop())
            .await
            .expect("the Lease task stopped");
    }

    #[tokio::test]
    async fn the_lease_names_the_node_and_the_driver() {
        let mut writer = NodeStatusWriter::new(client(), "node-a", "gpu.migdra.dev", Duration::from_secs(15))
            .with_heartbeat_lease(client(), "migdra-system", Duration::from_secs(300));
        writer.node_uid = "uid-a".into();
        let now = Timestamp::from_second(1_800_000_000).unwrap();
        let lease: Lease = serde_json::from_value(writer.lease_object("node-a.gpu.migdra.dev", now)).unwrap();
        assert_eq!(lease.metadata.name.as_deref(), Some("node-a.gpu.migdra.dev"));
        assert_eq!(
            lease.metadata.labels.unwrap()[HEARTBEAT_LEASE_LABEL],
            "gpu.migdra.dev"
        );
        let owner = &lease.metadata.owner_references.unwrap()[0];
        assert_eq!((owner.kind.as_str(), owner.uid.as_str()), ("Node", "uid-a"));
        let spec = lease.spec.unwrap();
        assert_eq!(spec.holder_identity.as_deref(), Some("node-a"));
        assert_eq!(spec.lease_duration_seconds, Some(23));
        assert_eq!(spec.renew_time, Some(MicroTime(now)));
    }
}
