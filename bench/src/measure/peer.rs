//! B1's peer: pools shaped as NVIDIA's DRA driver (`gpu-kubelet-plugin`, driver
//! `gpu.nvidia.com`) publishes them with its `DynamicMIG` gate on Kubernetes 1.35+, for the
//! same 8 × H100-80GB a simulated node has, and the claim a user of that driver writes for one
//! `1g.10gb`.
//!
//! The shape, per node (one pool named after the node):
//! * G + 1 slices: slice 0 holds only the counter sets, one per GPU (`gpu-<minor>-counter-set`);
//!   then one devices-only slice per GPU, GPUs in PCI bus order.
//! * A counter set holds one counter per device capacity, named by turning the camelCase
//!   capacity name into dashes, valued at the largest value any profile has (the full
//!   profile's, not the GPU's raw total), plus `memory-slice-<i>` = 1 for each memory slice
//!   (as many as the largest placement covers). Nothing is pruned.
//! * Devices per GPU: the full GPU (`gpu-<minor>`) and every (profile, placement) NVML offers
//!   for a profile whose compute instance spans its GPU instance (`+me` and double-memory 1g
//!   included), named `gpu-<minor>-mig-<profile>-<GI profile ID>-<placement start>` with the
//!   profile's dots dropped and other characters outside `[a-z0-9-]` turned into dashes;
//!   sorted by name, since the scheduler takes the first fit.
//! * A MIG device carries seven capacities (SMs, engines, memory in bytes) and consumes each
//!   of them (zeros included) plus the memory slices of its placement; the full GPU's
//!   capacities are the counter set's maxima and it consumes every counter of its set.
//! * Attributes as NVIDIA's driver sets them: the full GPU has `type=gpu`, `uuid`, product,
//!   brand, architecture, CUDA capability, driver and CUDA driver versions, PCI bus and root; a
//!   dynamic MIG device has `type=mig`, `parentUUID`, `profile` and the parent's other
//!   attributes, but no `uuid` (it does not exist yet). `addressingMode` is left out: NVML
//!   reports none on a PCIe x86 host.
//!
//! Profiles and placements come from `migdra-api`'s catalog, the same table migdra's own pool
//! is built from.

use std::collections::BTreeMap;

use anyhow::Context as _;
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::{
    api::resource::v1::{
        Counter, CounterSet, Device, DeviceAttribute, DeviceCapacity, DeviceClass, DeviceCounterConsumption,
        ResourcePool, ResourceSlice, ResourceSliceSpec,
    },
    apimachinery::pkg::{api::resource::Quantity, apis::meta::v1::ObjectMeta},
};
use kube::{Api, Client, api::PostParams};
use migdra_api::{catalog::GpuModel, geometry::MigProfile, slices::quantity};
use serde_json::json;

/// NVIDIA's driver name.
pub const DRIVER: &str = "gpu.nvidia.com";
/// NVIDIA's DeviceClass for MIG devices.
pub const CLASS: &str = "mig.nvidia.com";
/// The profile B1's claims ask for.
pub const PROFILE: &str = "1g.10gb";
/// The catalog model every simulated node has eight of.
pub const MODEL: &str = "H100-80GB";
/// GPUs per simulated node.
pub const GPUS_PER_NODE: u32 = 8;

/// Version attributes as an H100 node with a current driver reports them.
const DRIVER_VERSION: &str = "580.82.7";
const CUDA_DRIVER_VERSION: &str = "13.0.0";
/// NVML's brand string for data-centre GPUs.
const BRAND: &str = "Nvidia";

