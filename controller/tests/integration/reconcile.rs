//! The reconciler against a scripted API server: the exact calls it makes for a new pool, a
//! no-op resync, an inventory change, a kubelet wipe, a dead plugin, a deleted node, a write
//! conflict, an invalid policy, an API server that drops fields, and status writes deferred
//! while other reconciliations write slices.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use http::StatusCode;
use k8s_openapi::{
    api::resource::v1::ResourceSlice,
    jiff::{SignedDuration, Timestamp},
};
use kube::runtime::controller::Action;
use migdra_api::{
    inventory::{GpuInventory, GpuNode},
    policy::{EffectivePolicy, MigPolicy, MigPolicySpec},
    slices::published_plan,
};
use migdra_controller::{
    Error,
    reconcile::{LIVE_RESYNC, error_policy},
};
use migdra_testkit::controller::*;

fn name(i: usize) -> String {
    format!("{NODE}-{DRIVER}-{i:03}")
}

/// Slice count and device count of the default-policy pool of `gpus`.
fn expected_pool(gpus: &[GpuInventory]) -> (usize, usize) {
    let (plan, _) = published_plan(gpus, &EffectivePolicy::default(), &Default::default());
    (plan.slice_count(), plan.devices.len())
}

/// Seconds from now to the heartbeat expiry the expiry watch next looks at `NODE` (the one
/// its reconciliation saw), after checking that the reconciliation found the node live and
/// requeued it only for the resync.
fn expiry_watched_in(h: &Harness, action: &Action) -> i64 {
    assert_eq!(
        requeue_secs(action),
        Some(LIVE_RESYNC.as_secs()),
        "a live node is requeued only for the resync"
    );
    let until = h
        .ctx
        .heartbeats
        .live_until(NODE)
        .expect("a live node is watched for expiry");
    until.saturating_duration_since(Instant::now()).as_secs() as i64
}

/// A check that a written slice belongs to the pool at `generation` with `count` slices.
fn pool_slice(generation: i64, count: usize) -> impl Fn(&ResourceSlice) + Send + 'static {
    move |s: &ResourceSlice| {
        assert_eq!(s.spec.driver, DRIVER);
        assert_eq!(s.spec.node_name.as_deref(), Some(NODE));
        assert_eq!(s.spec.pool.name, POOL);
        assert_eq!(s.spec.pool.generation, generation);
        assert_eq!(s.spec.pool.resource_slice_count, count as i64);
        let owner = &s.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
            ("Node", NODE, NODE_UID)
        );
        assert_eq!(owner.controller, Some(true));
        assert_eq!(s.metadata.labels.as_ref().unwrap()["gpu.migdra.dev/node"], NODE);
        // What the slice cache compares by (the cache holds no specs).
        let annotations = s.metadata.annotations.as_ref().unwrap();
        assert!(
            annotations.contains_key("gpu.migdra.dev/spec-hash"),
            "{annotations:?}"
        );
        assert_eq!(
            annotations["gpu.migdra.dev/pool-generation"],
            generation.to_string()
        );
    }
}

/// Publishes the pool of `gpus` from scratch; returns what the server stored and the
/// GpuNode with the controller's status, as the watches would deliver them.
async fn publish_fresh(h: &mut Harness, gpus: Vec<GpuInventory>) -> (Vec<ResourceSlice>, GpuNode) {
    let g = gpunode(Some(live_plugin()), gpus.clone());
    let (count, devices) = expected_pool(&gpus);
    let scenario = Scenario::new()
        .then_all((0..count).map(|i| create_slice(&name(i), pool_slice(1, count))))
        .then(patch_status(move |body| {
            assert_eq!(condition(body), ("True", "Published"));
            let p = &body["status"]["publication"];
            assert_eq!(p["pool"], POOL);
            assert_eq!(p["generation"], 1);
            assert_eq!(p["slices"], count);
            assert_eq!(p["devices"], devices);
        }));
    let (result, served) = h.reconcile(&g, scenario).await;
    let action = result.unwrap();
    let expiry = expiry_watched_in(h, &action);
    assert!((20..=25).contains(&expiry), "heartbeat expires in {expiry}s");
    assert_eq!(served.written.len(), count);
    let g = with_status_patch(g, &served.status_patches[0]);
    (served.written, g)
}

/// `publish_fresh`, then the slice cache shows what the server stored.
async fn publish_stored(h: &mut Harness, gpus: Vec<GpuInventory>) -> (Vec<ResourceSlice>, GpuNode) {
    let (stored, g) = publish_fresh(h, gpus).await;
    h.store_slices(&stored);
    (stored, g)
}

#[tokio::test]
async fn create_writes_every_slice_of_one_generation_then_the_status() {
    let mut h = Harness::new();
    let gpus = h100s(2);
    let (count, devices) = expected_pool(&gpus);
    assert!(
        count >= 2,
        "a counter slice and at least one device slice: {count}"
    );
    let (stored, g) = publish_fresh(&mut h, gpus).await;
    // Counter slices first, then devices in order; every device is published exactly once.
    assert!(stored[0].spec.shared_counters.is_some());
    let published: usize = stored
        .iter()
        .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
        .sum();
    assert_eq!(published, devices);
    let p = g.status.unwrap().publication.unwrap();
    assert_eq!((p.gpus, p.policy), (2, None));
    let metrics = h.ctx.metrics.encode();
    assert!(metrics.contains(&format!(
        "migdra_controller_slice_writes_total{{operation=\"create\"}} {count}"
    )));
    assert!(metrics.contains(&format!(
        "migdra_controller_published_devices{{node=\"{NODE}\"}} {devices}"
    )));
    assert!(metrics.contains("migdra_controller_reconciles_total{result=\"success\"} 1"));
}

#[tokio::test]
async fn resync_of_a_published_pool_writes_nothing() {
    let mut h = Harness::new();
    // 80 GiB whole-GPU memory: published as 81920Mi, stored by the server as 80Gi. MIG is off
    // on that GPU, so the default MIG mode offers it whole.
    let mut gpus = h100s(2);
    gpus[0].memory_mib = 81920;
    if let Some(mig) = gpus[0].mig.as_mut() {
        mig.enabled = false;
    }
    let (stored, g) = publish_fresh(&mut h, gpus).await;
    assert!(
        serde_json::to_string(&stored).unwrap().contains("\"80Gi\""),
        "the fake server canonicalised a quantity"
    );
    // The cache has not caught up yet: the reconciler waits instead of rewriting.
    let (result, _) = h.reconcile(&g, Scenario::new()).await;
    let wait = requeue_secs(&result.unwrap()).unwrap();
    assert!(wait <= 15, "waits for the cache, {wait}s");
    // The cache shows exactly what was published (as the server normalised it): no writes.
    h.store_slices(&stored);
    for _ in 0..2 {
        let (result, _) = h.reconcile(&g, Scenario::new()).await;
        assert!(requeue_secs(&result.unwrap()).is_some());
    }
    assert!(!h.ctx.metrics.encode().contains("operation=\"update\""));
}

#[tokio::test]
async fn inventory_change_bumps_the_generation_rewrites_all_and_deletes_the_surplus() {
    let mut h = Harness::new();
    let (stored, g, count) = one_of_four_gpus_left(&mut h).await;
    let before = stored.len();
    let (_, devices) = expected_pool(&h100s(1));
    let scenario = Scenario::new()
        .then_all(shrink(&stored, count, 2))
        .then(patch_status(move |body| {
            assert_eq!(condition(body), ("True", "Published"));
            assert_eq!(body["status"]["publication"]["generation"], 2);
            assert_eq!(body["status"]["publication"]["slices"], count);
            assert_eq!(body["status"]["publication"]["devices"], devices);
            assert_eq!(body["status"]["publication"]["gpus"], 1);
        }));
    let (result, served) = h.reconcile(&g, scenario).await;
    assert!(result.is_ok());
    assert_eq!(served.deleted, (count..before).map(name).collect::<Vec<_>>());
    assert!(served.written.iter().all(|s| s.spec.pool.generation == 2));
}

/// Publishes and caches a four-GPU pool; returns its slices, its GpuNode after the plugin
/// reports one GPU left, and the slice count of that smaller pool.
async fn one_of_four_gpus_left(h: &mut Harness) -> (Vec<ResourceSlice>, GpuNode, usize) {
    let (stored, mut g) = publish_stored(h, h100s(4)).await;
    g.status.as_mut().unwrap().gpus = Some(h100s(1));
    let (count, _) = expected_pool(&h100s(1));
    assert!(count < stored.len(), "one GPU left: fewer slices");
    (stored, g, count)
}

