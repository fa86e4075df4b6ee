//! Startup recovery: repairs, from the journal alone, whatever a previous run left half done.

use super::{Driver, DriverError};
use crate::{
    checkpoint::{ClaimState, LoadOutcome},
    claims::ClaimSource,
    nvml::GpuBackend,
};

/// What startup recovery did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// How the checkpoint was loaded.
    pub checkpoint: Option<LoadOutcome>,
    /// Half-prepared claims rolled back.
    pub rolled_back: Vec<String>,
    /// Half-unprepared claims finished.
    pub unprepared: Vec<String>,
    /// Completed claims whose CDI spec was missing and rewritten.
    pub cdi_rewritten: Vec<String>,
}

impl RecoveryReport {
    /// A sentence for people (the GpuNode event), when anything was repaired.
    pub fn summary(&self) -> Option<String> {
        if self.rolled_back.is_empty() && self.unprepared.is_empty() && self.cdi_rewritten.is_empty() {
            return None;
        }
        Some(format!(
            "repaired interrupted operations at start: {} half-prepared claim(s) rolled back, {} half-unprepared claim(s) finished, {} CDI spec(s) rewritten",
            self.rolled_back.len(),
            self.unprepared.len(),
            self.cdi_rewritten.len()
        ))
    }
}

impl<B: GpuBackend + 'static, C: ClaimSource> Driver<B, C> {
    pub(super) fn recover(&self) -> Result<RecoveryReport, DriverError> {
        let node = self.node_lock()?;
        let mut report = RecoveryReport::default();
        let mut failures = Vec::new();
        for (uid, record) in self.recorded_claims() {
            let result = match record.state {
                ClaimState::PrepareStarted => {
                    self.inner.metrics.recovery("rollback");
                    let locks = self.lock_record_gpus(&node, &record);
                    self.tear_down(&locks, &uid, &record)
                        .map(|()| report.rolled_back.push(uid.clone()))
                }
                ClaimState::UnprepareStarted => {
                    self.inner.metrics.recovery("finish_unprepare");
                    let locks = self.lock_record_gpus(&node, &record);
                    self.tear_down(&locks, &uid, &record)
                        .map(|()| report.unprepared.push(uid.clone()))
                }
                ClaimState::PrepareCompleted if !self.inner.cdi.has_claim_spec(&uid) => {
                    // /var/run/cdi is a tmpfs on many hosts; the instances are still there, so
                    // the spec is rebuilt from the record rather than re-preparing.
                    self.inner.metrics.recovery("rewrite_cdi");
                    self.write_cdi(&uid, &record.devices)
                        .map(|()| report.cdi_rewritten.push(uid.clone()))
                }
                ClaimState::PrepareCompleted => Ok(()),
            };
            if let Err(e) = result {
                tracing::error!(claim = %record.key(), %uid, error = %e, "recovery failed");
                failures.push(format!("{}: {e}", record.key()));
            }
        }
        if failures.is_empty() {
            tracing::info!(?report, "recovery finished");
            Ok(report)
        } else {
            Err(DriverError::Recovery(failures.len(), failures.join("; ")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_only_when_something_was_repaired() {
        let mut report = RecoveryReport {
            checkpoint: Some(LoadOutcome::Loaded),
            ..RecoveryReport::default()
        };
        assert_eq!(report.summary(), None);
        report.rolled_back.push("u1".into());
        report.cdi_rewritten.push("u2".into());
        let summary = report.summary().unwrap();
        assert!(summary.contains("1 half-prepared claim(s) rolled back, 0 half-unprepared claim(s) finished, 1 CDI spec(s) rewritten"), "{summary}");
    }
}
