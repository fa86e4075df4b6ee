//! migdra-controller: turns every live node's GpuNode inventory, under the MigPolicy that
//! selects it, into the node's ResourceSlice pool, and withdraws the pool when the node's
//! kubelet plugin goes away.
//!
//! Data flow: [`cli`] → [`leader`] (only the lease holder runs) → [`controller`] (watches and
//! caches; [`geometry_cache`] keeps the GpuNode cache small, [`slice_index`] finds a node's
//! slices) → [`reconcile`] per GpuNode: [`liveness`] → [`desired`] (policy, plan, keep the
//! devices [`claims`] hold, render, validate) → [`compare`] (semantic diff) → [`publish`]
//! (slice writes, recorded in [`expectations`]) → [`status`] (deferred while slices are
//! written, see [`status_deferral`]); a failed reconciliation is retried after its
//! [`backoff`]. The [`context`] holds what the reconciliations share.

pub mod backoff;
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
pub mod slice_index;
pub mod status;
pub mod status_deferral;

use std::time::Duration;

use anyhow::Context as _;
use kube::Client;
use tokio_util::sync::CancellationToken;

pub use error::{Error, Result};

/// How long a reconciliation waits for the caches after start.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// Heartbeat expiry alone withdraws at most one pool per this interval (the node lifecycle
/// controller's default eviction rate, 0.1 nodes/s).
const EXPIRY_WITHDRAWAL_INTERVAL: Duration = Duration::from_secs(10);
/// How long one heartbeat census is reused (a pass over every GpuNode, which the
/// reconciliations of one second would otherwise each repeat).
const CENSUS_TTL: Duration = Duration::from_secs(1);

/// Runs the binary: prints the CRDs, or runs the controller until SIGTERM/SIGINT.
pub async fn run(args: cli::Args) -> anyhow::Result<()> {
    if let Some(cli::Command::PrintCrds) = args.command {
        print!("{}", crds::crds_yaml().context("rendering the CRDs")?);
        return Ok(());
    }
    args.process.init_logging()?;
    let identity = args.identity();
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        driver = %args.driver_name,
        %identity,
        leader_elect = args.leader_elect,
        "starting"
    );
    let metrics = metrics::Metrics::new();
    let process = {
        let metrics = metrics.clone();
        args.process.start(move || metrics.encode()).await?
    };
    let client = migdra_runtime::kube_client(args.process.kubeconfig.as_deref()).await?;

    // Both the leader and a standby replica are ready: a standby is healthy and waiting.
    process.ready.set(true);
    let result = run_controller(&args, identity, client, metrics, &process.shutdown).await;
    process.ready.set(false);
    process.shutdown.cancel();
    let _ = process.http_task.await;
    result.context("controller")?;
    tracing::info!("stopped");
    Ok(())
}

/// Runs the controller until `shutdown`: while this replica holds the lease, or throughout
/// without leader election.
async fn run_controller(
    args: &cli::Args,
    identity: String,
    client: Client,
    metrics: metrics::Metrics,
    shutdown: &CancellationToken,
) -> Result<()> {
    let config = context::ControllerConfig {
        driver: args.driver_name.clone(),
        pool: desired::PoolSettings {
            keep_memory_counter: args.keep_memory_counter,
            default_mig_mode: args.default_mig_mode.into(),
        },
        heartbeat_timeout: args.heartbeat_timeout(),
        mass_expiry_threshold: args.mass_expiry_threshold,
        identity: identity.clone(),
        ready_timeout: READY_TIMEOUT,
        heartbeat_namespace: args.namespace.clone(),
        census_ttl: CENSUS_TTL,
        concurrency: args.max_concurrent_reconciles,
        expiry_withdrawal_interval: EXPIRY_WITHDRAWAL_INTERVAL,
        status_defer_max: status_deferral::MAX_WAIT,
        status_defer_quiet: status_deferral::QUIET,
    };
    if !args.leader_elect {
        metrics.set_leader(true);
        return controller::run(client, config, metrics, shutdown.clone()).await;
    }
    let lease = leader::LeaseConfig {
        namespace: args.namespace.clone(),
        name: args.lease_name.clone(),
        identity,
        duration_seconds: args.lease_duration_seconds,
    };
    let task = {
        let (client, metrics) = (client.clone(), metrics.clone());
        move |stop| controller::run(client.clone(), config.clone(), metrics.clone(), stop)
    };
    leader::run(client, lease, metrics, shutdown.clone(), task).await
}

/// Locks `mutex`, ignoring poisoning: every mutex of the controller guards plain data that a
/// panic cannot leave half-updated in a way later readers care about.
pub(crate) fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
