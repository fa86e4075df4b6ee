//! The `GpuNode` custom resource: one per GPU node, named after the node, written by the
//! kubelet plugin (what the node has) and read by the controller (what to publish).
//!
//! The plugin owns `status.plugin` and `status.gpus`; the controller owns
//! `status.publication` and `status.conditions`. Both write with server-side apply under
//! their own field managers, so neither clobbers the other.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{
    geometry::{Architecture, MigGeometry, Placement},
    profile::ProfileName,
};

/// API group of migdra's custom resources and opaque configuration.
pub const GROUP: &str = "gpu.migdra.dev";
/// API version of migdra's custom resources and opaque configuration.
pub const VERSION: &str = "v1alpha1";
/// `apiVersion` string of migdra's objects.
pub const API_VERSION: &str = "gpu.migdra.dev/v1alpha1";
/// Default DRA driver name.
pub const DEFAULT_DRIVER_NAME: &str = "gpu.migdra.dev";

/// Spec of a [`GpuNode`].
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "gpu.migdra.dev",
    version = "v1alpha1",
    kind = "GpuNode",
    plural = "gpunodes",
    shortname = "gpun",
    status = "GpuNodeStatus",
    printcolumn = r#"{"name":"Driver","type":"string","jsonPath":".spec.driver"}"#,
    printcolumn = r#"{"name":"GPUs","type":"integer","jsonPath":".status.publication.gpus"}"#,
    printcolumn = r#"{"name":"Registered","type":"boolean","jsonPath":".status.plugin.registered"}"#,
    printcolumn = r#"{"name":"Devices","type":"integer","jsonPath":".status.publication.devices"}"#,
    printcolumn = r#"{"name":"Live","type":"string","description":"Whether the controller sees the plugin live and publishes its pool (the Published condition)","jsonPath":".status.conditions[?(@.type==\"Published\")].status"}"#,
    printcolumn = r#"{"name":"Instances","type":"integer","priority":1,"description":"MIG instances on the node (migdra's and foreign)","jsonPath":".status.summary.instances"}"#,
    printcolumn = r#"{"name":"Foreign","type":"integer","priority":1,"description":"MIG instances migdra did not create","jsonPath":".status.summary.foreignInstances"}"#,
    printcolumn = r#"{"name":"Free-Slices","type":"string","priority":1,"description":"Free memory slices of the MIG-enabled GPUs, free/total","jsonPath":".status.summary.freeMemorySlices"}"#,
    printcolumn = r#"{"name":"Health","type":"string","priority":1,"description":"Healthy, or how many GPUs are unhealthy","jsonPath":".status.summary.health"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct GpuNodeSpec {
    /// The node this inventory describes (equal to `metadata.name`).
    pub node_name: String,
    /// The DRA driver name the node's plugin serves.
    pub driver: String,
}

/// Status of a [`GpuNode`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuNodeStatus {
    /// The kubelet plugin's registration with the kubelet (written by the plugin; its
    /// heartbeat is a Lease, see [`heartbeat_lease_name`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugin: Option<PluginStatus>,
    /// The GPUs of the node (written by the plugin).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus: Option<Vec<GpuInventory>>,
    /// Figures of `gpus` at a glance, for `kubectl get gpunodes -o wide` (written by the
    /// plugin with `gpus`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<NodeSummary>,
    /// What the controller published for this node (written by the controller).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publication: Option<PublicationStatus>,
    /// Conditions (written by the controller): `Published`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
}

/// A node's GPUs at a glance: counts a printer column can show (a column cannot count a list).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeSummary {
    /// GPUs on the node.
    pub gpus: u32,
    /// GPUs that failed their last health probe (or wait for a repair).
    pub unhealthy_gpus: u32,
    /// MIG instances on the node, migdra's and foreign.
    pub instances: u32,
    /// MIG instances migdra did not create.
    pub foreign_instances: u32,
    /// Free memory slices over all MIG-enabled GPUs, as `free/total`.
    pub free_memory_slices: String,
    /// `Healthy`, or `<n>/<gpus> unhealthy`.
    pub health: String,
}

