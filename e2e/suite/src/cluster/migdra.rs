//! migdra's own processes on the cluster: where its binaries are, the ServiceAccount tokens
//! they run with (the plugin's bound to the Node), starting and restarting the controller and
//! the kubelet plugin, and waiting until they published the node's pool.

use std::{path::PathBuf, time::Duration};

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client, api::PostParams};
use migdra_api::inventory::{GpuNode, pool_name};
use migdra_fake_nvml::testing::HOST_LIBRARY;
use serde_json::json;

use super::{
    CHART_NAMESPACE, Cluster, DRIVER, HOOK_PATH, NODE, PLUGIN_ACCOUNT, kubeconfig_yaml, wait_until, write,
};

/// The kubelet plugin's component name (logs, pid file, [`Cluster::stop`]).
pub const PLUGIN: &str = "migdra-kubelet-plugin";
/// Seconds between the plugin's stale-claim garbage-collection passes: short, so that a test
/// sees a pass while the plugin runs (a pass never touches a claim that still exists, so the
/// other tests are unaffected, and prove that).
pub const STALE_CLAIM_GC_INTERVAL_SECONDS: u64 = 5;

/// Requests a token of one of the chart's ServiceAccounts (`account`), bound to the Node
/// `(name, uid)` when given.
async fn request_token(
    admin: &Client,
    account: &str,
    node: Option<(String, String)>,
) -> anyhow::Result<String> {
    let mut request = json!({
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"audiences": [], "expirationSeconds": 86400},
    });
    if let Some((name, uid)) = node {
        request["spec"]["boundObjectRef"] =
            json!({"apiVersion": "v1", "kind": "Node", "name": name, "uid": uid});
    }
    let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(admin.clone(), CHART_NAMESPACE);
    let response: serde_json::Value = accounts
        .create_subresource("token", account, &PostParams::default(), &request)
        .await
        .with_context(|| format!("requesting a token for {account}"))?;
    Ok(response["status"]["token"]
        .as_str()
        .context("no token in the TokenRequest response")?
        .to_string())
}

/// Clients authenticated as the chart's kubelet-plugin ServiceAccount with a token bound to a
/// given Node: what a real plugin on that node sends with (its own connection, the admission
/// policy's node check, API Priority and Fairness as a ServiceAccount, not as the admin).
#[derive(Clone)]
pub struct PluginIdentities {
    admin: Client,
    apiserver_port: u16,
}

impl PluginIdentities {
    /// A client of its own for the plugin of Node `node` (whose UID is `uid`).
    pub async fn client_for(&self, node: &str, uid: &str) -> anyhow::Result<Client> {
        Ok(Client::try_from(self.config_for(node, uid).await?)?)
    }

    /// The configuration [`Self::client_for`] makes its client from (one token), for more
    /// than one client of that plugin.
    pub async fn config_for(&self, node: &str, uid: &str) -> anyhow::Result<kube::Config> {
        let token = request_token(
            &self.admin,
            PLUGIN_ACCOUNT,
            Some((node.to_string(), uid.to_string())),
        )
        .await?;
        super::token_config(self.apiserver_port, &token).await
    }
}

/// Finds migdra's binaries: `$MIGDRA_BIN_DIR`, or the cargo target directory of the running
/// executable (tests run from target/<profile>/deps, binaries from target/<profile>).
pub(super) fn migdra_bin_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("MIGDRA_BIN_DIR") {
        return Ok(PathBuf::from(dir));
    }
    let exe = std::env::current_exe()?;
    for dir in exe.ancestors().skip(1).take(3) {
        if dir.join("migdra-kubelet-plugin").is_file() && dir.join("migdra-controller").is_file() {
            return Ok(dir.to_path_buf());
        }
    }
    bail!(
        "migdra-controller and migdra-kubelet-plugin not found next to {}; run `cargo build --workspace` first",
        exe.display()
    )
}

impl Cluster {
    /// Requests a token of one of the chart's ServiceAccounts and writes a kubeconfig with it.
    /// The plugin's token is bound to the Node, which gives it the node name the admission
    /// policy checks.
    pub(super) async fn service_account_kubeconfig(
        &self,
        account: &str,
        bind_to_node: bool,
    ) -> anyhow::Result<PathBuf> {
        let bound = if bind_to_node {
            let node = Api::<Node>::all(self.client.clone()).get(NODE).await?;
            Some((
                NODE.to_string(),
                node.metadata.uid.context("the node has no uid")?,
            ))
        } else {
            None
        };
        let token = request_token(&self.client, account, bound).await?;
        let path = self.layout.run_dir.join(format!("{account}.kubeconfig"));
        write(&path, &kubeconfig_yaml(self.layout.apiserver_port, &token))?;
        Ok(path)
    }

    /// Mints clients as the kubelet plugin of any node (for simulated nodes).
    pub fn plugin_identities(&self) -> PluginIdentities {
        PluginIdentities {
            admin: self.client.clone(),
            apiserver_port: self.layout.apiserver_port,
        }
    }

