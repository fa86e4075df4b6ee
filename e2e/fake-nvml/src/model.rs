//! The GPU models the fake simulates and their MIG tables, written in the fake itself from
//! public sources: NVIDIA's MIG user guide and `nvidia-smi mig -lgip` outputs pasted in public
//! issues, each row naming its source (the legend is above the per-model tables). Profile
//! indexes and placements follow NVML's rules for the profile's shape
//! (`shared/reference/mig-nvml.md` §2, §3). Nothing here comes from migdra-api, so the fake is
//! an independent witness of the product's catalog and geometry (the cross-check lives in
//! `tests/fake/`).
//!
//! Memory sizes and engine counts vary by driver: a row uses one published output. Where no
//! public number was found the value is marked `[unsourced]`; the catalog marks the same
//! values as estimates.

/// `NVML_DEVICE_ARCH_TURING`.
pub const ARCH_TURING: u32 = 6;
/// `NVML_DEVICE_ARCH_AMPERE`.
pub const ARCH_AMPERE: u32 = 7;
/// `NVML_DEVICE_ARCH_ADA`.
pub const ARCH_ADA: u32 = 8;
/// `NVML_DEVICE_ARCH_HOPPER`.
pub const ARCH_HOPPER: u32 = 9;
/// `NVML_DEVICE_ARCH_BLACKWELL`.
pub const ARCH_BLACKWELL: u32 = 10;

/// Multiprocessor and engine counts of one GPU-instance profile (`nvmlGpuInstanceProfileInfo_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Engines {
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Copy engines.
    pub copy_engines: u32,
    /// Video decoders.
    pub decoders: u32,
    /// Video encoders (0 on every datacenter profile, §5).
    pub encoders: u32,
    /// JPEG decoders.
    pub jpeg_engines: u32,
    /// Optical-flow accelerators.
    pub ofa_engines: u32,
}

/// One GPU-instance profile as NVML reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GiProfile {
    /// Profile **index** (`NVML_GPU_INSTANCE_PROFILE_*`, what the v1 info call takes).
    pub index: u32,
    /// Profile **ID** (what the info returns and create, placement and list calls take).
    pub id: u32,
    /// Name without the `MIG ` prefix, e.g. `3g.40gb` or `1g.10gb+me`.
    pub name: &'static str,
    /// Compute slices (`sliceCount`).
    pub compute_slices: u32,
    /// Memory slices a placement covers (the placement `size`).
    pub memory_slices: u32,
    /// Most instances of this profile on one GPU (`instanceCount`).
    pub instance_count: u32,
    /// Valid placement starts, in memory slices.
    pub starts: &'static [u32],
    /// Multiprocessors and engines of one instance.
    pub engines: Engines,
    /// Memory of one instance (`memorySizeMB`, MiB).
    pub memory_mib: u64,
}

/// The MIG side of a MIG-capable model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MigTable {
    /// Memory slices of the GPU (8, or 4 on A30; §2).
    pub memory_slices: u32,
    /// Most MIG devices on one GPU (`nvmlDeviceGetMaxMigDeviceCount`; §2).
    pub max_mig_devices: u32,
    /// GPU-instance profiles in index order.
    pub profiles: &'static [GiProfile],
    /// The driver offers the `7_SLICE_NVL` compute-instance profile (index 8) in 7-slice GPU
    /// instances, a duplicate of the plain 7-slice one.
    pub ci_7_slice_nvl: bool,
}

impl MigTable {
    /// The profile with ID `id`.
    pub fn profile_by_id(&self, id: u32) -> Option<&'static GiProfile> {
        self.profiles.iter().find(|p| p.id == id)
    }

    /// Optical-flow accelerators of the whole GPU: those of the profile that covers every
    /// memory slice (a GPU instance of the whole GPU has all its engines). One on every
    /// simulated model (§4: "a single OFA/JPEG").
    pub fn ofa_engines(&self) -> u32 {
        self.profiles
            .iter()
            .filter(|p| p.memory_slices == self.memory_slices)
            .map(|p| p.engines.ofa_engines)
            .max()
            .unwrap_or(0)
    }
}

