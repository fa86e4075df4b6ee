//! Claims as the API server would serve them: an in-memory [`ClaimSource`] that records and
//! applies status writes, and builders of allocated claims.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use dra_kubelet::ClaimRef;
use k8s_openapi::api::resource::v1::{AllocatedDeviceStatus, ResourceClaim};
use migdra_kubelet_plugin::claims::ClaimSource;
use serde_json::json;

use super::{DRIVER, POOL};

/// Claims served from memory, as the API server would; [`StaticClaims::set_unreachable`]
/// makes every GET fail as if the API server could not be reached, and
/// [`StaticClaims::set_status_failing`] every status write. Status writes are recorded
/// ([`StaticClaims::status_writes`]) and applied as server-side apply would for one field
/// manager that owns all of its driver's entries: the stored claim's entries of that driver
/// are replaced by the applied ones, other drivers' entries stay, and a UID that does not
/// match is refused (422, as the API server refuses it), a missing claim is 404.
/// [`StaticClaims::block_status`] holds every status write until its guard is dropped (a slow
/// or stuck API server). [`StaticClaims::delay_gets`] makes every GET take a while (a slow
/// API server).
#[derive(Clone, Default)]
pub struct StaticClaims {
    claims: Arc<Mutex<HashMap<(String, String), ResourceClaim>>>,
    unreachable: Arc<AtomicBool>,
    status_failing: Arc<AtomicBool>,
    writes: Arc<Mutex<Vec<StatusWrite>>>,
    /// Status writes wait for a read lock; [`StaticClaims::block_status`] holds the write lock.
    status_gate: Arc<tokio::sync::RwLock<()>>,
    writes_started: Arc<AtomicUsize>,
    get_delay: Arc<Mutex<Duration>>,
}

/// One status write as the plugin sent it.
#[derive(Clone, Debug)]
pub struct StatusWrite {
    pub namespace: String,
    pub name: String,
    pub field_manager: String,
    pub object: serde_json::Value,
    /// Whether it was accepted.
    pub accepted: bool,
}

fn api_error(code: u16, reason: &str, message: &str) -> kube::Error {
    let status: kube::core::Status = serde_json::from_value(json!({
        "status": "Failure", "code": code, "reason": reason, "message": message,
    }))
    .unwrap();
    kube::Error::Api(Box::new(status))
}

impl StaticClaims {
    pub fn put(&self, claim: ResourceClaim) {
        let key = (
            claim.metadata.namespace.clone().unwrap_or_default(),
            claim.metadata.name.clone().unwrap_or_default(),
        );
        self.claims.lock().unwrap().insert(key, claim);
    }

    /// Every GET answers only after `delay`.
    pub fn delay_gets(&self, delay: Duration) {
        *self.get_delay.lock().unwrap() = delay;
    }

    pub fn set_unreachable(&self, unreachable: bool) {
        self.unreachable.store(unreachable, Ordering::SeqCst);
    }

    /// Makes every status write fail (503) while `failing`.
    pub fn set_status_failing(&self, failing: bool) {
        self.status_failing.store(failing, Ordering::SeqCst);
    }

    /// Holds every status write (from its start) until the returned guard is dropped.
    pub async fn block_status(&self) -> tokio::sync::OwnedRwLockWriteGuard<()> {
        self.status_gate.clone().write_owned().await
    }

    /// How many status writes were sent so far, finished or not (held by
    /// [`StaticClaims::block_status`]).
    pub fn status_writes_started(&self) -> usize {
        self.writes_started.load(Ordering::SeqCst)
    }

    pub fn remove(&self, namespace: &str, name: &str) {
        self.claims
            .lock()
            .unwrap()
            .remove(&(namespace.to_string(), name.to_string()));
    }

    /// The stored claim (with the status writes applied).
    pub fn stored(&self, name: &str) -> Option<ResourceClaim> {
        self.claims
            .lock()
            .unwrap()
            .get(&("default".to_string(), name.to_string()))
            .cloned()
    }

    /// The stored claim's `status.devices` as JSON (`[]` when none).
    pub fn device_status(&self, name: &str) -> serde_json::Value {
        let claim = self.stored(name).unwrap_or_else(|| panic!("no claim {name}"));
        serde_json::to_value(claim.status.and_then(|s| s.devices).unwrap_or_default()).unwrap()
    }

    /// Every status write so far, in order.
    pub fn status_writes(&self) -> Vec<StatusWrite> {
        self.writes.lock().unwrap().clone()
    }

