//! Counters that can never refuse an allocation are left out of the published pool, because
//! the scheduler checks every counter of every device on every fit check. On an H100, no set of
//! placements the memory-slice counters allow exceeds the SM, copy-engine, decoder, JPEG or
//! memory budgets; only the optical-flow engine (one `+me` instance at a time) adds a rule.
//!
//! A counter is dropped only when it is *redundant*: the largest amount of it that any device
//! set accepted by the counters kept so far could consume is within its budget (an exact
//! search, not an estimate). So the scheduler allows exactly the same co-allocations as with
//! the full set. Counter sets are charged per device (a shared device once), which is the set
//! semantics the search uses.
//!
//! Counters are decided smallest budget first, then by name with numbers compared as numbers,
//! so the memory slices, which carry the placement rules, are kept first and the budgets they
//! imply are dropped. Identical GPUs of a node are decided once.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::{Counters, PoolPlan};

/// What [`prune_counters`] left out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pruned {
    /// Counters dropped from all sets together.
    pub counters: usize,
    /// Entries dropped from all devices' consumption together.
    pub consumptions: usize,
}

/// Drops every counter of `plan` that cannot refuse any device set the remaining counters
/// accept (see the module documentation), except those named in `keep`, which something other
/// than the scheduler reads (a quota charging claims by GPU memory). A kept redundant counter
/// refuses nothing the others accept, so keeping it changes no co-allocation. A device left
/// consuming nothing publishes no consumption, and a set left with no counter is removed.
pub fn prune_counters(plan: &mut PoolPlan, keep: &[&str]) -> Pruned {
    let mut decided: HashMap<Signature, BTreeSet<String>> = HashMap::new();
    let mut pruned = Pruned::default();
    let mut kept_by_set: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (set, counters) in &plan.counter_sets {
        let consumers: Vec<&Counters> = plan
            .devices
            .iter()
            .filter(|d| d.counter_set.as_deref() == Some(set.as_str()))
            .map(|d| &d.consumes)
            .collect();
        let signature = Signature::of(counters, &consumers);
        let mut kept = decided
            .entry(signature)
            .or_insert_with(|| necessary_counters(counters, &consumers))
            .clone();
        kept.extend(
            keep.iter()
                .filter(|name| counters.contains_key(**name))
                .map(|name| (*name).to_string()),
        );
        kept_by_set.insert(set.clone(), kept);
    }
    for (set, counters) in &mut plan.counter_sets {
        if let Some(kept) = kept_by_set.get(set.as_str()) {
            let before = counters.len();
            counters.retain(|name, _| kept.contains(name));
            pruned.counters += before - counters.len();
        }
    }
    plan.counter_sets.retain(|(_, counters)| !counters.is_empty());
    for device in &mut plan.devices {
        let Some(kept) = device.counter_set.as_ref().and_then(|set| kept_by_set.get(set)) else {
            continue;
        };
        let before = device.consumes.len();
        device.consumes.retain(|name, _| kept.contains(name));
        pruned.consumptions += before - device.consumes.len();
        if device.consumes.is_empty() {
            device.counter_set = None;
        }
    }
    pruned
}

/// A counter set and what its devices consume, independent of names of sets and devices and
/// of device order: GPUs with equal signatures keep the same counters.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Signature {
    budget: Vec<(String, u64)>,
    consumers: Vec<Vec<(String, u64)>>,
}

impl Signature {
    fn of(counters: &Counters, consumers: &[&Counters]) -> Self {
        let mut consumers: Vec<Vec<(String, u64)>> = consumers
            .iter()
            .map(|c| c.iter().map(|(k, v)| (k.clone(), *v)).collect())
            .collect();
        consumers.sort();
        Self {
            budget: counters.iter().map(|(k, v)| (k.clone(), *v)).collect(),
            consumers,
        }
    }
}

/// Orders counter names with embedded numbers compared as numbers (`memory-slice-2` before
/// `memory-slice-10`).
fn natural_key(name: &str) -> (String, u64) {
    let digits = name.len() - name.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    let (stem, number) = name.split_at(name.len() - digits);
    (stem.to_string(), number.parse().unwrap_or(0))
}

