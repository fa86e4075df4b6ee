//! End-to-end tests on a real cluster: upstream etcd, kube-apiserver, kube-scheduler,
//! kube-controller-manager and kubelet, the fake CRI runtime, simulated GPUs, and migdra's
//! controller and kubelet plugin. One cluster is started for the whole suite; tests run one
//! after another and each leaves the GPUs empty.
//!
//! Run: `cargo build --workspace && cargo test -p migdra-e2e --test e2e`

#![allow(clippy::unwrap_used)] // test code

use std::{
    collections::BTreeMap,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::{
    Api, ResourceExt,
    api::{Patch, PatchParams, PostParams},
};
use libtest_mimic::{Arguments, Failed, Trial};
use migdra_api::{
    catalog,
    device_name::DeviceName,
    inventory::{GpuNode, pool_name},
    slices::validate::validate_pool,
};
use migdra_e2e::{
    cluster::{
        CHART_NAMESPACE, CONTROLLER_ACCOUNT, Cluster, ClusterConfig, DRIVER, NODE, PLUGIN_ACCOUNT, wait_until,
    },
    workload::{self, Request, create_pod, create_template, on_gpu, profile_is, wait_phase},
};
use migdra_fake_nvml::config::FaultConfig;
use serde_json::json;
use tokio::sync::Mutex;

type Shared = Arc<Mutex<Cluster>>;
type TestFn = for<'a> fn(&'a mut Cluster) -> futures::future::BoxFuture<'a, anyhow::Result<()>>;

const MIG: &str = "mig.migdra.dev";
const WHOLE: &str = "gpu.migdra.dev";
const SHORT: Duration = Duration::from_secs(60);

fn mig(selectors: &[String]) -> Request {
    Request::Exactly {
        class: MIG.into(),
        selectors: selectors.to_vec(),
    }
}

