//! Catalog of MIG-capable GPU models: GPU-instance profiles with real NVML profile IDs and
//! indexes, placements, engines and memory. At run time the truth is what NVML reports; the
//! catalog drives the fake GPU, validation and the packing simulations.
//!
//! Sources: NVIDIA's MIG user guide and published `nvidia-smi` output
//! (`shared/reference/mig-nvml.md`). A value the reference does not pin down is an estimate,
//! listed in [`GpuModel::estimates`], so `gpu-check` can tell a wrong estimate from a wrong
//! fact. Models are found by PCI device ID (product names differ between boards of one model
//! and between drivers); variants with different SM counts (H100 SXM5 and PCIe) are separate
//! entries.

mod tables;

use tables::CATALOG;

use crate::{
    geometry::{Architecture, MigGeometry, MigProfile},
    inventory::{GpuHealth, GpuInventory, MigInventory},
    slices::counter_model,
};

/// Where a model's numbers come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataSource {
    /// Every number is documented by NVIDIA or published from real hardware.
    Documented,
    /// Some numbers are estimates; [`GpuModel::estimates`] says which.
    Estimated,
}

/// A per-profile field of the catalog that can be an estimate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ProfileField {
    Placements,
    MemoryMib,
    Multiprocessors,
    CopyEngines,
    Decoders,
    JpegEngines,
    OfaEngines,
}

impl ProfileField {
    /// The field's name as reports print it.
    pub fn as_str(self) -> &'static str {
        match self {
            ProfileField::Placements => "placements",
            ProfileField::MemoryMib => "memory MiB",
            ProfileField::Multiprocessors => "multiprocessors",
            ProfileField::CopyEngines => "copy engines",
            ProfileField::Decoders => "decoders",
            ProfileField::JpegEngines => "JPEG engines",
            ProfileField::OfaEngines => "OFA engines",
        }
    }
}

/// Fields of some profiles whose values are estimates rather than documented numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Estimate {
    pub fields: &'static [ProfileField],
    /// GPU-instance profile IDs concerned; empty means every profile of the model.
    pub profile_ids: &'static [u32],
    /// What the reference says and how the value was chosen.
    pub why: &'static str,
}

impl Estimate {
    /// True when this estimate covers `field` of profile `profile_id`.
    pub fn covers(&self, profile_id: u32, field: ProfileField) -> bool {
        self.fields.contains(&field)
            && (self.profile_ids.is_empty() || self.profile_ids.contains(&profile_id))
    }
}

/// A MIG-capable GPU model.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuModel {
    /// Short key used in configuration, e.g. `H100-80GB`.
    pub key: &'static str,
    /// Product name as NVML reports it.
    pub product_name: &'static str,
    /// PCI device IDs (vendor 0x10de) of the parts sharing this table.
    pub pci_device_ids: &'static [u16],
    pub architecture: Architecture,
    /// CUDA compute capability (major, minor).
    pub cuda_compute_capability: (u32, u32),
    /// Total device memory in MiB.
    pub memory_mib: u64,
    /// Multiprocessors of the whole GPU (MIG off).
    pub multiprocessors: u32,
    /// Compute slices in MIG mode.
    pub compute_slices: u32,
    /// Maximum MIG devices on one GPU.
    pub max_mig_devices: u32,
    /// GPU-instance profiles in NVML index order.
    pub profiles: Vec<MigProfile>,
    /// The numbers that are estimates (empty: everything is documented).
    pub estimates: &'static [Estimate],
}

impl GpuModel {
    /// Whether the model's table is fully documented.
    pub fn source(&self) -> DataSource {
        if self.estimates.is_empty() {
            DataSource::Documented
        } else {
            DataSource::Estimated
        }
    }

    /// The estimate covering `field` of profile `profile_id`, if that value is an estimate.
    pub fn estimate(&self, profile_id: u32, field: ProfileField) -> Option<&'static Estimate> {
        self.estimates.iter().find(|e| e.covers(profile_id, field))
    }

    /// The model's MIG geometry (profiles plus budget).
    pub fn geometry(&self) -> MigGeometry {
        MigGeometry::new(self.profiles.clone(), self.memory_mib)
    }

    /// Memory slices of the GPU.
    pub fn memory_slices(&self) -> u32 {
        self.geometry().budget.memory_slices
    }

    /// A deterministic `GPU-…` UUID for GPU `minor` of this model (used by the fake GPU and
    /// by tests; real UUIDs come from NVML).
    pub fn uuid(&self, minor: u32) -> String {
        let key = self.key.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        format!(
            "GPU-{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
            key >> 32,
            (key >> 16) & 0xffff,
            key & 0xfff,
            minor & 0xfff,
            u64::from(minor)
        )
    }

    /// The inventory a healthy GPU of this model reports, without instances.
    pub fn inventory(&self, minor: u32, mig_enabled: bool) -> GpuInventory {
        let geometry = self.geometry();
        GpuInventory {
            minor,
            index: minor,
            uuid: self.uuid(minor),
            product_name: self.product_name.to_string(),
            architecture: Some(self.architecture),
            cuda_compute_capability: Some(format!(
                "{}.{}",
                self.cuda_compute_capability.0, self.cuda_compute_capability.1
            )),
            pci_bus_id: Some(format!("0000:{:02x}:00.0", 0x10 + minor)),
            numa_node: Some(i64::from(minor / 4)),
            memory_mib: self.memory_mib,
            mig: Some(MigInventory {
                enabled: mig_enabled,
                change_pending: false,
                mode_switchable: self.architecture.mig_mode_switchable(),
                engine_counters_overruled: counter_model::engine_counters_overruled(&geometry),
                geometry,
                instances: Vec::new(),
            }),
            health: GpuHealth::healthy(),
        }
    }
}

