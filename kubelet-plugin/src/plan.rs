//! Placement planning: what a claim's allocation needs on this node, decided from plain values.
//!
//! [`plan`] takes the allocated devices, the state of the GPUs they are on ([`GpuView`]: the
//! description and the GPU instances that exist, ours or foreign) and the other recorded
//! claims, and returns either a [`Plan`] (the device records to write before creating
//! anything, and the MIG-mode switches needed) or why not ([`Rejection`]). It reads no file,
//! takes no lock and calls no NVML function: the driver gathers the views under the GPU
//! locks, and the tests below build them by hand.
//!
//! A share of a shared device (the allocation carries a share ID) that another claim already
//! holds *joins* its instance: the planned record carries the holder's instance IDs, and
//! nothing is created. Only the first share plans a new instance, like an exclusive device.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use migdra_api::{
    device_name::DeviceName,
    geometry::{MigGeometry, Placement, PlacementError},
    profile::ProfileName,
};

use crate::{
    checkpoint::{ClaimRecord, ClaimState, DeviceKind, DeviceRecord},
    claims::AllocatedDevice,
    nvml::{BackendError, GpuDescription, GpuInstanceRecord},
};

/// One GPU as planning sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuView {
    /// What the GPU is, and its MIG mode.
    pub description: GpuDescription,
    /// The GPU instances on it (empty when MIG is off), or why they could not be listed; the
    /// error fails the plan only when a decision needs the list.
    pub instances: Result<Vec<GpuInstanceRecord>, BackendError>,
}

/// What preparing a claim will do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The claim's devices as they are recorded before anything is created (MIG devices carry
    /// their placement; IDs are filled in as instances are created).
    pub devices: Vec<DeviceRecord>,
    /// GPUs whose MIG mode must be switched first: minor to the mode needed.
    pub mig_mode_changes: BTreeMap<u32, bool>,
}

/// Why a claim cannot be prepared as allocated. The message is what the user sees in the
/// pod's event; [`Rejection::reason`] is the stable label for metrics.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    /// The GPU holds a checkpoint record that recovery could not repair yet; nothing is
    /// created on it until the repair succeeds.
    #[error("device {device}: GPU {minor} is unavailable until recovery of claim {claim} succeeds: {error}")]
    GpuRecoveryPending {
        /// Device name.
        device: String,
        /// GPU minor.
        minor: u32,
        /// The unrepaired claim, `namespace/name`.
        claim: String,
        /// Why its repair failed last.
        error: String,
    },
    /// The GPU is lost (fallen off the bus, or mid reset): NVML cannot reach it, so nothing
    /// is created on it.
    #[error("device {device}: GPU {minor} is lost and cannot be used until it is back: {message}")]
    GpuLost {
        /// Device name.
        device: String,
        /// GPU minor.
        minor: u32,
        /// What NVML said.
        message: String,
    },
    /// The device names a GPU this node does not have.
    #[error("device {device}: this node has no GPU with minor number {minor}")]
    NoSuchGpu {
        /// Device name.
        device: String,
        /// Its GPU minor.
        minor: u32,
    },
    /// A whole GPU allocated after partitions of it.
    #[error("device {device} is GPU {minor} whole, which this claim also allocates partitions of")]
    WholeGpuAlsoPartitioned {
        /// Device name.
        device: String,
        /// GPU minor.
        minor: u32,
    },
    /// A partition of a GPU allocated whole earlier in the claim.
    #[error("device {device} is on GPU {minor}, which this claim also allocates whole")]
    PartitionOfWholeGpu {
        /// Device name.
        device: String,
        /// GPU minor.
        minor: u32,
    },
    /// The same whole GPU twice.
    #[error("device {device} is allocated twice in this claim")]
    DuplicateDevice {
        /// Device name.
        device: String,
    },
    /// Another prepared claim holds the GPU or an overlapping placement.
    #[error(
        "device {device} overlaps device {other_device} already prepared for claim {other_claim} ({other_uid})"
    )]
    InUseByClaim {
        /// Device name.
        device: String,
        /// The other claim's device.
        other_device: String,
        /// The other claim, `namespace/name`.
        other_claim: String,
        /// The other claim's UID.
        other_uid: String,
    },
    /// The same shared device twice in one claim (more shares are asked for with
    /// `capacity.requests`, not with a second device).
    #[error(
        "shared device {device} is allocated twice in this claim; ask for more shares with capacity.requests instead"
    )]
    DuplicateShare {
        /// Device name.
        device: String,
    },
    /// A shared device's instance is held only by claims that are not fully prepared (one is
    /// being rolled back or unprepared): it cannot be joined until that finishes.
    #[error(
        "shared device {device}: its MIG instance is being set up or torn down for claim {holder}; retry once that finishes"
    )]
    SharedInstanceUnsettled {
        /// Device name.
        device: String,
        /// A holder, `namespace/name`.
        holder: String,
    },
    /// The instance the holders of a shared device recorded is gone from the GPU.
    #[error(
        "shared device {device}: MIG instance {gpu_instance} on GPU {minor}, held by claim {holder}, no longer exists"
    )]
    SharedInstanceMissing {
        /// Device name.
        device: String,
        /// GPU minor.
        minor: u32,
        /// Recorded GPU-instance ID.
        gpu_instance: u32,
        /// A holder, `namespace/name`.
        holder: String,
    },
    /// A partition of a GPU that has no MIG.
    #[error("device {device}: GPU {minor} ({product_name}) is not MIG-capable")]
    NotMigCapable {
        /// Device name.
        device: String,
        /// GPU minor.
        minor: u32,
        /// Product name.
        product_name: String,
    },
    /// A profile the GPU does not offer.
    #[error("device {device}: GPU {minor} ({product_name}) has no MIG profile {profile} (it offers {})", offered.join(", "))]
    UnknownProfile {
        /// Device name.
        device: String,
        /// GPU minor.
        minor: u32,
        /// Product name.
        product_name: String,
        /// The profile asked for.
        profile: ProfileName,
        /// The profiles the GPU has.
        offered: Vec<String>,
    },
    /// The placement is not valid on the GPU, or collides with what exists or with another
    /// device of the claim.
    #[error("device {device}: cannot create {profile} at memory slice {start} on GPU {minor}: {cause}")]
    PlacementUnavailable {
        /// Device name.
        device: String,
        /// Profile.
        profile: ProfileName,
        /// Placement start.
        start: u32,
        /// GPU minor.
        minor: u32,
        /// What the geometry says.
        cause: PlacementError,
    },
    /// A whole GPU that carries instances migdra did not create.
    #[error(
        "GPU {minor} has {count} MIG instance(s) that migdra does not own; it cannot be handed out whole"
    )]
    ForeignInstances {
        /// GPU minor.
        minor: u32,
        /// How many instances.
        count: usize,
    },
    /// The MIG-mode switch waited for a GPU reset the driver could not do; it was withdrawn.
    #[error(
        "switching MIG mode on GPU {minor} needs a GPU reset the driver could not do (processes hold the GPU, or it is passed through to a VM); the change was withdrawn"
    )]
    MigModeChangePending {
        /// GPU minor.
        minor: u32,
    },
    /// The GPU vanished between planning and creation.
    #[error("GPU {minor} disappeared")]
    GpuGone {
        /// GPU minor.
        minor: u32,
    },
    /// `adminAccess` to a MIG device: MIG devices exist only once a claim has them created,
    /// so there is nothing to monitor (the chart's admission policy refuses such claims
    /// earlier; this is the plugin's own check).
    #[error(
        "device {device}: adminAccess is only supported for whole GPUs; a MIG device does not exist until a claim without adminAccess has it created (request a whole GPU, device class gpu.migdra.dev, to monitor a GPU and all its MIG instances)"
    )]
    AdminAccessMigDevice {
        /// Device name.
        device: String,
    },
    /// A claim with `adminAccess` devices and ordinary ones of this driver.
    #[error(
        "device {device} is allocated with adminAccess but device {other} of the same claim is not; put the monitoring request in a claim of its own"
    )]
    AdminAccessMixed {
        /// A device with admin access.
        device: String,
        /// A device without.
        other: String,
    },
}

