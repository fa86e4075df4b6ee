//! A model of the scheduler's allocator over one pool: devices are tried in pool order, and
//! the first one that matches the request and whose counter consumption fits what is left
//! of its counter set is taken. Used by the property tests and the packing simulation.

use std::collections::{BTreeMap, BTreeSet};

use super::{Counters, PlannedDevice, PoolPlan};

/// Allocation state over one pool.
#[derive(Clone, Debug)]
pub struct Allocator<'a> {
    plan: &'a PoolPlan,
    available: BTreeMap<String, Counters>,
    allocated: BTreeSet<usize>,
}

impl<'a> Allocator<'a> {
    /// Nothing allocated.
    pub fn new(plan: &'a PoolPlan) -> Self {
        Self {
            plan,
            available: plan.counter_sets.iter().cloned().collect(),
            allocated: BTreeSet::new(),
        }
    }

    /// True when device `index` could be allocated now.
    pub fn fits(&self, index: usize) -> bool {
        let Some(device) = self.plan.devices.get(index) else {
            return false;
        };
        if self.allocated.contains(&index) {
            return false;
        }
        match &device.counter_set {
            None => true,
            Some(set) => {
                let Some(left) = self.available.get(set) else {
                    return false;
                };
                device
                    .consumes
                    .iter()
                    .all(|(name, need)| left.get(name).is_some_and(|have| have >= need))
            }
        }
    }

    /// Allocates device `index` if it fits.
    pub fn take(&mut self, index: usize) -> bool {
        if !self.fits(index) {
            return false;
        }
        self.allocated.insert(index);
        if let Some(set) = &self.plan.devices[index].counter_set
            && let Some(left) = self.available.get_mut(set)
        {
            for (name, need) in &self.plan.devices[index].consumes {
                if let Some(have) = left.get_mut(name) {
                    *have -= need;
                }
            }
        }
        true
    }

    /// First fit: the first device in pool order that matches and fits; allocates it.
    pub fn allocate(&mut self, matches: impl Fn(&PlannedDevice) -> bool) -> Option<usize> {
        let index =
            (0..self.plan.devices.len()).find(|i| matches(&self.plan.devices[*i]) && self.fits(*i))?;
        self.take(index);
        Some(index)
    }

    /// Releases an allocated device.
    pub fn release(&mut self, index: usize) {
        if !self.allocated.remove(&index) {
            return;
        }
        if let Some(set) = &self.plan.devices[index].counter_set
            && let Some(left) = self.available.get_mut(set)
        {
            for (name, need) in &self.plan.devices[index].consumes {
                if let Some(have) = left.get_mut(name) {
                    *have += need;
                }
            }
        }
    }

    /// Allocated device indexes.
    pub fn allocated(&self) -> &BTreeSet<usize> {
        &self.allocated
    }
}
