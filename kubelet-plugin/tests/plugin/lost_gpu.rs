//! A lost GPU never wedges pod termination: unprepare of its claims completes (its instances
//! count as gone), the instances it could not destroy are remembered and destroyed when the
//! GPU comes back (never a foreign one), and prepare on a lost GPU is a typed rejection.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use migdra_kubelet_plugin::{driver::ClaimFailure, plan::Rejection};
use migdra_testkit::plugin::*;

/// Profile 3g.40gb (ID 9) at start 0 on GPU 0.
const OURS: &str = "gpu-0-mig-3g40gb-0";
/// A foreign 1g.10gb (profile 19) at start 6 on GPU 0.
const FOREIGN: (u32, u32) = (19, 6);

/// Two H100s (so NVML still describes one while the other is lost); GPU 0 holds a foreign
/// instance.
fn node() -> Node {
    let node = Node::two_h100s_with_a_foreign_1g();
    node.claims.put(claim("u1", "c1", &[("gpu", OURS)]));
    node
}

fn set_lost(node: &Node, lost: bool) {
    node.host.update_state(|s| s.gpus[0].lost = lost).unwrap();
}

fn placements(node: &Node) -> Vec<(u32, u32)> {
    let mut placements: Vec<_> = node.instances(0).into_iter().map(|(p, s, _)| (p, s)).collect();
    placements.sort();
    placements
}

fn orphans(driver: &TestDriver) -> Vec<(u32, u32, String)> {
    driver
        .gpus()
        .orphans()
        .unwrap()
        .all()
        .into_iter()
        .map(|o| (o.profile_id, o.start, o.claim))
        .collect()
}

/// Prepares u1, loses GPU 0 and unprepares u1 there.
async fn unprepared_while_lost(node: &Node, driver: &TestDriver) {
    prepare_one(driver, "u1", "c1").await.unwrap();
    assert_eq!(placements(node), [(9, 0), FOREIGN]);
    set_lost(node, true);
    unprepare_typed(driver, "u1", "c1")
        .await
        .expect("unprepare on a lost GPU completes");
    assert!(driver.recorded_claims().is_empty(), "the record is gone");
    assert!(node.cdi_specs().is_empty(), "the CDI spec is gone");
    assert_eq!(orphans(driver), [(9, 0, "default/c1".to_string())]);
}

