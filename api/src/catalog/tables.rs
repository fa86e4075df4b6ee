//! The catalog's per-model tables: GPU-instance profiles with their NVML IDs and indexes,
//! placements, engines and memory, and each model's identity and sources.

use std::sync::LazyLock;

use super::{Estimate, GpuModel, ProfileField};
use crate::{
    geometry::{Architecture, Engines, MigProfile},
    nvml_constants::*,
    profile::ProfileName,
};

/// SM and every engine count: what "SM and engine counts" estimates cover.
const SM_AND_ENGINES: &[ProfileField] = &[
    ProfileField::Multiprocessors,
    ProfileField::CopyEngines,
    ProfileField::Decoders,
    ProfileField::JpegEngines,
    ProfileField::OfaEngines,
];

/// Every per-profile field: what an estimate of a whole unpublished table covers.
const ALL_FIELDS: &[ProfileField] = &[
    ProfileField::Placements,
    ProfileField::MemoryMib,
    ProfileField::Multiprocessors,
    ProfileField::CopyEngines,
    ProfileField::Decoders,
    ProfileField::JpegEngines,
    ProfileField::OfaEngines,
];

/// One row of a profile table: index, ID, name, compute slices, memory slices, instance
/// count, starts, SM, CE, DEC, ENC, JPEG, OFA, MiB.
#[rustfmt::skip]
type Row = (u32, u32, &'static str, u32, u32, u32, &'static [u32], [u32; 6], u64);

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

/// RTX PRO 6000 Blackwell: 1g and 1g+me rows from a published `nvidia-smi mig -lgip`
/// (bigstack-oss/cubecos#312); 2g and 4g estimated.
#[rustfmt::skip]
const RTX_PRO_6000_PROFILES: [Row; 4] = [
    (GI_PROFILE_1_SLICE, 14, "1g.24gb", 1, 1, 4, &[0, 1, 2, 3], [46, 1, 1, 1, 1, 0], 23680),
    (GI_PROFILE_2_SLICE, 5, "2g.48gb", 2, 2, 2, &[0, 2], [92, 2, 2, 2, 2, 0], 47360),
    (GI_PROFILE_4_SLICE, 0, "4g.96gb", 4, 4, 1, ZERO, [188, 4, 4, 4, 4, 1], 94720),
    (GI_PROFILE_1_SLICE_REV1, 21, "1g.24gb+me", 1, 1, 1, &[0, 1, 2, 3], [46, 1, 1, 1, 1, 1], 23680),
];

#[rustfmt::skip]
const A30_PROFILES: [Row; 5] = [
    (GI_PROFILE_1_SLICE, 14, "1g.6gb", 1, 1, 4, &[0, 1, 2, 3], [14, 1, 1, 0, 0, 0], 5952),
    (GI_PROFILE_2_SLICE, 5, "2g.12gb", 2, 2, 2, &[0, 2], [28, 2, 2, 0, 0, 0], 11968),
    (GI_PROFILE_4_SLICE, 0, "4g.24gb", 4, 4, 1, ZERO, [56, 4, 4, 0, 1, 1], 24000),
    (GI_PROFILE_1_SLICE_REV1, 21, "1g.6gb+me", 1, 1, 1, &[0, 1, 2, 3], [14, 1, 1, 0, 1, 1], 5952),
    (GI_PROFILE_2_SLICE_REV1, 6, "2g.12gb+me", 2, 2, 1, &[0, 2], [28, 2, 2, 0, 1, 1], 11968),
];

/// What the Hopper models share; each sets the rest.
const HOPPER: GpuModel = GpuModel {
    key: "",
    product_name: "",
    pci_device_ids: &[],
    architecture: Architecture::Hopper,
    cuda_compute_capability: (9, 0),
    memory_mib: 0,
    multiprocessors: 132,
    compute_slices: 7,
    max_mig_devices: 7,
    profiles: Vec::new(),
    estimates: &[],
};

