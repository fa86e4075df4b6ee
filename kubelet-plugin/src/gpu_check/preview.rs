//! What migdra would publish and hand to containers for a GPU, computed read-only: the pool's
//! device names and counters (through [`migdra_api::slices::plan_pool`], the slice model the
//! plugin publishes with), the MIG capability files CDI specs are built from (as
//! [`CdiWriter`] reads them) and the driver files a spec would mount
//! ([`crate::driver_files::discover`]).

use std::{collections::BTreeMap, path::Path};

use k8s_openapi::api::resource::v1::DeviceAttribute;
use migdra_api::{
    device_name::DeviceName,
    geometry::MigProfile,
    inventory::{DEFAULT_DRIVER_NAME, GpuHealth},
    policy::{EffectivePolicy, MigMode},
    slices::{PlannedKind, PoolIdentity, plan_pool, published_plan, render_pool},
};
use serde::Serialize;

use super::{
    CheckOptions,
    report::{Finding, ProfileRow},
};
use crate::{
    cdi::CdiWriter,
    driver_files::{self, DiscoveryInputs},
    gpus::gpu_inventory,
    nvml::{GpuBackend, GpuDescription, GpuInstanceRecord, NvmlBackend, NvmlErrorKind},
};

/// The GPU instances that exist on a GPU (none when MIG is off or unsupported).
pub fn existing_instances(
    backend: &NvmlBackend,
    gpu: &GpuDescription,
) -> Result<Vec<GpuInstanceRecord>, crate::nvml::BackendError> {
    match &gpu.mig {
        Some(mig) if mig.enabled => match backend.list_gpu_instances(gpu.index) {
            Err(e) if e.kind == NvmlErrorKind::NotSupported => Ok(Vec::new()),
            other => other,
        },
        _ => Ok(Vec::new()),
    }
}

/// One device of the pool.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PublishedDevice {
    pub name: String,
    /// Profile ID and placement start; `None` for the whole GPU.
    pub profile_id: Option<u32>,
    pub start: Option<u32>,
    /// Its attributes and capacity as the ResourceSlice carries them (values as text).
    pub attributes: BTreeMap<String, String>,
    pub capacity: BTreeMap<String, String>,
}

/// The part of the node's pool one GPU contributes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PublishedReport {
    pub device_count: usize,
    /// In published order.
    pub devices: Vec<PublishedDevice>,
    pub counter_set: Option<String>,
    /// Its counters, as published: those that can refuse an allocation.
    pub counters: BTreeMap<String, u64>,
    /// Counters of the set left out because no device set could ever exceed them
    /// ([`migdra_api::slices::prune`]).
    pub counters_left_out: BTreeMap<String, u64>,
    #[serde(skip)]
    pub findings: Vec<Finding>,
}

