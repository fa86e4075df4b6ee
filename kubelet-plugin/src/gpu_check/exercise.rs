//! Full mode, on a GPU no other process uses ([`ensure_idle`]): creates every GPU-instance
//! profile at every placement, one at a time, through [`GpuBackend`] (as the plugin's prepare
//! does: GI at the placement, then the full CI), checks what migdra relies on (the placement
//! NVML reports, the `MIG-` UUID, the capability files and device nodes a CDI spec is built
//! from) and destroys it; then creates every maximal layout side by side and compares NVML's
//! verdict with the published counters'; times each NVML call. MIG mode is changed only with
//! the round-trip flag, and the mode found is restored at the end, also after failures.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use migdra_api::geometry::MigProfile;
use serde::Serialize;

use super::{CheckError, layouts, report::Finding};
use crate::{
    cdi::{CdiWriter, ClaimDevice},
    nvml::{GpuBackend, GpuDescription, MigModeChange, NvmlBackend},
};

/// How to run full mode without disturbing anything, printed when it refuses.
pub const SAFE_RUN_ADVICE: &str = "run full mode only on a node with no GPU workload: cordon \
    and drain it (kubectl cordon NODE; kubectl drain NODE --ignore-daemonsets), stop the \
    GPU clients node agents run (dcgm-exporter, nv-hostengine), then run gpu-check as a Job \
    pinned to the node or with `kubectl debug node/NODE --profile=sysadmin`; never `kubectl \
    exec` into the running plugin pod, whose own NVML session and prepared claims share the GPU";

/// Who else uses a GPU, as far as can be seen.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuUsers {
    /// Processes NVML lists (compute or graphics context), as `pid (kind)`.
    pub nvml_processes: Vec<String>,
    /// Why NVML's list could not be read, if it could not.
    pub nvml_error: Option<String>,
    /// Processes holding the GPU's device file open (NVML sessions such as nv-hostengine
    /// or nvidia-persistenced), as `pid (command)`; only those the proc root lets this
    /// process see.
    pub device_file_holders: Vec<String>,
}

impl GpuUsers {
    pub fn is_empty(&self) -> bool {
        self.nvml_processes.is_empty() && self.device_file_holders.is_empty()
    }

    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if !self.nvml_processes.is_empty() {
            parts.push(format!("NVML lists {}", self.nvml_processes.join(", ")));
        }
        if !self.device_file_holders.is_empty() {
            parts.push(format!(
                "the device file is open in {}",
                self.device_file_holders.join(", ")
            ));
        }
        parts.join("; ")
    }
}

/// The processes using `gpu`: NVML's running-process lists and, from `proc_root`, the
/// processes other than this one with `/dev/nvidia<minor>` open.
pub fn gpu_users(backend: &NvmlBackend, gpu: &GpuDescription, proc_root: &Path) -> GpuUsers {
    let (nvml_processes, nvml_error) = match backend.running_processes(gpu.index) {
        Ok(list) => (
            list.iter()
                .map(|p| match p.mig_instance {
                    Some((gi, ci)) => format!("{} ({}, GI {gi} CI {ci})", p.pid, p.kind),
                    None => format!("{} ({})", p.pid, p.kind),
                })
                .collect(),
            None,
        ),
        Err(e) => (Vec::new(), Some(e.to_string())),
    };
    GpuUsers {
        nvml_processes,
        nvml_error,
        device_file_holders: device_file_holders(proc_root, gpu.minor),
    }
}

