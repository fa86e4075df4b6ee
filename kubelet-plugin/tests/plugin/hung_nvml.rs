//! An NVML call that hangs (the fake's latency fault held for minutes, then removed) never
//! wedges the node: it fails its own claim after the call timeout, marks only its GPU
//! unhealthy, holds no lock another GPU's claims need, and what it did is repaired once it
//! returns.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::time::Duration;

use migdra_fake_nvml::{FaultState, config::FaultConfig};
use migdra_testkit::plugin::*;

const CREATE_GI: &str = "nvmlDeviceCreateGpuInstanceWithPlacement";
/// Ten minutes: longer than any test waits, so only removing the fault ends the call.
const HANG_MS: u64 = 600_000;

fn hang(node: &Node, function: &str, gpu: u32) {
    node.host
        .update_state(|s| {
            s.faults.push(FaultState {
                fault: FaultConfig::latency(function, HANG_MS).on_gpu(gpu),
                hits: 0,
            })
        })
        .unwrap();
}

/// Ends every held call: the fault goes, the waiting call runs.
fn release(node: &Node) {
    node.host.update_state(|s| s.faults.clear()).unwrap();
}

fn hits(node: &Node) -> u32 {
    node.host
        .read_state()
        .unwrap()
        .faults
        .iter()
        .map(|f| f.hits)
        .sum()
}

