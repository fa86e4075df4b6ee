//! migdra-controller: turns every live node's GpuNode inventory, under the MigPolicy that
//! selects it, into the node's ResourceSlice pool, and withdraws the pool when the node's
//! kubelet plugin goes away.
//!
//! Data flow: [`cli`] → [`leader`] (only the lease holder runs) → [`controller`] (watches and
//! caches; [`geometry_cache`] keeps the GpuNode cache small) → [`reconcile`] per GpuNode: [`liveness`] → [`desired`] (policy, plan, keep the
//! devices [`claims`] hold, render, validate) → [`compare`] (semantic diff) → [`publish`] (slice writes, recorded in
//! [`expectations`]) → [`status`].

pub mod claims;
pub mod cli;
pub mod compare;
pub mod context;
pub mod controller;
pub mod crds;
pub mod desired;
pub mod error;
pub mod expectations;
pub mod geometry_cache;
pub mod lag_windows;
pub mod leader;
pub mod liveness;
pub mod metrics;
pub mod naming;
pub mod publish;
pub mod reconcile;
pub mod status;

use std::{sync::Arc, time::Duration};

use anyhow::Context as _;
use migdra_runtime::Readiness;

pub use error::{Error, Result};

/// How long a reconciliation waits for the caches after start.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// Heartbeat expiry alone withdraws at most one pool per this interval (the node lifecycle
/// controller's default eviction rate, 0.1 nodes/s).
const EXPIRY_WITHDRAWAL_INTERVAL: Duration = Duration::from_secs(10);
/// How long one heartbeat census is reused (a pass over every GpuNode; at 2,000 nodes the
/// reconciles of one second would otherwise each repeat it).
const CENSUS_TTL: Duration = Duration::from_secs(1);

/// Runs the binary: prints the CRDs, or runs the controller until SIGTERM/SIGINT.
pub async fn run(args: cli::Args) -> anyhow::Result<()> {
    if let Some(cli::Command::PrintCrds) = args.command {
        print!("{}", crds::crds_yaml().context("rendering the CRDs")?);
        return Ok(());
    }
    migdra_runtime::init_logging(args.log_format, &args.log_level)
        .map_err(|e| anyhow::anyhow!("setting up logging: {e}"))?;
    let identity = args.identity();
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        driver = %args.driver_name,
        %identity,
        leader_elect = args.leader_elect,
        "starting"
    );
    let shutdown = migdra_runtime::shutdown_on_signals().context("installing signal handlers")?;

    let metrics = metrics::Metrics::new();
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

    let client = migdra_runtime::kube_client(args.kubeconfig.as_deref()).await?;
    let config = context::ControllerConfig {
        driver: args.driver_name.clone(),
        heartbeat_timeout: args.heartbeat_timeout(),
        mass_expiry_threshold: args.mass_expiry_threshold,
        identity: identity.clone(),
        ready_timeout: READY_TIMEOUT,
        heartbeat_namespace: args.namespace.clone(),
        census_ttl: CENSUS_TTL,
        concurrency: args.max_concurrent_reconciles,
        expiry_withdrawal_interval: EXPIRY_WITHDRAWAL_INTERVAL,
        status_defer_max: reconcile::STATUS_DEFER_MAX,
        status_defer_quiet: reconcile::STATUS_DEFER_QUIET,
    };

    // Both the leader and a standby replica are ready: a standby is healthy and waiting.
    ready.set(true);
    let result = if args.leader_elect {
        let lease = leader::LeaseConfig {
            namespace: args.namespace.clone(),
            name: args.lease_name.clone(),
            identity,
            duration_seconds: args.lease_duration_seconds,
        };
        let task = {
            let client = client.clone();
            let metrics = metrics.clone();
            move |stop| controller::run(client.clone(), config.clone(), metrics.clone(), stop)
        };
        leader::run(client, lease, metrics.clone(), shutdown.clone(), task).await
    } else {
        metrics.set_leader(true);
        controller::run(client, config, metrics.clone(), shutdown.clone()).await
    };
    ready.set(false);
    shutdown.cancel();
    let _ = http_task.await;
    result.context("controller")?;
    tracing::info!("stopped");
    Ok(())
}
