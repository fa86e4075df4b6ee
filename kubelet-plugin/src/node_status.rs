//! The node's `GpuNode`: created with a Node owner reference (so it is garbage-collected with
//! the node) and kept current with the inventory, the kubelet registration state and a
//! heartbeat, from which the controller decides whether to publish this node's pool.
//!
//! [`StatusLoop`] reads the GPU table ([`crate::gpus`]), never the driver: it keeps running
//! while another plugin instance holds the node lock.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use k8s_openapi::{
    api::core::v1::Node,
    apimachinery::pkg::apis::meta::v1::{OwnerReference, Time},
    jiff::Timestamp,
};
use kube::{
    Api, Client, Resource,
    api::{Patch, PatchParams},
    runtime::events::{Event, EventType, Recorder, Reporter},
};
use migdra_api::inventory::{API_VERSION, GpuInventory, GpuNode, NodeSummary, PluginStatus};
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::{
    driver::RecoveryEvent,
    events::{ClaimEvent, ClaimEvents},
    gpus::{Gpus, PendingRepair},
    nvml::GpuBackend,
};
use migdra_kubeletplugin::{DeviceHealthReport, RegistrationState};

/// Field manager of the plugin's writes.
pub const FIELD_MANAGER: &str = "migdra-kubelet-plugin";

/// By event type and reason: the note of the last event recorded, and its recorder.
type LastEvents = HashMap<(EventType, String), (String, Recorder)>;

/// Writes this node's GpuNode.
#[derive(Clone)]
pub struct NodeStatusWriter {
    api: Api<GpuNode>,
    nodes: Api<Node>,
    node: String,
    driver: String,
    started: Timestamp,
    heartbeat_interval: Duration,
    client: Client,
    recorders: Arc<Mutex<LastEvents>>,
    reference: Option<k8s_openapi::api::core::v1::ObjectReference>,
}

impl NodeStatusWriter {
    /// A writer for `node`, serving `driver`.
    pub fn new(client: Client, node: &str, driver: &str, heartbeat_interval: Duration) -> Self {
        Self {
            api: Api::all(client.clone()),
            nodes: Api::all(client.clone()),
            node: node.to_string(),
            driver: driver.to_string(),
            started: Timestamp::now(),
            heartbeat_interval,
            client,
            recorders: Arc::default(),
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

    /// Creates or adopts the GpuNode (metadata and spec), owned by the Node.
    pub async fn ensure_object(&mut self) -> Result<(), kube::Error> {
        let node = self.nodes.get(&self.node).await?;
        let owner = OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: self.node.clone(),
            uid: node.meta().uid.clone().unwrap_or_default(),
            ..OwnerReference::default()
        };
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

    /// Writes the plugin's part of the status.
    pub async fn publish(
        &self,
        registration: &RegistrationState,
        driver_version: Option<String>,
        gpus: &[GpuInventory],
    ) -> Result<(), kube::Error> {
        let plugin = PluginStatus {
            version: env!("CARGO_PKG_VERSION").to_string(),
            registered: registration.registered,
            registration_error: registration.error.clone(),
            start_time: Time(self.started),
            heartbeat_time: Time(Timestamp::now()),
            heartbeat_interval_seconds: u32::try_from(self.heartbeat_interval.as_secs()).unwrap_or(u32::MAX),
            driver_version,
        };
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

/// The status loop: refreshes the inventory and device health every `interval`, and
/// immediately when the kubelet's registration state changes; publishes them in the GpuNode
/// (when there is a writer) with events for GPU health changes and startup repairs.
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
    /// Runs until `shutdown`; then reports the plugin as unregistered so the controller
    /// withdraws the pool without waiting for the heartbeat to go stale.
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
        loop {
            let inventory = refresh(&gpus).await;
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
                    match writer.ensure_object().await {
                        Ok(()) => object_ready = true,
                        Err(e) => tracing::warn!(error = %e, "creating the GpuNode failed; retrying"),
                    }
                }
                if object_ready && let Some(note) = recovery_note.take() {
                    writer
                        .event(EventType::Warning, "RecoveredInterruptedOperations", note)
                        .await;
                }
                if object_ready && let Some(events) = &mut recovery_events {
                    while let Ok(event) = events.try_recv() {
                        writer.event(event.type_, event.reason, event.note).await;
                    }
                }
                for (type_, reason, note) in health_changes {
                    writer.event(type_, reason, note).await;
                }
                if object_ready {
                    let state = registration.borrow().clone();
                    if let Err(e) = writer.publish(&state, driver_version.clone(), inventory).await {
                        tracing::warn!(error = %e, "updating the GpuNode status failed; retrying");
                        object_ready = false;
                    }
                }
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
}
