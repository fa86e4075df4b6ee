//! The `MigPolicy` custom resource: which nodes offer which profiles, whether whole GPUs are
//! offered, and in which order devices are published (the only lever against fragmentation,
//! because the scheduler takes the first device that fits).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::profile::{ProfileName, ProfileVariant};

/// Spec of a [`MigPolicy`].
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "gpu.migdra.dev",
    version = "v1alpha1",
    kind = "MigPolicy",
    plural = "migpolicies",
    shortname = "migp",
    printcolumn = r#"{"name":"Priority","type":"integer","jsonPath":".spec.priority"}"#,
    printcolumn = r#"{"name":"Order","type":"string","jsonPath":".spec.deviceOrder"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct MigPolicySpec {
    /// Nodes the policy applies to. Absent or empty selects every node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,
    /// When several policies select a node, the highest priority wins; ties go to the
    /// alphabetically first name.
    #[serde(default)]
    pub priority: i32,
    /// Profiles to offer. Each entry is an exact profile name (`3g.40gb`, `1g.10gb+me`) or a
    /// slice class (`1g`, `3g`, `1g+me`) that matches every profile of that size and variant.
    /// Empty offers every profile the GPU supports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub profiles: Vec<String>,
    /// Profiles never to offer, in the same syntax.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exclude_profiles: Vec<String>,
    /// Offer whole GPUs (default true). Narrows what `migMode` offers: `false` leaves out every
    /// whole GPU, and is refused together with `migMode: Whole`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub whole_gpus: Option<bool>,
    /// Offer MIG partitions (default true). Narrows what `migMode` offers: `false` leaves out
    /// every partition, and is refused together with `migMode: Mig`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<bool>,
    /// Which MIG mode the selected nodes' MIG-capable GPUs are used in (see [`MigMode`]).
    /// Absent: the controller's default (`--default-mig-mode`, `Current` unless set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_mode: Option<MigMode>,
    /// Order of the published devices (default `Packed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_order: Option<DeviceOrder>,
    /// What to do with the devices of an unhealthy GPU (default `Omit`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unhealthy_gpus: Option<UnhealthyGpus>,
    /// Shared partitions (opt-in; needs DRAConsumableCapacity, beta and on from Kubernetes
    /// 1.36). The MIG devices of the listed profiles are published with
    /// `allowMultipleAllocations: true` and a `shares` capacity, so several claims can hold
    /// one MIG instance at once, each taking shares of it. The instance is created at the
    /// first prepare and destroyed after the last claim releases it. Absent: every device is
    /// exclusive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing: Option<SharingSpec>,
}

/// Which MIG devices are shared, and into how many shares.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SharingSpec {
    /// Profiles whose devices are shared, in the syntax of `profiles` (`1g.10gb`, `1g`,
    /// `1g+me`). They must also be offered (see `profiles` and `excludeProfiles`). Whole GPUs
    /// are never shared.
    pub profiles: Vec<String>,
    /// The value of each shared device's `shares` capacity (default 4, at most 64). A claim
    /// takes one share unless it asks for more with `capacity.requests: {shares: N}` (the
    /// request policy is default 1, valid range 1 to `shares` in steps of 1); the scheduler
    /// lets claims onto a device as long as their shares add up to at most this. Shares only
    /// divide the scheduler's view: the processes on one MIG instance share its memory and
    /// compute without isolation between them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 64))]
    pub shares: Option<u32>,
}

/// Shares of a shared device when the policy does not say.
pub const DEFAULT_SHARES: u32 = 4;
/// Most shares a shared device may have.
pub const MAX_SHARES: u32 = 64;

/// How a MIG-capable GPU is used, and so what it offers. A GPU without MIG is offered whole
/// in every mode (unless `wholeGpus: false`): it has no mode to choose.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum MigMode {
    /// Each GPU is used in the mode it is in: with MIG on it offers partitions, with MIG off
    /// it is offered whole. The plugin never switches a mode, so other clients holding the
    /// GPU (dcgm-exporter, nv-hostengine, nvidia-persistenced) never fail a claim.
    #[default]
    Current,
    /// Partitions only. A GPU with MIG off offers nothing until an admin (or mig-parted)
    /// turns MIG on.
    Mig,
    /// Whole GPUs only. A GPU with MIG on offers nothing until MIG is turned off.
    Whole,
    /// Both, switching the mode at prepare: the first partition on a GPU with MIG off turns
    /// it on, a whole GPU on an empty GPU with MIG on turns it off. Only GPUs whose mode the
    /// plugin reports switchable (Hopper and later, no process listed on them) offer the
    /// devices a switch would serve. A switch that another client blocks fails the claim.
    Dynamic,
}

