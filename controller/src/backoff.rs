//! Per-node exponential backoff after failed reconciliations: 1 s, 2 s, 4 s, … up to 2
//! minutes, reset by the next success.

use std::{collections::HashMap, sync::Mutex, time::Duration};

const BASE: Duration = Duration::from_secs(1);
pub const MAX: Duration = Duration::from_secs(120);

/// The consecutive failures of every node.
#[derive(Debug, Default)]
pub struct Backoff(Mutex<HashMap<String, u32>>);

impl Backoff {
    /// Counts one more consecutive failure of `node`; returns how long its retry waits.
    pub fn failed(&self, node: &str) -> Duration {
        let mut failures = crate::lock(&self.0);
        let count = failures.entry(node.to_string()).or_insert(0);
        *count = count.saturating_add(1);
        delay(*count)
    }

    /// Forgets `node`'s failures after a success.
    pub fn succeeded(&self, node: &str) {
        crate::lock(&self.0).remove(node);
    }
}

/// The delay after `attempt` consecutive failures (1-based).
pub fn delay(attempt: u32) -> Duration {
    let exponent = attempt.saturating_sub(1).min(16);
    BASE.saturating_mul(1 << exponent).min(MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped() {
        assert_eq!(delay(1), Duration::from_secs(1));
        assert_eq!(delay(2), Duration::from_secs(2));
        assert_eq!(delay(5), Duration::from_secs(16));
        assert_eq!(delay(8), MAX);
        assert_eq!(delay(u32::MAX), MAX);
    }

    #[test]
    fn a_success_resets_the_backoff() {
        let backoff = Backoff::default();
        assert_eq!(backoff.failed("a"), Duration::from_secs(1));
        assert_eq!(backoff.failed("a"), Duration::from_secs(2));
        assert_eq!(backoff.failed("b"), Duration::from_secs(1), "per node");
        backoff.succeeded("a");
        assert_eq!(backoff.failed("a"), Duration::from_secs(1));
    }
}
