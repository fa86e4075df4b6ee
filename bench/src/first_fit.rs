//! What a device order costs the scheduler's allocator, without a cluster: how many devices
//! it considers before the first fit for a request. The allocator (Kubernetes 1.37,
//! `allocateOne`) walks a pool's devices in order, skips devices already in use without
//! looking at them, evaluates the request's CEL selectors (class and claim) on every other
//! device, and checks the counters of each device that matches; it stops at the first
//! device whose counters fit. So a device of another profile ahead of the first fit costs a
//! CEL evaluation each time, on every node the scheduler filters, for every pod.

use migdra_api::{
    catalog::GpuModel,
    policy::DeviceOrder,
    profile::ProfileName,
    slices::{PlannedDevice, PlannedKind, PoolPlan, allocator::Allocator},
};

use crate::packing;

/// An order of a node's devices the table compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// One of migdra's [`DeviceOrder`]s.
    Migdra(DeviceOrder),
    /// [`DeviceOrder::Packed`], then grouped profile by profile across the node
    /// ([`by_profile`]).
    PackedByProfile,
}

impl Order {
    /// Every order the table shows, migdra's default first.
    pub const ALL: [Order; 4] = [
        Order::Migdra(DeviceOrder::Packed),
        Order::PackedByProfile,
        Order::Migdra(DeviceOrder::Naive),
        Order::Migdra(DeviceOrder::Spread),
    ];

    pub fn name(self) -> &'static str {
        match self {
            Order::Migdra(DeviceOrder::Packed) => "packed (default)",
            Order::Migdra(DeviceOrder::Naive) => "naive",
            Order::Migdra(DeviceOrder::Spread) => "spread",
            Order::PackedByProfile => "packed, by profile",
        }
    }

    /// The pool of `gpus` GPUs of `model` with MIG on, without whole GPUs, in this order.
    pub fn plan(self, model: &GpuModel, gpus: u32) -> PoolPlan {
        match self {
            Order::Migdra(order) => packing::plan(model, gpus, order),
            Order::PackedByProfile => by_profile(packing::plan(model, gpus, DeviceOrder::Packed)),
        }
    }
}

/// A device's profile, or `None` for a whole GPU.
fn profile_of(device: &PlannedDevice) -> Option<ProfileName> {
    match &device.kind {
        PlannedKind::Mig { profile, .. } => Some(profile.name),
        PlannedKind::Gpu => None,
    }
}

/// The same devices grouped profile by profile across the node, profiles in the order they
/// first appear; devices of one profile keep their relative order, so a request for one exact
/// profile gets the same device as in `plan`.
pub fn by_profile(mut plan: PoolPlan) -> PoolPlan {
    let mut ranks: Vec<Option<ProfileName>> = Vec::new();
    for device in &plan.devices {
        let profile = profile_of(device);
        if !ranks.contains(&profile) {
            ranks.push(profile);
        }
    }
    plan.devices.sort_by_key(|d| {
        let profile = profile_of(d);
        ranks.iter().position(|p| *p == profile).unwrap_or(usize::MAX)
    });
    plan
}

/// What the allocator did to find the first fit for one request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cost {
    /// Devices whose selectors were evaluated (every device considered that is not in use).
    pub evaluations: usize,
    /// Devices that matched and whose counters were checked.
    pub counter_checks: usize,
    /// The device allocated, if any fits.
    pub hit: Option<usize>,
}

/// Walks `allocator`'s pool as the scheduler's allocator does for a request that `matches`.
pub fn first_fit_cost(
    allocator: &Allocator<'_>,
    plan: &PoolPlan,
    matches: impl Fn(&PlannedDevice) -> bool,
) -> Cost {
    let mut cost = Cost::default();
    for (index, device) in plan.devices.iter().enumerate() {
        if allocator.allocated().contains(&index) {
            continue;
        }
        cost.evaluations += 1;
        if !matches(device) {
            continue;
        }
        cost.counter_checks += 1;
        if allocator.fits(index) {
            cost.hit = Some(index);
            break;
        }
    }
    cost
}

