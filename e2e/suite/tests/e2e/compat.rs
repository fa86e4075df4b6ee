//! Pods written for the NVIDIA device plugin (mixed MIG strategy) run unchanged: they ask for
//! `nvidia.com/mig-<profile>` or `nvidia.com/gpu` in `resources.limits`, with no claim, and the
//! chart's DeviceClasses (`deviceClasses.extendedResources`, on in the e2e install) turn the
//! request into a claim the scheduler allocates from migdra's devices (DRAExtendedResource).
//! The MIG instance is created at prepare and destroyed when the pod ends, as for any claim.

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::{core::v1::Pod, resource::v1::ResourceClaim};
use kube::{Api, api::PostParams};
use migdra_api::device_name::DeviceName;
use migdra_e2e::{
    cluster::{Cluster, DRIVER, probe_image, wait_until},
    workload::{self, NAMESPACE, create_pod, create_template, on_gpu, profile_is, wait_phase},
};
use serde_json::json;

use crate::support::{
    SHORT, check_driver_files, gpu_uuid, instances, mig, mig_instance, settle, total_instances,
};

tests![
    device_plugin_mig_request_gets_an_instance_on_demand,
    device_plugin_gpu_request_gets_a_whole_gpu,
    device_plugin_request_for_a_profile_no_gpu_has_stays_pending,
];

/// The device plugin's name of a MIG profile (mixed strategy): `+` is written as `.`.
fn mig_resource(profile: &str) -> String {
    format!("nvidia.com/mig-{}", profile.replace('+', "."))
}

/// Creates a pod as a device-plugin user writes it: one container `main` with
/// `resources.limits: {<resource>: 1}`, no resource claims, running the gpu-probe with `args`.
async fn create_limits_pod(
    cluster: &Cluster,
    name: &str,
    resource: &str,
    args: &[&str],
    restart_never: bool,
) -> anyhow::Result<()> {
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app.kubernetes.io/part-of": "migdra-e2e"}},
        "spec": {
            "restartPolicy": if restart_never { "Never" } else { "Always" },
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "main",
                "image": probe_image(),
                "args": args,
                "resources": {"limits": {resource: "1"}},
            }],
        }
    }))?;
    Api::<Pod>::namespaced(cluster.client.clone(), NAMESPACE)
        .create(&PostParams::default(), &pod)
        .await?;
    Ok(())
}

/// The claim the scheduler made for the pod's extended resources, after checking that the
/// pod's status maps `resource` of container `main` to one of its requests.
async fn extended_resource_claim(
    cluster: &Cluster,
    pod: &str,
    resource: &str,
) -> anyhow::Result<ResourceClaim> {
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), NAMESPACE);
    let status = wait_until(SHORT, || async {
        pods.get(pod).await.ok()?.status?.extended_resource_claim_status
    })
    .await
    .with_context(|| format!("pod {pod} has no extendedResourceClaimStatus"))?;
    ensure!(
        status
            .request_mappings
            .iter()
            .any(|m| m.container_name == "main" && m.resource_name == resource),
        "{pod}: no request mapping for {resource}: {:?}",
        status.request_mappings
    );
    Ok(
        Api::<ResourceClaim>::namespaced(cluster.client.clone(), NAMESPACE)
            .get(&status.resource_claim_name)
            .await?,
    )
}

async fn device_plugin_mig_request_gets_an_instance_on_demand(cluster: &mut Cluster) -> anyhow::Result<()> {
    let c = cluster.client.clone();
    ensure!(total_instances(cluster) == 0, "instances before the pod exists");
    let resource = mig_resource("1g.10gb");
    create_limits_pod(cluster, "dp-mig", &resource, &["sleep", "10"], true).await?;
    wait_phase(&c, "dp-mig", "Running", SHORT).await?;
    let claim = extended_resource_claim(cluster, "dp-mig", &resource).await?;
    let uid = claim.metadata.uid.clone().unwrap_or_default();
    let allocated = workload::allocated(&claim);
    ensure!(allocated.len() == 1, "{allocated:?}");
    let device = allocated[0].1.clone();
    let DeviceName::Mig {
        minor,
        profile,
        start,
    } = device.parse::<DeviceName>()?
    else {
        bail!("{device} is not MIG")
    };
    ensure!(profile.to_string() == "1g.10gb", "{device} is not a 1g.10gb");
    // Created on demand: the one instance on the GPUs is the allocated placement.
    ensure!(
        total_instances(cluster) == 1 && instances(cluster, minor).iter().any(|(_, s, _)| *s == start),
        "instances {:?}",
        cluster.gpus()?.gpus
    );
    let (capability_minors, mig_uuid) = mig_instance(cluster, minor, start)?;
    let view = workload::container_view(&c, "dp-mig", "main").await?;
    ensure!(
        view.device_uuid(&device) == Some(mig_uuid.as_str()),
        "{device}: env {:?}",
        view.env
    );
    let caps = view.capability_minors();
    ensure!(caps.len() == 2, "GI and CI capability nodes: {:?}", view.devices);
    for m in capability_minors {
        ensure!(caps.contains(&m), "capability minor {m} not in {caps:?}");
    }
    check_driver_files(cluster, &view)?;
    // The pod ends: its instance and the claim's CDI spec go.
    wait_phase(&c, "dp-mig", "Succeeded", SHORT).await?;
    wait_until(SHORT, || async {
        (!instances(cluster, minor).iter().any(|(_, s, _)| *s == start)).then_some(())
    })
    .await
    .context("the instance was not destroyed after the pod finished")?;
    let spec = cluster.layout.cdi_dir.join(format!("{DRIVER}-claim_{uid}.json"));
    wait_until(SHORT, || async { (!spec.exists()).then_some(()) })
        .await
        .context("CDI spec not removed")?;
    settle(cluster).await
}