impl NodeSummary {
    /// The summary of an inventory. A MIG-enabled GPU's used memory slices are the union of its
    /// instances' placements (foreign ones included); GPUs with MIG off count as neither free
    /// nor used (a whole-GPU claim takes them as one device).
    pub fn of(gpus: &[GpuInventory]) -> Self {
        let mut summary = Self {
            gpus: u32::try_from(gpus.len()).unwrap_or(u32::MAX),
            ..Self::default()
        };
        let (mut free, mut total) = (0u32, 0u32);
        for gpu in gpus {
            if !gpu.health.healthy {
                summary.unhealthy_gpus += 1;
            }
            let Some(mig) = &gpu.mig else { continue };
            let count = |owner| {
                let n = mig.instances.iter().filter(|i| i.owner == owner).count();
                u32::try_from(n).unwrap_or(u32::MAX)
            };
            summary.instances += count(InstanceOwner::Migdra) + count(InstanceOwner::Foreign);
            summary.foreign_instances += count(InstanceOwner::Foreign);
            if mig.enabled {
                let used = mig.used_memory_slices().len();
                let slices = mig.geometry.budget.memory_slices;
                total += slices;
                free += slices.saturating_sub(u32::try_from(used).unwrap_or(u32::MAX));
            }
        }
        summary.free_memory_slices = format!("{free}/{total}");
        summary.health = if summary.unhealthy_gpus == 0 {
            "Healthy".into()
        } else {
            format!("{}/{} unhealthy", summary.unhealthy_gpus, summary.gpus)
        };
        summary
    }
}

/// The kubelet plugin's view of itself, written when it changes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PluginStatus {
    /// migdra version of the plugin.
    pub version: String,
    /// True once the kubelet confirmed the plugin's registration.
    pub registered: bool,
    /// The kubelet's reason when it rejected the registration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registration_error: Option<String>,
    /// When the plugin process started.
    pub start_time: Time,
    /// NVIDIA driver version reported by NVML.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_version: Option<String>,
}

/// One GPU as NVML reports it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuInventory {
    /// Device minor (`/dev/nvidia<minor>`); names the GPU in device names.
    pub minor: u32,
    /// NVML enumeration index.
    pub index: u32,
    /// GPU UUID (`GPU-…`).
    pub uuid: String,
    /// Product name, e.g. `NVIDIA H100 80GB HBM3`.
    pub product_name: String,
    /// Architecture, when NVML reports one migdra knows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<Architecture>,
    /// CUDA compute capability, e.g. `9.0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_compute_capability: Option<String>,
    /// PCI bus ID, e.g. `0000:3b:00.0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_bus_id: Option<String>,
    /// NUMA node, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<i64>,
    /// Total memory in MiB.
    pub memory_mib: u64,
    /// MIG state; absent when the GPU is not MIG-capable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigInventory>,
    /// Health of the GPU.
    pub health: GpuHealth,
}

/// Health of a GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuHealth {
    /// False when the GPU failed its last health probe.
    pub healthy: bool,
    /// Why it is unhealthy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl GpuHealth {
    /// A healthy GPU.
    pub fn healthy() -> Self {
        Self {
            healthy: true,
            reason: None,
        }
    }
}

/// MIG state of a MIG-capable GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigInventory {
    /// Current MIG mode.
    pub enabled: bool,
    /// True when a mode change is pending (Ampere: needs a GPU reset).
    #[serde(default)]
    pub change_pending: bool,
    /// True when the plugin may switch MIG mode on demand: no reset needed (Hopper and later)
    /// and no process NVML lists holds the GPU. `migMode: Dynamic` offers switches only here.
    pub mode_switchable: bool,
    /// Profiles, placements and budgets as NVML reports them.
    pub geometry: MigGeometry,
    /// GPU instances that exist now.
    #[serde(default)]
    pub instances: Vec<MigInstance>,
    /// Why migdra's engine and memory counters are not published for this GPU: a layout
    /// NVML's placements allow that they would refuse. Its devices then consume memory
    /// slices, instance counts and the optical-flow engine only. Absent when the counters
    /// are published.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_counters_overruled: Option<String>,
}

impl MigInventory {
    /// The memory slices covered by the GPU's instances (foreign ones included), in order.
    /// An instance of a profile the GPU does not report covers nothing known.
    pub fn used_memory_slices(&self) -> std::collections::BTreeSet<u32> {
        self.instances
            .iter()
            .filter_map(|i| {
                self.geometry
                    .profile_by_id(i.placement.profile_id)
                    .map(|p| p.memory_range(i.placement.start))
            })
            .flatten()
            .collect()
    }
}

/// Who made a GPU instance.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum InstanceOwner {
    /// Created by migdra for a claim.
    Migdra,
    /// Created by someone else (an admin, mig-parted, another driver); migdra never touches it.
    #[default]
    Foreign,
}

