//! The whole controller (watches, caches, reconciler) against a fake API server: it lists
//! and watches GpuNodes, Node metadata, MigPolicies, ResourceClaims, only its own driver's
//! slices and heartbeat Leases, the kubelets' node Leases, and publishes the pool of a live
//! node from what the lists returned.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use http::{Method, StatusCode};
use k8s_openapi::api::resource::v1::ResourceSlice;
use migdra_api::{policy::EffectivePolicy, slices::published_plan};
use migdra_controller::{context::ControllerConfig, controller, metrics::Metrics};
use migdra_testkit::controller::{
    NAMESPACE, NODE, NODE_UID, ago, config, gpunode, h100s, lease, node_lease, plugin,
    router::{Call, Reply, serve, status},
};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

fn list(kind: &str, api_version: &str, items: Vec<Value>) -> Reply {
    Reply::Json(
        StatusCode::OK,
        json!({
            "apiVersion": api_version, "kind": kind,
            "metadata": {"resourceVersion": "10"}, "items": items,
        }),
    )
}

fn handle(call: &Call, written: &Mutex<Vec<ResourceSlice>>, gpunode: &Value) -> Reply {
    if call.method == Method::GET && call.is_watch() {
        return Reply::Hold;
    }
    match (&call.method, call.path.as_str()) {
        (&Method::GET, "/apis/gpu.migdra.dev/v1alpha1/gpunodes") => {
            list("GpuNodeList", "gpu.migdra.dev/v1alpha1", vec![gpunode.clone()])
        }
        (&Method::GET, "/api/v1/nodes") => list(
            "PartialObjectMetadataList",
            "meta.k8s.io/v1",
            vec![json!({
                "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                "metadata": {"name": NODE, "uid": NODE_UID, "resourceVersion": "5",
                             "labels": {"gpu": "h100"}},
            })],
        ),
        (&Method::GET, "/apis/gpu.migdra.dev/v1alpha1/migpolicies") => {
            list("MigPolicyList", "gpu.migdra.dev/v1alpha1", Vec::new())
        }
        (&Method::GET, "/apis/resource.k8s.io/v1/resourceslices") => {
            list("ResourceSliceList", "resource.k8s.io/v1", Vec::new())
        }
        (&Method::GET, "/apis/resource.k8s.io/v1/resourceclaims") => {
            list("ResourceClaimList", "resource.k8s.io/v1", Vec::new())
        }
        (&Method::GET, p) if p == format!("/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases") => {
            list(
                "LeaseList",
                "coordination.k8s.io/v1",
                vec![serde_json::to_value(lease(NODE, ago(2))).unwrap()],
            )
        }
        (&Method::GET, "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases") => list(
            "LeaseList",
            "coordination.k8s.io/v1",
            vec![serde_json::to_value(node_lease(NODE, ago(4), 9)).unwrap()],
        ),
        (&Method::POST, "/apis/resource.k8s.io/v1/resourceslices") => {
            let mut stored = call.body.clone();
            let mut w = written.lock().unwrap();
            stored["metadata"]["resourceVersion"] = json!((20 + w.len()).to_string());
            w.push(serde_json::from_value(stored.clone()).unwrap());
            Reply::Json(StatusCode::CREATED, stored)
        }
        (&Method::PATCH, p) if p == format!("/apis/gpu.migdra.dev/v1alpha1/gpunodes/{NODE}/status") => {
            let mut object = gpunode.clone();
            object["status"]["publication"] = call.body["status"]["publication"].clone();
            object["status"]["conditions"] = call.body["status"]["conditions"].clone();
            Reply::Json(StatusCode::OK, object)
        }
        _ => status(StatusCode::NOT_FOUND, "NotFound"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_watches_its_inputs_and_publishes_a_live_node() {
    let gpus = h100s(2);
    // A registered plugin, written an hour ago; its Lease, renewed 2 s ago, makes it live.
    let registered = plugin(true, ago(3600));
    let g = serde_json::to_value(gpunode(Some(registered), gpus.clone())).unwrap();
    let written = Arc::new(Mutex::new(Vec::new()));
    let (client, calls) = {
        let written = written.clone();
        serve(move |call| handle(call, &written, &g))
    };
    let config = ControllerConfig {
        ready_timeout: Duration::from_secs(5),
        census_ttl: Duration::from_secs(1),
        concurrency: 4,
        ..config()
    };
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(controller::run(client, config, Metrics::new(), shutdown.clone()));

    let status_patched = || {
        calls
            .lock()
            .unwrap()
            .iter()
            .any(|c| c.method == Method::PATCH && c.path.ends_with("/status"))
    };
    for _ in 0..200 {
        if status_patched() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        status_patched(),
        "the pool was published: {:?}",
        calls.lock().unwrap()
    );

    let expected = published_plan(&gpus, &EffectivePolicy::default(), &Default::default())
        .0
        .slice_count();
    let written = written.lock().unwrap().clone();
    assert_eq!(written.len(), expected);
    assert!(written.iter().all(|s| s.spec.pool.generation == 1));

    let calls = calls.lock().unwrap().clone();
    let slice_reads: Vec<&Call> = calls
        .iter()
        .filter(|c| c.method == Method::GET && c.path == "/apis/resource.k8s.io/v1/resourceslices")
        .collect();
    assert!(slice_reads.len() >= 2, "a list and a watch of slices");
    for c in slice_reads {
        assert!(
            c.query.contains("fieldSelector=spec.driver%3Dgpu.migdra.dev"),
            "slices are watched by driver: {}",
            c.query
        );
    }
    for path in [
        "/apis/gpu.migdra.dev/v1alpha1/gpunodes",
        "/api/v1/nodes",
        "/apis/gpu.migdra.dev/v1alpha1/migpolicies",
        "/apis/resource.k8s.io/v1/resourceclaims",
        "/apis/coordination.k8s.io/v1/namespaces/migdra-system/leases",
        "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases",
    ] {
        assert!(
            calls.iter().any(|c| c.path == path && c.is_watch()),
            "{path} is watched"
        );
    }

    let heartbeat_leases = format!("/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases");
    let lease_reads: Vec<&Call> = calls.iter().filter(|c| c.path == heartbeat_leases).collect();
    for c in lease_reads {
        assert!(
            c.query
                .contains("labelSelector=gpu.migdra.dev%2Fheartbeat%3Dgpu.migdra.dev"),
            "Leases are watched by label: {}",
            c.query
        );
    }

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("graceful shutdown")
        .unwrap()
        .unwrap();
}
