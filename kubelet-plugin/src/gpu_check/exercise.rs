//! Full mode: on an idle GPU, creates every GPU-instance profile at every placement, one at a
//! time, through [`GpuBackend`] (as the plugin's prepare does: GI at the placement, then the
//! full CI), checks what migdra relies on (the placement NVML reports, the `MIG-` UUID, the
//! capability files and device nodes a CDI spec is built from), destroys it, and times each
//! NVML call. The MIG mode found is restored at the end, also after failures.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use migdra_api::geometry::MigProfile;
use serde::Serialize;

use super::{CheckError, report::Finding};
use crate::{
    cdi::{CdiWriter, ClaimDevice},
    nvml::{GpuBackend, GpuDescription, MigModeChange, NvmlBackend},
};

/// What full mode cannot check, printed with every full-mode report.
pub const PROCESS_CHECK_NOTE: &str = "idle check covers GPU and compute instances only: the GPU \
    backend does not expose NVML's running-process list, so make sure no process uses the GPU";

/// Refuses (with the reason) unless the GPU has no GPU or compute instance.
pub fn ensure_idle(backend: &NvmlBackend, gpu: &GpuDescription) -> Result<(), CheckError> {
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
    Err(CheckError::Refused {
        gpu: gpu.index,
        reason: format!(
            "the GPU is not idle: {list}; full mode creates and destroys instances and needs an \
             idle GPU (use --read-only on a GPU in use)"
        ),
    })
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

/// Full mode's results for one GPU.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ExerciseReport {
    /// Every placement, in NVML profile order.
    pub placements: Vec<PlacementResult>,
    pub timings: Vec<CallTiming>,
    /// What happened to the MIG mode (`left on`, `enabled, then restored to off`, ...).
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

/// Exercises every placement of an idle MIG-capable GPU whose MIG mode is `was_enabled` (see
/// the module docs). Problems are findings, never early returns, so the MIG mode is always
/// restored.
pub fn exercise_gpu(
    backend: &NvmlBackend,
    gpu: &GpuDescription,
    was_enabled: bool,
    cdi: &CdiWriter,
) -> ExerciseReport {
    let mut findings = Vec::new();
    let mut timings = Timings::default();
    let label = format!("GPU {} ({})", gpu.index, gpu.product_name);
    let mut placements = Vec::new();
    let mut mig_mode_note = "left on".to_string();

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
            match backend.list_gpu_instances(current.index) {
                Ok(left) if left.is_empty() => {}
                Ok(left) => findings.push(Finding::mismatch(format!(
                    "{label}: {} GPU instance(s) left after full mode: {left:?}",
                    left.len()
                ))),
                Err(e) => findings.push(Finding::mismatch(format!("{label}: {e}"))),
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
        timings: timings.summary(),
        mig_mode_note,
        findings,
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
