//! `gpu-check` against the fake NVML library: read-only mode changes nothing and reports
//! what the catalog says; full mode creates and destroys every placement, restores the MIG
//! mode and refuses a GPU that is in use; the binary runs as an operator would run it.

#![allow(clippy::unwrap_used)]

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use migdra_api::catalog::{self, GpuModel};
use migdra_fake_nvml::{
    FakeConfig, FaultConfig, GpuConfig, InstanceConfig, code,
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

#[test]
fn read_only_passes_on_h100_and_a100_and_changes_nothing() {
    let node = CheckedHost::with_gpus(&[
        ("H100-80GB", true),
        ("A100-SXM4-40GB", true),
        ("H100-80GB", false),
    ]);
    let before = node.host.read_state().unwrap();
    let report = node.check(&node.options(true)).expect("check runs");
    assert_eq!(
        node.host.read_state().unwrap(),
        before,
        "read-only changes no fake state"
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
fn a_model_the_catalog_lacks_is_a_mismatch() {
    let node = CheckedHost::with_gpus(&[("H100-80GB", true)]);
    let mut options = node.options(true);
    options.catalog = altered_catalog("H100-80GB", |m| m.product_name = "NVIDIA H100 (renamed)");
    let report = node.check(&options).unwrap();
    assert_eq!(report.exit_code(), EXIT_MISMATCH);
    let m = mismatches(&report);
    assert_eq!(m.len(), 1, "{m:?}");
    assert!(
        m[0].contains("\"NVIDIA H100 80GB HBM3\" is not in migdra's catalog"),
        "{}",
        m[0]
    );
    assert!(
        report.gpus[0]
            .profiles
            .iter()
            .all(|p| p.catalog == RowStatus::NotInCatalog)
    );
    assert!(
        report
            .render_table()
            .contains("MISMATCH: GPU 0 (NVIDIA H100 80GB HBM3): product name")
    );
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

#[test]
fn full_mode_creates_and_destroys_every_placement_and_restores_mig_mode() {
    let node = CheckedHost::with_gpus(&[
        ("H100-80GB", true),
        ("H100-80GB", false),
        ("A100-SXM4-40GB", true),
    ]);
    let report = node
        .check(&node.options(false))
        .expect("full mode runs on idle GPUs");
    assert!(mismatches(&report).is_empty(), "{:?}", mismatches(&report));
    assert_eq!(report.mode, "full");
    assert!(report.notes.iter().any(|n| n.contains("running-process list")));

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
        for t in &ex.timings {
            assert_eq!(t.count, placements_of(key), "{} timed once per placement", t.call);
            assert!(t.p50_ms <= t.max_ms);
        }
    }
    assert_eq!(
        report.gpus[1].exercise.as_ref().unwrap().mig_mode_note,
        "enabled for the check, restored to off"
    );
    let table = report.render_table();
    assert!(table.contains("create GI"), "{table}");
    assert!(table.contains("3g.40gb@4"), "{table}");
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
    let report = node.check(&node.options(false)).unwrap();
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
    let report = node.check(&node.options(false)).unwrap();
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
    let report = node.check(&node.options(false)).unwrap();
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
