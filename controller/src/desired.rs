//! The pool a live node should publish: policy, plan, keep what claims hold, render,
//! validate — all pure, from the api crate's slice model — turned into named ResourceSlice
//! objects.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::{
    api::resource::v1::ResourceSlice,
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference},
};
use migdra_api::{
    inventory::{GpuNode, pool_name},
    policy::{MigMode, MigPolicy, PolicyError, policy_for_node},
    slices::{PoolIdentity, published_plan, render_pool, retained::Retention, validate::validate_pool},
};

use crate::naming::{NODE_LABEL, is_dns_subdomain, node_label_value, slice_name};

/// A node's desired pool, generation not yet assigned.
#[derive(Clone, Debug, PartialEq)]
pub struct DesiredPool {
    pub pool: String,
    /// Slices in pool order, named, labelled and owned by the Node.
    pub slices: Vec<ResourceSlice>,
    pub devices: u32,
    /// GPUs with at least one device in the pool.
    pub gpus: u32,
    /// The MigPolicy applied, if any.
    pub policy: Option<String>,
    /// Allocated devices the policy no longer offers: kept (tainted) or dropped.
    pub retention: Retention,
}

/// Why no pool can be published.
#[derive(Debug, Clone, PartialEq)]
pub enum DesiredError {
    /// The applicable MigPolicy is invalid.
    Policy(PolicyError),
    /// The rendered pool breaks API rules (one entry per problem).
    Invalid(Vec<String>),
}

/// The identity of a node, as the pool needs it.
#[derive(Clone, Copy, Debug)]
pub struct NodeRef<'a> {
    pub name: &'a str,
    /// For the owner reference.
    pub uid: Option<&'a str>,
    /// For policy selection.
    pub labels: &'a BTreeMap<String, String>,
}

/// The controller's pool settings (its flags).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolSettings {
    /// Publish the `memory` counter for quotas whatever the policy (`--keep-memory-counter`).
    pub keep_memory_counter: bool,
    /// The MIG mode of nodes whose MigPolicy names none (`--default-mig-mode`).
    pub default_mig_mode: MigMode,
}

/// Computes the pool of a node whose plugin is live. `allocated` names the devices of this
/// pool that claims hold: each stays in the pool, tainted if no longer offered.
/// `settings` are the cluster-wide ones no MigPolicy overrides.
pub fn desired_pool<'p>(
    gpunode: &GpuNode,
    node: NodeRef<'_>,
    policies: impl IntoIterator<Item = &'p MigPolicy>,
    driver: &str,
    settings: PoolSettings,
    allocated: &BTreeSet<String>,
) -> Result<DesiredPool, DesiredError> {
    let mut policy =
        policy_for_node(policies, node.labels, settings.default_mig_mode).map_err(DesiredError::Policy)?;
    policy.keep_memory_counter = settings.keep_memory_counter;
    let status = gpunode.status.as_ref();
    let gpus = status.and_then(|s| s.gpus.as_deref()).unwrap_or_default();
    let driver_version = status
        .and_then(|s| s.plugin.as_ref())
        .and_then(|p| p.driver_version.as_deref());
    let (plan, retention) = published_plan(gpus, &policy, allocated);
    let pool = pool_name(node.name, driver);
    let id = PoolIdentity {
        driver,
        node: node.name,
        pool: &pool,
        generation: 0,
        driver_version,
    };
    let specs = render_pool(&id, gpus, &plan);
    let mut problems: Vec<String> = validate_pool(&specs).err().map_or_else(Vec::new, |errors| {
        errors.iter().map(ToString::to_string).collect()
    });
    let count = specs.len();
    let owner = node.uid.map(|uid| OwnerReference {
        api_version: "v1".into(),
        kind: "Node".into(),
        name: node.name.to_string(),
        uid: uid.to_string(),
        controller: Some(true),
        block_owner_deletion: None,
    });
    let labels =
        node_label_value(node.name).map(|v| BTreeMap::from([(NODE_LABEL.to_string(), v.to_string())]));
    let slices: Vec<ResourceSlice> = specs
        .into_iter()
        .enumerate()
        .map(|(index, spec)| ResourceSlice {
            metadata: ObjectMeta {
                name: Some(slice_name(node.name, driver, index, count)),
                labels: labels.clone(),
                owner_references: owner.clone().map(|o| vec![o]),
                ..ObjectMeta::default()
            },
            spec,
        })
        .collect();
    for slice in &slices {
        let name = slice.metadata.name.as_deref().unwrap_or_default();
        if !is_dns_subdomain(name) {
            problems.push(format!("slice name {name:?} is not a valid object name"));
        }
    }
    if !problems.is_empty() {
        return Err(DesiredError::Invalid(problems));
    }
    let gpus_used: BTreeSet<u32> = plan.devices.iter().map(|d| d.gpu_minor).collect();
    Ok(DesiredPool {
        pool,
        slices,
        devices: u32::try_from(plan.devices.len()).unwrap_or(u32::MAX),
        gpus: u32::try_from(gpus_used.len()).unwrap_or(u32::MAX),
        policy: policy.name,
        retention,
    })
}

