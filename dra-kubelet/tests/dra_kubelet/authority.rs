//! Both sockets behind the `:authority` fix, called with the exact bytes a kubelet's grpc-go
//! client sends: with the percent-encoded socket path as `:authority` (every kubelet on the
//! registration socket, kubelets before 1.34 on the DRA socket too), and with a normal one.

use std::time::Duration;

use dra_kubelet::DeviceHealthReport;
use migdra_proto::{
    dra::{v1, v1beta1},
    health,
    registration::{InfoRequest, PluginInfo},
};
use prost::Message;

use migdra_testkit::dra_kubelet::{
    DRIVER, GET_INFO, Harness, RawClient, RawResponse, claim, device_for, percent_encoded, v1_claim,
    v1beta1_claim,
};

const DRA_V1: &str = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin";
const DRA_V1BETA1: &str = "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin";
const HEALTH_V1: &str = "/v1.DRAResourceHealth/NodeWatchResources";
const HEALTH_V1ALPHA1: &str = "/v1alpha1.DRAResourceHealth/NodeWatchResources";

/// The message of a successful unary gRPC answer.
fn decode_ok<M: Message + Default>(response: &RawResponse) -> M {
    assert_eq!(response.header(":status"), Some("200"), "{response:?}");
    assert_eq!(response.header("grpc-status"), Some("0"), "{response:?}");
    M::decode(response.message()).expect("response message")
}

fn v1_device(uid: &str) -> v1::Device {
    let d = device_for(uid);
    v1::Device {
        request_names: d.request_names,
        pool_name: d.pool_name,
        device_name: d.device_name,
        cdi_device_ids: d.cdi_device_ids,
        share_id: d.share_id,
    }
}

fn v1beta1_device(uid: &str) -> v1beta1::Device {
    let d = device_for(uid);
    v1beta1::Device {
        request_names: d.request_names,
        pool_name: d.pool_name,
        device_name: d.device_name,
        cdi_device_ids: d.cdi_device_ids,
    }
}

fn report(device: &str, healthy: Option<bool>) -> DeviceHealthReport {
    DeviceHealthReport {
        pool_name: "node-a".to_string(),
        device_name: device.to_string(),
        healthy,
        message: String::new(),
    }
}

/// Prepares and unprepares through v1 and v1beta1 on one connection to the DRA socket, as a
/// kubelet does, with `authority`.
async fn prepare_and_unprepare_both_versions(h: &Harness, authority: &str) {
    let mut kubelet = RawClient::connect(&h.dra_socket).await;

    let request = v1::NodePrepareResourcesRequest {
        claims: ["ok-1", "fail-2"].map(v1_claim).to_vec(),
    };
    let prepared: v1::NodePrepareResourcesResponse = decode_ok(
        &kubelet
            .call(
                1,
                &format!("{DRA_V1}/NodePrepareResources"),
                authority,
                &request.encode_to_vec(),
            )
            .await,
    );
    assert_eq!(prepared.claims.len(), 2);
    assert_eq!(prepared.claims["ok-1"].error, "");
    assert_eq!(prepared.claims["ok-1"].devices, vec![v1_device("ok-1")]);
    assert_eq!(prepared.claims["fail-2"].error, "cannot do fail-2");

    let request = v1::NodeUnprepareResourcesRequest {
        claims: ["ok-1", "missing-3"].map(v1_claim).to_vec(),
    };
    let unprepared: v1::NodeUnprepareResourcesResponse = decode_ok(
        &kubelet
            .call(
                3,
                &format!("{DRA_V1}/NodeUnprepareResources"),
                authority,
                &request.encode_to_vec(),
            )
            .await,
    );
    assert_eq!(unprepared.claims.len(), 2);
    assert_eq!(unprepared.claims["ok-1"].error, "");
    assert!(
        unprepared.claims["missing-3"].error.contains("missing-3"),
        "{unprepared:?}"
    );

    let request = v1beta1::NodePrepareResourcesRequest {
        claims: vec![v1beta1_claim("shared-4")],
    };
    let prepared: v1beta1::NodePrepareResourcesResponse = decode_ok(
        &kubelet
            .call(
                5,
                &format!("{DRA_V1BETA1}/NodePrepareResources"),
                authority,
                &request.encode_to_vec(),
            )
            .await,
    );
    assert_eq!(prepared.claims.len(), 1);
    assert_eq!(prepared.claims["shared-4"].error, "");
    assert_eq!(
        prepared.claims["shared-4"].devices,
        vec![v1beta1_device("shared-4")]
    );

    let request = v1beta1::NodeUnprepareResourcesRequest {
        claims: vec![v1beta1_claim("fail-5")],
    };
    let unprepared: v1beta1::NodeUnprepareResourcesResponse = decode_ok(
        &kubelet
            .call(
                7,
                &format!("{DRA_V1BETA1}/NodeUnprepareResources"),
                authority,
                &request.encode_to_vec(),
            )
            .await,
    );
    assert_eq!(unprepared.claims.len(), 1);
    assert_eq!(unprepared.claims["fail-5"].error, "cannot do fail-5");

    // A raw client answers no PING while idle, which would hold up h2's graceful shutdown.
    drop(kubelet);
    let prepare_calls = h.driver.prepare_calls.lock().expect("lock").clone();
    assert_eq!(
        prepare_calls,
        vec![vec![claim("ok-1"), claim("fail-2")], vec![claim("shared-4")]]
    );
    let unprepare_calls = h.driver.unprepare_calls.lock().expect("lock").clone();
    assert_eq!(
        unprepare_calls,
        vec![vec![claim("ok-1"), claim("missing-3")], vec![claim("fail-5")]]
    );
}