/// The calls that shrink the pool `cached` to `count` slices at `generation`: the first
/// `count` replaced at their cached versions, the rest deleted.
fn shrink(cached: &[ResourceSlice], count: usize, generation: i64) -> Vec<Step> {
    let replaced = cached[..count].iter().enumerate().map(|(i, s)| {
        let rv = s
            .metadata
            .resource_version
            .as_deref()
            .expect("stored with a version");
        replace_slice(&name(i), Some(rv), pool_slice(generation, count))
    });
    let deleted = (count..cached.len()).map(|i| delete_slice(&name(i)));
    replaced.chain(deleted).collect()
}

/// The plugin's next heartbeat: a Lease renewal now.
fn heartbeat(h: &mut Harness) {
    h.put_lease(NODE, Timestamp::now());
}

/// The reconcile after a wipe the plugin has not answered: nothing to delete, the pool is
/// reported withdrawn, and the node waits for the next heartbeat.
async fn withdrawn_after_wipe(h: &mut Harness, g: &GpuNode) -> GpuNode {
    let scenario = Scenario::new().then(patch_status(|body| {
        assert_eq!(condition(body), ("False", "PluginNotReady"));
        let text = body["status"]["conditions"][0]["message"].as_str().unwrap();
        assert!(text.contains("deleted by someone else"), "{text}");
        assert_eq!(body["status"]["publication"]["devices"], 0);
    }));
    let (result, served) = h.reconcile(g, scenario).await;
    assert_eq!(result.unwrap(), Action::await_change());
    assert!(served.written.is_empty(), "a wiped pool is not republished");
    with_status_patch(g.clone(), &served.status_patches[0])
}

#[tokio::test]
async fn a_kubelet_wipe_withdraws_the_pool_until_the_plugin_heartbeats_again() {
    let mut h = Harness::new();
    let (stored, g) = publish_stored(&mut h, h100s(1)).await;
    let (result, _) = h.reconcile(&g, Scenario::new()).await;
    assert!(result.is_ok(), "in sync");
    // The kubelet deletes the node's slices (its plugin has been gone for 30 s). The last
    // heartbeat is still fresh, but older than the wipe: the pool stays withdrawn.
    h.wipe_slices(&stored);
    let count = stored.len();
    assert!(
        h.ctx
            .metrics
            .encode()
            .contains(&format!("migdra_controller_slice_wipes_total {count}"))
    );
    let g = withdrawn_after_wipe(&mut h, &g).await;
    // Resyncs and unrelated GpuNode changes keep it withdrawn.
    let (result, _) = h.reconcile(&g, Scenario::new()).await;
    assert_eq!(result.unwrap(), Action::await_change());

    // The plugin heartbeats after the wipe (it re-registered with a restarted kubelet): the
    // pool comes back, the generation continuing above the published one.
    heartbeat(&mut h);
    let scenario = Scenario::new()
        .then_all((0..count).map(|i| create_slice(&name(i), pool_slice(2, count))))
        .then(patch_status(|body| {
            assert_eq!(condition(body), ("True", "Published"));
            assert_eq!(body["status"]["publication"]["generation"], 2);
        }));
    let (result, served) = h.reconcile(&g, scenario).await;
    assert!(requeue_secs(&result.unwrap()).is_some());
    assert_eq!(served.written.len(), count);
}

#[tokio::test]
async fn a_wipe_right_after_the_create_is_a_wipe_too() {
    let mut h = Harness::new();
    let (stored, g) = publish_fresh(&mut h, h100s(1)).await;
    // The watch shows the creates and then the wipe before any reconcile looked.
    h.store_slices(&stored);
    h.wipe_slices(&stored);
    let g = withdrawn_after_wipe(&mut h, &g).await;
    let count = stored.len();
    let scenario = Scenario::new()
        .then_all((0..count).map(|i| create_slice(&name(i), pool_slice(2, count))))
        .then(patch_status(|_| {}));
    heartbeat(&mut h);
    let (result, _) = h.reconcile(&g, scenario).await;
    assert!(result.is_ok());
}

#[tokio::test]
async fn slices_missing_after_a_relist_count_as_a_wipe() {
    let mut h = Harness::new();
    let (_, g) = publish_stored(&mut h, h100s(1)).await;
    let (result, _) = h.reconcile(&g, Scenario::new()).await;
    assert!(result.is_ok(), "in sync");
    // The watch restarted and relisted: the slices are gone from the cache without any
    // delete event.
    h.relist_slices(&[]);
    withdrawn_after_wipe(&mut h, &g).await;
}

#[tokio::test]
async fn the_controllers_own_deletes_are_no_wipe() {
    let mut h = Harness::new();
    let (stored, g, count) = one_of_four_gpus_left(&mut h).await;
    let scenario = Scenario::new()
        .then_all(shrink(&stored, count, 2))
        .then(patch_status(|_| {}));
    let (result, served) = h.reconcile(&g, scenario).await;
    assert!(result.is_ok());
    let g = with_status_patch(g, &served.status_patches[0]);
    // The watch delivers the writes and the controller's own deletes.
    h.store_slices(&served.written);
    h.wipe_slices(&stored[count..]);
    assert!(!h.ctx.metrics.encode().contains("slice_wipes_total 1"));
    let (result, _) = h.reconcile(&g, Scenario::new()).await;
    assert!(requeue_secs(&result.unwrap()).is_some(), "still published");
}

/// `count` more GpuNodes of registered plugins whose last heartbeat was `seconds` ago.
fn other_nodes(h: &mut Harness, count: usize, seconds: i64) {
    for i in 0..count {
        let mut other = gpunode(Some(live_plugin()), h100s(1));
        let name = format!("node-other-{seconds}-{i}");
        other.metadata.name = Some(name.clone());
        other.spec.node_name = name.clone();
        h.put_gpunode(&other);
        h.put_lease(&name, ago(seconds));
    }
}

/// `node-a`'s heartbeat expires (last renewed two minutes ago) along with those of `stale`
/// other nodes, while `live` other nodes keep heartbeating.
fn expire_among(h: &mut Harness, stale: usize, live: usize) {
    other_nodes(h, stale, 120);
    other_nodes(h, live, 0);
    h.put_lease(NODE, ago(120));
}

/// Checks the gauges of expired heartbeats and of withdrawals held back for a mass expiry.
fn assert_expiries(h: &Harness, expired: usize, held: usize) {
    let metrics = h.ctx.metrics.encode();
    assert!(
        metrics.contains(&format!("migdra_controller_heartbeat_withdrawals_held {held}")),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!("migdra_controller_expired_heartbeats {expired}")),
        "{metrics}"
    );
}

/// node-a's Lease as the cache has it, which the server confirms (no later renewal).
fn unchanged_lease(h: &Harness) -> Step {
    let cached = h.ctx.heartbeats.heartbeat(NODE).expect("a cached Lease");
    get_lease(Some(cached.beat.renewed))
}

/// Reconciles `g` whose expired Lease the server confirms: its pool of `slices` slices is
/// withdrawn.
async fn confirmed_and_withdrawn(h: &mut Harness, g: &GpuNode, slices: usize) {
    let scenario = Scenario::new()
        .then(unchanged_lease(h))
        .then_all(withdrawal(slices, "PluginNotReady"));
    let (result, served) = h.reconcile(g, scenario).await;
    assert_eq!(result.unwrap(), Action::await_change());
    assert_eq!(served.deleted.len(), slices);
}

/// Reconciles `g` with nothing to call: its pool is kept, and looked at again within 10 s.
async fn kept_for_a_recheck(h: &mut Harness, g: &GpuNode) -> Served {
    let (result, served) = h.reconcile(g, Scenario::new()).await;
    let recheck = requeue_secs(&result.unwrap()).expect("looked at again soon");
    assert!(recheck <= 10, "{recheck}");
    served
}

#[tokio::test]
async fn most_heartbeats_expiring_at_once_withdraw_nothing() {
    let mut h = Harness::new();
    let (stored, g) = publish_stored(&mut h, h100s(1)).await;
    // node-a and three more nodes miss their heartbeats together, one node is fine: 4 of 5.
    expire_among(&mut h, 3, 1);
    kept_for_a_recheck(&mut h, &g).await;
    assert_expiries(&h, 4, 1);

    // An explicit "not registered" still withdraws.
    unregistered_withdraws(&mut h, &g, stored.len()).await;
}

#[tokio::test]
async fn a_few_expired_heartbeats_among_many_live_ones_withdraw() {
    let mut h = Harness::new();
    let (stored, g) = publish_stored(&mut h, h100s(1)).await;
    // node-a and two more are stale, four are fine: 3 of 7 is not a mass expiry.
    expire_among(&mut h, 2, 4);
    confirmed_and_withdrawn(&mut h, &g, stored.len()).await;
    assert_expiries(&h, 3, 0);
}