/// A request of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request {
    /// One exact profile (a per-profile class, or the MIG class with a `profile` selector).
    Profile(&'static str),
    /// Any MIG device with at least this much memory (the MIG class with a `memory` capacity
    /// selector), in GiB.
    AtLeastGib(u64),
}

impl Request {
    pub fn name(self) -> String {
        match self {
            Request::Profile(p) => p.to_string(),
            Request::AtLeastGib(g) => format!("any ≥ {g} GiB"),
        }
    }

    pub fn matches(self, device: &PlannedDevice) -> bool {
        match (&device.kind, self) {
            (PlannedKind::Mig { profile, .. }, Request::Profile(p)) => profile.name.to_string() == p,
            (PlannedKind::Mig { profile, .. }, Request::AtLeastGib(g)) => profile.memory_mib >= g * 1024,
            (PlannedKind::Gpu, _) => false,
        }
    }
}

/// The node states of the table: `(name, requests placed by first fit from empty)`.
pub fn states() -> Vec<(&'static str, Vec<Request>)> {
    vec![
        ("empty", Vec::new()),
        ("10 × 1g.10gb", vec![Request::Profile("1g.10gb"); 10]),
        ("28 × 1g.10gb", vec![Request::Profile("1g.10gb"); 28]),
        (
            "mixed: 6 × 1g.10gb, 4 × 2g.20gb, 2 × 3g.40gb",
            [
                vec![Request::Profile("1g.10gb"); 6],
                vec![Request::Profile("2g.20gb"); 4],
                vec![Request::Profile("3g.40gb"); 2],
            ]
            .concat(),
        ),
    ]
}

/// The cost of `request` on `plan` after `fill` was placed by first fit (in the same order).
pub fn cost_after(plan: &PoolPlan, fill: &[Request], request: Request) -> Cost {
    let mut allocator = Allocator::new(plan);
    for r in fill {
        allocator.allocate(|d| r.matches(d));
    }
    first_fit_cost(&allocator, plan, |d| request.matches(d))
}

/// Mean selector evaluations per claim while `count` claims of `request` fill an empty pool one
/// at a time (B1's workload on one node), and how many were placed.
pub fn mean_while_filling(plan: &PoolPlan, request: Request, count: usize) -> (f64, usize) {
    let mut allocator = Allocator::new(plan);
    let (mut evaluations, mut placed) = (0, 0);
    for _ in 0..count {
        let cost = first_fit_cost(&allocator, plan, |d| request.matches(d));
        evaluations += cost.evaluations;
        if let Some(index) = cost.hit {
            allocator.take(index);
            placed += 1;
        }
    }
    (evaluations as f64 / count.max(1) as f64, placed)
}

#[cfg(test)]
mod tests {
    use migdra_api::catalog;

    use super::*;
    use crate::packing::{first_fit, random_stream, stream_profiles};

