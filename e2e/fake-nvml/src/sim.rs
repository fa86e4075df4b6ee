//! The MIG rules the fake enforces, on the in-memory state. They are written here from
//! NVML's documented behaviour (`shared/reference/mig-nvml.md` §11 with the §12
//! corrections) and share no code with migdra-api; every answer is an NVML return code.
//!
//! GPU instances (§12 "NVML's placement rule"): a GPU instance can be created only at one
//! of its profile's placements, its memory slices must not overlap any existing GPU
//! instance's, and a profile has at most `instanceCount` instances. SM and engine counts
//! are not budgets NVML checks, with one exception the fake adds on its own: the GPU's
//! optical-flow accelerators (one per GPU) go to at most as many instances as there are,
//! because §4 says the `+me` profiles exist once "because there is a single OFA/JPEG". On
//! A30, whose two `+me` profiles each have instanceCount 1, that keeps them from coexisting.
//! It is inferred from the hardware, not a documented NVML return.

use crate::{
    code,
    model::{FakeModel, GiProfile, MigTable},
    state::{ComputeInstanceState, GpuInstanceState, GpuState},
};

/// `NVML_GPU_INSTANCE_PROFILE_COUNT` (nvml.h v13, §3): profile indexes at or above it are
/// INVALID_ARGUMENT.
pub const GI_PROFILE_COUNT: u32 = 18;
/// `NVML_COMPUTE_INSTANCE_PROFILE_COUNT` (nvml.h v13, §3).
pub const CI_PROFILE_COUNT: u32 = 9;
/// `NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1`: accepted for 1-slice GPU instances only
/// (GH200 creates the full CI of a double-memory 1g with it; §3, §11 rule 7).
pub const CI_PROFILE_1_SLICE_REV1: u32 = 7;
/// `NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE_NVL` (index 8): NOT_SUPPORTED (A100 answers so; §3)
/// except on models whose table offers it ([`MigTable::ci_7_slice_nvl`]) or with the quirk.
pub const CI_PROFILE_7_SLICE_NVL: u32 = 8;
/// `NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED`, the only engine profile (§3).
pub const CI_ENGINE_PROFILE_SHARED: u32 = 0;
/// Most compute instances one GPU instance can hold (CI IDs 0–7, §2).
pub const MAX_COMPUTE_INSTANCES: u32 = 8;

/// Compute slices of CI profile index `index` (§3 CI index table: `1_SLICE` 0 … `6_SLICE` 6,
/// `1_SLICE_REV1` 7).
fn ci_index_slices(index: u32) -> Option<u32> {
    match index {
        0 | CI_PROFILE_1_SLICE_REV1 => Some(1),
        1 => Some(2),
        2 => Some(3),
        3 => Some(4),
        4 => Some(7),
        5 => Some(8),
        6 => Some(6),
        _ => None,
    }
}

/// The CI profile index of the full compute instance of a GPU instance with
/// `compute_slices` slices (the plain index, not `1_SLICE_REV1`).
pub fn full_compute_instance_profile(compute_slices: u32) -> Option<u32> {
    (0..CI_PROFILE_1_SLICE_REV1).find(|i| ci_index_slices(*i) == Some(compute_slices))
}

/// go-nvlib's rule for the CI sizes a G-slice GPU instance offers (§4): C ≤ G, and not
/// (C < G and 2C > G + 1); it reproduces the published "maximum CIs per GI" tables.
fn valid_compute_instance_size(gi_slices: u32, ci_slices: u32) -> bool {
    ci_slices == gi_slices || (ci_slices < gi_slices && 2 * ci_slices <= gi_slices + 1)
}

/// The GPU-instance ID of a placement (§7, §11 rule 5): a binary-heap index over the
/// physical memory-slice range (full 0, halves 1–2, quarters 3–6, eighths 7–14). Boards
/// that number the halves swapped (`swap_halves`) have physical start = logical start XOR
/// half the GPU. The reference marks the model unverified; it is the only rule it gives.
pub fn gpu_instance_id(start: u32, size: u32, total_slices: u32, swap_halves: bool) -> u32 {
    let physical_start = if swap_halves && total_slices >= 2 {
        start ^ (total_slices / 2)
    } else {
        start
    };
    let size = size.max(1);
    let level = (total_slices / size).max(1).ilog2();
    (1 << level) - 1 + physical_start / size
}

/// Whether two memory-slice ranges `[start, start + size)` overlap.
fn overlaps(a_start: u32, a_size: u32, b_start: u32, b_size: u32) -> bool {
    a_start < b_start + b_size && b_start < a_start + a_size
}

