//! Which devices of a pool claims hold, from the ResourceClaims' allocation results.
//!
//! A device that a claim holds must stay in its pool (tainted if no longer offered) until the
//! claim releases it, or the scheduler forgets its counter consumption (see
//! [`migdra_api::slices::retained`]). The controller watches every ResourceClaim, keeps only
//! the allocation results of its own driver ([`strip_claim`], so the cache stays small), and
//! reconciles the nodes whose pools a claim's allocation names, before and after each change
//! ([`ClaimChanges`]), so a released device leaves the pool promptly.

use std::{
    collections::{BTreeSet, HashMap},
    sync::Arc,
};

use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationResult, ResourceClaim, ResourceClaimSpec, ResourceClaimStatus,
};
use kube::{ResourceExt, runtime::watcher};
use migdra_api::inventory::pool_name;

/// The node whose pool `pool` is, for this driver's pool naming (`<node>/<driver>`).
pub fn node_of_pool<'a>(pool: &'a str, driver: &str) -> Option<&'a str> {
    let node = pool.strip_suffix(driver)?.strip_suffix('/')?;
    (!node.is_empty() && pool_name(node, driver) == pool).then_some(node)
}

/// The device names of `driver`'s pool `pool` that `claims` have allocated.
pub fn allocated_devices<'a>(
    claims: impl IntoIterator<Item = &'a ResourceClaim>,
    driver: &str,
    pool: &str,
) -> BTreeSet<String> {
    claims
        .into_iter()
        .flat_map(results)
        .filter(|r| r.driver == driver && r.pool == pool)
        .map(|r| r.device.clone())
        .collect()
}

fn results(
    claim: &ResourceClaim,
) -> impl Iterator<Item = &k8s_openapi::api::resource::v1::DeviceRequestAllocationResult> {
    claim
        .status
        .iter()
        .flat_map(|s| &s.allocation)
        .flat_map(|a| &a.devices)
        .flat_map(|d| d.results.iter().flatten())
}

/// The nodes whose pools (of `driver`) `claim`'s allocation names.
pub fn claim_nodes(claim: &ResourceClaim, driver: &str) -> BTreeSet<String> {
    results(claim)
        .filter(|r| r.driver == driver)
        .filter_map(|r| node_of_pool(&r.pool, driver).map(str::to_string))
        .collect()
}

/// Cuts a claim down to what the controller needs before it enters the cache: its identity
/// and this driver's allocation results.
pub fn strip_claim(claim: &mut ResourceClaim, driver: &str) {
    claim.metadata.managed_fields = None;
    claim.metadata.annotations = None;
    claim.metadata.labels = None;
    claim.metadata.owner_references = None;
    claim.spec = ResourceClaimSpec::default();
    let results: Vec<_> = results(claim).filter(|r| r.driver == driver).cloned().collect();
    claim.status = (!results.is_empty()).then(|| ResourceClaimStatus {
        allocation: Some(AllocationResult {
            devices: Some(DeviceAllocationResult {
                results: Some(results),
                config: None,
            }),
            ..AllocationResult::default()
        }),
        ..ResourceClaimStatus::default()
    });
}

/// Turns claim watch events into the nodes to reconcile: those the claim's allocation names
/// now and those it named before (a deallocated claim no longer says where it was).
#[derive(Debug, Default)]
pub struct ClaimChanges {
    seen: HashMap<(Option<String>, String), BTreeSet<String>>,
}

impl ClaimChanges {
    /// The nodes whose pools `event` changes the allocations of.
    pub fn admit(&mut self, event: &watcher::Event<ResourceClaim>, driver: &str) -> BTreeSet<String> {
        let (claim, deleted) = match event {
            watcher::Event::Apply(c) | watcher::Event::InitApply(c) => (c, false),
            watcher::Event::Delete(c) => (c, true),
            watcher::Event::Init | watcher::Event::InitDone => return BTreeSet::new(),
        };
        let key = (claim.namespace(), claim.name_any());
        let now = if deleted {
            BTreeSet::new()
        } else {
            claim_nodes(claim, driver)
        };
        let before = if now.is_empty() {
            self.seen.remove(&key).unwrap_or_default()
        } else {
            self.seen.insert(key, now.clone()).unwrap_or_default()
        };
        if before == now {
            return BTreeSet::new();
        }
        before.union(&now).cloned().collect()
    }
}

/// The allocated devices of `node`'s pool in the claim cache.
pub fn allocated_on(claims: &[Arc<ResourceClaim>], driver: &str, node: &str) -> BTreeSet<String> {
    allocated_devices(claims.iter().map(AsRef::as_ref), driver, &pool_name(node, driver))
}

#[cfg(test)]
mod tests {
    use k8s_openapi::{
        api::resource::v1::{DeviceRequestAllocationResult, ResourceClaimSpec},
        apimachinery::pkg::apis::meta::v1::ObjectMeta,
    };

    use super::*;

