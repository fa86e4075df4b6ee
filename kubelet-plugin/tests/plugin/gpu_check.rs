//! `gpu-check` against the fake NVML library: read-only mode makes no mutating NVML call and
//! reports what the catalog says (a model found by PCI device ID, an unknown one derived from
//! NVML); full mode creates and destroys every placement and every maximal layout, reports a
//! layout NVML refuses, does the MIG mode round trip only when asked and refuses a GPU other
//! processes use; the binary runs as an operator would run it.

#![allow(clippy::unwrap_used)]

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
};

use migdra_api::catalog::{self, GpuModel};
use migdra_fake_nvml::{
    FakeConfig, FaultConfig, GpuConfig, GpuQuirks, InstanceConfig, code,
    config::DEFAULT_DRIVER_VERSION,
    driver_root::{DriverRootOptions, create_driver_root},
    testing::FakeGpuHost,
};
use migdra_kubelet_plugin::{
    driver_files::{DEFAULT_HOOK_PATH, HostDir},
    gpu_check::{
        self, CheckError, CheckOptions, EXIT_MISMATCH, EXIT_OK, GpuCheckReport, Severity, report::RowStatus,
    },
    nvml::NvmlBackend,
};

/// A host with a driver root and a kernel release, so driver-file discovery runs too.
struct CheckedHost {
    host: FakeGpuHost,
    driver_root: tempfile::TempDir,
}

impl CheckedHost {
    fn new(config: FakeConfig) -> Self {
        let host = FakeGpuHost::new(config).expect("fake GPU host");
        let kernel = host.proc_root().join("sys/kernel");
        std::fs::create_dir_all(&kernel).unwrap();
        std::fs::write(kernel.join("osrelease"), "6.8.0-test\n").unwrap();
        let driver_root = tempfile::tempdir().unwrap();
        create_driver_root(
            driver_root.path(),
            DEFAULT_DRIVER_VERSION,
            &DriverRootOptions::default(),
        )
        .unwrap();
        Self { host, driver_root }
    }

    fn with_gpus(gpus: &[(&str, bool)]) -> Self {
        Self::new(FakeConfig {
            gpus: gpus.iter().map(|(m, mig)| GpuConfig::new(m, *mig)).collect(),
            ..FakeConfig::default()
        })
    }

    fn options(&self, read_only: bool) -> CheckOptions {
        CheckOptions {
            read_only,
            mig_mode_round_trip: false,
            gpu: None,
            proc_root: self.host.proc_root(),
            driver_root: HostDir {
                on_host: self.driver_root.path().into(),
                visible_at: self.driver_root.path().into(),
            },
            host_root: PathBuf::from("/"),
            hook_path: PathBuf::from(DEFAULT_HOOK_PATH),
            catalog: catalog::models(),
        }
    }

    fn check(&self, options: &CheckOptions) -> Result<GpuCheckReport, CheckError> {
        let backend = NvmlBackend::new(Some(&self.host.lib_path())).expect("load the fake NVML");
        gpu_check::check(&backend, options)
    }
}

fn mismatches(report: &GpuCheckReport) -> Vec<String> {
    report
        .all_findings()
        .filter(|f| f.severity == Severity::Mismatch)
        .map(|f| f.message.clone())
        .collect()
}

fn placements_of(key: &str) -> usize {
    catalog::model(key)
        .unwrap()
        .profiles
        .iter()
        .map(|p| p.placements.len())
        .sum()
}

/// NVML calls the fake saw that change something (by name: every NVML call that changes
/// GPU state sets, creates, destroys, resets or clears).
fn mutating_calls(node: &CheckedHost) -> Vec<String> {
    let log = node.host.read_state().unwrap().call_log.expect("call log on");
    assert!(
        log.contains_key("nvmlDeviceGetMigMode"),
        "the log records calls: {log:?}"
    );
    log.into_keys()
        .filter(|f| {
            ["Set", "Create", "Destroy", "Reset", "Clear"]
                .iter()
                .any(|w| f.contains(w))
        })
        .collect()
}

fn log_calls(node: &CheckedHost) {
    node.host
        .update_state(|s| s.call_log = Some(Default::default()))
        .unwrap();
}

