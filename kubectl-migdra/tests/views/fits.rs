//! The fits view.

use kubectl_migdra::{
    fits::{self, Shape},
    render::{self, Style, text},
};
use migdra_api::policy::{DeviceOrder, EffectivePolicy};

use crate::{fixture, golden};

fn profile(p: &str) -> Shape {
    Shape::Profile(p.parse().unwrap())
}

#[test]
fn a_small_profile_lands_on_the_first_free_placement_in_pool_order() {
    let view = fits::build(&fixture::snapshot(), &profile("1g.10gb"), None);
    let landing = view.nodes[0].lands.as_ref().unwrap();
    // Packed order: GPU 0 first, 1g starts ascending; 0 is used, 1 is free (2 is allocated).
    assert_eq!(landing.device, "gpu-0-mig-1g10gb-1");
    assert_eq!((landing.gpu, landing.start), (0, 1));
    assert_eq!(landing.memory_slices, [1]);
}

#[test]
fn the_published_order_decides_the_placement() {
    // The answer comes from the published slices, not from a recomputation of the plan:
    // published in Naive order with gpu-0-mig-1g10gb-1 left out, the claim takes the next
    // free 1g placement in that pool, 3.
    let mut snapshot = fixture::snapshot();
    let gpus = fixture::gpus();
    snapshot.slices = fixture::slices(
        &gpus,
        &EffectivePolicy {
            device_order: DeviceOrder::Naive,
            ..fixture::dynamic()
        },
    );
    for slice in &mut snapshot.slices {
        if let Some(devices) = &mut slice.spec.devices {
            devices.retain(|d| d.name != "gpu-0-mig-1g10gb-1");
        }
    }
    let view = fits::build(&snapshot, &profile("1g.10gb"), None);
    assert_eq!(view.nodes[0].lands.as_ref().unwrap().device, "gpu-0-mig-1g10gb-3");
}

#[test]
fn a_large_profile_that_cannot_land_says_what_holds_each_placement() {
    let view = fits::build(&fixture::snapshot(), &profile("3g.40gb"), None);
    let node = &view.nodes[0];
    assert!(node.lands.is_none());
    assert!(node.problem.is_none());
    let blocked: Vec<(&str, &str)> = node
        .blocked
        .iter()
        .map(|b| (b.device.as_str(), b.reason.as_str()))
        .collect();
    // GPU 0's 3g@4 is not published (foreign instance); 3g@0 overlaps two claims' slices.
    assert_eq!(blocked[0].0, "gpu-0-mig-3g40gb-0");
    assert!(
        blocked[0]
            .1
            .contains("memory-slice-0 used by gpu-0-mig-1g10gb-0 (claim default/train-a-gpu)"),
        "{}",
        blocked[0].1
    );
    assert!(
        blocked[0]
            .1
            .contains("memory-slice-2 used by gpu-0-mig-1g10gb-2 (claim default/infer-b-gpu)"),
        "{}",
        blocked[0].1
    );
    assert!(blocked.iter().all(|(d, _)| *d != "gpu-0-mig-3g40gb-4"));
    // GPU 1's placements are all held by the whole-GPU claim.
    let gpu1: Vec<_> = blocked.iter().filter(|(d, _)| d.starts_with("gpu-1-")).collect();
    assert_eq!(gpu1.len(), 2);
    assert!(
        gpu1.iter()
            .all(|(_, r)| r.contains("used by gpu-1 (claim default/whole)"))
    );
}

#[test]
fn memory_requests_match_by_capacity() {
    // A 1g.10gb instance has 9856 MiB: less than 10Gi, but at least 9Gi. The smallest such
    // device comes first in packed order.
    let view = fits::build(&fixture::snapshot(), &Shape::memory("9Gi").unwrap(), None);
    assert_eq!(view.nodes[0].lands.as_ref().unwrap().device, "gpu-0-mig-1g10gb-1");
    // Every 2-slice placement overlaps a claim, the foreign instance or the whole GPU.
    let view = fits::build(&fixture::snapshot(), &Shape::memory("19Gi").unwrap(), None);
    assert!(view.nodes[0].lands.is_none());
    assert!(
        view.nodes[0]
            .blocked
            .iter()
            .any(|b| b.device == "gpu-0-mig-1g20gb-2")
    );
    assert!(Shape::memory("lots").is_err());
}

#[test]
fn missing_or_incomplete_pools_and_unpublished_profiles_are_explained() {
    let mut snapshot = fixture::snapshot();
    snapshot.slices.pop();
    let view = fits::build(&snapshot, &profile("1g.10gb"), None);
    assert!(view.nodes[0].problem.as_deref().unwrap().contains("incomplete"));

    snapshot.slices.clear();
    let view = fits::build(&snapshot, &profile("1g.10gb"), None);
    assert!(
        view.nodes[0]
            .problem
            .as_deref()
            .unwrap()
            .contains("no ResourceSlices")
    );

    let view = fits::build(&fixture::snapshot(), &profile("1g.5gb"), None);
    assert_eq!(
        view.nodes[0].problem.as_deref(),
        Some("the pool publishes no 1g.5gb device: every GPU with the profile is unhealthy (GPU 2)")
    );

    let view = fits::build(&fixture::snapshot(), &profile("1g.10gb"), Some("elsewhere"));
    assert!(view.nodes[0].problem.as_deref().unwrap().contains("no GpuNode"));
}

#[test]
fn fits_renderings_match_the_goldens() {
    let snapshot = fixture::snapshot();
    let lands = fits::build(&snapshot, &profile("1g.10gb"), None);
    let blocked = fits::build(&snapshot, &profile("3g.40gb"), None);
    golden::check(
        "fits.txt",
        &format!(
            "{}{}",
            text::fits(&lands, &Style::PLAIN),
            text::fits(&blocked, &Style::PLAIN)
        ),
    );
    golden::check("fits-blocked.json", &render::json(&blocked).unwrap());
}
