//! The short circuit of a reconciliation that would change nothing (see the module docs of
//! [`crate::reconcile`]): a [`Memo`] per node of the last reconciliation that found the pool
//! up to date, keyed by a hash of everything the pool is computed from ([`PoolInputs`]).

use std::{
    collections::{BTreeSet, HashMap},
    sync::{Arc, Mutex},
};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use migdra_api::{
    inventory::{GpuNode, PublicationStatus},
    policy::{MigPolicy, MigPolicySpec},
};
use sha2::{Digest, Sha256};

use crate::{compare::SliceMeta, desired::NodeRef};

/// What a reconciliation that found a node's pool up to date saw.
#[derive(Clone, Debug, PartialEq)]
pub struct Memo {
    /// The GpuNode's resourceVersion when its inventory was hashed.
    pub gpunode_version: Option<String>,
    /// [`inventory_hash`] of the GpuNode.
    pub inventory: [u8; 16],
    /// [`PoolInputs::hash`], the inventory hash included.
    pub inputs: [u8; 16],
    pub publication: PublicationStatus,
    /// The `Published` condition's message.
    pub message: String,
}

/// The memo of every node.
#[derive(Debug, Default)]
pub struct Memos(Mutex<HashMap<String, Memo>>);

impl Memos {
    /// The memo of `node`'s last up-to-date reconciliation.
    pub fn get(&self, node: &str) -> Option<Memo> {
        crate::lock(&self.0).get(node).cloned()
    }

    /// Records (or, with `None`, forgets) `node`'s memo.
    pub fn set(&self, node: &str, memo: Option<Memo>) {
        let mut memos = crate::lock(&self.0);
        match memo {
            Some(memo) => memos.insert(node.to_string(), memo),
            None => memos.remove(node),
        };
    }
}

/// A SHA-256 over values serialized as JSON, each followed by a 0 byte.
struct Hasher(Sha256);

impl Hasher {
    fn add(&mut self, value: &impl serde::Serialize) {
        // Serializing plain data cannot fail; a failure would only weaken the memo, which the
        // `0xff` marker then keeps from matching anything serialized.
        match serde_json::to_vec(value) {
            Ok(json) => self.0.update(json),
            Err(_) => self.0.update([0xff]),
        }
        self.0.update([0]);
    }

    fn finish(self) -> [u8; 16] {
        let mut out = [0u8; 16];
        out.copy_from_slice(&self.0.finalize()[..16]);
        out
    }
}

/// Hash of what the pool takes from the GpuNode: its driver, inventory and driver version.
pub fn inventory_hash(gpunode: &GpuNode) -> [u8; 16] {
    let status = gpunode.status.as_ref();
    let mut h = Hasher(Sha256::new());
    h.add(&gpunode.spec.driver);
    h.add(&status.and_then(|s| s.gpus.as_ref()));
    h.add(
        &status
            .and_then(|s| s.plugin.as_ref())
            .and_then(|p| p.driver_version.as_ref()),
    );
    h.finish()
}

/// What a node's pool is computed from, besides the state of its publication (see
/// [`Self::hash`]).
#[derive(Clone, Copy)]
pub struct PoolInputs<'a> {
    /// [`inventory_hash`] of the GpuNode.
    pub inventory: [u8; 16],
    pub node: &'a NodeRef<'a>,
    /// Every MigPolicy.
    pub policies: &'a [Arc<MigPolicy>],
    /// The devices claims hold.
    pub allocated: &'a BTreeSet<String>,
}

impl PoolInputs<'_> {
    /// The hash of these inputs, the generation the status records, and the node's cached
    /// slices (names and versions): everything the pool and its diff depend on.
    pub fn hash(&self, published_generation: Option<i64>, cached: &[Arc<SliceMeta>]) -> [u8; 16] {
        let mut h = Hasher(Sha256::new());
        h.0.update(self.inventory);
        h.add(&(self.node.name, self.node.uid, self.node.labels));
        let mut policies: Vec<(&Option<String>, &MigPolicySpec)> = self
            .policies
            .iter()
            .map(|p| (&p.metadata.name, &p.spec))
            .collect();
        policies.sort_by(|a, b| a.0.cmp(b.0));
        h.add(&policies);
        h.add(self.allocated);
        h.add(&published_generation);
        let slices: Vec<(&Option<String>, &Option<String>)> = cached
            .iter()
            .map(|s| (&s.metadata.name, &s.metadata.resource_version))
            .collect();
        h.add(&slices);
        h.finish()
    }
}