/// `stale`: the plugin's Lease was last renewed two minutes ago, which the reconcile
/// confirms with a fresh read of the Lease before withdrawing.
async fn withdrawn_when(
    plugin: Option<migdra_api::inventory::PluginStatus>,
    message: &'static str,
    stale: bool,
) {
    let mut h = Harness::new();
    let (stored, g) = publish_stored(&mut h, h100s(2)).await;
    let mut g = g;
    g.status.as_mut().unwrap().plugin = plugin;
    let reads = if stale {
        // One other node heartbeats: node-a's expiry is not every heartbeat's.
        other_nodes(&mut h, 1, 0);
        h.put_lease(NODE, ago(120));
        vec![unchanged_lease(&h)]
    } else {
        Vec::new()
    };
    let scenario = Scenario::new()
        .then_all(reads)
        .then_all((0..stored.len()).map(|i| delete_slice(&name(i))))
        .then(patch_status(move |body| {
            assert_eq!(condition(body), ("False", "PluginNotReady"));
            let text = body["status"]["conditions"][0]["message"].as_str().unwrap();
            assert!(text.contains(message), "{text}");
            let p = &body["status"]["publication"];
            assert_eq!((p["slices"].as_u64(), p["devices"].as_u64()), (Some(0), Some(0)));
            assert_eq!(p["generation"], 1, "the last generation is kept");
        }));
    let (result, served) = h.reconcile(&g, scenario).await;
    assert_eq!(result.unwrap(), Action::await_change());
    assert_eq!(served.deleted.len(), stored.len());
    assert!(h.ctx.metrics.encode().contains(&format!(
        "migdra_controller_published_devices{{node=\"{NODE}\"}} 0"
    )));

    // Withdrawn and recorded: nothing more to do.
    h.wipe_slices(&stored);
    let g = with_status_patch(g, &served.status_patches[0]);
    let (result, _) = h.reconcile(&g, Scenario::new()).await;
    assert!(result.is_ok());
}

#[tokio::test]
async fn an_unregistered_plugin_withdraws_the_pool() {
    withdrawn_when(Some(plugin(false, ago(0))), "not registered", false).await;
}

#[tokio::test]
async fn a_stale_heartbeat_withdraws_the_pool() {
    withdrawn_when(Some(live_plugin()), "last heartbeat", true).await;
}

#[tokio::test]
async fn a_missing_plugin_status_withdraws_the_pool() {
    withdrawn_when(None, "has not reported", false).await;
}

#[tokio::test]
async fn a_deleted_node_withdraws_the_pool() {
    let mut h = Harness::new();
    let (stored, g) = publish_stored(&mut h, h100s(1)).await;
    h.delete_node(NODE);
    let scenario = Scenario::new().then_all(withdrawal(stored.len(), "NodeNotFound"));
    let (result, served) = h.reconcile(&g, scenario).await;
    assert_eq!(result.unwrap(), Action::await_change());
    assert_eq!(served.deleted.len(), stored.len());
    assert!(!h.ctx.metrics.encode().contains(&format!("node=\"{NODE}\"")));
}

#[tokio::test]
async fn a_conflict_fails_the_reconcile_and_the_retry_succeeds() {
    let mut h = Harness::new();
    let (stored, g, count) = one_of_four_gpus_left(&mut h).await;
    let rv = |i: usize| stored[i].metadata.resource_version.clone().unwrap();

    // The second write loses a race: the reconcile fails, without event or status write.
    let scenario = Scenario::new()
        .then(replace_slice(&name(0), Some(&rv(0)), pool_slice(2, count)))
        .then(answering(
            replace_slice(&name(1), Some(&rv(1)), pool_slice(2, count)),
            Answer::Fail(StatusCode::CONFLICT, "Conflict"),
        ));
    let (result, served) = h.reconcile(&g, scenario).await;
    let err = result.unwrap_err();
    assert!(matches!(err, Error::Conflict { .. }), "{err}");
    assert_eq!(err.metric_label(), "conflict");
    assert_eq!(
        h.ctx.status_deferral.slice_writers(),
        0,
        "a failed publish no longer counts as writing"
    );
    let g = Arc::new(g);
    let first = error_policy(g.clone(), &err, h.ctx.clone());
    assert_eq!(requeue_secs(&first), Some(1));
    assert!(
        h.ctx
            .metrics
            .encode()
            .contains("migdra_controller_reconcile_errors_total{reason=\"conflict\"} 1")
    );

    // The watch delivers the first write; the retry writes a complete new generation.
    h.store_slices(&served.written);
    let mut cached = stored.clone();
    cached[0] = served.written[0].clone();
    let scenario = Scenario::new()
        .then_all(shrink(&cached, count, 3))
        .then(patch_status(|body| {
            assert_eq!(condition(body), ("True", "Published"));
            assert_eq!(body["status"]["publication"]["generation"], 3);
        }));
    let (result, _) = h.reconcile(&g, scenario).await;
    assert!(result.is_ok());
}

/// The MigPolicy "broken", naming a profile no GPU has.
fn unknown_profile_policy() -> MigPolicy {
    MigPolicy::new(
        "broken",
        MigPolicySpec {
            profiles: vec!["9x".into()],
            ..Default::default()
        },
    )
}

/// The calls of a refused policy: a status naming it, then an event.
fn policy_refused() -> Scenario {
    Scenario::new()
        .then(patch_status(|body| {
            assert_eq!(condition(body), ("False", "PolicyInvalid"));
            let text = body["status"]["conditions"][0]["message"].as_str().unwrap();
            assert!(text.contains("broken"), "{text}");
        }))
        .then(event("PolicyInvalid"))
}

#[tokio::test]
async fn an_invalid_policy_is_reported_and_nothing_is_written() {
    let mut h = Harness::new();
    h.add_policy(unknown_profile_policy());
    let g = gpunode(Some(live_plugin()), h100s(2));
    let scenario = policy_refused();
    let (result, served) = h.reconcile(&g, scenario).await;
    assert!(
        requeue_secs(&result.unwrap()).is_some(),
        "still watching the heartbeat"
    );
    assert!(served.written.is_empty());
    assert!(
        h.ctx
            .metrics
            .encode()
            .contains("migdra_controller_reconcile_errors_total{reason=\"policy\"} 1")
    );

    // Already reported: the next reconcile makes no call at all.
    let g = with_status_patch(g, &served.status_patches[0]);
    let (result, _) = h.reconcile(&g, Scenario::new()).await;
    assert!(result.is_ok());

    // A valid policy restricting the profiles publishes a smaller pool.
    h.add_policy(MigPolicy::new(
        "broken",
        MigPolicySpec {
            profiles: vec!["7g".into()],
            whole_gpus: Some(false),
            ..Default::default()
        },
    ));
    // A 7g on each GPU alone: nothing on a GPU can overlap it, so the pool needs no counters
    // and is one slice.
    let scenario = Scenario::new()
        .then(create_slice(&name(0), |s| {
            pool_slice(1, 1)(s);
            assert_eq!(s.spec.devices.as_ref().unwrap().len(), 2, "one 7g device per GPU");
            assert!(s.spec.shared_counters.is_none());
        }))
        .then(patch_status(|body| {
            assert_eq!(condition(body), ("True", "Published"));
            assert_eq!(body["status"]["publication"]["policy"], "broken");
        }));
    let (result, _) = h.reconcile(&g, scenario).await;
    assert!(result.is_ok());
}

#[tokio::test]
async fn quantities_the_server_rewrites_are_not_dropped_fields() {
    let mut h = Harness::new();
    // A100 40GB with MIG off: the whole GPU is a device with 40960Mi of memory.
    let a100 = migdra_api::catalog::model("A100-SXM4-40GB").unwrap();
    let gpus = vec![a100.inventory(0, false), a100.inventory(1, false)];
    let g = gpunode(Some(live_plugin()), gpus.clone());
    let (count, _) = expected_pool(&gpus);
    // Every slice comes back with its quantities as the API server writes them: the same
    // spec, so the pool is published.
    let scenario = Scenario::new()
        .then_all((0..count).map(|i| {
            answering(
                create_slice(&name(i), pool_slice(1, count)),
                Answer::StoreCanonical,
            )
        }))
        .then(patch_status(|body| {
            assert_eq!(condition(body), ("True", "Published"));
        }));
    let (result, served) = h.reconcile(&g, scenario).await;
    assert!(result.is_ok(), "{result:?}");
    let memory: Vec<String> = served
        .written
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .filter_map(|d| d.capacity.as_ref()?.get("memory").map(|c| c.value.0.clone()))
        .collect();
    assert_eq!(
        memory,
        ["40Gi", "40Gi"],
        "the server's answer had the canonical form"
    );
}