async fn device_plugin_gpu_request_gets_a_whole_gpu(cluster: &mut Cluster) -> anyhow::Result<()> {
    let c = cluster.client.clone();
    create_limits_pod(cluster, "dp-gpu", "nvidia.com/gpu", &["sleep", "3600"], false).await?;
    wait_phase(&c, "dp-gpu", "Running", SHORT).await?;
    let claim = extended_resource_claim(cluster, "dp-gpu", "nvidia.com/gpu").await?;
    let allocated = workload::allocated(&claim);
    ensure!(allocated.len() == 1, "{allocated:?}");
    let device = allocated[0].1.clone();
    let DeviceName::Gpu { minor } = device.parse::<DeviceName>()? else {
        bail!("{device} is not a whole GPU")
    };
    let uuid = gpu_uuid(cluster, minor);
    let gpu = cluster
        .gpus()?
        .gpus
        .into_iter()
        .find(|g| g.minor == minor)
        .context("no such GPU")?;
    ensure!(
        !gpu.mig_enabled && gpu.gpu_instances.is_empty(),
        "a whole GPU has MIG off and no instances"
    );
    let view = workload::container_view(&c, "dp-gpu", "main").await?;
    ensure!(
        view.device_uuid(&device) == Some(uuid.as_str()),
        "env {:?}",
        view.env
    );
    let nvidia = format!("/dev/nvidia{minor}");
    ensure!(
        view.device_paths().contains(&nvidia.as_str()) && view.capability_minors().is_empty(),
        "{:?}",
        view.devices
    );
    check_driver_files(cluster, &view)?;
    workload::delete_pods(&c, &["dp-gpu"]).await?;
    // Leave the GPU as the next tests expect it, in MIG mode: a partition on it switches MIG
    // back on.
    create_template(
        &c,
        "dp-restore",
        mig(&[profile_is("1g.10gb"), on_gpu(&uuid)]),
        None,
    )
    .await?;
    create_pod(&c, "dp-restore", "dp-restore", &["sleep", "3600"], false).await?;
    wait_phase(&c, "dp-restore", "Running", SHORT).await?;
    ensure!(
        cluster
            .gpus()?
            .gpus
            .iter()
            .any(|g| g.minor == minor && g.mig_enabled),
        "MIG not back on GPU {minor}"
    );
    settle(cluster).await
}

async fn device_plugin_request_for_a_profile_no_gpu_has_stays_pending(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    // 1g.12gb is an H100 NVL / GH200 profile: the chart has a class for it (see the e2e chart
    // values), but no simulated GPU (two H100 80GB, one A100 40GB) can make it.
    let resource = mig_resource("1g.12gb");
    create_limits_pod(cluster, "dp-none", &resource, &["sleep", "3600"], false).await?;
    let condition = workload::wait_unschedulable(&cluster.client, "dp-none", SHORT).await?;
    let message = condition.message.clone().unwrap_or_default();
    eprintln!("e2e: dp-none unschedulable: {message}");
    ensure!(
        condition.reason.as_deref() == Some("Unschedulable")
            && message.starts_with("0/1 nodes are available"),
        "{condition:?}"
    );
    // The scheduler turned the request into a claim and found no device for it (no
    // "Insufficient nvidia.com/...": the name is served through the DeviceClass, not the node).
    ensure!(
        message.contains("cannot allocate all claims") && !message.contains("Insufficient"),
        "the scheduler's reason is not the claim's: {message}"
    );
    ensure!(
        workload::phase(&cluster.client, "dp-none").await.as_deref() == Some("Pending"),
        "dp-none is not Pending"
    );
    ensure!(
        total_instances(cluster) == 0,
        "an instance was created for dp-none"
    );
    settle(cluster).await
}
