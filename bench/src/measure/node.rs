//! The real node (real kubelet, fake CRI, fake NVML with 8 H100s): B5 pod start with and
//! without a MIG claim, B6 plugin memory idle and with every 1g.10gb placement prepared (56),
//! B4 NodePrepareResources latency from the kubelet's DRA metrics against one GET of a claim
//! by the plugin's own client. Correctness checked on the way: every claim got its own
//! device and the fake GPUs hold one MIG instance per prepared claim.

use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::{core::v1::Pod, resource::v1::ResourceClaim};
use kube::{Api, api::PostParams};
use migdra_e2e::cluster::{Cluster, NODE, PLUGIN};
use serde_json::json;

use super::pods::{NAMESPACE, allocated_devices, create_template, delete_run, pod, run_claims, wait_running};
use crate::{
    probe::{kubelet_client, load_average, rss_kib, scrape_client, scrape_http},
    prom::{Histogram, Metrics},
    stats::{Samples, latency, mib, ms},
    table::Row,
};

/// DeviceClass of one 1g.10gb partition (the chart's per-profile class).
pub const MIG_1G_CLASS: &str = "1g-10gb.mig.migdra.dev";
/// 1g.10gb placements on 8 H100s (7 each).
pub const ALL_1G_PLACEMENTS: usize = 56;

const RUN_PLAIN: &str = "b5-plain";
const RUN_MIG: &str = "b5-mig";

/// What the real-node measures produce.
pub struct NodeResults {
    /// Table rows (B4, B5, B6 plugin).
    pub rows: Vec<Row>,
}

fn prepare_histogram(metrics: &Metrics) -> Histogram {
    metrics.histogram("dra_grpc_operations_duration_seconds", &[], |labels| {
        labels
            .get("method_name")
            .is_some_and(|m| m.ends_with("NodePrepareResources"))
    })
}

