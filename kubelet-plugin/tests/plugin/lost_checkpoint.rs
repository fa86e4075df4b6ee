//! A lost checkpoint (corrupt, or of a newer format) never leaks migdra's instances: at start
//! the plugin rebuilds the records of the claims still allocated here (which later unprepare
//! normally), destroys the instances of claims that are gone, and leaves the instance an admin
//! made by hand, from the claims' CDI specs and the inventory it last published.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::fs;

use migdra_api::inventory::GpuInventory;
use migdra_kubelet_plugin::{
    checkpoint::{ClaimState, DeviceKind, LoadOutcome},
    driver::OwnershipReport,
    metrics::Metrics,
};
use migdra_testkit::plugin::*;

const KEPT: &str = "gpu-0-mig-3g40gb-0";
const DELETED: &str = "gpu-1-mig-2g20gb-2";

/// GPU 0 holds a hand-made 1g.10gb at 6; claims c1 (kept) and c2 (deleted later) are prepared.
/// Returns the inventory the status loop would have published.
async fn prepared_node() -> (Node, Vec<GpuInventory>) {
    let node = Node::two_h100s_with_a_foreign_1g();
    node.claims.put(claim("uid-1", "c1", &[("gpu", KEPT)]));
    node.claims.put(claim("uid-2", "c2", &[("gpu", DELETED)]));
    let (driver, _) = node.start(None);
    prepare_one(&driver, "uid-1", "c1").await.unwrap();
    prepare_one(&driver, "uid-2", "c2").await.unwrap();
    let published = driver.gpus().inventory().unwrap();
    assert_eq!(node.total_instances(), 3);
    (node, published)
}

fn checkpoint_path(node: &Node) -> std::path::PathBuf {
    node.state_dir().join("checkpoint.json")
}

/// Flips the checkpoint's content so its checksum no longer matches.
fn corrupt(node: &Node) {
    let text = fs::read_to_string(checkpoint_path(node)).unwrap();
    fs::write(
        checkpoint_path(node),
        text.replace("PrepareCompleted", "PrepareStarted"),
    )
    .unwrap();
}

