//! The migdra demo: brings up a local cluster with simulated GPUs (two H100-80GB and one
//! A100-40GB), runs workloads asking for different MIG profiles, prints each GPU's MIG layout
//! (which placement is used by which pod, as `kubectl migdra layout` prints it), and tears
//! everything down on exit or Ctrl-C.
//!
//! Run: `make demo` (or `cargo build --workspace && cargo run -p migdra-e2e --bin migdra-demo`).

use std::time::Duration;

use anyhow::Context;
use migdra_e2e::{
    cluster::{Cluster, ClusterConfig},
    layout,
    workload::{self, Request, create_pod, create_pod_with, create_template, profile_is, wait_phase},
};

const MIG: &str = "mig.migdra.dev";

fn mig(selectors: Vec<String>) -> Request {
    Request::Exactly {
        class: MIG.into(),
        selectors,
    }
}

/// Prints the layout as `kubectl migdra layout` does.
async fn show(cluster: &Cluster, title: &str) -> anyhow::Result<()> {
    println!("\n== {title}\n{}", layout::render(cluster).await?);
    Ok(())
}

async fn run(cluster: &Cluster) -> anyhow::Result<()> {
    let c = &cluster.client;
    show(cluster, "GPUs before any workload").await?;

    println!(
        "Creating workloads (each pod gets a claim from its template; the scheduler picks the placement):"
    );
    // A whole GPU, pinned to the second H100, shared by two containers of one pod.
    let second = cluster
        .gpus()?
        .gpus
        .iter()
        .find(|g| g.minor == 1)
        .map(|g| g.uuid.clone())
        .context("GPU 1")?;
    let whole = Request::Exactly {
        class: "gpu.migdra.dev".into(),
        selectors: vec![workload::on_gpu(&second)],
    };
    create_template(c, "whole-gpu", whole, None).await?;
    create_pod_with(
        c,
        "shared",
        "whole-gpu",
        &[("server", &["sleep", "3600"]), ("sidecar", &["sleep", "3600"])],
        false,
    )
    .await?;
    println!(
        "  pod {:<12} claim template whole-gpu (GPU 1 whole; two containers share one claim)",
        "shared"
    );
    wait_phase(c, "shared", "Running", Duration::from_secs(120)).await?;
    let at_least_15gib = "device.capacity[\"gpu.migdra.dev\"].memory.compareTo(quantity(\"15Gi\")) >= 0";
    let workloads: Vec<(&str, &str, Request)> = vec![
        ("training", "3g-40gb", mig(vec![profile_is("3g.40gb")])),
        ("inference-a", "1g-10gb", mig(vec![profile_is("1g.10gb")])),
        ("inference-b", "1g-10gb", mig(vec![profile_is("1g.10gb")])),
        ("notebook", "any-15gib", mig(vec![at_least_15gib.into()])),
        ("a100-job", "a100-2g", mig(vec![profile_is("2g.10gb")])),
        (
            "flexible",
            "2g-or-1g",
            Request::FirstAvailable(vec![
                ("big".into(), MIG.into(), vec![profile_is("2g.20gb")]),
                ("small".into(), MIG.into(), vec![profile_is("1g.10gb")]),
            ]),
        ),
    ];
    let mut templates = std::collections::BTreeSet::new();
    for (pod, template, request) in workloads {
        if templates.insert(template) {
            create_template(c, template, request, None).await?;
        }
        create_pod(c, pod, template, &["sleep", "3600"], false).await?;
        println!("  pod {pod:<12} claim template {template}");
    }

    for pod in [
        "training",
        "inference-a",
        "inference-b",
        "notebook",
        "a100-job",
        "flexible",
        "shared",
    ] {
        wait_phase(c, pod, "Running", Duration::from_secs(120)).await?;
        let claim = workload::pod_claim(c, pod).await?;
        let devices: Vec<String> = workload::allocated(&claim)
            .into_iter()
            .map(|(r, d)| format!("{d} (request {r})"))
            .collect();
        println!("  {pod:<12} Running on {}", devices.join(", "));
    }
    show(cluster, "GPUs with the workloads running").await?;

    println!("Deleting inference-a and training...");
    workload::delete_pods(c, &["inference-a", "training"]).await?;
    // The kubelet unprepares (and the plugin destroys the instances) just after the pods go.
    tokio::time::sleep(Duration::from_secs(3)).await;
    show(
        cluster,
        "GPUs after two pods finished (their instances are destroyed)",
    )
    .await?;
    workload::delete_all(c).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    println!(
        "Starting a local cluster: etcd, kube-apiserver, kube-scheduler, kube-controller-manager, kubelet,"
    );
    println!(
        "a fake CRI runtime, simulated GPUs (2x H100-80GB, 1x A100-SXM4-40GB) and migdra. This takes a minute."
    );
    let mut cluster = Cluster::start(ClusterConfig::default())
        .await
        .context("starting the cluster")?;
    println!(
        "Cluster up; component logs in {}",
        cluster.layout.logs_dir().display()
    );
    let outcome = tokio::select! {
        result = run(&cluster) => result,
        _ = tokio::signal::ctrl_c() => {
            println!("Interrupted.");
            Ok(())
        }
    };
    println!(
        "Tearing down (logs kept in {}).",
        cluster.layout.logs_dir().display()
    );
    cluster.teardown();
    outcome
}
