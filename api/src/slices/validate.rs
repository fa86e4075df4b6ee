//! Client-side validation of a whole pool before anything is written. The API server checks
//! each slice on its own, but not references between slices; a pool with a duplicate device,
//! a duplicate counter set or a reference to a missing counter is marked invalid by the
//! scheduler as a whole and silently never allocated from. This validator enforces the 1.35+
//! limits and every cross-reference.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{CapacityRequestPolicy, Device, ResourceSliceSpec};

use super::quantity;
use crate::device_name::is_dns_label;

/// Limits of `resource.k8s.io/v1` (Kubernetes 1.35+).
pub mod limits {
    pub const DEVICES_PER_SLICE: usize = 128;
    /// Devices per slice when any device has taints or consumes counters.
    pub const DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS: usize = 64;
    pub const COUNTER_SETS_PER_SLICE: usize = 8;
    pub const COUNTERS_PER_SET: usize = 32;
    pub const CONSUMPTIONS_PER_DEVICE: usize = 2;
    pub const COUNTERS_PER_CONSUMPTION: usize = 32;
    /// Attributes plus capacities per device.
    pub const ATTRIBUTES_AND_CAPACITIES: usize = 32;
    pub const ATTRIBUTE_VALUE_LENGTH: usize = 64;
    pub const TAINTS_PER_DEVICE: usize = 16;
    pub const REQUEST_POLICY_VALID_VALUES: usize = 10;
    pub const DRIVER_NAME_LENGTH: usize = 63;
    pub const POOL_NAME_LENGTH: usize = 253;
    /// Identifier part of a qualified name.
    pub const IDENTIFIER_LENGTH: usize = 32;
    /// Domain part of a qualified name.
    pub const DOMAIN_LENGTH: usize = 63;
}

/// One way a pool breaks the rules. `slice` is the index in the pool.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("a pool needs at least one slice")]
    Empty,
    #[error("driver name {0:?} is not a DNS subdomain of at most 63 characters")]
    DriverName(String),
    #[error("pool name {0:?} must be DNS subdomains joined by '/', at most 253 characters")]
    PoolName(String),
    #[error("slice {slice}: {field} differs from slice 0")]
    Inconsistent { slice: usize, field: &'static str },
    #[error("resourceSliceCount is {declared}, but the pool has {actual} slices")]
    SliceCount { declared: i64, actual: usize },
    #[error("pool generation {0} is negative")]
    Generation(i64),
    #[error("slice {slice}: a slice holds either devices or sharedCounters, not both")]
    Mixed { slice: usize },
    #[error(
        "slice {slice}: exactly one of nodeName, nodeSelector, allNodes or perDeviceNodeSelection must be set"
    )]
    NodeSelection { slice: usize },
    #[error("slice {slice}: {count} devices exceed the limit of {limit}")]
    TooManyDevices {
        slice: usize,
        count: usize,
        limit: usize,
    },
    #[error(
        "slice {slice}: {count} counter sets exceed the limit of {}",
        limits::COUNTER_SETS_PER_SLICE
    )]
    TooManyCounterSets { slice: usize, count: usize },
    #[error("counter set {set:?}: {reason}")]
    CounterSet { set: String, reason: String },
    #[error("counter set {0:?} is defined more than once in the pool")]
    DuplicateCounterSet(String),
    #[error("device name {0:?} is not a DNS label")]
    DeviceName(String),
    #[error("device {0:?} appears more than once in the pool")]
    DuplicateDevice(String),
    #[error("device {device:?}: {reason}")]
    Device { device: String, reason: String },
}

fn is_dns_subdomain(s: &str, max: usize) -> bool {
    !s.is_empty() && s.len() <= max && s.split('.').all(is_dns_label)
}

fn is_c_identifier(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= limits::IDENTIFIER_LENGTH
        && s.chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// `<identifier>` or `<dns subdomain>/<identifier>`.
pub fn is_qualified_name(s: &str) -> bool {
    match s.split_once('/') {
        None => is_c_identifier(s),
        Some((domain, id)) => is_dns_subdomain(domain, limits::DOMAIN_LENGTH) && is_c_identifier(id),
    }
}

fn is_semver(v: &str) -> bool {
    let (core, _) = v.split_once(['-', '+']).unwrap_or((v, ""));
    let parts: Vec<&str> = core.split('.').collect();
    parts.len() == 3
        && parts.iter().all(|p| {
            !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) && (p.len() == 1 || !p.starts_with('0'))
        })
}