#[tokio::test]
async fn dropped_fields_are_an_error_with_event_and_condition() {
    let mut h = Harness::new();
    let g = gpunode(Some(live_plugin()), h100s(1));
    let (count, _) = expected_pool(&h100s(1));
    // The counter slice is stored without its counters (DRAPartitionableDevices off).
    let scenario = Scenario::new()
        .then(answering(
            create_slice(&name(0), pool_slice(1, count)),
            Answer::DropField("sharedCounters"),
        ))
        .then(event("FieldsDropped"))
        .then(patch_status(|body| {
            assert_eq!(condition(body), ("False", "FieldsDropped"));
        }));
    let (result, _) = h.reconcile(&g, scenario).await;
    let err = result.unwrap_err();
    assert!(matches!(err, Error::FieldsDropped { .. }), "{err}");
}

#[tokio::test]
async fn a_gpunode_of_another_driver_gets_none_of_our_slices() {
    let mut h = Harness::new();
    let (stored, g) = publish_stored(&mut h, h100s(1)).await;
    let mut g = g;
    g.spec.driver = "gpu.example.com".into();
    // Our slices go; the foreign GpuNode's status is left alone.
    let scenario = Scenario::new().then_all((0..stored.len()).map(|i| delete_slice(&name(i))));
    let (result, _) = h.reconcile(&g, scenario).await;
    assert_eq!(result.unwrap(), Action::await_change());
}

/// The device names in the written slices.
fn device_names(written: &[ResourceSlice]) -> Vec<String> {
    written
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .map(|d| d.name.clone())
        .collect()
}

#[tokio::test]
async fn a_claimed_device_the_policy_stops_offering_stays_tainted_until_released() {
    let mut h = Harness::new();
    let (stored, g) = publish_stored(&mut h, h100s(1)).await;
    const HELD: &str = "gpu-0-mig-3g40gb-4";
    assert!(device_names(&stored).contains(&HELD.to_string()));
    h.claim("training", &[HELD]);
    // 1g profiles with the media-engine one: the same counters are needed as for the default
    // pool (the memory slices and the single optical-flow engine), so only the device slice
    // changes.
    let only_1g = || {
        MigPolicy::new(
            "only-1g",
            MigPolicySpec {
                profiles: vec!["1g".into(), "1g+me".into()],
                whole_gpus: Some(false),
                ..Default::default()
            },
        )
    };
    h.add_policy(only_1g());
    let policy = only_1g().effective(Default::default()).unwrap();
    let (plan, _) = published_plan(&h100s(1), &policy, &Default::default());
    assert_eq!(
        plan.slice_count(),
        stored.len(),
        "one counter slice, one device slice"
    );
    let rv = |i: usize| stored[i].metadata.resource_version.clone().unwrap();
    // Only the device slice changes: one update, the generation stays. It gains a taint, so
    // its live version is read first (for the times of taints it may already have).
    let scenario = Scenario::new()
        .then(get_slice(stored[1].clone()))
        .then(replace_slice(&name(1), Some(&rv(1)), pool_slice(1, 2)))
        .then(patch_status(move |body| {
            assert_eq!(condition(body), ("True", "Published"));
            assert_eq!(body["status"]["publication"]["devices"], plan.devices.len() + 1);
            assert_eq!(body["status"]["publication"]["generation"], 1);
        }));
    let (result, served) = h.reconcile(&g, scenario).await;
    assert!(result.is_ok());
    let names = device_names(&served.written);
    assert!(names.contains(&HELD.to_string()), "{names:?}");
    assert!(
        names.iter().all(|n| n == HELD || n.contains("-mig-1g")),
        "{names:?}"
    );
    let held = served
        .written
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .find(|d| d.name == HELD)
        .unwrap();
    let taints = held.taints.as_ref().unwrap();
    assert_eq!(taints[0].key, "gpu.migdra.dev/not-offered");
    assert_eq!(taints[0].effect, "NoSchedule");
    assert!(
        held.consumes_counters.is_some(),
        "the scheduler still counts what it holds"
    );

    // Released: the device leaves the pool.
    let g = with_status_patch(g, &served.status_patches[0]);
    h.store_slices(&served.written);
    h.claim("training", &[]);
    let rv = served.written[0].metadata.resource_version.clone().unwrap();
    let scenario = Scenario::new()
        .then(replace_slice(&name(1), Some(&rv), pool_slice(1, 2)))
        .then(patch_status(|_| {}));
    let (result, served) = h.reconcile(&g, scenario).await;
    assert!(result.is_ok());
    assert!(!device_names(&served.written).contains(&HELD.to_string()));
}

#[tokio::test]
async fn a_single_slice_change_keeps_the_generation_and_the_taint_times() {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    let mut h = Harness::new();
    h.add_policy(MigPolicy::new(
        "taint",
        MigPolicySpec {
            unhealthy_gpus: Some(migdra_api::policy::UnhealthyGpus::Taint),
            ..Default::default()
        },
    ));
    let mut gpus = h100s(1);
    gpus[0].health.healthy = false;
    gpus[0].health.reason = Some("XID 79".into());
    let g = gpunode(Some(live_plugin()), gpus);
    let scenario = Scenario::new()
        .then(create_slice(&name(0), pool_slice(1, 2)))
        .then(create_slice(&name(1), pool_slice(1, 2)))
        .then(patch_status(|_| {}));
    let (result, served) = h.reconcile(&g, scenario).await;
    assert!(result.is_ok());
    // The API server stamped the taints when it stored them.
    let added = Time(Timestamp::from_second(1_750_000_000).unwrap());
    let mut stored = served.written.clone();
    let mut tainted = 0;
    for d in stored[1].spec.devices.iter_mut().flatten() {
        for t in d.taints.iter_mut().flatten() {
            t.time_added = Some(added.clone());
            tainted += 1;
        }
    }
    assert!(tainted > 0, "the unhealthy GPU's devices are tainted");
    h.store_slices(&stored);
    let g = with_status_patch(g, &served.status_patches[0]);

    // A new NVIDIA driver version changes every device's attributes: the device slice only.
    let mut g = g;
    g.status.as_mut().unwrap().plugin.as_mut().unwrap().driver_version = Some("580.95.05".into());
    let rv = stored[1].metadata.resource_version.clone().unwrap();
    // The cache has no specs: the live slice is read for its taint times.
    let live = stored[1].clone();
    let scenario = Scenario::new()
        .then(get_slice(live))
        .then(replace_slice(&name(1), Some(&rv), move |s| {
            assert_eq!(s.spec.pool.generation, 1, "one update: no new generation");
            let taints: Vec<_> = s
                .spec
                .devices
                .iter()
                .flatten()
                .flat_map(|d| d.taints.iter().flatten())
                .collect();
            assert_eq!(taints.len(), tainted);
            assert!(
                taints.iter().all(|t| t.time_added == Some(added.clone())),
                "a rewrite keeps when the taints were added"
            );
        }));
    // Same generation, same counts: the status already says it all.
    let (result, served) = h.reconcile(&g, scenario).await;
    assert!(result.is_ok());
    assert!(served.status_patches.is_empty());
}

/// The calls of a withdrawal of `slices` slices: each deleted, then a status saying
/// `Published=False` for `reason`.
fn withdrawal(slices: usize, reason: &'static str) -> Vec<Step> {
    let mut steps: Vec<Step> = (0..slices).map(|i| delete_slice(&name(i))).collect();
    steps.push(patch_status(move |body| {
        assert_eq!(condition(body), ("False", reason));
    }));
    steps
}

/// Reconciles `g` with its plugin reporting itself not registered: the pool of `slices`
/// slices is withdrawn at once, whatever holds back expiry.
async fn unregistered_withdraws(h: &mut Harness, g: &GpuNode, slices: usize) -> Served {
    let mut unregistered = g.clone();
    unregistered.status.as_mut().unwrap().plugin = Some(plugin(false, ago(0)));
    let scenario = Scenario::new().then_all(withdrawal(slices, "PluginNotReady"));
    let (result, served) = h.reconcile(&unregistered, scenario).await;
    assert_eq!(result.unwrap(), Action::await_change());
    served
}

/// Publishes a one-GPU pool, caches its slices, and leaves the plugin's Lease last renewed
/// `lease_age` seconds ago, while one other node heartbeats (so node-a's expiry is not every
/// heartbeat's, which would hold it).
async fn publish_leased(h: &mut Harness, lease_age: i64) -> (Vec<ResourceSlice>, GpuNode) {
    let (stored, g) = publish_stored(h, h100s(1)).await;
    other_nodes(h, 1, 0);
    h.put_lease(NODE, ago(lease_age));
    (stored, g)
}

