//! B1, scheduling throughput: pods with one `1g.10gb` claim each over simulated 8-GPU nodes,
//! once against migdra's pools (every placement, shared counters) and once against the
//! static-MIG anchor (each node publishes 56 ready-made 1g.10gb devices without counters,
//! under a driver of its own), and against the peer, NVIDIA's DynamicMIG pools ([`super::peer`]).
//! No kubelet runs on simulated nodes, so this is scheduling plus
//! allocation: a pod counts when the scheduler bound it (`spec.nodeName` observed by a watch).
//! Correctness: every claim allocated, no device allocated twice.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::{
    core::v1::Pod,
    resource::v1::{DeviceClass, ResourceSlice},
};
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams, PostParams},
    runtime::{WatchStreamExt, watcher},
};
use serde_json::json;

use super::{
    node::MIG_1G_CLASS,
    pods::{NAMESPACE, RUN_LABEL, allocated_devices, create_template, delete_run, pod, run_claims},
};
use migdra_e2e::cluster::{Cluster, DRIVER, wait_until};

use super::{
    levers::{self, LEVER_CLASS, Lever},
    peer,
    profile::ProfileRequest,
    publish::{CONTROLLER, delete_driver_slices},
};
use crate::{
    probe::{load_average, peak_rss_kib, rss_kib, scrape_client},
    prom::Metrics,
    sim::objects::SIMULATED_LABEL,
    stats::{Samples, latency},
    table::Row,
};

/// Driver name of the static-MIG anchor's slices.
pub const STATIC_DRIVER: &str = "static.bench.migdra.dev";
/// DeviceClass of the anchor's devices.
pub const STATIC_CLASS: &str = "static-1g-10gb.bench.migdra.dev";
/// Ready-made 1g.10gb devices per anchor node (7 per H100, 8 H100s).
const STATIC_DEVICES_PER_NODE: usize = 56;

/// One scheduling run's outcome.
struct RunResult {
    bound: usize,
    pods: usize,
    pods_per_second: f64,
    bind_latency: Samples,
    creation_seconds: f64,
    correct: bool,
    unallocated: usize,
    duplicates: usize,
    /// Allocated devices per GPU minor ([`levers::landing`]).
    landing: String,
}

/// A static 1g.10gb device at `placement` of GPU `gpu` of `node`: the bare anchor's four
/// attributes and one capacity, or (`nvidia`) the attributes and capacities NVIDIA's DRA driver
/// publishes for a MIG device made ahead of time (H100 values).
fn static_device(node: &str, gpu: usize, placement: usize, nvidia: bool) -> serde_json::Value {
    let parent = format!("GPU-static-{node}-{gpu}");
    let mut device = json!({
        "name": format!("gpu-{gpu}-mig-1g10gb-{placement}"),
        "attributes": {
            "type": {"string": "mig"},
            "profile": {"string": "1g.10gb"},
            "parentUUID": {"string": parent},
            "placementStart": {"int": placement},
        },
        "capacity": {"memory": {"value": "10Gi"}},
    });
    if nvidia {
        device["attributes"] = json!({
            "type": {"string": "mig"},
            "uuid": {"string": format!("MIG-static-{node}-{gpu}-{placement}")},
            "parentUUID": {"string": parent},
            "profile": {"string": "1g.10gb"},
            "productName": {"string": "NVIDIA H100 80GB HBM3"},
            "brand": {"string": "Nvidia"},
            "architecture": {"string": "Hopper"},
            "cudaComputeCapability": {"version": "9.0.0"},
            "driverVersion": {"version": "580.82.7"},
            "cudaDriverVersion": {"version": "13.0.0"},
            "resource.kubernetes.io/pciBusID": {"string": format!("0000:{:02x}:00.0", 0x18 + gpu)},
            "resource.kubernetes.io/pcieRoot": {"string": format!("pci0000:{:02x}", 0x10 + gpu)},
        });
        device["capacity"] = json!({
            "multiprocessors": {"value": "16"},
            "copyEngines": {"value": "1"},
            "decoders": {"value": "1"},
            "encoders": {"value": "0"},
            "jpegEngines": {"value": "1"},
            "ofaEngines": {"value": "0"},
            "memory": {"value": "10Gi"},
            format!("memorySlice{placement}"): {"value": "1"},
        });
    }
    device
}