#[test]
fn read_only_passes_on_h100_and_a100_and_changes_nothing() {
    let node = CheckedHost::with_gpus(&[
        ("H100-80GB", true),
        ("A100-SXM4-40GB", true),
        ("H100-80GB", false),
    ]);
    log_calls(&node);
    let before = node.host.read_state().unwrap().gpus;
    let report = node.check(&node.options(true)).expect("check runs");
    assert_eq!(
        node.host.read_state().unwrap().gpus,
        before,
        "read-only changes no fake state"
    );
    assert_eq!(
        mutating_calls(&node),
        Vec::<String>::new(),
        "no mutating NVML call"
    );

    assert!(mismatches(&report).is_empty(), "{:?}", mismatches(&report));
    assert_eq!(report.exit_code(), EXIT_OK);
    assert_eq!(report.mode, "read-only");
    assert_eq!(report.driver_version, DEFAULT_DRIVER_VERSION);
    let keys: Vec<_> = report.gpus.iter().map(|g| g.catalog_model.as_deref()).collect();
    assert_eq!(
        keys,
        [Some("H100-80GB"), Some("A100-SXM4-40GB"), Some("H100-80GB")]
    );
    for (gpu, key) in report
        .gpus
        .iter()
        .zip(["H100-80GB", "A100-SXM4-40GB", "H100-80GB"])
    {
        let model = catalog::model(key).unwrap();
        assert_eq!(gpu.profiles.len(), model.profiles.len());
        assert!(gpu.profiles.iter().all(|p| p.catalog == RowStatus::Match));
        // One device per placement, plus the whole GPU where MIG mode can be switched
        // without a reset (Hopper), each named as the pool names it.
        let published = gpu.published.as_ref().unwrap();
        let partitions = published
            .devices
            .iter()
            .filter(|d| d.profile_id.is_some())
            .count();
        assert_eq!(partitions, placements_of(key), "GPU {}", gpu.index);
        // Each with the attributes and capacity its ResourceSlice entry carries.
        for d in &published.devices {
            assert_eq!(d.attributes["productName"], model.product_name, "{}", d.name);
            let uuid = if d.profile_id.is_some() {
                "parentUUID"
            } else {
                "uuid"
            };
            assert_eq!(d.attributes[uuid], gpu.uuid, "{}", d.name);
            assert!(d.capacity.contains_key("memory"), "{}", d.name);
        }
        let whole = published
            .devices
            .iter()
            .any(|d| d.name == format!("gpu-{}", gpu.minor));
        assert_eq!(
            whole,
            model.architecture.mig_mode_switchable(),
            "GPU {}",
            gpu.index
        );
        let three_g = gpu.profiles.iter().find(|p| p.id == 9).unwrap();
        let mut names = three_g.device_names.clone();
        names.sort();
        let label = model
            .profiles
            .iter()
            .find(|p| p.gi_profile_id == 9)
            .unwrap()
            .name
            .to_label();
        assert_eq!(
            names,
            [
                format!("gpu-{}-mig-{label}-0", gpu.minor),
                format!("gpu-{}-mig-{label}-4", gpu.minor)
            ]
        );
        let caps = gpu.capabilities.as_ref().unwrap();
        assert!(caps.caps_major.is_some());
    }
    let files = report
        .driver_files
        .as_ref()
        .unwrap()
        .summary
        .as_ref()
        .expect("driver files found");
    assert!(
        files
            .library_paths
            .iter()
            .any(|p| p.ends_with(&format!("libcuda.so.{DEFAULT_DRIVER_VERSION}")))
    );

    let table = report.render_table();
    assert!(table.contains("result: OK (0 mismatches"), "{table}");
    assert!(table.contains("gpu-0-mig-7g80gb-0"), "{table}");
}

#[test]
fn read_only_reads_the_capability_minors_of_existing_instances() {
    let node = CheckedHost::new(FakeConfig {
        gpus: vec![GpuConfig::new("H100-80GB", true)],
        instances: vec![InstanceConfig {
            gpu: 0,
            profile_id: 9,
            start: 4,
        }],
        ..FakeConfig::default()
    });
    let report = node.check(&node.options(true)).unwrap();
    assert!(mismatches(&report).is_empty(), "{:?}", mismatches(&report));
    let caps = report.gpus[0].capabilities.as_ref().unwrap();
    assert_eq!(caps.instances.len(), 1);
    let c = &caps.instances[0];
    let gi = node.host.read_state().unwrap().gpus[0].gpu_instances[0].id;
    assert_eq!(c.gpu_instance, gi);
    assert_eq!(c.gi_minor, migdra_fake_nvml::procfs::gi_cap_minor(0, gi));
    assert_eq!(c.ci_minor, migdra_fake_nvml::procfs::ci_cap_minor(0, gi, 0));
    // The foreign instance's slices and the whole GPU are not published.
    let published = report.gpus[0].published.as_ref().unwrap();
    assert!(
        !published
            .devices
            .iter()
            .any(|d| d.name == "gpu-0" || d.name == "gpu-0-mig-3g40gb-4")
    );
}

