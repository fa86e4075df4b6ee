//! A checkpoint record answers only for the allocation it was made for: a claim deallocated
//! and allocated other devices under the same UID while its unprepare was missed gets its new
//! devices, its old instances are destroyed (freeing their placements), and the claim gets a
//! `Reallocated` event. The stale-claim GC releases such a record too.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use migdra_kubelet_plugin::{checkpoint::ClaimState, driver::StaleCause};
use migdra_testkit::plugin::*;

/// Device A, where the claim is first allocated.
const A: &str = "gpu-0-mig-3g40gb-4";
/// Device B, on the other GPU, where the claim is allocated again.
const B: &str = "gpu-1-mig-3g40gb-0";
/// Another device on GPU 0, whose placement overlaps A's.
const A_OVERLAP: &str = "gpu-0-mig-2g20gb-4";

/// Two H100s with claim u1 (default/c1) prepared on A, then allocated B under the same UID
/// with no unprepare in between.
async fn reallocated_without_unprepare() -> (Node, TestDriver) {
    let node = Node::new(&[("H100-80GB", true), ("H100-80GB", true)]);
    let (driver, _) = node.start(None);
    node.claims.put(claim("u1", "c1", &[("gpu", A)]));
    prepare_one(&driver, "u1", "c1").await.unwrap();
    assert_eq!(node.instances(0).len(), 1);
    node.claims.put(claim("u1", "c1", &[("gpu", B)]));
    (node, driver)
}

fn spec_devices(node: &Node, uid: &str) -> Vec<String> {
    let spec = node.cdi_spec(uid);
    spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_allocated_other_devices_under_the_same_uid_gets_them_and_releases_the_old() {
    let (node, driver) = reallocated_without_unprepare().await;
    let mut events = record_claim_events(&driver);

    let devices = prepare_one(&driver, "u1", "c1").await.unwrap();
    assert_eq!(devices.len(), 1);
    assert_eq!(devices[0].device_name, B, "the new device, not the recorded one");
    assert!(node.instances(0).is_empty(), "A's instance was destroyed");
    let gpu1 = node.instances(1);
    assert_eq!(gpu1.len(), 1, "B's instance was created: {gpu1:?}");
    assert_eq!((gpu1[0].0, gpu1[0].1), (9, 0), "3g at memory slice 0");
    assert_eq!(node.cdi_specs().len(), 1);
    let names = spec_devices(&node, "u1");
    assert!(
        names.iter().all(|n| n.contains(B)),
        "the CDI spec names B only: {names:?}"
    );
    let env = node.cdi_spec("u1")["devices"][0]["containerEdits"]["env"][0]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        env,
        format!("MIGDRA_DEVICE_UUID_GPU_1_MIG_3G40GB_0={}", gpu1[0].2[0])
    );
    let record = &driver.recorded_claims()["u1"];
    assert_eq!(record.state, ClaimState::PrepareCompleted);
    assert_eq!(record.device_names(), [B]);

    let events = queued_events(&mut events);
    let reallocated: Vec<_> = events.iter().filter(|e| e.reason == "Reallocated").collect();
    assert_eq!(reallocated.len(), 1, "{events:?}");
    let event = reallocated[0];
    assert_eq!((event.name.as_str(), event.uid.as_str()), ("c1", "u1"));
    assert_eq!(event.action, "PrepareResourceClaim");
    assert!(event.note.contains(A) && event.note.contains(B), "{}", event.note);

    // The status names the new device only.
    status_written(&driver).await;
    let status = node.claims.device_status("c1").to_string();
    assert!(status.contains(B) && !status.contains(A), "{status}");

    // A's placement is free again: a claim overlapping it is prepared.
    node.claims.put(claim("u2", "c2", &[("gpu", A_OVERLAP)]));
    prepare_one(&driver, "u2", "c2").await.unwrap();
    assert_eq!(node.instances(0).len(), 1);

    // Prepared for B, the claim is answered from its record again, with no second event.
    let mut events = record_claim_events(&driver);
    assert_eq!(prepare_one(&driver, "u1", "c1").await.unwrap(), devices);
    assert_eq!(node.instances(1).len(), 1, "nothing re-created");
    assert!(queued_events(&mut events).is_empty());

    unprepare_one(&driver, "u1", "c1").await.unwrap();
    unprepare_one(&driver, "u2", "c2").await.unwrap();
    assert_eq!(node.total_instances(), 0);
    assert!(node.cdi_specs().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn the_answer_without_the_node_lock_is_not_the_earlier_allocation() {
    // Another plugin instance (a rolling update) prepared the claim: this one has its record
    // too and would answer from it without the node lock.
    let (node, old) = reallocated_without_unprepare().await;
    let (new, _) = node.start(None);
    assert!(new.recorded_claims().contains_key("u1"));
    let devices = prepare_one(&new, "u1", "c1").await.unwrap();
    assert_eq!(devices[0].device_name, B);
    assert!(node.instances(0).is_empty());
    assert_eq!(node.instances(1).len(), 1);
    // The instance that prepared A does not answer with A either.
    let devices = prepare_one(&old, "u1", "c1").await.unwrap();
    assert_eq!(devices[0].device_name, B);
    assert_eq!(node.total_instances(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unreadable_claim_is_answered_from_its_record() {
    // The API server cannot say the allocation changed: the record's answer stands.
    let node = Node::new(&[("H100-80GB", true), ("H100-80GB", true)]);
    let (driver, _) = node.start(None);
    node.claims.put(claim("u1", "c1", &[("gpu", A)]));
    let devices = prepare_one(&driver, "u1", "c1").await.unwrap();
    node.claims.set_unreachable(true);
    assert_eq!(prepare_one(&driver, "u1", "c1").await.unwrap(), devices);
    assert_eq!(node.instances(0).len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_adminaccess_allocation_under_the_same_uid_releases_the_recorded_instance() {
    let node = Node::new(&[("H100-80GB", true), ("H100-80GB", true)]);
    let (driver, _) = node.start(None);
    node.claims.put(claim("u1", "c1", &[("gpu", A)]));
    prepare_one(&driver, "u1", "c1").await.unwrap();
    node.claims.put(admin_claim("u1", "c1", &[("gpu", "gpu-1")]));
    let devices = prepare_one(&driver, "u1", "c1").await.unwrap();
    assert_eq!(devices[0].device_name, "gpu-1");
    assert_eq!(node.total_instances(), 0, "A's instance was destroyed");
    assert!(
        driver.recorded_claims().is_empty(),
        "adminAccess leaves no record"
    );
    assert_eq!(spec_devices(&node, "u1").len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_stale_claim_gc_releases_a_record_of_other_devices() {
    let (node, driver) = reallocated_without_unprepare().await;
    let round = driver.collect_stale_claims().await;
    assert_eq!(round.released.len(), 1, "{round:?}");
    assert_eq!(round.released[0].cause, StaleCause::Reallocated);
    assert_eq!(round.released[0].cause.reason(), "Reallocated");
    assert!(node.instances(0).is_empty(), "A's instance was destroyed");
    assert!(node.cdi_specs().is_empty());
    assert!(driver.recorded_claims().is_empty());

    // The kubelet's prepare then creates B; the GC leaves a record of the current devices.
    prepare_one(&driver, "u1", "c1").await.unwrap();
    assert_eq!(node.instances(1).len(), 1);
    let round = driver.collect_stale_claims().await;
    assert!(round.released.is_empty(), "{round:?}");
    assert_eq!(node.instances(1).len(), 1);
}