/// The devices (with their attributes and capacity) and counters migdra could publish for
/// `gpu` (the default policy in `Dynamic` MIG mode, which offers partitions and the whole GPU
/// whatever its mode), with a check that every name is a DNS label that parses back to the
/// same device.
pub fn published(
    gpu: &GpuDescription,
    instances: &[GpuInstanceRecord],
    driver_version: &str,
) -> PublishedReport {
    // All instances are foreign: the check has no claims.
    let no_claims = BTreeMap::new();
    let switchable = gpu.architecture.is_some_and(|a| a.mig_mode_switchable());
    let gpus = [gpu_inventory(
        gpu,
        instances,
        &no_claims,
        GpuHealth::healthy(),
        switchable,
    )];
    let policy = EffectivePolicy {
        mig_mode: MigMode::Dynamic,
        ..EffectivePolicy::default()
    };
    let budget = plan_pool(&gpus, &policy)
        .counter_sets
        .first()
        .map(|(_, c)| c.clone())
        .unwrap_or_default();
    let (plan, _) = published_plan(&gpus, &policy, &Default::default());
    let identity = PoolIdentity {
        driver: DEFAULT_DRIVER_NAME,
        node: "gpu-check",
        pool: "gpu-check",
        generation: 1,
        driver_version: Some(driver_version),
    };
    let rendered: BTreeMap<String, _> = render_pool(&identity, &gpus, &plan)
        .into_iter()
        .flat_map(|slice| slice.devices.unwrap_or_default())
        .map(|d| (d.name.clone(), d))
        .collect();
    let label = format!("GPU {} ({})", gpu.index, gpu.product_name);
    // What the plugin's EngineCountersOverruled event says, before the node publishes.
    let mut findings: Vec<Finding> = gpus[0]
        .mig
        .as_ref()
        .and_then(|m| m.engine_counters_overruled.as_ref())
        .map(|why| Finding::warning(format!("{label}: {why}")))
        .into_iter()
        .collect();
    let mut devices = Vec::new();
    for d in &plan.devices {
        let name = d.name.to_string();
        let parses_back = name.parse::<DeviceName>().ok() == Some(d.name);
        if !parses_back || name.len() > 63 {
            findings.push(Finding::mismatch(format!(
                "{label}: device name {name:?} is not a DNS label that names the device back"
            )));
        }
        let (profile_id, start) = match &d.kind {
            PlannedKind::Mig { profile, start } => (Some(profile.gi_profile_id), Some(*start)),
            PlannedKind::Gpu => (None, None),
        };
        let rendered = rendered.get(&name);
        let attributes = rendered
            .and_then(|d| d.attributes.as_ref())
            .map(|a| a.iter().map(|(k, v)| (k.clone(), attribute_text(v))).collect())
            .unwrap_or_default();
        let capacity = rendered
            .and_then(|d| d.capacity.as_ref())
            .map(|c| c.iter().map(|(k, v)| (k.clone(), v.value.0.clone())).collect())
            .unwrap_or_default();
        devices.push(PublishedDevice {
            name,
            profile_id,
            start,
            attributes,
            capacity,
        });
    }
    let (counter_set, counters) = plan
        .counter_sets
        .into_iter()
        .next()
        .map_or((None, BTreeMap::new()), |(name, c)| (Some(name), c));
    let counters_left_out = budget
        .into_iter()
        .filter(|(name, _)| !counters.contains_key(name))
        .collect();
    PublishedReport {
        device_count: devices.len(),
        devices,
        counter_set,
        counters,
        counters_left_out,
        findings,
    }
}

fn attribute_text(a: &DeviceAttribute) -> String {
    match (a.bool, a.int, &a.string, &a.version) {
        (Some(b), ..) => b.to_string(),
        (_, Some(i), ..) => i.to_string(),
        (_, _, Some(s), _) => s.clone(),
        (.., Some(v)) => v.clone(),
        _ => String::new(),
    }
}

pub fn fill_device_names(rows: &mut [ProfileRow], published: &PublishedReport) {
    for row in rows {
        row.device_names = published
            .devices
            .iter()
            .filter(|d| d.profile_id == Some(row.id))
            .map(|d| d.name.clone())
            .collect();
    }
}

/// The maximal layouts of a GPU ([`super::layouts::maximal_layouts`]) and which of them the
/// published counters let the scheduler allocate; full mode then asks NVML.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LayoutsPreview {
    pub maximal: usize,
    pub counters_accept: usize,
    /// `layout: why`, for those the counters refuse (e.g. two `+me` instances on a GPU with
    /// one OFA engine).
    pub counters_refuse: Vec<String>,
}

pub fn layouts(gpu: &GpuDescription, profiles: &[MigProfile]) -> LayoutsPreview {
    let counters = super::layouts::CounterModel::new(gpu);
    let all = super::layouts::maximal_layouts(profiles);
    let counters_refuse: Vec<String> = all
        .iter()
        .filter_map(|l| {
            counters
                .accepts(l)
                .err()
                .map(|why| format!("{}: {why}", super::layouts::label(l)))
        })
        .collect();
    LayoutsPreview {
        maximal: all.len(),
        counters_accept: all.len() - counters_refuse.len(),
        counters_refuse,
    }
}

/// Capability minors of one existing instance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InstanceCapabilities {
    pub gpu_instance: u32,
    pub compute_instance: u32,
    /// Minors of the GI's and the CI's capability devices.
    pub gi_minor: u32,
    pub ci_minor: u32,
}

/// The MIG capability layout of a GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CapabilityReport {
    /// `nvidia-caps` major from `/proc/devices`.
    pub caps_major: Option<u32>,
    /// `/proc/driver/nvidia-caps/mig-minors` exists.
    pub mig_minors_present: bool,
    /// Minors read for the existing instances.
    pub instances: Vec<InstanceCapabilities>,
    #[serde(skip)]
    pub findings: Vec<Finding>,
}