/// The catalog with `edit` applied to model `key` (leaked: the check takes a static catalog).
fn altered_catalog(key: &str, edit: impl FnOnce(&mut GpuModel)) -> &'static [GpuModel] {
    let mut models = catalog::models().to_vec();
    let model = models.iter_mut().find(|m| m.key == key).unwrap();
    edit(model);
    Box::leak(models.into_boxed_slice())
}

#[test]
fn an_unknown_pci_device_id_is_derived_from_nvml_not_failed() {
    // A board with H100 tables that the catalog does not know (a new SKU).
    let node = CheckedHost::new(FakeConfig {
        gpus: vec![GpuConfig::new("H100-80GB", true).with_quirks(GpuQuirks {
            pci_device_id: Some(0x2999),
            product_name: Some("NVIDIA H999".into()),
            profile_names: BTreeMap::from([(9, "3g.40gb.new".to_string())]),
            ..Default::default()
        })],
        ..FakeConfig::default()
    });
    log_calls(&node);
    let report = node.check(&node.options(true)).unwrap();
    assert_eq!(report.exit_code(), EXIT_OK, "{:?}", mismatches(&report));
    assert_eq!(mutating_calls(&node), Vec::<String>::new());
    let gpu = &report.gpus[0];
    assert_eq!(gpu.catalog_model, None);
    assert_eq!(gpu.pci_device_id.as_deref(), Some("0x2999"));
    assert!(
        gpu.findings.iter().any(|f| f.severity == Severity::Warning
            && f.message
                .contains("unknown model, derived from NVML: PCI device ID 0x2999")),
        "{:?}",
        gpu.findings
    );
    // Every profile NVML reports, published and named from NVML's slices and memory.
    assert_eq!(gpu.profiles.len(), 7);
    assert!(
        gpu.profiles
            .iter()
            .all(|p| p.catalog == RowStatus::DerivedFromNvml)
    );
    let three_g = gpu.profiles.iter().find(|p| p.id == 9).unwrap();
    assert_eq!(three_g.name, "3g.40gb");
    assert_eq!(three_g.nvml_name.as_deref(), Some("3g.40gb.new"));
    assert_eq!(three_g.placements, [0, 4]);
    assert_eq!(three_g.device_names.len(), 2);
    let seven_g = gpu.profiles.iter().find(|p| p.id == 0).unwrap();
    assert_eq!(seven_g.nvml_name.as_deref(), Some("7g.80gb"));
    assert!(gpu.findings.iter().any(|f| {
        f.message
            .contains("\"3g.40gb.new\" by NVML and published as \"3g.40gb\"")
    }));
    let table = report.render_table();
    assert!(table.contains("unknown model, derived from NVML"), "{table}");
    assert!(table.contains("from NVML"), "{table}");

    // A catalog that knows the board by name only: still unknown, the name is not used.
    let mut options = node.options(true);
    options.catalog = altered_catalog("H100-80GB", |m| m.product_name = "NVIDIA H999");
    let report = node.check(&options).unwrap();
    assert_eq!(report.gpus[0].catalog_model, None);
}

#[test]
fn gh200_is_recognised_by_its_pci_device_id_under_the_name_nvml_reports() {
    let node = CheckedHost::with_gpus(&[("H100-96GB", true)]);
    let report = node.check(&node.options(true)).unwrap();
    let gpu = &report.gpus[0];
    assert_eq!(gpu.product_name, "NVIDIA GH200 480GB");
    assert_eq!(gpu.catalog_model.as_deref(), Some("H100-96GB"));
    assert!(mismatches(&report).is_empty(), "{:?}", mismatches(&report));
    assert!(gpu.profiles.iter().all(|p| p.catalog == RowStatus::Match));
}