/// How devices are ordered in the pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum DeviceOrder {
    /// Fill one GPU before the next; within a GPU, smaller profiles first; each profile's
    /// placements that use a memory slice smaller profiles cannot (slice 7 on 8-slice GPUs)
    /// first, then ascending start, so partly used blocks fill before new ones are broken.
    #[default]
    Packed,
    /// Profile-table order and ascending placement start, GPU by GPU: what plain iteration
    /// gives. Kept as the baseline the packing simulation compares against.
    Naive,
    /// Spread across GPUs: the same per-GPU order as `Packed`, but interleaved so consecutive
    /// claims land on different GPUs (less contention per GPU, more fragmentation).
    Spread,
}

/// What happens to the devices of an unhealthy GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum UnhealthyGpus {
    /// Leave them out of the pool.
    #[default]
    Omit,
    /// Publish them with a `NoSchedule` taint (needs the DRADeviceTaints feature).
    Taint,
}

/// One entry of a profile list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProfileMatcher {
    /// An exact name.
    Exact(ProfileName),
    /// Every profile with this many compute slices and this variant.
    Class {
        compute_slices: u32,
        variant: ProfileVariant,
    },
}

/// A profile-list entry that parses as neither form.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid profile entry {0:?}: use a profile name such as 3g.40gb or a class such as 3g or 1g+me")]
pub struct InvalidProfileMatcher(pub String);

impl ProfileMatcher {
    /// Parses `3g.40gb`, `1g.10gb+me`, `3g` or `1g+me`.
    pub fn parse(s: &str) -> Result<Self, InvalidProfileMatcher> {
        if let Ok(name) = s.parse::<ProfileName>() {
            return Ok(Self::Exact(name));
        }
        // A class is a name without the memory part: reuse the name parser with a dummy size.
        let (g, suffix) = s
            .split_once('g')
            .ok_or_else(|| InvalidProfileMatcher(s.to_string()))?;
        let probe = format!("{g}g.1gb{suffix}");
        let name = probe
            .parse::<ProfileName>()
            .map_err(|_| InvalidProfileMatcher(s.to_string()))?;
        Ok(Self::Class {
            compute_slices: name.compute_slices,
            variant: name.variant,
        })
    }

    /// True when `profile` matches.
    pub fn matches(&self, profile: &ProfileName) -> bool {
        match self {
            Self::Exact(name) => name == profile,
            Self::Class {
                compute_slices,
                variant,
            } => profile.compute_slices == *compute_slices && profile.variant == *variant,
        }
    }
}

/// The settings that apply to one node, after defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EffectivePolicy {
    pub name: Option<String>,
    /// Offered profiles (empty = all).
    pub profiles: Vec<ProfileMatcher>,
    pub exclude_profiles: Vec<ProfileMatcher>,
    pub whole_gpus: bool,
    pub mig: bool,
    pub mig_mode: MigMode,
    pub device_order: DeviceOrder,
    pub unhealthy_gpus: UnhealthyGpus,
    /// Shared profiles (empty: nothing is shared).
    pub shared_profiles: Vec<ProfileMatcher>,
    pub shares: u32,
    /// Publish the `memory` counter although it never refuses an allocation, for quota
    /// systems that charge claims by it (Kueue's counter-based quota). Cluster-wide, from the
    /// controller's `--keep-memory-counter`; no MigPolicy sets it.
    pub keep_memory_counter: bool,
}

impl Default for EffectivePolicy {
    fn default() -> Self {
        Self {
            name: None,
            profiles: Vec::new(),
            exclude_profiles: Vec::new(),
            whole_gpus: true,
            mig: true,
            mig_mode: MigMode::default(),
            device_order: DeviceOrder::default(),
            unhealthy_gpus: UnhealthyGpus::default(),
            shared_profiles: Vec::new(),
            shares: DEFAULT_SHARES,
            keep_memory_counter: false,
        }
    }
}

impl EffectivePolicy {
    /// True when the policy offers `profile`.
    pub fn offers(&self, profile: &ProfileName) -> bool {
        self.mig
            && (self.profiles.is_empty() || self.profiles.iter().any(|m| m.matches(profile)))
            && !self.exclude_profiles.iter().any(|m| m.matches(profile))
    }

    /// The `shares` capacity of `profile`'s devices when the policy shares them; `None` for
    /// exclusive devices.
    pub fn shares_of(&self, profile: &ProfileName) -> Option<u32> {
        self.shared_profiles
            .iter()
            .any(|m| m.matches(profile))
            .then_some(self.shares)
    }
}

