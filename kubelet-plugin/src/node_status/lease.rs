//! The node's heartbeat Lease and the task that renews it.
//!
//! The task applies the whole Lease once (and again after it vanished), then merge-patches
//! only `spec.renewTime` every heartbeat interval, and at once when the status loop asks
//! ([`LeaseTask::renew_now`]: a registration change, so a plugin re-registered after the
//! kubelet wiped its slices gets its pool back without waiting for the next beat). A renewal
//! refused by an answer that can change on its own is tried again within the beat (see
//! [`RenewalRetry`]). While NVML answers nothing on the node ([`Gpus::nvml_stuck`]) the
//! renewals pause, so the controller withdraws the pool as for a dead plugin, and resume at
//! once when it answers again.

use std::{sync::Arc, time::Duration};

use k8s_openapi::{
    api::coordination::v1::Lease,
    apimachinery::pkg::apis::meta::v1::{MicroTime, OwnerReference},
    jiff::Timestamp,
};
use kube::{
    Api, Client,
    api::{Patch, PatchParams},
};
use migdra_api::inventory::{HEARTBEAT_LEASE_LABEL, RenewalRetry, heartbeat_lease_name};
use serde_json::json;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use super::{FIELD_MANAGER, bounded, write_bound};
use crate::gpus::Gpus;

/// This node's heartbeat Lease: where it lives and what it says.
#[derive(Clone)]
pub struct HeartbeatLease {
    api: Api<Lease>,
    name: String,
    node: String,
    driver: String,
    interval: Duration,
    started: Timestamp,
}

impl HeartbeatLease {
    /// The Lease of the plugin of `driver` on `node`, in `namespace` (the controller's),
    /// renewed every `interval` through `client` (see [`heartbeat_client`]).
    pub fn new(client: Client, namespace: &str, node: &str, driver: &str, interval: Duration) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            name: heartbeat_lease_name(node, driver),
            node: node.to_string(),
            driver: driver.to_string(),
            interval,
            started: Timestamp::now(),
        }
    }

    /// The whole Lease as the plugin applies it, owned by the Node (`owner`). The controller
    /// maps it to its node by `spec.holderIdentity` (the name is shortened for long node
    /// names) and expects the next renewal within `leaseDurationSeconds`.
    fn object(&self, owner: &OwnerReference, now: Timestamp) -> serde_json::Value {
        json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.name,
                "labels": { HEARTBEAT_LEASE_LABEL: self.driver },
                "ownerReferences": [owner],
            },
            "spec": {
                "holderIdentity": self.node,
                "leaseDurationSeconds": lease_duration_seconds(self.interval),
                "acquireTime": MicroTime(self.started),
                "renewTime": MicroTime(now),
            },
        })
    }
}

/// The Lease's `leaseDurationSeconds`: one and a half heartbeat intervals (rounded up), the
/// window in which the controller expects the next renewal.
fn lease_duration_seconds(interval: Duration) -> i32 {
    let millis = interval.as_millis().saturating_mul(3).div_ceil(2);
    i32::try_from(millis.div_ceil(1000)).unwrap_or(i32::MAX)
}

/// Renews one Lease, owned by `owner`.
struct Renewer {
    lease: HeartbeatLease,
    owner: OwnerReference,
    /// False until the whole object was applied (and again after a renewal found it gone).
    exists: bool,
}

