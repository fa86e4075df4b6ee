//! Retrying API calls that failed for transient reasons (a loaded API server answers 429,
//! 500, 503 or 504, or drops the connection): the bench measures under load and must not
//! abort a whole measure for one such answer. Errors that say something (4xx) are returned.

use std::{future::Future, time::Duration};

/// Attempts before giving up.
const ATTEMPTS: u32 = 6;

/// Whether an API error is worth retrying.
pub fn is_transient(error: &kube::Error) -> bool {
    match error {
        kube::Error::Api(status) => matches!(status.code, 429 | 500 | 502 | 503 | 504),
        kube::Error::HyperError(_) | kube::Error::Service(_) => true,
        _ => false,
    }
}

/// Runs `call` until it succeeds, fails for a non-transient reason, or failed
/// [`ATTEMPTS`] times; waits 0.5 s, 1 s, 2 s, … between attempts.
pub async fn retry<T, F, Fut>(mut call: F) -> Result<T, kube::Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, kube::Error>>,
{
    let mut wait = Duration::from_millis(500);
    let mut attempt = 1;
    loop {
        match call().await {
            Err(e) if attempt < ATTEMPTS && is_transient(&e) => {
                tracing::debug!(error = %e, attempt, "transient API error; retrying");
                tokio::time::sleep(wait).await;
                wait *= 2;
                attempt += 1;
            }
            other => return other,
        }
    }
}