/// Publishes the anchor: one slice per node with 56 counter-less 1g.10gb devices, described
/// as [`static_device`] does.
async fn publish_static(client: &Client, nodes: &[String], nvidia: bool) -> anyhow::Result<()> {
    let classes: Api<DeviceClass> = Api::all(client.clone());
    let class: DeviceClass = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": STATIC_CLASS},
        "spec": {"selectors": [{"cel": {"expression": format!(
            "device.driver == \"{STATIC_DRIVER}\" && device.attributes[\"{STATIC_DRIVER}\"].type == \"mig\" && device.attributes[\"{STATIC_DRIVER}\"].profile == \"1g.10gb\""
        )}}]},
    }))?;
    match classes.create(&PostParams::default(), &class).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => return Err(e.into()),
    }
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    stream::iter(nodes.iter().cloned())
        .map(|node| {
            let slices = slices.clone();
            async move {
                let devices: Vec<_> = (0..STATIC_DEVICES_PER_NODE)
                    .map(|i| static_device(&node, i / 7, i % 7, nvidia))
                    .collect();
                let slice: ResourceSlice = serde_json::from_value(json!({
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceSlice",
                    "metadata": {"name": format!("{node}-static")},
                    "spec": {
                        "driver": STATIC_DRIVER,
                        "nodeName": node,
                        "pool": {"name": format!("{node}/static"), "generation": 1, "resourceSliceCount": 1},
                        "devices": devices,
                    },
                }))?;
                match crate::retry::retry(|| async { slices.create(&PostParams::default(), &slice).await })
                    .await
                {
                    Ok(_) => Ok(()),
                    Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
                    Err(e) => Err(anyhow::Error::from(e)),
                }
            }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

async fn remove_static(client: &Client) -> anyhow::Result<()> {
    delete_driver_slices(client, STATIC_DRIVER).await
}

/// Creates `count` pods of `run` with claims from `template` on simulated nodes, and waits
/// until the scheduler bound them all (or made no progress for a minute).
async fn schedule(
    client: &Client,
    run: &str,
    template: &str,
    count: usize,
    concurrency: usize,
) -> anyhow::Result<RunResult> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let bound: Arc<Mutex<BTreeMap<String, Instant>>> = Arc::default();
    let watch = {
        let (pods, bound) = (pods.clone(), bound.clone());
        let config = watcher::Config::default().labels(&format!("{RUN_LABEL}={run}"));
        tokio::spawn(async move {
            let mut events = std::pin::pin!(watcher(pods, config).applied_objects());
            while let Some(event) = events.next().await {
                let Ok(pod) = event else { continue };
                let on_node = pod.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some();
                if let (true, Some(name), Ok(mut bound)) = (on_node, pod.metadata.name, bound.lock()) {
                    bound.entry(name).or_insert_with(Instant::now);
                }
            }
        })
    };
    // Give the watch its initial list before the first pod exists.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let on_simulated = json!({SIMULATED_LABEL: "true"});
    let began = Instant::now();
    let created: BTreeMap<String, Instant> = stream::iter(0..count)
        .map(|i| {
            let (pods, on_simulated) = (pods.clone(), on_simulated.clone());
            async move {
                let name = format!("{run}-{i:05}");
                let at = Instant::now();
                pods.create(
                    &PostParams::default(),
                    &pod(&name, run, on_simulated, Some(template))?,
                )
                .await
                .with_context(|| format!("creating pod {name}"))?;
                anyhow::Ok((name, at))
            }
        })
        .buffer_unordered(concurrency.max(1))
        .try_collect()
        .await?;
    let creation_seconds = began.elapsed().as_secs_f64();
    let (mut last_count, mut last_progress) = (0, Instant::now());
    loop {
        let now_bound = bound.lock().map(|b| b.len()).unwrap_or_default();
        if now_bound >= count {
            break;
        }
        if now_bound != last_count {
            (last_count, last_progress) = (now_bound, Instant::now());
        } else if last_progress.elapsed() > Duration::from_secs(60) {
            tracing::warn!(
                run,
                bound = now_bound,
                count,
                "no pod bound for a minute; stopping the run"
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    watch.abort();
    let bound = bound.lock().map(|b| b.clone()).unwrap_or_default();
    let mut bind_latency = Samples::default();
    for (name, at) in &bound {
        if let Some(created) = created.get(name) {
            bind_latency.push(at.saturating_duration_since(*created));
        }
    }
    let last = bound.values().max().copied().unwrap_or(began);
    let span = last.saturating_duration_since(began).as_secs_f64();
    let claims = run_claims(client, run).await?;
    let (devices, unallocated) = allocated_devices(&claims);
    let distinct: BTreeSet<_> = devices.iter().collect();
    let duplicates = devices.len() - distinct.len();
    Ok(RunResult {
        bound: bound.len(),
        pods: count,
        pods_per_second: if span > 0.0 {
            bound.len() as f64 / span
        } else {
            0.0
        },
        bind_latency,
        creation_seconds,
        correct: bound.len() == count && claims.len() == count && unallocated == 0 && duplicates == 0,
        unallocated,
        duplicates,
        landing: levers::landing(&devices),
    })
}

/// What the scheduler's own metrics say about one phase (differences of two scrapes).
#[derive(Debug, Default)]
struct SchedulerFigures {
    /// `scheduler_schedule_attempts_total` by result.
    attempts: BTreeMap<String, f64>,
    /// Mean `scheduler_scheduling_attempt_duration_seconds` by result.
    attempt_mean: BTreeMap<String, f64>,
    /// Mean `scheduler_pod_scheduling_attempts` of the pods scheduled.
    attempts_per_pod: Option<f64>,
    /// DynamicResources' mean time and (sampled) count per extension point.
    dra: BTreeMap<String, (f64, f64)>,
    /// Mean time of each extension point over all plugins.
    extension_points: BTreeMap<String, f64>,
    /// `scheduler_queue_incoming_pods_total` by queue and event.
    incoming: BTreeMap<String, f64>,
}

fn label_values(m: &Metrics, name: &str, label: &str) -> BTreeSet<String> {
    m.matching(name, &[])
        .filter_map(|s| s.labels.get(label).cloned())
        .collect()
}

impl SchedulerFigures {
    fn between(before: &Metrics, after: &Metrics) -> Self {
        let mut f = Self::default();
        for result in label_values(after, "scheduler_schedule_attempts_total", "result") {
            let l = [("result", result.as_str())];
            let d = after.sum("scheduler_schedule_attempts_total", &l)
                - before.sum("scheduler_schedule_attempts_total", &l);
            f.attempts.insert(result.clone(), d);
            let h = "scheduler_scheduling_attempt_duration_seconds";
            if let Some(mean) = after
                .histogram(h, &l, |_| true)
                .since(&before.histogram(h, &l, |_| true))
                .mean()
            {
                f.attempt_mean.insert(result, mean);
            }
        }
        let h = "scheduler_pod_scheduling_attempts";
        f.attempts_per_pod = after
            .histogram(h, &[], |_| true)
            .since(&before.histogram(h, &[], |_| true))
            .mean();
        let h = "scheduler_plugin_execution_duration_seconds";
        for point in label_values(after, &format!("{h}_count"), "extension_point") {
            let l = [
                ("plugin", "DynamicResources"),
                ("extension_point", point.as_str()),
            ];
            let d = after
                .histogram(h, &l, |_| true)
                .since(&before.histogram(h, &l, |_| true));
            if let Some(mean) = d.mean() {
                f.dra.insert(point, (mean, d.count));
            }
        }
        let h = "scheduler_framework_extension_point_duration_seconds";
        for point in label_values(after, &format!("{h}_count"), "extension_point") {
            let l = [("extension_point", point.as_str())];
            let d = after
                .histogram(h, &l, |_| true)
                .since(&before.histogram(h, &l, |_| true));
            if let Some(mean) = d.mean() {
                f.extension_points.insert(point, mean);
            }
        }
        let name = "scheduler_queue_incoming_pods_total";
        for s in after.matching(name, &[]) {
            let (queue, event) = (
                s.labels.get("queue").cloned().unwrap_or_default(),
                s.labels.get("event").cloned().unwrap_or_default(),
            );
            let l = [("queue", queue.as_str()), ("event", event.as_str())];
            let d = s.value - before.sum(name, &l);
            if d > 0.0 {
                *f.incoming.entry(format!("{queue}/{event}")).or_default() += d;
            }
        }
        f
    }

    fn describe(&self) -> String {
        let ms = |s: f64| format!("{:.1} ms", s * 1000.0);
        let attempts = self
            .attempts
            .iter()
            .map(|(r, n)| {
                let mean = self.attempt_mean.get(r).map(|m| format!(" (mean {})", ms(*m)));
                format!("{r} {n:.0}{}", mean.unwrap_or_default())
            })
            .collect::<Vec<_>>()
            .join(", ");
        let dra = self
            .dra
            .iter()
            .filter(|(_, (_, n))| *n > 0.0)
            .map(|(p, (mean, n))| format!("{p} {} (n={n:.0})", ms(*mean)))
            .collect::<Vec<_>>()
            .join(", ");
        let points = ["PreFilter", "Filter", "Score", "Reserve", "PreBind", "Bind"]
            .iter()
            .filter_map(|p| self.extension_points.get(*p).map(|m| format!("{p} {}", ms(*m))))
            .collect::<Vec<_>>()
            .join(", ");
        let incoming = self
            .incoming
            .iter()
            .map(|(k, n)| format!("{k} {n:.0}"))
            .collect::<Vec<_>>()
            .join(", ");
        format!(
            "scheduler: attempts {attempts}; attempts per scheduled pod {}; DynamicResources (sampled) {dra}; \
             extension points (mean) {points}; queue arrivals {incoming}",
            self.attempts_per_pod
                .map_or_else(|| "?".into(), |a| format!("{a:.2}")),
        )
    }
}

async fn scrape_scheduler(scheduler: Option<&Client>) -> Option<Metrics> {
    let client = scheduler?;
    match scrape_client(client, "/metrics").await {
        Ok(m) => Some(m),
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "scraping the scheduler's /metrics failed");
            None
        }
    }
}

/// Which workload a B1 phase schedules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Phase {
    /// The static-MIG anchor as a static-MIG cluster has it: each node publishes its 56
    /// counter-less devices and nothing else (migdra's controller is stopped and its pools
    /// withdrawn for the phase, then restored).
    Anchor,
    /// The static devices published next to migdra's pools on the same nodes (how the
    /// anchor was measured before): the scheduler also walks migdra's devices for every
    /// anchor claim.
    AnchorBeside,
    /// The static-MIG anchor alone, with each device described as NVIDIA's DRA driver
    /// describes a MIG device made ahead of time: its twelve attributes (type, UUIDs, profile,
    /// product, brand, architecture, CUDA and driver versions, PCI bus and root) and eight
    /// capacities (SMs, engines, memory, its memory slice) instead of the bare anchor's four
    /// and one. The scheduler evaluates selectors over every attribute of a device, so this is
    /// the static world as it is deployed; B1's ratio stays against the bare anchor.
    #[value(name = "anchor-nvidia-attributes")]
    AnchorNvidiaAttributes,
    /// NVIDIA's DRA driver with its `DynamicMIG` gate, the peer: each node publishes the
    /// pool that driver publishes for 8 × H100-80GB ([`super::peer`]: a counter slice, then
    /// 26 devices per GPU over every counter it has), and the claims ask as its users do
    /// (its `mig.nvidia.com` class, a selector on `profile`). migdra's pools are withdrawn
    /// for the phase, as for the anchor.
    #[value(name = "nvidia-dynamic-mig")]
    NvidiaDynamicMig,
    /// migdra's pools.
    Migdra,
    /// migdra's pools under a MigPolicy that offers only `1g.10gb` (no whole GPUs): 56
    /// counter-backed devices per node instead of 208, as a cluster that uses one profile
    /// would configure it. The policy is applied for the phase and deleted after.
    #[value(name = "migdra-1g10gb-only")]
    MigdraOneProfile,
    // The lever phases: migdra's pools with one change ([`levers::Lever`]), published under
    // another driver with migdra's pools withdrawn (as for the anchor), the `1g.10gb` class
    // copied for that driver.
    /// migdra's pool, devices grouped profile by profile across the node.
    #[value(name = "lever-order-by-profile")]
    LeverOrderByProfile,
    /// migdra's pool, a node's counter sets merged into as few as the limits allow.
    #[value(name = "lever-merged-counter-sets")]
    LeverMergedCounterSets,
    /// migdra's pool without counters (a bound: overlapping partitions are allowed).
    #[value(name = "lever-no-counters")]
    LeverNoCounters,
    /// migdra's pool with only the attributes and capacities selectors use.
    #[value(name = "lever-selector-attributes")]
    LeverSelectorAttributes,
    /// migdra's pool without the engine capacities.
    #[value(name = "lever-no-engine-capacities")]
    LeverNoEngineCapacities,
}

impl Phase {
    fn is_anchor(self) -> bool {
        matches!(
            self,
            Self::Anchor | Self::AnchorBeside | Self::AnchorNvidiaAttributes
        )
    }

    pub(crate) fn lever(self) -> Option<Lever> {
        match self {
            Self::LeverOrderByProfile => Some(Lever::OrderByProfile),
            Self::LeverMergedCounterSets => Some(Lever::MergedCounterSets),
            Self::LeverNoCounters => Some(Lever::NoCounters),
            Self::LeverSelectorAttributes => Some(Lever::SelectorAttributes),
            Self::LeverNoEngineCapacities => Some(Lever::NoEngineCapacities),
            _ => None,
        }
    }

    /// Whether the phase runs with migdra's pools withdrawn (a cluster without migdra).
    fn without_migdra(self) -> bool {
        matches!(
            self,
            Self::Anchor | Self::AnchorNvidiaAttributes | Self::NvidiaDynamicMig
        )
    }

    fn describe(self) -> &'static str {
        match self {
            Phase::Anchor => "anchor (static devices alone)",
            Phase::AnchorBeside => "anchor beside migdra's pools",
            Phase::AnchorNvidiaAttributes => {
                "anchor with NVIDIA's attributes (static devices alone, each described as NVIDIA's driver does)"
            }
            Phase::NvidiaDynamicMig => {
                "peer: NVIDIA's DynamicMIG pools (9 slices, 208 devices, 8 counter sets of 15 per node)"
            }
            Phase::Migdra => "migdra",
            Phase::MigdraOneProfile => "migdra, MigPolicy offering only 1g.10gb (56 devices per node)",
            lever => lever.lever().map_or("lever", Lever::describe),
        }
    }
}

