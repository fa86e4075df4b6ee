//! Recovery of a lost checkpoint: when the checkpoint was unreadable (or missing) at start, the
//! records of the claims prepared on this boot are rebuilt from what survives, so their MIG
//! instances are neither leaked nor taken from running pods. The evidence is gathered here (the
//! claims' CDI specs of this boot, the inventory the plugin last published on its GpuNode, the
//! claims as the API server has them now, NVML's instances); [`crate::ownership::decide`] judges
//! each instance; the verdicts are carried out under the node lock and the GPUs' locks.

use std::collections::BTreeMap;

use kube::runtime::events::EventType;
use migdra_api::inventory::{GpuInventory, InstanceOwner};

use super::{Driver, DriverError, RecoveryEvent, uuid_variable};
use crate::{
    checkpoint::{ClaimRecord, ClaimState, DeviceKind, DeviceRecord},
    claims::{self, ClaimError, ClaimSource},
    ownership::{self, ClaimNow, Decision, Evidence, NodeInstance, Source, Verdict},
};

/// What the recovery of a lost checkpoint did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OwnershipReport {
    /// Claims still allocated here whose records were rebuilt (their instances kept), by UID.
    pub kept: Vec<String>,
    /// Instances destroyed, as `GPU <minor> GI <id> (claim <uid>: why)`.
    pub destroyed: Vec<String>,
    /// Instances nothing names as migdra's, left untouched.
    pub foreign: usize,
    /// Instances left as they are because their fate could not be decided or carried out, with
    /// why (they count as foreign until a later start decides).
    pub undecided: Vec<String>,
}

impl OwnershipReport {
    /// Whether any instance of migdra's was found (kept, destroyed or left undecided).
    pub fn acted(&self) -> bool {
        !(self.kept.is_empty() && self.destroyed.is_empty() && self.undecided.is_empty())
    }

    /// A sentence for people.
    pub fn summary(&self) -> String {
        let mut note = format!(
            "the checkpoint was lost; recovered from CDI specs, the published inventory and the claims: {} claim(s) kept with their instances, {} instance(s) destroyed (no claim owns them now), {} foreign instance(s) untouched",
            self.kept.len(),
            self.destroyed.len(),
            self.foreign
        );
        if !self.undecided.is_empty() {
            note.push_str(&format!(
                ", {} instance(s) left undecided: {}",
                self.undecided.len(),
                self.undecided.join("; ")
            ));
        }
        note
    }
}

impl RecoveryEvent {
    /// The event for a recovered checkpoint: Warning when instances were left undecided.
    pub fn lost_checkpoint(report: &OwnershipReport) -> Self {
        let type_ = if report.undecided.is_empty() {
            EventType::Normal
        } else {
            EventType::Warning
        };
        Self {
            type_,
            reason: "CheckpointRecovered",
            note: report.summary(),
        }
    }
}

/// The node as found: its instances, its GPUs' UUIDs by minor, and the evidence on disk.
struct Found {
    instances: Vec<NodeInstance>,
    gpus: BTreeMap<u32, String>,
    evidence: Vec<Evidence>,
}