#[cfg(test)]
mod tests {
    use migdra_api::{
        catalog,
        inventory::{GpuNodeSpec, GpuNodeStatus},
        policy::MigPolicySpec,
    };

    use super::*;

    /// Settings under which the tests' MIG-on H100s offer partitions and whole GPUs.
    fn dynamic(keep_memory_counter: bool) -> PoolSettings {
        PoolSettings {
            keep_memory_counter,
            default_mig_mode: MigMode::Dynamic,
        }
    }

    fn gpunode(gpus: usize) -> GpuNode {
        let model = catalog::model("H100-80GB").unwrap();
        let mut g = GpuNode::new(
            "node-a",
            GpuNodeSpec {
                node_name: "node-a".into(),
                driver: "gpu.migdra.dev".into(),
            },
        );
        g.status = Some(GpuNodeStatus {
            gpus: Some((0..gpus as u32).map(|m| model.inventory(m, true)).collect()),
            ..Default::default()
        });
        g
    }

    #[test]
    fn renders_named_owned_slices_in_pool_order() {
        let labels = BTreeMap::new();
        let node = NodeRef {
            name: "node-a",
            uid: Some("uid-a"),
            labels: &labels,
        };
        let pool = desired_pool(
            &gpunode(2),
            node,
            [],
            "gpu.migdra.dev",
            dynamic(false),
            &BTreeSet::new(),
        )
        .unwrap();
        assert_eq!(pool.pool, "node-a/gpu.migdra.dev");
        assert_eq!(pool.gpus, 2);
        assert!(pool.devices > 2);
        let names: Vec<&str> = pool
            .slices
            .iter()
            .map(|s| s.metadata.name.as_deref().unwrap())
            .collect();
        assert_eq!(names[0], "node-a-gpu.migdra.dev-000");
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(sorted, names);
        // Counter slices first.
        assert!(pool.slices[0].spec.shared_counters.is_some());
        for s in &pool.slices {
            let owner = &s.metadata.owner_references.as_ref().unwrap()[0];
            assert_eq!((owner.kind.as_str(), owner.uid.as_str()), ("Node", "uid-a"));
            assert_eq!(owner.controller, Some(true));
            assert_eq!(s.metadata.labels.as_ref().unwrap()[NODE_LABEL], "node-a");
            assert_eq!(s.spec.pool.resource_slice_count as usize, pool.slices.len());
            assert_eq!(s.spec.node_name.as_deref(), Some("node-a"));
        }
    }

