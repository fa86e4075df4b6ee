//! `migdra-bench`: boots the e2e cluster (8 simulated H100s on the real node), runs the
//! measures in order (real node first, while the cluster is quiet; then simulated nodes at
//! growing counts) and prints the table, also written to `<out>/bench-<time>.md`.

use std::{process::Command, time::Duration};

use anyhow::Context as _;
use clap::Parser;
use migdra_bench::{
    cli::{Args, Measure, PluginIdentity},
    measure, probe,
    sim::{fleet::Fleet, heartbeat::Heartbeat},
    table::{Context, Row, render},
};
use migdra_e2e::cluster::{CHART_NAMESPACE, Cluster, ClusterConfig, DRIVER, MigdraMode, Runtime, repo_root};
use migdra_fake_nvml::config::GpuConfig;

fn command_line() -> String {
    let mut words = vec!["migdra-bench".to_string()];
    words.extend(std::env::args().skip(1));
    // Every variable that changes what is measured: the bench's own, the binaries and the
    // upstream build used, and the allocator's tuning the measured processes inherit.
    let env: Vec<String> = std::env::vars()
        .filter(|(k, _)| {
            k.starts_with("BENCH_")
                || ["MIGDRA_BIN_DIR", "MIGDRA_CACHE_DIR", "MIGDRA_K8S_MINOR"].contains(&k.as_str())
                || k.starts_with("MALLOC_")
        })
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    if env.is_empty() {
        format!("make bench ({})", words.join(" "))
    } else {
        format!("make bench {} ({})", env.join(" "), words.join(" "))
    }
}

fn versions(cluster: &Cluster) -> String {
    let git = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(repo_root())
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let kube = Command::new(cluster.layout.upstream_bin.join("kube-apiserver"))
        .arg("--version")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    format!(
        "migdra {} ({git}), controller and plugin release builds; {kube} (apiserver, scheduler, controller-manager, kubelet)",
        env!("CARGO_PKG_VERSION")
    )
}

/// SIGINT or SIGTERM.
async fn interrupted() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