/// A GPU instance that exists on a GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigInstance {
    /// Profile name, when the profile ID is one the GPU reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<ProfileName>,
    /// GPU-instance profile ID and placement start.
    pub placement: Placement,
    /// NVML GPU-instance ID.
    pub gpu_instance_id: u32,
    /// Who created it.
    pub owner: InstanceOwner,
    /// `namespace/name` of the claim it serves, for migdra's instances.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<String>,
    /// UID of the claim it serves, for migdra's instances.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_uid: Option<String>,
    /// NVML compute-instance ID of the instance migdra created in it (migdra's instances).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_instance_id: Option<u32>,
    /// MIG device UUID (`MIG-…`) of that compute instance (migdra's instances): what
    /// `nvidia-smi -L` and the container's `NVIDIA_VISIBLE_DEVICES` show.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_uuid: Option<String>,
}

/// What the controller published for a node.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PublicationStatus {
    /// Pool name.
    pub pool: String,
    /// Pool generation last written.
    pub generation: i64,
    /// Slices in the pool.
    pub slices: u32,
    /// Devices in the pool.
    pub devices: u32,
    /// GPUs published.
    pub gpus: u32,
    /// Name of the MigPolicy applied, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
}

/// The pool name of a node. Pools are named per driver, `<node>/<driver>`, because schedulers
/// without kubernetes/kubernetes#140434's fix share counter accounting between same-named
/// pools of different drivers.
pub fn pool_name(node: &str, driver: &str) -> String {
    format!("{node}/{driver}")
}

/// Label on every plugin heartbeat Lease; its value is the driver name (the controller's
/// watch selects on it).
pub const HEARTBEAT_LEASE_LABEL: &str = "gpu.migdra.dev/heartbeat";

/// Longest object name (a DNS subdomain).
const MAX_OBJECT_NAME: usize = 253;

/// The name of the `coordination.k8s.io/v1` Lease the plugin of `driver` on `node` renews as
/// its heartbeat, in the controller's namespace: `<node>.<driver>`, or, when that is longer
/// than an object name may be, `<node prefix>-<hash of node>.<driver>`, cut to fit. The
/// Lease's `spec.holderIdentity` is the whole node name: a reader maps a Lease to its node by
/// that, and checks that this function gives the Lease's name for it.
pub fn heartbeat_lease_name(node: &str, driver: &str) -> String {
    let name = format!("{node}.{driver}");
    if name.len() <= MAX_OBJECT_NAME {
        return name;
    }
    let hash = format!("{:016x}", fnv1a_64(node.as_bytes()));
    let keep = node.floor_char_boundary(MAX_OBJECT_NAME.saturating_sub(driver.len() + 1 + hash.len() + 1));
    // A name part may neither end in '-' nor be followed by '-' after a '.'.
    match node[..keep].trim_end_matches(['-', '.']) {
        "" => format!("{hash}.{driver}"),
        prefix => format!("{prefix}-{hash}.{driver}"),
    }
}

/// The 64-bit FNV-1a hash: stable across Rust versions and platforms, unlike std's hashers,
/// so a plugin and a controller built apart name a Lease alike.
fn fnv1a_64(bytes: &[u8]) -> u64 {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes.iter().fold(OFFSET_BASIS, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(PRIME)
    })
}

/// When a plugin tries a failed heartbeat Lease renewal again, before its next beat: the
/// controller keeps a pool only while the last renewal is younger than the heartbeat timeout
/// (25 s against a 15 s beat by default), so one failed renewal must not wait for the next
/// beat. Each retry is a fresh request with a new `renewTime` (an old one would vouch for less
/// of the timeout). Only answers that can change are retried ([`Self::retryable`]); delays
/// double from [`Self::FIRST_DELAY`] to [`Self::MAX_DELAY`], each cut by up to half at random
/// so that plugins refused together (API Priority and Fairness) do not return together; no
/// retry is due at or after the next beat.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RenewalRetry {
    failures: u32,
}

impl RenewalRetry {
    /// Before jitter.
    pub const FIRST_DELAY: std::time::Duration = std::time::Duration::from_millis(500);
    /// Before jitter.
    pub const MAX_DELAY: std::time::Duration = std::time::Duration::from_secs(4);

    /// Whether a renewal answered with HTTP `status` is worth trying again within the beat:
    /// no answer (`None`), 429 (flow control) and 5xx; any other 4xx would come again.
    pub fn retryable(status: Option<u16>) -> bool {
        match status {
            None => true,
            Some(code) => code == 429 || (500..600).contains(&code),
        }
    }