/// `pid (command)` of every process under `proc_root` with `/dev/nvidia<minor>` open, except
/// this one. Unreadable processes (other users', without privileges) are skipped.
pub fn device_file_holders(proc_root: &Path, minor: u32) -> Vec<String> {
    let device = PathBuf::from(format!("/dev/nvidia{minor}"));
    // `self` in a proc root names this process as that proc root's PID namespace sees it.
    let me = std::fs::read_link(proc_root.join("self"))
        .ok()
        .and_then(|p| p.to_str().and_then(|s| s.parse::<u32>().ok()))
        .unwrap_or_else(std::process::id);
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        return Vec::new();
    };
    let mut holders: Vec<(u32, String)> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()))
        .filter(|pid| *pid != me)
        .filter(|pid| {
            std::fs::read_dir(proc_root.join(pid.to_string()).join("fd")).is_ok_and(|fds| {
                fds.flatten()
                    .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|target| target == device))
            })
        })
        .map(|pid| {
            let comm = std::fs::read_to_string(proc_root.join(pid.to_string()).join("comm"))
                .map(|c| c.trim().to_string())
                .unwrap_or_else(|_| "?".into());
            (pid, comm)
        })
        .collect();
    holders.sort();
    holders
        .into_iter()
        .map(|(pid, comm)| format!("{pid} ({comm})"))
        .collect()
}

/// Refuses (with the reason and how to run safely) unless the GPU has no GPU or compute
/// instance and no other process uses it.
pub fn ensure_idle(backend: &NvmlBackend, gpu: &GpuDescription, users: &GpuUsers) -> Result<(), CheckError> {
    let refuse = |why: String| CheckError::Refused {
        gpu: gpu.index,
        reason: format!(
            "{why}; full mode creates and destroys instances; {SAFE_RUN_ADVICE} (--read-only changes nothing and is safe on a GPU in use)"
        ),
    };
    if !users.is_empty() {
        return Err(refuse(format!(
            "other processes use the GPU: {}",
            users.describe()
        )));
    }
    if let Some(e) = &users.nvml_error {
        return Err(refuse(format!(
            "NVML cannot say which processes use the GPU ({e})"
        )));
    }
    let instances = super::preview::existing_instances(backend, gpu)?;
    if instances.is_empty() {
        return Ok(());
    }
    let list = instances
        .iter()
        .map(|gi| {
            let (id, profile, start, cis) = (gi.id, gi.profile_id, gi.start, gi.compute_instances.len());
            format!("GI {id} (profile ID {profile}, start {start}, {cis} compute instance(s))")
        })
        .collect::<Vec<_>>()
        .join(", ");
    Err(refuse(format!("the GPU is not idle: {list}")))
}

/// One placement exercised.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PlacementResult {
    pub profile: String,
    pub profile_id: u32,
    pub start: u32,
    /// The IDs NVML gave.
    pub gpu_instance: Option<u32>,
    pub compute_instance: Option<u32>,
    pub mig_uuid: Option<String>,
    /// Capability minors (GI, CI) from the access files.
    pub capability_minors: Option<(u32, u32)>,
    /// Every check passed and the instance was destroyed.
    pub ok: bool,
}

/// Timing of one NVML call kind.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CallTiming {
    /// `create GI`, `create CI`, `destroy CI`, `destroy GI`.
    pub call: String,
    /// Successful calls timed.
    pub count: usize,
    /// Lower median.
    pub p50_ms: f64,
    pub max_ms: f64,
}

/// One layout tried: its GPU instances created side by side.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LayoutResult {
    /// `4g.40gb@0 + 3g.40gb@4`.
    pub layout: String,
    /// `None`: NVML created every instance; else the first refusal.
    pub nvml_refused: Option<String>,
    /// `None`: the published counters let the scheduler allocate the whole layout.
    pub counters_refused: Option<String>,
}

impl LayoutResult {
    pub fn agree(&self) -> bool {
        self.nvml_refused.is_some() == self.counters_refused.is_some()
    }
}

/// Full mode's results for one GPU.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ExerciseReport {
    /// Every placement, in NVML profile order.
    pub placements: Vec<PlacementResult>,
    /// Every maximal layout ([`layouts::maximal_layouts`]), created side by side.
    pub layouts: Vec<LayoutResult>,
    pub timings: Vec<CallTiming>,
    /// What happened to the MIG mode (`left on`, `round trip off and on`, ...).
    pub mig_mode_note: String,
    #[serde(skip)]
    pub findings: Vec<Finding>,
}