    #[test]
    fn the_memory_counter_is_published_only_when_kept_whatever_the_policy() {
        let labels = BTreeMap::new();
        let node = NodeRef {
            name: "node-a",
            uid: None,
            labels: &labels,
        };
        let only_1g = MigPolicy::new(
            "only-1g",
            MigPolicySpec {
                profiles: vec!["1g.10gb".into()],
                ..Default::default()
            },
        );
        let memory_in = |pool: &DesiredPool| -> (usize, usize) {
            let sets = pool
                .slices
                .iter()
                .flat_map(|s| s.spec.shared_counters.iter().flatten())
                .filter(|set| set.counters.contains_key("memory"))
                .count();
            let devices = pool
                .slices
                .iter()
                .flat_map(|s| s.spec.devices.iter().flatten())
                .filter(|d| {
                    d.consumes_counters
                        .iter()
                        .flatten()
                        .any(|c| c.counters.contains_key("memory"))
                })
                .count();
            (sets, devices)
        };
        for policies in [vec![], vec![&only_1g]] {
            let bare = desired_pool(
                &gpunode(2),
                node,
                policies.clone(),
                "gpu.migdra.dev",
                dynamic(false),
                &BTreeSet::new(),
            )
            .unwrap();
            assert_eq!(memory_in(&bare), (0, 0));
            let kept = desired_pool(
                &gpunode(2),
                node,
                policies,
                "gpu.migdra.dev",
                dynamic(true),
                &BTreeSet::new(),
            )
            .unwrap();
            assert_eq!(kept.devices, bare.devices);
            assert_eq!(memory_in(&kept), (2, kept.devices as usize));
        }
    }

    #[test]
    fn policy_errors_and_policy_names_come_through() {
        let labels = BTreeMap::new();
        let node = NodeRef {
            name: "node-a",
            uid: None,
            labels: &labels,
        };
        let mut bad = MigPolicy::new(
            "bad",
            MigPolicySpec {
                profiles: vec!["nonsense".into()],
                ..Default::default()
            },
        );
        assert!(matches!(
            desired_pool(
                &gpunode(1),
                node,
                [&bad],
                "gpu.migdra.dev",
                dynamic(false),
                &BTreeSet::new()
            ),
            Err(DesiredError::Policy(_))
        ));
        bad.spec.profiles = vec!["7g".into()];
        bad.spec.whole_gpus = Some(false);
        let pool = desired_pool(
            &gpunode(1),
            node,
            [&bad],
            "gpu.migdra.dev",
            dynamic(false),
            &BTreeSet::new(),
        )
        .unwrap();
        assert_eq!(pool.policy.as_deref(), Some("bad"));
        assert_eq!(pool.devices, 1, "one 7g placement on one GPU");
        assert!(pool.slices[0].metadata.owner_references.is_none());
    }

    #[test]
    fn allocated_devices_the_policy_stopped_offering_stay_tainted() {
        let labels = BTreeMap::new();
        let node = NodeRef {
            name: "node-a",
            uid: None,
            labels: &labels,
        };
        let only_1g = MigPolicy::new(
            "only-1g",
            MigPolicySpec {
                profiles: vec!["1g".into()],
                whole_gpus: Some(false),
                ..Default::default()
            },
        );
        let allocated = BTreeSet::from(["gpu-0-mig-3g40gb-4".to_string()]);
        let without = desired_pool(
            &gpunode(1),
            node,
            [&only_1g],
            "gpu.migdra.dev",
            dynamic(false),
            &BTreeSet::new(),
        )
        .unwrap();
        let with = desired_pool(
            &gpunode(1),
            node,
            [&only_1g],
            "gpu.migdra.dev",
            dynamic(false),
            &allocated,
        )
        .unwrap();
        assert_eq!(with.devices, without.devices + 1);
        assert_eq!(with.retention.kept, ["gpu-0-mig-3g40gb-4"]);
        let device = with
            .slices
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .find(|d| d.name == "gpu-0-mig-3g40gb-4")
            .expect("the allocated 3g stays in the pool");
        let taint = &device.taints.as_ref().unwrap()[0];
        assert_eq!(
            (taint.key.as_str(), taint.effect.as_str()),
            (migdra_api::slices::NOT_OFFERED_TAINT, "NoSchedule")
        );
        let consumed = &device.consumes_counters.as_ref().unwrap()[0];
        assert_eq!(consumed.counter_set, "gpu-0");
        // It blocks the memory slices the 1g placements 4 to 6 need (slice 7 is left out of the
        // pool: every placement on it also covers slice 6).
        for s in 4..7 {
            assert!(consumed.counters.contains_key(&format!("memory-slice-{s}")));
        }
        // Released: gone again.
        assert!(
            without
                .slices
                .iter()
                .flat_map(|s| s.spec.devices.iter().flatten())
                .all(|d| d.name != "gpu-0-mig-3g40gb-4")
        );
    }

