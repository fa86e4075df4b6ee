//! The claim says what it got: after a prepare the plugin writes this driver's
//! `status.devices` entries (MIG UUID, parent GPU, instance IDs, profile, placement; or the
//! whole GPU's UUID), removes them at unprepare, never fails or holds up a prepare over them
//! (they are written in the background, in order per claim) and retries failed writes. And `adminAccess` on a whole GPU: device nodes, nothing created or reserved.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::sync::Arc;

use migdra_kubelet_plugin::{driver::ClaimFailure, metrics::Metrics, plan::Rejection};
use serde_json::json;

use dra_kubelet::DraDriver;

use migdra_testkit::plugin::*;

/// Another driver's entry, which the plugin must never touch.
fn foreign_entry() -> serde_json::Value {
    json!({"driver": "net.example.com", "pool": "p", "device": "eth0", "data": {"mac": "x"}})
}

/// A claim allocated `results`, with another driver's status entry in place.
fn claim_with_foreign_entry(
    uid: &str,
    name: &str,
    results: &[(&str, &str)],
) -> k8s_openapi::api::resource::v1::ResourceClaim {
    let mut claim = claim(uid, name, results);
    claim.status.as_mut().unwrap().devices = Some(vec![serde_json::from_value(foreign_entry()).unwrap()]);
    claim
}