/// The NVML calls full mode times, in report order.
pub const TIMED_CALLS: [&str; 4] = ["create GI", "create CI", "destroy CI", "destroy GI"];

#[derive(Debug, Default)]
pub struct Timings(BTreeMap<&'static str, Vec<Duration>>);

impl Timings {
    /// Times `f` under `call` when it succeeds.
    pub fn time<T, E>(&mut self, call: &'static str, f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
        let started = Instant::now();
        let result = f();
        if result.is_ok() {
            self.0.entry(call).or_default().push(started.elapsed());
        }
        result
    }

    /// Count, p50 (lower median) and max per call, in [`TIMED_CALLS`] order.
    pub fn summary(&self) -> Vec<CallTiming> {
        TIMED_CALLS
            .iter()
            .map(|call| {
                let mut d = self.0.get(call).cloned().unwrap_or_default();
                d.sort_unstable();
                let ms = |d: Option<&Duration>| d.map_or(0.0, |d| d.as_secs_f64() * 1000.0);
                CallTiming {
                    call: (*call).to_string(),
                    count: d.len(),
                    p50_ms: ms(d.get(d.len().saturating_sub(1) / 2)),
                    max_ms: ms(d.last()),
                }
            })
            .collect()
    }
}

/// Exercises an idle MIG-capable GPU: every placement alone, then every maximal layout side
/// by side, then (with `round_trip`) MIG mode off and on again. A GPU with MIG off is
/// exercised only with `round_trip`: MIG is enabled for the check and restored to off.
/// Problems are findings, never early returns, so the MIG mode is always restored.
pub fn exercise_gpu(
    backend: &NvmlBackend,
    gpu: &GpuDescription,
    cdi: &CdiWriter,
    round_trip: bool,
) -> ExerciseReport {
    let mut findings = Vec::new();
    let mut timings = Timings::default();
    let label = format!("GPU {} ({})", gpu.index, gpu.product_name);
    let mut placements = Vec::new();
    let mut layouts = Vec::new();
    let was_enabled = gpu.mig.as_ref().is_some_and(|m| m.enabled);
    let mut mig_mode_note = "left on".to_string();

    if !was_enabled && !round_trip {
        findings.push(Finding::warning(format!(
            "{label}: MIG mode is off, so no MIG instance was created; pass \
             --mig-mode-round-trip to enable MIG for the check and restore it afterwards"
        )));
        return ExerciseReport {
            placements,
            layouts,
            timings: timings.summary(),
            mig_mode_note: "off, not changed".into(),
            findings,
        };
    }

    // MIG on, then the GPU as NVML now describes it (the minor may change with the mode).
    let current = if was_enabled {
        Ok(gpu.clone())
    } else {
        enable_mig(backend, gpu)
    };
    match current {
        Err(e) => {
            findings.push(Finding::mismatch(format!("{label}: {e}")));
            mig_mode_note = "could not be enabled".into();
        }
        Ok(current) => {
            for p in current.mig.iter().flat_map(|m| &m.profiles) {
                for &start in &p.placements {
                    let (result, problems) =
                        exercise_placement(backend, &current, cdi, p, start, &mut timings);
                    let (name, id) = (p.name, p.gi_profile_id);
                    let problem =
                        |problem| Finding::mismatch(format!("{label}: {name}@{start} (ID {id}): {problem}"));
                    findings.extend(problems.into_iter().map(problem));
                    placements.push(result);
                }
            }
            if gpu_is_clean(backend, &current, &label, &mut findings) {
                layouts = exercise_layouts(backend, &current, &label, &mut timings, &mut findings);
                gpu_is_clean(backend, &current, &label, &mut findings);
            }
            if was_enabled && round_trip {
                mig_mode_note = mig_mode_round_trip(backend, &current, &label, &mut findings);
            }
        }
    }
    if !was_enabled {
        mig_mode_note = match backend.set_mig_mode(gpu.index, false) {
            Ok(MigModeChange::Applied) => "enabled for the check, restored to off".into(),
            Ok(MigModeChange::PendingReset) => {
                findings.push(Finding::warning(format!(
                    "{label}: MIG mode restored to off, pending a GPU reset"
                )));
                "enabled for the check, off pending a reset".into()
            }
            Err(e) => {
                findings.push(Finding::mismatch(format!(
                    "{label}: restoring MIG mode off failed: {e}"
                )));
                "enabled for the check, NOT restored".into()
            }
        };
    }
    ExerciseReport {
        placements,
        layouts,
        timings: timings.summary(),
        mig_mode_note,
        findings,
    }
}

/// True when the GPU has no GPU instance left; a finding otherwise.
fn gpu_is_clean(
    backend: &NvmlBackend,
    gpu: &GpuDescription,
    label: &str,
    findings: &mut Vec<Finding>,
) -> bool {
    match backend.list_gpu_instances(gpu.index) {
        Ok(left) if left.is_empty() => true,
        Ok(left) => {
            findings.push(Finding::mismatch(format!(
                "{label}: {} GPU instance(s) left after full mode: {left:?}",
                left.len()
            )));
            false
        }
        Err(e) => {
            findings.push(Finding::mismatch(format!("{label}: {e}")));
            false
        }
    }
}

/// Creates every maximal layout side by side (GPU instances only: the engines that decide
/// whether a layout fits belong to them), destroys it, and compares NVML's verdict with the
/// published counters'. Stops when an instance cannot be destroyed, since every later
/// layout would then be refused for the wrong reason.
fn exercise_layouts(
    backend: &NvmlBackend,
    gpu: &GpuDescription,
    label: &str,
    timings: &mut Timings,
    findings: &mut Vec<Finding>,
) -> Vec<LayoutResult> {
    let Some(mig) = &gpu.mig else { return Vec::new() };
    let counters = layouts::CounterModel::new(gpu);
    let mut results = Vec::new();
    for layout in layouts::maximal_layouts(&mig.profiles) {
        let mut created = Vec::new();
        let mut nvml_refused = None;
        for m in &layout {
            let id = m.profile.gi_profile_id;
            match timings.time("create GI", || {
                backend.create_gpu_instance(gpu.index, id, m.start)
            }) {
                Ok(gi) => created.push(gi),
                Err(e) => {
                    nvml_refused = Some(format!("{}: {e}", m.label()));
                    break;
                }
            }
        }
        let mut stuck = false;
        for gi in created.into_iter().rev() {
            if let Err(e) = timings.time("destroy GI", || backend.destroy_gpu_instance(gpu.index, gi)) {
                findings.push(Finding::mismatch(format!(
                    "{label}: layout {}: destroying GI {gi} failed: {e}; layouts not tried further",
                    layouts::label(&layout)
                )));
                stuck = true;
            }
        }
        let result = LayoutResult {
            layout: layouts::label(&layout),
            nvml_refused,
            counters_refused: counters.accepts(&layout).err(),
        };
        match (&result.nvml_refused, &result.counters_refused) {
            (Some(nvml), None) => findings.push(Finding::mismatch(format!(
                "{label}: NVML refuses layout {} ({nvml}), which migdra's counters accept: the \
                 scheduler can allocate it and the prepare would fail",
                result.layout
            ))),
            (None, Some(counters)) => findings.push(Finding::mismatch(format!(
                "{label}: NVML accepts layout {}, which migdra's counters refuse ({counters}): \
                 migdra never offers it",
                result.layout
            ))),
            _ => {}
        }
        results.push(result);
        if stuck {
            break;
        }
    }
    results
}

/// MIG mode off and on again on an idle GPU with MIG on, checking that the profiles NVML
/// reports afterwards are the ones before. Skipped where the switch needs a GPU reset.
fn mig_mode_round_trip(
    backend: &NvmlBackend,
    gpu: &GpuDescription,
    label: &str,
    findings: &mut Vec<Finding>,
) -> String {
    if !gpu.architecture.is_some_and(|a| a.mig_mode_switchable()) {
        findings.push(Finding::warning(format!(
            "{label}: MIG mode round trip skipped: switching needs a GPU reset on this architecture"
        )));
        return "left on (round trip needs a GPU reset)".into();
    }
    match backend.set_mig_mode(gpu.index, false) {
        Ok(MigModeChange::Applied) => {}
        Ok(MigModeChange::PendingReset) => {
            findings.push(Finding::mismatch(format!(
                "{label}: disabling MIG mode is pending a GPU reset on a GPU that switches without one"
            )));
        }
        Err(e) => {
            findings.push(Finding::mismatch(format!(
                "{label}: disabling MIG mode failed: {e}"
            )));
            return "round trip failed: could not be disabled, left on".into();
        }
    }
    match enable_mig(backend, gpu) {
        Ok(again) => {
            let profiles = |g: &GpuDescription| g.mig.as_ref().map(|m| m.profiles.clone());
            if profiles(&again) != profiles(gpu) {
                findings.push(Finding::mismatch(format!(
                    "{label}: the GPU-instance profiles NVML reports changed across the MIG mode round trip"
                )));
            }
            "round trip off and on again, left on".into()
        }
        Err(e) => {
            findings.push(Finding::mismatch(format!(
                "{label}: re-enabling MIG mode after the round trip failed: {e}"
            )));
            "round trip failed: MIG NOT re-enabled".into()
        }
    }
}

/// Enables MIG (only where that takes effect without a reset) and re-discovers the GPU.
fn enable_mig(backend: &NvmlBackend, gpu: &GpuDescription) -> Result<GpuDescription, String> {
    match backend.set_mig_mode(gpu.index, true) {
        Ok(MigModeChange::Applied) => {}
        Ok(MigModeChange::PendingReset) => {
            let why = "enabling MIG needs a GPU reset on this GPU (Ampere); enable MIG mode \
                       and reset the GPU first, then run gpu-check again";
            return Err(why.into());
        }
        Err(e) => return Err(format!("enabling MIG mode: {e}")),
    }
    let found = backend
        .discover()
        .map_err(|e| e.to_string())?
        .into_iter()
        .find(|g| g.uuid == gpu.uuid);
    match found {
        Some(g) if g.mig.as_ref().is_some_and(|m| m.enabled) => Ok(g),
        Some(_) => Err("MIG mode still off after enabling it".into()),
        None => Err("the GPU is gone after enabling MIG mode".into()),
    }
}

/// Creates, checks and destroys one placement. Returns the result and the problems found.
fn exercise_placement(
    backend: &NvmlBackend,
    gpu: &GpuDescription,
    cdi: &CdiWriter,
    profile: &MigProfile,
    start: u32,
    timings: &mut Timings,
) -> (PlacementResult, Vec<String>) {
    let mut problems = Vec::new();
    let profile_id = profile.gi_profile_id;
    let mut result = PlacementResult {
        profile: profile.name.to_string(),
        profile_id,
        start,
        ..PlacementResult::default()
    };
    let index = gpu.index;
    let gi = match timings.time("create GI", || {
        backend.create_gpu_instance(index, profile_id, start)
    }) {
        Ok(gi) => gi,
        Err(e) => {
            problems.push(e.to_string());
            return (result, problems);
        }
    };
    result.gpu_instance = Some(gi);
    let expected_size = gpu
        .mig
        .iter()
        .flat_map(|m| &m.profiles)
        .find(|p| p.gi_profile_id == profile_id)
        .map(|p| p.memory_slices);
    match backend.list_gpu_instances(index) {
        Ok(list) => match list.iter().find(|r| r.id == gi) {
            Some(r) if r.profile_id == profile_id && r.start == start && Some(r.size) == expected_size => {}
            Some(r) => problems.push(format!(
                "NVML lists GI {gi} as profile ID {} at {{start {}, size {}}}, expected {{start {start}, size {}}}",
                r.profile_id,
                r.start,
                r.size,
                expected_size.map_or("?".into(), |s| s.to_string())
            )),
            None => problems.push(format!("GI {gi} is not listed after its creation")),
        },
        Err(e) => problems.push(e.to_string()),
    }
    match timings.time("create CI", || backend.create_full_compute_instance(index, gi)) {
        Ok(ci) => {
            result.compute_instance = Some(ci.id);
            if !ci.mig_uuid.starts_with("MIG-") {
                problems.push(format!("MIG UUID {:?} does not start with MIG-", ci.mig_uuid));
            }
            result.mig_uuid = Some(ci.mig_uuid.clone());
            match check_device_files(cdi, gpu.minor, gi, ci.id) {
                Ok(minors) => result.capability_minors = Some(minors),
                Err(e) => problems.push(e),
            }
            if let Err(e) = timings.time("destroy CI", || {
                backend.destroy_compute_instance(index, gi, ci.id)
            }) {
                problems.push(e.to_string());
            }
        }
        Err(e) => problems.push(e.to_string()),
    }
    match timings.time("destroy GI", || backend.destroy_gpu_instance(index, gi)) {
        Ok(()) => {
            // A capability file that outlives its instance would hand out a stale minor.
            if cdi.capability(gpu.minor, gi, None).is_ok() {
                problems.push(format!(
                    "the capability file of GI {gi} still exists after its destruction"
                ));
            }
        }
        Err(e) => problems.push(format!("{e} (the instance may be left on the GPU)")),
    }
    result.ok = problems.is_empty();
    (result, problems)
}

/// The device nodes a CDI spec would carry for the instance: both capability devices with the
/// minors the access files give, under the `nvidia-caps` major.
fn check_device_files(cdi: &CdiWriter, gpu_minor: u32, gi: u32, ci: u32) -> Result<(u32, u32), String> {
    let majors = cdi.majors().map_err(|e| e.to_string())?;
    let device = ClaimDevice {
        device_name: "gpu-check".into(),
        gpu_minor,
        mig: Some((gi, ci)),
        mig_monitor: false,
        env: BTreeMap::new(),
    };
    let nodes = cdi.device_nodes(&device, majors).map_err(|e| e.to_string())?;
    let (gi_minor, _) = cdi.capability(gpu_minor, gi, None).map_err(|e| e.to_string())?;
    let (ci_minor, _) = cdi
        .capability(gpu_minor, gi, Some(ci))
        .map_err(|e| e.to_string())?;
    if gi_minor == ci_minor {
        return Err(format!("GI and CI capability minors are both {gi_minor}"));
    }
    for minor in [gi_minor, ci_minor] {
        let path = format!("/dev/nvidia-caps/nvidia-cap{minor}");
        if !nodes
            .iter()
            .any(|n| n.path == path && Some(n.major) == majors.caps && n.minor == minor)
        {
            return Err(format!("the CDI device nodes lack {path}"));
        }
    }
    Ok((gi_minor, ci_minor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timings_summarise_count_lower_median_and_max_per_call() {
        let mut t = Timings::default();
        for ms in [5, 1, 3, 9] {
            t.0.entry("create GI")
                .or_default()
                .push(Duration::from_millis(ms));
        }
        t.0.entry("destroy GI")
            .or_default()
            .push(Duration::from_millis(2));
        let s = t.summary();
        assert_eq!(s.iter().map(|c| c.call.as_str()).collect::<Vec<_>>(), TIMED_CALLS);
        assert_eq!((s[0].count, s[0].p50_ms, s[0].max_ms), (4, 3.0, 9.0));
        assert_eq!((s[1].count, s[1].p50_ms, s[1].max_ms), (0, 0.0, 0.0));
        assert_eq!((s[3].count, s[3].p50_ms), (1, 2.0));
    }

    #[test]
    fn only_successful_calls_are_timed() {
        let mut t = Timings::default();
        let _ = t.time("create CI", || Err::<(), _>("no"));
        let _ = t.time("create CI", || Ok::<_, ()>(1));
        assert_eq!(t.summary()[1].count, 1);
    }
}
