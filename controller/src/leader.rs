//! Leader election with a coordination.k8s.io Lease (kube-lease-manager): the controller
//! runs only while this replica holds the lease.
//!
//! * Lease acquired → the controller task starts.
//! * Lease lost, or renewing it failed → the task is aborted at once (in-flight
//!   reconciliations are dropped at their next await), so two replicas never write together;
//!   the lease manager is rebuilt and competes again.
//! * Shutdown → the task stops gracefully, then the lease is released so a standby takes
//!   over without waiting for it to expire.

use std::{future::Future, time::Duration};

use kube::Client;
use kube_lease_manager::{LeaseManager, LeaseManagerBuilder, LeaseManagerError};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::{error::Error, metrics::Metrics};

/// How long a graceful stop may take before the task is aborted.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// Wait before retrying after a lease error, doubled up to `RETRY_MAX`.
const RETRY_MIN: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(10);

/// Where the lease lives and who competes for it.
#[derive(Clone, Debug)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    /// This replica's identity (the lease holder string).
    pub identity: String,
    /// At least 2.
    pub duration_seconds: u64,
}

impl LeaseConfig {
    /// The renewal grace: a third of the duration, at least 1 s, less than the duration.
    pub fn grace_seconds(&self) -> u64 {
        (self.duration_seconds / 3).clamp(1, self.duration_seconds.saturating_sub(1).max(1))
    }
}

/// The controller task while it runs.
struct Running {
    handle: JoinHandle<Result<(), Error>>,
    stop: CancellationToken,
}

impl Running {
    /// Aborts at once (the lease is lost).
    async fn abort(self) {
        self.handle.abort();
        let _ = self.handle.await;
    }

    /// Stops gracefully, aborting after [`STOP_TIMEOUT`].
    async fn stop(mut self) {
        self.stop.cancel();
        if tokio::time::timeout(STOP_TIMEOUT, &mut self.handle)
            .await
            .is_err()
        {
            tracing::warn!("the controller did not stop in time; aborting it");
            self.abort().await;
        }
    }
}

/// Runs `task` while holding the lease, until `shutdown`. `task` gets a token that asks it
/// to stop gracefully; it must not return before then (if it does, its error ends the
/// election and is returned, after the lease is released).
pub async fn run<F, Fut>(
    client: Client,
    config: LeaseConfig,
    metrics: Metrics,
    shutdown: CancellationToken,
    task: F,
) -> Result<(), Error>
where
    F: Fn(CancellationToken) -> Fut,
    Fut: Future<Output = Result<(), Error>> + Send + 'static,
{
    let mut retry = RETRY_MIN;
    metrics.set_leader(false);
    loop {
        let manager = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            built = build(&client, &config) => built,
        };
        match manager {
            Ok(manager) => {
                let error = match hold(&manager, &config, &metrics, &shutdown, &task).await {
                    Ok(result) => {
                        match manager.release().await {
                            Ok(_) => tracing::info!(lease = %config.name, "lease released"),
                            Err(e) => tracing::warn!(error = %e, "releasing the lease failed"),
                        }
                        return result;
                    }
                    Err(e) => e,
                };
                tracing::warn!(error = %error, ?retry, "lease renewal failed; stopped the controller, competing again");
            }
            Err(e) => tracing::warn!(error = %e, ?retry, "setting up the lease failed; retrying"),
        }
        if sleep_or_shutdown(retry, &shutdown).await {
            return Ok(());
        }
        retry = (retry * 2).min(RETRY_MAX);
    }
}

/// Runs `task` while `manager` holds the lease. Returns, for the lease to be released, what
/// shutdown (or the task's end) gives; or the lease manager's error, for it to be rebuilt.
async fn hold<F, Fut>(
    manager: &LeaseManager,
    config: &LeaseConfig,
    metrics: &Metrics,
    shutdown: &CancellationToken,
    task: &F,
) -> Result<Result<(), Error>, LeaseManagerError>
where
    F: Fn(CancellationToken) -> Fut,
    Fut: Future<Output = Result<(), Error>> + Send + 'static,
{
    let mut running: Option<Running> = None;
    let held = loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => {
                if let Some(r) = running.take() {
                    r.stop().await;
                }
                break Ok(Ok(()));
            }
            joined = async {
                match running.as_mut() {
                    Some(r) => (&mut r.handle).await,
                    None => std::future::pending().await,
                }
            } => {
                break Ok(match joined {
                    Ok(Ok(())) => Err(Error::Controller("the controller ended unexpectedly".into())),
                    Ok(Err(e)) => Err(e),
                    Err(e) => Err(Error::Controller(format!("the controller task failed: {e}"))),
                });
            }
            changed = manager.changed() => {
                if let Ok(true) = changed {
                    tracing::info!(identity = %config.identity, lease = %config.name, "acquired the lease; starting the controller");
                    if running.is_none() {
                        let stop = CancellationToken::new();
                        let handle = tokio::spawn(task(stop.clone()));
                        running = Some(Running { handle, stop });
                    }
                    metrics.set_leader(true);
                    continue;
                }
                if let Ok(false) = changed {
                    tracing::warn!(identity = %config.identity, "lost the lease; stopping the controller");
                }
                if let Some(r) = running.take() {
                    r.abort().await;
                }
                metrics.set_leader(false);
                if let Err(e) = changed {
                    break Err(e);
                }
            }
        }
    };
    metrics.set_leader(false);
    held
}

async fn build(client: &Client, config: &LeaseConfig) -> Result<LeaseManager, LeaseManagerError> {
    LeaseManagerBuilder::new(client.clone(), &config.name)
        .with_namespace(&config.namespace)
        .with_identity(&config.identity)
        .with_duration(config.duration_seconds)
        .with_grace(config.grace_seconds())
        .with_field_manager(format!("migdra-controller-{}", config.identity))
        .build()
        .await
}

/// Sleeps `d`; true when shutdown came first.
async fn sleep_or_shutdown(d: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => true,
        _ = tokio::time::sleep(d) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grace_is_a_third_of_the_duration() {
        let c = |d| LeaseConfig {
            namespace: "ns".into(),
            name: "l".into(),
            identity: "me".into(),
            duration_seconds: d,
        };
        assert_eq!(c(15).grace_seconds(), 5);
        assert_eq!(c(2).grace_seconds(), 1);
        assert_eq!(c(4).grace_seconds(), 1);
        assert_eq!(c(60).grace_seconds(), 20);
    }
}
