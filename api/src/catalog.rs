//! Catalog of MIG-capable GPU models: their GPU-instance profiles with real NVML profile IDs
//! and index constants, placements, engines and memory.
//!
//! At run time the truth is what NVML reports; this catalog drives the fake GPU, validation
//! and the packing simulations. Sources: NVIDIA's MIG user guide and published `nvidia-smi`
//! output (see `shared/reference/mig-nvml.md`). Where the reference gives a range, an
//! approximation or nothing, the value here is an estimate, and the model lists it in
//! [`GpuModel::estimates`] (field by field and profile by profile), so tools such as
//! `migdra-kubelet-plugin gpu-check` can tell a wrong estimate from a wrong fact.
//!
//! A model is identified by the product name NVML reports (`nvmlDeviceGetName`, see
//! [`model_by_product_name`]) or its PCI device ID. Variants with different SM counts are
//! separate entries: H100 SXM5 (`NVIDIA H100 80GB HBM3`, 0x2330, 132 SMs) and H100 PCIe
//! (`NVIDIA H100 PCIe`, 0x2331, 114 SMs).

use std::sync::LazyLock;

use crate::{
    geometry::{Architecture, Engines, MigGeometry, MigProfile},
    inventory::{GpuHealth, GpuInventory, MigInventory},
    nvml_constants::*,
    profile::ProfileName,
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
    /// Possible placement starts.
    Placements,
    /// Memory of one instance (MiB).
    MemoryMib,
    /// Streaming multiprocessors.
    Multiprocessors,
    /// Copy engines.
    CopyEngines,
    /// Video decoders.
    Decoders,
    /// JPEG decoders.
    JpegEngines,
    /// Optical-flow accelerators.
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

/// SM and every engine count: what "SM and engine counts" estimates cover.
const SM_AND_ENGINES: &[ProfileField] = &[
    ProfileField::Multiprocessors,
    ProfileField::CopyEngines,
    ProfileField::Decoders,
    ProfileField::JpegEngines,
    ProfileField::OfaEngines,
];

/// Fields of some profiles whose values are estimates rather than documented numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Estimate {
    /// The estimated fields.
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
    hopper_with_sms(names, mib, HOPPER_ENGINES.map(|e| e[0]))
}

/// H100 PCIe SMs per profile (1g, 1g+me, 1g double, 2g, 3g, 4g, 7g): estimates, the SXM5
/// counts scaled by 114/132 and rounded (7g: all 114).
const H100_PCIE_SMS: [u32; 7] = [14, 14, 22, 28, 52, 55, 114];

