//! MIG geometry: GPU-instance profiles, placements, budgets, and the rules that decide
//! whether a set of GPU instances can coexist on one GPU.
//!
//! A placement is `{start, size}` in memory slices. Two GPU instances conflict when their
//! memory-slice ranges overlap (compute slice *c* sits under memory slice *c*, so memory
//! overlap alone reproduces every valid and invalid combination). On top of that the GPU
//! has engine budgets (for example a single OFA engine, which is why only one `+me`
//! instance fits) and per-profile instance limits.

use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::profile::ProfileName;

/// Engine and multiprocessor counts of a profile, or the budget of a whole GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Engines {
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Copy engines.
    pub copy_engines: u32,
    /// Video decoders.
    pub decoders: u32,
    /// Video encoders.
    pub encoders: u32,
    /// JPEG decoders.
    pub jpeg_engines: u32,
    /// Optical-flow accelerators.
    pub ofa_engines: u32,
}

impl Engines {
    fn combine(self, other: Engines, f: impl Fn(u32, u32) -> u32) -> Engines {
        Engines {
            multiprocessors: f(self.multiprocessors, other.multiprocessors),
            copy_engines: f(self.copy_engines, other.copy_engines),
            decoders: f(self.decoders, other.decoders),
            encoders: f(self.encoders, other.encoders),
            jpeg_engines: f(self.jpeg_engines, other.jpeg_engines),
            ofa_engines: f(self.ofa_engines, other.ofa_engines),
        }
    }

    /// Component-wise maximum.
    pub fn max(self, other: Engines) -> Engines {
        self.combine(other, Ord::max)
    }

    /// Component-wise difference, floored at zero.
    pub fn saturating_sub(self, other: Engines) -> Engines {
        self.combine(other, u32::saturating_sub)
    }

    /// True when every component of `self` is at most the one of `budget`.
    pub fn fits_in(self, budget: Engines) -> bool {
        self.named()
            .iter()
            .zip(budget.named())
            .all(|((_, used), (_, limit))| *used <= limit)
    }

    /// The components with their counter names (DNS labels), in a fixed order.
    pub fn named(self) -> [(&'static str, u32); 6] {
        [
            ("multiprocessors", self.multiprocessors),
            ("copy-engines", self.copy_engines),
            ("decoders", self.decoders),
            ("encoders", self.encoders),
            ("jpeg-engines", self.jpeg_engines),
            ("ofa-engines", self.ofa_engines),
        ]
    }
}

impl std::ops::Add for Engines {
    type Output = Engines;

    fn add(self, other: Engines) -> Engines {
        self.combine(other, |a, b| a + b)
    }
}

/// One GPU-instance profile of one GPU model, as NVML reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigProfile {
    /// Profile name, e.g. `3g.40gb`.
    pub name: ProfileName,
    /// GPU-instance profile **ID** (what create/placement calls take; 1g = 19 on A100/H100).
    pub gi_profile_id: u32,
    /// GPU-instance profile **index** (the `NVML_GPU_INSTANCE_PROFILE_*` constant).
    pub gi_profile_index: u32,
    /// Compute slices (NVML `sliceCount`).
    pub compute_slices: u32,
    /// Memory slices a placement covers (the placement `size`).
    pub memory_slices: u32,
    /// Maximum number of instances of this profile on one GPU.
    pub instance_count: u32,
    /// Valid placement starts, in memory slices.
    pub placements: Vec<u32>,
    /// Engines and multiprocessors of one instance.
    pub engines: Engines,
    /// Memory of one instance in MiB.
    pub memory_mib: u64,
}

impl MigProfile {
    /// The memory-slice range a placement at `start` covers.
    pub fn memory_range(&self, start: u32) -> std::ops::Range<u32> {
        start..start + self.memory_slices
    }
}

/// What the GPU as a whole offers to its GPU instances.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigBudget {
    /// Memory slices of the GPU (8 on A100/H100/B200, 4 on A30).
    pub memory_slices: u32,
    /// Engine budget shared by all GPU instances.
    pub engines: Engines,
    /// Memory budget in MiB.
    pub memory_mib: u64,
}

impl MigBudget {
    /// The budget implied by a profile table: the memory-slice count is the largest placement
    /// end; each engine budget is the largest count any single profile has (the full-GPU
    /// profile owns every engine); memory is the GPU's total.
    pub fn from_profiles(profiles: &[MigProfile], total_memory_mib: u64) -> MigBudget {
        let memory_slices = profiles
            .iter()
            .flat_map(|p| p.placements.iter().map(move |s| s + p.memory_slices))
            .max()
            .unwrap_or(0);
        let engines = profiles
            .iter()
            .fold(Engines::default(), |acc, p| acc.max(p.engines));
        let largest_profile_memory = profiles.iter().map(|p| p.memory_mib).max().unwrap_or(0);
        MigBudget {
            memory_slices,
            engines,
            memory_mib: total_memory_mib.max(largest_profile_memory),
        }
    }
}

/// A GPU instance placed on a GPU: which profile, at which start.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct Placement {
    /// GPU-instance profile ID.
    pub profile_id: u32,
    /// First memory slice.
    pub start: u32,
}

