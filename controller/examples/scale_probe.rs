//! Scale probe: one controller binary against an API server with many simulated 8×H100 nodes.
//!
//! Starts etcd and kube-apiserver from the cached upstream binaries (nothing else: no
//! scheduler, no kubelet), installs the CRDs, creates `--nodes` Node objects with their
//! GpuNodes (the plugin's schema, 8 healthy H100s each) and, in `lease` mode, their heartbeat
//! Leases, then starts the controller binary and measures:
//!
//! * cold publish: time from the controller's start until it created every slice of every
//!   pool (its own `slice_writes_total{operation="create"}`);
//! * steady state with live heartbeats (every `--interval-seconds`, spread evenly): CPU
//!   share of one core and slice writes over `--steady-seconds`; RSS and peak RSS;
//! * a no-op resync: the controller restarted against the published pools, slice writes in
//!   its first `--resync-seconds`.
//!
//! Heartbeat modes: `lease` (this version's plugin: Lease renewals, a GpuNode status write
//! every 300 s) and `gpunode` (older plugins: a GpuNode status write every beat).
//!
//! `cargo run -p migdra-controller --example scale_probe -- --controller target/debug/migdra-controller`

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use clap::{Parser, ValueEnum};
use futures::{StreamExt, stream};
use k8s_openapi::{
    api::{
        coordination::v1::Lease,
        core::v1::{Namespace, Node},
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    jiff::Timestamp,
};
use kube::{
    Api, Client, CustomResourceExt,
    api::{Patch, PatchParams, PostParams},
};
use migdra_api::{
    catalog,
    inventory::{GpuNode, MigInventory, heartbeat_lease_name},
    policy::{EffectivePolicy, MigPolicy},
    slices::published_plan,
};
use serde_json::json;

const DRIVER: &str = "gpu.migdra.dev";
const NAMESPACE: &str = "migdra-system";
const TOKEN: &str = "scale-probe-admin";
const PLUGIN_MANAGER: &str = "migdra-kubelet-plugin";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Heartbeat {
    /// Lease renewals every interval, GpuNode status every 300 s (this version's plugin).
    Lease,
    /// GpuNode status every interval (plugins before the Lease).
    Gpunode,
}

#[derive(Debug, Parser)]
struct Args {
    /// Simulated 8×H100 nodes.
    #[arg(long, default_value_t = 500)]
    nodes: usize,
    /// The controller binary to measure.
    #[arg(long)]
    controller: PathBuf,
    /// How the simulated plugins heartbeat.
    #[arg(long, value_enum, default_value = "lease")]
    heartbeat: Heartbeat,
    /// Seconds between heartbeats of one node.
    #[arg(long, default_value_t = 15)]
    interval_seconds: u64,
    /// Seconds of steady state measured.
    #[arg(long, default_value_t = 120)]
    steady_seconds: u64,
    /// Seconds the restarted controller gets for its no-op resync.
    #[arg(long, default_value_t = 60)]
    resync_seconds: u64,
    /// Concurrent requests while creating the simulated nodes.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Directory of etcd and kube-apiserver (default: the newest under ~/.cache/migdra/upstream).
    #[arg(long)]
    upstream_bin: Option<PathBuf>,
    /// Working directory (etcd data, logs); removed at the end.
    #[arg(long, default_value = "target/scale-probe")]
    work_dir: PathBuf,
}

/// Processes this probe started, killed on drop.
struct Processes(Vec<(String, Child)>);

impl Drop for Processes {
    fn drop(&mut self) {
        for (name, child) in self.0.iter_mut().rev() {
            if child.kill().is_ok() {
                let _ = child.wait();
            }
            eprintln!("stopped {name}");
        }
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn spawn(name: &str, bin: &Path, args: &[String], logs: &Path) -> anyhow::Result<Child> {
    let log = std::fs::File::create(logs.join(format!("{name}.log")))?;
    Command::new(bin)
        .args(args)
        .stdout(log.try_clone()?)
        .stderr(log)
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))
}

fn upstream_bin(arg: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(dir) = arg {
        return Ok(dir);
    }
    let home = std::env::var("HOME").context("HOME")?;
    let base = PathBuf::from(home).join(".cache/migdra/upstream");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&base)
        .with_context(|| format!("reading {}", base.display()))?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|p| p.join("kube-apiserver").exists())
        .collect();
    dirs.sort();
    dirs.pop().context("no cached upstream binaries")
}

