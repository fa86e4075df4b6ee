//! Cross-check of the fake, an independent witness, against migdra-api.
//!
//! The fake's MIG rules (`migdra_fake_nvml::sim`) and model tables (`migdra_fake_nvml::model`)
//! are written from the NVML reference (`shared/reference/mig-nvml.md`), with no code from
//! migdra-api. For every MIG-capable model of `migdra_api::catalog` this test checks:
//!
//! * that the fake's profile table (names, indexes, IDs, slice counts, instance counts,
//!   placements, memory, SM and engine counts) and device facts agree with the catalog,
//!   reporting every field that disagrees;
//! * that the layouts (sets of GPU instances on one GPU) migdra's published counters let the
//!   scheduler co-allocate are exactly the layouts the fake admits through its own rules,
//!   both found by exhaustive depth-first search.
//!
//! Where the two disagree because migdra-api departs from the reference, the fake stays
//! faithful to the reference and the case is listed below with the section it rests on.
//! A listed case that no longer occurs fails the test too, so the lists stay true.

use std::{collections::BTreeSet, path::Path};

use migdra_api::{
    catalog::{self, GpuModel},
    geometry::Architecture,
    policy::EffectivePolicy,
    slices::{PlannedKind, allocator::Allocator, plan_pool},
};
use migdra_fake_nvml::{
    FakeConfig, GpuConfig, code,
    model::{FakeModel, GiProfile},
    state::{FakeState, GpuState},
};

/// A layout: the GPU instances on one GPU, as (profile ID, placement start).
type Layout = BTreeSet<(u32, u32)>;

/// Table fields where the fake (per the reference) and the catalog are known to disagree:
/// `(model key, "profile field" as the report names it, why)`.
const EXPECTED_TABLE_DISCREPANCIES: &[(&str, &str, &str)] = &[];

/// A family of layouts the fake admits and migdra's counters refuse (or the reverse).
struct LayoutDiscrepancy {
    model: &'static str,
    /// True for the layouts this case explains.
    explains: fn(&Layout) -> bool,
    /// Whether the fake admits them (true) or only the counters do (false).
    fake_admits: bool,
    why: &'static str,
}

/// None at present. The A30 pair `1g.6gb+me` (ID 21) with `2g.12gb+me` (ID 6) was one until
/// the fake modelled the single OFA engine (mig-nvml.md §4): migdra's counters refuse the pair
/// through the single `ofa-engines` counter, and now the fake refuses it too.
const EXPECTED_LAYOUT_DISCREPANCIES: &[LayoutDiscrepancy] = &[];

fn fake_model(key: &str) -> FakeModel {
    FakeModel::lookup(key).unwrap_or_else(|| panic!("the fake does not simulate catalog model {key}"))
}

/// A fresh simulated GPU of `key` with MIG on.
fn fake_gpu(key: &str) -> GpuState {
    let config = FakeConfig {
        gpus: vec![GpuConfig::new(key, true)],
        ..FakeConfig::default()
    };
    let mut state = FakeState::from_config(&config, Path::new("proc-root-unused")).expect("state");
    state.gpus.remove(0)
}

