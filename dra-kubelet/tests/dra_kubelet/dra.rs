//! The DRA service over a real unix socket, through v1 and v1beta1 clients.

use std::time::Duration;

use migdra_proto::dra::{v1, v1beta1};
use migdra_testkit::dra_kubelet::{Harness, channel, claim, device_for, v1_claim, v1beta1_claim};

const UIDS: [&str; 5] = ["ok-1", "shared-2", "fail-3", "missing-4", "blank-5"];

#[tokio::test]
async fn v1_prepare_answers_every_claim_with_share_id() {
    let mut h = Harness::start(Vec::new(), Duration::from_secs(10)).await;
    let mut client = v1::dra_plugin_client::DraPluginClient::new(channel(&h.dra_socket).await);
    let response = client
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: UIDS.map(v1_claim).to_vec(),
        })
        .await
        .expect("prepare")
        .into_inner();

    let mut keys: Vec<_> = response.claims.keys().cloned().collect();
    keys.sort();
    assert_eq!(
        keys,
        ["blank-5", "fail-3", "missing-4", "ok-1", "shared-2"],
        "exactly the requested UIDs"
    );

    let ok = &response.claims["ok-1"];
    assert_eq!(ok.error, "");
    let expected = device_for("ok-1");
    assert_eq!(
        ok.devices,
        vec![v1::Device {
            request_names: expected.request_names,
            pool_name: expected.pool_name,
            device_name: expected.device_name,
            cdi_device_ids: expected.cdi_device_ids,
            share_id: None,
        }]
    );
    let shared = &response.claims["shared-2"];
    assert_eq!(shared.error, "");
    assert_eq!(shared.devices[0].share_id.as_deref(), Some("share-shared-2"));

    let failed = &response.claims["fail-3"];
    assert_eq!(failed.error, "cannot do fail-3");
    assert!(failed.devices.is_empty());
    let missing = &response.claims["missing-4"];
    assert!(missing.error.contains("missing-4"), "{}", missing.error);
    assert!(missing.devices.is_empty());
    assert!(
        !response.claims["blank-5"].error.is_empty(),
        "an empty error would read as success"
    );

    let calls = h.driver.prepare_calls.lock().expect("lock").clone();
    assert_eq!(
        calls,
        vec![UIDS.map(claim).to_vec()],
        "one driver call with the claims as sent"
    );
    h.stop().await;
}

#[tokio::test]
async fn v1beta1_prepare_uses_the_same_driver() {
    let mut h = Harness::start(Vec::new(), Duration::from_secs(10)).await;
    let mut client = v1beta1::dra_plugin_client::DraPluginClient::new(channel(&h.dra_socket).await);
    let response = client
        .node_prepare_resources(v1beta1::NodePrepareResourcesRequest {
            claims: UIDS.map(v1beta1_claim).to_vec(),
        })
        .await
        .expect("prepare")
        .into_inner();
    assert_eq!(response.claims.len(), UIDS.len());
    let shared = device_for("shared-2");
    assert_eq!(
        response.claims["shared-2"].devices,
        vec![v1beta1::Device {
            request_names: shared.request_names,
            pool_name: shared.pool_name,
            device_name: shared.device_name,
            cdi_device_ids: shared.cdi_device_ids,
        }]
    );
    assert_eq!(response.claims["ok-1"].error, "");
    assert_eq!(response.claims["fail-3"].error, "cannot do fail-3");
    assert!(response.claims["missing-4"].error.contains("missing-4"));
    assert!(!response.claims.contains_key("unrequested-uid"));
    assert_eq!(h.driver.prepare_calls.lock().expect("lock").len(), 1);
    h.stop().await;
}

#[tokio::test]
async fn unprepare_reports_per_claim_errors_in_both_versions() {
    let mut h = Harness::start(Vec::new(), Duration::from_secs(10)).await;
    let channel = channel(&h.dra_socket).await;

    let v1_response = v1::dra_plugin_client::DraPluginClient::new(channel.clone())
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: UIDS.map(v1_claim).to_vec(),
        })
        .await
        .expect("unprepare v1")
        .into_inner();
    let v1_errors: Vec<(String, String)> = {
        let mut e: Vec<_> = v1_response
            .claims
            .into_iter()
            .map(|(k, v)| (k, v.error))
            .collect();
        e.sort();
        e
    };

    let beta_response = v1beta1::dra_plugin_client::DraPluginClient::new(channel)
        .node_unprepare_resources(v1beta1::NodeUnprepareResourcesRequest {
            claims: UIDS.map(v1beta1_claim).to_vec(),
        })
        .await
        .expect("unprepare v1beta1")
        .into_inner();
    let beta_errors: Vec<(String, String)> = {
        let mut e: Vec<_> = beta_response
            .claims
            .into_iter()
            .map(|(k, v)| (k, v.error))
            .collect();
        e.sort();
        e
    };

    assert_eq!(v1_errors, beta_errors, "both versions map outcomes the same way");
    let errors: std::collections::HashMap<_, _> = v1_errors.into_iter().collect();
    assert_eq!(errors.len(), UIDS.len());
    assert_eq!(errors["ok-1"], "");
    assert_eq!(errors["shared-2"], "");
    assert_eq!(errors["fail-3"], "cannot do fail-3");
    assert!(errors["missing-4"].contains("missing-4"));
    assert!(!errors["blank-5"].is_empty());
    assert_eq!(h.driver.unprepare_calls.lock().expect("lock").len(), 2);
    h.stop().await;
}

#[tokio::test]
async fn empty_requests_get_empty_answers_without_driver_calls() {
    let mut h = Harness::start(Vec::new(), Duration::from_secs(10)).await;
    let channel = channel(&h.dra_socket).await;
    let mut v1_client = v1::dra_plugin_client::DraPluginClient::new(channel.clone());
    let mut beta_client = v1beta1::dra_plugin_client::DraPluginClient::new(channel);

    let prepared = v1_client
        .node_prepare_resources(v1::NodePrepareResourcesRequest::default())
        .await
        .expect("prepare")
        .into_inner();
    assert!(prepared.claims.is_empty());
    let unprepared = v1_client
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest::default())
        .await
        .expect("unprepare")
        .into_inner();
    assert!(unprepared.claims.is_empty());
    let prepared = beta_client
        .node_prepare_resources(v1beta1::NodePrepareResourcesRequest::default())
        .await
        .expect("prepare")
        .into_inner();
    assert!(prepared.claims.is_empty());
    let unprepared = beta_client
        .node_unprepare_resources(v1beta1::NodeUnprepareResourcesRequest::default())
        .await
        .expect("unprepare")
        .into_inner();
    assert!(unprepared.claims.is_empty());

    assert!(h.driver.prepare_calls.lock().expect("lock").is_empty());
    assert!(h.driver.unprepare_calls.lock().expect("lock").is_empty());
    h.stop().await;
}