/// Two H100s; `a` wants a 1g.10gb on GPU 0, `b` one on GPU 1.
fn node(timeout: Duration) -> Node {
    let mut node = Node::new(&[("H100-80GB", true), ("H100-80GB", true)]);
    node.nvml_call_timeout = timeout;
    node.claims
        .put(claim("ua", "a", &[("gpu", "gpu-0-mig-1g10gb-0")]));
    node.claims
        .put(claim("ub", "b", &[("gpu", "gpu-1-mig-1g10gb-0")]));
    node
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hung_create_fails_its_claim_alone_and_is_repaired_when_it_returns() {
    let node = node(Duration::from_secs(15));
    let (driver, _) = node.start(None);
    hang(&node, CREATE_GI, 0);

    let stuck = tokio::spawn({
        let driver = driver.clone();
        async move { prepare_typed(&driver, "ua", "a").await }
    });
    wait_until("the create on GPU 0 is held", || hits(&node) == 1).await;
    // GPU 1's claim prepares and unprepares while GPU 0's create is still inside NVML (the
    // fault is still there) and its caller still waits for it.
    prepare_typed(&driver, "ub", "b")
        .await
        .expect("GPU 1 serves while GPU 0 hangs");
    assert!(
        !stuck.is_finished(),
        "the held call's caller returned before its timeout"
    );
    unprepare_typed(&driver, "ub", "b").await.unwrap();
    assert!(node.instances(1).is_empty());

    // After the timeout the claim fails, saying NVML does not answer.
    let failure = stuck.await.unwrap().expect_err("the claim on the hung GPU fails");
    let message = failure.to_string();
    assert!(message.contains("NVML is not answering"), "{message}");
    assert_eq!(driver.gpus().nvml_calls().overdue().len(), 1);
    // Only GPU 0 is unhealthy, with the reason; the node is still offered.
    let inventory = driver.gpus().inventory().unwrap();
    assert!(!inventory[0].health.healthy);
    let reason = inventory[0].health.reason.clone().unwrap_or_default();
    assert!(reason.contains("NVML is not answering"), "{reason}");
    assert!(inventory[1].health.healthy, "{:?}", inventory[1].health);
    assert_eq!(driver.gpus().nvml_stuck(), None);
    // The kubelet's retry fails the same way without another call into NVML.
    let retried = prepare_typed(&driver, "ua", "a").await.expect_err("still hung");
    assert!(retried.to_string().contains("NVML is not answering"), "{retried}");
    assert_eq!(hits(&node), 1, "a call was made on the hung GPU");
    prepare_typed(&driver, "ub", "b")
        .await
        .expect("GPU 1 still serves");

    // The call returns and creates its instance after all; nobody waits for it any more.
    release(&node);
    wait_until("the held call returned", || {
        driver.gpus().nvml_calls().overdue().is_empty()
    })
    .await;
    wait_until("its instance exists", || node.instances(0).len() == 1).await;
    let repaired = driver.reconcile_after_overdue().unwrap();
    assert_eq!(repaired.len(), 1, "{repaired:?}");
    assert!(node.instances(0).is_empty(), "the late instance was destroyed");
    assert!(!driver.recorded_claims().contains_key("ua"));
    let inventory = driver.gpus().inventory().unwrap();
    assert!(inventory[0].health.healthy, "{:?}", inventory[0].health);
    // And the claim prepares normally now.
    prepare_typed(&driver, "ua", "a").await.unwrap();
    assert_eq!(node.instances(0).len(), 1);
    assert_eq!(node.instances(1).len(), 1, "GPU 1's claim kept its instance");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hung_destroy_leaves_the_claim_recorded_and_the_retry_finishes_it() {
    let node = node(Duration::from_secs(2));
    let (driver, _) = node.start(None);
    prepare_typed(&driver, "ua", "a").await.unwrap();
    hang(&node, "nvmlGpuInstanceDestroy", 0);
    let failure = unprepare_typed(&driver, "ua", "a")
        .await
        .expect_err("the destroy hangs");
    assert!(failure.to_string().contains("NVML is not answering"), "{failure}");
    assert_eq!(failure.reason(), "NvmlNotAnswering");
    assert!(
        driver.recorded_claims().contains_key("ua"),
        "the record stays until its instance is gone"
    );
    release(&node);
    wait_until("the held destroy returned", || {
        driver.gpus().nvml_calls().overdue().is_empty()
    })
    .await;
    // Whether the reconciliation or the kubelet's retry gets there first, the claim ends
    // with no instance and no record.
    unprepare_typed(&driver, "ua", "a").await.unwrap();
    assert!(node.instances(0).is_empty());
    assert!(driver.recorded_claims().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn calls_overdue_on_every_gpu_mean_the_node_answers_nothing() {
    let node = node(Duration::from_secs(1));
    let (driver, _) = node.start(None);
    for gpu in [0, 1] {
        hang(&node, CREATE_GI, gpu);
    }
    let (a, b) = tokio::join!(
        prepare_typed(&driver, "ua", "a"),
        prepare_typed(&driver, "ub", "b")
    );
    assert!(a.is_err() && b.is_err(), "{a:?} {b:?}");
    let stuck = driver.gpus().nvml_stuck().expect("no GPU answers");
    assert!(
        stuck.contains("GPU index 0") && stuck.contains("GPU index 1"),
        "{stuck}"
    );
    let inventory = driver.gpus().inventory().unwrap();
    assert!(inventory.iter().all(|g| !g.health.healthy), "{inventory:?}");

    release(&node);
    wait_until("both creates returned", || {
        driver.gpus().nvml_calls().overdue().is_empty()
    })
    .await;
    assert_eq!(driver.gpus().nvml_stuck(), None);
    driver.reconcile_after_overdue().unwrap();
    assert_eq!(node.total_instances(), 0);
    let inventory = driver.gpus().inventory().unwrap();
    assert!(inventory.iter().all(|g| g.health.healthy), "{inventory:?}");
}

/// The orphan list's entries, as the file has them.
fn listed_orphans(node: &Node) -> Vec<serde_json::Value> {
    let path = node
        .state_dir()
        .join(migdra_kubelet_plugin::orphans::ORPHANS_FILE);
    let text = std::fs::read_to_string(path).unwrap_or_else(|_| r#"{"orphans":[]}"#.into());
    let file: serde_json::Value = serde_json::from_str(&text).unwrap();
    file["orphans"].as_array().cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_create_that_returns_after_its_plugin_was_replaced_is_destroyed() {
    let mut node = Node::two_h100s_with_a_foreign_1g();
    node.nvml_call_timeout = Duration::from_secs(2);
    node.claims
        .put(claim("ua", "a", &[("gpu", "gpu-0-mig-1g10gb-0")]));
    let (old, _) = node.start(None);
    hang(&node, CREATE_GI, 0);
    let failure = prepare_typed(&old, "ua", "a")
        .await
        .expect_err("the create on GPU 0 hangs past the bound");
    assert!(failure.to_string().contains("NVML is not answering"), "{failure}");
    // The old plugin could not roll back on the hung GPU: the half-prepared record stays.
    assert!(old.recorded_claims().contains_key("ua"));
    drop(old);

    // Its replacement (a new process: it does not know the old one's call is still inside
    // NVML) rolls the record back, and watches the placement instead of forgetting it.
    let (new, report) = node.start(None);
    assert_eq!(report.rolled_back, ["ua"]);
    assert!(!new.recorded_claims().contains_key("ua"));
    let watched = listed_orphans(&node);
    assert_eq!(watched.len(), 1, "{watched:?}");
    assert_eq!(watched[0]["device"], "gpu-0-mig-1g10gb-0");
    assert!(watched[0]["awaitedUntil"].is_u64(), "{watched:?}");
    // While nothing appears, the watch stays through inventory passes.
    new.gpus().inventory().unwrap();
    assert_eq!(listed_orphans(&node).len(), 1);
    assert_eq!(node.instances(0).len(), 1, "only the foreign instance");

    // The old call returns and creates its instance, with no record anywhere.
    release(&node);
    wait_until("the late instance exists", || node.instances(0).len() == 2).await;
    new.gpus().inventory().unwrap();
    let left: Vec<(u32, u32)> = node.instances(0).iter().map(|(p, s, _)| (*p, *s)).collect();
    assert_eq!(
        left,
        [(19, 6)],
        "the late instance is destroyed, the foreign one kept"
    );
    assert!(
        listed_orphans(&node).is_empty(),
        "the watch ends with the destroy"
    );
    // The placement serves the claim again.
    prepare_typed(&new, "ua", "a").await.unwrap();
    assert_eq!(node.instances(0).len(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_create_is_not_watched() {
    let node = node(Duration::from_secs(15));
    let (driver, _) = node.start(None);
    node.host
        .update_state(|s| {
            s.faults.push(FaultState {
                fault: FaultConfig::error(CREATE_GI, 23).on_gpu(0),
                hits: 0,
            })
        })
        .unwrap();
    prepare_typed(&driver, "ua", "a")
        .await
        .expect_err("the create fails");
    assert!(!driver.recorded_claims().contains_key("ua"));
    assert!(
        listed_orphans(&node).is_empty(),
        "a create that returned an error leaves nothing to watch"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_create_held_across_a_reboot_creates_nothing() {
    // Ampere keeps MIG mode across the reload, so the create could still succeed after it.
    let mut node = Node::new(&[("A100-80GB", true)]);
    node.nvml_call_timeout = Duration::from_secs(1);
    node.claims
        .put(claim("ua", "a", &[("gpu", "gpu-0-mig-1g10gb-0")]));
    let (driver, _) = node.start(None);
    hang(&node, CREATE_GI, 0);
    prepare_typed(&driver, "ua", "a")
        .await
        .expect_err("the create hangs past the bound");
    assert_eq!(driver.gpus().nvml_calls().overdue().len(), 1);
    // The node reboots while the call is inside the driver; on a node the reboot ends the
    // call with its process, so it must not act on the new boot's GPUs when let go.
    node.host.update_state(|s| s.reload_driver()).unwrap();
    release(&node);
    wait_until("the held call returned", || {
        driver.gpus().nvml_calls().overdue().is_empty()
    })
    .await;
    assert!(node.instances(0).is_empty(), "{:?}", node.instances(0));
}
