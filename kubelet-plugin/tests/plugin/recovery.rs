//! Recovery never blocks serving: a half-prepared claim whose teardown fails at start (NVML
//! failing on its GPU) leaves the start successful, the record untouched, that GPU alone
//! unhealthy and refusing prepares, and is repaired later by the background repair (or by
//! the kubelet's unprepare), which restores the GPU's health.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::{sync::Arc, time::Duration};

use dra_kubelet::DeviceHealthReport;
use migdra_fake_nvml::{
    FaultState,
    config::{FakeConfig, FaultConfig, GpuConfig},
};
use migdra_kubelet_plugin::{
    checkpoint::ClaimState,
    driver::{Backoff, ClaimFailure, RecoveryReport, Step, StepHook},
    metrics::Metrics,
    plan::Rejection,
};
use migdra_testkit::plugin::*;

const STUCK: &str = "gpu-0-mig-3g40gb-4";
const OTHER_GPU: &str = "gpu-1-mig-3g40gb-4";
const SAME_GPU: &str = "gpu-0-mig-1g10gb-0";
const UNKNOWN: u32 = migdra_fake_nvml::code::UNKNOWN;

fn node() -> Node {
    let node = Node::with_config(FakeConfig {
        gpus: vec![
            GpuConfig::new("H100-80GB", true),
            GpuConfig::new("H100-80GB", true),
        ],
        ..FakeConfig::default()
    });
    node.claims.put(claim("uid-1", "c1", &[("gpu", STUCK)]));
    node.claims.put(claim("uid-2", "c2", &[("gpu", OTHER_GPU)]));
    node.claims.put(claim("uid-3", "c3", &[("gpu", SAME_GPU)]));
    node
}

/// Leaves claim uid-1 half prepared (its instance created and recorded, then a crash), and
/// makes destroying a GPU instance on GPU 0 fail the next `failures` times.
async fn half_prepared_with_failing_teardown(node: &Node, failures: u32) {
    {
        let hook: StepHook = Arc::new(|_uid, step| {
            if step == Step::DeviceRecorded {
                panic!("injected crash after the device was recorded");
            }
        });
        let (driver, _) = node.start(Some(hook));
        assert!(prepare_one(&driver, "uid-1", "c1").await.is_err());
    }
    assert_eq!(node.instances(0).len(), 1, "the crash left the instance behind");
    node.host
        .update_state(|s| {
            s.faults.push(FaultState {
                fault: FaultConfig::error("nvmlGpuInstanceDestroy", UNKNOWN)
                    .on_gpu(0)
                    .times(failures),
                hits: 0,
            })
        })
        .unwrap();
}

fn start_with_pending(node: &Node, metrics: Metrics) -> (TestDriver, RecoveryReport) {
    let (driver, report) = node
        .try_start_with(None, metrics)
        .expect("an unrepairable record must not fail the start");
    assert!(report.rolled_back.is_empty(), "{report:?}");
    assert_eq!(report.pending.len(), 1, "{report:?}");
    let pending = &report.pending[0];
    assert_eq!(pending.uid, "uid-1");
    assert_eq!(pending.claim, "default/c1");
    assert_eq!(pending.minors.iter().copied().collect::<Vec<_>>(), [0]);
    assert!(pending.error.contains("GPU instance"), "{}", pending.error);
    (driver, report)
}

/// The device-health reports of GPU `minor` (whole and its placements).
fn health_of(reports: &[DeviceHealthReport], minor: u32) -> Vec<&DeviceHealthReport> {
    let whole = format!("gpu-{minor}");
    let prefix = format!("gpu-{minor}-");
    let of: Vec<_> = reports
        .iter()
        .filter(|r| r.device_name == whole || r.device_name.starts_with(&prefix))
        .collect();
    assert!(of.len() > 1, "GPU {minor} has whole and MIG devices: {reports:?}");
    of
}