pub(super) static CATALOG: LazyLock<Vec<GpuModel>> = LazyLock::new(|| {
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
            profiles: profiles(&A30_PROFILES),
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
            memory_mib: 81559,
            profiles: hopper(
                ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
                [9984, 20096, 20096, 40448, 40448, 81152],
            ),
            ..HOPPER
        },
        GpuModel {
            key: "H100-PCIE-80GB",
            product_name: "NVIDIA H100 PCIe",
            pci_device_ids: &[0x2331],
            memory_mib: 81559,
            multiprocessors: 114,
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
            ..HOPPER
        },
        GpuModel {
            key: "H100-NVL-94GB",
            product_name: "NVIDIA H100 NVL",
            // H100 NVL and H800 NVL (0x233A), which share the table in NVIDIA's mig-parted
            // configuration.
            pci_device_ids: &[0x2321, 0x233A],
            memory_mib: 95830,
            // 1g double and 2g: 21.62 GiB in a published `nvidia-smi mig -lgip`
            // (NVIDIA/gpu-operator#903).
            profiles: hopper(
                ["1g.12gb", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"],
                [11008, 22144, 22144, 47232, 47232, 94976],
            ),
            estimates: &[Estimate {
                fields: &[ProfileField::MemoryMib],
                profile_ids: &[9, 5, 0],
                why: "mig-nvml.md §5 gives ranges by driver (3g/4g 46.1-46.4 GiB, 7g 92.6-93.1 GiB)",
            }],
            ..HOPPER
        },
        GpuModel {
            key: "H100-96GB",
            // The name NVML reports for GH200 (96 GB HBM3 next to 480 GB LPDDR5X); models are
            // found by PCI device ID, so the H100 96GB sharing the table needs no name here.
            product_name: "NVIDIA GH200 480GB",
            pci_device_ids: &[0x233D, 0x2342],
            memory_mib: 97871,
            profiles: hopper(
                ["1g.12gb", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"],
                [11264, 23552, 23552, 47616, 47616, 95232],
            ),
            // Shared by H100 96GB and GH200 96GB; §5 gives every memory size, and SM and
            // engine counts "follow the H100 SXM pattern".
            ..HOPPER
        },
        GpuModel {
            key: "H200-141GB",
            product_name: "NVIDIA H200",
            pci_device_ids: &[0x2335, 0x233B],
            memory_mib: 143771,
            profiles: hopper(
                ["1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"],
                [16384, 33024, 33024, 71168, 71168, 143104],
            ),
            // Memory, SM and engine counts of every profile: a published `nvidia-smi mig
            // -lgip` (NVIDIA/mig-parted#120), 7g 139.75 GiB.
            estimates: &[Estimate {
                fields: &[ProfileField::Placements],
                profile_ids: &[],
                why: "no published `-lgipp` for H200; placements assumed equal to H100",
            }],
            ..HOPPER
        },
        GpuModel {
            key: "GH200-144GB",
            product_name: "NVIDIA GH200 144G HBM3e",
            pci_device_ids: &[0x2348],
            memory_mib: 146944,
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
            ..HOPPER
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
        GpuModel {
            key: "GB200",
            product_name: "NVIDIA GB200",
            pci_device_ids: &[0x2941],
            architecture: Architecture::Blackwell,
            cuda_compute_capability: (10, 0),
            memory_mib: 189471,
            multiprocessors: 152,
            compute_slices: 7,
            max_mig_devices: 7,
            // 1g, 1g+me, 1g double and 2g: published `nvidia-smi mig -lgip` outputs
            // (NVIDIA/mig-parted#227, NVIDIA/gpu-operator#1303).
            profiles: eight_slice([
                ("1g.23gb", [18, 2, 1, 0, 1, 0], 22528),
                ("1g.23gb+me", [18, 2, 1, 0, 1, 1], 22528),
                ("1g.47gb", [32, 2, 1, 0, 1, 0], 46592),
                ("2g.47gb", [38, 4, 2, 0, 2, 0], 46592),
                ("3g.93gb", [60, 6, 3, 0, 3, 0], 93184),
                ("4g.93gb", [76, 8, 4, 0, 4, 0], 93184),
                ("7g.186gb", [152, 16, 7, 0, 7, 1], 186368),
            ]),
            estimates: &[
                Estimate {
                    fields: &[ProfileField::Placements],
                    profile_ids: &[],
                    why: "no published `-lgipp` for GB200; placements assumed equal to Hopper's",
                },
                Estimate {
                    fields: &[
                        ProfileField::MemoryMib,
                        ProfileField::Multiprocessors,
                        ProfileField::CopyEngines,
                        ProfileField::Decoders,
                        ProfileField::JpegEngines,
                    ],
                    profile_ids: &[9, 5, 0],
                    why: "no published 3g/4g/7g rows for GB200: SMs 60/76/152, the other engines \
                          as B200's, memory 2x/2x/4x the 2g's",
                },
            ],
        },
        GpuModel {
            key: "B300",
            product_name: "NVIDIA B300 SXM6 AC",
            pci_device_ids: &[0x3182],
            architecture: Architecture::Blackwell,
            cuda_compute_capability: (10, 3),
            memory_mib: 275040,
            multiprocessors: 148,
            compute_slices: 7,
            max_mig_devices: 7,
            profiles: eight_slice([
                ("1g.34gb", [18, 2, 1, 0, 1, 0], 33024),
                ("1g.34gb+me", [18, 2, 1, 0, 1, 1], 33024),
                ("1g.67gb", [30, 2, 1, 0, 1, 0], 66560),
                ("2g.67gb", [36, 4, 2, 0, 2, 0], 66560),
                ("3g.135gb", [72, 6, 3, 0, 3, 0], 133120),
                ("4g.135gb", [72, 8, 4, 0, 4, 0], 133120),
                ("7g.269gb", [144, 16, 7, 0, 7, 1], 266240),
            ]),
            estimates: &[Estimate {
                fields: ALL_FIELDS,
                profile_ids: &[],
                why: "no published MIG table for B300, only its profile names: B200's engines, \
                      memory that gives those names",
            }],
        },
        GpuModel {
            key: "GB300",
            product_name: "NVIDIA GB300",
            pci_device_ids: &[0x31C2],
            architecture: Architecture::Blackwell,
            cuda_compute_capability: (10, 3),
            memory_mib: 284263,
            multiprocessors: 148,
            compute_slices: 7,
            max_mig_devices: 7,
            profiles: eight_slice([
                ("1g.35gb", [18, 2, 1, 0, 1, 0], 34048),
                ("1g.35gb+me", [18, 2, 1, 0, 1, 1], 34048),
                ("1g.70gb", [30, 2, 1, 0, 1, 0], 68608),
                ("2g.70gb", [36, 4, 2, 0, 2, 0], 68608),
                ("3g.139gb", [72, 6, 3, 0, 3, 0], 137216),
                ("4g.139gb", [72, 8, 4, 0, 4, 0], 137216),
                ("7g.278gb", [144, 16, 7, 0, 7, 1], 274432),
            ]),
            estimates: &[Estimate {
                fields: ALL_FIELDS,
                profile_ids: &[],
                why: "no published MIG table for GB300, only its 1g/2g/3g names: B200's engines, \
                      memory that gives those names",
            }],
        },
        GpuModel {
            key: "H20",
            product_name: "NVIDIA H20",
            pci_device_ids: &[0x2329],
            memory_mib: 97871,
            multiprocessors: 78,
            profiles: hopper_with_sms(
                ["1g.12gb", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"],
                [11264, 23552, 23552, 47616, 47616, 95232],
                [9, 9, 15, 19, 35, 38, 78],
            ),
            estimates: &[Estimate {
                fields: ALL_FIELDS,
                profile_ids: &[],
                why: "no published MIG table for H20, only its profile names: memory as H100 96GB, \
                      SMs the Hopper counts scaled by 78/132",
            }],
            ..HOPPER
        },
        GpuModel {
            key: "RTX-PRO-6000",
            product_name: "NVIDIA RTX PRO 6000 Blackwell Server Edition",
            pci_device_ids: &[0x2BB5],
            architecture: Architecture::Blackwell,
            cuda_compute_capability: (12, 0),
            memory_mib: 97887,
            multiprocessors: 188,
            compute_slices: 4,
            max_mig_devices: 4,
            // The card's `+gfx`, `+me.all` and `-me` profiles are left out.
            profiles: profiles(&RTX_PRO_6000_PROFILES),
            estimates: &[
                Estimate {
                    fields: &[ProfileField::Placements],
                    profile_ids: &[],
                    why: "no published `-lgipp` for RTX PRO 6000; placements assumed equal to A30's",
                },
                Estimate {
                    fields: ALL_FIELDS,
                    profile_ids: &[5, 0],
                    why: "no published 2g/4g rows for RTX PRO 6000: engines per slice, memory that \
                          gives the profile names",
                },
            ],
        },
    ]
});
