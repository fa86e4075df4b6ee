//! `migdra-kubelet-plugin gpu-check`: checks, before migdra is enabled on a node, that migdra
//! understands the node's GPUs (model, driver, MIG profiles, device files). The model is
//! found as the plugin finds it, by PCI device ID; a model the catalog lacks is described
//! from what NVML reports.
//!
//! Data flow: the GPUs are discovered through the production backend ([`NvmlBackend`], so the
//! check sees exactly what the plugin would), then each GPU goes through
//! * [`compare`]: the discovered profiles against [`migdra_api::catalog`] (pure);
//! * [`preview`]: the device names and counters migdra would publish (pure), the MIG
//!   capability files under the proc root and the driver files the CDI spec would mount
//!   (read-only file access);
//! * [`layouts`]: every maximal layout (GPU instances side by side) and whether the published
//!   counters let the scheduler allocate it (pure);
//! * [`exercise`] (full mode only, on a GPU no other process uses): every profile created at
//!   every placement, then every maximal layout created side by side and NVML's verdict
//!   compared with the counters', through [`GpuBackend`], with NVML timings; MIG mode off and
//!   on again when asked;
//!
//! and [`report`] renders the outcome as a table or JSON and decides the exit code.

pub mod compare;
pub mod exercise;
pub mod layouts;
pub mod preview;
pub mod report;

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use migdra_api::catalog::GpuModel;

use crate::{
    cdi::CdiWriter,
    driver_files::HostDir,
    nvml::{GpuBackend, GpuDescription, NvmlBackend},
};
pub use report::{Finding, GpuCheckReport, Severity};

/// Exit code: every check passed (warnings allowed).
pub const EXIT_OK: i32 = 0;
/// Exit code: at least one mismatch between what migdra expects and what the GPU does.
pub const EXIT_MISMATCH: i32 = 1;
/// Exit code: the check could not run (NVML failed, full mode refused, bad arguments).
pub const EXIT_NOT_RUN: i32 = 2;

/// Checks that migdra understands this node's GPUs. Read-only mode changes nothing; full mode
/// creates and destroys every MIG profile at every placement and every maximal layout, and
/// needs GPUs no other process uses (a cordoned, drained node).
#[derive(Clone, Debug, Parser)]
#[command(name = "migdra-kubelet-plugin gpu-check", version)]
pub struct GpuCheckArgs {
    /// Only read: discovery, catalog comparison, device names, counters, capability files,
    /// driver files. Safe on a node in production.
    #[arg(long, env = "GPU_CHECK_READ_ONLY")]
    pub read_only: bool,
    /// Full mode: also switch MIG mode off and on again (on a GPU with MIG on), or enable it
    /// for the check and restore it (on a GPU with MIG off, which is otherwise left alone).
    #[arg(long, env = "GPU_CHECK_MIG_MODE_ROUND_TRIP", conflicts_with = "read_only")]
    pub mig_mode_round_trip: bool,
    /// Check only the GPU with this NVML index.
    #[arg(long, env = "GPU_CHECK_GPU")]
    pub gpu: Option<u32>,
    /// Output format.
    #[arg(
        short = 'o',
        long,
        env = "GPU_CHECK_OUTPUT",
        value_enum,
        default_value = "table"
    )]
    pub output: OutputFormat,
    /// Path of libnvidia-ml.so (default: the loader's search path).
    #[arg(long, env = "NVML_LIB_PATH")]
    pub nvml_lib_path: Option<PathBuf>,
    /// Where /proc is (for /proc/devices and the MIG capability files).
    #[arg(long, env = "PROC_ROOT", default_value = "/proc")]
    pub proc_root: PathBuf,
    /// Host path of the NVIDIA driver installation whose files the CDI spec mounts.
    #[arg(long, env = "DRIVER_ROOT", default_value = "/")]
    pub driver_root: PathBuf,
    /// Where this process sees the driver root (default: the driver root itself).
    #[arg(long, env = "DRIVER_ROOT_MOUNT")]
    pub driver_root_mount: Option<PathBuf>,
    /// Where this process sees the host's `/` (for `nvidia-cdi-hook`).
    #[arg(long, env = "HOST_ROOT", default_value = "/")]
    pub host_root: PathBuf,
    /// Host path of NVIDIA's `nvidia-cdi-hook`.
    #[arg(long, env = "NVIDIA_CDI_HOOK_PATH", default_value = crate::driver_files::DEFAULT_HOOK_PATH)]
    pub nvidia_cdi_hook_path: PathBuf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// Human-readable tables.
    Table,
    /// One JSON document (the [`GpuCheckReport`]).
    Json,
}

