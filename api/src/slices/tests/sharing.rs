//! Shared partitions: how they are rendered, and that the scheduler's rules for them (as the
//! allocator model and a re-statement of the 1.37 capacity check apply them) keep the
//! hardware promises of exclusive devices.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::Device;
use proptest::prelude::*;

use super::{
    super::{
        allocator::Allocator,
        validate::{PoolError, validate_pool},
        *,
    },
    dynamic,
};
use crate::{
    catalog,
    geometry::{MigGeometry, Placement},
    policy::ProfileMatcher,
};

fn h100s(count: u32) -> Vec<GpuInventory> {
    let model = catalog::model("H100-80GB").expect("H100 in the catalog");
    (0..count).map(|m| model.inventory(m, true)).collect()
}

fn sharing(profiles: &[&str], shares: u32) -> EffectivePolicy {
    EffectivePolicy {
        shared_profiles: profiles
            .iter()
            .map(|p| ProfileMatcher::parse(p).unwrap())
            .collect(),
        shares,
        ..dynamic()
    }
}

fn render(gpus: &[GpuInventory], plan: &PoolPlan) -> Vec<ResourceSliceSpec> {
    let id = PoolIdentity {
        driver: "gpu.migdra.dev",
        node: "node-a",
        pool: "node-a/gpu.migdra.dev",
        generation: 1,
        driver_version: Some("580.82.07"),
    };
    render_pool(&id, gpus, plan)
}

fn rendered_devices(slices: &[ResourceSliceSpec]) -> Vec<Device> {
    slices
        .iter()
        .flat_map(|s| s.devices.iter().flatten().cloned())
        .collect()
}

/// Capacity requests of one claim, by capacity name.
type Requests = BTreeMap<&'static str, u128>;
/// A way to break a rendered device.
type Breakage = Box<dyn Fn(&mut Device)>;

fn is_1g10gb(d: &PlannedDevice) -> bool {
    matches!(&d.kind, PlannedKind::Mig { profile, .. } if profile.name.to_string() == "1g.10gb")
}

fn q(s: &str) -> u128 {
    quantity::parse(s).unwrap_or_else(|| panic!("quantity {s:?}"))
}

/// What one claim consumes of each capacity of `device`, the way the 1.37 allocator computes
/// it (`calculateConsumedCapacity`, `violatesPolicy`): the policy's default when the claim does
/// not ask, the request rounded up to the range's step otherwise, the whole value when the
/// capacity has no policy. `None` when the request violates a policy.
fn consumed(device: &Device, requests: &BTreeMap<&str, u128>) -> Option<BTreeMap<String, u128>> {
    let mut out = BTreeMap::new();
    for (name, cap) in device.capacity.iter().flatten() {
        let requested = requests.get(name.as_str()).copied();
        let amount = match (&cap.request_policy, requested) {
            (None, None) => q(&cap.value.0),
            (None, Some(r)) => r,
            (Some(p), None) => q(&p.default.as_ref()?.0),
            (Some(p), Some(r)) => match (&p.valid_range, p.valid_values.as_deref()) {
                (Some(range), _) => {
                    let min = q(&range.min.0);
                    let step = range.step.as_ref().map_or(1, |s| q(&s.0));
                    let v = if r < min {
                        min
                    } else {
                        min + (r - min).div_ceil(step) * step
                    };
                    if range.max.as_ref().is_some_and(|m| v > q(&m.0)) {
                        return None;
                    }
                    v
                }
                // Rounded up to the next valid value; none that large violates the policy.
                (None, Some(values)) => values.iter().map(|v| q(&v.0)).find(|v| *v >= r)?,
                (None, None) => r,
            },
        };
        out.insert(name.clone(), amount);
    }
    Some(out)
}