/// Every model in the catalog.
pub fn models() -> &'static [GpuModel] {
    &CATALOG
}

/// Looks a model up by its key (case-insensitive).
pub fn model(key: &str) -> Option<&'static GpuModel> {
    CATALOG.iter().find(|m| m.key.eq_ignore_ascii_case(key))
}

/// Looks a model up by PCI device ID, which is how the plugin and gpu-check identify a GPU
/// (also telling the SXM and PCIe variants of a GPU apart).
pub fn model_by_pci_device_id(device_id: u16) -> Option<&'static GpuModel> {
    CATALOG.iter().find(|m| m.pci_device_ids.contains(&device_id))
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;
    use crate::{
        geometry::{Placement, PlacementError, gpu_instance_id},
        nvml_constants::GI_PROFILE_COUNT,
        profile::ProfileName,
    };

    /// Checks a whole layout: every instance must be addable to the ones before it.
    fn check_layout(g: &MigGeometry, layout: &[Placement]) -> Result<(), PlacementError> {
        for (i, placement) in layout.iter().enumerate() {
            g.check_add(&layout[..i], *placement)?;
        }
        Ok(())
    }

    /// How many more instances of `profile_id` fit next to `existing` (NVML's remaining
    /// capacity). Greedy over starts is exact: placements of one profile never overlap.
    fn remaining_capacity(g: &MigGeometry, existing: &[Placement], profile_id: u32) -> u32 {
        let Some(profile) = g.profile_by_id(profile_id) else {
            return 0;
        };
        let mut layout = existing.to_vec();
        let mut count = 0;
        for start in &profile.placements {
            let candidate = Placement {
                profile_id,
                start: *start,
            };
            if g.check_add(&layout, candidate).is_ok() {
                layout.push(candidate);
                count += 1;
            }
        }
        count
    }

    fn id_of(model: &GpuModel, name: &str) -> u32 {
        let name: ProfileName = name.parse().unwrap();
        model
            .profiles
            .iter()
            .find(|p| p.name == name)
            .unwrap()
            .gi_profile_id
    }

    #[test]
    fn every_model_is_internally_consistent() {
        for m in models() {
            let g = m.geometry();
            let mut ids = HashSet::new();
            let mut indexes = HashSet::new();
            for p in &m.profiles {
                assert!(
                    ids.insert(p.gi_profile_id),
                    "{}: duplicate profile id {}",
                    m.key,
                    p.gi_profile_id
                );
                assert!(indexes.insert(p.gi_profile_index), "{}: duplicate index", m.key);
                assert!(p.gi_profile_index < GI_PROFILE_COUNT);
                assert!(p.compute_slices <= m.compute_slices, "{} {}", m.key, p.name);
                assert_eq!(p.name.compute_slices, p.compute_slices, "{} {}", m.key, p.name);
                for s in &p.placements {
                    assert!(
                        s + p.memory_slices <= g.budget.memory_slices,
                        "{} {}@{s}",
                        m.key,
                        p.name
                    );
                    assert_eq!(s % p.memory_slices, 0, "{} {}@{s} is not aligned", m.key, p.name);
                }
                // No instance limit is stricter than what placements and budgets enforce, so the
                // counters of the slice model (memory slices + budgets) capture every NVML limit.
                assert_eq!(
                    remaining_capacity(&g, &[], p.gi_profile_id),
                    p.instance_count,
                    "{} {}: instance count not implied by placements and budgets",
                    m.key,
                    p.name
                );
            }
            assert_eq!(g.budget.memory_slices, if m.compute_slices == 4 { 4 } else { 8 });
            assert_eq!(g.budget.engines.ofa_engines, 1, "{}: one OFA engine", m.key);
        }
    }

    #[test]
    fn real_profile_ids_differ_from_indexes() {
        let a100 = model("A100-SXM4-40GB").unwrap();
        assert_eq!(id_of(a100, "1g.5gb"), 19);
        assert_eq!(id_of(a100, "1g.5gb+me"), 20);
        assert_eq!(id_of(a100, "1g.10gb"), 15);
        assert_eq!(id_of(a100, "7g.40gb"), 0);
        let a30 = model("A30-24GB").unwrap();
        assert_eq!(id_of(a30, "1g.6gb"), 14);
        assert_eq!(id_of(a30, "2g.12gb+me"), 6);
        assert_eq!(model_by_pci_device_id(0x2330).unwrap().key, "H100-80GB");
    }

    #[test]
    fn zero_waste_layouts_fit_and_overlaps_do_not() {
        let h100 = model("H100-80GB").unwrap();
        let g = h100.geometry();
        let p = |name: &str, start| Placement {
            profile_id: id_of(h100, name),
            start,
        };
        for layout in [
            vec![p("7g.80gb", 0)],
            vec![p("4g.40gb", 0), p("3g.40gb", 4)],
            vec![p("2g.20gb", 0), p("2g.20gb", 2), p("3g.40gb", 4)],
            vec![p("1g.10gb", 0), p("1g.10gb", 1), p("2g.20gb", 2), p("3g.40gb", 4)],
            (0..7).map(|s| p("1g.10gb", s)).collect(),
            vec![p("1g.20gb", 0), p("1g.20gb", 2), p("1g.20gb", 4), p("1g.20gb", 6)],
        ] {
            check_layout(&g, &layout).unwrap_or_else(|e| panic!("{layout:?}: {e}"));
        }
        assert!(matches!(
            check_layout(&g, &[p("3g.40gb", 4), p("2g.20gb", 4)]),
            Err(PlacementError::Overlap { .. })
        ));
        assert!(matches!(
            check_layout(&g, &[p("1g.10gb", 0), p("1g.10gb", 0)]),
            Err(PlacementError::Overlap { .. })
        ));
        // A single OFA engine: a second +me instance exceeds the budget even without overlap.
        assert!(matches!(
            check_layout(&g, &[p("1g.10gb+me", 0), p("1g.10gb+me", 3)]),
            Err(PlacementError::InstanceLimit { .. } | PlacementError::Budget { .. })
        ));
        assert!(matches!(
            g.check_add(&[], p("3g.40gb", 2)),
            Err(PlacementError::InvalidStart { .. })
        ));
        assert!(matches!(
            g.check_add(
                &[],
                Placement {
                    profile_id: 99,
                    start: 0
                }
            ),
            Err(PlacementError::UnknownProfile(99))
        ));
    }

    #[test]
    fn gpu_instance_ids_follow_the_heap_layout() {
        assert_eq!(gpu_instance_id(0, 8, 8, false), 0);
        assert_eq!(gpu_instance_id(0, 4, 8, false), 1);
        assert_eq!(gpu_instance_id(4, 4, 8, false), 2);
        assert_eq!(gpu_instance_id(4, 4, 8, true), 1);
        assert_eq!(gpu_instance_id(2, 2, 8, false), 4);
        assert_eq!(gpu_instance_id(6, 1, 8, false), 13);
        assert_eq!(gpu_instance_id(3, 1, 4, false), 6);
        // Every placement of every model gets an ID in 0..=14, unique among non-overlapping ones.
        for m in models() {
            let g = m.geometry();
            for (p, s) in g.all_placements() {
                let id = gpu_instance_id(s, p.memory_slices, g.budget.memory_slices, false);
                assert!(id <= 14, "{} {}@{s} -> {id}", m.key, p.name);
            }
        }
    }

    #[test]
    fn estimates_name_existing_profiles_and_documented_models_have_none() {
        for m in models() {
            for e in m.estimates {
                assert!(!e.fields.is_empty(), "{}: an estimate without fields", m.key);
                for id in e.profile_ids {
                    assert!(
                        m.profiles.iter().any(|p| p.gi_profile_id == *id),
                        "{}: estimate names profile ID {id}, which the model lacks",
                        m.key
                    );
                }
            }
            assert_eq!(m.source() == DataSource::Documented, m.estimates.is_empty());
        }
        let b200 = model("B200").unwrap();
        assert_eq!(b200.source(), DataSource::Estimated);
        assert!(b200.estimate(9, ProfileField::Multiprocessors).is_some());
        assert!(b200.estimate(19, ProfileField::Multiprocessors).is_none());
        assert!(
            b200.estimate(19, ProfileField::Placements).is_some(),
            "every profile"
        );
        assert_eq!(model("H100-80GB").unwrap().source(), DataSource::Documented);
    }

    #[test]
    fn h100_pcie_and_sxm_are_separate_models() {
        let sxm = model_by_pci_device_id(0x2330).unwrap();
        let pcie = model_by_pci_device_id(0x2331).unwrap();
        assert_eq!(sxm.key, "H100-80GB");
        assert_eq!(pcie.key, "H100-PCIE-80GB");
        assert_eq!((sxm.multiprocessors, pcie.multiprocessors), (132, 114));
        let sms = |m: &GpuModel| m.profiles.iter().map(|p| p.engines.multiprocessors).max();
        assert_eq!(sms(pcie), Some(114), "7g spans the PCIe card's SMs");
        assert!(pcie.estimate(0, ProfileField::Multiprocessors).is_some());
        // Same placements and IDs: only the numbers differ.
        let shape = |m: &GpuModel| {
            m.profiles
                .iter()
                .map(|p| (p.gi_profile_id, p.placements.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(shape(sxm), shape(pcie));
        for m in models() {
            for id in m.pci_device_ids {
                assert_eq!(model_by_pci_device_id(*id).unwrap().key, m.key, "unique PCI IDs");
            }
        }
    }
}