/// One device capacity in NVIDIA's naming and its value for `profile`.
fn capacities(profile: &MigProfile) -> [(&'static str, String); 7] {
    let e = profile.engines;
    [
        ("multiprocessors", e.multiprocessors.to_string()),
        ("copyEngines", e.copy_engines.to_string()),
        ("decoders", e.decoders.to_string()),
        ("encoders", e.encoders.to_string()),
        ("jpegEngines", e.jpeg_engines.to_string()),
        ("ofaEngines", e.ofa_engines.to_string()),
        ("memory", quantity::mebibytes(profile.memory_mib)),
    ]
}

/// A counter's name from a capacity's: a dash before each capital, lower case
/// (`copyEngines` → `copy-engines`).
fn counter_name(capacity: &str) -> String {
    let mut name = String::with_capacity(capacity.len() + 2);
    let mut previous_lower = false;
    for c in capacity.chars() {
        if c.is_ascii_uppercase() && previous_lower {
            name.push('-');
        }
        previous_lower = c.is_ascii_lowercase() || c.is_ascii_digit();
        name.push(c.to_ascii_lowercase());
    }
    name
}

fn memory_slice_counter(i: u32) -> String {
    format!("memory-slice-{i}")
}

/// The profile's part of a device name: dots dropped, anything else outside `[a-z0-9-]`
/// a dash (`1g.10gb+me` → `1g10gb-me`).
fn name_part(profile: &str) -> String {
    profile
        .to_ascii_lowercase()
        .replace('.', "")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect::<String>()
        .trim_matches('-')
        .to_string()
}

fn quantity_of(value: &str) -> Quantity {
    Quantity(value.to_string())
}

/// Largest value of each capacity over every profile with a placement, and the largest
/// placement size: what NVIDIA's driver derives its counter set and full-GPU device from.
fn maxima(model: &GpuModel) -> (BTreeMap<&'static str, u128>, u32) {
    let mut max = BTreeMap::new();
    let mut memory_slices = 0;
    for profile in model.profiles.iter().filter(|p| !p.placements.is_empty()) {
        memory_slices = memory_slices.max(profile.memory_slices);
        for (name, value) in capacities(profile) {
            let value = quantity::parse(&value).unwrap_or_default();
            let entry = max.entry(name).or_insert(0);
            *entry = (*entry).max(value);
        }
    }
    (max, memory_slices)
}

/// A base-unit value back as a quantity: memory in `Mi` when whole mebibytes.
fn quantity_from(name: &str, value: u128) -> String {
    if name == "memory" && value > 0 && value.is_multiple_of(1 << 20) {
        format!("{}Mi", value >> 20)
    } else {
        value.to_string()
    }
}

/// The counters of GPU `minor`'s set, all of them (also what the full GPU consumes).
fn full_counters(model: &GpuModel) -> BTreeMap<String, Counter> {
    let (max, memory_slices) = maxima(model);
    let mut counters: BTreeMap<String, Counter> = max
        .iter()
        .map(|(name, value)| {
            (
                counter_name(name),
                Counter {
                    value: quantity_of(&quantity_from(name, *value)),
                },
            )
        })
        .collect();
    for i in 0..memory_slices {
        counters.insert(
            memory_slice_counter(i),
            Counter {
                value: quantity_of("1"),
            },
        );
    }
    counters
}

fn counter_set_name(minor: u32) -> String {
    format!("gpu-{minor}-counter-set")
}

/// One simulated GPU's identity on `node`.
struct Gpu {
    minor: u32,
    uuid: String,
    pci_bus_id: String,
    pcie_root: String,
}

impl Gpu {
    fn new(node: &str, minor: u32) -> Self {
        Self {
            minor,
            uuid: format!("GPU-peer-{node}-{minor}"),
            pci_bus_id: format!("0000:{:02x}:00.0", 0x18 + minor),
            pcie_root: format!("pci0000:{:02x}", 0x10 + minor),
        }
    }

    /// The attributes a MIG device and its parent share.
    fn shared_attributes(&self, model: &GpuModel) -> BTreeMap<String, DeviceAttribute> {
        let string = |s: &str| DeviceAttribute {
            string: Some(s.to_string()),
            ..DeviceAttribute::default()
        };
        let version = |s: String| DeviceAttribute {
            version: Some(s),
            ..DeviceAttribute::default()
        };
        let (major, minor) = model.cuda_compute_capability;
        BTreeMap::from([
            ("productName".into(), string(model.product_name)),
            ("brand".into(), string(BRAND)),
            (
                "architecture".into(),
                string(&format!("{:?}", model.architecture)),
            ),
            (
                "cudaComputeCapability".into(),
                version(format!("{major}.{minor}.0")),
            ),
            ("driverVersion".into(), version(DRIVER_VERSION.into())),
            ("cudaDriverVersion".into(), version(CUDA_DRIVER_VERSION.into())),
            ("resource.kubernetes.io/pciBusID".into(), string(&self.pci_bus_id)),
            ("resource.kubernetes.io/pcieRoot".into(), string(&self.pcie_root)),
        ])
    }

    fn full_device(&self, model: &GpuModel) -> Device {
        let mut attributes = self.shared_attributes(model);
        attributes.insert(
            "type".into(),
            DeviceAttribute {
                string: Some("gpu".into()),
                ..DeviceAttribute::default()
            },
        );
        attributes.insert(
            "uuid".into(),
            DeviceAttribute {
                string: Some(self.uuid.clone()),
                ..DeviceAttribute::default()
            },
        );
        let (max, _) = maxima(model);
        Device {
            name: format!("gpu-{}", self.minor),
            attributes: Some(attributes),
            capacity: Some(
                max.iter()
                    .map(|(name, value)| {
                        (
                            (*name).to_string(),
                            DeviceCapacity {
                                value: quantity_of(&quantity_from(name, *value)),
                                ..DeviceCapacity::default()
                            },
                        )
                    })
                    .collect(),
            ),
            consumes_counters: Some(vec![DeviceCounterConsumption {
                counter_set: counter_set_name(self.minor),
                counters: full_counters(model),
            }]),
            ..Device::default()
        }
    }

    fn mig_device(&self, model: &GpuModel, profile: &MigProfile, start: u32) -> Device {
        let mut attributes = self.shared_attributes(model);
        for (name, value) in [
            ("type", "mig".to_string()),
            ("parentUUID", self.uuid.clone()),
            ("profile", profile.name.to_string()),
        ] {
            attributes.insert(
                name.into(),
                DeviceAttribute {
                    string: Some(value),
                    ..DeviceAttribute::default()
                },
            );
        }
        let capacities = capacities(profile);
        let mut counters: BTreeMap<String, Counter> = capacities
            .iter()
            .map(|(name, value)| {
                (
                    counter_name(name),
                    Counter {
                        value: quantity_of(value),
                    },
                )
            })
            .collect();
        for i in profile.memory_range(start) {
            counters.insert(
                memory_slice_counter(i),
                Counter {
                    value: quantity_of("1"),
                },
            );
        }
        Device {
            name: format!(
                "gpu-{}-mig-{}-{}-{start}",
                self.minor,
                name_part(&profile.name.to_string()),
                profile.gi_profile_id
            ),
            attributes: Some(attributes),
            capacity: Some(
                capacities
                    .into_iter()
                    .map(|(name, value)| {
                        (
                            name.to_string(),
                            DeviceCapacity {
                                value: quantity_of(&value),
                                ..DeviceCapacity::default()
                            },
                        )
                    })
                    .collect(),
            ),
            consumes_counters: Some(vec![DeviceCounterConsumption {
                counter_set: counter_set_name(self.minor),
                counters,
            }]),
            ..Device::default()
        }
    }

    /// The GPU's devices in the order NVIDIA's driver emits them: sorted by name.
    fn devices(&self, model: &GpuModel) -> Vec<Device> {
        let mut devices = vec![self.full_device(model)];
        for profile in &model.profiles {
            for start in &profile.placements {
                devices.push(self.mig_device(model, profile, *start));
            }
        }
        devices.sort_by(|a, b| a.name.cmp(&b.name));
        devices
    }
}

/// The pool NVIDIA's driver publishes for `node` with `gpus` GPUs of `model`: the counter
/// slice first, then one devices-only slice per GPU.
pub fn node_pool(node: &str, model: &GpuModel, gpus: u32) -> Vec<ResourceSliceSpec> {
    let gpus: Vec<Gpu> = (0..gpus).map(|minor| Gpu::new(node, minor)).collect();
    let pool = ResourcePool {
        name: node.to_string(),
        generation: 1,
        resource_slice_count: i64::from(u32::try_from(gpus.len() + 1).unwrap_or(u32::MAX)),
    };
    let slice = |shared_counters: Option<Vec<CounterSet>>, devices: Option<Vec<Device>>| ResourceSliceSpec {
        driver: DRIVER.to_string(),
        node_name: Some(node.to_string()),
        pool: pool.clone(),
        shared_counters,
        devices,
        ..ResourceSliceSpec::default()
    };
    let counter_sets = gpus
        .iter()
        .map(|gpu| CounterSet {
            name: counter_set_name(gpu.minor),
            counters: full_counters(model),
        })
        .collect();
    let mut slices = vec![slice(Some(counter_sets), None)];
    slices.extend(gpus.iter().map(|gpu| slice(None, Some(gpu.devices(model)))));
    slices
}

/// Creates NVIDIA's MIG DeviceClass (its selector: the driver and `type == 'mig'`).
async fn create_class(client: &Client) -> anyhow::Result<()> {
    let classes: Api<DeviceClass> = Api::all(client.clone());
    let class: DeviceClass = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": CLASS},
        "spec": {"selectors": [{"cel": {"expression": format!(
            "device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == 'mig'"
        )}}]},
    }))?;
    match classes.create(&PostParams::default(), &class).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(anyhow::Error::from(e).context(format!("creating DeviceClass {CLASS}"))),
    }
}

