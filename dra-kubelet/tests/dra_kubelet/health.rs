//! Resource health over a real unix socket, through v1alpha1 and v1 clients.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dra_kubelet::DeviceHealthReport;
use migdra_proto::health::{v1, v1alpha1};
use migdra_testkit::dra_kubelet::{GUARD, Harness, channel};
use tokio_stream::StreamExt;
use tonic::{Streaming, transport::Channel};

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

/// (device name, health, message length) per device of a v1 or v1alpha1 snapshot, for
/// comparing snapshots. A macro: the two versions' messages are different types.
macro_rules! summary {
    ($response:expr) => {
        $response
            .devices
            .iter()
            .map(|d| {
                let id = d.device.as_ref().expect("device id");
                assert_eq!(id.pool_name, "node-a");
                (id.device_name.clone(), d.health, d.message.chars().count())
            })
            .collect::<Vec<(String, i32, usize)>>()
    };
}

async fn watch_v1alpha1(channel: Channel) -> Streaming<v1alpha1::NodeWatchResourcesResponse> {
    v1alpha1::dra_resource_health_client::DraResourceHealthClient::new(channel)
        .node_watch_resources(v1alpha1::NodeWatchResourcesRequest {})
        .await
        .expect("watch v1alpha1")
        .into_inner()
}

async fn watch_v1(channel: Channel) -> Streaming<v1::NodeWatchResourcesResponse> {
    v1::dra_resource_health_client::DraResourceHealthClient::new(channel)
        .node_watch_resources(v1::NodeWatchResourcesRequest {})
        .await
        .expect("watch v1")
        .into_inner()
}

/// The next snapshot on `stream`, within the guard.
async fn next<T>(stream: &mut Streaming<T>) -> T {
    tokio::time::timeout(GUARD, stream.next())
        .await
        .expect("in time")
        .expect("item")
        .expect("ok")
}

#[tokio::test]
async fn v1alpha1_sends_full_list_at_once_and_on_change() {
    // A resend interval far beyond the test, so every message after the first is a change.
    let mut h = Harness::start(initial_devices(), Duration::from_secs(3600)).await;
    let channel = channel(&h.dra_socket).await;
    let before = now();
    let mut stream = watch_v1alpha1(channel).await;

    let first = next(&mut stream).await;
    assert_eq!(
        summary!(first),
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
    let second = next(&mut stream).await;
    assert_eq!(
        summary!(second),
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
    let mut stream = watch_v1(channel(&h.dra_socket).await).await;

    let first = next(&mut stream).await;
    assert_eq!(
        summary!(first),
        vec![
            ("dev-0".to_string(), v1::HealthStatus::Healthy as i32, 2),
            ("dev-1".to_string(), v1::HealthStatus::Unhealthy as i32, 1024),
            ("dev-2".to_string(), v1::HealthStatus::Unknown as i32, 19),
        ]
    );

    h.health.send_replace(Vec::new());
    let second = next(&mut stream).await;
    assert!(second.devices.is_empty(), "an emptied list is sent too");

    h.health.send_replace(vec![report("dev-3", None, "")]);
    let third = next(&mut stream).await;
    assert_eq!(
        summary!(third),
        vec![("dev-3".to_string(), v1::HealthStatus::Unknown as i32, 0)]
    );
    h.stop().await;
}

#[tokio::test]
async fn both_versions_resend_the_full_list_periodically() {
    let mut h = Harness::start(initial_devices(), Duration::from_millis(100)).await;
    let channel = channel(&h.dra_socket).await;
    let mut alpha = watch_v1alpha1(channel.clone()).await;
    let mut stable = watch_v1(channel).await;

    // Without any change, each stream keeps delivering the complete list.
    let expected = vec![
        ("dev-0".to_string(), 1, 2),
        ("dev-1".to_string(), 2, 1024),
        ("dev-2".to_string(), 0, 19),
    ];
    for _ in 0..3 {
        let a = next(&mut alpha).await;
        assert_eq!(summary!(a), expected);
        assert!(
            a.devices.iter().all(|d| d.health_check_timeout_seconds == 0),
            "kubelet default timeout"
        );
        let b = next(&mut stable).await;
        assert_eq!(summary!(b), expected);
    }
    h.stop().await;
}

#[tokio::test]
async fn streams_end_when_the_server_shuts_down() {
    let mut h = Harness::start(initial_devices(), Duration::from_secs(3600)).await;
    let mut stream = watch_v1(channel(&h.dra_socket).await).await;
    next(&mut stream).await;

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