/// Scheduling failures the scheduler reported for `run`'s pods: `FailedScheduling` events
/// (each counted with its repetitions) and the pods that got one.
async fn failed_scheduling(client: &Client, run: &str) -> anyhow::Result<(u64, usize)> {
    use k8s_openapi::api::events::v1::Event;
    let events: Api<Event> = Api::namespaced(client.clone(), NAMESPACE);
    let list = events
        .list(&ListParams::default().fields("reason=FailedScheduling"))
        .await?;
    let mut pods = BTreeSet::new();
    let mut count = 0u64;
    for e in list.items {
        let Some(name) = e.regarding.as_ref().and_then(|r| r.name.clone()) else {
            continue;
        };
        if !name.starts_with(&format!("{run}-")) {
            continue;
        }
        let repeats = e.series.as_ref().map_or(1, |s| s.count.max(1) as u64)
            + e.deprecated_count.map_or(0, |c| (c.max(1) - 1) as u64);
        count += repeats;
        pods.insert(name);
    }
    Ok((count, pods.len()))
}

/// The policy of [`Phase::MigdraOneProfile`].
const ONE_PROFILE_POLICY: &str = "bench-b1-only-1g10gb";

/// Devices of migdra's pools: (all, those of profile `1g.10gb`).
async fn migdra_devices(client: &Client) -> anyhow::Result<(usize, usize)> {
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let selector = ListParams::default().fields(&format!("spec.driver={DRIVER}"));
    let list = slices.list(&selector).await?;
    let names: Vec<&str> = list
        .items
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .map(|d| d.name.as_str())
        .collect();
    let one_profile = names.iter().filter(|n| n.contains("-mig-1g10gb-")).count();
    Ok((names.len(), one_profile))
}

