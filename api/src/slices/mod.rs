//! The slice model: a node's GPU inventory plus its policy become the node's ResourceSlice
//! pool (Kubernetes 1.35+ layout).
//!
//! * One counter set per MIG-offering GPU (`gpu-<minor>`): a counter per memory slice
//!   (`memory-slice-<i>`, value 1) plus the engine and memory budgets, so the scheduler
//!   enforces every NVML limit: overlapping placements, and budgets such as the single `+me`
//!   instance (one OFA engine).
//! * One device per offered (GPU, profile, placement), consuming the memory slices it covers
//!   plus its engines and memory; one whole-GPU device per GPU consuming everything.
//! * Counter-only slices (at most 8 sets each), then device-only slices (at most 64 each) in
//!   the published order, which is the scheduler's first-fit order. Counters that can never
//!   refuse anything are dropped first ([`prune`]).
//!
//! A MIG device of a profile the policy shares is published with
//! `allowMultipleAllocations: true` and a [`SHARES_CAPACITY`] capacity: the scheduler
//! (DRAConsumableCapacity) lets several claims hold it while their shares fit and charges its
//! counters once, so a shared partition blocks its memory slices like an exclusive one. Its
//! other capacities have the request policy "default 0, only 0", or the allocator would charge
//! each claim the full value and a second claim would never fit.
//!
//! Placements occupied by instances migdra did not create are left out and their engines
//! subtracted from the budgets; unhealthy GPUs are left out or tainted, by policy. Devices
//! that claims hold stay in the pool, tainted, even when no longer offered ([`retained`]).

pub mod allocator;
pub mod counter_model;
pub mod order;
pub mod prune;
pub mod quantity;
pub mod retained;
pub mod validate;

use std::collections::BTreeMap;

use k8s_openapi::{
    api::resource::v1::{
        CapacityRequestPolicy, CapacityRequestPolicyRange, Counter, CounterSet, Device, DeviceAttribute,
        DeviceCapacity, DeviceCounterConsumption, DeviceTaint, ResourcePool, ResourceSliceSpec,
    },
    apimachinery::pkg::api::resource::Quantity,
};

use crate::{
    device_name::DeviceName,
    geometry::{Engines, MigGeometry, MigProfile},
    inventory::{GpuInventory, InstanceOwner, MigInventory},
    policy::{EffectivePolicy, MigMode, UnhealthyGpus},
};

/// Devices per slice when devices consume counters (1.35+ limit).
pub const MAX_DEVICES_PER_SLICE: usize = 64;
/// Counter sets per slice (1.35+ limit).
pub const MAX_COUNTER_SETS_PER_SLICE: usize = 8;
/// The counter holding the memory budget, in MiB.
pub const MEMORY_COUNTER: &str = "memory";
/// Taint key on devices of unhealthy GPUs (policy `Taint`).
pub const UNHEALTHY_TAINT: &str = "gpu.migdra.dev/unhealthy";
/// Taint key on devices kept in the pool only because a claim holds them.
pub const NOT_OFFERED_TAINT: &str = "gpu.migdra.dev/not-offered";
/// The capacity a shared device is divided into; each claim takes some of it (default 1).
pub const SHARES_CAPACITY: &str = "shares";

/// Counter values by counter name. `memory` is in MiB; everything else is a count.
pub type Counters = BTreeMap<String, u64>;

/// What a planned device is.
#[derive(Clone, Debug, PartialEq)]
pub enum PlannedKind {
    Gpu,
    Mig { profile: MigProfile, start: u32 },
}

/// A device of the pool before it is rendered: what ordering, simulation and rendering need.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedDevice {
    pub gpu_minor: u32,
    pub name: DeviceName,
    pub kind: PlannedKind,
    /// None for a GPU published without counters.
    pub counter_set: Option<String>,
    pub consumes: Counters,
    /// Set when the parent GPU is unhealthy and the policy taints rather than omits.
    pub unhealthy: Option<String>,
    /// True for a device the pool keeps only because a claim holds it (see [`retained`]):
    /// published tainted [`NOT_OFFERED_TAINT`] so nothing new lands on it.
    pub not_offered: bool,
    /// For a shared MIG device, its [`SHARES_CAPACITY`]: several claims may hold it while
    /// their shares add up to at most this. `None`: exclusive.
    pub shares: Option<u32>,
}

/// The structure of a node's pool: counter sets and ordered devices.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PoolPlan {
    /// In GPU order.
    pub counter_sets: Vec<(String, Counters)>,
    /// Devices in published (first-fit) order.
    pub devices: Vec<PlannedDevice>,
}

