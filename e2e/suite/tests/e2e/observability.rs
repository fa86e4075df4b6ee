//! What an operator observes, on the real cluster: the plugin's and the controller's
//! `/metrics` (scraped over HTTP as Prometheus would), with the instance info series naming
//! the pod that uses the instance, and the GpuNode status with its instances' claims and the
//! summary behind `kubectl get gpunodes -o wide`; a claim the plugin rejects gets a Warning
//! event on the ResourceClaim with the failure's reason, counted by reason.
//!
//! Every name in `charts/tests/metric_names.txt` (the list the chart tests check every
//! dashboard query and alert expression against) must be one the processes expose; run with
//! `MIGDRA_UPDATE_METRIC_NAMES=1` to rewrite it from the scrape after adding a metric. (A
//! family shows up in a scrape once it has a series, so the list holds what this test makes
//! happen: an instance, a rejected claim; earlier tests may add more.)

use std::{collections::BTreeSet, time::Duration};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use migdra_api::{
    device_name::DeviceName,
    inventory::{GpuNode, InstanceOwner},
};
use migdra_e2e::{
    cluster::{CONTROLLER, Cluster, NODE, PLUGIN, repo_root, wait_until},
    workload::{self, create_pod, create_template, profile_is, wait_phase},
};

use crate::support::{SHORT, mig, settle};

tests![metrics_and_gpunode_status_show_each_instance_with_its_pod];

/// The Warning events the plugin recorded on ResourceClaim `claim` in `default`.
async fn claim_events(cluster: &Cluster, claim: &str) -> anyhow::Result<Vec<Event>> {
    let events: Api<Event> = Api::namespaced(cluster.client.clone(), "default");
    Ok(events
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter(|e| {
            e.regarding.as_ref().is_some_and(|r| {
                r.kind.as_deref() == Some("ResourceClaim") && r.name.as_deref() == Some(claim)
            }) && e.reporting_controller.as_deref() == Some("migdra-kubelet-plugin")
        })
        .collect())
}

/// The checked-in list of metric names (sample names: counters with `_total`, histograms
/// with `_bucket`/`_sum`/`_count`).
const NAMES_FILE: &str = "charts/tests/metric_names.txt";

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
    let plugin = cluster.scrape_metrics(PLUGIN).await?;
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
    // The per-GPU series follow the inventory, refreshed every heartbeat.
    wait_until(SHORT, || async {
        let text = cluster.scrape_metrics(PLUGIN).await.ok()?;
        text.lines().any(|l| l == used).then_some(())
    })
    .await
    .with_context(|| format!("no {used} in\n{plugin}"))?;

    // The controller publishes this node's pool and sees its plugin live.
    let controller = cluster.scrape_metrics(CONTROLLER).await?;
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

    // The wide view reads the summary and the Published condition.
    let out = std::process::Command::new(cluster.layout.upstream_bin.join("kubectl"))
        .arg(format!("--kubeconfig={}", cluster.layout.kubeconfig.display()))
        .args(["get", "gpunodes", "-o", "wide"])
        .output()?;
    let wide = String::from_utf8_lossy(&out.stdout).to_string();
    ensure!(
        out.status.success(),
        "kubectl: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(cluster.layout.run_dir.join("gpunodes-wide.txt"), &wide)?;
    let rows: Vec<Vec<&str>> = wide.lines().map(|l| l.split_whitespace().collect()).collect();
    let header = rows.first().context("no header")?;
    let row = rows
        .iter()
        .find(|r| r.first() == Some(&NODE))
        .with_context(|| format!("no row for {NODE}:\n{wide}"))?;
    let column = |name: &str| {
        header
            .iter()
            .position(|h| *h == name)
            .and_then(|i| row.get(i).copied())
            .with_context(|| format!("no {name} column:\n{wide}"))
    };
    let free = format!("{}/{total_slices}", total_slices - 2);
    for (name, want) in [
        ("INSTANCES", "1"),
        ("FOREIGN", "0"),
        ("FREE-SLICES", free.as_str()),
        ("HEALTH", "Healthy"),
        ("LIVE", "True"),
    ] {
        ensure!(column(name)? == want, "{name} is not {want}:\n{wide}");
    }

    // A claim the plugin rejects (bad opaque configuration): a Warning on the claim with the
    // failure's reason, and the failure counted under the same reason.
    let config = serde_json::json!({"apiVersion": "gpu.migdra.dev/v1alpha1", "kind": "DeviceConfig", "sharing": "mps"});
    create_template(&c, "rejected", mig(&[profile_is("1g.10gb")]), Some(config)).await?;
    create_pod(&c, "rejected", "rejected", &["sleep", "3600"], false).await?;
    let rejected = workload::pod_claim(&c, "rejected").await?;
    let rejected_name = rejected.metadata.name.clone().unwrap_or_default();
    let event = wait_until(Duration::from_secs(90), || async {
        let events = claim_events(cluster, &rejected_name).await.ok()?;
        events
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("InvalidConfig"))
    })
    .await
    .with_context(|| format!("no InvalidConfig event on claim {rejected_name}"))?;
    let note = event.note.clone().unwrap_or_default();
    ensure!(
        event.type_.as_deref() == Some("Warning")
            && event.action.as_deref() == Some("PrepareResourceClaim")
            && note.contains("unknown field `sharing`"),
        "{event:?}"
    );
    let regarding_uid = event.regarding.as_ref().and_then(|r| r.uid.clone());
    ensure!(regarding_uid == rejected.metadata.uid, "{event:?}");
    let plugin = cluster.scrape_metrics(PLUGIN).await?;
    let failures = format!(
        "migdra_kubelet_plugin_claim_failures_total{{node=\"{NODE}\",operation=\"prepare\",reason=\"InvalidConfig\"}} "
    );
    ensure!(
        plugin.lines().any(|l| l.starts_with(&failures)),
        "no {failures} in\n{plugin}"
    );
    ensure!(
        claim_events(cluster, &claim_name).await?.is_empty(),
        "the prepared claim got no Warning"
    );

    // Every name the dashboard and alerts may use is one the real processes expose.
    let controller = cluster.scrape_metrics(CONTROLLER).await?;
    let mut names = sample_names(&plugin)?;
    names.extend(sample_names(&controller)?);
    let path = repo_root().join(NAMES_FILE);
    if std::env::var_os("MIGDRA_UPDATE_METRIC_NAMES").is_some() {
        let listed: String = names.iter().map(|n| format!("{n}\n")).collect();
        std::fs::write(&path, &listed).with_context(|| format!("writing {}", path.display()))?;
    } else {
        let checked_in =
            std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let missing: Vec<&str> = checked_in
            .lines()
            .filter(|n| !n.is_empty() && !names.contains(*n))
            .collect();
        ensure!(
            missing.is_empty(),
            "{NAMES_FILE} lists names the cluster's processes do not expose: {missing:?} \
             (rerun with MIGDRA_UPDATE_METRIC_NAMES=1 if they were renamed or removed)"
        );
    }

    // Gone with the pod: the info series leaves the scrape.
    workload::delete_pods(&c, &["observed", "rejected"]).await?;
    wait_until(Duration::from_secs(120), || async {
        let text = cluster.scrape_metrics(PLUGIN).await.ok()?;
        samples(&text, "migdra_kubelet_plugin_mig_instance_info")
            .is_empty()
            .then_some(())
    })
    .await
    .context("the info series outlived the instance")?;
    settle(cluster).await
}
