//! The controller's part of a GpuNode's status: `status.publication` and the `Published`
//! condition, written with server-side apply under the controller's own field manager so the
//! plugin's `status.plugin` and `status.gpus` are never touched. Patched only on change (and
//! not again while the cache has not caught up with the controller's own last write); the
//! caller may defer a change (see [`update`]).

use std::{collections::HashMap, sync::Mutex};

use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
    jiff::Timestamp,
};
use kube::{
    Api,
    api::{Patch, PatchParams},
};
use migdra_api::inventory::{API_VERSION, GpuNode, GpuNodeStatus, PublicationStatus};
use serde_json::json;

use crate::error::{Error, is_not_found};

pub const FIELD_MANAGER: &str = "migdra-controller";

pub const CONDITION_PUBLISHED: &str = "Published";

/// Condition reasons.
pub mod reason {
    pub const PUBLISHED: &str = "Published";
    /// The plugin is not live; the pool is withdrawn.
    pub const PLUGIN_NOT_READY: &str = "PluginNotReady";
    /// The Node is gone; the pool is withdrawn.
    pub const NODE_NOT_FOUND: &str = "NodeNotFound";
}

/// What the `Published` condition should say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Published {
    /// True when the pool is published as desired.
    pub ok: bool,
    pub reason: String,
    pub message: String,
}

impl Published {
    pub fn yes(message: impl Into<String>) -> Self {
        Self {
            ok: true,
            reason: reason::PUBLISHED.to_string(),
            message: message.into(),
        }
    }

    pub fn no(reason: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            ok: false,
            reason: reason.into(),
            message: message.into(),
        }
    }
}

/// The status the controller wants on a GpuNode.
#[derive(Clone, Debug, PartialEq)]
pub struct DesiredStatus {
    pub publication: PublicationStatus,
    /// `status.conditions[type=Published]`.
    pub condition: Condition,
}

/// Builds the desired status. The condition keeps its `lastTransitionTime` unless its
/// status flips.
pub fn desired_status(
    gpunode: &GpuNode,
    publication: PublicationStatus,
    published: &Published,
    now: Timestamp,
) -> DesiredStatus {
    let status = if published.ok { "True" } else { "False" };
    let existing = current_condition(gpunode.status.as_ref());
    let last_transition_time = match existing {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => Time(now),
    };
    DesiredStatus {
        publication,
        condition: Condition {
            type_: CONDITION_PUBLISHED.to_string(),
            status: status.to_string(),
            reason: published.reason.clone(),
            message: truncate(&published.message, 32 * 1024),
            observed_generation: gpunode.metadata.generation,
            last_transition_time,
        },
    }
}

pub fn current_condition(status: Option<&GpuNodeStatus>) -> Option<&Condition> {
    status?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == CONDITION_PUBLISHED)
}

/// True when two conditions report the same (the transition time aside).
fn same_condition(a: &Condition, b: &Condition) -> bool {
    a.status == b.status
        && a.reason == b.reason
        && a.message == b.message
        && a.observed_generation == b.observed_generation
}

/// True when the GpuNode already shows `desired`.
pub fn is_current(gpunode: &GpuNode, desired: &DesiredStatus) -> bool {
    let status = gpunode.status.as_ref();
    status.and_then(|s| s.publication.as_ref()) == Some(&desired.publication)
        && current_condition(status).is_some_and(|c| same_condition(c, &desired.condition))
}

/// One status write of the controller: over which version of which GpuNode, what it wrote,
/// and the version it produced.
#[derive(Clone, Debug)]
struct Written {
    uid: Option<String>,
    over: Option<String>,
    after: Option<String>,
    status: DesiredStatus,
}

/// The last status the controller wrote to each GpuNode. A reconciliation right after its own
/// write (triggered by the slice events of that write) often still sees the GpuNode before
/// it and would apply the same large status again. The ledger skips exactly that case: the
/// cached GpuNode is the version the last write went over and the wanted status is the one
/// written. Any other version is compared as usual.
#[derive(Debug, Default)]
pub struct StatusLedger(Mutex<HashMap<String, Written>>);

impl StatusLedger {
    /// The controller's last write if it went over this very version of `gpunode`.
    fn written_over(&self, gpunode: &GpuNode) -> Option<Written> {
        let written = crate::lock(&self.0)
            .get(gpunode.metadata.name.as_deref()?)?
            .clone();
        (written.uid == gpunode.metadata.uid
            && written.over.is_some()
            && written.over == gpunode.metadata.resource_version)
            .then_some(written)
    }

