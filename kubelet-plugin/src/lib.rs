//! migdra's kubelet plugin: prepares allocated ResourceClaims by creating the allocated MIG
//! instance, hands it to containers through CDI, and destroys it after the pod is gone.
//!
//! [`cli`] → [`run`] starts everything. The kubelet's gRPC calls (served by [`dra_kubelet`])
//! reach the [`driver`] state machine, which reads claims ([`claims`]), plans placements
//! ([`plan`]), records progress in the [`journal`] ([`checkpoint`] file, written through
//! [`state_dir`]), works on GPUs through the GPU table ([`gpus`], over [`nvml`]) and writes CDI
//! specs ([`cdi`], with the driver's files found by [`driver_files`]). Instances a teardown
//! left on a lost GPU are listed in [`orphans`]. Prepared claims report their devices in their
//! status ([`claim_status`]). The status loop ([`node_status`]) publishes the inventory and
//! device health; [`metrics`] counts what happens; [`events`] records failures on the claim.
//! The `gpu-check` subcommand ([`gpu_check`]) checks a node's GPUs without running the plugin.

pub mod cdi;
pub mod checkpoint;
pub mod claim_status;
pub mod claims;
pub mod cli;
pub mod driver;
pub mod driver_files;
pub mod events;
pub mod gpu_check;
pub mod gpus;
pub mod journal;
pub mod metrics;
pub mod node_status;
pub mod nvml;
pub mod orphans;
pub mod ownership;
pub mod plan;
pub mod state_dir;

use std::{sync::Arc, time::Duration};

use anyhow::Context as _;
use migdra_api::inventory::{GpuInventory, GpuNode};
use migdra_runtime::Process;
use tokio::{
    sync::{mpsc, watch},
    task::JoinHandle,
};
use tokio_util::sync::CancellationToken;

use crate::{
    cdi::{CdiWriter, DriverSetup},
    claims::KubeClaims,
    driver::{Backoff, Driver, DriverConfig, RecoveryEvent, RecoveryReport},
    events::ClaimEvents,
    metrics::Metrics,
    node_status::{HeartbeatLease, NodeStatusWriter, StatusLoop},
    nvml::ReloadingNvml,
};
use dra_kubelet::{PluginServer, PluginServerConfig, PluginServing, RegistrationState};

/// How long an instance joining a running one (a rolling update) waits for the kubelet's
/// registration before it reports status regardless.
const JOIN_REGISTRATION_WAIT: Duration = Duration::from_secs(60);

/// How long after serving the plugin warns that the kubelet has not registered it.
const REGISTRATION_WARNING_AFTER: Duration = Duration::from_secs(60);

/// How long the start waits for this node's GpuNode when recovering a lost checkpoint.
const PUBLISHED_INVENTORY_TIMEOUT: Duration = Duration::from_secs(10);

/// How often claim status writes that failed are retried.
const CLAIM_STATUS_RETRY_INTERVAL: Duration = Duration::from_secs(30);

/// Locks `mutex`, ignoring poisoning: a panic leaves nothing half-written behind (durable
/// state is in files written atomically; the rest is caches and flags).
pub(crate) fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The driver as the plugin runs it: claims come from the API server.
type PluginDriver = Driver<KubeClaims>;

