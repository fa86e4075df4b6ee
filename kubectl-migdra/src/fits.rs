//! The fits view: where a new claim for one MIG device of a given shape (a profile, or at
//! least some memory) would land now, node by node, or why it cannot.
//!
//! It replays the scheduler's allocator on the pool as published: the pool's newest complete
//! generation, slices by name, devices in listed order, the first untainted device that matches
//! and whose counters still fit after every allocated device's consumption. The counter
//! arithmetic is migdra-api's allocator model ([`Allocator`]) over a [`PoolPlan`] rebuilt from
//! the published slices, so it is the same model the packing simulation and the property tests
//! check. The scheduler picks among nodes by its own scoring; the view answers per node.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};
use migdra_api::{
    device_name::DeviceName,
    geometry::MigProfile,
    inventory::{GpuInventory, GpuNode},
    profile::ProfileName,
    slices::{
        Counters, MEMORY_COUNTER, NOT_OFFERED_TAINT, PlannedDevice, PlannedKind, PoolPlan, SHARES_CAPACITY,
        UNHEALTHY_TAINT, allocator::Allocator, quantity,
    },
};
use serde::Serialize;

use crate::{
    VIEW_API_VERSION,
    snapshot::{Snapshot, node_of, pool_of},
    usage::{DeviceUse, Usage},
};

/// The shape of the claim asked about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Shape {
    Profile(ProfileName),
    /// Any MIG device with at least this much memory.
    Memory {
        bytes: u128,
        /// As the user wrote it (`20Gi`).
        text: String,
    },
}

impl Shape {
    /// Parses `--memory` (`20Gi`, `10240Mi`).
    pub fn memory(text: &str) -> Result<Self, String> {
        let bytes = quantity::parse(text)
            .ok_or_else(|| format!("{text:?} is not a memory quantity such as 20Gi or 10240Mi"))?;
        Ok(Self::Memory {
            bytes,
            text: text.to_string(),
        })
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Shape::Profile(p) => write!(f, "{p}"),
            Shape::Memory { text, .. } => write!(f, "a MIG device with at least {text}"),
        }
    }
}

/// The answer for every selected node.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FitsView {
    pub api_version: String,
    pub kind: String,
    pub request: FitsRequest,
    pub nodes: Vec<NodeFit>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FitsRequest {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeFit {
    pub node: String,
    pub pool: String,
    /// The device a claim would get now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lands: Option<Landing>,
    /// Why no device of the shape can be considered at all (no pool, incomplete pool, shape
    /// not published).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
    /// When it does not land: each published device of the shape, in pool order, and what
    /// stops it.
    pub blocked: Vec<BlockedDevice>,
}

/// Where a claim would land.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Landing {
    pub device: String,
    pub gpu: u32,
    pub profile: String,
    pub start: u32,
    /// Memory slices it would cover.
    pub memory_slices: Vec<u32>,
}

/// A published device of the right shape that a claim cannot get now.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BlockedDevice {
    pub device: String,
    pub reason: String,
}

/// Answers for `node` (every node with a GpuNode when `None`).
pub fn build(snapshot: &Snapshot, shape: &Shape, node: Option<&str>) -> FitsView {
    let usage = Usage::build(snapshot);
    let mut gpu_nodes: Vec<&GpuNode> = snapshot
        .gpu_nodes
        .iter()
        .filter(|g| node.is_none_or(|n| node_of(g) == n))
        .collect();
    gpu_nodes.sort_by(|a, b| node_of(a).cmp(node_of(b)));
    let mut nodes: Vec<NodeFit> = gpu_nodes
        .into_iter()
        .map(|g| node_fit(snapshot, &usage, g, shape))
        .collect();
    if let Some(node) = node
        && nodes.is_empty()
    {
        nodes.push(NodeFit {
            node: node.to_string(),
            pool: migdra_api::inventory::pool_name(node, &snapshot.driver),
            lands: None,
            problem: Some("no GpuNode: migdra's kubelet plugin has not reported this node".into()),
            blocked: Vec::new(),
        });
    }
    FitsView {
        api_version: VIEW_API_VERSION.into(),
        kind: "Fits".into(),
        request: match shape {
            Shape::Profile(p) => FitsRequest {
                profile: Some(p.to_string()),
                memory: None,
            },
            Shape::Memory { text, .. } => FitsRequest {
                profile: None,
                memory: Some(text.clone()),
            },
        },
        nodes,
    }
}

