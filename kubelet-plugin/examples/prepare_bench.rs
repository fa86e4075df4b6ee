//! Prepare/unprepare latency of the plugin's state machine through the production NVML code,
//! against the fake NVML library (one simulated H100-80GB). It measures migdra's own work
//! (claim validation, checkpoint writes, NVML calls, CDI spec) plus the fake's file-locked
//! state updates, not a real GPU's instance creation time, nor the API server (the claim GET
//! and status write answer at once).
//!
//! Per call it reports the handler's time, the part inside NVML (from the plugin's own
//! `call_nvml_duration_seconds` metric, read before and after each call), the rest, and the
//! fsyncs the call made. Two scenarios: one claim at a time, and seven kubelet calls at once
//! (seven 1g.10gb claims, as when the kubelet starts several pods together), where waiting
//! for the node lock shows.
//!
//! The plugin's files go to a temporary directory (`TMPDIR`); `PREPARE_BENCH_STATE_DIR` and
//! `PREPARE_BENCH_CDI_DIR` put the checkpoint and the CDI specs elsewhere (e.g. a tmpfs, as
//! `/var/run/cdi` is on most nodes), to tell the file system's share apart.
//!
//! Run: `cargo run --release -p migdra-kubelet-plugin --example prepare_bench`

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use dra_kubelet::{ClaimRef, DraDriver};
use k8s_openapi::api::resource::v1::ResourceClaim;
use migdra_fake_nvml::testing::FakeGpuHost;
use migdra_kubelet_plugin::{
    cdi::CdiWriter,
    claims::ClaimSource,
    driver::{Driver, DriverConfig},
    metrics::Metrics,
    nvml::NvmlBackend,
    state_dir::fsync_count,
};
use serde_json::json;

#[derive(Clone, Default)]
struct Claims(Arc<Mutex<HashMap<String, ResourceClaim>>>);

impl ClaimSource for Claims {
    async fn get(&self, _namespace: &str, name: &str) -> Result<Option<ResourceClaim>, kube::Error> {
        Ok(self.0.lock().map(|m| m.get(name).cloned()).unwrap_or(None))
    }

    /// The status write is the API server's work; the benchmark measures the node's.
    async fn apply_status(
        &self,
        _namespace: &str,
        _name: &str,
        _field_manager: &str,
        _object: &serde_json::Value,
    ) -> Result<(), kube::Error> {
        Ok(())
    }
}

fn claim(uid: &str, device: &str) -> anyhow::Result<ResourceClaim> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": uid, "namespace": "default", "uid": uid},
        "spec": {"devices": {"requests": []}},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": "gpu.migdra.dev", "pool": "bench/gpu.migdra.dev", "device": device}
        ]}}},
    }))?)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

/// The `_sum` of the plugin's NVML-time histogram for `operation`, in seconds.
fn nvml_seconds(metrics: &Metrics, operation: &str) -> f64 {
    let series =
        format!("migdra_kubelet_plugin_call_nvml_duration_seconds_sum{{operation=\"{operation}\"}} ");
    metrics
        .encode()
        .lines()
        .find_map(|l| l.strip_prefix(&series)?.parse().ok())
        .unwrap_or(0.0)
}

/// Samples of one operation: handler time, NVML time, fsyncs.
#[derive(Default)]
struct Samples {
    handler: Vec<Duration>,
    nvml: Vec<Duration>,
    outside: Vec<Duration>,
    fsyncs: Vec<u64>,
}

impl Samples {
    fn push(&mut self, handler: Duration, nvml: Duration, fsyncs: u64) {
        self.handler.push(handler);
        self.nvml.push(nvml);
        self.outside.push(handler.saturating_sub(nvml));
        self.fsyncs.push(fsyncs);
    }

    fn print(mut self, name: &str) {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        for (part, samples) in [
            ("handler", &mut self.handler),
            ("NVML", &mut self.nvml),
            ("outside NVML", &mut self.outside),
        ] {
            if samples.is_empty() {
                continue;
            }
            samples.sort();
            let mean = samples.iter().sum::<Duration>() / samples.len() as u32;
            println!(
                "  {name:<9} {part:<13} p50 {:>7.2} ms   p99 {:>7.2} ms   mean {:>7.2} ms   max {:>7.2} ms",
                ms(percentile(samples, 0.5)),
                ms(percentile(samples, 0.99)),
                ms(mean),
                ms(samples[samples.len() - 1]),
            );
        }
        if !self.fsyncs.is_empty() {
            let total: u64 = self.fsyncs.iter().sum();
            println!(
                "  {name:<9} fsyncs per call: {:.2} (min {}, max {})",
                total as f64 / self.fsyncs.len() as f64,
                self.fsyncs.iter().min().copied().unwrap_or(0),
                self.fsyncs.iter().max().copied().unwrap_or(0),
            );
        }
    }
}

