//! The real node (real kubelet, fake CRI, fake NVML with 8 H100s): B5 pod start with and
//! without a MIG claim, B6 plugin memory idle and with every 1g.10gb placement prepared (56),
//! B4 NodePrepareResources latency against one GET of a claim by the plugin's own client:
//! the kubelet's DRA histogram, and the plugin's own histograms of its handler time, the part
//! inside NVML and the rest (the headline, from the plugin's fine buckets). Correctness checked on the way: every claim got its own
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
    stats::{Samples, Summary, latency, mib, ms},
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

/// The plugin's prepare histograms (its `call_*duration_seconds` families).
#[derive(Clone, Debug, Default, PartialEq)]
struct PluginPrepares {
    /// The handler's whole time per kubelet call.
    handler: Histogram,
    /// Time inside NVML per call.
    nvml: Histogram,
    /// Handler time minus NVML time per call (fine buckets).
    outside: Histogram,
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
        }
    }

    fn since(&self, before: &Self) -> Self {
        Self {
            handler: self.handler.since(&before.handler),
            nvml: self.nvml.since(&before.nvml),
            outside: self.outside.since(&before.outside),
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

/// The B4 row: the plugin's outside-NVML p99 against the floor's p99 (one claim GET), with
/// the kubelet's own figure, the handler's and the NVML time in the note. `kubelet_dra` names
/// the kubelet's DRA metrics, for when it has no prepares.
fn b4_row(
    kubelet: &Histogram,
    plugin: Option<&PluginPrepares>,
    floor: &Summary,
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
    let outside_p99 = plugin.and_then(|p| p.outside.quantile(0.99));
    let (value, note) = match plugin.filter(|p| p.outside.count > 0.0) {
        Some(p) => {
            let nvml_mean = p.nvml.mean().unwrap_or(0.0);
            let kubelet_minus_nvml = kubelet
                .mean()
                .map_or_else(|| "n/a".to_string(), |mean| ms(mean - nvml_mean));
            let value = format!(
                "outside NVML, plugin: p50 ≈{} / p99 ≈{} (n={})",
                p.outside.quantile(0.5).map_or_else(|| "?".into(), ms),
                outside_p99.map_or_else(|| "?".into(), ms),
                p.outside.count
            );
            let note = format!(
                "kubelet-observed (dra_grpc_operations_duration_seconds): {kubelet_figure}; \
                plugin handler: {}; NVML per prepare: mean {} (fake NVML); \
                kubelet mean − NVML mean: {kubelet_minus_nvml} (the kubelet's histogram starts at \
                {kubelet_start}, so the kubelet-observed figure minus NVML is only available as a mean; \
                quantiles are interpolated in the plugin's buckets); kubelet buckets: {kubelet_buckets}; load {load}",
                histogram_latency(&p.handler).unwrap_or_else(|| "none".into()),
                ms(nvml_mean),
            );
            (value, note)
        }
        None => (
            format!("kubelet-observed: {kubelet_figure}"),
            format!(
                "the plugin exported no NVML timing (call_outside_nvml_duration_seconds missing or empty): \
                 NVML time NOT subtracted; kubelet buckets: {kubelet_buckets}; load {load}"
            ),
        ),
    };
    // Without the plugin's figure the kubelet's p99 stands in (NVML included).
    let p99 = outside_p99.or_else(|| kubelet.quantile(0.99));
    Row {
        id: "B4",
        measure: "plugin NodePrepareResources latency minus time inside NVML (plugin's call_outside_nvml_duration_seconds; kubelet's figure in the note)".into(),
        value,
        anchor: format!("one GET of the claim, plugin's client: {}", latency(floor)),
        ratio: p99.map(|p| p / floor.p99),
        goal: "p99 ≤ 1.5× the floor",
        met: p99.map(|p| p <= 1.5 * floor.p99),
        note,
    }
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
    let plugin_port = cluster.allocated_port("plugin-http");
    let plugin_before = match plugin_port {
        Some(port) => scrape_http(port).await.ok(),
        None => None,
    };
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
    let plugin_after = match plugin_port {
        Some(port) => scrape_http(port).await.ok(),
        None => None,
    };
    // Every prepare of this run, as the kubelet's figure.
    let plugin_prepares = plugin_after.as_ref().map(|after| {
        let after = PluginPrepares::read(after);
        match &plugin_before {
            Some(before) => after.since(&PluginPrepares::read(before)),
            None => after,
        }
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

    let mut rows = vec![b4_row(
        &prepares,
        plugin_prepares.as_ref(),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A plugin exposition: `observations` of each (handler, nvml) pair, in seconds.
    fn plugin_text(observations: &[(f64, f64)]) -> String {
        let mut text = String::new();
        for (family, pick) in [
            ("call_duration_seconds", 0),
            ("call_nvml_duration_seconds", 1),
            ("call_outside_nvml_duration_seconds", 2),
        ] {
            let values: Vec<f64> = observations
                .iter()
                .map(|&(handler, nvml)| [handler, nvml, handler - nvml][pick])
                .collect();
            let name = format!("migdra_kubelet_plugin_{family}");
            for bound in [0.001, 0.002, 0.005, 0.01, 0.1, f64::INFINITY] {
                let le = if bound.is_infinite() {
                    "+Inf".to_string()
                } else {
                    bound.to_string()
                };
                let count = values.iter().filter(|v| **v <= bound).count();
                text += &format!("{name}_bucket{{operation=\"prepare\",le=\"{le}\"}} {count}\n");
                text += &format!("{name}_bucket{{operation=\"unprepare\",le=\"{le}\"}} 99\n");
            }
            text += &format!(
                "{name}_sum{{operation=\"prepare\"}} {}\n",
                values.iter().sum::<f64>()
            );
            text += &format!("{name}_count{{operation=\"prepare\"}} {}\n", values.len());
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

    fn floor() -> Summary {
        Summary {
            count: 200,
            p50: 0.0015,
            p99: 0.004,
            mean: 0.002,
        }
    }

    #[test]
    fn b4_takes_the_phase_of_the_plugin_histograms_and_compares_outside_nvml_with_the_floor() {
        let before = PluginPrepares::read(&Metrics::parse(&plugin_text(&[(0.5, 0.4)])));
        let after = PluginPrepares::read(&Metrics::parse(&plugin_text(&[
            (0.5, 0.4),
            (0.009, 0.008),
            (0.0105, 0.009),
            (0.011, 0.0095),
            (0.04, 0.0384),
        ])));
        let phase = after.since(&before);
        // The unprepare series are not mixed in, the earlier observation is taken out.
        assert_eq!(phase.outside.count, 4.0);
        assert!((phase.nvml.sum - 0.0649).abs() < 1e-9, "{}", phase.nvml.sum);
        let outside_p99 = phase.outside.quantile(0.99).unwrap();
        let row = b4_row(&kubelet(), Some(&phase), &floor(), &[], "1.0");
        assert_eq!(row.ratio, Some(outside_p99 / 0.004));
        assert_eq!(row.met, Some(outside_p99 <= 1.5 * 0.004));
        assert!(row.value.contains("outside NVML"), "{}", row.value);
        // Kubelet mean 80 ms minus NVML mean 16.225 ms.
        assert!(row.note.contains(&ms(0.08 - 0.0649 / 4.0)), "{}", row.note);
        assert!(row.note.contains("starts at 100 ms"), "{}", row.note);
    }

    #[test]
    fn without_the_plugin_histograms_b4_falls_back_to_the_kubelet_figure_and_says_so() {
        let row = b4_row(&kubelet(), None, &floor(), &[], "1.0");
        assert_eq!(row.ratio, Some(kubelet().quantile(0.99).unwrap() / 0.004));
        assert!(row.note.contains("NOT subtracted"), "{}", row.note);
        let empty = PluginPrepares::read(&Metrics::parse(""));
        let row = b4_row(&kubelet(), Some(&empty), &floor(), &[], "1.0");
        assert!(row.note.contains("NOT subtracted"), "{}", row.note);
    }
}
