//! The status loop: refreshes the inventory and device health every heartbeat interval, and
//! at once when the kubelet's registration state changes or an NVML call becomes overdue or
//! returns; writes the GpuNode status when
//! something in it changed, records events for GPU health changes and startup repairs, and
//! starts the heartbeat Lease's renewal task once the GpuNode exists.

use std::{collections::BTreeMap, time::Duration};

use kube::runtime::events::EventType;
use migdra_api::inventory::GpuInventory;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::{NodeStatusWriter, bounded, lease::LeaseTask, write_bound};
use crate::{
    driver::RecoveryEvent,
    events::{ClaimEvent, ClaimEvents},
    gpus::{Gpus, PendingRepair},
};
use dra_kubelet::{DeviceHealthReport, RegistrationState};

/// The status loop's inputs and outputs; [`Self::run`] runs it.
pub struct StatusLoop {
    pub gpus: Gpus,
    /// Writes the GpuNode and heartbeats; `None` only refreshes the device health.
    pub writer: Option<NodeStatusWriter>,
    /// What startup recovery repaired, recorded once as an event.
    pub recovery_note: Option<String>,
    /// Driver events to record on the GpuNode; kept until it exists.
    pub recovery_events: Option<mpsc::UnboundedReceiver<RecoveryEvent>>,
    pub registration: watch::Receiver<RegistrationState>,
    /// The resource-health stream's device health.
    pub health: watch::Sender<Vec<DeviceHealthReport>>,
    /// The heartbeat: time between refreshes and between Lease renewals.
    pub interval: Duration,
    /// Where events about claims go: a GPU turning unhealthy is also a Warning on each claim
    /// with a device on it; a repair left pending and its completion are events on the claim.
    pub claim_events: ClaimEvents,
}

/// What a GpuNode status write carries; written again only when it differs.
#[derive(PartialEq)]
struct WrittenStatus {
    registration: RegistrationState,
    driver_version: Option<String>,
    gpus: Vec<GpuInventory>,
}

