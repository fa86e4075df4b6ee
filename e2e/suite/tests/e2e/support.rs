//! What the theme modules share: the test table entry, the device classes, queries on the
//! simulated GPUs and the published pool, and the cleanup every test ends with.

use std::{path::PathBuf, time::Duration};

use anyhow::{Context, ensure};
use futures::future::BoxFuture;
use k8s_openapi::api::{
    core::v1::{Event, Pod, PodCondition},
    resource::v1::ResourceSlice,
};
use kube::{Api, ResourceExt, api::ListParams};
use migdra_api::inventory::pool_name;
use migdra_e2e::{
    cluster::{CONTROLLER, Cluster, DRIVER, MigdraMode, NODE, Runtime, wait_until},
    workload::{self, ContainerView, Request},
};

/// Checks that a container sees the simulated host's driver files once (see
/// [`ContainerView::check_driver_files`]), of the version the fake NVML reports.
pub(crate) fn check_driver_files(cluster: &Cluster, view: &ContainerView) -> anyhow::Result<()> {
    let version = cluster.gpus()?.driver_version;
    view.check_driver_files(&cluster.layout.driver_root(), &version)
        .with_context(|| format!("container {}/{}", view.pod, view.container))
}

/// One end-to-end test: its name in the results, the module it is in, and its body, run on
/// the shared cluster.
#[derive(Clone, Copy)]
pub(crate) struct Test {
    pub name: &'static str,
    pub module: &'static str,
    pub run: for<'a> fn(&'a mut Cluster) -> BoxFuture<'a, anyhow::Result<()>>,
}

/// The chart's DeviceClass of MIG partitions.
pub(crate) const MIG: &str = "mig.migdra.dev";
/// The chart's DeviceClass of whole GPUs.
pub(crate) const WHOLE: &str = "gpu.migdra.dev";
/// Timeout of a step expected to be quick: a pod starting, an instance or a CDI spec going away.
pub(crate) const SHORT: Duration = Duration::from_secs(60);

/// A request for exactly one MIG partition matching `selectors`.
pub(crate) fn mig(selectors: &[String]) -> Request {
    Request::Exactly {
        class: MIG.into(),
        selectors: selectors.to_vec(),
    }
}

/// UUID of the simulated GPU with `minor`.
pub(crate) fn gpu_uuid(cluster: &Cluster, minor: u32) -> String {
    cluster
        .gpus()
        .unwrap()
        .gpus
        .iter()
        .find(|g| g.minor == minor)
        .unwrap()
        .uuid
        .clone()
}

/// GPU instances on GPU `minor`: (profile ID, start, CI UUIDs).
pub(crate) fn instances(cluster: &Cluster, minor: u32) -> Vec<(u32, u32, Vec<String>)> {
    let state = cluster.gpus().unwrap();
    let gpu = state.gpus.iter().find(|g| g.minor == minor).unwrap();
    gpu.gpu_instances
        .iter()
        .map(|gi| {
            (
                gi.profile_id,
                gi.start,
                gi.compute_instances.iter().map(|c| c.uuid.clone()).collect(),
            )
        })
        .collect()
}

/// GPU instances on all simulated GPUs.
pub(crate) fn total_instances(cluster: &Cluster) -> usize {
    cluster
        .gpus()
        .unwrap()
        .gpus
        .iter()
        .map(|g| g.gpu_instances.len())
        .sum()
}

/// The CDI spec the plugin writes for the claim with UID `uid`.
pub(crate) fn claim_spec(cluster: &Cluster, uid: &str) -> PathBuf {
    cluster.layout.cdi_dir.join(format!("{DRIVER}-claim_{uid}.json"))
}

/// The CDI specs of claims in the CDI directory.
pub(crate) fn claim_specs(cluster: &Cluster) -> anyhow::Result<Vec<PathBuf>> {
    Ok(std::fs::read_dir(&cluster.layout.cdi_dir)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().contains("-claim_"))
        })
        .collect())
}

/// A pod's UID (empty when it has none yet).
pub(crate) fn uid(pod: &Pod) -> String {
    pod.metadata.uid.clone().unwrap_or_default()
}

/// A pod's name.
pub(crate) fn name(pod: &Pod) -> String {
    pod.metadata.name.clone().unwrap_or_default()
}

