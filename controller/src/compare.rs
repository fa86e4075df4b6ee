//! The pure diff between the slices a pool should have and the slices it has.
//!
//! The controller caches only its slices' *metadata* (every pool's specs would take gigabytes
//! on a large cluster). Every slice it writes carries [`SPEC_HASH_ANNOTATION`], the hash of
//! the canonical spec it wrote, and [`GENERATION_ANNOTATION`], the pool generation. A desired
//! slice is unchanged when the cached slice of its name at the pool's generation carries its
//! hash; a slice without them counts as new, so the pool is rewritten at a new generation. (A
//! spec edited by hand goes unnoticed until the pool changes: the controller is the only
//! writer.)
//!
//! The canonical form ([`normalize_spec`]) makes semantically equal specs hash alike
//! ([`spec_hash`]), so a written slice is checked against the API server's answer by hash:
//! `pool.generation` and a device taint's `timeAdded` (the API server fills it in) are
//! ignored; absent and empty lists and maps are equal, and absent and `false` booleans;
//! quantities compare by value (`40960Mi` comes back as `40Gi`, `1000` as `1k`).
//!
//! The metadata the controller sets (node label, Node owner reference) must be present;
//! anything others add is ignored. Generation bumps follow the upstream slice controller
//! (see [`diff_pool`]).

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use k8s_openapi::{
    api::resource::v1::{
        Counter, CounterSet, Device, DeviceCapacity, DeviceCounterConsumption, DeviceTaint, ResourceSlice,
        ResourceSliceSpec,
    },
    apimachinery::pkg::{api::resource::Quantity, apis::meta::v1::Time},
};
use kube::{ResourceExt, core::PartialObjectMeta};
use migdra_api::slices::quantity;
use sha2::{Digest, Sha256};

/// What the controller caches of a slice.
pub type SliceMeta = PartialObjectMeta<ResourceSlice>;

/// Annotation on every written slice: the hash of its canonical spec ([`spec_hash`]).
pub const SPEC_HASH_ANNOTATION: &str = "gpu.migdra.dev/spec-hash";

/// Annotation on every written slice: its `spec.pool.generation`.
pub const GENERATION_ANNOTATION: &str = "gpu.migdra.dev/pool-generation";

/// The hash of `spec`'s canonical form ([`normalize_spec`]): 128 bits of SHA-256 over its
/// JSON (struct fields in declaration order, maps sorted), in hex.
pub fn spec_hash(spec: &ResourceSliceSpec) -> String {
    let json = serde_json::to_vec(&normalize_spec(spec)).unwrap_or_default();
    hex::encode(&Sha256::digest(&json)[..16])
}

/// The pool generation a cached slice was written with, if the controller wrote it.
pub fn cached_generation(slice: &SliceMeta) -> Option<i64> {
    slice
        .annotations()
        .get(GENERATION_ANNOTATION)
        .and_then(|g| g.parse().ok())
}

fn cached_hash(slice: &SliceMeta) -> Option<&str> {
    slice.annotations().get(SPEC_HASH_ANNOTATION).map(String::as_str)
}

/// One write of the pool.
#[derive(Clone, Debug, PartialEq)]
pub enum SliceWrite {
    Create(ResourceSlice),
    /// Carries the `resourceVersion` it was read at, so a concurrent change fails with a
    /// conflict instead of being overwritten.
    Replace(ResourceSlice),
}

/// One slice to delete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceDelete {
    pub name: String,
    /// UID it was read with (a precondition of the delete).
    pub uid: Option<String>,
}

/// What it takes to turn the current slices into the desired ones.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PoolDiff {
    /// The pool's generation after the writes (the current one when it is kept).
    pub generation: i64,
    /// Slices to create or replace, in pool order, all at `generation`.
    pub writes: Vec<SliceWrite>,
    /// Slices to delete.
    pub deletes: Vec<SliceDelete>,
    /// Delete before writing. With a new generation the writes go first, so it is complete before
    /// the old one disappears; a kept generation deletes obsolete slices first (as upstream does),
    /// so the one rewritten slice never sits next to leftovers of its generation.
    pub deletes_first: bool,
}

impl PoolDiff {
    pub fn is_empty(&self) -> bool {
        self.writes.is_empty() && self.deletes.is_empty()
    }
}

