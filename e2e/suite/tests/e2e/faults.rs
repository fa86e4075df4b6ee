//! Things going wrong: the kubelet restarts, the plugin is killed mid-prepare, a claim carries
//! a bad config, a GPU falls off the bus. The driver converges, reports what happened and
//! leaves nothing half made.

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use migdra_api::{device_name::DeviceName, slices::NOT_OFFERED_TAINT};
use migdra_e2e::{
    cluster::{Cluster, wait_until},
    workload::{self, create_pod, create_template, on_gpu, profile_is, wait_phase},
};
use migdra_fake_nvml::config::FaultConfig;
use serde_json::json;

use crate::support::{
    SHORT, device_health, gpu_uuid, gpunode_events, instances, mig, published_on, settle, slices, taint_keys,
    total_instances,
};

tests![
    kubelet_restart_republishes_slices_and_keeps_pods,
    plugin_killed_mid_prepare_converges,
    bad_opaque_config_is_reported_and_creates_nothing,
    lost_gpu_turns_unhealthy_and_leaves_the_pool,
    hung_nvml_on_one_gpu_leaves_the_others_serving,
];

async fn kubelet_restart_republishes_slices_and_keeps_pods(cluster: &mut Cluster) -> anyhow::Result<()> {
    let c = cluster.client.clone();
    create_template(&c, "survivor", mig(&[profile_is("3g.40gb")]), None).await?;
    create_pod(&c, "survivor", "survivor", &["sleep", "3600"], false).await?;
    wait_phase(&c, "survivor", "Running", SHORT).await?;
    let before: Vec<String> = slices(cluster)
        .await?
        .iter()
        .filter_map(|s| s.metadata.uid.clone())
        .collect();
    let instances_before = total_instances(cluster);
    cluster.restart_kubelet()?;
    // The kubelet deletes the node's slices when it starts; the controller re-creates them.
    wait_until(Duration::from_secs(120), || async {
        let now = slices(cluster).await.ok()?;
        let uids: Vec<String> = now.iter().filter_map(|s| s.metadata.uid.clone()).collect();
        let complete = !now.is_empty() && now.len() as i64 == now[0].spec.pool.resource_slice_count;
        (complete && uids.iter().all(|u| !before.contains(u))).then_some(())
    })
    .await
    .context("slices were not wiped and re-created")?;
    cluster.wait_published(Duration::from_secs(60)).await?;
    // The kubelet found its root a shared mount and stacked no bind mount of its own on it:
    // each one doubles the stack, and a pod's tmpfs volume mounted below then outlives its
    // unmount, which keeps the pod Terminating for ever (the plugin's, in a rolling update).
    let mounts = cluster.kubelet_root_mounts()?;
    ensure!(
        mounts == 1,
        "{mounts} mounts at the kubelet's root {} after its restart",
        cluster.layout.kubelet_root.display()
    );
    ensure!(workload::phase(&c, "survivor").await.as_deref() == Some("Running"));
    // The container the kubelet found still runs (never restarted) and still sees its MIG device.
    let view = workload::container_view(&c, "survivor", "main").await?;
    ensure!(
        view.restart_count == 0,
        "survivor/main restarted {} times",
        view.restart_count
    );
    view.ensure_one_mig_uuid()?;
    ensure!(
        total_instances(cluster) == instances_before,
        "instances changed across the kubelet restart"
    );
    settle(cluster).await
}