impl Renewer {
    /// Renews the Lease: applies it whole the first time and after it vanished, otherwise
    /// merge-patches `renewTime` alone.
    async fn renew(&mut self) -> Result<(), kube::Error> {
        let now = Timestamp::now();
        let lease = &self.lease;
        if self.exists {
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
        let object = lease.object(&self.owner, now);
        lease
            .api
            .patch(
                &lease.name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(object),
            )
            .await?;
        self.exists = true;
        Ok(())
    }
}

/// The task renewing the heartbeat Lease, apart from the status loop. Dropping it stops the
/// task (the status loop aborted in a hand-over, or restarting it).
pub(super) struct LeaseTask {
    /// The Node UID the Lease's owner reference carries.
    pub(super) node_uid: String,
    renew_now: Arc<Notify>,
    cancel_on_drop: tokio_util::sync::DropGuard,
    task: tokio::task::JoinHandle<()>,
}

impl LeaseTask {
    /// Starts renewing `lease`, owned by `owner`, every heartbeat interval, until `shutdown`
    /// or until this is dropped or stopped; paused while NVML answers nothing on `gpus`.
    pub(super) fn start(
        lease: HeartbeatLease,
        owner: OwnerReference,
        gpus: Option<Gpus>,
        shutdown: &CancellationToken,
    ) -> Self {
        let stop = shutdown.child_token();
        let renew_now = Arc::new(Notify::new());
        let node_uid = owner.uid.clone();
        let renewer = Renewer {
            lease,
            owner,
            exists: false,
        };
        let task = tokio::spawn(renew_every_interval(
            renewer,
            renew_now.clone(),
            gpus,
            stop.clone(),
        ));
        Self {
            node_uid,
            renew_now,
            cancel_on_drop: stop.drop_guard(),
            task,
        }
    }

    /// Renews once more as soon as possible, besides the interval (a renewal in flight is
    /// followed by another).
    pub(super) fn renew_now(&self) {
        self.renew_now.notify_one();
    }

    /// Stops the task and waits until it ended (an unanswered renewal is dropped).
    pub(super) async fn stop(self) {
        drop(self.cancel_on_drop);
        if let Err(e) = self.task.await {
            tracing::warn!(error = %e, "heartbeat Lease task failed");
        }
    }
}

/// Renews through `renewer` every interval and on `renew_now` (each renewal bounded by
/// [`write_bound`]) until `stop`. A renewal refused by an answer that can change on its own
/// (429 from API Priority and Fairness, 5xx, no connection) is tried again, with a fresh
/// `renewTime`, after a [`RenewalRetry`] delay, while that comes before the next beat: one
/// refused renewal would otherwise let the heartbeat expire.
async fn renew_every_interval(
    mut renewer: Renewer,
    renew_now: Arc<Notify>,
    gpus: Option<Gpus>,
    stop: CancellationToken,
) {
    let interval = renewer.lease.interval;
    let mut nvml_changes = gpus.as_ref().map(|g| g.nvml_calls().subscribe());
    let mut paused = false;
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
            _ = renew_now.notified() => {}
            _ = sleep_until_some(retry_at) => {}
            _ = changed_if_some(&mut nvml_changes) => {}
        }
        retry_at = None;
        match gpus.as_ref().and_then(Gpus::nvml_stuck) {
            Some(reason) => {
                if !std::mem::replace(&mut paused, true) {
                    tracing::error!(%reason, "NVML answers nothing on this node: the heartbeat pauses, so the controller stops offering its GPUs");
                }
                continue;
            }
            None if std::mem::take(&mut paused) => {
                tracing::info!("NVML answers again: the heartbeat resumes");
            }
            None => {}
        }
        let outcome = tokio::select! {
            _ = stop.cancelled() => break,
            outcome = bounded(write_bound(interval), "renewing the heartbeat Lease", renewer.renew()) => outcome,
        };
        match outcome {
            Some(Ok(())) => {
                if retry.failures() > 0 {
                    tracing::info!(
                        failed = retry.failures(),
                        "renewed the heartbeat Lease after failed attempts"
                    );
                }
                retry.succeeded();
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
                    tracing::warn!(error = %e, retry_in = ?delay, "renewing the heartbeat Lease failed");
                } else {
                    tracing::debug!(error = %e, failed = retry.failures(), retry_in = ?delay, "renewing the heartbeat Lease failed again");
                }
            }
            // Unanswered within its bound: the next beat is due already.
            None => {}
        }
    }
}

/// The client the heartbeat Lease is renewed through: without kube's own retry of
/// 429/503/504, which would resend the same `renewTime` ([`renew_every_interval`] retries with
/// a fresh one), and off the connection the GpuNode and event writes queue on.
pub fn heartbeat_client(mut config: kube::Config) -> Result<Client, kube::Error> {
    config.default_retry = false;
    Client::try_from(config)
}

