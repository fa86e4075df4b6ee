//! Stale claims are garbage-collected: a recorded claim whose ResourceClaim was deleted,
//! replaced or re-allocated elsewhere is released (instance destroyed, CDI spec and record
//! gone) at the next pass; a claim the API server cannot be asked about, one still allocated
//! here, and one being prepared are never touched.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::{
    sync::{Arc, Mutex, OnceLock},
    time::Duration,
};

use migdra_kubelet_plugin::{
    driver::{RecoveryEvent, StaleCause, Step, StepHook},
    metrics::Metrics,
};
use migdra_testkit::plugin::*;
use serde_json::json;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

const DEVICE: &str = "gpu-0-mig-3g40gb-4";

/// A node with one prepared claim (u1 = default/c1) and the driver that prepared it.
async fn prepared(metrics: Metrics) -> (Node, TestDriver) {
    let node = Node::new(&[("H100-80GB", true)]);
    let (driver, _) = node.try_start_with(None, metrics).unwrap();
    node.claims.put(claim("u1", "c1", &[("gpu", DEVICE)]));
    prepare_one(&driver, "u1", "c1").await.unwrap();
    assert_eq!(node.instances(0).len(), 1);
    assert_eq!(node.cdi_specs().len(), 1);
    (node, driver)
}

fn assert_released(node: &Node, driver: &TestDriver) {
    assert!(node.instances(0).is_empty(), "the instance was destroyed");
    assert!(node.cdi_specs().is_empty(), "the CDI spec was removed");
    assert!(driver.recorded_claims().is_empty(), "the record was forgotten");
}