/// The counters of one set that must be kept, given what its devices consume.
fn necessary_counters(counters: &Counters, consumers: &[&Counters]) -> BTreeSet<String> {
    let mut order: Vec<&String> = counters.keys().collect();
    order.sort_by_key(|name| (counters[*name], natural_key(name)));
    let index: BTreeMap<&str, usize> = order.iter().enumerate().map(|(i, n)| (n.as_str(), i)).collect();
    let budget: Vec<u64> = order.iter().map(|n| counters[*n]).collect();
    // Dense consumption vectors, ordered by the first counter each device consumes, so that
    // devices that compete for the same memory slices are next to each other in the search.
    let mut devices: Vec<Vec<u64>> = consumers
        .iter()
        .map(|c| {
            let mut dense = vec![0; order.len()];
            for (name, value) in c.iter() {
                if let Some(i) = index.get(name.as_str()) {
                    dense[*i] = *value;
                }
            }
            dense
        })
        .collect();
    devices.sort_by_key(|d| (d.iter().position(|v| *v > 0).unwrap_or(usize::MAX), d.clone()));

    let mut kept: Vec<usize> = Vec::new();
    for candidate in 0..order.len() {
        let total: u64 = devices.iter().map(|d| d[candidate]).fold(0, u64::saturating_add);
        if total <= budget[candidate] {
            continue; // even every device together fits
        }
        let most = MaxSearch::new(&devices, &budget, &kept, candidate).run();
        if most > budget[candidate] {
            kept.push(candidate);
        }
    }
    kept.into_iter().map(|i| order[i].clone()).collect()
}

/// The largest amount of counter `target` a device set can consume while every counter in
/// `kept` stays within its budget: a depth-first search over the devices (take or skip each),
/// memoized on the device position and what is left of the kept counters that later devices
/// still consume.
struct MaxSearch<'a> {
    devices: &'a [Vec<u64>],
    budget: &'a [u64],
    kept: &'a [usize],
    target: usize,
    /// For each position, which kept counters (by position in `kept`) any device from there on
    /// consumes: the rest cannot matter any more and is left out of the memo key.
    relevant: Vec<Vec<bool>>,
    memo: HashMap<(usize, Vec<u64>), u64>,
}

impl<'a> MaxSearch<'a> {
    fn new(devices: &'a [Vec<u64>], budget: &'a [u64], kept: &'a [usize], target: usize) -> Self {
        let mut relevant = vec![vec![false; kept.len()]; devices.len() + 1];
        for i in (0..devices.len()).rev() {
            for (k, counter) in kept.iter().enumerate() {
                relevant[i][k] = relevant[i + 1][k] || devices[i][*counter] > 0;
            }
        }
        Self {
            devices,
            budget,
            kept,
            target,
            relevant,
            memo: HashMap::new(),
        }
    }

    fn run(mut self) -> u64 {
        let left: Vec<u64> = self.kept.iter().map(|k| self.budget[*k]).collect();
        self.best(0, left)
    }