/// What the slice cache will show for a node once it caught up with a publication: every
/// desired slice, with the resourceVersion of the write when it was written and as cached
/// otherwise (only names and versions: what [`PoolInputs::hash`] reads), in the cache's order
/// (by name). `None` when a desired slice is neither written nor cached (nothing to predict).
pub fn cache_after_publish(
    desired: &[String],
    written: &[(String, Option<String>)],
    cached: &[Arc<SliceMeta>],
) -> Option<Vec<Arc<SliceMeta>>> {
    let mut after = desired
        .iter()
        .map(|name| {
            let version = match written.iter().find(|(w, _)| w == name) {
                Some((_, version)) => version.clone(),
                None => cached
                    .iter()
                    .find(|s| s.metadata.name.as_ref() == Some(name))?
                    .metadata
                    .resource_version
                    .clone(),
            };
            Some(Arc::new(SliceMeta {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    resource_version: version,
                    ..Default::default()
                },
                ..Default::default()
            }))
        })
        .collect::<Option<Vec<_>>>()?;
    after.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    Some(after)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use migdra_api::{
        catalog,
        inventory::{GpuNodeSpec, GpuNodeStatus},
    };

    use super::*;

    fn slice(name: &str, rv: &str) -> Arc<SliceMeta> {
        Arc::new(SliceMeta {
            metadata: ObjectMeta {
                name: Some(name.into()),
                resource_version: Some(rv.into()),
                ..Default::default()
            },
            ..Default::default()
        })
    }

    #[test]
    fn pool_inputs_hash_changes_with_every_input() {
        let mut g = GpuNode::new(
            "n",
            GpuNodeSpec {
                node_name: "n".into(),
                driver: "gpu.migdra.dev".into(),
            },
        );
        let model = catalog::model("H100-80GB").unwrap();
        g.status = Some(GpuNodeStatus {
            gpus: Some(vec![model.inventory(0, true)]),
            ..Default::default()
        });
        let inventory = inventory_hash(&g);
        let mut unhealthy = g.clone();
        unhealthy.status.as_mut().unwrap().gpus.as_mut().unwrap()[0]
            .health
            .healthy = false;
        assert_ne!(inventory_hash(&unhealthy), inventory);

        let labels = BTreeMap::from([("gpu".to_string(), "h100".to_string())]);
        let node = NodeRef {
            name: "n",
            uid: Some("u1"),
            labels: &labels,
        };
        let policies = vec![Arc::new(MigPolicy::new("p", MigPolicySpec::default()))];
        let allocated = BTreeSet::new();
        let cached = vec![slice("s", "1")];
        let base = PoolInputs {
            inventory,
            node: &node,
            policies: &policies,
            allocated: &allocated,
        };
        let hash = base.hash(Some(1), &cached);
        assert_eq!(hash, base.hash(Some(1), &cached), "deterministic");

        let relabelled = BTreeMap::from([("gpu".to_string(), "a100".to_string())]);
        let relabelled_node = NodeRef {
            labels: &relabelled,
            ..node
        };
        let recreated_node = NodeRef {
            uid: Some("u2"),
            ..node
        };
        let changed_policy = vec![Arc::new(MigPolicy::new(
            "p",
            MigPolicySpec {
                profiles: vec!["1g".into()],
                ..Default::default()
            },
        ))];
        let held = BTreeSet::from(["gpu-0-mig-1g10gb-0".to_string()]);
        let rewritten = vec![slice("s", "2")];
        let variants = [
            PoolInputs {
                inventory: inventory_hash(&unhealthy),
                ..base
            }
            .hash(Some(1), &cached),
            PoolInputs {
                node: &relabelled_node,
                ..base
            }
            .hash(Some(1), &cached),
            PoolInputs {
                node: &recreated_node,
                ..base
            }
            .hash(Some(1), &cached),
            PoolInputs {
                policies: &changed_policy,
                ..base
            }
            .hash(Some(1), &cached),
            PoolInputs {
                allocated: &held,
                ..base
            }
            .hash(Some(1), &cached),
            base.hash(Some(2), &cached),
            base.hash(Some(1), &rewritten),
        ];
        for (i, v) in variants.iter().enumerate() {
            assert_ne!(*v, hash, "variant {i}");
        }
    }

    #[test]
    fn the_cache_after_a_publish_has_the_written_versions_and_keeps_the_rest() {
        let names = |v: &[Arc<SliceMeta>]| -> Vec<(Option<String>, Option<String>)> {
            v.iter()
                .map(|s| (s.metadata.name.clone(), s.metadata.resource_version.clone()))
                .collect()
        };
        // b rewritten, a unchanged, c deleted (not desired), d created.
        let cached = vec![slice("a", "1"), slice("b", "2"), slice("c", "3")];
        let desired = vec!["d".to_string(), "b".to_string(), "a".to_string()];
        let written = vec![
            ("b".to_string(), Some("10".to_string())),
            ("d".to_string(), Some("11".to_string())),
        ];
        let after = cache_after_publish(&desired, &written, &cached).expect("predictable");
        let some = |s: &str| Some(s.to_string());
        assert_eq!(
            names(&after),
            vec![
                (some("a"), some("1")),
                (some("b"), some("10")),
                (some("d"), some("11"))
            ]
        );
        // A desired slice neither written nor cached: nothing to predict.
        let missing = vec!["a".to_string(), "e".to_string()];
        assert!(cache_after_publish(&missing, &written, &cached).is_none());
    }
}