/// The default auto-placement order of `nvmlDeviceCreateGpuInstance` (§11 rule 4, as
/// observed on A100), restricted to the profile's valid starts; starts the table does not
/// mention come last.
pub fn default_auto_placement(profile: &GiProfile) -> Vec<u32> {
    let preferred: &[u32] = match (profile.compute_slices, profile.memory_slices) {
        (1, 1) => &[6, 4, 5, 0, 1, 2, 3],
        (1, 2) => &[6, 4, 2, 0],
        (2, _) => &[4, 0, 2],
        (3, _) => &[4, 0],
        _ => &[],
    };
    let mut order: Vec<u32> = preferred
        .iter()
        .copied()
        .filter(|s| profile.starts.contains(s))
        .collect();
    let rest: Vec<u32> = profile
        .starts
        .iter()
        .copied()
        .filter(|s| !order.contains(s))
        .collect();
    order.extend(rest);
    order
}

/// Compute slices of compute-instance profile `index` inside a GPU instance with
/// `gi_slices` compute slices (§3, §4, §11 rule 7).
pub fn compute_instance_profile_slices(gi_slices: u32, index: u32) -> Result<u32, u32> {
    if index >= CI_PROFILE_COUNT {
        return Err(code::INVALID_ARGUMENT);
    }
    if index == CI_PROFILE_7_SLICE_NVL {
        return Err(code::NOT_SUPPORTED);
    }
    if index == CI_PROFILE_1_SLICE_REV1 {
        return if gi_slices == 1 {
            Ok(1)
        } else {
            Err(code::NOT_SUPPORTED)
        };
    }
    match ci_index_slices(index) {
        Some(c) if valid_compute_instance_size(gi_slices, c) => Ok(c),
        _ => Err(code::NOT_SUPPORTED),
    }
}

/// Valid starts of a `ci_slices` compute instance inside a `gi_slices` GPU instance: aligned
/// to the next power of two (§11 rule 7: 1c everywhere; 2c at 0, 2, 4; 3c at 0 and 4 in a
/// 7g, 0 in a 3g; 4c at 0).
pub fn compute_instance_placements(ci_slices: u32, gi_slices: u32) -> Vec<u32> {
    if ci_slices == 0 {
        return Vec::new();
    }
    let step = ci_slices.next_power_of_two();
    (0..gi_slices)
        .step_by(step as usize)
        .filter(|s| s + ci_slices <= gi_slices)
        .collect()
}

/// The lowest value in `0..limit` not in `used`.
pub fn lowest_free_id(used: impl IntoIterator<Item = u32>, limit: u32) -> Option<u32> {
    let used: Vec<u32> = used.into_iter().collect();
    (0..limit).find(|id| !used.contains(id))
}

/// What a compute-instance profile looks like inside a given GPU instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ComputeProfile {
    /// Profile ID (= index, §3).
    pub id: u32,
    /// Compute slices.
    pub slices: u32,
    /// How many fit in the GPU instance (GI slices ÷ CI slices, §11 rule 7).
    pub instance_count: u32,
    /// Multiprocessors.
    pub multiprocessors: u32,
}

impl GpuState {
    /// The GPU's model.
    pub fn fake_model(&self) -> Option<FakeModel> {
        FakeModel::lookup(&self.model)
    }