/// Publishes the peer's pool on every node in `nodes` (and its DeviceClass).
pub async fn publish(client: &Client, nodes: &[String], concurrency: usize) -> anyhow::Result<()> {
    create_class(client).await?;
    let model =
        migdra_api::catalog::model(MODEL).with_context(|| format!("{MODEL} is not in the catalog"))?;
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    stream::iter(nodes.iter().cloned())
        .map(|node| {
            let slices = slices.clone();
            async move {
                for (i, spec) in node_pool(&node, model, GPUS_PER_NODE).into_iter().enumerate() {
                    let slice = ResourceSlice {
                        metadata: ObjectMeta {
                            name: Some(format!("{node}-{DRIVER}-{i}")),
                            ..ObjectMeta::default()
                        },
                        spec,
                    };
                    match crate::retry::retry(|| async {
                        slices.create(&PostParams::default(), &slice).await
                    })
                    .await
                    {
                        Ok(_) => {}
                        Err(kube::Error::Api(e)) if e.code == 409 => {}
                        Err(e) => {
                            return Err(anyhow::Error::from(e)
                                .context(format!("creating the peer's slice {i} on {node}")));
                        }
                    }
                }
                anyhow::Ok(())
            }
        })
        .buffer_unordered(concurrency.max(1))
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// Deletes every slice of the peer's driver and waits until they are gone.
pub async fn remove(client: &Client) -> anyhow::Result<()> {
    super::publish::delete_driver_slices(client, DRIVER)
        .await
        .context("deleting the peer's slices")
}

/// The selector a user of NVIDIA's driver writes for one `1g.10gb` next to its MIG class: one on
/// its `profile` attribute.
pub fn profile_selector() -> String {
    format!("device.attributes['{DRIVER}'].profile == '{PROFILE}'")
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use migdra_api::slices::{
        quantity,
        validate::{limits, validate_pool},
    };

    use super::*;

    fn h100() -> &'static GpuModel {
        migdra_api::catalog::model(MODEL).expect("H100-80GB in the catalog")
    }

    fn pool() -> Vec<ResourceSliceSpec> {
        node_pool("sim-gpu-0001", h100(), GPUS_PER_NODE)
    }

    fn value(q: &Quantity) -> u128 {
        quantity::parse(&q.0).unwrap_or_else(|| panic!("{:?} is not an integer quantity", q.0))
    }

    /// Counter sets of the pool by name: counter → value.
    fn sets(pool: &[ResourceSliceSpec]) -> BTreeMap<String, BTreeMap<String, u128>> {
        pool.iter()
            .flat_map(|s| s.shared_counters.iter().flatten())
            .map(|set| {
                let counters = set
                    .counters
                    .iter()
                    .map(|(n, c)| (n.clone(), value(&c.value)))
                    .collect();
                (set.name.clone(), counters)
            })
            .collect()
    }

    fn devices(slice: &ResourceSliceSpec) -> &[Device] {
        slice.devices.as_deref().unwrap_or_default()
    }

    fn consumption(device: &Device) -> &DeviceCounterConsumption {
        match device.consumes_counters.as_deref() {
            Some([one]) => one,
            other => panic!("{}: expected one consumption, got {other:?}", device.name),
        }
    }

    fn memory_slices(device: &Device) -> BTreeSet<String> {
        consumption(device)
            .counters
            .keys()
            .filter(|n| n.starts_with("memory-slice-"))
            .cloned()
            .collect()
    }

    #[test]
    fn the_pool_passes_the_api_servers_and_the_allocators_rules() {
        let pool = pool();
        assert_eq!(validate_pool(&pool), Ok(()));
        // A pool that breaks a cross-reference fails the same check, so the check is live.
        let mut broken = pool.clone();
        broken[1].devices.as_mut().expect("devices")[3]
            .consumes_counters
            .as_mut()
            .expect("consumption")[0]
            .counters
            .insert(
                "memory-slice-9".into(),
                Counter {
                    value: quantity_of("1"),
                },
            );
        assert!(validate_pool(&broken).is_err());
    }

    #[test]
    fn one_counter_slice_then_one_device_slice_per_gpu() {
        let pool = pool();
        assert_eq!(pool.len(), GPUS_PER_NODE as usize + 1);
        assert_eq!(pool[0].pool.resource_slice_count, pool.len() as i64);
        assert!(devices(&pool[0]).is_empty());
        let names: Vec<&str> = pool[0]
            .shared_counters
            .iter()
            .flatten()
            .map(|s| s.name.as_str())
            .collect();
        let expected: Vec<String> = (0..GPUS_PER_NODE).map(counter_set_name).collect();
        assert_eq!(names, expected);
        assert!(names.len() <= limits::COUNTER_SETS_PER_SLICE);
        for (minor, slice) in pool[1..].iter().enumerate() {
            assert!(slice.shared_counters.is_none());
            assert!(devices(slice).len() <= limits::DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS);
            let prefix = format!("gpu-{minor}");
            assert!(
                devices(slice)
                    .iter()
                    .all(|d| d.name == prefix || d.name.starts_with(&format!("{prefix}-mig-")))
            );
            for device in devices(slice) {
                assert_eq!(consumption(device).counter_set, counter_set_name(minor as u32));
                assert!(consumption(device).counters.len() <= limits::COUNTERS_PER_CONSUMPTION);
            }
        }
    }

    #[test]
    fn every_counter_nvidia_publishes_with_the_largest_profiles_values() {
        let sets = sets(&pool());
        let set = &sets["gpu-0-counter-set"];
        let mut expected: BTreeMap<String, u128> = [
            ("multiprocessors", 132),
            ("copy-engines", 8),
            ("decoders", 7),
            ("encoders", 0),
            ("jpeg-engines", 7),
            ("ofa-engines", 1),
            ("memory", 81152 << 20),
        ]
        .into_iter()
        .map(|(n, v)| (n.to_string(), v))
        .collect();
        expected.extend((0..8).map(|i| (memory_slice_counter(i), 1)));
        assert_eq!(set, &expected);
        assert!(set.len() <= limits::COUNTERS_PER_SET);
    }

    #[test]
    fn every_consumed_counter_exists_in_its_set_and_fits() {
        let pool = pool();
        let sets = sets(&pool);
        for device in pool.iter().flat_map(devices) {
            let c = consumption(device);
            let set = sets
                .get(&c.counter_set)
                .unwrap_or_else(|| panic!("{}: no set {}", device.name, c.counter_set));
            for (name, counter) in &c.counters {
                let available = set
                    .get(name)
                    .unwrap_or_else(|| panic!("{}: no counter {name}", device.name));
                assert!(
                    value(&counter.value) <= *available,
                    "{}: {name} exceeds its set",
                    device.name
                );
            }
        }
    }

    #[test]
    fn placements_plus_one_devices_per_gpu_sorted_by_name() {
        let model = h100();
        let placements: usize = model.profiles.iter().map(|p| p.placements.len()).sum();
        assert_eq!(placements, 25, "7 + 7 (+me) + 4 (1g.20gb) + 3 + 2 + 1 + 1");
        for slice in &pool()[1..] {
            let names: Vec<&str> = devices(slice).iter().map(|d| d.name.as_str()).collect();
            assert_eq!(names.len(), placements + 1);
            assert!(names.is_sorted(), "{names:?}");
        }
        let names: Vec<String> = pool()[1]
            .devices
            .iter()
            .flatten()
            .map(|d| d.name.clone())
            .collect();
        for expected in [
            "gpu-0",
            "gpu-0-mig-1g10gb-19-0",
            "gpu-0-mig-1g10gb-me-20-6",
            "gpu-0-mig-1g20gb-15-6",
            "gpu-0-mig-3g40gb-9-4",
            "gpu-0-mig-7g80gb-0-0",
        ] {
            assert!(
                names.iter().any(|n| n == expected),
                "{expected} missing from {names:?}"
            );
        }
        // The full GPU sorts first, then the 1g.10gb placements: the first fit for B1's claim.
        assert_eq!(names[0], "gpu-0");
        assert_eq!(names[1], "gpu-0-mig-1g10gb-19-0");
    }

    #[test]
    fn overlapping_placements_share_a_memory_slice_counter() {
        let pool = pool();
        let gpu0 = devices(&pool[1]);
        let mut overlapping_pairs = 0;
        for (i, a) in gpu0.iter().enumerate() {
            for b in &gpu0[i + 1..] {
                let shared = memory_slices(a).intersection(&memory_slices(b)).count();
                let range = |d: &Device| -> Option<std::ops::Range<u32>> {
                    let mut parts = d.name.rsplitn(3, '-');
                    let start: u32 = parts.next()?.parse().ok()?;
                    let id: u32 = parts.next()?.parse().ok()?;
                    h100().geometry().profile_by_id(id).map(|p| p.memory_range(start))
                };
                let (ra, rb) = (range(a).unwrap_or(0..8), range(b).unwrap_or(0..8));
                let overlap = ra.start < rb.end && rb.start < ra.end;
                assert_eq!(shared > 0, overlap, "{} and {}", a.name, b.name);
                overlapping_pairs += usize::from(overlap);
            }
        }
        assert!(overlapping_pairs > 0);
        // The two 3g.40gb placements leave each other alone; 3g at 4 and 1g.20gb at 6 do not.
        let find = |n: &str| gpu0.iter().find(|d| d.name == n).expect(n);
        assert!(
            memory_slices(find("gpu-0-mig-3g40gb-9-0"))
                .is_disjoint(&memory_slices(find("gpu-0-mig-3g40gb-9-4")))
        );
        assert!(
            !memory_slices(find("gpu-0-mig-3g40gb-9-4"))
                .is_disjoint(&memory_slices(find("gpu-0-mig-1g20gb-15-6")))
        );
    }

    #[test]
    fn the_full_gpu_consumes_every_counter_of_its_set() {
        let pool = pool();
        let sets = sets(&pool);
        for slice in &pool[1..] {
            let full = &devices(slice)[0];
            let c = consumption(full);
            let consumed: BTreeMap<String, u128> = c
                .counters
                .iter()
                .map(|(n, q)| (n.clone(), value(&q.value)))
                .collect();
            assert_eq!(&consumed, &sets[&c.counter_set], "{}", full.name);
        }
    }

    #[test]
    fn attributes_and_capacities_as_nvidias_driver_sets_them() {
        let pool = pool();
        let gpu0 = devices(&pool[1]);
        let keys = |d: &Device| -> BTreeSet<String> {
            d.attributes.iter().flatten().map(|(k, _)| k.clone()).collect()
        };
        let shared = [
            "productName",
            "brand",
            "architecture",
            "cudaComputeCapability",
            "driverVersion",
            "cudaDriverVersion",
            "resource.kubernetes.io/pciBusID",
            "resource.kubernetes.io/pcieRoot",
        ];
        let full: BTreeSet<String> = shared
            .iter()
            .chain(&["type", "uuid"])
            .map(|s| s.to_string())
            .collect();
        let mig: BTreeSet<String> = shared
            .iter()
            .chain(&["type", "parentUUID", "profile"])
            .map(|s| s.to_string())
            .collect();
        assert_eq!(keys(&gpu0[0]), full);
        let one_g = &gpu0[1];
        assert_eq!(keys(one_g), mig);
        let attribute = |d: &Device, k: &str| {
            d.attributes
                .as_ref()
                .and_then(|a| a.get(k))
                .and_then(|a| a.string.clone())
        };
        assert_eq!(attribute(one_g, "profile").as_deref(), Some(PROFILE));
        assert_eq!(attribute(one_g, "type").as_deref(), Some("mig"));
        assert_eq!(attribute(one_g, "parentUUID"), attribute(&gpu0[0], "uuid"));
        let capacity: BTreeMap<String, u128> = one_g
            .capacity
            .iter()
            .flatten()
            .map(|(k, c)| (k.clone(), value(&c.value)))
            .collect();
        let expected: BTreeMap<String, u128> = [
            ("multiprocessors", 16),
            ("copyEngines", 1),
            ("decoders", 1),
            ("encoders", 0),
            ("jpegEngines", 1),
            ("ofaEngines", 0),
            ("memory", 9984 << 20),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        assert_eq!(capacity, expected);
        // Every capacity is consumed as the counter of the same name, zeros included, plus
        // the placement's memory slice.
        let consumed = &consumption(one_g).counters;
        assert_eq!(consumed.len(), 7 + 1);
        for (name, v) in &expected {
            assert_eq!(value(&consumed[&counter_name(name)].value), *v, "{name}");
        }
        assert_eq!(
            memory_slices(one_g),
            BTreeSet::from(["memory-slice-0".to_string()])
        );
    }

    #[test]
    fn names_follow_nvidias_rules() {
        assert_eq!(counter_name("copyEngines"), "copy-engines");
        assert_eq!(counter_name("ofaEngines"), "ofa-engines");
        assert_eq!(counter_name("memory"), "memory");
        assert_eq!(name_part("1g.10gb+me"), "1g10gb-me");
        assert_eq!(name_part("7g.80gb"), "7g80gb");
        assert_eq!(name_part("1g.24gb+me.all"), "1g24gb-meall");
    }
}