    fn apply(&self, namespace: &str, name: &str, object: &serde_json::Value) -> Result<(), kube::Error> {
        if self.status_failing.load(Ordering::SeqCst) {
            return Err(api_error(
                503,
                "ServiceUnavailable",
                "status writes fail (simulated)",
            ));
        }
        let mut claims = self.claims.lock().unwrap();
        let Some(claim) = claims.get_mut(&(namespace.to_string(), name.to_string())) else {
            return Err(api_error(404, "NotFound", "not found"));
        };
        if object["metadata"]["uid"].as_str() != claim.metadata.uid.as_deref() {
            // What the API server answers a server-side apply naming another UID.
            return Err(api_error(
                422,
                "Invalid",
                "metadata.uid: Invalid value: field is immutable",
            ));
        }
        let applied: Vec<AllocatedDeviceStatus> =
            serde_json::from_value(object["status"]["devices"].clone()).unwrap();
        let driver = applied
            .first()
            .map(|d| d.driver.clone())
            .unwrap_or_else(|| DRIVER.into());
        let status = claim.status.get_or_insert_with(Default::default);
        let mut devices: Vec<_> = status
            .devices
            .take()
            .unwrap_or_default()
            .into_iter()
            .filter(|d| d.driver != driver)
            .collect();
        devices.extend(applied);
        status.devices = (!devices.is_empty()).then_some(devices);
        Ok(())
    }
}

impl ClaimSource for StaticClaims {
    async fn get(&self, namespace: &str, name: &str) -> Result<Option<ResourceClaim>, kube::Error> {
        let delay = *self.get_delay.lock().unwrap();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if self.unreachable.load(Ordering::SeqCst) {
            return Err(kube::Error::ReadEvents(std::io::Error::other(
                "connection refused (simulated)",
            )));
        }
        Ok(self
            .claims
            .lock()
            .unwrap()
            .get(&(namespace.to_string(), name.to_string()))
            .cloned())
    }

    async fn apply_status(
        &self,
        namespace: &str,
        name: &str,
        field_manager: &str,
        object: &serde_json::Value,
    ) -> Result<(), kube::Error> {
        self.writes_started.fetch_add(1, Ordering::SeqCst);
        let _open = self.status_gate.read().await;
        let result = if self.unreachable.load(Ordering::SeqCst) {
            Err(kube::Error::ReadEvents(std::io::Error::other(
                "connection refused (simulated)",
            )))
        } else {
            self.apply(namespace, name, object)
        };
        self.writes.lock().unwrap().push(StatusWrite {
            namespace: namespace.into(),
            name: name.into(),
            field_manager: field_manager.into(),
            object: object.clone(),
            accepted: result.is_ok(),
        });
        result
    }
}

/// A claim allocated from this node's pool.
pub fn claim(uid: &str, name: &str, results: &[(&str, &str)]) -> ResourceClaim {
    claim_with(uid, name, POOL, results, json!([]))
}

/// A claim with explicit pool and allocation config entries.
pub fn claim_with(
    uid: &str,
    name: &str,
    pool: &str,
    results: &[(&str, &str)],
    config: serde_json::Value,
) -> ResourceClaim {
    let results: Vec<_> = results
        .iter()
        .map(
            |(request, device)| json!({"request": request, "driver": DRIVER, "pool": pool, "device": device}),
        )
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default", "uid": uid},
        "spec": {"devices": {"requests": []}},
        "status": {"allocation": {"devices": {"results": results, "config": config}}},
    }))
    .unwrap()
}

/// A claim whose every result was allocated with `adminAccess`.
pub fn admin_claim(uid: &str, name: &str, results: &[(&str, &str)]) -> ResourceClaim {
    let mut claim = claim(uid, name, results);
    let devices = claim
        .status
        .as_mut()
        .and_then(|s| s.allocation.as_mut())
        .and_then(|a| a.devices.as_mut())
        .unwrap();
    for result in devices.results.iter_mut().flatten() {
        result.admin_access = Some(true);
    }
    claim
}

pub fn claim_ref(uid: &str, name: &str) -> ClaimRef {
    ClaimRef {
        namespace: "default".into(),
        uid: uid.into(),
        name: name.into(),
    }
}

/// `claim` reserved for `pods` (its `status.reservedFor`, as the scheduler writes it).
pub fn reserved_for(mut claim: ResourceClaim, pods: &[&str]) -> ResourceClaim {
    let entries = pods
        .iter()
        .map(|pod| json!({"resource": "pods", "name": pod, "uid": format!("uid-of-{pod}")}))
        .collect::<Vec<_>>();
    let status = claim.status.get_or_insert_with(Default::default);
    status.reserved_for = Some(serde_json::from_value(json!(entries)).unwrap());
    claim
}