/// UUID of the simulated GPU with `minor`.
fn gpu_uuid(cluster: &Cluster, minor: u32) -> String {
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
fn instances(cluster: &Cluster, minor: u32) -> Vec<(u32, u32, Vec<String>)> {
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

fn total_instances(cluster: &Cluster) -> usize {
    cluster
        .gpus()
        .unwrap()
        .gpus
        .iter()
        .map(|g| g.gpu_instances.len())
        .sum()
}

async fn slices(cluster: &Cluster) -> anyhow::Result<Vec<ResourceSlice>> {
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
/// every CDI spec removed.
async fn settle(cluster: &Cluster) -> anyhow::Result<()> {
    workload::delete_all(&cluster.client).await?;
    wait_until(Duration::from_secs(120), || async {
        (total_instances(cluster) == 0).then_some(())
    })
    .await
    .with_context(|| format!("MIG instances left behind: {:?}", cluster.gpus().map(|s| s.gpus)))?;
    let specs: Vec<_> = std::fs::read_dir(&cluster.layout.cdi_dir)?
        .flatten()
        .map(|e| e.path())
        .collect();
    ensure!(specs.is_empty(), "CDI specs left behind: {specs:?}");
    Ok(())
}

// ---- 1 ------------------------------------------------------------------------------

fn slices_match_the_model(cluster: &mut Cluster) -> futures::future::BoxFuture<'_, anyhow::Result<()>> {
    Box::pin(async move {
        let slices = slices(cluster).await?;
        let specs: Vec<_> = slices.iter().map(|s| s.spec.clone()).collect();
        validate_pool(&specs).map_err(|e| anyhow::anyhow!("published pool is invalid: {e:?}"))?;
        let generation = specs[0].pool.generation;
        ensure!(
            specs.iter().all(|s| s.pool.generation == generation),
            "mixed generations"
        );
        ensure!(
            specs.len() as i64 == specs[0].pool.resource_slice_count,
            "pool incomplete"
        );
        // Devices per GPU and profile, as published...
        let mut published: BTreeMap<(u32, String), usize> = BTreeMap::new();
        for device in specs.iter().flat_map(|s| s.devices.iter().flatten()) {
            let key = match device.name.parse::<DeviceName>()? {
                DeviceName::Gpu { minor } => (minor, "whole".to_string()),
                DeviceName::Mig { minor, profile, .. } => (minor, profile.to_string()),
            };
            *published.entry(key).or_default() += 1;
        }
        // ...and as the model says: every placement of every profile, whole GPUs only where
        // MIG mode can be switched without a reset (Hopper), none on the A100 in MIG mode.
        let mut expected: BTreeMap<(u32, String), usize> = BTreeMap::new();
        for gpu in cluster.gpus()?.gpus {
            let model = catalog::model(&gpu.model).context("model")?;
            for p in &model.profiles {
                expected.insert((gpu.minor, p.name.to_string()), p.placements.len());
            }
            if model.architecture.mig_mode_switchable() {
                expected.insert((gpu.minor, "whole".into()), 1);
            }
        }
        ensure!(
            published == expected,
            "published {published:?}\nexpected {expected:?}"
        );
        // The counter sets are in their own slices, one per GPU.
        let sets: usize = specs
            .iter()
            .map(|s| s.shared_counters.as_ref().map_or(0, Vec::len))
            .sum();
        ensure!(sets == 3, "{sets} counter sets");
        Ok(())
    })
}

// ---- 2 ------------------------------------------------------------------------------

fn mig_pod_gets_exactly_its_instance(
    cluster: &mut Cluster,
) -> futures::future::BoxFuture<'_, anyhow::Result<()>> {
    Box::pin(async move {
        let c = cluster.client.clone();
        create_template(&c, "mig-3g", mig(&[profile_is("3g.40gb")]), None).await?;
        create_pod(&c, "mig-3g", "mig-3g", &["sleep", "3600"], false).await?;
        wait_phase(&c, "mig-3g", "Running", SHORT).await?;
        let claim = workload::pod_claim(&c, "mig-3g").await?;
        let allocated = workload::allocated(&claim);
        ensure!(allocated.len() == 1, "{allocated:?}");
        let device = &allocated[0].1;
        let DeviceName::Mig {
            minor,
            profile,
            start,
        } = device.parse::<DeviceName>()?
        else {
            bail!("{device} is not MIG")
        };
        ensure!(profile.to_string() == "3g.40gb");
        // The instance exists at the allocated placement (3g is GI profile 9).
        let on_gpu: Vec<_> = instances(cluster, minor)
            .into_iter()
            .filter(|(p, s, _)| *p == 9 && *s == start)
            .collect();
        ensure!(
            on_gpu.len() == 1,
            "no 3g instance at {start} on GPU {minor}: {:?}",
            instances(cluster, minor)
        );
        let mig_uuid = on_gpu[0].2.first().context("no compute instance")?.clone();
        // The container received exactly that instance.
        let record = workload::container_record(&cluster.layout.records_dir, "mig-3g", "main")?;
        ensure!(
            record.env_value("NVIDIA_VISIBLE_DEVICES") == Some(mig_uuid.as_str()),
            "env {:?}",
            record.env
        );
        let uid = claim.metadata.uid.clone().unwrap_or_default();
        ensure!(
            record.cdi_devices == vec![format!("{DRIVER}/claim={uid}-{device}")],
            "CDI devices {:?}",
            record.cdi_devices
        );
        let paths: Vec<&str> = record.device_nodes.iter().map(|n| n.path.as_str()).collect();
        for expected in [
            format!("/dev/nvidia{minor}"),
            "/dev/nvidiactl".into(),
            "/dev/nvidia-uvm".into(),
        ] {
            ensure!(
                paths.contains(&expected.as_str()),
                "missing {expected} in {paths:?}"
            );
        }
        let caps: Vec<_> = record
            .device_nodes
            .iter()
            .filter(|n| n.path.starts_with("/dev/nvidia-caps/"))
            .collect();
        ensure!(caps.len() == 2, "GI and CI capability nodes: {caps:?}");
        // Their minors are the ones of this instance's capability files.
        let state = cluster.gpus()?;
        let gi = state
            .gpus
            .iter()
            .find(|g| g.minor == minor)
            .unwrap()
            .gpu_instances
            .iter()
            .find(|gi| gi.start == start)
            .unwrap();
        let access = cluster.layout.gpu_host.join(format!(
            "proc-root/driver/nvidia/capabilities/gpu{minor}/mig/gi{}/access",
            gi.id
        ));
        let text = std::fs::read_to_string(&access)?;
        let gi_minor: i64 = text
            .lines()
            .find_map(|l| l.strip_prefix("DeviceFileMinor:"))
            .context("minor")?
            .trim()
            .parse()?;
        ensure!(
            caps.iter().any(|n| n.minor == gi_minor),
            "GI capability minor {gi_minor} not in {caps:?}"
        );
        // The kubelet shows the device's health from the plugin's health stream.
        let healthy = wait_until(Duration::from_secs(60), || async {
            device_health(cluster, "mig-3g", device)
                .await
                .filter(|h| h == "Healthy")
        })
        .await;
        ensure!(
            healthy.is_ok(),
            "device health stayed {:?}",
            device_health(cluster, "mig-3g", device).await
        );
        settle(cluster).await
    })
}

// ---- 3 ------------------------------------------------------------------------------

fn finished_pod_releases_its_instance(
    cluster: &mut Cluster,
) -> futures::future::BoxFuture<'_, anyhow::Result<()>> {
    Box::pin(async move {
        let c = cluster.client.clone();
        create_template(&c, "mig-2g", mig(&[profile_is("2g.20gb")]), None).await?;
        create_pod(&c, "short-job", "mig-2g", &["sleep", "10"], true).await?;
        wait_phase(&c, "short-job", "Running", SHORT).await?;
        let claim = workload::pod_claim(&c, "short-job").await?;
        let uid = claim.metadata.uid.clone().unwrap_or_default();
        let (_, device) = workload::allocated(&claim).pop().context("not allocated")?;
        let DeviceName::Mig { minor, start, .. } = device.parse::<DeviceName>()? else {
            bail!("not MIG")
        };
        ensure!(instances(cluster, minor).iter().any(|(_, s, _)| *s == start));
        wait_phase(&c, "short-job", "Succeeded", SHORT).await?;
        wait_until(SHORT, || async {
            (!instances(cluster, minor).iter().any(|(_, s, _)| *s == start)).then_some(())
        })
        .await
        .context("the instance was not destroyed after the pod finished")?;
        let spec = cluster.layout.cdi_dir.join(format!("{DRIVER}-claim_{uid}.json"));
        wait_until(SHORT, || async { (!spec.exists()).then_some(()) })
            .await
            .context("CDI spec not removed")?;
        ensure!(
            workload::phase(&c, "short-job").await.as_deref() == Some("Succeeded"),
            "the pod was not deleted, it completed"
        );
        settle(cluster).await
    })
}