    const DRIVER: &str = "gpu.migdra.dev";

    fn result(driver: &str, pool: &str, device: &str) -> DeviceRequestAllocationResult {
        DeviceRequestAllocationResult {
            driver: driver.into(),
            pool: pool.into(),
            device: device.into(),
            request: "gpu".into(),
            ..Default::default()
        }
    }

    fn claim(name: &str, results: Vec<DeviceRequestAllocationResult>) -> ResourceClaim {
        ResourceClaim {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("default".into()),
                labels: Some([("app".to_string(), "x".to_string())].into()),
                ..Default::default()
            },
            spec: ResourceClaimSpec::default(),
            status: (!results.is_empty()).then(|| ResourceClaimStatus {
                allocation: Some(AllocationResult {
                    devices: Some(DeviceAllocationResult {
                        results: Some(results),
                        config: None,
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn pool_names_map_back_to_nodes() {
        assert_eq!(node_of_pool("node-a/gpu.migdra.dev", DRIVER), Some("node-a"));
        assert_eq!(
            node_of_pool(&pool_name("ip-10.x", DRIVER), DRIVER),
            Some("ip-10.x")
        );
        assert_eq!(node_of_pool("node-a/other.dev", DRIVER), None);
        assert_eq!(node_of_pool("/gpu.migdra.dev", DRIVER), None);
        assert_eq!(node_of_pool("node-agpu.migdra.dev", DRIVER), None);
    }

    #[test]
    fn only_this_drivers_results_in_this_pool_count() {
        let claims = [
            claim(
                "a",
                vec![
                    result(DRIVER, "node-a/gpu.migdra.dev", "gpu-0-mig-3g40gb-4"),
                    result("nic.example.com", "node-a/gpu.migdra.dev", "eth0"),
                ],
            ),
            claim("b", vec![result(DRIVER, "node-b/gpu.migdra.dev", "gpu-1")]),
            claim(
                "c",
                vec![result(DRIVER, "node-a/gpu.migdra.dev", "gpu-1-mig-1g10gb-0")],
            ),
            claim("pending", vec![]),
        ];
        assert_eq!(
            allocated_devices(&claims, DRIVER, "node-a/gpu.migdra.dev"),
            BTreeSet::from(["gpu-0-mig-3g40gb-4".to_string(), "gpu-1-mig-1g10gb-0".to_string()])
        );
        let arcs: Vec<Arc<ResourceClaim>> = claims.iter().cloned().map(Arc::new).collect();
        assert_eq!(
            allocated_on(&arcs, DRIVER, "node-b"),
            BTreeSet::from(["gpu-1".to_string()])
        );
        assert_eq!(
            claim_nodes(&claims[0], DRIVER),
            BTreeSet::from(["node-a".to_string()])
        );
    }

    #[test]
    fn stripped_claims_keep_only_this_drivers_results() {
        let mut c = claim(
            "a",
            vec![
                result(DRIVER, "node-a/gpu.migdra.dev", "gpu-0"),
                result("nic.example.com", "node-a/nic", "eth0"),
            ],
        );
        strip_claim(&mut c, DRIVER);
        assert_eq!(c.metadata.labels, None);
        assert_eq!(c.name_any(), "a");
        let results: Vec<&str> = results(&c).map(|r| r.device.as_str()).collect();
        assert_eq!(results, ["gpu-0"]);
        let mut other = claim("b", vec![result("nic.example.com", "node-a/nic", "eth0")]);
        strip_claim(&mut other, DRIVER);
        assert_eq!(other.status, None);
    }

    #[test]
    fn claim_events_reconcile_the_nodes_before_and_after() {
        let mut changes = ClaimChanges::default();
        let nodes = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<BTreeSet<_>>();
        let unallocated = claim("a", vec![]);
        assert!(
            changes
                .admit(&watcher::Event::Apply(unallocated.clone()), DRIVER)
                .is_empty()
        );
        let on_a = claim("a", vec![result(DRIVER, "node-a/gpu.migdra.dev", "gpu-0")]);
        assert_eq!(
            changes.admit(&watcher::Event::Apply(on_a.clone()), DRIVER),
            nodes(&["node-a"])
        );
        // A status update that changes nothing of ours triggers nothing.
        assert!(
            changes
                .admit(&watcher::Event::Apply(on_a.clone()), DRIVER)
                .is_empty()
        );
        // Deallocated: the new object names no pool, the old one did.
        assert_eq!(
            changes.admit(&watcher::Event::Apply(unallocated), DRIVER),
            nodes(&["node-a"])
        );
        assert_eq!(
            changes.admit(&watcher::Event::InitApply(on_a.clone()), DRIVER),
            nodes(&["node-a"])
        );
        assert_eq!(
            changes.admit(&watcher::Event::Delete(on_a), DRIVER),
            nodes(&["node-a"])
        );
        assert!(changes.admit(&watcher::Event::InitDone, DRIVER).is_empty());
    }
}