/// Runs the plugin until SIGTERM/SIGINT: metrics and probes, NVML, the driver (with startup
/// recovery), its background loops, the status loop, then the kubelet's DRA and registration
/// sockets; once they are gone, the status loop stops or hands over to another instance.
pub async fn run(args: cli::Args) -> anyhow::Result<()> {
    args.process.init_logging()?;
    tracing::info!(version = env!("CARGO_PKG_VERSION"), node = %args.node_name, driver = %args.driver_name, "starting");
    let metrics = Metrics::for_node(&args.node_name);
    let Process {
        shutdown,
        ready,
        http_task,
    } = {
        let metrics = metrics.clone();
        args.process.start(move || metrics.encode()).await?
    };
    let (grpc_health, grpc_health_task) = serve_grpc_health(&args, &shutdown).await;

    let kube_config = migdra_runtime::kube_config(args.process.kubeconfig.as_deref()).await?;
    let client =
        kube::Client::try_from(kube_config.clone()).map_err(migdra_runtime::KubeClientError::from)?;
    let hook_missing = {
        let (source, host_root, hook_path) = (
            args.nvidia_cdi_hook_source.clone(),
            args.host_root.clone(),
            args.nvidia_cdi_hook_path.clone(),
        );
        tokio::task::spawn_blocking(move || {
            driver_files::ensure_hook(source.as_deref(), &host_root, &hook_path)
        })
        .await?
    };
    let (driver, mut report) = start_driver(&args, KubeClaims::new(client.clone()), metrics).await?;
    if driver.records_lost() {
        let published = published_inventory(&client, &args.node_name).await;
        report.lost_records = driver
            .recover_lost_records(&published)
            .await
            .context("recovering the records of a lost checkpoint")?;
    }
    let mut tasks = vec![http_task, grpc_health_task];
    let node_warnings = hook_missing.map(|note| RecoveryEvent {
        type_: kube::runtime::events::EventType::Warning,
        reason: "CdiHookMissing",
        note,
    });
    let (claim_events, recovery_events) = spawn_background(
        &args,
        (&driver, &report),
        node_warnings,
        client.clone(),
        &shutdown,
        &mut tasks,
    );
    let (registration_tx, registration) = watch::channel(RegistrationState::default());
    let heartbeat_client =
        node_status::heartbeat_client(kube_config).map_err(migdra_runtime::KubeClientError::from)?;
    let lease = HeartbeatLease::new(
        heartbeat_client,
        &args.heartbeat_namespace,
        &args.node_name,
        &args.driver_name,
        args.heartbeat_interval(),
    );
    let writer = NodeStatusWriter::new(client, &args.node_name, &args.driver_name, lease);
    let (status, health) = status_loop(
        &args,
        &driver,
        &report,
        writer,
        (claim_events, recovery_events),
        registration.clone(),
    )
    .await?;

    let mut server_config = PluginServerConfig::new(&args.kubelet_root_dir, &args.driver_name)
        .with_instance(&args.plugin_instance);
    server_config.health_resend_interval = args.health_resend_interval();
    let peer_config = server_config.clone();
    // Joining a running instance (a rolling update): until the kubelet has registered this
    // one, its heartbeat would report the node's plugin unregistered over the other's and
    // the controller would withdraw the pool. So the status loop starts once registered.
    let joining = !peer_config.live_peer_registrations().await.is_empty();
    let driver_gpus = driver.gpus().clone();
    let server = PluginServer::new(server_config, Arc::new(driver), health, registration_tx);
    let serving = serve_kubelet(server, &shutdown).await?;
    ready.set(true);
    grpc_health
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    tasks.push(tokio::spawn(report_readiness(
        grpc_health,
        driver_gpus,
        shutdown.clone(),
    )));
    tracing::info!("serving the kubelet");
    tasks.push(tokio::spawn(warn_while_unregistered(
        registration.clone(),
        peer_config.registration_socket(),
        shutdown.clone(),
    )));
    if joining {
        wait_for_registration(registration, &shutdown).await;
    }
    // Stopped after the sockets are gone, not on the shutdown signal: see `stop_status_loop`.
    let status_stop = CancellationToken::new();
    let status_task = tokio::spawn(status.run(status_stop.clone()));
    let served = serving.wait().await;
    ready.set(false);
    stop_status_loop(&peer_config, status_task, status_stop).await;
    shutdown.cancel();
    futures::future::join_all(tasks).await;
    served.context("kubelet gRPC servers")?;
    tracing::info!("stopped");
    Ok(())
}