impl Rejection {
    /// A stable CamelCase label of the cause (a bounded set, for metrics).
    pub fn reason(&self) -> &'static str {
        match self {
            Self::GpuRecoveryPending { .. } => "GpuRecoveryPending",
            Self::GpuLost { .. } => "GpuLost",
            Self::NoSuchGpu { .. } => "NoSuchGpu",
            Self::WholeGpuAlsoPartitioned { .. } => "WholeGpuAlsoPartitioned",
            Self::PartitionOfWholeGpu { .. } => "PartitionOfWholeGpu",
            Self::DuplicateDevice { .. } => "DuplicateDevice",
            Self::InUseByClaim { .. } => "InUseByClaim",
            Self::DuplicateShare { .. } => "DuplicateShare",
            Self::SharedInstanceUnsettled { .. } => "SharedInstanceUnsettled",
            Self::SharedInstanceMissing { .. } => "SharedInstanceMissing",
            Self::NotMigCapable { .. } => "NotMigCapable",
            Self::UnknownProfile { .. } => "UnknownProfile",
            Self::PlacementUnavailable { cause, .. } => match cause {
                PlacementError::UnknownProfile(_) | PlacementError::InvalidStart { .. } => "InvalidPlacement",
                PlacementError::Overlap { .. } => "PlacementOverlap",
                PlacementError::InstanceLimit { .. } => "InstanceLimit",
                PlacementError::Budget { .. } => "MigBudgetExceeded",
            },
            Self::ForeignInstances { .. } => "ForeignInstances",
            Self::MigModeChangePending { .. } => "MigModeChangePending",
            Self::GpuGone { .. } => "GpuGone",
            Self::AdminAccessMigDevice { .. } => "AdminAccessMigDevice",
            Self::AdminAccessMixed { .. } => "AdminAccessMixed",
        }
    }
}

