//! Crash safety: the plugin is stopped dead (a panic that skips every cleanup path) at every
//! point between two steps of prepare, unprepare and startup recovery, then restarted, and
//! the kubelet's retries are replayed. Every claim must converge, no MIG instance may leak,
//! and the instance migdra did not create must survive.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::{
    panic::{AssertUnwindSafe, catch_unwind},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use migdra_kubelet_plugin::driver::{Step, StepHook};
use migdra_testkit::plugin::*;

const DEVICES: [(&str, &str); 2] = [("a", "gpu-0-mig-3g40gb-0"), ("b", "gpu-1-mig-2g20gb-2")];

/// A hook that "crashes" at the `occurrence`-th time (1-based) `target` is reached.
fn crash_at(target: Step, occurrence: usize) -> (StepHook, Arc<AtomicUsize>) {
    let seen = Arc::new(AtomicUsize::new(0));
    let counter = seen.clone();
    let hook: StepHook = Arc::new(move |_uid, step| {
        if step == target && counter.fetch_add(1, Ordering::SeqCst) + 1 == occurrence {
            panic!("injected crash at {step:?} #{occurrence}");
        }
    });
    (hook, seen)
}

fn node() -> Node {
    let node = Node::two_h100s_with_a_foreign_1g();
    node.claims.put(claim("uid-1", "c1", &DEVICES));
    node
}

fn foreign_only(node: &Node) {
    let gpu0 = node.instances(0);
    assert_eq!(
        gpu0.len(),
        1,
        "GPU 0 should hold only the foreign instance: {gpu0:?}"
    );
    assert_eq!((gpu0[0].0, gpu0[0].1), (19, 6));
    assert!(
        node.instances(1).is_empty(),
        "GPU 1 leaked: {:?}",
        node.instances(1)
    );
    assert!(
        node.cdi_specs().is_empty(),
        "CDI specs leaked: {:?}",
        node.cdi_specs()
    );
}

fn fully_prepared(node: &Node) {
    assert_eq!(node.instances(0).len(), 2);
    assert_eq!(node.instances(1).len(), 1);
    assert!(
        node.instances(0)
            .iter()
            .chain(node.instances(1).iter())
            .all(|(_, _, cis)| cis.len() == 1)
    );
    assert_eq!(node.cdi_specs().len(), 1);
}

/// Restarts the plugin. With `recovery_crash`, the first restart crashes inside recovery at
/// that step (a crash during the repair itself) if recovery reaches it; either way that
/// process is gone and the node starts once more. Returns the driver and whether the
/// recovery crash happened.
fn restart(node: &Node, recovery_crash: Option<(Step, usize)>) -> (TestDriver, bool) {
    let mut crashed = false;
    if let Some((step, n)) = recovery_crash {
        let (hook, _) = crash_at(step, n);
        crashed = catch_unwind(AssertUnwindSafe(|| node.try_start(Some(hook)).map(drop))).is_err();
    }
    (node.start(None).0, crashed)
}

const PREPARE_POINTS: [(Step, usize); 9] = [
    (Step::PrepareRecorded, 1),
    (Step::GpuInstanceCreated, 1),
    (Step::ComputeInstanceCreated, 1),
    (Step::DeviceRecorded, 1),
    (Step::GpuInstanceCreated, 2),
    (Step::ComputeInstanceCreated, 2),
    (Step::DeviceRecorded, 2),
    (Step::CdiWritten, 1),
    (Step::PrepareCompleted, 1),
];

const UNPREPARE_POINTS: [(Step, usize); 7] = [
    (Step::UnprepareRecorded, 1),
    (Step::ComputeInstanceDestroyed, 1),
    (Step::GpuInstanceDestroyed, 1),
    (Step::ComputeInstanceDestroyed, 2),
    (Step::GpuInstanceDestroyed, 2),
    (Step::CdiRemoved, 1),
    (Step::ClaimForgotten, 1),
];

/// Crash points inside recovery (rolling back or finishing an unprepare).
const RECOVERY_POINTS: [Option<(Step, usize)>; 4] = [
    None,
    Some((Step::ComputeInstanceDestroyed, 1)),
    Some((Step::GpuInstanceDestroyed, 2)),
    Some((Step::CdiRemoved, 1)),
];