impl StatusLoop {
    /// Runs until `shutdown`; then stops the Lease renewals and reports the plugin as
    /// unregistered so the controller withdraws the pool without waiting for the heartbeat to
    /// go stale. Dropping the future (an aborted task) stops the Lease renewals too.
    pub async fn run(self, shutdown: CancellationToken) {
        let Self {
            gpus,
            mut writer,
            mut recovery_note,
            mut recovery_events,
            mut registration,
            health,
            interval,
            claim_events,
        } = self;
        let driver_version = gpus.backend().driver_version().ok();
        let mut object_ready = false;
        let mut registration_open = true;
        let mut registration_changed = false;
        let mut health_seen: BTreeMap<u32, bool> = BTreeMap::new();
        let mut overruled_seen: BTreeMap<u32, String> = BTreeMap::new();
        let mut repairs_seen = BTreeMap::new();
        let mut last_written: Option<WrittenStatus> = None;
        let mut lease: Option<LeaseTask> = None;
        let mut nvml_changes = gpus.nvml_calls().subscribe();
        loop {
            let beat_started = tokio::time::Instant::now();
            let inventory = refresh(&gpus).await;
            let refresh_took = beat_started.elapsed();
            if let Some(inventory) = &inventory {
                let reports = gpus.device_health(inventory);
                health.send_if_modified(|current| {
                    let changed = *current != reports;
                    if changed {
                        *current = reports;
                    }
                    changed
                });
            }
            // Repairs that became pending or are done: an event on their claim.
            for event in repair_claim_events(&mut repairs_seen, gpus.recovery_pending()) {
                claim_events.send(event);
            }
            // GPU health changes: a Warning on each claim using a GPU that became unhealthy
            // (queued, with or without a GpuNode writer), and an event on the GpuNode.
            let mut health_changes = Vec::new();
            for gpu in inventory.iter().flatten() {
                let before = health_seen.insert(gpu.minor, gpu.health.healthy);
                match (before, gpu.health.healthy) {
                    (Some(true) | None, false) => {
                        let reason = gpu.health.reason.clone().unwrap_or_default();
                        for event in unhealthy_gpu_claim_events(&gpus, gpu, &reason) {
                            claim_events.send(event);
                        }
                        let note = format!("GPU {} ({}) is unhealthy: {reason}", gpu.minor, gpu.uuid);
                        health_changes.push((EventType::Warning, "GpuUnhealthy", note));
                    }
                    (Some(false), true) => {
                        let note = format!("GPU {} ({}) is healthy again", gpu.minor, gpu.uuid);
                        health_changes.push((EventType::Normal, "GpuHealthy", note));
                    }
                    _ => {}
                }
                if let Some(event) = overruled_counters_event(&mut overruled_seen, gpu) {
                    health_changes.push(event);
                }
            }
            if let (Some(writer), Some(inventory)) = (&mut writer, &inventory) {
                if !object_ready {
                    match bounded(
                        write_bound(interval),
                        "creating the GpuNode",
                        writer.ensure_object(),
                    )
                    .await
                    {
                        Some(Ok(())) => object_ready = true,
                        Some(Err(e)) => tracing::warn!(error = %e, "creating the GpuNode failed; retrying"),
                        None => {}
                    }
                }
                let owner = writer.owner();
                if object_ready && lease.as_ref().is_none_or(|l| l.node_uid != owner.uid) {
                    // The Lease's owner is the Node: started once its UID is known, and
                    // restarted (re-applying the Lease) if the Node turned out replaced.
                    lease = Some(LeaseTask::start(
                        writer.lease().clone(),
                        owner,
                        Some(gpus.clone()),
                        &shutdown,
                    ));
                }
                if object_ready {
                    if let Some(note) = recovery_note.take() {
                        let event = writer.event(EventType::Warning, "RecoveredInterruptedOperations", note);
                        bounded(interval, "recording an event", event).await;
                    }
                    while let Some(Ok(event)) = recovery_events.as_mut().map(|e| e.try_recv()) {
                        let event = writer.event(event.type_, event.reason, event.note);
                        bounded(interval, "recording an event", event).await;
                    }
                }
                for (type_, reason, note) in health_changes {
                    bounded(interval, "recording an event", writer.event(type_, reason, note)).await;
                }
                if object_ready {
                    let state = registration.borrow().clone();
                    let content = WrittenStatus {
                        registration: state.clone(),
                        driver_version: driver_version.clone(),
                        gpus: inventory.clone(),
                    };
                    if last_written.as_ref() != Some(&content) {
                        let publish = writer.publish(&state, driver_version.clone(), inventory);
                        match bounded(write_bound(interval), "updating the GpuNode status", publish).await {
                            Some(Ok(())) => last_written = Some(content),
                            Some(Err(e)) => {
                                tracing::warn!(error = %e, "updating the GpuNode status failed; retrying");
                                object_ready = false;
                                last_written = None;
                            }
                            // No answer says nothing about the object: the next beat writes
                            // the status again, without first re-creating the GpuNode (one
                            // more slow write on a server that is already slow).
                            None => last_written = None,
                        }
                    }
                    // A registration change is a heartbeat too: after the kubelet wiped the
                    // node's slices, the controller republishes on the first renewal after.
                    if std::mem::take(&mut registration_changed)
                        && let Some(lease) = &lease
                    {
                        lease.renew_now();
                    }
                }
            }
            let beat_took = beat_started.elapsed();
            if beat_took > interval {
                tracing::warn!(
                    ?interval,
                    refresh = ?refresh_took,
                    api_calls = ?beat_took.saturating_sub(refresh_took),
                    "a status beat took longer than the heartbeat interval; the next one is late"
                );
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(interval) => {}
                // A call became overdue or returned: GPU health changes now.
                _ = nvml_changes.changed() => {}
                changed = registration.changed(), if registration_open => {
                    // A closed channel means the registration server is gone; from then on the
                    // timer alone drives the refreshes.
                    registration_open = changed.is_ok();
                    registration_changed |= registration_open;
                }
            }
        }
        // No renewal after the plugin reported itself gone.
        if let Some(lease) = lease {
            lease.stop().await;
        }
        if let (Some(writer), Some(inventory)) = (&writer, refresh(&gpus).await) {
            let gone = RegistrationState {
                registered: false,
                error: Some("plugin shut down".into()),
            };
            if let Err(e) = writer.publish(&gone, driver_version, &inventory).await {
                tracing::warn!(error = %e, "reporting shutdown in the GpuNode failed");
            }
        }
    }
}

