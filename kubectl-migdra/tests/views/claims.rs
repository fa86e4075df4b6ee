//! The claims view.

use kubectl_migdra::{
    claims::{self, ClaimState},
    render::{self, Style, text},
};

use crate::{fixture, golden};

fn states(namespace: Option<&str>) -> Vec<(String, ClaimState)> {
    claims::build(&fixture::snapshot(), namespace)
        .claims
        .into_iter()
        .map(|c| (format!("{}/{}", c.namespace, c.name), c.state))
        .collect()
}

#[test]
fn states_come_from_the_status_the_pods_and_the_events() {
    use ClaimState::*;
    assert_eq!(
        states(None),
        [
            ("default/infer-b-gpu".to_string(), Failed),
            ("default/train-a-gpu".to_string(), Prepared),
            ("default/whole".to_string(), Prepared),
            ("team-b/waiting".to_string(), Pending),
        ]
    );
    assert_eq!(states(Some("team-b")), [("team-b/waiting".to_string(), Pending)]);
}

#[test]
fn a_failed_claim_carries_the_newest_plugin_message() {
    let view = claims::build(&fixture::snapshot(), Some("default"));
    let failed = view.claims.iter().find(|c| c.name == "infer-b-gpu").unwrap();
    let message = failed.message.as_deref().unwrap();
    assert!(message.contains("NVML: Insufficient resources"), "{message}");
    assert_eq!(failed.node.as_deref(), Some(fixture::NODE));
    assert_eq!(failed.devices[0].profile.as_deref(), Some("1g.10gb"));
    assert_eq!(failed.devices[0].start, Some(2));
}

#[test]
fn without_a_ready_condition_or_a_running_pod_an_allocated_claim_is_only_allocated() {
    let mut snapshot = fixture::snapshot();
    snapshot.events.clear();
    let view = claims::build(&snapshot, Some("default"));
    let claim = view.claims.iter().find(|c| c.name == "infer-b-gpu").unwrap();
    assert_eq!(claim.state, ClaimState::Allocated);

    // A Ready condition that is false is a failure even without events.
    let claim = snapshot
        .claims
        .iter_mut()
        .find(|c| c.metadata.name.as_deref() == Some("infer-b-gpu"))
        .unwrap();
    let status = claim.status.as_mut().unwrap();
    status.devices = Some(vec![serde_json::from_value(serde_json::json!({
        "driver": fixture::DRIVER, "pool": "gpu-node-a/gpu.migdra.dev", "device": "gpu-0-mig-1g10gb-2",
        "conditions": [{"type": "Ready", "status": "False", "reason": "PrepareFailed", "message": "GPU 0 is lost",
            "lastTransitionTime": "2026-12-01T20:00:00Z"}],
    })).unwrap()]);
    let view = claims::build(&snapshot, Some("default"));
    let claim = view.claims.iter().find(|c| c.name == "infer-b-gpu").unwrap();
    assert_eq!(
        (claim.state, claim.message.as_deref()),
        (ClaimState::Failed, Some("GPU 0 is lost"))
    );
}

#[test]
fn a_warning_the_plugin_recorded_on_the_claim_counts_when_it_is_newest() {
    let mut snapshot = fixture::snapshot();
    snapshot.events.push(
        serde_json::from_value(serde_json::json!({
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": "infer-b-gpu.1", "namespace": "default"},
            "involvedObject": {"kind": "ResourceClaim", "namespace": "default", "name": "infer-b-gpu"},
            "reason": "MigModeChangePending",
            "type": "Warning",
            "eventTime": "2026-12-01T20:00:09.000000Z",
            "message": "GPU 0 needs a reset to enable MIG",
        }))
        .unwrap(),
    );
    let view = claims::build(&snapshot, Some("default"));
    let claim = view.claims.iter().find(|c| c.name == "infer-b-gpu").unwrap();
    assert_eq!(claim.state, ClaimState::Failed);
    assert_eq!(
        claim.message.as_deref(),
        Some("MigModeChangePending: GPU 0 needs a reset to enable MIG")
    );
    // The same warning on a claim whose pod runs does not make it failed.
    let train = view.claims.iter().find(|c| c.name == "train-a-gpu").unwrap();
    assert_eq!(train.state, ClaimState::Prepared);
}

#[test]
fn claims_renderings_match_the_goldens() {
    let view = claims::build(&fixture::snapshot(), None);
    golden::check("claims.txt", &text::claims(&view, &Style::PLAIN));
    golden::check("claims.json", &render::json(&view).unwrap());
}