/// Applies (`on`) or deletes the one-profile MigPolicy and waits until every pool shows it:
/// only `1g.10gb` devices, or back to `full` devices.
async fn one_profile_policy(client: &Client, on: bool, full: usize) -> anyhow::Result<()> {
    use kube::api::{Patch, PatchParams};
    use migdra_api::policy::MigPolicy;
    let policies: Api<MigPolicy> = Api::all(client.clone());
    if on {
        let policy = json!({
            "apiVersion": "gpu.migdra.dev/v1alpha1", "kind": "MigPolicy",
            "metadata": {"name": ONE_PROFILE_POLICY},
            "spec": {"priority": 1000, "profiles": ["1g.10gb"], "wholeGpus": false},
        });
        policies
            .patch(
                ONE_PROFILE_POLICY,
                &PatchParams::apply("migdra-bench").force(),
                &Patch::Apply(policy),
            )
            .await?;
    } else {
        policies
            .delete(ONE_PROFILE_POLICY, &DeleteParams::default())
            .await?;
    }
    wait_until(Duration::from_secs(600), || async {
        let (all, one) = migdra_devices(client).await.ok()?;
        let done = if on { all > 0 && all == one } else { all >= full };
        done.then_some(())
    })
    .await
    .with_context(|| {
        format!(
            "the pools did not {} the one-profile policy",
            if on { "take" } else { "drop" }
        )
    })?;
    // As for the anchor: let the scheduler's informers take the new slices in.
    tokio::time::sleep(Duration::from_secs(5)).await;
    Ok(())
}