// ---- 4 ------------------------------------------------------------------------------

fn seven_1g_pods_pack_one_gpu_and_an_eighth_waits(
    cluster: &mut Cluster,
) -> futures::future::BoxFuture<'_, anyhow::Result<()>> {
    Box::pin(async move {
        let c = cluster.client.clone();
        let uuid = gpu_uuid(cluster, 1);
        create_template(&c, "one-g", mig(&[profile_is("1g.10gb"), on_gpu(&uuid)]), None).await?;
        create_pod(&c, "pack-1", "one-g", &["sleep", "60"], true).await?;
        for i in 2..=7 {
            create_pod(&c, &format!("pack-{i}"), "one-g", &["sleep", "3600"], true).await?;
        }
        for i in 1..=7 {
            wait_phase(&c, &format!("pack-{i}"), "Running", Duration::from_secs(90)).await?;
        }
        let mut starts: Vec<u32> = instances(cluster, 1)
            .iter()
            .filter(|(p, _, _)| *p == 19)
            .map(|(_, s, _)| *s)
            .collect();
        starts.sort_unstable();
        ensure!(
            starts == vec![0, 1, 2, 3, 4, 5, 6],
            "GPU 1 holds 1g instances at {starts:?}"
        );
        create_pod(&c, "pack-8", "one-g", &["sleep", "3600"], true).await?;
        // The eighth cannot be scheduled while the seven run.
        let deadline = Instant::now() + Duration::from_secs(8);
        while Instant::now() < deadline {
            ensure!(
                workload::phase(&c, "pack-8").await.as_deref() == Some("Pending"),
                "pack-8 left Pending early"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        ensure!(
            workload::phase(&c, "pack-1").await.as_deref() == Some("Running"),
            "pack-1 finished too early for the check"
        );
        wait_phase(&c, "pack-1", "Succeeded", Duration::from_secs(90)).await?;
        wait_phase(&c, "pack-8", "Running", Duration::from_secs(120)).await?;
        ensure!(instances(cluster, 1).len() == 7);
        settle(cluster).await
    })
}

// ---- 5 ------------------------------------------------------------------------------

fn whole_gpu_and_partitions_exclude_each_other(
    cluster: &mut Cluster,
) -> futures::future::BoxFuture<'_, anyhow::Result<()>> {
    Box::pin(async move {
        let c = cluster.client.clone();
        let uuid = gpu_uuid(cluster, 1);
        create_template(&c, "part", mig(&[profile_is("1g.10gb"), on_gpu(&uuid)]), None).await?;
        create_template(
            &c,
            "whole",
            Request::Exactly {
                class: WHOLE.into(),
                selectors: vec![on_gpu(&uuid)],
            },
            None,
        )
        .await?;
        create_pod(&c, "part-1", "part", &["sleep", "3600"], false).await?;
        wait_phase(&c, "part-1", "Running", SHORT).await?;
        create_pod(&c, "whole-1", "whole", &["sleep", "3600"], false).await?;
        tokio::time::sleep(Duration::from_secs(8)).await;
        ensure!(
            workload::phase(&c, "whole-1").await.as_deref() == Some("Pending"),
            "whole GPU allocated next to a partition"
        );
        workload::delete_pods(&c, &["part-1"]).await?;
        wait_phase(&c, "whole-1", "Running", Duration::from_secs(120)).await?;
        let gpu = cluster.gpus()?.gpus.into_iter().find(|g| g.minor == 1).unwrap();
        ensure!(
            !gpu.mig_enabled && gpu.gpu_instances.is_empty(),
            "whole GPU needs MIG off and no instances"
        );
        let record = workload::container_record(&cluster.layout.records_dir, "whole-1", "main")?;
        ensure!(record.env_value("NVIDIA_VISIBLE_DEVICES") == Some(uuid.as_str()));
        create_pod(&c, "part-2", "part", &["sleep", "3600"], false).await?;
        tokio::time::sleep(Duration::from_secs(8)).await;
        ensure!(
            workload::phase(&c, "part-2").await.as_deref() == Some("Pending"),
            "partition allocated on a GPU in use whole"
        );
        workload::delete_pods(&c, &["whole-1"]).await?;
        wait_phase(&c, "part-2", "Running", Duration::from_secs(120)).await?;
        ensure!(
            cluster
                .gpus()?
                .gpus
                .iter()
                .find(|g| g.minor == 1)
                .unwrap()
                .mig_enabled,
            "MIG switched back on"
        );
        settle(cluster).await
    })
}

