//! Resource health over a real unix socket, through v1alpha1 and v1 clients.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dra_kubelet::DeviceHealthReport;
use migdra_proto::health::{v1, v1alpha1};
use migdra_testkit::dra_kubelet::{GUARD, Harness, channel};
use tokio_stream::StreamExt;

fn report(device: &str, healthy: Option<bool>, message: &str) -> DeviceHealthReport {
    DeviceHealthReport {
        pool_name: "node-a".to_string(),
        device_name: device.to_string(),
        healthy,
        message: message.to_string(),
    }
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64
}

fn initial_devices() -> Vec<DeviceHealthReport> {
    vec![
        report("dev-0", Some(true), "ok"),
        report("dev-1", Some(false), &"x".repeat(3000)),
        report("dev-2", None, "health probe failed"),
    ]
}

/// (device name, health, message length) per device, for comparing snapshots.
fn summary_v1alpha1(response: &v1alpha1::NodeWatchResourcesResponse) -> Vec<(String, i32, usize)> {
    response
        .devices
        .iter()
        .map(|d| {
            let id = d.device.as_ref().expect("device id");
            assert_eq!(id.pool_name, "node-a");
            (id.device_name.clone(), d.health, d.message.chars().count())
        })
        .collect()
}

fn summary_v1(response: &v1::NodeWatchResourcesResponse) -> Vec<(String, i32, usize)> {
    response
        .devices
        .iter()
        .map(|d| {
            let id = d.device.as_ref().expect("device id");
            assert_eq!(id.pool_name, "node-a");
            (id.device_name.clone(), d.health, d.message.chars().count())
        })
        .collect()
}

#[tokio::test]
async fn v1alpha1_sends_full_list_at_once_and_on_change() {
    // A resend interval far beyond the test, so every message after the first is a change.
    let mut h = Harness::start(initial_devices(), Duration::from_secs(3600)).await;
    let mut client =
        v1alpha1::dra_resource_health_client::DraResourceHealthClient::new(channel(&h.dra_socket).await);
    let before = now();
    let mut stream = client
        .node_watch_resources(v1alpha1::NodeWatchResourcesRequest {})
        .await
        .expect("watch")
        .into_inner();

    let first = tokio::time::timeout(GUARD, stream.next())
        .await
        .expect("in time")
        .expect("item")
        .expect("ok");
    assert_eq!(
        summary_v1alpha1(&first),
        vec![
            ("dev-0".to_string(), v1alpha1::HealthStatus::Healthy as i32, 2),
            (
                "dev-1".to_string(),
                v1alpha1::HealthStatus::Unhealthy as i32,
                1024
            ),
            ("dev-2".to_string(), v1alpha1::HealthStatus::Unknown as i32, 19),
        ]
    );
    for device in &first.devices {
        assert!(
            device.last_updated_time >= before && device.last_updated_time <= now(),
            "Unix seconds"
        );
        // Three resend intervals exceed the kubelet's 30 s default, so the timeout is announced.
        assert_eq!(device.health_check_timeout_seconds, 3 * 3600);
    }
    assert_eq!(first.devices[0].message, "ok");

    h.health.send_replace(vec![
        report("dev-0", Some(false), "XID 79"),
        report("dev-1", Some(true), ""),
    ]);
    let second = tokio::time::timeout(GUARD, stream.next())
        .await
        .expect("in time")
        .expect("item")
        .expect("ok");
    assert_eq!(
        summary_v1alpha1(&second),
        vec![
            ("dev-0".to_string(), v1alpha1::HealthStatus::Unhealthy as i32, 6),
            ("dev-1".to_string(), v1alpha1::HealthStatus::Healthy as i32, 0),
        ]
    );
    assert_eq!(second.devices[0].message, "XID 79");
    h.stop().await;
}

