//! The names of the cached slices per node, so a reconciliation looks at its node's slices
//! only, not at every slice in the cache. Maintained from the slice watch like the cache
//! itself: a relist builds a new index, swapped in when it is complete.

use std::{
    collections::{BTreeSet, HashMap},
    sync::{Arc, Mutex},
};

use kube::runtime::{
    reflector::{ObjectRef, Store},
    watcher,
};

use crate::{compare::SliceMeta, naming::slice_node};

pub(crate) type ByNode = HashMap<String, BTreeSet<String>>;

/// The slice cache, indexed by node.
pub struct SliceIndex {
    store: Store<SliceMeta>,
    index: Mutex<Index>,
}

#[derive(Debug, Default)]
struct Index {
    by_node: ByNode,
    relisting: Option<ByNode>,
}

fn insert(index: &mut ByNode, slice: &SliceMeta) {
    if let (Some(node), Some(name)) = (slice_node(slice), slice.metadata.name.as_ref()) {
        index.entry(node.to_string()).or_default().insert(name.clone());
    }
}

/// Removes `slice` from `node`'s set, and the set when it is empty.
pub(crate) fn remove(index: &mut ByNode, node: &str, slice: &str) {
    if let Some(names) = index.get_mut(node) {
        names.remove(slice);
        if names.is_empty() {
            index.remove(node);
        }
    }
}

impl SliceIndex {
    /// An index over `store`, filled by [`Self::observe`].
    pub fn new(store: Store<SliceMeta>) -> Self {
        Self {
            store,
            index: Mutex::default(),
        }
    }

    /// Feeds one event of the slice watch, after the cache applied it.
    pub fn observe(&self, event: &watcher::Event<SliceMeta>) {
        let mut index = crate::lock(&self.index);
        let Index { by_node, relisting } = &mut *index;
        match event {
            watcher::Event::Apply(slice) => insert(by_node, slice),
            watcher::Event::Delete(slice) => {
                if let (Some(node), Some(name)) = (slice_node(slice), slice.metadata.name.as_ref()) {
                    remove(by_node, node, name);
                }
            }
            watcher::Event::Init => *relisting = Some(HashMap::new()),
            watcher::Event::InitApply(slice) => {
                if let Some(relisting) = relisting {
                    insert(relisting, slice);
                }
            }
            watcher::Event::InitDone => {
                if let Some(complete) = relisting.take() {
                    *by_node = complete;
                }
            }
        }
    }

    /// The cached slices of this driver on `node` (the watch selects the driver), by name.
    pub fn node_slices(&self, node: &str) -> Vec<Arc<SliceMeta>> {
        let index = crate::lock(&self.index);
        let Some(names) = index.by_node.get(node) else {
            return Vec::new();
        };
        names
            .iter()
            .filter_map(|name| self.store.get(&ObjectRef::new(name)))
            .filter(|s| slice_node(s) == Some(node))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use kube::runtime::reflector;

    use super::*;
    use crate::naming::NODE_LABEL;

    fn slice(name: &str, node: &str) -> SliceMeta {
        SliceMeta {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(BTreeMap::from([(NODE_LABEL.to_string(), node.to_string())])),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn slices_are_found_by_node_and_a_relist_replaces_the_index() {
        let (store, mut writer) = reflector::store::<SliceMeta>();
        let index = SliceIndex::new(store);
        let mut feed = |event: watcher::Event<SliceMeta>| {
            writer.apply_watcher_event(&event);
            index.observe(&event);
        };
        feed(watcher::Event::Apply(slice("a-1", "a")));
        feed(watcher::Event::Apply(slice("a-0", "a")));
        feed(watcher::Event::Apply(slice("b-0", "b")));
        feed(watcher::Event::Delete(slice("b-0", "b")));
        // A relist that shows only a-1: a-0's deletion was missed.
        feed(watcher::Event::Init);
        feed(watcher::Event::InitApply(slice("a-1", "a")));
        let names = |node: &str| -> Vec<String> {
            index
                .node_slices(node)
                .iter()
                .filter_map(|s| s.metadata.name.clone())
                .collect()
        };
        assert_eq!(names("a"), ["a-0", "a-1"], "until the relist is complete");
        assert!(names("b").is_empty());
        feed(watcher::Event::InitDone);
        assert_eq!(names("a"), ["a-1"]);
    }
}
