//! The real node (real kubelet, fake CRI, fake NVML with 8 H100s): B5 pod start with and
//! without a MIG claim, B6 plugin memory idle and with every 1g.10gb placement prepared (56),
//! B4 NodePrepareResources latency against one GET of a claim by the plugin's own client:
//! the kubelet's DRA histogram, and the plugin's own histograms of its handler time, the part
//! inside NVML and the rest (the headline, from the plugin's fine buckets). Correctness checked on the way: every claim got its own
//! device and the fake GPUs hold one MIG instance per prepared claim.
//!
//! B5 is also measured on containerd and runc ([`b5_on_containerd`]): a cluster of its own whose
//! kubelet starts real containers (sandbox, CNI, runc, the claim's CDI edits applied), with
//! migdra as host processes as on the fake CRI.

use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::{core::v1::Pod, resource::v1::ResourceClaim};
use kube::{Api, api::PostParams};
use migdra_e2e::cluster::{Cluster, ClusterConfig, MigdraMode, NODE, PLUGIN, Runtime};
use migdra_fake_nvml::config::GpuConfig;
use serde_json::json;

use super::pods::{NAMESPACE, allocated_devices, create_template, delete_run, pod, run_claims, wait_running};
use crate::{
    probe::{kubelet_client, load_average, rss_kib, scrape_client, scrape_http},
    prom::{Histogram, Metrics},
    stats::{Samples, Summary, latency, mib, ms},
    table::Row,
};

/// DeviceClass of one 1g.10gb partition (the chart's per-profile class).
pub const MIG_1G_CLASS: &str = "1g-10gb.mig.migdra.dev";
/// 1g.10gb placements on 8 H100s (7 each).
pub const ALL_1G_PLACEMENTS: usize = 56;

const RUN_PLAIN: &str = "b5-plain";
const RUN_MIG: &str = "b5-mig";
const RUN_B4: &str = "b4-mig";

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

/// The plugin's prepare histograms (its `call_*duration_seconds` families).
#[derive(Clone, Debug, Default, PartialEq)]
struct PluginPrepares {
    /// The handler's whole time per kubelet call.
    handler: Histogram,
    /// Time inside NVML per call.
    nvml: Histogram,
    /// Handler time minus NVML time per call (fine buckets).
    outside: Histogram,
    /// The claim GET each prepare made (part of `outside`).
    claim_get: Histogram,
    /// Handler time minus NVML time minus the wait for the claim GETs per call: migdra's own
    /// work (empty from a plugin older than that histogram).
    own: Histogram,
}

impl PluginPrepares {
    fn read(metrics: &Metrics) -> Self {
        let family = |name: &str| {
            metrics.histogram(
                &format!("migdra_kubelet_plugin_{name}"),
                &[("operation", "prepare")],
                |_| true,
            )
        };
        Self {
            handler: family("call_duration_seconds"),
            nvml: family("call_nvml_duration_seconds"),
            outside: family("call_outside_nvml_duration_seconds"),
            claim_get: metrics.histogram("migdra_kubelet_plugin_claim_read_duration_seconds", &[], |_| true),
            own: family("call_own_duration_seconds"),
        }
    }

    fn since(&self, before: &Self) -> Self {
        self.each(before, Histogram::since)
    }

    fn plus(&self, other: &Self) -> Self {
        self.each(other, Histogram::plus)
    }

    /// `op` on each histogram of the two.
    fn each(&self, other: &Self, op: fn(&Histogram, &Histogram) -> Histogram) -> Self {
        Self {
            handler: op(&self.handler, &other.handler),
            nvml: op(&self.nvml, &other.nvml),
            outside: op(&self.outside, &other.outside),
            claim_get: op(&self.claim_get, &other.claim_get),
            own: op(&self.own, &other.own),
        }
    }

    /// The prepares between two scrapes (`before` missing: all of `after`).
    fn between(before: Option<&Metrics>, after: &Metrics) -> Self {
        let after = Self::read(after);
        match before {
            Some(before) => after.since(&Self::read(before)),
            None => after,
        }
    }
}

/// `p50 ≈… / p99 ≈… / mean … (n=…)` of a histogram; `None` when it is empty.
fn histogram_latency(h: &Histogram) -> Option<String> {
    Some(format!(
        "p50 ≈{} / p99 ≈{} / mean {} (n={})",
        ms(h.quantile(0.5)?),
        ms(h.quantile(0.99)?),
        ms(h.mean()?),
        h.count
    ))
}

