//! B1's levers (issue #30 §2): one change to migdra's pool at a time, measured against the pool
//! as the controller publishes it. A lever phase copies migdra's pools as published, applies
//! one transform ([`transform`]), and publishes the copy under [`LEVER_DRIVER`] with a copy of
//! the `1g.10gb` class whose selector names that driver; migdra's own pools are withdrawn for
//! the phase and restored after, as for the anchor (a selector pins the driver only inside
//! CEL, so pools left beside the copy would be walked too).

use std::collections::BTreeMap;

use anyhow::Context as _;
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::resource::v1::{
    CounterSet, Device, DeviceClass, DeviceCounterConsumption, ResourceSlice, ResourceSliceSpec,
};
use kube::{
    Api, Client,
    api::{ListParams, ObjectMeta, PostParams},
};

use super::publish::delete_driver_slices;

/// Driver name of the transformed copies.
pub const LEVER_DRIVER: &str = "levers.bench.migdra.dev";
/// The copy of migdra's `1g.10gb` class, selecting [`LEVER_DRIVER`]'s devices.
pub const LEVER_CLASS: &str = "1g-10gb.levers.bench.migdra.dev";

/// Devices per slice when devices consume counters, and without (Kubernetes 1.35+ limits).
const DEVICES_PER_SLICE_WITH_COUNTERS: usize = 64;
const DEVICES_PER_SLICE: usize = 128;
/// Counters per counter set (Kubernetes 1.35+ limit).
const COUNTERS_PER_SET: usize = 32;

/// The attributes the chart's DeviceClasses select on (`type`, `profile`) and those the
/// documented user selectors use (`computeSlices`, docs/claims.md).
const SELECTOR_ATTRIBUTES: [&str; 3] = ["type", "profile", "computeSlices"];
/// The capacities the documented user selectors use (`memory`), and `shares`, which the
/// allocator charges on shared devices.
const SELECTOR_CAPACITIES: [&str; 2] = ["memory", "shares"];
/// The engine capacities, which only describe a partition.
const ENGINE_CAPACITIES: [&str; 6] = [
    "multiprocessors",
    "copyEngines",
    "decoders",
    "encoders",
    "jpegEngines",
    "ofaEngines",
];

/// One change to a published pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lever {
    /// The same devices, profile by profile across the node: every device of the node's first
    /// profile (in published order), then the next profile's. Devices of one profile keep
    /// their relative order, so a request for one exact profile gets the same device as
    /// before, after fewer devices of other profiles.
    OrderByProfile,
    /// The node's counter sets merged into as few sets as the per-set counter limit allows
    /// (counters renamed `<set>-<counter>`): fewer counter sets per slice, the same counters.
    MergedCounterSets,
    /// No counters at all: the devices alone, 128 per slice. Not a candidate (overlapping
    /// placements would be allocated together): the bound of what any counter lever can gain.
    NoCounters,
    /// Only the attributes and capacities selectors use ([`SELECTOR_ATTRIBUTES`],
    /// [`SELECTOR_CAPACITIES`]).
    SelectorAttributes,
    /// Every attribute, without the engine capacities ([`ENGINE_CAPACITIES`]).
    NoEngineCapacities,
}

impl Lever {
    /// The phase's short name (run names, notes).
    pub fn name(self) -> &'static str {
        match self {
            Self::OrderByProfile => "order-by-profile",
            Self::MergedCounterSets => "merged-counter-sets",
            Self::NoCounters => "no-counters",
            Self::SelectorAttributes => "selector-attributes",
            Self::NoEngineCapacities => "no-engine-capacities",
        }
    }

    /// What the lever changes, for the note.
    pub fn describe(self) -> &'static str {
        match self {
            Self::OrderByProfile => "migdra's pool, devices ordered profile by profile across the node",
            Self::MergedCounterSets => {
                "migdra's pool, counter sets merged (4 GPUs per set, 2 sets per node instead of 8)"
            }
            Self::NoCounters => "migdra's pool without counters (a bound, not a candidate: overlaps allowed)",
            Self::SelectorAttributes => {
                "migdra's pool, only the attributes and capacities selectors use (type, profile, computeSlices; memory)"
            }
            Self::NoEngineCapacities => "migdra's pool without the six engine capacities",
        }
    }
}