#[test]
fn a_profile_that_differs_from_the_catalog_is_a_mismatch_per_field() {
    let node = CheckedHost::with_gpus(&[("A100-SXM4-40GB", true)]);
    let mut options = node.options(true);
    options.catalog = altered_catalog("A100-SXM4-40GB", |m| {
        let p = m.profiles.iter_mut().find(|p| p.gi_profile_id == 14).unwrap();
        p.placements = vec![0, 2, 4, 6];
        p.memory_mib = 10240;
    });
    let report = node.check(&options).unwrap();
    assert_eq!(report.exit_code(), EXIT_MISMATCH);
    let m = mismatches(&report);
    assert_eq!(m.len(), 2, "{m:?}");
    assert!(
        m.iter()
            .any(|l| l.contains("2g.10gb (ID 14) placements: NVML [0, 2, 4], catalog [0, 2, 4, 6]"))
    );
    assert!(
        m.iter()
            .any(|l| l.contains("2g.10gb (ID 14) memory MiB: NVML 9856, catalog 10240"))
    );
}

#[test]
fn estimated_catalog_entries_warn_without_failing() {
    let node = CheckedHost::with_gpus(&[("B200", true), ("H100-PCIE-80GB", true)]);
    let report = node.check(&node.options(true)).unwrap();
    assert_eq!(report.exit_code(), EXIT_OK, "{:?}", mismatches(&report));
    assert_eq!(report.gpus[1].catalog_model.as_deref(), Some("H100-PCIE-80GB"));
    for gpu in &report.gpus {
        assert_eq!(gpu.catalog_source.as_deref(), Some("estimated"));
        assert!(
            gpu.findings
                .iter()
                .any(|f| f.severity == Severity::Warning && f.message.contains("estimated, not documented")),
            "{:?}",
            gpu.findings
        );
    }
}

fn round_trip(mut options: CheckOptions) -> CheckOptions {
    options.mig_mode_round_trip = true;
    options
}

#[test]
fn full_mode_creates_every_placement_and_layout_and_round_trips_mig_mode_when_asked() {
    let node = CheckedHost::with_gpus(&[
        ("H100-80GB", true),
        ("H100-80GB", false),
        ("A100-SXM4-40GB", true),
    ]);
    let report = node
        .check(&round_trip(node.options(false)))
        .expect("full mode runs on idle GPUs");
    assert!(mismatches(&report).is_empty(), "{:?}", mismatches(&report));
    assert_eq!(report.mode, "full");
    assert!(
        report.notes.iter().any(|n| n.contains("PID namespace")),
        "{:?}",
        report.notes
    );

    let state = node.host.read_state().unwrap();
    assert!(
        state.gpus.iter().all(|g| g.gpu_instances.is_empty()),
        "no instance left"
    );
    let modes: Vec<_> = state.gpus.iter().map(|g| g.mig_enabled).collect();
    assert_eq!(modes, [true, false, true], "MIG modes as found");

    for (gpu, key) in report
        .gpus
        .iter()
        .zip(["H100-80GB", "H100-80GB", "A100-SXM4-40GB"])
    {
        let ex = gpu.exercise.as_ref().unwrap();
        assert_eq!(ex.placements.len(), placements_of(key), "GPU {}", gpu.index);
        assert!(ex.placements.iter().all(|p| p.ok));
        for p in &ex.placements {
            assert!(p.mig_uuid.as_deref().unwrap().starts_with("MIG-"));
            let gi = p.gpu_instance.unwrap();
            assert_eq!(
                p.capability_minors,
                Some((
                    migdra_fake_nvml::procfs::gi_cap_minor(gpu.minor, gi),
                    migdra_fake_nvml::procfs::ci_cap_minor(gpu.minor, gi, p.compute_instance.unwrap())
                ))
            );
        }
        let mut every: Vec<_> = ex.placements.iter().map(|p| (p.profile_id, p.start)).collect();
        every.sort_unstable();
        every.dedup();
        assert_eq!(every.len(), placements_of(key), "each placement once");

        // Every maximal layout, side by side, with NVML and the counters agreeing on each.
        let preview = gpu.layouts.as_ref().unwrap();
        assert_eq!(ex.layouts.len(), preview.maximal, "GPU {}", gpu.index);
        assert!(ex.layouts.len() > 10, "GPU {}: {}", gpu.index, ex.layouts.len());
        assert!(ex.layouts.iter().all(|l| l.agree()), "{:?}", ex.layouts);
        for shape in ["4g", "3g", "2g"] {
            assert!(
                ex.layouts
                    .iter()
                    .any(|l| l.layout.contains(shape) && l.nvml_refused.is_none()),
                "a layout with a {shape}"
            );
        }
        let seven_1g = ex
            .layouts
            .iter()
            .find(|l| l.layout.matches("1g").count() == 7 && !l.layout.contains("+me"))
            .expect("7 x 1g");
        assert_eq!(seven_1g.nvml_refused, None);
        let gis_in_layouts: usize = ex
            .layouts
            .iter()
            .filter(|l| l.nvml_refused.is_none())
            .map(|l| l.layout.split(" + ").count())
            .sum();
        let timing = |call: &str| ex.timings.iter().find(|t| t.call == call).unwrap().count;
        assert_eq!(timing("create CI"), placements_of(key));
        assert_eq!(timing("destroy CI"), placements_of(key));
        assert!(timing("create GI") >= placements_of(key) + gis_in_layouts);
        assert_eq!(timing("create GI"), timing("destroy GI"), "every GI destroyed");
    }
    let notes: Vec<_> = report
        .gpus
        .iter()
        .map(|g| g.exercise.as_ref().unwrap().mig_mode_note.as_str())
        .collect();
    assert_eq!(
        notes,
        [
            "round trip off and on again, left on",
            "enabled for the check, restored to off",
            "left on (round trip needs a GPU reset)"
        ]
    );
    let table = report.render_table();
    assert!(table.contains("create GI"), "{table}");
    assert!(table.contains("3g.40gb@4"), "{table}");
    assert!(table.contains("layouts created side by side"), "{table}");
}

