//! The migdra demo: brings up a local cluster with simulated GPUs (two H100-80GB and one
//! A100-40GB) whose kubelet runs on containerd and runc, installs migdra with `helm install`
//! from its chart (its images pulled from a registry on loopback), runs workloads asking for
//! different MIG profiles from the workload image, prints what each container saw and each
//! GPU's MIG layout (which placement is used by which pod, as `kubectl migdra layout` prints
//! it), and tears everything down on exit or Ctrl-C.
//!
//! Run: `make demo` (or `cargo build --workspace --bins && cargo run -p migdra-e2e --bin
//! migdra-demo`), as root.

use std::time::Duration;

use anyhow::Context;
use migdra_e2e::{
    cluster::{Cluster, ClusterConfig, MigdraMode, Runtime},
    layout,
    workload::{self, Request, create_template, profile_is, wait_phase},
};

const MIG: &str = "mig.migdra.dev";

fn mig(selectors: Vec<String>) -> Request {
    Request::Exactly {
        class: MIG.into(),
        selectors,
    }
}

/// Creates pod `name` whose `containers` all run the workload probe (print what the container
/// got, then wait) with the one claim made from `template`.
async fn create_probe_pod(
    cluster: &Cluster,
    name: &str,
    template: &str,
    containers: &[&str],
) -> anyhow::Result<()> {
    let sleep: &[&str] = &["sleep"];
    let containers: Vec<(&str, &[&str])> = containers.iter().map(|c| (*c, sleep)).collect();
    workload::create_pod_with(&cluster.client, name, template, &containers, false).await
}

/// One line of what a container saw, from the probe's report: the GPU device nodes, the MIG
/// capability nodes and the device UUIDs migdra put in its environment.
async fn container_saw(cluster: &Cluster, pod: &str, container: &str) -> anyhow::Result<String> {
    let view = workload::container_view(&cluster.client, pod, container).await?;
    let names = |prefix: &str| -> Vec<String> {
        view.device_paths()
            .into_iter()
            .filter_map(|p| p.strip_prefix(prefix).map(str::to_string))
            .collect()
    };
    let gpus: Vec<String> = names("/dev/")
        .into_iter()
        .filter(|n| n.strip_prefix("nvidia").is_some_and(|d| d.parse::<u32>().is_ok()))
        .collect();
    let caps = names("/dev/nvidia-caps/");
    Ok(format!(
        "/dev/{{{}}}, nvidia-caps {{{}}}, {}",
        gpus.join(","),
        caps.join(","),
        view.device_uuids().join(", ")
    ))
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
    create_probe_pod(cluster, "shared", "whole-gpu", &["server", "sidecar"]).await?;
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
        create_probe_pod(cluster, pod, template, &["main"]).await?;
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
    println!("\nWhat each container saw (the workload image's probe, from inside the container):");
    for (pod, containers) in [
        ("training", &["main"][..]),
        ("inference-a", &["main"]),
        ("inference-b", &["main"]),
        ("notebook", &["main"]),
        ("a100-job", &["main"]),
        ("flexible", &["main"]),
        ("shared", &["server", "sidecar"]),
    ] {
        for container in containers {
            let label = if containers.len() > 1 {
                format!("{pod}/{container}")
            } else {
                pod.to_string()
            };
            println!("  {label:<15} {}", container_saw(cluster, pod, container).await?);
        }
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
        "containerd and runc, simulated GPUs (2x H100-80GB, 1x A100-SXM4-40GB), and migdra installed with"
    );
    println!(
        "helm install from its chart, its images pulled from a registry on loopback. This takes a minute or two."
    );
    let config = ClusterConfig {
        runtime: Some(Runtime::Containerd),
        migdra_mode: Some(MigdraMode::Chart),
        ..ClusterConfig::default()
    };
    let mut cluster = Cluster::start(config).await.context("starting the cluster")?;
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
