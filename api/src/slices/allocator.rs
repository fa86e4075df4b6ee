//! A model of the scheduler's allocator over one pool: devices are tried in pool order, and
//! the first one that matches the request and whose counter consumption fits what is left
//! of its counter set is taken. Used by `kubectl migdra`, the property tests and the packing
//! simulation.
//!
//! A shared device ([`PlannedDevice::shares`], `allowMultipleAllocations`) follows the
//! DRAConsumableCapacity rules of the 1.37 allocator: several allocations may hold it while
//! their shares add up to at most its `shares` capacity, and its counters are charged by the
//! first allocation only (a further share skips the counter check) and given back when the
//! last one is released.

use std::collections::{BTreeMap, BTreeSet};

use super::{Counters, PlannedDevice, PoolPlan};

/// Allocation state over one pool.
#[derive(Clone, Debug)]
pub struct Allocator<'a> {
    plan: &'a PoolPlan,
    available: BTreeMap<String, Counters>,
    allocated: BTreeSet<usize>,
    /// Shares taken per held shared device (an entry exists exactly while it is held).
    shares_taken: BTreeMap<usize, u32>,
}

impl<'a> Allocator<'a> {
    pub fn new(plan: &'a PoolPlan) -> Self {
        Self {
            plan,
            available: plan.counter_sets.iter().cloned().collect(),
            allocated: BTreeSet::new(),
            shares_taken: BTreeMap::new(),
        }
    }

    /// True when device `index` could be allocated now (one share of a shared device).
    pub fn fits(&self, index: usize) -> bool {
        self.fits_shares(index, 1)
    }

    /// True when `shares` shares of device `index` could be allocated now. For an exclusive
    /// device, `shares` is ignored: it fits when nobody holds it and its counters fit.
    pub fn fits_shares(&self, index: usize, shares: u32) -> bool {
        let Some(device) = self.plan.devices.get(index) else {
            return false;
        };
        if let Some(capacity) = device.shares {
            let taken = self.shares_taken.get(&index).copied();
            if shares == 0 || taken.unwrap_or(0).saturating_add(shares) > capacity {
                return false;
            }
            if taken.is_some() {
                // Already held: its counters are charged, a further share does not need them.
                return true;
            }
        } else if self.allocated.contains(&index) {
            return false;
        }
        self.counters_fit(device)
    }

    fn counters_fit(&self, device: &PlannedDevice) -> bool {
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

    /// Allocates device `index` if it fits (one share of a shared device).
    pub fn take(&mut self, index: usize) -> bool {
        self.take_shares(index, 1)
    }

    /// Allocates `shares` shares of device `index` (for an exclusive device: the device) if
    /// they fit. The counters are charged when the device goes from free to held.
    pub fn take_shares(&mut self, index: usize, shares: u32) -> bool {
        if !self.fits_shares(index, shares) {
            return false;
        }
        let device = &self.plan.devices[index];
        if device.shares.is_some() {
            *self.shares_taken.entry(index).or_insert(0) += shares;
        }
        if self.allocated.insert(index) {
            self.charge(index, false);
        }
        true
    }

    /// First fit: the first device in pool order that matches and fits; allocates it.
    pub fn allocate(&mut self, matches: impl Fn(&PlannedDevice) -> bool) -> Option<usize> {
        self.allocate_shares(matches, 1)
    }

    /// First fit of a request for `shares` shares (ignored by exclusive devices).
    pub fn allocate_shares(
        &mut self,
        matches: impl Fn(&PlannedDevice) -> bool,
        shares: u32,
    ) -> Option<usize> {
        let index = (0..self.plan.devices.len())
            .find(|i| matches(&self.plan.devices[*i]) && self.fits_shares(*i, shares))?;
        self.take_shares(index, shares);
        Some(index)
    }

    /// Releases an allocated device (one share of a shared device).
    pub fn release(&mut self, index: usize) {
        self.release_shares(index, 1);
    }

    /// Releases `shares` shares of device `index` (for an exclusive device: the device). The
    /// counters come back when the last share is released.
    pub fn release_shares(&mut self, index: usize, shares: u32) {
        if !self.allocated.contains(&index) {
            return;
        }
        if let Some(taken) = self.shares_taken.get_mut(&index) {
            *taken = taken.saturating_sub(shares);
            if *taken > 0 {
                return;
            }
            self.shares_taken.remove(&index);
        }
        self.allocated.remove(&index);
        self.charge(index, true);
    }

    fn charge(&mut self, index: usize, give_back: bool) {
        let device = &self.plan.devices[index];
        if let Some(set) = &device.counter_set
            && let Some(left) = self.available.get_mut(set)
        {
            for (name, need) in &device.consumes {
                if let Some(have) = left.get_mut(name) {
                    if give_back {
                        *have += need;
                    } else {
                        *have -= need;
                    }
                }
            }
        }
    }

    /// Allocated device indexes (a shared device is listed once, however many hold it).
    pub fn allocated(&self) -> &BTreeSet<usize> {
        &self.allocated
    }

    /// Shares taken of shared device `index` (0 when free or exclusive).
    pub fn shares_taken(&self, index: usize) -> u32 {
        self.shares_taken.get(&index).copied().unwrap_or(0)
    }

    /// What is left of counter set `set`.
    pub fn available(&self, set: &str) -> Option<&Counters> {
        self.available.get(set)
    }
}
