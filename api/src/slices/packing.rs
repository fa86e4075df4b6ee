//! Packing simulation: how many MIG claims a device order lets the scheduler place, on
//! random mixed claim streams, compared with the best any placement choice could do.
//!
//! Each claim asks for one exact profile. Claims are placed by first fit over the pool order
//! (as the scheduler does); a claim that fits nowhere is rejected. Used by the tests that
//! justify the default order and by `cargo run -p migdra-api --example packing`.

use super::{PlannedKind, PoolPlan, allocator::Allocator};
use crate::{
    geometry::{MigGeometry, Placement},
    profile::{ProfileName, ProfileVariant},
};

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