/// Validates a whole pool. Returns every problem found, not just the first.
pub fn validate_pool(slices: &[ResourceSliceSpec]) -> Result<(), Vec<PoolError>> {
    let mut errors = Vec::new();
    let Some(first) = slices.first() else {
        return Err(vec![PoolError::Empty]);
    };
    if !is_dns_subdomain(&first.driver, limits::DRIVER_NAME_LENGTH) {
        errors.push(PoolError::DriverName(first.driver.clone()));
    }
    let pool = &first.pool;
    if pool.name.len() > limits::POOL_NAME_LENGTH || !pool.name.split('/').all(|p| is_dns_subdomain(p, 253)) {
        errors.push(PoolError::PoolName(pool.name.clone()));
    }
    if pool.generation < 0 {
        errors.push(PoolError::Generation(pool.generation));
    }
    if usize::try_from(pool.resource_slice_count).ok() != Some(slices.len()) {
        errors.push(PoolError::SliceCount {
            declared: pool.resource_slice_count,
            actual: slices.len(),
        });
    }

    // Counter sets of the whole pool, for the cross-references below.
    let mut sets: BTreeMap<&str, BTreeMap<&str, u128>> = BTreeMap::new();
    for (i, slice) in slices.iter().enumerate() {
        for (field, differs) in [
            ("driver", slice.driver != first.driver),
            ("pool.name", slice.pool.name != pool.name),
            ("pool.generation", slice.pool.generation != pool.generation),
            (
                "pool.resourceSliceCount",
                slice.pool.resource_slice_count != pool.resource_slice_count,
            ),
            ("nodeName", slice.node_name != first.node_name),
        ] {
            if differs {
                errors.push(PoolError::Inconsistent { slice: i, field });
            }
        }
        let selections = [
            slice.node_name.is_some(),
            slice.node_selector.is_some(),
            slice.all_nodes == Some(true),
            slice.per_device_node_selection == Some(true),
        ];
        if selections.iter().filter(|s| **s).count() != 1 {
            errors.push(PoolError::NodeSelection { slice: i });
        }
        let has_devices = slice.devices.as_ref().is_some_and(|d| !d.is_empty());
        let has_counters = slice.shared_counters.as_ref().is_some_and(|c| !c.is_empty());
        if has_devices && has_counters {
            errors.push(PoolError::Mixed { slice: i });
        }
        let counter_sets = slice.shared_counters.as_deref().unwrap_or_default();
        if counter_sets.len() > limits::COUNTER_SETS_PER_SLICE {
            errors.push(PoolError::TooManyCounterSets {
                slice: i,
                count: counter_sets.len(),
            });
        }
        for set in counter_sets {
            if !is_dns_label(&set.name) {
                errors.push(PoolError::CounterSet {
                    set: set.name.clone(),
                    reason: "name is not a DNS label".into(),
                });
            }
            if set.counters.is_empty() || set.counters.len() > limits::COUNTERS_PER_SET {
                errors.push(PoolError::CounterSet {
                    set: set.name.clone(),
                    reason: format!(
                        "has {} counters; 1 to {} are allowed",
                        set.counters.len(),
                        limits::COUNTERS_PER_SET
                    ),
                });
            }
            let mut values = BTreeMap::new();
            for (name, counter) in &set.counters {
                if !is_dns_label(name) {
                    errors.push(PoolError::CounterSet {
                        set: set.name.clone(),
                        reason: format!("counter {name:?} is not a DNS label"),
                    });
                }
                match quantity::parse(&counter.value.0) {
                    Some(v) => {
                        values.insert(name.as_str(), v);
                    }
                    None => errors.push(PoolError::CounterSet {
                        set: set.name.clone(),
                        reason: format!(
                            "counter {name}: {:?} is not a non-negative integer quantity",
                            counter.value.0
                        ),
                    }),
                }
            }
            if sets.insert(set.name.as_str(), values).is_some() {
                errors.push(PoolError::DuplicateCounterSet(set.name.clone()));
            }
        }
    }

    let mut names = BTreeSet::new();
    for (i, slice) in slices.iter().enumerate() {
        let devices = slice.devices.as_deref().unwrap_or_default();
        let constrained = devices.iter().any(|d| {
            d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty())
                || d.taints.as_ref().is_some_and(|t| !t.is_empty())
        });
        let limit = if constrained {
            limits::DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS
        } else {
            limits::DEVICES_PER_SLICE
        };
        if devices.len() > limit {
            errors.push(PoolError::TooManyDevices {
                slice: i,
                count: devices.len(),
                limit,
            });
        }
        for device in devices {
            if !is_dns_label(&device.name) {
                errors.push(PoolError::DeviceName(device.name.clone()));
            }
            if !names.insert(device.name.as_str()) {
                errors.push(PoolError::DuplicateDevice(device.name.clone()));
            }
            validate_device(device, &sets, &mut errors);
        }
    }
    if errors.is_empty() { Ok(()) } else { Err(errors) }
}