/// Whether `claims` (each a map of capacity requests) can all hold `device` at once under the
/// allocator's capacity rule: per capacity, the sum of what each consumes is at most its value.
fn capacity_admits(device: &Device, claims: &[BTreeMap<&str, u128>]) -> bool {
    let mut total: BTreeMap<String, u128> = BTreeMap::new();
    for claim in claims {
        let Some(consumed) = consumed(device, claim) else {
            return false;
        };
        for (name, amount) in consumed {
            *total.entry(name).or_default() += amount;
        }
    }
    device
        .capacity
        .iter()
        .flatten()
        .all(|(name, cap)| total.get(name).copied().unwrap_or(0) <= q(&cap.value.0))
}

#[test]
fn shared_profiles_render_as_multi_allocatable_devices_with_a_shares_capacity() {
    let gpus = h100s(2);
    let plan = plan_pool(&gpus, &sharing(&["1g.10gb"], 3));
    let slices = render(&gpus, &plan);
    validate_pool(&slices).expect("a pool with shared devices is valid");
    let devices = rendered_devices(&slices);
    let (shared, exclusive): (Vec<&Device>, Vec<&Device>) = devices
        .iter()
        .partition(|d| d.allow_multiple_allocations == Some(true));
    // An H100 has 7 placements of 1g.10gb.
    assert_eq!(shared.len(), 14, "every 1g.10gb placement on both GPUs is shared");
    for device in &shared {
        let attributes = device.attributes.as_ref().unwrap();
        assert_eq!(attributes["profile"].string.as_deref(), Some("1g.10gb"));
        let capacity = device.capacity.as_ref().unwrap();
        let shares = &capacity[SHARES_CAPACITY];
        assert_eq!(shares.value.0, "3");
        let policy = shares.request_policy.as_ref().unwrap();
        assert_eq!(policy.default.as_ref().unwrap().0, "1");
        let range = policy.valid_range.as_ref().unwrap();
        assert_eq!(
            (
                range.min.0.as_str(),
                range.max.as_ref().unwrap().0.as_str(),
                range.step.as_ref().unwrap().0.as_str()
            ),
            ("1", "3", "1")
        );
        for (name, cap) in capacity.iter().filter(|(n, _)| *n != SHARES_CAPACITY) {
            let policy = cap
                .request_policy
                .as_ref()
                .unwrap_or_else(|| panic!("{name} has no policy"));
            assert_eq!(policy.default.as_ref().unwrap().0, "0", "{name}");
        }
        assert!(
            device.consumes_counters.as_ref().is_some_and(|c| !c.is_empty()),
            "a shared partition still blocks its memory slices"
        );
    }
    for device in &exclusive {
        assert_eq!(device.allow_multiple_allocations, None);
        let capacity = device.capacity.as_ref().unwrap();
        assert!(!capacity.contains_key(SHARES_CAPACITY), "{}", device.name);
        assert!(
            capacity.values().all(|c| c.request_policy.is_none()),
            "{}",
            device.name
        );
    }
    assert!(
        exclusive.iter().any(|d| d.name == "gpu-0"),
        "whole GPUs stay exclusive"
    );
    // Nothing shared without the opt-in.
    let plain = rendered_devices(&render(&gpus, &plan_pool(&gpus, &dynamic())));
    assert!(plain.iter().all(|d| d.allow_multiple_allocations.is_none()));
}

