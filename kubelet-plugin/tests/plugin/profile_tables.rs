//! Discovery against models whose tables NVML's rules overrule ours: profile indexes walked
//! until NVML calls one invalid, a duplicate full compute-instance profile, and per-profile
//! engine counts that add up past the full GPU's.

use std::collections::{BTreeMap, BTreeSet};

use migdra_api::{
    inventory::{GpuHealth, GpuInventory},
    policy::EffectivePolicy,
    slices::plan_pool,
};
use migdra_fake_nvml::{FakeConfig, FaultConfig, GpuConfig, GpuQuirks, code, testing::FakeGpuHost};
use migdra_kubelet_plugin::{
    gpus::gpu_inventory,
    nvml::{GpuBackend, NvmlBackend},
};

fn host_of(gpus: Vec<GpuConfig>, faults: Vec<FaultConfig>) -> FakeGpuHost {
    FakeGpuHost::new(FakeConfig {
        gpus,
        faults,
        ..FakeConfig::default()
    })
    .expect("fake GPU host")
}

fn backend(host: &FakeGpuHost) -> NvmlBackend {
    NvmlBackend::new(Some(&host.lib_path())).expect("NVML init against the fake")
}

/// (profile ID, profile index) of every profile discovered on GPU 0.
fn discovered(host: &FakeGpuHost) -> BTreeSet<(u32, u32)> {
    let gpu = backend(host).discover().expect("discovery").remove(0);
    gpu.mig
        .expect("a MIG-capable GPU")
        .profiles
        .iter()
        .map(|p| (p.gi_profile_id, p.gi_profile_index))
        .collect()
}

/// What the plugin reports for GPU 0 of `host`, without instances.
fn inventory(host: &FakeGpuHost) -> GpuInventory {
    let gpu = backend(host).discover().expect("discovery").remove(0);
    gpu_inventory(&gpu, &[], &BTreeMap::new(), GpuHealth::healthy(), true)
}

#[test]
fn profile_indexes_are_walked_until_nvml_calls_one_invalid() {
    // A driver numbering the `+me` profile past the header's count (18) still has it found.
    let quirks = GpuQuirks {
        profile_indexes: BTreeMap::from([(20, 21)]),
        ..GpuQuirks::default()
    };
    let host = host_of(
        vec![GpuConfig::new("H100-80GB", true).with_quirks(quirks)],
        vec![],
    );
    let profiles = discovered(&host);
    assert!(profiles.contains(&(20, 21)), "{profiles:?}");
    assert!(!profiles.iter().any(|(id, index)| *id == 20 && *index != 21));
    assert_eq!(profiles.len(), 7);

    // INVALID_ARGUMENT ends the walk: nothing past index 3 is asked for.
    let host = host_of(
        vec![GpuConfig::new("H100-80GB", true)],
        vec![FaultConfig::error("nvmlDeviceGetGpuInstanceProfileInfo", code::INVALID_ARGUMENT).on_profile(3)],
    );
    let indexes: BTreeSet<u32> = discovered(&host).iter().map(|(_, index)| *index).collect();
    assert_eq!(indexes, BTreeSet::from([0, 1, 2]));
}

#[test]
fn the_plain_full_compute_instance_wins_over_a_duplicate_of_its_size() {
    // GB200's table offers `7_SLICE_NVL` (index 8) next to the plain 7-slice CI profile (4).
    let host = host_of(vec![GpuConfig::new("GB200", true)], vec![]);
    let nvml = backend(&host);
    let gi = nvml.create_gpu_instance(0, 0, 0).unwrap();
    nvml.create_full_compute_instance(0, gi).unwrap();
    let state = host.read_state().unwrap();
    assert_eq!(state.gpus[0].gpu_instances[0].compute_instances[0].profile_id, 4);
    let listed = nvml.list_gpu_instances(0).unwrap();
    assert_eq!(listed[0].compute_instances.len(), 1);
}

#[test]
fn engine_counts_that_add_up_past_the_gpu_fall_back_to_slice_counters() {
    let policy = EffectivePolicy {
        whole_gpus: false,
        ..EffectivePolicy::default()
    };
    let host = host_of(vec![GpuConfig::new("A100-80GB-OVERADDING", true)], vec![]);
    let gpu = inventory(&host);
    let why = gpu
        .mig
        .as_ref()
        .unwrap()
        .engine_counters_overruled
        .clone()
        .unwrap();
    assert!(why.contains("decoders counter"), "{why}");
    let plan = plan_pool(std::slice::from_ref(&gpu), &policy);
    let (_, counters) = &plan.counter_sets[0];
    assert!(!counters.contains_key("decoders"), "{counters:?}");
    assert_eq!(counters.get("profile-20-instances"), Some(&1));

    // NVML creates 4g + 3g, which the reported decoders (4 + 3 of 5) would refuse; both
    // devices are published and share no counter but the memory slices.
    let nvml = backend(&host);
    nvml.create_gpu_instance(0, 5, 0).unwrap();
    nvml.create_gpu_instance(0, 9, 4).unwrap();
    let consumes = |name: &str| {
        plan.devices
            .iter()
            .find(|d| d.name.to_string() == name)
            .map(|d| d.consumes.clone())
            .unwrap_or_else(|| panic!("{name} not published"))
    };
    let four = consumes("gpu-0-mig-4g40gb-0");
    let three = consumes("gpu-0-mig-3g40gb-4");
    assert!(four.keys().all(|k| !three.contains_key(k)), "{four:?} {three:?}");

    // The same GPU with consistent counts keeps its engine counters.
    let host = host_of(vec![GpuConfig::new("A100-80GB", true)], vec![]);
    let gpu = inventory(&host);
    assert_eq!(gpu.mig.as_ref().unwrap().engine_counters_overruled, None);
    let plan = plan_pool(&[gpu], &policy);
    assert!(plan.counter_sets[0].1.contains_key("decoders"));
}
