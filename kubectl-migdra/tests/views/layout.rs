//! The layout view.

use kubectl_migdra::{
    layout::{self, InstanceOwnerView, MigMode, SliceUse},
    render::{self, Style, text},
};

use crate::{fixture, golden};

#[test]
fn instances_are_joined_with_their_claims_pods_and_mig_uuids() {
    let view = layout::build(&fixture::snapshot(), &[]);
    assert_eq!(view.nodes.len(), 1);
    let node = &view.nodes[0];
    assert_eq!(node.pool, "gpu-node-a/gpu.migdra.dev");
    let gpu0 = &node.gpus[0];
    assert_eq!(gpu0.minor, 0);
    let starts: Vec<(u32, InstanceOwnerView)> = gpu0.instances.iter().map(|i| (i.start, i.owner)).collect();
    assert_eq!(
        starts,
        [
            (0, InstanceOwnerView::Migdra),
            (2, InstanceOwnerView::Allocated),
            (4, InstanceOwnerView::Foreign)
        ]
    );
    let created = &gpu0.instances[0];
    assert_eq!(created.device.as_deref(), Some("gpu-0-mig-1g10gb-0"));
    assert_eq!(
        created.mig_uuid.as_deref(),
        Some("MIG-11111111-2222-3333-4444-555555555555")
    );
    assert_eq!(created.users.len(), 1);
    assert_eq!(created.users[0].claim.to_string(), "default/train-a-gpu");
    assert_eq!(created.users[0].pods[0].to_string(), "default/train-a");
    let pending = &gpu0.instances[1];
    assert_eq!(pending.gpu_instance_id, None);
    assert_eq!(pending.users[0].pods[0].name, "infer-b");
    let foreign = &gpu0.instances[2];
    assert!(foreign.users.is_empty());
    assert_eq!(foreign.memory_slices, [4, 5, 6, 7]);
    use SliceUse::*;
    assert_eq!(
        gpu0.slice_map,
        [Migdra, Free, Allocated, Free, Foreign, Foreign, Foreign, Foreign]
    );
}

#[test]
fn free_placements_and_fragmentation_follow_the_occupied_slices() {
    let view = layout::build(&fixture::snapshot(), &[]);
    let gpu0 = &view.nodes[0].gpus[0];
    let one_g = gpu0.free.iter().find(|f| f.profile == "1g.10gb").unwrap();
    assert_eq!(one_g.starts, [1, 3]);
    // Slices 1 and 3 are free but not adjacent within a 2-slice placement: no 2-slice profile fits.
    assert!(gpu0.free.iter().all(|f| f.memory_slices == 1), "{:?}", gpu0.free);
    let f = gpu0.fragmentation.as_ref().unwrap();
    assert_eq!(
        (f.free_slices, f.largest_fit_slices, f.stranded_slices, f.percent),
        (2, 1, 1, 50)
    );

    // The whole GPU is taken: every slice is, nothing is free.
    let gpu1 = &view.nodes[0].gpus[1];
    assert_eq!(gpu1.mig, MigMode::Disabled);
    assert_eq!(gpu1.whole_gpu[0].claim.to_string(), "default/whole");
    assert!(gpu1.slice_map.iter().all(|s| *s == SliceUse::WholeGpu));
    assert!(gpu1.free.is_empty() && gpu1.fragmentation.is_none());

    // An empty 8-slice GPU: the 7g profile takes every slice, nothing is stranded.
    let mut snapshot = fixture::snapshot();
    snapshot.claims.clear();
    let status = snapshot.gpu_nodes[0].status.as_mut().unwrap();
    status.gpus.as_mut().unwrap()[0]
        .mig
        .as_mut()
        .unwrap()
        .instances
        .clear();
    let view = layout::build(&snapshot, &[]);
    let f = view.nodes[0].gpus[0].fragmentation.clone().unwrap();
    assert_eq!(f.largest_fit.as_deref(), Some("7g.80gb"));
    assert_eq!((f.free_slices, f.stranded_slices, f.percent), (8, 0, 0));
}

#[test]
fn an_orphaned_migdra_instance_keeps_its_recorded_claim_and_unhealthy_gpus_say_why() {
    let view = layout::build(&fixture::snapshot(), &[]);
    let gpu2 = &view.nodes[0].gpus[2];
    assert!(!gpu2.healthy);
    assert!(gpu2.health_reason.as_deref().unwrap().contains("XID 79"));
    let leaked = &gpu2.instances[0];
    assert!(leaked.users.is_empty());
    assert_eq!(leaked.recorded_claim.as_deref(), Some("default/gone"));
}

#[test]
fn unknown_nodes_are_reported_not_dropped() {
    let view = layout::build(
        &fixture::snapshot(),
        &["nope".to_string(), fixture::NODE.to_string()],
    );
    let names: Vec<&str> = view.nodes.iter().map(|n| n.node.as_str()).collect();
    assert_eq!(names, ["gpu-node-a", "nope"]);
    assert!(view.nodes[1].problem.as_deref().unwrap().contains("no GpuNode"));
}

#[test]
fn layout_renderings_match_the_goldens() {
    let view = layout::build(&fixture::snapshot(), &[]);
    golden::check("layout.txt", &text::layout(&view, &Style::PLAIN));
    golden::check("layout.json", &render::json(&view).unwrap());
    golden::check("layout.yaml", &render::yaml(&view).unwrap());
}

#[test]
fn colour_only_adds_escapes() {
    let view = layout::build(&fixture::snapshot(), &[]);
    let coloured = text::layout(&view, &Style { color: true });
    assert!(coloured.contains("\x1b[36m"), "migdra's instances are cyan");
    assert!(coloured.contains("\x1b[33m"), "foreign instances are yellow");
    assert_eq!(strip_ansi(&coloured), text::layout(&view, &Style::PLAIN));
}

pub fn strip_ansi(s: &str) -> String {
    let mut out = String::new();
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
