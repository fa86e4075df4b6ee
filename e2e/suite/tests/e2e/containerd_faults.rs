//! Faults and updates of migdra from its chart on the real runtime (`MIGDRA_E2E_RUNTIME=containerd
//! MIGDRA_E2E_MIGDRA=chart`; the DaemonSet's rolling update is the `rolling_update` theme): the plugin
//! container OOM-killed (its SIGKILL mid-prepare is in the `faults` theme), containerd restarted
//! mid-prepare, a plugin image that cannot be pulled. Everything acts through Kubernetes and the runtime:
//! no test here starts or stops a migdra process itself. First, what the runtime gave the
//! plugin's container that the simulated GPU host cannot notice missing.

use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::{Api, api::DeleteParams};
use migdra_e2e::{
    cluster::{CHART_NAMESPACE, Cluster, NODE, plugin_container, plugin_ready, wait_until},
    workload::{self, create_pod, create_template, delete_pods, profile_is, wait_phase},
};
use migdra_fake_nvml::{config::FaultConfig, state::FaultState};

use crate::support::{
    SHORT, heartbeat_withdrawals, mig, name, require_chart, settle, slices, total_instances, uid,
};

tests![
    containerd_chart_plugin_container_got_what_the_plugin_needs,
    containerd_plugin_oom_killed_then_fixed_converges,
    containerd_restarted_mid_prepare_converges,
    containerd_unpullable_plugin_image_is_reported,
];