/// Stops migdra's controller and withdraws its pools (a static-MIG cluster has none).
async fn withdraw_migdra(cluster: &mut Cluster) -> anyhow::Result<usize> {
    let slices: Api<ResourceSlice> = Api::all(cluster.client.clone());
    let selector = ListParams::default().fields(&format!("spec.driver={DRIVER}"));
    let published = slices.list_metadata(&selector).await?.items.len();
    cluster.stop(CONTROLLER, Duration::from_secs(10));
    delete_driver_slices(&cluster.client, DRIVER).await?;
    Ok(published)
}

/// Starts migdra's controller again and waits until it republished `slices` slices.
async fn restore_migdra(cluster: &mut Cluster, slices: usize) -> anyhow::Result<()> {
    cluster.start_migdra_controller()?;
    let api: Api<ResourceSlice> = Api::all(cluster.client.clone());
    let selector = ListParams::default().fields(&format!("spec.driver={DRIVER}"));
    wait_until(Duration::from_secs(300), || async {
        let n = api.list_metadata(&selector).await.ok()?.items.len();
        (n >= slices).then_some(())
    })
    .await
    .context("migdra's pools did not come back after the anchor")?;
    // Pools complete: give the scheduler's informers a moment, as for the anchor.
    tokio::time::sleep(Duration::from_secs(5)).await;
    Ok(())
}

/// The control plane's processes whose memory B1 records at each size.
const CONTROL_PLANE: [&str; 4] = [
    "kube-apiserver",
    "etcd",
    "kube-scheduler",
    "kube-controller-manager",
];

/// Resident memory of the control plane and of the bench itself (the simulated nodes' plugins
/// live in it) over one B1 size, sampled every 2 s, and the least memory the machine had
/// available: what tells whether a size fits.
struct ControlPlaneMemory {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<MemoryPeaks>,
}

/// Name of the bench's own process in [`MemoryPeaks::rss`].
const BENCH_PROCESS: &str = "migdra-bench";

#[derive(Debug, Default)]
struct MemoryPeaks {
    /// Process → (peak, last) RSS in KiB.
    rss: BTreeMap<&'static str, (u64, u64)>,
    /// Least `MemAvailable` seen, KiB.
    least_available: Option<u64>,
}

fn mem_available_kib() -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

