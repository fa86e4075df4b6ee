//! Workloads of the measures: claim templates for a DeviceClass, pods with or without a claim
//! placed by node selector, bound/Running observation and forced cleanup (simulated nodes have
//! no kubelet to finish a graceful deletion).

use std::time::{Duration, Instant};

use anyhow::Context as _;
use k8s_openapi::api::{
    core::v1::Pod,
    resource::v1::{ResourceClaim, ResourceClaimTemplate},
};
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams, PostParams},
};
use serde_json::{Value, json};

/// Namespace of the bench's workloads.
pub const NAMESPACE: &str = "default";
/// Label naming the measure run a pod or claim belongs to.
pub const RUN_LABEL: &str = "bench.migdra.dev/run";

/// Creates a claim template `name` with one request of a device of `class` (and matching the
/// CEL `selector`, when given); its claims carry the run label.
pub async fn create_template(
    client: &Client,
    name: &str,
    class: &str,
    selector: Option<&str>,
    run: &str,
) -> anyhow::Result<()> {
    let mut request = json!({"deviceClassName": class});
    if let Some(expression) = selector {
        request["selectors"] = json!([{"cel": {"expression": expression}}]);
    }
    let template: ResourceClaimTemplate = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "metadata": {"labels": {RUN_LABEL: run}},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}},
        },
    }))?;
    let api: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), NAMESPACE);
    match crate::retry::retry(|| async { api.create(&PostParams::default(), &template).await }).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e).with_context(|| format!("creating claim template {name}")),
    }
}

/// A pod of run `run` that sleeps, placed by `node_selector`, with a claim from `template`
/// when given.
pub fn pod(name: &str, run: &str, node_selector: Value, template: Option<&str>) -> anyhow::Result<Pod> {
    let mut container = json!({
        "name": "main",
        "image": "registry.k8s.io/e2e-test-images/busybox:1.36",
        "command": ["sleep", "3600"],
    });
    let mut spec = json!({
        "restartPolicy": "Always",
        "automountServiceAccountToken": false,
        "terminationGracePeriodSeconds": 1,
        "nodeSelector": node_selector,
        "containers": [],
    });
    if let Some(template) = template {
        container["resources"] = json!({"claims": [{"name": "gpu"}]});
        spec["resourceClaims"] = json!([{"name": "gpu", "resourceClaimTemplateName": template}]);
    }
    spec["containers"] = json!([container]);
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {RUN_LABEL: run}},
        "spec": spec,
    }))?)
}

/// Polls a pod every 20 ms until it is Running; the time from `created` to the first
/// observation.
pub async fn wait_running(
    client: &Client,
    name: &str,
    created: Instant,
    timeout: Duration,
) -> anyhow::Result<Duration> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    loop {
        let pod = crate::retry::retry(|| pods.get(name)).await?;
        if pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running") {
            return Ok(created.elapsed());
        }
        if created.elapsed() > timeout {
            anyhow::bail!("pod {name} not Running after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The claims of run `run`.
pub async fn run_claims(client: &Client, run: &str) -> anyhow::Result<Vec<ResourceClaim>> {
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NAMESPACE);
    Ok(claims
        .list(&ListParams::default().labels(&format!("{RUN_LABEL}={run}")))
        .await?
        .items)
}

/// The allocated devices of claims as (pool, device); the second value counts claims
/// without an allocation.
pub fn allocated_devices(claims: &[ResourceClaim]) -> (Vec<(String, String)>, usize) {
    let mut devices = Vec::new();
    let mut unallocated = 0;
    for claim in claims {
        match claim.status.as_ref().and_then(|s| s.allocation.as_ref()) {
            Some(allocation) => {
                for r in allocation.devices.iter().flat_map(|d| d.results.iter().flatten()) {
                    devices.push((r.pool.clone(), r.device.clone()));
                }
            }
            None => unallocated += 1,
        }
    }
    (devices, unallocated)
}

/// Deletes the pods of run `run` at once (grace 0: no kubelet finishes a graceful deletion on
/// simulated nodes) and waits until they and their claims are gone.
pub async fn delete_run(
    client: &Client,
    run: &str,
    grace_seconds: u32,
    timeout: Duration,
) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), NAMESPACE);
    let selector = ListParams::default().labels(&format!("{RUN_LABEL}={run}"));
    let params = DeleteParams {
        grace_period_seconds: Some(grace_seconds),
        ..DeleteParams::default()
    };
    crate::retry::retry(|| pods.delete_collection(&params, &selector)).await?;
    let deadline = Instant::now() + timeout;
    loop {
        let left_pods = crate::retry::retry(|| pods.list_metadata(&selector))
            .await?
            .items
            .len();
        let left_claims = crate::retry::retry(|| claims.list_metadata(&selector))
            .await?
            .items
            .len();
        if left_pods == 0 && left_claims == 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            anyhow::bail!("run {run}: {left_pods} pods and {left_claims} claims left after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
