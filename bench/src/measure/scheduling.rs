//! B1, scheduling throughput: pods with one `1g.10gb` claim each over simulated 8-GPU nodes,
//! once against migdra's pools (every placement, shared counters) and once against the
//! static-MIG anchor (each node publishes 56 ready-made 1g.10gb devices without counters,
//! under a driver of its own). No kubelet runs on simulated nodes, so this is scheduling plus
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
use crate::{
    probe::load_average,
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
}

/// Publishes the anchor: one slice per node with 56 counter-less 1g.10gb devices.
async fn publish_static(client: &Client, nodes: &[String]) -> anyhow::Result<()> {
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
                    .map(|i| {
                        let (gpu, placement) = (i / 7, i % 7);
                        json!({
                            "name": format!("gpu-{gpu}-mig-1g10gb-{placement}"),
                            "attributes": {
                                "type": {"string": "mig"},
                                "profile": {"string": "1g.10gb"},
                                "parentUUID": {"string": format!("GPU-static-{node}-{gpu}")},
                                "placementStart": {"int": placement},
                            },
                            "capacity": {"memory": {"value": "10Gi"}},
                        })
                    })
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
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    slices
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().fields(&format!("spec.driver={STATIC_DRIVER}")),
        )
        .await?;
    Ok(())
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
    })
}

/// Runs B1 over `nodes` (simulated, already published by migdra) with `count` pods per run.
pub async fn run(client: &Client, nodes: &[String], count: usize, concurrency: usize) -> anyhow::Result<Row> {
    publish_static(client, nodes)
        .await
        .context("publishing the static anchor")?;
    create_template(client, "bench-b1-static", STATIC_CLASS, "b1-static").await?;
    create_template(client, "bench-b1-migdra", MIG_1G_CLASS, "b1-migdra").await?;
    let load_before = load_average();
    // Anchor first, then migdra; both on the same nodes, one after the other.
    let anchor = schedule(client, "b1-static", "bench-b1-static", count, concurrency).await?;
    delete_run(client, "b1-static", 0, Duration::from_secs(300)).await?;
    remove_static(client).await?;
    let load_mid = load_average();
    let migdra = schedule(client, "b1-migdra", "bench-b1-migdra", count, concurrency).await?;
    let load_after = load_average();
    delete_run(client, "b1-migdra", 0, Duration::from_secs(300)).await?;
    let describe = |r: &RunResult| -> String {
        let lat = r.bind_latency.summary().map(|s| latency(&s)).unwrap_or_default();
        format!(
            "{}/{} bound, created→bound {lat}, pods created in {:.1} s{}",
            r.bound,
            r.pods,
            r.creation_seconds,
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
    let ratio = (anchor.pods_per_second > 0.0).then(|| migdra.pods_per_second / anchor.pods_per_second);
    Ok(Row {
        id: "B1",
        measure: format!(
            "scheduling throughput (scheduling + allocation, no kubelet on simulated nodes): {count} pods with a 1g.10gb claim over {} simulated 8×H100 nodes",
            nodes.len()
        ),
        value: format!("{:.1} pods/s", migdra.pods_per_second),
        anchor: format!(
            "static MIG, 56 counter-less devices per node: {:.1} pods/s",
            anchor.pods_per_second
        ),
        ratio,
        goal: "≥ 80% of the anchor",
        met: ratio.map(|r| r >= 0.8),
        note: format!(
            "migdra: {}; anchor: {}; correct: {}; load {load_before} / {load_mid} / {load_after}",
            describe(&migdra),
            describe(&anchor),
            if migdra.correct && anchor.correct {
                "yes"
            } else {
                "NO"
            }
        ),
    })
}