impl ControlPlaneMemory {
    fn start(cluster: &Cluster) -> Self {
        let pids: Vec<(&'static str, u32)> = CONTROL_PLANE
            .iter()
            .filter_map(|name| cluster.pid(name).map(|pid| (*name, pid)))
            .chain([(BENCH_PROCESS, std::process::id())])
            .collect();
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let mut peaks = MemoryPeaks::default();
            loop {
                for (name, pid) in &pids {
                    if let Some(kib) = rss_kib(*pid) {
                        let entry = peaks.rss.entry(name).or_default();
                        *entry = (entry.0.max(kib), kib);
                    }
                }
                if let Some(kib) = mem_available_kib() {
                    peaks.least_available = Some(peaks.least_available.map_or(kib, |l| l.min(kib)));
                }
                tokio::select! {
                    _ = &mut stopped => break,
                    () = tokio::time::sleep(Duration::from_secs(2)) => {}
                }
            }
            peaks
        });
        Self { stop, task }
    }

    /// Stops sampling and describes the figures.
    async fn finish(self) -> String {
        let _ = self.stop.send(());
        let peaks = self.task.await.unwrap_or_default();
        let gib = |kib: u64| format!("{:.2} GiB", kib as f64 / 1024.0 / 1024.0);
        let processes = CONTROL_PLANE
            .iter()
            .chain([&BENCH_PROCESS])
            .map(|name| match peaks.rss.get(name) {
                Some((peak, last)) => format!("{name} {} (at the end {})", gib(*peak), gib(*last)),
                None => format!("{name} not running"),
            })
            .collect::<Vec<_>>()
            .join(", ");
        format!(
            "control-plane and bench RSS over this size's phases, peak of 2-s samples: \
             {processes}; the bench's peak since it started (VmHWM) {}; least memory available on the machine: {}",
            peak_rss_kib(std::process::id()).map_or_else(|| "?".into(), gib),
            peaks.least_available.map_or_else(|| "?".into(), gib)
        )
    }
}

/// One phase's outcome.
struct PhaseResult {
    phase: Phase,
    result: RunResult,
    scheduler: Option<SchedulerFigures>,
    /// `FailedScheduling` events and the pods they name.
    failures: Option<(u64, usize)>,
    load: String,
    /// The scheduler CPU profile's summary, when one was taken.
    profile: Option<String>,
}