/// A published device with what matching needs beyond the allocator's plan.
struct Published {
    mig: Option<(MigProfile, u32)>,
    memory_bytes: Option<u128>,
    blocking_taints: Vec<String>,
}

fn node_fit(snapshot: &Snapshot, usage: &Usage, gpu_node: &GpuNode, shape: &Shape) -> NodeFit {
    let node = node_of(gpu_node).to_string();
    let pool = pool_of(gpu_node, &snapshot.driver);
    let mut fit = NodeFit {
        node,
        pool: pool.clone(),
        lands: None,
        problem: None,
        blocked: Vec::new(),
    };
    let slices = match current_slices(snapshot, &pool) {
        Ok(slices) => slices,
        Err(problem) => {
            fit.problem = Some(problem);
            return fit;
        }
    };
    let (plan, published) = rebuild_plan(gpu_node, &slices);
    let mut allocator = Allocator::new(&plan);
    let mut holders: BTreeMap<usize, &[DeviceUse]> = BTreeMap::new();
    for (device, users) in usage.pool_devices(&pool) {
        if let Some(index) = plan.devices.iter().position(|d| d.name.to_string() == device) {
            allocator.take(index);
            holders.insert(index, users);
        }
    }
    let mut candidates = 0;
    for (index, (planned, device)) in plan.devices.iter().zip(&published).enumerate() {
        if !matches(shape, device) {
            continue;
        }
        candidates += 1;
        if !device.blocking_taints.is_empty() {
            fit.blocked.push(BlockedDevice {
                device: planned.name.to_string(),
                reason: format!("tainted {}", device.blocking_taints.join(", ")),
            });
        } else if allocator.fits(index) {
            if let Some((profile, start)) = &device.mig {
                fit.lands = Some(Landing {
                    device: planned.name.to_string(),
                    gpu: planned.gpu_minor,
                    profile: profile.name.to_string(),
                    start: *start,
                    memory_slices: profile.memory_range(*start).collect(),
                });
                fit.blocked.clear();
                return fit;
            }
        } else {
            fit.blocked.push(BlockedDevice {
                device: planned.name.to_string(),
                reason: explain(&plan, &holders, index),
            });
        }
    }
    if candidates == 0 {
        fit.problem = Some(not_published(snapshot, gpu_node, shape));
    }
    fit
}

/// The pool's newest generation, slices by name; an error when there is none or it is
/// incomplete (the scheduler allocates nothing from an incomplete pool).
fn current_slices<'a>(snapshot: &'a Snapshot, pool: &str) -> Result<Vec<&'a ResourceSlice>, String> {
    let ours: Vec<&ResourceSlice> = snapshot
        .slices
        .iter()
        .filter(|s| s.spec.driver == snapshot.driver && s.spec.pool.name == pool)
        .collect();
    let Some(generation) = ours.iter().map(|s| s.spec.pool.generation).max() else {
        return Err(format!(
            "no ResourceSlices for pool {pool}: the controller publishes a node only while its plugin is registered and live"
        ));
    };
    let mut current: Vec<&ResourceSlice> = ours
        .into_iter()
        .filter(|s| s.spec.pool.generation == generation)
        .collect();
    current.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let expected = current
        .iter()
        .map(|s| s.spec.pool.resource_slice_count)
        .max()
        .unwrap_or(0);
    if i64::try_from(current.len()).unwrap_or(i64::MAX) != expected {
        return Err(format!(
            "pool {pool} is incomplete ({} of {expected} slices at generation {generation}): the scheduler allocates nothing from it until the controller finishes writing it",
            current.len()
        ));
    }
    Ok(current)
}