/// Asserts GPU 0's health (pending recovery or not) and that GPU 1 stays healthy.
fn assert_gpu0_health(driver: &TestDriver, recovery_pending: bool) {
    let inventory = driver.gpus().inventory().unwrap();
    let gpu0 = inventory.iter().find(|g| g.minor == 0).unwrap();
    let gpu1 = inventory.iter().find(|g| g.minor == 1).unwrap();
    assert!(gpu1.health.healthy, "{:?}", gpu1.health);
    let reports = driver.gpus().device_health(&inventory);
    assert!(health_of(&reports, 1).iter().all(|r| r.healthy == Some(true)));
    if recovery_pending {
        assert!(!gpu0.health.healthy);
        let reason = gpu0.health.reason.clone().unwrap_or_default();
        assert!(
            reason.starts_with("recovery of claim default/c1 pending: "),
            "{reason}"
        );
        for report in health_of(&reports, 0) {
            assert_eq!(report.healthy, Some(false), "{report:?}");
            assert_eq!(report.message, reason);
        }
    } else {
        assert!(gpu0.health.healthy, "{:?}", gpu0.health);
        assert!(health_of(&reports, 0).iter().all(|r| r.healthy == Some(true)));
    }
}

fn metric(metrics: &Metrics, line: &str) -> bool {
    metrics.encode().lines().any(|l| l == line)
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unrepairable_record_keeps_only_its_gpu_out_until_the_repair_succeeds() {
    let node = node();
    // One failure at start, one on the first background retry.
    half_prepared_with_failing_teardown(&node, 2).await;
    let metrics = Metrics::new();
    let (driver, _) = start_with_pending(&node, metrics.clone());

    // The record is kept as it was, and so is its instance.
    let recorded = driver.recorded_claims();
    assert_eq!(recorded["uid-1"].state, ClaimState::PrepareStarted);
    assert_eq!(node.instances(0).len(), 1);
    assert_gpu0_health(&driver, true);
    assert!(metric(&metrics, "migdra_kubelet_plugin_pending_repairs 1"));
    assert!(metric(
        &metrics,
        r#"migdra_kubelet_plugin_repair_attempts_total{outcome="failed"} 1"#
    ));

    // The other GPU serves; the affected one refuses, creating nothing.
    assert_eq!(prepare_one(&driver, "uid-2", "c2").await.unwrap().len(), 1);
    assert_eq!(node.instances(1).len(), 1);
    let err = prepare_typed(&driver, "uid-3", "c3").await.unwrap_err();
    assert!(
        matches!(&err, ClaimFailure::Rejected(Rejection::GpuRecoveryPending { minor: 0, claim, device, .. })
            if claim == "default/c1" && device == SAME_GPU),
        "{err}"
    );
    assert_eq!(err.reason(), "GpuRecoveryPending");
    assert_eq!(node.instances(0).len(), 1, "nothing created on GPU 0");
    assert!(!driver.recorded_claims().contains_key("uid-3"));

    // First retry: NVML still fails; the record stays pending.
    let round = driver.retry_pending_repairs().unwrap();
    assert!(round.completed.is_empty(), "{round:?}");
    assert_eq!(round.pending.len(), 1);
    assert_eq!(
        driver.recorded_claims()["uid-1"].state,
        ClaimState::PrepareStarted
    );
    assert_gpu0_health(&driver, true);

    // The fault is spent: the retry rolls the claim back and the GPU is healthy again.
    let round = driver.retry_pending_repairs().unwrap();
    assert_eq!(
        round.completed.iter().map(|p| p.uid.as_str()).collect::<Vec<_>>(),
        ["uid-1"]
    );
    assert!(round.pending.is_empty());
    assert!(driver.pending_repairs().is_empty());
    assert!(!driver.recorded_claims().contains_key("uid-1"));
    assert!(node.instances(0).is_empty(), "{:?}", node.instances(0));
    assert_gpu0_health(&driver, false);
    assert!(metric(&metrics, "migdra_kubelet_plugin_pending_repairs 0"));
    assert!(metric(
        &metrics,
        r#"migdra_kubelet_plugin_repair_attempts_total{outcome="failed"} 2"#
    ));
    assert!(metric(
        &metrics,
        r#"migdra_kubelet_plugin_repair_attempts_total{outcome="repaired"} 1"#
    ));

    // GPU 0 serves again.
    assert_eq!(prepare_one(&driver, "uid-3", "c3").await.unwrap().len(), 1);
    assert_eq!(node.instances(0).len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_background_loop_retries_with_backoff_and_reports_completion() {
    let node = node();
    // One failure at start, two in the loop, then success.
    half_prepared_with_failing_teardown(&node, 3).await;
    let (driver, report) = start_with_pending(&node, Metrics::new());
    let warning = migdra_kubelet_plugin::driver::RecoveryEvent::pending(&report).unwrap();
    assert_eq!(warning.reason, "RecoveryPending");
    assert!(warning.note.contains("claim default/c1"), "{}", warning.note);

    let (events_tx, mut events_rx) = tokio::sync::mpsc::unbounded_channel();
    let backoff = Backoff {
        initial: Duration::from_millis(1),
        max: Duration::from_millis(4),
    };
    let shutdown = tokio_util::sync::CancellationToken::new();
    // The loop ends by itself once nothing is pending; the timeout only guards a hang.
    tokio::time::timeout(
        Duration::from_secs(60),
        driver.clone().run_repair_loop(backoff, events_tx, shutdown),
    )
    .await
    .expect("the repair loop finishes once the faults stop");

    let fault_hits = node.host.read_state().unwrap().faults[0].hits;
    assert_eq!(fault_hits, 3, "start and two background attempts failed");
    let event = events_rx.try_recv().expect("a completion event");
    assert_eq!(event.reason, "RecoveryCompleted");
    assert_eq!(event.type_, kube::runtime::events::EventType::Normal);
    assert!(event.note.contains("default/c1"), "{}", event.note);
    assert!(events_rx.try_recv().is_err(), "one event per repaired record");
    assert!(driver.recorded_claims().is_empty());
    assert!(node.instances(0).is_empty());
    assert_gpu0_health(&driver, false);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_kubelets_unprepare_of_a_pending_claim_ends_the_pending_repair() {
    let node = node();
    half_prepared_with_failing_teardown(&node, 1).await;
    let (driver, _) = start_with_pending(&node, Metrics::new());
    assert_gpu0_health(&driver, true);

    unprepare_one(&driver, "uid-1", "c1").await.unwrap();
    assert!(driver.pending_repairs().is_empty());
    assert!(driver.recorded_claims().is_empty());
    assert!(node.instances(0).is_empty());
    assert_gpu0_health(&driver, false);
    // Nothing left for the background repair.
    let round = driver.retry_pending_repairs().unwrap();
    assert!(
        round.completed.is_empty() && round.pending.is_empty(),
        "{round:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_shutdown_token_ends_the_repair_loop() {
    let node = node();
    // Never stops failing.
    half_prepared_with_failing_teardown(&node, u32::MAX).await;
    let (driver, _) = start_with_pending(&node, Metrics::new());
    let (events_tx, mut events_rx) = tokio::sync::mpsc::unbounded_channel();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(driver.clone().run_repair_loop(
        Backoff {
            initial: Duration::from_millis(1),
            max: Duration::from_millis(2),
        },
        events_tx,
        shutdown.clone(),
    ));
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(60), task)
        .await
        .expect("the loop stops on shutdown")
        .unwrap();
    assert!(events_rx.try_recv().is_err(), "nothing was repaired");
    assert_eq!(driver.pending_repairs().len(), 1);
    assert_eq!(
        driver.recorded_claims()["uid-1"].state,
        ClaimState::PrepareStarted
    );
}