/// What the fake needs to know about a GPU model.
#[derive(Clone, Copy, Debug)]
pub struct FakeModel {
    /// Configuration key (`H100-80GB`, ...).
    pub key: &'static str,
    /// Product name (`nvmlDeviceGetName`).
    pub product_name: &'static str,
    /// PCI device ID (vendor 0x10de).
    pub pci_device_id: u16,
    /// `nvmlDeviceArchitecture_t` value.
    pub architecture: u32,
    /// CUDA compute capability.
    pub cuda_compute_capability: (i32, i32),
    /// Total memory in MiB.
    pub memory_mib: u64,
    /// Multiprocessors of the whole GPU.
    pub multiprocessors: u32,
    /// The MIG table, for MIG-capable GPUs.
    pub mig: Option<&'static MigTable>,
}

impl FakeModel {
    /// Looks a model up by configuration key (case-insensitive).
    pub fn lookup(key: &str) -> Option<FakeModel> {
        MODELS.iter().find(|m| m.key.eq_ignore_ascii_case(key)).copied()
    }

    /// Every model the fake simulates.
    pub fn all() -> &'static [FakeModel] {
        MODELS
    }

    /// Every key the fake accepts.
    pub fn keys() -> Vec<&'static str> {
        MODELS.iter().map(|m| m.key).collect()
    }

    /// Total memory in bytes.
    pub fn memory_bytes(&self) -> u64 {
        self.memory_mib * 1024 * 1024
    }

    /// Hopper and later switch MIG mode without a reset; Ampere needs one (§1.6, §10).
    pub fn mig_mode_switchable(&self) -> bool {
        self.architecture >= ARCH_HOPPER
    }
}

// ---------------------------------------------------------------------------------------
// Profile shapes: index (§3 index table), ID (§3 observed IDs), compute slices, placement
// size and starts (§2), instance count (§5). Identical on every 8-slice part (§2, §3).

/// The parts of a profile that are the same on every model of a family.
struct Shape {
    index: u32,
    id: u32,
    compute_slices: u32,
    memory_slices: u32,
    instance_count: u32,
    starts: &'static [u32],
}

const fn profile(shape: Shape, name: &'static str, e: [u32; 6], memory_mib: u64) -> GiProfile {
    GiProfile {
        index: shape.index,
        id: shape.id,
        name,
        compute_slices: shape.compute_slices,
        memory_slices: shape.memory_slices,
        instance_count: shape.instance_count,
        starts: shape.starts,
        engines: Engines {
            multiprocessors: e[0],
            copy_engines: e[1],
            decoders: e[2],
            encoders: e[3],
            jpeg_engines: e[4],
            ofa_engines: e[5],
        },
        memory_mib,
    }
}

/// `1_SLICE` (index 0), ID 19: `{0..6}:1`, 7 instances.
const G1: Shape = Shape {
    index: 0,
    id: 19,
    compute_slices: 1,
    memory_slices: 1,
    instance_count: 7,
    starts: &[0, 1, 2, 3, 4, 5, 6],
};
/// `2_SLICE` (index 1), ID 14: `{0,2,4}:2`, 3 instances.
const G2: Shape = Shape {
    index: 1,
    id: 14,
    compute_slices: 2,
    memory_slices: 2,
    instance_count: 3,
    starts: &[0, 2, 4],
};
/// `3_SLICE` (index 2), ID 9: `{0,4}:4`, 2 instances.
const G3: Shape = Shape {
    index: 2,
    id: 9,
    compute_slices: 3,
    memory_slices: 4,
    instance_count: 2,
    starts: &[0, 4],
};
/// `4_SLICE` (index 3), ID 5: `{0}:4`, 1 instance.
const G4: Shape = Shape {
    index: 3,
    id: 5,
    compute_slices: 4,
    memory_slices: 4,
    instance_count: 1,
    starts: &[0],
};
/// `7_SLICE` (index 4), ID 0: `{0}:8`, 1 instance.
const G7: Shape = Shape {
    index: 4,
    id: 0,
    compute_slices: 7,
    memory_slices: 8,
    instance_count: 1,
    starts: &[0],
};
/// `1_SLICE_REV1` (index 7, `+me`), ID 20: `{0..6}:1`, 1 instance (the single OFA, §4/§12).
const G1_ME: Shape = Shape {
    index: 7,
    id: 20,
    compute_slices: 1,
    memory_slices: 1,
    instance_count: 1,
    starts: &[0, 1, 2, 3, 4, 5, 6],
};
/// `1_SLICE_REV2` (index 9, double memory), ID 15: `{0,2,4,6}:2`, 4 instances.
const G1_DOUBLE: Shape = Shape {
    index: 9,
    id: 15,
    compute_slices: 1,
    memory_slices: 2,
    instance_count: 4,
    starts: &[0, 2, 4, 6],
};

