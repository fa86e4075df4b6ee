//! Who owns the MIG instances of a node whose checkpoint was lost (corrupt, or of a format newer
//! than this binary's): the decision from evidence, without I/O. The driver gathers the evidence
//! and carries the verdicts out ([`crate::driver::OwnershipReport`]).
//!
//! An instance is migdra's only when something migdra wrote names its MIG UUID for a claim
//! ([`Evidence`]): a claim's CDI spec of this boot (the device's UUID variable), or the last
//! inventory the plugin published on its GpuNode (an instance owned by migdra). A MIG UUID is
//! made anew with each instance, so evidence never names an instance made since by someone
//! else at the same place with the same IDs. Anything else is someone else's and left alone.
//!
//! Each claim the evidence names is judged by what the API server says of it now ([`ClaimNow`]).
//! It keeps its instances when it exists with the same UID, is allocated from this node's pool,
//! and every MIG device of its allocation has an instance (with a compute instance) that the
//! evidence gives to it; its record is then rebuilt as prepared, with the IDs NVML reports. An
//! instance no claim keeps is destroyed when every claim named for it certainly owns nothing
//! here now; when one of them could not be read it is left as it is.

use std::collections::{BTreeMap, BTreeSet};

use migdra_api::{device_name::DeviceName, profile::ProfileName};

use crate::{
    checkpoint::{ClaimRecord, ClaimState, DeviceKind, DeviceRecord},
    claims::AllocatedDevice,
    nvml::{ComputeInstanceRecord, GpuInstanceRecord},
};

/// A GPU instance NVML lists on the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeInstance {
    pub gpu_uuid: String,
    pub gpu_minor: u32,
    /// Its profile's name, when the GPU reports the profile ID.
    pub profile: Option<ProfileName>,
    pub gpu_instance: GpuInstanceRecord,
}

impl NodeInstance {
    /// Whether it sits where device `name` is.
    fn is_at(&self, name: &DeviceName) -> bool {
        match name {
            DeviceName::Mig {
                minor,
                profile,
                start,
            } => {
                *minor == self.gpu_minor
                    && Some(*profile) == self.profile
                    && *start == self.gpu_instance.start
            }
            DeviceName::Gpu { .. } => false,
        }
    }
}

/// Where a piece of evidence was read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Source {
    CdiSpec,
    GpuNode,
}

/// Something migdra wrote that says it made an instance for a claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Evidence {
    pub source: Source,
    pub claim_uid: String,
    /// `(namespace, name)` of the claim, when the source names them.
    pub claim: Option<(String, String)>,
    /// The MIG UUID of the instance's compute instance.
    pub mig_uuid: String,
}

impl Evidence {
    fn names(&self, instance: &NodeInstance) -> bool {
        let cis = &instance.gpu_instance.compute_instances;
        cis.iter().any(|ci| ci.mig_uuid == self.mig_uuid)
    }
}

/// What the API server says now of a claim the evidence names.
#[derive(Clone, Debug, PartialEq)]
pub enum ClaimNow {
    /// It exists with the evidence's UID and is allocated from this node's pool: its devices of
    /// this driver there.
    Allocated {
        namespace: String,
        name: String,
        devices: Vec<AllocatedDevice>,
    },
    /// It owns nothing here any more; why, for people.
    Gone(String),
    /// It could not be read, or its name is not known: nothing follows.
    Unknown(String),
}

/// What becomes of one instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Owned by these claims (UIDs), whose records are rebuilt.
    Keep { claims: Vec<String> },
    /// migdra made it and none of the claims named for it owns it now: `(UID, why)` of each.
    Destroy { claims: Vec<(String, String)> },
    /// Nothing says migdra made it: left alone.
    Foreign,
    /// A claim named for it could not be read: left alone for now.
    Undecided { reason: String },
}

/// The verdicts and what the driver records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// One per instance, in the order given.
    pub verdicts: Vec<Verdict>,
    /// The rebuilt records (prepared) of the claims that keep instances, by UID.
    pub records: BTreeMap<String, ClaimRecord>,
    /// The named claims that certainly own nothing here now, by UID, with why.
    pub not_owners: BTreeMap<String, String>,
}