impl PoolPlan {
    pub fn device_slices(&self) -> usize {
        self.devices.len().div_ceil(MAX_DEVICES_PER_SLICE)
    }

    pub fn counter_slices(&self) -> usize {
        self.counter_sets.len().div_ceil(MAX_COUNTER_SETS_PER_SLICE)
    }

    /// Total slices, at least one (an empty pool still publishes one slice, so the scheduler
    /// sees a complete, empty pool rather than none).
    pub fn slice_count(&self) -> usize {
        (self.device_slices() + self.counter_slices()).max(1)
    }
}

pub fn counter_set_name(minor: u32) -> String {
    format!("gpu-{minor}")
}

pub fn memory_slice_counter(i: u32) -> String {
    format!("memory-slice-{i}")
}

fn engine_counters(engines: Engines, memory_mib: u64) -> Counters {
    let mut counters: Counters = engines
        .named()
        .into_iter()
        .filter(|(_, v)| *v > 0)
        .map(|(k, v)| (k.to_string(), u64::from(v)))
        .collect();
    if memory_mib > 0 {
        counters.insert(MEMORY_COUNTER.to_string(), memory_mib);
    }
    counters
}

/// A GPU's counter set (budgets minus what foreign instances hold; a memory slice a foreign
/// instance covers has the value 0) and which memory slices foreign instances block. While the
/// GPU's engine counters are overruled ([`counter_model`]), the engine and memory budgets give
/// way to one instance counter per profile, and the optical-flow budget stays.
pub(crate) fn gpu_counters(mig: &MigInventory) -> (Counters, Vec<bool>) {
    let geometry = &mig.geometry;
    let mut budget_engines = geometry.budget.engines;
    let mut budget_memory = geometry.budget.memory_mib;
    let mut instances: BTreeMap<u32, u32> = geometry
        .profiles
        .iter()
        .map(|p| (p.gi_profile_id, p.instance_count))
        .collect();
    let mut blocked = vec![false; geometry.budget.memory_slices as usize];
    for instance in mig.instances.iter().filter(|i| i.owner == InstanceOwner::Foreign) {
        if let Some(p) = geometry.profile_by_id(instance.placement.profile_id) {
            budget_engines = budget_engines.saturating_sub(p.engines);
            budget_memory = budget_memory.saturating_sub(p.memory_mib);
            if let Some(left) = instances.get_mut(&p.gi_profile_id) {
                *left = left.saturating_sub(1);
            }
            for s in p.memory_range(instance.placement.start) {
                if let Some(b) = blocked.get_mut(s as usize) {
                    *b = true;
                }
            }
        }
    }
    let mut counters = if mig.engine_counters_overruled.is_some() {
        let mut counters = engine_counters(
            Engines {
                ofa_engines: budget_engines.ofa_engines,
                ..Engines::default()
            },
            0,
        );
        for (id, left) in instances {
            counters.insert(counter_model::instance_counter(id), u64::from(left));
        }
        counters
    } else {
        engine_counters(budget_engines, budget_memory)
    };
    for i in 0..geometry.budget.memory_slices {
        counters.insert(memory_slice_counter(i), u64::from(!blocked[i as usize]));
    }
    (counters, blocked)
}

/// What a MIG device at (`profile`, `start`) of `mig`'s GPU consumes: its memory slices, and
/// its engines and memory, or, while the engine counters are overruled, one instance of its
/// profile and its optical-flow engines.
pub(crate) fn mig_consumption(mig: &MigInventory, profile: &MigProfile, start: u32) -> Counters {
    let mut consumes = if mig.engine_counters_overruled.is_some() {
        let mut consumes = engine_counters(
            Engines {
                ofa_engines: profile.engines.ofa_engines,
                ..Engines::default()
            },
            0,
        );
        consumes.insert(counter_model::instance_counter(profile.gi_profile_id), 1);
        consumes
    } else {
        engine_counters(profile.engines, profile.memory_mib)
    };
    for s in profile.memory_range(start) {
        consumes.insert(memory_slice_counter(s), 1);
    }
    consumes
}

/// True when every counter `consumes` names exists in `counters` with at least that value.
pub(crate) fn fits_in(consumes: &Counters, counters: &Counters) -> bool {
    consumes
        .iter()
        .all(|(k, v)| counters.get(k).is_some_and(|have| have >= v))
}

/// What one GPU offers under a policy's [`MigMode`], before profile lists and budgets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuOffer {
    /// MIG partitions.
    pub partitions: bool,
    /// The whole GPU.
    pub whole: bool,
}