    /// Records a failed renewal; the delay before the next attempt, or `None` when that
    /// would not come before the next beat. `entropy` (any random value) picks the jitter.
    pub fn failed(
        &mut self,
        until_next_beat: std::time::Duration,
        entropy: u64,
    ) -> Option<std::time::Duration> {
        self.failures = self.failures.saturating_add(1);
        let doublings = (self.failures - 1).min(16);
        let full = Self::FIRST_DELAY
            .saturating_mul(1 << doublings)
            .min(Self::MAX_DELAY);
        // Keep between half and all of it: (entropy / 2^64) of the other half is cut.
        let cut = full.mul_f64((entropy as f64 / u64::MAX as f64) / 2.0);
        let delay = full.saturating_sub(cut);
        (delay < until_next_beat).then_some(delay)
    }

    /// [`Self::failed`] with a random `entropy` (std's per-instance random hash keys).
    pub fn failed_now(&mut self, until_next_beat: std::time::Duration) -> Option<std::time::Duration> {
        use std::hash::BuildHasher;
        let entropy = std::collections::hash_map::RandomState::new().hash_one(self.failures);
        self.failed(until_next_beat, entropy)
    }

    /// Records a successful renewal: the next failure starts from [`Self::FIRST_DELAY`].
    pub fn succeeded(&mut self) {
        self.failures = 0;
    }

    pub fn failures(&self) -> u32 {
        self.failures
    }
}

#[cfg(test)]
mod renewal_retry_tests {
    use std::time::Duration;

    use proptest::prelude::*;

    use super::RenewalRetry;

    #[test]
    fn only_answers_that_can_change_are_retried() {
        for status in [None, Some(429), Some(500), Some(503), Some(504)] {
            assert!(RenewalRetry::retryable(status), "{status:?}");
        }
        for status in [Some(400), Some(403), Some(404), Some(409), Some(422), Some(200)] {
            assert!(!RenewalRetry::retryable(status), "{status:?}");
        }
    }

    #[test]
    fn delays_double_up_to_the_cap_and_restart_after_a_success() {
        let mut retry = RenewalRetry::default();
        let beat = Duration::from_secs(60);
        let full: Vec<Duration> = (0..6).map(|_| retry.failed(beat, 0).unwrap()).collect();
        assert_eq!(
            full,
            [500, 1000, 2000, 4000, 4000, 4000].map(Duration::from_millis)
        );
        assert_eq!(retry.failures(), 6);
        retry.succeeded();
        assert_eq!(retry.failures(), 0);
        assert_eq!(retry.failed(beat, u64::MAX), Some(Duration::from_millis(250)));
    }

    #[test]
    fn no_retry_is_due_at_or_after_the_next_beat() {
        let mut retry = RenewalRetry::default();
        assert_eq!(retry.failed(Duration::from_millis(500), 0), None);
        assert_eq!(
            retry.failed(Duration::from_millis(1001), 0),
            Some(Duration::from_secs(1))
        );
        assert_eq!(retry.failures(), 2);
    }

    proptest! {
        #[test]
        fn every_delay_is_within_half_and_all_of_the_doubling_and_before_the_beat(
            failures in 1u32..40,
            entropy in any::<u64>(),
            beat_ms in 1u64..30_000,
        ) {
            let mut retry = RenewalRetry::default();
            let beat = Duration::from_millis(beat_ms);
            let mut delay = None;
            for _ in 0..failures {
                delay = retry.failed(beat, entropy);
            }
            let doubled = RenewalRetry::FIRST_DELAY
                .saturating_mul(1 << (failures - 1).min(16))
                .min(RenewalRetry::MAX_DELAY);
            match delay {
                Some(d) => {
                    prop_assert!(d < beat);
                    prop_assert!(d <= doubled && d >= doubled / 2, "{d:?} vs {doubled:?}");
                }
                // Refused only when even the longest delay it could have picked is not early.
                None => prop_assert!(doubled >= beat, "{doubled:?} vs beat {beat:?}"),
            }
        }
    }
}

#[cfg(test)]
mod lease_name_tests {
    use proptest::prelude::*;

    use super::*;

    /// A DNS subdomain, as Kubernetes validates object names.
    fn is_dns_subdomain(name: &str) -> bool {
        name.len() <= MAX_OBJECT_NAME
            && name.split('.').all(|label| {
                !label.is_empty()
                    && label.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
                    && label.ends_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
                    && label
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            })
    }

