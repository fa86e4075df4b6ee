//! Leader election against a fake Lease API: the controller task runs only while the lease
//! is ours, is aborted when another holder takes it, restarts when the lease comes back, and
//! on shutdown stops gracefully before the lease is released.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use http::{Method, StatusCode};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::MicroTime, jiff::Timestamp};
use migdra_controller::{
    leader::{self, LeaseConfig},
    metrics::Metrics,
};
use migdra_testkit::controller::router::{Reply, serve, status};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

const LEASE_PATH: &str = "/apis/coordination.k8s.io/v1/namespaces/migdra-system/leases";

type Journal = Arc<Mutex<Vec<String>>>;

/// A single Lease with create, get and (apply or strategic merge) patch of its spec.
fn lease_server(lease: Arc<Mutex<Option<Value>>>, journal: Journal) -> kube::Client {
    let (client, _) = serve(move |call| {
        let name_path = format!("{LEASE_PATH}/migdra-controller");
        let mut lease = lease.lock().unwrap();
        match (&call.method, call.path.as_str()) {
            (&Method::GET, p) if p == name_path => match lease.as_ref() {
                Some(l) => Reply::Json(StatusCode::OK, l.clone()),
                None => status(StatusCode::NOT_FOUND, "NotFound"),
            },
            (&Method::POST, LEASE_PATH) => {
                let mut l = call.body.clone();
                l["metadata"]["resourceVersion"] = json!("1");
                l["metadata"]["namespace"] = json!("migdra-system");
                *lease = Some(l.clone());
                Reply::Json(StatusCode::CREATED, l)
            }
            (&Method::PATCH, p) if p == name_path => {
                let Some(l) = lease.as_mut() else {
                    return status(StatusCode::NOT_FOUND, "NotFound");
                };
                let spec = l["spec"].as_object().cloned().unwrap_or_default();
                let mut spec = spec;
                for (k, v) in call.body["spec"].as_object().into_iter().flatten() {
                    if v.is_null() {
                        spec.remove(k);
                    } else {
                        spec.insert(k.clone(), v.clone());
                    }
                }
                if call.body["spec"].get("holderIdentity") == Some(&Value::Null) {
                    let entry = match spec_holder(l) {
                        Some("replica-a") => "lease released".to_string(),
                        other => format!("expired lease of {} cleared", other.unwrap_or("nobody")),
                    };
                    journal.lock().unwrap().push(entry);
                }
                l["spec"] = Value::Object(spec);
                Reply::Json(StatusCode::OK, l.clone())
            }
            _ => status(StatusCode::NOT_FOUND, "NotFound"),
        }
    });
    client
}

fn spec_holder(lease: &Value) -> Option<&str> {
    lease["spec"]["holderIdentity"].as_str()
}

fn holder(lease: &Arc<Mutex<Option<Value>>>) -> Option<String> {
    lease.lock().unwrap().as_ref()?["spec"]["holderIdentity"]
        .as_str()
        .map(str::to_string)
}

async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    for _ in 0..200 {
        if condition() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting until {what}");
}

/// Marks the task stopped when dropped (also when aborted).
struct Running(Arc<AtomicBool>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_runs_only_while_the_lease_is_held() {
    let lease = Arc::new(Mutex::new(None));
    let journal: Journal = Arc::default();
    let client = lease_server(lease.clone(), journal.clone());
    let metrics = Metrics::new();
    let shutdown = CancellationToken::new();
    let running = Arc::new(AtomicBool::new(false));
    let starts = Arc::new(AtomicUsize::new(0));

    let task = {
        let running = running.clone();
        let starts = starts.clone();
        let journal = journal.clone();
        move |stop: CancellationToken| {
            let running = running.clone();
            let starts = starts.clone();
            let journal = journal.clone();
            async move {
                running.store(true, Ordering::SeqCst);
                starts.fetch_add(1, Ordering::SeqCst);
                let _guard = Running(running);
                stop.cancelled().await;
                journal
                    .lock()
                    .unwrap()
                    .push("controller stopped gracefully".into());
                Ok(())
            }
        }
    };
    let config = LeaseConfig {
        namespace: "migdra-system".into(),
        name: "migdra-controller".into(),
        identity: "replica-a".into(),
        duration_seconds: 2,
    };
    let election = tokio::spawn(leader::run(
        client,
        config,
        metrics.clone(),
        shutdown.clone(),
        task,
    ));

    // Acquired: the controller runs and the gauge says so.
    eventually("the controller runs", || running.load(Ordering::SeqCst)).await;
    assert_eq!(holder(&lease).as_deref(), Some("replica-a"));
    assert!(metrics.encode().contains("migdra_controller_leader 1"));

    // Another replica takes the lease (ours expired on its clock): we stop at our next renewal.
    {
        let mut l = lease.lock().unwrap();
        let spec = &mut l.as_mut().unwrap()["spec"];
        spec["holderIdentity"] = json!("replica-b");
        spec["renewTime"] = serde_json::to_value(MicroTime(Timestamp::now())).unwrap();
        spec["leaseDurationSeconds"] = json!(2);
    }
    eventually("the controller is aborted", || !running.load(Ordering::SeqCst)).await;
    assert!(metrics.encode().contains("migdra_controller_leader 0"));
    assert!(
        journal.lock().unwrap().is_empty(),
        "aborted, not stopped gracefully: {journal:?}"
    );

    // replica-b stops renewing: its lease expires and we take over again.
    eventually("the controller runs again", || running.load(Ordering::SeqCst)).await;
    assert_eq!(starts.load(Ordering::SeqCst), 2);
    assert_eq!(holder(&lease).as_deref(), Some("replica-a"));

    // Shutdown: graceful stop first, then the lease is released.
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), election)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(holder(&lease), None);
    assert_eq!(
        *journal.lock().unwrap(),
        [
            "expired lease of replica-b cleared",
            "controller stopped gracefully",
            "lease released"
        ]
    );
    assert!(metrics.encode().contains("migdra_controller_leader 0"));
}