async fn plugin_killed_mid_prepare_converges(cluster: &mut Cluster) -> anyhow::Result<()> {
    let c = cluster.client.clone();
    // Compute-instance creation takes 6 s once: the plugin is killed inside it, with the GPU
    // instance already made.
    cluster.update_gpus(|s| {
        s.faults.push(migdra_fake_nvml::state::FaultState {
            fault: FaultConfig::latency("nvmlGpuInstanceCreateComputeInstance", 6000).times(1),
            hits: 0,
        })
    })?;
    create_template(&c, "crashy", mig(&[profile_is("2g.20gb")]), None).await?;
    create_pod(&c, "crashy", "crashy", &["sleep", "3600"], false).await?;
    let state_dir = cluster.layout.plugin_state.clone();
    wait_until(SHORT, || async {
        let checkpoint = std::fs::read_to_string(state_dir.join("checkpoint.json")).ok()?;
        checkpoint.contains("PrepareStarted").then_some(())
    })
    .await
    .context("prepare never started")?;
    wait_until(Duration::from_secs(10), || async {
        cluster
            .gpus()
            .ok()?
            .gpus
            .iter()
            .any(|g| g.gpu_instances.iter().any(|gi| gi.compute_instances.is_empty()))
            .then_some(())
    })
    .await
    .context("the GPU instance was not created before the kill")?;
    // SIGKILL of the plugin's process (its container's, which the kubelet restarts).
    let killed = cluster.kill_plugin().await?;
    let half = cluster
        .gpus()?
        .gpus
        .iter()
        .flat_map(|g| &g.gpu_instances)
        .filter(|gi| gi.compute_instances.is_empty())
        .count();
    ensure!(
        half == 1,
        "expected one half-created instance after the kill, found {half}"
    );
    cluster.restart_killed_plugin(&killed).await?;
    wait_phase(&c, "crashy", "Running", Duration::from_secs(180)).await?;
    // The restarted plugin rolled the half-prepared claim back and said so on its GpuNode.
    let note = wait_until(Duration::from_secs(30), || async {
        gpunode_events(cluster, "RecoveredInterruptedOperations")
            .await
            .ok()?
            .into_iter()
            .next()
    })
    .await
    .context("no RecoveredInterruptedOperations event on the GpuNode")?;
    ensure!(
        note.contains("1 half-prepared claim(s) rolled back"),
        "event says: {note}"
    );
    let claim = workload::pod_claim(&c, "crashy").await?;
    let (_, device) = workload::allocated(&claim).pop().context("not allocated")?;
    let DeviceName::Mig { minor, start, .. } = device.parse::<DeviceName>()? else {
        bail!("not MIG")
    };
    let all: Vec<_> = cluster
        .gpus()?
        .gpus
        .iter()
        .flat_map(|g| g.gpu_instances.clone())
        .collect();
    ensure!(
        all.len() == 1,
        "exactly one instance after recovery, found {all:?}"
    );
    ensure!(
        all[0].start == start && all[0].compute_instances.len() == 1,
        "{all:?} vs {device}"
    );
    let view = workload::container_view(&c, "crashy", "main").await?;
    ensure!(
        view.device_uuid(&device) == Some(all[0].compute_instances[0].uuid.as_str()),
        "env {:?}",
        view.env
    );
    ensure!(
        cluster
            .gpus()?
            .gpus
            .iter()
            .any(|g| g.minor == minor && g.gpu_instances.len() == 1)
    );
    settle(cluster).await
}

async fn bad_opaque_config_is_reported_and_creates_nothing(cluster: &mut Cluster) -> anyhow::Result<()> {
    let c = cluster.client.clone();
    let config = json!({"apiVersion": "gpu.migdra.dev/v1alpha1", "kind": "DeviceConfig", "sharing": "mps"});
    create_template(&c, "bad-config", mig(&[profile_is("1g.10gb")]), Some(config)).await?;
    create_pod(&c, "bad-config", "bad-config", &["sleep", "3600"], false).await?;
    let message = wait_until(Duration::from_secs(90), || async {
        let events = workload::pod_events(&c, "bad-config").await.ok()?;
        events
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("FailedPrepareDynamicResources"))
            .and_then(|e| e.message)
    })
    .await
    .context("no FailedPrepareDynamicResources event")?;
    ensure!(
        message.contains("unknown field `sharing`"),
        "event says: {message}"
    );
    ensure!(workload::phase(&c, "bad-config").await.as_deref() == Some("Pending"));
    ensure!(total_instances(cluster) == 0, "something was created on the GPU");
    settle(cluster).await
}

async fn wait_health(cluster: &Cluster, pod: &str, device: &str, want: &str) -> anyhow::Result<()> {
    wait_until(Duration::from_secs(60), || async {
        device_health(cluster, pod, device).await.filter(|h| h == want)
    })
    .await
    .with_context(|| format!("device health never became {want}"))
    .map(drop)
}

async fn lost_gpu_turns_unhealthy_and_leaves_the_pool(cluster: &mut Cluster) -> anyhow::Result<()> {
    let c = cluster.client.clone();
    let a100 = gpu_uuid(cluster, 2);
    create_template(&c, "watched", mig(&[profile_is("1g.5gb"), on_gpu(&a100)]), None).await?;
    create_pod(&c, "watched", "watched", &["sleep", "3600"], false).await?;
    wait_phase(&c, "watched", "Running", SHORT).await?;
    let (_, device) = workload::allocated(&workload::pod_claim(&c, "watched").await?)
        .pop()
        .context("not allocated")?;
    wait_health(cluster, "watched", &device, "Healthy").await?;
    ensure!(
        published_on(cluster, 2).await.unwrap_or(0) > 0,
        "the A100 is not published"
    );
    // The GPU falls off the bus: the kubelet learns it from the health stream, and the
    // controller withdraws the GPU's free devices (the default policy omits unhealthy GPUs).
    // The A100 is minor 2; the state is in NVML index order.
    let a100_at = cluster.state_index_of_minor(2)?;
    cluster.update_gpus(|s| s.gpus[a100_at].lost = true)?;
    wait_health(cluster, "watched", &device, "Unhealthy").await?;
    wait_until(Duration::from_secs(60), || async {
        (published_on(cluster, 2).await == Some(0)).then_some(())
    })
    .await
    .context("the lost GPU's devices were not withdrawn")?;
    // The device the running pod holds stays in the pool, tainted, so the scheduler keeps
    // counting what it consumes.
    let taints = taint_keys(cluster, &device).await.unwrap_or_default();
    ensure!(
        taints.iter().any(|k| k == NOT_OFFERED_TAINT),
        "the held device {device} is not kept with the not-offered taint: {taints:?}"
    );
    ensure!(
        published_on(cluster, 0).await.unwrap_or(0) > 0,
        "the healthy GPUs stay published"
    );
    // It comes back.
    cluster.update_gpus(|s| s.gpus[a100_at].lost = false)?;
    wait_health(cluster, "watched", &device, "Healthy").await?;
    wait_until(Duration::from_secs(60), || async {
        (published_on(cluster, 2).await > Some(0)).then_some(())
    })
    .await
    .context("the recovered GPU was not published again")?;
    settle(cluster).await
}

