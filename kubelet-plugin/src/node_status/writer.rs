//! Writes this node's `GpuNode`: the object (owned by the Node), the plugin's part of its
//! status, and events on it.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use k8s_openapi::{
    api::core::v1::{Node, ObjectReference},
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

use super::{FIELD_MANAGER, HeartbeatLease};
use dra_kubelet::RegistrationState;

/// By event type and reason: the note of the last event recorded, and its recorder.
type LastEvents = HashMap<(EventType, String), (String, Recorder)>;

/// Writes this node's GpuNode, and carries the heartbeat Lease the status loop renews once
/// the GpuNode exists (the Lease's owner is the Node, whose UID [`Self::ensure_object`] reads).
#[derive(Clone)]
pub struct NodeStatusWriter {
    api: Api<GpuNode>,
    nodes: Api<Node>,
    node: String,
    node_uid: String,
    driver: String,
    started: Timestamp,
    client: Client,
    recorders: Arc<Mutex<LastEvents>>,
    lease: HeartbeatLease,
    reference: Option<ObjectReference>,
}

impl NodeStatusWriter {
    pub fn new(client: Client, node: &str, driver: &str, lease: HeartbeatLease) -> Self {
        Self {
            api: Api::all(client.clone()),
            nodes: Api::all(client.clone()),
            node: node.to_string(),
            node_uid: String::new(),
            driver: driver.to_string(),
            started: Timestamp::now(),
            client,
            recorders: Arc::default(),
            lease,
            reference: None,
        }
    }

    pub(super) fn lease(&self) -> &HeartbeatLease {
        &self.lease
    }

    /// The recorder for an event. kube's [`Recorder`] folds every event of one type and reason
    /// on one object into one series that keeps the first note; so only a repeat of the last
    /// note stays in its series, and another note gets a recorder, and an event, of its own.
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

    /// The owner reference to the Node (its UID once [`Self::ensure_object`] read it).
    pub(super) fn owner(&self) -> OwnerReference {
        OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: self.node.clone(),
            uid: self.node_uid.clone(),
            ..OwnerReference::default()
        }
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http::{Method, Request, Response};
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
        let client = Client::new(service, "default");
        let lease = HeartbeatLease::new(
            client.clone(),
            "migdra-system",
            "node-a",
            "gpu.migdra.dev",
            Duration::from_secs(15),
        );
        let mut writer = NodeStatusWriter::new(client, "node-a", "gpu.migdra.dev", lease);
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