    fn h100() -> &'static GpuModel {
        catalog::model("H100-80GB").expect("H100 in the catalog")
    }

    #[test]
    fn counts_on_one_h100_by_hand() {
        // One H100, packed order, no whole GPU: 1g.10gb at 0..=6 (7), 1g.10gb+me at 0..=6 (7),
        // 1g.20gb at 6, 0, 2, 4 (4), 2g.20gb (3), 3g.40gb at 4, 0 (2), 4g.40gb (1), 7g.80gb (1).
        let plan = Order::Migdra(DeviceOrder::Packed).plan(h100(), 1);
        assert_eq!(plan.devices.len(), 25);
        let one_g = Request::Profile("1g.10gb");
        // Empty: the first device fits.
        assert_eq!(
            cost_after(&plan, &[], one_g),
            Cost {
                evaluations: 1,
                counter_checks: 1,
                hit: Some(0)
            }
        );
        // 2g.20gb on an empty GPU: 14 + 4 devices of other profiles first, then the first 2g.
        let two_g = cost_after(&plan, &[], Request::Profile("2g.20gb"));
        assert_eq!(
            (two_g.evaluations, two_g.counter_checks, two_g.hit),
            (19, 1, Some(18))
        );
        // After 3 × 1g.10gb (devices 0..=2 in use, skipped): 1g.10gb at 3 is the 1st evaluated.
        let after = cost_after(&plan, &[one_g; 3], one_g);
        assert_eq!((after.evaluations, after.hit), (1, Some(3)));
        // 2g.20gb after 1g.10gb at 0..=2: skips 3 in use, evaluates 4 + 7 + 4 other profiles
        // and 2g at 0 (slices 0-1 taken), then 2g at 2 (slice 2 taken), then 2g at 4 fits.
        let after = cost_after(&plan, &[one_g; 3], Request::Profile("2g.20gb"));
        assert_eq!((after.evaluations, after.counter_checks), (4 + 7 + 4 + 3, 3));
        assert_eq!(
            plan.devices[after.hit.expect("fits")].name.to_string(),
            "gpu-0-mig-2g20gb-4"
        );
        // Full of 1g.10gb: nothing fits; every device not in use was evaluated.
        let full = cost_after(&plan, &[one_g; 7], one_g);
        assert_eq!((full.evaluations, full.hit), (18, None));
        // "Any ≥ 19 GiB" (an H100 1g.20gb has 20,096 MiB, under 20 GiB) takes the first
        // 1g.20gb (at 6, the slice 1g.10gb cannot use).
        let any = cost_after(&plan, &[], Request::AtLeastGib(19));
        assert_eq!(
            plan.devices[any.hit.expect("fits")].name.to_string(),
            "gpu-0-mig-1g20gb-6"
        );
        assert_eq!(any.evaluations, 15);
    }

    #[test]
    fn by_profile_reaches_1g_first_fit_at_once_on_a_partly_filled_node() {
        // Two H100s, GPU 0 full of 1g.10gb: packed walks GPU 0's 18 other devices first.
        let one_g = Request::Profile("1g.10gb");
        let packed = Order::Migdra(DeviceOrder::Packed).plan(h100(), 2);
        let grouped = Order::PackedByProfile.plan(h100(), 2);
        let a = cost_after(&packed, &[one_g; 7], one_g);
        let b = cost_after(&grouped, &[one_g; 7], one_g);
        assert_eq!(a.evaluations, 19);
        assert_eq!(b.evaluations, 1);
        assert_eq!(
            packed.devices[a.hit.expect("fits")].name,
            grouped.devices[b.hit.expect("fits")].name
        );
    }

    #[test]
    fn by_profile_places_exact_profile_streams_exactly_as_packed() {
        // The same placements, hence B7's figure, for claims of one exact profile each.
        for model in catalog::models() {
            let profiles = stream_profiles(&model.geometry());
            let packed = Order::Migdra(DeviceOrder::Packed).plan(model, 2);
            let grouped = Order::PackedByProfile.plan(model, 2);
            for seed in 1..=20 {
                let events = random_stream(&profiles, seed, 100, 6);
                assert_eq!(
                    first_fit(&packed, &events),
                    first_fit(&grouped, &events),
                    "{} seed {seed}",
                    model.key
                );
            }
        }
    }

    #[test]
    fn a_request_nothing_matches_evaluates_every_free_device() {
        let plan = Order::Migdra(DeviceOrder::Packed).plan(h100(), 2);
        let cost = cost_after(&plan, &[], Request::Profile("9g.999gb"));
        assert_eq!((cost.evaluations, cost.counter_checks, cost.hit), (50, 0, None));
    }

    #[test]
    fn filling_an_h100_node_with_1g_costs_what_the_order_puts_ahead() {
        let one_g = Request::Profile("1g.10gb");
        let (packed, placed) =
            mean_while_filling(&Order::Migdra(DeviceOrder::Packed).plan(h100(), 8), one_g, 56);
        assert_eq!(placed, 56);
        // GPU g's 7 claims each walk the 18 other devices of the g full GPUs before it.
        let expected = (0..8).map(|g| 7.0 * (18.0 * g as f64 + 1.0)).sum::<f64>() / 56.0;
        assert!((packed - expected).abs() < 1e-9, "{packed} vs {expected}");
        let (grouped, placed) = mean_while_filling(&Order::PackedByProfile.plan(h100(), 8), one_g, 56);
        assert_eq!((grouped, placed), (1.0, 56));
    }
}