/// Why planning failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The allocation cannot be served.
    #[error(transparent)]
    Rejected(#[from] Rejection),
    /// Listing a GPU's instances failed, and the decision needed them.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// Whether a claim is an `adminAccess` claim: `Ok(true)` when every device is allocated with
/// admin access (then only whole GPUs: nothing is planned, created or recorded for it),
/// `Ok(false)` when none is. A MIG device with admin access, or a mix, is refused.
pub fn admin_access(devices: &[AllocatedDevice]) -> Result<bool, Rejection> {
    if let Some(device) = devices
        .iter()
        .find(|d| d.admin_access && matches!(d.name, DeviceName::Mig { .. }))
    {
        return Err(Rejection::AdminAccessMigDevice {
            device: device.device.clone(),
        });
    }
    let admin = devices.iter().find(|d| d.admin_access);
    let ordinary = devices.iter().find(|d| !d.admin_access);
    match (admin, ordinary) {
        (Some(admin), Some(ordinary)) => Err(Rejection::AdminAccessMixed {
            device: admin.device.clone(),
            other: ordinary.device.clone(),
        }),
        (admin, _) => Ok(admin.is_some()),
    }
}

/// Plans a claim's `devices` on `gpus` (by minor), next to the `others` recorded claims
/// (`(uid, record)`, the claim itself excluded). Devices are checked in allocation order;
/// the first problem is returned.
pub fn plan(
    devices: &[AllocatedDevice],
    gpus: &BTreeMap<u32, GpuView>,
    others: &[(String, ClaimRecord)],
) -> Result<Plan, PlanError> {
    let mut records = Vec::with_capacity(devices.len());
    let mut mig_mode_changes = BTreeMap::new();
    // Placements this claim already planned, per GPU, and the GPUs it takes whole.
    let mut planned: HashMap<u32, Vec<Placement>> = HashMap::new();
    let mut whole: BTreeSet<u32> = BTreeSet::new();
    for device in devices {
        let minor = device.name.minor();
        let gpu = gpus.get(&minor).ok_or_else(|| Rejection::NoSuchGpu {
            device: device.device.clone(),
            minor,
        })?;
        let description = &gpu.description;
        let kind = match &device.name {
            DeviceName::Gpu { .. } => {
                if planned.contains_key(&minor) {
                    return Err(Rejection::WholeGpuAlsoPartitioned {
                        device: device.device.clone(),
                        minor,
                    }
                    .into());
                }
                if !whole.insert(minor) {
                    return Err(Rejection::DuplicateDevice {
                        device: device.device.clone(),
                    }
                    .into());
                }
                if let Some((uid, other, d)) = find_other(others, |d| d.gpu_minor == minor) {
                    return Err(in_use(&device.device, d, other, uid).into());
                }
                if check_whole_gpu_usable(gpu)? {
                    mig_mode_changes.insert(minor, false);
                }
                DeviceKind::Gpu
            }
            DeviceName::Mig { profile, start, .. } => {
                let (profile, start) = (*profile, *start);
                let geometry = geometry_of(description).ok_or_else(|| Rejection::NotMigCapable {
                    device: device.device.clone(),
                    minor,
                    product_name: description.product_name.clone(),
                })?;
                let p = geometry
                    .profile_by_name(&profile)
                    .ok_or_else(|| Rejection::UnknownProfile {
                        device: device.device.clone(),
                        minor,
                        product_name: description.product_name.clone(),
                        profile,
                        offered: geometry.profiles.iter().map(|p| p.name.to_string()).collect(),
                    })?;
                if whole.contains(&minor) {
                    return Err(Rejection::PartitionOfWholeGpu {
                        device: device.device.clone(),
                        minor,
                    }
                    .into());
                }
                let size = p.memory_slices;
                if device.share_id.is_some() {
                    if records
                        .iter()
                        .any(|r: &DeviceRecord| r.is_share() && r.device == device.device)
                    {
                        return Err(Rejection::DuplicateShare {
                            device: device.device.clone(),
                        }
                        .into());
                    }
                    if let Some(joined) = join_shared(device, minor, &description.uuid, gpu, others)? {
                        records.push(DeviceRecord {
                            request: device.request.clone(),
                            pool: device.pool.clone(),
                            device: device.device.clone(),
                            gpu_uuid: description.uuid.clone(),
                            gpu_minor: minor,
                            kind: joined,
                            env: device.config.env.clone(),
                            share_id: device.share_id.clone(),
                        });
                        continue;
                    }
                }
                let clash = find_other(others, |d| {
                    d.gpu_minor == minor
                        && match d.kind {
                            DeviceKind::Gpu => true,
                            DeviceKind::Mig {
                                start: s, size: z, ..
                            } => start < s + z && s < start + size,
                        }
                });
                if let Some((uid, other, d)) = clash {
                    return Err(in_use(&device.device, d, other, uid).into());
                }
                let placement = Placement {
                    profile_id: p.gi_profile_id,
                    start,
                };
                let mine = planned.entry(minor).or_default();
                let mut layout: Vec<Placement> = gpu
                    .instances
                    .clone()?
                    .iter()
                    .map(|gi| Placement {
                        profile_id: gi.profile_id,
                        start: gi.start,
                    })
                    .collect();
                layout.extend(mine.iter().copied());
                check_nvml_rules(&geometry, &layout, placement).map_err(|cause| {
                    Rejection::PlacementUnavailable {
                        device: device.device.clone(),
                        profile,
                        start,
                        minor,
                        cause,
                    }
                })?;
                if check_mig_usable(&device.device, description)? {
                    mig_mode_changes.insert(minor, true);
                }
                mine.push(placement);
                DeviceKind::Mig {
                    profile_id: p.gi_profile_id,
                    start,
                    size,
                    gpu_instance: None,
                    compute_instance: None,
                    mig_uuid: None,
                }
            }
        };
        records.push(DeviceRecord {
            request: device.request.clone(),
            pool: device.pool.clone(),
            device: device.device.clone(),
            gpu_uuid: description.uuid.clone(),
            gpu_minor: minor,
            kind,
            env: device.config.env.clone(),
            share_id: device.share_id.clone(),
        });
    }
    Ok(Plan {
        devices: records,
        mig_mode_changes,
    })
}

/// For a share of a shared device: the instance its other holders recorded, when there are
/// any (`None`: this is the first share, which creates the instance). Joining needs a fully
/// prepared holder (a half-prepared or half-unprepared one may not have, or no longer have, a
/// whole instance) and the instance to still be on the GPU.
fn join_shared(
    device: &AllocatedDevice,
    minor: u32,
    gpu_uuid: &str,
    gpu: &GpuView,
    others: &[(String, ClaimRecord)],
) -> Result<Option<DeviceKind>, PlanError> {
    let probe = DeviceRecord {
        request: device.request.clone(),
        pool: device.pool.clone(),
        device: device.device.clone(),
        gpu_uuid: gpu_uuid.to_string(),
        gpu_minor: minor,
        kind: DeviceKind::Gpu,
        env: BTreeMap::new(),
        share_id: device.share_id.clone(),
    };
    let holders: Vec<(&ClaimRecord, &DeviceRecord)> = others
        .iter()
        .flat_map(|(_, r)| r.devices.iter().map(move |d| (r, d)))
        .filter(|(_, d)| d.same_shared_instance(&probe))
        .collect();
    let Some((first, _)) = holders.first() else {
        return Ok(None);
    };
    let settled = holders.iter().find_map(|(r, d)| match &d.kind {
        DeviceKind::Mig {
            gpu_instance: Some(gi),
            compute_instance: Some(_),
            mig_uuid: Some(_),
            ..
        } if r.state == ClaimState::PrepareCompleted => Some((*r, *gi, d.kind.clone())),
        _ => None,
    });
    let Some((holder, gi, kind)) = settled else {
        return Err(Rejection::SharedInstanceUnsettled {
            device: device.device.clone(),
            holder: first.key(),
        }
        .into());
    };
    let instances = gpu.instances.clone()?;
    let exists = match &kind {
        DeviceKind::Mig {
            profile_id, start, ..
        } => instances
            .iter()
            .any(|i| i.id == gi && i.profile_id == *profile_id && i.start == *start),
        DeviceKind::Gpu => false,
    };
    if !exists {
        return Err(Rejection::SharedInstanceMissing {
            device: device.device.clone(),
            minor,
            gpu_instance: gi,
            holder: holder.key(),
        }
        .into());
    }
    Ok(Some(kind))
}

/// Checks what NVML itself enforces when creating a GPU instance, and nothing more: a known
/// profile at one of its placements, no memory-slice overlap, and the profile's instance
/// count (§12 "NVML's placement rule"). The summed engine and memory budgets of
/// [`MigGeometry::check_add`] are the published counters, which are the scheduler's to
/// enforce; prepare must not refuse what NVML would create.
fn check_nvml_rules(
    geometry: &MigGeometry,
    existing: &[Placement],
    new: Placement,
) -> Result<(), PlacementError> {
    match geometry.check_add(existing, new) {
        // `check_add` checks budgets last, so a budget error means every NVML rule passed.
        Err(PlacementError::Budget { .. }) => Ok(()),
        other => other,
    }
}

/// Whether MIG devices can be made on the GPU; `Ok(true)` when MIG must be switched on first.
///
/// Whatever the architecture: whether a switch needs a reset nobody can do is NVML's
/// answer, not the plan's. An idle bare-metal Ampere is reset by the driver itself (§12);
/// only when that fails does the switch stay pending ([`Rejection::MigModeChangePending`]).
fn check_mig_usable(device: &str, gpu: &GpuDescription) -> Result<bool, Rejection> {
    match &gpu.mig {
        Some(mig) if mig.enabled => Ok(false),
        Some(_) => Ok(true),
        None => Err(Rejection::NotMigCapable {
            device: device.to_string(),
            minor: gpu.minor,
            product_name: gpu.product_name.clone(),
        }),
    }
}

/// Whether the GPU can be handed out whole; `Ok(true)` when MIG must be switched off first
/// (as for switching on, NVML says whether that needs a reset it cannot do).
fn check_whole_gpu_usable(gpu: &GpuView) -> Result<bool, PlanError> {
    let description = &gpu.description;
    match &description.mig {
        Some(mig) if mig.enabled => {
            let instances = gpu.instances.clone()?;
            if instances.is_empty() {
                Ok(true)
            } else {
                Err(Rejection::ForeignInstances {
                    minor: description.minor,
                    count: instances.len(),
                }
                .into())
            }
        }
        _ => Ok(false),
    }
}

/// The MIG geometry of a MIG-capable GPU.
pub fn geometry_of(gpu: &GpuDescription) -> Option<MigGeometry> {
    gpu.mig
        .as_ref()
        .map(|m| MigGeometry::new(m.profiles.clone(), gpu.memory_mib))
}

/// Whether the GPU's MIG mode can be switched without a reset. A MIG-capable GPU of an
/// architecture migdra does not know is newer than Ampere (MIG began with Ampere, which
/// migdra knows), so it switches as Hopper and later do.
pub fn mode_switchable(gpu: &GpuDescription) -> bool {
    match gpu.architecture {
        Some(architecture) => architecture.mig_mode_switchable(),
        None => gpu.mig.is_some(),
    }
}

/// The first device of another recorded claim that matches `pred`.
fn find_other(
    others: &[(String, ClaimRecord)],
    pred: impl Fn(&DeviceRecord) -> bool,
) -> Option<(&str, &ClaimRecord, &DeviceRecord)> {
    others
        .iter()
        .find_map(|(uid, r)| r.devices.iter().find(|d| pred(d)).map(|d| (uid.as_str(), r, d)))
}

fn in_use(device: &str, existing: &DeviceRecord, other: &ClaimRecord, uid: &str) -> Rejection {
    Rejection::InUseByClaim {
        device: device.to_string(),
        other_device: existing.device.clone(),
        other_claim: other.key(),
        other_uid: uid.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use migdra_api::{catalog, config::DeviceConfig};

    use super::*;
    use crate::{
        checkpoint::ClaimState,
        nvml::{MigDescription, NvmlErrorKind},
    };

    const POOL: &str = "node/gpu.migdra.dev";
    // Real GPU-instance profile IDs of the 8-slice parts.
    const P_1G: u32 = 19;
    const P_3G: u32 = 9;

    /// GPU `minor` of catalog model `key`; `mig` is the MIG mode (`None`: not MIG-capable).
    fn gpu(minor: u32, key: &str, mig: Option<bool>) -> GpuDescription {
        let model = catalog::model(key).unwrap();
        GpuDescription {
            index: minor,
            minor,
            uuid: model.uuid(minor),
            product_name: model.product_name.to_string(),
            pci_bus_id: None,
            numa_node: None,
            memory_mib: model.memory_mib,
            architecture: Some(model.architecture),
            cuda_compute_capability: None,
            mig: mig.map(|enabled| MigDescription {
                enabled,
                pending_enabled: enabled,
                profiles: model.profiles.clone(),
            }),
        }
    }

    fn instance(id: u32, profile_id: u32, start: u32, size: u32) -> GpuInstanceRecord {
        GpuInstanceRecord {
            id,
            profile_id,
            start,
            size,
            compute_instances: Vec::new(),
        }
    }

    fn view(description: GpuDescription, instances: Vec<GpuInstanceRecord>) -> GpuView {
        GpuView {
            description,
            instances: Ok(instances),
        }
    }

    fn gpus(views: Vec<GpuView>) -> BTreeMap<u32, GpuView> {
        views.into_iter().map(|v| (v.description.minor, v)).collect()
    }

    fn allocated(names: &[&str]) -> Vec<AllocatedDevice> {
        names
            .iter()
            .enumerate()
            .map(|(i, name)| AllocatedDevice {
                request: format!("r{i}"),
                pool: POOL.into(),
                device: name.to_string(),
                name: name.parse().unwrap(),
                config: DeviceConfig::default(),
                share_id: None,
                admin_access: false,
            })
            .collect()
    }

    /// `allocated`, each device a share (share IDs `share-<i>`).
    fn shares(names: &[&str]) -> Vec<AllocatedDevice> {
        let mut devices = allocated(names);
        for (i, d) in devices.iter_mut().enumerate() {
            d.share_id = Some(format!("share-{i}"));
        }
        devices
    }

    /// A claim holding a share of `device` (1g.10gb at `start` on GPU 0 of an H100), in
    /// `state`, with instance IDs when `created`.
    fn holder(uid: &str, state: ClaimState, start: u32, created: bool) -> (String, ClaimRecord) {
        let device = format!("gpu-0-mig-1g10gb-{start}");
        let (_, mut record) = other_mig(P_1G, start, 1, &device);
        record.name = uid.into();
        record.state = state;
        let d = &mut record.devices[0];
        d.share_id = Some(format!("share-of-{uid}"));
        d.gpu_uuid = catalog::model("H100-80GB").unwrap().uuid(0);
        if let DeviceKind::Mig {
            gpu_instance,
            compute_instance,
            mig_uuid,
            ..
        } = &mut d.kind
        {
            *gpu_instance = created.then_some(7);
            *compute_instance = created.then_some(0);
            *mig_uuid = created.then(|| "MIG-shared".to_string());
        }
        (uid.into(), record)
    }

    #[test]
    fn a_share_joins_the_instance_of_a_prepared_holder_and_only_the_first_creates() {
        let device = "gpu-0-mig-1g10gb-6";
        let mig_on = || view(gpu(0, "H100-80GB", Some(true)), vec![instance(7, P_1G, 6, 1)]);
        // First share: planned like an exclusive device, remembered as a share.
        let first = plan(&shares(&[device]), &gpus(vec![h100(Some(true))]), &[]).unwrap();
        assert_eq!(first.devices[0].kind, mig(P_1G, 6, 1));
        assert_eq!(first.devices[0].share_id.as_deref(), Some("share-0"));
        // Second share: the holder's instance, nothing to create.
        let others = [holder("a", ClaimState::PrepareCompleted, 6, true)];
        let joined = plan(&shares(&[device]), &gpus(vec![mig_on()]), &others).unwrap();
        assert_eq!(joined.devices[0].kind, others[0].1.devices[0].kind);
        assert!(joined.mig_mode_changes.is_empty());
        // A half-prepared or half-unprepared holder alone cannot be joined.
        for state in [ClaimState::PrepareStarted, ClaimState::UnprepareStarted] {
            let others = [holder("a", state, 6, true)];
            assert!(
                matches!(
                    plan(&shares(&[device]), &gpus(vec![mig_on()]), &others),
                    Err(PlanError::Rejected(Rejection::SharedInstanceUnsettled { .. }))
                ),
                "{state:?}"
            );
        }
        // ...but next to a prepared one it does not matter.
        let others = [
            holder("a", ClaimState::UnprepareStarted, 6, true),
            holder("b", ClaimState::PrepareCompleted, 6, true),
        ];
        assert!(plan(&shares(&[device]), &gpus(vec![mig_on()]), &others).is_ok());
        // The holders' instance vanished from the GPU.
        let others = [holder("a", ClaimState::PrepareCompleted, 6, true)];
        assert!(matches!(
            plan(&shares(&[device]), &gpus(vec![h100(Some(true))]), &others),
            Err(PlanError::Rejected(Rejection::SharedInstanceMissing {
                gpu_instance: 7,
                ..
            }))
        ));
        // An exclusive allocation of a shared device, or a share next to an exclusive holder of
        // an overlapping placement, is a clash as before.
        assert!(matches!(
            plan(&allocated(&[device]), &gpus(vec![mig_on()]), &others),
            Err(PlanError::Rejected(Rejection::InUseByClaim { .. }))
        ));
        let exclusive = [other_mig(P_3G, 4, 4, "gpu-0-mig-3g40gb-4")];
        assert!(matches!(
            plan(&shares(&[device]), &gpus(vec![h100(Some(true))]), &exclusive),
            Err(PlanError::Rejected(Rejection::InUseByClaim { .. }))
        ));
        // A share of another placement of the same profile is another instance.
        let elsewhere = plan(&shares(&["gpu-0-mig-1g10gb-5"]), &gpus(vec![mig_on()]), &others).unwrap();
        assert_eq!(elsewhere.devices[0].kind, mig(P_1G, 5, 1));
        // One claim, the same shared device twice.
        assert!(matches!(
            plan(&shares(&[device, device]), &gpus(vec![h100(Some(true))]), &[]),
            Err(PlanError::Rejected(Rejection::DuplicateShare { .. }))
        ));
    }

    /// Devices allocated with (`true`) or without admin access.
    fn with_admin(names: &[(&str, bool)]) -> Vec<AllocatedDevice> {
        let plain: Vec<&str> = names.iter().map(|(n, _)| *n).collect();
        allocated(&plain)
            .into_iter()
            .zip(names)
            .map(|(d, (_, admin))| AllocatedDevice {
                admin_access: *admin,
                ..d
            })
            .collect()
    }

    #[test]
    fn admin_access_is_whole_gpus_only_and_never_mixed() {
        // (what, devices, expected: Ok(is admin) or the rejection's reason)
        type Case<'a> = (&'a str, &'a [(&'a str, bool)], Result<bool, &'a str>);
        let cases: &[Case] = &[
            (
                "no admin access",
                &[("gpu-0", false), ("gpu-1-mig-1g10gb-0", false)],
                Ok(false),
            ),
            (
                "two whole GPUs with admin access",
                &[("gpu-0", true), ("gpu-1", true)],
                Ok(true),
            ),
            (
                "a MIG device with admin access",
                &[("gpu-0-mig-1g10gb-0", true)],
                Err("AdminAccessMigDevice"),
            ),
            (
                "a MIG device with admin access next to a whole GPU with it",
                &[("gpu-0", true), ("gpu-1-mig-3g40gb-4", true)],
                Err("AdminAccessMigDevice"),
            ),
            (
                "admin and ordinary",
                &[("gpu-0", true), ("gpu-1", false)],
                Err("AdminAccessMixed"),
            ),
            ("nothing", &[], Ok(false)),
        ];
        for (what, names, expected) in cases {
            let got = admin_access(&with_admin(names)).map_err(|r| r.reason());
            assert_eq!(got, *expected, "{what}");
        }
        let Err(rejection) = admin_access(&with_admin(&[("gpu-0-mig-1g10gb-0", true)])) else {
            panic!("expected a rejection")
        };
        assert!(
            rejection
                .to_string()
                .starts_with("device gpu-0-mig-1g10gb-0: adminAccess is only supported for whole GPUs"),
            "{rejection}"
        );
    }

    /// Another claim, prepared, holding MIG `profile_id` at `start` (size `size`) on GPU 0.
    fn other_mig(profile_id: u32, start: u32, size: u32, device: &str) -> (String, ClaimRecord) {
        other(
            DeviceKind::Mig {
                profile_id,
                start,
                size,
                gpu_instance: Some(1),
                compute_instance: Some(0),
                mig_uuid: Some("MIG-x".into()),
            },
            device,
        )
    }

    fn other(kind: DeviceKind, device: &str) -> (String, ClaimRecord) {
        (
            "uid-other".into(),
            ClaimRecord {
                namespace: "ns".into(),
                name: "other".into(),
                state: ClaimState::PrepareCompleted,
                devices: vec![DeviceRecord {
                    request: "gpu".into(),
                    pool: POOL.into(),
                    device: device.into(),
                    gpu_uuid: "GPU-0".into(),
                    gpu_minor: 0,
                    kind,
                    env: BTreeMap::new(),
                    share_id: None,
                }],
            },
        )
    }

    fn h100(mig: Option<bool>) -> GpuView {
        view(gpu(0, "H100-80GB", mig), Vec::new())
    }

    fn mig(profile_id: u32, start: u32, size: u32) -> DeviceKind {
        DeviceKind::Mig {
            profile_id,
            start,
            size,
            gpu_instance: None,
            compute_instance: None,
            mig_uuid: None,
        }
    }

    #[test]
    fn accepted_plans() {
        struct Case {
            what: &'static str,
            gpus: Vec<GpuView>,
            others: Vec<(String, ClaimRecord)>,
            devices: &'static [&'static str],
            kinds: Vec<DeviceKind>,
            mode_changes: Vec<(u32, bool)>,
        }
        let cases = vec![
            Case {
                what: "a partition on a GPU in MIG mode",
                gpus: vec![h100(Some(true))],
                others: vec![],
                devices: &["gpu-0-mig-3g40gb-4"],
                kinds: vec![mig(P_3G, 4, 4)],
                mode_changes: vec![],
            },
            Case {
                what: "a partition on a switchable GPU with MIG off switches it on",
                gpus: vec![h100(Some(false))],
                others: vec![],
                devices: &["gpu-0-mig-3g40gb-0"],
                kinds: vec![mig(P_3G, 0, 4)],
                mode_changes: vec![(0, true)],
            },
            Case {
                what: "a whole GPU with MIG off",
                gpus: vec![h100(Some(false))],
                others: vec![],
                devices: &["gpu-0"],
                kinds: vec![DeviceKind::Gpu],
                mode_changes: vec![],
            },
            Case {
                what: "a whole, empty, switchable GPU in MIG mode switches it off",
                gpus: vec![h100(Some(true))],
                others: vec![],
                devices: &["gpu-0"],
                kinds: vec![DeviceKind::Gpu],
                mode_changes: vec![(0, false)],
            },
            Case {
                what: "a whole GPU that is not MIG-capable",
                gpus: vec![h100(None)],
                others: vec![],
                devices: &["gpu-0"],
                kinds: vec![DeviceKind::Gpu],
                mode_changes: vec![],
            },
            Case {
                what: "two partitions side by side, next to another claim's instance",
                gpus: vec![view(
                    gpu(0, "H100-80GB", Some(true)),
                    vec![instance(1, P_1G, 6, 1)],
                )],
                others: vec![other_mig(P_1G, 6, 1, "gpu-0-mig-1g10gb-6")],
                devices: &["gpu-0-mig-3g40gb-0", "gpu-0-mig-1g10gb-4"],
                kinds: vec![mig(P_3G, 0, 4), mig(P_1G, 4, 1)],
                mode_changes: vec![],
            },
            Case {
                what: "partitions of two GPUs, one of them switched on",
                gpus: vec![
                    h100(Some(true)),
                    view(gpu(1, "H100-80GB", Some(false)), Vec::new()),
                ],
                others: vec![],
                devices: &["gpu-0-mig-3g40gb-0", "gpu-1-mig-3g40gb-4"],
                kinds: vec![mig(P_3G, 0, 4), mig(P_3G, 4, 4)],
                mode_changes: vec![(1, true)],
            },
            Case {
                what: "a partition of an Ampere GPU with MIG off asks NVML to switch it on",
                gpus: vec![view(gpu(0, "A100-SXM4-40GB", Some(false)), Vec::new())],
                others: vec![],
                devices: &["gpu-0-mig-1g5gb-0"],
                kinds: vec![mig(P_1G, 0, 1)],
                mode_changes: vec![(0, true)],
            },
            Case {
                what: "a whole, empty Ampere GPU in MIG mode asks NVML to switch it off",
                gpus: vec![view(gpu(0, "A100-SXM4-40GB", Some(true)), Vec::new())],
                others: vec![],
                devices: &["gpu-0"],
                kinds: vec![DeviceKind::Gpu],
                mode_changes: vec![(0, false)],
            },
            Case {
                what: "a listing failure does not matter when the decision does not need it",
                gpus: vec![GpuView {
                    description: gpu(0, "H100-80GB", Some(false)),
                    instances: Err(listing_failed()),
                }],
                others: vec![],
                devices: &["gpu-0"],
                kinds: vec![DeviceKind::Gpu],
                mode_changes: vec![],
            },
        ];
        for case in cases {
            let views = gpus(case.gpus);
            let devices = allocated(case.devices);
            let plan = plan(&devices, &views, &case.others).unwrap_or_else(|e| panic!("{}: {e}", case.what));
            let kinds: Vec<DeviceKind> = plan.devices.iter().map(|d| d.kind.clone()).collect();
            assert_eq!(kinds, case.kinds, "{}", case.what);
            assert_eq!(
                plan.mig_mode_changes,
                case.mode_changes.into_iter().collect::<BTreeMap<_, _>>(),
                "{}",
                case.what
            );
            for (record, device) in plan.devices.iter().zip(&devices) {
                assert_eq!(record.device, device.device, "{}", case.what);
                assert_eq!(record.request, device.request, "{}", case.what);
                assert_eq!(record.gpu_minor, device.name.minor(), "{}", case.what);
                assert_eq!(
                    record.gpu_uuid,
                    views[&device.name.minor()].description.uuid,
                    "{}",
                    case.what
                );
            }
        }
    }

    fn listing_failed() -> BackendError {
        BackendError {
            operation: "list GPU instances on GPU 0".into(),
            kind: NvmlErrorKind::Other,
            message: "boom".into(),
        }
    }

    #[test]
    fn rejected_plans() {
        let foreign_1g_at_6 = || view(gpu(0, "H100-80GB", Some(true)), vec![instance(3, P_1G, 6, 1)]);
        // (what, GPUs, other claims, allocated devices, expected reason)
        type Case = (
            &'static str,
            Vec<GpuView>,
            Vec<(String, ClaimRecord)>,
            &'static [&'static str],
            &'static str,
        );
        let cases: Vec<Case> = vec![
            (
                "no such GPU",
                vec![h100(Some(true))],
                vec![],
                &["gpu-7-mig-3g40gb-4"],
                "NoSuchGpu",
            ),
            (
                "whole GPU after its partition",
                vec![h100(Some(true))],
                vec![],
                &["gpu-0-mig-3g40gb-4", "gpu-0"],
                "WholeGpuAlsoPartitioned",
            ),
            (
                "partition after its whole GPU",
                vec![h100(Some(false))],
                vec![],
                &["gpu-0", "gpu-0-mig-3g40gb-4"],
                "PartitionOfWholeGpu",
            ),
            (
                "the same GPU twice",
                vec![h100(Some(false))],
                vec![],
                &["gpu-0", "gpu-0"],
                "DuplicateDevice",
            ),
            (
                "whole GPU with another claim's partition",
                vec![h100(Some(true))],
                vec![other_mig(P_3G, 0, 4, "gpu-0-mig-3g40gb-0")],
                &["gpu-0"],
                "InUseByClaim",
            ),
            (
                "partition overlapping another claim's partition",
                vec![h100(Some(true))],
                vec![other_mig(P_3G, 4, 4, "gpu-0-mig-3g40gb-4")],
                &["gpu-0-mig-1g10gb-5"],
                "InUseByClaim",
            ),
            (
                "partition of another claim's whole GPU",
                vec![h100(Some(false))],
                vec![other(DeviceKind::Gpu, "gpu-0")],
                &["gpu-0-mig-1g10gb-0"],
                "InUseByClaim",
            ),
            (
                "partition of a GPU without MIG",
                vec![h100(None)],
                vec![],
                &["gpu-0-mig-3g40gb-4"],
                "NotMigCapable",
            ),
            (
                "profile the GPU lacks",
                vec![h100(Some(true))],
                vec![],
                &["gpu-0-mig-1g5gb-0"],
                "UnknownProfile",
            ),
            (
                "invalid start",
                vec![h100(Some(true))],
                vec![],
                &["gpu-0-mig-3g40gb-2"],
                "InvalidPlacement",
            ),
            (
                "overlaps a foreign instance",
                vec![foreign_1g_at_6()],
                vec![],
                &["gpu-0-mig-3g40gb-4"],
                "PlacementOverlap",
            ),
            (
                "two devices of the claim overlap",
                vec![h100(Some(true))],
                vec![],
                &["gpu-0-mig-3g40gb-4", "gpu-0-mig-2g20gb-4"],
                "PlacementOverlap",
            ),
            (
                "whole GPU with a foreign instance",
                vec![foreign_1g_at_6()],
                vec![],
                &["gpu-0"],
                "ForeignInstances",
            ),
        ];
        for (what, views, others, names, reason) in cases {
            let devices = allocated(names);
            match plan(&devices, &gpus(views), &others) {
                Err(PlanError::Rejected(rejection)) => {
                    assert_eq!(rejection.reason(), reason, "{what}: {rejection}")
                }
                other => panic!("{what}: expected a rejection {reason}, got {other:?}"),
            }
        }
    }

    /// Prepare enforces what NVML enforces (known profile and start, memory-slice overlap,
    /// the profile's instance count) and nothing more: summed engine budgets are the
    /// published counters' business.
    #[test]
    fn prepare_enforces_only_what_nvml_enforces() {
        // A30 IDs: 1g+me 21, 2g+me 6 (both with the single OFA); H100: 1g+me 20, 1g 19.
        // (what, model, existing GPU instances (profile ID, start, size), allocated
        // (profile ID, start), expected rejection reason or None)
        type Case = (
            &'static str,
            &'static str,
            &'static [(u32, u32, u32)],
            &'static [(u32, u32)],
            Option<&'static str>,
        );
        let cases: &[Case] = &[
            (
                "two OFA users next to each other (NVML creates both)",
                "A30-24GB",
                &[(21, 0, 1)],
                &[(6, 2)],
                None,
            ),
            (
                "two OFA users in one claim",
                "A30-24GB",
                &[],
                &[(21, 0), (6, 2)],
                None,
            ),
            (
                "the second 1g+me is over the instance count",
                "H100-80GB",
                &[(20, 0, 1)],
                &[(20, 1)],
                Some("InstanceLimit"),
            ),
            (
                "two 1g+me in one claim",
                "H100-80GB",
                &[],
                &[(20, 0), (20, 1)],
                Some("InstanceLimit"),
            ),
            (
                "memory slices overlap",
                "A30-24GB",
                &[(21, 2, 1)],
                &[(6, 2)],
                Some("PlacementOverlap"),
            ),
            (
                "seven 1g next to each other",
                "H100-80GB",
                &[
                    (19, 0, 1),
                    (19, 1, 1),
                    (19, 2, 1),
                    (19, 3, 1),
                    (19, 4, 1),
                    (19, 5, 1),
                ],
                &[(19, 6)],
                None,
            ),
            (
                "not a placement of the profile",
                "H100-80GB",
                &[],
                &[(19, 7)],
                Some("InvalidPlacement"),
            ),
        ];
        for (what, key, existing, wanted, expected) in cases {
            let model = catalog::model(key).unwrap();
            let instances = existing
                .iter()
                .enumerate()
                .map(|(i, (id, start, size))| instance(i as u32 + 1, *id, *start, *size))
                .collect();
            let names: Vec<String> = wanted
                .iter()
                .map(|(id, start)| {
                    let profile = model.profiles.iter().find(|p| p.gi_profile_id == *id).unwrap();
                    DeviceName::Mig {
                        minor: 0,
                        profile: profile.name,
                        start: *start,
                    }
                    .to_string()
                })
                .collect();
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let result = plan(
                &allocated(&names),
                &gpus(vec![view(gpu(0, key, Some(true)), instances)]),
                &[],
            );
            match (expected, result) {
                (None, Ok(plan)) => assert_eq!(plan.devices.len(), wanted.len(), "{what}"),
                (Some(reason), Err(PlanError::Rejected(rejection))) => {
                    assert_eq!(rejection.reason(), *reason, "{what}: {rejection}")
                }
                (expected, result) => panic!("{what}: expected {expected:?}, got {result:?}"),
            }
        }
    }

    #[test]
    fn a_listing_failure_fails_the_plan_only_where_the_list_is_needed() {
        let failing = |mig| {
            gpus(vec![GpuView {
                description: gpu(0, "H100-80GB", Some(mig)),
                instances: Err(listing_failed()),
            }])
        };
        for names in [&["gpu-0-mig-3g40gb-4"][..], &["gpu-0"][..]] {
            let result = plan(&allocated(names), &failing(true), &[]);
            assert_eq!(result, Err(PlanError::Backend(listing_failed())), "{names:?}");
        }
        // A rejection decided before the list is needed wins.
        let result = plan(&allocated(&["gpu-0-mig-1g5gb-0"]), &failing(true), &[]);
        assert!(
            matches!(result, Err(PlanError::Rejected(Rejection::UnknownProfile { .. }))),
            "{result:?}"
        );
    }

    #[test]
    fn instances_of_other_gpus_do_not_block() {
        let views = gpus(vec![
            h100(Some(true)),
            view(gpu(1, "H100-80GB", Some(true)), vec![instance(1, P_3G, 4, 4)]),
        ]);
        plan(&allocated(&["gpu-0-mig-3g40gb-4"]), &views, &[]).unwrap();
    }

    #[test]
    fn messages_name_the_device_and_the_cause() {
        let devices = allocated(&["gpu-0-mig-1g5gb-0"]);
        let Err(PlanError::Rejected(rejection)) = plan(&devices, &gpus(vec![h100(Some(true))]), &[]) else {
            panic!("expected a rejection")
        };
        let message = rejection.to_string();
        assert!(
            message.starts_with("device gpu-0-mig-1g5gb-0: GPU 0 (")
                && message.contains("has no MIG profile 1g.5gb (it offers 1g.10gb, "),
            "{message}"
        );
        let devices = allocated(&["gpu-0-mig-1g10gb-5"]);
        let others = [other_mig(P_3G, 4, 4, "gpu-0-mig-3g40gb-4")];
        let Err(PlanError::Rejected(rejection)) = plan(&devices, &gpus(vec![h100(Some(true))]), &others)
        else {
            panic!("expected a rejection")
        };
        assert_eq!(
            rejection.to_string(),
            "device gpu-0-mig-1g10gb-5 overlaps device gpu-0-mig-3g40gb-4 already prepared for claim ns/other (uid-other)"
        );
        let devices = allocated(&["gpu-0-mig-3g40gb-4"]);
        let Err(PlanError::Rejected(rejection)) = plan(&devices, &gpus(vec![foreign_overlap()]), &[]) else {
            panic!("expected a rejection")
        };
        let message = rejection.to_string();
        assert!(
            message
                .starts_with("device gpu-0-mig-3g40gb-4: cannot create 3g.40gb at memory slice 4 on GPU 0: ")
                && message.contains("overlaps the existing 1g.10gb@6"),
            "{message}"
        );
    }

    fn foreign_overlap() -> GpuView {
        view(gpu(0, "H100-80GB", Some(true)), vec![instance(3, P_1G, 6, 1)])
    }
}