/// Why a policy cannot be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("MigPolicy {policy}: {source}")]
    Profile {
        policy: String,
        #[source]
        source: InvalidProfileMatcher,
    },
    #[error("MigPolicy {policy}: sharing.shares is {shares}, but must be between 1 and {MAX_SHARES}")]
    Shares { policy: String, shares: u32 },
    #[error("MigPolicy {policy}: invalid nodeSelector: {reason}")]
    Selector { policy: String, reason: String },
    #[error(
        "MigPolicy {policy}: migMode {mode:?} with {field}: false would offer nothing on MIG-capable GPUs"
    )]
    ModeOffersNothing {
        policy: String,
        mode: MigMode,
        field: &'static str,
    },
}

impl MigPolicy {
    fn policy_name(&self) -> String {
        self.metadata.name.clone().unwrap_or_default()
    }

    /// True when the policy's selector matches `labels`.
    pub fn selects(&self, labels: &BTreeMap<String, String>) -> Result<bool, PolicyError> {
        match &self.spec.node_selector {
            None => Ok(true),
            Some(selector) => {
                label_selector_matches(selector, labels).map_err(|reason| PolicyError::Selector {
                    policy: self.policy_name(),
                    reason,
                })
            }
        }
    }

    /// The effective settings of this policy; `default_mig_mode` applies when it names no
    /// `migMode`.
    pub fn effective(&self, default_mig_mode: MigMode) -> Result<EffectivePolicy, PolicyError> {
        let parse = |entries: &[String]| {
            entries
                .iter()
                .map(|e| ProfileMatcher::parse(e))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|source| PolicyError::Profile {
                    policy: self.policy_name(),
                    source,
                })
        };
        let defaults = EffectivePolicy::default();
        let sharing = self.spec.sharing.clone().unwrap_or_default();
        let shares = sharing.shares.unwrap_or(defaults.shares);
        if !(1..=MAX_SHARES).contains(&shares) {
            return Err(PolicyError::Shares {
                policy: self.policy_name(),
                shares,
            });
        }
        let whole_gpus = self.spec.whole_gpus.unwrap_or(defaults.whole_gpus);
        let mig = self.spec.mig.unwrap_or(defaults.mig);
        let mig_mode = self.spec.mig_mode.unwrap_or(default_mig_mode);
        let contradiction = match self.spec.mig_mode {
            Some(MigMode::Mig) if !mig => Some("mig"),
            Some(MigMode::Whole) if !whole_gpus => Some("wholeGpus"),
            _ => None,
        };
        if let Some(field) = contradiction {
            return Err(PolicyError::ModeOffersNothing {
                policy: self.policy_name(),
                mode: mig_mode,
                field,
            });
        }
        Ok(EffectivePolicy {
            name: Some(self.policy_name()),
            profiles: parse(&self.spec.profiles)?,
            exclude_profiles: parse(&self.spec.exclude_profiles)?,
            whole_gpus,
            mig,
            mig_mode,
            device_order: self.spec.device_order.unwrap_or(defaults.device_order),
            unhealthy_gpus: self.spec.unhealthy_gpus.unwrap_or(defaults.unhealthy_gpus),
            shared_profiles: parse(&sharing.profiles)?,
            shares,
            keep_memory_counter: defaults.keep_memory_counter,
        })
    }
}

/// Picks the policy for a node: among the policies whose selector matches, the highest
/// priority, then the first name. No match gives the defaults with `default_mig_mode`. A
/// policy with an invalid
/// selector or profile list is an error for every node it could apply to, rather than being
/// silently skipped (which would publish a different set of devices than the admin asked).
pub fn policy_for_node<'a>(
    policies: impl IntoIterator<Item = &'a MigPolicy>,
    labels: &BTreeMap<String, String>,
    default_mig_mode: MigMode,
) -> Result<EffectivePolicy, PolicyError> {
    let mut matching: Vec<&MigPolicy> = Vec::new();
    for policy in policies {
        if policy.selects(labels)? {
            matching.push(policy);
        }
    }
    let best = matching
        .into_iter()
        .min_by(|a, b| (b.spec.priority, a.policy_name()).cmp(&(a.spec.priority, b.policy_name())));
    best.map_or_else(
        || {
            Ok(EffectivePolicy {
                mig_mode: default_mig_mode,
                ..EffectivePolicy::default()
            })
        },
        |p| p.effective(default_mig_mode),
    )
}