fn ours(status: &serde_json::Value) -> Vec<serde_json::Value> {
    status
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["driver"] == DRIVER)
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn prepare_writes_what_the_claim_got_and_unprepare_removes_only_that() {
    // GPU 0 in MIG mode, GPU 1 not.
    let node = Node::new(&[("H100-80GB", true), ("H100-80GB", false)]);
    node.claims.put(claim_with_foreign_entry(
        "uid-mig",
        "mig",
        &[("gpu", "gpu-0-mig-3g40gb-4")],
    ));
    node.claims.put(claim("uid-whole", "whole", &[("gpu", "gpu-1")]));
    let (driver, _) = node.start(None);
    prepare_one(&driver, "uid-mig", "mig").await.unwrap();
    prepare_one(&driver, "uid-whole", "whole").await.unwrap();
    status_written(&driver).await;

    let state = node.host.read_state().unwrap();
    let gi = &state.gpus[0].gpu_instances[0];
    let mig_uuid = gi.compute_instances[0].uuid.clone();
    let status = node.claims.device_status("mig");
    let entries = ours(&status);
    assert_eq!(entries.len(), 1, "{status}");
    let entry = &entries[0];
    assert_eq!(entry["pool"], POOL);
    assert_eq!(entry["device"], "gpu-0-mig-3g40gb-4");
    assert_eq!(
        entry["data"],
        json!({
            "type": "mig",
            "uuid": mig_uuid,
            "parentUUID": state.gpus[0].uuid,
            "gpuIndex": 0,
            "gpuMinor": 0,
            "gpuInstanceID": gi.id,
            "computeInstanceID": gi.compute_instances[0].id,
            "profile": "3g.40gb",
            "placement": {"start": 4, "size": 4},
        })
    );
    let ready = &entry["conditions"][0];
    assert_eq!(
        (ready["type"].as_str(), ready["status"].as_str()),
        (Some("Ready"), Some("True"))
    );
    assert_eq!(ready["reason"], "MigDeviceCreated");
    assert!(ready["message"].as_str().unwrap().contains(&mig_uuid), "{ready}");
    // The other driver's entry is as it was.
    assert!(status.as_array().unwrap().contains(&foreign_entry()), "{status}");

    let whole = ours(&node.claims.device_status("whole"));
    assert_eq!(
        whole[0]["data"],
        json!({"type": "gpu", "uuid": state.gpus[1].uuid, "gpuIndex": 1, "gpuMinor": 1})
    );
    assert_eq!(whole[0]["conditions"][0]["reason"], "GpuPrepared");

    // Server-side applies of the status subresource, by the plugin's own field manager,
    // naming nothing but the claim and this driver's entries.
    let writes = node.claims.status_writes();
    assert_eq!(writes.len(), 2);
    for write in &writes {
        assert_eq!(write.field_manager, "gpu.migdra.dev/kubelet-plugin");
        assert!(write.accepted);
        assert!(write.object["status"].get("allocation").is_none());
        assert!(
            write.object["status"]["devices"]
                .as_array()
                .unwrap()
                .iter()
                .all(|d| d["driver"] == DRIVER)
        );
    }

    // Answered again from the checkpoint: no second write.
    prepare_one(&driver, "uid-mig", "mig").await.unwrap();
    status_written(&driver).await;
    assert_eq!(node.claims.status_writes().len(), 2);

    unprepare_one(&driver, "uid-mig", "mig").await.unwrap();
    status_written(&driver).await;
    let status = node.claims.device_status("mig");
    assert!(ours(&status).is_empty(), "{status}");
    assert_eq!(status, json!([foreign_entry()]));
    // A claim never prepared here is not written at unprepare.
    unprepare_one(&driver, "uid-unknown", "unknown").await.unwrap();
    status_written(&driver).await;
    assert_eq!(node.claims.status_writes().len(), 3);
    assert!(driver.claim_status_pending().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_status_write_never_fails_the_prepare_and_is_retried() {
    let node = Node::new(&[("H100-80GB", true)]);
    node.claims
        .put(claim("uid-a", "a", &[("gpu", "gpu-0-mig-1g10gb-0")]));
    let metrics = Metrics::new();
    let (driver, _) = node.try_start_with(None, metrics.clone()).unwrap();
    node.claims.set_status_failing(true);
    let prepared = prepare_one(&driver, "uid-a", "a").await.unwrap();
    assert_eq!(prepared[0].device_name, "gpu-0-mig-1g10gb-0");
    assert_eq!(node.total_instances(), 1);
    status_written(&driver).await;
    assert_eq!(driver.claim_status_pending(), ["uid-a"]);
    let text = metrics.encode();
    assert!(
        text.contains(
            r#"migdra_kubelet_plugin_claim_status_writes_total{operation="ready",outcome="failed"} 1"#
        ) && text.contains("migdra_kubelet_plugin_claim_status_pending 1"),
        "{text}"
    );

    // Still failing: kept.
    let round = driver.retry_claim_status().await;
    assert_eq!(round.failed, ["uid-a"]);
    node.claims.set_status_failing(false);
    let round = driver.retry_claim_status().await;
    assert_eq!(round.written, ["uid-a"]);
    assert!(driver.claim_status_pending().is_empty());
    let entries = ours(&node.claims.device_status("a"));
    assert_eq!(entries[0]["data"]["profile"], "1g.10gb");

    // The removal at unprepare is retried too, until the entries are gone.
    node.claims.set_status_failing(true);
    unprepare_one(&driver, "uid-a", "a").await.unwrap();
    assert_eq!(node.total_instances(), 0);
    status_written(&driver).await;
    assert_eq!(driver.claim_status_pending(), ["uid-a"]);
    node.claims.set_status_failing(false);
    assert_eq!(driver.retry_claim_status().await.written, ["uid-a"]);
    assert!(ours(&node.claims.device_status("a")).is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_retry_gives_up_on_claims_that_are_gone_replaced_or_unprepared() {
    let node = Node::new(&[("H100-80GB", true)]);
    node.claims
        .put(claim("uid-gone", "gone", &[("gpu", "gpu-0-mig-1g10gb-0")]));
    node.claims
        .put(claim("uid-old", "replaced", &[("gpu", "gpu-0-mig-1g10gb-1")]));
    node.claims
        .put(claim("uid-done", "done", &[("gpu", "gpu-0-mig-1g10gb-2")]));
    let (driver, _) = node.start(None);
    node.claims.set_status_failing(true);
    for (uid, name) in [
        ("uid-gone", "gone"),
        ("uid-old", "replaced"),
        ("uid-done", "done"),
    ] {
        prepare_one(&driver, uid, name).await.unwrap();
    }
    status_written(&driver).await;
    assert_eq!(driver.claim_status_pending().len(), 3);
    node.claims.remove("default", "gone");
    node.claims
        .put(claim("uid-new", "replaced", &[("gpu", "gpu-0-mig-1g10gb-1")]));
    // Unprepared while its ready status was pending: the removal replaces the ready write.
    unprepare_one(&driver, "uid-done", "done").await.unwrap();
    status_written(&driver).await;
    node.claims.set_status_failing(false);
    let mut round = driver.retry_claim_status().await;
    round.dropped.sort();
    assert_eq!(round.dropped, ["uid-gone", "uid-old"]);
    // The cleared claim had none of our entries: nothing to write, done.
    assert_eq!(round.written, ["uid-done"]);
    assert!(driver.claim_status_pending().is_empty());
    // The replacement claim was never written.
    assert!(ours(&node.claims.device_status("replaced")).is_empty());
    let written_to_new = node
        .claims
        .status_writes()
        .iter()
        .filter(|w| w.accepted && w.object["metadata"]["uid"] == "uid-new")
        .count();
    assert_eq!(written_to_new, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_plugin_writes_the_status_of_claims_prepared_before() {
    let node = Node::new(&[("H100-80GB", true)]);
    node.claims
        .put(claim("uid-a", "a", &[("gpu", "gpu-0-mig-2g20gb-2")]));
    {
        let (driver, _) = node.start(None);
        node.claims.set_status_failing(true);
        prepare_one(&driver, "uid-a", "a").await.unwrap();
        status_written(&driver).await;
    }
    node.claims.set_status_failing(false);
    let (driver, _) = node.start(None);
    assert!(driver.claim_status_pending().is_empty());
    let inventory = driver.gpus().inventory().unwrap();
    driver.queue_recorded_claim_status(&inventory);
    assert_eq!(driver.retry_claim_status().await.written, ["uid-a"]);
    let entries = ours(&node.claims.device_status("a"));
    let uuid = node.instances(0)[0].2[0].clone();
    assert_eq!(entries[0]["data"]["uuid"], uuid.as_str());
    assert_eq!(entries[0]["data"]["placement"], json!({"start": 2, "size": 2}));
}

#[tokio::test(flavor = "multi_thread")]
async fn admin_access_to_a_whole_gpu_in_use_creates_changes_and_reserves_nothing() {
    let node = Node::new(&[("H100-80GB", true)]);
    node.claims
        .put(claim("uid-work", "work", &[("gpu", "gpu-0-mig-3g40gb-0")]));
    node.claims
        .put(admin_claim("uid-watch", "watch", &[("monitor", "gpu-0")]));
    node.claims
        .put(claim("uid-more", "more", &[("gpu", "gpu-0-mig-3g40gb-4")]));
    let metrics = Metrics::new();
    let (driver, _) = node.try_start_with(None, metrics.clone()).unwrap();
    prepare_one(&driver, "uid-work", "work").await.unwrap();
    let before = node.instances(0);

    let prepared = prepare_one(&driver, "uid-watch", "watch").await.unwrap();
    assert_eq!(prepared[0].device_name, "gpu-0");
    assert_eq!(prepared[0].request_names, ["monitor"]);
    // Nothing created or switched; no record that could block anyone.
    assert_eq!(node.instances(0), before);
    let state = node.host.read_state().unwrap();
    assert!(
        state.gpus[0].mig_enabled && state.gpus[0].mig_pending,
        "MIG mode unchanged"
    );
    assert!(!driver.recorded_claims().contains_key("uid-watch"));
    // The GPU's device nodes, with the MIG monitor capability (so the agent sees every
    // instance) and no instance's capabilities.
    let spec = node.cdi_spec("uid-watch");
    let device = &spec["devices"][0];
    assert_eq!(device["name"], "uid-watch-gpu-0");
    let paths: Vec<&str> = device["containerEdits"]["deviceNodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["path"].as_str().unwrap())
        .collect();
    assert_eq!(
        paths,
        [
            "/dev/nvidia0",
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/nvidia-uvm-tools",
            "/dev/nvidia-caps/nvidia-cap2"
        ]
    );
    status_written(&driver).await;
    let entries = ours(&node.claims.device_status("watch"));
    assert_eq!(entries[0]["data"]["adminAccess"], true);
    assert_eq!(entries[0]["data"]["uuid"], state.gpus[0].uuid.as_str());
    assert_eq!(entries[0]["conditions"][0]["reason"], "AdminAccessGranted");

    // Others keep using the GPU while it is watched.
    prepare_one(&driver, "uid-more", "more").await.unwrap();
    assert_eq!(node.instances(0).len(), 2);
    // Not counted as a prepared claim.
    driver.gpus().inventory().unwrap();
    assert_eq!(driver.recorded_claims().len(), 2);

    unprepare_one(&driver, "uid-watch", "watch").await.unwrap();
    assert!(!node.cdi().has_claim_spec("uid-watch"));
    assert_eq!(node.instances(0).len(), 2, "the others' instances stay");
    status_written(&driver).await;
    assert!(ours(&node.claims.device_status("watch")).is_empty());
    let text = metrics.encode();
    assert!(!text.contains("AdminAccess"), "no failure counted: {text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn admin_access_to_a_mig_device_is_refused_with_a_clear_reason() {
    let node = Node::new(&[("H100-80GB", true)]);
    node.claims
        .put(admin_claim("uid-x", "x", &[("monitor", "gpu-0-mig-1g10gb-0")]));
    let mut mixed = admin_claim(
        "uid-y",
        "y",
        &[("monitor", "gpu-0"), ("work", "gpu-0-mig-1g10gb-1")],
    );
    mixed
        .status
        .as_mut()
        .and_then(|s| s.allocation.as_mut())
        .and_then(|a| a.devices.as_mut())
        .and_then(|d| d.results.as_mut())
        .unwrap()[1]
        .admin_access = None;
    node.claims.put(mixed);
    let (driver, _) = node.start(None);
    match prepare_typed(&driver, "uid-x", "x").await {
        Err(ClaimFailure::Rejected(Rejection::AdminAccessMigDevice { device })) => {
            assert_eq!(device, "gpu-0-mig-1g10gb-0")
        }
        other => panic!("expected AdminAccessMigDevice, got {other:?}"),
    }
    let message = prepare_one(&driver, "uid-x", "x").await.unwrap_err();
    assert!(
        message.contains("adminAccess is only supported for whole GPUs"),
        "{message}"
    );
    match prepare_typed(&driver, "uid-y", "y").await {
        Err(ClaimFailure::Rejected(r)) => assert_eq!(r.reason(), "AdminAccessMixed"),
        other => panic!("expected AdminAccessMixed, got {other:?}"),
    }
    assert_eq!(node.total_instances(), 0);
    assert!(node.cdi_specs().is_empty());
    assert!(driver.claim_status_queued().is_empty());
    assert!(node.claims.status_writes().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn after_a_failed_write_the_queued_ones_wait_for_the_retry() {
    let node = Node::new(&[("H100-80GB", true)]);
    node.claims
        .put(claim("uid-a", "a", &[("gpu", "gpu-0-mig-1g10gb-0")]));
    node.claims
        .put(claim("uid-b", "b", &[("gpu", "gpu-0-mig-1g10gb-1")]));
    let metrics = Metrics::new();
    let (driver, _) = node.try_start_with(None, metrics.clone()).unwrap();
    node.claims.set_status_failing(true);
    // Held while the first write is in flight, so the second claim is queued behind it.
    let gate = node.claims.block_status().await;
    let out = driver
        .prepare(vec![claim_ref("uid-a", "a"), claim_ref("uid-b", "b")])
        .await;
    assert!(out["uid-a"].is_ok() && out["uid-b"].is_ok());
    wait_until("the first write started", || {
        node.claims.status_writes_started() == 1
    })
    .await;
    drop(gate);
    status_written(&driver).await;
    // One write tried; the other claim moved to the retry without a try.
    assert_eq!(node.claims.status_writes().len(), 1);
    assert_eq!(driver.claim_status_pending(), ["uid-a", "uid-b"]);
    let text = metrics.encode();
    assert!(
        text.contains(
            r#"migdra_kubelet_plugin_claim_status_writes_total{operation="ready",outcome="deferred"} 1"#
        ) && text.contains(
            r#"migdra_kubelet_plugin_claim_status_writes_total{operation="ready",outcome="failed"} 1"#
        ) && text.contains("migdra_kubelet_plugin_claim_status_pending 2"),
        "{text}"
    );
    node.claims.set_status_failing(false);
    let mut written = driver.retry_claim_status().await.written;
    written.sort();
    assert_eq!(written, ["uid-a", "uid-b"]);
    for name in ["a", "b"] {
        assert_eq!(ours(&node.claims.device_status(name)).len(), 1, "{name}");
    }
    assert!(
        metrics
            .encode()
            .contains("migdra_kubelet_plugin_claim_status_pending 0")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_status_of_a_claim_replaced_under_the_same_name_is_never_touched() {
    let node = Node::new(&[("H100-80GB", true)]);
    node.claims
        .put(claim("uid-old", "c", &[("gpu", "gpu-0-mig-1g10gb-0")]));
    let (driver, _) = node.start(None);
    prepare_one(&driver, "uid-old", "c").await.unwrap();
    status_written(&driver).await;
    // The claim is deleted and created again under its name; the new one is prepared
    // elsewhere and has an entry of this driver already.
    let mut replacement = claim("uid-new", "c", &[("gpu", "gpu-0-mig-1g10gb-1")]);
    let theirs = json!({"driver": DRIVER, "pool": POOL, "device": "gpu-0-mig-1g10gb-1"});
    replacement.status.as_mut().unwrap().devices =
        Some(vec![serde_json::from_value(theirs.clone()).unwrap()]);
    node.claims.put(replacement);
    // Unpreparing the old one removes its instance; its status write names the old UID and is
    // refused, and not retried.
    unprepare_one(&driver, "uid-old", "c").await.unwrap();
    assert_eq!(node.total_instances(), 0);
    status_written(&driver).await;
    let last = node.claims.status_writes().pop().unwrap();
    assert_eq!(last.object["metadata"]["uid"], "uid-old");
    assert!(!last.accepted);
    assert!(driver.claim_status_pending().is_empty());
    assert_eq!(node.claims.device_status("c"), json!([theirs]));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_another_instance_unprepared_is_not_written_back_as_ready() {
    // Two plugin instances on one node (a rolling update), sharing the checkpoint.
    let node = Node::new(&[("H100-80GB", true)]);
    node.claims
        .put(claim("uid-a", "a", &[("gpu", "gpu-0-mig-1g10gb-0")]));
    let (old, _) = node.start(None);
    node.claims.set_status_failing(true);
    prepare_one(&old, "uid-a", "a").await.unwrap();
    status_written(&old).await;
    assert_eq!(old.claim_status_pending(), ["uid-a"]);
    node.claims.set_status_failing(false);
    let (new, _) = node.start(None);
    unprepare_one(&new, "uid-a", "a").await.unwrap();
    assert_eq!(node.total_instances(), 0);
    status_written(&new).await;
    // The old instance's pending ready write finds the claim no longer prepared.
    let round = old.retry_claim_status().await;
    assert_eq!(round.dropped, ["uid-a"]);
    assert!(ours(&node.claims.device_status("a")).is_empty());
}

/// Whether `entries` (a `status.devices` write) say ready, or clear.
fn is_ready_write(write: &StatusWrite) -> bool {
    !write.object["status"]["devices"].as_array().unwrap().is_empty()
}

#[tokio::test(flavor = "multi_thread")]
async fn prepare_answers_while_the_status_api_is_stuck_and_the_status_lands_after() {
    let node = Node::new(&[("H100-80GB", true)]);
    node.claims
        .put(claim("uid-a", "a", &[("gpu", "gpu-0-mig-1g10gb-0")]));
    let (driver, _) = node.start(None);
    let gate = node.claims.block_status().await;
    let prepared = prepare_one(&driver, "uid-a", "a").await.unwrap();
    assert_eq!(prepared[0].device_name, "gpu-0-mig-1g10gb-0");
    // Answered; the write waits (queued or held in flight), nothing written yet.
    assert_eq!(driver.claim_status_queued(), ["uid-a"]);
    assert!(ours(&node.claims.device_status("a")).is_empty());
    assert!(node.claims.status_writes().is_empty());
    drop(gate);
    status_written(&driver).await;
    let entries = ours(&node.claims.device_status("a"));
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0]["conditions"][0]["status"], "True");
    assert_eq!(entries[0]["data"]["profile"], "1g.10gb");
    assert!(driver.claim_status_pending().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_claim_unprepared_while_its_ready_write_is_stuck_ends_cleared_and_ready_again_after() {
    let node = Node::new(&[("H100-80GB", true)]);
    node.claims
        .put(claim("uid-a", "a", &[("gpu", "gpu-0-mig-1g10gb-0")]));
    let (driver, _) = node.start(None);
    let gate = node.claims.block_status().await;
    prepare_one(&driver, "uid-a", "a").await.unwrap();
    // The ready write is in flight (held) when the unprepare asks for the clear.
    wait_until("the ready write started", || {
        node.claims.status_writes_started() == 1
    })
    .await;
    unprepare_one(&driver, "uid-a", "a").await.unwrap();
    assert_eq!(node.total_instances(), 0);
    assert_eq!(driver.claim_status_queued(), ["uid-a"]);
    drop(gate);
    status_written(&driver).await;
    // Only if a write outlived the write timeout on a loaded machine: the retry finishes it.
    if !driver.claim_status_pending().is_empty() {
        driver.retry_claim_status().await;
    }
    let status = node.claims.device_status("a");
    assert!(ours(&status).is_empty(), "{status}");
    // The order of the accepted writes: the ready one (if it landed), then the clear; never
    // a ready write after the clear.
    let accepted: Vec<bool> = node
        .claims
        .status_writes()
        .iter()
        .filter(|w| w.accepted)
        .map(is_ready_write)
        .collect();
    assert_eq!(accepted.last(), Some(&false), "{accepted:?}");
    assert!(
        accepted.iter().filter(|ready| **ready).count() <= 1,
        "{accepted:?}"
    );
    assert!(driver.claim_status_pending().is_empty());

    // Prepared again: ready again.
    prepare_one(&driver, "uid-a", "a").await.unwrap();
    status_written(&driver).await;
    let entries = ours(&node.claims.device_status("a"));
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0]["conditions"][0]["status"], "True");
    assert!(is_ready_write(node.claims.status_writes().last().unwrap()));
}

#[tokio::test(flavor = "multi_thread")]
async fn requests_queued_behind_a_stuck_write_are_coalesced_latest_wins() {
    let node = Node::new(&[("H100-80GB", true)]);
    node.claims
        .put(claim("uid-a", "a", &[("gpu", "gpu-0-mig-1g10gb-0")]));
    node.claims
        .put(claim("uid-b", "b", &[("gpu", "gpu-0-mig-1g10gb-1")]));
    let (driver, _) = node.start(None);
    let gate = node.claims.block_status().await;
    prepare_one(&driver, "uid-a", "a").await.unwrap();
    wait_until("the first write started", || {
        node.claims.status_writes_started() == 1
    })
    .await;
    // Behind it: b prepared, unprepared and prepared again; one entry for b, the latest.
    for _ in 0..2 {
        prepare_one(&driver, "uid-b", "b").await.unwrap();
        unprepare_one(&driver, "uid-b", "b").await.unwrap();
    }
    prepare_one(&driver, "uid-b", "b").await.unwrap();
    assert_eq!(driver.claim_status_queued(), ["uid-a", "uid-b"]);
    drop(gate);
    status_written(&driver).await;
    let writes = node.claims.status_writes();
    let to_b: Vec<bool> = writes
        .iter()
        .filter(|w| w.name == "b")
        .map(is_ready_write)
        .collect();
    assert_eq!(to_b, [true], "one write for b, the latest request");
    assert_eq!(ours(&node.claims.device_status("b")).len(), 1);
    assert_eq!(ours(&node.claims.device_status("a")).len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plugin_stopped_before_its_status_write_leaves_it_to_the_next_start() {
    let node = Node::new(&[("H100-80GB", true)]);
    node.claims
        .put(claim("uid-a", "a", &[("gpu", "gpu-0-mig-1g10gb-3")]));
    {
        // The kubelet got its answer; the status never got written before the plugin stopped.
        let (driver, _) = node.start(None);
        node.claims.set_status_failing(true);
        prepare_one(&driver, "uid-a", "a").await.unwrap();
        status_written(&driver).await;
        assert_eq!(driver.claim_status_pending(), ["uid-a"]);
    }
    node.claims.set_status_failing(false);
    assert!(ours(&node.claims.device_status("a")).is_empty());
    let (driver, _) = node.start(None);
    let shutdown = tokio_util::sync::CancellationToken::new();
    // What the plugin runs: its first pass queues every prepared claim's status.
    let retries = tokio::spawn(
        driver
            .clone()
            .run_claim_status_retries(std::time::Duration::from_secs(30), shutdown.clone()),
    );
    wait_until("the restarted plugin wrote the status", || {
        ours(&node.claims.device_status("a")).len() == 1
    })
    .await;
    let entries = ours(&node.claims.device_status("a"));
    assert_eq!(entries[0]["data"]["uuid"], node.instances(0)[0].2[0].as_str());
    assert!(driver.claim_status_pending().is_empty());
    // Shutting down does not wait for the next pass.
    shutdown.cancel();
    tokio::time::timeout(std::time::Duration::from_secs(20), retries)
        .await
        .expect("the status task stops at shutdown")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_queued_ready_write_of_a_claim_another_instance_unprepared_is_dropped() {
    // Two plugin instances on one node (a rolling update), sharing the checkpoint.
    let node = Node::new(&[("H100-80GB", true)]);
    node.claims
        .put(claim("uid-x", "x", &[("gpu", "gpu-0-mig-1g10gb-0")]));
    node.claims
        .put(claim("uid-a", "a", &[("gpu", "gpu-0-mig-1g10gb-1")]));
    let (old, _) = node.start(None);
    let gate = node.claims.block_status().await;
    prepare_one(&old, "uid-x", "x").await.unwrap();
    wait_until("x's write started", || node.claims.status_writes_started() == 1).await;
    // a's ready write waits behind x's when the new instance unprepares a.
    prepare_one(&old, "uid-a", "a").await.unwrap();
    let (new, _) = node.start(None);
    unprepare_one(&new, "uid-a", "a").await.unwrap();
    drop(gate);
    status_written(&old).await;
    status_written(&new).await;
    let to_a: Vec<bool> = node
        .claims
        .status_writes()
        .iter()
        .filter(|w| w.name == "a")
        .map(is_ready_write)
        .collect();
    assert_eq!(to_a, [false], "only the new instance's clear");
    assert!(ours(&node.claims.device_status("a")).is_empty());
    assert_eq!(ours(&node.claims.device_status("x")).len(), 1);
    assert!(old.claim_status_pending().is_empty());
}

/// An inventory that read the GPUs before a prepare switched MIG mode on must not report (or
/// leave behind) the old mode: an adminAccess claim after it still gets the monitor capability.
#[tokio::test(flavor = "multi_thread")]
async fn an_inventory_begun_before_a_mode_switch_does_not_undo_it() {
    let node = Node::new(&[("H100-80GB", false)]);
    node.claims
        .put(claim("uid-work", "work", &[("gpu", "gpu-0-mig-3g40gb-0")]));
    node.claims
        .put(admin_claim("uid-watch", "watch", &[("monitor", "gpu-0")]));
    let backend = Arc::new(GatedBackend::new(node.nvml()));
    let (driver, _) = node.start_over(backend.clone(), None, Metrics::new()).unwrap();
    let gate = backend.close_after_discovery();
    let inventory = tokio::task::spawn_blocking({
        let gpus = driver.gpus().clone();
        move || gpus.inventory()
    });
    wait_until("the inventory read MIG off and waits", || backend.waiting() == 1).await;
    // The prepare switches MIG on while the inventory holds its answer.
    prepare_one(&driver, "uid-work", "work").await.unwrap();
    assert!(node.host.read_state().unwrap().gpus[0].mig_enabled);
    drop(gate);
    let inventory = inventory.await.unwrap().unwrap();
    assert_eq!(
        inventory[0].mig.as_ref().map(|m| m.enabled),
        Some(true),
        "{inventory:?}"
    );

    prepare_one(&driver, "uid-watch", "watch").await.unwrap();
    let spec = node.cdi_spec("uid-watch");
    let paths: Vec<&str> = spec["devices"][0]["containerEdits"]["deviceNodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["path"].as_str().unwrap())
        .collect();
    assert!(
        paths.contains(&"/dev/nvidia-caps/nvidia-cap2"),
        "no monitor capability: {paths:?}"
    );
}
