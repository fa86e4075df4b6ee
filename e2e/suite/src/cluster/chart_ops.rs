//! Acting on the installed release (`MIGDRA_E2E_MIGDRA=chart`): upgrades that change its
//! values, the rollback to what the launcher installed, the plugin DaemonSet's pods, and the
//! node's restore after a failed test.

use std::{process::Command, time::Duration};

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Pod;
use kube::{Api, api::ListParams};

use super::{CHART_NAMESPACE, Cluster, Runtime, repo_root};

/// The environment variable naming a chart directory to install instead of `charts/migdra`
/// (a scratch copy with something removed, to see which test notices).
pub const CHART_DIR_ENV: &str = "MIGDRA_E2E_CHART";
/// The release the launcher installs.
const RELEASE: &str = "migdra";
/// The release's pods (controller and plugin).
const RELEASE_POD_SELECTOR: &str = "app.kubernetes.io/instance=migdra";

/// The chart the launcher installs and upgrades: [`CHART_DIR_ENV`], else `charts/migdra`.
pub(super) fn chart_dir() -> std::path::PathBuf {
    std::env::var_os(CHART_DIR_ENV)
        .filter(|v| !v.is_empty())
        .map_or_else(|| repo_root().join("charts/migdra"), std::path::PathBuf::from)
}

impl Cluster {
    /// Runs helm with the run's own helm home and the admin kubeconfig; fails with helm's
    /// stderr.
    pub(super) fn helm(&self, args: &[&str]) -> anyhow::Result<std::process::Output> {
        let home = self.layout.run_dir.join("helm");
        let output = Command::new(&self.layout.helm)
            .args(args)
            .env("HELM_CONFIG_HOME", home.join("config"))
            .env("HELM_CACHE_HOME", home.join("cache"))
            .env("HELM_DATA_HOME", home.join("data"))
            .env("KUBECONFIG", &self.layout.kubeconfig)
            .output()
            .context("running helm")?;
        if !output.status.success() {
            bail!(
                "helm {args:?} failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(output)
    }

    /// `helm upgrade` of the release with its current values plus `set` (`key=value` each,
    /// as `--set` takes them); returns without waiting for the rollout. The current values
    /// go in as a file (`helm get values`), not with `--reuse-values`: that merges the values
    /// file's `nodeSelector: null` (drop the chart's GPU-label selector) into a null the
    /// schema refuses ("at '/kubeletPlugin/nodeSelector': got null, want object").
    pub fn upgrade_chart(&self, set: &[&str]) -> anyhow::Result<()> {
        self.upgrade_release("--set", set)
    }

    /// [`Cluster::upgrade_chart`] with `--set-json` values (`key=<JSON>` each): a whole map
    /// where the release's value is null (`--set` cannot set a key under a null).
    pub fn upgrade_chart_json(&self, set_json: &[&str]) -> anyhow::Result<()> {
        self.upgrade_release("--set-json", set_json)
    }

    fn upgrade_release(&self, flag: &str, set: &[&str]) -> anyhow::Result<()> {
        let current = self.helm(&[
            "get",
            "values",
            RELEASE,
            "--namespace",
            CHART_NAMESPACE,
            "--output",
            "yaml",
        ])?;
        let values = self.layout.run_dir.join("values-current.yaml");
        std::fs::write(&values, &current.stdout).context("writing the release's values")?;
        let values = values.to_str().context("non-UTF-8 run dir")?;
        let chart = chart_dir();
        let chart = chart.to_str().context("non-UTF-8 chart path")?;
        let mut args = vec![
            "upgrade",
            RELEASE,
            chart,
            "--namespace",
            CHART_NAMESPACE,
            "--values",
            values,
            // Every revision kept: revision 1 is what [`Cluster::restore_chart`] goes back to,
            // and helm's default keeps only the last 10.
            "--history-max",
            "0",
        ];
        args.extend(set.iter().flat_map(|v| [flag, *v]));
        self.helm(&args).map(drop)
    }

    /// Rolls the release back to the values the launcher installed (revision 1) and waits
    /// until the DaemonSet and the Deployment are Ready with one plugin pod and the node's
    /// pool is published.
    pub async fn restore_chart(&self) -> anyhow::Result<()> {
        self.rollback_chart()?;
        self.wait_chart_workloads_ready(Duration::from_secs(240)).await?;
        super::wait_until(Duration::from_secs(120), || async {
            (self.plugin_pods().await.ok()?.len() == 1).then_some(())
        })
        .await
        .context("the rollback left more than one plugin pod")?;
        self.wait_published(Duration::from_secs(90)).await
    }

    /// `helm rollback` of the release to the values the launcher installed (revision 1);
    /// returns without waiting for the rollout.
    pub fn rollback_chart(&self) -> anyhow::Result<()> {
        self.helm(&[
            "rollback",
            RELEASE,
            "1",
            "--namespace",
            CHART_NAMESPACE,
            "--history-max",
            "0",
        ])
        .map(drop)
    }

    /// The plugin DaemonSet's pods, terminating ones included.
    pub async fn plugin_pods(&self) -> anyhow::Result<Vec<Pod>> {
        self.release_pods("kubelet-plugin").await
    }

    /// The release's pods of one `component` (the chart's `app.kubernetes.io/component`
    /// label: `kubelet-plugin` or `controller`), terminating ones included.
    pub(super) async fn release_pods(&self, component: &str) -> anyhow::Result<Vec<Pod>> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), CHART_NAMESPACE);
        let selector = format!("{RELEASE_POD_SELECTOR},app.kubernetes.io/component={component}");
        Ok(pods.list(&ListParams::default().labels(&selector)).await?.items)
    }

    /// The last lines of each of the release's containers (of its last run, for one waiting
    /// to restart): a crash-looping plugin says there what it misses.
    pub(super) fn release_logs_tail(&self) -> String {
        Command::new(self.layout.upstream_bin.join("kubectl"))
            .arg(format!("--kubeconfig={}", self.layout.kubeconfig.display()))
            .args([
                "logs",
                "--namespace",
                CHART_NAMESPACE,
                "--selector",
                RELEASE_POD_SELECTOR,
            ])
            .args(["--all-containers", "--prefix", "--tail=15"])
            .output()
            .map(|o| super::strip_ansi(&String::from_utf8_lossy(&o.stdout)))
            .unwrap_or_default()
    }

    /// After a failed test, in chart mode: containerd and the kubelet run again (a test may
    /// have left them down), then the release goes back to its installed values.
    pub(super) async fn restore_chart_node(&mut self) -> anyhow::Result<()> {
        if self.layout.runtime == Runtime::Containerd && !self.is_running("containerd") {
            eprintln!("e2e: containerd is down after a failed test; starting it again");
            self.kill("containerd");
            self.restart_containerd()?;
        }
        if !self.is_running("kubelet") {
            eprintln!("e2e: kubelet is down after a failed test; starting it again");
            self.kill("kubelet");
            self.start_kubelet()?;
        }
        self.restore_chart().await
    }
}