#[tokio::test]
async fn lease_renewals_keep_a_node_live() {
    let mut h = Harness::new();
    let (_, g) = publish_leased(&mut h, 3).await;
    // Live through the Lease, however old the GpuNode: nothing to write; watched for the
    // Lease's expiry (25 s after the renewal).
    let (result, _) = h.reconcile(&g, Scenario::new()).await;
    let expiry = expiry_watched_in(&h, &result.unwrap());
    assert!((20..=22).contains(&expiry), "heartbeat expires in {expiry}s");
    assert!(h.ctx.heartbeats.is_live(NODE));
}

#[tokio::test]
async fn the_expiry_watch_hands_over_only_heartbeats_not_renewed_since() {
    let mut h = Harness::new();
    let (_, g) = publish_leased(&mut h, 3).await;
    let (result, _) = h.reconcile(&g, Scenario::new()).await;
    expiry_watched_in(&h, &result.unwrap());
    let first = h.ctx.heartbeats.live_until(NODE).unwrap();
    assert!(
        h.ctx.heartbeats.take_expired(Instant::now()).is_empty(),
        "not expired yet"
    );

    // Renewed before the expiry: moved to the renewal's expiry without a reconciliation.
    let renewed = h.put_lease(NODE, ago(0));
    assert!(h.ctx.heartbeats.take_expired(first).is_empty());
    let second = h.ctx.heartbeats.live_until(NODE).unwrap();
    assert_eq!(second, renewed + Duration::from_secs(25));
    assert!(
        h.ctx.heartbeats.is_live(NODE),
        "a renewal of a live node still triggers nothing"
    );

    // Not renewed again: handed to a reconciliation at that expiry, once; it stops counting
    // as live, so a late renewal triggers a reconciliation.
    assert_eq!(h.ctx.heartbeats.take_expired(second), vec![NODE.to_string()]);
    assert!(!h.ctx.heartbeats.is_live(NODE));
    assert!(
        h.ctx
            .heartbeats
            .take_expired(second + Duration::from_secs(60))
            .is_empty()
    );
}

#[tokio::test]
async fn a_lease_that_stops_being_renewed_withdraws_the_pool() {
    // The Lease, last renewed 40 s ago, says the plugin is gone; the server agrees.
    let mut h = Harness::new();
    let (stored, g) = publish_leased(&mut h, 40).await;
    let scenario = Scenario::new()
        .then(unchanged_lease(&h))
        .then_all((0..stored.len()).map(|i| delete_slice(&name(i))))
        .then(patch_status(|body| {
            assert_eq!(condition(body), ("False", "PluginNotReady"));
            let text = body["status"]["conditions"][0]["message"].as_str().unwrap();
            assert!(text.contains("heartbeat"), "{text}");
        }));
    let (result, _) = h.reconcile(&g, scenario).await;
    assert_eq!(result.unwrap(), Action::await_change());
    assert!(
        !h.ctx.heartbeats.is_live(NODE),
        "the next Lease renewal must trigger a reconcile"
    );
}

#[tokio::test]
async fn an_unchanged_pool_is_remembered_until_an_input_changes() {
    let mut h = Harness::new();
    let (stored, g) = publish_stored(&mut h, h100s(1)).await;
    // The publish left the memo the caches match once they show its writes; a full
    // computation over those caches finds the same inputs.
    let predicted = h.ctx.memos.get(NODE).expect("a publish leaves a memo");
    h.ctx.memos.set(NODE, None);
    let (result, _) = h.reconcile(&g, Scenario::new()).await;
    assert!(result.is_ok());
    let computed = h.ctx.memos.get(NODE).expect("the pool was found up to date");
    assert_eq!(computed.inputs, predicted.inputs);
    // Same inputs: still nothing to write (now without computing the pool).
    let (result, _) = h.reconcile(&g, Scenario::new()).await;
    assert!(result.is_ok());

    // A relabelled node falls under a policy: the memo must not hide that.
    h.add_policy(MigPolicy::new(
        "only-7g",
        MigPolicySpec {
            // With the media-engine 1g, whose placements the 7g overlaps: the pool keeps its
            // counters, so only the device slice is rewritten.
            profiles: vec!["7g".into(), "1g+me".into()],
            whole_gpus: Some(false),
            node_selector: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector {
                match_labels: Some([("tier".to_string(), "big".to_string())].into()),
                ..Default::default()
            }),
            ..Default::default()
        },
    ));
    let (result, _) = h.reconcile(&g, Scenario::new()).await;
    assert!(result.is_ok(), "the policy selects no label of this node yet");
    h.add_node(NODE, &[("gpu", "h100"), ("tier", "big")]);
    let count = stored.len();
    let scenario = Scenario::new()
        .then(replace_slice(&name(1), None, |s| {
            let devices = s.spec.devices.as_ref().unwrap();
            assert_eq!(devices.len(), 8, "one 7g placement and seven 1g+me");
        }))
        .then(patch_status(|body| {
            assert_eq!(body["status"]["publication"]["policy"], "only-7g");
        }));
    assert_eq!(count, 2);
    let (result, _) = h.reconcile(&g, scenario).await;
    assert!(result.is_ok());
    // Written: the memo now describes the caches after the write, not the ones before, so
    // the next reconciliation over the old cache waits for it instead of trusting it.
    let after_write = h.ctx.memos.get(NODE).expect("a publish leaves a memo");
    assert_ne!(after_write.inputs, computed.inputs);
    let (result, served) = h.reconcile(&g, Scenario::new()).await;
    assert!(requeue_secs(&result.unwrap()).is_some());
    assert!(served.written.is_empty() && served.status_patches.is_empty());
}

#[tokio::test]
async fn reconciliations_after_a_publish_reuse_its_memo_and_do_not_rewrite_its_status() {
    let mut h = Harness::new();
    let gpus = h100s(2);
    let (stored, with_status) = publish_fresh(&mut h, gpus.clone()).await;
    let predicted = h.ctx.memos.get(NODE).expect("a publish leaves a memo");
    assert!(
        predicted.gpunode_version.as_deref().is_some_and(|v| v != "1"),
        "the memo names the GpuNode version the status write produced: {predicted:?}"
    );
    h.store_slices(&stored);
    // The slice cache caught up, the GpuNode cache not yet (version 1, no status): the same
    // status is not applied again, and the memo is used (left as it was).
    let before_write = gpunode(Some(live_plugin()), gpus.clone());
    let (result, served) = h.reconcile(&before_write, Scenario::new()).await;
    assert!(requeue_secs(&result.unwrap()).is_some());
    assert!(served.status_patches.is_empty(), "no second status write");
    assert_eq!(h.ctx.memos.get(NODE), Some(predicted.clone()));
    // The GpuNode cache caught up: nothing to write either.
    let (result, served) = h.reconcile(&with_status, Scenario::new()).await;
    assert!(result.is_ok() && served.status_patches.is_empty());
    // Another version of the GpuNode without the controller's status (someone else wrote
    // it meanwhile): the status is written.
    let mut other_version = gpunode(Some(live_plugin()), gpus);
    other_version.metadata.resource_version = Some("2".into());
    let scenario = Scenario::new().then(patch_status(|body| {
        assert_eq!(condition(body), ("True", "Published"));
    }));
    let (result, served) = h.reconcile(&other_version, scenario).await;
    assert!(result.is_ok());
    assert_eq!(served.status_patches.len(), 1);
}

#[tokio::test]
async fn expiry_withdraws_at_most_one_pool_per_interval() {
    let mut h = Harness::new();
    let (stored, g) = publish_stored(&mut h, h100s(1)).await;
    other_nodes(&mut h, 6, 0);
    // Another node's pool was just withdrawn for an expired heartbeat.
    assert!(h.ctx.heartbeats.allow_expiry_withdrawal());
    assert!(!h.ctx.heartbeats.allow_expiry_withdrawal(), "one per interval");
    // node-a's heartbeat expires too (1 of 7: no mass expiry): kept for now, looked at again.
    h.put_lease(NODE, ago(120));
    kept_for_a_recheck(&mut h, &g).await;
    assert!(!h.ctx.heartbeats.is_live(NODE));
    // The limit holds back expiry only: an unregistered plugin is withdrawn at once.
    unregistered_withdraws(&mut h, &g, stored.len()).await;
}