    fn best(&mut self, at: usize, mut left: Vec<u64>) -> u64 {
        if at == self.devices.len() {
            return 0;
        }
        for (k, value) in left.iter_mut().enumerate() {
            if !self.relevant[at][k] {
                *value = 0;
            }
        }
        if let Some(known) = self.memo.get(&(at, left.clone())) {
            return *known;
        }
        let device = &self.devices[at];
        let skip = self.best(at + 1, left.clone());
        let fits = self
            .kept
            .iter()
            .zip(&left)
            .all(|(counter, have)| device[*counter] <= *have);
        let take = if fits {
            let rest: Vec<u64> = self
                .kept
                .iter()
                .zip(&left)
                .map(|(counter, have)| have - device[*counter])
                .collect();
            device[self.target].saturating_add(self.best(at + 1, rest))
        } else {
            0
        };
        let most = skip.max(take);
        self.memo.insert((at, left), most);
        most
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;
    use crate::{
        catalog,
        geometry::Placement,
        inventory::{GpuInventory, InstanceOwner, MigInstance},
        policy::{EffectivePolicy, ProfileMatcher},
        slices::{
            MEMORY_COUNTER, PlannedKind,
            allocator::Allocator,
            plan_pool, published_plan, render_pool,
            retained::retain_allocated,
            test_pool_identity,
            validate::{PoolError, validate_pool},
        },
    };

    /// Every device set the pool's counters accept (each device once: counters are charged per
    /// device), by depth-first search.
    fn accepted_sets(plan: &PoolPlan) -> BTreeSet<Vec<usize>> {
        fn dfs(
            alloc: &Allocator<'_>,
            from: usize,
            devices: usize,
            current: &mut Vec<usize>,
            out: &mut BTreeSet<Vec<usize>>,
        ) {
            out.insert(current.clone());
            for i in from..devices {
                if alloc.fits(i) {
                    let mut next = alloc.clone();
                    next.take(i);
                    current.push(i);
                    dfs(&next, i + 1, devices, current, out);
                    current.pop();
                }
            }
        }
        let mut out = BTreeSet::new();
        dfs(
            &Allocator::new(plan),
            0,
            plan.devices.len(),
            &mut Vec::new(),
            &mut out,
        );
        out
    }

    /// What the pool validator says of `plan` rendered for node-a.
    fn validation(gpus: &[GpuInventory], plan: &PoolPlan) -> Result<(), Vec<PoolError>> {
        validate_pool(&render_pool(&test_pool_identity(), gpus, plan))
    }

    fn counter_names(plan: &PoolPlan) -> BTreeSet<String> {
        plan.counter_sets
            .iter()
            .flat_map(|(_, c)| c.keys().cloned())
            .collect()
    }

    fn assert_same_sets(full: &PoolPlan, pruned: &PoolPlan, what: &str) {
        let before = accepted_sets(full);
        let after = accepted_sets(pruned);
        let names = |set: &Vec<usize>| -> Vec<String> {
            set.iter().map(|i| full.devices[*i].name.to_string()).collect()
        };
        if let Some(set) = after.difference(&before).next() {
            panic!(
                "{what}: the pruned counters accept {:?}, the full ones refuse it",
                names(set)
            );
        }
        if let Some(set) = before.difference(&after).next() {
            panic!(
                "{what}: the full counters accept {:?}, the pruned ones refuse it",
                names(set)
            );
        }
    }

    #[test]
    fn every_model_keeps_exactly_the_device_sets_it_accepted() {
        for model in catalog::models() {
            let gpus = vec![model.inventory(0, true)];
            let full = plan_pool(&gpus, &EffectivePolicy::default());
            let mut pruned = full.clone();
            let dropped = prune_counters(&mut pruned, &[]);
            assert_same_sets(&full, &pruned, model.key);
            assert_eq!(full.devices.len(), pruned.devices.len(), "{}", model.key);
            assert!(
                dropped.counters > 0,
                "{}: nothing was redundant among {:?}",
                model.key,
                counter_names(&full)
            );
        }
    }

    #[test]
    fn an_h100_keeps_its_placement_rules_and_the_single_optical_flow_engine() {
        let model = catalog::model("H100-80GB").expect("H100 in the catalog");
        let gpus: Vec<GpuInventory> = (0..8).map(|m| model.inventory(m, true)).collect();
        let mut plan = plan_pool(&gpus, &EffectivePolicy::default());
        let full_entries: usize = plan.devices.iter().map(|d| d.consumes.len()).sum();
        let dropped = prune_counters(&mut plan, &[]);
        let expected: BTreeSet<String> = (0..7)
            .map(|s| format!("memory-slice-{s}"))
            .chain(["ofa-engines".to_string()])
            .collect();
        for (set, counters) in &plan.counter_sets {
            let kept: BTreeSet<String> = counters.keys().cloned().collect();
            assert_eq!(kept, expected, "{set}");
        }
        assert_eq!(plan.counter_sets.len(), 8);
        let entries: usize = plan.devices.iter().map(|d| d.consumes.len()).sum();
        assert_eq!(entries + dropped.consumptions, full_entries);
        // A 1g.10gb consumes its one memory slice and nothing else.
        let one_g = plan
            .devices
            .iter()
            .find(|d| d.name.to_string() == "gpu-3-mig-1g10gb-2")
            .expect("1g.10gb at 2");
        assert_eq!(
            one_g.consumes,
            Counters::from([("memory-slice-2".to_string(), 1)])
        );
    }

    #[test]
    fn a_set_whose_counters_never_refuse_anything_is_removed_with_the_consumption() {
        // One device on its own can never be refused by its set.
        let model = catalog::model("H100-80GB").expect("H100 in the catalog");
        let gpus = vec![model.inventory(0, true)];
        let policy = EffectivePolicy {
            profiles: vec![ProfileMatcher::parse("7g.80gb").expect("matcher")],
            whole_gpus: false,
            ..EffectivePolicy::default()
        };
        let mut plan = plan_pool(&gpus, &policy);
        assert_eq!(plan.devices.len(), 1);
        prune_counters(&mut plan, &[]);
        assert!(plan.counter_sets.is_empty());
        assert_eq!(plan.devices[0].counter_set, None);
        assert!(plan.devices[0].consumes.is_empty());
        assert_eq!(validation(&gpus, &plan), Ok(()));
    }

    #[test]
    fn names_with_numbers_sort_as_numbers() {
        let mut names = vec!["memory-slice-10", "memory-slice-2", "memory", "memory-slice-1"];
        names.sort_by_key(|n| natural_key(n));
        assert_eq!(
            names,
            ["memory", "memory-slice-1", "memory-slice-2", "memory-slice-10"]
        );
    }

    /// A one-GPU pool from the property tests' inputs: the model, foreign instances, the
    /// offered and shared profiles, whole GPUs, and devices claims hold (kept even when not
    /// offered), before any pruning.
    fn arbitrary_pool(
        model: usize,
        foreign: &[usize],
        offered: &[bool],
        shared: &[bool],
        whole: bool,
        held: &[usize],
    ) -> (&'static str, Vec<GpuInventory>, PoolPlan) {
        let models = catalog::models();
        let model = &models[model % models.len()];
        let geometry = model.geometry();
        let placements: Vec<_> = geometry.all_placements().collect();
        let mut gpu = model.inventory(0, true);
        let mut blocked = BTreeSet::new();
        for f in foreign {
            let (profile, start) = placements[f % placements.len()];
            let range: BTreeSet<u32> = profile.memory_range(start).collect();
            if !range.is_disjoint(&blocked) {
                continue;
            }
            blocked.extend(range);
            if let Some(mig) = gpu.mig.as_mut() {
                let id = u32::try_from(mig.instances.len()).unwrap_or(0) + 1;
                mig.instances.push(MigInstance {
                    profile: Some(profile.name),
                    placement: Placement {
                        profile_id: profile.gi_profile_id,
                        start,
                    },
                    gpu_instance_id: id,
                    owner: InstanceOwner::Foreign,
                    ..MigInstance::default()
                });
            }
        }
        let mut names: Vec<String> = geometry.profiles.iter().map(|p| p.name.to_string()).collect();
        names.sort();
        names.dedup();
        let pick = |flags: &[bool]| -> Vec<ProfileMatcher> {
            names
                .iter()
                .zip(flags.iter().cycle())
                .filter(|(_, on)| **on)
                .filter_map(|(n, _)| ProfileMatcher::parse(n).ok())
                .collect()
        };
        let mut profiles = pick(offered);
        if profiles.is_empty() {
            profiles = pick(&[true]);
        }
        let policy = EffectivePolicy {
            profiles,
            shared_profiles: pick(shared),
            whole_gpus: whole,
            ..EffectivePolicy::default()
        };
        let gpus = vec![gpu];
        let mut full = plan_pool(&gpus, &policy);
        // Claims may hold placements the policy does not offer (they stay, tainted).
        let held: BTreeSet<String> = held
            .iter()
            .map(|h| {
                let (profile, start) = placements[h % placements.len()];
                crate::device_name::DeviceName::Mig {
                    minor: 0,
                    profile: profile.name,
                    start,
                }
                .to_string()
            })
            .collect();
        retain_allocated(&mut full, &gpus, &held);
        (model.key, gpus, full)
    }

    #[test]
    fn an_h100_keeping_memory_publishes_each_devices_memory_and_the_gpus_budget() {
        let model = catalog::model("H100-80GB").expect("H100 in the catalog");
        let gpus: Vec<GpuInventory> = (0..2).map(|m| model.inventory(m, true)).collect();
        let full = plan_pool(&gpus, &EffectivePolicy::default());
        let mut plan = full.clone();
        prune_counters(&mut plan, &[MEMORY_COUNTER]);
        let budget = model.geometry().budget.memory_mib;
        for (set, counters) in &plan.counter_sets {
            assert_eq!(counters.get(MEMORY_COUNTER), Some(&budget), "{set}");
        }
        for device in &plan.devices {
            let expected = match &device.kind {
                PlannedKind::Mig { profile, .. } => profile.memory_mib,
                PlannedKind::Gpu => budget,
            };
            assert_eq!(
                device.consumes.get(MEMORY_COUNTER),
                Some(&expected),
                "{}",
                device.name
            );
        }
        // Everything else is pruned as without the memory counter.
        let mut without = full.clone();
        prune_counters(&mut without, &[]);
        for ((_, with), (_, bare)) in plan.counter_sets.iter().zip(&without.counter_sets) {
            let mut with = with.clone();
            with.remove(MEMORY_COUNTER);
            assert_eq!(&with, bare);
        }
    }

    #[test]
    fn keeping_a_counter_the_pool_does_not_have_adds_nothing() {
        let model = catalog::model("A100-SXM4-40GB").expect("A100 in the catalog");
        let gpus = vec![model.inventory(0, true)];
        let full = plan_pool(&gpus, &EffectivePolicy::default());
        let mut kept = full.clone();
        prune_counters(&mut kept, &["no-such-counter"]);
        let mut bare = full;
        prune_counters(&mut bare, &[]);
        assert_eq!(kept, bare);
    }

    #[test]
    fn published_plan_keeps_memory_only_when_the_policy_asks() {
        let model = catalog::model("H100-80GB").expect("H100 in the catalog");
        let gpus = vec![model.inventory(0, true)];
        let has_memory = |plan: &PoolPlan| counter_names(plan).contains(MEMORY_COUNTER);
        let (plan, _) = published_plan(&gpus, &EffectivePolicy::default(), &BTreeSet::new());
        assert!(!has_memory(&plan));
        let keeping = EffectivePolicy {
            keep_memory_counter: true,
            ..EffectivePolicy::default()
        };
        let (plan, _) = published_plan(&gpus, &keeping, &BTreeSet::new());
        assert!(has_memory(&plan));
        assert_eq!(validation(&gpus, &plan), Ok(()));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Whatever the model, the foreign instances, the offered and shared profiles and the
        /// devices kept for claims: the pruned pool accepts exactly the device sets the full
        /// one accepted, and renders valid.
        #[test]
        fn pruning_never_changes_what_the_scheduler_may_co_allocate(
            model in 0usize..64,
            foreign in proptest::collection::vec(0usize..64, 0..3),
            offered in proptest::collection::vec(any::<bool>(), 8),
            shared in proptest::collection::vec(any::<bool>(), 8),
            whole in any::<bool>(),
            held in proptest::collection::vec(0usize..64, 0..3),
        ) {
            let (key, gpus, full) = arbitrary_pool(model, &foreign, &offered, &shared, whole, &held);
            let mut pruned = full.clone();
            prune_counters(&mut pruned, &[]);
            assert_same_sets(&full, &pruned, key);
            prop_assert_eq!(validation(&gpus, &pruned), Ok(()));
        }

        /// The same pools with `memory` kept for a quota: exactly the device sets the full pool
        /// and the pool pruned without it accept, valid, and every device that consumed memory
        /// still consumes the same amount from a set that still holds the same budget.
        #[test]
        fn keeping_memory_never_changes_what_the_scheduler_may_co_allocate(
            model in 0usize..64,
            foreign in proptest::collection::vec(0usize..64, 0..3),
            offered in proptest::collection::vec(any::<bool>(), 8),
            shared in proptest::collection::vec(any::<bool>(), 8),
            whole in any::<bool>(),
            held in proptest::collection::vec(0usize..64, 0..3),
        ) {
            let (key, gpus, full) = arbitrary_pool(model, &foreign, &offered, &shared, whole, &held);
            let mut kept = full.clone();
            prune_counters(&mut kept, &[MEMORY_COUNTER]);
            let mut pruned = full.clone();
            prune_counters(&mut pruned, &[]);
            assert_same_sets(&full, &kept, key);
            assert_same_sets(&pruned, &kept, key);
            prop_assert_eq!(validation(&gpus, &kept), Ok(()));
            for (before, after) in full.devices.iter().zip(&kept.devices) {
                prop_assert_eq!(
                    before.consumes.get(MEMORY_COUNTER),
                    after.consumes.get(MEMORY_COUNTER),
                    "{}", before.name
                );
            }
            for (set, counters) in &full.counter_sets {
                let budget = kept.counter_sets.iter().find(|(s, _)| s == set).and_then(|(_, c)| c.get(MEMORY_COUNTER));
                prop_assert_eq!(budget, counters.get(MEMORY_COUNTER), "{}", set);
            }
        }
    }
}