/// How one named claim was judged.
enum Judged {
    Keeps(ClaimRecord, BTreeSet<usize>),
    NotOwner(String),
    Unknown(String),
}

/// Decides the fate of every instance from the evidence and the claims' state now. `claims`
/// has an entry for every claim UID the evidence names (a missing one counts as unknown);
/// `gpus` maps this node's GPU minors to their UUIDs.
pub fn decide(
    instances: &[NodeInstance],
    evidence: &[Evidence],
    claims: &BTreeMap<String, ClaimNow>,
    gpus: &BTreeMap<u32, String>,
) -> Decision {
    let named: Vec<BTreeSet<&str>> = instances
        .iter()
        .map(|i| {
            evidence
                .iter()
                .filter(|e| e.names(i))
                .map(|e| e.claim_uid.as_str())
                .collect()
        })
        .collect();
    let uids: BTreeSet<&str> = named.iter().flatten().copied().collect();
    let judged: BTreeMap<&str, Judged> = uids
        .iter()
        .map(|uid| {
            let judged = match claims.get(*uid) {
                None => Judged::Unknown("the claim's name is not known".into()),
                Some(ClaimNow::Unknown(why)) => Judged::Unknown(why.clone()),
                Some(ClaimNow::Gone(why)) => Judged::NotOwner(why.clone()),
                Some(ClaimNow::Allocated {
                    namespace,
                    name,
                    devices,
                }) => rebuild(uid, namespace, name, devices, instances, &named, evidence, gpus),
            };
            (*uid, judged)
        })
        .collect();

    let verdicts = named
        .iter()
        .enumerate()
        .map(|(i, names)| {
            if names.is_empty() {
                return Verdict::Foreign;
            }
            let keepers: Vec<String> = names
                .iter()
                .filter(|uid| matches!(judged.get(**uid), Some(Judged::Keeps(_, held)) if held.contains(&i)))
                .map(|uid| uid.to_string())
                .collect();
            if !keepers.is_empty() {
                return Verdict::Keep { claims: keepers };
            }
            let mut claims = Vec::new();
            for uid in names {
                match judged.get(*uid) {
                    Some(Judged::NotOwner(why)) => claims.push((uid.to_string(), why.clone())),
                    Some(Judged::Keeps(..)) => claims.push((
                        uid.to_string(),
                        "the claim is allocated other devices here".to_string(),
                    )),
                    Some(Judged::Unknown(why)) => {
                        return Verdict::Undecided {
                            reason: format!("claim {uid}: {why}"),
                        };
                    }
                    None => {}
                }
            }
            Verdict::Destroy { claims }
        })
        .collect();

    let mut records = BTreeMap::new();
    let mut not_owners = BTreeMap::new();
    for (uid, judged) in judged {
        match judged {
            Judged::Keeps(record, _) => {
                records.insert(uid.to_string(), record);
            }
            Judged::NotOwner(why) => {
                not_owners.insert(uid.to_string(), why);
            }
            Judged::Unknown(_) => {}
        }
    }
    Decision {
        verdicts,
        records,
        not_owners,
    }
}

