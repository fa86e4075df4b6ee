//! Whether a GPU's engine and memory counters may be published.
//!
//! The engine counters (multiprocessors, copy engines, decoders, encoders, JPEG engines) and the
//! memory counter are migdra's model: each device consumes its profile's counts and the GPU's
//! budget is the full-GPU profile's. NVML states no such rule; its rules are the placements
//! (no two GPU instances share a memory slice), each profile's instance count, and the single
//! optical-flow engine going to one `+me` instance at a time. Some drivers report per-profile
//! engine counts that add up past the full GPU's, and then the engine counters would refuse
//! layouts NVML creates.
//!
//! So, per GPU, every maximal layout NVML's rules allow is checked against the counters. Where
//! one is refused, the GPU's devices are published with counters for memory slices, instance
//! counts and the optical-flow engine only ([`super::gpu_counters`]), and the inventory says why
//! ([`crate::inventory::MigInventory::engine_counters_overruled`]).

use std::fmt;

use crate::geometry::{Engines, MigGeometry, Placement};

/// A counter of migdra's model that refuses a layout NVML allows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CounterConflict {
    /// The counter's name in the published pool (`decoders`, `memory`, ...).
    pub counter: &'static str,
    /// A maximal layout NVML allows that the counter refuses: profile names and starts.
    pub layout: Vec<(String, u32)>,
    /// What the layout's devices consume of the counter together.
    pub used: u64,
    /// The counter's budget.
    pub budget: u64,
}

impl fmt::Display for CounterConflict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let layout: Vec<String> = self.layout.iter().map(|(p, s)| format!("{p}@{s}")).collect();
        write!(
            f,
            "the {} counter ({} on the GPU) refuses {} ({} together), which NVML's placements allow",
            self.counter,
            self.budget,
            layout.join(" + "),
            self.used
        )
    }
}

/// Whether NVML's own rules let `new` join `existing`: a valid start, no shared memory slice,
/// the profile's instance count, and the optical-flow engines (one `+me` instance per engine).
pub fn nvml_admits(geometry: &MigGeometry, existing: &[Placement], new: Placement) -> bool {
    let Some(profile) = geometry.profile_by_id(new.profile_id) else {
        return false;
    };
    if !profile.placements.contains(&new.start) {
        return false;
    }
    let range = profile.memory_range(new.start);
    let mut same_profile = 0;
    let mut ofa = profile.engines.ofa_engines;
    for placed in existing {
        let Some(other) = geometry.profile_by_id(placed.profile_id) else {
            return false;
        };
        let other_range = other.memory_range(placed.start);
        if range.start < other_range.end && other_range.start < range.end {
            return false;
        }
        if other.gi_profile_id == profile.gi_profile_id {
            same_profile += 1;
        }
        ofa += other.engines.ofa_engines;
    }
    same_profile < profile.instance_count
        && (profile.engines.ofa_engines == 0 || ofa <= geometry.budget.engines.ofa_engines)
}

/// Every layout NVML's rules allow to which no further GPU instance can be added, each in
/// profile-table order, found by exhaustive depth-first search.
pub fn maximal_layouts(geometry: &MigGeometry) -> Vec<Vec<Placement>> {
    let candidates: Vec<Placement> = geometry
        .all_placements()
        .map(|(p, start)| Placement {
            profile_id: p.gi_profile_id,
            start,
        })
        .collect();
    let mut out = Vec::new();
    let mut stack: Vec<(usize, Vec<Placement>)> = vec![(0, Vec::new())];
    while let Some((from, layout)) = stack.pop() {
        // Candidates before `from` were tried at a shallower level; maximality looks at all.
        if !candidates.iter().any(|c| nvml_admits(geometry, &layout, *c)) {
            out.push(layout.clone());
            continue;
        }
        for (i, candidate) in candidates.iter().enumerate().skip(from) {
            if nvml_admits(geometry, &layout, *candidate) {
                let mut grown = layout.clone();
                grown.push(*candidate);
                stack.push((i + 1, grown));
            }
        }
    }
    out
}

/// The engine and memory counters that refuse some layout NVML allows on a GPU with this
/// geometry, one conflict per counter (the first layout found). Empty when migdra's counters
/// accept every layout NVML's placements allow. The optical-flow counter is one of NVML's
/// rules here and never conflicts.
pub fn engine_counter_conflicts(geometry: &MigGeometry) -> Vec<CounterConflict> {
    let budget = geometry.budget;
    let mut conflicts: Vec<CounterConflict> = Vec::new();
    for layout in maximal_layouts(geometry) {
        let profiles: Vec<_> = layout
            .iter()
            .filter_map(|p| {
                geometry
                    .profile_by_id(p.profile_id)
                    .map(|profile| (profile, p.start))
            })
            .collect();
        let engines = profiles
            .iter()
            .fold(Engines::default(), |sum, (p, _)| sum + p.engines);
        let memory: u64 = profiles.iter().map(|(p, _)| p.memory_mib).sum();
        let counters = engines
            .named()
            .into_iter()
            .zip(budget.engines.named())
            .filter(|((name, _), _)| *name != "ofa-engines")
            .map(|((name, used), (_, limit))| (name, u64::from(used), u64::from(limit)))
            .chain([(super::MEMORY_COUNTER, memory, budget.memory_mib)]);
        for (counter, used, limit) in counters {
            if used > limit && !conflicts.iter().any(|c| c.counter == counter) {
                conflicts.push(CounterConflict {
                    counter,
                    layout: profiles.iter().map(|(p, s)| (p.name.to_string(), *s)).collect(),
                    used,
                    budget: limit,
                });
            }
        }
    }
    conflicts
}

/// The sentence the inventory carries when a GPU's engine and memory counters are not
/// published ([`crate::inventory::MigInventory::engine_counters_overruled`]); `None` when they
/// accept every layout NVML allows.
pub fn engine_counters_overruled(geometry: &MigGeometry) -> Option<String> {
    let conflicts = engine_counter_conflicts(geometry);
    if conflicts.is_empty() {
        return None;
    }
    let each: Vec<String> = conflicts.iter().map(ToString::to_string).collect();
    Some(format!(
        "the engine counts NVML reports per profile add up past the GPU's: {}; devices are published with counters for memory slices, instance counts and the optical-flow engine only",
        each.join("; ")
    ))
}

/// The counter holding how many more GPU instances of profile `profile_id` the GPU takes,
/// published only while the engine counters are overruled.
pub fn instance_counter(profile_id: u32) -> String {
    format!("profile-{profile_id}-instances")
}