#[tokio::test]
async fn v1_sends_full_list_at_once_and_on_change() {
    let mut h = Harness::start(initial_devices(), Duration::from_secs(3600)).await;
    let mut client =
        v1::dra_resource_health_client::DraResourceHealthClient::new(channel(&h.dra_socket).await);
    let mut stream = client
        .node_watch_resources(v1::NodeWatchResourcesRequest {})
        .await
        .expect("watch")
        .into_inner();

    let first = tokio::time::timeout(GUARD, stream.next())
        .await
        .expect("in time")
        .expect("item")
        .expect("ok");
    assert_eq!(
        summary_v1(&first),
        vec![
            ("dev-0".to_string(), v1::HealthStatus::Healthy as i32, 2),
            ("dev-1".to_string(), v1::HealthStatus::Unhealthy as i32, 1024),
            ("dev-2".to_string(), v1::HealthStatus::Unknown as i32, 19),
        ]
    );

    h.health.send_replace(Vec::new());
    let second = tokio::time::timeout(GUARD, stream.next())
        .await
        .expect("in time")
        .expect("item")
        .expect("ok");
    assert!(second.devices.is_empty(), "an emptied list is sent too");

    h.health.send_replace(vec![report("dev-3", None, "")]);
    let third = tokio::time::timeout(GUARD, stream.next())
        .await
        .expect("in time")
        .expect("item")
        .expect("ok");
    assert_eq!(
        summary_v1(&third),
        vec![("dev-3".to_string(), v1::HealthStatus::Unknown as i32, 0)]
    );
    h.stop().await;
}

#[tokio::test]
async fn both_versions_resend_the_full_list_periodically() {
    let mut h = Harness::start(initial_devices(), Duration::from_millis(100)).await;
    let channel = channel(&h.dra_socket).await;
    let mut alpha = v1alpha1::dra_resource_health_client::DraResourceHealthClient::new(channel.clone())
        .node_watch_resources(v1alpha1::NodeWatchResourcesRequest {})
        .await
        .expect("watch v1alpha1")
        .into_inner();
    let mut stable = v1::dra_resource_health_client::DraResourceHealthClient::new(channel)
        .node_watch_resources(v1::NodeWatchResourcesRequest {})
        .await
        .expect("watch v1")
        .into_inner();

    // Without any change, each stream keeps delivering the complete list.
    let expected = vec![
        ("dev-0".to_string(), 1, 2),
        ("dev-1".to_string(), 2, 1024),
        ("dev-2".to_string(), 0, 19),
    ];
    for _ in 0..3 {
        let a = tokio::time::timeout(GUARD, alpha.next())
            .await
            .expect("in time")
            .expect("item")
            .expect("ok");
        assert_eq!(summary_v1alpha1(&a), expected);
        assert!(
            a.devices.iter().all(|d| d.health_check_timeout_seconds == 0),
            "kubelet default timeout"
        );
        let b = tokio::time::timeout(GUARD, stable.next())
            .await
            .expect("in time")
            .expect("item")
            .expect("ok");
        assert_eq!(summary_v1(&b), expected);
    }
    h.stop().await;
}

#[tokio::test]
async fn streams_end_when_the_server_shuts_down() {
    let mut h = Harness::start(initial_devices(), Duration::from_secs(3600)).await;
    let mut client =
        v1::dra_resource_health_client::DraResourceHealthClient::new(channel(&h.dra_socket).await);
    let mut stream = client
        .node_watch_resources(v1::NodeWatchResourcesRequest {})
        .await
        .expect("watch")
        .into_inner();
    tokio::time::timeout(GUARD, stream.next())
        .await
        .expect("in time")
        .expect("item")
        .expect("ok");

    // An open stream must not hold up the shutdown (stop() fails after the guard otherwise).
    h.stop().await;
    let end = tokio::time::timeout(GUARD, stream.next())
        .await
        .expect("stream ended in time");
    assert!(
        end.is_none_or(|item| item.is_err()),
        "no further snapshots after shutdown"
    );
}