/// Serves the gRPC health service until `shutdown`, not serving until the reporter says so.
async fn serve_grpc_health(
    args: &cli::Args,
    shutdown: &CancellationToken,
) -> (tonic_health::server::HealthReporter, JoinHandle<()>) {
    let (reporter, service) = tonic_health::server::health_reporter();
    for service in ["", READINESS_SERVICE] {
        reporter
            .set_service_status(service, tonic_health::ServingStatus::NotServing)
            .await;
    }
    let shutdown = shutdown.clone();
    let addr = args.grpc_health_address;
    let task = tokio::spawn(async move {
        let result = tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_shutdown(addr, shutdown.cancelled_owned())
            .await;
        if let Err(e) = result {
            tracing::error!(%addr, error = %e, "gRPC health endpoint failed");
        }
    });
    (reporter, task)
}

/// The gRPC health service the readiness probe asks for: SERVING while NVML answers on this
/// node, NOT_SERVING while it answers nothing ([`gpus::Gpus::nvml_stuck`]). Liveness asks for
/// the process (service `""`): restarting a plugin stuck in the kernel frees nothing.
pub const READINESS_SERVICE: &str = "ready";

async fn report_readiness(
    reporter: tonic_health::server::HealthReporter,
    gpus: gpus::Gpus,
    shutdown: CancellationToken,
) {
    let mut changes = gpus.nvml_calls().subscribe();
    loop {
        let status = match gpus.nvml_stuck() {
            None => tonic_health::ServingStatus::Serving,
            Some(_) => tonic_health::ServingStatus::NotServing,
        };
        reporter.set_service_status(READINESS_SERVICE, status).await;
        tokio::select! {
            _ = shutdown.cancelled() => return,
            changed = changes.changed() => if changed.is_err() { return },
        }
    }
}

/// Loads NVML and starts the driver, which repairs what a previous run left half done.
async fn start_driver(
    args: &cli::Args,
    claims: KubeClaims,
    metrics: Metrics,
) -> anyhow::Result<(PluginDriver, RecoveryReport)> {
    let boot_id = state_dir::read_boot_id(&args.boot_id_path)?;
    let backend = {
        let path = args.nvml_lib_path.clone().or_else(|| {
            let root = args.resolved_driver_root_mount();
            let found = driver_files::find_nvml_library(&root, driver_files::LibraryArch::HOST);
            match &found {
                Some(path) => tracing::info!(path = %path.display(), "found NVML in the driver root"),
                None => tracing::warn!(
                    driver_root = %root.display(),
                    "no {} in the driver root's library directories; loading it through the loader's search path",
                    driver_files::NVML_LIBRARY
                ),
            }
            found
        });
        tokio::task::spawn_blocking(move || ReloadingNvml::new(path.as_deref()))
            .await?
            .context("loading NVML")?
    };
    let config = DriverConfig {
        driver_name: args.driver_name.clone(),
        node_name: args.node_name.clone(),
        state_dir: args.resolved_state_dir(),
        boot_id,
        lock_timeout: args.lock_timeout(),
        nvml_call_timeout: args.nvml_call_timeout(),
    };
    let kernel_release = driver_files::read_kernel_release(&args.proc_root).unwrap_or_else(|e| {
        tracing::warn!(error = %e, "kernel release unknown; firmware is looked for in the version-independent directories only");
        String::new()
    });
    let driver_setup = DriverSetup {
        driver_root: driver_files::HostDir {
            on_host: args.driver_root.clone(),
            visible_at: args.resolved_driver_root_mount(),
        },
        host_root: args.host_root.clone(),
        hook_path: args.nvidia_cdi_hook_path.clone(),
        dev_root: args.dev_root.clone(),
        kernel_release,
    };
    tracing::info!(?driver_setup, "driver files");
    let cdi = CdiWriter::new(&args.cdi_dir, &args.driver_name, &args.proc_root).with_driver(driver_setup);
    let (driver, report) = tokio::task::spawn_blocking(move || {
        Driver::start(config, Arc::new(backend), claims, cdi, None, metrics)
    })
    .await?
    .context("starting the driver")?;
    tracing::info!(?report, pool = driver.pool(), "driver ready");
    Ok((driver, report))
}