/// Replaces the checkpoint with one of a format this binary does not know.
fn newer_format(node: &Node) {
    use sha2::Digest;
    let data = r#"{"version":2,"bootId":"boot-1","claims":{},"somethingNew":[]}"#;
    let checksum = format!("sha256:{}", hex::encode(sha2::Sha256::digest(data.as_bytes())));
    fs::write(
        checkpoint_path(node),
        format!(r#"{{"checksum":"{checksum}","data":{data}}}"#),
    )
    .unwrap();
}

fn metric(metrics: &Metrics, line: &str) -> bool {
    metrics.encode().lines().any(|l| l == line)
}

/// Restarts, recovers, and checks the outcome every variant shares: c1 kept and recorded with
/// the IDs NVML reports, c2's instance destroyed, the hand-made one untouched; then c1
/// unprepares normally.
async fn restart_and_check(node: &Node, published: &[GpuInventory]) -> OwnershipReport {
    node.claims.remove("default", "c2");
    let metrics = Metrics::new();
    let (driver, report) = node.try_start_with(None, metrics.clone()).unwrap();
    assert!(
        matches!(report.checkpoint, Some(LoadOutcome::Unreadable { .. })),
        "{report:?}"
    );
    assert!(
        driver.recorded_claims().is_empty(),
        "nothing is known before the recovery"
    );
    let lost = driver
        .recover_lost_records(published)
        .await
        .unwrap()
        .expect("the checkpoint was lost");
    assert_eq!(lost.kept, ["uid-1"], "{lost:?}");
    assert_eq!(lost.destroyed.len(), 1, "{lost:?}");
    assert!(lost.destroyed[0].contains("GPU 1"), "{lost:?}");
    assert_eq!(lost.foreign, 1, "{lost:?}");
    assert!(lost.undecided.is_empty(), "{lost:?}");
    for verdict in ["kept", "destroyed", "foreign"] {
        assert!(
            metric(
                &metrics,
                &format!(r#"migdra_kubelet_plugin_lost_record_instances_total{{verdict="{verdict}"}} 1"#)
            ),
            "{}",
            metrics.encode()
        );
    }

    // GPU 0: c1's 3g.40gb at 0 and the hand-made 1g.10gb at 6; GPU 1: nothing.
    let mut gpu0: Vec<(u32, u32)> = node.instances(0).iter().map(|i| (i.0, i.1)).collect();
    gpu0.sort();
    assert_eq!(gpu0, [(9, 0), (19, 6)]);
    assert!(node.instances(1).is_empty(), "{:?}", node.instances(1));

    // The record carries what NVML reports now; the CDI spec hands out that instance.
    let records = driver.recorded_claims();
    let record = &records["uid-1"];
    assert_eq!(record.state, ClaimState::PrepareCompleted);
    assert_eq!(
        (record.namespace.as_str(), record.name.as_str()),
        ("default", "c1")
    );
    let DeviceKind::Mig {
        start: 0,
        mig_uuid: Some(uuid),
        ..
    } = &record.devices[0].kind
    else {
        panic!("{record:?}")
    };
    let on_gpu = node.instances(0).into_iter().find(|i| i.1 == 0).unwrap();
    assert_eq!(on_gpu.2, std::slice::from_ref(uuid));
    let spec = node.cdi_spec("uid-1");
    let env = spec["devices"][0]["containerEdits"]["env"].to_string();
    assert!(env.contains(uuid.as_str()), "{env}");
    assert_eq!(spec["annotations"]["gpu.migdra.dev/claim-name"], "c1");
    assert_eq!(
        node.cdi_specs().len(),
        1,
        "c2's spec is removed: {:?}",
        node.cdi_specs()
    );

    // The kubelet's retried prepare is answered from the record; unprepare tears it down.
    let devices = prepare_one(&driver, "uid-1", "c1").await.unwrap();
    assert_eq!(devices[0].device_name, KEPT);
    assert_eq!(node.instances(0).len(), 2, "nothing new was created");
    unprepare_one(&driver, "uid-1", "c1").await.unwrap();
    let gpu0: Vec<(u32, u32)> = node.instances(0).iter().map(|i| (i.0, i.1)).collect();
    assert_eq!(gpu0, [(19, 6)], "only the hand-made instance is left");
    assert!(node.cdi_specs().is_empty());
    lost
}

#[tokio::test(flavor = "multi_thread")]
async fn a_corrupt_checkpoint_is_recovered_from_the_cdi_specs() {
    let (node, _) = prepared_node().await;
    corrupt(&node);
    // No GpuNode could be read: the CDI specs alone decide.
    restart_and_check(&node, &[]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_newer_format_checkpoint_is_recovered_from_the_published_inventory() {
    let (node, published) = prepared_node().await;
    newer_format(&node);
    // /var/run/cdi is a tmpfs: the claims' specs may be gone too; the GpuNode still tells.
    for spec in node.cdi_specs() {
        fs::remove_file(spec).unwrap();
    }
    restart_and_check(&node, &published).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unreadable_claim_leaves_its_instance_alone() {
    let (node, published) = prepared_node().await;
    corrupt(&node);
    node.claims.set_unreachable(true);
    let (driver, _) = node.start(None);
    let lost = driver.recover_lost_records(&published).await.unwrap().unwrap();
    assert!(lost.kept.is_empty() && lost.destroyed.is_empty(), "{lost:?}");
    assert_eq!(lost.undecided.len(), 2, "{lost:?}");
    assert_eq!(node.total_instances(), 3, "nothing is destroyed on a guess");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_readable_checkpoint_needs_no_recovery() {
    let (node, published) = prepared_node().await;
    let (driver, _) = node.start(None);
    assert!(!driver.records_lost());
    assert_eq!(driver.recover_lost_records(&published).await.unwrap(), None);
    assert_eq!(driver.recorded_claims().len(), 2);
}
