//! How every exported function runs: panic containment ([`entry`]), injected faults and a
//! transaction on the state file ([`call`]), and [`get`], the shape shared by every NVML
//! getter that writes one value through one out parameter.

use std::{
    panic::AssertUnwindSafe,
    sync::{Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use nvml_wrapper_sys::bindings::nvmlReturn_t;

use super::{handles::Target, init::report, init::session, memory::Out};
use crate::{
    code::{GPU_IS_LOST, INVALID_ARGUMENT, LIB_RM_VERSION_MISMATCH, SUCCESS, UNKNOWN},
    state::{FakeState, GpuState, update_state},
};

/// Locks a mutex, recovering it if a panicking call poisoned it.
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs an exported function's body: its error is the return code, a panic is UNKNOWN.
pub(super) fn entry(f: impl FnOnce() -> Result<(), u32>) -> nvmlReturn_t {
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => UNKNOWN,
    }
}

/// Counts the call (when the call log is on) and the hits of the faults matching it; returns
/// (latency ms, error).
fn fire_faults(
    state: &mut FakeState,
    function: &str,
    gpu: Option<u32>,
    profile: Option<u32>,
) -> (u64, Option<u32>) {
    if let Some(log) = &mut state.call_log {
        *log.entry(function.to_string()).or_default() += 1;
    }
    let mut latency = 0;
    let mut error = None;
    for f in &mut state.faults {
        if f.matches(function, gpu, profile) && f.fault.times.is_none_or(|t| f.hits < t) {
            f.hits += 1;
            latency += f.fault.latency_ms.unwrap_or(0);
            error = error.or(f.fault.error);
        }
    }
    (latency, error)
}

/// The latency the faults matching a call add now (hits not counted): a call already delayed
/// ends its wait early when its fault is removed or shortened, so a test can hold a call for
/// minutes and let it go when it has seen what it wanted.
fn latency_now(state: &FakeState, function: &str, gpu: Option<u32>, profile: Option<u32>) -> u64 {
    state
        .faults
        .iter()
        .filter(|f| f.matches(function, gpu, profile))
        .map(|f| f.fault.latency_ms.unwrap_or(0))
        .sum()
}

/// How often a delayed call looks whether its fault is still there.
const DELAY_POLL: Duration = Duration::from_millis(50);

/// Waits `latency` ms, or until the faults matching the call ask for no more than has passed.
fn delay(path: &std::path::Path, latency: u64, function: &str, gpu: Option<u32>, profile: Option<u32>) {
    let started = std::time::Instant::now();
    let mut wanted = Duration::from_millis(latency);
    while started.elapsed() < wanted {
        std::thread::sleep(DELAY_POLL.min(wanted.saturating_sub(started.elapsed())));
        if let Ok(state) = crate::state::read_state(path) {
            wanted = wanted.min(Duration::from_millis(latency_now(&state, function, gpu, profile)));
        }
    }
}

enum Step<T> {
    Done(Result<T, u32>),
    /// Latency ms, the error to end with, and the driver load the call went into.
    Delayed(u64, Option<u32>, u64),
}

/// Runs `body` on the state under the lock, after applying the faults for `function`.
/// Latency is spent outside the lock, as a slow driver call would not block other processes'
/// bookkeeping.
pub(super) fn call<T>(
    function: &str,
    gpu: Option<u32>,
    body: impl FnOnce(&mut FakeState) -> Result<T, u32>,
) -> Result<T, u32> {
    call_about(function, gpu, None, body)
}

/// As [`call`], for a function with a profile argument (ID or index), which faults may
/// be limited to.
pub(super) fn call_about<T>(
    function: &str,
    gpu: Option<u32>,
    profile: Option<u32>,
    body: impl FnOnce(&mut FakeState) -> Result<T, u32>,
) -> Result<T, u32> {
    let (path, driver_upgrade) = session()?;
    let mut body = Some(body);
    let step = update_state(&path, |state| {
        // The driver was upgraded under this session: only a new session talks to it.
        if state.driver_upgrades != driver_upgrade {
            return Step::Done(Err(LIB_RM_VERSION_MISMATCH));
        }
        match fire_faults(state, function, gpu, profile) {
            (0, None) => Step::Done(body.take().map_or(Err(UNKNOWN), |b| b(state))),
            (latency, error) => Step::Delayed(latency, error, state.driver_loads),
        }
    })
    .map_err(report)?;
    match step {
        Step::Done(result) => result,
        Step::Delayed(latency, error, load) => {
            delay(&path, latency, function, gpu, profile);
            if let Some(code) = error {
                return Err(code);
            }
            let body = body.take().ok_or(UNKNOWN)?;
            update_state(&path, |state| {
                // The driver this call went into is gone (see `FakeState::driver_loads`).
                if state.driver_loads != load {
                    return Err(UNKNOWN);
                }
                body(state)
            })
            .map_err(report)?
        }
    }
}

/// GPU `gpu`: INVALID_ARGUMENT if it does not exist, GPU_IS_LOST if it fell off the bus.
pub(super) fn gpu_ref(state: &FakeState, gpu: u32) -> Result<&GpuState, u32> {
    let g = state.gpus.get(gpu as usize).ok_or(INVALID_ARGUMENT)?;
    if g.lost { Err(GPU_IS_LOST) } else { Ok(g) }
}

/// As [`gpu_ref`], for changes.
pub(super) fn gpu_mut(state: &mut FakeState, gpu: u32) -> Result<&mut GpuState, u32> {
    let g = state.gpus.get_mut(gpu as usize).ok_or(INVALID_ARGUMENT)?;
    if g.lost { Err(GPU_IS_LOST) } else { Ok(g) }
}

/// When a getter rejects a NULL out parameter.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum NullOut {
    /// Right after resolving the handle: no fault fires, the state is not read.
    First,
    /// Only when writing: faults and GPU errors (lost, stale) take precedence.
    OnWrite,
}

/// A getter: resolves `target` (the handle argument), then, under the state lock and after
/// the faults of `function`, looks the GPU up and writes `value(gpu, target)` to `out`.
pub(super) fn get<H: Target, O: Out>(
    function: &str,
    target: Result<H, u32>,
    out: O,
    null: NullOut,
    value: impl FnOnce(&GpuState, H) -> Result<O::Value, u32>,
) -> nvmlReturn_t {
    get_about(function, None, target, out, null, value)
}

/// As [`get`], for a getter with a profile argument (ID or index).
pub(super) fn get_about<H: Target, O: Out>(
    function: &str,
    profile: Option<u32>,
    target: Result<H, u32>,
    out: O,
    null: NullOut,
    value: impl FnOnce(&GpuState, H) -> Result<O::Value, u32>,
) -> nvmlReturn_t {
    entry(|| {
        let target = target?;
        if null == NullOut::First {
            out.check()?;
        }
        call_about(function, Some(target.gpu()), profile, |s| {
            out.put(value(gpu_ref(s, target.gpu())?, target)?)
        })
    })
}
