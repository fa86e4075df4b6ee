//! Rolling update: two plugin instances (two `Driver`s, as an old and a new plugin pod) on one
//! node, sharing its state dir, checkpoint, node lock and GPUs. Each works under the node lock
//! and re-reads the checkpoint the other may have changed, so they hand out the same answers
//! and never create anything twice.
#![allow(clippy::unwrap_used)]

use std::{
    sync::{Arc, Mutex, mpsc},
    time::Duration,
};

use migdra_kubelet_plugin::{
    checkpoint::ClaimState,
    driver::{ClaimFailure, NodeAccessError, Step, StepHook},
    state_dir::NodeLockError,
};
use migdra_testkit::plugin::*;

const SMALL_0: &str = "gpu-0-mig-1g10gb-0";
const SMALL_1: &str = "gpu-0-mig-1g10gb-1";
const HALF_1: &str = "gpu-1-mig-3g40gb-4";
const SMALL_1_0: &str = "gpu-1-mig-1g10gb-0";

fn two_gpus() -> Node {
    Node::new(&[("H100-80GB", true), ("H100-80GB", true)])
}

/// The MIG UUIDs a prepared claim's CDI spec hands out.
fn handed_out_uuids(node: &Node, uid: &str) -> Vec<String> {
    let spec = node.cdi_spec(uid);
    spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|d| d["containerEdits"]["env"].as_array().unwrap().clone())
        .map(|e| e.as_str().unwrap().split_once('=').unwrap().1.to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_prepared_by_one_instance_is_prepared_for_the_other_which_can_unprepare_it() {
    let node = two_gpus();
    let (old, _) = node.start(None);
    let (new, _) = node.start(None);
    node.claims.put(claim("u1", "c1", &[("gpu", SMALL_0)]));

    let by_old = prepare_one(&old, "u1", "c1").await.unwrap();
    assert_eq!(node.total_instances(), 1);
    let uuids = handed_out_uuids(&node, "u1");

    // The new instance started before the prepare; it still knows the claim, answers it
    // identically and creates nothing — also when the API no longer has the claim (the
    // answer comes from the shared checkpoint).
    node.claims.remove("default", "c1");
    let by_new = prepare_one(&new, "u1", "c1").await.unwrap();
    assert_eq!(by_new, by_old);
    assert_eq!(node.total_instances(), 1, "the second instance created nothing");
    assert_eq!(handed_out_uuids(&node, "u1"), uuids);
    assert_eq!(new.recorded_claims()["u1"].state, ClaimState::PrepareCompleted);

    // The new instance unprepares what the old one created.
    unprepare_one(&new, "u1", "c1").await.unwrap();
    assert_eq!(node.total_instances(), 0);
    assert!(node.cdi_specs().is_empty());

    // The old instance sees it gone: its idempotent answer does not resurrect the claim from
    // its own earlier copy (the claim is gone from the API, so preparing again fails).
    let err = prepare_typed(&old, "u1", "c1").await.unwrap_err();
    assert!(matches!(err, ClaimFailure::Claim(_)), "{err}");
    assert!(old.recorded_claims().is_empty());
    assert_eq!(node.total_instances(), 0);
    unprepare_one(&old, "u1", "c1").await.unwrap();
    assert_eq!(node.total_instances(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn each_instance_writes_on_top_of_the_others_records() {
    let node = two_gpus();
    let (old, _) = node.start(None);
    let (new, _) = node.start(None);
    node.claims.put(claim("u1", "c1", &[("gpu", SMALL_0)]));
    node.claims.put(claim("u2", "c2", &[("gpu", HALF_1)]));

    prepare_one(&old, "u1", "c1").await.unwrap();
    prepare_one(&new, "u2", "c2").await.unwrap();
    // Had the new instance written from its stale copy, u1's record would be lost.
    for driver in [&old, &new] {
        let recorded = driver.recorded_claims();
        assert_eq!(recorded.keys().collect::<Vec<_>>(), ["u1", "u2"]);
    }
    // A third instance reads both from the file.
    let (third, report) = node.start(None);
    assert_eq!(third.recorded_claims().len(), 2);
    assert!(report.rolled_back.is_empty() && report.unprepared.is_empty());

    unprepare_one(&old, "u2", "c2").await.unwrap();
    unprepare_one(&new, "u1", "c1").await.unwrap();
    assert_eq!(node.total_instances(), 0);
    assert!(
        third.recorded_claims().is_empty(),
        "the third instance's view follows the file"
    );
    assert!(node.cdi_specs().is_empty());
    let (fourth, _) = node.start(None);
    assert!(
        fourth.recorded_claims().is_empty(),
        "{:?}",
        fourth.recorded_claims()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn interleaved_prepares_from_both_instances_never_create_twice() {
    let node = two_gpus();
    let (old, _) = node.start(None);
    let (new, _) = node.start(None);
    let claims = [
        ("u1", "c1", SMALL_0),
        ("u2", "c2", SMALL_1),
        ("u3", "c3", HALF_1),
        ("u4", "c4", SMALL_1_0),
    ];
    for (uid, name, device) in claims {
        node.claims.put(claim(uid, name, &[("gpu", device)]));
    }

    // Both instances are asked for every claim at once, in opposite orders.
    let forward: Vec<_> = claims.iter().map(|(u, n, _)| claim_ref(u, n)).collect();
    let backward: Vec<_> = forward.iter().rev().cloned().collect();
    let (by_old, by_new) = tokio::join!(old.prepare_claims(forward), new.prepare_claims(backward));

    assert_eq!(node.total_instances(), claims.len(), "one instance per claim");
    for (uid, _, _) in claims {
        let (a, b) = (by_old[uid].as_ref().unwrap(), by_new[uid].as_ref().unwrap());
        assert_eq!(a, b, "both instances hand out the same devices for {uid}");
        assert_eq!(handed_out_uuids(&node, uid).len(), 1);
    }
    let recorded = new.recorded_claims();
    assert_eq!(recorded.len(), claims.len());
    assert!(recorded.values().all(|r| r.state == ClaimState::PrepareCompleted));

    // And interleaved unprepares leave nothing.
    let all: Vec<_> = claims.iter().map(|(u, n, _)| claim_ref(u, n)).collect();
    let (a, b) = tokio::join!(old.unprepare_claims(all.clone()), new.unprepare_claims(all));
    assert!(a.values().chain(b.values()).all(Result::is_ok));
    assert_eq!(node.total_instances(), 0);
    assert!(node.cdi_specs().is_empty());
    assert!(old.recorded_claims().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn an_instance_waits_for_the_node_lock_the_other_holds_then_sees_its_work() {
    let node = two_gpus();
    // The old instance stops inside its prepare (holding the node lock) until released.
    let (holding_tx, holding_rx) = mpsc::channel::<()>();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let gate = Arc::new(Mutex::new(Some((holding_tx, release_rx))));
    let hook: StepHook = Arc::new(move |uid, step| {
        if uid == "u1"
            && step == Step::ComputeInstanceCreated
            && let Some((holding, release)) = gate.lock().unwrap().take()
        {
            holding.send(()).unwrap();
            release.recv().unwrap();
        }
    });
    let (old, _) = node.start(Some(hook));
    let (new, _) = node.start(None);
    node.claims.put(claim("u1", "c1", &[("gpu", SMALL_0)]));
    node.claims.put(claim("u2", "c2", &[("gpu", HALF_1)]));

    let old_prepare = {
        let old = old.clone();
        tokio::spawn(async move { prepare_one(&old, "u1", "c1").await })
    };
    tokio::task::spawn_blocking(move || holding_rx.recv_timeout(Duration::from_secs(20)))
        .await
        .unwrap()
        .expect("the old instance reached its prepare");

    // The new instance cannot take the node lock (its timeout is 2 s in these tests) — for
    // another claim on another GPU too, and for unprepare.
    let err = prepare_typed(&new, "u2", "c2").await.unwrap_err();
    assert!(
        matches!(err, ClaimFailure::NodeAccess(NodeAccessError::Lock(ref e)) if matches!(**e, NodeLockError::Held { .. })),
        "{err}"
    );
    let message = unprepare_one(&new, "u1", "c1").await.unwrap_err();
    assert!(
        message.contains("another plugin instance holds the node lock"),
        "{message}"
    );
    assert_eq!(
        node.total_instances(),
        1,
        "only the old instance's half-done prepare"
    );
    assert_eq!(new.recorded_claims()["u1"].state, ClaimState::PrepareStarted);

    release_tx.send(()).unwrap();
    let devices = old_prepare.await.unwrap().unwrap();

    // Now the new instance gets the lock, sees the old one's claim, and prepares its own.
    assert_eq!(prepare_one(&new, "u1", "c1").await.unwrap(), devices);
    prepare_one(&new, "u2", "c2").await.unwrap();
    assert_eq!(node.total_instances(), 2);
    assert_eq!(
        old.recorded_claims().len(),
        2,
        "the old instance's view follows the file"
    );
    unprepare_one(&old, "u2", "c2").await.unwrap();
    assert_eq!(node.total_instances(), 1);
    unprepare_one(&old, "u1", "c1").await.unwrap();
    assert_eq!(node.total_instances(), 0);
    assert!(new.recorded_claims().is_empty());
}
