//! What an operator observes, on the real cluster: the plugin's and the controller's
//! `/metrics` (scraped over HTTP as Prometheus would), with the instance info series naming
//! the pod that uses the instance, and the GpuNode status with its instances' claims and the
//! summary behind `kubectl get gpunodes -o wide`.
//!
//! The metric names the scrape exposes are compared with `charts/tests/metric_names.txt`, the
//! list the chart tests check every dashboard query and alert expression against; run with
//! `MIGDRA_UPDATE_METRIC_NAMES=1` to rewrite it after adding a metric.

use std::{collections::BTreeSet, time::Duration};

use anyhow::{Context, bail, ensure};
use kube::Api;
use migdra_api::{
    device_name::DeviceName,
    inventory::{GpuNode, InstanceOwner},
};
use migdra_e2e::{
    cluster::{Cluster, NODE, repo_root, wait_until},
    workload::{self, create_pod, create_template, profile_is, wait_phase},
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::{SHORT, mig, settle};

tests![metrics_and_gpunode_status_show_each_instance_with_its_pod];

/// The checked-in list of metric names (sample names: counters with `_total`, histograms
/// with `_bucket`/`_sum`/`_count`).
const NAMES_FILE: &str = "charts/tests/metric_names.txt";

/// GETs `/metrics` from a component's loopback endpoint (HTTP/1.0: the server closes after
/// the response, so reading to the end is the whole body).
async fn scrape(cluster: &Cluster, endpoint: &str) -> anyhow::Result<String> {
    let port = cluster
        .endpoint_port(endpoint)
        .with_context(|| format!("{endpoint} has no port: not started?"))?;
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await?;
    let mut response = String::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_string(&mut response))
        .await
        .context("scrape timed out")??;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("no HTTP header in the response")?;
    ensure!(
        head.starts_with("HTTP/1.") && head.contains(" 200 "),
        "{endpoint}: {head}"
    );
    Ok(body.to_string())
}

/// The sample names of every family an OpenMetrics text declares (from its `# TYPE` lines, so
/// a family without series yet is listed too).
fn sample_names(text: &str) -> anyhow::Result<BTreeSet<String>> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let Some(declaration) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let (family, kind) = declaration
            .split_once(' ')
            .with_context(|| format!("bad TYPE line {line:?}"))?;
        let suffixes: &[&str] = match kind {
            "counter" => &["_total"],
            "histogram" => &["_bucket", "_sum", "_count"],
            "info" => &["_info"],
            "gauge" | "unknown" => &[""],
            other => bail!("unexpected metric type {other} of {family}"),
        };
        names.extend(suffixes.iter().map(|s| format!("{family}{s}")));
    }
    Ok(names)
}

/// The sample lines of `name` (exact), from an OpenMetrics text.
fn samples<'a>(text: &'a str, name: &str) -> Vec<&'a str> {
    let with_labels = format!("{name}{{");
    let bare = format!("{name} ");
    text.lines()
        .filter(|l| l.starts_with(&with_labels) || l.starts_with(&bare))
        .collect()
}