#[test]
fn claims_fit_a_shared_device_while_their_shares_add_up() {
    let gpus = h100s(1);
    let plan = plan_pool(&gpus, &sharing(&["1g.10gb"], 4));
    let devices = rendered_devices(&render(&gpus, &plan));
    let device = devices
        .iter()
        .find(|d| d.allow_multiple_allocations == Some(true))
        .unwrap();
    let default = BTreeMap::new;
    let asks = |n: u128| BTreeMap::from([(SHARES_CAPACITY, n)]);
    let cases: Vec<(&str, Vec<Requests>, bool)> = vec![
        ("one claim", vec![default()], true),
        ("four default claims", vec![default(); 4], true),
        ("five default claims", vec![default(); 5], false),
        ("2 + 2 shares", vec![asks(2), asks(2)], true),
        ("3 + 2 shares", vec![asks(3), asks(2)], false),
        ("all four shares", vec![asks(4)], true),
        ("more shares than the device has", vec![asks(5)], false),
        ("zero rounds up to one share", vec![asks(0), asks(3)], true),
        ("zero rounds up, then too many", vec![asks(0), asks(4)], false),
        (
            "memory is not divided",
            vec![BTreeMap::from([("memory", 1)])],
            false,
        ),
    ];
    for (what, claims, fits) in cases {
        assert_eq!(capacity_admits(device, &claims), fits, "{what}");
    }
    // Without the zero policies on the descriptive capacities, a second claim would be
    // charged the whole memory again and never fit: the rendering must not regress to that.
    let mut no_policies = device.clone();
    for (name, cap) in no_policies.capacity.iter_mut().flatten() {
        if name != SHARES_CAPACITY {
            cap.request_policy = None;
        }
    }
    assert!(!capacity_admits(&no_policies, &[default(), default()]));
}

#[test]
fn request_policies_are_validated_like_the_api_server_does() {
    let gpus = h100s(1);
    let plan = plan_pool(&gpus, &sharing(&["1g.10gb"], 2));
    let slices = render(&gpus, &plan);
    let breakages: Vec<(&str, Breakage)> = vec![
        (
            "a policy on an exclusive device",
            Box::new(|d| d.allow_multiple_allocations = None),
        ),
        (
            "max above the capacity",
            Box::new(|d| {
                let cap = d.capacity.as_mut().unwrap().get_mut(SHARES_CAPACITY).unwrap();
                cap.value.0 = "1".into();
            }),
        ),
        (
            "no default",
            Box::new(|d| {
                let cap = d.capacity.as_mut().unwrap().get_mut(SHARES_CAPACITY).unwrap();
                cap.request_policy.as_mut().unwrap().default = None;
            }),
        ),
        (
            "default not a valid value",
            Box::new(|d| {
                let cap = d.capacity.as_mut().unwrap().get_mut("memory").unwrap();
                cap.request_policy.as_mut().unwrap().default = Some(Quantity("1".into()));
            }),
        ),
        (
            "both validValues and validRange",
            Box::new(|d| {
                let cap = d.capacity.as_mut().unwrap().get_mut(SHARES_CAPACITY).unwrap();
                cap.request_policy.as_mut().unwrap().valid_values = Some(vec![Quantity("1".into())]);
            }),
        ),
    ];
    for (what, breaks) in breakages {
        let mut broken = slices.clone();
        let device = broken
            .iter_mut()
            .flat_map(|s| s.devices.iter_mut().flatten())
            .find(|d| d.allow_multiple_allocations == Some(true))
            .unwrap();
        breaks(device);
        let errors = validate_pool(&broken).expect_err(what);
        assert!(
            errors
                .iter()
                .any(|e| matches!(e, PoolError::Device { reason, .. } if reason.contains("requestPolicy"))),
            "{what}: {errors:?}"
        );
    }
}

#[test]
fn first_fit_stacks_claims_on_one_shared_device_before_opening_the_next() {
    let gpus = h100s(1);
    let plan = plan_pool(&gpus, &sharing(&["1g.10gb"], 3));
    let mut alloc = Allocator::new(&plan);
    let first: Vec<usize> = (0..3).map(|_| alloc.allocate(is_1g10gb).unwrap()).collect();
    assert!(
        first.iter().all(|i| *i == first[0]),
        "three shares of one device: {first:?}"
    );
    assert_eq!(alloc.shares_taken(first[0]), 3);
    let fourth = alloc.allocate(is_1g10gb).unwrap();
    assert_ne!(fourth, first[0], "the full device takes no fourth claim");
    // A claim for two shares skips a device with one left.
    let two = alloc.allocate_shares(is_1g10gb, 2).unwrap();
    assert_eq!(two, fourth, "the second device has two shares left");
    let another_two = alloc.allocate_shares(is_1g10gb, 2).unwrap();
    assert_ne!(another_two, fourth);
    // The shares come back one by one; the counters only with the last.
    let set = counter_set_name(0);
    let initial = plan.counter_sets[0].1.clone();
    for i in [first[0], first[0]] {
        alloc.release(i);
        assert!(alloc.allocated().contains(&first[0]));
    }
    alloc.release(first[0]);
    assert!(!alloc.allocated().contains(&first[0]));
    alloc.release_shares(fourth, 3);
    alloc.release_shares(another_two, 2);
    assert!(alloc.allocated().is_empty());
    assert_eq!(alloc.available(&set), Some(&initial), "every counter is back");
}