    /// The version `gpunode` will have once the cache shows `desired` that the controller
    /// already wrote over this very version of it, if it did.
    pub fn already_written(&self, gpunode: &GpuNode, desired: &DesiredStatus) -> Option<Option<String>> {
        let written = self.written_over(gpunode)?;
        (written.status.publication == desired.publication
            && same_condition(&written.status.condition, &desired.condition))
        .then_some(written.after)
    }

    /// The publication the controller last wrote over this very version of `gpunode`: what
    /// the server shows while the cache still has the version before the write.
    pub fn publication(&self, gpunode: &GpuNode) -> Option<PublicationStatus> {
        self.written_over(gpunode).map(|w| w.status.publication)
    }

    /// Records that `desired` was written over `gpunode` (as cached), producing `after`.
    pub fn record(&self, gpunode: &GpuNode, desired: &DesiredStatus, after: Option<String>) {
        let Some(name) = gpunode.metadata.name.clone() else {
            return;
        };
        let written = Written {
            uid: gpunode.metadata.uid.clone(),
            over: gpunode.metadata.resource_version.clone(),
            after,
            status: desired.clone(),
        };
        crate::lock(&self.0).insert(name, written);
    }

    /// Forgets `node` (its GpuNode is gone).
    pub fn forget(&self, node: &str) {
        crate::lock(&self.0).remove(node);
    }
}

/// What a status update did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StatusUpdate {
    /// Written; the GpuNode's new resourceVersion.
    Written(Option<String>),
    /// Nothing to write: the GpuNode shows it, or will once the cache shows the controller's
    /// last write (whose resulting resourceVersion this is).
    Unchanged(Option<String>),
    /// Not written now: the caller deferred the change. The GpuNode keeps the version it has
    /// (this one).
    Deferred(Option<String>),
    Gone,
}

impl StatusUpdate {
    pub fn wrote(&self) -> bool {
        matches!(self, Self::Written(_))
    }

    /// The resourceVersion the GpuNode has (or will have in the cache) with this status.
    pub fn version(&self) -> Option<&str> {
        match self {
            Self::Written(v) | Self::Unchanged(v) | Self::Deferred(v) => v.as_deref(),
            Self::Gone => None,
        }
    }
}

/// The server-side apply body of a status write.
pub fn apply_body(desired: &DesiredStatus) -> serde_json::Value {
    json!({
        "apiVersion": API_VERSION,
        "kind": "GpuNode",
        "status": {
            "publication": desired.publication,
            "conditions": [desired.condition],
        },
    })
}

/// Writes `desired` unless the GpuNode already shows it, or the controller's last write over
/// this version of it did (see [`StatusLedger`]), or `defer` (asked only when a write would
/// go out, so deferring costs no API call) says it waits. A GpuNode deleted meanwhile is not
/// an error.
pub async fn update(
    api: &Api<GpuNode>,
    ledger: &StatusLedger,
    gpunode: &GpuNode,
    desired: &DesiredStatus,
    defer: impl FnOnce() -> bool,
) -> Result<StatusUpdate, Error> {
    if is_current(gpunode, desired) {
        return Ok(StatusUpdate::Unchanged(gpunode.metadata.resource_version.clone()));
    }
    if let Some(after) = ledger.already_written(gpunode, desired) {
        tracing::trace!("the status wanted is the one written last; the cache has not shown it yet");
        return Ok(StatusUpdate::Unchanged(after));
    }
    if defer() {
        return Ok(StatusUpdate::Deferred(gpunode.metadata.resource_version.clone()));
    }
    let name = gpunode.metadata.name.clone().unwrap_or_default();
    let params = PatchParams::apply(FIELD_MANAGER).force();
    match api
        .patch_status(&name, &params, &Patch::Apply(apply_body(desired)))
        .await
    {
        Ok(stored) => {
            tracing::debug!(node = %name, "wrote GpuNode status");
            let after = stored.metadata.resource_version;
            ledger.record(gpunode, desired, after.clone());
            Ok(StatusUpdate::Written(after))
        }
        Err(e) if is_not_found(&e) => {
            ledger.forget(&name);
            Ok(StatusUpdate::Gone)
        }
        Err(source) => Err(Error::StatusPatch { node: name, source }),
    }
}

/// `s` cut to at most `max` bytes, on a character boundary.
pub(crate) fn truncate(s: &str, max: usize) -> String {
    s[..s.floor_char_boundary(max)].to_string()
}

#[cfg(test)]
mod tests {
    use migdra_api::inventory::GpuNodeSpec;

    use super::*;