/// The ResourceSlices of this node's pool, by name.
pub(crate) async fn slices(cluster: &Cluster) -> anyhow::Result<Vec<ResourceSlice>> {
    let api: Api<ResourceSlice> = Api::all(cluster.client.clone());
    let pool = pool_name(NODE, DRIVER);
    let mut list: Vec<_> = api
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter(|s| s.spec.pool.name == pool)
        .collect();
    list.sort_by_key(|s| s.name_any());
    Ok(list)
}

/// Cleans up after a test: every test pod and template gone, every MIG instance destroyed,
/// every claim's CDI spec removed (the node-wide driver spec stays: claims of any later pod
/// name it).
pub(crate) async fn settle(cluster: &Cluster) -> anyhow::Result<()> {
    workload::delete_all(&cluster.client).await?;
    wait_until(Duration::from_secs(120), || async {
        (total_instances(cluster) == 0).then_some(())
    })
    .await
    .with_context(|| format!("MIG instances left behind: {:?}", cluster.gpus().map(|s| s.gpus)))?;
    let driver_spec = cluster.layout.cdi_dir.join(format!("{DRIVER}-driver.json"));
    ensure!(
        driver_spec.is_file(),
        "the node-wide driver spec {} is gone",
        driver_spec.display()
    );
    let specs: Vec<_> = std::fs::read_dir(&cluster.layout.cdi_dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| *p != driver_spec)
        .collect();
    ensure!(specs.is_empty(), "CDI specs left behind: {specs:?}");
    Ok(())
}

/// Health the kubelet reports for `device` in the pod's first container.
pub(crate) async fn device_health(cluster: &Cluster, pod: &str, device: &str) -> Option<String> {
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(cluster.client.clone(), "default");
    let pod = serde_json::to_value(pods.get(pod).await.ok()?).ok()?;
    let statuses = pod["status"]["containerStatuses"][0]["allocatedResourcesStatus"]
        .as_array()?
        .clone();
    statuses
        .iter()
        .flat_map(|s| s["resources"].as_array().cloned().unwrap_or_default())
        .find_map(|r| {
            let ours = r["resourceID"].as_str().is_some_and(|id| id.ends_with(device));
            if ours {
                r["health"].as_str().map(str::to_string)
            } else {
                None
            }
        })
}

/// Fails unless migdra runs from its chart on containerd (the harness ignores the tests that
/// need it on the fake CRI).
pub fn require_chart(cluster: &Cluster) -> anyhow::Result<()> {
    ensure!(
        cluster.layout.runtime == Runtime::Containerd && cluster.layout.migdra_mode == MigdraMode::Chart,
        "migdra does not run from its chart on containerd: run with MIGDRA_E2E_RUNTIME=containerd MIGDRA_E2E_MIGDRA=chart"
    );
    Ok(())
}

/// The MIG device's GI and CI capability minors and its CI UUID, from the simulated GPUs.
pub fn mig_instance(cluster: &Cluster, minor: u32, start: u32) -> anyhow::Result<(Vec<i64>, String)> {
    let state = cluster.gpus()?;
    let gi = state
        .gpus
        .iter()
        .find(|g| g.minor == minor)
        .context("no such GPU")?
        .gpu_instances
        .iter()
        .find(|gi| gi.start == start)
        .with_context(|| format!("no instance at {start} on GPU {minor}"))?;
    let ci = gi.compute_instances.first().context("no compute instance")?;
    let base = cluster.layout.gpu_host.join(format!(
        "proc-root/driver/nvidia/capabilities/gpu{minor}/mig/gi{}",
        gi.id
    ));
    let mut minors = Vec::new();
    for access in [base.join("access"), base.join(format!("ci{}/access", ci.id))] {
        let text = std::fs::read_to_string(&access)?;
        minors.push(
            text.lines()
                .find_map(|l| l.strip_prefix("DeviceFileMinor:"))
                .context("no DeviceFileMinor")?
                .trim()
                .parse()?,
        );
    }
    Ok((minors, ci.uuid.clone()))
}