/// The GPU inventory this node's GpuNode status holds (what the plugin last published): empty
/// when there is none or it cannot be read, which leaves the CDI specs as the only evidence.
async fn published_inventory(client: &kube::Client, node: &str) -> Vec<GpuInventory> {
    let api: kube::Api<GpuNode> = kube::Api::all(client.clone());
    match tokio::time::timeout(PUBLISHED_INVENTORY_TIMEOUT, api.get_opt(node)).await {
        Ok(Ok(found)) => found.and_then(|n| n.status?.gpus).unwrap_or_default(),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "cannot read this node's GpuNode; recovering from the CDI specs alone");
            Vec::new()
        }
        Err(_) => {
            tracing::warn!("reading this node's GpuNode timed out; recovering from the CDI specs alone");
            Vec::new()
        }
    }
}

/// Spawns into `tasks` what runs beside the kubelet's calls (and queues `node_warnings` for the
/// GpuNode): the task that writes claim events,
/// the repair of what recovery left pending, the stale-claim GC and the claim status retries.
/// Returns where claim events go and what the repairs report, for the status loop.
fn spawn_background(
    args: &cli::Args,
    (driver, report): (&PluginDriver, &RecoveryReport),
    node_warnings: Option<RecoveryEvent>,
    client: kube::Client,
    shutdown: &CancellationToken,
    tasks: &mut Vec<JoinHandle<()>>,
) -> (ClaimEvents, mpsc::UnboundedReceiver<RecoveryEvent>) {
    // Failed claims become events on the claim, written by their own task (never under a lock).
    let (claim_events, claim_events_rx) = ClaimEvents::channel();
    driver.set_claim_events(claim_events.clone());
    let reporter = kube::runtime::events::Reporter {
        controller: node_status::FIELD_MANAGER.into(),
        instance: Some(args.node_name.clone()),
    };
    let recorder = kube::runtime::events::Recorder::new(client, reporter);
    tasks.push(tokio::spawn(events::publish_claim_events(
        recorder,
        claim_events_rx,
        shutdown.clone(),
    )));
    // Records recovery could not repair keep their GPUs unhealthy and are retried in the
    // background; serving does not wait for them.
    let (recovery_tx, recovery_rx) = mpsc::unbounded_channel();
    // Warnings found at start go to the GpuNode with the recovery events.
    if let Some(event) = node_warnings {
        let _ = recovery_tx.send(event);
    }
    if let Some(event) = RecoveryEvent::pending(report) {
        let _ = recovery_tx.send(event);
    }
    if let Some(lost) = report.lost_records.as_ref().filter(|l| l.acted()) {
        let _ = recovery_tx.send(RecoveryEvent::lost_checkpoint(lost));
    }
    tasks.push(tokio::spawn(driver.clone().run_repair_loop(
        Backoff::default(),
        recovery_tx.clone(),
        shutdown.clone(),
    )));
    // An NVML call that was overdue may still have done its work when it returns: what it
    // left half done is repaired then.
    tasks.push(tokio::spawn(
        driver.clone().run_overdue_reconcile(shutdown.clone()),
    ));
    // Claims deleted while nobody unprepared them release their instances; the first pass
    // runs now, after recovery.
    tasks.push(tokio::spawn(driver.clone().run_stale_claim_gc(
        args.stale_claim_gc_interval(),
        recovery_tx,
        shutdown.clone(),
    )));
    // Claim status writes that failed (API server unreachable, RBAC missing) are retried;
    // the first pass also writes the status of claims a previous run prepared.
    tasks.push(tokio::spawn(
        driver
            .clone()
            .run_claim_status_retries(CLAIM_STATUS_RETRY_INTERVAL, shutdown.clone()),
    ));
    (claim_events, recovery_rx)
}

