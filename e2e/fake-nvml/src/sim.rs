//! The MIG rules the fake enforces, on the in-memory state (mig-nvml.md §11). Placement
//! checks delegate to `MigGeometry::check_add`, so the fake and migdra's pure model agree
//! exactly; everything here answers NVML return codes.

use migdra_api::{
    geometry::{Architecture, MigGeometry, MigProfile, Placement, PlacementError},
    nvml_constants::{
        CI_PROFILE_1_SLICE_REV1, CI_PROFILE_COUNT, GI_PROFILE_COUNT, compute_instance_slices,
        valid_compute_instance_sizes,
    },
    profile::ProfileVariant,
};

use crate::{
    code,
    model::FakeModel,
    state::{ComputeInstanceState, GpuInstanceState, GpuState},
};

/// Most compute instances one GPU instance can hold (CI IDs 0–7).
pub const MAX_COMPUTE_INSTANCES: u32 = 8;
/// `NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE_NVL` (index 8): not supported by any simulated GPU.
const CI_PROFILE_7_SLICE_NVL: u32 = 8;

/// NVML's answer to a rejected GPU-instance placement.
pub fn placement_error_code(err: &PlacementError) -> u32 {
    match err {
        PlacementError::UnknownProfile(_) | PlacementError::InvalidStart { .. } => code::INVALID_ARGUMENT,
        PlacementError::Overlap { .. }
        | PlacementError::InstanceLimit { .. }
        | PlacementError::Budget { .. } => code::INSUFFICIENT_RESOURCES,
    }
}

/// The default auto-placement order of `nvmlDeviceCreateGpuInstance` (as observed on A100),
/// restricted to the profile's valid starts; starts the table does not mention come last.
pub fn default_auto_placement(profile: &MigProfile) -> Vec<u32> {
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
        .filter(|s| profile.placements.contains(s))
        .collect();
    let rest: Vec<u32> = profile
        .placements
        .iter()
        .copied()
        .filter(|s| !order.contains(s))
        .collect();
    order.extend(rest);
    order
}

/// Compute slices of compute-instance profile `index` inside a GPU instance with
/// `gi_slices` compute slices (go-nvlib's size rule; index 7 only for 1-slice GPU instances).
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
    match compute_instance_slices(index) {
        Some(c) if valid_compute_instance_sizes(gi_slices).contains(&c) => Ok(c),
        _ => Err(code::NOT_SUPPORTED),
    }
}

/// Valid starts of a `ci_slices` compute instance inside a `gi_slices` GPU instance: aligned
/// to the next power of two (1c everywhere; 2c at 0, 2, 4; 3c at 0 and 4 in a 7g; 4c at 0).
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
    /// Profile ID (= index).
    pub id: u32,
    /// Compute slices.
    pub slices: u32,
    /// How many fit in the GPU instance.
    pub instance_count: u32,
    /// Multiprocessors.
    pub multiprocessors: u32,
}

impl GpuState {
    /// The GPU's model.
    pub fn fake_model(&self) -> Option<FakeModel> {
        FakeModel::lookup(&self.model)
    }

    /// MIG geometry, for MIG-capable GPUs.
    pub fn geometry(&self) -> Option<MigGeometry> {
        if !self.mig_capable {
            return None;
        }
        self.fake_model().and_then(|m| m.mig).map(|m| m.geometry())
    }

    /// Architecture, for catalog models.
    pub fn architecture(&self) -> Option<Architecture> {
        self.fake_model().and_then(|m| m.mig).map(|m| m.architecture)
    }

    /// GPU-instance profile by ID.
    pub fn gi_profile(&self, profile_id: u32) -> Option<MigProfile> {
        self.geometry().and_then(|g| g.profile_by_id(profile_id).cloned())
    }

    /// GPU-instance profile by index: NOT_SUPPORTED for a non-MIG GPU or an index the model
    /// lacks, INVALID_ARGUMENT at or beyond COUNT.
    pub fn gi_profile_by_index(&self, index: u32) -> Result<MigProfile, u32> {
        let geometry = self.geometry().ok_or(code::NOT_SUPPORTED)?;
        if index >= GI_PROFILE_COUNT {
            return Err(code::INVALID_ARGUMENT);
        }
        geometry
            .profiles
            .into_iter()
            .find(|p| p.gi_profile_index == index)
            .ok_or(code::NOT_SUPPORTED)
    }

    /// Fails with NOT_SUPPORTED unless the GPU is MIG-capable with MIG mode on.
    pub fn require_mig(&self) -> Result<MigGeometry, u32> {
        match self.geometry() {
            Some(g) if self.mig_enabled => Ok(g),
            _ => Err(code::NOT_SUPPORTED),
        }
    }

    /// Existing GPU instances as geometry placements.
    pub fn placements(&self) -> Vec<Placement> {
        self.gpu_instances
            .iter()
            .map(|gi| Placement {
                profile_id: gi.profile_id,
                start: gi.start,
            })
            .collect()
    }