/// Runs B1 over `nodes` (simulated, already published by migdra) with `count` pods per
/// phase, the phases in `order` (a phase may repeat: order effects show), reading the
/// scheduler's metrics through `scheduler` around each phase.
pub async fn run(
    cluster: &mut Cluster,
    scheduler: Option<&Client>,
    nodes: &[String],
    count: usize,
    concurrency: usize,
    order: &[Phase],
    profiles: Option<(u64, std::path::PathBuf)>,
) -> anyhow::Result<Vec<Row>> {
    let client = &cluster.client.clone();
    let memory = ControlPlaneMemory::start(cluster);
    let mut phases = Vec::new();
    // migdra's slices while they are withdrawn; consecutive phases without migdra share one
    // withdrawal (at 1,000 nodes a republish takes minutes).
    let mut withdrawn = None;
    for (i, phase) in order.iter().enumerate() {
        match (phase.without_migdra(), withdrawn) {
            (true, None) => withdrawn = Some(withdraw_migdra(cluster).await?),
            (false, Some(slices)) => {
                restore_migdra(cluster, slices).await?;
                withdrawn = None;
            }
            _ => {}
        }
        let full_devices = if *phase == Phase::MigdraOneProfile {
            let (full, _) = migdra_devices(client).await?;
            one_profile_policy(client, true, full).await?;
            Some(full)
        } else {
            None
        };
        // migdra's slices while a lever phase runs without them.
        let mut lever_withdrawn = None;
        let (run, template) = match phase {
            Phase::Anchor | Phase::AnchorBeside | Phase::AnchorNvidiaAttributes => {
                let nvidia = *phase == Phase::AnchorNvidiaAttributes;
                publish_static(client, nodes, nvidia)
                    .await
                    .context("publishing the static anchor")?;
                // Let the scheduler's informers take the new slices in before the first pod.
                tokio::time::sleep(Duration::from_secs(5)).await;
                let name = match phase {
                    Phase::Anchor => "static",
                    Phase::AnchorBeside => "beside",
                    _ => "static-nvidia",
                };
                (format!("b1-{name}-{i}"), STATIC_CLASS)
            }
            Phase::NvidiaDynamicMig => {
                peer::publish(client, nodes, concurrency)
                    .await
                    .context("publishing the peer's pools")?;
                tokio::time::sleep(Duration::from_secs(5)).await;
                (format!("b1-peer-{i}"), peer::CLASS)
            }
            Phase::Migdra => (format!("b1-migdra-{i}"), MIG_1G_CLASS),
            Phase::MigdraOneProfile => (format!("b1-one-profile-{i}"), MIG_1G_CLASS),
            lever_phase => {
                let lever = lever_phase
                    .lever()
                    .with_context(|| format!("B1 phase {lever_phase:?} is not a lever"))?;
                // The copy is read from migdra's pools before they are withdrawn.
                let copy = levers::prepare(client, DRIVER, MIG_1G_CLASS, lever).await?;
                lever_withdrawn = Some(withdraw_migdra(cluster).await?);
                levers::publish(client, &copy)
                    .await
                    .with_context(|| format!("publishing lever {}'s pools", lever.name()))?;
                tracing::info!(devices = copy.devices(), "lever pools published");
                tokio::time::sleep(Duration::from_secs(5)).await;
                (format!("b1-{}-{i}", lever.name()), LEVER_CLASS)
            }
        };
        // A template per phase: its claims carry the phase's run label.
        let (run, class) = (run, template);
        let template = format!("bench-{run}");
        if *phase == Phase::NvidiaDynamicMig {
            create_template(client, &template, class, Some(&peer::profile_selector()), &run).await?;
        } else {
            create_template(client, &template, class, None, &run).await?;
        }
        let before = scrape_scheduler(scheduler).await;
        let load = load_average();
        let profile = scheduler
            .zip(profiles.as_ref())
            .map(|(scheduler, (seconds, dir))| {
                let request = ProfileRequest {
                    seconds: *seconds,
                    path: dir.join(format!(
                        "scheduler-{run}-{}.pprof",
                        k8s_openapi::jiff::Timestamp::now().as_second()
                    )),
                };
                tokio::spawn(super::profile::take(scheduler.clone(), request))
            });
        let result = schedule(client, &run, &template, count, concurrency).await?;
        let after = scrape_scheduler(scheduler).await;
        let profile = match profile {
            Some(task) => Some(match task.await {
                Ok(Ok(summary)) => summary,
                Ok(Err(e)) => format!("scheduler CPU profile failed: {e:#}"),
                Err(e) => format!("scheduler CPU profile failed: {e}"),
            }),
            None => None,
        };
        let load = format!("{load} → {}", load_average());
        let failures = failed_scheduling(client, &run).await.ok();
        delete_run(client, &run, 0, Duration::from_secs(300)).await?;
        if phase.is_anchor() {
            remove_static(client).await?;
        }
        if let Some(slices) = lever_withdrawn {
            levers::remove(client).await?;
            restore_migdra(cluster, slices).await?;
        }
        if *phase == Phase::NvidiaDynamicMig {
            peer::remove(client).await?;
        }
        if let Some(full) = full_devices {
            one_profile_policy(client, false, full).await?;
        }
        let scheduler = before.zip(after).map(|(b, a)| SchedulerFigures::between(&b, &a));
        phases.push(PhaseResult {
            phase: *phase,
            result,
            scheduler,
            failures,
            load,
            profile,
        });
    }
    if let Some(slices) = withdrawn {
        restore_migdra(cluster, slices).await?;
    }
    let memory = memory.finish().await;
    let last = |p: Phase| phases.iter().rev().find(|r| r.phase == p).map(|r| &r.result);
    // The ratio is against the static world alone when it was measured.
    let alone = last(Phase::Anchor).is_some();
    let Some(migdra) = last(Phase::Migdra) else {
        anyhow::bail!("B1 needs at least one migdra phase");
    };
    let anchor = last(Phase::Anchor).or_else(|| last(Phase::AnchorBeside));
    let peer = last(Phase::NvidiaDynamicMig);
    let describe = |r: &RunResult| -> String {
        let lat = r.bind_latency.summary().map(|s| latency(&s)).unwrap_or_default();
        format!(
            "{}/{} bound, created→bound {lat}, pods created in {:.1} s, claims per GPU minor: {}{}",
            r.bound,
            r.pods,
            r.creation_seconds,
            r.landing,
            if r.correct {
                String::new()
            } else {
                format!(
                    ", INCORRECT: {} unallocated, {} duplicate devices",
                    r.unallocated, r.duplicates
                )
            }
        )
    };
    let over = |n: &RunResult, d: &RunResult| {
        (d.pods_per_second > 0.0).then(|| n.pods_per_second / d.pods_per_second)
    };
    // The other pairs a reader compares: the one-profile pool against both anchors, migdra
    // against the anchor described as NVIDIA's driver describes it, and the peer against the
    // static worlds.
    let mut ratios = Vec::new();
    for (what, numerator, denominator) in [
        (
            "migdra 1g.10gb-only / anchor",
            Phase::MigdraOneProfile,
            Phase::Anchor,
        ),
        (
            "migdra 1g.10gb-only / anchor with NVIDIA's attributes",
            Phase::MigdraOneProfile,
            Phase::AnchorNvidiaAttributes,
        ),
        (
            "migdra / anchor with NVIDIA's attributes",
            Phase::Migdra,
            Phase::AnchorNvidiaAttributes,
        ),
        (
            "anchor with NVIDIA's attributes / anchor",
            Phase::AnchorNvidiaAttributes,
            Phase::Anchor,
        ),
        ("peer / anchor", Phase::NvidiaDynamicMig, Phase::Anchor),
        (
            "migdra 1g.10gb-only / peer",
            Phase::MigdraOneProfile,
            Phase::NvidiaDynamicMig,
        ),
    ] {
        if let (Some(n), Some(d)) = (last(numerator), last(denominator))
            && let Some(r) = over(n, d)
        {
            ratios.push(format!("{what}: {r:.2}×"));
        }
    }
    ratios.extend(lever_ratios(&phases));
    let note = format!(
        "{}{}; {memory}; correct: {}",
        if ratios.is_empty() {
            String::new()
        } else {
            format!("{}; ", ratios.join(", "))
        },
        phases
            .iter()
            .enumerate()
            .map(|(i, p)| format!(
                "phase {} {}: {:.1} pods/s, {}; FailedScheduling events: {}; {}; load {}{}",
                i + 1,
                p.phase.describe(),
                p.result.pods_per_second,
                describe(&p.result),
                p.failures
                    .map_or_else(|| "?".to_string(), |(n, pods)| format!("{n} (on {pods} pods)")),
                p.scheduler.as_ref().map_or_else(
                    || "scheduler metrics unavailable".into(),
                    SchedulerFigures::describe
                ),
                p.load,
                p.profile.as_ref().map_or_else(String::new, |p| format!("; {p}"))
            ))
            .collect::<Vec<_>>()
            .join("; "),
        if phases.iter().all(|p| p.result.correct) {
            "yes"
        } else {
            "NO"
        }
    );
    let workload = format!(
        "{count} pods with a 1g.10gb claim over {} simulated 8×H100 nodes",
        nodes.len()
    );
    let mut rows = Vec::new();
    if let Some(anchor) = anchor {
        let ratio = over(migdra, anchor);
        rows.push(Row {
            id: "B1",
            measure: format!(
                "scheduling throughput (scheduling + allocation, no kubelet on simulated nodes): {workload}"
            ),
            value: format!("{:.1} pods/s", migdra.pods_per_second),
            anchor: format!(
                "static MIG, 56 counter-less devices per node{}: {:.1} pods/s",
                if alone {
                    " (alone)"
                } else {
                    ", beside migdra's pools"
                },
                anchor.pods_per_second
            ),
            ratio,
            goal: "≥ 80% of the anchor",
            met: ratio.map(|r| r >= 0.8),
            note: note.clone(),
        });
    }
    if let Some(peer) = peer {
        let ratio = over(migdra, peer);
        rows.push(Row {
            id: "B1",
            measure: format!("scheduling throughput against the peer, NVIDIA's DynamicMIG pools: {workload}"),
            value: format!("{:.1} pods/s", migdra.pods_per_second),
            anchor: format!(
                "NVIDIA's DynamicMIG pools (gpu.nvidia.com, class mig.nvidia.com + profile selector): {:.1} pods/s",
                peer.pods_per_second
            ),
            ratio,
            goal: "≥ 1.2× the peer",
            met: ratio.map(|r| r >= 1.2),
            note: if rows.is_empty() {
                note.clone()
            } else {
                "phases and scheduler figures in the row above".into()
            },
        });
    }
    if rows.is_empty() {
        // Only migdra and lever phases: the note carries the levers' ratios.
        rows.push(Row {
            id: "B1",
            measure: format!(
                "scheduling throughput (scheduling + allocation, no kubelet on simulated nodes): {workload}"
            ),
            value: format!("{:.1} pods/s", migdra.pods_per_second),
            anchor: "static MIG not run".into(),
            ratio: None,
            goal: "≥ 80% of the anchor",
            met: None,
            note,
        });
    }
    Ok(rows)
}