/// Runs B5, B6 (plugin) and B4 with `pairs` pods of each kind for B5.
pub async fn run(cluster: &Cluster, pairs: usize) -> anyhow::Result<NodeResults> {
    let client = cluster.client.clone();
    let plugin_pid = cluster.pid(PLUGIN).context("the plugin is not running")?;
    let kubelet_port = cluster.allocated_port("kubelet").context("no kubelet port")?;
    let kubelet = kubelet_client(kubelet_port)?;
    let idle_rss = rss_kib(plugin_pid).context("plugin RSS")?;
    let kubelet_before = scrape_client(&kubelet, "/metrics")
        .await
        .context("the kubelet's /metrics")?;
    create_template(&client, "bench-mig-1g", MIG_1G_CLASS, RUN_MIG).await?;
    let on_node = json!({"kubernetes.io/hostname": NODE});
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);

    // B5: alternate plain and MIG pods, one at a time, so drift hits both alike.
    let load_b5 = load_average();
    let (mut plain, mut mig) = (Samples::default(), Samples::default());
    let timeout = Duration::from_secs(120);
    for i in 0..pairs.min(ALL_1G_PLACEMENTS) {
        for (run, samples, template) in [
            (RUN_PLAIN, &mut plain, None),
            (RUN_MIG, &mut mig, Some("bench-mig-1g")),
        ] {
            let name = format!("{run}-{i:03}");
            let created = Instant::now();
            pods.create(
                &PostParams::default(),
                &pod(&name, run, on_node.clone(), template)?,
            )
            .await
            .with_context(|| format!("creating pod {name}"))?;
            samples.push(wait_running(&client, &name, created, timeout).await?);
        }
    }

    // B6: the rest of the 56 placements at once, then the plugin's memory.
    let started = mig.len();
    stream::iter(started..ALL_1G_PLACEMENTS)
        .map(|i| {
            let (client, pods, on_node) = (client.clone(), pods.clone(), on_node.clone());
            async move {
                let name = format!("{RUN_MIG}-{i:03}");
                let created = Instant::now();
                pods.create(
                    &PostParams::default(),
                    &pod(&name, RUN_MIG, on_node, Some("bench-mig-1g"))?,
                )
                .await?;
                wait_running(&client, &name, created, Duration::from_secs(300)).await
            }
        })
        .buffer_unordered(8)
        .try_collect::<Vec<_>>()
        .await
        .context("preparing every 1g.10gb placement")?;
    // Let the status loop and caches settle before reading memory.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let full_rss = rss_kib(plugin_pid).context("plugin RSS")?;
    let claims = run_claims(&client, RUN_MIG).await?;
    let (devices, unallocated) = allocated_devices(&claims);
    let distinct: BTreeSet<_> = devices.iter().collect();
    let instances: usize = cluster.gpus()?.gpus.iter().map(|g| g.gpu_instances.len()).sum();
    let correct = claims.len() == ALL_1G_PLACEMENTS
        && unallocated == 0
        && distinct.len() == devices.len()
        && instances == ALL_1G_PLACEMENTS;

    // B4: the kubelet's own histogram over every prepare of this run, against one GET of a
    // claim by the plugin's client (the plugin's first API call of a prepare).
    let kubelet_after = scrape_client(&kubelet, "/metrics").await?;
    let prepares = prepare_histogram(&kubelet_after).since(&prepare_histogram(&kubelet_before));
    let plugin_metrics = match cluster.allocated_port("plugin-http") {
        Some(port) => scrape_http(port).await.ok(),
        None => None,
    };
    let plugin_prepare = plugin_metrics.as_ref().map(|m| {
        m.histogram(
            "migdra_kubelet_plugin_call_duration_seconds",
            &[("operation", "prepare")],
            |_| true,
        )
    });
    let plugin_client = cluster.plugin_client().await?;
    let claim_name = claims
        .first()
        .and_then(|c| c.metadata.name.clone())
        .context("no claim to GET")?;
    let claims_api: Api<ResourceClaim> = Api::namespaced(plugin_client, NAMESPACE);
    let mut gets = Samples::default();
    for _ in 0..200 {
        let began = Instant::now();
        claims_api.get(&claim_name).await?;
        gets.push(began.elapsed());
    }
    let gets = gets.summary().context("GET samples")?;

    // Clean up: unprepare everything (checks the way back too).
    let deleted = Instant::now();
    delete_run(&client, RUN_MIG, 1, Duration::from_secs(300)).await?;
    delete_run(&client, RUN_PLAIN, 1, Duration::from_secs(120)).await?;
    let instances_left = migdra_e2e::cluster::wait_until(Duration::from_secs(120), || async {
        let left: usize = cluster
            .gpus()
            .ok()?
            .gpus
            .iter()
            .map(|g| g.gpu_instances.len())
            .sum();
        (left == 0).then_some(left)
    })
    .await
    .is_ok();
    let unprepare_time = deleted.elapsed();

    let mut rows = Vec::new();
    let prepare_p50 = prepares.quantile(0.5);
    let prepare_p99 = prepares.quantile(0.99);
    let b4_value = match (prepare_p50, prepare_p99, prepares.mean()) {
        (Some(p50), Some(p99), Some(mean)) => format!(
            "p50 ≈{} / p99 ≈{} / mean {} (n={})",
            ms(p50),
            ms(p99),
            ms(mean),
            prepares.count
        ),
        _ => format!(
            "no NodePrepareResources in the kubelet's metrics (its dra_* metrics: {})",
            kubelet_after.names_with_prefix("dra_").join(", ")
        ),
    };
    let plugin_note = plugin_prepare
        .as_ref()
        .and_then(|h| {
            Some(format!(
                "plugin's own prepare histogram: mean {} (n={})",
                ms(h.mean()?),
                h.count
            ))
        })
        .unwrap_or_default();
    rows.push(Row {
        id: "B4",
        measure: "plugin NodePrepareResources latency, kubelet's dra_grpc_operations_duration_seconds (quantiles interpolated in its buckets)".into(),
        value: b4_value,
        anchor: format!("one GET of the claim, plugin's client: {}", latency(&gets)),
        ratio: prepare_p99.map(|p| p / gets.p99),
        goal: "p99 ≤ 1.5× the floor",
        met: prepare_p99.map(|p| p <= 1.5 * gets.p99),
        note: format!(
            "NVML time NOT subtracted: the plugin exports no NVML timing (fake NVML); {plugin_note}; buckets: {}; load {load_b5}",
            prepares
                .buckets
                .iter()
                .map(|(b, c)| format!("≤{b}:{c}"))
                .collect::<Vec<_>>()
                .join(" ")
        ),
    });
    let (plain_s, mig_s) = (
        plain.summary().context("no B5 samples")?,
        mig.summary().context("no B5 samples")?,
    );
    rows.push(Row {
        id: "B5",
        measure: "pod start created → Running, real kubelet, with a 1g.10gb claim".into(),
        value: latency(&mig_s),
        anchor: format!("without a claim: {}", latency(&plain_s)),
        ratio: Some(mig_s.p50 / plain_s.p50),
        goal: "median delta ≤ 300 ms",
        met: Some(mig_s.p50 - plain_s.p50 <= 0.3),
        note: format!(
            "median delta {}; one pod at a time, alternating, Running polled every 20 ms; load {load_b5}",
            ms(mig_s.p50 - plain_s.p50)
        ),
    });
    rows.push(Row {
        id: "B6",
        measure: format!("plugin RSS idle → with {ALL_1G_PLACEMENTS} prepared claims"),
        value: format!("{} → {}", mib(idle_rss), mib(full_rss)),
        anchor: String::new(),
        ratio: None,
        goal: "plugin ≤ 20 MiB",
        met: Some(full_rss <= 20 * 1024),
        note: format!(
            "correct: {} ({} claims, {} allocated devices, {} distinct, {} MIG instances on the fake GPUs); \
             all unprepared after delete: {instances_left} ({:.1} s)",
            if correct { "yes" } else { "NO" },
            claims.len(),
            devices.len(),
            distinct.len(),
            instances,
            unprepare_time.as_secs_f64()
        ),
    });
    Ok(NodeResults { rows })
}