impl GpuOffer {
    /// The rule: a GPU without MIG is offered whole in every mode. A MIG-capable GPU offers
    /// what its current mode serves (`Current`), or only what the mode the policy names serves
    /// when the GPU is in it (`Mig`, `Whole`), or, with `Dynamic`, also what a switch would
    /// serve when the plugin reports the mode switchable now (a whole GPU only while no
    /// foreign instance is on it). `mig: false` and `wholeGpus: false` then take away
    /// partitions and whole GPUs.
    pub fn of(gpu: &GpuInventory, policy: &EffectivePolicy) -> Self {
        let Some(mig) = &gpu.mig else {
            return Self {
                partitions: false,
                whole: policy.whole_gpus,
            };
        };
        let on = mig.enabled;
        let (partitions, whole) = match policy.mig_mode {
            MigMode::Current => (on, !on),
            MigMode::Mig => (on, false),
            MigMode::Whole => (false, !on),
            MigMode::Dynamic => {
                let foreign = mig.instances.iter().any(|i| i.owner == InstanceOwner::Foreign);
                (
                    on || mig.mode_switchable,
                    !on || (mig.mode_switchable && !foreign),
                )
            }
        };
        Self {
            partitions: partitions && policy.mig,
            whole: whole && policy.whole_gpus,
        }
    }
}

/// Plans a node's pool: which devices exist, what they consume, in which order.
pub fn plan_pool(gpus: &[GpuInventory], policy: &EffectivePolicy) -> PoolPlan {
    let mut plan = PoolPlan::default();
    let mut per_gpu: Vec<(u32, Option<MigGeometry>, Vec<PlannedDevice>)> = Vec::new();
    let mut gpus: Vec<&GpuInventory> = gpus.iter().collect();
    gpus.sort_by_key(|g| g.minor);
    for gpu in gpus {
        let unhealthy =
            (!gpu.health.healthy).then(|| gpu.health.reason.clone().unwrap_or_else(|| "unhealthy".into()));
        if unhealthy.is_some() && policy.unhealthy_gpus == UnhealthyGpus::Omit {
            continue;
        }
        let whole_gpu = |counter_set, consumes| PlannedDevice {
            gpu_minor: gpu.minor,
            name: DeviceName::Gpu { minor: gpu.minor },
            kind: PlannedKind::Gpu,
            counter_set,
            consumes,
            unhealthy: unhealthy.clone(),
            not_offered: false,
            shares: None,
        };
        let mut devices = Vec::new();
        let offer = GpuOffer::of(gpu, policy);
        let offers_mig = gpu.mig.as_ref().filter(|_| offer.partitions);

        let mut geometry_used = None;
        if let Some(mig) = offers_mig {
            let geometry = &mig.geometry;
            let set = counter_set_name(gpu.minor);
            let (counters, blocked) = gpu_counters(mig);
            for (profile, start) in geometry.all_placements() {
                if !policy.offers(&profile.name) {
                    continue;
                }
                if profile
                    .memory_range(start)
                    .any(|s| blocked.get(s as usize).copied().unwrap_or(true))
                {
                    continue;
                }
                let consumes = mig_consumption(mig, profile, start);
                if !fits_in(&consumes, &counters) {
                    continue; // the remaining budget can never hold it
                }
                devices.push(PlannedDevice {
                    gpu_minor: gpu.minor,
                    name: DeviceName::Mig {
                        minor: gpu.minor,
                        profile: profile.name,
                        start,
                    },
                    kind: PlannedKind::Mig {
                        profile: profile.clone(),
                        start,
                    },
                    counter_set: Some(set.clone()),
                    consumes,
                    unhealthy: unhealthy.clone(),
                    not_offered: false,
                    shares: policy.shares_of(&profile.name),
                });
            }
            if offer.whole {
                // The whole GPU takes every counter, so it excludes, and is excluded by, any
                // partition.
                devices.push(whole_gpu(Some(set.clone()), counters.clone()));
            }
            if !devices.is_empty() {
                plan.counter_sets.push((set, counters));
                geometry_used = Some(geometry.clone());
            }
        } else if offer.whole {
            devices.push(whole_gpu(None, Counters::new()));
        }
        per_gpu.push((gpu.minor, geometry_used, devices));
    }
    plan.devices = order::order(per_gpu, policy.device_order);
    plan
}