/// Waits for a change on `changes`; forever when there is none to watch (or it closed).
async fn changed_if_some(changes: &mut Option<watch::Receiver<u64>>) {
    match changes {
        Some(receiver) => {
            if receiver.changed().await.is_err() {
                *changes = None;
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
    }
}

async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use http::{Request, Response};
    use kube::client::Body;
    use tower_test::mock;

    use super::*;

    type Handle = mock::Handle<Request<Body>, Response<Body>>;

    const DRIVER: &str = "gpu.migdra.dev";

    fn lease(client: Client, node: &str, interval: Duration) -> HeartbeatLease {
        HeartbeatLease::new(client, "migdra-system", node, DRIVER, interval)
    }

    fn owner() -> OwnerReference {
        OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: "node-a".into(),
            uid: "uid-a".into(),
            ..OwnerReference::default()
        }
    }

    fn mock_client() -> (Client, Handle) {
        let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
        (Client::new(service, "default"), handle)
    }

    fn lease_json() -> serde_json::Value {
        json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
               "metadata": {"name": "node-a.gpu.migdra.dev", "namespace": "migdra-system"}})
    }

    fn status(code: u16, reason: &str) -> serde_json::Value {
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
               "reason": reason, "code": code, "message": reason})
    }

    /// Answers the next request on `handle` with `code` and `body`; returns (method, path,
    /// content type, body) of the request.
    async fn answer(
        handle: &mut Handle,
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
            Response::builder()
                .status(code)
                .header("content-type", "application/json")
                .body(Body::from(serde_json::to_vec(&body).unwrap()))
                .unwrap(),
        );
        (
            parts.method.to_string(),
            parts.uri.path().to_string(),
            content_type,
            serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
        )
    }

    #[test]
    fn lease_duration_is_one_and_a_half_intervals_rounded_up() {
        assert_eq!(lease_duration_seconds(Duration::from_secs(15)), 23);
        assert_eq!(lease_duration_seconds(Duration::from_secs(10)), 15);
        assert_eq!(lease_duration_seconds(Duration::from_secs(1)), 2);
    }

    #[tokio::test]
    async fn the_lease_names_the_node_and_the_driver() {
        let (client, _handle) = mock_client();
        let now = Timestamp::from_second(1_800_000_000).unwrap();
        let object = lease(client, "node-a", Duration::from_secs(15)).object(&owner(), now);
        let lease: Lease = serde_json::from_value(object).unwrap();
        assert_eq!(lease.metadata.name.as_deref(), Some("node-a.gpu.migdra.dev"));
        assert_eq!(lease.metadata.labels.unwrap()[HEARTBEAT_LEASE_LABEL], DRIVER);
        let owner = &lease.metadata.owner_references.unwrap()[0];
        assert_eq!((owner.kind.as_str(), owner.uid.as_str()), ("Node", "uid-a"));
        let spec = lease.spec.unwrap();
        assert_eq!(spec.holder_identity.as_deref(), Some("node-a"));
        assert_eq!(spec.lease_duration_seconds, Some(23));
        assert_eq!(spec.renew_time, Some(MicroTime(now)));
    }

    #[tokio::test]
    async fn a_node_name_too_long_for_the_plain_lease_name_still_gets_a_lease() {
        let (client, mut handle) = mock_client();
        let node = format!("{}.example.com", "n".repeat(240));
        let heartbeat = lease(client, &node, Duration::from_secs(15));
        let name = heartbeat_lease_name(&node, DRIVER);
        assert!(name.len() <= 253, "{}", name.len());
        let mut renewer = Renewer {
            lease: heartbeat,
            owner: owner(),
            exists: false,
        };
        let server = tokio::spawn(async move { answer(&mut handle, 200, lease_json()).await });
        renewer.renew().await.unwrap();
        let (method, path, _, body) = server.await.unwrap();
        assert_eq!(method, "PATCH");
        assert_eq!(
            path,
            format!("/apis/coordination.k8s.io/v1/namespaces/migdra-system/leases/{name}")
        );
        assert_eq!(body["metadata"]["name"], name.as_str());
        assert_eq!(
            body["spec"]["holderIdentity"],
            node.as_str(),
            "the whole node name"
        );
    }

    #[tokio::test]
    async fn the_lease_is_applied_once_then_renewed_by_merge_patch_and_recreated_when_gone() {
        let (client, mut handle) = mock_client();
        let mut renewer = Renewer {
            lease: lease(client, "node-a", Duration::from_secs(15)),
            owner: owner(),
            exists: false,
        };
        let path = "/apis/coordination.k8s.io/v1/namespaces/migdra-system/leases/node-a.gpu.migdra.dev";
        let server = tokio::spawn(async move {
            let mut seen = Vec::new();
            // First beat: the whole object, server-side applied.
            seen.push(answer(&mut handle, 200, lease_json()).await);
            // Second beat: only renewTime, merge-patched.
            seen.push(answer(&mut handle, 200, lease_json()).await);
            // Third beat: the Lease was deleted meanwhile: merge patch 404, then apply again.
            seen.push(answer(&mut handle, 404, status(404, "NotFound")).await);
            seen.push(answer(&mut handle, 200, lease_json()).await);
            seen
        });
        for _ in 0..3 {
            renewer.renew().await.unwrap();
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
        assert_eq!(seen[0].3["metadata"]["labels"][HEARTBEAT_LEASE_LABEL], DRIVER);
        let renewal = seen[1].3.as_object().unwrap();
        assert_eq!(renewal.len(), 1, "a renewal carries only the spec: {renewal:?}");
        let spec = seen[1].3["spec"].as_object().unwrap();
        assert_eq!(spec.keys().collect::<Vec<_>>(), ["renewTime"]);
    }

    #[tokio::test(start_paused = true)]
    async fn the_lease_task_renews_every_interval_and_when_asked_and_stops_when_asked() {
        let (client, mut handle) = mock_client();
        let interval = Duration::from_secs(15);
        let shutdown = CancellationToken::new();
        let task = LeaseTask::start(lease(client, "node-a", interval), owner(), None, &shutdown);

        let start = tokio::time::Instant::now();
        answer(&mut handle, 200, lease_json()).await;
        assert!(start.elapsed() < interval, "the first renewal goes at once");
        // A refusal that would be refused again waits for the next beat.
        answer(&mut handle, 403, status(403, "Forbidden")).await;
        assert!(start.elapsed() >= interval, "{:?}", start.elapsed());
        let refused = tokio::time::Instant::now();
        answer(&mut handle, 200, lease_json()).await;
        assert!(refused.elapsed() >= interval, "renewed on the next beat");
        // Asked to, it renews at once, between two beats.
        let asked = tokio::time::Instant::now();
        task.renew_now();
        answer(&mut handle, 200, lease_json()).await;
        assert!(asked.elapsed() < interval / 2, "{:?}", asked.elapsed());
        // A renewal in flight, unanswered: stopping ends the task anyway.
        let (_request, _unanswered) = handle.next_request().await.expect("a renewal");
        tokio::time::timeout(Duration::from_secs(10), task.stop())
            .await
            .expect("the Lease task stopped");
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_renewal_is_tried_again_before_the_next_beat_unless_it_would_be_refused_again() {
        let (client, mut handle) = mock_client();
        let interval = Duration::from_secs(15);
        let renewer = Renewer {
            lease: lease(client, "node-a", interval),
            owner: owner(),
            exists: true,
        };
        let stop = CancellationToken::new();
        let task = tokio::spawn(renew_every_interval(renewer, Arc::default(), None, stop.clone()));
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
        answer(&mut handle, 200, lease_json()).await;
        let retried = beat.elapsed();
        assert!(retried < interval, "renewed {retried:?} into the beat");
        assert!(
            retried >= first_retry + RenewalRetry::FIRST_DELAY,
            "the delay doubled: {retried:?}"
        );

        // Beat 2: refused by the admission policy; that is not tried again until beat 3.
        answer(&mut handle, 403, status(403, "Forbidden")).await;
        let refused = beat.elapsed();
        assert!(refused >= interval, "beat 2 on time: {refused:?}");
        answer(&mut handle, 200, lease_json()).await;
        assert!(
            beat.elapsed() >= 2 * interval,
            "the 403 was not retried before beat 3 ({:?})",
            beat.elapsed()
        );
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("the Lease task stopped")
            .unwrap();
    }
}