/// A Hopper table with the H100 SXM engines but the given SM counts.
fn hopper_with_sms(names: [&'static str; 6], mib: [u64; 6], sms: [u32; 7]) -> Vec<MigProfile> {
    let me = format!("{}+me", names[0]).leak() as &'static str;
    let mut e = HOPPER_ENGINES;
    for (engines, sm) in e.iter_mut().zip(sms) {
        engines[0] = sm;
    }
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
            estimates: &[],
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
            estimates: &[
                Estimate {
                    fields: &[ProfileField::MemoryMib],
                    profile_ids: &[19, 20, 0],
                    why: "mig-nvml.md §5 gives ranges by driver (1g 9.50-9.75 GiB, 7g 78.5-79.0 GiB)",
                },
                Estimate {
                    fields: &[ProfileField::Decoders],
                    profile_ids: &[14, 9, 5],
                    why: "mig-nvml.md §5: 2g/3g/4g decoders 1/2/2, some drivers report 2/3/4",
                },
            ],
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
            estimates: &[
                Estimate {
                    fields: &[ProfileField::MemoryMib],
                    profile_ids: &[0],
                    why: "mig-nvml.md §5: 4g memory 23.44-23.50 GiB by driver",
                },
                Estimate {
                    fields: &[ProfileField::Decoders],
                    profile_ids: &[14],
                    why: "mig-nvml.md §5: 1g decoders are 0 in the documentation, 1 on hardware",
                },
            ],
        },
        GpuModel {
            key: "H100-80GB",
            product_name: "NVIDIA H100 80GB HBM3",
            // SXM5 and the H800s listed with it in mig-nvml.md §5; the PCIe card (0x2331)
            // has fewer SMs and is its own entry.
            pci_device_ids: &[0x2330, 0x2324, 0x2322],
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
            estimates: &[],
        },
        GpuModel {
            key: "H100-PCIE-80GB",
            product_name: "NVIDIA H100 PCIe",
            pci_device_ids: &[0x2331],
            architecture: Architecture::Hopper,
            cuda_compute_capability: (9, 0),
            memory_mib: 81559,
            multiprocessors: 114,
            compute_slices: 7,
            max_mig_devices: 7,
            profiles: hopper_with_sms(
                ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
                [9984, 20096, 20096, 40448, 40448, 81152],
                H100_PCIE_SMS,
            ),
            estimates: &[
                Estimate {
                    fields: &[ProfileField::Multiprocessors],
                    profile_ids: &[],
                    why: "mig-nvml.md §5: H100 PCIe has 114 SMs, per-profile counts not captured; \
                          estimated as the SXM5 counts scaled by 114/132",
                },
                Estimate {
                    fields: &[
                        ProfileField::MemoryMib,
                        ProfileField::CopyEngines,
                        ProfileField::Decoders,
                        ProfileField::JpegEngines,
                        ProfileField::OfaEngines,
                    ],
                    profile_ids: &[],
                    why: "not in mig-nvml.md §5 for the PCIe card; assumed equal to H100 SXM5",
                },
            ],
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
            estimates: &[Estimate {
                fields: &[ProfileField::MemoryMib],
                profile_ids: &[9, 5, 0],
                why: "mig-nvml.md §5 gives ranges by driver (3g/4g 46.1-46.4 GiB, 7g 92.6-93.1 GiB)",
            }],
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
            // Shared by H100 96GB and GH200 96GB; §5 gives every memory size, and SM and
            // engine counts "follow the H100 SXM pattern".
            estimates: &[],
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
            estimates: &[
                Estimate {
                    fields: &[ProfileField::MemoryMib],
                    profile_ids: &[0],
                    why: "mig-nvml.md §5: 7g memory \"about 138\" GiB; 139.0 GiB used",
                },
                Estimate {
                    fields: &[ProfileField::Placements],
                    profile_ids: &[],
                    why: "mig-nvml.md §5: H200 placements unverified, assumed equal to H100",
                },
                Estimate {
                    fields: SM_AND_ENGINES,
                    profile_ids: &[14, 9, 5, 0],
                    why: "mig-nvml.md §5: larger-profile SM and engine counts unverified, assumed equal to H100",
                },
            ],
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
            estimates: &[
                Estimate {
                    fields: &[ProfileField::MemoryMib],
                    profile_ids: &[9, 5, 0],
                    why: "not in mig-nvml.md §5; estimated as 2x and 4x the 2g's memory",
                },
                Estimate {
                    fields: &[ProfileField::Placements],
                    profile_ids: &[],
                    why: "mig-nvml.md §5: GH200-144 placements unverified, assumed equal to H100",
                },
                Estimate {
                    fields: SM_AND_ENGINES,
                    profile_ids: &[14, 9, 5, 0],
                    why: "mig-nvml.md §5: larger-profile SM and engine counts unverified, assumed equal to H100",
                },
            ],
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
            estimates: &[
                Estimate {
                    fields: &[ProfileField::Placements],
                    profile_ids: &[],
                    why: "mig-nvml.md §5: Blackwell placements not captured, presumed identical to Hopper",
                },
                Estimate {
                    fields: &[ProfileField::MemoryMib],
                    profile_ids: &[19, 20],
                    why: "mig-nvml.md §5: 1g memory 20.5-22.0 GiB by driver; 22.0 GiB used",
                },
                Estimate {
                    fields: &[
                        ProfileField::MemoryMib,
                        ProfileField::Multiprocessors,
                        ProfileField::Decoders,
                        ProfileField::JpegEngines,
                    ],
                    profile_ids: &[9, 5, 0],
                    why: "mig-nvml.md §5 marks 3g/4g/7g memory, SM, decoder and JPEG counts \"?\"; \
                          SMs estimated, decoders and JPEG per slice as on Hopper, memory 2x/2x/4x the 2g's",
                },
                Estimate {
                    fields: &[ProfileField::CopyEngines],
                    profile_ids: &[14],
                    why: "mig-nvml.md §5: 2g copy engines 4 on hardware, 3 in the documentation",
                },
            ],
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

/// Looks a model up by the product name NVML reports (exact, ignoring ASCII case and
/// surrounding whitespace). This is how SXM and PCIe variants of a GPU are told apart.
pub fn model_by_product_name(product_name: &str) -> Option<&'static GpuModel> {
    let name = product_name.trim();
    CATALOG.iter().find(|m| m.product_name.eq_ignore_ascii_case(name))
}

/// Looks a model up by PCI device ID.
pub fn model_by_pci_device_id(device_id: u16) -> Option<&'static GpuModel> {
    CATALOG.iter().find(|m| m.pci_device_ids.contains(&device_id))
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;
    use crate::geometry::{MigGeometry, Placement, PlacementError, gpu_instance_id};

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
        let sxm = model_by_product_name("NVIDIA H100 80GB HBM3").unwrap();
        let pcie = model_by_product_name("NVIDIA H100 PCIe").unwrap();
        assert_eq!(sxm.key, "H100-80GB");
        assert_eq!(pcie.key, "H100-PCIE-80GB");
        assert_eq!(model_by_pci_device_id(0x2331).unwrap().key, pcie.key);
        assert_eq!(model_by_pci_device_id(0x2330).unwrap().key, sxm.key);
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
            assert_eq!(
                model_by_product_name(m.product_name).unwrap().key,
                m.key,
                "unique names"
            );
            for id in m.pci_device_ids {
                assert_eq!(model_by_pci_device_id(*id).unwrap().key, m.key, "unique PCI IDs");
            }
        }
    }
}