/// A30 (4 memory and 4 compute slices): `1_SLICE`, ID 14, `{0,1,2,3}:1`, 4 instances.
const A30_G1: Shape = Shape {
    index: 0,
    id: 14,
    compute_slices: 1,
    memory_slices: 1,
    instance_count: 4,
    starts: &[0, 1, 2, 3],
};
/// A30 `2_SLICE`, ID 5, `{0,2}:2`, 2 instances.
const A30_G2: Shape = Shape {
    index: 1,
    id: 5,
    compute_slices: 2,
    memory_slices: 2,
    instance_count: 2,
    starts: &[0, 2],
};
/// A30 `4_SLICE`, ID 0, `{0}:4`, 1 instance.
const A30_G4: Shape = Shape {
    index: 3,
    id: 0,
    compute_slices: 4,
    memory_slices: 4,
    instance_count: 1,
    starts: &[0],
};
/// A30 `1_SLICE_REV1` (`+me`), ID 21, `{0..3}:1`, 1 instance.
const A30_G1_ME: Shape = Shape {
    index: 7,
    id: 21,
    compute_slices: 1,
    memory_slices: 1,
    instance_count: 1,
    starts: &[0, 1, 2, 3],
};
/// A30 `2_SLICE_REV1` (`+me`), ID 6, `{0,2}:2`, 1 instance.
const A30_G2_ME: Shape = Shape {
    index: 8,
    id: 6,
    compute_slices: 2,
    memory_slices: 2,
    instance_count: 1,
    starts: &[0, 2],
};

/// An 8-slice table (§2): 8 memory slices, at most 7 MIG devices.
const fn eight_slice(profiles: &'static [GiProfile]) -> MigTable {
    MigTable {
        memory_slices: 8,
        max_mig_devices: 7,
        profiles,
        ci_7_slice_nvl: false,
    }
}

/// A 4-slice table (A30, RTX PRO 6000): 4 memory slices, at most 4 MIG devices.
const fn four_slice(profiles: &'static [GiProfile]) -> MigTable {
    MigTable {
        memory_slices: 4,
        max_mig_devices: 4,
        profiles,
        ci_7_slice_nvl: false,
    }
}

// ---------------------------------------------------------------------------------------
// Per-model numbers. Engines are [SM, CE, DEC, ENC, JPEG, OFA]; memory in MiB, the GiB
// `nvidia-smi mig -lgip` prints times 1024. Every row names its source:
//
// * [guide]: NVIDIA's MIG user guide, "Supported MIG Profiles"
//   (docs.nvidia.com/datacenter/tesla/mig-user-guide/supported-mig-profiles.html);
// * [name#n]: an `nvidia-smi mig -lgip` output pasted in GitHub issue or pull request #n
//   of the named repository (`mig-parted` and `gpu-operator` are NVIDIA's);
// * [configs]: the model's profile names in NVIDIA's mig-parted `config-default.yaml` and
//   the GPU Operator's `default-mig-parted-config`, which key models by PCI device ID;
// * [unsourced]: no public number found; an estimate the tests must not treat as a fact.
//
// Placements and instance counts are NVML's for the profile shape (§2); `-lgip` confirms
// the instance counts of every row it shows.

/// A100-SXM4-40GB: [guide] A100 table (SM fractions of 98, engines); memory [mig-nvml.md §5].
static A100_40GB: MigTable = eight_slice(&[
    profile(G1, "1g.5gb", [14, 1, 0, 0, 0, 0], 4864),
    profile(G2, "2g.10gb", [28, 2, 1, 0, 0, 0], 9856),
    profile(G3, "3g.20gb", [42, 3, 2, 0, 0, 0], 19968),
    profile(G4, "4g.20gb", [56, 4, 2, 0, 0, 0], 19968),
    profile(G7, "7g.40gb", [98, 7, 5, 0, 1, 1], 40192),
    profile(G1_ME, "1g.5gb+me", [14, 1, 1, 0, 1, 1], 4864),
    profile(G1_DOUBLE, "1g.10gb", [14, 1, 1, 0, 0, 0], 9856),
]);