impl<C: ClaimSource> Driver<C> {
    /// Rebuilds the records a lost checkpoint held (see the module doc), when the checkpoint was
    /// unreadable or missing at start; `None` otherwise. `published` is the inventory of this
    /// node's GpuNode status (empty when it could not be read). Call it after
    /// [`Driver::start`] and before serving the kubelet.
    pub async fn recover_lost_records(
        &self,
        published: &[GpuInventory],
    ) -> Result<Option<OwnershipReport>, DriverError> {
        if !self.inner.records_lost {
            return Ok(None);
        }
        let driver = self.clone();
        let found = tokio::task::spawn_blocking(move || driver.find_instances())
            .await
            .map_err(|e| DriverError::Task(e.to_string()))??;
        let mut evidence = found.evidence;
        evidence.extend(published_evidence(published));
        let mut names: BTreeMap<&str, &(String, String)> = BTreeMap::new();
        for e in &evidence {
            if let Some(claim) = &e.claim {
                names.entry(e.claim_uid.as_str()).or_insert(claim);
            }
        }
        let mut now = BTreeMap::new();
        for uid in evidence.iter().map(|e| e.claim_uid.as_str()) {
            if now.contains_key(uid) {
                continue;
            }
            let state = match names.get(uid) {
                Some((namespace, name)) => self.claim_now(uid, namespace, name).await,
                None => ClaimNow::Unknown("no record names the claim's namespace and name".into()),
            };
            now.insert(uid.to_string(), state);
        }
        let decision = ownership::decide(&found.instances, &evidence, &now, &found.gpus);
        let driver = self.clone();
        let instances = found.instances;
        let report = tokio::task::spawn_blocking(move || driver.carry_out(&instances, decision))
            .await
            .map_err(|e| DriverError::Task(e.to_string()))??;
        tracing::info!(?report, "{}", report.summary());
        Ok(Some(report))
    }

