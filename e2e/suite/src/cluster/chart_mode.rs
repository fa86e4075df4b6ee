//! migdra from its chart (the suite's default, on containerd only; `MIGDRA_E2E_MIGDRA=host`
//! runs it as host processes instead): `helm install` with `e2e/values-fake-gpu.yaml` runs the
//! controller Deployment and the plugin DaemonSet as pods, from migdra's images
//! (`e2e/runtime/migdra-images.sh`, pulled from the run's registry, see [`super::registry`]),
//! against the simulated GPU host.

use std::{fs, time::Duration};

use anyhow::{Context, bail};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use kube::Api;
use migdra_fake_nvml::testing::HOST_LIBRARY;

use super::{CHART_NAMESPACE, Cluster, repo_root, wait_until, write};

/// The environment variable that selects how migdra runs: `host`, or unset/empty/`chart`.
pub const MIGDRA_MODE_ENV: &str = "MIGDRA_E2E_MIGDRA";
/// The chart's values for the simulated GPU node; `@RUN@` stands for the run directory.
const VALUES_FILE: &str = "e2e/values-fake-gpu.yaml";
/// Where the values file puts the fake NVML library in the simulated driver root
/// (`nvmlLibPath`), apart from the driver's own libnvidia-ml.
const FAKE_NVML_IN_DRIVER_ROOT: &str = "usr/lib/migdra-e2e";
/// The chart's workloads (release name `migdra`).
const PLUGIN_DAEMONSET: &str = "migdra-kubelet-plugin";
pub(super) const CONTROLLER_DEPLOYMENT: &str = "migdra-controller";

/// How migdra's controller and kubelet plugin run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MigdraMode {
    /// Host processes started by the launcher, with tokens of the chart's ServiceAccounts.
    HostProcesses,
    /// Pods of the chart's Deployment and DaemonSet.
    #[default]
    Chart,
}

impl MigdraMode {
    /// The mode [`MIGDRA_MODE_ENV`] selects.
    pub fn from_env() -> anyhow::Result<Self> {
        match std::env::var(MIGDRA_MODE_ENV) {
            Err(std::env::VarError::NotPresent) => Ok(Self::Chart),
            Ok(v) if v.is_empty() || v == "chart" => Ok(Self::Chart),
            Ok(v) if v == "host" => Ok(Self::HostProcesses),
            Ok(v) => bail!("{MIGDRA_MODE_ENV}={v:?}: expected \"chart\" or \"host\""),
            Err(e) => bail!("{MIGDRA_MODE_ENV}: {e}"),
        }
    }
}

impl Cluster {
    /// Writes the values file for this run (`@RUN@`, `@KUBELET_ROOT@` and `@REGISTRY@` replaced) and
    /// returns its path.
    pub(super) fn fake_gpu_values(&self) -> anyhow::Result<std::path::PathBuf> {
        let template = fs::read_to_string(repo_root().join(VALUES_FILE))
            .with_context(|| format!("reading {VALUES_FILE}"))?;
        let run = self.layout.run_dir.to_str().context("non-UTF-8 run dir")?;
        let kubelet_root = self
            .layout
            .kubelet_root
            .to_str()
            .context("non-UTF-8 kubelet root")?;
        let path = self.layout.run_dir.join("values-fake-gpu.yaml");
        let values = template
            .replace("@KUBELET_ROOT@", kubelet_root)
            .replace("@REGISTRY@", super::registry::REGISTRY)
            .replace("@RUN@", run);
        write(&path, &values)?;
        Ok(path)
    }

    /// Puts the fake NVML library where the values file's `nvmlLibPath` names it.
    pub(super) fn install_fake_nvml_in_driver_root(&self) -> anyhow::Result<()> {
        let dir = self.layout.driver_root().join(FAKE_NVML_IN_DRIVER_ROOT);
        fs::create_dir_all(&dir)?;
        fs::copy(self.layout.gpu_host.join(HOST_LIBRARY), dir.join(HOST_LIBRARY))
            .context("copying the fake NVML into the driver root")?;
        Ok(())
    }

    /// Waits until the plugin DaemonSet's pods are all updated and Ready, and the controller
    /// Deployment's replicas are Ready.
    pub async fn wait_chart_workloads_ready(&self, timeout: Duration) -> anyhow::Result<()> {
        let daemonsets: Api<DaemonSet> = Api::namespaced(self.client.clone(), CHART_NAMESPACE);
        let deployments: Api<Deployment> = Api::namespaced(self.client.clone(), CHART_NAMESPACE);
        wait_until(timeout, || async {
            let ds = daemonsets.get(PLUGIN_DAEMONSET).await.ok()?;
            let generation = ds.metadata.generation?;
            let s = ds.status?;
            let ds_ready = s.observed_generation == Some(generation)
                && s.desired_number_scheduled > 0
                && s.number_ready == s.desired_number_scheduled
                && s.updated_number_scheduled == Some(s.desired_number_scheduled);
            let deploy = deployments.get(CONTROLLER_DEPLOYMENT).await.ok()?;
            let want = deploy.spec?.replicas.unwrap_or(1);
            let deploy_ready = deploy.status?.ready_replicas.unwrap_or(0) == want;
            (ds_ready && deploy_ready).then_some(())
        })
        .await
        .with_context(|| {
            format!(
                "the chart's DaemonSet {PLUGIN_DAEMONSET} and Deployment {CONTROLLER_DEPLOYMENT} did not become Ready{}",
                self.chart_pods_summary()
            )
        })
    }

    /// `kubectl get pods -o wide` and the events of the chart's namespace, for a failure report.
    pub(super) fn chart_pods_summary(&self) -> String {
        let kubectl = self.layout.upstream_bin.join("kubectl");
        let run = |args: &[&str]| {
            std::process::Command::new(&kubectl)
                .arg(format!("--kubeconfig={}", self.layout.kubeconfig.display()))
                .args(["--namespace", CHART_NAMESPACE])
                .args(args)
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default()
        };
        format!(
            ":\n{}\n{}\n{}",
            run(&["get", "pods", "-o", "wide"]),
            run(&["get", "events", "--sort-by=.lastTimestamp"]),
            self.release_logs_tail()
        )
    }
}