/// The events for repairs that appeared in `now` (pending) or left it (completed) since
/// `seen`, which becomes `now`.
fn repair_claim_events(
    seen: &mut BTreeMap<String, PendingRepair>,
    now: Vec<PendingRepair>,
) -> Vec<ClaimEvent> {
    let now: BTreeMap<String, PendingRepair> = now.into_iter().map(|p| (p.uid.clone(), p)).collect();
    let pending = now
        .iter()
        .filter(|(uid, _)| !seen.contains_key(*uid))
        .filter_map(|(_, p)| ClaimEvent::recovery_pending(p));
    let completed = seen
        .iter()
        .filter(|(uid, _)| !now.contains_key(*uid))
        .filter_map(|(_, p)| ClaimEvent::recovery_completed(p));
    let events = pending.chain(completed).collect();
    *seen = now;
    events
}

/// The Warning for a GPU whose engine counters NVML's placements overrule, once per GPU and
/// reason (`seen` remembers them), also logged.
fn overruled_counters_event(
    seen: &mut BTreeMap<u32, String>,
    gpu: &GpuInventory,
) -> Option<(EventType, &'static str, String)> {
    let why = gpu.mig.as_ref()?.engine_counters_overruled.as_ref()?;
    if seen.get(&gpu.minor) == Some(why) {
        return None;
    }
    seen.insert(gpu.minor, why.clone());
    tracing::warn!(gpu = gpu.minor, uuid = %gpu.uuid, reason = %why, "engine counters overruled by NVML's placements");
    let mut note = format!("GPU {} ({}): {why}", gpu.minor, gpu.uuid);
    // The API server's limit on a note.
    if note.len() > 1024 {
        note.truncate(note.floor_char_boundary(1021));
        note.push_str("...");
    }
    Some((EventType::Warning, "EngineCountersOverruled", note))
}

/// The events for the recorded claims with a device on `gpu`, which became unhealthy.
fn unhealthy_gpu_claim_events(gpus: &Gpus, gpu: &GpuInventory, why: &str) -> Vec<ClaimEvent> {
    gpus.recorded_claims_on(gpu.minor)
        .into_iter()
        .map(|(uid, namespace, name)| {
            ClaimEvent::gpu_unhealthy(namespace, name, uid, gpu.minor, &gpu.uuid, why)
        })
        .collect()
}

/// One inventory, on a blocking thread (NVML calls block); `None` when it failed (logged).
async fn refresh(gpus: &Gpus) -> Option<Vec<GpuInventory>> {
    let gpus = gpus.clone();
    match tokio::task::spawn_blocking(move || gpus.inventory()).await {
        Ok(Ok(inventory)) => Some(inventory),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "GPU discovery failed");
            None
        }
        Err(e) => {
            tracing::error!(error = %e, "inventory task failed");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use migdra_api::catalog;

    use super::*;

    #[test]
    fn overruled_counters_are_reported_once_per_gpu_and_reason() {
        let mut seen = BTreeMap::new();
        let consistent = catalog::model("A100-80GB").unwrap().inventory(0, true);
        assert_eq!(overruled_counters_event(&mut seen, &consistent), None);

        let mut overruled = consistent.clone();
        let mig = overruled.mig.as_mut().unwrap();
        mig.engine_counters_overruled = Some("the decoders counter refuses 4g + 3g".into());
        let (type_, reason, note) = overruled_counters_event(&mut seen, &overruled).unwrap();
        assert_eq!((type_, reason), (EventType::Warning, "EngineCountersOverruled"));
        assert!(
            note.starts_with("GPU 0 (GPU-") && note.ends_with("refuses 4g + 3g"),
            "{note}"
        );
        assert_eq!(overruled_counters_event(&mut seen, &overruled), None, "once");

        let mut other = overruled.clone();
        other.minor = 1;
        assert!(overruled_counters_event(&mut seen, &other).is_some(), "per GPU");
        overruled.mig.as_mut().unwrap().engine_counters_overruled = Some("x".repeat(2000));
        let (_, _, note) = overruled_counters_event(&mut seen, &overruled).unwrap();
        assert_eq!(note.len(), 1024, "cut to the API server's limit");
    }
}
