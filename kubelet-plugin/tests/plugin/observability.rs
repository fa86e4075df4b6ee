//! What an operator sees of the plugin: the per-instance info series and per-GPU series of
//! the metrics, and the events on ResourceClaims (queued by the driver and the status loop,
//! written by the event task to the events API).
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::{sync::Arc, time::Duration};

use dra_kubelet::RegistrationState;
use http::{Method, Request, Response};
use kube::{
    client::Body,
    runtime::events::{EventType, Recorder, Reporter},
};
use migdra_fake_nvml::{
    FaultState,
    config::{FakeConfig, FaultConfig, GpuConfig, InstanceConfig},
};
use migdra_kubelet_plugin::{
    driver::{Step, StepHook},
    events::{ClaimEvent, ClaimEvents, publish_claim_events},
    gpus::Gpus,
    metrics::Metrics,
    node_status::{HeartbeatLease, NodeStatusWriter, StatusLoop},
};
use migdra_testkit::plugin::*;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tower_test::mock;

const H100_3G_AT_4: &str = "gpu-0-mig-3g40gb-4";
/// A foreign 1g.10gb (GI profile 19) at memory slice 0.
const FOREIGN: (u32, u32) = (19, 0);

/// The metric lines of `family` (exact name, with labels), from an OpenMetrics text.
fn lines<'a>(text: &'a str, family: &str) -> Vec<&'a str> {
    let prefix = format!("{family}{{");
    text.lines().filter(|l| l.starts_with(&prefix)).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn each_created_instance_has_an_info_series_until_it_is_destroyed() {
    let node = Node::new(&[("H100-80GB", true)]);
    let metrics = Metrics::new();
    let (driver, _) = node.try_start_with(None, metrics.clone()).unwrap();
    driver.gpus().inventory().unwrap(); // as the status loop does: learns the GPUs' indices
    node.claims.put(reserved_for(
        claim("uid-1", "train", &[("gpu", H100_3G_AT_4)]),
        &["trainer-0"],
    ));

    prepare_one(&driver, "uid-1", "train").await.unwrap();
    let state = node.host.read_state().unwrap();
    let gpu = &state.gpus[0];
    let gi = &gpu.gpu_instances[0];
    let ci = &gi.compute_instances[0];
    let expected = format!(
        "migdra_kubelet_plugin_mig_instance_info{{gpu_uuid=\"{}\",gpu=\"{}\",gpu_minor=\"{}\",gi=\"{}\",ci=\"{}\",mig_uuid=\"{}\",profile=\"3g.40gb\",placement=\"4\",namespace=\"default\",pod=\"trainer-0\",claim=\"train\"}} 1",
        gpu.uuid, gpu.index, gpu.minor, gi.id, ci.id, ci.uuid
    );
    let text = metrics.encode();
    assert_eq!(
        lines(&text, "migdra_kubelet_plugin_mig_instance_info"),
        vec![expected.as_str()],
        "{text}"
    );

    unprepare_one(&driver, "uid-1", "train").await.unwrap();
    let text = metrics.encode();
    assert!(
        lines(&text, "migdra_kubelet_plugin_mig_instance_info").is_empty(),
        "the destroyed instance's series is gone:\n{text}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn per_gpu_series_show_slices_instances_by_profile_mig_mode_and_health() {
    let node = Node::with_config(FakeConfig {
        gpus: vec![
            GpuConfig::new("H100-80GB", true),
            GpuConfig::new("H100-80GB", false),
        ],
        instances: vec![InstanceConfig {
            gpu: 0,
            profile_id: FOREIGN.0,
            start: FOREIGN.1,
        }],
        ..FakeConfig::default()
    });
    let metrics = Metrics::new();
    let (driver, _) = node.try_start_with(None, metrics.clone()).unwrap();
    node.claims.put(claim("uid-1", "c1", &[("gpu", H100_3G_AT_4)]));
    prepare_one(&driver, "uid-1", "c1").await.unwrap();
    let inventory = driver.gpus().inventory().unwrap();
    let gpu = |minor: u32| {
        let g = inventory.iter().find(|g| g.minor == minor).unwrap();
        format!(
            "gpu=\"{}\",gpu_minor=\"{}\",gpu_uuid=\"{}\"",
            g.index, g.minor, g.uuid
        )
    };
    let (g0, g1) = (gpu(0), gpu(1));
    let text = metrics.encode();

    // 3g.40gb@4 covers slices 4..8, the foreign 1g.10gb@0 slice 0: 5 of 8 used.
    let mut slices = lines(&text, "migdra_kubelet_plugin_gpu_memory_slices");
    slices.sort();
    assert_eq!(
        slices,
        vec![
            format!("migdra_kubelet_plugin_gpu_memory_slices{{{g0},state=\"free\"}} 3"),
            format!("migdra_kubelet_plugin_gpu_memory_slices{{{g0},state=\"used\"}} 5"),
        ],
        "only the MIG-enabled GPU has memory slices:\n{text}"
    );
    let mut by_profile = lines(&text, "migdra_kubelet_plugin_gpu_mig_instances");
    by_profile.sort();
    assert_eq!(
        by_profile,
        vec![
            format!(
                "migdra_kubelet_plugin_gpu_mig_instances{{{g0},profile=\"1g.10gb\",owner=\"foreign\"}} 1"
            ),
            format!("migdra_kubelet_plugin_gpu_mig_instances{{{g0},profile=\"3g.40gb\",owner=\"migdra\"}} 1"),
        ],
        "{text}"
    );
    let mut modes = lines(&text, "migdra_kubelet_plugin_gpu_mig_mode");
    modes.sort();
    let mut expected_modes = vec![
        format!("migdra_kubelet_plugin_gpu_mig_mode{{{g0}}} 1"),
        format!("migdra_kubelet_plugin_gpu_mig_mode{{{g1}}} 0"),
    ];
    expected_modes.sort();
    assert_eq!(modes, expected_modes, "{text}");
    assert!(
        text.contains(&format!("migdra_kubelet_plugin_gpu_healthy{{{g0}}} 1")),
        "{text}"
    );

    // The GPU is lost: unhealthy. The instance is destroyed once it is back: series follow.
    node.host.update_state(|s| s.gpus[0].lost = true).unwrap();
    driver.gpus().inventory().unwrap();
    let text = metrics.encode();
    assert!(
        text.contains(&format!("migdra_kubelet_plugin_gpu_healthy{{{g0}}} 0")),
        "{text}"
    );
    node.host.update_state(|s| s.gpus[0].lost = false).unwrap();
    unprepare_one(&driver, "uid-1", "c1").await.unwrap();
    driver.gpus().inventory().unwrap();
    let text = metrics.encode();
    assert_eq!(
        lines(&text, "migdra_kubelet_plugin_gpu_mig_instances"),
        vec![format!(
            "migdra_kubelet_plugin_gpu_mig_instances{{{g0},profile=\"1g.10gb\",owner=\"foreign\"}} 1"
        )],
        "the destroyed profile's series is removed, not left at 0:\n{text}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_prepare_is_a_warning_event_on_the_claim_with_its_reason() {
    let node = Node::new(&[("H100-80GB", true)]);
    let (driver, _) = node.start(None);
    let mut events = record_claim_events(&driver);
    node.claims
        .put(claim("u1", "bad-profile", &[("gpu", "gpu-0-mig-1g5gb-0")]));
    node.claims.put(claim("u2", "good", &[("gpu", H100_3G_AT_4)]));
    let outcomes = driver
        .prepare_claims(vec![
            claim_ref("u1", "bad-profile"),
            claim_ref("u2", "good"),
            claim_ref("u3", "missing"),
        ])
        .await;
    let mut queued = queued_events(&mut events);
    queued.sort_by(|a, b| a.uid.cmp(&b.uid));
    let summary: Vec<_> = queued
        .iter()
        .map(|e| (e.uid.as_str(), e.name.as_str(), e.reason, e.action, e.type_))
        .collect();
    assert_eq!(
        summary,
        vec![
            (
                "u1",
                "bad-profile",
                "UnknownProfile",
                "PrepareResourceClaim",
                EventType::Warning
            ),
            (
                "u3",
                "missing",
                "ClaimNotFound",
                "PrepareResourceClaim",
                EventType::Warning
            ),
        ],
        "one event per failed claim, none for the prepared one"
    );
    let failure = outcomes["u1"].as_ref().unwrap_err();
    assert!(
        queued[0].note.contains(&failure.to_string()),
        "{}",
        queued[0].note
    );
    assert_eq!(queued[0].namespace, "default");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gpu_turning_unhealthy_is_a_warning_event_on_the_claims_using_it() {
    let node = Node::new(&[("H100-80GB", true), ("H100-80GB", true)]);
    let (driver, _) = node.start(None);
    node.claims.put(claim("u1", "on-gpu-0", &[("gpu", H100_3G_AT_4)]));
    node.claims
        .put(claim("u2", "on-gpu-1", &[("gpu", "gpu-1-mig-3g40gb-4")]));
    prepare_one(&driver, "u1", "on-gpu-0").await.unwrap();
    prepare_one(&driver, "u2", "on-gpu-1").await.unwrap();

    let (claim_events, mut events) = ClaimEvents::channel();
    let stop = CancellationToken::new();
    let task = status_loop(
        driver.gpus(),
        None,
        Duration::from_millis(50),
        claim_events,
        &stop,
    );
    // Healthy GPUs: nothing for any claim.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(queued_events(&mut events), Vec::new());

    node.host.update_state(|s| s.gpus[0].lost = true).unwrap();
    let event = tokio::time::timeout(Duration::from_secs(20), events.recv())
        .await
        .expect("an event for the claim on the lost GPU")
        .unwrap();
    stop.cancel();
    task.await.unwrap();
    assert_eq!((event.uid.as_str(), event.name.as_str()), ("u1", "on-gpu-0"));
    assert_eq!((event.reason, event.type_), ("GpuUnhealthy", EventType::Warning));
    let uuid = node.host.read_state().unwrap().gpus[0].uuid.clone();
    assert!(event.note.contains(&uuid), "{}", event.note);
    assert!(
        queued_events(&mut events).iter().all(|e| e.uid == "u1"),
        "the claim on the healthy GPU gets nothing, and the lost GPU's claim one event per change"
    );
}

/// A status loop over `gpus` with `writer` (none: no GpuNode, only device health and claim
/// events), sending claim events to `claim_events`, refreshing every `interval` until `stop`.
fn status_loop(
    gpus: &Gpus,
    writer: Option<NodeStatusWriter>,
    interval: Duration,
    claim_events: ClaimEvents,
    stop: &CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let (_registration_tx, registration) = watch::channel(RegistrationState::default());
    let (health, _health_rx) = watch::channel(Vec::new());
    let status = StatusLoop {
        gpus: gpus.clone(),
        writer,
        recovery_note: None,
        recovery_events: None,
        registration,
        health,
        interval,
        claim_events,
    };
    tokio::spawn(status.run(stop.clone()))
}

/// The next queued event with `reason` (others are skipped), within 20 s.
async fn next_event(events: &mut tokio::sync::mpsc::Receiver<ClaimEvent>, reason: &str) -> ClaimEvent {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let event = tokio::time::timeout_at(deadline, events.recv())
            .await
            .unwrap_or_else(|_| panic!("no {reason} event"))
            .unwrap();
        if event.reason == reason {
            return event;
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_repair_left_pending_and_its_completion_are_events_on_the_claim() {
    let node = Node::new(&[("H100-80GB", true)]);
    node.claims.put(claim("uid-1", "stuck", &[("gpu", H100_3G_AT_4)]));
    {
        // A crash after the instance was recorded leaves the claim half prepared...
        let hook: StepHook = Arc::new(|_uid, step| {
            if step == Step::DeviceRecorded {
                panic!("injected crash after the device was recorded");
            }
        });
        let (driver, _) = node.start(Some(hook));
        assert!(prepare_one(&driver, "uid-1", "stuck").await.is_err());
    }
    // ...and the rollback at the next start fails once (NVML cannot destroy the instance).
    node.host
        .update_state(|s| {
            s.faults.push(FaultState {
                fault: FaultConfig::error("nvmlGpuInstanceDestroy", migdra_fake_nvml::code::UNKNOWN)
                    .on_gpu(0)
                    .times(1),
                hits: 0,
            })
        })
        .unwrap();
    let (driver, report) = node.start(None);
    assert_eq!(report.pending.len(), 1, "{report:?}");

    let (claim_events, mut events) = ClaimEvents::channel();
    let stop = CancellationToken::new();
    let task = status_loop(
        driver.gpus(),
        None,
        Duration::from_millis(50),
        claim_events,
        &stop,
    );
    let pending = next_event(&mut events, "RecoveryPending").await;
    assert_eq!((pending.uid.as_str(), pending.name.as_str()), ("uid-1", "stuck"));
    assert_eq!(pending.type_, EventType::Warning);
    assert!(
        pending.note.contains(&report.pending[0].error),
        "{}",
        pending.note
    );

    // The background repair succeeds now: the claim hears it is done.
    let round = driver.retry_pending_repairs().unwrap();
    assert_eq!(round.completed.len(), 1, "{round:?}");
    let completed = next_event(&mut events, "RecoveryCompleted").await;
    stop.cancel();
    task.await.unwrap();
    assert_eq!(
        (completed.uid.as_str(), completed.type_),
        ("uid-1", EventType::Normal)
    );
    assert!(
        queued_events(&mut events)
            .iter()
            .all(|e| e.reason != "RecoveryPending"),
        "pending is reported once, not at every refresh"
    );
}

/// Answers one request of the mocked API server with `body` and returns the request's method,
/// path and JSON body.
async fn answer(
    handle: &mut mock::Handle<Request<Body>, Response<Body>>,
) -> (Method, String, serde_json::Value) {
    let (request, send) = tokio::time::timeout(Duration::from_secs(10), handle.next_request())
        .await
        .expect("the event task stopped writing")
        .expect("mock closed");
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let bytes = request.into_body().collect_bytes().await.unwrap();
    let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    send.send_response(Response::builder().body(Body::from(bytes.to_vec())).unwrap());
    (method, path, body)
}

#[tokio::test(flavor = "multi_thread")]
async fn claim_events_are_written_to_the_claims_namespace_and_repeats_aggregate() {
    let (service, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: "migdra-kubelet-plugin".into(),
            instance: Some(NODE.into()),
        },
    );
    let (events, receiver) = ClaimEvents::channel();
    let stop = CancellationToken::new();
    let task = tokio::spawn(publish_claim_events(recorder, receiver, stop.clone()));
    let event = ClaimEvent {
        namespace: "team-a".into(),
        name: "train".into(),
        uid: "uid-1".into(),
        type_: EventType::Warning,
        reason: "PlacementOverlap",
        action: "PrepareResourceClaim",
        note: "prepare failed on this node: overlap".into(),
    };
    events.send(event.clone());
    events.send(event);

    let (method, path, first) = answer(&mut handle).await;
    assert_eq!(method, Method::POST);
    assert_eq!(path, "/apis/events.k8s.io/v1/namespaces/team-a/events");
    assert_eq!(first["reason"], "PlacementOverlap");
    assert_eq!(first["type"], "Warning");
    assert_eq!(first["action"], "PrepareResourceClaim");
    assert_eq!(first["reportingController"], "migdra-kubelet-plugin");
    assert_eq!(first["reportingInstance"], NODE);
    assert_eq!(
        first["regarding"],
        serde_json::json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "namespace": "team-a", "name": "train", "uid": "uid-1"})
    );
    // The repeat is a count on the same event, not a second object.
    let (method, path, second) = answer(&mut handle).await;
    assert_eq!(method, Method::PATCH);
    let name = first["metadata"]["name"].as_str().unwrap();
    assert_eq!(
        path,
        format!("/apis/events.k8s.io/v1/namespaces/team-a/events/{name}")
    );
    assert_eq!(second["series"]["count"], 2);
    stop.cancel();
    task.await.unwrap();
}

/// The value of the one sample named `series` (name with its labels), from an OpenMetrics text.
fn sample(text: &str, series: &str) -> f64 {
    let values: Vec<f64> = text
        .lines()
        .filter_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .collect();
    assert_eq!(values.len(), 1, "one sample {series}:\n{text}");
    values[0]
}

/// Observations of every `nvml_call_duration_seconds` series together.
fn nvml_calls_observed(text: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with("migdra_kubelet_plugin_nvml_call_duration_seconds_count{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_prepare_reports_its_time_inside_and_outside_nvml_and_one_from_the_checkpoint_none_inside() {
    let node = Node::new(&[("H100-80GB", true)]);
    let metrics = Metrics::new();
    let (driver, _) = node.try_start_with(None, metrics.clone()).unwrap();
    node.claims.put(claim("uid-1", "train", &[("gpu", H100_3G_AT_4)]));
    let nvml = "migdra_kubelet_plugin_call_nvml_duration_seconds";
    let outside = "migdra_kubelet_plugin_call_outside_nvml_duration_seconds";
    let handler = "migdra_kubelet_plugin_call_duration_seconds";
    let function = "migdra_kubelet_plugin_nvml_call_duration_seconds";
    let prepare = "{operation=\"prepare\"}";

    prepare_one(&driver, "uid-1", "train").await.unwrap();
    assert_eq!(node.total_instances(), 1);
    let text = metrics.encode();
    assert_eq!(sample(&text, &format!("{nvml}_count{prepare}")), 1.0);
    assert_eq!(sample(&text, &format!("{outside}_count{prepare}")), 1.0);
    let inside = sample(&text, &format!("{nvml}_sum{prepare}"));
    assert!(inside > 0.0, "creating an instance takes NVML calls:\n{text}");
    assert!(sample(&text, &format!("{outside}_sum{prepare}")) > 0.0, "{text}");
    // Both parts of the call add up to the call (the NVML calls ran inside it).
    let total = sample(&text, &format!("{handler}_sum{prepare}"));
    let parts = inside + sample(&text, &format!("{outside}_sum{prepare}"));
    assert!((total - parts).abs() < 1e-6, "{total} vs {parts}");
    for created in ["create_gpu_instance", "create_full_compute_instance"] {
        let count = sample(&text, &format!("{function}_count{{function=\"{created}\"}}"));
        assert_eq!(count, 1.0, "{created}:\n{text}");
    }
    let per_function: f64 = text
        .lines()
        .filter(|l| l.starts_with(&format!("{function}_sum{{")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!((per_function - inside).abs() < 1e-6, "{per_function} vs {inside}");
    let calls_after_create = nvml_calls_observed(&text);

    // Asked again: answered from the checkpoint, without a single NVML call.
    prepare_one(&driver, "uid-1", "train").await.unwrap();
    let text = metrics.encode();
    assert_eq!(sample(&text, &format!("{nvml}_count{prepare}")), 2.0);
    assert_eq!(sample(&text, &format!("{nvml}_sum{prepare}")), inside);
    assert_eq!(sample(&text, &format!("{outside}_count{prepare}")), 2.0);
    assert_eq!(nvml_calls_observed(&text), calls_after_create);

    // Unprepare destroys through NVML, counted under its own operation.
    unprepare_one(&driver, "uid-1", "train").await.unwrap();
    let text = metrics.encode();
    let unprepare = "{operation=\"unprepare\"}";
    assert_eq!(sample(&text, &format!("{nvml}_count{unprepare}")), 1.0);
    assert!(sample(&text, &format!("{nvml}_sum{unprepare}")) > 0.0, "{text}");
    assert_eq!(sample(&text, &format!("{nvml}_sum{prepare}")), inside);
    for destroyed in ["destroy_compute_instance", "destroy_gpu_instance"] {
        let count = sample(&text, &format!("{function}_count{{function=\"{destroyed}\"}}"));
        assert_eq!(count, 1.0, "{destroyed}:\n{text}");
    }
}

/// The driver's own work is the call minus its NVML time and minus its wait for the claim GET:
/// a slow API server shows in the call and in the GET, not in the driver's own time.
#[tokio::test(flavor = "multi_thread")]
async fn a_slow_claim_get_is_not_counted_as_the_drivers_own_work() {
    let node = Node::new(&[("H100-80GB", true)]);
    let metrics = Metrics::new();
    let (driver, _) = node.try_start_with(None, metrics.clone()).unwrap();
    node.claims.put(claim("uid-1", "train", &[("gpu", H100_3G_AT_4)]));
    let get_delay = Duration::from_millis(200);
    node.claims.delay_gets(get_delay);
    let series =
        |name: &str, part: &str| format!("migdra_kubelet_plugin_{name}_{part}{{operation=\"prepare\"}}");

    prepare_one(&driver, "uid-1", "train").await.unwrap();
    let text = metrics.encode();
    let total = sample(&text, &series("call_duration_seconds", "sum"));
    let inside = sample(&text, &series("call_nvml_duration_seconds", "sum"));
    let outside = sample(&text, &series("call_outside_nvml_duration_seconds", "sum"));
    let own = sample(&text, &series("call_own_duration_seconds", "sum"));
    let get = sample(&text, "migdra_kubelet_plugin_claim_read_duration_seconds_sum");
    assert_eq!(sample(&text, &series("call_own_duration_seconds", "count")), 1.0);
    assert!(get >= get_delay.as_secs_f64(), "the GET took the delay: {get}");
    assert!(
        outside >= get,
        "the GET is part of the time outside NVML: {outside} vs {get}"
    );
    // The own work is what is left of the call after NVML and the GET; the GET's own timer
    // and the call's wait for it differ by the scheduling around one await.
    assert!(own >= 0.0 && own < outside, "{own} vs {outside}");
    assert!(
        (outside - get - own).abs() < 0.01,
        "own {own}, outside {outside}, GET {get}"
    );
    assert!(
        (total - inside - outside).abs() < 1e-6,
        "{total} vs {inside} + {outside}"
    );
    assert!(
        own < get_delay.as_secs_f64(),
        "the 200 ms GET is not the driver's own work: {own}"
    );

    // Answered from the checkpoint after the GET shows the same allocation: the second
    // call's own time is its time outside NVML minus that GET.
    prepare_one(&driver, "uid-1", "train").await.unwrap();
    let text = metrics.encode();
    assert_eq!(sample(&text, &series("call_own_duration_seconds", "count")), 2.0);
    let own_both = sample(&text, &series("call_own_duration_seconds", "sum"));
    let outside_both = sample(&text, &series("call_outside_nvml_duration_seconds", "sum"));
    let get_both = sample(&text, "migdra_kubelet_plugin_claim_read_duration_seconds_sum");
    assert!(
        get_both - get >= get_delay.as_secs_f64(),
        "the second GET took the delay"
    );
    assert!(
        ((outside_both - outside) - (get_both - get) - (own_both - own)).abs() < 0.01,
        "the second call's own time is its time outside NVML minus its GET: own {}, outside {}, GET {}",
        own_both - own,
        outside_both - outside,
        get_both - get
    );
    assert!(
        own_both - own < get_delay.as_secs_f64(),
        "the second call's GET is not its own work: {}",
        own_both - own
    );
}

/// A GpuNode writer heartbeating every `interval` through the Lease in `migdra-system`, over
/// `client` (the mocked API server).
fn writer(client: kube::Client, interval: Duration) -> NodeStatusWriter {
    let lease = HeartbeatLease::new(client.clone(), "migdra-system", NODE, DRIVER, interval);
    NodeStatusWriter::new(client, NODE, DRIVER, lease)
}

/// What the mocked API server answers to a status loop's request for `path`: the Node, the
/// GpuNode or the Lease.
fn api_answer(path: &str) -> serde_json::Value {
    if path.starts_with("/api/v1/nodes/") {
        serde_json::json!({"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": NODE, "uid": "node-uid"}})
    } else if path.contains("/gpunodes/") {
        serde_json::json!({"apiVersion": "gpu.migdra.dev/v1alpha1", "kind": "GpuNode",
            "metadata": {"name": NODE, "uid": "gpunode-uid"}, "spec": {"nodeName": NODE, "driver": DRIVER}})
    } else if path.contains("/leases/") {
        serde_json::json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": format!("{NODE}.{DRIVER}"), "namespace": "migdra-system"}})
    } else {
        panic!("the status loop asked for {path}")
    }
}

fn json_response(body: &serde_json::Value) -> Response<Body> {
    Response::builder()
        .body(Body::from(serde_json::to_vec(body).unwrap()))
        .unwrap()
}

fn is_lease(path: &str) -> bool {
    path.contains("/leases/")
}

/// A status loop writing every `interval` to a mocked API server, and what drives it.
struct MockedApi {
    handle: mock::Handle<Request<Body>, Response<Body>>,
    task: tokio::task::JoinHandle<()>,
    stop: CancellationToken,
    /// Kept open, so that the loop's claim events have somewhere to go.
    _events: tokio::sync::mpsc::Receiver<ClaimEvent>,
}

fn mocked_api(gpus: &Gpus, interval: Duration) -> MockedApi {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let writer = writer(kube::Client::new(service, "default"), interval);
    let (claim_events, _events) = ClaimEvents::channel();
    let stop = CancellationToken::new();
    let task = status_loop(gpus, Some(writer), interval, claim_events, &stop);
    MockedApi {
        handle,
        task,
        stop,
        _events,
    }
}

/// The next request the loop makes, within 10 s, as method, path and the way to answer it.
async fn next_call(
    handle: &mut mock::Handle<Request<Body>, Response<Body>>,
    seen: &[(Method, String)],
) -> (Method, String, mock::SendResponse<Response<Body>>) {
    let (request, send) = tokio::time::timeout(Duration::from_secs(10), handle.next_request())
        .await
        .unwrap_or_else(|_| panic!("the heartbeat stopped after {seen:?}"))
        .expect("mock closed");
    (request.method().clone(), request.uri().path().to_string(), send)
}

fn is_gpunode_status(method: &Method, path: &str) -> bool {
    *method == Method::PATCH && path.ends_with(&format!("/gpunodes/{NODE}/status"))
}

/// An overloaded API server may hold a request for minutes. One renewal hanging must not
/// hold the later ones, or the controller would take a live plugin for dead: the Lease task
/// gives up on the call after its bound and renews again. The GpuNode status, unchanged, is
/// written once: it is no heartbeat.
#[tokio::test(flavor = "multi_thread")]
async fn a_hung_lease_renewal_does_not_hold_the_next_beats() {
    let node = Node::new(&[("H100-80GB", true)]);
    let (driver, _) = node.start(None);
    let interval = Duration::from_millis(300);
    let mut api = mocked_api(driver.gpus(), interval);

    let mut hung = Vec::new();
    let mut seen: Vec<(Method, String)> = Vec::new();
    // Up to the third Lease request (no Lease request is ever answered): each one after the
    // first comes once the one before hit its bound of two intervals.
    while seen.iter().filter(|(_, p)| is_lease(p)).count() < 3 {
        let (method, path, send) = next_call(&mut api.handle, &seen).await;
        seen.push((method, path.clone()));
        if is_lease(&path) {
            hung.push(send);
            continue;
        }
        send.send_response(json_response(&api_answer(&path)));
    }
    api.stop.cancel();
    // The final "unregistered" write at shutdown fails at once against a closed mock.
    drop((hung, api.handle));
    let first_lease = seen.iter().position(|(_, p)| is_lease(p)).unwrap();
    let first_status = seen.iter().position(|(m, p)| is_gpunode_status(m, p)).unwrap();
    // The Lease task starts once the GpuNode exists (the Node's UID is the Lease's owner).
    assert!(
        seen[..first_lease]
            .iter()
            .any(|(m, p)| *m == Method::PATCH && p.ends_with(&format!("/gpunodes/{NODE}"))),
        "{seen:?}"
    );
    // Nothing in the status changed while the Lease requests hung: no second status write.
    assert!(
        !seen[first_status + 1..]
            .iter()
            .any(|(m, p)| is_gpunode_status(m, p)),
        "{seen:?}"
    );
    let _ = tokio::time::timeout(Duration::from_secs(10), api.task).await;
}

/// An API server that answers writes more slowly than the heartbeat interval: a status write
/// left unanswered within its bound (two intervals) is written again at the next beat, never
/// preceded by re-creating the GpuNode (one more write a slow server would have to take). A
/// write answered after 1.5 intervals is waited for: it is not written again.
#[tokio::test(flavor = "multi_thread")]
async fn status_writes_slower_than_the_interval_do_not_re_create_the_gpunode() {
    let node = Node::new(&[("H100-80GB", true)]);
    let (driver, _) = node.start(None);
    let interval = Duration::from_millis(300);
    let mut api = mocked_api(driver.gpus(), interval);

    let mut unanswered = Vec::new();
    let mut seen: Vec<(Method, String)> = Vec::new();
    // Three status writes: the first two never answered, the third after 1.5 intervals.
    while seen.iter().filter(|(m, p)| is_gpunode_status(m, p)).count() < 3 {
        let (method, path, send) = next_call(&mut api.handle, &seen).await;
        seen.push((method.clone(), path.clone()));
        if !is_gpunode_status(&method, &path) {
            send.send_response(json_response(&api_answer(&path)));
            continue;
        }
        match seen.iter().filter(|(m, p)| is_gpunode_status(m, p)).count() {
            1 | 2 => unanswered.push(send),
            _ => {
                tokio::spawn(async move {
                    tokio::time::sleep(interval.mul_f32(1.5)).await;
                    send.send_response(json_response(&api_answer(&path)));
                });
            }
        }
    }
    // Four more intervals: the Lease is renewed, the status is not written again.
    let quiet_until = tokio::time::Instant::now() + interval * 4;
    while let Ok(request) = tokio::time::timeout_at(quiet_until, api.handle.next_request()).await {
        let (request, send) = request.expect("mock closed");
        let (method, path) = (request.method().clone(), request.uri().path().to_string());
        seen.push((method, path.clone()));
        send.send_response(json_response(&api_answer(&path)));
    }
    api.stop.cancel();
    drop((unanswered, api.handle));
    let statuses = seen.iter().filter(|(m, p)| is_gpunode_status(m, p)).count();
    assert_eq!(statuses, 3, "the answered write was not repeated: {seen:?}");
    let first_status = seen.iter().position(|(m, p)| is_gpunode_status(m, p)).unwrap();
    let recreated: Vec<_> = seen[first_status..]
        .iter()
        .filter(|(m, p)| *m == Method::PATCH && p.ends_with(&format!("/gpunodes/{NODE}")))
        .collect();
    assert!(recreated.is_empty(), "the GpuNode was written again: {seen:?}");
    let _ = tokio::time::timeout(Duration::from_secs(10), api.task).await;
}

/// The Lease has a task of its own: an inventory refresh hanging in NVML holds the status
/// loop, never the renewals, so the controller keeps seeing a live plugin. Stopped, the
/// plugin still reports itself unregistered in the GpuNode, after the last renewal.
#[tokio::test(flavor = "multi_thread")]
async fn a_hung_inventory_refresh_does_not_hold_the_lease_renewals() {
    let node = Node::new(&[("H100-80GB", true)]);
    let backend = Arc::new(GatedBackend::new(node.nvml()));
    let (driver, _) = node.start_over(backend.clone(), None, Metrics::new()).unwrap();
    let interval = Duration::from_millis(200);
    let api = mocked_api(driver.gpus(), interval);

    // Every request as (method, path, body), recorded before it is answered.
    let seen = Arc::new(std::sync::Mutex::new(
        Vec::<(Method, String, serde_json::Value)>::new(),
    ));
    let mut handle = api.handle;
    let server = {
        let seen = seen.clone();
        tokio::spawn(async move {
            while let Some((request, send)) = handle.next_request().await {
                let (method, path) = (request.method().clone(), request.uri().path().to_string());
                let bytes = request.into_body().collect_bytes().await.unwrap();
                let body = serde_json::from_slice(&bytes).unwrap_or_default();
                seen.lock().unwrap().push((method, path.clone(), body));
                send.send_response(json_response(&api_answer(&path)));
            }
        })
    };
    let leases = |seen: &[(Method, String, serde_json::Value)]| {
        seen.iter()
            .filter(|(m, p, _)| *m == Method::PATCH && is_lease(p))
            .count()
    };
    wait_until("the GpuNode status was written and the Lease renewed", || {
        let seen = seen.lock().unwrap();
        leases(&seen) >= 1 && seen.iter().any(|(m, p, _)| is_gpunode_status(m, p))
    })
    .await;

    let gate = backend.close();
    wait_until("an inventory refresh hangs in NVML", || backend.waiting() > 0).await;
    let (requests_then, leases_then) = {
        let seen = seen.lock().unwrap();
        (seen.len(), leases(&seen))
    };
    wait_until("two more Lease renewals while the refresh hangs", || {
        leases(&seen.lock().unwrap()) >= leases_then + 2
    })
    .await;
    assert_eq!(backend.waiting(), 1, "the refresh still hangs");
    {
        // Only the Lease task talked to the API server meanwhile: the status loop was held.
        let seen = seen.lock().unwrap();
        let meanwhile: Vec<_> = seen[requests_then..].iter().map(|(m, p, _)| (m, p)).collect();
        assert!(meanwhile.iter().all(|(_, p)| is_lease(p)), "{meanwhile:?}");
    }

    drop(gate);
    api.stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), api.task)
        .await
        .expect("the status loop stopped")
        .unwrap();
    server.abort();
    let seen = seen.lock().unwrap();
    let (method, path, last) = seen.last().unwrap();
    assert!(is_gpunode_status(method, path), "{seen:?}");
    assert_eq!(last["status"]["plugin"]["registered"], false, "{last}");
}

/// NVML answering nothing on the node (here its discovery hangs past the call timeout) pauses
/// the heartbeat, so the controller stops offering the node; once NVML answers, the Lease is
/// renewed again at once.
#[tokio::test(flavor = "multi_thread")]
async fn a_node_where_nvml_answers_nothing_stops_renewing_its_lease() {
    let mut node = Node::new(&[("H100-80GB", true)]);
    node.nvml_call_timeout = Duration::from_secs(1);
    let backend = Arc::new(GatedBackend::new(node.nvml()));
    let (driver, _) = node.start_over(backend.clone(), None, Metrics::new()).unwrap();
    let interval = Duration::from_millis(200);
    let api = mocked_api(driver.gpus(), interval);
    let leases = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut handle = api.handle;
    let server = {
        let leases = leases.clone();
        tokio::spawn(async move {
            while let Some((request, send)) = handle.next_request().await {
                let path = request.uri().path().to_string();
                if *request.method() == Method::PATCH && is_lease(&path) {
                    leases.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                send.send_response(json_response(&api_answer(&path)));
            }
        })
    };
    let renewals = || leases.load(std::sync::atomic::Ordering::SeqCst);
    wait_until("the Lease is renewed", || renewals() >= 2).await;

    let gate = backend.close();
    wait_until("NVML counts as answering nothing", || {
        driver.gpus().nvml_stuck().is_some()
    })
    .await;
    let paused_at = renewals();
    // Ten beats with no renewal (one may have been in flight when the call became overdue).
    tokio::time::sleep(interval * 10).await;
    assert!(renewals() <= paused_at + 1, "renewed while NVML answered nothing");

    drop(gate);
    wait_until("NVML answers again", || driver.gpus().nvml_stuck().is_none()).await;
    let resumed_from = renewals();
    wait_until("the Lease is renewed again", || renewals() > resumed_from).await;
    api.stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(20), api.task).await;
    server.abort();
}