#[test]
fn without_the_round_trip_flag_full_mode_leaves_mig_mode_alone() {
    let node = CheckedHost::with_gpus(&[("H100-80GB", true), ("H100-80GB", false)]);
    log_calls(&node);
    let report = node.check(&node.options(false)).unwrap();
    assert_eq!(report.exit_code(), EXIT_OK, "{:?}", mismatches(&report));
    let log = node.host.read_state().unwrap().call_log.unwrap();
    assert!(!log.contains_key("nvmlDeviceSetMigMode"), "{log:?}");
    let off = report.gpus[1].exercise.as_ref().unwrap();
    assert!(off.placements.is_empty() && off.layouts.is_empty());
    assert_eq!(off.mig_mode_note, "off, not changed");
    assert!(
        report.gpus[1]
            .findings
            .iter()
            .any(|f| f.message.contains("pass --mig-mode-round-trip")),
        "{:?}",
        report.gpus[1].findings
    );
    assert_eq!(report.gpus[0].exercise.as_ref().unwrap().mig_mode_note, "left on");
}

#[test]
fn a_layout_nvml_refuses_and_the_counters_accept_is_a_mismatch() {
    // NVML refuses every 4g instance: each layout with one is a disagreement.
    let node = CheckedHost::new(FakeConfig {
        gpus: vec![GpuConfig::new("H100-80GB", true)],
        faults: vec![
            FaultConfig::error(
                "nvmlDeviceCreateGpuInstanceWithPlacement",
                code::INSUFFICIENT_RESOURCES,
            )
            .on_profile(5),
        ],
        ..FakeConfig::default()
    });
    let report = node.check(&node.options(false)).unwrap();
    assert_eq!(report.exit_code(), EXIT_MISMATCH);
    let ex = report.gpus[0].exercise.as_ref().unwrap();
    let refused: Vec<_> = ex.layouts.iter().filter(|l| !l.agree()).collect();
    assert!(!refused.is_empty());
    assert!(
        refused.iter().all(|l| l.layout.starts_with("4g.40gb@0")),
        "{refused:?}"
    );
    assert!(refused.iter().all(
        |l| l.nvml_refused.as_deref().unwrap().starts_with("4g.40gb@0: ") && l.counters_refused.is_none()
    ));
    let m = mismatches(&report);
    assert!(
        m.iter()
            .any(|l| l.contains("NVML refuses layout 4g.40gb@0 + 3g.40gb@4")
                && l.contains("which migdra's counters accept")),
        "{m:?}"
    );
    // Every other layout still ran, and nothing is left on the GPU.
    assert!(ex.layouts.iter().filter(|l| l.agree()).count() > 10);
    assert!(node.host.read_state().unwrap().gpus[0].gpu_instances.is_empty());
    assert!(
        report.render_table().contains("NVML refuse (4g.40gb@0"),
        "{}",
        report.render_table()
    );
}