/// Compares `desired` (in pool order, generation not yet set) with the cached metadata of the
/// `current` slices and plans the writes, bumping the generation exactly when the upstream
/// ResourceSlice controller (`k8s.io/dynamic-resource-allocation/resourceslice`) would:
///
/// * slices below the highest current generation, or with names the pool no longer has,
///   are obsolete and deleted, which alone bumps nothing;
/// * a desired slice without an (annotated) current one at the highest generation is new;
/// * when nothing is new and at most one slice's hash changed, the generation is kept and
///   only that slice is rewritten (one update is atomic: the scheduler never sees a mix);
///   otherwise the generation goes one above both the highest current one and
///   `published_generation` (from the GpuNode status, which outlives withdrawn slices), and
///   every desired slice is written with it.
///
/// A slice whose spec matches but lacks controller-set metadata is rewritten without
/// counting as a change (the scheduler does not read metadata). Every write carries both
/// annotations. Device taint times are not in the cache: see [`keep_taint_times`].
pub fn diff_pool(
    desired: Vec<ResourceSlice>,
    current: &[Arc<SliceMeta>],
    published_generation: Option<i64>,
) -> PoolDiff {
    let by_name: BTreeMap<String, &SliceMeta> = current.iter().map(|s| (s.name_any(), s.as_ref())).collect();
    let current_generation = current
        .iter()
        .filter_map(|s| cached_generation(s))
        .max()
        .unwrap_or(0);
    let desired_names: BTreeSet<String> = desired.iter().map(|s| s.name_any()).collect();

    let mut new = 0usize;
    let mut spec_changed = BTreeSet::new();
    let mut metadata_changed = BTreeSet::new();
    let mut hashes = Vec::with_capacity(desired.len());
    for want in &desired {
        let name = want.name_any();
        let hash = spec_hash(&want.spec);
        match by_name.get(&name) {
            Some(have) if cached_generation(have) == Some(current_generation) => {
                if cached_hash(have) != Some(hash.as_str()) {
                    spec_changed.insert(name);
                } else if !metadata_matches(want, have) {
                    metadata_changed.insert(name);
                }
            }
            _ => new += 1,
        }
        hashes.push(hash);
    }
    let deletes: Vec<SliceDelete> = by_name
        .iter()
        .filter(|(name, _)| !desired_names.contains(*name))
        .map(|(name, have)| SliceDelete {
            name: name.clone(),
            uid: have.metadata.uid.clone(),
        })
        .collect();

    let keep = new == 0 && spec_changed.len() <= 1;
    let generation = if keep {
        current_generation
    } else {
        current_generation.max(published_generation.unwrap_or(0)) + 1
    };
    let writes = desired
        .into_iter()
        .zip(hashes)
        .filter(|(slice, _)| {
            let name = slice.name_any();
            !keep || spec_changed.contains(&name) || metadata_changed.contains(&name)
        })
        .map(|(mut slice, hash)| {
            slice.spec.pool.generation = generation;
            let annotations = slice.metadata.annotations.get_or_insert_default();
            annotations.insert(SPEC_HASH_ANNOTATION.to_string(), hash);
            annotations.insert(GENERATION_ANNOTATION.to_string(), generation.to_string());
            match by_name.get(&slice.name_any()) {
                Some(have) => {
                    slice.metadata.resource_version = have.metadata.resource_version.clone();
                    SliceWrite::Replace(slice)
                }
                None => {
                    slice.metadata.resource_version = None;
                    SliceWrite::Create(slice)
                }
            }
        })
        .collect();
    PoolDiff {
        generation,
        writes,
        deletes,
        deletes_first: keep,
    }
}

/// A taint's identity on a device: (device name, key, value, effect).
type TaintKey = (String, String, Option<String>, String);

/// The names of the slices `diff` replaces with at least one device taint: the slices whose
/// live versions [`keep_taint_times`] needs.
pub fn tainted_replacements(diff: &PoolDiff) -> Vec<String> {
    diff.writes
        .iter()
        .filter_map(|w| match w {
            SliceWrite::Replace(s) if has_taints(s) => Some(s.name_any()),
            _ => None,
        })
        .collect()
}

fn has_taints(slice: &ResourceSlice) -> bool {
    slice
        .spec
        .devices
        .iter()
        .flatten()
        .any(|d| d.taints.as_ref().is_some_and(|t| !t.is_empty()))
}

