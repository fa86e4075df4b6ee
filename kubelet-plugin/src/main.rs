//! `migdra-kubelet-plugin`: the node half of migdra.

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use anyhow::Context;
use clap::Parser;
use migdra_api::inventory::DEFAULT_DRIVER_NAME;
use migdra_kubelet_plugin::{
    cdi::CdiWriter,
    checkpoint,
    claims::KubeClaims,
    driver::{Driver, DriverConfig},
    grpc::{
        RegistrationState,
        server::{PluginServer, PluginServerConfig},
    },
    metrics::Metrics,
    node_status::{self, NodeStatusWriter},
    nvml::NvmlBackend,
};
use migdra_runtime::{LogFormat, Readiness};
use tokio::sync::watch;

/// migdra kubelet plugin: creates the MIG instance of each allocated ResourceClaim on this
/// node, hands it to containers through CDI, and destroys it once the pod is gone.
#[derive(Debug, Parser)]
#[command(name = "migdra-kubelet-plugin", version)]
struct Args {
    /// Name of this node (from the downward API in a DaemonSet).
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// DRA driver name; must match the DeviceClasses and the controller.
    #[arg(long, env = "DRIVER_NAME", default_value = DEFAULT_DRIVER_NAME)]
    driver_name: String,
    /// The kubelet's root directory (sockets go under plugins/ and plugins_registry/).
    #[arg(long, env = "KUBELET_ROOT_DIR", default_value = "/var/lib/kubelet")]
    kubelet_root_dir: PathBuf,
    /// Directory for per-claim CDI specs (the runtime's dynamic CDI directory).
    #[arg(long, env = "CDI_ROOT", default_value = "/var/run/cdi")]
    cdi_dir: PathBuf,
    /// Path of libnvidia-ml.so (default: the loader's search path).
    #[arg(long, env = "NVML_LIB_PATH")]
    nvml_lib_path: Option<PathBuf>,
    /// Directory of the checkpoint and lock file (default: <kubelet-root-dir>/plugins/<driver>).
    #[arg(long, env = "STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// Where /proc is (for /proc/devices and the MIG capability files).
    #[arg(long, env = "PROC_ROOT", default_value = "/proc")]
    proc_root: PathBuf,
    /// File holding the kernel boot ID.
    #[arg(long, env = "BOOT_ID_PATH", default_value = "/proc/sys/kernel/random/boot_id")]
    boot_id_path: PathBuf,
    /// Kubeconfig file (default: in-cluster configuration, or $KUBECONFIG).
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Log format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value = "text")]
    log_format: LogFormat,
    /// Log filter, RUST_LOG syntax.
    #[arg(long, env = "LOG_LEVEL", default_value = "info")]
    log_level: String,
    /// Address of the HTTP endpoint (/metrics, /healthz, /readyz).
    #[arg(long, env = "HTTP_ADDRESS", default_value = "0.0.0.0:8080")]
    http_address: SocketAddr,
    /// Address of the gRPC health endpoint (grpc.health.v1) for kubelet gRPC probes.
    #[arg(long, env = "GRPC_HEALTH_ADDRESS", default_value = "0.0.0.0:51515")]
    grpc_health_address: SocketAddr,
    /// Seconds between inventory refreshes and GpuNode heartbeats.
    #[arg(long, env = "HEARTBEAT_INTERVAL_SECONDS", default_value_t = 15)]
    heartbeat_interval_seconds: u64,
    /// Seconds between full re-sends of the device health list to the kubelet.
    #[arg(long, env = "HEALTH_RESEND_INTERVAL_SECONDS", default_value_t = 10)]
    health_resend_interval_seconds: u64,
    /// Seconds a call waits for the node lock held by another plugin instance.
    #[arg(long, env = "LOCK_TIMEOUT_SECONDS", default_value_t = 30)]
    lock_timeout_seconds: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    migdra_runtime::init_logging(args.log_format, &args.log_level)
        .map_err(|e| anyhow::anyhow!("setting up logging: {e}"))?;
    tracing::info!(version = env!("CARGO_PKG_VERSION"), node = %args.node_name, driver = %args.driver_name, "starting");
    let shutdown = migdra_runtime::shutdown_on_signals().context("installing signal handlers")?;

    let metrics = Metrics::new();
    let ready = Readiness::default();
    let renderer = {
        let metrics = metrics.clone();
        Arc::new(move || metrics.encode())
    };
    let (http_addr, http_task) =
        migdra_runtime::serve_http(args.http_address, renderer, ready.clone(), shutdown.clone())
            .await
            .context("starting the HTTP endpoint")?;
    tracing::info!(%http_addr, "serving metrics and probes");
    let (grpc_health, grpc_health_service) = tonic_health::server::health_reporter();
    grpc_health
        .set_service_status("", tonic_health::ServingStatus::NotServing)
        .await;
    let grpc_health_task = {
        let shutdown = shutdown.clone();
        let addr = args.grpc_health_address;
        tokio::spawn(async move {
            let result = tonic::transport::Server::builder()
                .add_service(grpc_health_service)
                .serve_with_shutdown(addr, shutdown.cancelled_owned())
                .await;
            if let Err(e) = result {
                tracing::error!(%addr, error = %e, "gRPC health endpoint failed");
            }
        })
    };

    let client = migdra_runtime::kube_client(args.kubeconfig.as_deref()).await?;

    let state_dir = args
        .state_dir
        .clone()
        .unwrap_or_else(|| args.kubelet_root_dir.join("plugins").join(&args.driver_name));
    let boot_id = checkpoint::read_boot_id(&args.boot_id_path)?;
    let backend = {
        let path = args.nvml_lib_path.clone();
        tokio::task::spawn_blocking(move || NvmlBackend::new(path.as_deref()))
            .await?
            .context("loading NVML")?
    };
    let config = DriverConfig {
        driver_name: args.driver_name.clone(),
        node_name: args.node_name.clone(),
        state_dir,
        boot_id,
        lock_timeout: Duration::from_secs(args.lock_timeout_seconds),
    };
    let cdi = CdiWriter::new(&args.cdi_dir, &args.driver_name, &args.proc_root);
    let (driver, report) = {
        let claims = KubeClaims::new(client.clone());
        let metrics = metrics.clone();
        tokio::task::spawn_blocking(move || {
            Driver::start(config, Arc::new(backend), claims, cdi, None, metrics)
        })
        .await?
        .context("starting the driver")?
    };
    tracing::info!(?report, pool = driver.pool(), "driver ready");

    // The health list starts from a first inventory, so the kubelet never sees an empty one.
    let first = {
        let driver = driver.clone();
        tokio::task::spawn_blocking(move || driver.inventory())
            .await?
            .context("first GPU inventory")?
    };
    let (health_tx, health_rx) = watch::channel(driver.device_health(&first));
    let (registration_tx, registration_rx) = watch::channel(RegistrationState::default());
    let heartbeat = Duration::from_secs(args.heartbeat_interval_seconds.max(1));
    let writer = NodeStatusWriter::new(client, &args.node_name, &args.driver_name, heartbeat);
    let status_task = tokio::spawn(node_status::run(
        driver.clone(),
        Some(writer),
        report,
        registration_rx.clone(),
        health_tx,
        heartbeat,
        shutdown.clone(),
    ));

    let mut server_config = PluginServerConfig::new(&args.kubelet_root_dir, &args.driver_name);
    server_config.health_resend_interval = Duration::from_secs(args.health_resend_interval_seconds.max(1));
    let server = PluginServer::new(server_config, Arc::new(driver), health_rx, registration_tx);
    let serving = server
        .serve_dra(shutdown.clone())
        .await
        .context("serving the DRA socket")?;
    let serving = serving
        .register()
        .await
        .context("creating the registration socket")?;
    ready.set(true);
    grpc_health
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    tracing::info!("serving the kubelet");
    let served = serving.wait().await;
    ready.set(false);
    if let Err(e) = status_task.await {
        tracing::warn!(error = %e, "status task failed");
    }
    shutdown.cancel();
    let _ = tokio::join!(http_task, grpc_health_task);
    served.context("kubelet gRPC servers")?;
    tracing::info!("stopped");
    Ok(())
}
