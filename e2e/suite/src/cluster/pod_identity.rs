//! The identities migdra's running pods have (migdra from its chart): the ServiceAccount token
//! the kubelet projected into the chart's plugin or controller pod, read from the pod's volume
//! in the kubelet's root dir as root on the node can. A client with it acts exactly as the
//! running pod does: its ServiceAccount, its token bound to the pod and, for the plugin, to the
//! node (the admission policy's and the API server's node checks, API Priority and Fairness).

use std::fs;

use anyhow::{Context, bail};
use kube::Client;

use super::Cluster;

impl Cluster {
    /// A client with the token of the running kubelet plugin pod.
    pub async fn running_plugin_client(&self) -> anyhow::Result<Client> {
        self.running_pod_client("kubelet-plugin", "kubelet-plugin").await
    }

    /// A client with the token of the running controller pod.
    pub async fn running_controller_client(&self) -> anyhow::Result<Client> {
        self.running_pod_client("controller", "controller").await
    }

    /// A client with the token of a pod of the release's `component` whose container
    /// `container` is Ready.
    async fn running_pod_client(&self, component: &str, container: &str) -> anyhow::Result<Client> {
        let pods = self.release_pods(component).await?;
        let pod = pods
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .find(|p| {
                p.status
                    .iter()
                    .flat_map(|s| s.container_statuses.iter().flatten())
                    .any(|s| s.name == container && s.ready)
            })
            .with_context(|| {
                format!(
                    "no {component} pod has its {container} container Ready (of {} pods)",
                    pods.len()
                )
            })?;
        let uid = pod.metadata.uid.as_deref().context("a pod without a uid")?;
        // The projected volume with the ServiceAccount token the kubelet keeps fresh
        // (`kube-api-access-<suffix>`, mounted into every container).
        let (volume, file) = pod
            .spec
            .iter()
            .flat_map(|s| s.volumes.iter().flatten())
            .find_map(|v| {
                let token = v
                    .projected
                    .as_ref()?
                    .sources
                    .iter()
                    .flatten()
                    .find_map(|s| s.service_account_token.as_ref())?;
                Some((v.name.clone(), token.path.clone()))
            })
            .with_context(|| format!("the {component} pod has no projected ServiceAccount token"))?;
        let path = self
            .layout
            .kubelet_root
            .join("pods")
            .join(uid)
            .join("volumes/kubernetes.io~projected")
            .join(volume)
            .join(file);
        let token = fs::read_to_string(&path)
            .with_context(|| format!("reading the {component} pod's token at {}", path.display()))?;
        if token.trim().is_empty() {
            bail!("the {component} pod's token at {} is empty", path.display());
        }
        let config = super::token_config(self.layout.apiserver_port, token.trim()).await?;
        Ok(Client::try_from(config)?)
    }
}