/// The B4 row. The headline is the prepares the kubelet made one at a time: their time
/// outside NVML against the claim GETs those same prepares made (the floor, under the same API
/// server load; the bench's own GETs after the run, in the anchor too, are the fallback for a
/// plugin without that histogram). The prepares made 8 at a time are in the note: they
/// also wait for the node lock while the claims ahead of them are created. The kubelet's own
/// figure covers all of them.
fn b4_row(
    kubelet: &Histogram,
    one_at_a_time: Option<&PluginPrepares>,
    eight_at_a_time: Option<&PluginPrepares>,
    bench_gets: &Summary,
    kubelet_dra: &[String],
    load: &str,
) -> Row {
    let kubelet_figure = histogram_latency(kubelet).unwrap_or_else(|| {
        format!(
            "no NodePrepareResources in the kubelet's metrics (its dra_* metrics: {})",
            kubelet_dra.join(", ")
        )
    });
    let kubelet_start = kubelet
        .buckets
        .first()
        .map_or_else(|| "?".to_string(), |(bound, _)| ms(*bound));
    let kubelet_buckets = kubelet
        .buckets
        .iter()
        .map(|(b, c)| format!("≤{b}:{c}"))
        .collect::<Vec<_>>()
        .join(" ");
    let bench_figure = format!(
        "{} GETs by the bench with the plugin's client after the run: {}",
        bench_gets.count,
        latency(bench_gets)
    );
    let measure = "plugin NodePrepareResources latency minus time inside NVML, prepares one at a time (plugin's call_outside_nvml_duration_seconds; kubelet's figure in the note)".to_string();
    let Some(p) = one_at_a_time.filter(|p| p.outside.count > 0.0) else {
        let p99 = kubelet.quantile(0.99);
        return Row {
            id: "B4",
            measure,
            value: format!("kubelet-observed: {kubelet_figure}"),
            anchor: bench_figure,
            ratio: p99.map(|p| p / bench_gets.p99),
            goal: "p99 ≤ 1.5× the floor",
            met: p99.map(|p| p <= 1.5 * bench_gets.p99),
            note: format!(
                "the plugin exported no NVML timing (call_outside_nvml_duration_seconds missing or empty): \
                 NVML time NOT subtracted; kubelet buckets: {kubelet_buckets}; load {load}"
            ),
        };
    };
    let outside_p99 = p.outside.quantile(0.99);
    let (floor_p99, anchor) = match p.claim_get.quantile(0.99) {
        Some(get_p99) => (
            get_p99,
            format!(
                "the claim GET of each of those prepares (plugin's claim_read_duration_seconds): {}; {bench_figure}",
                histogram_latency(&p.claim_get).unwrap_or_default()
            ),
        ),
        None => (
            bench_gets.p99,
            format!("{bench_figure} (the plugin does not time its claim GETs)"),
        ),
    };
    let nvml_mean = p.nvml.mean().unwrap_or(0.0);
    // migdra's own work: from the plugin's own histogram, with its tail; from an older plugin
    // only the mean of the difference is known.
    let rest = match (histogram_latency(&p.own), p.outside.mean(), p.claim_get.mean()) {
        (Some(own), _, _) => format!(
            "; migdra's own work, outside NVML and the claim GET (plugin's call_own_duration_seconds): {own}"
        ),
        (None, Some(outside), Some(get)) => format!(
            "; outside NVML and outside the claim GET: mean {}",
            ms(outside - get)
        ),
        _ => String::new(),
    };
    let concurrent = eight_at_a_time
        .filter(|c| c.outside.count > 0.0)
        .map_or_else(
            || "none".to_string(),
            |c| {
                format!(
                    "outside NVML {}, handler {}, claim GET {} (waiting for the node lock while the claims ahead are created counts as outside NVML)",
                    histogram_latency(&c.outside).unwrap_or_default(),
                    histogram_latency(&c.handler).unwrap_or_default(),
                    histogram_latency(&c.claim_get).unwrap_or_else(|| "n/a".into()),
                )
            },
        );
    let value = format!(
        "outside NVML, plugin: p50 ≈{} / p99 ≈{} (n={}){rest}",
        p.outside.quantile(0.5).map_or_else(|| "?".into(), ms),
        outside_p99.map_or_else(|| "?".into(), ms),
        p.outside.count
    );
    let note = format!(
        "one at a time: plugin handler {}, NVML per prepare mean {} (fake NVML); 8 at a time: {concurrent}; \
         kubelet-observed, all prepares (dra_grpc_operations_duration_seconds): {kubelet_figure} (its histogram starts at \
         {kubelet_start}, so the kubelet-observed figure minus NVML is only available as a mean; \
         quantiles are interpolated in the plugin's buckets); kubelet buckets: {kubelet_buckets}; load {load}",
        histogram_latency(&p.handler).unwrap_or_else(|| "none".into()),
        ms(nvml_mean),
    );
    Row {
        id: "B4",
        measure,
        value,
        anchor,
        ratio: outside_p99.map(|o| o / floor_p99),
        goal: "p99 ≤ 1.5× the floor",
        met: outside_p99.map(|o| o <= 1.5 * floor_p99),
        note,
    }
}