/// Opens the v1 and v1alpha1 health streams on one connection to the DRA socket with
/// `authority`, and checks both deliver the list at once and again after a change.
async fn watch_health_both_versions(h: &Harness, authority: &str) {
    let mut kubelet = RawClient::connect(&h.dra_socket).await;
    kubelet
        .request(
            1,
            HEALTH_V1,
            authority,
            &health::v1::NodeWatchResourcesRequest {}.encode_to_vec(),
        )
        .await;
    kubelet
        .request(
            3,
            HEALTH_V1ALPHA1,
            authority,
            &health::v1alpha1::NodeWatchResourcesRequest {}.encode_to_vec(),
        )
        .await;

    let v1_summary = |message: Vec<u8>| -> Vec<(String, i32)> {
        health::v1::NodeWatchResourcesResponse::decode(&message[..])
            .expect("v1 health response")
            .devices
            .into_iter()
            .map(|d| (d.device.expect("device id").device_name, d.health))
            .collect()
    };
    let v1alpha1_summary = |message: Vec<u8>| -> Vec<(String, i32)> {
        health::v1alpha1::NodeWatchResourcesResponse::decode(&message[..])
            .expect("v1alpha1 health response")
            .devices
            .into_iter()
            .map(|d| (d.device.expect("device id").device_name, d.health))
            .collect()
    };

    let healthy = health::v1::HealthStatus::Healthy as i32;
    let unhealthy = health::v1::HealthStatus::Unhealthy as i32;
    let unknown = health::v1::HealthStatus::Unknown as i32;
    let initial = vec![("dev-0".to_string(), healthy), ("dev-1".to_string(), unknown)];
    assert_eq!(v1_summary(kubelet.next_message(1).await), initial);
    assert_eq!(v1alpha1_summary(kubelet.next_message(3).await), initial);

    h.health.send_replace(vec![report("dev-1", Some(false))]);
    let changed = vec![("dev-1".to_string(), unhealthy)];
    assert_eq!(v1_summary(kubelet.next_message(1).await), changed);
    assert_eq!(v1alpha1_summary(kubelet.next_message(3).await), changed);
    drop(kubelet);
}

/// GetInfo on the registration socket with `authority`; returns the announced plugin.
async fn get_info(h: &Harness, authority: &str) -> PluginInfo {
    let mut kubelet = RawClient::connect(&h.registration_socket).await;
    let info = decode_ok(
        &kubelet
            .call(1, GET_INFO, authority, &InfoRequest {}.encode_to_vec())
            .await,
    );
    drop(kubelet);
    info
}

fn initial_health() -> Vec<DeviceHealthReport> {
    vec![report("dev-0", Some(true)), report("dev-1", None)]
}

#[tokio::test]
async fn dra_socket_serves_a_kubelet_sending_the_percent_encoded_path() {
    let mut h = Harness::start(initial_health(), Duration::from_secs(3600)).await;
    let authority = percent_encoded(&h.dra_socket);
    assert!(
        authority.starts_with("%2Ftmp%2Fmd") && authority.ends_with(&format!("%2F{DRIVER}%2Fdra.sock")),
        "{authority}"
    );
    prepare_and_unprepare_both_versions(&h, &authority).await;
    watch_health_both_versions(&h, &authority).await;
    h.stop().await;
}

#[tokio::test]
async fn kubelet_registers_then_dials_the_announced_endpoint_by_its_path() {
    // The whole sequence of a kubelet before 1.34: both dials by bare path.
    let mut h = Harness::start(initial_health(), Duration::from_secs(3600)).await;
    let info = get_info(&h, &percent_encoded(&h.registration_socket)).await;
    assert_eq!(info.name, DRIVER);
    assert_eq!(info.endpoint, h.dra_socket.display().to_string());

    let endpoint = std::path::PathBuf::from(&info.endpoint);
    let mut kubelet = RawClient::connect(&endpoint).await;
    let request = v1::NodePrepareResourcesRequest {
        claims: vec![v1_claim("ok-1")],
    };
    let prepared: v1::NodePrepareResourcesResponse = decode_ok(
        &kubelet
            .call(
                1,
                &format!("{DRA_V1}/NodePrepareResources"),
                &percent_encoded(&endpoint),
                &request.encode_to_vec(),
            )
            .await,
    );
    assert_eq!(prepared.claims["ok-1"].devices, vec![v1_device("ok-1")]);
    drop(kubelet);
    h.stop().await;
}

#[tokio::test]
async fn both_sockets_serve_a_normal_authority() {
    // What kubelets 1.34+ send on the DRA socket (they dial `unix:<path>`).
    let mut h = Harness::start(initial_health(), Duration::from_secs(3600)).await;
    let info = get_info(&h, "localhost").await;
    assert_eq!(info.name, DRIVER);
    assert_eq!(info.endpoint, h.dra_socket.display().to_string());
    prepare_and_unprepare_both_versions(&h, "localhost").await;
    watch_health_both_versions(&h, "localhost").await;
    h.stop().await;
}
