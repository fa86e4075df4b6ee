//! What a trial runs on: the simulated GPUs (a seeded mix of H100, A100 and A30 boards, some
//! holding an instance someone else created) and a scheduler that hands out placements the
//! way kube-scheduler would under migdra's counters: never two overlapping allocations on one
//! GPU, never one over a foreign instance, at most `instanceCount` of a profile per GPU.

use std::collections::BTreeMap;

use migdra_fake_nvml::{
    config::{FakeConfig, GpuConfig, InstanceConfig},
    model::{FakeModel, GiProfile},
};

use super::rng::Rng;

/// GPUs per simulated node.
pub const GPUS: u32 = 8;
/// The boards a node is assembled from.
pub const MODELS: [&str; 4] = ["H100-80GB", "A100-SXM4-40GB", "A100-80GB", "A30-24GB"];

/// A MIG placement on one GPU, as a device of the pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// GPU index (the fake numbers minors as indexes).
    pub gpu: u32,
    pub profile_id: u32,
    pub start: u32,
    pub size: u32,
    /// The pool's device name, e.g. `gpu-3-mig-1g10gb-5`.
    pub device: String,
}

impl Placement {
    pub fn overlaps(&self, gpu: u32, start: u32, size: u32) -> bool {
        self.gpu == gpu && self.start < start + size && start < self.start + self.size
    }
}

/// The node a trial runs on.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub models: Vec<&'static str>,
    /// Instances that exist before the plugin starts (created by someone else).
    pub foreign: Vec<Placement>,
}

/// The profiles a trial allocates on a model: every MIG profile but the `+`-variants, whose
/// engine budgets (one media-extension instance per GPU) the scheduler here does not model.
pub fn profiles(model: &str) -> Vec<GiProfile> {
    FakeModel::lookup(model)
        .and_then(|m| m.mig)
        .map(|mig| {
            mig.profiles
                .iter()
                .filter(|p| !p.name.contains('+') && !p.starts.is_empty())
                .copied()
                .collect()
        })
        .unwrap_or_default()
}

/// The pool's device name of a placement.
pub fn device_name(gpu: u32, profile: &GiProfile, start: u32) -> String {
    let label = profile.name.replace('.', "").replace('+', "-");
    format!("gpu-{gpu}-mig-{label}-{start}")
}

impl Scenario {
    pub fn generate(rng: &mut Rng) -> Self {
        let models: Vec<&'static str> = (0..GPUS).map(|_| *rng.pick(&MODELS)).collect();
        let mut foreign = Vec::new();
        for (gpu, model) in (0u32..).zip(&models) {
            if !rng.percent(40) {
                continue;
            }
            // A small instance, so most of the GPU stays usable.
            let small: Vec<GiProfile> = profiles(model)
                .into_iter()
                .filter(|p| p.memory_slices <= 2)
                .collect();
            if small.is_empty() {
                continue;
            }
            let profile = *rng.pick(&small);
            let start = *rng.pick(profile.starts);
            foreign.push(Placement {
                gpu,
                profile_id: profile.id,
                start,
                size: profile.memory_slices,
                device: device_name(gpu, &profile, start),
            });
        }
        Self { models, foreign }
    }

    pub fn fake_config(&self) -> FakeConfig {
        FakeConfig {
            gpus: self.models.iter().map(|m| GpuConfig::new(m, true)).collect(),
            instances: self
                .foreign
                .iter()
                .map(|f| InstanceConfig {
                    gpu: f.gpu,
                    profile_id: f.profile_id,
                    start: f.start,
                })
                .collect(),
            ..FakeConfig::default()
        }
    }
}

/// The scheduler's view: which placements are allocated (to a claim that still exists).
#[derive(Debug)]
pub struct Scheduler {
    models: Vec<&'static str>,
    foreign: Vec<Placement>,
    /// Allocated placements by claim UID.
    allocated: BTreeMap<String, Vec<Placement>>,
}

impl Scheduler {
    pub fn new(scenario: &Scenario) -> Self {
        Self {
            models: scenario.models.clone(),
            foreign: scenario.foreign.clone(),
            allocated: BTreeMap::new(),
        }
    }

    fn free(&self, gpu: u32, profile: &GiProfile, start: u32, also: &[Placement]) -> bool {
        let size = profile.memory_slices;
        let taken = self
            .foreign
            .iter()
            .chain(self.allocated.values().flatten())
            .chain(also);
        let mut same_profile = 0;
        for p in taken {
            if p.overlaps(gpu, start, size) {
                return false;
            }
            same_profile += u32::from(p.gpu == gpu && p.profile_id == profile.id);
        }
        same_profile < profile.instance_count
    }

    /// Instances on the node that neither a foreign instance nor an allocation explains (what
    /// a lost GPU left behind, until the plugin destroys it): the plugin's inventory reports
    /// them as occupied, so the controller offers nothing over them.
    pub fn unexplained(&self, state: &migdra_fake_nvml::FakeState) -> Vec<Placement> {
        let mut out = Vec::new();
        for gpu in &state.gpus {
            for gi in &gpu.gpu_instances {
                let explained = self
                    .foreign
                    .iter()
                    .chain(self.allocated.values().flatten())
                    .any(|p| p.gpu == gpu.index && p.profile_id == gi.profile_id && p.start == gi.start);
                if !explained {
                    out.push(Placement {
                        gpu: gpu.index,
                        profile_id: gi.profile_id,
                        start: gi.start,
                        size: gi.size,
                        device: String::new(),
                    });
                }
            }
        }
        out
    }

    /// Allocates `count` placements for claim `uid` on random GPUs not in `avoid` (lost GPUs
    /// are unhealthy and not offered) and not over `occupied`; `None` when the node is too
    /// full.
    pub fn allocate(
        &mut self,
        rng: &mut Rng,
        uid: &str,
        count: usize,
        avoid: &[u32],
        occupied: &[Placement],
    ) -> Option<Vec<Placement>> {
        let mut chosen: Vec<Placement> = occupied.to_vec();
        let reserved = chosen.len();
        for _ in 0..count {
            let mut found = None;
            for _attempt in 0..24 {
                let gpu = rng.below(u64::from(GPUS)) as u32;
                if avoid.contains(&gpu) {
                    continue;
                }
                let candidates = profiles(self.models[gpu as usize]);
                // Small profiles more often than large ones, as in a busy cluster.
                let profile = if rng.percent(60) {
                    *candidates.iter().min_by_key(|p| p.memory_slices)?
                } else {
                    *rng.pick(&candidates)
                };
                let start = *rng.pick(profile.starts);
                if self.free(gpu, &profile, start, &chosen) {
                    found = Some(Placement {
                        gpu,
                        profile_id: profile.id,
                        start,
                        size: profile.memory_slices,
                        device: device_name(gpu, &profile, start),
                    });
                    break;
                }
            }
            chosen.push(found?);
        }
        let chosen = chosen.split_off(reserved);
        self.allocated.insert(uid.to_string(), chosen.clone());
        Some(chosen)
    }

    /// The claim was deleted: its placements are free again.
    pub fn release(&mut self, uid: &str) {
        self.allocated.remove(uid);
    }
}
