//! The DRA resource health service (`NodeWatchResources`), served as both `v1alpha1` and `v1`
//! `DRAResourceHealth` from a watch channel of device health snapshots.
//!
//! The kubelet marks a device Unknown when it is not re-reported within its health-check timeout
//! (30 s by default), so each stream sends the complete list at once, on every change, and again
//! after every `resend_interval` without a change. `last_updated_time` is the time of sending:
//! every send is a fresh report.

use std::{
    pin::Pin,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use futures::Stream;
use migdra_proto::health::{v1, v1alpha1};
use tokio::{sync::watch, time::MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::debug;

use crate::DeviceHealthReport;

/// How often the full list is re-sent without a change by default; well inside the kubelet's
/// 30 s default timeout.
pub const DEFAULT_RESEND_INTERVAL: Duration = Duration::from_secs(10);

/// The longest message the kubelet accepts (characters).
pub const MAX_MESSAGE_CHARS: usize = 1024;

/// The kubelet's default health-check timeout; reports carry an explicit timeout only when the
/// resend interval would not fit into it three times.
const KUBELET_DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves `NodeWatchResources` from a watch channel; one value backs both the v1alpha1 and the v1
/// services.
#[derive(Clone)]
pub struct HealthService {
    devices: watch::Receiver<Vec<DeviceHealthReport>>,
    resend_interval: Duration,
    shutdown: CancellationToken,
}

/// Health as the protobuf enum value (identical numbering in v1alpha1 and v1).
fn health_value(healthy: Option<bool>) -> i32 {
    match healthy {
        Some(true) => v1::HealthStatus::Healthy as i32,
        Some(false) => v1::HealthStatus::Unhealthy as i32,
        None => v1::HealthStatus::Unknown as i32,
    }
}

/// `message` cut to the kubelet's limit, on a character boundary.
fn truncate_message(message: &str) -> String {
    match message.char_indices().nth(MAX_MESSAGE_CHARS) {
        Some((cut, _)) => message[..cut].to_string(),
        None => message.to_string(),
    }
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

type ResponseStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

impl HealthService {
    /// A service streaming `devices`; streams end when `shutdown` is cancelled (so that a
    /// graceful server shutdown is not held up by the never-ending streams) or when the sender
    /// is dropped. A zero `resend_interval` is treated as one second.
    pub fn new(
        devices: watch::Receiver<Vec<DeviceHealthReport>>,
        resend_interval: Duration,
        shutdown: CancellationToken,
    ) -> Self {
        let resend_interval = if resend_interval.is_zero() {
            Duration::from_secs(1)
        } else {
            resend_interval
        };
        Self {
            devices,
            resend_interval,
            shutdown,
        }
    }

    pub fn v1alpha1_server(&self) -> v1alpha1::dra_resource_health_server::DraResourceHealthServer<Self> {
        v1alpha1::dra_resource_health_server::DraResourceHealthServer::new(self.clone())
    }

    pub fn v1_server(&self) -> v1::dra_resource_health_server::DraResourceHealthServer<Self> {
        v1::dra_resource_health_server::DraResourceHealthServer::new(self.clone())
    }

    /// The timeout to announce per device: 0 (the kubelet's default) unless three resend
    /// intervals exceed it.
    fn announced_timeout(&self) -> i64 {
        if self.resend_interval * 3 <= KUBELET_DEFAULT_TIMEOUT {
            0
        } else {
            i64::try_from((self.resend_interval * 3).as_secs()).unwrap_or(i64::MAX)
        }
    }

    /// A stream of complete snapshots, each converted with `convert(devices, now, timeout)`.
    fn snapshots<T, F>(&self, version: &'static str, convert: F) -> ResponseStream<T>
    where
        T: Send + 'static,
        F: Fn(&[DeviceHealthReport], i64, i64) -> T + Send + 'static,
    {
        struct State<F> {
            devices: watch::Receiver<Vec<DeviceHealthReport>>,
            resend: tokio::time::Interval,
            shutdown: CancellationToken,
            initial: bool,
            timeout: i64,
            convert: F,
        }

        let mut resend = tokio::time::interval_at(
            tokio::time::Instant::now() + self.resend_interval,
            self.resend_interval,
        );
        resend.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let state = State {
            devices: self.devices.clone(),
            resend,
            shutdown: self.shutdown.clone(),
            initial: true,
            timeout: self.announced_timeout(),
            convert,
        };
        debug!(version, "health stream opened");
        Box::pin(futures::stream::unfold(state, move |mut state| async move {
            if state.initial {
                state.initial = false;
            } else {
                tokio::select! {
                    () = state.shutdown.cancelled() => {
                        debug!(version, "health stream closed: shutting down");
                        return None;
                    }
                    changed = state.devices.changed() => {
                        if changed.is_err() {
                            debug!(version, "health stream closed: no more health updates");
                            return None;
                        }
                    }
                    _ = state.resend.tick() => {}
                }
            }
            // Restart the resend period after every send, so a change does not shorten the
            // next periodic send.
            state.resend.reset();
            let message = {
                let devices = state.devices.borrow_and_update();
                (state.convert)(&devices, unix_now(), state.timeout)
            };
            Some((Ok(message), state))
        }))
    }
}

/// The two versions have identical messages in distinct generated modules; this implements
/// each version's service on the one handler.
macro_rules! health_version {
    ($version:ident) => {
        #[tonic::async_trait]
        impl $version::dra_resource_health_server::DraResourceHealth for HealthService {
            type NodeWatchResourcesStream = ResponseStream<$version::NodeWatchResourcesResponse>;

            async fn node_watch_resources(
                &self,
                _request: Request<$version::NodeWatchResourcesRequest>,
            ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
                let convert = |devices: &[DeviceHealthReport], now, timeout| {
                    let devices = devices.iter().map(|device| $version::DeviceHealth {
                        device: Some($version::DeviceIdentifier {
                            pool_name: device.pool_name.clone(),
                            device_name: device.device_name.clone(),
                        }),
                        health: health_value(device.healthy),
                        last_updated_time: now,
                        health_check_timeout_seconds: timeout,
                        message: truncate_message(&device.message),
                    });
                    $version::NodeWatchResourcesResponse {
                        devices: devices.collect(),
                    }
                };
                Ok(Response::new(self.snapshots(stringify!($version), convert)))
            }
        }
    };
}

health_version!(v1alpha1);
health_version!(v1);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncates_on_character_boundary() {
        let long: String = "é".repeat(MAX_MESSAGE_CHARS + 5);
        let cut = truncate_message(&long);
        assert_eq!(cut.chars().count(), MAX_MESSAGE_CHARS);
        assert_eq!(truncate_message("short"), "short");
        let exact = "x".repeat(MAX_MESSAGE_CHARS);
        assert_eq!(truncate_message(&exact), exact);
    }

    #[test]
    fn health_enum_values_match_both_versions() {
        assert_eq!(health_value(Some(true)), v1alpha1::HealthStatus::Healthy as i32);
        assert_eq!(
            health_value(Some(false)),
            v1alpha1::HealthStatus::Unhealthy as i32
        );
        assert_eq!(health_value(None), v1alpha1::HealthStatus::Unknown as i32);
    }

    #[test]
    fn announces_timeout_only_for_long_intervals() {
        let (_tx, rx) = watch::channel(Vec::new());
        let token = CancellationToken::new();
        assert_eq!(
            HealthService::new(rx.clone(), DEFAULT_RESEND_INTERVAL, token.clone()).announced_timeout(),
            0
        );
        assert_eq!(
            HealthService::new(rx, Duration::from_secs(20), token).announced_timeout(),
            60
        );
    }
}