    fn gpunode(condition: Option<Condition>, publication: Option<PublicationStatus>) -> GpuNode {
        let mut g = GpuNode::new(
            "n",
            GpuNodeSpec {
                node_name: "n".into(),
                driver: "gpu.migdra.dev".into(),
            },
        );
        g.metadata.generation = Some(1);
        g.status = Some(GpuNodeStatus {
            publication,
            conditions: condition.map(|c| vec![c]),
            ..Default::default()
        });
        g
    }

    fn publication(generation: i64) -> PublicationStatus {
        PublicationStatus {
            pool: "n/gpu.migdra.dev".into(),
            generation,
            slices: 2,
            devices: 10,
            gpus: 1,
            policy: None,
        }
    }

    #[test]
    fn transition_time_moves_only_when_the_status_flips() {
        let t0 = Timestamp::from_second(1_700_000_000).unwrap();
        let t1 = Timestamp::from_second(1_700_000_100).unwrap();
        let fresh = desired_status(&gpunode(None, None), publication(1), &Published::yes("ok"), t0);
        assert_eq!(fresh.condition.last_transition_time, Time(t0));
        assert_eq!(fresh.condition.observed_generation, Some(1));
        let g = gpunode(Some(fresh.condition.clone()), Some(publication(1)));
        assert!(is_current(&g, &fresh));
        let again = desired_status(&g, publication(1), &Published::yes("ok"), t1);
        assert_eq!(again, fresh, "nothing changed: same status, same time");
        let newer = desired_status(&g, publication(2), &Published::yes("ok"), t1);
        assert!(!is_current(&g, &newer));
        assert_eq!(newer.condition.last_transition_time, Time(t0));
        let down = desired_status(&g, publication(1), &Published::no("PluginNotReady", "gone"), t1);
        assert!(!is_current(&g, &down));
        assert_eq!(down.condition.last_transition_time, Time(t1));
        assert_eq!(down.condition.status, "False");
    }

    #[test]
    fn ledger_skips_only_a_repeat_over_the_version_it_wrote_over() {
        let ledger = StatusLedger::default();
        let t0 = Timestamp::from_second(1_700_000_000).unwrap();
        let mut before = gpunode(None, None);
        before.metadata.uid = Some("u1".into());
        before.metadata.resource_version = Some("10".into());
        let wanted = desired_status(&before, publication(2), &Published::yes("ok"), t0);
        assert!(!is_current(&before, &wanted));
        assert_eq!(
            ledger.already_written(&before, &wanted),
            None,
            "nothing written yet"
        );
        ledger.record(&before, &wanted, Some("11".into()));
        // The cache still shows version 10: the same status again is skipped, even with a
        // later transition time computed from the stale condition.
        let later = desired_status(
            &before,
            publication(2),
            &Published::yes("ok"),
            t0 + k8s_openapi::jiff::SignedDuration::from_secs(5),
        );
        assert_eq!(ledger.already_written(&before, &later), Some(Some("11".into())));
        // A different status is written.
        let other = desired_status(&before, publication(3), &Published::yes("ok"), t0);
        assert_eq!(ledger.already_written(&before, &other), None);
        let down = desired_status(
            &before,
            publication(2),
            &Published::no("PluginNotReady", "gone"),
            t0,
        );
        assert_eq!(ledger.already_written(&before, &down), None);
        // Another version of the object (someone else wrote, or it was re-created) is compared
        // as usual.
        let mut newer = before.clone();
        newer.metadata.resource_version = Some("12".into());
        assert_eq!(ledger.already_written(&newer, &wanted), None);
        let mut recreated = before.clone();
        recreated.metadata.uid = Some("u2".into());
        assert_eq!(ledger.already_written(&recreated, &wanted), None);
        assert_eq!(ledger.publication(&before), Some(publication(2)));
        assert_eq!(ledger.publication(&newer), None);
        ledger.forget("n");
        assert_eq!(ledger.already_written(&before, &wanted), None);
        assert_eq!(ledger.publication(&before), None);
    }

    #[test]
    fn apply_body_carries_only_the_controllers_fields() {
        let d = desired_status(
            &gpunode(None, None),
            publication(3),
            &Published::yes("ok"),
            Timestamp::UNIX_EPOCH,
        );
        let body = apply_body(&d);
        let status = body["status"].as_object().unwrap();
        assert_eq!(status.len(), 2);
        assert_eq!(body["status"]["publication"]["generation"], 3);
        assert_eq!(body["status"]["conditions"][0]["type"], "Published");
        assert_eq!(body["kind"], "GpuNode");
    }
}