// ---- 6 ------------------------------------------------------------------------------

fn first_available_falls_back_when_no_2g_fits(
    cluster: &mut Cluster,
) -> futures::future::BoxFuture<'_, anyhow::Result<()>> {
    Box::pin(async move {
        let c = cluster.client.clone();
        let a100 = gpu_uuid(cluster, 2);
        create_template(&c, "a100-4g", mig(&[profile_is("4g.20gb"), on_gpu(&a100)]), None).await?;
        create_template(&c, "a100-2g", mig(&[profile_is("2g.10gb"), on_gpu(&a100)]), None).await?;
        create_pod(&c, "fill-4g", "a100-4g", &["sleep", "3600"], false).await?;
        wait_phase(&c, "fill-4g", "Running", SHORT).await?;
        create_pod(&c, "fill-2g", "a100-2g", &["sleep", "3600"], false).await?;
        wait_phase(&c, "fill-2g", "Running", SHORT).await?;
        // Slices 0-5 are taken: no 2g placement (0, 2, 4) is free, but a 1g fits at 6.
        let chain = Request::FirstAvailable(vec![
            (
                "big".into(),
                MIG.into(),
                vec![profile_is("2g.10gb"), on_gpu(&a100)],
            ),
            (
                "small".into(),
                MIG.into(),
                vec![profile_is("1g.5gb"), on_gpu(&a100)],
            ),
        ]);
        create_template(&c, "fallback", chain, None).await?;
        create_pod(&c, "fallback", "fallback", &["sleep", "3600"], false).await?;
        wait_phase(&c, "fallback", "Running", SHORT).await?;
        let claim = workload::pod_claim(&c, "fallback").await?;
        let allocated = workload::allocated(&claim);
        ensure!(
            allocated.len() == 1 && allocated[0].0 == "gpu/small",
            "{allocated:?}"
        );
        ensure!(allocated[0].1 == "gpu-2-mig-1g5gb-6", "{allocated:?}");
        let record = workload::container_record(&cluster.layout.records_dir, "fallback", "main")?;
        ensure!(
            record
                .env_value("NVIDIA_VISIBLE_DEVICES")
                .is_some_and(|v| v.starts_with("MIG-"))
        );
        settle(cluster).await
    })
}