/// The published pool as migdra-api's plan, plus what matching needs per device. Devices
/// that are not migdra device names, or whose profile the node's inventory does not know,
/// are left out (no claim of a MIG shape can match them).
fn rebuild_plan(gpu_node: &GpuNode, slices: &[&ResourceSlice]) -> (PoolPlan, Vec<Published>) {
    let mut plan = PoolPlan::default();
    let mut published = Vec::new();
    for slice in slices {
        for set in slice.spec.shared_counters.iter().flatten() {
            let counters: Counters = set
                .counters
                .iter()
                .map(|(name, c)| (name.clone(), counter_value(name, &c.value.0)))
                .collect();
            plan.counter_sets.push((set.name.clone(), counters));
        }
    }
    let gpus = node_gpus(gpu_node);
    for device in slices.iter().flat_map(|s| s.spec.devices.iter().flatten()) {
        let Ok(name) = device.name.parse::<DeviceName>() else {
            continue;
        };
        let (kind, mig) = match name {
            DeviceName::Gpu { .. } => (PlannedKind::Gpu, None),
            DeviceName::Mig {
                minor,
                profile,
                start,
            } => {
                let Some(p) = gpus
                    .iter()
                    .find(|g| g.minor == minor)
                    .and_then(|g| g.mig.as_ref())
                    .and_then(|m| m.geometry.profile_by_name(&profile))
                else {
                    continue;
                };
                (
                    PlannedKind::Mig {
                        profile: p.clone(),
                        start,
                    },
                    Some((p.clone(), start)),
                )
            }
        };
        let consumption = device.consumes_counters.iter().flatten().next();
        let taints = blocking_taints(device);
        plan.devices.push(PlannedDevice {
            gpu_minor: name.minor(),
            name,
            kind,
            counter_set: consumption.map(|c| c.counter_set.clone()),
            consumes: consumption
                .map(|c| {
                    c.counters
                        .iter()
                        .map(|(name, q)| (name.clone(), counter_value(name, &q.value.0)))
                        .collect()
                })
                .unwrap_or_default(),
            unhealthy: taints
                .iter()
                .any(|t| t.starts_with(UNHEALTHY_TAINT))
                .then(|| "tainted unhealthy".to_string()),
            not_offered: taints.iter().any(|t| t.starts_with(NOT_OFFERED_TAINT)),
            // A shared device's `shares` capacity; `fits` still treats a held shared device
            // as taken (it does not read the shares each holder consumed).
            shares: device
                .allow_multiple_allocations
                .unwrap_or(false)
                .then(|| {
                    device
                        .capacity
                        .as_ref()
                        .and_then(|c| c.get(SHARES_CAPACITY))
                        .and_then(|q| q.value.0.parse().ok())
                })
                .flatten(),
        });
        published.push(Published {
            mig,
            memory_bytes: device
                .capacity
                .as_ref()
                .and_then(|c| c.get("memory"))
                .and_then(|q| quantity::parse(&q.value.0)),
            blocking_taints: taints,
        });
    }
    (plan, published)
}

/// A counter's value in the plan's units (MiB for `memory`, a count otherwise).
fn counter_value(name: &str, quantity_text: &str) -> u64 {
    let value = quantity::parse(quantity_text).unwrap_or(0);
    let value = if name == MEMORY_COUNTER {
        value >> 20
    } else {
        value
    };
    u64::try_from(value).unwrap_or(u64::MAX)
}

/// Taints a claim without tolerations cannot pass: `key[=value]:effect`.
fn blocking_taints(device: &Device) -> Vec<String> {
    device
        .taints
        .iter()
        .flatten()
        .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
        .map(|t| match &t.value {
            Some(v) if !v.is_empty() => format!("{}={v}:{}", t.key, t.effect),
            _ => format!("{}:{}", t.key, t.effect),
        })
        .collect()
}

fn matches(shape: &Shape, device: &Published) -> bool {
    let Some((profile, _)) = &device.mig else {
        return false;
    };
    match shape {
        Shape::Profile(wanted) => profile.name == *wanted,
        Shape::Memory { bytes, .. } => device.memory_bytes.is_some_and(|m| m >= *bytes),
    }
}

fn claims_text(users: &[DeviceUse]) -> String {
    let claims: Vec<String> = users.iter().map(|u| format!("claim {}", u.claim)).collect();
    claims.join(", ")
}

fn node_gpus(gpu_node: &GpuNode) -> Vec<GpuInventory> {
    gpu_node
        .status
        .as_ref()
        .and_then(|s| s.gpus.clone())
        .unwrap_or_default()
}

