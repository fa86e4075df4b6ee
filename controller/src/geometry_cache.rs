//! Keeps the GpuNode cache small: each GPU's MIG geometry (its profile table, ~90 % of a
//! GpuNode) is the same for every GPU of a model, so the GpuNode watch moves it out of the
//! cached object into this table, shared between all GPUs that report an equal one. The
//! reconciler puts it back ([`GeometryCache::restore`]) only when it computes a pool: one
//! copy per GPU model instead of one per GPU.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard, Weak},
};

use migdra_api::{geometry::MigGeometry, inventory::GpuNode};
use sha2::{Digest, Sha256};

/// The geometries moved out of cached GpuNodes. Cheap to share.
#[derive(Debug, Default)]
pub struct GeometryCache {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Per GpuNode name, per GPU minor, the geometry taken from it.
    by_gpu: HashMap<String, HashMap<u32, Arc<MigGeometry>>>,
    /// Every distinct geometry, by content hash.
    interned: HashMap<[u8; 32], Weak<MigGeometry>>,
}

fn content_hash(geometry: &MigGeometry) -> [u8; 32] {
    Sha256::digest(serde_json::to_vec(geometry).unwrap_or_default()).into()
}

impl GeometryCache {
    fn lock(&self) -> MutexGuard<'_, State> {
        crate::lock(&self.state)
    }

    /// Moves the geometries out of `gpunode` (a watch modifier: called on every event of
    /// the GpuNode watch before the cache stores the object).
    pub fn take(&self, gpunode: &mut GpuNode) {
        let Some(name) = gpunode.metadata.name.clone() else {
            return;
        };
        let Some(gpus) = gpunode.status.as_mut().and_then(|s| s.gpus.as_mut()) else {
            return;
        };
        let mut state = self.lock();
        let State { by_gpu, interned } = &mut *state;
        let mut taken = HashMap::new();
        let previous = by_gpu.remove(&name).unwrap_or_default();
        for gpu in gpus.iter_mut() {
            let Some(mig) = gpu.mig.as_mut() else {
                continue;
            };
            if mig.geometry.profiles.is_empty() {
                continue;
            }
            // A cached GpuNode shows a geometry without profiles instead of the real one.
            let geometry = std::mem::replace(&mut mig.geometry, MigGeometry::new(Vec::new(), 0));
            // The same GPU usually reports the same table as last time: no hashing then.
            let shared = match previous.get(&gpu.minor) {
                Some(known) if **known == geometry => known.clone(),
                _ => {
                    let hash = content_hash(&geometry);
                    match interned.get(&hash).and_then(Weak::upgrade) {
                        Some(known) if *known == geometry => known,
                        _ => {
                            let fresh = Arc::new(geometry);
                            interned.insert(hash, Arc::downgrade(&fresh));
                            fresh
                        }
                    }
                }
            };
            taken.insert(gpu.minor, shared);
        }
        if !taken.is_empty() {
            by_gpu.insert(name, taken);
        }
        interned.retain(|_, weak| weak.strong_count() > 0);
    }

    /// `gpunode` with the geometries [`Self::take`] moved out put back. A GPU whose
    /// geometry is still in the object is left as it is.
    pub fn restore(&self, gpunode: &GpuNode) -> GpuNode {
        let mut full = gpunode.clone();
        let Some(name) = gpunode.metadata.name.as_deref() else {
            return full;
        };
        let state = self.lock();
        let Some(taken) = state.by_gpu.get(name) else {
            return full;
        };
        for gpu in full.status.iter_mut().flat_map(|s| s.gpus.iter_mut().flatten()) {
            if let (Some(mig), Some(geometry)) = (gpu.mig.as_mut(), taken.get(&gpu.minor))
                && mig.geometry.profiles.is_empty()
            {
                mig.geometry = (**geometry).clone();
            }
        }
        full
    }

    /// Drops what was taken from the GpuNodes not named in `keep` (deleted ones).
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        let mut state = self.lock();
        state.by_gpu.retain(|name, _| keep(name));
        state.interned.retain(|_, weak| weak.strong_count() > 0);
    }
}

#[cfg(test)]
mod tests {
    use migdra_api::{
        catalog,
        inventory::{GpuNodeSpec, GpuNodeStatus},
    };

    use super::*;

    fn gpunode(name: &str, models: &[&str]) -> GpuNode {
        let mut g = GpuNode::new(
            name,
            GpuNodeSpec {
                node_name: name.into(),
                driver: "gpu.migdra.dev".into(),
            },
        );
        g.status = Some(GpuNodeStatus {
            gpus: Some(
                models
                    .iter()
                    .enumerate()
                    .map(|(i, m)| catalog::model(m).unwrap().inventory(i as u32, true))
                    .collect(),
            ),
            ..Default::default()
        });
        g
    }

    #[test]
    fn geometries_are_shared_and_restored_exactly() {
        let geometries = GeometryCache::default();
        let a = gpunode("a", &["H100-80GB", "H100-80GB", "A100-SXM4-40GB"]);
        let b = gpunode("b", &["H100-80GB", "A100-SXM4-40GB"]);
        let (mut cached_a, mut cached_b) = (a.clone(), b.clone());
        geometries.take(&mut cached_a);
        geometries.take(&mut cached_b);
        for g in [&cached_a, &cached_b] {
            assert!(
                g.status
                    .as_ref()
                    .unwrap()
                    .gpus
                    .as_ref()
                    .unwrap()
                    .iter()
                    .all(|gpu| gpu.mig.as_ref().unwrap().geometry.profiles.is_empty()),
                "the cached object holds no profile table"
            );
        }
        assert_eq!(geometries.lock().interned.len(), 2, "one per model");
        assert_eq!(geometries.restore(&cached_a).status, a.status);
        assert_eq!(geometries.restore(&cached_b).status, b.status);
        // An object that was never taken from is returned as it is.
        assert_eq!(geometries.restore(&a).status, a.status);

        // A changed geometry on one GPU (another firmware) is that GPU's only.
        let mut changed = a.clone();
        let gpus = changed.status.as_mut().unwrap().gpus.as_mut().unwrap();
        gpus[1].mig.as_mut().unwrap().geometry.profiles.pop();
        let mut cached = changed.clone();
        geometries.take(&mut cached);
        assert_eq!(geometries.restore(&cached).status, changed.status);
        assert_eq!(geometries.lock().interned.len(), 3);

        // Deleted nodes are forgotten, and so are geometries nobody reports any more.
        geometries.retain(|name| name == "b");
        assert_eq!(geometries.lock().interned.len(), 2);
        assert_eq!(geometries.restore(&cached_b).status, b.status);
    }
}