/// What a check run needs besides the backend.
#[derive(Clone, Debug)]
pub struct CheckOptions {
    /// Full mode (create and destroy instances) when false.
    pub read_only: bool,
    /// Full mode: MIG mode round trip ([`GpuCheckArgs::mig_mode_round_trip`]).
    pub mig_mode_round_trip: bool,
    /// Only this NVML index.
    pub gpu: Option<u32>,
    pub proc_root: PathBuf,
    pub driver_root: HostDir,
    /// Where this process sees the host's `/`.
    pub host_root: PathBuf,
    /// Host path of `nvidia-cdi-hook`.
    pub hook_path: PathBuf,
    /// The catalog to compare with (migdra's own, [`migdra_api::catalog::models`]; tests
    /// pass altered ones).
    pub catalog: &'static [GpuModel],
}

impl From<&GpuCheckArgs> for CheckOptions {
    fn from(args: &GpuCheckArgs) -> Self {
        Self {
            read_only: args.read_only,
            mig_mode_round_trip: args.mig_mode_round_trip,
            gpu: args.gpu,
            proc_root: args.proc_root.clone(),
            driver_root: HostDir {
                on_host: args.driver_root.clone(),
                visible_at: args
                    .driver_root_mount
                    .clone()
                    .unwrap_or_else(|| args.driver_root.clone()),
            },
            host_root: args.host_root.clone(),
            hook_path: args.nvidia_cdi_hook_path.clone(),
            catalog: migdra_api::catalog::models(),
        }
    }
}

/// Why a check could not run at all.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// An NVML call the whole check depends on failed.
    #[error(transparent)]
    Backend(#[from] crate::nvml::BackendError),
    /// `--gpu` names no GPU.
    #[error("no GPU with NVML index {0} (found: {1})")]
    NoSuchGpu(u32, String),
    /// Full mode refused on a GPU that is not idle, or that cannot be exercised.
    #[error("full mode refused on GPU {gpu}: {reason}")]
    Refused { gpu: u32, reason: String },
}

/// Runs the subcommand: prints the report to stdout and returns the exit code.
pub fn run(args: &GpuCheckArgs) -> i32 {
    let outcome = NvmlBackend::new(args.nvml_lib_path.as_deref())
        .map_err(|e| e.to_string())
        .and_then(|backend| check(&backend, &CheckOptions::from(args)).map_err(|e| e.to_string()))
        .and_then(|report| {
            let text = match args.output {
                OutputFormat::Table => report.render_table(),
                OutputFormat::Json => {
                    serde_json::to_string_pretty(&report).map_err(|e| format!("encoding the report: {e}"))?
                        + "\n"
                }
            };
            Ok((text, report.exit_code()))
        });
    match outcome {
        Ok((text, code)) => {
            print!("{text}");
            code
        }
        Err(e) => {
            eprintln!("gpu-check: {e}");
            EXIT_NOT_RUN
        }
    }
}

