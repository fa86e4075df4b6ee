//! The claim says what it got, and adminAccess: after prepare the plugin writes its driver's
//! `status.devices` entries (a MIG claim's MIG UUID, parent GPU, instance IDs, profile and
//! placement; a whole GPU's UUID) with a `Ready` condition; a monitoring claim with
//! `adminAccess` gets a GPU that others go on using, without creating or reserving anything;
//! and
//! `adminAccess` to a MIG partition is refused when the claim is created.

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::{
    core::v1::Namespace,
    resource::v1::{ResourceClaim, ResourceClaimTemplate},
};
use kube::{
    Api, Client,
    api::{Patch, PatchParams, PostParams},
};
use migdra_api::{device_name::DeviceName, inventory::pool_name};
use migdra_e2e::{
    cluster::{Cluster, DRIVER, NODE, wait_until},
    workload::{self, Request, create_pod, create_template, on_gpu, profile_is, wait_phase},
};
use serde_json::{Value, json};

use crate::support::{MIG, SHORT, WHOLE, gpu_uuid, instances, mig, mig_instance, settle};

tests![
    mig_and_whole_gpu_claims_report_their_devices,
    admin_access_watches_a_gpu_others_use,
    admin_access_to_a_mig_partition_is_refused_at_admission
];

/// The label that allows adminAccess claims in a namespace.
const ADMIN_ACCESS_LABEL: &str = "resource.kubernetes.io/admin-access";

/// The plugin's entry for `device` in the claim's status, once written (it is written in the
/// background after prepare, so possibly just after the pod started).
async fn status_entry(client: &Client, claim: &str, device: &str) -> anyhow::Result<Value> {
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), workload::NAMESPACE);
    wait_until(SHORT, || async {
        let claim = serde_json::to_value(claims.get(claim).await.ok()?).ok()?;
        claim["status"]["devices"]
            .as_array()?
            .iter()
            .find(|d| d["driver"] == DRIVER && d["device"] == device)
            .cloned()
    })
    .await
    .with_context(|| format!("claim {claim} has no status entry for {device}"))
}

/// Checks the entry's `Ready` condition and returns its reason.
fn ready_reason(entry: &Value, generation: Option<i64>) -> anyhow::Result<String> {
    let conditions = entry["conditions"].as_array().context("no conditions")?;
    let ready = conditions
        .iter()
        .find(|c| c["type"] == "Ready")
        .context("no Ready condition")?;
    ensure!(ready["status"] == "True", "{ready}");
    ensure!(
        ready["observedGeneration"].as_i64() == generation,
        "observedGeneration {ready}, claim generation {generation:?}"
    );
    ensure!(
        ready["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{ready}"
    );
    Ok(ready["reason"].as_str().unwrap_or_default().to_string())
}

async fn mig_and_whole_gpu_claims_report_their_devices(cluster: &mut Cluster) -> anyhow::Result<()> {
    let c = cluster.client.clone();
    create_template(&c, "status-mig", mig(&[profile_is("1g.10gb")]), None).await?;
    let whole = Request::Exactly {
        class: WHOLE.into(),
        selectors: vec![],
    };
    create_template(&c, "status-gpu", whole, None).await?;
    create_pod(&c, "status-mig", "status-mig", &["sleep", "3600"], false).await?;
    create_pod(&c, "status-gpu", "status-gpu", &["sleep", "3600"], false).await?;
    wait_phase(&c, "status-mig", "Running", SHORT).await?;
    wait_phase(&c, "status-gpu", "Running", SHORT).await?;

    // The MIG claim: what was created, where.
    let claim = workload::pod_claim(&c, "status-mig").await?;
    let name = claim.metadata.name.clone().unwrap_or_default();
    let (_, device) = workload::allocated(&claim).pop().context("not allocated")?;
    let DeviceName::Mig { minor, start, .. } = device.parse::<DeviceName>()? else {
        bail!("{device} is not MIG")
    };
    let entry = status_entry(&c, &name, &device).await?;
    let (_, mig_uuid) = mig_instance(cluster, minor, start)?;
    let state = cluster.gpus()?;
    let gpu = state.gpus.iter().find(|g| g.minor == minor).context("no GPU")?;
    let gi = gpu
        .gpu_instances
        .iter()
        .find(|gi| gi.start == start)
        .context("no instance")?;
    ensure!(
        entry["pool"] == pool_name(NODE, DRIVER).as_str(),
        "pool {}",
        entry["pool"]
    );
    let expected = json!({
        "type": "mig",
        "uuid": mig_uuid,
        "parentUUID": gpu.uuid,
        "gpuIndex": gpu.index,
        "gpuMinor": minor,
        "gpuInstanceID": gi.id,
        "computeInstanceID": gi.compute_instances[0].id,
        "profile": "1g.10gb",
        "placement": {"start": start, "size": 1},
    });
    ensure!(entry["data"] == expected, "data {} != {expected}", entry["data"]);
    let reason = ready_reason(&entry, claim.metadata.generation)?;
    ensure!(reason == "MigDeviceCreated", "{reason}");
    // The container sees the UUID the status names.
    let view = workload::container_view(&c, "status-mig", "main").await?;
    ensure!(
        view.device_uuid(&device) == Some(mig_uuid.as_str()),
        "status-mig sees env {:?}",
        view.env
    );
    // Written by the plugin's own field manager, on the status subresource.
    let claims: Api<ResourceClaim> = Api::namespaced(c.clone(), workload::NAMESPACE);
    let stored = claims.get(&name).await?;
    let managers: Vec<_> = stored
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .map(|m| {
            (
                m.manager.clone().unwrap_or_default(),
                m.operation.clone().unwrap_or_default(),
                m.subresource.clone().unwrap_or_default(),
            )
        })
        .collect();
    ensure!(
        managers.contains(&(
            format!("{DRIVER}/kubelet-plugin"),
            "Apply".to_string(),
            "status".to_string()
        )),
        "managed fields {managers:?}"
    );

    // The whole GPU: its UUID.
    let claim = workload::pod_claim(&c, "status-gpu").await?;
    let name = claim.metadata.name.clone().unwrap_or_default();
    let (_, device) = workload::allocated(&claim).pop().context("not allocated")?;
    let DeviceName::Gpu { minor } = device.parse::<DeviceName>()? else {
        bail!("{device} is not a whole GPU")
    };
    let entry = status_entry(&c, &name, &device).await?;
    let index = state
        .gpus
        .iter()
        .find(|g| g.minor == minor)
        .map(|g| g.index)
        .context("no GPU")?;
    let expected =
        json!({"type": "gpu", "uuid": gpu_uuid(cluster, minor), "gpuIndex": index, "gpuMinor": minor});
    ensure!(entry["data"] == expected, "data {} != {expected}", entry["data"]);
    ensure!(ready_reason(&entry, claim.metadata.generation)? == "GpuPrepared");
    settle(cluster).await
}

/// Labels (`Some("true")`) or unlabels (`None`) the test namespace for adminAccess.
async fn admin_namespace(client: &Client, value: Option<&str>) -> anyhow::Result<()> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .patch(
            workload::NAMESPACE,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {ADMIN_ACCESS_LABEL: value}}})),
        )
        .await?;
    Ok(())
}