/// Devices of GPU `minor` in the published pool that new claims can get (untainted).
pub(crate) async fn published_on(cluster: &Cluster, minor: u32) -> Option<usize> {
    let prefix = format!("gpu-{minor}");
    let slices = slices(cluster).await.ok()?;
    Some(
        slices
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .filter(|d| d.name == prefix || d.name.starts_with(&format!("{prefix}-")))
            .filter(|d| d.taints.as_ref().is_none_or(|t| t.is_empty()))
            .count(),
    )
}

/// The taint keys of a published device, or `None` when it is not published.
pub(crate) async fn taint_keys(cluster: &Cluster, device: &str) -> Option<Vec<String>> {
    let slices = slices(cluster).await.ok()?;
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .find(|d| d.name == device)
        .map(|d| d.taints.iter().flatten().map(|t| t.key.clone()).collect())
}

/// Waits until the scheduler reports the pod unschedulable (`PodScheduled=False`) and returns
/// that condition.
pub(crate) async fn wait_unschedulable(cluster: &Cluster, pod: &str) -> anyhow::Result<PodCondition> {
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), workload::NAMESPACE);
    wait_until(SHORT, || async {
        pods.get(pod)
            .await
            .ok()?
            .status?
            .conditions?
            .into_iter()
            .find(|c| c.type_ == "PodScheduled" && c.status == "False")
    })
    .await
    .with_context(|| format!("the scheduler never reported {pod} unschedulable"))
}

/// The node the pod is bound to, if any.
pub(crate) async fn bound_node(cluster: &Cluster, pod: &str) -> anyhow::Result<Option<String>> {
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), workload::NAMESPACE);
    Ok(pods.get(pod).await?.spec.and_then(|s| s.node_name))
}

/// Messages of the events with `reason` that the plugin recorded on this node's GpuNode.
pub(crate) async fn gpunode_events(cluster: &Cluster, reason: &str) -> anyhow::Result<Vec<String>> {
    let events: Api<Event> = Api::namespaced(cluster.client.clone(), workload::NAMESPACE);
    let list = events
        .list(&ListParams::default().fields(&format!("involvedObject.name={NODE}")))
        .await?;
    Ok(list
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .filter_map(|e| e.message)
        .collect())
}

/// Every device of this node's pool with its taint keys, by name.
pub(crate) async fn published_devices(cluster: &Cluster) -> anyhow::Result<Vec<(String, Vec<String>)>> {
    let mut devices: Vec<(String, Vec<String>)> = slices(cluster)
        .await?
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .map(|d| {
            (
                d.name.clone(),
                d.taints.iter().flatten().map(|t| t.key.clone()).collect(),
            )
        })
        .collect();
    devices.sort();
    Ok(devices)
}

impl Test {
    /// The theme: the last segment of the module path (`day2` for `e2e::day2`).
    pub(crate) fn theme(&self) -> &'static str {
        self.module.rsplit("::").next().unwrap_or(self.module)
    }
}

/// How often the controller's log says it withdrew the node's pool because the plugin's
/// heartbeat expired (the logs are kept across the suite, so callers compare counts).
pub(crate) fn heartbeat_withdrawals(cluster: &Cluster) -> usize {
    cluster
        .component_log(CONTROLLER)
        .lines()
        .filter(|l| {
            l.contains("withdrawing the pool") && l.contains("last heartbeat") && l.contains("is older than")
        })
        .count()
}

/// The value of sample `sample` of the controller's metric family `family` (e.g. family
/// `migdra_controller_slice_writes`, sample
/// `migdra_controller_slice_writes_total{operation="delete"}`); 0 while the family has no such
/// series yet. An error when the controller does not declare the family, so an assertion on
/// it cannot pass with the metric gone.
pub(crate) async fn controller_sample(cluster: &Cluster, family: &str, sample: &str) -> anyhow::Result<f64> {
    let text = cluster.scrape_metrics(CONTROLLER).await?;
    ensure!(
        text.lines().any(|l| l.starts_with(&format!("# TYPE {family} "))),
        "the controller exposes no metric {family}"
    );
    let value = text.lines().find_map(|line| {
        let (name, value) = line.rsplit_once(' ')?;
        (name == sample).then(|| value.parse::<f64>().ok()).flatten()
    });
    Ok(value.unwrap_or(0.0))
}
