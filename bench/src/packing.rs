//! Packing simulation: how many MIG claims a device order lets the scheduler place, on
//! random mixed claim streams, compared with the best any placement choice could do.
//!
//! Each claim asks for one exact profile. Claims are placed by first fit over the pool order
//! (as the scheduler does); a claim that fits nowhere is rejected. B7 reports it
//! ([`crate::measure::packing`]); the tests below justify the default device order.

use migdra_api::{
    catalog::GpuModel,
    geometry::{MigGeometry, Placement},
    policy::{DeviceOrder, EffectivePolicy},
    profile::{ProfileName, ProfileVariant},
    slices::{PlannedKind, PoolPlan, allocator::Allocator, plan_pool},
};

/// The pool of `gpus` GPUs of `model` with MIG on, in `order`, without whole-GPU devices.
pub fn plan(model: &GpuModel, gpus: u32, order: DeviceOrder) -> PoolPlan {
    let inventory: Vec<_> = (0..gpus).map(|m| model.inventory(m, true)).collect();
    plan_pool(
        &inventory,
        &EffectivePolicy {
            device_order: order,
            whole_gpus: false,
            ..Default::default()
        },
    )
}

/// The claims of an arrival-only stream, in order.
pub fn arrivals(events: Vec<Event>) -> Vec<ProfileName> {
    events
        .into_iter()
        .filter_map(|e| match e {
            Event::Arrive { profile, .. } => Some(profile),
            Event::Depart { .. } => None,
        })
        .collect()
}

/// A claim stream event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Claim `id` asks for `profile`.
    Arrive {
        /// Claim ID.
        id: usize,
        /// Requested profile.
        profile: ProfileName,
    },
    /// Claim `id` is released (if it was placed).
    Depart {
        /// Claim ID.
        id: usize,
    },
}

/// A small deterministic PRNG (xorshift64*), so simulations are reproducible from a seed.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// Seeds the generator (0 is mapped to a fixed non-zero seed).
    pub fn new(seed: u64) -> Self {
        Self(if seed == 0 { 0x9e37_79b9_7f4a_7c15 } else { seed })
    }

    /// Next value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}

/// The profiles a stream draws from: every plain (non-media) profile of the geometry.
pub fn stream_profiles(geometry: &MigGeometry) -> Vec<ProfileName> {
    geometry
        .profiles
        .iter()
        .filter(|p| p.name.variant == ProfileVariant::Standard)
        .map(|p| p.name)
        .collect()
}

/// A random stream of `arrivals` claims drawn uniformly from `profiles`; each claim is released
/// after between 1 and `2 * mean_hold` later arrivals (0 = never released).
pub fn random_stream(profiles: &[ProfileName], seed: u64, arrivals: usize, mean_hold: usize) -> Vec<Event> {
    let mut rng = Rng::new(seed);
    let mut departures: Vec<(usize, usize)> = Vec::new(); // (due at arrival number, id)
    let mut events = Vec::new();
    for id in 0..arrivals {
        departures.sort_unstable();
        while departures.first().is_some_and(|(due, _)| *due <= id) {
            let (_, gone) = departures.remove(0);
            events.push(Event::Depart { id: gone });
        }
        events.push(Event::Arrive {
            id,
            profile: profiles[rng.below(profiles.len())],
        });
        if mean_hold > 0 {
            departures.push((id + 1 + rng.below(2 * mean_hold), id));
        }
    }
    events
}

/// Runs a stream against a pool by first fit; returns (accepted, rejected).
pub fn first_fit(plan: &PoolPlan, events: &[Event]) -> (usize, usize) {
    let mut allocator = Allocator::new(plan);
    let mut placed = std::collections::HashMap::new();
    let (mut accepted, mut rejected) = (0, 0);
    for event in events {
        match event {
            Event::Arrive { id, profile } => {
                let hit = allocator.allocate(
                    |d| matches!(&d.kind, PlannedKind::Mig { profile: p, .. } if p.name == *profile),
                );
                match hit {
                    Some(index) => {
                        placed.insert(*id, index);
                        accepted += 1;
                    }
                    None => rejected += 1,
                }
            }
            Event::Depart { id } => {
                if let Some(index) = placed.remove(id) {
                    allocator.release(index);
                }
            }
        }
    }
    (accepted, rejected)
}

/// The most of `requests` (arrivals only, no releases) that `gpus` GPUs of `geometry` can
/// hold at once with the best placement choices, free to refuse any request: an offline bound
/// no scheduler reaches. Exhaustive, for small inputs.
pub fn optimum(geometry: &MigGeometry, gpus: usize, requests: &[ProfileName]) -> usize {
    exhaustive(geometry, gpus, requests, true)
}

/// The most of `requests` (arrivals only, in order) that can be placed when every request
/// that fits somewhere must be placed (as a scheduler must), choosing each placement with
/// hindsight: the best any device order could do on this stream. Exhaustive, for small inputs.
pub fn optimum_online(geometry: &MigGeometry, gpus: usize, requests: &[ProfileName]) -> usize {
    exhaustive(geometry, gpus, requests, false)
}