/// A device's profile key for [`Lever::OrderByProfile`]: its `profile` attribute, or its
/// `type` for a whole GPU.
fn profile_key(device: &Device) -> String {
    let attribute = |name: &str| {
        device
            .attributes
            .as_ref()
            .and_then(|a| a.get(name))
            .and_then(|a| a.string.clone())
    };
    attribute("profile")
        .or_else(|| attribute("type"))
        .unwrap_or_default()
}

/// Transforms one node's pool (its slices in published order: counter slices, then device
/// slices) by `lever`, for `driver`. The result is a complete pool of its own: the slice
/// count is set on every slice and the limits of Kubernetes 1.35+ are kept.
pub fn transform(lever: Lever, driver: &str, pool: &[ResourceSliceSpec]) -> Vec<ResourceSliceSpec> {
    let Some(first) = pool.first() else {
        return Vec::new();
    };
    let mut sets: Vec<CounterSet> = pool
        .iter()
        .flat_map(|s| s.shared_counters.iter().flatten().cloned())
        .collect();
    let mut devices: Vec<Device> = pool
        .iter()
        .flat_map(|s| s.devices.iter().flatten().cloned())
        .collect();
    match lever {
        Lever::OrderByProfile => {
            let mut rank: BTreeMap<String, usize> = BTreeMap::new();
            for device in &devices {
                let next = rank.len();
                rank.entry(profile_key(device)).or_insert(next);
            }
            // Stable: devices of one profile keep their published order.
            devices.sort_by_key(|d| rank.get(&profile_key(d)).copied().unwrap_or(usize::MAX));
        }
        Lever::MergedCounterSets => {
            let per_set = sets.iter().map(|s| s.counters.len()).max().unwrap_or(1).max(1);
            let sets_per_merged = (COUNTERS_PER_SET / per_set).max(1);
            let mut merged_of: BTreeMap<String, String> = BTreeMap::new();
            let mut merged: Vec<CounterSet> = Vec::new();
            for (i, chunk) in sets.chunks(sets_per_merged).enumerate() {
                let name = format!("merged-{i}");
                let mut counters = BTreeMap::new();
                for set in chunk {
                    merged_of.insert(set.name.clone(), name.clone());
                    for (counter, value) in &set.counters {
                        counters.insert(format!("{}-{counter}", set.name), value.clone());
                    }
                }
                merged.push(CounterSet { name, counters });
            }
            for device in &mut devices {
                for consumption in device.consumes_counters.iter_mut().flatten() {
                    let set = consumption.counter_set.clone();
                    *consumption = DeviceCounterConsumption {
                        counter_set: merged_of.get(&set).cloned().unwrap_or_else(|| set.clone()),
                        counters: consumption
                            .counters
                            .iter()
                            .map(|(c, v)| (format!("{set}-{c}"), v.clone()))
                            .collect(),
                    };
                }
            }
            sets = merged;
        }
        Lever::NoCounters => {
            sets.clear();
            for device in &mut devices {
                device.consumes_counters = None;
            }
        }
        Lever::SelectorAttributes => {
            for device in &mut devices {
                if let Some(attributes) = &mut device.attributes {
                    attributes.retain(|name, _| SELECTOR_ATTRIBUTES.contains(&name.as_str()));
                }
                if let Some(capacity) = &mut device.capacity {
                    capacity.retain(|name, _| SELECTOR_CAPACITIES.contains(&name.as_str()));
                }
            }
        }
        Lever::NoEngineCapacities => {
            for device in &mut devices {
                if let Some(capacity) = &mut device.capacity {
                    capacity.retain(|name, _| !ENGINE_CAPACITIES.contains(&name.as_str()));
                }
            }
        }
    }
    let constrained = devices
        .iter()
        .any(|d| d.consumes_counters.is_some() || d.taints.is_some());
    let per_slice = if constrained {
        DEVICES_PER_SLICE_WITH_COUNTERS
    } else {
        DEVICES_PER_SLICE
    };
    let base = || ResourceSliceSpec {
        driver: driver.to_string(),
        node_name: first.node_name.clone(),
        pool: first.pool.clone(),
        ..ResourceSliceSpec::default()
    };
    let mut slices: Vec<ResourceSliceSpec> = sets
        .chunks(8)
        .map(|chunk| ResourceSliceSpec {
            shared_counters: Some(chunk.to_vec()),
            ..base()
        })
        .chain(devices.chunks(per_slice).map(|chunk| ResourceSliceSpec {
            devices: Some(chunk.to_vec()),
            ..base()
        }))
        .collect();
    let count = i64::try_from(slices.len()).unwrap_or(i64::MAX);
    for slice in &mut slices {
        slice.pool.resource_slice_count = count;
        slice.pool.generation = 1;
    }
    slices
}

