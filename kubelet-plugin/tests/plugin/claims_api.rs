//! Prepare and unprepare against a mocked API server: the claim GETs the plugin makes, and
//! what it does with missing, unallocated, foreign-pool and replaced claims.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::{sync::Arc, time::Duration};

use dra_kubelet::DraDriver;
use http::{Method, Request, Response, StatusCode};
use kube::client::Body;
use migdra_kubelet_plugin::{
    claims::KubeClaims,
    driver::{Driver, DriverConfig},
    metrics::Metrics,
    nvml::NvmlBackend,
};
use migdra_testkit::plugin::*;
use serde_json::json;
use tower_test::mock;

type Handle = mock::Handle<Request<Body>, Response<Body>>;

fn not_found(name: &str) -> Response<Body> {
    let status = json!({
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404,
        "message": format!("resourceclaims.resource.k8s.io \"{name}\" not found"),
        "details": {"name": name, "group": "resource.k8s.io", "kind": "resourceclaims"}
    });
    Response::builder()
        .status(StatusCode::NOT_FOUND)
        .body(Body::from(serde_json::to_vec(&status).unwrap()))
        .unwrap()
}

/// A status write the plugin sent to the mocked API server.
#[derive(Debug)]
struct StatusPatch {
    path: String,
    query: String,
    content_type: String,
    body: serde_json::Value,
}

/// Answers the expected GETs in any order (the plugin fetches a batch concurrently), checking
/// each is a GET of a ResourceClaim by name in resource.k8s.io/v1, and `patches` status
/// writes (PATCHes of the `status` subresource), answered with the claim as last served.
async fn serve_claims_and_status(
    mut handle: Handle,
    mut expected: Vec<(&'static str, Option<serde_json::Value>)>,
    mut patches: usize,
) -> (Handle, Vec<StatusPatch>) {
    let mut served: std::collections::HashMap<String, serde_json::Value> = Default::default();
    let mut written = Vec::new();
    while !expected.is_empty() || patches > 0 {
        let (request, send) = tokio::time::timeout(Duration::from_secs(10), handle.next_request())
            .await
            .expect("the plugin stopped asking")
            .expect("mock closed");
        let path = request.uri().path().to_string();
        let name = path
            .strip_prefix("/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/")
            .unwrap_or_else(|| panic!("unexpected request {path}"))
            .to_string();
        if request.method() == Method::PATCH {
            assert!(patches > 0, "unexpected status write {path}");
            patches -= 1;
            let name = name
                .strip_suffix("/status")
                .unwrap_or_else(|| panic!("a PATCH of something else than the status: {path}"))
                .to_string();
            let query = request.uri().query().unwrap_or_default().to_string();
            let content_type = request
                .headers()
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string();
            let bytes = request.into_body().collect_bytes().await.unwrap();
            let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            // The claim as stored after the write (the mock keeps no state: the applied
            // object, completed with a spec).
            let mut answer = served.get(&name).cloned().unwrap_or_else(|| body.clone());
            answer["status"]["devices"] = body["status"]["devices"].clone();
            answer["spec"] = json!({"devices": {"requests": []}});
            written.push(StatusPatch {
                path,
                query,
                content_type,
                body,
            });
            send.send_response(
                Response::builder()
                    .body(Body::from(serde_json::to_vec(&answer).unwrap()))
                    .unwrap(),
            );
            continue;
        }
        assert_eq!(request.method(), Method::GET);
        let position = expected
            .iter()
            .position(|(n, _)| *n == name)
            .unwrap_or_else(|| panic!("unexpected GET of {name}"));
        let (_, answer) = expected.remove(position);
        match answer {
            Some(object) => {
                served.insert(name.clone(), object.clone());
                send.send_response(
                    Response::builder()
                        .body(Body::from(serde_json::to_vec(&object).unwrap()))
                        .unwrap(),
                )
            }
            None => send.send_response(not_found(&name)),
        }
    }
    (handle, written)
}

/// A driver on `node` whose claim GETs go to a mocked API server.
fn start_with_mock_api(node: &Node) -> (Driver<KubeClaims>, Handle) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let config = DriverConfig {
        driver_name: DRIVER.into(),
        node_name: NODE.into(),
        state_dir: node.state_dir(),
        boot_id: "boot-1".into(),
        lock_timeout: Duration::from_secs(2),
        nvml_call_timeout: Duration::from_secs(20),
    };
    let backend = NvmlBackend::new(Some(&node.host.lib_path())).unwrap();
    let claims = KubeClaims::new(client);
    let (driver, _) = Driver::start(
        config,
        Arc::new(backend),
        claims,
        node.cdi(),
        None,
        Metrics::new(),
    )
    .unwrap();
    (driver, handle)
}