/// Gives every written taint without a `timeAdded` the one the same taint (key, value,
/// effect) on the same device has in `live` (the current slices, read from the API server),
/// so a rewrite does not make an old taint look new.
pub fn keep_taint_times(diff: &mut PoolDiff, live: &[ResourceSlice]) {
    let mut times: BTreeMap<TaintKey, Time> = BTreeMap::new();
    for device in live.iter().flat_map(|s| s.spec.devices.iter().flatten()) {
        for taint in device.taints.iter().flatten() {
            if let Some(time) = &taint.time_added {
                times
                    .entry(taint_key(&device.name, taint))
                    .or_insert_with(|| time.clone());
            }
        }
    }
    if times.is_empty() {
        return;
    }
    for write in &mut diff.writes {
        let (SliceWrite::Create(slice) | SliceWrite::Replace(slice)) = write;
        for device in slice.spec.devices.iter_mut().flatten() {
            let name = device.name.clone();
            for taint in device.taints.iter_mut().flatten() {
                if taint.time_added.is_none() {
                    taint.time_added = times.get(&taint_key(&name, taint)).cloned();
                }
            }
        }
    }
}

fn taint_key(device: &str, taint: &DeviceTaint) -> TaintKey {
    (
        device.to_string(),
        taint.key.clone(),
        taint.value.clone().filter(|v| !v.is_empty()),
        taint.effect.clone(),
    )
}

fn metadata_matches(want: &ResourceSlice, have: &SliceMeta) -> bool {
    let labels = have.labels();
    let labels_ok = want.labels().iter().all(|(k, v)| labels.get(k) == Some(v));
    let owners = have.owner_references();
    let owners_ok = want.owner_references().iter().all(|w| {
        owners.iter().any(|h| {
            h.uid == w.uid
                && h.kind == w.kind
                && h.name == w.name
                && h.api_version == w.api_version
                && h.controller.unwrap_or(false) == w.controller.unwrap_or(false)
        })
    });
    labels_ok && owners_ok
}

/// The canonical form of a spec for comparison: generation zeroed, empty collections and
/// `false` booleans dropped, quantities in base units, taint times dropped.
pub fn normalize_spec(spec: &ResourceSliceSpec) -> ResourceSliceSpec {
    ResourceSliceSpec {
        driver: spec.driver.clone(),
        node_name: spec.node_name.clone().filter(|n| !n.is_empty()),
        node_selector: spec.node_selector.clone(),
        all_nodes: true_only(spec.all_nodes),
        per_device_node_selection: true_only(spec.per_device_node_selection),
        pool: {
            let mut pool = spec.pool.clone();
            pool.generation = 0;
            pool
        },
        devices: non_empty(&spec.devices).map(|devices| devices.iter().map(normalize_device).collect()),
        shared_counters: non_empty(&spec.shared_counters).map(|sets| {
            sets.iter()
                .map(|set| CounterSet {
                    name: set.name.clone(),
                    counters: normalize_counters(&set.counters),
                })
                .collect()
        }),
    }
}

fn normalize_device(device: &Device) -> Device {
    Device {
        name: device.name.clone(),
        all_nodes: true_only(device.all_nodes),
        allow_multiple_allocations: true_only(device.allow_multiple_allocations),
        attributes: device.attributes.clone().filter(|a| !a.is_empty()),
        binding_conditions: non_empty(&device.binding_conditions).cloned(),
        binding_failure_conditions: non_empty(&device.binding_failure_conditions).cloned(),
        binds_to_node: true_only(device.binds_to_node),
        capacity: device
            .capacity
            .as_ref()
            .filter(|c| !c.is_empty())
            .map(|capacity| {
                let normalize = |cap: &DeviceCapacity| DeviceCapacity {
                    value: normalize_quantity(&cap.value),
                    request_policy: cap.request_policy.clone(),
                };
                capacity
                    .iter()
                    .map(|(name, cap)| (name.clone(), normalize(cap)))
                    .collect()
            }),
        consumes_counters: non_empty(&device.consumes_counters).map(|consumptions| {
            consumptions
                .iter()
                .map(|c| DeviceCounterConsumption {
                    counter_set: c.counter_set.clone(),
                    counters: normalize_counters(&c.counters),
                })
                .collect()
        }),
        node_name: device.node_name.clone().filter(|n| !n.is_empty()),
        node_selector: device.node_selector.clone(),
        taints: non_empty(&device.taints).map(|taints| {
            taints
                .iter()
                .map(|t| DeviceTaint {
                    effect: t.effect.clone(),
                    key: t.key.clone(),
                    time_added: None,
                    value: t.value.clone().filter(|v| !v.is_empty()),
                })
                .collect()
        }),
    }
}