/// Reads the capability layout: the `nvidia-caps` major, the minor table, and for every
/// existing compute instance the per-instance access files a CDI spec would be built from.
pub fn capability_layout(
    cdi: &CdiWriter,
    proc_root: &Path,
    gpu: &GpuDescription,
    instances: &[GpuInstanceRecord],
) -> CapabilityReport {
    let mut findings = Vec::new();
    let label = format!("GPU {} ({})", gpu.index, gpu.product_name);
    let mig_on = gpu.mig.as_ref().is_some_and(|m| m.enabled);
    let caps_major = match cdi.majors() {
        Ok(m) => m.caps,
        Err(e) => {
            findings.push(Finding::mismatch(format!("{label}: {e}")));
            None
        }
    };
    if caps_major.is_none() && mig_on {
        findings.push(Finding::mismatch(format!(
            "{label}: MIG is on but {} has no nvidia-caps character device; CDI specs cannot name \
             the capability devices",
            proc_root.join("devices").display()
        )));
    }
    let mig_minors = proc_root.join("driver/nvidia-caps/mig-minors");
    let mig_minors_present = mig_minors.is_file();
    if !mig_minors_present && gpu.mig.is_some() {
        findings.push(Finding::warning(format!(
            "{label}: {} is missing",
            mig_minors.display()
        )));
    }
    let mut caps = Vec::new();
    for gi in instances {
        for ci in &gi.compute_instances {
            match (
                cdi.capability(gpu.minor, gi.id, None),
                cdi.capability(gpu.minor, gi.id, Some(ci.id)),
            ) {
                (Ok((gi_minor, _)), Ok((ci_minor, _))) => caps.push(InstanceCapabilities {
                    gpu_instance: gi.id,
                    compute_instance: ci.id,
                    gi_minor,
                    ci_minor,
                }),
                (Err(e), _) | (_, Err(e)) => findings.push(Finding::mismatch(format!(
                    "{label}: existing instance GI {} CI {}: {e}",
                    gi.id, ci.id
                ))),
            }
        }
    }
    CapabilityReport {
        caps_major,
        mig_minors_present,
        instances: caps,
        findings,
    }
}

/// Counts of the discovered driver files.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DriverFilesSummary {
    /// Versioned libraries and utilities.
    pub libraries: usize,
    pub binaries: usize,
    /// GSP firmware files.
    pub firmware: usize,
    /// Sockets.
    pub ipc: usize,
    pub soname_links: usize,
    /// `nvidia-cdi-hook`, when found.
    pub hook: Option<String>,
    pub library_paths: Vec<String>,
}

/// The driver files a claim's CDI spec would mount.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DriverFilesReport {
    pub driver_root: String,
    /// What was found; `None` when discovery failed (see the warnings).
    pub summary: Option<DriverFilesSummary>,
    #[serde(skip)]
    pub findings: Vec<Finding>,
}