/// Runs every check on the selected GPUs. Full mode refuses (before changing anything on any
/// GPU) unless no other process uses any selected MIG-capable GPU and none has instances.
pub fn check(backend: &NvmlBackend, options: &CheckOptions) -> Result<GpuCheckReport, CheckError> {
    let driver_version = backend.driver_version()?;
    let gpus = selected_gpus(backend.discover()?, options.gpu)?;
    let cdi = CdiWriter::new(
        options.proc_root.join("unused-cdi-dir"),
        "gpu-check",
        &options.proc_root,
    );
    let mut report = GpuCheckReport::new(options.read_only, driver_version.clone());
    let users: Vec<_> = gpus
        .iter()
        .map(|gpu| exercise::gpu_users(backend, gpu, &options.proc_root))
        .collect();

    if !options.read_only {
        for (gpu, users) in gpus.iter().zip(&users).filter(|(g, _)| g.mig.is_some()) {
            exercise::ensure_idle(backend, gpu, users)?;
        }
        report.notes.push(format!(
            "other GPU users are seen through NVML's process lists and the device files open \
             under {}; an NVML client in a PID namespace that proc root does not show is not seen",
            options.proc_root.display()
        ));
    }

    for (gpu, users) in gpus.iter().zip(users) {
        let instances = preview::existing_instances(backend, gpu);
        let mut gpu_report = report::GpuReport::new(gpu);
        let comparison =
            compare::compare_with_catalog(gpu, options.catalog, &nvml_profile_names(backend, gpu, options));
        gpu_report.catalog_model = comparison.model.map(|m| m.key.to_string());
        gpu_report.catalog_source = comparison.model.map(|m| report::source_name(m.source()));
        gpu_report.findings.extend(comparison.findings);
        gpu_report.profiles = comparison.rows;
        if let Some(e) = &users.nvml_error {
            gpu_report.findings.push(Finding::warning(format!(
                "GPU {}: NVML's running-process list is unreadable: {e}",
                gpu.index
            )));
        }
        gpu_report.users = Some(users);
        match &instances {
            Ok(instances) => {
                let published = preview::published(gpu, instances, &driver_version);
                preview::fill_device_names(&mut gpu_report.profiles, &published);
                gpu_report.findings.extend(published.findings.iter().cloned());
                gpu_report.published = Some(published);
                let caps = preview::capability_layout(&cdi, &options.proc_root, gpu, instances);
                gpu_report.findings.extend(caps.findings.iter().cloned());
                gpu_report.capabilities = Some(caps);
            }
            Err(e) => gpu_report.findings.push(Finding::mismatch(format!(
                "listing the GPU instances failed: {e}"
            ))),
        }
        if let Some(mig) = &gpu.mig {
            gpu_report.layouts = Some(preview::layouts(gpu, &mig.profiles));
        }
        if gpu.mig.is_some() && !options.read_only {
            let exercised = exercise::exercise_gpu(backend, gpu, &cdi, options.mig_mode_round_trip);
            gpu_report.findings.extend(exercised.findings.iter().cloned());
            gpu_report.exercise = Some(exercised);
        }
        report.gpus.push(gpu_report);
    }

    let files = preview::driver_files(options, &driver_version);
    report.findings.extend(files.findings.iter().cloned());
    report.driver_files = Some(files);
    Ok(report)
}

/// NVML's own profile names, read only for a MIG-on GPU whose model the catalog does not
/// know (the only case they are shown); a failure leaves them out with a warning in the log.
fn nvml_profile_names(
    backend: &NvmlBackend,
    gpu: &GpuDescription,
    options: &CheckOptions,
) -> std::collections::BTreeMap<u32, String> {
    let known = gpu
        .pci_device_id
        .is_some_and(|id| options.catalog.iter().any(|m| m.pci_device_ids.contains(&id)));
    if known || !gpu.mig.as_ref().is_some_and(|m| m.enabled) {
        return Default::default();
    }
    backend.gpu_instance_profile_names(gpu.index).unwrap_or_else(|e| {
        tracing::warn!(gpu = gpu.index, error = %e, "NVML's profile names unreadable");
        Default::default()
    })
}

fn selected_gpus(gpus: Vec<GpuDescription>, only: Option<u32>) -> Result<Vec<GpuDescription>, CheckError> {
    let Some(index) = only else { return Ok(gpus) };
    if !gpus.iter().any(|g| g.index == index) {
        let found: Vec<_> = gpus.iter().map(|g| g.index.to_string()).collect();
        return Err(CheckError::NoSuchGpu(index, found.join(", ")));
    }
    Ok(gpus.into_iter().filter(|g| g.index == index).collect())
}