fn failed_row(id: &'static str, what: &str, error: &anyhow::Error) -> Row {
    eprintln!("{id} {what} failed: {error:#}");
    Row {
        id,
        measure: what.to_string(),
        value: "FAILED".into(),
        anchor: String::new(),
        ratio: None,
        goal: "",
        met: None,
        note: format!("{error:#}"),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                // kube's client logs every retried 5xx and every skipped certificate check.
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube_client=off")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    args.check()?;
    let out_dir = args.out_dir()?;
    let mut rows = Vec::new();
    let mut appendix = String::new();
    let load_start = probe::load_average();

    // B7 first: a pure simulation, before the cluster loads the machine.
    if args.runs(Measure::B7) {
        eprintln!("B7: packing simulation");
        let (row, output) = measure::packing::run();
        rows.push(row);
        appendix = output;
    }

    eprintln!("booting the e2e cluster (8 simulated H100s on the real node)");
    let config = ClusterConfig {
        gpus: (0..8).map(|_| GpuConfig::new("H100-80GB", true)).collect(),
        controller_heartbeat_timeout_seconds: 25,
        kubelet_anonymous_reads: true,
        control_plane_api_qps: args.control_plane_api_qps,
        // B1–B4 and B6 measure migdra and the control plane, not a container runtime: the fake
        // CRI under the kubelet and migdra as host processes (their pids give CPU and memory).
        runtime: Some(Runtime::FakeCri),
        migdra_mode: Some(MigdraMode::HostProcesses),
        ..ClusterConfig::default()
    };
    let mut cluster = Cluster::start(config).await.context("starting the e2e cluster")?;
    if args.keep_memory_counter {
        cluster
            .set_keep_memory_counter(true)
            .await
            .context("restarting the controller with --keep-memory-counter")?;
    }
    let versions = versions(&cluster);
    // Ctrl-C or SIGTERM ends the run early; the cluster is torn down either way.
    let result = tokio::select! {
        r = run(&args, &mut cluster, &mut rows) => r,
        _ = interrupted() => Err(anyhow::anyhow!("interrupted")),
    };
    let logs = cluster.layout.logs_dir();
    cluster.teardown();
    if let Err(e) = &result {
        rows.push(failed_row("—", "bench run", e));
    } else if args.runs(Measure::B5) {
        // B5 again on the real runtime, on a cluster of its own (the one above runs the fake CRI).
        eprintln!("B5: the real node on containerd + runc");
        let row = tokio::select! {
            r = measure::node::b5_on_containerd(args.b5_pods) => r,
            _ = interrupted() => Err(anyhow::anyhow!("interrupted")),
        };
        rows.push(row.unwrap_or_else(|e| failed_row("B5", "pod start on containerd + runc", &e)));
    }
    rows.sort_by_key(|r| r.id);

    let context = Context {
        date: format!("{} UTC", jiff_now()),
        command: command_line(),
        machine: format!(
            "{} (shared with other builds: load average {load_start} at start, {} at end)",
            probe::machine(),
            probe::load_average()
        ),
        versions,
        notes: vec![
            format!(
                "simulated nodes: Node (capacity, conditions, node Lease every 10 s) + GpuNode of 8 × H100-80GB; plugin heartbeat (Lease renewal) every {} s; plugin writes as {}",
                args.heartbeat_interval_seconds,
                args.plugin_identity.describe(),
            ),
            match args.control_plane_api_qps {
                Some(qps) => format!(
                    "kube-scheduler and kube-controller-manager client rate: --kube-api-qps={qps} --kube-api-burst={}",
                    qps.saturating_mul(2)
                ),
                None => "kube-scheduler and kube-controller-manager client rate: upstream defaults (50 and 20 QPS)".into(),
            },
            match &args.after_bin_dir {
                Some(dir) => format!(
                    "before/after in one run: **before** = the binaries the cluster started with ({}), heartbeat as above, floor concurrency {}; \
                     **after** = the controller in {}, floor concurrency {}; same cluster, same simulated nodes",
                    std::env::var("MIGDRA_BIN_DIR").unwrap_or_else(|_| "next to migdra-bench".into()),
                    concurrency_text(args.floor_concurrency),
                    dir.display(),
                    concurrency_text(args.after_floor_concurrency)
                ),
                None => format!(
                    "B2 floor concurrency: {}",
                    concurrency_text(args.floor_concurrency)
                ),
            },
            if args.nodes.iter().any(|n| *n > args.upstream_controllers_max_nodes) {
                format!(
                    "kube-scheduler and kube-controller-manager stopped before the fleet grew past {} nodes (BENCH_UPSTREAM_CONTROLLERS_MAX_NODES): B2/B3/B6 do not involve them, and at 2,000 nodes they ran the machine out of memory",
                    args.upstream_controllers_max_nodes
                )
            } else {
                "kube-scheduler and kube-controller-manager running throughout".into()
            },
            format!("label: {}", if args.label.is_empty() { "—" } else { &args.label }),
            format!(
                "controller publishes the memory counter (--keep-memory-counter): {}",
                args.keep_memory_counter
            ),
            format!("cluster logs: {}", logs.display()),
        ],
    };
    let table = render(&context, &rows);
    println!("{table}");
    std::fs::create_dir_all(&out_dir)?;
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let file = out_dir.join(format!("bench-{stamp}.md"));
    std::fs::write(
        &file,
        format!("{table}\n\n## B7 simulation output\n\n```\n{appendix}```\n"),
    )?;
    eprintln!("written to {}", file.display());
    result
}

fn concurrency_text(c: usize) -> String {
    if c == 0 {
        "every pool at once".into()
    } else {
        format!("{c} pools at a time")
    }
}

fn jiff_now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%d %H:%M")
        .to_string()
}

async fn run(args: &Args, cluster: &mut Cluster, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    if args.runs(Measure::B4) || args.runs(Measure::B5) || args.runs(Measure::B6) {
        eprintln!("B4/B5/B6: the real node");
        match measure::node::run(cluster, args.b5_pods, args.b4_extra_pods).await {
            Ok(r) => rows.extend(r.rows),
            Err(e) => rows.push(failed_row("B5", "real-node measures (B4, B5, B6 plugin)", &e)),
        }
    }
    let heartbeat = Heartbeat::new(DRIVER, CHART_NAMESPACE, args.heartbeat_interval_seconds);
    let identities =
        (args.plugin_identity == PluginIdentity::ServiceAccount).then(|| cluster.plugin_identities());
    let mut fleet = Fleet::new(cluster.client.clone(), identities, heartbeat.clone());
    let sorted = |mut sizes: Vec<usize>| {
        sizes.sort_unstable();
        sizes.dedup();
        sizes
    };
    let b1_sizes = if args.runs(Measure::B1) {
        sorted(args.b1_nodes.clone())
    } else {
        Vec::new()
    };
    let controller_sizes = if args.runs(Measure::B2) || args.runs(Measure::B3) || args.runs(Measure::B6) {
        sorted(args.nodes.clone())
    } else {
        Vec::new()
    };
    let before = if args.after_bin_dir.is_some() {
        "before"
    } else {
        ""
    };
    // The fleet only grows: at each size, B1 (the scheduler over the pools), then the
    // controller measures.
    for n in sorted([b1_sizes.clone(), controller_sizes.clone()].concat()) {
        if b1_sizes.contains(&n) {
            scheduling(args, cluster, &mut fleet, n, rows).await?;
        }
        if controller_sizes.contains(&n) {
            controller_measures(args, cluster, &mut fleet, rows, before, args.floor_concurrency, n).await?;
        }
    }
    if let Some(dir) = &args.after_bin_dir {
        eprintln!("switching to the controller in {}", dir.display());
        cluster.layout.migdra_bin = dir.clone();
        for n in controller_sizes {
            controller_measures(
                args,
                cluster,
                &mut fleet,
                rows,
                "after",
                args.after_floor_concurrency,
                n,
            )
            .await?;
        }
    }
    fleet.stop().await;
    Ok(())
}