/// A claim spec with one request `watch` for adminAccess to a device of `class`.
fn admin_spec(class: &str, selectors: &[String]) -> Value {
    let selectors: Vec<Value> = selectors
        .iter()
        .map(|s| json!({"cel": {"expression": s}}))
        .collect();
    json!({"devices": {"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": class, "adminAccess": true, "selectors": selectors,
    }}]}})
}

async fn admin_access_watches_a_gpu_others_use(cluster: &mut Cluster) -> anyhow::Result<()> {
    let c = cluster.client.clone();
    admin_namespace(&c, Some("true")).await?;
    let result = watch_a_gpu_in_use(cluster).await;
    admin_namespace(&c, None).await?;
    result?;
    settle(cluster).await
}

/// A monitoring pod watches a GPU while workloads come and go on it. It starts while the GPU
/// has no allocation: the scheduler checks a device's shared counters even for adminAccess
/// requests, so a whole GPU (which consumes all of its GPU's counters) can be allocated only
/// while none of its partitions is; once allocated, an adminAccess result counts as nothing
/// allocated, so it blocks no one.
async fn watch_a_gpu_in_use(cluster: &Cluster) -> anyhow::Result<()> {
    let c = cluster.client.clone();
    let minor = 1;
    let uuid = gpu_uuid(cluster, minor);
    // A first workload leaves the GPU in MIG mode (a whole-GPU test before may have switched
    // it off), then ends.
    create_template(&c, "work-3g", mig(&[profile_is("3g.40gb"), on_gpu(&uuid)]), None)
        .await
        .context("creating template work-3g")?;
    create_pod(&c, "warm-up", "work-3g", &["sleep", "3600"], false)
        .await
        .context("creating pod warm-up")?;
    wait_phase(&c, "warm-up", "Running", SHORT).await?;
    workload::delete_pods(&c, &["warm-up"]).await?;
    wait_until(SHORT, || async {
        instances(cluster, minor).is_empty().then_some(())
    })
    .await
    .context("the warm-up instance stayed")?;

    let template: ResourceClaimTemplate = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "watch-gpu", "namespace": workload::NAMESPACE},
        "spec": {"spec": admin_spec(WHOLE, &[on_gpu(&uuid)])},
    }))?;
    Api::<ResourceClaimTemplate>::namespaced(c.clone(), workload::NAMESPACE)
        .create(&PostParams::default(), &template)
        .await
        .context("creating the adminAccess template watch-gpu")?;
    create_pod(&c, "watch", "watch-gpu", &["sleep", "3600"], false)
        .await
        .context("creating pod watch")?;
    wait_phase(&c, "watch", "Running", SHORT).await?;
    let claim = workload::pod_claim(&c, "watch")
        .await
        .context("reading the claim of pod watch")?;
    let device = format!("gpu-{minor}");
    let results = workload::allocation_results(&claim);
    ensure!(
        results.len() == 1 && results[0].device == device && results[0].admin_access == Some(true),
        "the monitoring claim's allocation: {results:?}"
    );
    // Nothing created or switched.
    ensure!(
        instances(cluster, minor).is_empty(),
        "instances on GPU {minor} with only the monitoring pod: {:?}",
        instances(cluster, minor)
    );
    let mig_on = |cluster: &Cluster| -> anyhow::Result<bool> {
        let state = cluster.gpus()?;
        Ok(state
            .gpus
            .iter()
            .find(|g| g.minor == minor)
            .context("no GPU")?
            .mig_enabled)
    };
    ensure!(mig_on(cluster)?, "MIG mode was switched");
    // The GPU's device nodes, the MIG monitor capability (so the agent sees every instance)
    // and no instance capability, and the GPU's UUID.
    let view = workload::container_view(&c, "watch", "main").await?;
    let paths = view.device_paths();
    for expected in [
        format!("/dev/nvidia{minor}").as_str(),
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
    ] {
        ensure!(paths.contains(&expected), "missing {expected} in {paths:?}");
    }
    let caps = view.capability_minors();
    ensure!(caps == [2], "only the monitor capability (minor 2): {caps:?}");
    ensure!(
        view.device_uuid(&device) == Some(uuid.as_str()),
        "the GPU's UUID in the container's env {:?}",
        view.env
    );
    let name = claim.metadata.name.clone().unwrap_or_default();
    let entry = status_entry(&c, &name, &device).await?;
    ensure!(entry["data"]["adminAccess"] == true, "status entry {entry}");
    let reason =
        ready_reason(&entry, claim.metadata.generation).with_context(|| format!("status entry {entry}"))?;
    ensure!(reason == "AdminAccessGranted", "status entry {entry}");

    // Workloads get partitions of the watched GPU, and the whole GPU next to it is free too.
    create_pod(&c, "work", "work-3g", &["sleep", "3600"], false).await?;
    create_template(&c, "more-1g", mig(&[profile_is("1g.10gb"), on_gpu(&uuid)]), None).await?;
    create_pod(&c, "more", "more-1g", &["sleep", "3600"], false).await?;
    wait_phase(&c, "work", "Running", SHORT).await?;
    wait_phase(&c, "more", "Running", SHORT).await?;
    ensure!(
        instances(cluster, minor).len() == 2,
        "{:?}",
        instances(cluster, minor)
    );
    ensure!(workload::phase(&c, "watch").await.as_deref() == Some("Running"));
    ensure!(mig_on(cluster)?);

    // The monitoring pod leaves nothing behind and takes nothing with it.
    let uid = claim.metadata.uid.clone().unwrap_or_default();
    workload::delete_pods(&c, &["watch"]).await?;
    let spec = cluster.layout.cdi_dir.join(format!("{DRIVER}-claim_{uid}.json"));
    wait_until(SHORT, || async { (!spec.exists()).then_some(()) })
        .await
        .context("the monitoring claim's CDI spec was not removed")?;
    ensure!(instances(cluster, minor).len() == 2, "the others' instances stay");
    ensure!(workload::phase(&c, "work").await.as_deref() == Some("Running"));
    Ok(())
}