fn assert_untouched(node: &Node, driver: &TestDriver) {
    assert_eq!(node.instances(0).len(), 1, "the instance is still there");
    assert!(node.cdi().spec_path("u1").exists(), "the CDI spec is still there");
    assert!(driver.recorded_claims().contains_key("u1"), "the record is kept");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deleted_claim_is_released_at_the_next_pass() {
    let metrics = Metrics::new();
    let (node, driver) = prepared(metrics.clone()).await;
    node.claims.remove("default", "c1");
    let round = driver.collect_stale_claims().await;
    assert_eq!(round.released.len(), 1, "{round:?}");
    assert_eq!(round.released[0].uid, "u1");
    assert_eq!(round.released[0].claim, "default/c1");
    assert_eq!(round.released[0].cause, StaleCause::NotFound);
    assert_released(&node, &driver);
    let text = metrics.encode();
    assert!(
        text.contains(r#"migdra_kubelet_plugin_stale_claims_released_total{reason="ClaimNotFound"} 1"#),
        "{text}"
    );
    let event = RecoveryEvent::stale_released(&round.released[0]);
    assert_eq!(event.reason, "StaleClaimReleased");
    assert!(event.note.contains("default/c1"), "{}", event.note);

    // The placement is free again for a new claim.
    node.claims.put(claim("u2", "c2", &[("gpu", DEVICE)]));
    prepare_one(&driver, "u2", "c2").await.unwrap();
    // A second pass finds nothing stale.
    assert!(driver.collect_stale_claims().await.released.is_empty());
    assert_eq!(node.instances(0).len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_replaced_under_the_same_name_is_released() {
    let (node, driver) = prepared(Metrics::new()).await;
    node.claims.put(claim("u1-new", "c1", &[("gpu", DEVICE)]));
    let round = driver.collect_stale_claims().await;
    assert_eq!(round.released.len(), 1, "{round:?}");
    assert_eq!(
        round.released[0].cause,
        StaleCause::Replaced {
            current_uid: "u1-new".into()
        }
    );
    assert_released(&node, &driver);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_allocated_from_another_pool_is_released() {
    let (node, driver) = prepared(Metrics::new()).await;
    node.claims.put(claim_with(
        "u1",
        "c1",
        "node-b/gpu.migdra.dev",
        &[("gpu", DEVICE)],
        json!([]),
    ));
    let round = driver.collect_stale_claims().await;
    assert_eq!(round.released.len(), 1, "{round:?}");
    assert_eq!(round.released[0].cause, StaleCause::NotAllocatedHere);
    assert_released(&node, &driver);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_api_error_touches_nothing() {
    let metrics = Metrics::new();
    let (node, driver) = prepared(metrics.clone()).await;
    // Deleted, but the API server cannot be asked: nothing proves it is gone.
    node.claims.remove("default", "c1");
    node.claims.set_unreachable(true);
    let round = driver.collect_stale_claims().await;
    assert!(round.released.is_empty(), "{round:?}");
    assert_eq!(round.unknown, ["u1"]);
    assert_untouched(&node, &driver);
    assert!(!metrics.encode().contains("stale_claims_released_total{"));

    // Once the API server answers, it is released.
    node.claims.set_unreachable(false);
    assert_eq!(driver.collect_stale_claims().await.released.len(), 1);
    assert_released(&node, &driver);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_still_allocated_here_is_untouched() {
    let (node, driver) = prepared(Metrics::new()).await;
    let round = driver.collect_stale_claims().await;
    assert!(round.released.is_empty(), "{round:?}");
    assert!(round.unknown.is_empty(), "{round:?}");
    assert_untouched(&node, &driver);
    // And the kubelet can still unprepare it normally.
    unprepare_one(&driver, "u1", "c1").await.unwrap();
    assert_released(&node, &driver);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_being_prepared_is_never_collected() {
    let node = Node::new(&[("H100-80GB", true)]);
    node.claims.put(claim("u1", "c1", &[("gpu", DEVICE)]));
    let runtime = tokio::runtime::Handle::current();
    let slot: Arc<OnceLock<TestDriver>> = Arc::new(OnceLock::new());
    let released_mid_prepare: Arc<Mutex<Vec<usize>>> = Arc::default();
    let hook: StepHook = {
        let (slot, seen, claims) = (slot.clone(), released_mid_prepare.clone(), node.claims.clone());
        Arc::new(move |_uid, step| {
            if step != Step::GpuInstanceCreated {
                return;
            }
            // Mid-prepare (PrepareStarted recorded, the instance created) the claim vanishes
            // from the API server and a GC pass runs.
            claims.remove("default", "c1");
            let driver = slot.get().unwrap().clone();
            let round = runtime.block_on(driver.collect_stale_claims());
            seen.lock().unwrap().push(round.released.len());
        })
    };
    let (driver, _) = node.start(Some(hook));
    let _ = slot.set(driver.clone());
    prepare_one(&driver, "u1", "c1").await.unwrap();
    assert_eq!(
        *released_mid_prepare.lock().unwrap(),
        [0],
        "the pass during prepare released nothing"
    );
    assert_untouched(&node, &driver);
    // Once prepared, the next pass sees it is gone.
    assert_eq!(driver.collect_stale_claims().await.released.len(), 1);
    assert_released(&node, &driver);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_periodic_task_releases_and_stops_at_shutdown() {
    let (node, driver) = prepared(Metrics::new()).await;
    let (events_tx, mut events_rx) = mpsc::unbounded_channel();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(driver.clone().run_stale_claim_gc(
        Duration::from_millis(10),
        events_tx,
        shutdown.clone(),
    ));
    // The claim is deleted after the first pass may have run: a later pass releases it.
    node.claims.remove("default", "c1");
    let event = tokio::time::timeout(Duration::from_secs(30), events_rx.recv())
        .await
        .expect("a pass released the claim")
        .expect("an event");
    assert_eq!(event.reason, "StaleClaimReleased");
    assert!(event.note.contains("default/c1"), "{}", event.note);
    assert_released(&node, &driver);
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the task ends at shutdown")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_zero_interval_disables_the_collection() {
    let (node, driver) = prepared(Metrics::new()).await;
    node.claims.remove("default", "c1");
    let (events_tx, _events_rx) = mpsc::unbounded_channel();
    driver
        .clone()
        .run_stale_claim_gc(Duration::ZERO, events_tx, CancellationToken::new())
        .await;
    assert_untouched(&node, &driver);
}

/// A node whose claim c1 (u1) a second plugin instance began to prepare and died at, after
/// recording the device; returns the node and the instance that keeps serving.
async fn half_prepared_by_a_dead_instance() -> (Node, TestDriver) {
    let node = Node::new(&[("H100-80GB", true)]);
    node.claims.put(claim("u1", "c1", &[("gpu", DEVICE)]));
    let (driver, _) = node.start(None);
    let hook: StepHook = Arc::new(|_uid, step| {
        if step == Step::DeviceRecorded {
            panic!("injected crash after the device was recorded");
        }
    });
    let (old, _) = node.start(Some(hook));
    assert!(prepare_one(&old, "u1", "c1").await.is_err());
    (node, driver)
}

/// A plugin instance that dies mid-prepare while another one
/// serves (a rolling update) leaves a half-prepared record that no recovery will see. Once
/// its claim is gone no kubelet retries it either, so the collection rolls it back, instance
/// included; it can tell that nothing is preparing it, since every prepare holds the node lock.
#[tokio::test(flavor = "multi_thread")]
async fn a_half_prepared_record_of_a_deleted_claim_is_rolled_back() {
    let (node, driver) = half_prepared_by_a_dead_instance().await;
    assert_eq!(node.instances(0).len(), 1, "the dead instance left its instance");
    node.claims.remove("default", "c1");

    let round = driver.collect_stale_claims().await;
    assert_eq!(round.released.len(), 1, "{round:?}");
    assert_eq!(round.released[0].cause, StaleCause::NotFound);
    assert_released(&node, &driver);
}

/// A half-prepared record whose claim still exists is the kubelet's to retry: left alone.
#[tokio::test(flavor = "multi_thread")]
async fn a_half_prepared_record_of_a_live_claim_is_left_to_the_kubelet() {
    let (node, driver) = half_prepared_by_a_dead_instance().await;
    let round = driver.collect_stale_claims().await;
    assert!(round.released.is_empty(), "{round:?}");
    assert_eq!(node.instances(0).len(), 1);
    // The kubelet's retry rolls it back and prepares afresh.
    prepare_one(&driver, "u1", "c1").await.unwrap();
    assert_untouched(&node, &driver);
}

/// An `adminAccess` claim has no record, only its CDI spec: when its pod is deleted without an
/// unprepare, the pass removes the spec once the claim is gone or replaced, and keeps it while
/// the claim exists or cannot be asked about.
#[tokio::test(flavor = "multi_thread")]
async fn a_deleted_admin_access_claims_spec_is_removed_at_the_next_pass() {
    let node = Node::new(&[("H100-80GB", true), ("H100-80GB", true)]);
    let (driver, _) = node.start(None);
    node.claims
        .put(admin_claim("ua", "watch-a", &[("monitor", "gpu-0")]));
    node.claims
        .put(admin_claim("ub", "watch-b", &[("monitor", "gpu-1")]));
    prepare_one(&driver, "ua", "watch-a").await.unwrap();
    prepare_one(&driver, "ub", "watch-b").await.unwrap();
    assert!(driver.recorded_claims().is_empty(), "adminAccess records nothing");

    node.claims.set_unreachable(true);
    node.claims.remove("default", "watch-a");
    let round = driver.collect_stale_claims().await;
    assert!(round.released.is_empty(), "{round:?}");
    assert_eq!(round.unknown, ["ua", "ub"]);
    assert!(
        node.cdi().spec_path("ua").exists(),
        "kept while the API cannot be asked"
    );

    node.claims.set_unreachable(false);
    let round = driver.collect_stale_claims().await;
    assert_eq!(round.released.len(), 1, "{round:?}");
    assert_eq!(round.released[0].uid, "ua");
    assert_eq!(round.released[0].claim, "default/watch-a");
    assert_eq!(round.released[0].cause, StaleCause::NotFound);
    assert!(
        !node.cdi().spec_path("ua").exists(),
        "the gone claim's spec was removed"
    );
    assert!(
        node.cdi().spec_path("ub").exists(),
        "the existing claim's spec stays"
    );

    // Replaced under the same name: the old UID's spec goes.
    node.claims
        .put(admin_claim("ub-2", "watch-b", &[("monitor", "gpu-1")]));
    let round = driver.collect_stale_claims().await;
    assert_eq!(
        round.released.iter().map(|r| r.cause.clone()).collect::<Vec<_>>(),
        [StaleCause::Replaced {
            current_uid: "ub-2".into()
        }]
    );
    assert!(node.cdi_specs().is_empty());
}
