//! The DRA plugin service (`NodePrepareResources`, `NodeUnprepareResources`), served as both
//! `v1.DRAPlugin` and `v1beta1.DRAPlugin` by one handler over a [`DraDriver`].
//!
//! The kubelet fails the whole pod sync when a claim UID is missing from a response, so every
//! requested UID is answered: a UID the driver did not answer becomes a per-claim error, and UIDs
//! the driver invented are dropped.
//!
//! Calls reach the driver one at a time (prepare and unprepare alike), as with the Go
//! `kubeletplugin` helper's default: the kubelet may call concurrently for different pods, and a
//! driver's allocation decisions must not interleave.

use std::{collections::HashMap, sync::Arc};

use migdra_proto::dra::{v1, v1beta1};
use tokio::sync::Mutex;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use crate::{ClaimRef, DraDriver, PrepareOutcome, PreparedDevice, UnprepareOutcome};

/// Serves the DRA plugin service for a [`DraDriver`]; one value backs both versions.
pub struct DraService<D> {
    driver: Arc<D>,
    serialize: Arc<Mutex<()>>,
}

impl<D> Clone for DraService<D> {
    fn clone(&self) -> Self {
        Self {
            driver: Arc::clone(&self.driver),
            serialize: Arc::clone(&self.serialize),
        }
    }
}

impl<D: DraDriver> DraService<D> {
    pub fn new(driver: Arc<D>) -> Self {
        Self {
            driver,
            serialize: Arc::new(Mutex::new(())),
        }
    }

    pub fn v1_server(&self) -> v1::dra_plugin_server::DraPluginServer<Self> {
        v1::dra_plugin_server::DraPluginServer::new(self.clone())
    }

    pub fn v1beta1_server(&self) -> v1beta1::dra_plugin_server::DraPluginServer<Self> {
        v1beta1::dra_plugin_server::DraPluginServer::new(self.clone())
    }

    /// Prepares `claims` and returns exactly one outcome per requested UID.
    async fn prepare(&self, version: &str, claims: Vec<ClaimRef>) -> HashMap<String, PrepareOutcome> {
        info!(version, claims = claims.len(), "NodePrepareResources");
        if claims.is_empty() {
            return HashMap::new();
        }
        let answered = {
            let _serialized = self.serialize.lock().await;
            self.driver.prepare(claims.clone()).await
        };
        complete_outcomes("prepare", &claims, answered)
    }

    /// Unprepares `claims` and returns exactly one outcome per requested UID.
    async fn unprepare(&self, version: &str, claims: Vec<ClaimRef>) -> HashMap<String, UnprepareOutcome> {
        info!(version, claims = claims.len(), "NodeUnprepareResources");
        if claims.is_empty() {
            return HashMap::new();
        }
        let answered = {
            let _serialized = self.serialize.lock().await;
            self.driver.unprepare(claims.clone()).await
        };
        complete_outcomes("unprepare", &claims, answered)
    }
}

/// Keeps the driver's outcome for every requested claim, turns a missing one into an error,
/// drops unrequested UIDs and makes sure no error is empty (an empty error means success to the
/// kubelet).
fn complete_outcomes<T>(
    operation: &str,
    claims: &[ClaimRef],
    mut answered: HashMap<String, Result<T, String>>,
) -> HashMap<String, Result<T, String>> {
    let mut outcomes = HashMap::with_capacity(claims.len());
    for claim in claims {
        if outcomes.contains_key(&claim.uid) {
            continue;
        }
        let outcome = match answered.remove(&claim.uid) {
            Some(Ok(value)) => Ok(value),
            Some(Err(error)) if error.is_empty() => Err(format!("{operation} failed without a message")),
            Some(Err(error)) => Err(error),
            None => Err(format!(
                "driver returned no {operation} result for claim {}/{} ({})",
                claim.namespace, claim.name, claim.uid
            )),
        };
        if let Err(error) = &outcome {
            warn!(
                operation,
                namespace = %claim.namespace,
                name = %claim.name,
                uid = %claim.uid,
                %error,
                "claim failed"
            );
        }
        outcomes.insert(claim.uid.clone(), outcome);
    }
    for uid in answered.keys() {
        warn!(operation, %uid, "driver answered a claim that was not requested; dropped");
    }
    outcomes
}

fn claim_refs<C: Into<ClaimRef>>(claims: Vec<C>) -> Vec<ClaimRef> {
    claims.into_iter().map(Into::into).collect()
}

fn v1_device(device: PreparedDevice) -> v1::Device {
    v1::Device {
        request_names: device.request_names,
        pool_name: device.pool_name,
        device_name: device.device_name,
        cdi_device_ids: device.cdi_device_ids,
        share_id: device.share_id,
    }
}

fn v1beta1_device(device: PreparedDevice) -> v1beta1::Device {
    // v1beta1 has no share_id field: a share ID cannot be sent to such a kubelet.
    v1beta1::Device {
        request_names: device.request_names,
        pool_name: device.pool_name,
        device_name: device.device_name,
        cdi_device_ids: device.cdi_device_ids,
    }
}

