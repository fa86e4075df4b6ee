//! The controller's part of a GpuNode's status: `status.publication` and the `Published`
//! condition, written with server-side apply under the controller's own field manager so the
//! plugin's `status.plugin` and `status.gpus` are never touched. Patched only on change.

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

/// Field manager of every controller write.
pub const FIELD_MANAGER: &str = "migdra-controller";

/// Type of the condition the controller maintains.
pub const CONDITION_PUBLISHED: &str = "Published";

/// Condition reasons.
pub mod reason {
    /// The pool is published.
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
    /// CamelCase reason.
    pub reason: String,
    /// Human-readable message.
    pub message: String,
}

impl Published {
    /// A `True` condition.
    pub fn yes(message: impl Into<String>) -> Self {
        Self {
            ok: true,
            reason: reason::PUBLISHED.to_string(),
            message: message.into(),
        }
    }

    /// A `False` condition.
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
    /// `status.publication`.
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

/// The current `Published` condition.
pub fn current_condition(status: Option<&GpuNodeStatus>) -> Option<&Condition> {
    status?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == CONDITION_PUBLISHED)
}

/// True when the GpuNode already shows `desired`.
pub fn is_current(gpunode: &GpuNode, desired: &DesiredStatus) -> bool {
    let status = gpunode.status.as_ref();
    let publication_ok = status.and_then(|s| s.publication.as_ref()) == Some(&desired.publication);
    let condition_ok = current_condition(status).is_some_and(|c| {
        c.status == desired.condition.status
            && c.reason == desired.condition.reason
            && c.message == desired.condition.message
            && c.observed_generation == desired.condition.observed_generation
    });
    publication_ok && condition_ok
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

/// Writes `desired` unless the GpuNode already shows it. Returns true when it wrote.
/// A GpuNode deleted meanwhile is not an error.
pub async fn update(api: &Api<GpuNode>, gpunode: &GpuNode, desired: &DesiredStatus) -> Result<bool, Error> {
    if is_current(gpunode, desired) {
        return Ok(false);
    }
    let name = gpunode.metadata.name.clone().unwrap_or_default();
    let params = PatchParams::apply(FIELD_MANAGER).force();
    match api
        .patch_status(&name, &params, &Patch::Apply(apply_body(desired)))
        .await
    {
        Ok(_) => {
            tracing::debug!(node = %name, "wrote GpuNode status");
            Ok(true)
        }
        Err(e) if is_not_found(&e) => Ok(false),
        Err(source) => Err(Error::StatusPatch { node: name, source }),
    }
}

/// `s` cut to at most `max` bytes, on a character boundary.
pub(crate) fn truncate(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
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