/// Every field where the fake's model differs from the catalog's, as `(field, message)`.
fn table_discrepancies(model: &GpuModel) -> Vec<(String, String)> {
    let fake = fake_model(model.key);
    let mut out = Vec::new();
    let mut differ = |field: String, catalog: String, fake: String| {
        if catalog != fake {
            out.push((field, format!("catalog {catalog}, fake {fake}")));
        }
    };
    differ(
        "product name".into(),
        model.product_name.into(),
        fake.product_name.into(),
    );
    differ(
        "architecture".into(),
        format!("{:?}", Some(model.architecture)),
        format!("{:?}", Architecture::from_nvml_value(fake.architecture)),
    );
    differ(
        "PCI device ID".into(),
        format!("one of {:04x?}", model.pci_device_ids),
        if model.pci_device_ids.contains(&fake.pci_device_id) {
            format!("one of {:04x?}", model.pci_device_ids)
        } else {
            format!("{:04x}", fake.pci_device_id)
        },
    );
    differ(
        "compute capability".into(),
        format!("{:?}", model.cuda_compute_capability),
        format!("{:?}", fake.cuda_compute_capability),
    );
    differ(
        "memory MiB".into(),
        model.memory_mib.to_string(),
        fake.memory_mib.to_string(),
    );
    differ(
        "multiprocessors".into(),
        model.multiprocessors.to_string(),
        fake.multiprocessors.to_string(),
    );
    let Some(table) = fake.mig else {
        differ("MIG".into(), "capable".into(), "not capable".into());
        return out;
    };
    differ(
        "memory slices".into(),
        model.memory_slices().to_string(),
        table.memory_slices.to_string(),
    );
    differ(
        "max MIG devices".into(),
        model.max_mig_devices.to_string(),
        table.max_mig_devices.to_string(),
    );
    let fake_ids: BTreeSet<u32> = table.profiles.iter().map(|p| p.id).collect();
    let catalog_ids: BTreeSet<u32> = model.profiles.iter().map(|p| p.gi_profile_id).collect();
    differ(
        "profile IDs".into(),
        format!("{catalog_ids:?}"),
        format!("{fake_ids:?}"),
    );
    for p in &model.profiles {
        let Some(f) = table.profile_by_id(p.gi_profile_id) else {
            continue;
        };
        let name = p.name.to_string();
        let mut field = |what: &str, catalog: String, fake: String| {
            differ(format!("{name} {what}"), catalog, fake);
        };
        field("name", name.clone(), f.name.into());
        field("index", p.gi_profile_index.to_string(), f.index.to_string());
        field(
            "compute slices",
            p.compute_slices.to_string(),
            f.compute_slices.to_string(),
        );
        field(
            "placement size",
            p.memory_slices.to_string(),
            f.memory_slices.to_string(),
        );
        field(
            "instance count",
            p.instance_count.to_string(),
            f.instance_count.to_string(),
        );
        field(
            "placements",
            format!("{:?}", p.placements),
            format!("{:?}", f.starts),
        );
        field("memory MiB", p.memory_mib.to_string(), f.memory_mib.to_string());
        let e = p.engines;
        let fe = f.engines;
        for (what, catalog, fake) in [
            ("SMs", e.multiprocessors, fe.multiprocessors),
            ("copy engines", e.copy_engines, fe.copy_engines),
            ("decoders", e.decoders, fe.decoders),
            ("encoders", e.encoders, fe.encoders),
            ("JPEG", e.jpeg_engines, fe.jpeg_engines),
            ("OFA", e.ofa_engines, fe.ofa_engines),
        ] {
            field(what, catalog.to_string(), fake.to_string());
        }
    }
    out
}

/// Every layout migdra's published counters let the scheduler co-allocate on one GPU of
/// `model` (MIG partitions only), found by depth-first search with the scheduler's
/// allocator model over the pool migdra would publish.
fn layouts_by_counters(model: &GpuModel) -> BTreeSet<Layout> {
    let gpus = vec![model.inventory(0, true)];
    let policy = EffectivePolicy {
        whole_gpus: false,
        ..EffectivePolicy::default()
    };
    let plan = plan_pool(&gpus, &policy);
    let placement = |i: usize| match &plan.devices[i].kind {
        PlannedKind::Mig { profile, start } => Some((profile.gi_profile_id, *start)),
        PlannedKind::Gpu => None,
    };
    let mut out = BTreeSet::new();
    let mut stack = vec![(Allocator::new(&plan), 0, Layout::new())];
    while let Some((alloc, from, layout)) = stack.pop() {
        for i in from..plan.devices.len() {
            let Some(p) = placement(i) else { continue };
            let mut next = alloc.clone();
            if next.take(i) {
                let mut grown = layout.clone();
                grown.insert(p);
                stack.push((next, i + 1, grown));
            }
        }
        out.insert(layout);
    }
    out
}