/// (utime + stime in clock ticks, VmRSS KiB, VmHWM KiB) of `pid`.
fn usage(pid: u32) -> anyhow::Result<(u64, u64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = stat.rsplit_once(')').context("stat format")?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib = |key: &str| -> u64 {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    Ok((ticks, kib("VmRSS:"), kib("VmHWM:")))
}

/// Slice writes by operation from the controller's metrics.
async fn writes(http: &reqwest_lite::Http, port: u16) -> [u64; 3] {
    let text = http.get(port, "/metrics").await.unwrap_or_default();
    let value = |op: &str| -> u64 {
        let key = format!("migdra_controller_slice_writes_total{{operation=\"{op}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&key))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .map_or(0, |v| v as u64)
    };
    [value("create"), value("update"), value("delete")]
}

/// A minimal HTTP/1.0 GET over loopback (the metrics endpoint), without another dependency.
mod reqwest_lite {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    pub struct Http;

    impl Http {
        pub async fn get(&self, port: u16, path: &str) -> std::io::Result<String> {
            let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
            stream
                .write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
                .await?;
            let mut body = String::new();
            stream.read_to_string(&mut body).await?;
            Ok(body)
        }
    }
}

fn controller_args(kubeconfig: &Path, port: u16) -> Vec<String> {
    vec![
        format!("--kubeconfig={}", kubeconfig.display()),
        "--leader-elect=false".into(),
        format!("--namespace={NAMESPACE}"),
        format!("--http-address=127.0.0.1:{port}"),
        "--log-level=warn,migdra_controller=info".into(),
    ]
}

fn gpunode_status(node: &str, heartbeat: Heartbeat, interval: u64) -> serde_json::Value {
    let model = catalog::model("H100-80GB").expect("the catalog has the H100");
    let gpus: Vec<_> = (0..8)
        .map(|minor| {
            let mut gpu = model.inventory(minor, true);
            gpu.uuid = format!("GPU-{node}-{minor}");
            if let Some(MigInventory { enabled, .. }) = gpu.mig.as_mut() {
                *enabled = true;
            }
            gpu
        })
        .collect();
    let announced = match heartbeat {
        Heartbeat::Lease => 300,
        Heartbeat::Gpunode => interval,
    };
    let now = Timestamp::now().to_string();
    json!({
        "apiVersion": "gpu.migdra.dev/v1alpha1", "kind": "GpuNode",
        "status": {
            "plugin": {
                "version": "0.1.0", "registered": true, "startTime": now, "heartbeatTime": now,
                "heartbeatIntervalSeconds": announced, "driverVersion": "580.82.07",
            },
            "gpus": gpus,
        },
    })
}

async fn create_node(client: &Client, name: &str, args: &Args) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.present": "true"}},
        "status": {"capacity": {"cpu": "96", "memory": "1Ti", "pods": "110"}},
    }))?;
    let node = nodes.create(&PostParams::default(), &node).await?;
    let uid = node.metadata.uid.clone().unwrap_or_default();
    let owner = json!([{"apiVersion": "v1", "kind": "Node", "name": name, "uid": uid}]);
    let gpunodes: Api<GpuNode> = Api::all(client.clone());
    let apply = PatchParams::apply(PLUGIN_MANAGER).force();
    gpunodes
        .patch(
            name,
            &apply,
            &Patch::Apply(json!({
                "apiVersion": "gpu.migdra.dev/v1alpha1", "kind": "GpuNode",
                "metadata": {"name": name, "ownerReferences": owner},
                "spec": {"nodeName": name, "driver": DRIVER},
            })),
        )
        .await?;
    gpunodes
        .patch_status(
            name,
            &apply,
            &Patch::Apply(gpunode_status(name, args.heartbeat, args.interval_seconds)),
        )
        .await?;
    if args.heartbeat == Heartbeat::Lease {
        renew_lease(client, name, true).await?;
    }
    Ok(())
}

async fn renew_lease(client: &Client, node: &str, create: bool) -> anyhow::Result<()> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), NAMESPACE);
    let name = heartbeat_lease_name(node, DRIVER).context("lease name")?;
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(Timestamp::now());
    if create {
        leases
            .patch(
                &name,
                &PatchParams::apply(PLUGIN_MANAGER).force(),
                &Patch::Apply(json!({
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": name, "labels": {"gpu.migdra.dev/heartbeat": DRIVER}},
                    "spec": {"holderIdentity": node, "leaseDurationSeconds": 23,
                             "acquireTime": now, "renewTime": now},
                })),
            )
            .await?;
    } else {
        leases
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"renewTime": now}})),
            )
            .await?;
    }
    Ok(())
}

async fn gpunode_beat(client: &Client, node: &str) -> anyhow::Result<()> {
    let gpunodes: Api<GpuNode> = Api::all(client.clone());
    gpunodes
        .patch_status(
            node,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"plugin": {"heartbeatTime": Timestamp::now().to_string()}}})),
        )
        .await?;
    Ok(())
}

