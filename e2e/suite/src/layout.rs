//! The MIG layout the demo prints and the tests read: `kubectl migdra`'s layout view of the
//! cluster (one renderer, in the kubectl-migdra crate), taken once the node's GpuNode shows
//! what the simulated GPUs hold (the plugin refreshes it every few seconds).

use std::{collections::BTreeSet, time::Duration};

use anyhow::Context;
use kube::{Api, Client};
use kubectl_migdra::{
    client::{Connection, Needs},
    layout::{self, LayoutView},
    render::{Style, text},
    snapshot::Snapshot,
};
use migdra_api::inventory::GpuNode;

use crate::cluster::{Cluster, DRIVER, NODE, wait_until};

/// What `kubectl migdra layout` reads, read with `client`.
pub async fn snapshot(client: &Client) -> anyhow::Result<Snapshot> {
    let connection = Connection {
        client: client.clone(),
        default_namespace: "default".into(),
    };
    let needs = Needs {
        gpu_nodes: true,
        claims: true,
        pods: true,
        ..Needs::default()
    };
    Ok(kubectl_migdra::client::snapshot(&connection, DRIVER, &needs).await?)
}

/// (GPU minor, GI profile ID, start) of every GPU instance.
type Placements = BTreeSet<(u32, u32, u32)>;

/// Waits until the GpuNode lists exactly the GPU instances the simulated GPUs hold.
pub async fn wait_in_sync(cluster: &Cluster, timeout: Duration) -> anyhow::Result<()> {
    let nodes: Api<GpuNode> = Api::all(cluster.client.clone());
    let reported = || async {
        let node = nodes.get(NODE).await.ok()?;
        let gpus = node.status?.gpus?;
        Some(
            gpus.iter()
                .flat_map(|g| {
                    g.mig
                        .iter()
                        .flat_map(|m| &m.instances)
                        .map(|i| (g.minor, i.placement.profile_id, i.placement.start))
                })
                .collect::<Placements>(),
        )
    };
    let actual = || -> anyhow::Result<Placements> {
        Ok(cluster
            .gpus()?
            .gpus
            .iter()
            .flat_map(|g| {
                g.gpu_instances
                    .iter()
                    .map(|gi| (g.minor, gi.profile_id, gi.start))
            })
            .collect())
    };
    wait_until(timeout, || async {
        let want = actual().ok()?;
        (reported().await? == want).then_some(())
    })
    .await
    .with_context(|| {
        format!(
            "the GpuNode does not show the simulated GPUs' instances {:?}",
            actual().ok()
        )
    })
}

/// The layout view of the cluster, once the GpuNode is in sync with the simulated GPUs.
pub async fn view(cluster: &Cluster) -> anyhow::Result<LayoutView> {
    wait_in_sync(cluster, Duration::from_secs(30)).await?;
    Ok(layout::build(&snapshot(&cluster.client).await?, &[]))
}

/// The layout as `kubectl migdra layout` prints it (colours on a terminal).
pub async fn render(cluster: &Cluster) -> anyhow::Result<String> {
    Ok(text::layout(&view(cluster).await?, &Style::detect(false)))
}