/// One line per plugin pod (name, phase, the container's state), for failure messages.
fn describe(pods: &[Pod]) -> String {
    pods.iter()
        .map(|p| {
            let status = plugin_container(p)
                .map(|s| {
                    format!(
                        "ready={} restarts={} state={} last={}",
                        s.ready,
                        s.restart_count,
                        serde_json::to_string(&s.state).unwrap_or_default(),
                        serde_json::to_string(&s.last_state).unwrap_or_default()
                    )
                })
                .unwrap_or_default();
            let phase = p
                .status
                .as_ref()
                .and_then(|s| s.phase.clone())
                .unwrap_or_default();
            format!("{} {phase} {status}", name(p))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Holds the next compute-instance creation in the fake NVML for `millis`: a prepare started
/// then is caught with its GPU instance made and its compute instance not yet.
fn hold_next_compute_instance(cluster: &Cluster, millis: u64) -> anyhow::Result<()> {
    cluster.update_gpus(|s| {
        s.faults.push(FaultState {
            fault: FaultConfig::latency("nvmlGpuInstanceCreateComputeInstance", millis).times(1),
            hits: 0,
        })
    })
}

/// GPU instances without a compute instance: a prepare caught halfway.
fn half_made(cluster: &Cluster) -> anyhow::Result<usize> {
    Ok(cluster
        .gpus()?
        .gpus
        .iter()
        .flat_map(|g| &g.gpu_instances)
        .filter(|gi| gi.compute_instances.is_empty())
        .count())
}

async fn wait_half_made(cluster: &Cluster) -> anyhow::Result<()> {
    wait_until(SHORT, || async { (half_made(cluster).ok()? > 0).then_some(()) })
        .await
        .context("no prepare reached the held compute-instance creation")
}

/// Exactly one MIG instance, whole (one compute instance), on the whole simulated host.
fn one_whole_instance(cluster: &Cluster) -> anyhow::Result<()> {
    let all: Vec<_> = cluster
        .gpus()?
        .gpus
        .iter()
        .flat_map(|g| g.gpu_instances.clone())
        .collect();
    ensure!(
        all.len() == 1 && all[0].compute_instances.len() == 1,
        "expected one whole MIG instance, found {all:?}"
    );
    Ok(())
}

/// What runc gave the plugin's container, read from its main process on the host
/// (`/proc/<pid>`): the chart's mounts at their paths, the privileges NVML needs on a real
/// node, and the node's name. The simulated host cannot notice these missing: the e2e values
/// mount the whole simulated GPU host (its `dev` directory included) for the fake NVML, whose
/// "device nodes" are plain files, so a chart without its `/dev` mount or without `privileged`
/// would still pass every other test here and fail on the first real node.
async fn containerd_chart_plugin_container_got_what_the_plugin_needs(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    require_chart(cluster)?;
    let plugin = cluster.the_plugin_pod().await?;
    let container = plugin_container(&plugin)
        .and_then(|s| s.container_id.clone())
        .context("no container id")?;
    let pid = cluster.container_pid(&container)?;
    let proc_dir = std::path::PathBuf::from(format!("/proc/{pid}"));
    let read = |file: &str| {
        std::fs::read_to_string(proc_dir.join(file)).with_context(|| format!("reading /proc/{pid}/{file}"))
    };

    // Mount points as the container sees them (mountinfo's fifth field).
    let mountinfo = read("mountinfo")?;
    let mounts: Vec<&str> = mountinfo
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .collect();
    let run = cluster.layout.run_dir.to_str().context("non-UTF-8 run dir")?;
    let kubelet_root = cluster
        .layout
        .kubelet_root
        .to_str()
        .context("non-UTF-8 kubelet root")?;
    let wanted = [
        (
            format!("{kubelet_root}/plugins"),
            "the kubelet's plugins dir (DRA socket, checkpoint)",
        ),
        (
            format!("{kubelet_root}/plugins_registry"),
            "the kubelet's registration dir",
        ),
        (format!("{run}/cdi"), "the CDI spec dir (cdiRoot)"),
        ("/driver-root".to_string(), "the driver root (nvidiaDriverRoot)"),
        (format!("{run}/gpu-host/dev"), "the device root (devRoot)"),
        (format!("/host{run}/gpu-host/hook-bin"), "the nvidia-cdi-hook dir"),
    ];
    for (path, what) in &wanted {
        ensure!(
            mounts.contains(&path.as_str()),
            "the plugin's container has no mount of {what} at {path}; its mounts: {mounts:?}"
        );
    }

    // privileged: every capability (CAP_SYS_ADMIN among them) and every device in its
    // devices cgroup: NVML opens the /dev/nvidia-caps nodes MIG instances bring.
    let status = read("status")?;
    let cap_eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(str::trim)
        .context("no CapEff in /proc/<pid>/status")?;
    let cap_eff = u64::from_str_radix(cap_eff, 16)?;
    const CAP_SYS_ADMIN: u32 = 21;
    ensure!(
        cap_eff & (1 << CAP_SYS_ADMIN) != 0,
        "the plugin's container lacks CAP_SYS_ADMIN (CapEff {cap_eff:#x}): is it privileged?"
    );
    let cgroup = read("cgroup")?;
    let devices = cgroup
        .lines()
        .find_map(|l| l.split_once(":devices:").map(|(_, path)| path))
        .context("the plugin's process is in no devices cgroup (cgroup v1 expected here)")?;
    let list_path = format!("/sys/fs/cgroup/devices{devices}/devices.list");
    let list = std::fs::read_to_string(&list_path).with_context(|| format!("reading {list_path}"))?;
    ensure!(
        list.lines().any(|l| l.trim() == "a *:* rwm"),
        "the plugin's container may not open every device (devices cgroup {devices}: {list:?}): is it privileged?"
    );

    // The node's name, from the downward API.
    let environ =
        std::fs::read(proc_dir.join("environ")).with_context(|| format!("reading /proc/{pid}/environ"))?;
    let node_name = environ
        .split(|b| *b == 0)
        .find_map(|v| v.strip_prefix(b"NODE_NAME="))
        .map(|v| String::from_utf8_lossy(v).into_owned());
    ensure!(
        node_name.as_deref() == Some(NODE),
        "the plugin's NODE_NAME is {node_name:?}, the node is {NODE}"
    );
    Ok(())
}

/// `result`, with the plugin pods' states added to its error.
async fn with_plugin_pods<T>(cluster: &Cluster, result: anyhow::Result<T>, what: &str) -> anyhow::Result<T> {
    match result {
        Ok(value) => Ok(value),
        Err(e) => {
            let pods = cluster.plugin_pods().await.map(|p| describe(&p));
            Err(e.context(format!("{what}:\n{}", pods.unwrap_or_else(|e| format!("{e:#}")))))
        }
    }
}

/// A memory limit the plugin cannot live in (`helm upgrade` of its resources): the kernel
/// OOM-kills the new pod's container (the kubelet reports `OOMKilled`) and restarts it, while
/// the surge keeps the old pod serving claims. Fixing the values (the rollback) converges to
/// one Ready plugin; claims from before and after are prepared and nothing leaks.
async fn containerd_plugin_oom_killed_then_fixed_converges(cluster: &mut Cluster) -> anyhow::Result<()> {
    require_chart(cluster)?;
    let c = cluster.client.clone();
    create_template(&c, "before-oom", mig(&[profile_is("1g.10gb")]), None).await?;
    create_pod(&c, "before-oom", "before-oom", &["sleep", "3600"], false).await?;
    wait_phase(&c, "before-oom", "Running", SHORT).await?;
    let old = uid(&cluster.the_plugin_pod().await?);
    cluster.upgrade_chart(&[
        "kubeletPlugin.resources.requests.memory=6Mi",
        "kubeletPlugin.resources.limits.memory=6Mi",
    ])?;
    let oom = wait_until(Duration::from_secs(180), || async {
        let pods = cluster.plugin_pods().await.ok()?;
        pods.iter().filter(|p| uid(p) != old).find_map(|p| {
            let s = plugin_container(p)?;
            let terminated = [s.state.as_ref(), s.last_state.as_ref()]
                .into_iter()
                .flatten()
                .filter_map(|st| st.terminated.as_ref())
                .find(|t| t.reason.as_deref() == Some("OOMKilled"))?;
            Some((s.restart_count, terminated.clone()))
        })
    })
    .await;
    let oom = with_plugin_pods(
        cluster,
        oom,
        "the plugin container under a 6Mi limit was not OOM-killed",
    )
    .await?;
    eprintln!("e2e: the plugin under a 6Mi limit: {oom:?}");
    ensure!(
        oom.1.exit_code == 128 + libc::SIGKILL,
        "OOMKilled with exit code {}",
        oom.1.exit_code
    );
    // The old pod still serves: a claim made now is prepared by it.
    let pods = cluster.plugin_pods().await?;
    ensure!(
        pods.iter().any(|p| uid(p) == old && plugin_ready(p)),
        "the old plugin pod stopped serving during the failed rollout:\n{}",
        describe(&pods)
    );
    create_template(&c, "during-oom", mig(&[profile_is("1g.10gb")]), None).await?;
    create_pod(&c, "during-oom", "during-oom", &["sleep", "3600"], false).await?;
    wait_phase(&c, "during-oom", "Running", Duration::from_secs(120)).await?;
    cluster.restore_chart().await?;
    ensure!(
        workload::phase(&c, "before-oom").await.as_deref() == Some("Running"),
        "the pod prepared before the failed rollout stopped running"
    );
    ensure!(
        total_instances(cluster) == 2,
        "instances: {:?}",
        cluster.gpus()?.gpus
    );
    delete_pods(&c, &["before-oom", "during-oom"]).await?;
    settle(cluster).await
}

/// containerd is stopped and started again (by its pid) while a prepare is held in NVML: the
/// plugin's container keeps running under its shim (no restart), the prepare finishes, the
/// kubelet makes the pod's sandbox once containerd answers again, and the pod runs with one
/// whole instance; nothing is left after it is deleted.
async fn containerd_restarted_mid_prepare_converges(cluster: &mut Cluster) -> anyhow::Result<()> {
    require_chart(cluster)?;
    let c = cluster.client.clone();
    let plugin = cluster.the_plugin_pod().await?;
    let restarts = plugin_container(&plugin)
        .map(|s| s.restart_count)
        .unwrap_or_default();
    hold_next_compute_instance(cluster, 8000)?;
    create_template(&c, "ctrd-restart", mig(&[profile_is("1g.10gb")]), None).await?;
    create_pod(&c, "ctrd-restart", "ctrd-restart", &["sleep", "3600"], false).await?;
    wait_half_made(cluster).await?;
    let restarted = Instant::now();
    cluster.restart_containerd()?;
    eprintln!(
        "e2e: containerd stopped and started again in {:.1}s",
        restarted.elapsed().as_secs_f64()
    );
    wait_phase(&c, "ctrd-restart", "Running", Duration::from_secs(180)).await?;
    one_whole_instance(cluster)?;
    let plugin = cluster.the_plugin_pod().await?;
    let now = plugin_container(&plugin)
        .map(|s| s.restart_count)
        .unwrap_or_default();
    ensure!(
        now == restarts,
        "the plugin container restarted ({restarts} -> {now}) across containerd's restart"
    );
    delete_pods(&c, &["ctrd-restart"]).await?;
    settle(cluster).await
}

/// The plugin's image cannot be pulled (`helm upgrade` to a tag that does not exist): the new
/// pod's status names the image and the pull failure while the surge keeps the old pod
/// serving. Once the old pod hangs and is deleted, the node has no plugin answering: the
/// controller withdraws its pool on the expired heartbeat rather than advertise it. Fixing the image
/// (the rollback) brings the plugin and the pool back.
async fn containerd_unpullable_plugin_image_is_reported(cluster: &mut Cluster) -> anyhow::Result<()> {
    require_chart(cluster)?;
    let old = cluster.the_plugin_pod().await?;
    cluster.upgrade_chart(&[
        "kubeletPlugin.image.tag=0.0.0-missing",
        "kubeletPlugin.image.pullPolicy=IfNotPresent",
    ])?;
    let pulled = wait_until(Duration::from_secs(120), || async {
        let pods = cluster.plugin_pods().await.ok()?;
        pods.iter().filter(|p| uid(p) != uid(&old)).find_map(|p| {
            let s = plugin_container(p)?;
            let waiting = s.state.as_ref()?.waiting.as_ref()?;
            let reason = waiting.reason.clone()?;
            matches!(reason.as_str(), "ErrImagePull" | "ImagePullBackOff").then(|| {
                (
                    s.image.clone(),
                    reason,
                    waiting.message.clone().unwrap_or_default(),
                )
            })
        })
    })
    .await;
    let (image, reason, message) =
        with_plugin_pods(cluster, pulled, "no plugin pod reports the failed pull").await?;
    eprintln!("e2e: the plugin pod with image {image}: {reason}: {message}");
    ensure!(
        image.ends_with(":0.0.0-missing") && message.contains(&image),
        "the pull failure does not name the image {image}: {message}"
    );
    let pods = cluster.plugin_pods().await?;
    ensure!(
        pods.iter().any(|p| uid(p) == uid(&old) && plugin_ready(p)),
        "the old plugin pod stopped serving during the failed rollout:\n{}",
        describe(&pods)
    );
    cluster.wait_published(Duration::from_secs(30)).await?;

    // The old pod stops answering (frozen: SIGSTOP to its container's process, as a hung
    // plugin) and is deleted; its SIGTERM waits behind the stop until the kubelet's SIGKILL at
    // the end of the grace period, so nothing deregisters it: the controller must notice the
    // missed heartbeats.
    let old_container = plugin_container(&old)
        .and_then(|s| s.container_id.clone())
        .context("no container id")?;
    let pid = i32::try_from(cluster.container_pid(&old_container)?)?;
    let withdrawn_before = heartbeat_withdrawals(cluster);
    let frozen = Instant::now();
    // SAFETY: kill(2) on the pid containerd reports for the old plugin's container.
    #[allow(unsafe_code)]
    let stopped = unsafe { libc::kill(pid, libc::SIGSTOP) };
    ensure!(
        stopped == 0,
        "kill -STOP {pid}: {}",
        std::io::Error::last_os_error()
    );
    Api::<Pod>::namespaced(cluster.client.clone(), CHART_NAMESPACE)
        .delete(&name(&old), &DeleteParams::default())
        .await?;
    wait_until(Duration::from_secs(120), || async {
        slices(cluster).await.ok()?.is_empty().then_some(())
    })
    .await
    .context("the pool stayed advertised with no plugin answering")?;
    eprintln!(
        "e2e: the pool was withdrawn {:.1}s after the last running plugin froze",
        frozen.elapsed().as_secs_f64()
    );
    ensure!(
        heartbeat_withdrawals(cluster) > withdrawn_before,
        "the controller did not withdraw the pool for the expired heartbeat"
    );
    let pods = cluster.plugin_pods().await?;
    ensure!(
        pods.iter().all(|p| !plugin_ready(p)),
        "a plugin pod is Ready with an image that cannot be pulled:\n{}",
        describe(&pods)
    );
    cluster.restore_chart().await?;
    // Claims work again.
    let c = cluster.client.clone();
    create_template(&c, "after-pull-fix", mig(&[profile_is("1g.10gb")]), None).await?;
    create_pod(&c, "after-pull-fix", "after-pull-fix", &["sleep", "3600"], false).await?;
    wait_phase(&c, "after-pull-fix", "Running", Duration::from_secs(120)).await?;
    delete_pods(&c, &["after-pull-fix"]).await?;
    settle(cluster).await
}