    #[test]
    fn a_lease_is_named_after_its_node_and_driver_while_that_fits() {
        assert_eq!(
            heartbeat_lease_name("node-a", DEFAULT_DRIVER_NAME),
            "node-a.gpu.migdra.dev"
        );
        let longest = "n".repeat(253 - DEFAULT_DRIVER_NAME.len() - 1);
        assert_eq!(
            heartbeat_lease_name(&longest, DEFAULT_DRIVER_NAME),
            format!("{longest}.{DEFAULT_DRIVER_NAME}")
        );
    }

    #[test]
    fn a_long_node_name_is_cut_and_hashed_to_a_valid_distinct_name() {
        let longest = "n".repeat(253 - DEFAULT_DRIVER_NAME.len() - 1);
        let a = heartbeat_lease_name(&format!("{longest}a"), DEFAULT_DRIVER_NAME);
        let b = heartbeat_lease_name(&format!("{longest}b"), DEFAULT_DRIVER_NAME);
        for name in [&a, &b] {
            assert!(is_dns_subdomain(name), "{name}");
            assert!(name.ends_with(".gpu.migdra.dev"), "{name}");
            assert!(name.starts_with(&longest[..200]), "{name}");
        }
        assert_ne!(a, b, "nodes sharing a long prefix get Leases of their own");
        // The same node always gets the same name (a fixed hash, not a per-process one).
        assert_eq!(
            a,
            heartbeat_lease_name(&format!("{longest}a"), DEFAULT_DRIVER_NAME)
        );
        assert_eq!(fnv1a_64(b"node-a"), 0xe697_1cc2_2078_cb53);
    }

    #[test]
    fn a_cut_never_leaves_a_dash_or_dot_before_the_hash() {
        for cut_at in ["-", ".", "-----"] {
            let node = format!("{}{cut_at}x{}", "a".repeat(220), "b".repeat(30));
            let name = heartbeat_lease_name(&node, DEFAULT_DRIVER_NAME);
            assert!(is_dns_subdomain(&name), "{name}");
        }
    }

    proptest! {
        #[test]
        fn every_valid_node_name_gets_a_valid_lease_name(
            labels in prop::collection::vec("[a-z0-9]([a-z0-9-]{0,40}[a-z0-9])?", 1..12),
        ) {
            let node: String = labels.join(".").chars().take(253).collect();
            let node = node.trim_end_matches(['-', '.']).to_string();
            prop_assume!(is_dns_subdomain(&node));
            let name = heartbeat_lease_name(&node, DEFAULT_DRIVER_NAME);
            prop_assert!(is_dns_subdomain(&name), "{}", name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog;

    fn instance(gpu: &GpuInventory, profile: &str, start: u32, owner: InstanceOwner) -> MigInstance {
        let mig = gpu.mig.as_ref().unwrap();
        let profile = mig.geometry.profile_by_name(&profile.parse().unwrap()).unwrap();
        MigInstance {
            profile: Some(profile.name),
            placement: Placement {
                profile_id: profile.gi_profile_id,
                start,
            },
            gpu_instance_id: start + 1,
            owner,
            ..MigInstance::default()
        }
    }

    #[test]
    fn summary_counts_instances_free_slices_and_health() {
        let model = catalog::model("H100-80GB").unwrap();
        let mut busy = model.inventory(0, true);
        let ours = instance(&busy, "3g.40gb", 4, InstanceOwner::Migdra);
        let foreign = instance(&busy, "1g.10gb", 0, InstanceOwner::Foreign);
        busy.mig.as_mut().unwrap().instances = vec![ours, foreign];
        let mut sick = model.inventory(1, true);
        sick.health = GpuHealth {
            healthy: false,
            reason: Some("GPU is lost".into()),
        };
        let off = model.inventory(2, false);

        let summary = NodeSummary::of(&[busy.clone(), sick, off]);
        assert_eq!(summary.gpus, 3);
        assert_eq!(summary.unhealthy_gpus, 1);
        assert_eq!(summary.instances, 2);
        assert_eq!(summary.foreign_instances, 1);
        // GPU 0: 3g.40gb@4 covers slices 4..8, 1g.10gb@0 covers 0; GPU 1 is empty; GPU 2 has MIG off.
        assert_eq!(summary.free_memory_slices, "11/16");
        assert_eq!(summary.health, "1/3 unhealthy");
        assert_eq!(
            busy.mig
                .unwrap()
                .used_memory_slices()
                .into_iter()
                .collect::<Vec<_>>(),
            vec![0, 4, 5, 6, 7]
        );
        assert_eq!(NodeSummary::of(&[]).health, "Healthy");
    }
}