    #[test]
    fn a_sharing_policy_publishes_shared_devices_that_stay_while_held() {
        let labels = BTreeMap::new();
        let node = NodeRef {
            name: "node-a",
            uid: None,
            labels: &labels,
        };
        let mut shared = MigPolicy::new(
            "shared-1g",
            MigPolicySpec {
                sharing: Some(migdra_api::policy::SharingSpec {
                    profiles: vec!["1g.10gb".into()],
                    shares: Some(2),
                }),
                ..Default::default()
            },
        );
        let devices = |pool: &DesiredPool| -> Vec<k8s_openapi::api::resource::v1::Device> {
            pool.slices
                .iter()
                .flat_map(|s| s.spec.devices.iter().flatten().cloned())
                .collect()
        };
        let pool = desired_pool(
            &gpunode(1),
            node,
            [&shared],
            "gpu.migdra.dev",
            dynamic(false),
            &BTreeSet::new(),
        )
        .unwrap();
        let all = devices(&pool);
        let is_shared =
            |d: &k8s_openapi::api::resource::v1::Device| d.allow_multiple_allocations == Some(true);
        assert_eq!(
            all.iter().filter(|d| is_shared(d)).count(),
            7,
            "the 7 1g.10gb placements"
        );
        assert!(
            all.iter()
                .filter(|d| is_shared(d))
                .all(|d| d.name.contains("-mig-1g10gb-"))
        );
        let shares = &all
            .iter()
            .find(|d| is_shared(d))
            .unwrap()
            .capacity
            .as_ref()
            .unwrap()[migdra_api::slices::SHARES_CAPACITY];
        assert_eq!(shares.value.0, "2");
        // Two claims hold shares of one device; the policy stops offering 1g: the device stays,
        // tainted, with its counters, while either claim holds it.
        shared.spec.profiles = vec!["3g".into()];
        let share = |name: &str, share: &str| -> k8s_openapi::api::resource::v1::ResourceClaim {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"devices": {}},
                "status": {"allocation": {"devices": {"results": [{
                    "request": "mig", "driver": "gpu.migdra.dev", "pool": "node-a/gpu.migdra.dev",
                    "device": "gpu-0-mig-1g10gb-6", "shareID": share,
                }]}}},
            }))
            .unwrap()
        };
        let (a, b) = (share("a", "share-a"), share("b", "share-b"));
        let pool_name = "node-a/gpu.migdra.dev";
        for holders in [vec![&a, &b], vec![&b]] {
            let held = crate::claims::allocated_devices(holders.iter().copied(), "gpu.migdra.dev", pool_name);
            let pool = desired_pool(
                &gpunode(1),
                node,
                [&shared],
                "gpu.migdra.dev",
                dynamic(false),
                &held,
            )
            .unwrap();
            assert_eq!(
                pool.retention.kept,
                ["gpu-0-mig-1g10gb-6"],
                "{} holder(s)",
                holders.len()
            );
            let kept = devices(&pool)
                .into_iter()
                .find(|d| d.name == "gpu-0-mig-1g10gb-6")
                .expect("held device stays");
            assert!(kept.taints.is_some() && kept.consumes_counters.is_some());
        }
        let held = crate::claims::allocated_devices([], "gpu.migdra.dev", pool_name);
        let pool = desired_pool(
            &gpunode(1),
            node,
            [&shared],
            "gpu.migdra.dev",
            dynamic(false),
            &held,
        )
        .unwrap();
        assert!(
            devices(&pool).iter().all(|d| d.name != "gpu-0-mig-1g10gb-6"),
            "released by both: gone"
        );
    }

    #[test]
    fn invalid_pools_are_refused() {
        let labels = BTreeMap::new();
        let node = NodeRef {
            name: "node-a",
            uid: None,
            labels: &labels,
        };
        let err = desired_pool(
            &gpunode(1),
            node,
            [],
            "Not_A_Driver",
            dynamic(false),
            &BTreeSet::new(),
        )
        .unwrap_err();
        let DesiredError::Invalid(problems) = err else {
            panic!("expected an invalid pool")
        };
        assert!(problems.iter().any(|p| p.contains("driver name")), "{problems:?}");
    }
}