#[tokio::test(flavor = "multi_thread")]
async fn a_crash_between_any_two_prepare_steps_converges() {
    let (mut tested, mut recovery_crashes) = (0, 0);
    for (step, n) in PREPARE_POINTS {
        for recovery_crash in RECOVERY_POINTS {
            let node = node();
            {
                let (hook, seen) = crash_at(step, n);
                let (driver, _) = node.start(Some(hook));
                let outcome = prepare_one(&driver, "uid-1", "c1").await;
                assert!(outcome.is_err(), "{step:?}#{n}: the crash must fail the call");
                assert!(seen.load(Ordering::SeqCst) >= n, "{step:?}#{n} was never reached");
            } // the crashed process is gone

            let (driver, crashed) = restart(&node, recovery_crash);
            recovery_crashes += usize::from(crashed);
            let recorded = driver.recorded_claims();
            if step == Step::PrepareCompleted {
                // Completed before the crash: kept as is.
                assert_eq!(recorded.len(), 1);
                fully_prepared(&node);
            } else {
                // Half-prepared: rolled back entirely at start.
                assert!(
                    recorded.is_empty(),
                    "{step:?}#{n} / {recovery_crash:?}: {recorded:?}"
                );
                foreign_only(&node);
            }
            // The kubelet retries prepare, later unprepares: both converge.
            let devices = prepare_one(&driver, "uid-1", "c1").await.unwrap();
            assert_eq!(devices.len(), 2);
            fully_prepared(&node);
            unprepare_one(&driver, "uid-1", "c1").await.unwrap();
            foreign_only(&node);
            assert!(driver.recorded_claims().is_empty());
            tested += 1;
        }
    }
    assert_eq!(tested, PREPARE_POINTS.len() * RECOVERY_POINTS.len());
    assert!(
        recovery_crashes >= 15,
        "only {recovery_crashes} runs crashed inside recovery"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_crash_between_any_two_unprepare_steps_converges() {
    let mut recovery_crashes = 0;
    for (step, n) in UNPREPARE_POINTS {
        for recovery_crash in RECOVERY_POINTS {
            let node = node();
            {
                let (driver, _) = node.start(None);
                prepare_one(&driver, "uid-1", "c1").await.unwrap();
            }
            {
                let (hook, seen) = crash_at(step, n);
                let (driver, _) = node.start(Some(hook));
                let outcome = unprepare_one(&driver, "uid-1", "c1").await;
                assert!(outcome.is_err(), "{step:?}#{n}: the crash must fail the call");
                assert!(seen.load(Ordering::SeqCst) >= n, "{step:?}#{n} was never reached");
            }
            // Restart: recovery finishes the unprepare (the kubelet may never ask again if the
            // pod is gone), and the kubelet's retry is answered with success.
            let (driver, crashed) = restart(&node, recovery_crash);
            recovery_crashes += usize::from(crashed);
            foreign_only(&node);
            assert!(
                driver.recorded_claims().is_empty(),
                "{step:?}#{n}: {:?}",
                driver.recorded_claims()
            );
            unprepare_one(&driver, "uid-1", "c1").await.unwrap();
            foreign_only(&node);
        }
    }
    assert!(
        recovery_crashes >= 8,
        "only {recovery_crashes} runs crashed inside recovery"
    );
}

/// A reboot: MIG instances do not survive it (only the one someone else made is back,
/// recreated by its owner), and the node gets a new boot ID.
fn reboot(node: &mut Node) {
    node.host
        .update_state(|s| {
            for gpu in &mut s.gpus {
                gpu.gpu_instances
                    .retain(|gi| gi.start == 6 && gi.profile_id == 19);
            }
        })
        .unwrap();
    node.boot_id = "boot-2".into();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reboot_discards_the_checkpoint_and_prepares_afresh() {
    let mut node = node();
    {
        let (driver, _) = node.start(None);
        prepare_one(&driver, "uid-1", "c1").await.unwrap();
    }
    std::fs::remove_dir_all(node.cdi_dir()).unwrap();
    reboot(&mut node);
    let (driver, report) = node.start(None);
    assert!(matches!(
        report.checkpoint,
        Some(migdra_kubelet_plugin::checkpoint::LoadOutcome::PreviousBoot { .. })
    ));
    assert!(
        driver.recorded_claims().is_empty(),
        "the old boot's claims are not trusted"
    );
    prepare_one(&driver, "uid-1", "c1").await.unwrap();
    fully_prepared(&node);
}

#[tokio::test(flavor = "multi_thread")]
async fn after_a_reboot_no_claim_spec_of_the_earlier_boot_is_left_for_the_runtime() {
    // The CDI directory is on disk (e.g. /etc/cdi), so it survives the reboot.
    let mut node = node();
    {
        let (driver, _) = node.start(None);
        prepare_one(&driver, "uid-1", "c1").await.unwrap();
    }
    let cdi_dir = node.cdi_dir();
    let spec = |uid: &str| cdi_dir.join(format!("gpu.migdra.dev-claim_{uid}.json"));
    // Another claim's spec of that boot, and one a power loss tore as it was written (specs
    // are not synced).
    std::fs::copy(spec("uid-1"), spec("uid-2")).unwrap();
    std::fs::write(spec("uid-3"), "{\"cdiVer").unwrap();
    reboot(&mut node);
    let (driver, report) = node.start(None);
    assert_eq!(report.cdi_removed, ["uid-1", "uid-2", "uid-3"]);
    for uid in ["uid-1", "uid-2", "uid-3"] {
        assert!(
            !spec(uid).exists(),
            "{uid}'s spec names instances that died with the earlier boot"
        );
    }
    // The kubelet prepares the claim again on the new boot, and its spec is this boot's.
    prepare_one(&driver, "uid-1", "c1").await.unwrap();
    fully_prepared(&node);
    let (_, report) = node.start(None);
    assert!(
        report.cdi_removed.is_empty(),
        "a restart on the same boot removes nothing"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wiped_cdi_directory_is_rebuilt_at_start() {
    let node = node();
    let spec_before = {
        let (driver, _) = node.start(None);
        prepare_one(&driver, "uid-1", "c1").await.unwrap();
        node.cdi_spec("uid-1")
    };
    std::fs::remove_dir_all(node.cdi_dir()).unwrap();
    let (driver, report) = node.start(None);
    assert_eq!(report.cdi_rewritten, vec!["uid-1".to_string()]);
    assert_eq!(
        node.cdi_spec("uid-1"),
        spec_before,
        "the same devices, from the record"
    );
    fully_prepared(&node);
    unprepare_one(&driver, "uid-1", "c1").await.unwrap();
    foreign_only(&node);
}

/// What [`DEVICES`] becomes when the claim is allocated again under the same UID: on GPU 0 a
/// placement that overlaps the earlier 3g at 0, so it exists only once that one is released.
const REALLOCATED: [(&str, &str); 2] = [("a", "gpu-1-mig-3g40gb-4"), ("b", "gpu-0-mig-2g20gb-2")];

fn reallocated_prepared(node: &Node) {
    let gpu0: Vec<_> = node.instances(0).iter().map(|i| (i.0, i.1)).collect();
    assert_eq!(gpu0.len(), 2, "the foreign 1g and the new 2g: {gpu0:?}");
    assert!(gpu0.contains(&(19, 6)) && gpu0.contains(&(14, 2)), "{gpu0:?}");
    let gpu1: Vec<_> = node.instances(1).iter().map(|i| (i.0, i.1)).collect();
    assert_eq!(gpu1, [(9, 4)]);
    let spec = node.cdi_spec("uid-1").to_string();
    assert!(
        REALLOCATED.iter().all(|(_, d)| spec.contains(d)) && !DEVICES.iter().any(|(_, d)| spec.contains(d)),
        "{spec}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_crash_while_a_reallocated_claim_swaps_its_devices_converges() {
    // The release of the earlier devices is an unprepare, then the new devices' prepare.
    let points = UNPREPARE_POINTS.iter().chain(PREPARE_POINTS.iter());
    for &(step, n) in points {
        for recovery_crash in [None, Some((Step::GpuInstanceDestroyed, 1))] {
            let node = node();
            {
                let (driver, _) = node.start(None);
                prepare_one(&driver, "uid-1", "c1").await.unwrap();
            }
            node.claims.put(claim("uid-1", "c1", &REALLOCATED));
            {
                let (hook, seen) = crash_at(step, n);
                let (driver, _) = node.start(Some(hook));
                let outcome = prepare_one(&driver, "uid-1", "c1").await;
                assert!(outcome.is_err(), "{step:?}#{n}: the crash must fail the call");
                assert!(seen.load(Ordering::SeqCst) >= n, "{step:?}#{n} was never reached");
            }
            let (driver, _) = restart(&node, recovery_crash);
            // Recovery finished the release or rolled the new prepare back; either way no
            // record of the earlier devices is left.
            for record in driver.recorded_claims().values() {
                assert_eq!(
                    record.device_names(),
                    REALLOCATED.map(|(_, d)| d.to_string()),
                    "{step:?}#{n}"
                );
            }
            // The kubelet retries prepare, later unprepares: both converge.
            let devices = prepare_one(&driver, "uid-1", "c1").await.unwrap();
            assert_eq!(devices.len(), 2, "{step:?}#{n}");
            reallocated_prepared(&node);
            unprepare_one(&driver, "uid-1", "c1").await.unwrap();
            foreign_only(&node);
            assert!(driver.recorded_claims().is_empty());
        }
    }
}