/// The plan a node publishes: [`plan_pool`], then every device in `allocated` (device names
/// of this pool that claims hold) that the plan no longer offers kept, tainted
/// ([`retained::retain_allocated`]), then the counters that can never refuse anything left out
/// ([`prune::prune_counters`]; last, so that it sees every device the pool will hold), except
/// `memory` when the policy keeps it for quotas.
pub fn published_plan(
    gpus: &[GpuInventory],
    policy: &EffectivePolicy,
    allocated: &std::collections::BTreeSet<String>,
) -> (PoolPlan, retained::Retention) {
    let mut plan = plan_pool(gpus, policy);
    let retention = retained::retain_allocated(&mut plan, gpus, allocated);
    let keep: &[&str] = if policy.keep_memory_counter {
        &[MEMORY_COUNTER]
    } else {
        &[]
    };
    prune::prune_counters(&mut plan, keep);
    (plan, retention)
}

/// Identity of the pool being rendered.
#[derive(Clone, Debug)]
pub struct PoolIdentity<'a> {
    /// DRA driver name.
    pub driver: &'a str,
    pub node: &'a str,
    pub pool: &'a str,
    pub generation: i64,
    /// NVIDIA driver version, when known.
    pub driver_version: Option<&'a str>,
}

/// Renders a plan into slice specs: counter slices first, then device slices in order.
pub fn render_pool(id: &PoolIdentity<'_>, gpus: &[GpuInventory], plan: &PoolPlan) -> Vec<ResourceSliceSpec> {
    let count = i64::try_from(plan.slice_count()).unwrap_or(i64::MAX);
    let base = || ResourceSliceSpec {
        driver: id.driver.to_string(),
        node_name: Some(id.node.to_string()),
        pool: ResourcePool {
            name: id.pool.to_string(),
            generation: id.generation,
            resource_slice_count: count,
        },
        ..ResourceSliceSpec::default()
    };
    let mut slices = Vec::with_capacity(plan.slice_count());
    for chunk in plan.counter_sets.chunks(MAX_COUNTER_SETS_PER_SLICE) {
        let sets = chunk
            .iter()
            .map(|(name, counters)| CounterSet {
                name: name.clone(),
                counters: render_counters(counters),
            })
            .collect();
        slices.push(ResourceSliceSpec {
            shared_counters: Some(sets),
            ..base()
        });
    }
    let by_minor: BTreeMap<u32, &GpuInventory> = gpus.iter().map(|g| (g.minor, g)).collect();
    for chunk in plan.devices.chunks(MAX_DEVICES_PER_SLICE) {
        let devices = chunk
            .iter()
            .filter_map(|d| by_minor.get(&d.gpu_minor).map(|g| render_device(id, g, d)))
            .collect();
        slices.push(ResourceSliceSpec {
            devices: Some(devices),
            ..base()
        });
    }
    if slices.is_empty() {
        slices.push(ResourceSliceSpec {
            devices: Some(Vec::new()),
            ..base()
        });
    }
    slices
}

fn render_counters(counters: &Counters) -> BTreeMap<String, Counter> {
    counters
        .iter()
        .map(|(name, value)| {
            let q = if name == MEMORY_COUNTER {
                quantity::mebibytes(*value)
            } else {
                value.to_string()
            };
            (name.clone(), Counter { value: Quantity(q) })
        })
        .collect()
}

fn string(s: impl Into<String>) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(s.into()),
        ..Default::default()
    }
}

fn int(i: i64) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(i),
        ..Default::default()
    }
}

fn version(v: String) -> DeviceAttribute {
    DeviceAttribute {
        version: Some(v),
        ..Default::default()
    }
}

/// Normalises a dotted version into semver: `580.82.07` becomes `580.82.7`, `9.0` becomes
/// `9.0.0`. `None` when it is not made of one to three numbers.
pub fn semver(v: &str) -> Option<String> {
    let parts: Vec<u64> = v.split('.').map(|p| p.parse().ok()).collect::<Option<_>>()?;
    match parts.as_slice() {
        [a] => Some(format!("{a}.0.0")),
        [a, b] => Some(format!("{a}.{b}.0")),
        [a, b, c] => Some(format!("{a}.{b}.{c}")),
        _ => None,
    }
}

