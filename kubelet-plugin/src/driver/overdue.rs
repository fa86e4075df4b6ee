//! What an overdue NVML call leaves behind once it returns.
//!
//! A prepare whose NVML call ran past the timeout failed, and its rollback failed too (every
//! call on that GPU fails while the first one is overdue), so its record stays as
//! `PrepareStarted`; an unprepare stays `UnprepareStarted`. When the call returns it may have
//! done its work after all (an instance created that nobody waits for). Then every record left
//! half done on GPUs that answer again is repaired as at start: under the node lock alone no
//! kubelet call is running, so a record that is not complete is one that failed.

use tokio_util::sync::CancellationToken;

use super::{Driver, DriverError, Repair};
use crate::{checkpoint::ClaimState, claims::ClaimSource};

impl<C: ClaimSource> Driver<C> {
    /// Repairs what overdue NVML calls left half done, each time one returns, until
    /// `shutdown`. NVML work runs on blocking threads.
    pub async fn run_overdue_reconcile(self, shutdown: CancellationToken) {
        let mut returns = self.inner.gpus.nvml_calls().subscribe_returns();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                changed = returns.changed() => if changed.is_err() { return },
            }
            let driver = self.clone();
            match tokio::task::spawn_blocking(move || driver.reconcile_after_overdue()).await {
                Ok(Ok(repaired)) if !repaired.is_empty() => {
                    tracing::info!(?repaired, "repaired what overdue NVML calls left half done");
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "cannot repair what overdue NVML calls left; the kubelet's retries or the next return will")
                }
                Err(e) => tracing::error!(error = %e, "repair after an overdue NVML call failed"),
            }
        }
    }

    /// Repairs, under the node lock alone, every record left half done whose GPUs all answer
    /// now; returns what it did, by claim UID. Blocking.
    pub fn reconcile_after_overdue(&self) -> Result<Vec<(String, Repair)>, DriverError> {
        let node = self.node_lock()?;
        let mut repaired = Vec::new();
        for (uid, record) in self.recorded_claims() {
            if record.state == ClaimState::PrepareCompleted {
                continue;
            }
            if let Some(reason) = record
                .devices
                .iter()
                .find_map(|d| self.inner.gpus.nvml_stuck_on(d.gpu_minor))
            {
                tracing::debug!(claim = %record.key(), %uid, %reason, "left half done on a GPU NVML still does not answer; waiting for its call");
                continue;
            }
            match self.repair_record(&node, &uid, &record) {
                Ok(repair) => repaired.push((uid, repair)),
                Err(e) => {
                    tracing::warn!(claim = %record.key(), %uid, error = %e, "repairing a record left half done by an overdue NVML call failed; the kubelet's retry or unprepare tears it down");
                }
            }
        }
        Ok(repaired)
    }
}