/// Evaluates a Kubernetes label selector (matchLabels AND matchExpressions).
pub fn label_selector_matches(
    selector: &LabelSelector,
    labels: &BTreeMap<String, String>,
) -> Result<bool, String> {
    for (key, value) in selector.match_labels.iter().flatten() {
        if labels.get(key) != Some(value) {
            return Ok(false);
        }
    }
    for expr in selector.match_expressions.iter().flatten() {
        let values = expr.values.as_deref().unwrap_or_default();
        let present = labels.get(&expr.key);
        let ok = match expr.operator.as_str() {
            op @ ("In" | "NotIn") if values.is_empty() => {
                return Err(format!("operator {op} on {} needs values", expr.key));
            }
            "In" => present.is_some_and(|v| values.contains(v)),
            "NotIn" => present.is_none_or(|v| !values.contains(v)),
            "Exists" => present.is_some(),
            "DoesNotExist" => present.is_none(),
            other => return Err(format!("unknown operator {other}")),
        };
        if !ok {
            return Ok(false);
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    use super::*;

    fn policy(name: &str, priority: i32, selector: Option<LabelSelector>) -> MigPolicy {
        let mut p = MigPolicy::new(
            name,
            MigPolicySpec {
                priority,
                node_selector: selector,
                ..Default::default()
            },
        );
        p.spec.profiles = vec!["3g".into()];
        p
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn matchers() {
        let m = ProfileMatcher::parse("1g+me").unwrap();
        assert!(m.matches(&"1g.10gb+me".parse().unwrap()));
        assert!(!m.matches(&"1g.10gb".parse().unwrap()));
        let exact = ProfileMatcher::parse("3g.40gb").unwrap();
        assert!(exact.matches(&"3g.40gb".parse().unwrap()));
        assert!(!exact.matches(&"3g.20gb".parse().unwrap()));
        for bad in ["", "g", "3", "3x", "3g.", "1g+xx", "foo"] {
            assert!(ProfileMatcher::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn highest_priority_matching_policy_wins() {
        let sel = |k: &str, op: &str, v: &[&str]| LabelSelector {
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: k.into(),
                operator: op.into(),
                values: Some(v.iter().map(|s| s.to_string()).collect()),
            }]),
            ..Default::default()
        };
        let policies = [
            policy("b-all", 0, None),
            policy("a-h100", 10, Some(sel("gpu", "In", &["h100"]))),
            policy("c-h100", 10, Some(sel("gpu", "In", &["h100"]))),
            policy("z-a100", 20, Some(sel("gpu", "In", &["a100"]))),
        ];
        assert_eq!(
            policy_for_node(&policies, &labels(&[("gpu", "h100")]), MigMode::Current)
                .unwrap()
                .name
                .as_deref(),
            Some("a-h100")
        );
        assert_eq!(
            policy_for_node(&policies, &labels(&[]), MigMode::Current)
                .unwrap()
                .name
                .as_deref(),
            Some("b-all")
        );
        assert_eq!(
            policy_for_node(&policies[1..2], &labels(&[]), MigMode::Current).unwrap(),
            EffectivePolicy::default()
        );
        let broken = policy("x", 0, Some(sel("gpu", "In", &[])));
        assert!(policy_for_node([&broken], &labels(&[]), MigMode::Current).is_err());
    }

    #[test]
    fn selector_operators() {
        let req = |op: &str, values: Option<Vec<String>>| LabelSelector {
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "k".into(),
                operator: op.into(),
                values,
            }]),
            ..Default::default()
        };
        let with = labels(&[("k", "v")]);
        let without = labels(&[]);
        assert!(label_selector_matches(&req("Exists", None), &with).unwrap());
        assert!(!label_selector_matches(&req("Exists", None), &without).unwrap());
        assert!(label_selector_matches(&req("DoesNotExist", None), &without).unwrap());
        assert!(label_selector_matches(&req("NotIn", Some(vec!["x".into()])), &with).unwrap());
        assert!(!label_selector_matches(&req("NotIn", Some(vec!["v".into()])), &with).unwrap());
        assert!(label_selector_matches(&req("Bogus", None), &with).is_err());
        let ml = LabelSelector {
            match_labels: Some(labels(&[("k", "v")])),
            ..Default::default()
        };
        assert!(label_selector_matches(&ml, &with).unwrap());
        assert!(!label_selector_matches(&ml, &without).unwrap());
    }

    #[test]
    fn sharing_is_opt_in_per_profile_and_bounded() {
        let g1: ProfileName = "1g.10gb".parse().unwrap();
        let g3: ProfileName = "3g.40gb".parse().unwrap();
        let mut p = policy("share", 0, None);
        assert_eq!(
            p.effective(MigMode::default()).unwrap().shares_of(&g1),
            None,
            "nothing shared by default"
        );
        p.spec.sharing = Some(SharingSpec {
            profiles: vec!["1g".into()],
            shares: None,
        });
        let effective = p.effective(MigMode::default()).unwrap();
        assert_eq!(effective.shares_of(&g1), Some(DEFAULT_SHARES));
        assert_eq!(effective.shares_of(&g3), None);
        for (shares, ok) in [(0, false), (1, true), (MAX_SHARES, true), (MAX_SHARES + 1, false)] {
            p.spec.sharing = Some(SharingSpec {
                profiles: vec!["1g.10gb".into()],
                shares: Some(shares),
            });
            match p.effective(MigMode::default()) {
                Ok(e) => {
                    assert!(ok, "{shares} accepted");
                    assert_eq!(e.shares_of(&g1), Some(shares));
                }
                Err(e) => {
                    assert!(!ok, "{shares} refused: {e}");
                    assert!(matches!(e, PolicyError::Shares { .. }));
                }
            }
        }
        p.spec.sharing = Some(SharingSpec {
            profiles: vec!["9x".into()],
            shares: Some(2),
        });
        assert!(matches!(
            p.effective(MigMode::default()),
            Err(PolicyError::Profile { .. })
        ));
        let yaml: MigPolicySpec =
            serde_json::from_str(r#"{"sharing":{"profiles":["1g.10gb"],"shares":3}}"#).unwrap();
        assert_eq!(
            yaml.sharing,
            Some(SharingSpec {
                profiles: vec!["1g.10gb".into()],
                shares: Some(3)
            })
        );
    }

    #[test]
    fn offers_respects_lists_and_mig_switch() {
        let mut p = EffectivePolicy::default();
        let g1: ProfileName = "1g.10gb".parse().unwrap();
        assert!(p.offers(&g1));
        p.exclude_profiles = vec![ProfileMatcher::parse("1g").unwrap()];
        assert!(!p.offers(&g1));
        p.exclude_profiles.clear();
        p.profiles = vec![ProfileMatcher::parse("3g").unwrap()];
        assert!(!p.offers(&g1));
        assert!(p.offers(&"3g.40gb".parse().unwrap()));
        p.mig = false;
        assert!(!p.offers(&"3g.40gb".parse().unwrap()));
    }

    #[test]
    fn mig_mode_defaults_and_contradictions() {
        // A policy from before migMode: still valid, the booleans still narrow, and the mode
        // is the controller's default.
        let old: MigPolicySpec = serde_json::from_str(r#"{"wholeGpus":false,"mig":true}"#).unwrap();
        let old = MigPolicy::new("old", old);
        for default in [MigMode::Current, MigMode::Dynamic] {
            let e = old.effective(default).unwrap();
            assert_eq!((e.mig_mode, e.whole_gpus, e.mig), (default, false, true));
        }
        let named: MigPolicySpec = serde_json::from_str(r#"{"migMode":"Whole"}"#).unwrap();
        let named = MigPolicy::new("whole", named);
        assert_eq!(
            named.effective(MigMode::Dynamic).unwrap().mig_mode,
            MigMode::Whole
        );
        assert!(serde_json::from_str::<MigPolicySpec>(r#"{"migMode":"sometimes"}"#).is_err());
        // No match: the default mode.
        assert_eq!(
            policy_for_node([&named][..0].iter().copied(), &labels(&[]), MigMode::Dynamic)
                .unwrap()
                .mig_mode,
            MigMode::Dynamic
        );
        for (mode, spec, field) in [
            (MigMode::Mig, r#"{"migMode":"Mig","mig":false}"#, "mig"),
            (
                MigMode::Whole,
                r#"{"migMode":"Whole","wholeGpus":false}"#,
                "wholeGpus",
            ),
        ] {
            let p = MigPolicy::new("p", serde_json::from_str(spec).unwrap());
            let err = p.effective(MigMode::Current).unwrap_err();
            assert_eq!(
                err,
                PolicyError::ModeOffersNothing {
                    policy: "p".into(),
                    mode,
                    field
                }
            );
            assert!(err.to_string().contains(&format!("{field}: false")), "{err}");
        }
        // The same booleans with the other modes are fine.
        let p = MigPolicy::new(
            "p",
            serde_json::from_str(r#"{"migMode":"Dynamic","mig":false}"#).unwrap(),
        );
        assert!(!p.effective(MigMode::Current).unwrap().mig);
    }
}