/// A100-SXM4-80GB: engines as the 40GB part [guide: "profile names change according to the
/// memory proportion"]; memory [unsourced: mig-nvml.md §5 ranges].
static A100_80GB: MigTable = eight_slice(&[
    profile(G1, "1g.10gb", [14, 1, 0, 0, 0, 0], 9728),
    profile(G2, "2g.20gb", [28, 2, 1, 0, 0, 0], 19968),
    profile(G3, "3g.40gb", [42, 3, 2, 0, 0, 0], 40192),
    profile(G4, "4g.40gb", [56, 4, 2, 0, 0, 0], 40192),
    profile(G7, "7g.80gb", [98, 7, 5, 0, 1, 1], 80896),
    profile(G1_ME, "1g.10gb+me", [14, 1, 1, 0, 1, 1], 9728),
    profile(G1_DOUBLE, "1g.20gb", [14, 1, 1, 0, 0, 0], 19968),
]);

/// The A100-80GB as drivers that count 2g/3g/4g decoders 2/3/4 describe it (mig-nvml.md §5):
/// 4g + 3g then "needs" 7 decoders of the 7g's 5, a layout NVML still creates. Not a
/// catalog model: it exists to test that per-profile engine counts that add up past the
/// full GPU's never refuse a layout NVML allows.
static A100_80GB_OVERADDING: MigTable = eight_slice(&[
    profile(G1, "1g.10gb", [14, 1, 0, 0, 0, 0], 9728),
    profile(G2, "2g.20gb", [28, 2, 2, 0, 0, 0], 19968),
    profile(G3, "3g.40gb", [42, 3, 3, 0, 0, 0], 40192),
    profile(G4, "4g.40gb", [56, 4, 4, 0, 0, 0], 40192),
    profile(G7, "7g.80gb", [98, 7, 5, 0, 1, 1], 80896),
    profile(G1_ME, "1g.10gb+me", [14, 1, 1, 0, 1, 1], 9728),
    profile(G1_DOUBLE, "1g.20gb", [14, 1, 1, 0, 0, 0], 19968),
]);

/// A30: engines and instance counts [guide] A30 table, except the plain 1g's decoder, which
/// hardware reports as 1 where the guide says 0 [unsourced: mig-nvml.md §5]; memory
/// [unsourced: mig-nvml.md §5].
static A30_24GB: MigTable = four_slice(&[
    profile(A30_G1, "1g.6gb", [14, 1, 1, 0, 0, 0], 5952),
    profile(A30_G2, "2g.12gb", [28, 2, 2, 0, 0, 0], 11968),
    profile(A30_G4, "4g.24gb", [56, 4, 4, 0, 1, 1], 24000),
    profile(A30_G1_ME, "1g.6gb+me", [14, 1, 1, 0, 1, 1], 5952),
    profile(A30_G2_ME, "2g.12gb+me", [28, 2, 2, 0, 1, 1], 11968),
]);

/// Hopper engines. 1g, 1g+me, 1g double, 2g, 3g, 4g: [mig-parted#120] (H200, whose SM and
/// engine rows match the H100 NVL's [gpu-operator#903] and GH200-144GB's [mig-parted#139]
/// wherever those show them); 7g: [mig-parted#120].
const H_1G: [u32; 6] = [16, 1, 1, 0, 1, 0];
const H_1G_ME: [u32; 6] = [16, 1, 1, 0, 1, 1];
const H_1G_DOUBLE: [u32; 6] = [26, 1, 1, 0, 1, 0];
const H_2G: [u32; 6] = [32, 2, 2, 0, 2, 0];
const H_3G: [u32; 6] = [60, 3, 3, 0, 3, 0];
const H_4G: [u32; 6] = [64, 4, 4, 0, 4, 0];
const H_7G: [u32; 6] = [132, 8, 7, 0, 7, 1];