/// Physically valid: each held device once, NVML's rules over their placements.
fn layout_is_valid(plan: &PoolPlan, geometry: &MigGeometry, held: impl Iterator<Item = usize>) -> bool {
    let mut layout: Vec<Placement> = Vec::new();
    for i in held {
        if let PlannedKind::Mig { profile, start } = &plan.devices[i].kind {
            let p = Placement {
                profile_id: profile.gi_profile_id,
                start: *start,
            };
            if geometry.check_add(&layout, p).is_err() {
                return false;
            }
            layout.push(p);
        }
    }
    true
}

proptest! {
    /// Any sequence of claims arriving (for 1 to 3 shares, of any profile) and leaving: the
    /// counters left are always the budget minus what the *held* devices consume, each once
    /// however many claims hold it; no device holds more shares than it has; and what is held
    /// is a layout NVML accepts.
    #[test]
    fn a_shared_device_consumes_its_partition_counters_exactly_once(
        ops in proptest::collection::vec((any::<bool>(), 0usize..64, 1u32..4), 1..80),
        shared in proptest::sample::select(vec!["1g", "1g.10gb", "2g", "1g,2g,3g"]),
        shares in 1u32..5,
    ) {
        let gpus = h100s(1);
        let profiles: Vec<&str> = shared.split(',').collect();
        let policy = EffectivePolicy { whole_gpus: true, ..sharing(&profiles, shares) };
        let plan = plan_pool(&gpus, &policy);
        let geometry = catalog::model("H100-80GB").unwrap().geometry();
        let mut alloc = Allocator::new(&plan);
        // Claims holding devices: (device index, shares).
        let mut claims: Vec<(usize, u32)> = Vec::new();
        for (arrive, pick, want) in ops {
            if arrive || claims.is_empty() {
                let index = pick % plan.devices.len();
                let device = &plan.devices[index];
                let wanted = if device.shares.is_some() { want } else { 1 };
                let fits_before = alloc.fits_shares(index, wanted);
                let taken = alloc.take_shares(index, wanted);
                prop_assert_eq!(fits_before, taken);
                if taken {
                    claims.push((index, wanted));
                }
            } else {
                let (index, taken) = claims.remove(pick % claims.len());
                alloc.release_shares(index, taken);
            }
            let held: std::collections::BTreeSet<usize> = claims.iter().map(|(i, _)| *i).collect();
            prop_assert_eq!(alloc.allocated(), &held);
            let mut expected = plan.counter_sets[0].1.clone();
            for i in &held {
                for (name, need) in &plan.devices[*i].consumes {
                    *expected.get_mut(name).unwrap() -= need;
                }
            }
            prop_assert_eq!(alloc.available(&counter_set_name(0)), Some(&expected));
            for i in &held {
                let sum: u32 = claims.iter().filter(|(c, _)| c == i).map(|(_, s)| s).sum();
                match plan.devices[*i].shares {
                    Some(capacity) => {
                        prop_assert_eq!(alloc.shares_taken(*i), sum);
                        prop_assert!(sum <= capacity);
                    }
                    None => prop_assert_eq!(claims.iter().filter(|(c, _)| c == i).count(), 1),
                }
            }
            prop_assert!(layout_is_valid(&plan, &geometry, held.iter().copied()));
        }
    }
}