async fn metrics_and_gpunode_status_show_each_instance_with_its_pod(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    let c = cluster.client.clone();
    create_template(&c, "observed", mig(&[profile_is("2g.20gb")]), None).await?;
    create_pod(&c, "observed", "observed", &["sleep", "3600"], false).await?;
    wait_phase(&c, "observed", "Running", SHORT).await?;
    let claim = workload::pod_claim(&c, "observed").await?;
    let claim_name = claim.metadata.name.clone().unwrap_or_default();
    let claim_uid = claim.metadata.uid.clone().unwrap_or_default();
    let allocated = workload::allocated(&claim);
    ensure!(allocated.len() == 1, "{allocated:?}");
    let DeviceName::Mig { minor, start, .. } = allocated[0].1.parse::<DeviceName>()? else {
        bail!("{} is not MIG", allocated[0].1)
    };
    let state = cluster.gpus()?;
    let gpu = state
        .gpus
        .iter()
        .find(|g| g.minor == minor)
        .context("allocated GPU not simulated")?;
    let gi = gpu
        .gpu_instances
        .iter()
        .find(|gi| gi.start == start)
        .context("no instance at the allocated placement")?;
    let ci = gi.compute_instances.first().context("no compute instance")?;

    // The plugin's info series names the instance and the pod using it (the plugin read the
    // claim's reservedFor at prepare).
    let plugin = scrape(cluster, "plugin-http").await?;
    let expected = format!(
        "migdra_kubelet_plugin_mig_instance_info{{node=\"{NODE}\",gpu_uuid=\"{}\",gpu=\"{}\",gpu_minor=\"{minor}\",gi=\"{}\",ci=\"{}\",mig_uuid=\"{}\",profile=\"2g.20gb\",placement=\"{start}\",namespace=\"default\",pod=\"observed\",claim=\"{claim_name}\"}} 1",
        gpu.uuid, gpu.index, gi.id, ci.id, ci.uuid
    );
    let info = samples(&plugin, "migdra_kubelet_plugin_mig_instance_info");
    ensure!(
        info == vec![expected.as_str()],
        "expected\n{expected}\ngot\n{info:#?}"
    );
    let used = format!(
        "migdra_kubelet_plugin_gpu_memory_slices{{node=\"{NODE}\",gpu=\"{}\",gpu_minor=\"{minor}\",gpu_uuid=\"{}\",state=\"used\"}} 2",
        gpu.index, gpu.uuid
    );
    ensure!(plugin.lines().any(|l| l == used), "no {used} in\n{plugin}");

    // The controller publishes this node's pool and sees its plugin live.
    let controller = scrape(cluster, "controller-http").await?;
    for line in [
        format!("migdra_controller_plugin_live{{node=\"{NODE}\"}} 1"),
        "migdra_controller_published_pools 1".to_string(),
    ] {
        ensure!(
            controller.lines().any(|l| l == line),
            "no {line} in\n{controller}"
        );
    }
    let devices = samples(&controller, "migdra_controller_published_devices");
    ensure!(
        devices.iter().any(|l| l.starts_with(&format!(
            "migdra_controller_published_devices{{node=\"{NODE}\"}} "
        )) && !l.ends_with(" 0")),
        "{devices:?}"
    );

    // The GpuNode lists the instance with its claim, and the summary the wide view shows.
    let gpunodes: Api<GpuNode> = Api::all(c.clone());
    let status = wait_until(SHORT, || async {
        let status = gpunodes.get(NODE).await.ok()?.status?;
        let summary = status.summary.as_ref()?;
        (summary.instances == 1).then_some(status)
    })
    .await
    .context("the GpuNode summary never showed the instance")?;
    let summary = status.summary.clone().context("no summary")?;
    let gpus = status.gpus.clone().unwrap_or_default();
    let total_slices: u32 = gpus
        .iter()
        .filter_map(|g| g.mig.as_ref().filter(|m| m.enabled))
        .map(|m| m.geometry.budget.memory_slices)
        .sum();
    ensure!(
        summary.free_memory_slices == format!("{}/{total_slices}", total_slices - 2)
            && summary.foreign_instances == 0
            && summary.health == "Healthy",
        "{summary:?}"
    );
    let instance = gpus
        .iter()
        .filter(|g| g.minor == minor)
        .filter_map(|g| g.mig.as_ref())
        .flat_map(|m| &m.instances)
        .find(|i| i.placement.start == start)
        .context("the instance is not in the GpuNode status")?;
    ensure!(
        instance.owner == InstanceOwner::Migdra
            && instance.claim.as_deref() == Some(&format!("default/{claim_name}"))
            && instance.claim_uid.as_deref() == Some(claim_uid.as_str())
            && instance.compute_instance_id == Some(ci.id)
            && instance.mig_uuid.as_deref() == Some(ci.uuid.as_str()),
        "{instance:?}"
    );

    // Every family the dashboard and alerts may name, from the real processes.
    let mut names = sample_names(&plugin)?;
    names.extend(sample_names(&controller)?);
    let listed: String = names.iter().map(|n| format!("{n}\n")).collect();
    let path = repo_root().join(NAMES_FILE);
    if std::env::var_os("MIGDRA_UPDATE_METRIC_NAMES").is_some() {
        std::fs::write(&path, &listed).with_context(|| format!("writing {}", path.display()))?;
    } else {
        let checked_in =
            std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        if checked_in != listed {
            let scraped = cluster.layout.run_dir.join("metric_names.txt");
            std::fs::write(&scraped, &listed)?;
            bail!(
                "{NAMES_FILE} differs from the names the cluster's processes expose (written to {}); \
                 rerun with MIGDRA_UPDATE_METRIC_NAMES=1 if the change is intended",
                scraped.display()
            );
        }
    }

    // Gone with the pod: the info series leaves the scrape.
    workload::delete_pods(&c, &["observed"]).await?;
    wait_until(Duration::from_secs(120), || async {
        let text = scrape(cluster, "plugin-http").await.ok()?;
        samples(&text, "migdra_kubelet_plugin_mig_instance_info")
            .is_empty()
            .then_some(())
    })
    .await
    .context("the info series outlived the instance")?;
    settle(cluster).await
}