/// The prepared record of claim `uid` allocated `devices`, when every MIG device has an instance
/// the evidence gives to this claim; else why it owns nothing here.
#[allow(clippy::too_many_arguments)]
fn rebuild(
    uid: &str,
    namespace: &str,
    name: &str,
    devices: &[AllocatedDevice],
    instances: &[NodeInstance],
    named: &[BTreeSet<&str>],
    evidence: &[Evidence],
    gpus: &BTreeMap<u32, String>,
) -> Judged {
    if devices.is_empty() || devices.iter().any(|d| d.admin_access) {
        return Judged::NotOwner("the claim holds no MIG instance here".into());
    }
    let mut held = BTreeSet::new();
    let mut records = Vec::with_capacity(devices.len());
    for device in devices {
        let minor = device.name.minor();
        let Some(gpu_uuid) = gpus.get(&minor) else {
            return Judged::NotOwner(format!("its device {} is on no GPU of this node", device.device));
        };
        let kind = match device.name {
            DeviceName::Gpu { .. } => DeviceKind::Gpu,
            DeviceName::Mig { .. } => {
                let found = instances.iter().enumerate().find(|(j, instance)| {
                    instance.is_at(&device.name)
                        && named[*j].contains(uid)
                        && !instance.gpu_instance.compute_instances.is_empty()
                });
                let Some((j, instance)) = found else {
                    return Judged::NotOwner(format!(
                        "its device {} has no complete instance migdra made for it (the prepare did not finish)",
                        device.device
                    ));
                };
                held.insert(j);
                let gi = &instance.gpu_instance;
                let ci = compute_instance_of(uid, instance, evidence);
                DeviceKind::Mig {
                    profile_id: gi.profile_id,
                    start: gi.start,
                    size: gi.size,
                    gpu_instance: Some(gi.id),
                    compute_instance: Some(ci.id),
                    mig_uuid: Some(ci.mig_uuid.clone()),
                }
            }
        };
        records.push(DeviceRecord {
            request: device.request.clone(),
            pool: device.pool.clone(),
            device: device.device.clone(),
            gpu_uuid: gpu_uuid.clone(),
            gpu_minor: minor,
            kind,
            env: device.config.env.clone(),
            share_id: device.share_id.clone(),
        });
    }
    let record = ClaimRecord {
        namespace: namespace.to_string(),
        name: name.to_string(),
        state: ClaimState::PrepareCompleted,
        devices: records,
    };
    Judged::Keeps(record, held)
}