// ---- 7 ------------------------------------------------------------------------------

fn kubelet_restart_republishes_slices_and_keeps_pods(
    cluster: &mut Cluster,
) -> futures::future::BoxFuture<'_, anyhow::Result<()>> {
    Box::pin(async move {
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
        ensure!(workload::phase(&c, "survivor").await.as_deref() == Some("Running"));
        let record = workload::container_record(&cluster.layout.records_dir, "survivor", "main")?;
        ensure!(record.state == "running", "container state {}", record.state);
        ensure!(
            total_instances(cluster) == instances_before,
            "instances changed across the kubelet restart"
        );
        settle(cluster).await
    })
}

fn plugin_killed_mid_prepare_converges(
    cluster: &mut Cluster,
) -> futures::future::BoxFuture<'_, anyhow::Result<()>> {
    Box::pin(async move {
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
        cluster.kill("migdra-kubelet-plugin");
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
        cluster.start_plugin()?;
        wait_phase(&c, "crashy", "Running", Duration::from_secs(180)).await?;
        // The restarted plugin rolled the half-prepared claim back and said so on its GpuNode.
        let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(c.clone(), "default");
        let note = wait_until(Duration::from_secs(30), || async {
            let list = events
                .list(&kube::api::ListParams::default().fields(&format!("involvedObject.name={NODE}")))
                .await
                .ok()?;
            list.items
                .into_iter()
                .find(|e| e.reason.as_deref() == Some("RecoveredInterruptedOperations"))
                .and_then(|e| e.message)
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
        let record = workload::container_record(&cluster.layout.records_dir, "crashy", "main")?;
        ensure!(
            record.env_value("NVIDIA_VISIBLE_DEVICES") == Some(all[0].compute_instances[0].uuid.as_str())
        );
        ensure!(
            cluster
                .gpus()?
                .gpus
                .iter()
                .any(|g| g.minor == minor && g.gpu_instances.len() == 1)
        );
        settle(cluster).await
    })
}

// ---- 8 ------------------------------------------------------------------------------

fn bad_opaque_config_is_reported_and_creates_nothing(
    cluster: &mut Cluster,
) -> futures::future::BoxFuture<'_, anyhow::Result<()>> {
    Box::pin(async move {
        let c = cluster.client.clone();
        let config =
            json!({"apiVersion": "gpu.migdra.dev/v1alpha1", "kind": "DeviceConfig", "sharing": "mps"});
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
    })
}

// ---- health -------------------------------------------------------------------------------

/// Health the kubelet reports for `device` in the pod's first container.
async fn device_health(cluster: &Cluster, pod: &str, device: &str) -> Option<String> {
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

/// Devices of GPU `minor` in the published pool.
async fn published_on(cluster: &Cluster, minor: u32) -> Option<usize> {
    let prefix = format!("gpu-{minor}");
    let slices = slices(cluster).await.ok()?;
    Some(
        slices
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .filter(|d| d.name == prefix || d.name.starts_with(&format!("{prefix}-")))
            .count(),
    )
}

async fn wait_health(cluster: &Cluster, pod: &str, device: &str, want: &str) -> anyhow::Result<()> {
    wait_until(Duration::from_secs(60), || async {
        device_health(cluster, pod, device).await.filter(|h| h == want)
    })
    .await
    .with_context(|| format!("device health never became {want}"))
    .map(drop)
}

fn lost_gpu_turns_unhealthy_and_leaves_the_pool(
    cluster: &mut Cluster,
) -> futures::future::BoxFuture<'_, anyhow::Result<()>> {
    Box::pin(async move {
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
        // controller withdraws the GPU's devices (the default policy omits unhealthy GPUs).
        cluster.update_gpus(|s| s.gpus[2].lost = true)?;
        wait_health(cluster, "watched", &device, "Unhealthy").await?;
        wait_until(Duration::from_secs(60), || async {
            (published_on(cluster, 2).await == Some(0)).then_some(())
        })
        .await
        .context("the lost GPU's devices were not withdrawn")?;
        ensure!(
            published_on(cluster, 0).await.unwrap_or(0) > 0,
            "the healthy GPUs stay published"
        );
        // It comes back.
        cluster.update_gpus(|s| s.gpus[2].lost = false)?;
        wait_health(cluster, "watched", &device, "Healthy").await?;
        wait_until(Duration::from_secs(60), || async {
            (published_on(cluster, 2).await > Some(0)).then_some(())
        })
        .await
        .context("the recovered GPU was not published again")?;
        settle(cluster).await
    })
}

