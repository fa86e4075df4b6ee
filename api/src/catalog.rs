//! Catalog of MIG-capable GPU models: their GPU-instance profiles with real NVML profile IDs
//! and index constants, placements, engines and memory.
//!
//! At run time the truth is what NVML reports; this catalog drives the fake GPU, validation
//! and the packing simulations. Sources: NVIDIA's MIG user guide and published `nvidia-smi`
//! output (see `shared/reference/mig-nvml.md`). Models whose numbers are partly estimated
//! say so in [`GpuModel::data`].

use std::sync::LazyLock;

use crate::{
    geometry::{Architecture, Engines, MigGeometry, MigProfile},
    inventory::{GpuHealth, GpuInventory, MigInventory},
    nvml_constants::*,
    profile::ProfileName,
};

/// How much of a model's table comes from published hardware output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataQuality {
    /// Profile IDs, placements, engines and memory were published from real hardware.
    Published,
    /// Some numbers are estimates; the text says which.
    Partial(&'static str),
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
    /// Architecture.
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
    /// Where the numbers come from.
    pub data: DataQuality,
}

impl GpuModel {
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
                geometry: self.geometry(),
                instances: Vec::new(),
            }),
            health: GpuHealth::healthy(),
        }
    }
}

/// One row of a profile table: index, ID, name, compute slices, memory slices, instance
/// count, starts, SM, CE, DEC, ENC, JPEG, OFA, MiB.
type Row = (
    u32,
    u32,
    &'static str,
    u32,
    u32,
    u32,
    &'static [u32],
    [u32; 6],
    u64,
);

fn profiles(rows: &[Row]) -> Vec<MigProfile> {
    rows.iter()
        .map(|&(index, id, name, cs, ms, count, starts, e, mib)| MigProfile {
            name: name
                .parse::<ProfileName>()
                .unwrap_or_else(|err| panic!("catalog profile name: {err}")),
            gi_profile_id: id,
            gi_profile_index: index,
            compute_slices: cs,
            memory_slices: ms,
            instance_count: count,
            placements: starts.to_vec(),
            engines: Engines {
                multiprocessors: e[0],
                copy_engines: e[1],
                decoders: e[2],
                encoders: e[3],
                jpeg_engines: e[4],
                ofa_engines: e[5],
            },
            memory_mib: mib,
        })
        .collect()
}

const ALL7: &[u32] = &[0, 1, 2, 3, 4, 5, 6];
const EVEN: &[u32] = &[0, 2, 4, 6];
const TWO_G: &[u32] = &[0, 2, 4];
const THREE_G: &[u32] = &[0, 4];
const ZERO: &[u32] = &[0];