async fn admin_access_to_a_mig_partition_is_refused_at_admission(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    let c = cluster.client.clone();
    admin_namespace(&c, Some("true")).await?;
    let result = refused_at_admission(&c).await;
    admin_namespace(&c, None).await?;
    result
}

async fn refused_at_admission(c: &Client) -> anyhow::Result<()> {
    let check = |result: Result<(), kube::Error>, what: &str| -> anyhow::Result<()> {
        match result {
            Err(kube::Error::Api(e)) => {
                ensure!(
                    e.message
                        .contains("request gpu asks for adminAccess to a MIG partition")
                        && e.message.contains(&format!("device class {WHOLE}")),
                    "{what}: refused, but with: {}",
                    e.message
                );
                Ok(())
            }
            Err(e) => bail!("{what}: {e}"),
            Ok(()) => bail!("{what}: adminAccess to a MIG partition was accepted"),
        }
    };
    let claims: Api<ResourceClaim> = Api::namespaced(c.clone(), workload::NAMESPACE);
    let claim: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "watch-mig"},
        "spec": admin_spec(MIG, &[profile_is("1g.10gb")]),
    }))?;
    check(
        claims.create(&PostParams::default(), &claim).await.map(drop),
        "ResourceClaim",
    )?;
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(c.clone(), workload::NAMESPACE);
    let template: ResourceClaimTemplate = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "watch-mig"},
        "spec": {"spec": admin_spec(MIG, &[])},
    }))?;
    check(
        templates
            .create(&PostParams::default(), &template)
            .await
            .map(drop),
        "ResourceClaimTemplate",
    )?;
    // A whole GPU with adminAccess passes admission (dry run: nothing is left behind).
    let whole: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "watch-whole"},
        "spec": admin_spec(WHOLE, &[]),
    }))?;
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    claims
        .create(&dry, &whole)
        .await
        .context("adminAccess to a whole GPU must pass admission")?;
    Ok(())
}