#[tokio::test]
async fn an_expiry_the_api_server_refutes_keeps_the_pool() {
    // The cache shows the Lease last renewed 40 s ago (the watch lags behind a saturated API
    // server); the server has a renewal from a second ago.
    let mut h = Harness::new();
    let (_, g) = publish_leased(&mut h, 40).await;
    let scenario = Scenario::new().then(get_lease(Some(ago(1))));
    let (result, served) = h.reconcile(&g, scenario).await;
    assert!(served.deleted.is_empty() && served.status_patches.is_empty());
    // Live until the fresh renewal expires (25 s after it), looked at again then.
    let expiry = expiry_watched_in(&h, &result.unwrap());
    assert!((22..=24).contains(&expiry), "heartbeat expires in {expiry}s");
    assert!(h.ctx.heartbeats.is_live(NODE));
    let metrics = h.ctx.metrics.encode();
    assert!(
        metrics.contains(r#"migdra_controller_heartbeat_expiry_checks_total{outcome="refuted"} 1"#),
        "{metrics}"
    );
    assert!(
        h.ctx.heartbeats.allow_expiry_withdrawal(),
        "a refuted expiry uses up no withdrawal allowance"
    );
}

#[tokio::test]
async fn an_expiry_no_later_than_renewals_arrive_right_now_keeps_the_pool() {
    // Behind a saturated API server, renewals arrive 9 s later than the renewal before them
    // did (the 99th percentile's bucket: 10 s). A Lease last renewed 30 s ago is 5 s past its
    // 25 s timeout: that is the control plane, not a dead plugin.
    let mut h = Harness::new();
    let (stored, g) = publish_leased(&mut h, 30).await;
    late_renewals(&mut h, 40, Duration::from_secs(9), SignedDuration::ZERO);
    assert_eq!(h.ctx.heartbeats.allowance(), Duration::from_secs(10));
    // Kept without a read (the server is loaded enough) and looked at again soon.
    let served = kept_for_a_recheck(&mut h, &g).await;
    assert!(served.deleted.is_empty() && served.status_patches.is_empty());
    let metrics = h.ctx.metrics.encode();
    assert!(
        metrics.contains("migdra_controller_heartbeat_expiries_excused_total 1"),
        "{metrics}"
    );
    // 40 s old is later than that: confirmed by the server and withdrawn.
    h.put_lease(NODE, ago(40));
    confirmed_and_withdrawn(&mut h, &g, stored.len()).await;
}

#[tokio::test]
async fn a_few_late_renewals_give_no_allowance() {
    // Fewer late renewals than the allowance needs: none.
    let mut h = Harness::new();
    late_renewals(&mut h, 5, Duration::from_secs(60), SignedDuration::ZERO);
    assert_eq!(h.ctx.heartbeats.allowance(), Duration::ZERO);
    // Enough of them, far later than any cap: the cap.
    late_renewals(&mut h, 40, Duration::from_secs(600), SignedDuration::ZERO);
    assert_eq!(
        h.ctx.heartbeats.allowance(),
        migdra_controller::liveness::tracker::MAX_HEARTBEAT_ALLOWANCE
    );
}

/// Two renewals each of `nodes` other nodes, 15 s apart on the node's clock (which is off the
/// controller's by `skew`), the second reaching the controller `late` later than the first
/// did (the second arrives a second ago).
fn late_renewals(h: &mut Harness, nodes: usize, late: Duration, skew: SignedDuration) {
    let interval = Duration::from_secs(15);
    for i in 0..nodes {
        let name = format!("node-late-{}-{i}", late.as_secs());
        let renewed = Timestamp::now() + skew;
        let second = Duration::from_secs(1);
        h.put_lease_observed(&name, renewed - interval, before_now(second + interval + late));
        h.put_lease_observed(&name, renewed, before_now(second));
    }
}

/// Puts a Lease of node-a renewed every 15 s by a node whose clock is `skew` off the
/// controller's, each renewal observed as it was made: the last one a second ago.
fn skewed_renewals(h: &mut Harness, skew: SignedDuration) {
    for beat in [31, 16, 1] {
        let age = Duration::from_secs(beat);
        h.put_lease_observed(NODE, Timestamp::now() + skew - age, before_now(age));
    }
}

#[tokio::test]
async fn renewals_stamped_by_a_skewed_node_clock_keep_the_pool() {
    for skew in [SignedDuration::from_secs(-60), SignedDuration::from_secs(60)] {
        let mut h = Harness::new();
        let (_, g) = publish_stored(&mut h, h100s(1)).await;
        skewed_renewals(&mut h, skew);
        // Live for the timeout after the last renewal observed, nothing to write.
        let (result, served) = h.reconcile(&g, Scenario::new()).await;
        let expiry = expiry_watched_in(&h, &result.unwrap());
        assert!(
            (22..=24).contains(&expiry),
            "skew {skew}: heartbeat expires in {expiry}s"
        );
        assert!(served.written.is_empty() && served.status_patches.is_empty());
        assert!(h.ctx.heartbeats.is_live(NODE));
    }
}

#[tokio::test]
async fn a_skewed_ahead_lease_that_stops_being_renewed_withdraws_the_pool() {
    // The node's clock runs a minute ahead: its last renewal, observed 40 s ago, is stamped
    // 20 s in the controller's future. Expired 25 s after that observation all the same, and
    // the server has nothing later.
    let mut h = Harness::new();
    let (stored, g) = publish_stored(&mut h, h100s(1)).await;
    other_nodes(&mut h, 1, 0);
    let stamp = ago(40) + SignedDuration::from_secs(60);
    h.put_lease_observed(NODE, stamp, before_now(Duration::from_secs(40)));
    let scenario = Scenario::new()
        .then(get_lease(Some(stamp)))
        .then_all(withdrawal(stored.len(), "PluginNotReady"));
    let (result, served) = h.reconcile(&g, scenario).await;
    assert_eq!(result.unwrap(), Action::await_change());
    assert_eq!(served.deleted.len(), stored.len());
    assert!(!h.ctx.heartbeats.is_live(NODE));
}

#[tokio::test]
async fn skewed_node_clocks_give_no_allowance_to_other_nodes() {
    // Plenty of renewals from nodes a minute behind and a minute ahead, arriving on time.
    let mut h = Harness::new();
    for skew in [SignedDuration::from_secs(-60), SignedDuration::from_secs(60)] {
        late_renewals(&mut h, 30, Duration::ZERO, skew);
    }
    assert!(
        h.ctx.heartbeats.allowance() <= Duration::from_millis(100),
        "no more than punctual renewals give"
    );
    // node-a's heartbeat, 5 s past its timeout, is not excused: confirmed and withdrawn.
    let (stored, g) = publish_leased(&mut h, 30).await;
    confirmed_and_withdrawn(&mut h, &g, stored.len()).await;
    assert!(
        h.ctx
            .metrics
            .encode()
            .contains("migdra_controller_heartbeat_expiries_excused_total 0")
    );
}

#[tokio::test]
async fn a_single_nodes_silent_heartbeat_withdraws_its_pool() {
    // The only registered plugin's Lease stops changing, on a node without a kubelet Lease
    // (no witness): not held as a mass expiry; the confirmed expiry withdraws the pool before
    // the kubelet's wipe would.
    let mut h = Harness::new();
    let (stored, g) = publish_stored(&mut h, h100s(1)).await;
    h.put_lease(NODE, ago(120));
    confirmed_and_withdrawn(&mut h, &g, stored.len()).await;
    assert_expiries(&h, 1, 0);
}

/// A GpuNode of another registered plugin, `node`, whose Lease was last renewed `age` seconds
/// ago; returns it.
fn other_node(h: &mut Harness, node: &str, age: i64) -> GpuNode {
    let mut other = gpunode(Some(live_plugin()), h100s(1));
    other.metadata.name = Some(node.into());
    other.spec.node_name = node.into();
    h.put_gpunode(&other);
    h.put_lease(node, ago(age));
    other
}

/// The API server went silent two minutes ago: on each of `nodes` the kubelet renewed its
/// node Lease every 10 s until 125 s ago and the plugin its heartbeat until 120 s ago, and the
/// controller has observed nothing since.
fn silent_since_two_minutes(h: &mut Harness, nodes: &[&str]) {
    for node in nodes {
        h.renew_node_lease_between(node, Duration::from_secs(305), Duration::from_secs(125));
        h.put_lease(node, ago(120));
    }
}

/// Checks how often an expiry was held because the node's kubelet went quiet too.
fn assert_unwitnessed(h: &Harness, count: usize) {
    let metrics = h.ctx.metrics.encode();
    assert!(
        metrics.contains(&format!(
            "migdra_controller_heartbeat_expiries_unwitnessed_total {count}"
        )),
        "{metrics}"
    );
}

/// Reconciles `g`, whose plugin the controller has not seen renew since observations of the
/// node resumed `resumed` ago: live with a full timeout from then, nothing written.
async fn live_again_without_writes(h: &mut Harness, g: &GpuNode, resumed: Duration) {
    let (result, served) = h.reconcile(g, Scenario::new()).await;
    let expiry = expiry_watched_in(h, &result.unwrap());
    let left = HEARTBEAT_TIMEOUT.saturating_sub(resumed).as_secs() as i64;
    assert!(
        (left - 2..=left).contains(&expiry),
        "heartbeat expires in {expiry}s, {left}s expected"
    );
    assert!(served.written.is_empty() && served.deleted.is_empty() && served.status_patches.is_empty());
    assert!(h.ctx.heartbeats.is_live(NODE));
}

#[tokio::test]
async fn a_silent_api_server_withdraws_nothing_on_one_node_and_republishes_nothing_after() {
    let mut h = Harness::new();
    let (_, g) = publish_stored(&mut h, h100s(1)).await;
    // Neither the plugin's Lease nor the kubelet's was observed renewing for two minutes: the
    // controller cannot tell a dead plugin from its own view of the node stopping. Kept,
    // without a read, and looked at again soon.
    silent_since_two_minutes(&mut h, &[NODE]);
    kept_for_a_recheck(&mut h, &g).await;
    assert_expiries(&h, 1, 0);
    assert_unwitnessed(&h, 1);
    assert!(!h.ctx.heartbeats.is_live(NODE));

    // Observations flow again, the kubelet's renewal first: the plugin gets a full timeout
    // from that observation, not one long spent while the controller saw nothing.
    h.renew_node_lease(NODE, Duration::ZERO);
    live_again_without_writes(&mut h, &g, Duration::ZERO).await;
    // Its next renewal keeps it so: the pool was never withdrawn, so nothing is republished.
    heartbeat(&mut h);
    let (result, served) = h.reconcile(&g, Scenario::new()).await;
    expiry_watched_in(&h, &result.unwrap());
    assert!(served.written.is_empty() && served.status_patches.is_empty());
    assert_unwitnessed(&h, 1);
}

#[tokio::test]
async fn a_silent_api_server_withdraws_nothing_on_two_nodes_and_republishes_nothing_after() {
    let mut h = Harness::new();
    let (_, g) = publish_stored(&mut h, h100s(1)).await;
    other_node(&mut h, "node-b", 0);
    silent_since_two_minutes(&mut h, &[NODE, "node-b"]);
    // Both heartbeats expired, neither witnessed: two of two is no mass expiry, and neither
    // pool goes.
    kept_for_a_recheck(&mut h, &g).await;
    assert_expiries(&h, 2, 0);
    assert_unwitnessed(&h, 1);

    // Back: both kubelets' renewals arrive 3 s ago, the plugins' not yet.
    for node in [NODE, "node-b"] {
        h.renew_node_lease(node, Duration::from_secs(3));
    }
    live_again_without_writes(&mut h, &g, Duration::from_secs(3)).await;
    assert_expiries(&h, 0, 0);
}

#[tokio::test]
async fn a_dead_plugin_on_a_single_node_whose_kubelet_renews_is_withdrawn_in_the_usual_time() {
    let mut h = Harness::new();
    let (stored, g) = publish_stored(&mut h, h100s(1)).await;
    // The kubelet renews its node Lease every 10 s throughout; the plugin's last renewal was
    // observed 20 s ago: live for the rest of its 25 s timeout.
    h.renew_node_lease_between(NODE, Duration::from_secs(300), Duration::ZERO);
    h.put_lease(NODE, ago(20));
    let (result, _) = h.reconcile(&g, Scenario::new()).await;
    let expiry = expiry_watched_in(&h, &result.unwrap());
    assert!((3..=5).contains(&expiry), "heartbeat expires in {expiry}s");
    // 26 s without a renewal while the kubelet kept renewing: the plugin is dead, confirmed
    // and withdrawn, on one node.
    h.put_lease(NODE, ago(26));
    confirmed_and_withdrawn(&mut h, &g, stored.len()).await;
    assert_expiries(&h, 1, 0);
    assert_unwitnessed(&h, 0);
}

#[tokio::test]
async fn after_a_silence_the_timeout_restarts_from_the_first_fresh_observation() {
    // Silent from 125 s ago until the kubelet's renewals were observed again 40 s ago, every
    // 10 s since; the plugin's last renewal was observed before the silence. Its timeout ran
    // from 40 s ago: 15 s past it while the kubelet renewed, the plugin is dead.
    let mut h = Harness::new();
    let (stored, g) = publish_stored(&mut h, h100s(1)).await;
    silent_since_two_minutes(&mut h, &[NODE]);
    h.renew_node_lease_between(NODE, Duration::from_secs(40), Duration::ZERO);
    confirmed_and_withdrawn(&mut h, &g, stored.len()).await;
    assert_unwitnessed(&h, 0);
    // Observed again only 20 s ago: 5 s of its timeout left.
    let mut h = Harness::new();
    let (_, g) = publish_stored(&mut h, h100s(1)).await;
    silent_since_two_minutes(&mut h, &[NODE]);
    h.renew_node_lease_between(NODE, Duration::from_secs(20), Duration::ZERO);
    live_again_without_writes(&mut h, &g, Duration::from_secs(20)).await;
}

#[tokio::test]
async fn after_a_silence_on_many_nodes_the_late_plugins_are_not_withdrawn_one_by_one() {
    let mut h = Harness::new();
    let (_, g) = publish_stored(&mut h, h100s(1)).await;
    let others = ["node-b", "node-c", "node-d"];
    for node in others {
        other_node(&mut h, node, 0);
    }
    silent_since_two_minutes(&mut h, &[NODE, "node-b", "node-c", "node-d"]);
    kept_for_a_recheck(&mut h, &g).await;
    assert_expiries(&h, 4, 1);
    // Back: every kubelet renewed 2 s ago and the other three plugins too; node-a's plugin
    // has not yet. One stale heartbeat of four is no mass expiry, but node-a's timeout
    // restarted with its kubelet's fresh renewal: nothing is withdrawn.
    for node in [NODE, "node-b", "node-c", "node-d"] {
        h.renew_node_lease(node, Duration::from_secs(2));
    }
    for node in others {
        h.put_lease(node, ago(2));
    }
    live_again_without_writes(&mut h, &g, Duration::from_secs(2)).await;
    assert_expiries(&h, 0, 0);
}

#[tokio::test]
async fn kubelet_renewals_more_than_half_their_lease_apart_start_a_new_run() {
    let mut h = Harness::new();
    let witness = |h: &Harness| h.ctx.heartbeats.heartbeat(NODE).unwrap().witness.unwrap();
    assert_eq!(
        h.ctx.heartbeats.heartbeat(NODE).unwrap().witness,
        None,
        "no kubelet Lease yet"
    );
    let first = h.renew_node_lease(NODE, Duration::from_secs(100));
    // Every 10 s, and once 19 s after the last (less than half the 40 s Lease): one run.
    h.renew_node_lease_between(NODE, Duration::from_secs(90), Duration::from_secs(60));
    let late = h.renew_node_lease(NODE, Duration::from_secs(41));
    assert_eq!(witness(&h).since, first);
    assert_eq!(witness(&h).last, late);
    // 21 s later: the controller could not see the node in between; a new run.
    let resumed = h.renew_node_lease(NODE, Duration::from_secs(20));
    assert_eq!((witness(&h).since, witness(&h).last), (resumed, resumed));
    // An older state of the Lease (a lagging watch) is no renewal.
    let lease = node_lease(NODE, ago(60), 1);
    h.ctx.heartbeats.observe_node_lease(&lease, Instant::now());
    assert_eq!(witness(&h).last, resumed);
    // Deleted, or missing from a relist: no witness.
    h.ctx.heartbeats.retain_node_leases(|node| node != NODE);
    assert_eq!(h.ctx.heartbeats.heartbeat(NODE).unwrap().witness, None);
}

#[tokio::test]
async fn mass_expiry_holds_whatever_the_kubelets_say() {
    // The kubelets of all five nodes renew; four plugins stopped: still a mass expiry, held.
    let mut h = Harness::new();
    let (_, g) = publish_stored(&mut h, h100s(1)).await;
    expire_among(&mut h, 3, 1);
    for i in 0..3 {
        let node = format!("node-other-120-{i}");
        h.renew_node_lease_between(&node, Duration::from_secs(300), Duration::ZERO);
    }
    h.renew_node_lease_between(NODE, Duration::from_secs(300), Duration::ZERO);
    kept_for_a_recheck(&mut h, &g).await;
    assert_expiries(&h, 4, 1);
    assert_unwitnessed(&h, 0);
}

#[tokio::test]
async fn an_expiry_that_cannot_be_confirmed_keeps_the_pool() {
    let mut h = Harness::new();
    let (stored, stale) = publish_leased(&mut h, 120).await;
    let failing = answering(
        unchanged_lease(&h),
        Answer::Fail(StatusCode::INTERNAL_SERVER_ERROR, "InternalError"),
    );
    // No delete, no status write, no event: an overloaded API server is not loaded further.
    let (result, served) = h.reconcile(&stale, Scenario::new().then(failing)).await;
    let error = result.unwrap_err();
    assert!(matches!(error, Error::HeartbeatUnconfirmed { .. }), "{error}");
    assert!(error.to_string().contains("its pool is kept"), "{error}");
    assert!(served.deleted.is_empty() && served.status_patches.is_empty() && served.events.is_empty());
    let metrics = h.ctx.metrics.encode();
    assert!(
        metrics.contains(r#"migdra_controller_heartbeat_expiry_checks_total{outcome="failed"} 1"#),
        "{metrics}"
    );
    // Retried with backoff; once the server answers, the expiry is confirmed and withdraws.
    confirmed_and_withdrawn(&mut h, &stale, stored.len()).await;
    assert!(
        h.ctx
            .metrics
            .encode()
            .contains(r#"migdra_controller_heartbeat_expiry_checks_total{outcome="confirmed"} 1"#)
    );
}

/// Checks that `count` status writes have been deferred so far.
fn assert_deferred(h: &Harness, count: usize) {
    let metrics = h.ctx.metrics.encode();
    let total = metrics
        .lines()
        .find(|l| l.starts_with("migdra_controller_status_writes_deferred_total "))
        .unwrap_or_else(|| panic!("no deferral counter in\n{metrics}"));
    assert_eq!(
        total,
        format!("migdra_controller_status_writes_deferred_total {count}")
    );
}

/// Publishes `g`'s pool on a fresh node while others write slices: the slices are written
/// (returned as stored), the status is not.
async fn publish_deferred(h: &mut Harness, g: &GpuNode) -> Vec<ResourceSlice> {
    let gpus = g.status.as_ref().unwrap().gpus.clone().unwrap();
    let (count, _) = expected_pool(&gpus);
    let scenario = Scenario::new().then_all((0..count).map(|i| create_slice(&name(i), pool_slice(1, count))));
    let (result, served) = h.reconcile(g, scenario).await;
    let recheck = requeue_secs(&result.unwrap()).expect("looked at again soon");
    assert!(recheck <= 2, "recheck after {recheck}s");
    assert_eq!(served.written.len(), count);
    assert!(served.status_patches.is_empty(), "the status waits");
    served.written
}

#[tokio::test]
async fn a_published_status_waits_while_other_reconciliations_write_slices() {
    let mut h = Harness::new();
    let ctx = h.ctx.clone();
    let others = ctx.status_deferral.writing_slices();
    let gpus = h100s(2);
    let (_, devices) = expected_pool(&gpus);
    let g = gpunode(Some(live_plugin()), gpus);
    let stored = publish_deferred(&mut h, &g).await;
    assert_deferred(&h, 1);
    assert_eq!(
        h.ctx.status_deferral.slice_writers(),
        1,
        "its own writes are done; the others' are not"
    );
    // No status write: the GpuNode keeps the version the cache has.
    let predicted = h.ctx.memos.get(NODE).expect("a publish leaves a memo");
    assert_eq!(predicted.gpunode_version.as_deref(), Some("1"));

    // The slice cache caught up, the others still write: the memo leads straight to the
    // status write, which waits again.
    h.store_slices(&stored);
    let (result, served) = h.reconcile(&g, Scenario::new()).await;
    let recheck = requeue_secs(&result.unwrap()).unwrap();
    assert!(recheck <= 2, "recheck after {recheck}s");
    assert!(served.status_patches.is_empty());
    assert_eq!(h.ctx.memos.get(NODE), Some(predicted), "the memo was used");
    assert_deferred(&h, 2);

    // No one writes slices any more: the status goes out, once.
    drop(others);
    let scenario = Scenario::new().then(patch_status(move |body| {
        assert_eq!(condition(body), ("True", "Published"));
        assert_eq!(body["status"]["publication"]["generation"], 1);
        assert_eq!(body["status"]["publication"]["devices"], devices);
    }));
    let (result, served) = h.reconcile(&g, scenario).await;
    let expiry = expiry_watched_in(&h, &result.unwrap());
    assert!((20..=25).contains(&expiry), "heartbeat expires in {expiry}s");
    assert_eq!(served.status_patches.len(), 1);
    // The cache still shows the GpuNode without it: written already, not again.
    let (result, served) = h.reconcile(&g, Scenario::new()).await;
    assert!(result.is_ok() && served.status_patches.is_empty());
    assert_deferred(&h, 2);
}

#[tokio::test]
async fn a_deferred_status_is_written_after_the_bound_while_slices_are_still_written() {
    let bound = Duration::from_millis(300);
    let mut h = Harness::with_config(|c| c.status_defer_max = bound);
    let ctx = h.ctx.clone();
    let _others = ctx.status_deferral.writing_slices();
    let g = gpunode(Some(live_plugin()), h100s(1));
    let stored = publish_deferred(&mut h, &g).await;
    h.store_slices(&stored);
    // Waiting since the first deferral for longer than the bound: written, others or not.
    tokio::time::sleep(bound + Duration::from_millis(100)).await;
    let scenario = Scenario::new().then(patch_status(|body| {
        assert_eq!(condition(body), ("True", "Published"));
    }));
    let (result, served) = h.reconcile(&g, scenario).await;
    let expiry = expiry_watched_in(&h, &result.unwrap());
    assert!((20..=25).contains(&expiry), "heartbeat expires in {expiry}s");
    assert_eq!(served.status_patches.len(), 1);
    assert_deferred(&h, 1);
    assert_eq!(h.ctx.status_deferral.slice_writers(), 1);
}

#[tokio::test]
async fn a_zero_bound_never_defers() {
    let mut h = Harness::with_config(|c| c.status_defer_max = Duration::ZERO);
    let ctx = h.ctx.clone();
    let _others = ctx.status_deferral.writing_slices();
    publish_fresh(&mut h, h100s(1)).await;
    assert_deferred(&h, 0);
}

#[tokio::test]
async fn a_withdrawal_writes_its_status_at_once_while_slices_are_written() {
    let mut h = Harness::new();
    let (stored, g) = publish_stored(&mut h, h100s(1)).await;
    let ctx = h.ctx.clone();
    let _others = ctx.status_deferral.writing_slices();
    let served = unregistered_withdraws(&mut h, &g, stored.len()).await;
    assert_eq!(served.status_patches.len(), 1);
    assert_deferred(&h, 0);
}

#[tokio::test]
async fn a_refused_policy_writes_its_status_at_once_while_slices_are_written() {
    let mut h = Harness::new();
    h.add_policy(unknown_profile_policy());
    let ctx = h.ctx.clone();
    let _others = ctx.status_deferral.writing_slices();
    let g = gpunode(Some(live_plugin()), h100s(1));
    let scenario = policy_refused();
    let (result, served) = h.reconcile(&g, scenario).await;
    assert!(requeue_secs(&result.unwrap()).is_some());
    assert!(served.written.is_empty());
    assert_deferred(&h, 0);
}

#[tokio::test]
async fn a_status_waits_a_quiet_period_after_the_last_slice_write() {
    // Nobody is writing slices any more, but another pool's writes ended a moment ago: with
    // a quiet period, this pool's status still waits; once it has passed, it goes out.
    let quiet = Duration::from_millis(300);
    let mut h = Harness::with_config(|c| c.status_defer_quiet = quiet);
    drop(h.ctx.status_deferral.writing_slices());
    assert_eq!(h.ctx.status_deferral.slice_writers(), 0);
    let g = gpunode(Some(live_plugin()), h100s(1));
    let stored = publish_deferred(&mut h, &g).await;
    h.store_slices(&stored);
    assert_deferred(&h, 1);
    tokio::time::sleep(quiet + Duration::from_millis(100)).await;
    let scenario = Scenario::new().then(patch_status(|body| {
        assert_eq!(condition(body), ("True", "Published"));
    }));
    let (result, served) = h.reconcile(&g, scenario).await;
    assert!(result.is_ok());
    assert_eq!(served.status_patches.len(), 1);
}