/// Branch and bound over every placement of every request; `may_refuse` also explores
/// refusing a request that would fit.
fn exhaustive(geometry: &MigGeometry, gpus: usize, requests: &[ProfileName], may_refuse: bool) -> usize {
    struct Search<'a> {
        geometry: &'a MigGeometry,
        may_refuse: bool,
        best: usize,
    }
    impl Search<'_> {
        fn run(&mut self, layouts: &mut Vec<Vec<Placement>>, requests: &[ProfileName], placed: usize) {
            if placed + requests.len() <= self.best {
                return; // cannot beat the best found
            }
            let Some((first, rest)) = requests.split_first() else {
                self.best = self.best.max(placed);
                return;
            };
            let mut fitted = false;
            if let Some(profile) = self.geometry.profile_by_name(first) {
                for gpu in 0..layouts.len() {
                    // GPUs with identical layouts are interchangeable: try only the first.
                    if layouts[..gpu].contains(&layouts[gpu]) {
                        continue;
                    }
                    for start in &profile.placements {
                        let candidate = Placement {
                            profile_id: profile.gi_profile_id,
                            start: *start,
                        };
                        if self.geometry.check_add(&layouts[gpu], candidate).is_ok() {
                            fitted = true;
                            layouts[gpu].push(candidate);
                            self.run(layouts, rest, placed + 1);
                            layouts[gpu].pop();
                        }
                    }
                }
            }
            if self.may_refuse || !fitted {
                self.run(layouts, rest, placed);
            }
        }
    }
    let mut search = Search {
        geometry,
        may_refuse,
        best: 0,
    };
    search.run(&mut vec![Vec::new(); gpus], requests, 0);
    search.best
}

/// First-fit acceptance of arrival-only requests.
pub fn first_fit_arrivals(plan: &PoolPlan, requests: &[ProfileName]) -> usize {
    let events: Vec<Event> = requests
        .iter()
        .enumerate()
        .map(|(id, p)| Event::Arrive { id, profile: *p })
        .collect();
    first_fit(plan, &events).0
}

#[cfg(test)]
mod tests {
    use migdra_api::catalog;

    use super::*;

    #[test]
    fn packed_order_accepts_at_least_as_many_claims_as_naive_on_random_streams() {
        // Justifies the default: on every model, over many seeded mixed streams with releases
        // on two GPUs, first fit over the Packed order places at least as many claims in total
        // as the naive order, and strictly more on most models.
        let mut strictly_better = 0;
        for model in catalog::models() {
            let profiles = stream_profiles(&model.geometry());
            let (packed_plan, naive_plan) = (
                plan(model, 2, DeviceOrder::Packed),
                plan(model, 2, DeviceOrder::Naive),
            );
            let (mut packed, mut naive) = (0, 0);
            for seed in 1..=40 {
                let events = random_stream(&profiles, seed, 200, 6);
                packed += first_fit(&packed_plan, &events).0;
                naive += first_fit(&naive_plan, &events).0;
            }
            assert!(
                packed >= naive,
                "{}: packed placed {packed}, naive {naive}",
                model.key
            );
            if packed > naive {
                strictly_better += 1;
            }
        }
        assert!(
            strictly_better * 2 > catalog::models().len(),
            "packed beat naive on only {strictly_better} models"
        );
    }

    #[test]
    fn packed_order_is_near_the_best_placement_on_small_arrival_streams() {
        // Arrival-only streams of 8 claims on one GPU. The exhaustive optimum places every
        // claim that fits somewhere (as a scheduler must) but picks each placement with
        // hindsight: the best any device order could do. Packed must reach at least 97% of it
        // in total and place at least as many claims as the naive order.
        for model in catalog::models() {
            let geometry = model.geometry();
            let profiles = stream_profiles(&geometry);
            let packed_plan = plan(model, 1, DeviceOrder::Packed);
            let naive_plan = plan(model, 1, DeviceOrder::Naive);
            let (mut packed, mut naive, mut best) = (0, 0, 0);
            for seed in 1..=150 {
                let requests = arrivals(random_stream(&profiles, seed, 8, 0));
                let optimum = optimum_online(&geometry, 1, &requests);
                let p = first_fit_arrivals(&packed_plan, &requests);
                let n = first_fit_arrivals(&naive_plan, &requests);
                assert!(
                    p <= optimum && n <= optimum,
                    "{}: first fit beat the exhaustive optimum",
                    model.key
                );
                assert!(optimum <= self::optimum(&geometry, 1, &requests));
                packed += p;
                naive += n;
                best += optimum;
            }
            assert!(
                packed * 100 >= best * 97,
                "{}: packed {packed} vs optimum {best}",
                model.key
            );
            assert!(packed >= naive, "{}: packed {packed} vs naive {naive}", model.key);
        }
    }
}
