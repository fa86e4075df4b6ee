//! What a trial runs on: the simulated GPUs (a seeded mix of H100, A100 and A30 boards, some
//! with MIG off, some holding an instance someone else created), the kinds of claims
//! ([`ClaimKind`]), and an oracle scheduler that hands out devices the way kube-scheduler
//! would under migdra's counters: never two overlapping allocations on one GPU (a whole GPU
//! overlaps everything on it, shares of one device overlap nothing but each other's
//! neighbours), never one over a foreign instance, at most `instanceCount` of a profile per
//! GPU, at most [`SHARES`] claims per shared device; `adminAccess` needs the whole GPU's
//! counters free but reserves nothing.
//! Trials without the oracle allocate from the published pool instead (`published.rs`).

use std::collections::BTreeMap;

use migdra_fake_nvml::{
    config::{FakeConfig, GpuConfig, InstanceConfig},
    model::{FakeModel, GiProfile},
};

use super::rng::Rng;

/// GPUs per simulated node.
pub const GPUS: u32 = 8;
/// Claims one shared device holds at most (the policy's default `shares`).
pub const SHARES: u32 = migdra_api::policy::DEFAULT_SHARES;
/// The boards a node is assembled from.
pub const MODELS: [&str; 4] = ["H100-80GB", "A100-SXM4-40GB", "A100-80GB", "A30-24GB"];

/// What kind of claim a pod's claim is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClaimKind {
    /// MIG devices held exclusively.
    Mig,
    /// Shares of shared MIG devices: several claims hold one instance.
    Shared,
    /// Whole GPUs (MIG switched off if it is on).
    WholeGpu,
    /// `adminAccess` to whole GPUs: nothing is created, changed or reserved.
    AdminAccess,
}

impl ClaimKind {
    /// A kind, MIG claims most often.
    pub fn pick(rng: &mut Rng) -> Self {
        match rng.below(100) {
            0..55 => Self::Mig,
            55..75 => Self::Shared,
            75..90 => Self::WholeGpu,
            _ => Self::AdminAccess,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Mig => "MIG",
            Self::Shared => "shared MIG",
            Self::WholeGpu => "whole GPU",
            Self::AdminAccess => "adminAccess",
        }
    }
}

/// How a claim holds a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Usage {
    Exclusive,
    /// One share of a shared MIG device, with the allocation's share ID.
    Share(String),
    /// The whole GPU.
    Whole,
    /// The whole GPU with `adminAccess` (holds nothing).
    Admin,
}

/// A device of the pool as a claim holds it: a MIG placement (exclusive or shared), or a
/// whole GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// GPU index (the fake numbers minors as indexes).
    pub gpu: u32,
    /// MIG placements only (0 for a whole GPU).
    pub profile_id: u32,
    pub start: u32,
    pub size: u32,
    /// The pool's device name, e.g. `gpu-3-mig-1g10gb-5` or `gpu-3`.
    pub device: String,
    pub usage: Usage,
}

impl Placement {
    /// Whether it keeps the memory slices `start..start + size` of `gpu` from others.
    pub fn overlaps(&self, gpu: u32, start: u32, size: u32) -> bool {
        match self.usage {
            Usage::Admin => false,
            Usage::Whole => self.gpu == gpu,
            Usage::Exclusive | Usage::Share(_) => {
                self.gpu == gpu && self.start < start + size && start < self.start + self.size
            }
        }
    }

    pub fn is_mig(&self) -> bool {
        matches!(self.usage, Usage::Exclusive | Usage::Share(_))
    }

    pub fn share_id(&self) -> Option<&str> {
        match &self.usage {
            Usage::Share(id) => Some(id),
            _ => None,
        }
    }

    /// A MIG placement.
    pub fn mig(gpu: u32, profile: &GiProfile, start: u32, usage: Usage) -> Self {
        Self {
            gpu,
            profile_id: profile.id,
            start,
            size: profile.memory_slices,
            device: device_name(gpu, profile, start),
            usage,
        }
    }