/// Why device `index` does not fit: taken itself, or which counters are short and who
/// holds them.
fn explain(plan: &PoolPlan, holders: &BTreeMap<usize, &[DeviceUse]>, index: usize) -> String {
    if let Some(users) = holders.get(&index) {
        return format!("allocated to {}", claims_text(users));
    }
    let device = &plan.devices[index];
    let Some(set) = &device.counter_set else {
        return "does not fit".into();
    };
    let total = plan
        .counter_sets
        .iter()
        .find(|(name, _)| name == set)
        .map(|(_, c)| c.clone())
        .unwrap_or_default();
    // Memory slices first, in slice order, then the budgets.
    let mut needs: Vec<(&String, &u64)> = device.consumes.iter().collect();
    needs.sort_by_key(|(name, _)| {
        (
            !name.starts_with("memory-slice-"),
            slice_number(name),
            (*name).clone(),
        )
    });
    // Memory slices by who holds them; budgets by how much is short.
    let mut by_holder: Vec<(String, Vec<String>)> = Vec::new();
    let mut short_budgets: Vec<String> = Vec::new();
    for (counter, need) in needs {
        let have = total.get(counter).copied().unwrap_or(0);
        let users: Vec<(usize, u64)> = holders
            .keys()
            .filter_map(|i| {
                let other = &plan.devices[*i];
                (other.counter_set.as_ref() == Some(set))
                    .then(|| other.consumes.get(counter).map(|v| (*i, *v)))
                    .flatten()
            })
            .collect();
        let used: u64 = users.iter().map(|(_, v)| v).sum();
        let left = have.saturating_sub(used);
        if left >= *need {
            continue;
        }
        if !counter.starts_with("memory-slice-") {
            let unit = if counter == MEMORY_COUNTER { "Mi" } else { "" };
            short_budgets.push(format!("{counter} (needs {need}{unit}, {left}{unit} left)"));
            continue;
        }
        let holders_of_slice: Vec<String> = if users.is_empty() {
            vec!["held by an instance migdra did not create".to_string()]
        } else {
            users
                .iter()
                .map(|(i, _)| {
                    let users = holders.get(i).copied().unwrap_or(&[]);
                    format!("used by {} ({})", plan.devices[*i].name, claims_text(users))
                })
                .collect()
        };
        for holder in holders_of_slice {
            match by_holder.iter_mut().find(|(h, _)| *h == holder) {
                Some((_, counters)) => counters.push(counter.clone()),
                None => by_holder.push((holder, vec![counter.clone()])),
            }
        }
    }
    let mut parts: Vec<String> = by_holder
        .into_iter()
        .map(|(holder, counters)| format!("{} {holder}", counters.join(",")))
        .collect();
    // Budgets matter only when the slices are free: slices held by others explain it all.
    if parts.is_empty() && !short_budgets.is_empty() {
        parts.push(format!("budget short: {}", short_budgets.join(", ")));
    }
    if parts.is_empty() {
        return "does not fit the remaining counters".into();
    }
    parts.join("; ")
}

fn slice_number(counter: &str) -> u32 {
    counter
        .strip_prefix("memory-slice-")
        .and_then(|n| n.parse().ok())
        .unwrap_or(u32::MAX)
}

/// Why the pool has no device of the shape: the policy leaves the profile out, or no GPU of
/// the node has it.
fn not_published(snapshot: &Snapshot, gpu_node: &GpuNode, shape: &Shape) -> String {
    let gpus = node_gpus(gpu_node);
    let policy_name = gpu_node
        .status
        .as_ref()
        .and_then(|s| s.publication.as_ref())
        .and_then(|p| p.policy.clone());
    if let Shape::Profile(profile) = shape {
        let with_profile: Vec<&GpuInventory> = gpus
            .iter()
            .filter(|g| {
                g.mig
                    .as_ref()
                    .is_some_and(|m| m.geometry.profile_by_name(profile).is_some())
            })
            .collect();
        if with_profile.is_empty() {
            return format!("no GPU of this node has a {profile} profile");
        }
        if let Some(name) = &policy_name {
            let policy = snapshot
                .policies
                .iter()
                .find(|p| p.metadata.name.as_deref() == Some(name.as_str()));
            match policy.map(|p| p.effective(Default::default())) {
                Some(Ok(effective)) if !effective.offers(profile) => {
                    return format!("MigPolicy {name} does not offer {profile}");
                }
                Some(Err(e)) => return format!("the pool publishes no {profile} device ({e})"),
                _ => {}
            }
        }
        if with_profile.iter().all(|g| !g.health.healthy) {
            return format!(
                "the pool publishes no {profile} device: every GPU with the profile is unhealthy ({})",
                with_profile
                    .iter()
                    .map(|g| format!("GPU {}", g.minor))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        return format!("the pool publishes no {profile} device");
    }
    format!("the pool publishes no {shape}")
}