fn render_device(id: &PoolIdentity<'_>, gpu: &GpuInventory, device: &PlannedDevice) -> Device {
    let mut attributes = BTreeMap::new();
    attributes.insert("productName".to_string(), string(truncate(&gpu.product_name, 64)));
    if let Some(cc) = gpu.cuda_compute_capability.as_deref().and_then(semver) {
        attributes.insert("cudaComputeCapability".to_string(), version(cc));
    }
    if let Some(v) = id.driver_version.and_then(semver) {
        attributes.insert("driverVersion".to_string(), version(v));
    }
    if let Some(arch) = gpu.architecture {
        attributes.insert("architecture".to_string(), string(arch.to_string()));
    }
    if let Some(bus) = &gpu.pci_bus_id {
        attributes.insert("pciBusID".to_string(), string(bus.clone()));
    }
    if let Some(numa) = gpu.numa_node {
        attributes.insert("numaNode".to_string(), int(numa));
    }
    let mut capacity = BTreeMap::new();
    let cap = |v: String| DeviceCapacity {
        value: Quantity(v),
        ..Default::default()
    };
    match &device.kind {
        PlannedKind::Gpu => {
            attributes.insert("type".to_string(), string("gpu"));
            attributes.insert("uuid".to_string(), string(gpu.uuid.clone()));
            if let Some(bus) = &gpu.pci_bus_id {
                attributes.insert("resource.kubernetes.io/pciBusID".to_string(), string(bus.clone()));
            }
            capacity.insert("memory".to_string(), cap(quantity::mebibytes(gpu.memory_mib)));
        }
        PlannedKind::Mig { profile, start } => {
            attributes.insert("type".to_string(), string("mig"));
            attributes.insert("profile".to_string(), string(profile.name.to_string()));
            attributes.insert("parentUUID".to_string(), string(gpu.uuid.clone()));
            attributes.insert("placementStart".to_string(), int(i64::from(*start)));
            attributes.insert("memorySlices".to_string(), int(i64::from(profile.memory_slices)));
            attributes.insert(
                "computeSlices".to_string(),
                int(i64::from(profile.compute_slices)),
            );
            capacity.insert("memory".to_string(), cap(quantity::mebibytes(profile.memory_mib)));
            let e = profile.engines;
            for (name, value) in [
                ("multiprocessors", e.multiprocessors),
                ("copyEngines", e.copy_engines),
                ("decoders", e.decoders),
                ("encoders", e.encoders),
                ("jpegEngines", e.jpeg_engines),
                ("ofaEngines", e.ofa_engines),
            ] {
                capacity.insert(name.to_string(), cap(value.to_string()));
            }
        }
    }
    let consumes_counters = device.counter_set.as_ref().map(|set| {
        vec![DeviceCounterConsumption {
            counter_set: set.clone(),
            counters: render_counters(&device.consumes),
        }]
    });
    let taint = |key: &str| DeviceTaint {
        key: key.to_string(),
        effect: "NoSchedule".to_string(),
        ..Default::default()
    };
    let taints: Vec<DeviceTaint> = [
        device.unhealthy.as_ref().map(|_| taint(UNHEALTHY_TAINT)),
        device.not_offered.then(|| taint(NOT_OFFERED_TAINT)),
    ]
    .into_iter()
    .flatten()
    .collect();
    let taints = (!taints.is_empty()).then_some(taints);
    let allow_multiple_allocations = match (device.shares, &device.kind) {
        (Some(shares), PlannedKind::Mig { .. }) => {
            share_capacity(&mut capacity, shares);
            Some(true)
        }
        _ => None,
    };
    Device {
        name: device.name.to_string(),
        attributes: Some(attributes),
        capacity: Some(capacity),
        consumes_counters,
        taints,
        allow_multiple_allocations,
        ..Default::default()
    }
}

/// Makes a device's capacities those of a shared device: `shares` with the policy "default 1,
/// 1 to `shares` in steps of 1", and every descriptive capacity "default 0, only 0" (without a
/// policy the allocator charges each claim the whole value).
fn share_capacity(capacity: &mut BTreeMap<String, DeviceCapacity>, shares: u32) {
    let zero = || Quantity("0".to_string());
    for described in capacity.values_mut() {
        described.request_policy = Some(CapacityRequestPolicy {
            default: Some(zero()),
            valid_values: Some(vec![zero()]),
            valid_range: None,
        });
    }
    let q = |v: u32| Quantity(v.to_string());
    capacity.insert(
        SHARES_CAPACITY.to_string(),
        DeviceCapacity {
            value: q(shares),
            request_policy: Some(CapacityRequestPolicy {
                default: Some(q(1)),
                valid_values: None,
                valid_range: Some(CapacityRequestPolicyRange {
                    min: q(1),
                    max: Some(q(shares)),
                    step: Some(q(1)),
                }),
            }),
        },
    );
}

fn truncate(s: &str, max: usize) -> String {
    s[..s.floor_char_boundary(max)].to_string()
}

/// The pool identity the slice model's tests render node-a's pool with.
#[cfg(test)]
pub(crate) fn test_pool_identity() -> PoolIdentity<'static> {
    PoolIdentity {
        driver: "gpu.migdra.dev",
        node: "node-a",
        pool: "node-a/gpu.migdra.dev",
        generation: 1,
        driver_version: None,
    }
}

#[cfg(test)]
mod tests;