    /// Memory slices of the GPU.
    pub fn memory_slices(&self) -> u32 {
        self.geometry().map(|g| g.budget.memory_slices).unwrap_or(0)
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

    /// Checks whether `profile_id` can be placed at `start` (NVML's order of checks).
    pub fn check_gpu_instance(&self, profile_id: u32, start: u32) -> Result<(), u32> {
        let geometry = self.require_mig()?;
        let existing = self.placements();
        let new = Placement { profile_id, start };
        geometry
            .check_add(&existing, new)
            .map_err(|e| placement_error_code(&e))?;
        // `+me.all` owns every media engine: it only coexists with `-me` profiles.
        let variant = |id: u32| geometry.profile_by_id(id).map(|p| p.name.variant);
        let new_variant = variant(profile_id);
        for placed in &existing {
            let other = variant(placed.profile_id);
            let all = Some(ProfileVariant::AllMediaEngines);
            let none = Some(ProfileVariant::NoMediaEngines);
            if (new_variant == all && other != none) || (other == all && new_variant != none) {
                return Err(code::INSUFFICIENT_RESOURCES);
            }
        }
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
        let geometry = self.require_mig()?;
        let profile = geometry
            .profile_by_id(profile_id)
            .ok_or(code::INVALID_ARGUMENT)?
            .clone();
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
                    .unwrap_or_else(|| default_auto_placement(&profile));
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
        let id = migdra_api::geometry::gpu_instance_id(
            start,
            profile.memory_slices,
            geometry.budget.memory_slices,
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

    /// How many more GPU instances of `profile_id` fit.
    pub fn remaining_gpu_instance_capacity(&self, profile_id: u32) -> Result<u32, u32> {
        let geometry = self.require_mig()?;
        if geometry.profile_by_id(profile_id).is_none() {
            return Err(code::INVALID_ARGUMENT);
        }
        Ok(geometry.remaining_capacity(&self.placements(), profile_id))
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
        let slices = compute_instance_profile_slices(g, index)?;
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

    /// Handles `nvmlDeviceSetMigMode`: returns (return code, activation status).
    pub fn set_mig_mode(&mut self, enable: bool) -> (u32, u32) {
        let Some(arch) = self.architecture().filter(|_| self.mig_capable) else {
            return (code::NOT_SUPPORTED, code::NOT_SUPPORTED);
        };
        if enable == self.mig_enabled {
            self.mig_pending = enable;
            return (code::SUCCESS, code::SUCCESS);
        }
        let busy = self.client_holds_gpu || !self.gpu_instances.is_empty();
        if arch.mig_mode_switchable() {
            if busy {
                return (code::IN_USE, code::IN_USE);
            }
            self.mig_enabled = enable;
            self.mig_pending = enable;
            return (code::SUCCESS, code::SUCCESS);
        }
        // Ampere: the change needs a GPU reset, which the fake only does when told to
        // (`FakeState::reset_gpu`); NVML accepts the request and reports why it is pending.
        self.mig_pending = enable;
        (
            code::SUCCESS,
            if busy { code::IN_USE } else { code::RESET_REQUIRED },
        )
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
            lost: false,
            auto_placement: BTreeMap::new(),
            gpu_instances: Vec::new(),
        }
    }

    #[test]
    fn profile_index_lookups_follow_nvml() {
        let h100 = gpu("H100-80GB", false);
        // Works with MIG off; the index gives the real ID.
        assert_eq!(h100.gi_profile_by_index(0).unwrap().gi_profile_id, 19);
        assert_eq!(h100.gi_profile_by_index(9).unwrap().gi_profile_id, 15);
        assert_eq!(h100.gi_profile_by_index(5), Err(code::NOT_SUPPORTED));
        assert_eq!(
            h100.gi_profile_by_index(GI_PROFILE_COUNT),
            Err(code::INVALID_ARGUMENT)
        );
        assert_eq!(gpu("L4", false).gi_profile_by_index(0), Err(code::NOT_SUPPORTED));
    }

    #[test]
    fn gpu_instance_rules_match_the_geometry() {
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
    fn mig_mode_switching_depends_on_architecture() {
        let mut a100 = gpu("A100-80GB", false);
        assert_eq!(a100.set_mig_mode(true), (code::SUCCESS, code::RESET_REQUIRED));
        assert!(!a100.mig_enabled && a100.mig_pending);
        a100.client_holds_gpu = true;
        assert_eq!(a100.set_mig_mode(true), (code::SUCCESS, code::IN_USE));

        let mut h100 = gpu("H100-80GB", false);
        assert_eq!(h100.set_mig_mode(true), (code::SUCCESS, code::SUCCESS));
        assert!(h100.mig_enabled && h100.mig_pending);
        h100.create_gpu_instance(19, Some(0), 1).unwrap();
        assert_eq!(h100.set_mig_mode(false), (code::IN_USE, code::IN_USE));
        assert!(h100.mig_enabled);
        assert_eq!(gpu("L4", false).set_mig_mode(true).0, code::NOT_SUPPORTED);
    }
}