    /// A whole GPU (`usage` is [`Usage::Whole`] or [`Usage::Admin`]).
    pub fn whole(gpu: u32, usage: Usage) -> Self {
        Self {
            gpu,
            profile_id: 0,
            start: 0,
            size: 0,
            device: format!("gpu-{gpu}"),
            usage,
        }
    }
}

/// A share ID as the scheduler gives each allocation of a shared device (a UUID).
pub fn share_id(rng: &mut Rng) -> String {
    let (a, b) = (rng.next_u64(), rng.next_u64());
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        b >> 52,
        b & 0xffff_ffff_ffff
    )
}

/// The profile shared on a model: its smallest (as a policy sharing `1g` would).
pub fn shared_profile(model: &str) -> Option<GiProfile> {
    profiles(model).into_iter().min_by_key(|p| p.memory_slices)
}

/// The node a trial runs on.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub models: Vec<&'static str>,
    /// MIG mode of each GPU at the start (a MIG claim on one that is off switches it on).
    pub mig_on: Vec<bool>,
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
        let mig_on: Vec<bool> = models.iter().map(|_| !rng.percent(20)).collect();
        let mut foreign = Vec::new();
        for (gpu, model) in (0u32..).zip(&models) {
            if !mig_on[gpu as usize] || !rng.percent(40) {
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
            foreign.push(Placement::mig(gpu, &profile, start, Usage::Exclusive));
        }
        Self {
            models,
            mig_on,
            foreign,
        }
    }

    pub fn fake_config(&self) -> FakeConfig {
        FakeConfig {
            gpus: self
                .models
                .iter()
                .zip(&self.mig_on)
                .map(|(m, on)| GpuConfig::new(m, *on))
                .collect(),
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

/// The oracle scheduler: hands out what kube-scheduler would under migdra's counters, from
/// its own model of the node rather than from the published pool.
#[derive(Debug)]
pub struct Scheduler {
    models: Vec<&'static str>,
    foreign: Vec<Placement>,
    /// Allocated devices by claim UID.
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

    /// Every claim's allocated devices (what the published pool must keep counted).
    pub fn allocated(&self) -> &BTreeMap<String, Vec<Placement>> {
        &self.allocated
    }

    /// Records an allocation chosen elsewhere (from the published pool).
    pub fn record(&mut self, uid: &str, placements: Vec<Placement>) {
        self.allocated.insert(uid.to_string(), placements);
    }

    fn taken<'a>(&'a self, also: &'a [Placement]) -> impl Iterator<Item = &'a Placement> {
        self.foreign
            .iter()
            .chain(self.allocated.values().flatten())
            .chain(also)
    }

    fn free(&self, gpu: u32, profile: &GiProfile, start: u32, also: &[Placement]) -> bool {
        let size = profile.memory_slices;
        // Shares of one device are one instance: count each placement once.
        let mut same_profile = std::collections::BTreeSet::new();
        for p in self.taken(also) {
            if p.overlaps(gpu, start, size) {
                return false;
            }
            if p.is_mig() && p.gpu == gpu && p.profile_id == profile.id {
                same_profile.insert(p.start);
            }
        }
        (same_profile.len() as u32) < profile.instance_count
    }

    /// Whether nothing but `adminAccess` holds any part of GPU `gpu`.
    fn gpu_free(&self, gpu: u32, also: &[Placement]) -> bool {
        !self.taken(also).any(|p| p.gpu == gpu && p.usage != Usage::Admin)
    }

    /// Instances on the node that neither a foreign instance nor an allocation explains (what
    /// a lost GPU left behind, until the plugin destroys it): the plugin's inventory reports
    /// them as occupied, so the controller offers nothing over them.
    pub fn unexplained(&self, state: &migdra_fake_nvml::FakeState) -> Vec<Placement> {
        let mut out = Vec::new();
        for gpu in &state.gpus {
            for gi in &gpu.gpu_instances {
                let explained = self.taken(&[]).any(|p| {
                    p.is_mig() && p.gpu == gpu.index && p.profile_id == gi.profile_id && p.start == gi.start
                });
                if !explained {
                    out.push(Placement {
                        gpu: gpu.index,
                        profile_id: gi.profile_id,
                        start: gi.start,
                        size: gi.size,
                        device: String::new(),
                        usage: Usage::Exclusive,
                    });
                }
            }
        }
        out
    }

    /// One device of `kind` on a random GPU not in `avoid`, fitting next to `chosen`.
    fn one(&self, rng: &mut Rng, kind: ClaimKind, avoid: &[u32], chosen: &[Placement]) -> Option<Placement> {
        for _attempt in 0..24 {
            let gpu = rng.below(u64::from(GPUS)) as u32;
            if avoid.contains(&gpu) {
                continue;
            }
            let model = self.models[gpu as usize];
            match kind {
                ClaimKind::WholeGpu => {
                    if self.gpu_free(gpu, chosen) {
                        return Some(Placement::whole(gpu, Usage::Whole));
                    }
                }
                ClaimKind::AdminAccess => {
                    // The scheduler checks the whole GPU's counters for adminAccess too: only
                    // while nothing else holds part of it (a watched GPU stays open to others).
                    if self.gpu_free(gpu, chosen) && !chosen.iter().any(|p| p.gpu == gpu) {
                        return Some(Placement::whole(gpu, Usage::Admin));
                    }
                }
                ClaimKind::Shared => {
                    let profile = shared_profile(model)?;
                    // Join a device other claims share, while it has room, or share a new one.
                    let held: Vec<&Placement> = self
                        .allocated
                        .values()
                        .flatten()
                        .filter(|p| p.gpu == gpu && p.share_id().is_some())
                        .collect();
                    let joinable: Vec<&Placement> = held
                        .iter()
                        .copied()
                        .filter(|p| {
                            held.iter().filter(|h| h.device == p.device).count() < SHARES as usize
                                && !chosen.iter().any(|c| c.device == p.device)
                        })
                        .collect();
                    if !joinable.is_empty() && rng.percent(60) {
                        let p = rng.pick(&joinable);
                        return Some(Placement {
                            usage: Usage::Share(share_id(rng)),
                            ..(*p).clone()
                        });
                    }
                    let start = *rng.pick(profile.starts);
                    if self.free(gpu, &profile, start, chosen) {
                        return Some(Placement::mig(gpu, &profile, start, Usage::Share(share_id(rng))));
                    }
                }
                ClaimKind::Mig => {
                    let candidates = profiles(model);
                    // Small profiles more often than large ones, as in a busy cluster.
                    let profile = if rng.percent(60) {
                        *candidates.iter().min_by_key(|p| p.memory_slices)?
                    } else {
                        *rng.pick(&candidates)
                    };
                    let start = *rng.pick(profile.starts);
                    if self.free(gpu, &profile, start, chosen) {
                        return Some(Placement::mig(gpu, &profile, start, Usage::Exclusive));
                    }
                }
            }
        }
        None
    }

    /// Allocates `count` devices of `kind` for claim `uid` on random GPUs not in `avoid`
    /// (lost GPUs are unhealthy and not offered) and not over `occupied`; `None` when the
    /// node is too full.
    pub fn allocate(
        &mut self,
        rng: &mut Rng,
        uid: &str,
        kind: ClaimKind,
        count: usize,
        avoid: &[u32],
        occupied: &[Placement],
    ) -> Option<Vec<Placement>> {
        let mut chosen: Vec<Placement> = occupied.to_vec();
        let reserved = chosen.len();
        for _ in 0..count {
            let found = self.one(rng, kind, avoid, &chosen)?;
            chosen.push(found);
        }
        let chosen = chosen.split_off(reserved);
        self.allocated.insert(uid.to_string(), chosen.clone());
        Some(chosen)
    }

    /// The claim was deleted: its devices are free again.
    pub fn release(&mut self, uid: &str) {
        self.allocated.remove(uid);
    }
}