#[test]
fn a_failing_creation_is_a_mismatch_and_the_mig_mode_is_restored_anyway() {
    // A compute instance that cannot be created: its GPU instance must still be destroyed,
    // the other placements still run, and MIG goes back off.
    let node = CheckedHost::new(FakeConfig {
        gpus: vec![GpuConfig::new("H100-80GB", false)],
        faults: vec![FaultConfig::error("nvmlGpuInstanceCreateComputeInstance", code::UNKNOWN).times(1)],
        ..FakeConfig::default()
    });
    let report = node.check(&round_trip(node.options(false))).unwrap();
    assert_eq!(report.exit_code(), EXIT_MISMATCH);
    let m = mismatches(&report);
    assert_eq!(m.len(), 1, "{m:?}");
    assert!(m[0].contains("1g.10gb@0 (ID 19)"), "{}", m[0]);
    let ex = report.gpus[0].exercise.as_ref().unwrap();
    assert_eq!(ex.placements.iter().filter(|p| !p.ok).count(), 1);
    assert_eq!(ex.placements.len(), placements_of("H100-80GB"));
    let state = node.host.read_state().unwrap();
    assert!(
        state.gpus[0].gpu_instances.is_empty(),
        "the GI without CI was destroyed"
    );
    assert!(!state.gpus[0].mig_enabled, "MIG mode restored");
    assert!(report.render_table().contains("result: FAILED (1 mismatches"));
}

#[test]
fn full_mode_on_an_idle_ampere_with_mig_off_switches_exercises_and_switches_back() {
    // On idle bare-metal Ampere NVML resets the GPU itself when the mode changes.
    let node = CheckedHost::with_gpus(&[("A100-SXM4-40GB", false)]);
    let report = node.check(&round_trip(node.options(false))).unwrap();
    assert_eq!(report.exit_code(), 0, "{:?}", mismatches(&report));
    let ex = report.gpus[0].exercise.as_ref().unwrap();
    assert_eq!(ex.placements.len(), placements_of("A100-SXM4-40GB"));
    assert!(ex.placements.iter().all(|p| p.ok));
    let after = node.host.read_state().unwrap();
    assert_eq!(
        (after.gpus[0].mig_enabled, after.gpus[0].mig_pending),
        (false, false),
        "restored"
    );
    assert!(after.gpus[0].gpu_instances.is_empty());
}

#[test]
fn full_mode_on_ampere_that_cannot_reset_reports_the_reset_and_leaves_the_mode() {
    let node = CheckedHost::new(FakeConfig {
        gpus: vec![
            GpuConfig::new("A100-SXM4-40GB", false).with_quirks(migdra_fake_nvml::GpuQuirks {
                no_driver_reset: true,
                ..Default::default()
            }),
        ],
        ..FakeConfig::default()
    });
    let before = node.host.read_state().unwrap();
    let report = node.check(&round_trip(node.options(false))).unwrap();
    let m = mismatches(&report);
    assert!(m.iter().any(|l| l.contains("needs a GPU reset")), "{m:?}");
    let after = node.host.read_state().unwrap();
    assert!(!after.gpus[0].mig_enabled, "MIG stays off");
    assert_eq!(after.gpus[0].gpu_instances, before.gpus[0].gpu_instances);
}