/// The two API versions have identical messages in distinct generated modules; one handler
/// serves both, and this implements each version's service trait (and claim conversion) on it.
macro_rules! dra_plugin_version {
    ($version:ident, $device:ident) => {
        impl From<$version::Claim> for ClaimRef {
            fn from(claim: $version::Claim) -> Self {
                Self {
                    namespace: claim.namespace,
                    uid: claim.uid,
                    name: claim.name,
                }
            }
        }

        #[tonic::async_trait]
        impl<D: DraDriver> $version::dra_plugin_server::DraPlugin for DraService<D> {
            async fn node_prepare_resources(
                &self,
                request: Request<$version::NodePrepareResourcesRequest>,
            ) -> Result<Response<$version::NodePrepareResourcesResponse>, Status> {
                let claims = claim_refs(request.into_inner().claims);
                let outcomes = self.prepare(stringify!($version), claims).await;
                let claims = outcomes.into_iter().map(|(uid, outcome)| {
                    let (devices, error) = match outcome {
                        Ok(devices) => (devices.into_iter().map($device).collect(), String::new()),
                        Err(error) => (Vec::new(), error),
                    };
                    (
                        uid,
                        $version::NodePrepareResourceResponse { devices, error },
                    )
                });
                let claims = claims.collect();
                Ok(Response::new($version::NodePrepareResourcesResponse {
                    claims,
                }))
            }

            async fn node_unprepare_resources(
                &self,
                request: Request<$version::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$version::NodeUnprepareResourcesResponse>, Status> {
                let claims = claim_refs(request.into_inner().claims);
                let outcomes = self.unprepare(stringify!($version), claims).await;
                let claims = outcomes.into_iter().map(|(uid, outcome)| {
                    let error = outcome.err().unwrap_or_default();
                    (uid, $version::NodeUnprepareResourceResponse { error })
                });
                let claims = claims.collect();
                Ok(Response::new($version::NodeUnprepareResourcesResponse {
                    claims,
                }))
            }
        }
    };
}

dra_plugin_version!(v1, v1_device);
dra_plugin_version!(v1beta1, v1beta1_device);

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::sync::Notify;

    use super::*;

    /// Blocks every call until released and records how many calls were inside at once.
    #[derive(Default)]
    struct Gate {
        active: AtomicUsize,
        max_active: AtomicUsize,
        entered: Notify,
        release: Notify,
    }

    impl Gate {
        async fn pass<T>(&self, claims: Vec<ClaimRef>, value: T) -> HashMap<String, Result<T, String>>
        where
            T: Clone,
        {
            let now = self.active.fetch_add(1, Ordering::SeqCst) + 1;
            self.max_active.fetch_max(now, Ordering::SeqCst);
            self.entered.notify_one();
            self.release.notified().await;
            self.active.fetch_sub(1, Ordering::SeqCst);
            claims.into_iter().map(|c| (c.uid, Ok(value.clone()))).collect()
        }
    }

    impl DraDriver for Gate {
        async fn prepare(&self, claims: Vec<ClaimRef>) -> HashMap<String, PrepareOutcome> {
            self.pass(claims, Vec::new()).await
        }

        async fn unprepare(&self, claims: Vec<ClaimRef>) -> HashMap<String, UnprepareOutcome> {
            self.pass(claims, ()).await
        }
    }

    #[tokio::test]
    async fn driver_calls_are_serialized() {
        let gate = Arc::new(Gate::default());
        let service = DraService::new(Arc::clone(&gate));
        let control = async {
            gate.entered.notified().await;
            // `biased` polled the second call right after the first entered the driver.
            assert_eq!(gate.max_active.load(Ordering::SeqCst), 1, "second call waited");
            gate.release.notify_one();
            gate.entered.notified().await;
            gate.release.notify_one();
        };
        let (prepared, unprepared, ()) = tokio::join!(
            biased;
            service.prepare("v1", vec![claim("a")]),
            service.unprepare("v1", vec![claim("b")]),
            control,
        );
        assert_eq!(prepared["a"], Ok(Vec::new()));
        assert_eq!(unprepared["b"], Ok(()));
        assert_eq!(gate.max_active.load(Ordering::SeqCst), 1);
    }

    fn claim(uid: &str) -> ClaimRef {
        ClaimRef {
            namespace: "ns".into(),
            uid: uid.into(),
            name: format!("claim-{uid}"),
        }
    }

    #[test]
    fn complete_outcomes_answers_every_uid_once() {
        let claims = [claim("a"), claim("b"), claim("c"), claim("a")];
        let answered = HashMap::from([
            ("a".to_string(), Ok(1)),
            ("b".to_string(), Err(String::new())),
            ("x".to_string(), Ok(9)),
        ]);
        let outcomes = complete_outcomes("prepare", &claims, answered);
        assert_eq!(outcomes.len(), 3);
        assert_eq!(outcomes["a"], Ok(1));
        assert_eq!(outcomes["b"], Err("prepare failed without a message".to_string()));
        let missing = outcomes["c"].clone().unwrap_err();
        assert!(missing.contains("ns/claim-c (c)"), "{missing}");
        assert!(!outcomes.contains_key("x"));
    }
}
