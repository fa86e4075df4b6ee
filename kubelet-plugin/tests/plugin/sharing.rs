//! Shared partitions: several claims hold shares of one shared MIG device. The instance is
//! created at the first prepare, lives while any claim's record holds it, and is destroyed
//! after the last teardown, whichever path that takes (the kubelet's unprepare, startup
//! recovery, the stale-claim GC). A crash between any two steps, then the kubelet's retries,
//! never leaks the instance nor destroys it under a claim that still holds it.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::{
    panic::{AssertUnwindSafe, catch_unwind},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use dra_kubelet::DraDriver;
use k8s_openapi::api::resource::v1::ResourceClaim;
use migdra_kubelet_plugin::driver::{Step, StepHook};
use serde_json::json;

use migdra_testkit::plugin::*;

/// A shared 1g.10gb device of an H100 (memory slice 6).
const SHARED: &str = "gpu-0-mig-1g10gb-6";
/// The UUID variable of [`SHARED`] in a container.
const SHARED_UUID_VARIABLE: &str = "MIGDRA_DEVICE_UUID_GPU_0_MIG_1G10GB_6";

/// A claim holding a share of `device`, as the scheduler allocates it (a `shareID`).
fn share_claim(uid: &str, name: &str, device: &str) -> ResourceClaim {
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default", "uid": uid},
        "spec": {"devices": {"requests": []}},
        "status": {"allocation": {"devices": {"results": [{
            "request": "mig", "driver": DRIVER, "pool": POOL, "device": device,
            "shareID": format!("00000000-0000-0000-0000-00000000000{}", &uid[uid.len() - 1..]),
            "consumedCapacity": {"shares": "1"},
        }]}}},
    }))
    .unwrap()
}

/// A node with one H100 and two claims (u1 = c1, u2 = c2) sharing [`SHARED`].
fn node() -> Node {
    let node = Node::new(&[("H100-80GB", true)]);
    node.claims.put(share_claim("u1", "c1", SHARED));
    node.claims.put(share_claim("u2", "c2", SHARED));
    node
}

/// The MIG UUID a claim's CDI spec hands its containers.
fn uuid_in_spec(node: &Node, uid: &str) -> String {
    let spec = node.cdi_spec(uid);
    let env = spec["devices"][0]["containerEdits"]["env"]
        .as_array()
        .unwrap()
        .clone();
    env.iter()
        .filter_map(|e| e.as_str()?.strip_prefix(&format!("{SHARED_UUID_VARIABLE}=")))
        .map(str::to_string)
        .next()
        .unwrap_or_else(|| panic!("no {SHARED_UUID_VARIABLE} in {env:?}"))
}

/// Exactly one instance, at the shared placement, and every claim in `holders` is prepared,
/// recorded and hands out that instance.
fn held_by(node: &Node, driver: &TestDriver, holders: &[&str], context: &str) {
    let instances = node.instances(0);
    assert_eq!(
        instances.len(),
        1,
        "{context}: one shared instance: {instances:?}"
    );
    assert_eq!((instances[0].0, instances[0].1), (19, 6), "{context}");
    assert_eq!(instances[0].2.len(), 1, "{context}: its full compute instance");
    let uuid = &instances[0].2[0];
    let recorded = driver.recorded_claims();
    assert_eq!(
        recorded.keys().map(String::as_str).collect::<Vec<_>>(),
        holders,
        "{context}: the records are the holders"
    );
    for uid in holders {
        assert_eq!(
            &uuid_in_spec(node, uid),
            uuid,
            "{context}: {uid} sees the instance"
        );
    }
    assert_eq!(node.cdi_specs().len(), holders.len(), "{context}");
}