    /// The MIG table, for MIG-capable GPUs.
    pub fn mig_table(&self) -> Option<&'static MigTable> {
        if !self.mig_capable {
            return None;
        }
        self.fake_model().and_then(|m| m.mig)
    }

    /// GPU-instance profile by ID.
    pub fn gi_profile(&self, profile_id: u32) -> Option<&'static GiProfile> {
        self.mig_table().and_then(|t| t.profile_by_id(profile_id))
    }

    /// GPU-instance profile by index: NOT_SUPPORTED for a non-MIG GPU or an index the model
    /// lacks, INVALID_ARGUMENT at or beyond COUNT (§11 rule 2).
    pub fn gi_profile_by_index(&self, index: u32) -> Result<&'static GiProfile, u32> {
        let table = self.mig_table().ok_or(code::NOT_SUPPORTED)?;
        let moved = &self.quirks.profile_indexes;
        let count = moved.values().map(|i| i + 1).fold(GI_PROFILE_COUNT, u32::max);
        if index >= count {
            return Err(code::INVALID_ARGUMENT);
        }
        table
            .profiles
            .iter()
            .find(|p| moved.get(&p.id).copied().unwrap_or(p.index) == index)
            .ok_or(code::NOT_SUPPORTED)
    }

    /// Fails with NOT_SUPPORTED unless the GPU is MIG-capable with MIG mode on (§11 rule 1).
    pub fn require_mig(&self) -> Result<&'static MigTable, u32> {
        match self.mig_table() {
            Some(t) if self.mig_enabled => Ok(t),
            _ => Err(code::NOT_SUPPORTED),
        }
    }

    /// Memory slices of the GPU.
    pub fn memory_slices(&self) -> u32 {
        self.mig_table().map(|t| t.memory_slices).unwrap_or(0)
    }

    /// GPU instance by creation serial.
    pub fn gpu_instance_by_serial(&self, serial: u64) -> Option<&GpuInstanceState> {
        self.gpu_instances.iter().find(|gi| gi.serial == serial)
    }

    /// GPU instance by ID.
    pub fn gpu_instance_by_id(&self, id: u32) -> Option<&GpuInstanceState> {
        self.gpu_instances.iter().find(|gi| gi.id == id)
    }

    /// Compute instance by its creation serial, with its GPU instance.
    pub fn compute_instance_by_serial(
        &self,
        serial: u64,
    ) -> Option<(&GpuInstanceState, &ComputeInstanceState)> {
        self.gpu_instances.iter().find_map(|gi| {
            gi.compute_instances
                .iter()
                .find(|ci| ci.serial == serial)
                .map(|ci| (gi, ci))
        })
    }

    /// Whether `profile` at `start` is free of the existing GPU instances' memory slices,
    /// under the profile's instance count and within the GPU's free OFA engines:
    /// INSUFFICIENT_RESOURCES otherwise (§1.3, §12; the OFA rule is the fake's, from §4).
    fn check_resources(&self, profile: &GiProfile, start: u32) -> Result<(), u32> {
        let overlap = self
            .gpu_instances
            .iter()
            .any(|gi| overlaps(start, profile.memory_slices, gi.start, gi.size));
        let same_profile = self
            .gpu_instances
            .iter()
            .filter(|gi| gi.profile_id == profile.id)
            .count();
        if overlap
            || same_profile >= profile.instance_count as usize
            || profile.engines.ofa_engines > self.free_ofa_engines()
        {
            return Err(code::INSUFFICIENT_RESOURCES);
        }
        Ok(())
    }

    /// OFA engines of the GPU that no GPU instance holds (0 for a GPU without MIG).
    pub fn free_ofa_engines(&self) -> u32 {
        let Some(table) = self.mig_table() else {
            return 0;
        };
        let held: u32 = self
            .gpu_instances
            .iter()
            .filter_map(|gi| table.profile_by_id(gi.profile_id))
            .map(|p| p.engines.ofa_engines)
            .sum();
        table.ofa_engines().saturating_sub(held)
    }

    /// Checks whether `profile_id` can be placed at `start`, in NVML's order (§11 rule 3 as
    /// corrected by §12): MIG off NOT_SUPPORTED; unknown profile ID or a start that is not
    /// one of its placements INVALID_ARGUMENT; memory overlap with any GPU instance
    /// (including an identical one) or the profile's instance count reached
    /// INSUFFICIENT_RESOURCES; a client holding the GPU IN_USE.
    pub fn check_gpu_instance(&self, profile_id: u32, start: u32) -> Result<(), u32> {
        let table = self.require_mig()?;
        let profile = table.profile_by_id(profile_id).ok_or(code::INVALID_ARGUMENT)?;
        if !profile.starts.contains(&start) {
            return Err(code::INVALID_ARGUMENT);
        }
        self.check_resources(profile, start)?;
        if self.client_holds_gpu {
            return Err(code::IN_USE);
        }
        Ok(())
    }

    /// Creates a GPU instance of `profile_id` at `start` (or, without a start, at the first
    /// free start in auto-placement order) and returns its GPU-instance ID.
    pub fn create_gpu_instance(
        &mut self,
        profile_id: u32,
        start: Option<u32>,
        serial: u64,
    ) -> Result<u32, u32> {
        let table = self.require_mig()?;
        let profile = table.profile_by_id(profile_id).ok_or(code::INVALID_ARGUMENT)?;
        let start = match start {
            Some(start) => {
                self.check_gpu_instance(profile_id, start)?;
                start
            }
            None => {
                let order = self
                    .auto_placement
                    .get(&profile_id)
                    .cloned()
                    .unwrap_or_else(|| default_auto_placement(profile));
                let mut last_error = code::INSUFFICIENT_RESOURCES;
                let mut chosen = None;
                for start in order {
                    match self.check_gpu_instance(profile_id, start) {
                        Ok(()) => {
                            chosen = Some(start);
                            break;
                        }
                        Err(code::IN_USE) => return Err(code::IN_USE),
                        Err(e) => last_error = e,
                    }
                }
                // Auto placement never reports a start it picked itself as invalid.
                chosen.ok_or(if last_error == code::INVALID_ARGUMENT {
                    code::INSUFFICIENT_RESOURCES
                } else {
                    last_error
                })?
            }
        };
        let id = gpu_instance_id(
            start,
            profile.memory_slices,
            table.memory_slices,
            self.swap_halves,
        );
        if self.gpu_instance_by_id(id).is_some() {
            // Unreachable with non-overlapping placements; refuse rather than alias two GIs.
            return Err(code::INSUFFICIENT_RESOURCES);
        }
        self.gpu_instances.push(GpuInstanceState {
            id,
            profile_id,
            start,
            size: profile.memory_slices,
            serial,
            busy: false,
            compute_instances: Vec::new(),
        });
        self.gpu_instances.sort_by_key(|gi| gi.id);
        Ok(id)
    }

    /// How many more GPU instances of `profile_id` fit (§11 rule 6 without the SM and engine
    /// budgets, §12): the smallest of the instance count left, the free placements and, for
    /// a profile with OFA engines, how many of them the free OFA engines give. Placements of
    /// one profile never overlap each other, so every free one can be used at once.
    pub fn remaining_gpu_instance_capacity(&self, profile_id: u32) -> Result<u32, u32> {
        let table = self.require_mig()?;
        let profile = table.profile_by_id(profile_id).ok_or(code::INVALID_ARGUMENT)?;
        let existing = self
            .gpu_instances
            .iter()
            .filter(|gi| gi.profile_id == profile_id)
            .count();
        let free = profile
            .starts
            .iter()
            .filter(|s| {
                self.gpu_instances
                    .iter()
                    .all(|gi| !overlaps(**s, profile.memory_slices, gi.start, gi.size))
            })
            .count();
        let left = (profile.instance_count as usize).saturating_sub(existing);
        let by_ofa = match profile.engines.ofa_engines {
            0 => usize::MAX,
            per_instance => (self.free_ofa_engines() / per_instance) as usize,
        };
        Ok(u32::try_from(free.min(left).min(by_ofa)).unwrap_or(u32::MAX))
    }

    /// Destroys the GPU instance with `serial`: INVALID_ARGUMENT when it no longer exists
    /// (stale handle), IN_USE while it has compute instances or is busy.
    pub fn destroy_gpu_instance(&mut self, serial: u64) -> Result<(), u32> {
        let gi = self
            .gpu_instance_by_serial(serial)
            .ok_or(code::INVALID_ARGUMENT)?;
        if gi.busy || !gi.compute_instances.is_empty() {
            return Err(code::IN_USE);
        }
        self.gpu_instances.retain(|gi| gi.serial != serial);
        Ok(())
    }

    /// A compute-instance profile inside the GPU instance with `gi_serial`.
    pub fn compute_profile(&self, gi_serial: u64, index: u32) -> Result<ComputeProfile, u32> {
        let gi = self
            .gpu_instance_by_serial(gi_serial)
            .ok_or(code::INVALID_ARGUMENT)?;
        let profile = self.gi_profile(gi.profile_id).ok_or(code::INVALID_ARGUMENT)?;
        let g = profile.compute_slices;
        let nvl = self.quirks.ci_7_slice_nvl || self.mig_table().is_some_and(|t| t.ci_7_slice_nvl);
        let slices = if index == CI_PROFILE_7_SLICE_NVL && g == 7 && nvl {
            7
        } else {
            compute_instance_profile_slices(g, index)?
        };
        Ok(ComputeProfile {
            id: index,
            slices,
            instance_count: g / slices,
            multiprocessors: profile.engines.multiprocessors * slices / g.max(1),
        })
    }

    /// Free starts for a compute instance of profile `index` in the GPU instance.
    pub fn free_compute_placements(&self, gi_serial: u64, index: u32) -> Result<Vec<u32>, u32> {
        let cp = self.compute_profile(gi_serial, index)?;
        let gi = self
            .gpu_instance_by_serial(gi_serial)
            .ok_or(code::INVALID_ARGUMENT)?;
        let g = self
            .gi_profile(gi.profile_id)
            .map(|p| p.compute_slices)
            .unwrap_or(0);
        let same = gi
            .compute_instances
            .iter()
            .filter(|ci| ci.profile_id == cp.id)
            .count();
        if u32::try_from(same).unwrap_or(u32::MAX) >= cp.instance_count
            || gi.compute_instances.len() >= MAX_COMPUTE_INSTANCES as usize
        {
            return Ok(Vec::new());
        }
        Ok(compute_instance_placements(cp.slices, g)
            .into_iter()
            .filter(|s| {
                gi.compute_instances
                    .iter()
                    .all(|ci| s + cp.slices <= ci.start || ci.start + ci.size <= *s)
            })
            .collect())
    }

    /// Creates a compute instance of profile `index` at its first free placement (or at
    /// `start`) and returns its CI ID, the lowest free one.
    pub fn create_compute_instance(
        &mut self,
        gi_serial: u64,
        index: u32,
        serial: u64,
        uuid: String,
    ) -> Result<u32, u32> {
        self.create_compute_instance_at(gi_serial, index, None, serial, uuid)
    }

    /// As [`GpuState::create_compute_instance`], at an explicit start when given.
    pub fn create_compute_instance_at(
        &mut self,
        gi_serial: u64,
        index: u32,
        start: Option<u32>,
        serial: u64,
        uuid: String,
    ) -> Result<u32, u32> {
        let cp = self.compute_profile(gi_serial, index)?;
        if let Some(start) = start {
            let gi = self
                .gpu_instance_by_serial(gi_serial)
                .ok_or(code::INVALID_ARGUMENT)?;
            let g = self
                .gi_profile(gi.profile_id)
                .map(|p| p.compute_slices)
                .unwrap_or(0);
            if !compute_instance_placements(cp.slices, g).contains(&start) {
                return Err(code::INVALID_ARGUMENT);
            }
        }
        let free = self.free_compute_placements(gi_serial, index)?;
        let start = match start {
            Some(s) if free.contains(&s) => s,
            Some(_) => return Err(code::INSUFFICIENT_RESOURCES),
            None => *free.first().ok_or(code::INSUFFICIENT_RESOURCES)?,
        };
        let gi = self
            .gpu_instances
            .iter_mut()
            .find(|gi| gi.serial == gi_serial)
            .ok_or(code::INVALID_ARGUMENT)?;
        let id = lowest_free_id(gi.compute_instances.iter().map(|ci| ci.id), MAX_COMPUTE_INSTANCES)
            .ok_or(code::INSUFFICIENT_RESOURCES)?;
        gi.compute_instances.push(ComputeInstanceState {
            id,
            profile_id: cp.id,
            start,
            size: cp.slices,
            uuid,
            serial,
            busy: false,
        });
        gi.compute_instances.sort_by_key(|ci| ci.id);
        Ok(id)
    }

    /// Destroys the compute instance with `serial`: INVALID_ARGUMENT when stale, IN_USE
    /// while a simulated process runs on it.
    pub fn destroy_compute_instance(&mut self, serial: u64) -> Result<(), u32> {
        let (_, ci) = self
            .compute_instance_by_serial(serial)
            .ok_or(code::INVALID_ARGUMENT)?;
        if ci.busy {
            return Err(code::IN_USE);
        }
        for gi in &mut self.gpu_instances {
            gi.compute_instances.retain(|ci| ci.serial != serial);
        }
        Ok(())
    }

    /// MIG devices in `nvmlDeviceGetMigDeviceHandleByIndex` order: by (GI ID, CI ID).
    pub fn mig_devices(&self) -> Vec<(&GpuInstanceState, &ComputeInstanceState)> {
        let mut all: Vec<_> = self
            .gpu_instances
            .iter()
            .flat_map(|gi| gi.compute_instances.iter().map(move |ci| (gi, ci)))
            .collect();
        all.sort_by_key(|(gi, ci)| (gi.id, ci.id));
        all
    }

    /// `nvmlDeviceGetMaxMigDeviceCount`: 0 unless MIG is on.
    pub fn max_mig_devices(&self) -> u32 {
        match self.fake_model().and_then(|m| m.mig) {
            Some(m) if self.mig_capable && self.mig_enabled => m.max_mig_devices,
            _ => 0,
        }
    }

    /// `nvmlDeviceSetMigMode`: returns (return code, activation status). NVML reports a
    /// switch it could not carry out through the activation status, not the return code
    /// (§12; nvml.h lists no IN_USE return for it):
    /// - a client holding the GPU (`client_holds_gpu`, any of `clients`: an NVML session
    ///   such as DCGM, a compute or graphics process) or existing GPU instances: IN_USE
    ///   (nvml.h: "if device unbind fails because the device isn't idle"); on Ampere the change
    ///   stays pending (nvidia-smi: "pending enable … In use by another client");
    /// - Ampere: the driver resets the idle GPU itself, so the mode applies at once, unless
    ///   it cannot reset the GPU (`quirks.no_driver_reset`, a pass-through VM): then it stays
    ///   pending with RESET_REQUIRED until [`crate::FakeState::reset_gpu`];
    /// - Hopper and later: applies at once when idle.
    ///
    /// A mode that took effect may renumber the device (`quirks.minor_after_mode_change`).
    pub fn set_mig_mode(&mut self, enable: bool) -> (u32, u32) {
        let Some(model) = self.fake_model().filter(|m| m.mig.is_some() && self.mig_capable) else {
            return (code::NOT_SUPPORTED, code::NOT_SUPPORTED);
        };
        if enable == self.mig_enabled {
            self.mig_pending = enable;
            return (code::SUCCESS, code::SUCCESS);
        }
        let busy = self.client_holds_gpu || !self.clients.is_empty() || !self.gpu_instances.is_empty();
        let switchable = model.mig_mode_switchable();
        if busy {
            if !switchable {
                self.mig_pending = enable;
            }
            return (code::SUCCESS, code::IN_USE);
        }
        if !switchable && self.quirks.no_driver_reset {
            self.mig_pending = enable;
            return (code::SUCCESS, code::RESET_REQUIRED);
        }
        self.mig_enabled = enable;
        self.mig_pending = enable;
        if let Some(minor) = self.quirks.minor_after_mode_change {
            self.minor = minor;
        }
        (code::SUCCESS, code::SUCCESS)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn gpu(model: &str, mig: bool) -> GpuState {
        GpuState {
            index: 0,
            minor: 0,
            uuid: "GPU-x".into(),
            model: model.into(),
            pci_bus: 7,
            numa_node: 0,
            mig_capable: FakeModel::lookup(model).unwrap().mig.is_some(),
            swap_halves: false,
            mig_enabled: mig,
            mig_pending: mig,
            client_holds_gpu: false,
            clients: Vec::new(),
            lost: false,
            auto_placement: BTreeMap::new(),
            quirks: Default::default(),
            gpu_instances: Vec::new(),
        }
    }

    #[test]
    fn profile_index_lookups_follow_nvml() {
        let h100 = gpu("H100-80GB", false);
        // Works with MIG off; the index gives the real ID.
        assert_eq!(h100.gi_profile_by_index(0).unwrap().id, 19);
        assert_eq!(h100.gi_profile_by_index(9).unwrap().id, 15);
        assert_eq!(h100.gi_profile_by_index(5), Err(code::NOT_SUPPORTED));
        assert_eq!(
            h100.gi_profile_by_index(GI_PROFILE_COUNT),
            Err(code::INVALID_ARGUMENT)
        );
        assert_eq!(gpu("L4", false).gi_profile_by_index(0), Err(code::NOT_SUPPORTED));
    }

    #[test]
    fn gpu_instance_rules_follow_nvml() {
        let mut g = gpu("A100-SXM4-40GB", true);
        assert_eq!(g.create_gpu_instance(9, Some(4), 1), Ok(2));
        // Overlap with an identical instance: no "already exists" code.
        assert_eq!(
            g.create_gpu_instance(9, Some(4), 2),
            Err(code::INSUFFICIENT_RESOURCES)
        );
        assert_eq!(g.create_gpu_instance(9, Some(2), 2), Err(code::INVALID_ARGUMENT));
        assert_eq!(g.create_gpu_instance(77, Some(0), 2), Err(code::INVALID_ARGUMENT));
        assert_eq!(g.create_gpu_instance(20, Some(0), 3), Ok(7));
        // Second +me: no overlap, but the single OFA engine is taken.
        assert_eq!(
            g.create_gpu_instance(20, Some(1), 4),
            Err(code::INSUFFICIENT_RESOURCES)
        );
        assert_eq!(g.remaining_gpu_instance_capacity(19), Ok(3));
        assert_eq!(g.remaining_gpu_instance_capacity(0), Ok(0));
        g.mig_enabled = false;
        assert_eq!(g.create_gpu_instance(19, Some(1), 5), Err(code::NOT_SUPPORTED));
        assert_eq!(g.remaining_gpu_instance_capacity(19), Err(code::NOT_SUPPORTED));
    }

    #[test]
    fn overlap_instance_count_and_the_single_ofa_limit_gpu_instances() {
        // §12: SM and most engine counts are not budgets; the single OFA (§4) is. A30's two
        // `+me` profiles each have instanceCount 1, and on disjoint slices they still cannot
        // coexist: both need the OFA.
        let mut a30 = gpu("A30-24GB", true);
        assert_eq!(a30.mig_table().unwrap().ofa_engines(), 1);
        assert_eq!(a30.remaining_gpu_instance_capacity(6), Ok(1));
        assert_eq!(a30.create_gpu_instance(21, Some(0), 1), Ok(3));
        assert_eq!(a30.free_ofa_engines(), 0);
        assert_eq!(a30.remaining_gpu_instance_capacity(6), Ok(0), "the OFA is taken");
        assert_eq!(
            a30.create_gpu_instance(6, Some(2), 2),
            Err(code::INSUFFICIENT_RESOURCES)
        );
        // Profiles without an OFA are not limited by it.
        assert_eq!(a30.create_gpu_instance(5, Some(2), 2), Ok(2));
        assert_eq!(
            a30.create_gpu_instance(21, Some(1), 3),
            Err(code::INSUFFICIENT_RESOURCES)
        );
        assert_eq!(a30.remaining_gpu_instance_capacity(14), Ok(1));
        assert_eq!(a30.remaining_gpu_instance_capacity(21), Ok(0));
        // Destroying the OFA holder frees it for the other `+me` profile.
        a30.destroy_gpu_instance(1).unwrap();
        assert_eq!(a30.free_ofa_engines(), 1);
        assert_eq!(a30.create_gpu_instance(6, Some(0), 4), Ok(1));
        // A size that is not the profile's is not one of its placements.
        let mut h100 = gpu("H100-80GB", true);
        assert_eq!(
            h100.create_gpu_instance(5, Some(4), 1),
            Err(code::INVALID_ARGUMENT)
        );
        assert_eq!(h100.create_gpu_instance(5, Some(0), 1), Ok(1));
        assert_eq!(h100.create_gpu_instance(9, Some(4), 2), Ok(2));
        assert_eq!(h100.remaining_gpu_instance_capacity(19), Ok(0));
    }

    #[test]
    fn full_compute_instance_profiles_use_the_plain_indexes() {
        assert_eq!(full_compute_instance_profile(1), Some(0));
        assert_eq!(full_compute_instance_profile(3), Some(2));
        assert_eq!(full_compute_instance_profile(4), Some(3));
        assert_eq!(full_compute_instance_profile(7), Some(4));
        assert_eq!(full_compute_instance_profile(5), None);
        assert_eq!(gpu_instance_id(3, 1, 4, false), 6);
        assert_eq!(gpu_instance_id(2, 2, 4, false), 2);
    }

    #[test]
    fn client_holding_the_gpu_blocks_creation_last() {
        let mut g = gpu("H100-80GB", true);
        g.client_holds_gpu = true;
        assert_eq!(g.create_gpu_instance(9, Some(2), 1), Err(code::INVALID_ARGUMENT));
        assert_eq!(g.create_gpu_instance(9, Some(4), 1), Err(code::IN_USE));
    }

    #[test]
    fn gpu_instance_ids_use_the_heap_numbering() {
        let mut g = gpu("H100-80GB", true);
        assert_eq!(g.create_gpu_instance(19, Some(6), 1), Ok(13));
        assert_eq!(g.create_gpu_instance(14, Some(0), 2), Ok(3));
        let mut swapped = gpu("H100-80GB", true);
        swapped.swap_halves = true;
        assert_eq!(swapped.create_gpu_instance(9, Some(4), 1), Ok(1));
        assert_eq!(swapped.create_gpu_instance(9, Some(0), 2), Ok(2));
    }

    #[test]
    fn auto_placement_prefers_the_high_end() {
        let mut g = gpu("A100-SXM4-40GB", true);
        let starts: Vec<u32> = (0..7)
            .map(|i| {
                let id = g.create_gpu_instance(19, None, i + 1).unwrap();
                g.gpu_instances.iter().find(|gi| gi.id == id).unwrap().start
            })
            .collect();
        assert_eq!(starts, vec![6, 4, 5, 0, 1, 2, 3]);
        assert_eq!(
            g.create_gpu_instance(19, None, 9),
            Err(code::INSUFFICIENT_RESOURCES)
        );
        let mut g = gpu("H100-80GB", true);
        g.auto_placement.insert(9, vec![0, 4]);
        let id = g.create_gpu_instance(9, None, 1).unwrap();
        assert_eq!(g.gpu_instance_by_id(id).unwrap().start, 0);
        // The documented creation-order trap: 19,19,14,9 leaves no room for the 3g.
        let mut g = gpu("A100-SXM4-40GB", true);
        for (i, id) in [19, 19, 14].into_iter().enumerate() {
            g.create_gpu_instance(id, None, i as u64 + 1).unwrap();
        }
        assert_eq!(
            g.create_gpu_instance(9, None, 10),
            Err(code::INSUFFICIENT_RESOURCES)
        );
    }

    #[test]
    fn compute_instance_profiles_follow_the_size_rule() {
        assert_eq!(compute_instance_profile_slices(7, 4), Ok(7));
        assert_eq!(compute_instance_profile_slices(7, 3), Ok(4));
        assert_eq!(compute_instance_profile_slices(4, 2), Err(code::NOT_SUPPORTED));
        assert_eq!(compute_instance_profile_slices(1, 7), Ok(1));
        assert_eq!(compute_instance_profile_slices(2, 7), Err(code::NOT_SUPPORTED));
        assert_eq!(compute_instance_profile_slices(7, 8), Err(code::NOT_SUPPORTED));
        assert_eq!(compute_instance_profile_slices(7, 9), Err(code::INVALID_ARGUMENT));
        assert_eq!(compute_instance_placements(1, 7), vec![0, 1, 2, 3, 4, 5, 6]);
        assert_eq!(compute_instance_placements(2, 7), vec![0, 2, 4]);
        assert_eq!(compute_instance_placements(3, 7), vec![0, 4]);
        assert_eq!(compute_instance_placements(3, 3), vec![0]);
        assert_eq!(compute_instance_placements(4, 7), vec![0]);
        assert_eq!(compute_instance_placements(7, 7), vec![0]);
    }

    #[test]
    fn compute_instances_get_lowest_free_ids_and_no_overlap() {
        let mut g = gpu("H100-80GB", true);
        g.create_gpu_instance(0, Some(0), 1).unwrap();
        assert_eq!(g.compute_profile(1, 1).unwrap().instance_count, 3);
        assert_eq!(g.create_compute_instance(1, 1, 2, "MIG-a".into()), Ok(0));
        assert_eq!(g.create_compute_instance(1, 1, 3, "MIG-b".into()), Ok(1));
        assert_eq!(g.create_compute_instance(1, 2, 4, "MIG-c".into()), Ok(2));
        let starts: Vec<u32> = g.gpu_instances[0]
            .compute_instances
            .iter()
            .map(|ci| ci.start)
            .collect();
        assert_eq!(starts, vec![0, 2, 4]);
        // Every compute slice is taken now.
        assert_eq!(
            g.create_compute_instance(1, 0, 5, "MIG-d".into()),
            Err(code::INSUFFICIENT_RESOURCES)
        );
        g.destroy_compute_instance(3).unwrap();
        assert_eq!(g.create_compute_instance(1, 0, 6, "MIG-e".into()), Ok(1));
        assert_eq!(g.gpu_instances[0].compute_instances[1].start, 2);
        let order: Vec<u32> = g.mig_devices().iter().map(|(_, ci)| ci.id).collect();
        assert_eq!(order, vec![0, 1, 2]);
        assert_eq!(g.destroy_gpu_instance(1), Err(code::IN_USE));
        assert_eq!(g.destroy_compute_instance(99), Err(code::INVALID_ARGUMENT));
    }

    #[test]
    fn busy_instances_refuse_destruction() {
        let mut g = gpu("H100-80GB", true);
        g.create_gpu_instance(19, Some(0), 1).unwrap();
        g.create_compute_instance(1, 0, 2, "MIG-a".into()).unwrap();
        g.gpu_instances[0].compute_instances[0].busy = true;
        assert_eq!(g.destroy_compute_instance(2), Err(code::IN_USE));
        g.gpu_instances[0].compute_instances[0].busy = false;
        g.destroy_compute_instance(2).unwrap();
        g.gpu_instances[0].busy = true;
        assert_eq!(g.destroy_gpu_instance(1), Err(code::IN_USE));
        g.gpu_instances[0].busy = false;
        assert_eq!(g.destroy_gpu_instance(1), Ok(()));
        assert_eq!(g.destroy_gpu_instance(1), Err(code::INVALID_ARGUMENT));
    }

    #[test]
    fn mig_mode_switching_reports_through_the_activation_status() {
        // Idle bare-metal Ampere: the driver resets the GPU itself, the mode applies.
        let mut a100 = gpu("A100-80GB", false);
        assert_eq!(a100.set_mig_mode(true), (code::SUCCESS, code::SUCCESS));
        assert!(a100.mig_enabled && a100.mig_pending);
        // A client blocks the reset: pending, IN_USE in the status, SUCCESS returned.
        let mut a100 = gpu("A100-80GB", false);
        a100.client_holds_gpu = true;
        assert_eq!(a100.set_mig_mode(true), (code::SUCCESS, code::IN_USE));
        assert!(!a100.mig_enabled && a100.mig_pending);
        // No driver reset (pass-through VM): pending with RESET_REQUIRED.
        let mut a100 = gpu("A100-80GB", false);
        a100.quirks.no_driver_reset = true;
        assert_eq!(a100.set_mig_mode(true), (code::SUCCESS, code::RESET_REQUIRED));
        assert!(!a100.mig_enabled && a100.mig_pending);

        let mut h100 = gpu("H100-80GB", false);
        h100.quirks.minor_after_mode_change = Some(5);
        assert_eq!(h100.set_mig_mode(true), (code::SUCCESS, code::SUCCESS));
        assert!(h100.mig_enabled && h100.mig_pending);
        assert_eq!(h100.minor, 5, "renumbered after the mode change");
        h100.create_gpu_instance(19, Some(0), 1).unwrap();
        assert_eq!(h100.set_mig_mode(false), (code::SUCCESS, code::IN_USE));
        assert!(h100.mig_enabled && h100.mig_pending);
        assert_eq!(gpu("L4", false).set_mig_mode(true).0, code::NOT_SUPPORTED);
    }

    #[test]
    fn every_kind_of_client_blocks_a_mode_switch() {
        use crate::state::GpuClient;
        for client in [
            GpuClient::nvml_session(41, "nv-hostengine"),
            GpuClient::compute(42, "python3", 512),
        ] {
            let mut h100 = gpu("H100-80GB", false);
            h100.clients.push(client.clone());
            assert_eq!(
                h100.set_mig_mode(true),
                (code::SUCCESS, code::IN_USE),
                "{client:?}"
            );
            assert!(
                !h100.mig_enabled && !h100.mig_pending,
                "nothing pending on Hopper"
            );
            let mut a100 = gpu("A100-80GB", false);
            a100.clients.push(client);
            assert_eq!(a100.set_mig_mode(true), (code::SUCCESS, code::IN_USE));
            assert!(
                !a100.mig_enabled && a100.mig_pending,
                "Ampere waits for the reset"
            );
        }
        // A client of a GPU with MIG on blocks nothing but the switch: instances are made.
        let mut h100 = gpu("H100-80GB", true);
        h100.clients.push(GpuClient::nvml_session(41, "nv-hostengine"));
        assert!(h100.create_gpu_instance(19, Some(0), 1).is_ok());
    }
}
