//! A rolling update of the kubelet plugin without downtime, as the chart's DaemonSet does it
//! with `maxSurge: 1`: a second plugin process starts next to the first with socket names of
//! its own, the first stops, and then back again. Claims are prepared and unprepared all the
//! while; none fails and nothing is left behind.

use std::{
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use anyhow::{Context, ensure};
use kube::Client;
use migdra_e2e::{
    cluster::{Cluster, DRIVER, PLUGIN, SURGE_PLUGIN, wait_until},
    workload::{self, create_pod, create_template, profile_is, wait_phase},
};

use crate::support::{SHORT, mig, settle, total_instances};

tests![plugin_rolling_update_keeps_claims_flowing];

/// What the plugin logs once the kubelet accepted its registration.
const REGISTERED: &str = "kubelet registered the plugin";

/// How often a component's log says the kubelet registered it (the log is appended across
/// restarts, so callers wait for the count to grow).
fn registrations(cluster: &Cluster, component: &str) -> usize {
    std::fs::read_to_string(cluster.layout.log(component))
        .map(|log| log.matches(REGISTERED).count())
        .unwrap_or(0)
}

async fn wait_registered(cluster: &Cluster, component: &str, before: usize) -> anyhow::Result<()> {
    wait_until(SHORT, || async {
        (registrations(cluster, component) > before).then_some(())
    })
    .await
    .with_context(|| format!("the kubelet did not register {component}"))
}

/// Claims coming and going: pods `churn-<n>` one after another, each until it runs, then
/// deleted (which unprepares its claim). Any prepare failure the kubelet reports on a pod
/// is an error.
async fn churn(client: Client, stop: Arc<AtomicBool>, cycles: Arc<AtomicUsize>) -> anyhow::Result<()> {
    let mut n = 0;
    while !stop.load(Ordering::SeqCst) {
        let pod = format!("churn-{n}");
        create_pod(&client, &pod, "rolling", &["sleep", "3600"], false).await?;
        wait_phase(&client, &pod, "Running", Duration::from_secs(120)).await?;
        let failures: Vec<String> = workload::pod_events(&client, &pod)
            .await?
            .into_iter()
            .filter(|e| e.reason.as_deref().is_some_and(|r| r.contains("Prepare")))
            .map(|e| format!("{:?}: {:?}", e.reason, e.message))
            .collect();
        ensure!(failures.is_empty(), "pod {pod}: {failures:?}");
        workload::delete_pods(&client, &[&pod]).await?;
        n += 1;
        cycles.fetch_add(1, Ordering::SeqCst);
    }
    Ok(())
}

/// Waits until the churn completed one more whole cycle than it had now.
async fn one_more_cycle(
    cycles: &AtomicUsize,
    churn: &tokio::task::JoinHandle<anyhow::Result<()>>,
) -> anyhow::Result<()> {
    let target = cycles.load(Ordering::SeqCst) + 1;
    wait_until(Duration::from_secs(180), || async {
        (cycles.load(Ordering::SeqCst) >= target || churn.is_finished()).then_some(())
    })
    .await
    .context("the claim churn stalled")?;
    ensure!(!churn.is_finished(), "the claim churn stopped early");
    Ok(())
}

async fn plugin_rolling_update_keeps_claims_flowing(cluster: &mut Cluster) -> anyhow::Result<()> {
    let c = cluster.client.clone();
    create_template(&c, "rolling", mig(&[profile_is("1g.10gb")]), None).await?;
    // Prepared by the first plugin, unprepared by the second.
    create_pod(&c, "rolling-keeper", "rolling", &["sleep", "3600"], false).await?;
    wait_phase(&c, "rolling-keeper", "Running", SHORT).await?;

    let stop = Arc::new(AtomicBool::new(false));
    let cycles = Arc::new(AtomicUsize::new(0));
    let churn = tokio::spawn(churn(c.clone(), stop.clone(), cycles.clone()));
    let rolled = roll(cluster, &cycles, &churn).await;
    stop.store(true, Ordering::SeqCst);
    let churned = churn.await.context("the claim churn panicked")?;
    rolled?;
    churned.context("a claim failed during the rolling update")?;
    ensure!(
        cycles.load(Ordering::SeqCst) >= 5,
        "too few claims went through the update"
    );
    cluster.wait_published(SHORT).await?;
    settle(cluster).await?;
    let checkpoint = std::fs::read_to_string(cluster.layout.plugin_state.join("checkpoint.json"))?;
    ensure!(
        !checkpoint.contains("\"namespace\""),
        "claims left in the checkpoint: {checkpoint}"
    );
    Ok(())
}

/// Old → surge → old, with the churn running.
async fn roll(
    cluster: &mut Cluster,
    cycles: &AtomicUsize,
    churn: &tokio::task::JoinHandle<anyhow::Result<()>>,
) -> anyhow::Result<()> {
    let c = cluster.client.clone();
    let root = cluster.layout.kubelet_root.clone();
    let fixed = sockets(&root, None);
    let surge = sockets(&root, Some("surge-1"));
    one_more_cycle(cycles, churn).await?;
    let withdrawn_before = withdrawals(cluster);

    // The new instance starts next to the old one; both serve.
    let before = registrations(cluster, SURGE_PLUGIN);
    cluster.start_surge_plugin("surge-1")?;
    wait_registered(cluster, SURGE_PLUGIN, before).await?;
    ensure!(
        fixed.iter().chain(&surge).all(|s| s.exists()),
        "both instances' sockets exist"
    );
    one_more_cycle(cycles, churn).await?;

    // The old one stops and removes only its own sockets.
    cluster.stop(PLUGIN, Duration::from_secs(20));
    ensure!(
        fixed.iter().all(|s| !s.exists()),
        "the old instance's sockets are gone"
    );
    ensure!(
        surge.iter().all(|s| s.exists()),
        "the new instance's sockets stay"
    );
    one_more_cycle(cycles, churn).await?;

    // The new instance unprepares the claim the old one prepared.
    let instances = total_instances(cluster);
    workload::delete_pods(&c, &["rolling-keeper"]).await?;
    wait_until(SHORT, || async {
        (total_instances(cluster) < instances).then_some(())
    })
    .await
    .context("the keeper's instance was not destroyed by the new plugin")?;

    // And back, so the rest of the suite finds the plugin as it was.
    let before = registrations(cluster, PLUGIN);
    cluster.start_plugin()?;
    wait_registered(cluster, PLUGIN, before).await?;
    one_more_cycle(cycles, churn).await?;
    cluster.stop(SURGE_PLUGIN, Duration::from_secs(20));
    ensure!(
        surge.iter().all(|s| !s.exists()),
        "the surge instance's sockets are gone"
    );
    ensure!(fixed.iter().all(|s| s.exists()), "the plugin's sockets stay");
    one_more_cycle(cycles, churn).await?;
    one_more_cycle(cycles, churn).await?;
    // A hand-over, not an outage: the stopping instance saw the other registered and did not
    // report the node's plugin unregistered, so the pool stayed published throughout.
    ensure!(
        withdrawals(cluster) == withdrawn_before,
        "the controller withdrew the pool during the rolling update"
    );
    Ok(())
}

/// How often the controller's log says it withdrew the node's pool.
fn withdrawals(cluster: &Cluster) -> usize {
    std::fs::read_to_string(cluster.layout.log("migdra-controller"))
        .map(|log| log.matches("withdrawing the pool").count())
        .unwrap_or(0)
}

/// The DRA and registration socket of an instance.
fn sockets(kubelet_root: &Path, instance: Option<&str>) -> [std::path::PathBuf; 2] {
    match instance {
        Some(i) => [
            kubelet_root.join(format!("plugins/{DRIVER}/dra-{i}.sock")),
            kubelet_root.join(format!("plugins_registry/{DRIVER}-{i}-reg.sock")),
        ],
        None => [
            kubelet_root.join(format!("plugins/{DRIVER}/dra.sock")),
            kubelet_root.join(format!("plugins_registry/{DRIVER}-reg.sock")),
        ],
    }
}