fn normalize_counters(counters: &BTreeMap<String, Counter>) -> BTreeMap<String, Counter> {
    let normalize = |c: &Counter| Counter {
        value: normalize_quantity(&c.value),
    };
    counters
        .iter()
        .map(|(name, c)| (name.clone(), normalize(c)))
        .collect()
}

/// An integer quantity in base units (`40Gi` and `40960Mi` both become `42949672960`);
/// anything else unchanged.
pub fn normalize_quantity(q: &Quantity) -> Quantity {
    match quantity::parse(q.0.trim()) {
        Some(value) => Quantity(value.to_string()),
        None => q.clone(),
    }
}

fn true_only(b: Option<bool>) -> Option<bool> {
    b.filter(|b| *b)
}

fn non_empty<T>(v: &Option<Vec<T>>) -> Option<&Vec<T>> {
    v.as_ref().filter(|v| !v.is_empty())
}

#[cfg(test)]
mod tests {
    use k8s_openapi::{
        api::resource::v1::{DeviceAttribute, ResourcePool},
        apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time},
        jiff::Timestamp,
    };

    use super::*;

    impl SliceWrite {
        fn slice(&self) -> &ResourceSlice {
            let (Self::Create(s) | Self::Replace(s)) = self;
            s
        }
    }

    fn slice(name: &str, generation: i64, devices: Vec<Device>) -> ResourceSlice {
        ResourceSlice {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some([("gpu.migdra.dev/node".to_string(), "n".to_string())].into()),
                owner_references: Some(vec![OwnerReference {
                    api_version: "v1".into(),
                    kind: "Node".into(),
                    name: "n".into(),
                    uid: "uid-n".into(),
                    controller: Some(true),
                    ..Default::default()
                }]),
                ..Default::default()
            },
            spec: ResourceSliceSpec {
                driver: "gpu.migdra.dev".into(),
                node_name: Some("n".into()),
                pool: ResourcePool {
                    name: "n/gpu.migdra.dev".into(),
                    generation,
                    resource_slice_count: 2,
                },
                devices: Some(devices),
                ..Default::default()
            },
        }
    }

    fn device(memory: &str, taint: bool) -> Device {
        Device {
            name: "gpu-0".into(),
            attributes: Some(
                [(
                    "type".to_string(),
                    DeviceAttribute {
                        string: Some("gpu".into()),
                        ..Default::default()
                    },
                )]
                .into(),
            ),
            capacity: Some(
                [(
                    "memory".to_string(),
                    DeviceCapacity {
                        value: Quantity(memory.into()),
                        request_policy: None,
                    },
                )]
                .into(),
            ),
            taints: taint.then(|| {
                vec![DeviceTaint {
                    key: "gpu.migdra.dev/unhealthy".into(),
                    effect: "NoSchedule".into(),
                    ..Default::default()
                }]
            }),
            ..Default::default()
        }
    }

    /// What the API server hands back: defaults filled in, empties dropped, quantities
    /// canonical, plus metadata of its own.
    fn as_stored(mut s: ResourceSlice, rv: &str) -> Arc<ResourceSlice> {
        s.metadata.resource_version = Some(rv.into());
        s.metadata.uid = Some(format!("uid-{}", s.name_any()));
        s.metadata
            .labels
            .get_or_insert_default()
            .insert("extra".into(), "added-by-someone".into());
        for d in s.spec.devices.iter_mut().flatten() {
            for cap in d.capacity.iter_mut().flat_map(|c| c.values_mut()) {
                if cap.value.0 == "40960Mi" {
                    cap.value = Quantity("40Gi".into());
                }
            }
            for t in d.taints.iter_mut().flatten() {
                t.time_added = Some(Time(Timestamp::UNIX_EPOCH));
            }
            d.consumes_counters = Some(Vec::new());
            d.allow_multiple_allocations = Some(false);
        }
        s.spec.shared_counters = Some(Vec::new());
        s.spec.all_nodes = Some(false);
        Arc::new(s)
    }

    /// The cached metadata of `s` as the controller wrote it (hash and generation
    /// annotations), plus what the server and others add.
    fn cached(s: ResourceSlice, rv: &str) -> Arc<SliceMeta> {
        let mut metadata = s.metadata.clone();
        metadata.resource_version = Some(rv.into());
        metadata.uid = Some(format!("uid-{}", s.name_any()));
        metadata
            .labels
            .get_or_insert_default()
            .insert("extra".into(), "added-by-someone".into());
        let annotations = metadata.annotations.get_or_insert_default();
        annotations.insert(SPEC_HASH_ANNOTATION.into(), spec_hash(&s.spec));
        annotations.insert(GENERATION_ANNOTATION.into(), s.spec.pool.generation.to_string());
        Arc::new(SliceMeta {
            metadata,
            ..Default::default()
        })
    }

    #[test]
    fn semantic_equality_ignores_server_normalisation() {
        let want = slice("a", 0, vec![device("40960Mi", true)]);
        let have = as_stored(slice("a", 7, vec![device("40960Mi", true)]), "5");
        assert_ne!(want.spec, have.spec);
        assert_eq!(normalize_spec(&want.spec), normalize_spec(&have.spec));
        assert_eq!(spec_hash(&want.spec), spec_hash(&have.spec), "hashed alike");
        assert_ne!(
            spec_hash(&want.spec),
            spec_hash(&slice("a", 0, vec![device("40959Mi", true)]).spec)
        );
        assert_ne!(
            spec_hash(&want.spec),
            spec_hash(&slice("a", 0, vec![device("40Gi", false)]).spec)
        );
        assert_eq!(
            normalize_quantity(&Quantity("1k".into())),
            Quantity("1000".into())
        );
        assert_eq!(
            normalize_quantity(&Quantity("0.5".into())),
            Quantity("0.5".into())
        );
    }

    #[test]
    fn missing_owner_or_label_is_a_change() {
        let want = slice("a", 0, vec![device("1", false)]);
        let have = cached(want.clone(), "1");
        assert!(metadata_matches(&want, &have));
        let mut no_owner = (*have).clone();
        no_owner.metadata.owner_references = None;
        assert!(!metadata_matches(&want, &no_owner));
        let mut no_label = (*have).clone();
        no_label.metadata.labels = None;
        assert!(!metadata_matches(&want, &no_label));
    }

    #[test]
    fn slices_the_controller_did_not_write_are_rewritten_once_at_a_new_generation() {
        // No annotations: the spec cannot be compared, so the pool is rewritten, atomically.
        let desired = vec![slice("a", 0, vec![device("1", false)]), slice("b", 0, vec![])];
        let unannotated = |s: ResourceSlice, rv: &str| {
            let mut s = (*cached(s, rv)).clone();
            s.metadata.annotations = None;
            Arc::new(s)
        };
        let current = vec![
            unannotated(slice("a", 3, vec![device("1", false)]), "10"),
            unannotated(slice("b", 3, vec![]), "11"),
        ];
        let diff = diff_pool(desired.clone(), &current, Some(3));
        assert_eq!(diff.generation, 4);
        assert_eq!(diff.writes.len(), 2);
        assert!(matches!(diff.writes[0], SliceWrite::Replace(_)));
        // What was written is annotated, so the next pass writes nothing.
        let written: Vec<Arc<SliceMeta>> = diff
            .writes
            .iter()
            .map(|w| {
                let s = w.slice();
                assert_eq!(s.annotations()[GENERATION_ANNOTATION], "4");
                assert_eq!(s.annotations()[SPEC_HASH_ANNOTATION], spec_hash(&s.spec));
                cached(s.clone(), "20")
            })
            .collect();
        assert!(diff_pool(desired, &written, Some(4)).is_empty());
    }

    #[test]
    fn unchanged_pool_needs_no_writes() {
        let desired = vec![slice("a", 0, vec![device("1", false)]), slice("b", 0, vec![])];
        let current = vec![
            cached(slice("a", 3, vec![device("1", false)]), "10"),
            cached(slice("b", 3, vec![]), "11"),
        ];
        let diff = diff_pool(desired, &current, Some(3));
        assert!(diff.is_empty());
        assert_eq!(diff.generation, 3);
    }

    #[test]
    fn a_change_rewrites_every_slice_with_a_new_generation() {
        let desired = vec![slice("a", 0, vec![device("2", false)]), slice("c", 0, vec![])];
        let current = vec![
            cached(slice("a", 3, vec![device("1", false)]), "10"),
            cached(slice("b", 3, vec![]), "11"),
        ];
        let diff = diff_pool(desired, &current, Some(5));
        assert_eq!(diff.generation, 6, "above the published generation");
        assert_eq!(diff.writes.len(), 2);
        let SliceWrite::Replace(a) = &diff.writes[0] else {
            panic!("a exists and is replaced")
        };
        assert_eq!(a.metadata.resource_version.as_deref(), Some("10"));
        let SliceWrite::Create(c) = &diff.writes[1] else {
            panic!("c is new")
        };
        assert!(c.metadata.resource_version.is_none());
        assert!(diff.writes.iter().all(|w| w.slice().spec.pool.generation == 6));
        assert_eq!(
            diff.deletes,
            vec![SliceDelete {
                name: "b".into(),
                uid: Some("uid-b".into())
            }]
        );
    }

    #[test]
    fn mixed_generations_are_repaired() {
        let desired = vec![slice("a", 0, vec![]), slice("b", 0, vec![])];
        let current = vec![
            cached(slice("a", 4, vec![]), "10"),
            cached(slice("b", 3, vec![]), "11"),
        ];
        let diff = diff_pool(desired, &current, None);
        assert_eq!(diff.generation, 5);
        assert_eq!(diff.writes.len(), 2);
        assert!(diff.deletes.is_empty());
    }

    fn with_count(mut s: ResourceSlice, count: i64) -> ResourceSlice {
        s.spec.pool.resource_slice_count = count;
        s
    }

    #[test]
    fn one_changed_slice_is_rewritten_alone_at_the_same_generation() {
        let desired = vec![slice("a", 0, vec![device("2", false)]), slice("b", 0, vec![])];
        let current = vec![
            cached(slice("a", 3, vec![device("1", false)]), "10"),
            cached(slice("b", 3, vec![]), "11"),
        ];
        let diff = diff_pool(desired, &current, Some(3));
        assert_eq!(diff.generation, 3, "one update is atomic: no new generation");
        assert_eq!(diff.writes.len(), 1);
        let SliceWrite::Replace(a) = &diff.writes[0] else {
            panic!("a is replaced")
        };
        assert_eq!(a.name_any(), "a");
        assert_eq!(a.spec.pool.generation, 3);
        assert_eq!(a.metadata.resource_version.as_deref(), Some("10"));
        assert!(diff.deletes.is_empty());
    }

    #[test]
    fn two_changed_slices_bump_the_generation_and_rewrite_all() {
        let desired = vec![
            slice("a", 0, vec![device("2", false)]),
            slice("b", 0, vec![device("2", false)]),
            slice("c", 0, vec![]),
        ];
        let current = vec![
            cached(slice("a", 3, vec![device("1", false)]), "10"),
            cached(slice("b", 3, vec![device("1", false)]), "11"),
            cached(slice("c", 3, vec![]), "12"),
        ];
        let diff = diff_pool(desired, &current, Some(3));
        assert_eq!(diff.generation, 4);
        assert_eq!(diff.writes.len(), 3, "every slice moves to the new generation");
        assert!(!diff.deletes_first);
    }

    #[test]
    fn a_new_slice_bumps_the_generation() {
        let desired = vec![slice("a", 0, vec![]), slice("b", 0, vec![])];
        let current = vec![cached(slice("a", 3, vec![]), "10")];
        let diff = diff_pool(desired, &current, None);
        assert_eq!(diff.generation, 4);
        assert_eq!(diff.writes.len(), 2);
    }

    #[test]
    fn shrinking_to_one_slice_keeps_the_generation_and_deletes_first() {
        // Upstream: deleting obsolete slices bumps nothing; the one remaining slice changes
        // (its resourceSliceCount), which is a single update.
        let desired = vec![with_count(slice("a", 0, vec![]), 1)];
        let current = vec![
            cached(slice("a", 3, vec![]), "10"),
            cached(slice("b", 3, vec![]), "11"),
        ];
        let diff = diff_pool(desired, &current, None);
        assert_eq!(diff.generation, 3);
        assert_eq!(diff.writes.len(), 1);
        assert_eq!(diff.writes[0].slice().spec.pool.resource_slice_count, 1);
        assert_eq!(diff.deletes.len(), 1);
        assert!(
            diff.deletes_first,
            "no leftover of the same generation next to the rewrite"
        );
    }

    #[test]
    fn obsolete_slices_alone_bump_nothing() {
        let desired = vec![slice("a", 0, vec![]), slice("b", 0, vec![])];
        let current = vec![
            cached(slice("a", 3, vec![]), "10"),
            cached(slice("b", 3, vec![]), "11"),
            cached(slice("old", 2, vec![]), "9"),
        ];
        let diff = diff_pool(desired, &current, None);
        assert_eq!(diff.generation, 3);
        assert!(diff.writes.is_empty());
        assert_eq!(diff.deletes.len(), 1);
    }

    #[test]
    fn missing_metadata_is_rewritten_without_a_new_generation() {
        let desired = vec![slice("a", 0, vec![]), slice("b", 0, vec![])];
        let strip = |s: ResourceSlice, rv: &str| {
            let mut s = (*cached(s, rv)).clone();
            s.metadata.owner_references = None;
            Arc::new(s)
        };
        let current = vec![
            strip(slice("a", 3, vec![]), "10"),
            strip(slice("b", 3, vec![]), "11"),
        ];
        let diff = diff_pool(desired, &current, None);
        assert_eq!(diff.generation, 3, "the scheduler reads no metadata");
        assert_eq!(diff.writes.len(), 2);
        assert!(
            diff.writes
                .iter()
                .all(|w| w.slice().metadata.owner_references.is_some())
        );
    }

    #[test]
    fn rewritten_taints_keep_their_time_added() {
        let added = Time(Timestamp::from_second(1_700_000_000).unwrap());
        let mut live = (*as_stored(slice("a", 3, vec![device("1", true)]), "10")).clone();
        live.spec.devices.as_mut().unwrap()[0].taints.as_mut().unwrap()[0].time_added = Some(added.clone());
        // The device's capacity changes and it gains a second taint.
        let mut want = slice("a", 0, vec![device("2", true)]);
        want.spec.devices.as_mut().unwrap()[0]
            .taints
            .as_mut()
            .unwrap()
            .push(DeviceTaint {
                key: "gpu.migdra.dev/not-offered".into(),
                effect: "NoSchedule".into(),
                ..Default::default()
            });
        let current = [cached(slice("a", 3, vec![device("1", true)]), "10")];
        let mut diff = diff_pool(vec![want], &current, None);
        assert_eq!(tainted_replacements(&diff), ["a"]);
        keep_taint_times(&mut diff, &[live.clone()]);
        let written = diff.writes[0].slice();
        let taints = written.spec.devices.as_ref().unwrap()[0].taints.as_ref().unwrap();
        assert_eq!(taints[0].time_added, Some(added), "the old taint keeps its time");
        assert_eq!(taints[1].time_added, None, "the new taint gets the server's time");

        // A taint with another effect is another taint.
        live.spec.devices.as_mut().unwrap()[0].taints.as_mut().unwrap()[0].effect = "NoExecute".into();
        let mut diff = diff_pool(vec![slice("a", 0, vec![device("2", true)])], &current, None);
        keep_taint_times(&mut diff, &[live]);
        let taints = diff.writes[0].slice().spec.devices.as_ref().unwrap()[0]
            .taints
            .clone()
            .unwrap();
        assert_eq!(taints[0].time_added, None);
        // Nothing tainted, nothing to read.
        let diff = diff_pool(vec![slice("a", 0, vec![device("2", false)])], &current, None);
        assert!(tainted_replacements(&diff).is_empty());
    }

    #[test]
    fn withdrawing_deletes_everything() {
        let current = vec![cached(slice("a", 4, vec![]), "10")];
        let diff = diff_pool(Vec::new(), &current, None);
        assert!(diff.writes.is_empty());
        assert_eq!(diff.deletes.len(), 1);
        assert!(diff_pool(Vec::new(), &[], Some(9)).is_empty());
    }
}