/// A Hopper table: names and MiB for 1g, 1g double memory, 2g, 3g, 4g, 7g; the `+me`
/// profile has the 1g's memory.
macro_rules! hopper {
    ([$n1:literal, $n1d:literal, $n2:literal, $n3:literal, $n4:literal, $n7:literal], [$m1:literal, $m1d:literal, $m2:literal, $m3:literal, $m4:literal, $m7:literal]) => {
        eight_slice(&[
            profile(G1, $n1, H_1G, $m1),
            profile(G2, $n2, H_2G, $m2),
            profile(G3, $n3, H_3G, $m3),
            profile(G4, $n4, H_4G, $m4),
            profile(G7, $n7, H_7G, $m7),
            profile(G1_ME, concat!($n1, "+me"), H_1G_ME, $m1),
            profile(G1_DOUBLE, $n1d, H_1G_DOUBLE, $m1d),
        ])
    };
}

/// H100 SXM5 80GB: engines as above; memory [unsourced: mig-nvml.md §5].
static H100_80GB: MigTable = hopper!(
    ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
    [9984, 20096, 20096, 40448, 40448, 81152]
);

/// H100 PCIe (114 SMs [unsourced: mig-nvml.md §5]): per-profile SMs [unsourced], the SXM5
/// counts times 114/132, rounded; memory and other engines [unsourced], the SXM5 ones.
static H100_PCIE_80GB: MigTable = eight_slice(&[
    profile(G1, "1g.10gb", [14, 1, 1, 0, 1, 0], 9984),
    profile(G2, "2g.20gb", [28, 2, 2, 0, 2, 0], 20096),
    profile(G3, "3g.40gb", [52, 3, 3, 0, 3, 0], 40448),
    profile(G4, "4g.40gb", [55, 4, 4, 0, 4, 0], 40448),
    profile(G7, "7g.80gb", [114, 8, 7, 0, 7, 1], 81152),
    profile(G1_ME, "1g.10gb+me", [14, 1, 1, 0, 1, 1], 9984),
    profile(G1_DOUBLE, "1g.20gb", [22, 1, 1, 0, 1, 0], 20096),
]);