#[tokio::test(flavor = "multi_thread")]
async fn unprepare_on_a_lost_gpu_completes_and_its_instance_is_destroyed_when_it_returns() {
    let node = node();
    let (driver, _) = node.start(None);
    unprepared_while_lost(&node, &driver).await;
    // A second unprepare (the kubelet retries) is still a success.
    unprepare_typed(&driver, "u1", "c1").await.unwrap();

    // While lost: unhealthy, nothing destroyed, the orphan is kept.
    let inventory = driver.gpus().inventory().unwrap();
    assert!(!inventory[0].health.healthy, "{:?}", inventory[0].health);
    assert!(inventory[1].health.healthy);
    assert_eq!(
        placements(&node),
        [(9, 0), FOREIGN],
        "the lost GPU kept its instances"
    );
    assert_eq!(orphans(&driver).len(), 1);

    // Back with the instance still there: exactly that one is destroyed.
    set_lost(&node, false);
    let inventory = driver.gpus().inventory().unwrap();
    assert!(inventory[0].health.healthy, "{:?}", inventory[0].health);
    assert_eq!(
        placements(&node),
        [FOREIGN],
        "ours destroyed, the foreign one untouched"
    );
    assert!(orphans(&driver).is_empty());
    let reported: Vec<_> = inventory[0]
        .mig
        .as_ref()
        .unwrap()
        .instances
        .iter()
        .map(|i| (i.placement.profile_id, i.placement.start))
        .collect();
    assert_eq!(reported, [FOREIGN]);

    // The placement is usable again.
    node.claims.put(claim("u2", "c2", &[("gpu", OURS)]));
    prepare_one(&driver, "u2", "c2").await.unwrap();
    assert_eq!(placements(&node), [(9, 0), FOREIGN]);
    driver.gpus().inventory().unwrap();
    assert_eq!(
        placements(&node),
        [(9, 0), FOREIGN],
        "a live claim's instance is not an orphan"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_orphan_list_survives_a_restart() {
    let node = node();
    {
        let (driver, _) = node.start(None);
        unprepared_while_lost(&node, &driver).await;
    }
    // Restarted while the GPU is still lost; it comes back later.
    let (driver, _) = node.start(None);
    assert_eq!(orphans(&driver).len(), 1);
    set_lost(&node, false);
    driver.gpus().inventory().unwrap();
    assert_eq!(placements(&node), [FOREIGN]);
    assert!(orphans(&driver).is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn an_orphan_gone_with_a_reset_is_forgotten_and_nothing_else_is_destroyed() {
    let node = node();
    let (driver, _) = node.start(None);
    unprepared_while_lost(&node, &driver).await;
    // The GPU comes back after a reset (its instances are gone), and someone else creates an
    // instance of another profile meanwhile: it is not ours.
    node.host
        .update_state(|s| {
            s.reset_gpu(0);
        })
        .unwrap();
    assert!(placements(&node).is_empty());
    node.claims
        .put(claim("u3", "c3", &[("gpu", "gpu-0-mig-1g10gb-0")]));
    prepare_one(&driver, "u3", "c3").await.unwrap();
    let before = placements(&node);
    assert_eq!(before.len(), 1);
    driver.gpus().inventory().unwrap();
    assert!(
        orphans(&driver).is_empty(),
        "the orphan was gone and is forgotten"
    );
    assert_eq!(placements(&node), before, "nothing else was destroyed");
}

#[tokio::test(flavor = "multi_thread")]
async fn prepare_on_a_lost_gpu_is_a_typed_rejection() {
    let node = node();
    let (driver, _) = node.start(None);
    set_lost(&node, true);
    let failure = prepare_typed(&driver, "u1", "c1").await.unwrap_err();
    assert!(
        matches!(&failure, ClaimFailure::Rejected(Rejection::GpuLost { minor: 0, device, .. }) if device == OURS),
        "{failure}"
    );
    assert_eq!(failure.reason(), "GpuLost");
    assert!(failure.to_string().contains("GPU 0 is lost"), "{failure}");
    assert!(driver.recorded_claims().is_empty());
    assert!(node.cdi_specs().is_empty());
    assert_eq!(placements(&node), [FOREIGN], "nothing was created");
    // Back: the same claim prepares.
    set_lost(&node, false);
    prepare_one(&driver, "u1", "c1").await.unwrap();
    assert_eq!(placements(&node), [(9, 0), FOREIGN]);
}

/// An orphan recorded before its GPU instance had an ID (a
/// half-prepared claim torn down while its GPU was lost) matches any instance at its
/// placement. The instance was never created, so once the GPU is back another claim may be
/// prepared there before the next inventory; that inventory must not destroy the live
/// claim's instance.
#[tokio::test(flavor = "multi_thread")]
async fn an_orphan_never_destroys_the_instance_of_a_live_claim_at_its_placement() {
    use std::sync::Arc;

    use migdra_kubelet_plugin::driver::{Step, StepHook};

    let node = node();
    let (driver, _) = node.start(None);
    {
        // Another plugin instance (a rolling update) dies right after PrepareStarted: nothing
        // is created yet.
        let hook: StepHook = Arc::new(|_uid, step| {
            if step == Step::PrepareRecorded {
                panic!("injected crash after PrepareStarted");
            }
        });
        let (old, _) = node.start(Some(hook));
        assert!(prepare_one(&old, "u1", "c1").await.is_err());
    }
    assert_eq!(placements(&node), [FOREIGN], "nothing was created");
    // The pod is deleted while GPU 0 is lost: the unprepare completes, the (never created)
    // instance counts as gone and is listed as an orphan.
    set_lost(&node, true);
    unprepare_typed(&driver, "u1", "c1").await.unwrap();
    assert!(driver.recorded_claims().is_empty());
    assert_eq!(orphans(&driver), [(9, 0, "default/c1".to_string())]);
    // The GPU is back; another claim gets the same placement before the next inventory.
    set_lost(&node, false);
    node.claims.put(claim("u2", "c2", &[("gpu", OURS)]));
    prepare_one(&driver, "u2", "c2").await.unwrap();
    assert_eq!(placements(&node), [(9, 0), FOREIGN]);

    driver.gpus().inventory().unwrap();
    assert_eq!(
        placements(&node),
        [(9, 0), FOREIGN],
        "the live claim's instance survives the orphan pass"
    );
    assert!(
        orphans(&driver).is_empty(),
        "the orphan's placement belongs to u2 now"
    );
    unprepare_one(&driver, "u2", "c2").await.unwrap();
    assert_eq!(placements(&node), [FOREIGN]);
}

/// During a rolling update the instance that tears a claim down
/// on a lost GPU may not be the one still running when the GPU returns. The list of orphans
/// is the node's (a file under the node lock), not one instance's: the survivor destroys what
/// the other left, and its own additions keep the other's.
#[tokio::test(flavor = "multi_thread")]
async fn orphans_left_by_one_plugin_instance_are_destroyed_by_the_other() {
    let node = node();
    node.claims
        .put(claim("u2", "c2", &[("gpu", "gpu-0-mig-1g10gb-5")]));
    let (new, _) = node.start(None);
    {
        let (old, _) = node.start(None);
        prepare_one(&old, "u1", "c1").await.unwrap();
        prepare_one(&old, "u2", "c2").await.unwrap();
        set_lost(&node, true);
        unprepare_typed(&old, "u1", "c1").await.unwrap();
    } // the old instance is gone (the rolling update finished)
    // The new instance leaves an orphan of its own on the same lost GPU.
    unprepare_typed(&new, "u2", "c2").await.unwrap();
    assert_eq!(
        orphans(&new),
        [
            (9, 0, "default/c1".to_string()),
            (19, 5, "default/c2".to_string())
        ],
        "both instances' orphans are listed"
    );
    set_lost(&node, false);
    new.gpus().inventory().unwrap();
    assert_eq!(
        placements(&node),
        [FOREIGN],
        "both orphans destroyed, the foreign one kept"
    );
    assert!(orphans(&new).is_empty());
}

/// The inventory destroys orphans only when the node lock is free at once, which on a busy
/// node (kubelet calls back to back) can take long; meanwhile the claim allocated at the
/// orphan's placement (its own claim retrying, or a new one) would fail with an overlap. So a
/// prepare, which holds the node lock, destroys the orphans on its GPUs first.
#[tokio::test(flavor = "multi_thread")]
async fn a_prepare_destroys_the_orphans_on_its_gpu_before_planning() {
    let node = node();
    let (driver, _) = node.start(None);
    unprepared_while_lost(&node, &driver).await;
    set_lost(&node, false);
    assert_eq!(placements(&node), [(9, 0), FOREIGN], "the orphan is still there");
    // No inventory ran since the GPU came back.
    node.claims.put(claim("u2", "c2", &[("gpu", OURS)]));
    prepare_one(&driver, "u2", "c2").await.unwrap();
    assert_eq!(placements(&node), [(9, 0), FOREIGN]);
    assert!(
        orphans(&driver).is_empty(),
        "the orphan was destroyed by the prepare"
    );
    let recorded = driver.recorded_claims();
    let uuid = match &recorded["u2"].devices[0].kind {
        migdra_kubelet_plugin::checkpoint::DeviceKind::Mig { mig_uuid, .. } => mig_uuid.clone().unwrap(),
        other => panic!("{other:?}"),
    };
    let state = node.host.read_state().unwrap();
    assert!(
        state.gpus[0]
            .gpu_instances
            .iter()
            .any(|gi| gi.compute_instances.iter().any(|ci| ci.uuid == uuid)),
        "the instance at the placement is u2's new one"
    );
}

/// A rescan that cannot read a GPU's virtualization mode
/// describes it without MIG for that round. The orphan pass must ask NVML what is on the GPU
/// rather than trust that description, or it takes the orphan for gone and the instance leaks.
#[tokio::test(flavor = "multi_thread")]
async fn an_orphan_is_destroyed_even_when_a_rescan_misdescribes_its_gpu() {
    use migdra_fake_nvml::{FaultState, config::FaultConfig};

    let node = node();
    let (driver, _) = node.start(None);
    unprepared_while_lost(&node, &driver).await;
    set_lost(&node, false);
    node.host
        .update_state(|s| {
            s.faults.push(FaultState {
                fault: FaultConfig::error("nvmlDeviceGetVirtualizationMode", migdra_fake_nvml::code::UNKNOWN)
                    .on_gpu(0)
                    .times(1),
                hits: 0,
            })
        })
        .unwrap();
    driver.gpus().inventory().unwrap();
    assert_eq!(
        node.host.read_state().unwrap().faults[0].hits,
        1,
        "the rescan hit the fault"
    );
    assert_eq!(
        placements(&node),
        [FOREIGN],
        "the orphan was destroyed, not forgotten"
    );
    assert!(orphans(&driver).is_empty());
}

/// A GPU that was lost when the plugin started is unknown to it; once the GPU is back, a claim
/// on it is prepared without waiting for the next inventory.
#[tokio::test(flavor = "multi_thread")]
async fn a_gpu_lost_when_the_plugin_started_serves_claims_once_it_is_back() {
    let node = Node::new(&[("H100-80GB", true), ("H100-80GB", true)]);
    node.claims
        .put(claim("u2", "c2", &[("gpu", "gpu-1-mig-1g10gb-0")]));
    node.host.update_state(|s| s.gpus[1].lost = true).unwrap();
    let (driver, _) = node.start(None);
    let refused = prepare_typed(&driver, "u2", "c2").await.unwrap_err();
    assert!(
        matches!(refused, ClaimFailure::Rejected(Rejection::NoSuchGpu { .. })),
        "{refused}"
    );
    node.host.update_state(|s| s.gpus[1].lost = false).unwrap();
    prepare_typed(&driver, "u2", "c2")
        .await
        .expect("prepared once the GPU is back");
    assert_eq!(node.instances(1).len(), 1);
}