/// The API server's rules for a consumable capacity's request policy (1.37, integer
/// quantities): at most one of `validValues` and `validRange`, a `default` with either, every
/// bound within the capacity, the default a valid request, steps that land on the bounds.
fn check_request_policy(capacity: u128, policy: &CapacityRequestPolicy) -> Result<(), String> {
    let parse = |what: &str, q: &k8s_openapi::apimachinery::pkg::api::resource::Quantity| {
        quantity::parse(&q.0)
            .ok_or_else(|| format!("{what} {:?} is not a non-negative integer quantity", q.0))
    };
    let default = policy.default.as_ref().map(|d| parse("default", d)).transpose()?;
    let values = policy.valid_values.as_deref().unwrap_or_default();
    match (&policy.valid_range, values.is_empty()) {
        (Some(_), false) => Err("sets both validValues and validRange".into()),
        (None, false) => {
            let default = default.ok_or("needs a default with validValues")?;
            if values.len() > limits::REQUEST_POLICY_VALID_VALUES {
                return Err(format!(
                    "has {} validValues; at most {}",
                    values.len(),
                    limits::REQUEST_POLICY_VALID_VALUES
                ));
            }
            let values = values
                .iter()
                .map(|v| parse("valid value", v))
                .collect::<Result<Vec<_>, _>>()?;
            if !values.is_sorted() || values.windows(2).any(|w| w[0] == w[1]) {
                return Err("validValues must be ascending and distinct".into());
            }
            if values.last().is_some_and(|v| *v > capacity) {
                return Err("has a valid value larger than the capacity".into());
            }
            if !values.contains(&default) {
                return Err("default is not one of validValues".into());
            }
            Ok(())
        }
        (Some(range), true) => {
            let default = default.ok_or("needs a default with validRange")?;
            let min = parse("min", &range.min)?;
            let max = range.max.as_ref().map(|m| parse("max", m)).transpose()?;
            let step = range.step.as_ref().map(|s| parse("step", s)).transpose()?;
            if min > capacity || max.is_some_and(|m| m > capacity || m < min) {
                return Err("range bounds must satisfy min <= max <= capacity".into());
            }
            if default < min || max.is_some_and(|m| default > m) {
                return Err("default lies outside validRange".into());
            }
            if let Some(step) = step {
                if step == 0 || min + step > capacity {
                    return Err("step must be positive and min + step at most the capacity".into());
                }
                let on_step = |v: u128| (v - min).is_multiple_of(step);
                if !on_step(default) || max.is_some_and(|m| !on_step(m)) {
                    return Err("default and max must be min plus a multiple of step".into());
                }
            }
            Ok(())
        }
        (None, true) => Ok(()),
    }
}