// ---- the Helm chart under a real API server -------------------------------------------

fn kubectl(cluster: &Cluster, args: &[&str]) -> anyhow::Result<std::process::Output> {
    Ok(
        std::process::Command::new(cluster.layout.upstream_bin.join("kubectl"))
            .arg(format!("--kubeconfig={}", cluster.layout.kubeconfig.display()))
            .args(args)
            .output()?,
    )
}

fn chart_objects_pass_server_side_dry_run(
    cluster: &mut Cluster,
) -> futures::future::BoxFuture<'_, anyhow::Result<()>> {
    Box::pin(async move {
        for file in ["chart-default.yaml", "chart-custom.yaml"] {
            let path = cluster.layout.run_dir.join(file);
            let rendered = std::fs::read_to_string(&path)?;
            let objects = rendered.matches("\nkind: ").count() + usize::from(rendered.starts_with("kind: "));
            ensure!(objects >= 10, "{file}: only {objects} objects rendered");
            let out = kubectl(
                cluster,
                &[
                    "apply",
                    "--server-side",
                    "--dry-run=server",
                    "--force-conflicts",
                    "--field-manager=migdra-e2e",
                    "-f",
                    &path.to_string_lossy(),
                ],
            )?;
            let stdout = String::from_utf8_lossy(&out.stdout);
            ensure!(
                out.status.success(),
                "{file} rejected by the API server:\n{}{}",
                stdout,
                String::from_utf8_lossy(&out.stderr)
            );
            let applied = stdout.lines().filter(|l| l.contains("(server dry run)")).count();
            ensure!(
                applied == objects,
                "{file}: {applied} of {objects} objects applied:\n{stdout}"
            );
        }
        // The examples the docs point to are valid objects for this API server too.
        let examples = migdra_e2e::cluster::repo_root().join("examples");
        let out = kubectl(
            cluster,
            &[
                "apply",
                "--dry-run=server",
                "--namespace=default",
                "-f",
                &examples.to_string_lossy(),
            ],
        )?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        ensure!(
            out.status.success(),
            "examples rejected:\n{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let applied = stdout.lines().filter(|l| l.contains("(server dry run)")).count();
        ensure!(
            applied == 11,
            "{applied} of 11 example objects applied:\n{stdout}"
        );
        Ok(())
    })
}

/// One row of charts/tests/rbac_matrix.txt.
struct Row {
    subject: String,
    verb: String,
    resource: String,
    subresource: Option<String>,
    namespace: Option<String>,
    name: Option<String>,
    expected: bool,
    check: String,
}

fn matrix() -> anyhow::Result<Vec<Row>> {
    let text =
        std::fs::read_to_string(migdra_e2e::cluster::repo_root().join("charts/tests/rbac_matrix.txt"))?;
    let field =
        |s: &str| (s != "-").then(|| s.replace("$RELEASE_NS", CHART_NAMESPACE).replace("$NODE", NODE));
    let mut rows = Vec::new();
    for line in text
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
    {
        let f: Vec<&str> = line.split_whitespace().collect();
        ensure!(f.len() == 8, "bad matrix row: {line}");
        rows.push(Row {
            subject: f[0].into(),
            verb: f[1].into(),
            resource: f[2].into(),
            subresource: field(f[3]),
            namespace: field(f[4]),
            name: field(f[5]),
            expected: f[6] == "yes",
            check: f[7].into(),
        });
    }
    Ok(rows)
}