/// Reads the pools of `driver` as published, each node's slices in name order (the
/// controller's published order).
async fn published_pools(client: &Client, driver: &str) -> anyhow::Result<Vec<Vec<ResourceSliceSpec>>> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let list = api
        .list(&ListParams::default().fields(&format!("spec.driver={driver}")))
        .await?;
    let mut by_pool: BTreeMap<String, Vec<(String, ResourceSliceSpec)>> = BTreeMap::new();
    for slice in list.items {
        by_pool
            .entry(slice.spec.pool.name.clone())
            .or_default()
            .push((slice.metadata.name.unwrap_or_default(), slice.spec));
    }
    Ok(by_pool
        .into_values()
        .map(|mut slices| {
            slices.sort_by(|a, b| a.0.cmp(&b.0));
            slices.into_iter().map(|(_, spec)| spec).collect()
        })
        .collect())
}

/// Copies `class` with every mention of `from` in its selectors replaced by `to`, as `name`.
async fn copy_class(client: &Client, class: &str, name: &str, from: &str, to: &str) -> anyhow::Result<()> {
    let classes: Api<DeviceClass> = Api::all(client.clone());
    let mut copy = classes
        .get(class)
        .await
        .with_context(|| format!("reading DeviceClass {class}"))?;
    copy.metadata = ObjectMeta {
        name: Some(name.to_string()),
        ..ObjectMeta::default()
    };
    for selector in copy.spec.selectors.iter_mut().flatten() {
        if let Some(cel) = &mut selector.cel {
            cel.expression = cel.expression.replace(from, to);
        }
    }
    match classes.create(&PostParams::default(), &copy).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The transformed copy of `driver`'s pools, read before they are withdrawn.
pub struct Copy {
    pools: Vec<Vec<ResourceSliceSpec>>,
}

impl Copy {
    /// Devices in the copy, all nodes together.
    pub fn devices(&self) -> usize {
        self.pools
            .iter()
            .flatten()
            .map(|s| s.devices.as_ref().map_or(0, Vec::len))
            .sum()
    }
}

/// Reads `driver`'s published pools and transforms each by `lever`; copies `class` for the
/// copy's driver.
pub async fn prepare(client: &Client, driver: &str, class: &str, lever: Lever) -> anyhow::Result<Copy> {
    copy_class(client, class, LEVER_CLASS, driver, LEVER_DRIVER).await?;
    let pools = published_pools(client, driver)
        .await?
        .iter()
        .map(|pool| transform(lever, LEVER_DRIVER, pool))
        .collect();
    Ok(Copy { pools })
}

/// Publishes the copy (one create per slice, 16 at a time).
pub async fn publish(client: &Client, copy: &Copy) -> anyhow::Result<()> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let slices: Vec<ResourceSlice> = copy
        .pools
        .iter()
        .flat_map(|pool| {
            pool.iter().enumerate().map(|(i, spec)| ResourceSlice {
                metadata: ObjectMeta {
                    name: Some(format!(
                        "{}-lever-{i}",
                        spec.node_name.as_deref().unwrap_or("pool")
                    )),
                    ..ObjectMeta::default()
                },
                spec: spec.clone(),
            })
        })
        .collect();
    stream::iter(slices)
        .map(|slice| {
            let api = api.clone();
            async move {
                match crate::retry::retry(|| async { api.create(&PostParams::default(), &slice).await }).await
                {
                    Ok(_) => Ok(()),
                    Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
                    Err(e) => Err(anyhow::Error::from(e))
                        .with_context(|| format!("publishing {:?}", slice.metadata.name)),
                }
            }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// Deletes the copy's slices.
pub async fn remove(client: &Client) -> anyhow::Result<()> {
    delete_driver_slices(client, LEVER_DRIVER).await
}

/// Where first fit landed: allocated devices per GPU minor over all nodes, from device names
/// `gpu-<minor>…` (the static anchor's too). With the published order kept across a pool's
/// slices, B1's `1g.10gb` claims fill GPU 0 of each node before GPU 1.
pub fn landing(devices: &[(String, String)]) -> String {
    let mut per_gpu: BTreeMap<u32, usize> = BTreeMap::new();
    let mut other = 0;
    for (_, device) in devices {
        let minor = device
            .strip_prefix("gpu-")
            .and_then(|rest| rest.split('-').next())
            .and_then(|m| m.parse().ok());
        match minor {
            Some(m) => *per_gpu.entry(m).or_default() += 1,
            None => other += 1,
        }
    }
    let mut parts: Vec<String> = per_gpu.iter().map(|(m, n)| format!("GPU {m}: {n}")).collect();
    if other > 0 {
        parts.push(format!("other: {other}"));
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use migdra_api::{
        catalog,
        inventory::GpuInventory,
        policy::EffectivePolicy,
        slices::{PoolIdentity, published_plan, render_pool, validate},
    };

    use super::*;

    /// `gpus` H100s' pool as the controller renders it by default.
    fn pool(gpus: u32) -> Vec<ResourceSliceSpec> {
        let model = catalog::model(crate::sim::objects::GPU_MODEL).expect("the simulated model");
        let inventory: Vec<GpuInventory> = (0..gpus).map(|m| model.inventory(m, true)).collect();
        let (plan, _) = published_plan(&inventory, &EffectivePolicy::default(), &Default::default());
        let id = PoolIdentity {
            driver: "gpu.migdra.dev",
            node: "node-a",
            pool: "node-a/gpu.migdra.dev",
            generation: 3,
            driver_version: None,
        };
        render_pool(&id, &inventory, &plan)
    }

    fn names(slices: &[ResourceSliceSpec]) -> Vec<String> {
        slices
            .iter()
            .flat_map(|s| s.devices.iter().flatten().map(|d| d.name.clone()))
            .collect()
    }

    fn profiles(slices: &[ResourceSliceSpec]) -> Vec<String> {
        slices
            .iter()
            .flat_map(|s| s.devices.iter().flatten().map(profile_key))
            .collect()
    }

    const EVERY_LEVER: [Lever; 5] = [
        Lever::OrderByProfile,
        Lever::MergedCounterSets,
        Lever::NoCounters,
        Lever::SelectorAttributes,
        Lever::NoEngineCapacities,
    ];

    #[test]
    fn every_lever_keeps_the_devices_and_a_complete_valid_pool() {
        let before = pool(8);
        let mut expected = names(&before);
        expected.sort();
        for lever in EVERY_LEVER {
            let after = transform(lever, LEVER_DRIVER, &before);
            let mut got = names(&after);
            got.sort();
            assert_eq!(got, expected, "{lever:?}");
            for slice in &after {
                assert_eq!(slice.driver, LEVER_DRIVER);
                assert_eq!(slice.pool.resource_slice_count, after.len() as i64, "{lever:?}");
            }
            let valid = validate::validate_pool(&after);
            assert!(valid.is_ok(), "{lever:?}: {valid:?}");
        }
    }

    #[test]
    fn order_by_profile_groups_profiles_and_keeps_each_profiles_order() {
        let before = pool(2);
        let after = transform(Lever::OrderByProfile, LEVER_DRIVER, &before);
        let profiles = profiles(&after);
        // Each profile is one run.
        let mut runs = profiles.clone();
        runs.dedup();
        let mut distinct = runs.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(runs.len(), distinct.len(), "{profiles:?}");
        assert_eq!(profiles.first().map(String::as_str), Some("1g.10gb"));
        // Within a profile, the published order.
        let of = |slices: &[ResourceSliceSpec], p: &str| -> Vec<String> {
            slices
                .iter()
                .flat_map(|s| s.devices.iter().flatten())
                .filter(|d| profile_key(d) == p)
                .map(|d| d.name.clone())
                .collect()
        };
        for p in &distinct {
            assert_eq!(of(&after, p), of(&before, p), "{p}");
        }
        assert_eq!(of(&after, "1g.10gb").len(), 14);
    }

    #[test]
    fn merged_counter_sets_keep_every_counter_and_consumption() {
        let before = pool(8);
        let after = transform(Lever::MergedCounterSets, LEVER_DRIVER, &before);
        let sets: Vec<&CounterSet> = after
            .iter()
            .flat_map(|s| s.shared_counters.iter().flatten())
            .collect();
        let counters = |sets: &[&CounterSet]| sets.iter().map(|s| s.counters.len()).sum::<usize>();
        let original: Vec<&CounterSet> = before
            .iter()
            .flat_map(|s| s.shared_counters.iter().flatten())
            .collect();
        assert_eq!(counters(&sets), counters(&original));
        assert!(sets.len() < original.len(), "{} sets", sets.len());
        assert!(sets.iter().all(|s| s.counters.len() <= COUNTERS_PER_SET));
        // gpu-1's 1g.10gb at 0 consumes gpu-1's first memory slice, now in a merged set.
        let device = after
            .iter()
            .flat_map(|s| s.devices.iter().flatten())
            .find(|d| d.name == "gpu-1-mig-1g10gb-0")
            .expect("device");
        let consumption = &device.consumes_counters.as_ref().expect("consumes")[0];
        assert!(consumption.counter_set.starts_with("merged-"));
        assert!(
            consumption.counters.keys().all(|k| k.starts_with("gpu-1-")),
            "{:?}",
            consumption.counters
        );
        let set = sets
            .iter()
            .find(|s| s.name == consumption.counter_set)
            .expect("set");
        assert!(consumption.counters.keys().all(|k| set.counters.contains_key(k)));
    }

    #[test]
    fn attribute_levers_keep_what_selectors_use() {
        let before = pool(1);
        let after = transform(Lever::SelectorAttributes, LEVER_DRIVER, &before);
        let device = after
            .iter()
            .flat_map(|s| s.devices.iter().flatten())
            .find(|d| d.name == "gpu-0-mig-2g20gb-0")
            .expect("device");
        let attributes: Vec<&String> = device.attributes.as_ref().expect("attributes").keys().collect();
        assert_eq!(attributes, ["computeSlices", "profile", "type"]);
        let capacity: Vec<&String> = device.capacity.as_ref().expect("capacity").keys().collect();
        assert_eq!(capacity, ["memory"]);
        let after = transform(Lever::NoEngineCapacities, LEVER_DRIVER, &before);
        let device = after
            .iter()
            .flat_map(|s| s.devices.iter().flatten())
            .find(|d| d.name == "gpu-0-mig-2g20gb-0")
            .expect("device");
        assert!(
            device
                .attributes
                .as_ref()
                .expect("attributes")
                .contains_key("productName")
        );
        let capacity: Vec<&String> = device.capacity.as_ref().expect("capacity").keys().collect();
        assert_eq!(capacity, ["memory"]);
    }

    #[test]
    fn no_counters_drops_counter_slices_and_packs_devices_128_per_slice() {
        let before = pool(8);
        let after = transform(Lever::NoCounters, LEVER_DRIVER, &before);
        assert!(after.iter().all(|s| s.shared_counters.is_none()));
        assert_eq!(after.len(), 2, "208 devices, 128 per slice");
        assert!(
            after
                .iter()
                .flat_map(|s| s.devices.iter().flatten())
                .all(|d| d.consumes_counters.is_none())
        );
    }

    #[test]
    fn each_lever_has_its_b1_phase() {
        use clap::ValueEnum as _;
        for lever in EVERY_LEVER {
            let phase =
                crate::measure::scheduling::Phase::from_str(&format!("lever-{}", lever.name()), false)
                    .expect("a phase of that name");
            assert_eq!(phase.lever(), Some(lever));
        }
        assert!(crate::measure::scheduling::Phase::from_str("lever-nothing", false).is_err());
    }

    #[test]
    fn landing_counts_claims_per_gpu_minor() {
        let devices: Vec<(String, String)> = [
            "gpu-0-mig-1g10gb-0",
            "gpu-0-mig-1g10gb-1",
            "gpu-12-mig-1g10gb-0",
            "gpu-3",
            "something-else",
        ]
        .iter()
        .map(|d| ("node-a/gpu.migdra.dev".to_string(), d.to_string()))
        .collect();
        assert_eq!(landing(&devices), "GPU 0: 2, GPU 3: 1, GPU 12: 1, other: 1");
        assert_eq!(landing(&[]), "");
    }

    #[test]
    fn an_empty_pool_stays_empty() {
        assert!(transform(Lever::NoCounters, LEVER_DRIVER, &[]).is_empty());
    }
}