/// GPU 0's driver hangs in the kernel: creating a GPU instance there does not return for ten
/// minutes. The pod on GPU 0 waits with "NVML is not answering", GPU 0 leaves the pool, and
/// pods on GPU 1 still start and end; once the call returns, the first pod starts too.
async fn hung_nvml_on_one_gpu_leaves_the_others_serving(cluster: &mut Cluster) -> anyhow::Result<()> {
    let c = cluster.client.clone();
    let (hung_uuid, other_uuid) = (gpu_uuid(cluster, 0), gpu_uuid(cluster, 1));
    let hung_at = u32::try_from(cluster.state_index_of_minor(0)?)?;
    cluster.update_gpus(|s| {
        s.faults.push(migdra_fake_nvml::state::FaultState {
            fault: FaultConfig::latency("nvmlDeviceCreateGpuInstanceWithPlacement", 600_000).on_gpu(hung_at),
            hits: 0,
        })
    })?;
    let held = || -> anyhow::Result<u32> { Ok(cluster.gpus()?.faults.iter().map(|f| f.hits).sum()) };
    create_template(
        &c,
        "on-hung",
        mig(&[profile_is("1g.10gb"), on_gpu(&hung_uuid)]),
        None,
    )
    .await?;
    create_template(
        &c,
        "on-other",
        mig(&[profile_is("1g.10gb"), on_gpu(&other_uuid)]),
        None,
    )
    .await?;
    create_pod(&c, "hung", "on-hung", &["sleep", "3600"], false).await?;
    wait_until(SHORT, || async { (held().ok()? >= 1).then_some(()) })
        .await
        .context("the create on GPU 0 was never called")?;

    // A pod on GPU 1 starts and ends while GPU 0's create is still held.
    create_pod(&c, "other", "on-other", &["sleep", "3600"], false).await?;
    wait_phase(&c, "other", "Running", SHORT).await?;
    ensure!(
        instances(cluster, 1).len() == 1,
        "GPU 1: {:?}",
        instances(cluster, 1)
    );
    ensure!(
        held()? >= 1 && !cluster.gpus()?.faults.is_empty(),
        "the hang ended early"
    );
    workload::delete_pods(&c, &["other"]).await?;
    wait_until(SHORT, || async { instances(cluster, 1).is_empty().then_some(()) })
        .await
        .context("GPU 1's instance stayed after its pod ended")?;

    // The hung pod waits, told why; GPU 0 turns unhealthy and leaves the pool.
    let told = wait_until(Duration::from_secs(120), || async {
        let events = workload::pod_events(&c, "hung").await.ok()?;
        events
            .into_iter()
            .filter_map(|e| e.message)
            .find(|m| m.contains("NVML is not answering"))
    })
    .await
    .context("the hung pod was never told that NVML is not answering")?;
    ensure!(
        workload::phase(&c, "hung").await.as_deref() != Some("Running"),
        "the pod on the hung GPU runs: {told}"
    );
    wait_until(Duration::from_secs(60), || async {
        (published_on(cluster, 0).await == Some(0)).then_some(())
    })
    .await
    .context("the hung GPU's devices were not withdrawn")?;
    ensure!(
        published_on(cluster, 1).await.unwrap_or(0) > 0,
        "GPU 1 left the pool with GPU 0"
    );
    let unhealthy = gpunode_events(cluster, "GpuUnhealthy").await?;
    ensure!(
        unhealthy.iter().any(|m| m.contains("NVML is not answering")),
        "GpuUnhealthy events: {unhealthy:?}"
    );

    // The call returns: the late instance is reconciled and the pod starts with one instance.
    cluster.update_gpus(|s| s.faults.clear())?;
    wait_phase(&c, "hung", "Running", Duration::from_secs(180)).await?;
    ensure!(
        instances(cluster, 0).len() == 1,
        "GPU 0: {:?}",
        instances(cluster, 0)
    );
    wait_until(Duration::from_secs(60), || async {
        (published_on(cluster, 0).await > Some(0)).then_some(())
    })
    .await
    .context("GPU 0 was not published again")?;
    settle(cluster).await
}