fn rbac_matrix_holds_against_the_api_server(
    cluster: &mut Cluster,
) -> futures::future::BoxFuture<'_, anyhow::Result<()>> {
    Box::pin(async move {
        let rows = matrix()?;
        let mut failures = Vec::new();
        let mut checked = 0;
        for row in rows.iter().filter(|r| r.check == "can-i") {
            let account = if row.subject == "plugin" {
                PLUGIN_ACCOUNT
            } else {
                CONTROLLER_ACCOUNT
            };
            let target = match &row.name {
                Some(name) => format!("{}/{name}", row.resource),
                None => row.resource.clone(),
            };
            let mut args = vec!["auth".to_string(), "can-i".into(), row.verb.clone(), target];
            if let Some(sub) = &row.subresource {
                args.push(format!("--subresource={sub}"));
            }
            if let Some(ns) = &row.namespace {
                args.push(format!("--namespace={ns}"));
            }
            args.push(format!("--as=system:serviceaccount:{CHART_NAMESPACE}:{account}"));
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            let out = kubectl(cluster, &refs)?;
            let answer = String::from_utf8_lossy(&out.stdout).trim().to_string();
            if (answer == "yes") != row.expected {
                failures.push(format!(
                    "{} {}: got {answer}, expected {}",
                    row.subject,
                    args[2..].join(" "),
                    if row.expected { "yes" } else { "no" }
                ));
            }
            checked += 1;
        }
        // Admission rows: real requests with the plugin's node-bound token (dry run), against
        // its own node's GpuNode and another node's, which the admin creates first.
        let plugin = cluster.plugin_client().await?;
        let admin: Api<GpuNode> = Api::all(cluster.client.clone());
        let other: GpuNode = serde_json::from_value(json!({
            "apiVersion": "gpu.migdra.dev/v1alpha1", "kind": "GpuNode",
            "metadata": {"name": "other-node"}, "spec": {"nodeName": "other-node", "driver": DRIVER}
        }))?;
        admin.create(&PostParams::default(), &other).await?;
        let api: Api<GpuNode> = Api::all(plugin);
        for row in rows.iter().filter(|r| r.check == "admission") {
            let name = row.name.clone().context("admission rows name an object")?;
            let dry = PatchParams {
                dry_run: true,
                ..PatchParams::default()
            };
            let patch = Patch::Merge(json!({"metadata": {"labels": {"migdra.dev/e2e": "probe"}}}));
            let result = match (row.verb.as_str(), row.subresource.as_deref()) {
                ("create", None) => {
                    let mut object = other.clone();
                    object.metadata.name = Some(name.clone());
                    object.spec.node_name = name.clone();
                    api.create(
                        &PostParams {
                            dry_run: true,
                            ..PostParams::default()
                        },
                        &object,
                    )
                    .await
                    .map(drop)
                }
                ("patch", None) => api.patch(&name, &dry, &patch).await.map(drop),
                ("patch", Some("status")) => api
                    .patch_status(&name, &dry, &Patch::Merge(json!({"status": {"plugin": null}})))
                    .await
                    .map(drop),
                other => bail!("unsupported admission row {other:?}"),
            };
            // Allowed means admission let it through; an AlreadyExists after admission counts.
            let allowed = match &result {
                Ok(()) => true,
                Err(kube::Error::Api(e)) if e.code == 409 => true,
                Err(kube::Error::Api(e)) if e.code == 403 || e.code == 422 => {
                    ensure!(
                        e.message.contains("ValidatingAdmissionPolicy"),
                        "denied by something else: {}",
                        e.message
                    );
                    false
                }
                Err(e) => bail!("{} {} {name}: {e}", row.verb, row.resource),
            };
            if allowed != row.expected {
                failures.push(format!(
                    "plugin {} {} {name} ({:?}): allowed={allowed}, expected {}",
                    row.verb, row.resource, row.subresource, row.expected
                ));
            }
            checked += 1;
        }
        admin.delete("other-node", &Default::default()).await?;
        ensure!(checked == rows.len(), "checked {checked} of {} rows", rows.len());
        ensure!(
            failures.is_empty(),
            "{} of {checked} matrix rows failed:\n{}",
            failures.len(),
            failures.join("\n")
        );
        eprintln!("e2e: RBAC matrix: {checked} rows hold");
        Ok(())
    })
}

