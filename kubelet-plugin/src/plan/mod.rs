//! Placement planning: what a claim's allocation needs on this node, decided from plain values.
//!
//! [`plan`] takes the allocated devices, the state of the GPUs they are on ([`GpuView`]: the
//! description and the GPU instances that exist, ours or foreign) and the other recorded
//! claims, and returns either a [`Plan`] (the device records to write before creating
//! anything, and the MIG-mode switches needed) or why not ([`Rejection`]). It reads no file,
//! takes no lock and calls no NVML function: the driver gathers the views under the GPU
//! locks, and the tests build them by hand.
//!
//! A share of a shared device (the allocation carries a share ID) that another claim already
//! holds *joins* its instance: the planned record carries the holder's instance IDs, and
//! nothing is created. Only the first share plans a new instance, like an exclusive device.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use migdra_api::{
    device_name::DeviceName,
    geometry::{MigGeometry, Placement, PlacementError},
};

pub use self::rejection::{PlanError, Rejection};
use crate::{
    checkpoint::{ClaimRecord, ClaimState, DeviceKind, DeviceRecord},
    claims::AllocatedDevice,
    nvml::{BackendError, GpuDescription, GpuInstanceRecord},
};

mod rejection;
#[cfg(test)]
mod tests;

/// One GPU as planning sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuView {
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
                        records.push(planned_record(device, &description.uuid, joined));
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
        records.push(planned_record(device, &description.uuid, kind));
    }
    Ok(Plan {
        devices: records,
        mig_mode_changes,
    })
}

fn planned_record(device: &AllocatedDevice, gpu_uuid: &str, kind: DeviceKind) -> DeviceRecord {
    DeviceRecord {
        request: device.request.clone(),
        pool: device.pool.clone(),
        device: device.device.clone(),
        gpu_uuid: gpu_uuid.to_string(),
        gpu_minor: device.name.minor(),
        kind,
        env: device.config.env.clone(),
        share_id: device.share_id.clone(),
    }
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
    let probe = planned_record(device, gpu_uuid, DeviceKind::Gpu);
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