fn released(node: &Node, driver: &TestDriver, context: &str) {
    assert!(
        node.instances(0).is_empty(),
        "{context}: the instance leaked: {:?}",
        node.instances(0)
    );
    assert!(
        node.cdi_specs().is_empty(),
        "{context}: CDI specs leaked: {:?}",
        node.cdi_specs()
    );
    assert!(
        driver.recorded_claims().is_empty(),
        "{context}: {:?}",
        driver.recorded_claims()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn two_claims_share_one_instance_until_the_last_unprepare() {
    let node = node();
    let (driver, _) = node.start(None);
    let first = prepare_one(&driver, "u1", "c1").await.unwrap();
    held_by(&node, &driver, &["u1"], "first prepare");
    let second = prepare_one(&driver, "u2", "c2").await.unwrap();
    held_by(&node, &driver, &["u1", "u2"], "second prepare");
    assert_eq!(first[0].device_name, SHARED);
    assert_eq!(second[0].device_name, SHARED);
    assert_eq!(
        first[0].share_id.as_deref(),
        Some("00000000-0000-0000-0000-000000000001"),
        "the kubelet is told which share it got"
    );
    assert_eq!(
        second[0].share_id.as_deref(),
        Some("00000000-0000-0000-0000-000000000002")
    );
    assert_ne!(
        first[0].cdi_device_ids, second[0].cdi_device_ids,
        "each claim has its own CDI device"
    );
    // Prepare again (kubelet retry): answered from the record, nothing new.
    prepare_one(&driver, "u2", "c2").await.unwrap();
    held_by(&node, &driver, &["u1", "u2"], "repeated prepare");

    unprepare_one(&driver, "u1", "c1").await.unwrap();
    held_by(&node, &driver, &["u2"], "the first claim let go");
    unprepare_one(&driver, "u1", "c1").await.unwrap();
    held_by(&node, &driver, &["u2"], "a repeated unprepare of the first claim");
    // A new claim joins the survivor.
    node.claims.put(share_claim("u3", "c3", SHARED));
    prepare_one(&driver, "u3", "c3").await.unwrap();
    held_by(&node, &driver, &["u2", "u3"], "a third claim joined");
    unprepare_one(&driver, "u2", "c2").await.unwrap();
    unprepare_one(&driver, "u3", "c3").await.unwrap();
    released(&node, &driver, "the last claim let go");
}

#[tokio::test(flavor = "multi_thread")]
async fn claims_preparing_one_shared_device_at_once_create_one_instance() {
    // In one kubelet call (the claims run in parallel) ...
    let node = node();
    let (driver, _) = node.start(None);
    let outcomes = driver
        .prepare(vec![claim_ref("u1", "c1"), claim_ref("u2", "c2")])
        .await;
    assert!(outcomes.values().all(Result::is_ok), "{outcomes:?}");
    held_by(&node, &driver, &["u1", "u2"], "one call");
    let outcomes = driver
        .unprepare(vec![claim_ref("u1", "c1"), claim_ref("u2", "c2")])
        .await;
    assert!(outcomes.values().all(Result::is_ok), "{outcomes:?}");
    released(&node, &driver, "one unprepare call");
    // ... and in two calls at the same time.
    let (a, b) = tokio::join!(prepare_one(&driver, "u1", "c1"), prepare_one(&driver, "u2", "c2"));
    a.unwrap();
    b.unwrap();
    held_by(&node, &driver, &["u1", "u2"], "two calls");
    let (a, b) = tokio::join!(
        unprepare_one(&driver, "u1", "c1"),
        unprepare_one(&driver, "u2", "c2")
    );
    a.unwrap();
    b.unwrap();
    released(&node, &driver, "two unprepare calls");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_stale_claim_gc_releases_a_share_without_destroying_the_others_instance() {
    let node = node();
    let (driver, _) = node.start(None);
    prepare_one(&driver, "u1", "c1").await.unwrap();
    prepare_one(&driver, "u2", "c2").await.unwrap();
    node.claims.remove("default", "c1");
    let round = driver.collect_stale_claims().await;
    assert_eq!(round.released.len(), 1, "{round:?}");
    held_by(&node, &driver, &["u2"], "the deleted claim was collected");
    node.claims.remove("default", "c2");
    let round = driver.collect_stale_claims().await;
    assert_eq!(round.released.len(), 1, "{round:?}");
    released(&node, &driver, "the last holder was collected");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_exclusive_claim_cannot_take_a_shared_instance() {
    let node = node();
    let (driver, _) = node.start(None);
    prepare_one(&driver, "u1", "c1").await.unwrap();
    node.claims.put(claim("u9", "exclusive", &[("gpu", SHARED)]));
    let refused = prepare_typed(&driver, "u9", "exclusive").await.unwrap_err();
    assert_eq!(refused.reason(), "InUseByClaim", "{refused}");
    held_by(&node, &driver, &["u1"], "the refused claim changed nothing");
}

// ---------------------------------------------------------------------------------------
// Crash safety of the count.

/// A hook that "crashes" at the `occurrence`-th time (1-based) `target` is reached for claim
/// `uid`.
fn crash_at(uid: &'static str, target: Step, occurrence: usize) -> (StepHook, Arc<AtomicUsize>) {
    let seen = Arc::new(AtomicUsize::new(0));
    let counter = seen.clone();
    let hook: StepHook = Arc::new(move |claim, step| {
        if claim == uid && step == target && counter.fetch_add(1, Ordering::SeqCst) + 1 == occurrence {
            panic!("injected crash at {step:?} #{occurrence} of {uid}");
        }
    });
    (hook, seen)
}

/// Restarts the plugin; with `recovery_crash`, the first restart crashes inside recovery at
/// that step if recovery reaches it, and the node starts once more.
fn restart(node: &Node, recovery_crash: Option<(Step, usize)>) -> (TestDriver, bool) {
    let mut crashed = false;
    if let Some((step, n)) = recovery_crash {
        let seen = Arc::new(AtomicUsize::new(0));
        let hook: StepHook = Arc::new(move |_, s| {
            if s == step && seen.fetch_add(1, Ordering::SeqCst) + 1 == n {
                panic!("injected recovery crash at {s:?} #{n}");
            }
        });
        crashed = catch_unwind(AssertUnwindSafe(|| node.try_start(Some(hook)).map(drop))).is_err();
    }
    (node.start(None).0, crashed)
}

/// Crash points inside recovery: none, or while it tears a record down.
const RECOVERY_POINTS: [Option<(Step, usize)>; 5] = [
    None,
    Some((Step::ShareReleased, 1)),
    Some((Step::ComputeInstanceDestroyed, 1)),
    Some((Step::GpuInstanceDestroyed, 1)),
    Some((Step::CdiRemoved, 1)),
];

/// The phases of a shared device's life, each crashed at every step it passes.
#[derive(Clone, Copy, Debug)]
enum Phase {
    /// u1 prepares first: it creates the instance.
    FirstPrepare,
    /// u2 prepares while u1 holds the instance: it joins.
    JoiningPrepare,
    /// u1 unprepares while u2 still holds it: the instance stays.
    ReleasingUnprepare,
    /// u2, the last holder, unprepares: the instance goes.
    LastUnprepare,
}

const PHASES: [(Phase, &[Step]); 4] = [
    (
        Phase::FirstPrepare,
        &[
            Step::PrepareRecorded,
            Step::GpuInstanceCreated,
            Step::ComputeInstanceCreated,
            Step::DeviceRecorded,
            Step::CdiWritten,
            Step::PrepareCompleted,
        ],
    ),
    (
        Phase::JoiningPrepare,
        &[
            Step::PrepareRecorded,
            Step::ShareJoined,
            Step::CdiWritten,
            Step::PrepareCompleted,
        ],
    ),
    (
        Phase::ReleasingUnprepare,
        &[
            Step::UnprepareRecorded,
            Step::ShareReleased,
            Step::CdiRemoved,
            Step::ClaimForgotten,
        ],
    ),
    (
        Phase::LastUnprepare,
        &[
            Step::UnprepareRecorded,
            Step::ComputeInstanceDestroyed,
            Step::GpuInstanceDestroyed,
            Step::CdiRemoved,
            Step::ClaimForgotten,
        ],
    ),
];

/// Runs the phases before `phase` without crashing.
async fn run_until(node: &Node, phase: Phase) {
    let (driver, _) = node.start(None);
    let steps: &[(&str, &str, bool)] = match phase {
        Phase::FirstPrepare => &[],
        Phase::JoiningPrepare => &[("u1", "c1", true)],
        Phase::ReleasingUnprepare => &[("u1", "c1", true), ("u2", "c2", true)],
        Phase::LastUnprepare => &[("u1", "c1", true), ("u2", "c2", true), ("u1", "c1", false)],
    };
    for (uid, name, prepare) in steps {
        if *prepare {
            prepare_one(&driver, uid, name).await.unwrap();
        } else {
            unprepare_one(&driver, uid, name).await.unwrap();
        }
    }
}

/// The claim a phase works on, and whether it prepares.
fn subject(phase: Phase) -> (&'static str, &'static str, bool) {
    match phase {
        Phase::FirstPrepare => ("u1", "c1", true),
        Phase::JoiningPrepare => ("u2", "c2", true),
        Phase::ReleasingUnprepare => ("u1", "c1", false),
        Phase::LastUnprepare => ("u2", "c2", false),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_crash_at_any_step_of_a_shared_device_keeps_the_count_right() {
    let (mut tested, mut recovery_crashes) = (0, 0);
    for (phase, steps) in PHASES {
        for step in steps.iter().copied() {
            for recovery_crash in RECOVERY_POINTS {
                let context = format!("{phase:?} crashed at {step:?}, recovery {recovery_crash:?}");
                let node = node();
                run_until(&node, phase).await;
                let (uid, name, prepares) = subject(phase);
                {
                    let (hook, seen) = crash_at(uid, step, 1);
                    let (driver, _) = node.start(Some(hook));
                    let outcome = if prepares {
                        prepare_one(&driver, uid, name).await.map(drop)
                    } else {
                        unprepare_one(&driver, uid, name).await
                    };
                    assert!(outcome.is_err(), "{context}: the crash must fail the call");
                    assert!(seen.load(Ordering::SeqCst) >= 1, "{context}: never reached");
                } // the crashed process is gone

                let (driver, crashed) = restart(&node, recovery_crash);
                recovery_crashes += usize::from(crashed);
                // What recovery leaves: a half-done step is undone (prepare) or finished
                // (unprepare); a completed prepare stays. Either way the instance lives exactly
                // while a record holds it.
                let others: &[&str] = match phase {
                    Phase::FirstPrepare | Phase::LastUnprepare => &[],
                    Phase::JoiningPrepare => &["u1"],
                    Phase::ReleasingUnprepare => &["u2"],
                };
                let mut expected: Vec<&str> = others.to_vec();
                if prepares && step == Step::PrepareCompleted {
                    expected.push(uid);
                    expected.sort();
                }
                if expected.is_empty() {
                    released(&node, &driver, &context);
                } else {
                    held_by(&node, &driver, &expected, &context);
                }

                // The kubelet replays its retry, then both claims run their course.
                if prepares {
                    prepare_one(&driver, uid, name).await.unwrap();
                    let mut holders: Vec<&str> = others.to_vec();
                    holders.push(uid);
                    holders.sort();
                    held_by(&node, &driver, &holders, &context);
                } else {
                    unprepare_one(&driver, uid, name).await.unwrap();
                }
                for (uid, name) in [("u1", "c1"), ("u2", "c2")] {
                    unprepare_one(&driver, uid, name).await.unwrap();
                }
                released(&node, &driver, &context);
                // The device can be shared afresh.
                prepare_one(&driver, "u1", "c1").await.unwrap();
                prepare_one(&driver, "u2", "c2").await.unwrap();
                held_by(&node, &driver, &["u1", "u2"], &context);
                tested += 1;
            }
        }
    }
    let points: usize = PHASES.iter().map(|(_, steps)| steps.len()).sum();
    assert_eq!(tested, points * RECOVERY_POINTS.len());
    assert!(
        recovery_crashes >= 20,
        "only {recovery_crashes} runs crashed inside recovery"
    );
}