/// B1 over `n` simulated nodes.
async fn scheduling(
    args: &Args,
    cluster: &mut Cluster,
    fleet: &mut Fleet,
    n: usize,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    eprintln!("B1: {n} simulated nodes, {} pods per phase", args.b1_pods);
    fleet.grow_to(n, args.concurrency).await?;
    wait_pools(cluster, fleet).await?;
    let nodes: Vec<String> = fleet.node_names().into_iter().take(n).collect();
    let scheduler = scheduler_metrics_client(cluster)
        .await
        .map_err(|e| eprintln!("the scheduler's /metrics will not be read: {e:#}"))
        .ok();
    let profiles = (args.scheduler_profile_seconds > 0)
        .then(|| args.out_dir().map(|dir| (args.scheduler_profile_seconds, dir)))
        .transpose()?;
    match measure::scheduling::run(
        cluster,
        scheduler.as_ref(),
        &nodes,
        args.b1_pods,
        args.concurrency,
        &args.b1_order,
        profiles,
    )
    .await
    {
        Ok(r) => rows.extend(r),
        Err(e) => rows.push(failed_row(
            "B1",
            &format!("scheduling throughput at {n} nodes"),
            &e,
        )),
    }
    Ok(())
}

/// A client that may read the scheduler's `/metrics`.
async fn scheduler_metrics_client(cluster: &Cluster) -> anyhow::Result<kube::Client> {
    let port = cluster.allocated_port("scheduler").context("no scheduler port")?;
    probe::component_client(&cluster.layout.kubeconfig, port).await
}

/// B2, B3 and B6 (controller) at `n` nodes; `label` marks the rows (before/after).
async fn controller_measures(
    args: &Args,
    cluster: &mut Cluster,
    fleet: &mut Fleet,
    rows: &mut Vec<Row>,
    label: &str,
    floor_concurrency: usize,
    n: usize,
) -> anyhow::Result<()> {
    eprintln!("B2/B3/B6 {label}: {n} simulated nodes");
    if n > args.upstream_controllers_max_nodes {
        eprintln!(
            "stopping kube-scheduler and kube-controller-manager for the rest of the run \
             (above {} nodes, BENCH_UPSTREAM_CONTROLLERS_MAX_NODES)",
            args.upstream_controllers_max_nodes
        );
        cluster.stop("kube-scheduler", Duration::from_secs(10));
        cluster.stop("kube-controller-manager", Duration::from_secs(10));
    }
    let before_growth = fleet.len();
    fleet.grow_to(n, args.concurrency).await?;
    let measured = measure::publish::run(
        cluster,
        fleet,
        fleet.len() > before_growth,
        Duration::from_secs(args.steady_seconds),
        floor_concurrency,
        args.floor_max_nodes,
    )
    .await;
    match measured {
        Ok(r) => rows.extend(r.rows.into_iter().map(|mut row| {
            if !label.is_empty() {
                row.measure = format!("**{label}**: {}", row.measure);
            }
            row
        })),
        Err(e) => rows.push(failed_row(
            "B2",
            &format!("controller at {n} nodes ({label})"),
            &e,
        )),
    }
    Ok(())
}

/// Waits until the controller published a pool for every simulated node.
async fn wait_pools(cluster: &Cluster, fleet: &Fleet) -> anyhow::Result<()> {
    use k8s_openapi::api::resource::v1::ResourceSlice;
    let slices: kube::Api<ResourceSlice> = kube::Api::all(cluster.client.clone());
    let wanted: std::collections::BTreeSet<String> = fleet.node_names().into_iter().collect();
    migdra_e2e::cluster::wait_until(Duration::from_secs(120 + fleet.len() as u64), || async {
        let list = slices
            .list_metadata(&kube::api::ListParams::default().fields(&format!("spec.driver={DRIVER}")))
            .await
            .ok()?;
        // Slice names start with the node name (the controller's naming).
        let published = wanted
            .iter()
            .filter(|n| {
                list.items.iter().any(|s| {
                    s.metadata
                        .name
                        .as_deref()
                        .is_some_and(|name| name.starts_with(&format!("{n}-")))
                })
            })
            .count();
        (published == wanted.len()).then_some(())
    })
    .await
    .context("the controller did not publish every simulated node's pool")
}