/// One kubelet call, `prepare` or `unprepare`, for claim `uid`: its error, if it failed.
async fn call(driver: &Driver<Claims>, operation: &str, uid: &str) -> Option<String> {
    if operation == "prepare" {
        driver
            .prepare(vec![reference(uid)])
            .await
            .remove(uid)
            .and_then(Result::err)
    } else {
        driver
            .unprepare(vec![reference(uid)])
            .await
            .remove(uid)
            .and_then(Result::err)
    }
}

fn reference(uid: &str) -> ClaimRef {
    ClaimRef {
        namespace: "default".into(),
        uid: uid.to_string(),
        name: uid.to_string(),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    const ROUNDS: usize = 200;
    const CONCURRENT_ROUNDS: usize = 30;
    const AT_ONCE: usize = 7;
    let host = FakeGpuHost::with_gpus(&[("H100-80GB", true)])?;
    let dir = tempfile::tempdir()?;
    let under = |variable: &str, default: &str| -> anyhow::Result<std::path::PathBuf> {
        match std::env::var_os(variable) {
            Some(base) => Ok(tempfile::tempdir_in(base)?.keep()),
            None => Ok(dir.path().join(default)),
        }
    };
    let (state_dir, cdi_dir) = (
        under("PREPARE_BENCH_STATE_DIR", "state")?,
        under("PREPARE_BENCH_CDI_DIR", "cdi")?,
    );
    println!(
        "checkpoint in {}, CDI specs in {}",
        state_dir.display(),
        cdi_dir.display()
    );
    let claims = Claims::default();
    let config = DriverConfig {
        driver_name: "gpu.migdra.dev".into(),
        node_name: "bench".into(),
        state_dir,
        boot_id: "bench".into(),
        lock_timeout: Duration::from_secs(5),
        nvml_call_timeout: Duration::from_secs(20),
    };
    let backend = Arc::new(NvmlBackend::new(Some(&host.lib_path()))?);
    let cdi = CdiWriter::new(cdi_dir, "gpu.migdra.dev", host.proc_root());
    let metrics = Metrics::new();
    let (driver, _) = Driver::start(config, backend, claims.clone(), cdi, None, metrics.clone())?;
    let profiles = ["1g10gb", "2g20gb", "3g40gb"];
    let (mut prepare, mut unprepare) = (Samples::default(), Samples::default());
    let put = |uid: &str, device: &str| -> anyhow::Result<()> {
        if let Ok(mut map) = claims.0.lock() {
            map.insert(uid.to_string(), claim(uid, device)?);
        }
        Ok(())
    };
    for round in 0..ROUNDS {
        let uid = format!("claim-{round}");
        let device = match profiles[round % profiles.len()] {
            "3g40gb" => "gpu-0-mig-3g40gb-4".to_string(),
            "2g20gb" => "gpu-0-mig-2g20gb-2".to_string(),
            _ => format!("gpu-0-mig-1g10gb-{}", round % 7),
        };
        put(&uid, &device)?;
        for (operation, samples) in [("prepare", &mut prepare), ("unprepare", &mut unprepare)] {
            let (nvml_before, fsyncs_before) = (nvml_seconds(&metrics, operation), fsync_count());
            let started = Instant::now();
            let failed = call(&driver, operation, &uid).await;
            let handler = started.elapsed();
            if let Some(e) = failed {
                anyhow::bail!("{operation} {uid}: {e}");
            }
            let nvml = Duration::from_secs_f64((nvml_seconds(&metrics, operation) - nvml_before).max(0.0));
            samples.push(handler, nvml, fsync_count() - fsyncs_before);
        }
    }
    println!(
        "{ROUNDS} prepare/unprepare rounds, one claim at a time (1g, 2g, 3g in turn) on one simulated H100-80GB:"
    );
    prepare.print("prepare");
    unprepare.print("unprepare");

    // Seven kubelet calls at once, one 1g.10gb claim each (every placement of the GPU).
    let (mut prepare, mut unprepare) = (Samples::default(), Samples::default());
    for round in 0..CONCURRENT_ROUNDS {
        let uids: Vec<String> = (0..AT_ONCE).map(|i| format!("batch-{round}-{i}")).collect();
        for (i, uid) in uids.iter().enumerate() {
            put(uid, &format!("gpu-0-mig-1g10gb-{i}"))?;
        }
        for (operation, samples) in [("prepare", &mut prepare), ("unprepare", &mut unprepare)] {
            let calls = uids.iter().map(|uid| {
                let driver = driver.clone();
                let uid = uid.clone();
                async move {
                    let started = Instant::now();
                    let failed = call(&driver, operation, &uid).await;
                    (uid, started.elapsed(), failed)
                }
            });
            for (uid, handler, failed) in futures::future::join_all(calls).await {
                if let Some(e) = failed {
                    anyhow::bail!("{operation} {uid}: {e}");
                }
                // The NVML time of concurrent calls is not told apart here; handler only.
                samples.handler.push(handler);
            }
        }
    }
    println!("{CONCURRENT_ROUNDS} rounds of {AT_ONCE} kubelet calls at once (one 1g.10gb claim each):");
    prepare.print("prepare");
    unprepare.print("unprepare");
    Ok(())
}