#[tokio::test(flavor = "multi_thread")]
async fn prepare_reads_each_claim_and_rejects_the_wrong_ones() {
    let node = Node::new(&[("H100-80GB", true)]);
    let (driver, handle) = start_with_mock_api(&node);

    let good = serde_json::to_value(claim("uid-good", "good", &[("gpu", "gpu-0-mig-3g40gb-4")])).unwrap();
    let mut unallocated = serde_json::to_value(claim("uid-unalloc", "unallocated", &[])).unwrap();
    unallocated["status"] = json!({});
    let other_node = serde_json::to_value(claim_with(
        "uid-other",
        "other-node",
        "node-b/gpu.migdra.dev",
        &[("gpu", "gpu-0-mig-3g40gb-4")],
        json!([]),
    ))
    .unwrap();
    let replaced =
        serde_json::to_value(claim("uid-new", "replaced", &[("gpu", "gpu-0-mig-1g10gb-0")])).unwrap();
    let server = tokio::spawn(serve_claims_and_status(
        handle,
        vec![
            ("good", Some(good)),
            ("missing", None),
            ("unallocated", Some(unallocated)),
            ("other-node", Some(other_node)),
            ("replaced", Some(replaced)),
        ],
        1,
    ));
    let out = driver
        .prepare(vec![
            claim_ref("uid-good", "good"),
            claim_ref("uid-missing", "missing"),
            claim_ref("uid-unalloc", "unallocated"),
            claim_ref("uid-other", "other-node"),
            claim_ref("uid-old", "replaced"),
        ])
        .await;
    let (_, patches) = server.await.unwrap();
    assert_eq!(out.len(), 5);
    // Only the prepared claim's status is written: a server-side apply of its status
    // subresource, forced, by the plugin's field manager, with the claim's UID.
    assert_eq!(patches.len(), 1, "{patches:?}");
    let patch = &patches[0];
    assert_eq!(
        patch.path,
        "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/good/status"
    );
    assert_eq!(patch.content_type, "application/apply-patch+yaml");
    assert!(
        patch
            .query
            .contains("fieldManager=gpu.migdra.dev%2Fkubelet-plugin")
            && patch.query.contains("force=true"),
        "{}",
        patch.query
    );
    assert_eq!(patch.body["metadata"]["uid"], "uid-good");
    assert_eq!(patch.body["status"]["devices"][0]["device"], "gpu-0-mig-3g40gb-4");
    assert_eq!(
        patch.body["status"]["devices"][0]["conditions"][0]["type"],
        "Ready"
    );
    assert_eq!(
        out["uid-good"].as_ref().unwrap()[0].device_name,
        "gpu-0-mig-3g40gb-4"
    );
    assert_eq!(
        out["uid-missing"].as_ref().unwrap_err(),
        "ResourceClaim default/missing not found"
    );
    assert!(
        out["uid-unalloc"]
            .as_ref()
            .unwrap_err()
            .contains("is not allocated")
    );
    assert!(out["uid-other"].as_ref().unwrap_err().contains(
        "allocated from pool node-b/gpu.migdra.dev, but this node serves pool node-a/gpu.migdra.dev"
    ));
    assert!(
        out["uid-old"]
            .as_ref()
            .unwrap_err()
            .contains("has UID uid-new, but the kubelet asked for UID uid-old")
    );
    assert_eq!(
        node.instances(0).len(),
        1,
        "only the good claim created an instance"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_prepared_claim_is_answered_from_its_record_and_unprepare_needs_no_api_calls() {
    let node = Node::new(&[("H100-80GB", true)]);
    let (driver, handle) = start_with_mock_api(&node);
    let good = serde_json::to_value(claim("uid-1", "c1", &[("gpu", "gpu-0-mig-3g40gb-4")])).unwrap();
    // One GET, and the status write after the prepare (in the background: the server task
    // waits for it).
    let server = tokio::spawn(serve_claims_and_status(handle, vec![("c1", Some(good))], 1));
    let first = driver.prepare(vec![claim_ref("uid-1", "c1")]).await;
    let (handle, _) = server.await.unwrap();
    assert!(first["uid-1"].is_ok());
    // Answered from the checkpoint after one GET (a record answers only for the allocation
    // it was made for): the claim may even be gone from the API by now, which proves no
    // other allocation; nothing is written.
    let server = tokio::spawn(serve_claims_and_status(handle, vec![("c1", None)], 0));
    let again = driver.prepare(vec![claim_ref("uid-1", "c1")]).await;
    let (handle, _) = server.await.unwrap();
    assert_eq!(again["uid-1"], first["uid-1"]);
    // Unprepare carries only namespace, UID and name and reads nothing from the API; it
    // removes the status entries of the claim it had prepared (and writes nothing for the
    // claim it never had).
    let server = tokio::spawn(serve_claims_and_status(handle, vec![], 1));
    let out = driver
        .unprepare(vec![claim_ref("uid-1", "c1"), claim_ref("uid-unknown", "gone")])
        .await;
    let (mut handle, patches) = server.await.unwrap();
    wait_until("the clear was answered", || {
        driver.claim_status_queued().is_empty()
    })
    .await;
    assert!(out["uid-1"].is_ok() && out["uid-unknown"].is_ok());
    assert_eq!(node.total_instances(), 0);
    assert_eq!(patches.len(), 1);
    assert!(patches[0].path.ends_with("/resourceclaims/c1/status"));
    assert_eq!(patches[0].body["status"], json!({"devices": []}));
    assert!(
        tokio::time::timeout(Duration::from_millis(200), handle.next_request())
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn prepare_answers_before_the_api_server_answers_the_status_write() {
    let node = Node::new(&[("H100-80GB", true)]);
    let (driver, handle) = start_with_mock_api(&node);
    let good = serde_json::to_value(claim("uid-1", "c1", &[("gpu", "gpu-0-mig-1g10gb-0")])).unwrap();
    // Only the GET is answered before the prepare returns.
    let server = tokio::spawn(serve_claims_and_status(handle, vec![("c1", Some(good))], 0));
    let out = driver.prepare(vec![claim_ref("uid-1", "c1")]).await;
    let (handle, _) = server.await.unwrap();
    assert_eq!(
        out["uid-1"].as_ref().unwrap()[0].device_name,
        "gpu-0-mig-1g10gb-0"
    );
    // The status write is still waiting for its answer.
    assert_eq!(driver.claim_status_queued(), ["uid-1"]);
    let (_, patches) = serve_claims_and_status(handle, vec![], 1).await;
    assert_eq!(patches[0].body["metadata"]["uid"], "uid-1");
    assert_eq!(
        patches[0].body["status"]["devices"][0]["device"],
        "gpu-0-mig-1g10gb-0"
    );
    wait_until("the status write was answered", || {
        driver.claim_status_queued().is_empty()
    })
    .await;
    assert!(
        driver.claim_status_pending().is_empty(),
        "written, not kept for a retry"
    );
}