/// The compute instance of `instance` that claim `uid`'s evidence names by MIG UUID, else the
/// first (migdra creates one, spanning the GPU instance). The caller checked there is one.
fn compute_instance_of<'a>(
    uid: &str,
    instance: &'a NodeInstance,
    evidence: &[Evidence],
) -> &'a ComputeInstanceRecord {
    let cis = &instance.gpu_instance.compute_instances;
    let named = cis.iter().find(|ci| {
        evidence
            .iter()
            .any(|e| e.claim_uid == uid && e.mig_uuid == ci.mig_uuid)
    });
    named.unwrap_or(&cis[0])
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::checkpoint::AllocationEntry;

    const PROFILES: [&str; 3] = ["1g.10gb", "2g.20gb", "3g.40gb"];

    fn profile(p: usize) -> ProfileName {
        PROFILES[p].parse().unwrap()
    }

    fn instance(minor: u32, p: usize, start: u32, id: u32, with_ci: bool) -> NodeInstance {
        NodeInstance {
            gpu_uuid: format!("GPU-{minor}"),
            gpu_minor: minor,
            profile: Some(profile(p)),
            gpu_instance: GpuInstanceRecord {
                id,
                profile_id: 10 + p as u32,
                start,
                size: 1 + p as u32,
                compute_instances: if with_ci {
                    vec![ComputeInstanceRecord {
                        id: 0,
                        profile_id: 0,
                        mig_uuid: format!("MIG-{minor}-{id}"),
                    }]
                } else {
                    Vec::new()
                },
            },
        }
    }

    fn mig_device(instance: &NodeInstance, request: &str) -> AllocatedDevice {
        let name = DeviceName::Mig {
            minor: instance.gpu_minor,
            profile: instance.profile.unwrap(),
            start: instance.gpu_instance.start,
        };
        AllocatedDevice {
            request: request.into(),
            pool: "node/gpu.migdra.dev".into(),
            device: name.to_string(),
            name,
            config: Default::default(),
            share_id: None,
            admin_access: false,
        }
    }

    fn by_uuid(uid: &str, instance: &NodeInstance) -> Evidence {
        Evidence {
            source: Source::CdiSpec,
            claim_uid: uid.into(),
            claim: Some(("ns".into(), format!("c-{uid}"))),
            mig_uuid: instance.gpu_instance.compute_instances[0].mig_uuid.clone(),
        }
    }

    fn gpus() -> BTreeMap<u32, String> {
        (0..2).map(|m| (m, format!("GPU-{m}"))).collect()
    }

    fn allocated(uid: &str, devices: Vec<AllocatedDevice>) -> ClaimNow {
        ClaimNow::Allocated {
            namespace: "ns".into(),
            name: format!("c-{uid}"),
            devices,
        }
    }

    #[test]
    fn kept_deleted_and_hand_made_instances() {
        let kept = instance(0, 2, 0, 2, true);
        let deleted = instance(0, 0, 4, 9, true);
        let hand_made = instance(1, 0, 6, 7, true);
        let instances = [kept.clone(), deleted.clone(), hand_made];
        let published = Evidence {
            source: Source::GpuNode,
            claim: None,
            ..by_uuid("uid-b", &deleted)
        };
        let evidence = [by_uuid("uid-a", &kept), published];
        let claims = BTreeMap::from([
            (
                "uid-a".to_string(),
                allocated("uid-a", vec![mig_device(&kept, "gpu")]),
            ),
            ("uid-b".to_string(), ClaimNow::Gone("not found".into())),
        ]);
        let decision = decide(&instances, &evidence, &claims, &gpus());
        assert_eq!(
            decision.verdicts,
            [
                Verdict::Keep {
                    claims: vec!["uid-a".into()]
                },
                Verdict::Destroy {
                    claims: vec![("uid-b".into(), "not found".into())]
                },
                Verdict::Foreign,
            ]
        );
        let record = &decision.records["uid-a"];
        assert_eq!(record.state, ClaimState::PrepareCompleted);
        assert_eq!(
            (record.namespace.as_str(), record.name.as_str()),
            ("ns", "c-uid-a")
        );
        assert_eq!(
            record.devices[0].kind,
            DeviceKind::Mig {
                profile_id: 12,
                start: 0,
                size: 3,
                gpu_instance: Some(2),
                compute_instance: Some(0),
                mig_uuid: Some("MIG-0-2".into()),
            }
        );
        assert!(record.made_for([mig_device(&kept, "gpu")].iter().map(AllocationEntry::from)));
        assert_eq!(decision.not_owners.keys().collect::<Vec<_>>(), ["uid-b"]);
    }

    #[test]
    fn an_unreadable_claim_leaves_its_instance_and_a_partial_prepare_is_not_kept() {
        let a = instance(0, 0, 0, 1, true);
        let b = instance(1, 0, 0, 1, false);
        let evidence = [by_uuid("uid-a", &a), by_uuid("uid-x", &a)];
        let claims = BTreeMap::from([
            ("uid-a".to_string(), ClaimNow::Gone("replaced".into())),
            ("uid-x".to_string(), ClaimNow::Unknown("API down".into())),
        ]);
        let decision = decide(std::slice::from_ref(&a), &evidence, &claims, &gpus());
        assert!(
            matches!(&decision.verdicts[0], Verdict::Undecided { reason } if reason.contains("API down")),
            "{:?}",
            decision.verdicts
        );
        // Two devices, the second has no instance: not kept, the first destroyed.
        let evidence = [by_uuid("uid-a", &a)];
        let claims = BTreeMap::from([(
            "uid-a".to_string(),
            allocated("uid-a", vec![mig_device(&a, "x"), mig_device(&b, "y")]),
        )]);
        let decision = decide(&[a, b], &evidence, &claims, &gpus());
        assert!(decision.records.is_empty());
        assert!(
            matches!(&decision.verdicts[0], Verdict::Destroy { claims } if claims[0].1.contains("did not finish")),
            "{:?}",
            decision.verdicts
        );
        assert_eq!(decision.verdicts[1], Verdict::Foreign);
    }

    #[derive(Clone, Debug)]
    enum Now {
        Owns(Vec<usize>),
        Gone,
        Unknown,
    }

    fn arb_case() -> impl Strategy<Value = (Vec<NodeInstance>, Vec<(usize, usize)>, Vec<Now>)> {
        let instances = proptest::collection::vec((0u32..2, 0usize..3, 0u32..4, any::<bool>()), 0..6)
            .prop_map(|raw| {
                raw.into_iter()
                    .enumerate()
                    .map(|(id, (minor, p, start, ci))| instance(minor, p, start, id as u32, ci))
                    .collect::<Vec<_>>()
            });
        instances.prop_flat_map(|instances| {
            let n = instances.len().max(1);
            let evidence = proptest::collection::vec((0usize..4, 0..n), 0..8);
            let claims = proptest::collection::vec(
                prop_oneof![
                    proptest::collection::vec(0..n, 1..3).prop_map(Now::Owns),
                    Just(Now::Gone),
                    Just(Now::Unknown),
                ],
                4,
            );
            (Just(instances), evidence, claims)
        })
    }

    proptest! {
        #[test]
        fn never_touches_what_no_evidence_names_and_keeps_only_what_a_claim_owns(
            (instances, evidence, claims) in arb_case()
        ) {
            let uid = |c: usize| format!("uid-{c}");
            let evidence: Vec<Evidence> = evidence
                .iter()
                .filter(|(_, i)| *i < instances.len())
                .filter_map(|(c, i)| {
                    let ci = instances[*i].gpu_instance.compute_instances.first()?;
                    Some(Evidence {
                        source: Source::GpuNode,
                        claim_uid: uid(*c),
                        claim: None,
                        mig_uuid: ci.mig_uuid.clone(),
                    })
                })
                .collect();
            let now: BTreeMap<String, ClaimNow> = claims
                .iter()
                .enumerate()
                .map(|(c, now)| {
                    let state = match now {
                        Now::Owns(held) => allocated(
                            &uid(c),
                            held.iter()
                                .filter(|i| **i < instances.len())
                                .map(|i| mig_device(&instances[*i], &format!("r{i}")))
                                .collect(),
                        ),
                        Now::Gone => ClaimNow::Gone("gone".into()),
                        Now::Unknown => ClaimNow::Unknown("unreadable".into()),
                    };
                    (uid(c), state)
                })
                .collect();
            let decision = decide(&instances, &evidence, &now, &gpus());
            prop_assert_eq!(decision.verdicts.len(), instances.len());
            for (i, verdict) in decision.verdicts.iter().enumerate() {
                let named: BTreeSet<&str> = evidence
                    .iter()
                    .filter(|e| e.names(&instances[i]))
                    .map(|e| e.claim_uid.as_str())
                    .collect();
                match verdict {
                    Verdict::Foreign => prop_assert!(named.is_empty()),
                    Verdict::Keep { claims } => {
                        for c in claims {
                            prop_assert!(named.contains(c.as_str()));
                            let record = &decision.records[c];
                            let describes = record.devices.iter().any(|d| matches!(d.kind,
                                DeviceKind::Mig { gpu_instance: Some(id), .. } if id == instances[i].gpu_instance.id)
                                && d.gpu_minor == instances[i].gpu_minor);
                            prop_assert!(describes, "{:?} does not describe instance {}", record, i);
                        }
                    }
                    Verdict::Destroy { claims } => {
                        prop_assert!(!named.is_empty());
                        prop_assert_eq!(claims.len(), named.len());
                        for c in named {
                            prop_assert!(!matches!(now[c], ClaimNow::Unknown(_)), "an unreadable claim's instance destroyed");
                        }
                    }
                    Verdict::Undecided { .. } => {
                        prop_assert!(named.iter().any(|c| matches!(now[*c], ClaimNow::Unknown(_))));
                    }
                }
            }
            // Every kept record describes instances that exist, were named for it, and are kept.
            for (c, record) in &decision.records {
                let allocated = matches!(now[c], ClaimNow::Allocated { .. });
                prop_assert!(allocated);
                for device in &record.devices {
                    let DeviceKind::Mig { gpu_instance: Some(id), mig_uuid: Some(uuid), .. } = &device.kind else {
                        prop_assert!(false, "a MIG device without IDs: {:?}", device);
                        continue;
                    };
                    let i = instances
                        .iter()
                        .position(|x| x.gpu_minor == device.gpu_minor && x.gpu_instance.id == *id);
                    prop_assert!(i.is_some());
                    let i = i.unwrap_or_default();
                    prop_assert!(instances[i].gpu_instance.compute_instances.iter().any(|ci| ci.mig_uuid == *uuid));
                    let kept = matches!(&decision.verdicts[i], Verdict::Keep { claims } if claims.contains(c));
                    prop_assert!(kept);
                }
            }
        }
    }
}