fn main() {
    let mut args = Arguments::from_args();
    args.test_threads = Some(1); // one cluster, tests in order
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let tests: Vec<(&str, TestFn)> = vec![
        ("slices_match_the_model", slices_match_the_model),
        (
            "mig_pod_gets_exactly_its_instance",
            mig_pod_gets_exactly_its_instance,
        ),
        (
            "finished_pod_releases_its_instance",
            finished_pod_releases_its_instance,
        ),
        (
            "seven_1g_pods_pack_one_gpu_and_an_eighth_waits",
            seven_1g_pods_pack_one_gpu_and_an_eighth_waits,
        ),
        (
            "whole_gpu_and_partitions_exclude_each_other",
            whole_gpu_and_partitions_exclude_each_other,
        ),
        (
            "first_available_falls_back_when_no_2g_fits",
            first_available_falls_back_when_no_2g_fits,
        ),
        (
            "kubelet_restart_republishes_slices_and_keeps_pods",
            kubelet_restart_republishes_slices_and_keeps_pods,
        ),
        (
            "plugin_killed_mid_prepare_converges",
            plugin_killed_mid_prepare_converges,
        ),
        (
            "bad_opaque_config_is_reported_and_creates_nothing",
            bad_opaque_config_is_reported_and_creates_nothing,
        ),
        (
            "lost_gpu_turns_unhealthy_and_leaves_the_pool",
            lost_gpu_turns_unhealthy_and_leaves_the_pool,
        ),
        (
            "chart_objects_pass_server_side_dry_run",
            chart_objects_pass_server_side_dry_run,
        ),
        (
            "rbac_matrix_holds_against_the_api_server",
            rbac_matrix_holds_against_the_api_server,
        ),
    ];
    if args.list {
        let trials = tests
            .iter()
            .map(|(name, _)| Trial::test(*name, || Ok(())))
            .collect();
        libtest_mimic::run(&args, trials).exit();
    }
    let started = Instant::now();
    let cluster = match runtime.block_on(Cluster::start(ClusterConfig::default())) {
        Ok(cluster) => cluster,
        Err(e) => {
            eprintln!("e2e: cluster start failed: {e:?}");
            std::process::exit(1);
        }
    };
    eprintln!(
        "e2e: cluster up in {:.1}s; run dir {}",
        started.elapsed().as_secs_f64(),
        cluster.layout.run_dir.display()
    );
    let logs = cluster.layout.logs_dir();
    let shared: Shared = Arc::new(Mutex::new(cluster));
    let handle = runtime.handle().clone();
    let trials = tests
        .into_iter()
        .map(|(name, test)| {
            let shared = shared.clone();
            let handle = handle.clone();
            let logs = logs.clone();
            Trial::test(name, move || {
                handle.block_on(async {
                    let mut cluster = shared.lock().await;
                    let started = Instant::now();
                    let result = test(&mut cluster).await;
                    eprintln!("e2e: {name} took {:.1}s", started.elapsed().as_secs_f64());
                    if result.is_err() {
                        // Leave the GPUs clean for the next test even after a failure.
                        if let Err(e) = settle(&cluster).await {
                            eprintln!("e2e: cleanup after {name} failed: {e:?}");
                        }
                    }
                    result.map_err(|e| Failed::from(format!("{e:?}\n(component logs in {})", logs.display())))
                })
            })
        })
        .collect();
    let conclusion = libtest_mimic::run(&args, trials);
    runtime.block_on(async {
        let mut cluster = shared.lock().await;
        for name in [
            "migdra-controller",
            "migdra-kubelet-plugin",
            "kubelet",
            "kube-apiserver",
        ] {
            if let Some(kib) = cluster.rss_kib(name) {
                eprintln!(
                    "e2e: resident memory of {name} after the suite: {:.1} MiB",
                    kib as f64 / 1024.0
                );
            }
        }
        cluster.teardown();
    });
    eprintln!(
        "e2e: total {:.1}s; logs kept in {}",
        started.elapsed().as_secs_f64(),
        logs.display()
    );
    conclusion.exit();
}