/// H100 NVL and H800 NVL: 1g 10.75 GiB, 1g double and 2g 21.62 GiB [gpu-operator#903];
/// 3g, 4g, 7g memory [unsourced: mig-nvml.md §5 ranges].
static H100_NVL_94GB: MigTable = hopper!(
    ["1g.12gb", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"],
    [11008, 22144, 22144, 47232, 47232, 94976]
);

/// H100 96GB and GH200 480GB (96GB HBM3): names [configs]; memory [unsourced: mig-nvml.md §5].
static H100_96GB: MigTable = hopper!(
    ["1g.12gb", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"],
    [11264, 23552, 23552, 47616, 47616, 95232]
);

/// H20 (78 SMs): names [configs]; every number [unsourced]: memory as the H100 96GB's,
/// SMs the Hopper counts times 78/132, rounded, other engines the Hopper ones.
static H20: MigTable = eight_slice(&[
    profile(G1, "1g.12gb", [9, 1, 1, 0, 1, 0], 11264),
    profile(G2, "2g.24gb", [19, 2, 2, 0, 2, 0], 23552),
    profile(G3, "3g.48gb", [35, 3, 3, 0, 3, 0], 47616),
    profile(G4, "4g.48gb", [38, 4, 4, 0, 4, 0], 47616),
    profile(G7, "7g.96gb", [78, 8, 7, 0, 7, 1], 95232),
    profile(G1_ME, "1g.12gb+me", [9, 1, 1, 0, 1, 1], 11264),
    profile(G1_DOUBLE, "1g.24gb", [15, 1, 1, 0, 1, 0], 23552),
]);

/// H200: every row [mig-parted#120]: 16.00, 32.25, 32.25, 69.50, 69.50, 139.75 GiB.
static H200_141GB: MigTable = hopper!(
    ["1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"],
    [16384, 33024, 33024, 71168, 71168, 143104]
);

/// GH200 144GB HBM3e: 1g, 1g+me, 1g double, 2g [mig-parted#139] (17.50, 35.25, 35.25 GiB);
/// 3g, 4g, 7g memory [unsourced]: 2x and 4x the 2g's.
static GH200_144GB: MigTable = hopper!(
    ["1g.18gb", "1g.36gb", "2g.36gb", "3g.72gb", "4g.72gb", "7g.144gb"],
    [17920, 36096, 36096, 72192, 72192, 144384]
);

/// B200: 1g, 1g+me, 1g double, 2g [mig-parted#166] (22.00, 44.25 GiB; a later driver prints
/// 20.50 for the 1g [mig-parted#187]); 3g, 4g, 7g names [configs], numbers [unsourced]: SMs
/// 72, 72, 144, copy engines 6, 8, 16, decoders and JPEG per compute slice, memory 2x, 2x,
/// 4x the 2g's.
static B200: MigTable = eight_slice(&[
    profile(G1, "1g.23gb", [18, 2, 1, 0, 1, 0], 22528),
    profile(G2, "2g.45gb", [36, 4, 2, 0, 2, 0], 45312),
    profile(G3, "3g.90gb", [72, 6, 3, 0, 3, 0], 90624),
    profile(G4, "4g.90gb", [72, 8, 4, 0, 4, 0], 90624),
    profile(G7, "7g.180gb", [144, 16, 7, 0, 7, 1], 181248),
    profile(G1_ME, "1g.23gb+me", [18, 2, 1, 0, 1, 1], 22528),
    profile(G1_DOUBLE, "1g.45gb", [30, 2, 1, 0, 1, 0], 45312),
]);

/// GB200: 1g, 1g+me, 1g double [mig-parted#227] (22.00, 45.50 GiB; an earlier driver named
/// the 1g `1g.24gb` at 20.00 GiB [gpu-operator#1303]); 2g [gpu-operator#1303] (45.50 GiB,
/// 38 SMs); 3g, 4g, 7g names [configs], numbers [unsourced]: SMs 60, 76, 152, the other
/// engines as B200's, memory 2x, 2x, 4x the 2g's. The `7_SLICE_NVL` compute-instance profile
/// (index 8), which NVIDIA's DRA driver enumerated next to the plain 7-slice one on A100
/// (dra-driver-nvidia-gpu#1480), is offered here [unsourced], so a duplicate of the full
/// compute instance is always present on one model.
static GB200: MigTable = MigTable {
    ci_7_slice_nvl: true,
    ..eight_slice(&[
        profile(G1, "1g.23gb", [18, 2, 1, 0, 1, 0], 22528),
        profile(G2, "2g.47gb", [38, 4, 2, 0, 2, 0], 46592),
        profile(G3, "3g.93gb", [60, 6, 3, 0, 3, 0], 93184),
        profile(G4, "4g.93gb", [76, 8, 4, 0, 4, 0], 93184),
        profile(G7, "7g.186gb", [152, 16, 7, 0, 7, 1], 186368),
        profile(G1_ME, "1g.23gb+me", [18, 2, 1, 0, 1, 1], 22528),
        profile(G1_DOUBLE, "1g.47gb", [32, 2, 1, 0, 1, 0], 46592),
    ])
};

/// B300: names [configs via aws/sagemaker-hyperpod-cli#403, citing the GPU Operator's
/// `0x318210DE` entry]; every number [unsourced]: B200's engines, memory chosen so the names
/// come out as NVML derives them.
static B300: MigTable = eight_slice(&[
    profile(G1, "1g.34gb", [18, 2, 1, 0, 1, 0], 33024),
    profile(G2, "2g.67gb", [36, 4, 2, 0, 2, 0], 66560),
    profile(G3, "3g.135gb", [72, 6, 3, 0, 3, 0], 133120),
    profile(G4, "4g.135gb", [72, 8, 4, 0, 4, 0], 133120),
    profile(G7, "7g.269gb", [144, 16, 7, 0, 7, 1], 266240),
    profile(G1_ME, "1g.34gb+me", [18, 2, 1, 0, 1, 1], 33024),
    profile(G1_DOUBLE, "1g.67gb", [30, 2, 1, 0, 1, 0], 66560),
]);

/// GB300: 1g, 2g, 3g names [configs]; every number and the other names [unsourced]: B200's
/// engines, memory chosen so the names come out as NVML derives them.
static GB300: MigTable = eight_slice(&[
    profile(G1, "1g.35gb", [18, 2, 1, 0, 1, 0], 34048),
    profile(G2, "2g.70gb", [36, 4, 2, 0, 2, 0], 68608),
    profile(G3, "3g.139gb", [72, 6, 3, 0, 3, 0], 137216),
    profile(G4, "4g.139gb", [72, 8, 4, 0, 4, 0], 137216),
    profile(G7, "7g.278gb", [144, 16, 7, 0, 7, 1], 274432),
    profile(G1_ME, "1g.35gb+me", [18, 2, 1, 0, 1, 1], 34048),
    profile(G1_DOUBLE, "1g.70gb", [30, 2, 1, 0, 1, 0], 68608),
]);

/// RTX PRO 6000 Blackwell (4 slices): 1g and 1g+me [cubecos#312] (ID 14 and 21, 23.12 GiB,
/// 46 SMs, one decoder and one encoder each); 2g and 4g names [configs], IDs 5 and 0
/// [mig-nvml.md §3], numbers [unsourced]: engines per slice, the 4g all of them. The card's
/// `+gfx`, `+me.all` and `-me` profiles are not simulated.
static RTX_PRO_6000: MigTable = four_slice(&[
    profile(A30_G1, "1g.24gb", [46, 1, 1, 1, 1, 0], 23680),
    profile(A30_G2, "2g.48gb", [92, 2, 2, 2, 2, 0], 47360),
    profile(A30_G4, "4g.96gb", [188, 4, 4, 4, 4, 1], 94720),
    profile(A30_G1_ME, "1g.24gb+me", [46, 1, 1, 1, 1, 1], 23680),
]);

// ---------------------------------------------------------------------------------------
// Models. PCI device IDs [configs] (the `device-filter` entries), except where noted;
// product names, total memory and compute capabilities are what NVML reports where a source
// shows them, else [unsourced].

/// One model: key, product name, PCI device ID, architecture, compute capability, memory
/// MiB, SMs, MIG table.
macro_rules! model {
    ($key:literal, $name:literal, $pci:literal, $arch:expr, $cc:expr, $mib:literal, $sms:literal, $mig:expr $(,)?) => {
        FakeModel {
            key: $key,
            product_name: $name,
            pci_device_id: $pci,
            architecture: $arch,
            cuda_compute_capability: $cc,
            memory_mib: $mib,
            multiprocessors: $sms,
            mig: $mig,
        }
    };
}

static MODELS: &[FakeModel] = &[
    model!(
        "A100-SXM4-40GB",
        "NVIDIA A100-SXM4-40GB",
        0x20B0,
        ARCH_AMPERE,
        (8, 0),
        40960,
        108,
        Some(&A100_40GB),
    ),
    // Total memory 81920 MiB [mig-parted#31].
    model!(
        "A100-80GB",
        "NVIDIA A100-SXM4-80GB",
        0x20B2,
        ARCH_AMPERE,
        (8, 0),
        81920,
        108,
        Some(&A100_80GB),
    ),
    model!(
        "A100-80GB-OVERADDING",
        "NVIDIA A100-SXM4-80GB",
        0x20B2,
        ARCH_AMPERE,
        (8, 0),
        81920,
        108,
        Some(&A100_80GB_OVERADDING),
    ),
    model!(
        "A30-24GB",
        "NVIDIA A30",
        0x20B7,
        ARCH_AMPERE,
        (8, 0),
        24576,
        56,
        Some(&A30_24GB),
    ),
    model!(
        "H100-80GB",
        "NVIDIA H100 80GB HBM3",
        0x2330,
        ARCH_HOPPER,
        (9, 0),
        81559,
        132,
        Some(&H100_80GB),
    ),
    model!(
        "H100-PCIE-80GB",
        "NVIDIA H100 PCIe",
        0x2331,
        ARCH_HOPPER,
        (9, 0),
        81559,
        114,
        Some(&H100_PCIE_80GB),
    ),
    model!(
        "H100-NVL-94GB",
        "NVIDIA H100 NVL",
        0x2321,
        ARCH_HOPPER,
        (9, 0),
        95830,
        132,
        Some(&H100_NVL_94GB),
    ),
    // The name NVML reports on GH200 with 96GB HBM3 (issue 26 §5).
    model!(
        "H100-96GB",
        "NVIDIA GH200 480GB",
        0x2342,
        ARCH_HOPPER,
        (9, 0),
        97871,
        132,
        Some(&H100_96GB),
    ),
    // Product name and total memory [unsourced].
    model!(
        "H20",
        "NVIDIA H20",
        0x2329,
        ARCH_HOPPER,
        (9, 0),
        97871,
        78,
        Some(&H20),
    ),
    model!(
        "H200-141GB",
        "NVIDIA H200",
        0x2335,
        ARCH_HOPPER,
        (9, 0),
        143771,
        132,
        Some(&H200_141GB),
    ),
    model!(
        "GH200-144GB",
        "NVIDIA GH200 144G HBM3e",
        0x2348,
        ARCH_HOPPER,
        (9, 0),
        146944,
        132,
        Some(&GH200_144GB),
    ),
    model!(
        "B200",
        "NVIDIA B200",
        0x2901,
        ARCH_BLACKWELL,
        (10, 0),
        183359,
        148,
        Some(&B200),
    ),
    // Product name, total memory and SMs [unsourced].
    model!(
        "GB200",
        "NVIDIA GB200",
        0x2941,
        ARCH_BLACKWELL,
        (10, 0),
        189471,
        152,
        Some(&GB200),
    ),
    // Product name, total memory and SMs [unsourced].
    model!(
        "B300",
        "NVIDIA B300 SXM6 AC",
        0x3182,
        ARCH_BLACKWELL,
        (10, 3),
        275040,
        148,
        Some(&B300),
    ),
    // PCI device ID from the GPU Operator's config as k8s-test-infra's GB300 table cites it;
    // product name, total memory and SMs [unsourced].
    model!(
        "GB300",
        "NVIDIA GB300",
        0x31C2,
        ARCH_BLACKWELL,
        (10, 3),
        284263,
        148,
        Some(&GB300),
    ),
    // Total memory 97887 MiB [cubecos#312]; compute capability 12.0 [guide, Supported GPUs];
    // product name [unsourced] (nvidia-smi cuts it to "NVIDIA RTX PRO 6000 Blac...").
    model!(
        "RTX-PRO-6000",
        "NVIDIA RTX PRO 6000 Blackwell Server Edition",
        0x2BB5,
        ARCH_BLACKWELL,
        (12, 0),
        97887,
        188,
        Some(&RTX_PRO_6000),
    ),
    // GPUs without MIG, for the "not MIG-capable" paths.
    model!("L4", "NVIDIA L4", 0x27B8, ARCH_ADA, (8, 9), 23034, 58, None),
    model!("A10", "NVIDIA A10", 0x2236, ARCH_AMPERE, (8, 6), 23028, 72, None),
    model!("T4", "Tesla T4", 0x1EB8, ARCH_TURING, (7, 5), 15360, 40, None),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_resolve_by_key_and_tables_are_consistent() {
        let h100 = FakeModel::lookup("h100-80gb").unwrap();
        assert_eq!(h100.architecture, ARCH_HOPPER);
        assert!(h100.mig_mode_switchable());
        assert!(FakeModel::lookup("L4").unwrap().mig.is_none());
        assert!(FakeModel::lookup("RTX-9999").is_none());
        for model in FakeModel::all() {
            let Some(table) = model.mig else { continue };
            for p in table.profiles {
                for s in p.starts {
                    // §2: placements are aligned to their size and inside the GPU.
                    assert_eq!(s % p.memory_slices, 0, "{} {}@{s}", model.key, p.name);
                    assert!(
                        s + p.memory_slices <= table.memory_slices,
                        "{} {}@{s}",
                        model.key,
                        p.name
                    );
                }
                assert!(
                    p.instance_count as usize <= p.starts.len(),
                    "{} {}",
                    model.key,
                    p.name
                );
                assert!(
                    p.name.starts_with(&format!("{}g.", p.compute_slices)),
                    "{}",
                    p.name
                );
            }
        }
    }
}
