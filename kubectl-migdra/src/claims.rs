//! The claims view: every ResourceClaim of the driver's devices with its pods, its devices and
//! its state: `Pending` (not allocated), `Allocated` (the scheduler chose devices, the plugin
//! has not prepared them), `Prepared` (the plugin's `Ready` condition in `status.devices`, or,
//! where the plugin writes no status, a pod using the claim is running, which the kubelet
//! allows only after a successful prepare) and `Failed` (a `Ready` condition that is false,
//! or the newest of the kubelet's `FailedPrepareDynamicResources` events on a pod of the claim,
//! which carry the plugin's message, and the plugin's own Warning events on the claim).

use k8s_openapi::{
    api::{core::v1::Event, resource::v1::ResourceClaim},
    jiff::Timestamp,
};
use migdra_api::device_name::DeviceName;
use serde::Serialize;

use crate::{
    VIEW_API_VERSION,
    snapshot::Snapshot,
    usage::{
        ObjectRef, PodUse, ReadyCondition, Usage, allocation_results, claim_names, device_status, mig_uuid,
        ready_condition,
    },
};

/// Reason of the kubelet's event when a DRA driver's prepare fails.
pub const FAILED_PREPARE_REASON: &str = "FailedPrepareDynamicResources";

/// The claims of one namespace, or of all.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimsView {
    pub api_version: String,
    pub kind: String,
    /// Claims by namespace and name.
    pub claims: Vec<ClaimRow>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum ClaimState {
    Pending,
    /// Allocated, not prepared.
    Allocated,
    /// Prepared by the plugin.
    Prepared,
    /// Prepare failed.
    Failed,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimRow {
    pub namespace: String,
    pub name: String,
    pub state: ClaimState,
    /// The node whose pool the devices come from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The driver's allocated devices.
    pub devices: Vec<ClaimDevice>,
    pub pods: Vec<PodUse>,
    /// The failure message (Failed), or the plugin's `Ready` message.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// One allocated device of a claim.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimDevice {
    pub request: String,
    pub pool: String,
    pub device: String,
    /// MIG profile, for a partition.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    /// Placement start, for a partition.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub start: Option<u32>,
    /// MIG UUID the plugin reported.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mig_uuid: Option<String>,
    /// The plugin's `Ready` condition.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ready: Option<ReadyCondition>,
}

/// The claims of `namespace` (all namespaces when `None`).
pub fn build(snapshot: &Snapshot, namespace: Option<&str>) -> ClaimsView {
    let usage = Usage::build(snapshot);
    let mut claims: Vec<ClaimRow> = snapshot
        .claims
        .iter()
        .filter(|c| namespace.is_none_or(|ns| c.metadata.namespace.as_deref() == Some(ns)))
        .filter_map(|c| claim_row(snapshot, &usage, c))
        .collect();
    claims.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    ClaimsView {
        api_version: VIEW_API_VERSION.into(),
        kind: "Claims".into(),
        claims,
    }
}

fn claim_row(snapshot: &Snapshot, usage: &Usage, claim: &ResourceClaim) -> Option<ClaimRow> {
    let key = ObjectRef::of_claim(claim);
    let allocated = claim.status.as_ref().is_some_and(|s| s.allocation.is_some());
    let devices: Vec<ClaimDevice> = allocation_results(claim)
        .filter(|r| r.driver == snapshot.driver)
        .map(|r| {
            let status = device_status(claim, &r.driver, &r.pool, &r.device);
            let (profile, start) = match r.device.parse::<DeviceName>() {
                Ok(DeviceName::Mig { profile, start, .. }) => (Some(profile.to_string()), Some(start)),
                _ => (None, None),
            };
            ClaimDevice {
                request: r.request.clone(),
                pool: r.pool.clone(),
                device: r.device.clone(),
                profile,
                start,
                mig_uuid: status.and_then(mig_uuid),
                ready: status.and_then(ready_condition),
            }
        })
        .collect();
    if allocated && devices.is_empty() {
        return None; // allocated by other drivers only
    }
    if !allocated && !asks_for_driver(snapshot, claim) {
        return None;
    }
    let pods = usage.pods_of(&key).to_vec();
    let node = devices.first().map(|d| node_of_pool(snapshot, &d.pool));
    let (state, message) = if !allocated {
        (ClaimState::Pending, None)
    } else if let Some(failed) = devices.iter().filter_map(|d| d.ready.as_ref()).find(|r| !r.ready) {
        (
            ClaimState::Failed,
            failed.message.clone().or(failed.reason.clone()),
        )
    } else if devices.iter().all(|d| d.ready.as_ref().is_some_and(|r| r.ready))
        || pods
            .iter()
            .any(|p| p.phase == "Running" || p.phase == "Succeeded")
    {
        let message = devices
            .iter()
            .find_map(|d| d.ready.as_ref().and_then(|r| r.message.clone()));
        (ClaimState::Prepared, message)
    } else if let Some(message) = failure_event(snapshot, &key, &pods) {
        (ClaimState::Failed, Some(message))
    } else {
        (ClaimState::Allocated, None)
    };
    Some(ClaimRow {
        namespace: key.namespace,
        name: key.name,
        state,
        node,
        devices,
        pods,
        message,
    })
}

/// The node of a pool: the GpuNode that publishes it, else the pool name's `<node>/` part.
fn node_of_pool(snapshot: &Snapshot, pool: &str) -> String {
    snapshot
        .gpu_nodes
        .iter()
        .find(|g| crate::snapshot::pool_of(g, &snapshot.driver) == pool)
        .map(|g| crate::snapshot::node_of(g).to_string())
        .unwrap_or_else(|| {
            pool.strip_suffix(&format!("/{}", snapshot.driver))
                .unwrap_or(pool)
                .to_string()
        })
}

/// True when an unallocated claim asks for a DeviceClass of the driver (a class whose CEL
/// selectors name the driver, as the chart's classes do).
fn asks_for_driver(snapshot: &Snapshot, claim: &ResourceClaim) -> bool {
    let quoted = format!("\"{}\"", snapshot.driver);
    let ours = |class: &str| {
        snapshot.device_classes.iter().any(|dc| {
            dc.metadata.name.as_deref() == Some(class)
                && dc
                    .spec
                    .selectors
                    .iter()
                    .flatten()
                    .filter_map(|s| s.cel.as_ref())
                    .any(|cel| cel.expression.contains(&quoted))
        })
    };
    claim
        .spec
        .devices
        .iter()
        .flat_map(|d| d.requests.iter().flatten())
        .any(|r| {
            r.exactly.as_ref().is_some_and(|e| ours(&e.device_class_name))
                || r.first_available
                    .iter()
                    .flatten()
                    .any(|s| ours(&s.device_class_name))
        })
}

/// The newest prepare failure reported for the claim: the kubelet's
/// [`FAILED_PREPARE_REASON`] event on a pod of the claim (a pod with several claims counts
/// only when the message names this claim), or a Warning event the plugin recorded on the
/// claim itself (its message prefixed with the event's reason).
fn failure_event(snapshot: &Snapshot, claim: &ObjectRef, pods: &[PodUse]) -> Option<String> {
    let single_claim = |pod: &PodUse| {
        snapshot
            .pods
            .iter()
            .find(|p| {
                p.metadata.namespace.as_deref() == Some(pod.namespace.as_str())
                    && p.metadata.name.as_deref() == Some(pod.name.as_str())
            })
            .is_none_or(|p| claim_names(p).len() <= 1)
    };
    let on_pod = |e: &Event| {
        let o = &e.involved_object;
        e.reason.as_deref() == Some(FAILED_PREPARE_REASON)
            && o.kind.as_deref() == Some("Pod")
            && pods.iter().any(|p| {
                o.namespace.as_deref() == Some(p.namespace.as_str())
                    && o.name.as_deref() == Some(p.name.as_str())
                    && (single_claim(p) || e.message.as_deref().is_some_and(|m| m.contains(&claim.name)))
            })
    };
    let on_claim = |e: &Event| {
        let o = &e.involved_object;
        e.type_.as_deref() == Some("Warning")
            && o.kind.as_deref() == Some("ResourceClaim")
            && o.namespace.as_deref() == Some(claim.namespace.as_str())
            && o.name.as_deref() == Some(claim.name.as_str())
    };
    snapshot
        .events
        .iter()
        .filter(|e| on_pod(e) || on_claim(e))
        .max_by_key(|e| event_time(e))
        .and_then(|e| {
            let message = e.message.clone()?;
            Some(match e.reason.as_deref() {
                Some(reason) if on_claim(e) && !reason.is_empty() => format!("{reason}: {message}"),
                _ => message,
            })
        })
}

fn event_time(event: &Event) -> Option<Timestamp> {
    event
        .last_timestamp
        .as_ref()
        .map(|t| t.0)
        .or(event.event_time.as_ref().map(|t| t.0))
        .or(event.first_timestamp.as_ref().map(|t| t.0))
        .or(event.metadata.creation_timestamp.as_ref().map(|t| t.0))
}