/// Every layout the fake admits on a fresh GPU of `key`: GPU instances created one by one
/// at valid placements through the fake's own rules, by depth-first search. Every refusal
/// of a valid placement must be INSUFFICIENT_RESOURCES, NVML's code for overlap and
/// instance count (§1.3, §11 rule 3).
fn layouts_admitted_by_fake(key: &str) -> BTreeSet<Layout> {
    let gpu = fake_gpu(key);
    let table = gpu.mig_table().expect("MIG-capable");
    let candidates: Vec<(u32, u32)> = table
        .profiles
        .iter()
        .flat_map(|p: &GiProfile| p.starts.iter().map(move |s| (p.id, *s)))
        .collect();
    let mut out = BTreeSet::new();
    let mut serial = 1;
    let mut stack = vec![(gpu, 0, Layout::new())];
    while let Some((gpu, from, layout)) = stack.pop() {
        for (i, (id, start)) in candidates.iter().enumerate().skip(from) {
            let mut next = gpu.clone();
            serial += 1;
            match next.create_gpu_instance(*id, Some(*start), serial) {
                Ok(_) => {
                    let mut grown = layout.clone();
                    grown.insert((*id, *start));
                    stack.push((next, i + 1, grown));
                }
                Err(rc) => assert_eq!(
                    rc,
                    code::INSUFFICIENT_RESOURCES,
                    "{key}: profile {id} at {start} next to {layout:?}"
                ),
            }
        }
        out.insert(layout);
    }
    out
}

#[test]
fn fake_tables_agree_with_the_catalog_on_every_field() {
    let mut unexpected = Vec::new();
    let mut found = BTreeSet::new();
    for model in catalog::models() {
        for (field, message) in table_discrepancies(model) {
            if EXPECTED_TABLE_DISCREPANCIES
                .iter()
                .any(|(key, f, _)| *key == model.key && *f == field)
            {
                found.insert((model.key, field));
            } else {
                unexpected.push(format!("{} {field}: {message}", model.key));
            }
        }
    }
    assert!(
        unexpected.is_empty(),
        "the fake's tables (from mig-nvml.md) and migdra_api::catalog disagree:\n{}",
        unexpected.join("\n")
    );
    for (key, field, why) in EXPECTED_TABLE_DISCREPANCIES {
        assert!(
            found.contains(&(*key, field.to_string())),
            "{key} {field} now agrees; remove it from the expected discrepancies ({why})"
        );
    }
}

#[test]
fn the_counters_admit_exactly_the_layouts_the_fake_admits_on_every_model() {
    let mut failures = Vec::new();
    for model in catalog::models() {
        let by_counters = layouts_by_counters(model);
        let by_fake = layouts_admitted_by_fake(model.key);
        assert!(
            by_fake.len() > 10,
            "{}: only {} layouts",
            model.key,
            by_fake.len()
        );
        let expected: Vec<&LayoutDiscrepancy> = EXPECTED_LAYOUT_DISCREPANCIES
            .iter()
            .filter(|d| d.model == model.key)
            .collect();
        let explained = |layout: &Layout, fake_admits: bool| {
            expected
                .iter()
                .any(|d| d.fake_admits == fake_admits && (d.explains)(layout))
        };
        for (only_in, sets, fake_admits) in [
            (
                "the fake admits, the counters refuse",
                by_fake.difference(&by_counters),
                true,
            ),
            (
                "the counters admit, the fake refuses",
                by_counters.difference(&by_fake),
                false,
            ),
        ] {
            let unexplained: Vec<&Layout> = sets.filter(|l| !explained(l, fake_admits)).collect();
            if let Some(first) = unexplained.first() {
                failures.push(format!(
                    "{}: {} layouts {only_in}, e.g. {first:?}",
                    model.key,
                    unexplained.len()
                ));
            }
        }
        for d in &expected {
            let (admitted, refused) = if d.fake_admits {
                (&by_fake, &by_counters)
            } else {
                (&by_counters, &by_fake)
            };
            let occurs = admitted.iter().any(|l| (d.explains)(l) && !refused.contains(l));
            if !occurs {
                failures.push(format!(
                    "{}: the expected discrepancy no longer occurs; remove it ({})",
                    model.key, d.why
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