fn validate_device(
    device: &Device,
    sets: &BTreeMap<&str, BTreeMap<&str, u128>>,
    errors: &mut Vec<PoolError>,
) {
    let mut fail = |reason: String| {
        errors.push(PoolError::Device {
            device: device.name.clone(),
            reason,
        })
    };
    let attributes = device.attributes.as_ref();
    let capacity = device.capacity.as_ref();
    let total = attributes.map_or(0, |a| a.len()) + capacity.map_or(0, |c| c.len());
    if total > limits::ATTRIBUTES_AND_CAPACITIES {
        fail(format!(
            "{total} attributes and capacities exceed {}",
            limits::ATTRIBUTES_AND_CAPACITIES
        ));
    }
    for (name, value) in attributes.into_iter().flatten() {
        if !is_qualified_name(name) {
            fail(format!("attribute name {name:?} is not a qualified name"));
        }
        let set = [
            value.bool.is_some(),
            value.int.is_some(),
            value.string.is_some(),
            value.version.is_some(),
        ];
        if set.iter().filter(|s| **s).count() != 1 {
            fail(format!(
                "attribute {name} must set exactly one of bool, int, string, version"
            ));
        }
        if let Some(s) = &value.string
            && s.len() > limits::ATTRIBUTE_VALUE_LENGTH
        {
            fail(format!(
                "attribute {name} is longer than {} bytes",
                limits::ATTRIBUTE_VALUE_LENGTH
            ));
        }
        if let Some(v) = &value.version
            && (v.len() > limits::ATTRIBUTE_VALUE_LENGTH || !is_semver(v))
        {
            fail(format!(
                "attribute {name}: {v:?} is not a semantic version of at most 64 bytes"
            ));
        }
    }
    for (name, cap) in capacity.into_iter().flatten() {
        if !is_qualified_name(name) {
            fail(format!("capacity name {name:?} is not a qualified name"));
        }
        let Some(value) = quantity::parse(&cap.value.0) else {
            fail(format!(
                "capacity {name}: {:?} is not a non-negative integer quantity",
                cap.value.0
            ));
            continue;
        };
        if let Some(policy) = &cap.request_policy {
            if device.allow_multiple_allocations != Some(true) {
                fail(format!(
                    "capacity {name}: a requestPolicy needs allowMultipleAllocations: true"
                ));
            } else if let Err(reason) = check_request_policy(value, policy) {
                fail(format!("capacity {name}: requestPolicy {reason}"));
            }
        }
    }
    if device
        .taints
        .as_ref()
        .is_some_and(|t| t.len() > limits::TAINTS_PER_DEVICE)
    {
        fail(format!("more than {} taints", limits::TAINTS_PER_DEVICE));
    }
    let consumptions = device.consumes_counters.as_deref().unwrap_or_default();
    if consumptions.len() > limits::CONSUMPTIONS_PER_DEVICE {
        fail(format!(
            "{} counter consumptions exceed {}",
            consumptions.len(),
            limits::CONSUMPTIONS_PER_DEVICE
        ));
    }
    let mut seen_sets = BTreeSet::new();
    for consumption in consumptions {
        if !seen_sets.insert(consumption.counter_set.as_str()) {
            fail(format!("consumes counter set {} twice", consumption.counter_set));
        }
        if consumption.counters.len() > limits::COUNTERS_PER_CONSUMPTION {
            fail(format!(
                "consumes {} counters from one set; at most {}",
                consumption.counters.len(),
                limits::COUNTERS_PER_CONSUMPTION
            ));
        }
        let Some(set) = sets.get(consumption.counter_set.as_str()) else {
            fail(format!(
                "consumes from counter set {:?}, which the pool does not define",
                consumption.counter_set
            ));
            continue;
        };
        for (name, counter) in &consumption.counters {
            let Some(available) = set.get(name.as_str()) else {
                fail(format!(
                    "consumes counter {name:?}, which counter set {} does not define",
                    consumption.counter_set
                ));
                continue;
            };
            match quantity::parse(&counter.value.0) {
                None => fail(format!(
                    "consumption of {name}: {:?} is not a non-negative integer quantity",
                    counter.value.0
                )),
                Some(need) if need > *available => fail(format!(
                    "consumes {need} of counter {name}, more than the {available} its set holds: it could never be allocated"
                )),
                Some(_) => {}
            }
        }
    }
}