/// The eight-slice profile set of A100/H100/H200/B200 class parts, parametrised by the
/// numbers that differ between models: (name, SM, CE, DEC, JPEG, OFA, MiB) per profile in
/// the order 1g, 1g+me, 1g double memory, 2g, 3g, 4g, 7g.
fn eight_slice(p: [(&'static str, [u32; 6], u64); 7]) -> Vec<MigProfile> {
    profiles(&[
        (GI_PROFILE_1_SLICE, 19, p[0].0, 1, 1, 7, ALL7, p[0].1, p[0].2),
        (GI_PROFILE_2_SLICE, 14, p[3].0, 2, 2, 3, TWO_G, p[3].1, p[3].2),
        (GI_PROFILE_3_SLICE, 9, p[4].0, 3, 4, 2, THREE_G, p[4].1, p[4].2),
        (GI_PROFILE_4_SLICE, 5, p[5].0, 4, 4, 1, ZERO, p[5].1, p[5].2),
        (GI_PROFILE_7_SLICE, 0, p[6].0, 7, 8, 1, ZERO, p[6].1, p[6].2),
        (GI_PROFILE_1_SLICE_REV1, 20, p[1].0, 1, 1, 1, ALL7, p[1].1, p[1].2),
        (GI_PROFILE_1_SLICE_REV2, 15, p[2].0, 1, 2, 4, EVEN, p[2].1, p[2].2),
    ])
}

/// Hopper profile engines (H100 SXM pattern): SM, CE, DEC, ENC, JPEG, OFA for
/// 1g, 1g+me, 1g double, 2g, 3g, 4g, 7g.
const HOPPER_ENGINES: [[u32; 6]; 7] = [
    [16, 1, 1, 0, 1, 0],
    [16, 1, 1, 0, 1, 1],
    [26, 1, 1, 0, 1, 0],
    [32, 2, 2, 0, 2, 0],
    [60, 3, 3, 0, 3, 0],
    [64, 4, 4, 0, 4, 0],
    [132, 8, 7, 0, 7, 1],
];

fn hopper(names: [&'static str; 6], mib: [u64; 6]) -> Vec<MigProfile> {
    let me = format!("{}+me", names[0]).leak() as &'static str;
    let e = HOPPER_ENGINES;
    eight_slice([
        (names[0], e[0], mib[0]),
        (me, e[1], mib[0]),
        (names[1], e[2], mib[1]),
        (names[2], e[3], mib[2]),
        (names[3], e[4], mib[3]),
        (names[4], e[5], mib[4]),
        (names[5], e[6], mib[5]),
    ])
}

static CATALOG: LazyLock<Vec<GpuModel>> = LazyLock::new(|| {
    vec![
        GpuModel {
            key: "A100-SXM4-40GB",
            product_name: "NVIDIA A100-SXM4-40GB",
            pci_device_ids: &[0x20B0, 0x20B1, 0x20F1, 0x20F6],
            architecture: Architecture::Ampere,
            cuda_compute_capability: (8, 0),
            memory_mib: 40960,
            multiprocessors: 108,
            compute_slices: 7,
            max_mig_devices: 7,
            profiles: eight_slice([
                ("1g.5gb", [14, 1, 0, 0, 0, 0], 4864),
                ("1g.5gb+me", [14, 1, 1, 0, 1, 1], 4864),
                ("1g.10gb", [14, 1, 1, 0, 0, 0], 9856),
                ("2g.10gb", [28, 2, 1, 0, 0, 0], 9856),
                ("3g.20gb", [42, 3, 2, 0, 0, 0], 19968),
                ("4g.20gb", [56, 4, 2, 0, 0, 0], 19968),
                ("7g.40gb", [98, 7, 5, 0, 1, 1], 40192),
            ]),
            data: DataQuality::Published,
        },
        GpuModel {
            key: "A100-80GB",
            product_name: "NVIDIA A100-SXM4-80GB",
            pci_device_ids: &[0x20B2, 0x20B5, 0x20F3, 0x20F5],
            architecture: Architecture::Ampere,
            cuda_compute_capability: (8, 0),
            memory_mib: 81920,
            multiprocessors: 108,
            compute_slices: 7,
            max_mig_devices: 7,
            profiles: eight_slice([
                ("1g.10gb", [14, 1, 0, 0, 0, 0], 9728),
                ("1g.10gb+me", [14, 1, 1, 0, 1, 1], 9728),
                ("1g.20gb", [14, 1, 1, 0, 0, 0], 19968),
                ("2g.20gb", [28, 2, 1, 0, 0, 0], 19968),
                ("3g.40gb", [42, 3, 2, 0, 0, 0], 40192),
                ("4g.40gb", [56, 4, 2, 0, 0, 0], 40192),
                ("7g.80gb", [98, 7, 5, 0, 1, 1], 80896),
            ]),
            data: DataQuality::Partial(
                "memory per profile varies by driver (1g 9.50-9.75 GiB, 7g 78.5-79.0 GiB); \
                 some drivers report more decoders for 2g/3g/4g",
            ),
        },
        GpuModel {
            key: "A30-24GB",
            product_name: "NVIDIA A30",
            pci_device_ids: &[0x20B7],
            architecture: Architecture::Ampere,
            cuda_compute_capability: (8, 0),
            memory_mib: 24576,
            multiprocessors: 56,
            compute_slices: 4,
            max_mig_devices: 4,
            profiles: profiles(&[
                (
                    GI_PROFILE_1_SLICE,
                    14,
                    "1g.6gb",
                    1,
                    1,
                    4,
                    &[0, 1, 2, 3],
                    [14, 1, 1, 0, 0, 0],
                    5952,
                ),
                (
                    GI_PROFILE_2_SLICE,
                    5,
                    "2g.12gb",
                    2,
                    2,
                    2,
                    &[0, 2],
                    [28, 2, 2, 0, 0, 0],
                    11968,
                ),
                (
                    GI_PROFILE_4_SLICE,
                    0,
                    "4g.24gb",
                    4,
                    4,
                    1,
                    ZERO,
                    [56, 4, 4, 0, 1, 1],
                    24000,
                ),
                (
                    GI_PROFILE_1_SLICE_REV1,
                    21,
                    "1g.6gb+me",
                    1,
                    1,
                    1,
                    &[0, 1, 2, 3],
                    [14, 1, 1, 0, 1, 1],
                    5952,
                ),
                (
                    GI_PROFILE_2_SLICE_REV1,
                    6,
                    "2g.12gb+me",
                    2,
                    2,
                    1,
                    &[0, 2],
                    [28, 2, 2, 0, 1, 1],
                    11968,
                ),
            ]),
            data: DataQuality::Partial(
                "4g memory is 23.44-23.50 GiB by driver; 1g decoder count is 0 in the docs, 1 on hardware",
            ),
        },
        GpuModel {
            key: "H100-80GB",
            product_name: "NVIDIA H100 80GB HBM3",
            pci_device_ids: &[0x2330, 0x2331, 0x2324, 0x2322],
            architecture: Architecture::Hopper,
            cuda_compute_capability: (9, 0),
            memory_mib: 81559,
            multiprocessors: 132,
            compute_slices: 7,
            max_mig_devices: 7,
            profiles: hopper(
                ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
                [9984, 20096, 20096, 40448, 40448, 81152],
            ),
            data: DataQuality::Published,
        },
        GpuModel {
            key: "H100-NVL-94GB",
            product_name: "NVIDIA H100 NVL",
            pci_device_ids: &[0x2321],
            architecture: Architecture::Hopper,
            cuda_compute_capability: (9, 0),
            memory_mib: 95830,
            multiprocessors: 132,
            compute_slices: 7,
            max_mig_devices: 7,
            profiles: hopper(
                ["1g.12gb", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"],
                [11008, 22016, 22016, 47232, 47232, 94976],
            ),
            data: DataQuality::Partial(
                "placements, SM and engine counts assumed equal to H100 SXM; 3g/4g/7g memory ranges by driver",
            ),
        },
        GpuModel {
            key: "H100-96GB",
            product_name: "NVIDIA GH200 96GB HBM3",
            pci_device_ids: &[0x233D, 0x2342],
            architecture: Architecture::Hopper,
            cuda_compute_capability: (9, 0),
            memory_mib: 97871,
            multiprocessors: 132,
            compute_slices: 7,
            max_mig_devices: 7,
            profiles: hopper(
                ["1g.12gb", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"],
                [11264, 23552, 23552, 47616, 47616, 95232],
            ),
            data: DataQuality::Partial(
                "shared by H100 96GB and GH200 96GB; SM and engine counts assumed equal to H100 SXM",
            ),
        },
        GpuModel {
            key: "H200-141GB",
            product_name: "NVIDIA H200",
            pci_device_ids: &[0x2335, 0x233B],
            architecture: Architecture::Hopper,
            cuda_compute_capability: (9, 0),
            memory_mib: 143771,
            multiprocessors: 132,
            compute_slices: 7,
            max_mig_devices: 7,
            profiles: hopper(
                ["1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"],
                [16384, 33024, 33024, 71168, 71168, 142336],
            ),
            data: DataQuality::Partial(
                "placements, SM and engine counts assumed equal to H100 SXM; 7g memory estimated (about 138-139 GiB)",
            ),
        },
        GpuModel {
            key: "GH200-144GB",
            product_name: "NVIDIA GH200 144G HBM3e",
            pci_device_ids: &[0x2348],
            architecture: Architecture::Hopper,
            cuda_compute_capability: (9, 0),
            memory_mib: 146944,
            multiprocessors: 132,
            compute_slices: 7,
            max_mig_devices: 7,
            profiles: hopper(
                ["1g.18gb", "1g.36gb", "2g.36gb", "3g.72gb", "4g.72gb", "7g.144gb"],
                [17920, 36096, 36096, 72192, 72192, 144384],
            ),
            data: DataQuality::Partial(
                "3g/4g/7g memory estimated from 1g double memory; placements, SM and engines assumed equal to H100 SXM",
            ),
        },
        GpuModel {
            key: "B200",
            product_name: "NVIDIA B200",
            pci_device_ids: &[0x2901],
            architecture: Architecture::Blackwell,
            cuda_compute_capability: (10, 0),
            memory_mib: 183359,
            multiprocessors: 148,
            compute_slices: 7,
            max_mig_devices: 7,
            profiles: eight_slice([
                ("1g.23gb", [18, 2, 1, 0, 1, 0], 22528),
                ("1g.23gb+me", [18, 2, 1, 0, 1, 1], 22528),
                ("1g.45gb", [30, 2, 1, 0, 1, 0], 45312),
                ("2g.45gb", [36, 4, 2, 0, 2, 0], 45312),
                ("3g.90gb", [72, 6, 3, 0, 3, 0], 90624),
                ("4g.90gb", [72, 8, 4, 0, 4, 0], 90624),
                ("7g.180gb", [144, 16, 7, 0, 7, 1], 181248),
            ]),
            data: DataQuality::Partial(
                "placements assumed equal to Hopper; 3g/4g/7g SM, decoder, JPEG and memory estimated; \
                 1g memory 20.5-22.0 GiB by driver",
            ),
        },
    ]
});

/// Every model in the catalog.
pub fn models() -> &'static [GpuModel] {
    &CATALOG
}

/// Looks a model up by its key (case-insensitive).
pub fn model(key: &str) -> Option<&'static GpuModel> {
    CATALOG.iter().find(|m| m.key.eq_ignore_ascii_case(key))
}

/// Looks a model up by PCI device ID.
pub fn model_by_pci_device_id(device_id: u16) -> Option<&'static GpuModel> {
    CATALOG.iter().find(|m| m.pci_device_ids.contains(&device_id))
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;
    use crate::geometry::{Placement, PlacementError, gpu_instance_id};

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
                    g.remaining_capacity(&[], p.gi_profile_id),
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
            g.check_layout(&layout)
                .unwrap_or_else(|e| panic!("{layout:?}: {e}"));
        }
        assert!(matches!(
            g.check_layout(&[p("3g.40gb", 4), p("2g.20gb", 4)]),
            Err(PlacementError::Overlap { .. })
        ));
        assert!(matches!(
            g.check_layout(&[p("1g.10gb", 0), p("1g.10gb", 0)]),
            Err(PlacementError::Overlap { .. })
        ));
        // A single OFA engine: a second +me instance exceeds the budget even without overlap.
        assert!(matches!(
            g.check_layout(&[p("1g.10gb+me", 0), p("1g.10gb+me", 3)]),
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
}
