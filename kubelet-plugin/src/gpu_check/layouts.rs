//! Layouts: sets of GPU instances side by side on one GPU. Which layouts to try comes from
//! NVML's placement rules alone (no two instances share a memory slice, at most a profile's
//! instance count of it, one `+me` instance per optical-flow engine), so that the engine limits NVML enforces and the counters migdra
//! publishes are checked against each other, not assumed. Pure.

use std::collections::BTreeMap;

use migdra_api::{
    geometry::{MigGeometry, MigProfile},
    inventory::GpuHealth,
    policy::EffectivePolicy,
    slices::{PlannedKind, PoolPlan, allocator::Allocator, counter_model, published_plan},
};

use crate::{gpus::gpu_inventory, nvml::GpuDescription};

/// One GPU instance of a layout.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Member<'a> {
    pub start: u32,
    pub profile: &'a MigProfile,
}

impl Member<'_> {
    fn key(&self) -> (u32, u32) {
        (self.start, self.profile.gi_profile_id)
    }

    pub fn label(&self) -> String {
        format!("{}@{}", self.profile.name, self.start)
    }
}

/// A layout in start order.
pub type Layout<'a> = Vec<Member<'a>>;

pub fn label(layout: &[Member<'_>]) -> String {
    layout.iter().map(Member::label).collect::<Vec<_>>().join(" + ")
}

/// Every layout NVML's rules allow to which no further GPU instance can be added
/// ([`counter_model::maximal_layouts`]: memory slices, instance counts, optical-flow engines),
/// each once, in start order.
pub fn maximal_layouts(profiles: &[MigProfile]) -> Vec<Layout<'_>> {
    // NVML's placement rules need no memory total, only the profiles and their engines.
    let geometry = MigGeometry::new(profiles.to_vec(), 0);
    let mut out: Vec<Layout<'_>> = counter_model::maximal_layouts(&geometry)
        .into_iter()
        .filter_map(|placements| {
            let mut layout = placements
                .iter()
                .map(|p| {
                    let profile = profiles.iter().find(|q| q.gi_profile_id == p.profile_id)?;
                    Some(Member {
                        start: p.start,
                        profile,
                    })
                })
                .collect::<Option<Layout<'_>>>()?;
            layout.sort_by_key(Member::key);
            Some(layout)
        })
        .collect();
    out.sort_by_key(|l: &Layout<'_>| l.iter().map(Member::key).collect::<Vec<_>>());
    out
}

/// Decides layouts with the counters migdra publishes for a GPU, as the scheduler would.
pub struct CounterModel {
    plan: PoolPlan,
    /// Device index by (profile ID, start).
    devices: BTreeMap<(u32, u32), usize>,
}

impl CounterModel {
    /// The published pool of `gpu` with MIG on and no instances.
    pub fn new(gpu: &GpuDescription) -> Self {
        let mut gpu = gpu.clone();
        if let Some(mig) = gpu.mig.as_mut() {
            mig.enabled = true;
            mig.pending_enabled = true;
        }
        let switchable = gpu.architecture.is_some_and(|a| a.mig_mode_switchable());
        let inventory = gpu_inventory(&gpu, &[], &BTreeMap::new(), GpuHealth::healthy(), switchable);
        let (plan, _) = published_plan(&[inventory], &EffectivePolicy::default(), &Default::default());
        let devices = plan
            .devices
            .iter()
            .enumerate()
            .filter_map(|(i, d)| match &d.kind {
                PlannedKind::Mig { profile, start } => Some(((profile.gi_profile_id, *start), i)),
                PlannedKind::Gpu => None,
            })
            .collect();
        Self { plan, devices }
    }

    /// Whether the scheduler could allocate every instance of `layout` at once; `Err` names
    /// the first one it could not (or that is not published at all).
    pub fn accepts(&self, layout: &[Member<'_>]) -> Result<(), String> {
        let mut allocator = Allocator::new(&self.plan);
        for m in layout {
            let Some(&i) = self.devices.get(&(m.profile.gi_profile_id, m.start)) else {
                return Err(format!("{} is not published", m.label()));
            };
            if !allocator.take(i) {
                return Err(format!("{} does not fit next to the others", m.label()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use migdra_api::catalog;

    use super::*;

    fn labels(key: &str) -> Vec<String> {
        let model = catalog::model(key).unwrap();
        maximal_layouts(&model.profiles)
            .iter()
            .map(|l| label(l))
            .collect()
    }

    #[test]
    fn h100_maximal_layouts_include_the_usual_shapes_and_nothing_extendable() {
        let all = labels("H100-80GB");
        for expected in [
            "7g.80gb@0",
            "4g.40gb@0 + 3g.40gb@4",
            "1g.10gb@0 + 1g.10gb@1 + 1g.10gb@2 + 1g.10gb@3 + 1g.10gb@4 + 1g.10gb@5 + 1g.10gb@6",
        ] {
            assert!(
                all.iter().any(|l| l == expected),
                "{expected} missing from {all:#?}"
            );
        }
        // Not maximal: a 1g fits next to the 4g.
        assert!(!all.iter().any(|l| l == "4g.40gb@0"));
        // Each layout once.
        let mut unique = all.clone();
        unique.dedup();
        assert_eq!(unique.len(), all.len());
        // Two +me instances never (instance count 1); the +me cases are there.
        assert!(all.iter().all(|l| l.matches("+me").count() <= 1));
        assert!(all.iter().any(|l| l.contains("1g.10gb+me@")));
    }

    #[test]
    fn the_counters_accept_what_they_publish_and_refuse_what_they_do_not() {
        let model = catalog::model("A30-24GB").unwrap();
        let gpu = crate::nvml::catalog_gpu(0, "A30-24GB", Some(false));
        let counters = CounterModel::new(&gpu);
        let layouts = maximal_layouts(&model.profiles);
        assert!(layouts.iter().all(|l| !l.is_empty()));
        // A30: one optical-flow engine, so NVML never puts its two +me profiles side by side.
        assert!(layouts.iter().all(|l| {
            l.iter()
                .filter(|m| m.profile.name.to_string().contains("+me"))
                .count()
                <= 1
        }));
        assert!(layouts.iter().any(|l| label(l).contains("+me")));
        let refused: Vec<_> = layouts
            .iter()
            .filter(|l| counters.accepts(l).is_err())
            .map(|l| label(l))
            .collect();
        assert!(refused.is_empty(), "{refused:?}");
        let bogus = MigProfile {
            gi_profile_id: 99,
            ..model.profiles[0].clone()
        };
        let err = counters
            .accepts(&[Member {
                start: 0,
                profile: &bogus,
            }])
            .unwrap_err();
        assert!(err.contains("is not published"), "{err}");
    }
}