/// Why a GPU instance cannot be added to a GPU. Mirrors what NVML answers.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// The profile ID is not one of the GPU's profiles (NVML: INVALID_ARGUMENT).
    #[error("GPU-instance profile ID {0} does not exist on this GPU")]
    UnknownProfile(u32),
    /// The start is not a valid placement of the profile (NVML: INVALID_ARGUMENT).
    #[error("{profile} cannot be placed at memory slice {start} (valid starts: {valid:?})")]
    InvalidStart {
        profile: ProfileName,
        start: u32,
        valid: Vec<u32>,
    },
    /// The placement overlaps an existing GPU instance (NVML: INSUFFICIENT_RESOURCES).
    #[error("{profile}@{start} overlaps the existing {other}@{other_start}")]
    Overlap {
        profile: ProfileName,
        start: u32,
        other: ProfileName,
        other_start: u32,
    },
    /// The profile's instance limit is reached (NVML: INSUFFICIENT_RESOURCES).
    #[error("{profile} allows at most {limit} instances per GPU")]
    InstanceLimit { profile: ProfileName, limit: u32 },
    /// An engine or memory budget would be exceeded (NVML: INSUFFICIENT_RESOURCES).
    #[error("{profile}@{start} exceeds the GPU's {resource} budget ({used} of {budget} in use)")]
    Budget {
        profile: ProfileName,
        start: u32,
        resource: &'static str,
        used: u64,
        budget: u64,
    },
}

/// The MIG geometry of one GPU: its profiles and its budget.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigGeometry {
    /// GPU-instance profiles.
    pub profiles: Vec<MigProfile>,
    /// Shared budget.
    pub budget: MigBudget,
}

impl MigGeometry {
    /// Builds the geometry from a profile table and the GPU's total memory.
    pub fn new(profiles: Vec<MigProfile>, total_memory_mib: u64) -> Self {
        let budget = MigBudget::from_profiles(&profiles, total_memory_mib);
        Self { profiles, budget }
    }

    /// Looks a profile up by GPU-instance profile ID.
    pub fn profile_by_id(&self, id: u32) -> Option<&MigProfile> {
        self.profiles.iter().find(|p| p.gi_profile_id == id)
    }

    /// Looks a profile up by name.
    pub fn profile_by_name(&self, name: &ProfileName) -> Option<&MigProfile> {
        self.profiles.iter().find(|p| &p.name == name)
    }

    /// Every (profile, start) pair the GPU offers, in profile-table order.
    pub fn all_placements(&self) -> impl Iterator<Item = (&MigProfile, u32)> {
        self.profiles
            .iter()
            .flat_map(|p| p.placements.iter().map(move |s| (p, *s)))
    }

    /// Decides whether `new` can be created next to the `existing` GPU instances, checking in
    /// the order NVML does: profile, start, overlap, instance count, budgets.
    pub fn check_add(&self, existing: &[Placement], new: Placement) -> Result<(), PlacementError> {
        let profile = self
            .profile_by_id(new.profile_id)
            .ok_or(PlacementError::UnknownProfile(new.profile_id))?;
        if !profile.placements.contains(&new.start) {
            return Err(PlacementError::InvalidStart {
                profile: profile.name,
                start: new.start,
                valid: profile.placements.clone(),
            });
        }
        let range = profile.memory_range(new.start);
        let mut same_profile = 0;
        let mut used_engines = Engines::default();
        let mut used_memory = 0;
        for placed in existing {
            let other = self
                .profile_by_id(placed.profile_id)
                .ok_or(PlacementError::UnknownProfile(placed.profile_id))?;
            let other_range = other.memory_range(placed.start);
            if range.start < other_range.end && other_range.start < range.end {
                return Err(PlacementError::Overlap {
                    profile: profile.name,
                    start: new.start,
                    other: other.name,
                    other_start: placed.start,
                });
            }
            if other.gi_profile_id == profile.gi_profile_id {
                same_profile += 1;
            }
            used_engines = used_engines + other.engines;
            used_memory += other.memory_mib;
        }
        if same_profile >= profile.instance_count {
            return Err(PlacementError::InstanceLimit {
                profile: profile.name,
                limit: profile.instance_count,
            });
        }
        let after = used_engines + profile.engines;
        let budgets = self.budget.engines.named();
        for (((resource, used), (_, total)), (_, limit)) in
            used_engines.named().into_iter().zip(after.named()).zip(budgets)
        {
            if total > limit {
                return Err(PlacementError::Budget {
                    profile: profile.name,
                    start: new.start,
                    resource,
                    used: u64::from(used),
                    budget: u64::from(limit),
                });
            }
        }
        if used_memory + profile.memory_mib > self.budget.memory_mib {
            return Err(PlacementError::Budget {
                profile: profile.name,
                start: new.start,
                resource: "memory",
                used: used_memory,
                budget: self.budget.memory_mib,
            });
        }
        Ok(())
    }
}

/// The GPU-instance ID NVML assigns to a placement: a binary-heap index over the memory-slice
/// range (full = 0, halves = 1..2, quarters = 3..6, eighths = 7..14). Some boards number the
/// halves swapped; `swap_halves` models that. Never infer a placement from this ID.
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

/// GPU architecture, as far as MIG cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum Architecture {
    /// A100, A30: toggling MIG mode needs a GPU reset; the mode persists.
    Ampere,
    /// H100, H200, GH200: MIG mode toggles immediately; lost on driver reload.
    Hopper,
    /// B200 and later: as Hopper.
    Blackwell,
}

impl Architecture {
    /// True when MIG mode can be switched without a GPU reset (Hopper and later).
    pub fn mig_mode_switchable(self) -> bool {
        !matches!(self, Architecture::Ampere)
    }

    /// Parses NVML's architecture value.
    pub fn from_nvml_value(value: u32) -> Option<Self> {
        match value {
            7 => Some(Architecture::Ampere),
            9 => Some(Architecture::Hopper),
            10 => Some(Architecture::Blackwell),
            _ => None,
        }
    }
}

impl fmt::Display for Architecture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Architecture::Ampere => "Ampere",
            Architecture::Hopper => "Hopper",
            Architecture::Blackwell => "Blackwell",
        })
    }
}