/// The status loop over the driver's GPU table, and the device health it sends the kubelet.
/// The health list starts from a first inventory, so the kubelet never sees an empty one.
async fn status_loop(
    args: &cli::Args,
    driver: &PluginDriver,
    report: &RecoveryReport,
    writer: NodeStatusWriter,
    (claim_events, recovery_events): (ClaimEvents, mpsc::UnboundedReceiver<RecoveryEvent>),
    registration: watch::Receiver<RegistrationState>,
) -> anyhow::Result<(StatusLoop, watch::Receiver<Vec<dra_kubelet::DeviceHealthReport>>)> {
    let gpus = driver.gpus().clone();
    let first = {
        let gpus = gpus.clone();
        tokio::task::spawn_blocking(move || gpus.inventory())
            .await?
            .context("first GPU inventory")?
    };
    let (health, health_rx) = watch::channel(gpus.device_health(&first));
    let status = StatusLoop {
        gpus,
        writer: Some(writer),
        recovery_note: report.summary(),
        recovery_events: Some(recovery_events),
        registration,
        health,
        interval: args.heartbeat_interval(),
        claim_events,
    };
    Ok((status, health_rx))
}

/// Serves the DRA socket, then registers with the kubelet (never the other way round).
async fn serve_kubelet(
    server: PluginServer<PluginDriver>,
    shutdown: &CancellationToken,
) -> anyhow::Result<PluginServing> {
    let serving = server
        .serve_dra(shutdown.clone())
        .await
        .context("serving the DRA socket")?;
    serving
        .register()
        .await
        .context("creating the registration socket")
}

/// Waits until the kubelet registered this instance, for at most [`JOIN_REGISTRATION_WAIT`].
async fn wait_for_registration(
    mut registration: watch::Receiver<RegistrationState>,
    shutdown: &CancellationToken,
) {
    tracing::info!(
        "another plugin instance serves this node; reporting status once the kubelet registered this one"
    );
    let confirmed = tokio::time::timeout(JOIN_REGISTRATION_WAIT, registration.wait_for(|r| r.registered));
    tokio::select! {
        outcome = confirmed => if outcome.is_err() {
            tracing::warn!("the kubelet did not register this instance in time; reporting status anyway");
        },
        () = shutdown.cancelled() => {}
    }
}

/// Says, once, that the kubelet has not registered the plugin [`REGISTRATION_WARNING_AFTER`]
/// after its registration socket appeared. A kubelet that runs does so within seconds; when it
/// never does, the socket is almost always where the kubelet does not look (a
/// `kubeletRootDir` that is not the kubelet's `--root-dir`, or its `plugins_registry` not
/// mounted into the container at that path), and the node's pool stays unpublished.
async fn warn_while_unregistered(
    mut registration: watch::Receiver<RegistrationState>,
    socket: std::path::PathBuf,
    shutdown: CancellationToken,
) {
    let registered = tokio::select! {
        outcome = tokio::time::timeout(
            REGISTRATION_WARNING_AFTER,
            registration.wait_for(|r| r.registered),
        ) => outcome.is_ok(),
        () = shutdown.cancelled() => return,
    };
    if !registered {
        let error = registration.borrow().error.clone();
        tracing::warn!(
            socket = %socket.display(),
            kubelet_error = error.as_deref().unwrap_or("none"),
            "the kubelet has not registered the plugin {}s after its registration socket appeared; \
             the kubelet looks for it in <its --root-dir>/plugins_registry on the host: check that \
             kubeletRootDir is the kubelet's root dir and that this directory is the host's (mounted \
             into the plugin container at the same path). Until then the node's pool is not published",
            REGISTRATION_WARNING_AFTER.as_secs()
        );
    }
}

/// A stopping plugin normally reports itself unregistered, so the controller withdraws the
/// pool at once. In a rolling update another instance is still registered and serving: then
/// this one just stops reporting (aborting the status task stops its Lease renewals too), or
/// the pool would vanish for a heartbeat interval.
async fn stop_status_loop(
    peer_config: &PluginServerConfig,
    status_task: JoinHandle<()>,
    status_stop: CancellationToken,
) {
    let peers = peer_config.live_peer_registrations().await;
    if peers.is_empty() {
        status_stop.cancel();
        if let Err(e) = status_task.await {
            tracing::warn!(error = %e, "status task failed");
        }
    } else {
        tracing::info!(
            ?peers,
            "another plugin instance serves this node; handing over without reporting unregistered"
        );
        status_task.abort();
    }
}