/// MIG pods started one at a time (B5's and then more), whose prepares are B4's headline.
const B4_ONE_AT_A_TIME: usize = 46;

/// Creates pod `name` of `run` on the real node and waits until it runs; the time it took.
async fn start_pod(
    client: &kube::Client,
    name: &str,
    run: &str,
    template: Option<&str>,
    timeout: Duration,
) -> anyhow::Result<Duration> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let created = Instant::now();
    pods.create(
        &PostParams::default(),
        &pod(name, run, json!({"kubernetes.io/hostname": NODE}), template)?,
    )
    .await
    .with_context(|| format!("creating pod {name}"))?;
    wait_running(client, name, created, timeout).await
}

/// The plugin's metrics, when it serves them (`port`) and answers.
async fn scrape_plugin(port: Option<u16>) -> Option<Metrics> {
    scrape_http(port?).await.ok()
}

/// Waits until the fake GPUs hold no MIG instance; whether they got there in 120 s.
async fn wait_no_instances(cluster: &Cluster) -> bool {
    migdra_e2e::cluster::wait_until(Duration::from_secs(120), || async {
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
    .is_ok()
}

/// Runs B5, B6 (plugin) and B4 with `pairs` pods of each kind for B5 and `b4_extra` more
/// MIG pods one at a time for B4.
pub async fn run(cluster: &Cluster, pairs: usize, b4_extra: usize) -> anyhow::Result<NodeResults> {
    let client = cluster.client.clone();
    let plugin_pid = cluster.pid(PLUGIN).context("the plugin is not running")?;
    let kubelet_port = cluster.allocated_port("kubelet").context("no kubelet port")?;
    let kubelet = kubelet_client(kubelet_port)?;
    let idle_rss = rss_kib(plugin_pid).context("plugin RSS")?;
    let kubelet_before = scrape_client(&kubelet, "/metrics")
        .await
        .context("the kubelet's /metrics")?;
    let plugin_port = cluster.allocated_port("plugin-http");
    let plugin_before = scrape_plugin(plugin_port).await;
    create_template(&client, "bench-mig-1g", MIG_1G_CLASS, None, RUN_MIG).await?;
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
            samples.push(start_pod(&client, &format!("{run}-{i:03}"), run, template, timeout).await?);
        }
    }

    // B4 wants more prepares one at a time than B5 makes: the next MIG pods also start one at
    // a time, up to B4_ONE_AT_A_TIME in all.
    for i in mig.len()..B4_ONE_AT_A_TIME.max(mig.len()).min(ALL_1G_PLACEMENTS) {
        let name = format!("{RUN_MIG}-{i:03}");
        start_pod(&client, &name, RUN_MIG, Some("bench-mig-1g"), timeout).await?;
    }
    let started = B4_ONE_AT_A_TIME.max(mig.len()).min(ALL_1G_PLACEMENTS);
    let plugin_after_b5 = scrape_plugin(plugin_port).await;

    // B6: the rest of the 56 placements 8 at a time, then the plugin's memory.
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
    let plugin_after = scrape_plugin(plugin_port).await;
    // The first B4_ONE_AT_A_TIME prepares came one at a time, the rest eight at a time.
    let one_at_a_time = plugin_after_b5
        .as_ref()
        .map(|after| PluginPrepares::between(plugin_before.as_ref(), after));
    let eight_at_a_time = match (&plugin_after_b5, &plugin_after) {
        (Some(b5), Some(after)) => Some(PluginPrepares::between(Some(b5), after)),
        _ => None,
    };
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
    let instances_left = wait_no_instances(cluster).await;
    let unprepare_time = deleted.elapsed();

    // B4, more prepares one at a time: rounds of up to every placement, each round deleted
    // (and its instances destroyed) before the next.
    let plugin_before_extra = scrape_plugin(plugin_port).await;
    let mut extra_started = 0;
    for round in 0.. {
        let in_round = b4_extra.saturating_sub(extra_started).min(ALL_1G_PLACEMENTS);
        if in_round == 0 {
            break;
        }
        for i in 0..in_round {
            let name = format!("{RUN_B4}-{round}-{i:03}");
            start_pod(&client, &name, RUN_B4, Some("bench-mig-1g"), timeout).await?;
        }
        delete_run(&client, RUN_B4, 1, Duration::from_secs(300)).await?;
        anyhow::ensure!(
            wait_no_instances(cluster).await,
            "B4 round {round}: MIG instances left 120 s after its pods were deleted"
        );
        extra_started += in_round;
    }
    let extra_prepares = match (&plugin_before_extra, extra_started > 0) {
        (Some(before), true) => scrape_plugin(plugin_port)
            .await
            .map(|after| PluginPrepares::between(Some(before), &after)),
        _ => None,
    };
    let one_at_a_time = match (one_at_a_time, extra_prepares) {
        (Some(first), Some(extra)) => Some(first.plus(&extra)),
        (first, _) => first,
    };

    let mut rows = vec![b4_row(
        &prepares,
        one_at_a_time.as_ref(),
        eight_at_a_time.as_ref(),
        &gets,
        &kubelet_after.names_with_prefix("dra_"),
        &load_b5,
    )];
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

/// 1g.10gb placements on the containerd cluster's H100s (7 each).
const CONTAINERD_H100S: usize = 3;

/// B5 on containerd and runc: boots a cluster of its own on the real runtime (the e2e's
/// containerd cluster, migdra as host processes, `CONTAINERD_H100S`
/// simulated H100s), starts `pairs` pods without and with a 1g.10gb claim, one at a time,
/// alternating, then deletes them, checks every MIG instance went, and tears the cluster down.
pub async fn b5_on_containerd(pairs: usize) -> anyhow::Result<Row> {
    let config = ClusterConfig {
        gpus: (0..CONTAINERD_H100S)
            .map(|_| GpuConfig::new("H100-80GB", true))
            .collect(),
        runtime: Some(Runtime::Containerd),
        migdra_mode: Some(MigdraMode::HostProcesses),
        ..ClusterConfig::default()
    };
    let mut cluster = Cluster::start(config)
        .await
        .context("starting the containerd cluster")?;
    let result = b5_pairs(&cluster, pairs.min(CONTAINERD_H100S * 7)).await;
    cluster.teardown();
    let (plain, mig, load) = result?;
    Ok(Row {
        id: "B5",
        measure: "pod start created → Running, real kubelet on containerd + runc, with a 1g.10gb claim"
            .into(),
        value: latency(&mig),
        anchor: format!("without a claim: {}", latency(&plain)),
        ratio: Some(mig.p50 / plain.p50),
        goal: "median delta ≤ 300 ms",
        met: Some(mig.p50 - plain.p50 <= 0.3),
        note: format!(
            "median delta {}; containers started by runc (busybox sleep; the claim's CDI spec applied, \
             nvidia-cdi-hook run); one pod at a time, alternating, Running polled every 20 ms; load {load}",
            ms(mig.p50 - plain.p50)
        ),
    })
}

/// B5's alternating pods on `cluster`'s node; the two samples and the load average.
async fn b5_pairs(cluster: &Cluster, pairs: usize) -> anyhow::Result<(Summary, Summary, String)> {
    let client = cluster.client.clone();
    create_template(&client, "bench-mig-1g", MIG_1G_CLASS, None, RUN_MIG).await?;
    let load = load_average();
    let (mut plain, mut mig) = (Samples::default(), Samples::default());
    let timeout = Duration::from_secs(120);
    for i in 0..pairs {
        for (run, samples, template) in [
            (RUN_PLAIN, &mut plain, None),
            (RUN_MIG, &mut mig, Some("bench-mig-1g")),
        ] {
            samples.push(start_pod(&client, &format!("{run}-{i:03}"), run, template, timeout).await?);
        }
    }
    delete_run(&client, RUN_MIG, 1, Duration::from_secs(300)).await?;
    delete_run(&client, RUN_PLAIN, 1, Duration::from_secs(120)).await?;
    anyhow::ensure!(
        wait_no_instances(cluster).await,
        "MIG instances left 120 s after the B5 pods were deleted"
    );
    Ok((
        plain.summary().context("no B5 samples")?,
        mig.summary().context("no B5 samples")?,
        load,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a plugin times, from the oldest to the newest.
    #[derive(Clone, Copy, PartialEq, PartialOrd)]
    enum Timing {
        Nvml,
        ClaimGets,
        OwnWork,
    }

    /// A plugin's exposition after prepares of (handler, NVML, claim GET) seconds each, with
    /// the histograms a plugin of `timing` exports.
    fn plugin_text(observations: &[(f64, f64, f64)], timing: Timing) -> String {
        let mut text = String::new();
        let mut family = |name: &str, labels: &str, values: Vec<f64>| {
            let name = format!("migdra_kubelet_plugin_{name}");
            for bound in [0.001, 0.002, 0.005, 0.01, 0.1, f64::INFINITY] {
                let le = if bound.is_infinite() {
                    "+Inf".to_string()
                } else {
                    bound.to_string()
                };
                let count = values.iter().filter(|v| **v <= bound).count();
                let sep = if labels.is_empty() { "" } else { "," };
                text += &format!("{name}_bucket{{{labels}{sep}le=\"{le}\"}} {count}\n");
                if !labels.is_empty() {
                    text += &format!("{name}_bucket{{operation=\"unprepare\",le=\"{le}\"}} 99\n");
                }
            }
            text += &format!("{name}_sum{{{labels}}} {}\n", values.iter().sum::<f64>());
            text += &format!("{name}_count{{{labels}}} {}\n", values.len());
        };
        let pick = |f: fn(&(f64, f64, f64)) -> f64| observations.iter().map(f).collect::<Vec<f64>>();
        let prepare = "operation=\"prepare\"";
        family("call_duration_seconds", prepare, pick(|o| o.0));
        family("call_nvml_duration_seconds", prepare, pick(|o| o.1));
        family("call_outside_nvml_duration_seconds", prepare, pick(|o| o.0 - o.1));
        if timing >= Timing::ClaimGets {
            family("claim_read_duration_seconds", "", pick(|o| o.2));
        }
        if timing >= Timing::OwnWork {
            family("call_own_duration_seconds", prepare, pick(|o| o.0 - o.1 - o.2));
        }
        text
    }

    fn kubelet() -> Histogram {
        Histogram {
            buckets: vec![(0.1, 3.0), (0.2, 4.0), (f64::INFINITY, 4.0)],
            sum: 0.32,
            count: 4.0,
        }
    }

    fn bench_gets() -> Summary {
        Summary {
            count: 200,
            p50: 0.0015,
            p99: 0.004,
            mean: 0.002,
        }
    }

    #[test]
    fn b4_compares_prepares_one_at_a_time_with_their_own_claim_gets() {
        let earlier = (0.5, 0.4, 0.001);
        let one_at_a_time = [
            (0.009, 0.008, 0.0008),
            (0.0105, 0.009, 0.0012),
            (0.011, 0.0095, 0.0009),
        ];
        let eight_at_a_time = [(0.06, 0.01, 0.003), (0.09, 0.012, 0.004)];
        let before = Metrics::parse(&plugin_text(&[earlier], Timing::OwnWork));
        let after_b5 = Metrics::parse(&plugin_text(
            &[&[earlier][..], &one_at_a_time].concat(),
            Timing::OwnWork,
        ));
        let after = Metrics::parse(&plugin_text(
            &[&[earlier][..], &one_at_a_time, &eight_at_a_time].concat(),
            Timing::OwnWork,
        ));
        let sequential = PluginPrepares::between(Some(&before), &after_b5);
        let concurrent = PluginPrepares::between(Some(&after_b5), &after);
        // The unprepare series are not mixed in, and each phase has only its own prepares.
        assert_eq!((sequential.outside.count, concurrent.outside.count), (3.0, 2.0));
        assert!(
            (sequential.nvml.sum - 0.0265).abs() < 1e-9,
            "{}",
            sequential.nvml.sum
        );
        let outside_p99 = sequential.outside.quantile(0.99).unwrap();
        let get_p99 = sequential.claim_get.quantile(0.99).unwrap();
        let row = b4_row(
            &kubelet(),
            Some(&sequential),
            Some(&concurrent),
            &bench_gets(),
            &[],
            "1.0",
        );
        assert_eq!(row.ratio, Some(outside_p99 / get_p99));
        assert_eq!(row.met, Some(outside_p99 <= 1.5 * get_p99));
        assert!(
            row.anchor.contains("claim GET of each of those prepares"),
            "{}",
            row.anchor
        );
        // migdra's own work, with its tail: the three prepares' 0.2, 0.3 and 0.6 ms.
        let own = &sequential.own;
        assert_eq!(own.count, 3.0);
        assert!((own.sum - 0.0011).abs() < 1e-9, "{}", own.sum);
        assert!(
            row.value.contains(&format!(
                "migdra's own work, outside NVML and the claim GET (plugin's call_own_duration_seconds): p50 ≈{} / p99 ≈{}",
                ms(own.quantile(0.5).unwrap()),
                ms(own.quantile(0.99).unwrap())
            )),
            "{}",
            row.value
        );
        assert!(row.note.contains("8 at a time: outside NVML"), "{}", row.note);
        assert!(row.note.contains("starts at 100 ms"), "{}", row.note);
    }

    #[test]
    fn a_plugin_without_the_own_work_histogram_gives_the_mean_of_the_difference() {
        let prepares = [(0.009, 0.008, 0.0004), (0.0105, 0.009, 0.0006)];
        let before = Metrics::parse(&plugin_text(&[], Timing::ClaimGets));
        let after = Metrics::parse(&plugin_text(&prepares, Timing::ClaimGets));
        let sequential = PluginPrepares::between(Some(&before), &after);
        assert_eq!(sequential.own.count, 0.0);
        let row = b4_row(&kubelet(), Some(&sequential), None, &bench_gets(), &[], "1.0");
        // (1.0 + 1.5) / 2 ms outside NVML, minus (0.4 + 0.6) / 2 ms of GET.
        assert!(
            row.value.contains(&format!(
                "outside NVML and outside the claim GET: mean {}",
                ms(0.00075)
            )),
            "{}",
            row.value
        );
        assert!(!row.value.contains("own work"), "{}", row.value);
    }

    #[test]
    fn a_plugin_that_does_not_time_its_claim_gets_is_compared_with_the_benchs_gets() {
        let before = Metrics::parse(&plugin_text(&[], Timing::Nvml));
        let after = Metrics::parse(&plugin_text(
            &[(0.009, 0.008, 0.0), (0.0105, 0.009, 0.0)],
            Timing::Nvml,
        ));
        let sequential = PluginPrepares::between(Some(&before), &after);
        let outside_p99 = sequential.outside.quantile(0.99).unwrap();
        let row = b4_row(&kubelet(), Some(&sequential), None, &bench_gets(), &[], "1.0");
        assert_eq!(row.ratio, Some(outside_p99 / 0.004));
        assert!(
            row.anchor.contains("does not time its claim GETs"),
            "{}",
            row.anchor
        );
        assert!(row.note.contains("8 at a time: none"), "{}", row.note);
    }

    #[test]
    fn without_the_plugin_histograms_b4_falls_back_to_the_kubelet_figure_and_says_so() {
        let row = b4_row(&kubelet(), None, None, &bench_gets(), &[], "1.0");
        assert_eq!(row.ratio, Some(kubelet().quantile(0.99).unwrap() / 0.004));
        assert!(row.note.contains("NOT subtracted"), "{}", row.note);
        let empty = PluginPrepares::read(&Metrics::parse(""));
        let row = b4_row(&kubelet(), Some(&empty), None, &bench_gets(), &[], "1.0");
        assert!(row.note.contains("NOT subtracted"), "{}", row.note);
    }
}
