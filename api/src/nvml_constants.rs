//! NVML constants that the geometry needs, shared by the plugin and the fake NVML library.
//!
//! GPU-instance profile *indexes* (what `nvmlDeviceGetGpuInstanceProfileInfo` takes) are not
//! profile *IDs* (what create, placement and list calls take). `GI_PROFILE_<x>` is NVML's
//! `NVML_GPU_INSTANCE_PROFILE_<x>`, `CI_PROFILE_<x>` its `NVML_COMPUTE_INSTANCE_PROFILE_<x>`
//! (NVML header v13).

pub const GI_PROFILE_1_SLICE: u32 = 0;
pub const GI_PROFILE_2_SLICE: u32 = 1;
pub const GI_PROFILE_3_SLICE: u32 = 2;
pub const GI_PROFILE_4_SLICE: u32 = 3;
pub const GI_PROFILE_7_SLICE: u32 = 4;
pub const GI_PROFILE_8_SLICE: u32 = 5;
pub const GI_PROFILE_6_SLICE: u32 = 6;
/// 1g `+me`.
pub const GI_PROFILE_1_SLICE_REV1: u32 = 7;
/// 2g `+me` (A30).
pub const GI_PROFILE_2_SLICE_REV1: u32 = 8;
/// 1g with double memory.
pub const GI_PROFILE_1_SLICE_REV2: u32 = 9;
pub const GI_PROFILE_1_SLICE_GFX: u32 = 10;
pub const GI_PROFILE_2_SLICE_GFX: u32 = 11;
pub const GI_PROFILE_4_SLICE_GFX: u32 = 12;
pub const GI_PROFILE_1_SLICE_NO_ME: u32 = 13;
pub const GI_PROFILE_2_SLICE_NO_ME: u32 = 14;
pub const GI_PROFILE_1_SLICE_ALL_ME: u32 = 15;
pub const GI_PROFILE_2_SLICE_ALL_ME: u32 = 16;
pub const GI_PROFILE_3_SLICE_GFX: u32 = 17;
/// Indexes at or above it are invalid.
pub const GI_PROFILE_COUNT: u32 = 18;

pub const CI_PROFILE_1_SLICE: u32 = 0;
pub const CI_PROFILE_2_SLICE: u32 = 1;
pub const CI_PROFILE_3_SLICE: u32 = 2;
pub const CI_PROFILE_4_SLICE: u32 = 3;
pub const CI_PROFILE_7_SLICE: u32 = 4;
pub const CI_PROFILE_8_SLICE: u32 = 5;
pub const CI_PROFILE_6_SLICE: u32 = 6;
/// GH200 uses it for the full CI of a double-memory 1g GPU instance.
pub const CI_PROFILE_1_SLICE_REV1: u32 = 7;
pub const CI_PROFILE_COUNT: u32 = 9;
/// `NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED`, the only engine profile.
pub const CI_ENGINE_PROFILE_SHARED: u32 = 0;

/// The compute-instance profile index whose instance spans `compute_slices` compute slices
/// (the full compute instance of a GPU instance with that many slices).
pub fn full_compute_instance_profile(compute_slices: u32) -> Option<u32> {
    match compute_slices {
        1 => Some(CI_PROFILE_1_SLICE),
        2 => Some(CI_PROFILE_2_SLICE),
        3 => Some(CI_PROFILE_3_SLICE),
        4 => Some(CI_PROFILE_4_SLICE),
        6 => Some(CI_PROFILE_6_SLICE),
        7 => Some(CI_PROFILE_7_SLICE),
        8 => Some(CI_PROFILE_8_SLICE),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compute slices of a compute-instance profile index.
    pub fn compute_instance_slices(ci_profile_index: u32) -> Option<u32> {
        match ci_profile_index {
            CI_PROFILE_1_SLICE | CI_PROFILE_1_SLICE_REV1 => Some(1),
            CI_PROFILE_2_SLICE => Some(2),
            CI_PROFILE_3_SLICE => Some(3),
            CI_PROFILE_4_SLICE => Some(4),
            CI_PROFILE_6_SLICE => Some(6),
            CI_PROFILE_7_SLICE => Some(7),
            CI_PROFILE_8_SLICE => Some(8),
            _ => None,
        }
    }

    /// Valid compute-instance sizes inside a GPU instance of `gi_compute_slices` slices:
    /// C <= G and not (C < G and 2C > G + 1) (go-nvlib's rule, which matches hardware output).
    pub fn valid_compute_instance_sizes(gi_compute_slices: u32) -> Vec<u32> {
        (1..=gi_compute_slices)
            .filter(|c| *c == gi_compute_slices || 2 * c <= gi_compute_slices + 1)
            .collect()
    }

    #[test]
    fn compute_instance_sizes_match_published_tables() {
        assert_eq!(valid_compute_instance_sizes(7), vec![1, 2, 3, 4, 7]);
        assert_eq!(valid_compute_instance_sizes(4), vec![1, 2, 4]);
        assert_eq!(valid_compute_instance_sizes(3), vec![1, 2, 3]);
        assert_eq!(valid_compute_instance_sizes(2), vec![1, 2]);
        assert_eq!(valid_compute_instance_sizes(1), vec![1]);
    }

    #[test]
    fn full_compute_instance_round_trips() {
        for slices in [1, 2, 3, 4, 6, 7, 8] {
            let index = full_compute_instance_profile(slices).unwrap();
            assert_eq!(compute_instance_slices(index), Some(slices));
        }
        assert_eq!(full_compute_instance_profile(5), None);
    }
}