    /// Lists every GPU's instances and reads this boot's claim CDI specs, under the node lock.
    /// Blocking.
    fn find_instances(&self) -> Result<Found, DriverError> {
        let node = self.node_lock()?;
        let descriptions = self.backend().discover()?;
        let locks = node.lock_gpus(&self.inner.gpus, descriptions.iter().map(|d| d.minor));
        let mut instances = Vec::new();
        let mut gpus = BTreeMap::new();
        for (minor, view) in locks.views(&self.inner.gpus) {
            gpus.insert(minor, view.description.uuid.clone());
            let profiles = view
                .description
                .mig
                .as_ref()
                .map(|m| m.profiles.as_slice())
                .unwrap_or_default();
            for gi in view.instances? {
                instances.push(NodeInstance {
                    gpu_uuid: view.description.uuid.clone(),
                    gpu_minor: minor,
                    profile: profiles
                        .iter()
                        .find(|p| p.gi_profile_id == gi.profile_id)
                        .map(|p| p.name),
                    gpu_instance: gi,
                });
            }
        }
        let specs = self.inner.cdi.claim_specs_of_this_boot().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "cannot read the claims' CDI specs; deciding from the published inventory alone");
            Vec::new()
        });
        let evidence = specs
            .into_iter()
            .flat_map(|spec| {
                let uid = spec.uid;
                let claim = spec.claim;
                spec.devices.into_iter().filter_map(move |(device, env)| {
                    let mig_uuid = env
                        .get(&uuid_variable(&device))
                        .filter(|u| u.starts_with("MIG-"))?;
                    Some(Evidence {
                        source: Source::CdiSpec,
                        claim_uid: uid.clone(),
                        claim: claim.clone(),
                        mig_uuid: mig_uuid.clone(),
                    })
                })
            })
            .collect();
        Ok(Found {
            instances,
            gpus,
            evidence,
        })
    }

    /// What the API server says of claim `namespace/name` with UID `uid` now.
    async fn claim_now(&self, uid: &str, namespace: &str, name: &str) -> ClaimNow {
        let get = self.inner.claims.get(namespace, name);
        let found = match tokio::time::timeout(super::stale_gc::GET_TIMEOUT, get).await {
            Err(_) => {
                return ClaimNow::Unknown(format!("reading ResourceClaim {namespace}/{name} timed out"));
            }
            Ok(Err(e)) => return ClaimNow::Unknown(format!("reading ResourceClaim {namespace}/{name}: {e}")),
            Ok(Ok(None)) => return ClaimNow::Gone("the ResourceClaim no longer exists".into()),
            Ok(Ok(Some(found))) => found,
        };
        let driver = &self.inner.config.driver_name;
        match claims::allocated_devices(&found, uid, driver, self.pool()) {
            Ok(devices) if devices.is_empty() => {
                ClaimNow::Gone("the ResourceClaim is not allocated from this node's pool".into())
            }
            Ok(devices) => ClaimNow::Allocated {
                namespace: namespace.to_string(),
                name: name.to_string(),
                devices,
            },
            Err(
                e @ (ClaimError::Replaced { .. }
                | ClaimError::NotAllocated { .. }
                | ClaimError::OtherPool { .. }),
            ) => ClaimNow::Gone(e.to_string()),
            Err(e) => ClaimNow::Unknown(e.to_string()),
        }
    }

    /// Carries out the verdicts under the node lock and the GPUs' locks: rebuilds the kept claims'
    /// records and CDI specs, destroys the instances no claim owns (each recorded first, so a
    /// crash is repaired like an unprepare), removes the CDI specs of claims that own nothing
    /// here. An instance that changed since it was judged, or that another plugin instance
    /// recorded meanwhile, is left. Blocking.
    fn carry_out(
        &self,
        instances: &[NodeInstance],
        decision: Decision,
    ) -> Result<OwnershipReport, DriverError> {
        let node = self.node_lock()?;
        let locks = node.lock_gpus(&self.inner.gpus, instances.iter().map(|i| i.gpu_minor));
        let mut report = OwnershipReport::default();
        // Judged against the node as it is now, before anything is recorded or destroyed.
        let records = self.inner.journal.claims();
        let present: Vec<bool> = instances
            .iter()
            .map(|instance| {
                let listed = locks
                    .index(instance.gpu_minor)
                    .and_then(|index| self.backend().list_gpu_instances(index).ok())
                    .unwrap_or_default();
                let recorded = records.values().flat_map(|r| &r.devices).any(|d| {
                    d.gpu_minor == instance.gpu_minor
                        && matches!(d.kind, DeviceKind::Mig { start, profile_id, .. }
                            if (profile_id, start) == (instance.gpu_instance.profile_id, instance.gpu_instance.start))
                });
                !recorded && listed.contains(&instance.gpu_instance)
            })
            .collect();
        let mut failed_claims: BTreeMap<String, String> = BTreeMap::new();
        for (uid, record) in &decision.records {
            let kept_here =
                |i: usize| matches!(&decision.verdicts[i], Verdict::Keep { claims } if claims.contains(uid));
            if let Some(i) = (0..instances.len()).find(|i| kept_here(*i) && !present[*i]) {
                failed_claims.insert(
                    uid.clone(),
                    format!("{} changed while it was judged", describe(&instances[i])),
                );
                continue;
            }
            let restored = self
                .inner
                .journal
                .restore(uid, record)
                .map_err(super::ClaimFailure::from)
                .and_then(|()| self.write_cdi(uid, record));
            match restored {
                Ok(()) => {
                    tracing::info!(claim = %record.key(), %uid, devices = ?record.device_names(), "the claim is still allocated here; kept its instances and recorded it again");
                    report.kept.push(uid.clone());
                }
                Err(e) => {
                    tracing::error!(claim = %record.key(), %uid, error = %e, "cannot record a claim that keeps its instances; they stay unrecorded");
                    failed_claims.insert(uid.clone(), e.to_string());
                }
            }
        }
        for (i, (instance, verdict)) in instances.iter().zip(&decision.verdicts).enumerate() {
            let outcome = match verdict {
                Verdict::Foreign => {
                    report.foreign += 1;
                    "foreign"
                }
                Verdict::Undecided { reason } => {
                    tracing::warn!(instance = %describe(instance), %reason, "cannot tell whether a claim still owns this instance; leaving it until a later start");
                    report.undecided.push(format!("{}: {reason}", describe(instance)));
                    "undecided"
                }
                Verdict::Keep { claims } => match claims.iter().find_map(|c| failed_claims.get(c)) {
                    Some(error) => {
                        report.undecided.push(format!("{}: {error}", describe(instance)));
                        "failed"
                    }
                    None => "kept",
                },
                Verdict::Destroy { claims } => {
                    let why = claims
                        .iter()
                        .map(|(uid, why)| format!("claim {uid}: {why}"))
                        .collect::<Vec<_>>()
                        .join(", ");
                    if !present[i] {
                        report
                            .undecided
                            .push(format!("{}: changed while it was judged", describe(instance)));
                        "failed"
                    } else {
                        match self.destroy_unowned(&locks, i, instance) {
                            Ok(()) => {
                                tracing::info!(instance = %describe(instance), %why, "destroyed an instance migdra made that no claim owns now");
                                report.destroyed.push(format!("{} ({why})", describe(instance)));
                                "destroyed"
                            }
                            Err(e) => {
                                tracing::error!(instance = %describe(instance), error = %e, "destroying an instance no claim owns failed");
                                report.undecided.push(format!("{}: {e}", describe(instance)));
                                "failed"
                            }
                        }
                    }
                }
            };
            self.inner.metrics.lost_record_instance(outcome);
        }
        for uid in decision.not_owners.keys() {
            if let Err(e) = self.inner.cdi.remove_claim_spec(uid) {
                tracing::warn!(%uid, error = %e, "cannot remove the CDI spec of a claim that owns nothing here");
            }
        }
        self.inner.metrics.observe_claims(&self.inner.journal.claims());
        Ok(report)
    }

    /// Destroys an instance no claim owns through a record of its own (`UnprepareStarted`, so a
    /// crash is finished like an unprepare). When even that record cannot be written (a
    /// read-only state directory) it is destroyed without one: the evidence still names it.
    fn destroy_unowned(
        &self,
        locks: &crate::gpus::GpuLocks<'_>,
        i: usize,
        instance: &NodeInstance,
    ) -> Result<(), super::ClaimFailure> {
        let gi = &instance.gpu_instance;
        let uid = format!("lost-record-{}-{}-{i}", instance.gpu_uuid, gi.id);
        let device = instance.profile.map_or_else(
            || format!("gpu-{}-gi-{}", instance.gpu_minor, gi.id),
            |profile| {
                migdra_api::device_name::DeviceName::Mig {
                    minor: instance.gpu_minor,
                    profile,
                    start: gi.start,
                }
                .to_string()
            },
        );
        let record = ClaimRecord {
            namespace: String::new(),
            name: uid.clone(),
            state: ClaimState::UnprepareStarted,
            devices: vec![DeviceRecord {
                request: String::new(),
                pool: self.pool().to_string(),
                device,
                gpu_uuid: instance.gpu_uuid.clone(),
                gpu_minor: instance.gpu_minor,
                kind: DeviceKind::Mig {
                    profile_id: gi.profile_id,
                    start: gi.start,
                    size: gi.size,
                    gpu_instance: Some(gi.id),
                    compute_instance: gi.compute_instances.first().map(|ci| ci.id),
                    mig_uuid: gi.compute_instances.first().map(|ci| ci.mig_uuid.clone()),
                },
                env: BTreeMap::new(),
                share_id: None,
            }],
        };
        if let Err(e) = self.inner.journal.restore(&uid, &record) {
            tracing::warn!(error = %e, "cannot record the instance before destroying it; destroying it unrecorded");
        }
        self.tear_down(locks, &uid, &record)
    }
}

/// The published instances migdra owned, by MIG UUID (one made anew with each instance).
fn published_evidence(published: &[GpuInventory]) -> impl Iterator<Item = Evidence> + '_ {
    published
        .iter()
        .filter_map(|gpu| gpu.mig.as_ref())
        .flat_map(|mig| &mig.instances)
        .filter(|i| i.owner == InstanceOwner::Migdra)
        .filter_map(|i| {
            Some(Evidence {
                source: Source::GpuNode,
                claim_uid: i.claim_uid.clone()?,
                claim: i
                    .claim
                    .as_deref()
                    .and_then(|c| c.split_once('/'))
                    .map(|(ns, name)| (ns.to_string(), name.to_string())),
                mig_uuid: i.mig_uuid.clone()?,
            })
        })
}

fn describe(instance: &NodeInstance) -> String {
    let gi = &instance.gpu_instance;
    let profile = instance
        .profile
        .map_or_else(|| format!("profile {}", gi.profile_id), |p| p.to_string());
    format!(
        "GPU {} GI {} ({profile} at {})",
        instance.gpu_minor, gi.id, gi.start
    )
}