#[test]
fn full_mode_refuses_a_gpu_with_a_foreign_instance_and_touches_nothing() {
    let node = CheckedHost::new(FakeConfig {
        gpus: vec![
            GpuConfig::new("H100-80GB", true),
            GpuConfig::new("H100-80GB", true),
        ],
        instances: vec![InstanceConfig {
            gpu: 1,
            profile_id: 14,
            start: 2,
        }],
        ..FakeConfig::default()
    });
    let before = node.host.read_state().unwrap();
    let err = node.check(&node.options(false)).expect_err("refused");
    let text = err.to_string();
    assert!(matches!(err, CheckError::Refused { gpu: 1, .. }), "{text}");
    assert!(
        text.contains("not idle") && text.contains("profile ID 14, start 2"),
        "{text}"
    );
    assert_eq!(
        node.host.read_state().unwrap(),
        before,
        "nothing created on any GPU"
    );

    // Limited to the idle GPU, full mode runs.
    let mut options = node.options(false);
    options.gpu = Some(0);
    let report = node.check(&options).unwrap();
    assert_eq!(report.gpus.len(), 1);
    assert!(mismatches(&report).is_empty());
    options.gpu = Some(7);
    assert!(matches!(node.check(&options), Err(CheckError::NoSuchGpu(7, _))));
}

#[test]
fn full_mode_refuses_a_gpu_a_process_uses_and_says_how_to_run_safely() {
    let node = CheckedHost::with_gpus(&[("H100-80GB", true), ("H100-80GB", true)]);
    node.host
        .update_state(|s| {
            s.gpus[1]
                .clients
                .push(migdra_fake_nvml::state::GpuClient::compute(4242, "python3", 1024))
        })
        .unwrap();
    log_calls(&node);
    let err = node.check(&node.options(false)).expect_err("refused");
    let text = err.to_string();
    assert!(matches!(err, CheckError::Refused { gpu: 1, .. }), "{text}");
    assert!(text.contains("NVML lists 4242 (compute)"), "{text}");
    assert!(text.contains("kubectl debug node/"), "{text}");
    assert!(text.contains("cordon"), "{text}");
    assert!(
        text.contains("never `kubectl exec` into the running plugin pod"),
        "{text}"
    );
    assert_eq!(
        mutating_calls(&node),
        Vec::<String>::new(),
        "refused before any change"
    );

    // Read-only runs and shows who uses the GPU.
    let report = node.check(&node.options(true)).unwrap();
    let users = report.gpus[1].users.as_ref().unwrap();
    assert_eq!(users.nvml_processes, ["4242 (compute)"]);
    assert!(
        report
            .render_table()
            .contains("in use: NVML lists 4242 (compute)")
    );
    assert!(report.gpus[0].users.as_ref().unwrap().is_empty());
}

#[test]
fn full_mode_refuses_a_gpu_whose_device_file_another_process_holds() {
    // An NVML client without a context (nv-hostengine) is seen only in /proc.
    let node = CheckedHost::with_gpus(&[("H100-80GB", true)]);
    let process = node.host.proc_root().join("777");
    std::fs::create_dir_all(process.join("fd")).unwrap();
    std::os::unix::fs::symlink("/dev/nvidia0", process.join("fd/5")).unwrap();
    std::os::unix::fs::symlink("/dev/null", process.join("fd/0")).unwrap();
    std::fs::write(process.join("comm"), "nv-hostengine\n").unwrap();
    let err = node.check(&node.options(false)).expect_err("refused");
    assert!(
        err.to_string()
            .contains("the device file is open in 777 (nv-hostengine)"),
        "{err}"
    );
    // Another GPU's device file is no reason to refuse this one.
    std::fs::remove_file(process.join("fd/5")).unwrap();
    std::os::unix::fs::symlink("/dev/nvidia3", process.join("fd/5")).unwrap();
    let report = node.check(&node.options(false)).expect("runs");
    assert!(mismatches(&report).is_empty(), "{:?}", mismatches(&report));
}

fn run_binary(node: &CheckedHost, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_migdra-kubelet-plugin"))
        .arg("gpu-check")
        .args(extra)
        .env_clear()
        .env("NVML_LIB_PATH", node.host.lib_path())
        .env("PROC_ROOT", node.host.proc_root())
        .env("DRIVER_ROOT", node.driver_root.path())
        .output()
        .expect("run the plugin binary")
}

