//! Prepare/unprepare latency of the plugin's state machine through the production NVML code,
//! against the fake NVML library (one simulated H100-80GB). It measures migdra's own work
//! (claim validation, checkpoint writes with fsync, NVML calls, CDI spec) plus the fake's
//! file-locked state updates, not a real GPU's instance creation time.
//!
//! Run: `cargo run --release -p migdra-kubelet-plugin --example prepare_bench`

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use k8s_openapi::api::resource::v1::ResourceClaim;
use migdra_fake_nvml::testing::FakeGpuHost;
use migdra_kubelet_plugin::{
    cdi::CdiWriter,
    claims::ClaimSource,
    driver::{Driver, DriverConfig},
    metrics::Metrics,
    nvml::NvmlBackend,
};
use migdra_kubeletplugin::{ClaimRef, DraDriver};
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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    const ROUNDS: usize = 200;
    let host = FakeGpuHost::with_gpus(&[("H100-80GB", true)])?;
    let dir = tempfile::tempdir()?;
    let claims = Claims::default();
    let config = DriverConfig {
        driver_name: "gpu.migdra.dev".into(),
        node_name: "bench".into(),
        state_dir: dir.path().join("state"),
        boot_id: "bench".into(),
        lock_timeout: Duration::from_secs(5),
    };
    let backend = Arc::new(NvmlBackend::new(Some(&host.lib_path()))?);
    let cdi = CdiWriter::new(dir.path().join("cdi"), "gpu.migdra.dev", host.proc_root());
    let (driver, _) = Driver::start(config, backend, claims.clone(), cdi, None, Metrics::new())?;
    let profiles = ["1g10gb", "2g20gb", "3g40gb"];
    let (mut prepare, mut unprepare) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let uid = format!("claim-{round}");
        let device = match profiles[round % profiles.len()] {
            "3g40gb" => "gpu-0-mig-3g40gb-4".to_string(),
            "2g20gb" => "gpu-0-mig-2g20gb-2".to_string(),
            _ => format!("gpu-0-mig-1g10gb-{}", round % 7),
        };
        if let Ok(mut map) = claims.0.lock() {
            map.insert(uid.clone(), claim(&uid, &device)?);
        }
        let reference = ClaimRef {
            namespace: "default".into(),
            uid: uid.clone(),
            name: uid.clone(),
        };
        let started = Instant::now();
        let out = driver.prepare(vec![reference.clone()]).await;
        prepare.push(started.elapsed());
        if let Some(Err(e)) = out.get(&uid) {
            anyhow::bail!("prepare {uid}: {e}");
        }
        let started = Instant::now();
        let out = driver.unprepare(vec![reference]).await;
        unprepare.push(started.elapsed());
        if let Some(Err(e)) = out.get(&uid) {
            anyhow::bail!("unprepare {uid}: {e}");
        }
    }
    println!("{ROUNDS} prepare/unprepare rounds (1g, 2g, 3g in turn) on one simulated H100-80GB:");
    for (name, mut samples) in [("prepare", prepare), ("unprepare", unprepare)] {
        samples.sort();
        println!(
            "  {name:<9} p50 {:>7.2} ms   p90 {:>7.2} ms   p99 {:>7.2} ms   max {:>7.2} ms",
            percentile(&samples, 0.5).as_secs_f64() * 1e3,
            percentile(&samples, 0.9).as_secs_f64() * 1e3,
            percentile(&samples, 0.99).as_secs_f64() * 1e3,
            samples[samples.len() - 1].as_secs_f64() * 1e3,
        );
    }
    Ok(())
}