/// Discovers the driver's container files under `driver_root` (read-only). A failure is a
/// warning: it says containers would not get the driver's libraries, not that migdra
/// misunderstands the GPU.
pub fn driver_files(options: &CheckOptions, driver_version: &str) -> DriverFilesReport {
    let root = options.driver_root.on_host.display().to_string();
    let discovered = driver_files::read_kernel_release(&options.proc_root).and_then(|kernel_release| {
        driver_files::discover(&DiscoveryInputs {
            driver_root: options.driver_root.clone(),
            driver_version: driver_version.to_string(),
            kernel_release,
            host_root: options.host_root.clone(),
            hook_path: options.hook_path.clone(),
            arch: driver_files::LibraryArch::HOST,
        })
    });
    let summary = discovered.as_ref().ok().map(|files| DriverFilesSummary {
        libraries: files.libraries.len(),
        binaries: files.binaries.len(),
        firmware: files.firmware.len(),
        ipc: files.ipc.len(),
        soname_links: files.soname_links.len(),
        hook: files.hook.as_ref().map(|h| h.display().to_string()),
        library_paths: files
            .libraries
            .iter()
            .map(|f| f.host_path.display().to_string())
            .collect(),
    });
    // The plugin would name no hook in the specs: containers then get the soname links as
    // mounts and none of the hooks (the plugin's CdiHookMissing event says the same).
    let no_hook = summary.as_ref().filter(|s| s.hook.is_none()).map(|_| {
        format!(
            "nvidia-cdi-hook is not an executable file at {} on the host: containers would get the \
             driver's soname links as read-only mounts and none of its hooks (no linker cache \
             update, no CUDA forward compatibility, no protection of device nodes)",
            options.hook_path.display()
        )
    });
    let failed = discovered
        .err()
        .map(|e| format!("driver files under {root} not discovered: {e}"));
    let findings = failed.into_iter().chain(no_hook).map(Finding::warning).collect();
    DriverFilesReport {
        driver_root: root,
        summary,
        findings,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvml::ComputeInstanceRecord;

    fn h100() -> GpuDescription {
        GpuDescription {
            cuda_compute_capability: Some((9, 0)),
            ..crate::nvml::catalog_gpu(3, "H100-80GB", Some(true))
        }
    }

    #[test]
    fn an_idle_gpu_publishes_every_placement_and_the_whole_gpu() {
        let gpu = h100();
        let p = published(&gpu, &[], "580.82.07");
        assert!(p.findings.is_empty(), "{:?}", p.findings);
        let placements: usize = gpu
            .mig
            .as_ref()
            .unwrap()
            .profiles
            .iter()
            .map(|p| p.placements.len())
            .sum();
        assert_eq!(p.device_count, placements + 1);
        assert!(p.devices.iter().any(|d| d.name == "gpu-3"));
        let three_g = p.devices.iter().find(|d| d.name == "gpu-3-mig-3g40gb-4").unwrap();
        assert_eq!(three_g.attributes["profile"], "3g.40gb");
        assert_eq!(three_g.attributes["placementStart"], "4");
        assert_eq!(three_g.attributes["driverVersion"], "580.82.7");
        assert_eq!(three_g.capacity["multiprocessors"], "60");
        let whole = p.devices.iter().find(|d| d.name == "gpu-3").unwrap();
        assert_eq!(whole.attributes["type"], "gpu");
        assert_eq!(p.counter_set.as_deref(), Some("gpu-3"));
        assert_eq!(p.counters.get("memory-slice-6"), Some(&1));
        // Every placement that covers slice 7 also covers slice 6: that counter never decides.
        assert_eq!(p.counters.get("memory-slice-7"), None);
        assert_eq!(p.counters_left_out.get("memory-slice-7"), Some(&1));
        let mut rows = vec![ProfileRow {
            name: "3g.40gb".into(),
            id: 9,
            index: 2,
            compute_slices: 3,
            memory_slices: 4,
            instance_count: 2,
            memory_mib: 40448,
            multiprocessors: 60,
            placements: vec![0, 4],
            device_names: Vec::new(),
            nvml_name: None,
            catalog: super::super::report::RowStatus::Match,
        }];
        fill_device_names(&mut rows, &p);
        // In published (first-fit) order, which is the pool's, not the placement order.
        let mut names = rows[0].device_names.clone();
        names.sort();
        assert_eq!(names, ["gpu-3-mig-3g40gb-0", "gpu-3-mig-3g40gb-4"]);
    }

    #[test]
    fn a_foreign_instance_blocks_its_slices_and_the_whole_gpu_without_a_finding() {
        let gpu = h100();
        let foreign = GpuInstanceRecord {
            id: 2,
            profile_id: 9,
            start: 4,
            size: 4,
            compute_instances: vec![ComputeInstanceRecord {
                id: 0,
                profile_id: 2,
                mig_uuid: "MIG-x".into(),
            }],
        };
        let p = published(&gpu, &[foreign], "580.82.07");
        assert!(p.findings.is_empty());
        assert!(!p.devices.iter().any(|d| d.name == "gpu-3"));
        assert!(!p.devices.iter().any(|d| d.name == "gpu-3-mig-3g40gb-4"));
        assert!(p.devices.iter().any(|d| d.name == "gpu-3-mig-3g40gb-0"));
        // Slice 4 is the foreign instance's: no device consumes it, so it is not published,
        // and nothing published overlaps it.
        assert_eq!(p.counters_left_out.get("memory-slice-4"), Some(&0));
        assert_eq!(p.counters.get("memory-slice-4"), None);
    }
}