#[test]
fn the_binary_runs_gpu_check_read_only_from_flags_and_env() {
    let node = CheckedHost::with_gpus(&[("H100-80GB", true)]);
    let before = node.host.read_state().unwrap();
    let out = run_binary(&node, &["--read-only"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(EXIT_OK),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("result: OK (0 mismatches"), "{stdout}");
    assert!(
        stdout
            .lines()
            .any(|l| l.trim_start().starts_with("3g.40gb") && l.contains("match")),
        "{stdout}"
    );
    assert_eq!(node.host.read_state().unwrap(), before);

    let out = run_binary(&node, &["--read-only", "-o", "json"]);
    assert_eq!(out.status.code(), Some(EXIT_OK));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON output");
    assert_eq!(json["gpus"][0]["catalogModel"], "H100-80GB");
    assert_eq!(json["mode"], "read-only");

    // Inside the plugin's pod the driver root is mounted elsewhere: the chart's environment
    // (DRIVER_ROOT, DRIVER_ROOT_MOUNT) applies to gpu-check too, and the files are named by
    // their host paths, as the CDI spec names them.
    let out = Command::new(env!("CARGO_BIN_EXE_migdra-kubelet-plugin"))
        .args(["gpu-check", "--read-only", "-o", "json"])
        .env_clear()
        .env("NVML_LIB_PATH", node.host.lib_path())
        .env("PROC_ROOT", node.host.proc_root())
        .env("DRIVER_ROOT", "/run/nvidia/driver")
        .env("DRIVER_ROOT_MOUNT", node.driver_root.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(EXIT_OK));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let libraries = json["driverFiles"]["summary"]["libraryPaths"].as_array().unwrap();
    assert!(!libraries.is_empty());
    assert!(
        libraries
            .iter()
            .all(|p| p.as_str().unwrap().starts_with("/run/nvidia/driver/")),
        "{libraries:?}"
    );

    // Not an NVML library: the check cannot run.
    let out = Command::new(env!("CARGO_BIN_EXE_migdra-kubelet-plugin"))
        .args(["gpu-check", "--read-only", "--nvml-lib-path"])
        .arg(Path::new("/nonexistent/libnvidia-ml.so.1"))
        .env_clear()
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(gpu_check::EXIT_NOT_RUN));
    assert!(String::from_utf8_lossy(&out.stderr).contains("gpu-check: initialise NVML"));
}

#[test]
fn a_missing_cdi_hook_is_a_warning_and_an_installed_one_is_reported() {
    let node = CheckedHost::with_gpus(&[("H100-80GB", true)]);
    let host = tempfile::tempdir().unwrap();
    let options = CheckOptions {
        host_root: host.path().into(),
        ..node.options(true)
    };
    let hook_warnings = |report: &GpuCheckReport| -> Vec<String> {
        report
            .all_findings()
            .filter(|f| f.severity == Severity::Warning && f.message.contains("nvidia-cdi-hook"))
            .map(|f| f.message.clone())
            .collect()
    };
    let report = node.check(&options).unwrap();
    assert_eq!(report.exit_code(), EXIT_OK, "a missing hook is no mismatch");
    let warned = hook_warnings(&report);
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(
        warned[0].contains(&format!("at {DEFAULT_HOOK_PATH} on the host")),
        "{warned:?}"
    );
    assert!(warned[0].contains("none of its hooks"), "{warned:?}");

    let hook = host.path().join(DEFAULT_HOOK_PATH.trim_start_matches('/'));
    std::fs::create_dir_all(hook.parent().unwrap()).unwrap();
    std::fs::write(&hook, b"#!/bin/sh\n").unwrap();
    std::fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let report = node.check(&options).unwrap();
    assert!(hook_warnings(&report).is_empty(), "{:?}", hook_warnings(&report));
    let summary = report.driver_files.as_ref().unwrap().summary.as_ref().unwrap();
    assert_eq!(
        summary.hook.as_deref(),
        Some(DEFAULT_HOOK_PATH),
        "the host path, as the specs name it"
    );
}

#[test]
fn engine_counts_that_add_up_past_the_gpu_are_reported_read_only() {
    let node = CheckedHost::with_gpus(&[("A100-80GB-OVERADDING", true), ("A100-80GB", true)]);
    log_calls(&node);
    let report = node.check(&node.options(true)).unwrap();
    let overruled: Vec<&str> = report
        .all_findings()
        .filter(|f| f.severity == Severity::Warning && f.message.contains("add up past the GPU's"))
        .map(|f| f.message.as_str())
        .collect();
    assert_eq!(overruled.len(), 1, "{overruled:?}");
    assert!(overruled[0].starts_with("GPU 0 "), "{overruled:?}");
    assert!(overruled[0].contains("decoders"), "{overruled:?}");
    assert!(mutating_calls(&node).is_empty(), "read-only changed something");
}