    /// Starts (or restarts) migdra's controller, as the chart's controller ServiceAccount.
    pub fn start_migdra_controller(&mut self) -> anyhow::Result<()> {
        let l = self.layout.clone();
        let kubeconfig = self
            .controller_kubeconfig
            .clone()
            .context("no controller token yet")?;
        let http = self.port("controller-http")?;
        self.start_component(
            "migdra-controller",
            &l.migdra_bin.join("migdra-controller"),
            &[
                &format!("--kubeconfig={}", kubeconfig.display()),
                &format!("--driver-name={DRIVER}"),
                &format!("--namespace={CHART_NAMESPACE}"),
                "--identity=e2e-controller",
                &format!("--http-address=127.0.0.1:{http}"),
                &format!(
                    "--heartbeat-timeout-seconds={}",
                    self.controller_heartbeat_timeout_seconds
                ),
                "--log-level=info,migdra_controller=debug",
                &format!("--keep-memory-counter={}", self.controller_keep_memory_counter),
                // The suite's GPUs serve partitions and whole GPUs in turn.
                "--default-mig-mode=dynamic",
            ],
        )
    }

    /// Starts (or restarts) migdra's kubelet plugin, as the chart's plugin ServiceAccount with
    /// a token bound to the node. It uses the fixed socket names.
    pub fn start_plugin(&mut self) -> anyhow::Result<()> {
        let l = self.layout.clone();
        let kubeconfig = self.plugin_kubeconfig.clone().context("no plugin token yet")?;
        let (http, grpc) = (self.port("plugin-http")?, self.port("plugin-grpc-health")?);
        self.start_component(
            PLUGIN,
            &l.migdra_bin.join("migdra-kubelet-plugin"),
            &[
                &format!("--kubeconfig={}", kubeconfig.display()),
                &format!("--node-name={NODE}"),
                &format!("--driver-name={DRIVER}"),
                &format!("--kubelet-root-dir={}", l.kubelet_root.display()),
                &format!("--cdi-dir={}", l.cdi_dir.display()),
                &format!("--nvml-lib-path={}", l.gpu_host.join(HOST_LIBRARY).display()),
                &format!("--state-dir={}", l.plugin_state.display()),
                &format!("--proc-root={}", l.gpu_host.join("proc-root").display()),
                &format!("--driver-root={}", l.driver_root().display()),
                &format!("--host-root={}", l.host_root().display()),
                &format!("--nvidia-cdi-hook-path={HOOK_PATH}"),
                &format!("--dev-root={}", l.dev_root().display()),
                &format!("--http-address=127.0.0.1:{http}"),
                &format!("--grpc-health-address=127.0.0.1:{grpc}"),
                "--heartbeat-interval-seconds=3",
                &format!("--stale-claim-gc-interval-seconds={STALE_CLAIM_GC_INTERVAL_SECONDS}"),
                "--log-level=info,migdra_kubelet_plugin=debug",
            ],
        )
    }

    /// Whether a component this launcher started is still running.
    pub fn is_running(&mut self, name: &str) -> bool {
        self.components
            .get_mut(name)
            .is_some_and(|child| matches!(child.try_wait(), Ok(None)))
    }

    /// After a failed test: starts the kubelet and the kubelet plugin again if the test left
    /// either down (or either died), and waits until the node's pool is published, so the
    /// tests after it find the node as it was. In chart mode, containerd and the kubelet run
    /// again and the release is rolled back to its installed values instead.
    pub async fn restore(&mut self) -> anyhow::Result<()> {
        if self.layout.migdra_mode == super::MigdraMode::Chart {
            return self.restore_chart_node().await;
        }
        for (name, start) in [
            (
                "kubelet",
                Self::start_kubelet as fn(&mut Self) -> anyhow::Result<()>,
            ),
            (PLUGIN, Self::start_plugin),
        ] {
            if !self.is_running(name) {
                eprintln!("e2e: {name} is down after a failed test; starting it again");
                self.kill(name); // reaps it, when it died
                start(self)?;
            }
        }
        self.wait_published(Duration::from_secs(90)).await
    }

    /// The whole node pool is published and the plugin registered.
    pub async fn wait_published(&self, timeout: Duration) -> anyhow::Result<()> {
        let nodes: Api<GpuNode> = Api::all(self.client.clone());
        let slices: Api<k8s_openapi::api::resource::v1::ResourceSlice> = Api::all(self.client.clone());
        let pool = pool_name(NODE, DRIVER);
        wait_until(timeout, || async {
            let node = nodes.get(NODE).await.ok()?;
            let status = node.status?;
            if !status.plugin?.registered {
                return None;
            }
            let expected = status.publication?.slices as usize;
            let list = slices.list(&Default::default()).await.ok()?;
            let ours: Vec<_> = list.items.iter().filter(|s| s.spec.pool.name == pool).collect();
            let generation = ours.iter().map(|s| s.spec.pool.generation).max()?;
            let current = ours
                .iter()
                .filter(|s| s.spec.pool.generation == generation)
                .count();
            (current == expected && expected > 0).then_some(())
        })
        .await
        .with_context(|| {
            // In chart mode the plugin's own log says why (its last lines are in the summary).
            let details = if self.layout.migdra_mode == super::MigdraMode::Chart {
                self.chart_pods_summary()
            } else {
                String::new()
            };
            format!("migdra did not publish the node's pool{details}")
        })
    }

    /// A client authenticated as the kubelet plugin (its node-bound ServiceAccount token).
    pub async fn plugin_client(&self) -> anyhow::Result<Client> {
        let path = self.plugin_kubeconfig.clone().context("no plugin token yet")?;
        Ok(migdra_runtime::kube_client(Some(&path)).await?)
    }

    /// A client authenticated as the controller (its ServiceAccount token).
    pub async fn controller_client(&self) -> anyhow::Result<Client> {
        let path = self
            .controller_kubeconfig
            .clone()
            .context("no controller token yet")?;
        Ok(migdra_runtime::kube_client(Some(&path)).await?)
    }
}