/// Keeps every node's heartbeat going, spread evenly over the interval, until dropped.
fn heartbeats(
    client: Client,
    names: Arc<Vec<String>>,
    mode: Heartbeat,
    interval: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let gpunode_every = match mode {
            Heartbeat::Lease => Duration::from_secs(300),
            Heartbeat::Gpunode => interval,
        };
        let step = interval / u32::try_from(names.len().max(1)).unwrap_or(u32::MAX);
        let mut last_gpunode = vec![Instant::now(); names.len()];
        let mut ticker = tokio::time::interval(step.max(Duration::from_micros(100)));
        let mut i = 0usize;
        loop {
            ticker.tick().await;
            let node = names[i].clone();
            let client = client.clone();
            let gpunode_due = last_gpunode[i].elapsed() >= gpunode_every;
            if gpunode_due {
                last_gpunode[i] = Instant::now();
            }
            tokio::spawn(async move {
                let result = if gpunode_due {
                    gpunode_beat(&client, &node).await
                } else {
                    Ok(())
                };
                let result = match (result, mode) {
                    (Ok(()), Heartbeat::Lease) => renew_lease(&client, &node, false).await,
                    (other, _) => other,
                };
                if let Err(e) = result {
                    eprintln!("heartbeat of {node} failed: {e:#}");
                }
            });
            i = (i + 1) % names.len();
        }
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let bin = upstream_bin(args.upstream_bin.clone())?;
    let work = std::path::absolute(&args.work_dir)?;
    let _ = std::fs::remove_dir_all(&work);
    let logs = work.join("logs");
    std::fs::create_dir_all(&logs)?;
    let mut procs = Processes(Vec::new());

    // etcd and kube-apiserver.
    let (etcd_port, peer_port, api_port) = (free_port()?, free_port()?, free_port()?);
    let etcd_args: Vec<String> = vec![
        "--name=probe".into(),
        format!("--data-dir={}", work.join("etcd").display()),
        format!("--listen-client-urls=http://127.0.0.1:{etcd_port}"),
        format!("--advertise-client-urls=http://127.0.0.1:{etcd_port}"),
        format!("--listen-peer-urls=http://127.0.0.1:{peer_port}"),
        format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}"),
        format!("--initial-cluster=probe=http://127.0.0.1:{peer_port}"),
        "--listen-metrics-urls=".into(),
        "--quota-backend-bytes=8589934592".into(),
        "--unsafe-no-fsync".into(),
    ];
    procs.0.push((
        "etcd".into(),
        spawn("etcd", &bin.join("etcd"), &etcd_args, &logs)?,
    ));
    let status = Command::new("openssl")
        .args(["genrsa", "-out"])
        .arg(work.join("sa.key"))
        .arg("2048")
        .stderr(Stdio::null())
        .status()?;
    if !status.success() {
        bail!("openssl genrsa failed");
    }
    std::fs::write(
        work.join("tokens.csv"),
        format!("{TOKEN},admin,admin,system:masters\n"),
    )?;
    let sa_key = work.join("sa.key").display().to_string();
    let api_args: Vec<String> = vec![
        format!("--etcd-servers=http://127.0.0.1:{etcd_port}"),
        format!("--secure-port={api_port}"),
        "--bind-address=127.0.0.1".into(),
        "--advertise-address=127.0.0.1".into(),
        format!("--cert-dir={}", work.join("certs").display()),
        format!("--token-auth-file={}", work.join("tokens.csv").display()),
        "--anonymous-auth=false".into(),
        "--authorization-mode=RBAC".into(),
        format!("--service-account-key-file={sa_key}"),
        format!("--service-account-signing-key-file={sa_key}"),
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
        "--service-cluster-ip-range=10.96.0.0/16".into(),
        "--endpoint-reconciler-type=none".into(),
        "--feature-gates=DRAPartitionableDevices=true,DRADeviceTaints=true".into(),
        "--max-requests-inflight=800".into(),
        "--max-mutating-requests-inflight=400".into(),
    ];
    procs.0.push((
        "kube-apiserver".into(),
        spawn("kube-apiserver", &bin.join("kube-apiserver"), &api_args, &logs)?,
    ));
    let kubeconfig = work.join("admin.kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: p\n  cluster:\n    server: https://127.0.0.1:{api_port}\n    insecure-skip-tls-verify: true\nusers:\n- name: p\n  user:\n    token: {TOKEN}\ncontexts:\n- name: p\n  context:\n    cluster: p\n    user: p\ncurrent-context: p\n"
        ),
    )?;
    let client = migdra_runtime::kube_client(Some(&kubeconfig)).await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let req = http::Request::get("/readyz").body(Vec::new())?;
        if client.request_text(req).await.is_ok_and(|b| b.trim() == "ok") {
            break;
        }
        if Instant::now() > deadline {
            bail!("kube-apiserver not ready; see {}", logs.display());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!("API server ready");

    // CRDs and the namespace.
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in [GpuNode::crd(), MigPolicy::crd()] {
        crds.create(&PostParams::default(), &crd).await?;
    }
    for _ in 0..120 {
        let gpunodes: Api<GpuNode> = Api::all(client.clone());
        let policies: Api<MigPolicy> = Api::all(client.clone());
        if gpunodes.list(&Default::default()).await.is_ok()
            && policies.list(&Default::default()).await.is_ok()
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": NAMESPACE}}))?,
        )
        .await?;

    // The simulated nodes.
    let names: Arc<Vec<String>> = Arc::new((0..args.nodes).map(|i| format!("sim-node-{i:05}")).collect());
    let started = Instant::now();
    let results: Vec<anyhow::Result<()>> = stream::iter(names.iter())
        .map(|name| create_node(&client, name, &args))
        .buffer_unordered(args.concurrency)
        .collect()
        .await;
    for r in results {
        r?;
    }
    eprintln!(
        "{} simulated nodes created in {:.1?}",
        args.nodes,
        started.elapsed()
    );
    let model = catalog::model("H100-80GB").context("H100")?;
    let gpus: Vec<_> = (0..8).map(|m| model.inventory(m, true)).collect();
    let per_node = published_plan(&gpus, &EffectivePolicy::default(), &Default::default())
        .0
        .slice_count() as u64;
    let expected = per_node * args.nodes as u64;

    // Cold publish.
    let http = reqwest_lite::Http;
    let beats = heartbeats(
        client.clone(),
        names.clone(),
        args.heartbeat,
        Duration::from_secs(args.interval_seconds),
    );
    let port = free_port()?;
    let start = Instant::now();
    let mut controller = spawn(
        "controller",
        &args.controller,
        &controller_args(&kubeconfig, port),
        &logs,
    )?;
    let pid = controller.id();
    let cold = loop {
        let [create, _, _] = writes(&http, port).await;
        if create >= expected {
            break start.elapsed();
        }
        if start.elapsed() > Duration::from_secs(3600) {
            bail!("cold publish did not finish: {create} of {expected} slices");
        }
        if let Some(status) = controller.try_wait()? {
            bail!("controller exited: {status}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let after_cold = writes(&http, port).await;
    eprintln!("cold publish: {expected} slices in {cold:.1?} ({after_cold:?} create/update/delete)");

    // Steady state.
    tokio::time::sleep(Duration::from_secs(30)).await;
    let (t0, _, _) = usage(pid)?;
    let w0 = writes(&http, port).await;
    let clock = Instant::now();
    tokio::time::sleep(Duration::from_secs(args.steady_seconds)).await;
    let (t1, rss, hwm) = usage(pid)?;
    let w1 = writes(&http, port).await;
    let secs = clock.elapsed().as_secs_f64();
    // SAFETY-free: clock ticks per second are 100 on Linux for /proc/<pid>/stat.
    let cpu = (t1 - t0) as f64 / 100.0 / secs * 100.0;
    let steady_writes: u64 = w1.iter().zip(w0.iter()).map(|(a, b)| a - b).sum();
    let _ = controller.kill();
    let _ = controller.wait();

    // No-op resync.
    let port = free_port()?;
    let mut restarted = spawn(
        "controller-restart",
        &args.controller,
        &controller_args(&kubeconfig, port),
        &logs,
    )?;
    tokio::time::sleep(Duration::from_secs(args.resync_seconds)).await;
    let resync = writes(&http, port).await;
    let (_, rss_restart, _) = usage(restarted.id())?;
    let _ = restarted.kill();
    let _ = restarted.wait();
    beats.abort();

    println!(
        "| nodes | heartbeat | cold publish | slices | controller RSS (peak) | steady CPU | steady slice writes | no-op resync writes (c/u/d) | RSS after resync |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    println!(
        "| {} | {:?} every {} s | {:.1} s | {} | {:.0} MiB ({:.0} MiB) | {:.1}% of a core over {:.0} s | {} | {}/{}/{} | {:.0} MiB |",
        args.nodes,
        args.heartbeat,
        args.interval_seconds,
        cold.as_secs_f64(),
        expected,
        rss as f64 / 1024.0,
        hwm as f64 / 1024.0,
        cpu,
        secs,
        steady_writes,
        resync[0],
        resync[1],
        resync[2],
        rss_restart as f64 / 1024.0,
    );
    println!("controller: {}", args.controller.display());
    drop(procs);
    let _ = std::fs::remove_dir_all(work.join("etcd"));
    Ok(())
}