/// Each lever phase against migdra's default pool in the same run: its rate over the mean rate
/// of the `migdra` phases, and its DynamicResources Filter mean per sampled call over theirs.
fn lever_ratios(phases: &[PhaseResult]) -> Vec<String> {
    let filter = |p: &PhaseResult| {
        p.scheduler
            .as_ref()
            .and_then(|s| s.dra.get("Filter"))
            .map(|(mean, _)| *mean)
    };
    let mean =
        |values: Vec<f64>| (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64);
    let migdra: Vec<&PhaseResult> = phases.iter().filter(|p| p.phase == Phase::Migdra).collect();
    let rate = mean(migdra.iter().map(|p| p.result.pods_per_second).collect());
    let migdra_filter = mean(migdra.iter().filter_map(|p| filter(p)).collect());
    phases
        .iter()
        .filter_map(|p| Some((p.phase.lever()?, p)))
        .filter_map(|(lever, p)| {
            let rate = rate.filter(|r| *r > 0.0)?;
            let filter = filter(p)
                .zip(migdra_filter)
                .map(|(l, m)| format!(", Filter {:.2} / {:.2} ms", l * 1000.0, m * 1000.0))
                .unwrap_or_default();
            Some(format!(
                "lever {} / migdra (mean of its phases): {:.2}×{filter}",
                lever.name(),
                p.result.pods_per_second / rate
            ))
        })
        .collect()
}
